/**
 * \file gradacc.h
 * \brief gradacc: correct mixed-precision gradient accumulation behind a stable C ABI.
 *
 * gradacc keeps the dynamic loss scale (a scaler), adds each micro-batch's fp16 / bf16 / fp32
 * gradients, unscaled as they arrive, into one flat FP32 master buffer (an accumulator), and at the
 * accumulation boundary all-reduces that buffer once over a communicator (in-process, MPI or NCCL),
 * normalises it by the global item count, measures its norm and optionally clips it. Every rank
 * ends the boundary with identical gradients and the same decision to skip or take the step.
 *
 * \section linking Building and linking
 *
 * - CMake: `find_package(gradacc 0.2 REQUIRED)` then link `gradacc::gradacc` (shared library) or
 *   `gradacc::static` (static library, which brings its system libraries with it). The same target
 *   names exist when the source tree is added with `add_subdirectory`.
 * - pkg-config: `cc app.c $(pkg-config --cflags --libs gradacc)`; for the static library add
 *   `--static` and link `libgradacc.a` explicitly.
 * - By hand: `-I<prefix>/include -L<prefix>/lib -lgradacc`; the static library also needs
 *   `-lgcc_s -lutil -lrt -lpthread -lm -ldl`: the list rustc prints with `--print native-static-libs`, kept in
 *   one place, GRADACC_NATIVE_STATIC_LIBS in CMakeLists.txt, which gradacc::static and gradacc.pc
 *   (`pkg-config --static --libs gradacc`) carry and from which this line is generated.
 *
 * GRADACC_VERSION_MAJOR / _MINOR / _PATCH / _STRING give the version of this header;
 * gradacc_version_string() and gradacc_version_number() give the version of the library actually
 * loaded; compare them to detect a header/library mismatch.
 *
 * \section conventions Conventions shared by every function
 *
 * - Status: every function returns a gradacc_status_t, GRADACC_STATUS_OK (0) on success and
 *   another GRADACC_STATUS_* code otherwise, except the queries that cannot fail: the version,
 *   gradacc_status_string() (names a code) and gradacc_last_error() (a message about the calling
 *   thread's most recent failure that names the argument and the value that was wrong). The last
 *   error is per thread: a failure on one thread never overwrites another thread's message.
 *   gradacc_status_t is a C enum; codes may be added in later versions, so a `switch` over it
 *   needs a `default`.
 * - Outputs: output arguments come last and are written only on success; on failure they keep
 *   whatever the caller put there.
 * - Arguments: the object comes first, then inputs; a buffer pointer is followed by its length.
 *   NULL where a value is required, a wrong size, a dtype or device mismatch, a destroyed or
 *   foreign handle, or a call in the wrong state is reported as a status, never a crash. What a
 *   `void *` buffer holds (its element type, and its length where none is passed) the C ABI
 *   cannot see: gradacc_accumulator_add says what it checks, and the C++ wrapper's typed forms
 *   and the other bindings check the typed buffers they take.
 * - Config structs start with `size_t struct_size`: fill them with their `*_config_default()`
 *   initialiser, then change fields. Fields are only ever appended, so old callers keep working:
 *   the size of an older header's struct (any size that ends on a field, padded to 8 bytes or not)
 *   is accepted and the fields it lacks take their defaults; a larger size (a header newer than the
 *   library loaded), 0, or a size that ends inside a field fails with
 *   GRADACC_STATUS_INVALID_ARGUMENT, naming the argument and the value. Output structs
 *   (gradacc_sync_info_t, gradacc_scaler_stats_t) start with struct_size too: the caller sets it
 *   (GRADACC_SYNC_INFO_INIT / GRADACC_SCALER_STATS_INIT in C), the same sizes are accepted, and
 *   the library writes only the fields that size covers.
 * - Ranks and world sizes are `int32_t` in every communicator function, as in MPI and NCCL, whose
 *   `int` ranks callers pass on unchanged; values out of range fail with
 *   GRADACC_STATUS_INVALID_ARGUMENT, naming the argument and the value.
 * - Checkpoints: gradacc_scaler_save / _load and the accumulator's window checkpoints
 *   (gradacc_accumulator_save_window / _load_window / _merge_window) work on every device. On
 *   CUDA they copy between the device and the host (waiting for the object's stream); the bytes
 *   are the same on every device, so a window saved on CUDA resumes on the CPU and back.
 * - Ownership: every function that creates an object names the function that destroys it. Each
 *   `*_destroy` accepts NULL (and does nothing) and must not be called twice on the same handle.
 *   Pointers passed in are borrowed for the duration of the call unless a function says otherwise;
 *   a CUDA stream passed in stays the caller's and is never destroyed by gradacc.
 * - Threads: each function states what may run concurrently. Unless it says otherwise, calls on one
 *   handle must not overlap in time, and calls on different handles may run on different threads.
 * - CUDA: device work is ordered on the caller's stream and calls return once the work is enqueued,
 *   except functions that read a value back to the host, which say that they synchronise.
 */

#ifndef GRADACC_H
#define GRADACC_H

/* Generated from the Rust sources by scripts/gen-header (cbindgen). Do not edit by hand. */

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

/** Major version of this header (from Cargo.toml). */
#define GRADACC_VERSION_MAJOR 0
/** Minor version of this header (from Cargo.toml). */
#define GRADACC_VERSION_MINOR 2
/** Patch version of this header (from Cargo.toml). */
#define GRADACC_VERSION_PATCH 0
/** Full version of this header, as a string (from Cargo.toml). */
#define GRADACC_VERSION_STRING "0.2.0"
/**
 * Version of this header as one number, MAJOR * 10000 + MINOR * 100 + PATCH (as
 * NCCL_VERSION_CODE), for `#if GRADACC_VERSION_NUMBER >= GRADACC_VERSION(0, 2, 0)`; equal to
 * gradacc_version_number() of the library it came with.
 */
#define GRADACC_VERSION_NUMBER 200
/** A version as one number, comparable with GRADACC_VERSION_NUMBER. */
#define GRADACC_VERSION(major, minor, patch) ((major) * 10000 + (minor) * 100 + (patch))

/**
 * GRADACC_API marks every function of the C API: default visibility with GCC and Clang (the
 * declarations stay exported when the including code builds with -fvisibility=hidden), and
 * __declspec(dllimport) on Windows unless GRADACC_STATIC is defined (the CMake target
 * gradacc::static defines it for programs that link the static library). Define GRADACC_API
 * before including the header to replace it.
 */
#ifndef GRADACC_API
#  if defined(_WIN32) && !defined(GRADACC_STATIC)
#    define GRADACC_API __declspec(dllimport)
#  elif defined(__GNUC__)
#    define GRADACC_API __attribute__((visibility("default")))
#  else
#    define GRADACC_API
#  endif
#endif

/**
 * Initialiser of gradacc_sync_info_t for C99 and later (`gradacc_sync_info_t info =
 * GRADACC_SYNC_INFO_INIT;`): struct_size is this header's size, every other field 0. Output structs
 * carry struct_size like config structs, so the library writes only the fields the caller knows; a
 * struct_size of 0 fails. In C++ and other languages: zero the struct, then set struct_size.
 */
#define GRADACC_SYNC_INFO_INIT {.struct_size = sizeof(gradacc_sync_info_t)}
/** Initialiser of gradacc_scaler_stats_t for C99 and later, as GRADACC_SYNC_INFO_INIT. */
#define GRADACC_SCALER_STATS_INIT {.struct_size = sizeof(gradacc_scaler_stats_t)}
/** Initialiser of gradacc_mesh_part_t for C99 and later: struct_size is this header's size, every
 * pointer NULL and the count 0; set the accumulator (and comm, replicas, replicated) after. */
#define GRADACC_MESH_PART_INIT {.struct_size = sizeof(gradacc_mesh_part_t)}


/**
 * Bytes to which every tensor's FP32 master is aligned in the flat master: tensor `i` starts at
 * an element offset that is a multiple of GRADACC_MASTER_ALIGN / 4 (gradacc_accumulator_offset),
 * with zeros between tensors. An owned master starts at such an address too.
 */
#define GRADACC_MASTER_ALIGN 256

/**
 * The `fortran_comm` value of gradacc_comm_create_mpi that means MPI_COMM_WORLD.
 */
#define GRADACC_MPI_COMM_WORLD -1

/**
 * Result of every gradacc function: `GRADACC_STATUS_OK` (0) or an error code. A C enum whose
 * values never change meaning; new codes may be added, so a `switch` over it needs a default.
 * Functions that take a status back (gradacc_status_string) take it as `int32_t`, so any value is
 * safe to pass.
 */
typedef enum gradacc_status_t {
    /**
     * Success.
     */
    GRADACC_STATUS_OK = 0,
    /**
     * A required pointer argument was NULL.
     */
    GRADACC_STATUS_NULL_ARGUMENT = 1,
    /**
     * An argument's value is outside its domain (a count, an index, an enum value, a config
     * field).
     */
    GRADACC_STATUS_INVALID_ARGUMENT = 2,
    /**
     * A handle that was destroyed, never created, or is of another object type.
     */
    GRADACC_STATUS_INVALID_HANDLE = 3,
    /**
     * A gradient's dtype differs from its tensor's declared dtype.
     */
    GRADACC_STATUS_DTYPE_MISMATCH = 4,
    /**
     * A buffer's length, or an accumulator's layout across ranks, differs from what is expected.
     */
    GRADACC_STATUS_SIZE_MISMATCH = 5,
    /**
     * Objects bound to different devices or backends were combined.
     */
    GRADACC_STATUS_DEVICE_MISMATCH = 6,
    /**
     * The call is not allowed in the object's current state (e.g. sync inside a micro-batch).
     */
    GRADACC_STATUS_WRONG_STATE = 7,
    /**
     * The accumulation window holds no micro-batch (on any rank), or its global item count is 0.
     */
    GRADACC_STATUS_EMPTY_WINDOW = 8,
    /**
     * An overflow needed a backoff while the loss scale was already at min_scale.
     */
    GRADACC_STATUS_SCALE_AT_MINIMUM = 9,
    /**
     * The requested backend (CUDA, NCCL, MPI) is not in this build or not on this machine.
     */
    GRADACC_STATUS_BACKEND_UNAVAILABLE = 10,
    /**
     * The communicator failed.
     */
    GRADACC_STATUS_COMM_FAILURE = 11,
    /**
     * Another rank's call failed, so this rank stopped the collective too (nothing was reduced).
     */
    GRADACC_STATUS_PEER_FAILURE = 12,
    /**
     * Saved state bytes are corrupt, truncated, foreign, or of an unsupported version.
     */
    GRADACC_STATUS_CORRUPT_STATE = 13,
    /**
     * An allocation failed.
     */
    GRADACC_STATUS_OUT_OF_MEMORY = 14,
    /**
     * An internal error (a bug in gradacc); the message says where.
     */
    GRADACC_STATUS_INTERNAL = 15,
    /**
     * The CUDA driver reported an error (a failed launch or copy, an invalid device address, a
     * device that fell off the bus); the message carries the driver's own text.
     */
    GRADACC_STATUS_DEVICE_FAILURE = 16,
    /**
     * A collective did not complete within the communicator's timeout (gradacc_comm_set_timeout);
     * the communicator was aborted, and the message names the phase and how long it waited.
     */
    GRADACC_STATUS_TIMEOUT = 17,
} gradacc_status_t;

/**
 * A gradient accumulator (opaque). Create with gradacc_accumulator_create, free with
 * gradacc_accumulator_destroy.
 */
typedef struct gradacc_accumulator_t gradacc_accumulator_t;

/**
 * One rank's endpoint of a data-parallel group (opaque). Free with gradacc_comm_destroy.
 */
typedef struct gradacc_comm_t gradacc_comm_t;

/**
 * A mesh's shape (opaque), for frameworks without their own parallel state: each rank's
 * coordinates and groups in Megatron-Core's rank order or any other. Create with
 * gradacc_mesh_shape_create, free with gradacc_mesh_shape_destroy.
 */
typedef struct gradacc_mesh_shape_t gradacc_mesh_shape_t;

/**
 * One boundary over a job's accumulators (opaque): the world communicator and this rank's place
 * on the data axes. Create with gradacc_mesh_create, free with gradacc_mesh_destroy.
 */
typedef struct gradacc_mesh_t gradacc_mesh_t;

/**
 * FP32 master weights and AdamW or SGD state for an accumulator's tensors (opaque). Create with
 * gradacc_optimizer_create, free with gradacc_optimizer_destroy.
 */
typedef struct gradacc_optimizer_t gradacc_optimizer_t;

/**
 * A dynamic loss scaler (opaque). Create with gradacc_scaler_create, free with
 * gradacc_scaler_destroy.
 */
typedef struct gradacc_scaler_t gradacc_scaler_t;

/**
 * How the caller reduced its loss over the `count` items of a micro-batch.
 */
typedef int32_t gradacc_loss_reduction_t;

/**
 * What the summed gradient is divided by at the boundary.
 */
typedef int32_t gradacc_normalize_t;

/**
 * What each rank holds of the reduced gradient after the boundary.
 */
typedef int32_t gradacc_sharding_t;

