/**
 * \file gradacc.hpp
 * \brief Header-only C++17 wrapper over gradacc.h: move-only RAII objects and exceptions.
 *
 * Every C handle is owned by exactly one C++ object (a `std::unique_ptr` whose deleter calls the
 * matching `gradacc_*_destroy`), so handles cannot leak or be freed twice; objects can be moved,
 * never copied. Every failing C call becomes a `gradacc::Error` carrying the status and the
 * message of gradacc_last_error(), read on the same thread right after the call (a
 * `gradacc::TimeoutError`, derived from it, for GRADACC_STATUS_TIMEOUT). The typed gradient
 * forms (Accumulator::add over gradacc::Grad, add_tensor over spans) also check what the C ABI
 * cannot see behind a `void *`, each gradient's element type (and in add its length), and
 * throw a `gradacc::Error` with a message of their own when it does not match.
 *
 * \code
 *   gradacc::Scaler scaler;                                   // defaults, CPU
 *   gradacc::Accumulator acc({{4096, GRADACC_DTYPE_F16}, {64, GRADACC_DTYPE_F16}});
 *   acc.add(scaler, {w_grad, b_grad}, items);                 // one micro-batch, uint16_t words
 *   gradacc::SyncInfo info = acc.sync();                      // the boundary (one process)
 *   if (!scaler.update(acc)) sgd(acc.master(0));              // master(i): a span<float> view
 * \endcode
 *
 * Thread safety and ownership are those of the C functions (see gradacc.h); the wrapper adds no
 * locking and no state of its own besides the handle.
 */
#ifndef GRADACC_HPP
#define GRADACC_HPP

