/* The project's own kernels (src/backend/cuda/kernels/), compiled as host C++ with shim.h, and
 * what each launch touches: the race detector and the bounds checks need every kernel's memory
 * footprint, derived here from its arguments (and the device tables they point to). A kernel
 * whose signature changes no longer matches its footprint's and this file stops compiling. */
#include "kernels.h"

#include <tuple>
#include <type_traits>
#include <utility>

#include "shim.h"

#include "../../src/backend/cuda/kernels/math.cuh"
#include "../../src/backend/cuda/kernels/kernels.cu"

namespace sim {
namespace {

uint64_t dtype_bytes(int dtype) { return dtype == GA_DTYPE_F32 ? 4 : 2; }

/* Footprints: one per kernel, with the kernel's exact parameter types. */

/* The chunks of a multi-tensor launch (`name`'s): the tables read, each chunk inside its tensor and
 * among the launch's sources, each source's gradient read; `each(chunk, tensor)` adds the rest. */
template <class Each>
void fp_multi_chunks(Footprint &f, const char *name, const ga_tensor *tensors, const ga_chunk *chunks, ga_u64 num_chunks,
                     const ga_sources &sources, Each each) {
    if (sources.count > GA_SOURCES_PER_LAUNCH) violation("%s: %llu sources in one launch", name, (unsigned long long)sources.count);
    f.read(chunks, num_chunks * sizeof(ga_chunk));
    ga_u64 num_tensors = 0;
    for (ga_u64 c = 0; c < num_chunks; ++c) num_tensors = std::max(num_tensors, chunks[c].tensor + 1);
    f.read(tensors, num_tensors * sizeof(ga_tensor));
    for (ga_u64 c = 0; c < num_chunks; ++c) {
        const ga_chunk &k = chunks[c];
        if (k.tensor < sources.first_tensor || k.tensor >= sources.first_tensor + sources.count)
            violation("%s: chunk %llu is of tensor %llu, the launch has the sources of tensors %llu..%llu", name, (unsigned long long)c,
                      (unsigned long long)k.tensor, (unsigned long long)sources.first_tensor, (unsigned long long)(sources.first_tensor + sources.count));
        const ga_tensor &t = tensors[k.tensor];
        if (k.start + k.len > t.numel) violation("%s: chunk %llu runs past tensor %llu", name, (unsigned long long)c, (unsigned long long)k.tensor);
        const ga_source &s = sources.s[k.tensor - sources.first_tensor];
        f.read((const char *)(uintptr_t)s.grad + k.start * dtype_bytes(t.dtype), k.len * dtype_bytes(t.dtype));
        each(k, t);
    }
}

void fp_add_multi(Footprint &f, const ga_tensor *tensors, const ga_chunk *chunks, ga_u64 num_chunks, ga_sources sources, float *master,
                  const ga_scaler_state *scaler, double, ga_u32 *found_inf) {
    fp_multi_chunks(f, "ga_add_multi", tensors, chunks, num_chunks, sources,
                    [&](const ga_chunk &k, const ga_tensor &t) { f.write(master + t.offset + k.start, k.len * 4); });
    f.read(scaler, sizeof *scaler);
    f.write(found_inf, 4);
}

void fp_add_one(Footprint &f, float *master, const void *grad, ga_u64 numel, int dtype, const ga_scaler_state *scaler, double, ga_u32,
                ga_u32 *found_inf) {
    f.write(master, numel * 4);
    f.read(grad, numel * dtype_bytes(dtype));
    f.read(scaler, sizeof *scaler);
    f.write(found_inf, 4);
}

void fp_check_multi(Footprint &f, const ga_tensor *tensors, const ga_chunk *chunks, ga_u64 num_chunks, ga_sources sources,
                    const ga_scaler_state *scaler, double, ga_u32 *flags) {
    fp_multi_chunks(f, "ga_check_multi", tensors, chunks, num_chunks, sources, [](const ga_chunk &, const ga_tensor &) {});
    f.read(scaler, sizeof *scaler);
    if (sources.count > 0) f.write(flags + sources.first_tensor, sources.count * 4);
}

void fp_count_flags(Footprint &f, ga_u64 *counts, ga_u32 *flags, ga_u64 n) {
    f.write(counts, n * 8);
    f.write(flags, n * 4);
}

void fp_merge(Footprint &f, float *master, const float *staged, ga_u64 numel, ga_u32, ga_u32 *found_inf) {
    f.write(master, numel * 4);
    f.read(staged, numel * 4);
    f.write(found_inf, 4);
}

void fp_pack_control(Footprint &f, ga_boundary *b, ga_u64, ga_u64, const ga_u32 *found_inf, ga_u64, ga_u64, ga_u64, int) {
    f.write(b, 6 * sizeof(ga_u64));
    if (found_inf) f.read(found_inf, 4);
}

void fp_or_flag(Footprint &f, ga_u32 *into, const ga_u32 *from) {
    f.write(into, 4);
    f.read(from, 4);
}

void fp_to_bf16(Footprint &f, unsigned short *out, const float *in, ga_u64 n) {
    f.write(out, n * 2);
    f.read(in, n * 4);
}

void fp_sum_bf16(Footprint &f, float *out, const unsigned short *in, ga_u64 n, ga_u64 world) {
    f.write(out, n * 4);
    f.read(in, world * n * 2);
}

void fp_begin_boundary(Footprint &f, ga_boundary *b, int) { f.write(b, sizeof *b); }

void fp_scale_sum_squares(Footprint &f, float *buf, ga_u64 n, const ga_boundary *b, int, double *partials) {
    f.read(b, sizeof *b);
    f.write(buf, n * 4);
    f.write(partials, (n + GA_NORM_BLOCK - 1) / GA_NORM_BLOCK * 8);
}

void fp_segment_squares(Footprint &f, const float *master, const ga_u64 *spans, ga_u64 num_spans, ga_u64 lo, ga_u64 hi, double *out) {
    f.read(spans, num_spans * 16);
    for (ga_u64 s = 0; s < num_spans; ++s) {
        if (spans[2 * s] >= lo && spans[2 * s + 1] <= hi) f.read(master + (spans[2 * s] - lo), (spans[2 * s + 1] - spans[2 * s]) * 4);
    }
    f.write(out, num_spans * 8);
}

void fp_finish_norm(Footprint &f, ga_boundary *b, const double *partials, ga_u64 num_blocks, double) {
    f.write(b, sizeof *b);
    f.read(partials, num_blocks * 8);
}

void fp_scale_by(Footprint &f, float *buf, ga_u64 n, const ga_boundary *b) {
    f.read(b, sizeof *b);
    f.write(buf, n * 4);
}

void fp_scaler_gather(Footprint &f, ga_scaler_state *s, const ga_boundary *b) {
    f.write(s, sizeof *s);
    f.read(b, sizeof *b);
}

void fp_scaler_update(Footprint &f, ga_scaler_state *s, ga_scaler_rule) { f.write(s, sizeof *s); }

void fp_scale_loss(Footprint &f, void *loss, ga_u64 n, int dtype, const ga_scaler_state *s) {
    f.write(loss, n * dtype_bytes(dtype));
    f.read(s, sizeof *s);
}

/* The tensors a launch's chunks name (the table is read up to the largest), each chunk checked
 * against its tensor's launch slot. */
void fp_opt_chunks(Footprint &f, const char *kernel, const ga_opt_tensor *tensors, const ga_opt_chunk *chunks, ga_u64 num_chunks,
                   const ga_weights &weights) {
    if (weights.count > GA_SOURCES_PER_LAUNCH) violation("%s: %llu weights in one launch", kernel, (unsigned long long)weights.count);
    f.read(chunks, num_chunks * sizeof(ga_opt_chunk));
    ga_u64 num_tensors = 0;
    for (ga_u64 c = 0; c < num_chunks; ++c) num_tensors = std::max(num_tensors, chunks[c].tensor + 1);
    f.read(tensors, num_tensors * sizeof(ga_opt_tensor));
    for (ga_u64 c = 0; c < num_chunks; ++c) {
        const ga_opt_chunk &k = chunks[c];
        if (k.tensor < weights.first_tensor || k.tensor >= weights.first_tensor + weights.count)
            violation("%s: chunk %llu is of tensor %llu, the launch has the weights of tensors %llu..%llu", kernel, (unsigned long long)c,
                      (unsigned long long)k.tensor, (unsigned long long)weights.first_tensor,
                      (unsigned long long)(weights.first_tensor + weights.count));
    }
}

const void *weight_at(const ga_weights &weights, const ga_opt_tensor *tensors, const ga_opt_chunk &k) {
    return (const char *)(uintptr_t)weights.w[k.tensor - weights.first_tensor] + k.start * dtype_bytes(tensors[k.tensor].dtype);
}

void fp_opt_step(Footprint &f, const ga_opt_tensor *tensors, const ga_opt_chunk *chunks, ga_u64 num_chunks, ga_weights weights, const float *grad,
                 float *master, float *first, float *second, ga_u64, const ga_boundary *b, const ga_u64 *steps, const float *lr, ga_opt_rule rule) {
    fp_opt_chunks(f, "ga_opt_step", tensors, chunks, num_chunks, weights);
    if (rule.algorithm == GA_OPT_ADAMW && !second) violation("ga_opt_step: AdamW without second moments");
    for (ga_u64 c = 0; c < num_chunks; ++c) {
        const ga_opt_chunk &k = chunks[c];
        f.write(weight_at(weights, tensors, k), k.len * dtype_bytes(tensors[k.tensor].dtype));
        f.read(grad + k.at, k.len * 4);
        // Remainder masters and bf16 moments take 2 bytes per element (GA_MASTERS_*, GA_MOMENTS_*),
        // and no masters none: the weights are.
        if (rule.masters == GA_MASTERS_REMAINDER) {
            f.write((unsigned short *)master + k.at, k.len * 2);
        } else if (rule.masters == GA_MASTERS_F32) {
            f.write(master + k.at, k.len * 4);
        }
        if (rule.moments == GA_MOMENTS_BF16) {
            f.write((unsigned short *)first + k.at, k.len * 2);
            if (second) f.write((unsigned short *)second + k.at, k.len * 2);
        } else {
            f.write(first + k.at, k.len * 4);
            if (second) f.write(second + k.at, k.len * 4);
        }
    }
    f.read(b, sizeof *b);
    f.read(steps, sizeof *steps);
    f.read(lr, sizeof *lr);
}

void fp_opt_advance(Footprint &f, const ga_boundary *b, ga_u64 *steps) {
    f.read(b, sizeof *b);
    f.write(steps, sizeof *steps);
}

void fp_claim_schedule(Footprint &f, ga_u64 *words, const ga_u32 *lr_bits, const ga_u64 *steps) {
    f.write(words, 6 * sizeof(ga_u64));
    f.read(lr_bits, sizeof *lr_bits);
    f.read(steps, sizeof *steps);
}

void fp_opt_copy(Footprint &f, const ga_opt_tensor *tensors, const ga_opt_chunk *chunks, ga_u64 num_chunks, ga_weights weights,
                 unsigned short *staging, ga_u32 to_staging) {
    fp_opt_chunks(f, "ga_opt_copy", tensors, chunks, num_chunks, weights);
    for (ga_u64 c = 0; c < num_chunks; ++c) {
        const ga_opt_chunk &k = chunks[c];
        uint64_t bytes = k.len * dtype_bytes(tensors[k.tensor].dtype);
        if (to_staging) {
            f.read(weight_at(weights, tensors, k), bytes);
            f.write((char *)staging + k.at, bytes);
        } else {
            f.write(weight_at(weights, tensors, k), bytes);
            f.read((char *)staging + k.at, bytes);
        }
    }
}

void fp_layout_sizes(Footprint &f, ga_u64 *out) { f.write(out, 11 * sizeof(ga_u64)); }

/* Checks a pointer argument (null is allowed: a kernel may test it) against the live
 * allocations of the launching device. */
template <typename T> void check_argument(const char *kernel, size_t index, T value, int device) {
    if constexpr (std::is_pointer_v<T>) {
        if (value == nullptr) return;
        std::string why;
        if (!find_live((uint64_t)(uintptr_t)value, 0, device, &why))
            violation("%s: argument %zu = %p is not device memory of device %d: %s", kernel, index, (const void *)value, device, why.c_str());
    }
}

template <typename... A, size_t... I>
KernelInfo make(const char *name, void (*kernel)(A...), void (*footprint)(Footprint &, A...), std::index_sequence<I...>) {
    KernelInfo info;
    info.name = name;
    info.param_sizes = {sizeof(A)...};
    info.bind = [name, kernel, footprint](void **args, int device) {
        auto values = std::make_shared<std::tuple<A...>>(*static_cast<A *>(args[I])...);
        (check_argument(name, I, std::get<I>(*values), device), ...);
        BoundKernel bound;
        bound.footprint = [values, footprint](Footprint &f) { footprint(f, std::get<I>(*values)...); };
        bound.body = [values, kernel] { kernel(std::get<I>(*values)...); };
        return bound;
    };
    return info;
}

template <typename... A> KernelInfo make(const char *name, void (*kernel)(A...), void (*footprint)(Footprint &, A...)) {
    return make(name, kernel, footprint, std::index_sequence_for<A...>{});
}

const std::vector<KernelInfo> &registry() {
    static const std::vector<KernelInfo> kernels = {
        make("ga_add_multi", ga_add_multi, fp_add_multi),
        make("ga_add_one", ga_add_one, fp_add_one),
        make("ga_check_multi", ga_check_multi, fp_check_multi),
        make("ga_merge", ga_merge, fp_merge),
        make("ga_count_flags", ga_count_flags, fp_count_flags),
        make("ga_pack_control", ga_pack_control, fp_pack_control),
        make("ga_or_flag", ga_or_flag, fp_or_flag),
        make("ga_to_bf16", ga_to_bf16, fp_to_bf16),
        make("ga_sum_bf16", ga_sum_bf16, fp_sum_bf16),
        make("ga_begin_boundary", ga_begin_boundary, fp_begin_boundary),
        make("ga_scale_sum_squares", ga_scale_sum_squares, fp_scale_sum_squares),
        make("ga_segment_squares", ga_segment_squares, fp_segment_squares),
        make("ga_finish_norm", ga_finish_norm, fp_finish_norm),
        make("ga_scale_by", ga_scale_by, fp_scale_by),
        make("ga_scaler_gather", ga_scaler_gather, fp_scaler_gather),
        make("ga_scaler_update", ga_scaler_update, fp_scaler_update),
        make("ga_scale_loss", ga_scale_loss, fp_scale_loss),
        make("ga_opt_step", ga_opt_step, fp_opt_step),
        make("ga_opt_advance", ga_opt_advance, fp_opt_advance),
        make("ga_claim_schedule", ga_claim_schedule, fp_claim_schedule),
        make("ga_opt_copy", ga_opt_copy, fp_opt_copy),
        make("ga_layout_sizes", ga_layout_sizes, fp_layout_sizes),
    };
    return kernels;
}

} // namespace

const KernelInfo *find_kernel(const std::string &name) {
    for (const auto &k : registry())
        if (k.name == name) return &k;
    return nullptr;
}

} // namespace sim