/**
 * Element type of a model gradient buffer.
 */
typedef int32_t gradacc_dtype_t;

/**
 * What a non-finite gradient value costs the window (the Rust API's `Overflow`, whose doc is the
 * contract; docs/overflow.md states it for every language).
 */
typedef int32_t gradacc_overflow_t;

/**
 * Accumulator configuration. Initialise with gradacc_accumulator_config_default, then change
 * fields.
 */
typedef struct gradacc_accumulator_config_t {
    /**
     * sizeof(gradacc_accumulator_config_t); set by gradacc_accumulator_config_default.
     */
    size_t struct_size;
    /**
     * GRADACC_LOSS_REDUCTION_* (default MEAN).
     */
    gradacc_loss_reduction_t loss_reduction;
    /**
     * GRADACC_NORMALIZE_* (default BY_COUNT).
     */
    gradacc_normalize_t normalize;
    /**
     * Clip the boundary gradient's global L2 norm to this value; 0 disables clipping (default 0).
     */
    float max_grad_norm;
    /**
     * Target elements per communication bucket; a bucket holds whole tensors (default 4194304).
     */
    uint64_t bucket_numel;
    /**
     * Threads one kernel call may use on large tensors; results are bitwise identical for any
     * value (default 1).
     */
    uint32_t threads;
    /**
     * Padding, ignored (0.1's struct ended at `threads`, padded to 40 bytes: a field here would
     * read an older caller's padding).
     */
    uint32_t reserved;
    /**
     * GRADACC_SHARDING_* (default NONE).
     */
    gradacc_sharding_t sharding;
    /**
     * Ranks the gradient is sharded over: the size of the communicator given to sync (or, for
     * GRADACC_SHARDING_ACCUMULATE, to gradacc_accumulator_create_sharded) (default 1; must be 1
     * unless sharding is on; at most 65536).
     */
    uint32_t shard_count;
    /**
     * This rank's shard, in 0..shard_count: its rank on that communicator (default 0).
     */
    uint32_t shard_rank;
    /**
     * What the boundary's reductions send: GRADACC_DTYPE_F32 (default), or GRADACC_DTYPE_BF16,
     * half the bytes: each rank rounds its contribution to bf16 once, and the receiver sums the
     * contributions in FP32, so over W ranks the error is at most (2^-8 + (W-1) * 2^-24) of the
     * magnitude (the sum of the contributions' absolute values): the bf16 rounding's share does
     * not grow with the number of ranks (docs/sharding.md).
     */
    gradacc_dtype_t wire_dtype;
    /**
     * GRADACC_OVERFLOW_* (default SKIP_STEP).
     */
    gradacc_overflow_t overflow;
    /**
     * 1: every boundary also measures each tensor (gradacc_accumulator_tensor_stats); 0: off
     * (default). Every device and sharding policy.
     */
    uint32_t tensor_stats;
} gradacc_accumulator_config_t;

/**
 * One tensor of an accumulator: element count and the dtype its gradients arrive in.
 */
typedef struct gradacc_tensor_desc_t {
    /**
     * Number of elements (at least 1).
     */
    uint64_t numel;
    /**
     * GRADACC_DTYPE_*.
     */
    gradacc_dtype_t dtype;
} gradacc_tensor_desc_t;

/**
 * Kind of device an object is bound to.
 */
typedef int32_t gradacc_device_kind_t;

/**
 * The device an object is bound to. Pass NULL where a `const gradacc_device_t*` is taken to
 * mean the CPU.
 */
typedef struct gradacc_device_t {
    /**
     * GRADACC_DEVICE_CPU or GRADACC_DEVICE_CUDA.
     */
    gradacc_device_kind_t kind;
    /**
     * CUDA device ordinal; 0 for the CPU.
     */
    int32_t ordinal;
    /**
     * The caller's `cudaStream_t` / `CUstream` (borrowed, never destroyed; it must outlive every
     * object created on it, whose device memory is freed on it); NULL for the CPU. On CUDA, NULL
     * or `CU_STREAM_LEGACY` is the legacy default stream; `CU_STREAM_PER_THREAD` (0x2) is refused
     * (it names another stream on every thread).
     */
    void *stream;
} gradacc_device_t;

/**
 * One gradient with what it holds: `numel` values of `dtype` at `data` (a host address for a
 * CPU accumulator, a device address for a CUDA one). What the typed adds
 * (gradacc_accumulator_add_grads, gradacc_accumulator_add_tensor_grad) take, so that the library
 * can refuse a buffer of another element type or length, which a `void *` does not tell it.
 */
typedef struct gradacc_grad_t {
    const void *data;
    /**
     * Elements at `data`.
     */
    uint64_t numel;
    /**
     * GRADACC_DTYPE_* of the elements.
     */
    gradacc_dtype_t dtype;
} gradacc_grad_t;

/**
 * Where a window first went non-finite (gradacc_sync_info_t's `overflow_at`).
 */
typedef int32_t gradacc_overflow_at_t;

/**
 * What the boundary reports; identical on every rank. Set struct_size before the call
 * (`gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;` in C).
 */
typedef struct gradacc_sync_info_t {
    /**
     * sizeof(gradacc_sync_info_t), set by the caller: the library writes only the fields this size
     * covers (an older header's size is accepted), and never changes struct_size itself.
     */
    size_t struct_size;
    /**
     * Some rank saw an inf or NaN in this window, or the reduced gradient holds one (finite
     * windows whose sum overflowed): skip the optimizer step.
     */
    bool found_inf;
    /**
     * Items added over all micro-batches and ranks.
     */
    uint64_t total_count;
    /**
     * Micro-batches added over all ranks.
     */
    uint64_t microbatches;
    /**
     * Global L2 norm of the normalised gradient, before clipping.
     */
    double grad_norm;
    /**
     * Factor clipping applied (1 when clipping is off or not needed).
     */
    double clip_coef;
    /**
     * Micro-batches dropped over all ranks (GRADACC_OVERFLOW_DROP_MICROBATCH); their items and
     * micro-batches are not in total_count and microbatches.
     */
    uint64_t dropped_microbatches;
    /**
     * GRADACC_OVERFLOW_AT_*: where the window first went non-finite, in the order micro-batch,
     * then tensor, then rank; the same on every rank. NONE with found_inf set when a rank's
     * place is unknown (GRADACC_OVERFLOW_AT_NONE says when), whatever the other ranks located.
     */
    gradacc_overflow_at_t overflow_at;
    /**
     * With GRADACC_OVERFLOW_AT_GRADIENT: the rank (at a hybrid boundary, replica rank times the
     * shard group's size plus shard rank), its window's micro-batch (from 0, dropped ones
     * included; after gradacc_accumulator_load_window, see there) and the tensor index; 0
     * otherwise.
     */
    uint64_t overflow_rank;
    uint64_t overflow_microbatch;
    uint64_t overflow_tensor;
} gradacc_sync_info_t;

/**
 * A backend gradacc may be built with: a communicator transport or a device kind.
 */
typedef int32_t gradacc_backend_t;

/**
 * MPI communicator options. Initialise with gradacc_mpi_config_default, then change fields.
 * Options are appended over time; an older struct_size gives the missing ones their defaults.
 */
typedef struct gradacc_mpi_config_t {
    /**
     * sizeof(gradacc_mpi_config_t); set by gradacc_mpi_config_default.
     */
    size_t struct_size;
    /**
     * 1: when every rank is on one host, move the boundary's data through memory the ranks
     * share (a few MB, left nowhere after a crash) instead of MPI messages; MPI still carries the
     * control reduction and the block sums. Ranks on several hosts, or where the memory cannot
     * be shared, use MPI either way. 0: MPI only. Default 1.
     */
    uint32_t shared_memory;
} gradacc_mpi_config_t;

/**
 * An NCCL unique id: rank 0 makes it with gradacc_nccl_unique_id and sends its bytes to
 * every rank (MPI_Bcast, a file, a TCP store) before they call gradacc_comm_create_nccl.
 */
typedef struct gradacc_nccl_unique_id_t {
    /**
     * Opaque bytes (NCCL_UNIQUE_ID_BYTES).
     */
    uint8_t internal[128];
} gradacc_nccl_unique_id_t;

/**
 * A message's level, or the least severe level a callback receives.
 */
typedef int32_t gradacc_log_level_t;

/**
 * A log callback: `message` (NUL-terminated, valid only during the call) at `level`, with the
 * `user` pointer given to gradacc_set_log_callback. It is called on the thread whose call
 * produced the message, possibly from several threads at once, and must not call
 * gradacc_set_log_callback.
 */
typedef void (*gradacc_log_fn)(void *user, gradacc_log_level_t level, const char *message);

/**
 * A tensor whose values several model-parallel ranks hold alike (a layer norm replicated over
 * tensor-parallel ranks, a tied embedding on the first and the last pipeline stage): it enters
 * the global norm once, from one copy.
 */
typedef struct gradacc_replicated_t {
    /**
     * The tensor's index in its accumulator.
     */
    uint32_t tensor;
    /**
     * How many model-parallel ranks hold it at one data-parallel rank (at least 1): the step
     * checks that exactly that many declare it.
     */
    uint32_t copies;
    /**
     * The same on every copy and different for different tensors (a hash of the parameter's
     * name, say, with the tensor-parallel rank for a tied, vocabulary-sharded embedding).
     */
    uint64_t key;
} gradacc_replicated_t;

/**
 * One accumulator of a mesh step and the group it reduces over. Initialise with
 * GRADACC_MESH_PART_INIT (C) or set struct_size to sizeof(gradacc_mesh_part_t), then fill in
 * the fields; every element of an array of parts has the same struct_size (the array's stride).
 */
typedef struct gradacc_mesh_part_t {
    /**
     * sizeof(gradacc_mesh_part_t).
     */
    size_t struct_size;
    /**
     * The accumulator (borrowed for the call), on the CPU or a CUDA device, created with
     * max_grad_norm 0 (the mesh clips), and with tensor_stats 1 when it declares replicated
     * tensors.
     */
    struct gradacc_accumulator_t *accumulator;
    /**
     * Its group, as gradacc_accumulator_sync's `comm` (an NCCL communicator on the
     * accumulator's device for a CUDA one): NULL when it is alone, or for a sharded
     * accumulation's own communicator.
     */
    struct gradacc_comm_t *comm;
    /**
     * A hybrid boundary's replica group, as gradacc_accumulator_sync_hybrid's `replica_comm`
     * (`comm` is then the shard group); NULL otherwise.
     */
    struct gradacc_comm_t *replicas;
    /**
     * Its replicated tensors, `replicated_count` of them (NULL when the count is 0).
     */
    const struct gradacc_replicated_t *replicated;
    size_t replicated_count;
} gradacc_mesh_part_t;

/**
 * An optimizer's update rule.
 */
typedef int32_t gradacc_optimizer_algorithm_t;

/**
 * How the FP32 master weights become the model's 16-bit weights.
 */
typedef int32_t gradacc_rounding_t;

/**
 * How the FP32 master weights are kept between steps.
 */
typedef int32_t gradacc_masters_t;

/**
 * How AdamW's moments (SGD's momentum buffer) are kept between steps.
 */
typedef int32_t gradacc_moments_t;

/**
 * What the step writes for a tensor's weights (docs/optimizer.md, "FP8 weights on the
 * all-gather").
 */
typedef int32_t gradacc_weight_format_t;

/**
 * Optimizer configuration. Initialise with gradacc_optimizer_config_default, then change fields.
 */
typedef struct gradacc_optimizer_config_t {
    /**
     * sizeof(gradacc_optimizer_config_t); set by gradacc_optimizer_config_default.
     */
    size_t struct_size;
    /**
     * GRADACC_OPTIMIZER_* (default ADAMW).
     */
    gradacc_optimizer_algorithm_t algorithm;
    /**
     * Learning rate of the first step (default 1e-3); gradacc_optimizer_set_lr changes it.
     */
    float lr;
    /**
     * AdamW's betas (default 0.9 and 0.999) and eps (default 1e-8).
     */
    float beta1;
    float beta2;
    float eps;
    /**
     * Weight decay: decoupled for AdamW, L2 for SGD (default 0.01, AdamW's; set 0 for none).
     */
    float weight_decay;
    /**
     * SGD's momentum (default 0: none), dampening (default 0) and Nesterov (default false).
     */
    float momentum;
    float dampening;
    bool nesterov;
    /**
     * GRADACC_ROUNDING_* (default NEAREST_EVEN).
     */
    gradacc_rounding_t rounding;
    /**
     * The seed of stochastic rounding (default 0).
     */
    uint64_t seed;
    /**
     * GRADACC_MASTERS_* (default FP32; a caller built before this field gets FP32).
     */
    gradacc_masters_t masters;
    /**
     * GRADACC_MOMENTS_* (default FP32; a caller built before this field gets FP32).
     */
    gradacc_moments_t moments;
    /**
     * The seed of the bf16 moments' stochastic rounding (default 0).
     */
    uint64_t moment_seed;
    /**
     * NULL (the default): every tensor's weights in its model dtype. Else `n` entries (the
     * creation's tensor count), GRADACC_WEIGHTS_*, read during the creation only: tensor i's
     * weights are what entry i says, and gradacc_optimizer_step_scaled takes their scales.
     */
    const gradacc_weight_format_t *weight_formats;
} gradacc_optimizer_config_t;