#include "gradacc.h"

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace gradacc {

/** A failed gradacc call: the status code and the calling thread's gradacc_last_error() text. */
class Error : public std::runtime_error {
public:
    Error(gradacc_status_t status, const std::string &message)
        : std::runtime_error(std::string(gradacc_status_string(status)) + ": " + message),
          status_(status), message_(message) {}

    /** The GRADACC_STATUS_* code the call returned. */
    gradacc_status_t status() const noexcept { return status_; }
    /** gradacc_last_error() as it was right after the failing call, or the wrapper's own
     * message for a typed gradient it refused. */
    const std::string &message() const noexcept { return message_; }

private:
    gradacc_status_t status_;
    std::string message_;
};

/** GRADACC_STATUS_TIMEOUT: a collective did not complete within the communicator's timeout
 * (Communicator::set_timeout), and the communicator was aborted. Catch it before gradacc::Error. */
class TimeoutError : public Error {
public:
    explicit TimeoutError(const std::string &message) : Error(GRADACC_STATUS_TIMEOUT, message) {}
};

/** Throws gradacc::Error (TimeoutError for GRADACC_STATUS_TIMEOUT) unless `status` is
 * GRADACC_STATUS_OK. Call it right after the C call. */
inline void check(gradacc_status_t status) {
    if (status == GRADACC_STATUS_OK)
        return;
    if (status == GRADACC_STATUS_TIMEOUT)
        throw TimeoutError(gradacc_last_error());
    throw Error(status, gradacc_last_error());
}

/** The loaded library's version ("MAJOR.MINOR.PATCH"); compare with GRADACC_VERSION_STRING. */
inline std::string version() { return gradacc_version_string(); }

/** The library's report for a bug report (gradacc_diagnostics, what gradacc-info prints). */
inline std::string diagnostics() {
    std::size_t needed = 0;
    check(gradacc_diagnostics(nullptr, 0, &needed));
    std::string report(needed, '\0');
    check(gradacc_diagnostics(report.data(), report.size(), nullptr));
    report.resize(needed - 1);
    return report;
}

/** Sends the library's messages at `level` and more severe ones to `fn(level, message)`, on the
 * thread whose call produced them; an empty `fn` or GRADACC_LOG_OFF turns them off
 * (gradacc_set_log_callback; docs/diagnostics.md). One callback per process, kept here; `fn`
 * must not throw (a message is not worth an exception crossing the library) and must not call
 * set_log_callback. */
inline void set_log_callback(std::function<void(gradacc_log_level_t, const char *)> fn,
                             gradacc_log_level_t level = GRADACC_LOG_INFO) {
    static std::function<void(gradacc_log_level_t, const char *)> held;
    const auto forward = [](void *user, gradacc_log_level_t lv, const char *message) {
        auto *f = static_cast<std::function<void(gradacc_log_level_t, const char *)> *>(user);
        try {
            (*f)(lv, message);
        } catch (...) {
        }
    };
    if (!fn) {
        check(gradacc_set_log_callback(nullptr, nullptr, level));
        held = nullptr;
        return;
    }
    // Off first, so the library never calls `held` while it changes.
    check(gradacc_set_log_callback(nullptr, nullptr, GRADACC_LOG_OFF));
    held = std::move(fn);
    check(gradacc_set_log_callback(forward, &held, level));
}

/** A minimal non-owning view of `size` contiguous elements (std::span is C++20). */
template <class T>
class span {
public:
    constexpr span() noexcept = default;
    constexpr span(T *data, std::size_t size) noexcept : data_(data), size_(size) {}
    template <std::size_t N>
    constexpr span(T (&array)[N]) noexcept : data_(array), size_(N) {}
    /** Any contiguous container with data() and size() (std::vector, std::array, std::string...). */
    template <class C, class = std::enable_if_t<std::is_convertible_v<
                           decltype(std::declval<C &>().data()), T *>>>
    constexpr span(C &container) noexcept : data_(container.data()), size_(container.size()) {}
    /** A span of const elements also views a temporary container, for the call it is passed to
     * (as std::span<const T> does): `gradacc::f32_to_f16(std::vector<float>(n, 1.0f))`. */
    template <class C, class U = T,
              class = std::enable_if_t<std::is_const_v<U> &&
                                       std::is_convertible_v<decltype(std::declval<const C &>().data()), T *>>>
    constexpr span(const C &container) noexcept : data_(container.data()), size_(container.size()) {}

    constexpr T *data() const noexcept { return data_; }
    constexpr std::size_t size() const noexcept { return size_; }
    constexpr bool empty() const noexcept { return size_ == 0; }
    constexpr T &operator[](std::size_t i) const noexcept { return data_[i]; }
    constexpr T *begin() const noexcept { return data_; }
    constexpr T *end() const noexcept { return data_ + size_; }

private:
    T *data_ = nullptr;
    std::size_t size_ = 0;
};

namespace detail {
/** Runs one of the C array conversions after checking that `dst` is as long as `src`. */
template <class S, class D>
void convert(gradacc_status_t (*f)(const S *, D *, std::size_t), span<const S> src, span<D> dst,
             const char *function) {
    if (src.size() != dst.size())
        throw Error(GRADACC_STATUS_SIZE_MISMATCH, std::string(function) + ": `dst` has " +
                                                      std::to_string(dst.size()) + " elements, `src` " +
                                                      std::to_string(src.size()));
    check(f(src.data(), dst.data(), src.size()));
}
} // namespace detail

/** \name 16-bit conversions
 * C++17 has no 16-bit float type: fp16 and bf16 values are their bits in uint16_t, the words the
 * 16-bit forms of add, add_tensor and the optimizer take. These convert arrays through
 * gradacc_f32_to_f16 and friends (vectorised; rounding to nearest even, widening exactly). The
 * two-argument forms write into `dst`, which must be as long as `src` (else SIZE_MISMATCH) and
 * must not overlap it; the one-argument forms return a new vector.
 * @{ */
inline void f32_to_f16(span<const float> src, span<uint16_t> dst) {
    detail::convert(gradacc_f32_to_f16, src, dst, "gradacc::f32_to_f16");
}
inline void f16_to_f32(span<const uint16_t> src, span<float> dst) {
    detail::convert(gradacc_f16_to_f32, src, dst, "gradacc::f16_to_f32");
}
inline void f32_to_bf16(span<const float> src, span<uint16_t> dst) {
    detail::convert(gradacc_f32_to_bf16, src, dst, "gradacc::f32_to_bf16");
}
inline void bf16_to_f32(span<const uint16_t> src, span<float> dst) {
    detail::convert(gradacc_bf16_to_f32, src, dst, "gradacc::bf16_to_f32");
}
inline std::vector<uint16_t> f32_to_f16(span<const float> src) {
    std::vector<uint16_t> dst(src.size());
    f32_to_f16(src, dst);
    return dst;
}
inline std::vector<float> f16_to_f32(span<const uint16_t> src) {
    std::vector<float> dst(src.size());
    f16_to_f32(src, dst);
    return dst;
}
inline std::vector<uint16_t> f32_to_bf16(span<const float> src) {
    std::vector<uint16_t> dst(src.size());
    f32_to_bf16(src, dst);
    return dst;
}
inline std::vector<float> bf16_to_f32(span<const uint16_t> src) {
    std::vector<float> dst(src.size());
    bf16_to_f32(src, dst);
    return dst;
}
/** @} */

/** One gradient for the typed forms of Accumulator::add: a view of f32 values or of 16-bit words
 * (fp16 or bf16), with its length. It converts implicitly from span<const float>,
 * span<const uint16_t>, arrays and contiguous containers of either (std::vector, std::array, span),
 * so `acc.add(scaler, {w_grad, b_grad}, items)` takes the buffers themselves. It borrows the
 * memory, as span does. A C array in a braced list decays to a pointer and picks the raw form:
 * wrap it, `gradacc::Grad(array)`, or pass a span. */
class Grad {
public:
    Grad(span<const float> grad) noexcept : data_(grad.data()), size_(grad.size()), f32_(true) {}
    Grad(span<const uint16_t> grad) noexcept : data_(grad.data()), size_(grad.size()), f32_(false) {}
    template <std::size_t N>
    Grad(const float (&grad)[N]) noexcept : Grad(span<const float>(grad, N)) {}
    template <std::size_t N>
    Grad(const uint16_t (&grad)[N]) noexcept : Grad(span<const uint16_t>(grad, N)) {}
    template <class C, std::enable_if_t<std::is_convertible_v<decltype(std::declval<const C &>().data()),
                                                              const float *>, int> = 0>
    Grad(const C &container) noexcept : Grad(span<const float>(container.data(), container.size())) {}
    template <class C, std::enable_if_t<std::is_convertible_v<decltype(std::declval<const C &>().data()),
                                                              const uint16_t *>, int> = 0>
    Grad(const C &container) noexcept : Grad(span<const uint16_t>(container.data(), container.size())) {}

    const void *data() const noexcept { return data_; }
    std::size_t size() const noexcept { return size_; }
    /** Whether it holds f32 values; otherwise 16-bit words. */
    bool is_f32() const noexcept { return f32_; }

private:
    const void *data_;
    std::size_t size_;
    bool f32_;
};

/** The device an object is bound to: the CPU (default), or a CUDA device and the caller's stream. */
struct Device : gradacc_device_t {
    Device() noexcept : gradacc_device_t{GRADACC_DEVICE_CPU, 0, nullptr} {}
    static Device cpu() noexcept { return Device(); }
    /** `stream` stays the caller's (`cudaStream_t` / `CUstream`); gradacc never destroys it. */
    static Device cuda(int32_t ordinal, void *stream) noexcept {
        Device d;
        d.kind = GRADACC_DEVICE_CUDA;
        d.ordinal = ordinal;
        d.stream = stream;
        return d;
    }
};

/** gradacc_scaler_config_t initialised by gradacc_scaler_config_default(); change fields after. */
struct ScalerConfig : gradacc_scaler_config_t {
    ScalerConfig() : gradacc_scaler_config_t() { check(gradacc_scaler_config_default(this)); }
};

/** gradacc_accumulator_config_t initialised by gradacc_accumulator_config_default(). For a
 * reduce-scatter boundary set `sharding = GRADACC_SHARDING_REDUCE_SCATTER`, `shard_count` (the
 * communicator's size, or the shard group's for Accumulator::sync_hybrid) and `shard_rank` (this
 * rank on it); for sharded accumulation (ZeRO-2) `sharding = GRADACC_SHARDING_ACCUMULATE` with
 * the same two fields, and create it with Accumulator::sharded. `wire_dtype` is what the
 * reductions send (GRADACC_DTYPE_F32 by default, or GRADACC_DTYPE_BF16). `overflow` is what a
 * non-finite gradient costs: GRADACC_OVERFLOW_SKIP_STEP (default) skips the window's step,
 * GRADACC_OVERFLOW_DROP_MICROBATCH drops only the micro-batch that held it; another value throws
 * INVALID_ARGUMENT. `tensor_stats = 1` has every boundary also measure each tensor
 * (Accumulator::tensor_stats); a value other than 0 or 1 throws INVALID_ARGUMENT. Both run on
 * every device and sharding policy. The contract, in every language: docs/overflow.md. */
struct AccumulatorConfig : gradacc_accumulator_config_t {
    AccumulatorConfig() : gradacc_accumulator_config_t() {
        check(gradacc_accumulator_config_default(this));
    }
};

/** A rank's shard of an accumulator's flat FP32 master (Accumulator::shard()): elements `offset`
 * to `offset + data.size()` of the tensors laid out one after another, each at a multiple of
 * GRADACC_MASTER_ALIGN bytes (Accumulator::offset) with zeros between, and a view of them (device
 * memory on CUDA). */
struct Shard {
    std::size_t offset = 0;
    span<float> data;
    std::size_t numel() const noexcept { return data.size(); }
};

/** One tensor's telemetry of the last boundary (Accumulator::tensor_stats), the same on every
 * rank: the L2 norm of its reduced, normalised gradient before clipping, and the micro-batches
 * over every rank in which it held a non-finite value (dropped ones included). */
struct TensorStats {
    double grad_norm = 0.0;
    uint64_t nonfinite_microbatches = 0;
};

/** gradacc_optimizer_config_t initialised by gradacc_optimizer_config_default() (AdamW with
 * PyTorch's defaults, lr 1e-3); set `algorithm = GRADACC_OPTIMIZER_SGD` and the other fields
 * after. */
struct OptimizerConfig : gradacc_optimizer_config_t {
    OptimizerConfig() : gradacc_optimizer_config_t() { check(gradacc_optimizer_config_default(this)); }
};

using TensorDesc = gradacc_tensor_desc_t;
/** One tensor's optimizer options: weight decay on or off, and a learning-rate factor. */
using TensorGroup = gradacc_tensor_group_t;
/** gradacc_sync_info_t as the sync calls return it, struct_size set by the wrapper. Besides the
 * counts, `dropped_microbatches` (GRADACC_OVERFLOW_DROP_MICROBATCH) and where the window first
 * went non-finite: `overflow_at` (GRADACC_OVERFLOW_AT_NONE, _GRADIENT or _REDUCTION) and, with
 * _GRADIENT, `overflow_rank`, `overflow_microbatch` and `overflow_tensor`, 0-based as in C. */
using SyncInfo = gradacc_sync_info_t;
using ScalerStats = gradacc_scaler_stats_t;

namespace detail {
// Deleters for unique_ptr. A destroy that fails here can only mean a handle gradacc no longer
// knows, which the wrapper's single ownership rules out; a destructor must not throw anyway.
struct ScalerDelete {
    void operator()(gradacc_scaler_t *p) const noexcept { (void)gradacc_scaler_destroy(p); }
};
struct AccumulatorDelete {
    void operator()(gradacc_accumulator_t *p) const noexcept { (void)gradacc_accumulator_destroy(p); }
};
struct CommDelete {
    void operator()(gradacc_comm_t *p) const noexcept { (void)gradacc_comm_destroy(p); }
};
struct OptimizerDelete {
    void operator()(gradacc_optimizer_t *p) const noexcept { (void)gradacc_optimizer_destroy(p); }
};
struct MeshDelete {
    void operator()(gradacc_mesh_t *p) const noexcept { (void)gradacc_mesh_destroy(p); }
};
struct MeshShapeDelete {
    void operator()(gradacc_mesh_shape_t *p) const noexcept { (void)gradacc_mesh_shape_destroy(p); }
};

inline const char *dtype_name(gradacc_dtype_t dtype) noexcept {
    switch (dtype) {
    case GRADACC_DTYPE_F32:
        return "f32";
    case GRADACC_DTYPE_F16:
        return "f16";
    case GRADACC_DTYPE_BF16:
        return "bf16";
    default:
        return "an unknown dtype";
    }
}
} // namespace detail

class Accumulator;

/** One rank's endpoint of a data-parallel group. Move-only; destroyed with gradacc_comm_destroy. */
class Communicator {
public:
    /** Takes ownership of a handle from the C API (e.g. gradacc_comm_create_local). */
    explicit Communicator(gradacc_comm_t *owned) noexcept : handle_(owned) {}

    /** This handle's rank; ranks and world sizes are int, as in the C API, MPI and NCCL. */
    int rank() const {
        std::int32_t r = 0;
        check(gradacc_comm_rank(handle_.get(), &r));
        return r;
    }
    int world_size() const {
        std::int32_t n = 0;
        check(gradacc_comm_world_size(handle_.get(), &n));
        return n;
    }

    /** This rank's communicator of a split (gradacc_comm_split): the ranks that pass the same
     * `color` form a group, ranked by `key`. Collective over this communicator. */
    Communicator split(std::uint32_t color, std::uint32_t key) {
        gradacc_comm_t *p = nullptr;
        check(gradacc_comm_split(handle_.get(), color, key, &p));
        return Communicator(p);
    }

    /** How long a collective may wait for the other ranks, in seconds (default 600); 0 means
     * forever. Past it, the sync throws TimeoutError and the communicator is aborted. Applies to
     * collectives that start later; a negative, NaN or infinite value throws INVALID_ARGUMENT. */
    void set_timeout(double seconds) { check(gradacc_comm_set_timeout(handle_.get(), seconds)); }
    template <class Rep, class Period>
    void set_timeout(std::chrono::duration<Rep, Period> timeout) {
        set_timeout(std::chrono::duration<double>(timeout).count());
    }
    /** The timeout in seconds; 0 when it waits forever. */
    double timeout() const {
        double seconds = 0.0;
        check(gradacc_comm_timeout(handle_.get(), &seconds));
        return seconds;
    }

    /** Aborts this rank's communicator (after a peer died): a sync blocked in it on another
     * thread, and every later one, throws COMM_FAILURE; in a LocalGroup every rank fails. Safe
     * while another thread is blocked in a sync on it. The handle stays owned here. */
    void abort() { check(gradacc_comm_abort(handle_.get())); }

    gradacc_comm_t *get() const noexcept { return handle_.get(); }
    /** Gives the handle up: the caller must now free it with gradacc_comm_destroy. */
    gradacc_comm_t *release() noexcept { return handle_.release(); }

private:
    std::unique_ptr<gradacc_comm_t, detail::CommDelete> handle_;
};

/** An in-process group of `world_size` ranks (threads), rank 0 first. Hand communicator r to the
 * thread that runs rank r; every rank must take part in every sync. */
class LocalGroup {
public:
    explicit LocalGroup(int world_size) {
        // At least one slot, so a world_size out of range is reported as such, not as a NULL buffer.
        std::vector<gradacc_comm_t *> raw(world_size > 0 ? static_cast<std::size_t>(world_size) : 1, nullptr);
        check(gradacc_comm_create_local(world_size, raw.data()));
        comms_.reserve(raw.size());
        for (gradacc_comm_t *c : raw)
            comms_.emplace_back(c); // reserve() above: no allocation, so no leak on throw
    }

    std::size_t size() const noexcept { return comms_.size(); }
    Communicator &operator[](std::size_t rank) noexcept { return comms_[rank]; }
    const Communicator &operator[](std::size_t rank) const noexcept { return comms_[rank]; }
    std::vector<Communicator>::iterator begin() noexcept { return comms_.begin(); }
    std::vector<Communicator>::iterator end() noexcept { return comms_.end(); }

private:
    std::vector<Communicator> comms_;
};

/** A dynamic loss scaler. Move-only; destroyed with gradacc_scaler_destroy. */
class Scaler {
public:
    explicit Scaler(const ScalerConfig &config = ScalerConfig(), const Device &device = Device()) {
        gradacc_scaler_t *p = nullptr;
        check(gradacc_scaler_create(&config, &device, &p));
        handle_.reset(p);
    }

    /** The current loss scale (synchronises with the stream on CUDA). */
    float scale() const {
        float s = 0.0f;
        check(gradacc_scaler_scale(handle_.get(), &s));
        return s;
    }

    /** Multiplies `numel` loss values of `dtype` at `loss` in place by the current scale. */
    void scale_loss(void *loss, std::size_t numel, gradacc_dtype_t dtype) const {
        check(gradacc_scaler_scale_loss(handle_.get(), loss, numel, dtype));
    }
    void scale_loss(span<float> loss) const { scale_loss(loss.data(), loss.size(), GRADACC_DTYPE_F32); }

    /** Ends an optimizer step from the synced accumulators; returns true when it must be skipped. */
    inline bool update(std::initializer_list<const Accumulator *> accumulators);
    inline bool update(const Accumulator &accumulator);

    ScalerStats stats() const {
        ScalerStats s{};
        s.struct_size = sizeof s;
        check(gradacc_scaler_stats(handle_.get(), &s));
        return s;
    }

    /** The complete state as versioned bytes (for a checkpoint). */
    std::vector<uint8_t> save() const {
        std::size_t n = 0;
        check(gradacc_scaler_save(handle_.get(), nullptr, 0, &n));
        std::vector<uint8_t> bytes(n);
        check(gradacc_scaler_save(handle_.get(), bytes.data(), bytes.size(), &n));
        bytes.resize(n);
        return bytes;
    }
    void load(span<const uint8_t> bytes) {
        check(gradacc_scaler_load(handle_.get(), bytes.data(), bytes.size()));
    }

    gradacc_scaler_t *get() const noexcept { return handle_.get(); }
    /** Gives the handle up: the caller must now free it with gradacc_scaler_destroy. */
    gradacc_scaler_t *release() noexcept { return handle_.release(); }

private:
    std::unique_ptr<gradacc_scaler_t, detail::ScalerDelete> handle_;
};

/** FP32 master gradients of a list of tensors. Move-only; destroyed with
 * gradacc_accumulator_destroy. The scalers and communicators passed to its methods are borrowed
 * for the call only; Accumulator::sharded's communicator may be destroyed before it (the library
 * keeps the group). */
class Accumulator {
public:
    explicit Accumulator(span<const TensorDesc> tensors,
                         const AccumulatorConfig &config = AccumulatorConfig(),
                         const Device &device = Device()) {
        gradacc_accumulator_t *p = nullptr;
        check(gradacc_accumulator_create(&config, tensors.data(), tensors.size(), &device, &p));
        handle_.reset(p);
    }
    Accumulator(std::initializer_list<TensorDesc> tensors,
                const AccumulatorConfig &config = AccumulatorConfig(), const Device &device = Device())
        : Accumulator(span<const TensorDesc>(tensors.begin(), tensors.size()), config, device) {}

    /** Adopts the caller's FP32 buffer as the master; it must outlive the accumulator. */
    static Accumulator with_buffer(span<const TensorDesc> tensors, span<float> master,
                                   const AccumulatorConfig &config = AccumulatorConfig(),
                                   const Device &device = Device()) {
        gradacc_accumulator_t *p = nullptr;
        check(gradacc_accumulator_create_with_buffer(&config, tensors.data(), tensors.size(), &device,
                                                     master.data(), master.size(), &p));
        return Accumulator(p);
    }

    /** Sharded accumulation (ZeRO-2, gradacc_accumulator_create_sharded): `config.sharding` is
     * GRADACC_SHARDING_ACCUMULATE and `comm` a communicator of `config.shard_count` ranks on
     * which this is rank `config.shard_rank`. The accumulator holds only its shard (shard()), and
     * every micro-batch and sync is a collective over `comm`, each rank calling on its own
     * thread. docs/sharding.md ("Sharded accumulation (ZeRO-2)") states the contract: what each
     * rank holds, the calls every rank makes, how a failure ends and what the result equals. In
     * C++ a failure throws gradacc::Error with the page's status. The library keeps the group:
     * destroying `comm` first releases only its handle, and sync() goes on without it. */
    static Accumulator sharded(span<const TensorDesc> tensors, Communicator &comm,
                               const AccumulatorConfig &config, const Device &device = Device()) {
        gradacc_accumulator_t *p = nullptr;
        check(gradacc_accumulator_create_sharded(&config, tensors.data(), tensors.size(), &device, comm.get(),
                                                 &p));
        return Accumulator(p);
    }

    /** One micro-batch of `count` items: grads[i] is tensor i's gradient, float values for an
     * F32 tensor and 16-bit words for F16 / BF16, of its declared numel. Each is checked against
     * its tensor's dtype and numel before anything is added: a wrong element type throws
     * DTYPE_MISMATCH and a wrong length SIZE_MISMATCH, naming the argument, and the accumulator
     * is unchanged (a sharded accumulation's other ranks fail the micro-batch too). The other
     * refusals are gradacc_accumulator_add's. */
    void add(const Scaler &scaler, span<const Grad> grads, uint64_t count) {
        // A wrong tensor count (or a dead handle) is the C call's to report, as in the raw form.
        std::size_t n = 0;
        const bool counted = gradacc_accumulator_num_tensors(handle_.get(), &n) == GRADACC_STATUS_OK &&
                             n == grads.size();
        // At least one slot: an empty list is then refused for its count, not as a NULL `grads`.
        std::vector<const void *> ptrs(grads.size() > 0 ? grads.size() : 1, nullptr);
        const auto refuse = [&] { (void)gradacc_accumulator_add(handle_.get(), scaler.get(), nullptr, 0, 0); };
        for (std::size_t i = 0; i < grads.size(); i++) {
            const auto argument = [i] { return "grads[" + std::to_string(i) + "]"; };
            if (counted)
                check_grad("gradacc::Accumulator::add", i, grads[i], true, argument, refuse);
            ptrs[i] = grads[i].data();
        }
        check(gradacc_accumulator_add(handle_.get(), scaler.get(), ptrs.data(), grads.size(), count));
    }
    void add(const Scaler &scaler, std::initializer_list<Grad> grads, uint64_t count) {
        add(scaler, span<const Grad>(grads.begin(), grads.size()), count);
    }
    /** The raw form, unchecked as gradacc_accumulator_add is: grads[i] must point at tensor i's
     * declared numel values of its dtype, which the C ABI cannot tell behind a `void *` (it
     * checks the tensor count, NULLs, alignment and overlap with the master). Prefer the typed
     * form above; `{w.data(), b.data()}` picks this one, `{w, b}` the typed one. */
    void add(const Scaler &scaler, span<const void *const> grads, uint64_t count) {
        check(gradacc_accumulator_add(handle_.get(), scaler.get(), grads.data(), grads.size(), count));
    }
    void add(const Scaler &scaler, std::initializer_list<const void *> grads, uint64_t count) {
        add(scaler, span<const void *const>(grads.begin(), grads.size()), count);
    }
    /** The raw form for the window's last micro-batch (gradacc_accumulator_add_final): the
     * boundary after it then needs no read of its own to measure the norm, where it only measures
     * (with clipping, or NORMALIZE_NONE) and reduces nothing between ranks. The same bits as add. */
    void add_final(const Scaler &scaler, span<const void *const> grads, uint64_t count) {
        check(gradacc_accumulator_add_final(handle_.get(), scaler.get(), grads.data(), grads.size(), count));
    }

    /** Tensor by tensor, as backward hooks produce them. */
    void begin_microbatch(uint64_t count) {
        check(gradacc_accumulator_begin_microbatch(handle_.get(), count));
    }
    /** The raw form, unchecked as gradacc_accumulator_add_tensor is: `numel` must be the
     * tensor's (it is checked) and `grad` must hold that many values of the tensor's dtype (it
     * cannot be). Prefer the span forms. */
    void add_tensor(const Scaler &scaler, std::size_t index, const void *grad, std::size_t numel) {
        check(gradacc_accumulator_add_tensor(handle_.get(), scaler.get(), index, grad, numel));
    }
    /** float values for an F32 tensor. A span of the wrong element type throws DTYPE_MISMATCH
     * naming `grad`, one of the wrong length SIZE_MISMATCH (gradacc_accumulator_add_tensor's
     * check of `numel`), and nothing is added (a sharded accumulation's micro-batch then fails on
     * every rank, as for any refused add_tensor). */
    void add_tensor(const Scaler &scaler, std::size_t index, span<const float> grad) {
        add_checked_tensor(scaler, index, grad);
    }
    /** fp16 or bf16 words, whichever dtype tensor `index` was declared with; checked as above. */
    void add_tensor(const Scaler &scaler, std::size_t index, span<const uint16_t> grad) {
        add_checked_tensor(scaler, index, grad);
    }
    void end_microbatch() { check(gradacc_accumulator_end_microbatch(handle_.get())); }

    /** The boundary for one process; for a sharded accumulation (Accumulator::sharded), the
     * boundary over the communicator it was created with. */
    SyncInfo sync() { return sync_with(nullptr); }
    /** The boundary across `comm`'s group: every rank calls it, each on its own thread. A
     * sharded accumulator needs a group of `shard_count` ranks on which it is `shard_rank`;
     * otherwise every rank throws. A sharded accumulation takes only the communicator it was
     * created with (another throws INVALID_ARGUMENT there and PEER_FAILURE on the other ranks). */
    SyncInfo sync(Communicator &comm) { return sync_with(comm.get()); }
    /** sync() for an optimizer that steps right after: the clip coefficient is applied inside
     * Optimizer::step's pass, bitwise as after sync(), and master() / shard() hold the gradient
     * before it (gradacc_accumulator_sync_for_step). */
    SyncInfo sync_for_step() { return sync_with(nullptr, true); }
    /** sync(comm) with the clip coefficient left to the step, as sync_for_step(). */
    SyncInfo sync_for_step(Communicator &comm) { return sync_with(comm.get(), true); }
    /** The hybrid boundary (HSDP) of an accumulator with GRADACC_SHARDING_REDUCE_SCATTER or
     * GRADACC_SHARDING_ACCUMULATE: a reduce-scatter over `shard` (its shard group: `shard_count`
     * ranks, this one `shard_rank`; for a sharded accumulation, the communicator it was created
     * with, which reduced every micro-batch already), then an all-reduce of the shard over
     * `replicas`, the ranks holding the same shard in the other shard groups. Every rank of
     * both groups calls it, each on its own thread. Counts, overflow and the norm are the whole
     * grid's, the same on every rank, and replicas hold the same bits. Replica groups pairing
     * different shards throw SIZE_MISMATCH, and an unsharded accumulator INVALID_ARGUMENT, on
     * every rank with the window intact. Which communicators a device takes:
     * gradacc_accumulator_sync_hybrid. */
    SyncInfo sync_hybrid(Communicator &shard, Communicator &replicas) {
        SyncInfo info{};
        info.struct_size = sizeof info;
        check(gradacc_accumulator_sync_hybrid(handle_.get(), shard.get(), replicas.get(), &info));
        return info;
    }

    /** Tensor `index`'s FP32 master gradient, as a view into the accumulator's buffer. It stays
     * valid until the accumulator is destroyed (moving the Accumulator object does not move the
     * buffer); its contents are the boundary's result after sync(), a window in progress otherwise.
     * Reading it must not overlap calls that add. A sharded accumulation holds only its shard: a
     * tensor not wholly inside it throws INVALID_ARGUMENT (use shard()). */
    span<float> master(std::size_t index) const {
        float *p = nullptr;
        std::size_t n = 0;
        check(gradacc_accumulator_master(handle_.get(), index, &p, &n));
        return span<float>(p, n);
    }

    /** This rank's shard of the master: its range in the flat layout and a view of it, valid as
     * master()'s views are; the range never changes. Without sharding it is the whole master.
     * With GRADACC_SHARDING_REDUCE_SCATTER, after a sync only the shard holds the reduced
     * gradient (the bits an unsharded sync leaves there); the rest of the master is unspecified
     * until the next window's first micro-batch. With GRADACC_SHARDING_ACCUMULATE the shard is
     * all the accumulator holds: the window's sum over the ranks while accumulating, the
     * reduced gradient after sync(). Shards are cut in whole blocks of 4096 elements, so the
     * last ones may be shorter or empty. */
    Shard shard() const {
        std::size_t offset = 0, n = 0;
        float *p = nullptr;
        check(gradacc_accumulator_shard(handle_.get(), &offset, &n, &p));
        Shard s;
        s.offset = offset;
        s.data = span<float>(p, n);
        return s;
    }

    /** Where tensor `index` starts in the flat master, in elements: a multiple of
     * GRADACC_MASTER_ALIGN / 4. With shard()'s range it tells which tensors a shard holds. */
    std::size_t offset(std::size_t index) const {
        std::size_t at = 0;
        check(gradacc_accumulator_offset(handle_.get(), index, &at));
        return at;
    }

    /** The flat master's length, in f32 elements, of an accumulator over `tensors`: each tensor
     * at a multiple of GRADACC_MASTER_ALIGN bytes, zeros between and after the last. */
    static std::size_t master_numel(span<const TensorDesc> tensors) {
        std::size_t n = 0;
        check(gradacc_accumulator_master_numel(tensors.data(), tensors.size(), &n));
        return n;
    }

    std::size_t num_tensors() const {
        std::size_t n = 0;
        check(gradacc_accumulator_num_tensors(handle_.get(), &n));
        return n;
    }

    /** Each tensor's stats of the last boundary, in tensor order (gradacc_accumulator_tensor_stats);
     * they last until the next window's first micro-batch. Throws WRONG_STATE when the config
     * left `tensor_stats` at 0, and before a sync. */
    std::vector<TensorStats> tensor_stats() const {
        const std::size_t n = num_tensors();
        std::vector<double> norms(n);
        std::vector<uint64_t> counts(n);
        check(gradacc_accumulator_tensor_stats(handle_.get(), norms.data(), counts.data(), n));
        std::vector<TensorStats> stats(n);
        for (std::size_t i = 0; i < n; i++)
            stats[i] = TensorStats{norms[i], counts[i]};
        return stats;
    }

    void reset() { check(gradacc_accumulator_reset(handle_.get())); }

    /** The window in progress as versioned bytes (a checkpoint in the middle of accumulation). A
     * sharded accumulation saves its shard: the bytes load only into the same shard of an
     * accumulation over as many ranks (anything else throws CORRUPT_STATE). */
    std::vector<uint8_t> save_window() const {
        std::size_t n = 0;
        check(gradacc_accumulator_save_window(handle_.get(), nullptr, 0, &n));
        std::vector<uint8_t> bytes(n);
        check(gradacc_accumulator_save_window(handle_.get(), bytes.data(), bytes.size(), &n));
        bytes.resize(n);
        return bytes;
    }
    void load_window(span<const uint8_t> bytes) {
        check(gradacc_accumulator_load_window(handle_.get(), bytes.data(), bytes.size()));
    }
    /** Adds a window from save_window() (same tensors, any rank or device) into the current one:
     * masters, counts and micro-batches add, overflow flags OR, so windows saved on N ranks resume
     * on M. Corrupt bytes throw CORRUPT_STATE and leave the window unchanged. */
    void merge_window(span<const uint8_t> bytes) {
        check(gradacc_accumulator_merge_window(handle_.get(), bytes.data(), bytes.size()));
    }

    gradacc_accumulator_t *get() const noexcept { return handle_.get(); }
    /** Gives the handle up: the caller must now free it with gradacc_accumulator_destroy. */
    gradacc_accumulator_t *release() noexcept { return handle_.release(); }

private:
    explicit Accumulator(gradacc_accumulator_t *owned) noexcept : handle_(owned) {}

    // The length goes to the C call as `numel`, which checks it.
    void add_checked_tensor(const Scaler &scaler, std::size_t index, const Grad &grad) {
        check_grad(
            "gradacc::Accumulator::add_tensor", index, grad, false, [] { return std::string("grad"); },
            [&] { (void)gradacc_accumulator_add_tensor(handle_.get(), scaler.get(), index, nullptr, 0); });
        check(gradacc_accumulator_add_tensor(handle_.get(), scaler.get(), index, grad.data(), grad.size()));
    }

    // The C functions take a gradient as a `void *` and cannot tell its element type, nor (in
    // add, which takes no lengths) its length: the typed forms check them against tensor
    // `index`'s declaration. On a mismatch `refuse` makes the C call that a sharded
    // accumulation's other ranks need to fail too, then it throws. A descriptor that cannot be
    // read (an index out of range, a dead handle) is left to the C call, which reports why.
    template <class Argument, class Refuse>
    void check_grad(const char *function, std::size_t index, const Grad &grad, bool length, Argument argument,
                    Refuse refuse) const {
        gradacc_tensor_desc_t d{};
        if (gradacc_accumulator_tensor(handle_.get(), index, &d) != GRADACC_STATUS_OK)
            return;
        const bool f32 = d.dtype == GRADACC_DTYPE_F32;
        if (grad.is_f32() == f32 && (!length || grad.size() == d.numel))
            return;
        const std::string at = std::string(function) + ": `" + argument() + "`";
        const std::string tensor = "tensor " + std::to_string(index);
        refuse();
        if (grad.is_f32() != f32)
            throw Error(GRADACC_STATUS_DTYPE_MISMATCH,
                        at + " is a span of " + (grad.is_f32() ? "float" : "uint16_t") + ", but " + tensor +
                            " was declared " + detail::dtype_name(d.dtype));
        throw Error(GRADACC_STATUS_SIZE_MISMATCH,
                    at + " has " + std::to_string(grad.size()) + " elements, but " + tensor + " has " +
                        std::to_string(d.numel));
    }

    SyncInfo sync_with(gradacc_comm_t *comm, bool for_step = false) {
        SyncInfo info{};
        info.struct_size = sizeof info;
        check(for_step ? gradacc_accumulator_sync_for_step(handle_.get(), comm, &info)
                       : gradacc_accumulator_sync(handle_.get(), comm, &info));
        return info;
    }

    std::unique_ptr<gradacc_accumulator_t, detail::AccumulatorDelete> handle_;
};

/** A tensor several model-parallel ranks hold alike (`tensor`, `copies`, `key`, as in C): it
 * enters a mesh step's global norm once. */
using Replicated = gradacc_replicated_t;

/** One accumulator of a mesh step and the group it reduces over; everything is borrowed for the
 * call. `comm` null: the accumulator is alone, or a sharded accumulation's own; `replicas` is a
 * hybrid boundary's replica group (null otherwise). */
struct MeshPart {
    Accumulator *accumulator = nullptr;
    Communicator *comm = nullptr;
    Communicator *replicas = nullptr;
    std::vector<Replicated> replicated;
};

/** What a mesh step reports, the same on every rank: the job's SyncInfo (an overflow's rank is a
 * world rank) and the part of that rank's step it names. */
struct MeshInfo {
    SyncInfo info;
    std::optional<std::size_t> overflow_part;
};

/** One boundary over a job's accumulators (gradacc_mesh_create: the world communicator, this
 * rank's data-parallel rank and size, the global norm's clip). Move-only; destroyed with
 * gradacc_mesh_destroy. The mesh keeps its own reference to the world's communicator. */
/** Where a rank sits in its group over some axes (gradacc_mesh_shape_group): the group's
 * smallest world rank (a split's color), the rank's index in it (its rank there), its size. */
struct MeshGroup {
    std::uint32_t color = 0, key = 0, size = 0;
};

/** A mesh's shape (gradacc_mesh_shape_create): each rank's groups in Megatron-Core's rank order
 * (`order` nullptr: "tp-cp-dp-pp") or any other. Axis lists are names joined by '-': "cp-dp",
 * "tp", "edp". Move-only; destroyed with gradacc_mesh_shape_destroy. */
class MeshShape {
public:
    explicit MeshShape(std::uint32_t world_size, std::uint32_t tp = 1, std::uint32_t pp = 1, std::uint32_t cp = 1,
                       std::uint32_t ep = 1, std::uint32_t etp = 1, const char *order = nullptr) {
        gradacc_mesh_shape_t *p = nullptr;
        check(gradacc_mesh_shape_create(world_size, tp, pp, cp, ep, etp, order, &p));
        handle_.reset(p);
    }

    /** World rank `rank`'s group over `axes`; for Mesh, data_rank and data_size are the key and
     * the size over "cp-dp". */
    MeshGroup group(std::uint32_t rank, const char *axes) const {
        MeshGroup g;
        check(gradacc_mesh_shape_group(handle_.get(), rank, axes, &g.color, &g.key, &g.size));
        return g;
    }

    /** This rank's group over `axes`, split from `world` (an MPI communicator of every rank of the
     * mesh). Collective: every rank calls it with the same axes. */
    Communicator split(Communicator &world, const char *axes) const {
        gradacc_comm_t *p = nullptr;
        check(gradacc_mesh_shape_split(handle_.get(), world.get(), axes, &p));
        return Communicator(p);
    }

    gradacc_mesh_shape_t *get() const noexcept { return handle_.get(); }

private:
    std::unique_ptr<gradacc_mesh_shape_t, detail::MeshShapeDelete> handle_;
};

class Mesh {
public:
    Mesh(Communicator &world, std::uint32_t data_rank, std::uint32_t data_size, float max_grad_norm = 0.0f) {
        gradacc_mesh_t *p = nullptr;
        check(gradacc_mesh_create(world.get(), data_rank, data_size, max_grad_norm, &p));
        handle_.reset(p);
    }

    /** The mesh step over this rank's parts (gradacc_mesh_sync); every rank of the world calls
     * it. A null accumulator is passed on, so the library names it and tells the peers. */
    MeshInfo sync(span<const MeshPart> parts) {
        std::vector<gradacc_mesh_part_t> raw(parts.size());
        for (std::size_t i = 0; i < parts.size(); i++) {
            const MeshPart &p = parts[i];
            raw[i].struct_size = sizeof raw[i];
            raw[i].accumulator = p.accumulator ? p.accumulator->get() : nullptr;
            raw[i].comm = p.comm ? p.comm->get() : nullptr;
            raw[i].replicas = p.replicas ? p.replicas->get() : nullptr;
            raw[i].replicated = p.replicated.empty() ? nullptr : p.replicated.data();
            raw[i].replicated_count = p.replicated.size();
        }
        MeshInfo out{};
        out.info.struct_size = sizeof out.info;
        std::uint32_t part = 0;
        check(gradacc_mesh_sync(handle_.get(), raw.empty() ? nullptr : raw.data(), raw.size(), &out.info, &part));
        if (part != UINT32_MAX)
            out.overflow_part = part;
        return out;
    }
    MeshInfo sync(std::initializer_list<MeshPart> parts) {
        return sync(span<const MeshPart>(parts.begin(), parts.size()));
    }

    /** Ends the open micro-batch of each of this rank's accumulators (DROP_MICROBATCH, fed
     * tensor by tensor), its drop agreed over the world first (gradacc_mesh_end_microbatch);
     * every rank calls it once per micro-batch. True: this rank kept it. A null accumulator is
     * passed on, so the library names it and tells the peers. */
    bool end_microbatch(std::initializer_list<Accumulator *> accumulators) {
        std::vector<gradacc_accumulator_t *> raw;
        raw.reserve(accumulators.size());
        for (Accumulator *a : accumulators)
            raw.push_back(a ? a->get() : nullptr);
        std::uint32_t kept = 0;
        check(gradacc_mesh_end_microbatch(handle_.get(), raw.empty() ? nullptr : raw.data(), raw.size(), &kept));
        return kept == 1;
    }

    gradacc_mesh_t *get() const noexcept { return handle_.get(); }
    /** Gives the handle up: the caller must now free it with gradacc_mesh_destroy. */
    gradacc_mesh_t *release() noexcept { return handle_.release(); }

private:
    std::unique_ptr<gradacc_mesh_t, detail::MeshDelete> handle_;
};

inline bool Scaler::update(std::initializer_list<const Accumulator *> accumulators) {
    std::vector<const gradacc_accumulator_t *> raw;
    raw.reserve(accumulators.size());
    for (const Accumulator *a : accumulators)
        raw.push_back(a ? a->get() : nullptr);
    bool skipped = false;
    check(gradacc_scaler_update(handle_.get(), raw.data(), raw.size(), &skipped));
    return skipped;
}

inline bool Scaler::update(const Accumulator &accumulator) { return update({&accumulator}); }

/** FP32 master weights and AdamW or SGD state for an accumulator's tensors, stepped after each
 * sync. Move-only; destroyed with gradacc_optimizer_destroy. The accumulators and communicators
 * passed to its methods are borrowed for the call only. The contract (one step per synced
 * window, a skipped window changes nothing, the all-gather under sharding) is
 * gradacc_optimizer_create's and gradacc_optimizer_step's; docs/optimizer.md. */
class Optimizer {
public:
    /** Masters initialised from the model's weights: `weights[i]` points at tensor i's whole
     * weight of `dtypes[i]` (host memory; on a CUDA accumulator, a device address, and the masters
     * and state live in device memory); empty `dtypes` means the tensors' gradient dtypes, and
     * empty `groups` weight decay on and lr_scale 1 for every tensor. */
    Optimizer(const Accumulator &acc, span<const void *const> weights, span<const gradacc_dtype_t> dtypes = {},
              const OptimizerConfig &config = OptimizerConfig(), span<const TensorGroup> groups = {}) {
        gradacc_optimizer_t *p = nullptr;
        check(gradacc_optimizer_create(acc.get(), &config, groups.empty() ? nullptr : groups.data(), weights.data(),
                                       dtypes.empty() ? nullptr : dtypes.data(), weights.size(), &p));
        handle_.reset(p);
    }
    Optimizer(const Accumulator &acc, std::initializer_list<const void *> weights,
              std::initializer_list<gradacc_dtype_t> dtypes = {}, const OptimizerConfig &config = OptimizerConfig(),
              std::initializer_list<TensorGroup> groups = {})
        : Optimizer(acc, span<const void *const>(weights.begin(), weights.size()),
                    span<const gradacc_dtype_t>(dtypes.begin(), dtypes.size()), config,
                    span<const TensorGroup>(groups.begin(), groups.size())) {}

    /** Adopts the caller's FP32 masters (gradacc_optimizer_create_with_masters): `masters` holds
     * this rank's range of the flat layout (acc.shard()'s length; host memory, or one device
     * allocation on a CUDA accumulator), its values are the masters (not overwritten from the
     * weights), and every step updates them in place. It must outlive the optimizer, and the
     * caller must not write it while a call or a step enqueued on the stream runs. */
    static Optimizer with_masters(const Accumulator &acc, span<const void *const> weights, span<float> masters,
                                  span<const gradacc_dtype_t> dtypes = {},
                                  const OptimizerConfig &config = OptimizerConfig(),
                                  span<const TensorGroup> groups = {}) {
        gradacc_optimizer_t *p = nullptr;
        check(gradacc_optimizer_create_with_masters(acc.get(), &config, groups.empty() ? nullptr : groups.data(),
                                                    weights.data(), dtypes.empty() ? nullptr : dtypes.data(),
                                                    weights.size(), masters.data(), masters.size(), &p));
        return Optimizer(p);
    }
    static Optimizer with_masters(const Accumulator &acc, std::initializer_list<const void *> weights,
                                  span<float> masters, std::initializer_list<gradacc_dtype_t> dtypes = {},
                                  const OptimizerConfig &config = OptimizerConfig(),
                                  std::initializer_list<TensorGroup> groups = {}) {
        return with_masters(acc, span<const void *const>(weights.begin(), weights.size()), masters,
                            span<const gradacc_dtype_t>(dtypes.begin(), dtypes.size()), config,
                            span<const TensorGroup>(groups.begin(), groups.size()));
    }

    /** The step after acc.sync(): writes the model's weights (the pointers, in the dtypes given at
     * creation) and returns true, or returns false and changes nothing when the window held a
     * non-finite value. Under a sharded boundary every rank calls it with the communicator its
     * sync took (nullptr: a sharded accumulation's own). On a CUDA accumulator it is enqueued on
     * the accumulator's stream (the skip is decided on the device) and returns without waiting. */
    bool step(Accumulator &acc, span<void *const> weights, Communicator *comm = nullptr) {
        bool stepped = false;
        check(gradacc_optimizer_step(handle_.get(), acc.get(), weights.data(), weights.size(),
                                     comm ? comm->get() : nullptr, &stepped));
        return stepped;
    }
    bool step(Accumulator &acc, std::initializer_list<void *> weights, Communicator *comm = nullptr) {
        return step(acc, span<void *const>(weights.begin(), weights.size()), comm);
    }
    /** The step of an optimizer whose config's `weight_formats` makes some tensors FP8
     * (gradacc_optimizer_step_scaled): such a tensor's codes at `weights[i]` and its scales at
     * `scales[i]` (one float for GRADACC_WEIGHTS_E4M3_TENSORWISE, one byte per block of 32 for
     * GRADACC_WEIGHTS_MXFP8), nullptr for a model-dtype tensor; both written by the step, the
     * same bits on every rank. */
    bool step_scaled(Accumulator &acc, span<void *const> weights, span<void *const> scales, Communicator &comm) {
        bool stepped = false;
        check(gradacc_optimizer_step_scaled(handle_.get(), acc.get(), weights.data(), scales.data(), weights.size(),
                                            comm.get(), &stepped));
        return stepped;
    }
    bool step_scaled(Accumulator &acc, std::initializer_list<void *> weights, std::initializer_list<void *> scales,
                     Communicator &comm) {
        return step_scaled(acc, span<void *const>(weights.begin(), weights.size()),
                           span<void *const>(scales.begin(), scales.size()), comm);
    }

    /** With the communicator by reference, as Accumulator::sync takes it. */
    bool step(Accumulator &acc, span<void *const> weights, Communicator &comm) { return step(acc, weights, &comm); }
    bool step(Accumulator &acc, std::initializer_list<void *> weights, Communicator &comm) {
        return step(acc, weights, &comm);
    }

    /** The learning rate of the steps from the next one on. */
    void set_lr(float lr) { check(gradacc_optimizer_set_lr(handle_.get(), lr)); }

    /** On a CUDA accumulator, the device address of the learning rate every step reads (see
     * gradacc_optimizer_lr_device_ptr); throws DEVICE_MISMATCH on a CPU accumulator. */
    void *lr_device_ptr() const {
        void *p = nullptr;
        check(gradacc_optimizer_lr_device_ptr(handle_.get(), &p));
        return p;
    }

    /** The number of steps taken (a skipped step is not one). */
    uint64_t steps() const {
        uint64_t n = 0;
        check(gradacc_optimizer_steps(handle_.get(), &n));
        return n;
    }

    /** This rank's state as versioned bytes (for a checkpoint). */
    std::vector<uint8_t> save() const {
        std::size_t n = 0;
        check(gradacc_optimizer_save(handle_.get(), nullptr, 0, &n));
        std::vector<uint8_t> bytes(n);
        check(gradacc_optimizer_save(handle_.get(), bytes.data(), bytes.size(), &n));
        bytes.resize(n);
        return bytes;
    }
    /** Restores the state from the parts save() wrote on any number of ranks (together covering
     * this rank's elements, each rank's once). Bad parts throw CORRUPT_STATE, a part given twice
     * INVALID_ARGUMENT; either way nothing changes. */
    void load(span<const span<const uint8_t>> parts) {
        std::vector<const uint8_t *> ptrs;
        std::vector<std::size_t> lens;
        ptrs.reserve(parts.size());
        lens.reserve(parts.size());
        for (const span<const uint8_t> &part : parts) {
            ptrs.push_back(part.data());
            lens.push_back(part.size());
        }
        check(gradacc_optimizer_load(handle_.get(), ptrs.data(), lens.data(), parts.size()));
    }
    void load(std::initializer_list<span<const uint8_t>> parts) {
        load(span<const span<const uint8_t>>(parts.begin(), parts.size()));
    }

    gradacc_optimizer_t *get() const noexcept { return handle_.get(); }
    /** Gives the handle up: the caller must now free it with gradacc_optimizer_destroy. */
    gradacc_optimizer_t *release() noexcept { return handle_.release(); }

private:
    explicit Optimizer(gradacc_optimizer_t *owned) noexcept : handle_(owned) {}

    std::unique_ptr<gradacc_optimizer_t, detail::OptimizerDelete> handle_;
};

} // namespace gradacc

#endif /* GRADACC_HPP */