/**
 * One tensor's options (PyTorch's parameter groups, per tensor).
 */
typedef struct gradacc_tensor_group_t {
    /**
     * Whether weight decay applies to the tensor (biases and norms commonly take none).
     */
    bool weight_decay;
    /**
     * The tensor's learning rate is the optimizer's times this (finite, >= 0).
     */
    float lr_scale;
} gradacc_tensor_group_t;

/**
 * Scaler configuration. Initialise with gradacc_scaler_config_default, then change fields.
 */
typedef struct gradacc_scaler_config_t {
    /**
     * sizeof(gradacc_scaler_config_t); set by gradacc_scaler_config_default.
     */
    size_t struct_size;
    /**
     * Scale at creation (default 65536).
     */
    float init_scale;
    /**
     * Factor applied after growth_interval consecutive finite steps (default 2).
     */
    float growth_factor;
    /**
     * Factor applied on a backoff (default 0.5).
     */
    float backoff_factor;
    /**
     * Consecutive finite steps before the scale grows (default 2000).
     */
    uint32_t growth_interval;
    /**
     * Overflows tolerated before a backoff: 1 backs off on every overflow as PyTorch does
     * (default); n > 1 backs off on the n-th overflow since the last growth, as Megatron-Core.
     */
    uint32_t hysteresis;
    /**
     * Also refill the hysteresis tracker after every finite step, as DeepSpeed's option of this
     * name (default false).
     */
    bool consecutive_hysteresis;
    /**
     * Lowest scale (default 1). An overflow that needs a backoff at this scale makes
     * gradacc_scaler_update fail with GRADACC_STATUS_SCALE_AT_MINIMUM.
     */
    float min_scale;
    /**
     * Highest scale (default INFINITY: grow while the grown scale is finite, as PyTorch).
     */
    float max_scale;
    /**
     * false keeps the scale fixed at init_scale (default true).
     */
    bool dynamic;
} gradacc_scaler_config_t;

/**
 * Statistics of a scaler since creation or since its state was loaded. Set struct_size before
 * the call (`gradacc_scaler_stats_t st = GRADACC_SCALER_STATS_INIT;` in C).
 */
typedef struct gradacc_scaler_stats_t {
    /**
     * sizeof(gradacc_scaler_stats_t), set by the caller: the library writes only the fields this
     * size covers (an older header's size is accepted), and never changes struct_size itself.
     */
    size_t struct_size;
    /**
     * Optimizer steps seen by gradacc_scaler_update.
     */
    uint64_t steps;
    /**
     * Steps skipped because of an overflow.
     */
    uint64_t skipped_steps;
    /**
     * Times the scale grew.
     */
    uint64_t growths;
    /**
     * Times the scale backed off.
     */
    uint64_t backoffs;
} gradacc_scaler_stats_t;

/**
 * The loss is the mean over the micro-batch's items (default).
 */
#define GRADACC_LOSS_REDUCTION_MEAN 0

/**
 * The loss is the sum over the micro-batch's items.
 */
#define GRADACC_LOSS_REDUCTION_SUM 1

/**
 * The global item count over micro-batches and ranks (default): the gradient of the mean loss
 * over every item of the effective batch. Mean-reduced micro-batches are weighted by their count.
 */
#define GRADACC_NORMALIZE_BY_COUNT 0

/**
 * The global number of micro-batches (`loss / steps` with a DDP mean): a mean of means.
 */
#define GRADACC_NORMALIZE_BY_MICROBATCHES 1

/**
 * The number of ranks: sum over micro-batches, mean over ranks (DDP with no_sync). A window that
 * merged saved windows counts the ranks that produced them (gradacc_accumulator_merge_window).
 */
#define GRADACC_NORMALIZE_BY_WORLD 2

/**
 * No division: the plain sum.
 */
#define GRADACC_NORMALIZE_NONE 3

/**
 * Every rank holds the whole reduced gradient: an all-reduce, as DDP (default).
 */
#define GRADACC_SHARDING_NONE 0

/**
 * Rank `shard_rank` of `shard_count` holds only its shard of the reduced gradient, a contiguous
 * range of the flat layout (gradacc_accumulator_shard): a reduce-scatter, half an all-reduce's
 * traffic, as a distributed optimizer (ZeRO-1) needs. The window accumulates the whole gradient;
 * the norm and clipping coefficient are the whole gradient's, the same on every rank; the shard
 * holds the bits an all-reduce would leave there (on host communicators; on real NCCL, whose
 * collectives may order their sums differently, within the last bits). Sync on a communicator
 * of `shard_count` ranks on which this is rank `shard_rank`, on the CPU or CUDA, or with
 * gradacc_accumulator_sync_hybrid over a shard group and a replica group (HSDP).
 */
#define GRADACC_SHARDING_REDUCE_SCATTER 1

/**
 * Sharded accumulation (ZeRO-2): rank `shard_rank` of `shard_count` holds only its shard of the
 * FP32 gradient, and every micro-batch is reduce-scattered as it is added. Create it with
 * gradacc_accumulator_create_sharded. What each rank holds, the calls every rank makes, how a
 * failure ends and what the result equals: docs/sharding.md, "Sharded accumulation (ZeRO-2)".
 */
#define GRADACC_SHARDING_ACCUMULATE 2

/**
 * The window's step is skipped on every rank, as PyTorch's GradScaler does (default).
 */
#define GRADACC_OVERFLOW_SKIP_STEP 0

/**
 * Only the micro-batch that held it is dropped, on the rank that fed it; the boundary normalises
 * by what every rank kept, and the step is skipped only when nothing was kept or the sum
 * overflows. CPU and CUDA accumulators, every sharding policy; on CUDA each
 * gradacc_accumulator_add and gradacc_accumulator_end_microbatch waits for the stream
 * (docs/overflow.md). Update the scaler with gradacc_scaler_update: a drop backs the scale off.
 * A window that drops every micro-batch on every rank is one skipped step: found_inf 1,
 * total_count and microbatches 0, grad_norm 0, clip_coef 1, the master +0.0 throughout; the
 * scaler's update counts one overflow however many were dropped (GRADACC_STATUS_SCALE_AT_MINIMUM
 * at min_scale), and gradacc_optimizer_step changes nothing (docs/overflow.md, "A window that
 * drops everything").
 */
#define GRADACC_OVERFLOW_DROP_MICROBATCH 1

/**
 * Nowhere: the window stayed finite, or found_inf is set and the first place is unknown (a
 * rank's window went non-finite where nothing recorded it, which may come before any other
 * place, so no rank names one). Such places: a window restored by gradacc_accumulator_load_window or
 * gradacc_accumulator_merge_window that holds a non-finite value (every device and policy);
 * on CUDA under GRADACC_OVERFLOW_SKIP_STEP, every overflowing window; on CUDA under
 * GRADACC_OVERFLOW_DROP_MICROBATCH, a kept micro-batch whose sum overflowed a whole master
 * (the CPU locates that one: GRADIENT). A shard's overflowing sum under sharded accumulation is
 * REDUCTION on both devices.
 */
#define GRADACC_OVERFLOW_AT_NONE 0

/**
 * A gradient: `overflow_rank`, `overflow_microbatch` and `overflow_tensor` say where.
 */
#define GRADACC_OVERFLOW_AT_GRADIENT 1

/**
 * Every rank's window was finite; their sum overflowed.
 */
#define GRADACC_OVERFLOW_AT_REDUCTION 2

/**
 * The in-process communicator (gradacc_comm_create_local); in every build.
 */
#define GRADACC_BACKEND_LOCAL 0

/**
 * The MPI communicator (gradacc_comm_create_mpi); in builds with the `mpi` feature
 * (CMake option GRADACC_WITH_MPI).
 */
#define GRADACC_BACKEND_MPI 1

/**
 * The NCCL communicator (gradacc_comm_create_nccl): in every build; available where the CUDA
 * driver and NCCL (GRADACC_NCCL_LIBRARY, else libnccl.so.2 or libnccl.so) load.
 */
#define GRADACC_BACKEND_NCCL 2

/**
 * CUDA devices (GRADACC_DEVICE_CUDA): in every build; available where the CUDA driver sees a
 * device and NVRTC (GRADACC_NVRTC_LIBRARY, else libnvrtc.so.13, .so.12 or .so) loads.
 */
#define GRADACC_BACKEND_CUDA 3

/**
 * No messages.
 */
#define GRADACC_LOG_OFF 0

/**
 * A call failed in a way its status alone does not tell.
 */
#define GRADACC_LOG_ERROR 1

/**
 * A setting was not honoured (an unknown or unsupported GRADACC_CPU_ISA).
 */
#define GRADACC_LOG_WARN 2

/**
 * What a training run wants to know: a skipped step and the loss scale it backed off to, a
 * dropped micro-batch, a CUDA library loaded (and from where) or not.
 */
#define GRADACC_LOG_INFO 3

/**
 * The rest: a grown loss scale, each library candidate that did not load, the SIMD path chosen.
 */
#define GRADACC_LOG_DEBUG 4

/**
 * `torch.optim.AdamW` (amsgrad off): beta1, beta2, eps, weight_decay.
 */
#define GRADACC_OPTIMIZER_ADAMW 0

/**
 * `torch.optim.SGD`: momentum, dampening, nesterov, weight_decay.
 */
#define GRADACC_OPTIMIZER_SGD 1

/**
 * Round to nearest, ties to even.
 */
#define GRADACC_ROUNDING_NEAREST_EVEN 0

/**
 * Stochastic rounding keyed by `seed`, the step and the element (the same on every rank).
 */
#define GRADACC_ROUNDING_STOCHASTIC 1

/**
 * FP32 masters: 4 bytes per parameter beside the model's weight.
 */
#define GRADACC_MASTERS_FP32 0

/**
 * The master is the model's bf16 weight plus a 16-bit remainder the optimizer keeps: 2 bytes
 * per parameter, the FP32 master exactly. Only for bf16 weights rounded to nearest, without
 * adopted masters (else INVALID_ARGUMENT). The weight rounds ties away from zero instead of to
 * even (docs/optimizer.md, "Smaller state"); only the optimizer may write the weights.
 */
#define GRADACC_MASTERS_BF16_REMAINDER 1

/**
 * No masters: each step reads the master from the model's weight, steps it in f32 and writes it
 * back with the weights' rounding: 0 bytes per parameter. 16-bit weights need
 * GRADACC_ROUNDING_STOCHASTIC (else INVALID_ARGUMENT: an update below half a 16-bit spacing
 * would be lost); over f32 weights it is FP32 masters bit for bit. Not with adopted masters;
 * only the optimizer may write the weights (docs/optimizer.md, "Smaller state").
 */
#define GRADACC_MASTERS_NONE 2

/**
 * FP32 moments: 4 bytes per moment.
 */
#define GRADACC_MOMENTS_FP32 0

/**
 * bf16 moments, 2 bytes each, rounded stochastically keyed by `moment_seed`, the step and the
 * element (the same on every rank and shard count).
 */
#define GRADACC_MOMENTS_BF16 1

/**
 * 8-bit blockwise moments: 1 byte each plus one f32 scale per block of 64 elements of a tensor,
 * coded as the nearest entry of a dynamic quantisation map times the block's largest magnitude.
 * CPU optimizers only (CUDA refuses them with GRADACC_STATUS_INVALID_ARGUMENT).
 */
#define GRADACC_MOMENTS_INT8_BLOCKWISE 2

/**
 * The model's dtype given at creation (f32, f16 or bf16). The default.
 */
#define GRADACC_WEIGHTS_MODEL 0

/**
 * E4M3 codes (`float8_e4m3fn`) with one f32 scale per tensor: `scale = 448 / max(amax,
 * 1e-12)` from the amax of the tensor's new FP32 masters over all ranks, each code
 * E4M3(clamp(master * scale, ±448)) rounded to nearest even; the weight is `code / scale`. Only
 * under a sharded boundary (GRADACC_SHARDING_REDUCE_SCATTER, _ACCUMULATE), with FP32 masters,
 * on the CPU.
 */
#define GRADACC_WEIGHTS_E4M3_TENSORWISE 1

/**
 * MXFP8: E4M3 codes of `master / 2^e` (saturated at ±448, nearest even) with one E8M0 byte
 * `e + 127` per block of 32 elements, `e = floor(log2(block amax)) - 8` clamped to -127..=127;
 * the weight is `code * 2^e`. As GRADACC_WEIGHTS_E4M3_TENSORWISE, where it may be used.
 */
#define GRADACC_WEIGHTS_MXFP8 2

/**
 * IEEE 754 binary32.
 */
#define GRADACC_DTYPE_F32 0

/**
 * IEEE 754 binary16 (`_Float16`, `__half`, numpy `float16`).
 */
#define GRADACC_DTYPE_F16 1

/**
 * bfloat16 (`__nv_bfloat16`, the upper 16 bits of an f32).
 */
#define GRADACC_DTYPE_BF16 2

/**
 * Host memory; buffers are host pointers.
 */
#define GRADACC_DEVICE_CPU 0

/**
 * A CUDA device; buffers are device pointers and work is ordered on the given stream.
 */
#define GRADACC_DEVICE_CUDA 1

#ifdef __cplusplus
extern "C" {
#endif // __cplusplus

/**
 * Fills `*out` with the default accumulator configuration (and its struct_size).
 *
 * Thread safety: any thread.
 */
GRADACC_API
enum gradacc_status_t gradacc_accumulator_config_default(struct gradacc_accumulator_config_t *out);

/**
 * Creates an accumulator over `n` tensors, owning a zero-initialised FP32 master buffer laid out
 * tensor after tensor, each tensor starting at a multiple of GRADACC_MASTER_ALIGN bytes (the
 * buffer's start included), with zeros between. `config` NULL means the defaults; `device`
 * NULL means the CPU. On a CUDA device the master is allocated in device memory on the device's
 * stream (stream-ordered), and every later call on the accumulator is ordered on that stream;
 * the first CUDA object on a device compiles the kernels with NVRTC (tens of milliseconds).
 *
 * Ownership: `*out` is the caller's; free it with gradacc_accumulator_destroy.
 * Thread safety: any thread. See each function for what may run concurrently on the result.
 */
GRADACC_API
enum gradacc_status_t gradacc_accumulator_create(const struct gradacc_accumulator_config_t *config,
                                                 const struct gradacc_tensor_desc_t *tensors,
                                                 size_t n,
                                                 const struct gradacc_device_t *device,
                                                 struct gradacc_accumulator_t **out);

/**
 * Like gradacc_accumulator_create, but adopts the caller's FP32 buffer `master` of exactly
 * `master_numel` elements as the master buffer, e.g. a framework's own contiguous gradient
 * buffer: the tensors with the padding that starts each at a multiple of GRADACC_MASTER_ALIGN
 * bytes (gradacc_accumulator_master_numel gives the count; tensor i starts at
 * gradacc_accumulator_offset). Its contents are ignored until written; the padding is zeroed here
 * (stream-ordered on CUDA) and must stay untouched. A `master` aligned to GRADACC_MASTER_ALIGN
 * bytes makes every tensor's master as aligned.
 *
 * Ownership: `*out` is the caller's; free it with gradacc_accumulator_destroy. `master` stays the
 * caller's and must outlive the accumulator; gradacc never frees it.
 * Thread safety: as gradacc_accumulator_create.
 */
GRADACC_API
enum gradacc_status_t gradacc_accumulator_create_with_buffer(const struct gradacc_accumulator_config_t *config,
                                                             const struct gradacc_tensor_desc_t *tensors,
                                                             size_t n,
                                                             const struct gradacc_device_t *device,
                                                             float *master,
                                                             size_t master_numel,
                                                             struct gradacc_accumulator_t **out);

/**
 * Creates a sharded accumulation (GRADACC_SHARDING_ACCUMULATE, whose contract is in
 * docs/sharding.md, "Sharded accumulation (ZeRO-2)"). `config`->sharding must be
 * GRADACC_SHARDING_ACCUMULATE, and `comm` a communicator of `config`->shard_count ranks on
 * which this is rank `config`->shard_rank: a host communicator (in-process or MPI) when `device`
 * is NULL or the CPU, an NCCL communicator on the same device for CUDA. Fails, writing nothing,
 * with GRADACC_STATUS_INVALID_ARGUMENT for another policy, or a shard count or rank that is not
 * `comm`'s size and rank; GRADACC_STATUS_DEVICE_MISMATCH for a communicator of another kind or
 * device; GRADACC_STATUS_NULL_ARGUMENT or GRADACC_STATUS_INVALID_HANDLE for a NULL or dead `comm`.
 *
 * From then on gradacc_accumulator_add, gradacc_accumulator_begin_microbatch /
 * gradacc_accumulator_add_tensor / gradacc_accumulator_end_microbatch,
 * gradacc_accumulator_reset inside a micro-batch, and gradacc_accumulator_sync (with `comm` or
 * NULL) are collectives over `comm`. gradacc_accumulator_shard gives what the accumulator holds;
 * gradacc_accumulator_master covers only tensors inside it.
 *
 * Ownership: `*out` is the caller's; free it with gradacc_accumulator_destroy. The accumulator
 * holds its own reference to `comm`'s communicator: destroying the handle `comm` releases the
 * handle only, and the group stays usable through the accumulator (for MPI, destroy the
 * accumulator before MPI_Finalize).
 * Thread safety: any thread.
 */
GRADACC_API
enum gradacc_status_t gradacc_accumulator_create_sharded(const struct gradacc_accumulator_config_t *config,
                                                         const struct gradacc_tensor_desc_t *tensors,
                                                         size_t n,
                                                         const struct gradacc_device_t *device,
                                                         struct gradacc_comm_t *comm,
                                                         struct gradacc_accumulator_t **out);

/**
 * Destroys an accumulator. NULL is accepted and does nothing; must not be called twice on one
 * handle (a second call is detected and reported as GRADACC_STATUS_INVALID_HANDLE). Pointers from
 * gradacc_accumulator_master become invalid.
 *
 * Fails with GRADACC_STATUS_WRONG_STATE, leaving the accumulator usable, while a sync of it runs on
 * another thread: abort or destroy the communicator it waits on first.
 *
 * Thread safety: any thread, once no other call uses the accumulator.
 */
GRADACC_API enum gradacc_status_t gradacc_accumulator_destroy(struct gradacc_accumulator_t *acc);

/**
 * Adds one micro-batch of `count` items (a window holds at most 2^47 items per rank, so sums
 * over ranks stay exact): `grads[i]` is tensor i's gradient (numel and dtype as
 * declared), produced from a loss scaled by `scaler`'s current scale. One fused pass per tensor
 * converts to f32, unscales (and weights by `count` for a mean-reduced loss normalised by count),
 * flags non-finite values, and accumulates into the master (the first micro-batch of a window
 * overwrites it).
 *
 * Fails without changing anything on: a tensor count `n` other than the accumulator's
 * (GRADACC_STATUS_SIZE_MISMATCH); a NULL `grads` or `grads[i]` (GRADACC_STATUS_NULL_ARGUMENT);
 * a `grads[i]` not aligned for its tensor's dtype, or whose declared extent (the tensor's numel
 * elements of its dtype from `grads[i]`) shares any byte with the master, its own tensor's
 * master included (GRADACC_STATUS_INVALID_ARGUMENT); a `count` of 0 for a mean-reduced loss or
 * past the window's limit (GRADACC_STATUS_INVALID_ARGUMENT); a call inside an open micro-batch
 * (GRADACC_STATUS_WRONG_STATE); a scaler on another device (GRADACC_STATUS_DEVICE_MISMATCH).
 * What it cannot check: behind a `void *` the C ABI sees neither a buffer's element type nor
 * its length. Each `grads[i]` is read as its tensor's declared numel values of its declared
 * dtype, so a buffer of another element type is read as that dtype and a shorter one past its
 * end: both are the caller's to get right. gradacc_accumulator_add_grads takes each gradient with
 * its dtype and length (gradacc_grad_t) and refuses a mismatch; so do the C++ wrapper's typed
 * forms (gradacc::Accumulator::add over gradacc::Grad, add_tensor over spans) and the Go,
 * Python, Julia and Rust bindings for the typed buffers they take, not for raw addresses.
 *
 * On CUDA, `grads[i]` are device addresses; one kernel launch adds every tensor; the call
 * returns once the work is enqueued on the accumulator's stream (the buffers must stay valid
 * until the stream has run it). The scale is read on the device: no host synchronisation.
 *
 * Thread safety: serialised with every other call on `acc`; buffers are read during the call only
 * (on CUDA: by the stream's work).
 */
GRADACC_API
enum gradacc_status_t gradacc_accumulator_add(struct gradacc_accumulator_t *acc,
                                              const struct gradacc_scaler_t *scaler,
                                              const void *const *grads,
                                              size_t n,
                                              uint64_t count);

/**
 * gradacc_accumulator_add of the window's last micro-batch, which the boundary follows: on the
 * CPU, where the boundary only measures the sum (with clipping, or GRADACC_NORMALIZE_NONE), the
 * add also sums the norm's blocks of the master while each piece is in cache, so that a
 * boundary that reduces nothing between ranks (no communicator, or a group of one) needs no read
 * of its own: the report, the gradient and every step's bits are gradacc_accumulator_add's.
 * Anything that writes the master after it (another add, a tensor-by-tensor micro-batch, a
 * restore, an address taken with gradacc_accumulator_master or _shard) leaves the boundary to
 * measure for itself: a micro-batch wrongly called the last costs the saving, never the
 * result. Under GRADACC_SHARDING_ACCUMULATE and on CUDA it is gradacc_accumulator_add. Fails as
 * gradacc_accumulator_add does.
 *
 * Thread safety: as gradacc_accumulator_add.
 */
GRADACC_API
enum gradacc_status_t gradacc_accumulator_add_final(struct gradacc_accumulator_t *acc,
                                                    const struct gradacc_scaler_t *scaler,
                                                    const void *const *grads,
                                                    size_t n,
                                                    uint64_t count);

/**
 * gradacc_accumulator_add with each gradient's element type and length: `grads[i]` must hold
 * exactly tensor i's declared numel values of its declared dtype, else the call fails, adding
 * nothing, with GRADACC_STATUS_DTYPE_MISMATCH (another dtype) or GRADACC_STATUS_SIZE_MISMATCH
 * (another numel), naming the tensor and both values. Everything else is
 * gradacc_accumulator_add's, and so is what stays the caller's to get right: that `data` points
 * to that many values of that type.
 *
 * Thread safety: as gradacc_accumulator_add.
 */
GRADACC_API
enum gradacc_status_t gradacc_accumulator_add_grads(struct gradacc_accumulator_t *acc,
                                                    const struct gradacc_scaler_t *scaler,
                                                    const struct gradacc_grad_t *grads,
                                                    size_t n,
                                                    uint64_t count);

/**
 * Opens a micro-batch of `count` items whose gradients arrive tensor by tensor through
 * gradacc_accumulator_add_tensor (as a framework's backward hooks produce them).
 *
 * Thread safety: serialised with every other call on `acc`.
 */
GRADACC_API
enum gradacc_status_t gradacc_accumulator_begin_microbatch(struct gradacc_accumulator_t *acc,
                                                           uint64_t count);

/**
 * Opens the window's last micro-batch of `count` items, arriving tensor by tensor, and names the
 * communicator its boundary will use: on CUDA with NCCL, each bucket's all-reduce starts on a
 * communication stream as soon as every tensor of the bucket has arrived (one contribution
 * each; buckets start in reverse tensor order, as backward produces them), overlapping the rest
 * of the backward pass. gradacc_accumulator_sync with the same `comm` completes the boundary.
 * Every rank must do the same. On the CPU, and under GRADACC_OVERFLOW_DROP_MICROBATCH, it is
 * gradacc_accumulator_begin_microbatch.
 * The first call per communicator checks on the host that all ranks' layouts agree (it waits).
 *
 * Thread safety: serialised with every other call on `acc`.
 */
GRADACC_API
enum gradacc_status_t gradacc_accumulator_begin_final_microbatch(struct gradacc_accumulator_t *acc,
                                                                 uint64_t count,
                                                                 struct gradacc_comm_t *comm);

/**
 * Adds one contribution to tensor `index` of the open micro-batch: `numel` elements of the
 * tensor's declared dtype at `grad`. A tensor may receive several contributions (a chunked
 * backward); they are summed. Under GRADACC_SHARDING_ACCUMULATE each tensor takes one
 * contribution per micro-batch, and a call refused on any rank fails the micro-batch on every
 * rank at gradacc_accumulator_end_microbatch (docs/sharding.md).
 *
 * Fails without adding anything on: an `index` out of range (GRADACC_STATUS_INVALID_ARGUMENT);
 * a `numel` other than the tensor's declared one (GRADACC_STATUS_SIZE_MISMATCH); a NULL `grad`
 * (GRADACC_STATUS_NULL_ARGUMENT); a `grad` misaligned or overlapping the master, as in
 * gradacc_accumulator_add; no open micro-batch (GRADACC_STATUS_WRONG_STATE); a scaler on
 * another device. It cannot check that `grad` holds `numel` values of the tensor's dtype: as in
 * gradacc_accumulator_add, that is the caller's to get right; gradacc_accumulator_add_tensor_grad
 * takes the dtype too and checks it, and the C++ wrapper's span forms and the bindings check the
 * element type of the typed buffers they take.
 *
 * Thread safety: may run concurrently with other gradacc_accumulator_add_tensor calls on the same
 * accumulator from other threads (distinct tensors in parallel; one tensor's contributions are
 * serialised, and summed in the order they arrive, so contributions to one tensor from several
 * threads can round differently from run to run: for reproducible bits, give each tensor's
 * contributions from one thread); not concurrently with other calls on `acc`.
 */
GRADACC_API
enum gradacc_status_t gradacc_accumulator_add_tensor(struct gradacc_accumulator_t *acc,
                                                     const struct gradacc_scaler_t *scaler,
                                                     size_t index,
                                                     const void *grad,
                                                     size_t numel);

/**
 * gradacc_accumulator_add_tensor with the gradient's element type and length: `grad` must hold
 * exactly tensor `index`'s declared numel values of its declared dtype, else the call fails,
 * adding nothing, with GRADACC_STATUS_DTYPE_MISMATCH or GRADACC_STATUS_SIZE_MISMATCH, naming the
 * tensor and both values. Everything else is gradacc_accumulator_add_tensor's.
 *
 * Thread safety: as gradacc_accumulator_add_tensor.
 */
GRADACC_API
enum gradacc_status_t gradacc_accumulator_add_tensor_grad(struct gradacc_accumulator_t *acc,
                                                          const struct gradacc_scaler_t *scaler,
                                                          size_t index,
                                                          const struct gradacc_grad_t *grad);

/**
 * Closes the open micro-batch.
 *
 * Thread safety: serialised with every other call on `acc`; call it after every
 * gradacc_accumulator_add_tensor of the micro-batch has returned.
 */
GRADACC_API
enum gradacc_status_t gradacc_accumulator_end_microbatch(struct gradacc_accumulator_t *acc);

/**
 * The accumulation boundary; every rank of `comm`'s group calls it (`comm` NULL: one process).
 * The ranks agree on counts, overflow and layout first, then the FP32 master is summed bucket
 * by bucket, normalised (gradacc_normalize_t), measured and, if configured, clipped: every rank
 * ends with the same bits and the same `*out_info` (may be NULL). If any rank's call is invalid,
 * every rank fails and nothing is reduced; a window empty on every rank is EMPTY_WINDOW. A sync
 * right after a sync takes part with an empty window. On CUDA the work is enqueued on the
 * accumulator's stream and only a non-NULL `out_info` waits; see docs/cuda.md for NCCL's rules.
 * A sharded accumulation (GRADACC_SHARDING_ACCUMULATE) syncs over the communicator it was created
 * with: `comm` is that handle or NULL (another fails on every rank).
 *
 * Thread safety: serialised with every other call on `acc`; one call per rank, each on its
 * rank's thread.
 */
GRADACC_API
enum gradacc_status_t gradacc_accumulator_sync(struct gradacc_accumulator_t *acc,
                                               struct gradacc_comm_t *comm,
                                               struct gradacc_sync_info_t *out_info);

/**
 * gradacc_accumulator_sync for an optimizer that steps right after (gradacc_optimizer_step):
 * with clipping, the gradient in memory stays the sum before normalisation and clipping, whose
 * one factor the step applies inside its own pass, bitwise as after gradacc_accumulator_sync, and the
 * boundary saves a pass over the gradient. The addresses from gradacc_accumulator_master and
 * gradacc_accumulator_shard then hold that sum: a caller that reads the
 * reduced gradient itself syncs with gradacc_accumulator_sync. On CUDA it is
 * gradacc_accumulator_sync. Arguments, errors and `*out_info` (may be NULL) as
 * gradacc_accumulator_sync's, but the boundary's info is always read on the host (on CUDA the
 * call waits for the accumulator's stream).
 *
 * Thread safety: as gradacc_accumulator_sync.
 */
GRADACC_API
enum gradacc_status_t gradacc_accumulator_sync_for_step(struct gradacc_accumulator_t *acc,
                                                        struct gradacc_comm_t *comm,
                                                        struct gradacc_sync_info_t *out_info);

/**
 * The hybrid boundary (HSDP) of an accumulator created with GRADACC_SHARDING_REDUCE_SCATTER or
 * GRADACC_SHARDING_ACCUMULATE: the master is reduce-scattered over `shard_comm` (its shard group:
 * shard_count ranks, this one rank shard_rank; for ACCUMULATE, the communicator it was created
 * with, which reduced every micro-batch already), and each shard is then all-reduced over
 * `replica_comm`, the ranks holding
 * the same shard in the other shard groups (rank a*shard_count + i is shard i of shard group a
 * and replica a of replica group i, say). Every rank of both groups calls it. Counts, overflow
 * and layout are agreed over all ranks (the world is the product of the group sizes); the norm
 * is the whole gradient's; each shard is summed in its shard group in rank order, then over
 * the replicas in their rank order. Replica groups whose ranks hold different shards, or an
 * unsharded accumulator, fail on every rank with nothing reduced. Host communicators (in-process,
 * MPI) for a CPU accumulator; for a CUDA accumulator, two NCCL communicators on its device (the
 * first hybrid sync per pair of groups checks the grid's layouts, a host wait). `*out_info` may
 * be NULL.
 *
 * Thread safety: as gradacc_accumulator_sync.
 */
GRADACC_API
enum gradacc_status_t gradacc_accumulator_sync_hybrid(struct gradacc_accumulator_t *acc,
                                                      struct gradacc_comm_t *shard_comm,
                                                      struct gradacc_comm_t *replica_comm,
                                                      struct gradacc_sync_info_t *out_info);

/**
 * Writes a pointer to tensor `index`'s FP32 master gradient and its element count (a device
 * address on CUDA, whose contents are ready in the accumulator's stream order). The pointer
 * stays valid until the accumulator is destroyed; its contents are the boundary's result after
 * gradacc_accumulator_sync, and in progress otherwise. A sharded accumulation holds only its
 * shard: a tensor not wholly inside it is GRADACC_STATUS_INVALID_ARGUMENT (use
 * gradacc_accumulator_shard).
 *
 * Thread safety: any thread; reading through the pointer must not overlap calls that add.
 */
GRADACC_API
enum gradacc_status_t gradacc_accumulator_master(const struct gradacc_accumulator_t *acc,
                                                 size_t index,
                                                 float **out_data,
                                                 size_t *out_numel);

/**
 * This rank's shard of the master: `*out_offset` and `*out_numel` give its element range in the
 * flat layout (tensor after tensor, each at gradacc_accumulator_offset, zeros between), `*out_data` the address of its first element (a device
 * address on CUDA). Without sharding the shard is the whole master. Under
 * GRADACC_SHARDING_REDUCE_SCATTER, after a successful sync the range holds this rank's part of
 * the reduced, normalised (and clipped) gradient, for an optimizer that updates only its shard;
 * the rest of the master is unspecified until the next window's first micro-batch. Shards split
 * the layout into equal parts rounded up to whole blocks of 4096 elements; the last ones may be
 * shorter or empty (`*out_numel` 0). Under GRADACC_SHARDING_ACCUMULATE the shard is all the
 * accumulator holds: the window's sum over the ranks while accumulating, the reduced, normalised
 * (and clipped) gradient after sync.
 *
 * Ownership: `*out_data` is borrowed from `acc` and valid until it is destroyed.
 * Thread safety: any thread; the range never changes, and the data is stable while no call
 * writes the master.
 */
GRADACC_API
enum gradacc_status_t gradacc_accumulator_shard(const struct gradacc_accumulator_t *acc,
                                                size_t *out_offset,
                                                size_t *out_numel,
                                                float **out_data);

/**
 * Each tensor's telemetry of the last boundary, the same on every rank (`config`.tensor_stats =
 * 1): into `grad_norms[i]` the L2 norm of tensor i's reduced, normalised gradient before
 * clipping, into `nonfinite_microbatches[i]` the micro-batches over every rank in which it held a
 * non-finite value (docs/overflow.md). Either array may be NULL; `n` is the accumulator's tensor
 * count. GRADACC_STATUS_WRONG_STATE without tensor_stats, or before a sync that read its info;
 * nothing is written on failure.
 *
 * Thread safety: any thread; not concurrently with the next window's first micro-batch.
 */
GRADACC_API
enum gradacc_status_t gradacc_accumulator_tensor_stats(const struct gradacc_accumulator_t *acc,
                                                       double *grad_norms,
                                                       uint64_t *nonfinite_microbatches,
                                                       size_t n);

/**
 * Writes to `*out_numel` the length, in f32 elements, of the flat master of an accumulator over
 * the `n` tensors `tensors`: each tensor starts at a multiple of GRADACC_MASTER_ALIGN bytes, with
 * zeros between and after the last. It is the `master_numel` gradacc_accumulator_create_with_buffer
 * needs.
 *
 * Thread safety: any thread.
 */
GRADACC_API
enum gradacc_status_t gradacc_accumulator_master_numel(const struct gradacc_tensor_desc_t *tensors,
                                                       size_t n,
                                                       size_t *out_numel);

/**
 * Writes to `*out_offset` where tensor `index` starts in the flat master, in elements: a multiple
 * of GRADACC_MASTER_ALIGN / 4. With gradacc_accumulator_shard's range it tells which tensors'
 * elements a shard holds.
 *
 * Thread safety: any thread.
 */
GRADACC_API
enum gradacc_status_t gradacc_accumulator_offset(const struct gradacc_accumulator_t *acc,
                                                 size_t index,
                                                 size_t *out_offset);

/**
 * Writes the number of tensors to `*out`.
 *
 * Thread safety: any thread.
 */
GRADACC_API
enum gradacc_status_t gradacc_accumulator_num_tensors(const struct gradacc_accumulator_t *acc,
                                                      size_t *out);

/**
 * Writes tensor `index`'s descriptor (element count and dtype) to `*out`, so a caller that did
 * not create the accumulator can still size its buffers.
 *
 * Thread safety: any thread.
 */
GRADACC_API
enum gradacc_status_t gradacc_accumulator_tensor(const struct gradacc_accumulator_t *acc,
                                                 size_t index,
                                                 struct gradacc_tensor_desc_t *out);

/**
 * Discards the window in progress (or the synced result); the next micro-batch starts a new one.
 *
 * Thread safety: serialised with every other call on `acc`.
 */
GRADACC_API enum gradacc_status_t gradacc_accumulator_reset(struct gradacc_accumulator_t *acc);

/**
 * Saves the window in progress (masters, counts, micro-batches, overflow flag) as versioned
 * bytes, for a checkpoint in the middle of accumulation. Not inside a micro-batch nor after sync.
 * With `buf` NULL, only writes the needed size to `*out_len`. On CUDA it copies the masters to
 * the host (it waits for the accumulator's stream); the bytes are the same on every device. A
 * sharded accumulation saves its shard, and the bytes name it: they load only into the same
 * shard of an accumulation over as many ranks (anything else is GRADACC_STATUS_CORRUPT_STATE).
 *
 * Thread safety: serialised with every other call on `acc`.
 */
GRADACC_API
enum gradacc_status_t gradacc_accumulator_save_window(const struct gradacc_accumulator_t *acc,
                                                      uint8_t *buf,
                                                      size_t capacity,
                                                      size_t *out_len);

/**
 * Restores a window written by gradacc_accumulator_save_window from an accumulator with the same
 * tensors, saved on any device. Corrupt or foreign bytes fail and leave the accumulator unchanged.
 * The window's dropped micro-batches were not saved: gradacc_sync_info_t's
 * `dropped_microbatches` counts the drops after the load, and `overflow_microbatch` counts the
 * restored window's kept micro-batches, then each fed since the load, dropped ones included
 * (docs/overflow.md).
 *
 * Thread safety: serialised with every other call on `acc`.
 */
GRADACC_API
enum gradacc_status_t gradacc_accumulator_load_window(struct gradacc_accumulator_t *acc,
                                                      const uint8_t *bytes,
                                                      size_t len);

/**
 * Adds a window written by gradacc_accumulator_save_window (of an accumulator with the same
 * tensors, on any device or rank) into `acc`'s current window: masters add, item counts and
 * micro-batches add, overflow flags OR. Windows are sums, so work saved on N ranks resumes on M
 * (4 ranks to 2: each survivor merges one lost rank's window). The window counts the ranks'
 * windows it sums (a merge into a window with no micro-batch yet replaces this rank's own in the
 * count), so GRADACC_NORMALIZE_BY_WORLD divides by the size of the group that did the work; every
 * normalisation then gives the original group's gradient. Windows saved by 0.2 count as one
 * rank's window each. The merged window's kept micro-batches count in `overflow_microbatch` after
 * those already in the window. Corrupt or foreign bytes fail and leave the accumulator unchanged.
 *
 * Thread safety: serialised with every other call on `acc`.
 */
GRADACC_API
enum gradacc_status_t gradacc_accumulator_merge_window(struct gradacc_accumulator_t *acc,
                                                       const uint8_t *bytes,
                                                       size_t len);

/**
 * Creates an in-process group of `world_size` ranks (1 to 4096; one per thread, e.g. one replica
 * per socket or per device) and writes its handles, rank 0 first, to `out_comms[0..world_size]`.
 * Reductions sum in rank order, so every rank gets bitwise-identical results.
 *
 * Ownership: each handle is the caller's; free each with gradacc_comm_destroy.
 * Thread safety: each handle is used by one thread at a time (a concurrent second collective on
 * the same handle fails with GRADACC_STATUS_WRONG_STATE); every rank of the group must take part
 * in every sync, or the others wait for it.
 */
GRADACC_API
enum gradacc_status_t gradacc_comm_create_local(int32_t world_size,
                                                struct gradacc_comm_t **out_comms);

/**
 * Destroys a communicator handle. NULL is accepted and does nothing; must not be called twice on
 * one handle (a second call is detected and reported as GRADACC_STATUS_INVALID_HANDLE).
 * A sync on another thread that uses the handle (gradacc_accumulator_sync, _sync_hybrid) is
 * failed first, as gradacc_comm_abort fails it (GRADACC_STATUS_COMM_FAILURE; the communicator is
 * aborted, and in-process its whole group), and the destroy returns once that sync returned.
 * An NCCL communicator gradacc created is finalised and destroyed when healthy (its pending
 * collectives complete first, for at most 10 minutes), and aborted when it failed (a peer's
 * error, a timeout), which never waits for the other ranks.
 *
 * Thread safety: any thread, once no call uses the handle.
 */
GRADACC_API enum gradacc_status_t gradacc_comm_destroy(struct gradacc_comm_t *comm);

/**
 * Writes this handle's rank (0-based) to `*out`. Ranks and world sizes are `int32_t` in every
 * communicator function, as in MPI and NCCL, whose `int` ranks callers pass on unchanged.
 *
 * Thread safety: any thread.
 */
GRADACC_API
enum gradacc_status_t gradacc_comm_rank(const struct gradacc_comm_t *comm,
                                        int32_t *out);

/**
 * Writes the group's number of ranks to `*out`.
 *
 * Thread safety: any thread.
 */
GRADACC_API
enum gradacc_status_t gradacc_comm_world_size(const struct gradacc_comm_t *comm,
                                              int32_t *out);

/**
 * Writes to `*out` whether `backend` (GRADACC_BACKEND_*) can be used: MPI when the library was
 * built with it; CUDA and NCCL when their libraries load on this machine (checked without ever
 * failing: a machine with no driver just answers false). Every build has every function of the
 * header; a constructor of an unavailable backend fails with GRADACC_STATUS_BACKEND_UNAVAILABLE.
 *
 * Thread safety: any thread.
 */
GRADACC_API enum gradacc_status_t gradacc_backend_available(gradacc_backend_t backend, bool *out);

/**
 * Fills `*out` with the default MPI communicator options (and their struct_size). Available in
 * every build.
 *
 * Thread safety: any thread.
 */
GRADACC_API enum gradacc_status_t gradacc_mpi_config_default(struct gradacc_mpi_config_t *out);

/**
 * Creates this process's rank of an MPI communicator: MPI_COMM_WORLD when `fortran_comm` is
 * GRADACC_MPI_COMM_WORLD (-1), otherwise the caller's communicator given by its Fortran handle:
 * `MPI_Comm_c2f(comm)` in C, `comm.py2f()` in mpi4py, `MPI.API.MPI_Comm_c2f(comm.val)` in
 * MPI.jl (`comm.val` alone is MPI.jl's C handle, not this one). `config` NULL means the
 * defaults. Every rank of the communicator must call this (it is collective).
 *
 * gradacc works on a duplicate (MPI_Comm_dup) with MPI_ERRORS_RETURN, so MPI errors come back
 * as GRADACC_STATUS_COMM_FAILURE; it initialises MPI if the caller has not (and then finalises
 * it at exit). A build without MPI fails with GRADACC_STATUS_BACKEND_UNAVAILABLE. Details, and
 * how the boundary reduces: docs/mpi.md.
 *
 * Ownership: `*out_comm` is the caller's; free it with gradacc_comm_destroy (before MPI_Finalize
 * when the caller finalises MPI itself).
 * Thread safety: one collective at a time per handle (a concurrent second one fails with
 * GRADACC_STATUS_WRONG_STATE). Below MPI_THREAD_MULTIPLE (an MPI the caller initialised), gradacc
 * runs its collectives one at a time in the process, which MPI_THREAD_SERIALIZED needs; with
 * FUNNELED or SINGLE, make every gradacc MPI call from the thread that makes the caller's.
 */
GRADACC_API
enum gradacc_status_t gradacc_comm_create_mpi(int64_t fortran_comm,
                                              const struct gradacc_mpi_config_t *config,
                                              struct gradacc_comm_t **out_comm);

/**
 * Writes a new NCCL unique id to `*out` (rank 0 calls it, then shares the bytes). Works without
 * a GPU; needs NCCL (GRADACC_NCCL_LIBRARY, else libnccl.so.2 or libnccl.so).
 *
 * Thread safety: any thread.
 */
GRADACC_API enum gradacc_status_t gradacc_nccl_unique_id(struct gradacc_nccl_unique_id_t *out);

/**
 * Creates rank `rank` of `world_size` of the NCCL group named by `id`, on CUDA device
 * `device_ordinal` (one rank per GPU). Collective: returns once every rank has called it, or
 * fails with GRADACC_STATUS_TIMEOUT when they have not within 10 minutes; every later call waits
 * at most the communicator's timeout (gradacc_comm_set_timeout) for the other ranks. Two ranks of
 * one group on one device in one process are refused (GRADACC_STATUS_INVALID_ARGUMENT).
 * Accumulators on that device sync over it; their stream carries the collectives.
 *
 * Ownership: `*out_comm` is the caller's; free it with gradacc_comm_destroy, or first
 * gradacc_comm_abort to abandon pending collectives (after a peer failed).
 * Thread safety: any thread. Calls on one communicator from several threads (bucket reductions
 * from backward hooks, another accumulator's sync) run one at a time; every rank must still
 * issue them in the same order.
 */
GRADACC_API
enum gradacc_status_t gradacc_comm_create_nccl(const struct gradacc_nccl_unique_id_t *id,
                                               int32_t rank,
                                               int32_t world_size,
                                               int32_t device_ordinal,
                                               struct gradacc_comm_t **out_comm);

/**
 * Wraps the caller's `ncclComm_t` (passed as `void*`); its rank, size and device are read from
 * it. gradacc never destroys or aborts an adopted communicator. A non-blocking one
 * (ncclConfig_t.blocking = 0) works too: gradacc waits until each of its calls is enqueued.
 *
 * Ownership: `*out_comm` is the caller's (free with gradacc_comm_destroy, before the caller
 * destroys its ncclComm_t); `nccl_comm` stays the caller's.
 * Thread safety: as gradacc_comm_create_nccl; the caller must not run its own collectives on
 * the communicator concurrently with a gradacc call on it.
 */
GRADACC_API
enum gradacc_status_t gradacc_comm_adopt_nccl(void *nccl_comm,
                                              struct gradacc_comm_t **out_comm);

/**
 * Creates this rank's communicator of a split of `comm`: the ranks that pass the same `color`
 * form a group, ranked by `key` (ties by their rank in `comm`), on the same transport with the
 * same options: MPI_Comm_split for an MPI communicator, ncclCommSplit for an NCCL one (NCCL
 * 2.18 or newer; before, GRADACC_STATUS_BACKEND_UNAVAILABLE). An in-process one cannot be split
 * (GRADACC_STATUS_INVALID_ARGUMENT: make its groups with gradacc_comm_create_local). A mesh's
 * groups come from gradacc_mesh_shape_split, which passes each rank's color and key. Collective:
 * every rank of `comm` calls it; like creation it waits as long as the transport's split does.
 *
 * Ownership: `*out_comm` is the caller's; free it with gradacc_comm_destroy.
 * Thread safety: any thread; one collective at a time per handle, as for a sync.
 */
GRADACC_API
enum gradacc_status_t gradacc_comm_split(struct gradacc_comm_t *comm,
                                         uint32_t color,
                                         uint32_t key,
                                         struct gradacc_comm_t **out_comm);

/**
 * Sets how long a collective on `comm` may wait for the other ranks: after `seconds` it fails
 * with GRADACC_STATUS_TIMEOUT, naming the phase and the wait, and aborts the communicator.
 * 0 waits forever; the default is 600 (10 minutes). Applies to collectives that start later.
 *
 * Thread safety: any thread.
 */
GRADACC_API
enum gradacc_status_t gradacc_comm_set_timeout(struct gradacc_comm_t *comm,
                                               double seconds);

/**
 * Writes `comm`'s timeout in seconds to `*out` (0: it waits forever).
 *
 * Thread safety: any thread.
 */
GRADACC_API
enum gradacc_status_t gradacc_comm_timeout(const struct gradacc_comm_t *comm,
                                           double *out);

/**
 * Aborts this rank's communicator, of any backend: a sync waiting in it on any thread, and every
 * later one, fails with GRADACC_STATUS_COMM_FAILURE (use it when a peer died). In-process, every
 * rank of the group fails; with MPI, this rank stops waiting (MPI itself is not aborted). The
 * handle still needs gradacc_comm_destroy. An adopted NCCL communicator fails with
 * GRADACC_STATUS_WRONG_STATE (abort it with ncclCommAbort).
 *
 * Thread safety: any thread, also while another thread is blocked in a sync on the communicator
 * (that sync then fails with GRADACC_STATUS_COMM_FAILURE).
 */
GRADACC_API enum gradacc_status_t gradacc_comm_abort(struct gradacc_comm_t *comm);

/**
 * Converts the `n` f32 values at `src` to IEEE binary16 bits at `dst`, rounding to nearest
 * even: a value past the largest finite f16 (65504) rounds to infinity from 65520 up, a value
 * below the smallest subnormal (2^-24) to a signed zero from 2^-25 down; a NaN stays NaN, quiet,
 * with the upper bits of its payload. Uses F16C where the CPU has it (the same bits without).
 *
 * `src` and `dst` must not overlap. With `n` 0 nothing is read or written and either pointer may
 * be NULL; otherwise a NULL one fails with GRADACC_STATUS_NULL_ARGUMENT, and a pointer not
 * aligned to its element or an `n` past the address space with GRADACC_STATUS_INVALID_ARGUMENT,
 * writing nothing.
 *
 * Thread safety: any thread, at any time; it touches only `src` and `dst`.
 */
GRADACC_API enum gradacc_status_t gradacc_f32_to_f16(const float *src, uint16_t *dst, size_t n);

/**
 * Converts the `n` IEEE binary16 bit patterns at `src` to f32 values at `dst`, exactly (every
 * f16 value is an f32 value, subnormals included); a NaN stays NaN with its payload, and a
 * signalling one comes back quiet, as F16C's conversion gives it (the same bits without F16C).
 *
 * Arguments and failures as gradacc_f32_to_f16's.
 *
 * Thread safety: any thread, at any time; it touches only `src` and `dst`.
 */
GRADACC_API enum gradacc_status_t gradacc_f16_to_f32(const uint16_t *src, float *dst, size_t n);

/**
 * Converts the `n` f32 values at `src` to bfloat16 bits at `dst`, rounding to nearest even (a
 * value past the largest finite bf16 rounds to infinity); a NaN stays NaN, quiet, with the upper
 * bits of its payload. These are the bits a bf16 gradient of gradacc holds and its bf16 wire
 * rounds to.
 *
 * Arguments and failures as gradacc_f32_to_f16's.
 *
 * Thread safety: any thread, at any time; it touches only `src` and `dst`.
 */
GRADACC_API enum gradacc_status_t gradacc_f32_to_bf16(const float *src, uint16_t *dst, size_t n);

/**
 * Converts the `n` bfloat16 bit patterns at `src` to f32 values at `dst`, exactly: each pattern
 * becomes the upper half of an f32, a NaN's payload as it is (a signalling one stays
 * signalling), as gradacc reads a bf16 gradient.
 *
 * Arguments and failures as gradacc_f32_to_f16's.
 *
 * Thread safety: any thread, at any time; it touches only `src` and `dst`.
 */
GRADACC_API enum gradacc_status_t gradacc_bf16_to_f32(const uint16_t *src, float *dst, size_t n);

/**
 * Sends the library's messages at `level` and more severe ones (GRADACC_LOG_WARN: warnings and
 * errors) to `callback`, with `user` passed back unchanged; NULL `callback` (or
 * GRADACC_LOG_OFF) turns them off, back to the default: nothing, or stderr at the level the
 * environment variable `GRADACC_LOG` names (error, warn, info, debug). The messages say what
 * the statuses do not: a skipped step and its new loss scale, a dropped micro-batch, a CUDA
 * library loaded or not, a SIMD path other than the one asked for. Fails with INVALID_ARGUMENT
 * on an unknown `level`, changing nothing.
 *
 * Thread safety: any thread, but not from inside the callback.
 */
GRADACC_API
enum gradacc_status_t gradacc_set_log_callback(gradacc_log_fn callback,
                                               void *user,
                                               gradacc_log_level_t level);

/**
 * Writes the diagnostic report into `buf`, NUL-terminated, as snprintf does: the library's
 * version and file, the host and its SIMD path, each backend available or why not, the CUDA
 * driver, NVRTC and NCCL found (version and file) or why not, and every environment variable
 * the library reads. At most `size - 1` characters are written; `*needed` (when `needed` is not
 * NULL) receives the report's whole size, terminating NUL included, so a call with `buf` NULL
 * and `size` 0 asks for it. The `gradacc-info` program prints it. Fails with NULL_ARGUMENT when
 * `buf` is NULL and `size` is not 0.
 *
 * Thread safety: any thread.
 */
GRADACC_API enum gradacc_status_t gradacc_diagnostics(char *buf, size_t size, size_t *needed);

/**
 * Creates a mesh over `world`, a host communicator (in-process or MPI) of every rank of the job,
 * where this rank is data-parallel rank `data_rank` of `data_size`: the ranks that see different
 * data (data-parallel x context-parallel). In Megatron-Core's rank order, where the
 * tensor-parallel rank varies fastest, then the context-parallel, the data-parallel and the
 * pipeline one (rank = tp + TP*(cp + CP*(dp + DP*pp))), data_size = CP*DP and
 * data_rank = cp + CP*dp, this rank's index in its context x data-parallel group. `data_size`
 * divides the world's size. `max_grad_norm` clips the global norm (0: off), as PyTorch's
 * `clip_grad_norm_` over every parameter of the model. The mesh holds its own reference to
 * `world`'s communicator (the handle may be destroyed first; a sync in flight on it then fails).
 *
 * Ownership: `*out_mesh` is the caller's; free it with gradacc_mesh_destroy.
 * Thread safety: any thread.
 */
GRADACC_API
enum gradacc_status_t gradacc_mesh_create(struct gradacc_comm_t *world,
                                          uint32_t data_rank,
                                          uint32_t data_size,
                                          float max_grad_norm,
                                          struct gradacc_mesh_t **out_mesh);

/**
 * Destroys a mesh. NULL is accepted and does nothing; must not be called twice on one handle (a
 * second call is detected and reported as GRADACC_STATUS_INVALID_HANDLE). A sync on another
 * thread keeps the mesh until it returns.
 *
 * Thread safety: any thread.
 */
GRADACC_API enum gradacc_status_t gradacc_mesh_destroy(struct gradacc_mesh_t *mesh);

/**
 * Creates the shape of a mesh of `world_size` ranks: `tp`, `pp` and `cp` ranks on the
 * tensor-, pipeline- and context-parallel axes (data parallel takes the rest), and the experts
 * of each pipeline stage over `ep` x `etp` of its ranks (expert data parallel takes the rest of
 * the stage), as Megatron-Core's parallel state makes them. Every size is at least 1, and the
 * products divide the world and the stage. `order` is the dense axes' rank order, fastest
 * first, their names joined by '-': NULL for Megatron-Core's "tp-cp-dp-pp" (rank =
 * tp + TP*(cp + CP*(dp + DP*pp))), or any permutation of tp, cp, dp and pp. Experts number
 * the ranks of each stage in world order, expert-tensor fastest, then ep, then edp.
 *
 * Ownership: `*out_shape` is the caller's; free it with gradacc_mesh_shape_destroy.
 * Thread safety: any thread.
 */
GRADACC_API
enum gradacc_status_t gradacc_mesh_shape_create(uint32_t world_size,
                                                uint32_t tp,
                                                uint32_t pp,
                                                uint32_t cp,
                                                uint32_t ep,
                                                uint32_t etp,
                                                const char *order,
                                                struct gradacc_mesh_shape_t **out_shape);

/**
 * Destroys a mesh shape. NULL is accepted and does nothing; must not be called twice on one
 * handle (a second call is detected and reported as GRADACC_STATUS_INVALID_HANDLE).
 *
 * Thread safety: any thread.
 */
GRADACC_API enum gradacc_status_t gradacc_mesh_shape_destroy(struct gradacc_mesh_shape_t *shape);

/**
 * Where world rank `rank` sits in its group over `axes`: the axes' names joined by '-', all of
 * the dense view (tp, cp, dp, pp) or all of the expert one (etp, ep, edp, pp). The group is the
 * ranks whose other coordinates are `rank`'s, in world rank order. `*color_out` is its smallest
 * world rank (the color of a split: the same for all its members, different between groups),
 * `*key_out` the rank's index in it (its rank there; its coordinate when `axes` names one
 * axis), `*size_out` how many ranks it has; each may be NULL. For gradacc_mesh_create,
 * `data_rank` and `data_size` are the key and the size over "cp-dp".
 *
 * Thread safety: any thread.
 */
GRADACC_API
enum gradacc_status_t gradacc_mesh_shape_group(const struct gradacc_mesh_shape_t *shape,
                                               uint32_t rank,
                                               const char *axes,
                                               uint32_t *color_out,
                                               uint32_t *key_out,
                                               uint32_t *size_out);

/**
 * This rank's group over `axes` (as gradacc_mesh_shape_group), split from `world`: an MPI or
 * NCCL communicator of every rank of the mesh, whose ranks are the world ranks (see
 * gradacc_comm_split). Collective over `world`: every rank calls it with the same axes.
 *
 * Ownership: `*out_comm` is the caller's; free it with gradacc_comm_destroy.
 * Thread safety: as gradacc_comm_split.
 */
GRADACC_API
enum gradacc_status_t gradacc_mesh_shape_split(const struct gradacc_mesh_shape_t *shape,
                                               struct gradacc_comm_t *world,
                                               const char *axes,
                                               struct gradacc_comm_t **out_comm);

/**
 * The mesh step: the boundary of every accumulator of this rank's step (`parts[0..count]`), and
 * one agreement over the mesh's world for all. Every rank of the world calls it, each with its
 * own parts; the ranks of each part's group give that part at the same position of the parts
 * they share. Each part is reduced over its group and normalised by the job's totals: the item
 * counts summed over the data axes only (each data-parallel rank's window once; ranks at one
 * data-parallel rank must count alike, or the step fails on every rank naming them). The norm
 * is the job's: every distinct element once (each group's reduced gradient once; a replicated
 * tensor once over its copies), clipped by the mesh's max_grad_norm with one coefficient, the
 * same bits on every rank. A non-finite value on any rank in any part skips the step on every
 * rank: `*info_out` (may be NULL) reports it with the world rank, and `*overflow_part_out` (may
 * be NULL; UINT32_MAX when none) that rank's part. Every part's window reports the same info, so
 * gradacc_scaler_update_from and each optimizer's step follow it.
 *
 * A CUDA part's group is an NCCL communicator; the world stays a host one. Its control step and
 * its measures are read back to the host (the call waits for each CUDA part's stream), and the
 * job's report is written where the device's scaler and optimizer read it. A rank may mix CPU and
 * CUDA parts. A refused part whose accumulator is known takes part in its group's control step
 * on NCCL too; one with a NULL accumulator cannot tell an NCCL group (its peers wait until their
 * communicator's timeout).
 *
 * An invalid argument on one rank (a NULL or wrong handle, a struct_size, a replicated array)
 * fails that rank naming it, and the others with GRADACC_STATUS_PEER_FAILURE: the rank still
 * takes part, flagged invalid, in the control step of each part's group it can name and in the
 * world's agreement. A part whose group it cannot name (parts NULL, or parts[0].struct_size
 * wrong, so no element can be read; a NULL accumulator with a NULL comm under sharded
 * accumulation) leaves that group's peers waiting until their communicator's timeout. A failure
 * before the reductions leaves every window intact; one after them discards every window.
 *
 * Thread safety: serialised with every other call on each part's accumulator; one call per
 * rank, each on its rank's thread.
 */
GRADACC_API
enum gradacc_status_t gradacc_mesh_sync(struct gradacc_mesh_t *mesh,
                                        const struct gradacc_mesh_part_t *parts,
                                        size_t count,
                                        struct gradacc_sync_info_t *info_out,
                                        uint32_t *overflow_part_out);

/**
 * Ends the open micro-batch of each of `accumulators` (`count` handles, this rank's, each under
 * GRADACC_OVERFLOW_DROP_MICROBATCH and fed tensor by tensor since
 * gradacc_accumulator_begin_microbatch; not sharded accumulation), agreeing its drop over the
 * world first (one all-gather of 24 bytes per rank): if any rank at this data-parallel rank
 * (its tensor-, pipeline- and expert-tensor-parallel peers, which computed from the same data)
 * found a non-finite gradient in any of its accumulators, every one of them drops the
 * micro-batch in every accumulator; the others keep theirs. Every rank of the world calls it
 * once per micro-batch, before its peers' gradients of the next one. `*kept_out` (may be NULL)
 * is 1 when this rank kept the micro-batch, 0 when it dropped it. An invalid argument on one
 * rank fails it naming the argument, and the others with GRADACC_STATUS_PEER_FAILURE; every
 * micro-batch then stays open (end it again, or with gradacc_accumulator_end_microbatch).
 *
 * Thread safety: serialised with every other call on each accumulator; one call per rank, each
 * on its rank's thread.
 */
GRADACC_API
enum gradacc_status_t gradacc_mesh_end_microbatch(struct gradacc_mesh_t *mesh,
                                                  struct gradacc_accumulator_t *const *accumulators,
                                                  size_t count,
                                                  uint32_t *kept_out);

/**
 * Fills `*out` with the default optimizer configuration (AdamW with PyTorch's defaults, lr
 * 1e-3) and its struct_size.
 *
 * Thread safety: any thread.
 */
GRADACC_API
enum gradacc_status_t gradacc_optimizer_config_default(struct gradacc_optimizer_config_t *out);

/**
 * Creates an optimizer over `acc`'s tensors, device and sharding: its FP32 master weights (for
 * this rank's shard under GRADACC_SHARDING_REDUCE_SCATTER or _ACCUMULATE) initialised from the
 * model's weights `weights[i]` (pointers to each whole tensor, of `weight_dtypes[i]`, or of
 * the tensors' gradient dtypes when `weight_dtypes` is NULL), each tensor in `groups[i]` (NULL:
 * weight decay on, lr_scale 1). `config` NULL means the defaults
 * (gradacc_optimizer_config_default). `n` is the accumulator's tensor count. The semantics are the
 * Rust API's `Optimizer` (its documentation is the contract: one step per synced window, a
 * skipped window changes nothing, the all-gather under sharding); docs/optimizer.md.
 *
 * On a CPU accumulator the weights are host pointers. On a CUDA accumulator they are device
 * addresses on its device, and the masters, the state and the step count are allocated in
 * device memory on its stream; creation reads the weights (it waits for the stream).
 *
 * Fails, creating nothing, on a configuration out of range (the message names the field), a
 * wrong count, a NULL or misaligned weight, or, on a CUDA accumulator, a weight that is not one
 * device allocation of its tensor's length (GRADACC_STATUS_DEVICE_MISMATCH).
 *
 * Thread safety: any thread. Destroy with gradacc_optimizer_destroy.
 */
GRADACC_API
enum gradacc_status_t gradacc_optimizer_create(const struct gradacc_accumulator_t *acc,
                                               const struct gradacc_optimizer_config_t *config,
                                               const struct gradacc_tensor_group_t *groups,
                                               const void *const *weights,
                                               const gradacc_dtype_t *weight_dtypes,
                                               size_t n,
                                               struct gradacc_optimizer_t **out);

/**
 * Like gradacc_optimizer_create, but adopts the caller's FP32 master weights `masters`, of
 * exactly `masters_numel` elements, instead of allocating them: e.g. a framework's own FP32
 * master weights (Apex O2, Megatron's contiguous FP32 buffer). They are laid out as the
 * accumulator's flat layout over the range this rank holds (gradacc_accumulator_shard: the whole
 * layout unsharded, gradacc_accumulator_master_numel elements): element k is flat element
 * `shard.start + k`, so tensor i's masters start at element gradacc_accumulator_offset(i) -
 * `shard.start`. Host memory on a CPU accumulator, one device allocation on the accumulator's
 * device on a CUDA one.
 *
 * The values in `masters` ARE the master weights: creation does not overwrite them from
 * `weights` (which still give the model's dtypes and lengths, and which every step writes);
 * each gradacc_optimizer_step updates them in place (stream-ordered on CUDA), and
 * gradacc_optimizer_load writes into them (a refused load leaves them bit for bit). The
 * padding between tensors is never read; a load writes zeros there. Creation does not read the
 * weights, and on CUDA does not wait for the stream.
 *
 * Fails, creating nothing, as gradacc_optimizer_create does, and with
 * GRADACC_STATUS_NULL_ARGUMENT for a NULL `masters`, GRADACC_STATUS_INVALID_ARGUMENT for a
 * misaligned one (not 4-byte aligned), GRADACC_STATUS_SIZE_MISMATCH for a `masters_numel`
 * other than the shard's length, GRADACC_STATUS_INVALID_ARGUMENT for `masters` that overlap a
 * weight (a step writes both; gradacc_optimizer_step refuses such weights too), or, on a CUDA
 * accumulator, GRADACC_STATUS_DEVICE_MISMATCH for `masters` that are not one device allocation
 * of `masters_numel` floats on its device.
 *
 * Ownership: `*out` is the caller's; free it with gradacc_optimizer_destroy. `masters` stays the
 * caller's and must outlive the optimizer; gradacc never frees it. The caller must not write
 * `masters` while a call on the optimizer runs, nor (on CUDA) while a step enqueued on the
 * stream has not finished.
 * Thread safety: as gradacc_optimizer_create.
 */
GRADACC_API
enum gradacc_status_t gradacc_optimizer_create_with_masters(const struct gradacc_accumulator_t *acc,
                                                            const struct gradacc_optimizer_config_t *config,
                                                            const struct gradacc_tensor_group_t *groups,
                                                            const void *const *weights,
                                                            const gradacc_dtype_t *weight_dtypes,
                                                            size_t n,
                                                            float *masters,
                                                            size_t masters_numel,
                                                            struct gradacc_optimizer_t **out);

/**
 * Destroys an optimizer. NULL is accepted and does nothing; a second call on one handle is
 * reported as GRADACC_STATUS_INVALID_HANDLE.
 *
 * Thread safety: any thread, once no other call uses the optimizer.
 */
GRADACC_API enum gradacc_status_t gradacc_optimizer_destroy(struct gradacc_optimizer_t *opt);

/**
 * Sets the learning rate of the steps from the next one on (finite, >= 0). On a CUDA
 * accumulator the value is copied to the device on the accumulator's stream: steps enqueued
 * before this call keep theirs.
 *
 * Thread safety: any thread; serialised with the optimizer's other calls.
 */
GRADACC_API
enum gradacc_status_t gradacc_optimizer_set_lr(struct gradacc_optimizer_t *opt,
                                               float lr);

/**
 * On a CUDA accumulator, writes to `*out` the device address of the learning rate (one
 * `float`) that every step reads when it runs on the stream. A schedule on the device (a
 * kernel, or a memcpy node of a captured CUDA graph) writes it there, so a captured step replays
 * with the schedule and without the host. The value is used as written, unchecked.
 * GRADACC_STATUS_DEVICE_MISMATCH on a CPU accumulator (use gradacc_optimizer_set_lr).
 *
 * Thread safety: any thread. The address stays valid until the optimizer is destroyed.
 */
GRADACC_API
enum gradacc_status_t gradacc_optimizer_lr_device_ptr(const struct gradacc_optimizer_t *opt,
                                                      void **out);

/**
 * Writes the number of steps taken (a skipped step is not one) to `*out`. On a CUDA accumulator
 * the count is in device memory: this waits for the stream when a step since the last call
 * followed a gradacc_accumulator_sync whose `out_info` was NULL.
 *
 * Thread safety: any thread.
 */
GRADACC_API
enum gradacc_status_t gradacc_optimizer_steps(const struct gradacc_optimizer_t *opt,
                                              uint64_t *out);

/**
 * The step after gradacc_accumulator_sync of `acc` (the accumulator the optimizer was made
 * over): steps the FP32 masters and the state from the reduced gradient and writes the model's
 * weights `weights[i]` (pointers to each whole tensor, in the dtypes given at creation), or,
 * when the boundary found a non-finite value, changes nothing; `*out_stepped` (may be NULL) says
 * which. Under a sharded boundary every rank calls it, and the ranks agree first (a call invalid
 * on one rank fails on all: its own error there, GRADACC_STATUS_PEER_FAILURE elsewhere; ranks
 * whose optimizers differ, the learning rate and step count included, all fail with
 * GRADACC_STATUS_SIZE_MISMATCH) and then all-gather the weights over `comm`: the communicator
 * sync took (NULL for a sharded accumulation's own). WRONG_STATE before a sync or a
 * second time after one. A call whose `weights` are refused here still takes part in the
 * agreement, so the other ranks fail at once.
 *
 * On a CUDA accumulator the weights are device addresses, and the step is enqueued on the
 * accumulator's stream and returns without waiting (a sharded step's agreement waits for the
 * stream, except while the stream is captured into a CUDA graph: there the first sharded step
 * over a communicator fails with WRONG_STATE, and after it a call invalid on this rank aborts the
 * communicator, so the other ranks' all-gather fails; docs/optimizer.md). Whether the boundary
 * overflowed is read by the kernels on the device, so the step
 * may also follow a gradacc_accumulator_sync whose `out_info` was NULL (a sync that does not
 * wait); `out_stepped` must then be NULL (the host does not know; WRONG_STATE otherwise, before
 * anything runs). A weight that is not one device
 * allocation of its tensor's length fails with GRADACC_STATUS_DEVICE_MISMATCH.
 *
 * Thread safety: serialised with the optimizer's other calls and with every call on `acc`; the
 * weights are read and written during the call only (on CUDA: by the work it enqueues).
 */
GRADACC_API
enum gradacc_status_t gradacc_optimizer_step(struct gradacc_optimizer_t *opt,
                                             struct gradacc_accumulator_t *acc,
                                             void *const *weights,
                                             size_t n,
                                             struct gradacc_comm_t *comm,
                                             bool *out_stepped);

/**
 * gradacc_optimizer_step of an optimizer whose `config.weight_formats` makes some tensors FP8:
 * for such a tensor i, `weights[i]` holds its `numel` E4M3 codes (bytes) and `scales[i]` its
 * scales, which the step writes with the codes: one float for GRADACC_WEIGHTS_E4M3_TENSORWISE,
 * one E8M0 byte per block of 32 elements (the last block shorter) for GRADACC_WEIGHTS_MXFP8.
 * `scales[i]` is NULL for a tensor in its model dtype; `scales` may be NULL when no tensor is
 * FP8 (gradacc_optimizer_step is this with a NULL `scales`). After the step, every rank holds
 * every tensor's codes and scales, bitwise those of quantising the whole tensor's FP32 masters
 * once. When a new master of an FP8 tensor is infinite or NaN on any rank, no broken scale is
 * applied: every rank fails with GRADACC_STATUS_INVALID_ARGUMENT naming the tensor, and the
 * weights, the state and the step count stay as they were (docs/optimizer.md, "FP8 weights on
 * the all-gather"). A scale buffer of the wrong kind is refused as a weight is: NULL
 * (GRADACC_STATUS_NULL_ARGUMENT), misaligned, or given for a model-dtype tensor
 * (GRADACC_STATUS_INVALID_ARGUMENT).
 *
 * Thread safety: as gradacc_optimizer_step.
 */
GRADACC_API
enum gradacc_status_t gradacc_optimizer_step_scaled(struct gradacc_optimizer_t *opt,
                                                    struct gradacc_accumulator_t *acc,
                                                    void *const *weights,
                                                    void *const *scales,
                                                    size_t n,
                                                    struct gradacc_comm_t *comm,
                                                    bool *out_stepped);

/**
 * Writes this rank's optimizer state (versioned, checksummed) into `buf` (NULL: only reports
 * the size) and its length to `*out_len`. The format is the same on every device: on a CUDA
 * accumulator the state is copied to the host (this waits for the stream).
 *
 * Thread safety: any thread; serialised with the optimizer's other calls.
 */
GRADACC_API
enum gradacc_status_t gradacc_optimizer_save(const struct gradacc_optimizer_t *opt,
                                             uint8_t *buf,
                                             size_t capacity,
                                             size_t *out_len);

/**
 * Restores the state from `n` saved parts (`parts[k]`, `lens[k]` bytes each): what
 * gradacc_optimizer_save wrote on any number of ranks, together covering this rank's elements,
 * so a state saved over one shard count loads over another. Corrupt, foreign or insufficient
 * parts fail with GRADACC_STATUS_CORRUPT_STATE, and two parts that hold the same element (the
 * same part given twice, or parts of two saves) with GRADACC_STATUS_INVALID_ARGUMENT, naming
 * them; either way the optimizer is unchanged.
 *
 * Thread safety: any thread; serialised with the optimizer's other calls.
 */
GRADACC_API
enum gradacc_status_t gradacc_optimizer_load(struct gradacc_optimizer_t *opt,
                                             const uint8_t *const *parts,
                                             const size_t *lens,
                                             size_t n);

/**
 * Fills `*out` with the default scaler configuration (and its struct_size).
 *
 * Thread safety: any thread.
 */
GRADACC_API
enum gradacc_status_t gradacc_scaler_config_default(struct gradacc_scaler_config_t *out);

/**
 * Creates a scaler. `config` NULL means the defaults; `device` NULL means the CPU. On a CUDA
 * device the state lives in device memory, ordered on the device's stream, and is updated there
 * by gradacc_scaler_update without a host round trip.
 *
 * Ownership: `*out` is the caller's; free it with gradacc_scaler_destroy (after every
 * accumulator call that uses it has returned).
 * Thread safety: any thread. The new scaler may be used from several threads: reads and
 * gradacc_scaler_update are internally serialised.
 */
GRADACC_API
enum gradacc_status_t gradacc_scaler_create(const struct gradacc_scaler_config_t *config,
                                            const struct gradacc_device_t *device,
                                            struct gradacc_scaler_t **out);

/**
 * Destroys a scaler. NULL is accepted and does nothing; must not be called twice on one handle
 * (a second call is detected and reported as GRADACC_STATUS_INVALID_HANDLE).
 *
 * Thread safety: any thread, once no other call uses the scaler.
 */
GRADACC_API enum gradacc_status_t gradacc_scaler_destroy(struct gradacc_scaler_t *scaler);

/**
 * Reads the current loss scale into `*out`. On CUDA this synchronises with the scaler's stream.
 *
 * Thread safety: any thread, concurrently with other calls on the scaler.
 */
GRADACC_API
enum gradacc_status_t gradacc_scaler_scale(const struct gradacc_scaler_t *scaler,
                                           float *out);

/**
 * Multiplies `numel` loss values of `dtype` at `loss` in place by the current scale (16-bit
 * values round to nearest even). Call it on the loss before the backward pass. On CUDA `loss` is
 * a device address and the work is enqueued on the scaler's stream.
 *
 * Thread safety: any thread; `loss` must not be used concurrently.
 */
GRADACC_API
enum gradacc_status_t gradacc_scaler_scale_loss(const struct gradacc_scaler_t *scaler,
                                                void *loss,
                                                size_t numel,
                                                gradacc_dtype_t dtype);

/**
 * Ends an optimizer step: reads the agreed overflow flag of each of the `n` accumulators (each
 * must have completed gradacc_accumulator_sync for its current window), and updates the scale
 * once. `*out_skipped` (may be NULL) is set to true when any of them overflowed: skip the
 * optimizer step. Every rank calls it with its own scaler and gets the same result.
 *
 * Fails with GRADACC_STATUS_SCALE_AT_MINIMUM, changing nothing, when an overflow needs a backoff
 * while the scale is already at min_scale.
 *
 * On CUDA: the flags are gathered and the scale updated by kernels on the scaler's stream
 * (ordered after each accumulator's stream); with `out_skipped` NULL the call does not wait,
 * and a SCALE_AT_MINIMUM is reported by the next call that reads the state (get_scale,
 * get_stats, save, or an update with `out_skipped`); with `out_skipped` it waits (a host read).
 * Thread safety: any thread; serialised with other updates of the scaler.
 */
GRADACC_API
enum gradacc_status_t gradacc_scaler_update(struct gradacc_scaler_t *scaler,
                                            const struct gradacc_accumulator_t *const *accumulators,
                                            size_t n,
                                            bool *out_skipped);

/**
 * Writes the scaler's statistics to `*out`.
 *
 * Thread safety: any thread, concurrently with other calls on the scaler.
 */
GRADACC_API
enum gradacc_status_t gradacc_scaler_stats(const struct gradacc_scaler_t *scaler,
                                           struct gradacc_scaler_stats_t *out);

/**
 * Saves the scaler's complete state (config, scale, trackers, statistics) as versioned bytes.
 * With `buf` NULL, only writes the needed size to `*out_len`; otherwise `capacity` must be at
 * least that size, and `*out_len` receives the bytes written.
 *
 * Thread safety: any thread, concurrently with other calls on the scaler.
 */
GRADACC_API
enum gradacc_status_t gradacc_scaler_save(const struct gradacc_scaler_t *scaler,
                                          uint8_t *buf,
                                          size_t capacity,
                                          size_t *out_len);

/**
 * Restores a state written by gradacc_scaler_save. Corrupt, truncated or foreign bytes fail with
 * GRADACC_STATUS_CORRUPT_STATE and leave the scaler unchanged.
 *
 * Thread safety: any thread; serialised with other updates of the scaler.
 */
GRADACC_API
enum gradacc_status_t gradacc_scaler_load(struct gradacc_scaler_t *scaler,
                                          const uint8_t *bytes,
                                          size_t len);

/**
 * A static description of a status code (never NULL; unknown codes get a generic text). The code
 * is an `int32_t` rather than a gradacc_status_t so that any value may be passed.
 *
 * Thread safety: may be called from any thread at any time.
 */
GRADACC_API const char *gradacc_status_string(int32_t status);

/**
 * The message of the most recent failed gradacc call on the calling thread ("" if none yet).
 * It names the function, the argument and the value that was wrong. Successful calls leave it
 * unchanged.
 *
 * Ownership: the string belongs to gradacc and stays valid until the next failing gradacc call on
 * the same thread; copy it to keep it.
 * Thread safety: per thread; may be called from any thread.
 */
GRADACC_API const char *gradacc_last_error(void);

/**
 * The loaded library's version as "MAJOR.MINOR.PATCH" (static storage, never NULL). Compare with
 * GRADACC_VERSION_STRING to detect a header/library mismatch.
 *
 * Thread safety: any thread.
 */
GRADACC_API const char *gradacc_version_string(void);

/**
 * The loaded library's version as MAJOR * 10000 + MINOR * 100 + PATCH.
 *
 * Thread safety: any thread.
 */
GRADACC_API uint32_t gradacc_version_number(void);

#ifdef __cplusplus
}  // extern "C"
#endif  // __cplusplus

#endif  /* GRADACC_H */
