/* The CUDA kernels. NVRTC compiles this file at first use, prefixed with math.cuh (the
 * per-element arithmetic, also compiled and tested on the host), for the device's exact
 * architecture. Kernels are thin: they index, load, call math.cuh and store. All launches are
 * ordered on the caller's stream; nothing here synchronises with the host.
 *
 * Layouts shared with Rust (src/backend/cuda/layout.rs) are plain structs of fixed-width fields. */

/* One tensor of an accumulator: where it starts in the flat FP32 master, its length, its dtype. */
typedef struct {
    ga_u64 offset;
    ga_u64 numel;
    int dtype;
    int pad;
} ga_tensor;

/* A piece of one tensor that one thread block handles in a multi-tensor launch. */
typedef struct {
    ga_u64 tensor;
    ga_u64 start;
    ga_u64 len;
} ga_chunk;

/* One tensor's gradient in one micro-batch: its device address and whether this is the tensor's
 * first write of the window (then it assigns instead of adding). */
typedef struct {
    ga_u64 grad;
    ga_u32 assign;
    ga_u32 pad;
} ga_source;

/* The gradients of up to GA_SOURCES_PER_LAUNCH consecutive tensors, passed by value as a kernel
 * parameter (4 KB of parameter space at most): a launch copies them, so an add needs no
 * host-to-device copy and can be captured into a CUDA graph. */
#define GA_SOURCES_PER_LAUNCH 224
typedef struct {
    ga_u64 first_tensor;
    ga_u64 count;
    ga_source s[GA_SOURCES_PER_LAUNCH];
} ga_sources;

/* The boundary's control values and results, in device memory: the control words are reduced
 * across ranks, then the kernels below fill in the rest. */
typedef struct {
    ga_u64 count;        /* reduced item count */
    ga_u64 microbatches; /* reduced micro-batch count */
    ga_u64 found_inf;    /* reduced: ranks that saw a non-finite value */
    ga_u64 ranks;        /* reduced: rank-windows summed (BY_WORLD's divisor) */
    ga_u64 dropped;      /* reduced: micro-batches dropped (DROP_MICROBATCH) */
    ga_u64 first_bad;    /* complement of the first non-finite place's key, MAX-reduced under
                          * DROP_MICROBATCH (so the ranks agree on the smallest key) */
    ga_u64 divisor;      /* what the sum is divided by; 0 = empty window */
    double grad_norm;
    double clip_coef;
    float second_factor; /* clip / divisor for the clipping pass; 1 = no second pass */
    ga_u32 empty;        /* no micro-batch, or nothing to divide by */
    ga_u32 pad;
} ga_boundary;

/* OverflowKey's words (src/comm/mod.rs): no place, and a place the host does not know. */
#define GA_KEY_NONE 0xffffffffffffffffull
#define GA_KEY_UNLOCATED 0ull

/* Threads per block and elements per block-chunk: the Rust side passes its own values as -D
 * options (src/backend/cuda/compile.rs), so the two cannot drift apart. */
#ifndef GA_THREADS
#define GA_THREADS 256
#endif
#ifndef GA_CHUNK
#define GA_CHUNK 8192
#endif

/* master[i] = (assign ? 0 : master[i]) + grad[i] * factor over one range, by one thread block,
 * with 16-byte loads and stores where both buffers are aligned for them. Returns whether this
 * thread wrote a non-finite value. */
__device__ static int ga_add_range(float *master, const void *grad, ga_u64 n, int dtype, float factor, int assign) {
    int bad = 0;
    ga_u64 done = 0;
    int aligned = (((size_t)master | (size_t)grad) & 15u) == 0;
    if (aligned && dtype == GA_DTYPE_F32) {
        ga_u64 vectors = n / 4;
        const float4 *g4 = (const float4 *)grad;
        float4 *m4 = (float4 *)master;
        for (ga_u64 v = threadIdx.x; v < vectors; v += blockDim.x) {
            float4 g = g4[v];
            float4 m = assign ? make_float4(0.f, 0.f, 0.f, 0.f) : m4[v];
            m.x = ga_accumulate_one(m.x, g.x, factor, assign);
            m.y = ga_accumulate_one(m.y, g.y, factor, assign);
            m.z = ga_accumulate_one(m.z, g.z, factor, assign);
            m.w = ga_accumulate_one(m.w, g.w, factor, assign);
            bad |= !ga_is_finite(m.x) | !ga_is_finite(m.y) | !ga_is_finite(m.z) | !ga_is_finite(m.w);
            m4[v] = m;
        }
        done = vectors * 4;
    } else if (aligned) {
        ga_u64 vectors = n / 8;
        const uint4 *g8 = (const uint4 *)grad;
        float4 *m4 = (float4 *)master;
        for (ga_u64 v = threadIdx.x; v < vectors; v += blockDim.x) {
            uint4 packed = g8[v];
            ga_u32 words[4] = {packed.x, packed.y, packed.z, packed.w};
            float g[8];
            for (int k = 0; k < 4; ++k) {
                unsigned short lo = (unsigned short)(words[k] & 0xffffu), hi = (unsigned short)(words[k] >> 16);
                g[2 * k] = dtype == GA_DTYPE_F16 ? ga_f16_to_f32(lo) : ga_bf16_to_f32(lo);
                g[2 * k + 1] = dtype == GA_DTYPE_F16 ? ga_f16_to_f32(hi) : ga_bf16_to_f32(hi);
            }
            for (int half = 0; half < 2; ++half) {
                float4 m = assign ? make_float4(0.f, 0.f, 0.f, 0.f) : m4[2 * v + half];
                m.x = ga_accumulate_one(m.x, g[4 * half], factor, assign);
                m.y = ga_accumulate_one(m.y, g[4 * half + 1], factor, assign);
                m.z = ga_accumulate_one(m.z, g[4 * half + 2], factor, assign);
                m.w = ga_accumulate_one(m.w, g[4 * half + 3], factor, assign);
                bad |= !ga_is_finite(m.x) | !ga_is_finite(m.y) | !ga_is_finite(m.z) | !ga_is_finite(m.w);
                m4[2 * v + half] = m;
            }
        }
        done = vectors * 8;
    }
    for (ga_u64 i = done + threadIdx.x; i < n; i += blockDim.x) {
        float m = ga_accumulate_one(assign ? 0.f : master[i], ga_load_grad(grad, i, dtype), factor, assign);
        bad |= !ga_is_finite(m);
        master[i] = m;
    }
    return bad;
}

/* Raises the window's sticky overflow flag if any thread of the block saw a non-finite value.
 * Every thread of the block must call it. */
__device__ static void ga_flag_block(int bad, ga_u32 *found_inf) {
    if (__syncthreads_or(bad) && threadIdx.x == 0) {
        atomicOr(found_inf, 1u);
    }
}

/* One micro-batch, up to GA_SOURCES_PER_LAUNCH tensors (every tensor of most models), one launch:
 * `chunks` are those tensors' chunks; block b handles chunks b, b + gridDim.x, ... */
extern "C" __global__ void __launch_bounds__(GA_THREADS) ga_add_multi(
    const ga_tensor *tensors, const ga_chunk *chunks, ga_u64 num_chunks, ga_sources sources, float *master,
    const ga_scaler_state *scaler, double weight, ga_u32 *found_inf) {
    float factor = ga_unscale_factor(weight, scaler->scale);
    int bad = 0;
    for (ga_u64 c = blockIdx.x; c < num_chunks; c += gridDim.x) {
        ga_chunk chunk = chunks[c];
        ga_tensor t = tensors[chunk.tensor];
        ga_source s = sources.s[chunk.tensor - sources.first_tensor];
        size_t bytes = t.dtype == GA_DTYPE_F32 ? 4 : 2;
        const char *grad = (const char *)(size_t)s.grad + chunk.start * bytes;
        bad |= ga_add_range(master + t.offset + chunk.start, grad, chunk.len, t.dtype, factor, (int)s.assign);
    }
    ga_flag_block(bad, found_inf);
}

/* One contribution to one tensor (add_tensor, as backward hooks deliver them). */
extern "C" __global__ void __launch_bounds__(GA_THREADS) ga_add_one(
    float *master, const void *grad, ga_u64 numel, int dtype, const ga_scaler_state *scaler, double weight, ga_u32 assign,
    ga_u32 *found_inf) {
    float factor = ga_unscale_factor(weight, scaler->scale);
    size_t bytes = dtype == GA_DTYPE_F32 ? 4 : 2;
    int bad = 0;
    for (ga_u64 start = (ga_u64)blockIdx.x * GA_CHUNK; start < numel; start += (ga_u64)gridDim.x * GA_CHUNK) {
        ga_u64 len = numel - start < GA_CHUNK ? numel - start : GA_CHUNK;
        bad |= ga_add_range(master + start, (const char *)grad + start * bytes, len, dtype, factor, (int)assign);
    }
    ga_flag_block(bad, found_inf);
}

/* Which tensors of a micro-batch go non-finite once unscaled and weighted, before anything is
 * added (DROP_MICROBATCH): each value times the add's own factor, the add's own multiply, so a
 * tensor is flagged exactly when ga_add_multi would write a non-finite value of it. Raises
 * flags[tensor]; launched over ga_add_multi's chunks and sources. */
extern "C" __global__ void __launch_bounds__(GA_THREADS) ga_check_multi(
    const ga_tensor *tensors, const ga_chunk *chunks, ga_u64 num_chunks, ga_sources sources,
    const ga_scaler_state *scaler, double weight, ga_u32 *flags) {
    float factor = ga_unscale_factor(weight, scaler->scale);
    for (ga_u64 c = blockIdx.x; c < num_chunks; c += gridDim.x) {
        ga_chunk chunk = chunks[c];
        ga_tensor t = tensors[chunk.tensor];
        const void *grad = (const void *)(size_t)sources.s[chunk.tensor - sources.first_tensor].grad;
        int bad = 0;
        for (ga_u64 i = chunk.start + threadIdx.x; i < chunk.start + chunk.len; i += blockDim.x) {
            bad |= !ga_is_finite(GA_MUL(ga_load_grad(grad, i, t.dtype), factor));
        }
        ga_flag_block(bad, flags + chunk.tensor);
    }
}

/* tensor_stats under SKIP_STEP: each tensor flagged in the micro-batch counts one more
 * non-finite micro-batch, and its flag is cleared for the next. */
extern "C" __global__ void __launch_bounds__(GA_THREADS) ga_count_flags(ga_u64 *counts, ga_u32 *flags, ga_u64 n) {
    for (ga_u64 i = (ga_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (ga_u64)gridDim.x * blockDim.x) {
        if (flags[i] != 0) {
            counts[i] += 1;
            flags[i] = 0;
        }
    }
}

/* A hook micro-batch's staging merged into the master (DROP_MICROBATCH): the add with a factor of
 * 1, exact, so one contribution lands with the bits ga_add_one gives. */
extern "C" __global__ void __launch_bounds__(GA_THREADS) ga_merge(
    float *master, const float *staged, ga_u64 numel, ga_u32 assign, ga_u32 *found_inf) {
    int bad = 0;
    for (ga_u64 start = (ga_u64)blockIdx.x * GA_CHUNK; start < numel; start += (ga_u64)gridDim.x * GA_CHUNK) {
        ga_u64 len = numel - start < GA_CHUNK ? numel - start : GA_CHUNK;
        bad |= ga_add_range(master + start, staged + start, len, GA_DTYPE_F32, 1.0f, (int)assign);
    }
    ga_flag_block(bad, found_inf);
}

/* This rank's control words before the cross-rank sum. */
/* The single-thread kernels below do their work in thread 0 of block 0 only, whatever the launch
 * geometry: a wider launch must not write the same words from several threads. */
#define GA_ONE_THREAD()                                \
    do {                                               \
        if (threadIdx.x != 0 || blockIdx.x != 0) {     \
            return;                                    \
        }                                              \
    } while (0)

extern "C" __global__ void ga_pack_control(ga_boundary *b, ga_u64 count, ga_u64 microbatches, const ga_u32 *found_inf, ga_u64 ranks,
                                           ga_u64 dropped, ga_u64 first_bad, int unlocated_if_flagged) {
    GA_ONE_THREAD();
    int flagged = found_inf != 0 && *found_inf != 0;
    b->count = count;
    b->microbatches = microbatches;
    b->found_inf = flagged ? 1 : 0;
    b->ranks = ranks;
    b->dropped = dropped;
    /* A window flagged where the host knows no place (a sum that overflowed the master) may have
     * gone non-finite anywhere, so it sorts before every located place (OverflowKey::UNLOCATED);
     * a shard's flag that no rank names is a sum's over the ranks, reported as the reduction's
     * (unless `unlocated_if_flagged`: a restored window). */
    if (first_bad == GA_KEY_NONE && flagged && microbatches != 0 && unlocated_if_flagged) {
        first_bad = GA_KEY_UNLOCATED;
    }
    b->first_bad = ~first_bad;
}

/* A bf16 wire's outgoing words: each FP32 value rounded to bfloat16 once (to nearest even). */
extern "C" __global__ void __launch_bounds__(GA_THREADS) ga_to_bf16(unsigned short *out, const float *in, ga_u64 n) {
    for (ga_u64 i = (ga_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (ga_u64)gridDim.x * blockDim.x) {
        out[i] = ga_f32_to_bf16(in[i]);
    }
}

/* A bf16 wire's arrival: `out[i]` is the FP32 sum in rank order of the `world` contributions of
 * `n` words each (ga_sum_bf16_at). */
extern "C" __global__ void __launch_bounds__(GA_THREADS) ga_sum_bf16(float *out, const unsigned short *in, ga_u64 n, ga_u64 world) {
    for (ga_u64 i = (ga_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (ga_u64)gridDim.x * blockDim.x) {
        out[i] = ga_sum_bf16_at(in, n, world, i);
    }
}

/* Merges an overflow flag written on another stream (a sharded accumulation's bucket adds on
 * its communication stream) into the window's, once the streams are ordered. */
extern "C" __global__ void ga_or_flag(ga_u32 *into, const ga_u32 *from) {
    GA_ONE_THREAD();
    if (*from != 0) {
        *into = 1;
    }
}

/* After the control words are summed: what the boundary divides by. */
extern "C" __global__ void ga_begin_boundary(ga_boundary *b, int normalize) {
    GA_ONE_THREAD();
    ga_u64 divisor = ga_divisor(normalize, b->count, b->microbatches, b->ranks);
    if (b->microbatches == 0 && b->dropped != 0) {
        /* Every micro-batch of every rank was dropped: the master is zeros, the step is skipped. */
        divisor = 1;
        b->found_inf = 1;
    }
    b->divisor = divisor;
    b->empty = (b->microbatches == 0 && b->dropped == 0) || divisor == 0 ? 1u : 0u;
    b->grad_norm = 0.0;
    b->clip_coef = 1.0;
    b->second_factor = 1.0f;
}

/* Per NORM_BLOCK block of the summed master: its sum of squares as on entry (partials[block]),
 * then, when `normalize` is set, buf *= 1 / divisor. A half-warp owns a block: lane j sums
 * elements j, j + 16, ... in order, and the lanes combine by halving through shuffles, exactly
 * as ga_block_sum_squares (so the bits equal the CPU backend's). */
extern "C" __global__ void __launch_bounds__(GA_THREADS) ga_scale_sum_squares(
    float *buf, ga_u64 n, const ga_boundary *b, int normalize, double *partials) {
    if (b->empty) {
        return;
    }
    float factor = ga_normalize_factor(b->divisor);
    int scale = normalize && factor != 1.0f;
    ga_u64 num_blocks = (n + GA_NORM_BLOCK - 1) / GA_NORM_BLOCK;
    const ga_u64 per_cta = GA_THREADS / GA_NORM_LANES;
    ga_u32 lane = threadIdx.x % GA_NORM_LANES;
    for (ga_u64 base = (ga_u64)blockIdx.x * per_cta; base < num_blocks; base += (ga_u64)gridDim.x * per_cta) {
        ga_u64 block = base + threadIdx.x / GA_NORM_LANES;
        double acc = 0.0;
        if (block < num_blocks) {
            ga_u64 start = block * GA_NORM_BLOCK;
            ga_u64 end = start + GA_NORM_BLOCK < n ? start + GA_NORM_BLOCK : n;
            for (ga_u64 i = start + lane; i < end; i += GA_NORM_LANES) {
                float v = buf[i];
                acc = GA_DADD(acc, ga_square(v));
                if (scale) {
                    buf[i] = GA_MUL(v, factor);
                }
            }
        }
        for (int width = GA_NORM_LANES / 2; width > 0; width /= 2) {
            double other = __shfl_down_sync(0xffffffffu, acc, width, GA_NORM_LANES);
            if (lane < (ga_u32)width) {
                acc = GA_DADD(acc, other);
            }
        }
        if (block < num_blocks && lane == 0) {
            partials[block] = acc;
        }
    }
}

/* tensor_stats: each segment's sum of squares (a segment is one tensor's values inside one norm
 * block; `spans` lists [start, end) pairs of master elements), summed as ga_scale_sum_squares
 * sums a block, from the segment's first element, so the bits are the CPU's
 * math::block_sum_squares of the segment. `master` holds the elements [lo, hi) (this rank's shard,
 * or all of them); a segment outside (another rank's shard) is not here: -1
 * (tensor_stats::NOT_HERE). */
extern "C" __global__ void __launch_bounds__(GA_THREADS) ga_segment_squares(
    const float *master, const ga_u64 *spans, ga_u64 num_spans, ga_u64 lo, ga_u64 hi, double *out) {
    const ga_u64 per_cta = GA_THREADS / GA_NORM_LANES;
    ga_u32 lane = threadIdx.x % GA_NORM_LANES;
    for (ga_u64 base = (ga_u64)blockIdx.x * per_cta; base < num_spans; base += (ga_u64)gridDim.x * per_cta) {
        ga_u64 s = base + threadIdx.x / GA_NORM_LANES;
        int here = 0;
        double acc = 0.0;
        if (s < num_spans) {
            ga_u64 start = spans[2 * s], end = spans[2 * s + 1];
            here = start >= lo && end <= hi;
            for (ga_u64 i = start + lane; here && i < end; i += GA_NORM_LANES) {
                acc = GA_DADD(acc, ga_square(master[i - lo]));
            }
        }
        for (int width = GA_NORM_LANES / 2; width > 0; width /= 2) {
            double other = __shfl_down_sync(0xffffffffu, acc, width, GA_NORM_LANES);
            if (lane < (ga_u32)width) {
                acc = GA_DADD(acc, other);
            }
        }
        if (s < num_spans && lane == 0) {
            out[s] = here ? acc : -1.0;
        }
    }
}

/* The global norm from the block sums, folded as cpu::fold_block_sums (ga_fold_block_sums), and
 * the clip coefficient. The fold's fixed shape makes the result bitwise reproducible and lets the
 * block add in parallel: thread t owns lanes t + k * GA_THREADS, adds a row of GA_FOLD_LANES sums
 * at a time (coalesced loads, GA_FOLD_PER_THREAD independent chains), and halves in registers
 * while the partners are its own lanes, then through shared memory. Launched with one block of
 * exactly GA_THREADS threads (the lane ownership depends on it). */
#define GA_FOLD_PER_THREAD (GA_FOLD_LANES / GA_THREADS)
#ifdef __CUDACC__
#define GA_UNROLL _Pragma("unroll")
#else
#define GA_UNROLL
#endif
#if GA_FOLD_LANES % GA_THREADS != 0 || (GA_FOLD_PER_THREAD & (GA_FOLD_PER_THREAD - 1)) != 0
#error "the fold's lanes must split into a power of two per thread"
#endif
extern "C" __global__ void __launch_bounds__(GA_THREADS) ga_finish_norm(ga_boundary *b, const double *partials, ga_u64 num_blocks, double max_norm) {
    __shared__ double lanes[GA_THREADS];
    if (b->empty || blockIdx.x != 0) {
        return;
    }
    double acc[GA_FOLD_PER_THREAD];
GA_UNROLL
    for (int k = 0; k < GA_FOLD_PER_THREAD; ++k) {
        acc[k] = 0.0;
    }
    for (ga_u64 row = 0; row < num_blocks; row += GA_FOLD_LANES) {
GA_UNROLL
        for (int k = 0; k < GA_FOLD_PER_THREAD; ++k) {
            ga_u64 i = row + threadIdx.x + (ga_u64)k * GA_THREADS;
            if (i < num_blocks) {
                acc[k] = GA_DADD(acc[k], partials[i]);
            }
        }
    }
    ga_u64 width = ga_fold_first_width(num_blocks < GA_FOLD_LANES ? num_blocks : GA_FOLD_LANES);
    /* Lane t + k * GA_THREADS meets lane t + (k + width / GA_THREADS) * GA_THREADS: the same thread's. */
GA_UNROLL
    for (int w = GA_FOLD_PER_THREAD / 2; w > 0; w /= 2) {
        if (width == (ga_u64)w * GA_THREADS) {
            for (int k = 0; k < w; ++k) {
                acc[k] = GA_DADD(acc[k], acc[k + w]);
            }
            width /= 2;
        }
    }
    lanes[threadIdx.x] = acc[0];
    __syncthreads();
    for (; width > 0; width /= 2) {
        if (threadIdx.x < width) {
            lanes[threadIdx.x] = GA_DADD(lanes[threadIdx.x], lanes[threadIdx.x + width]);
        }
        __syncthreads();
    }
    double sum = lanes[0];
    if (threadIdx.x != 0) {
        return;
    }
    double norm = sqrt(sum) / (double)b->divisor;
    b->grad_norm = norm;
    /* A non-finite norm is an overflow of the reduction itself (every rank's window was finite):
     * f64 squares of f32 values cannot overflow and NaN propagates (Boundary::info). */
    if (!(norm - norm == 0.0)) {
        b->found_inf = 1;
    }
    if (max_norm != 0.0) {
        double coef = ga_clip_coef(norm, max_norm);
        b->clip_coef = coef;
        b->second_factor = (float)(coef / (double)b->divisor);
    }
}

/* The clipping pass (with clipping on): buf *= clip / divisor, skipped when that is 1. */
extern "C" __global__ void __launch_bounds__(GA_THREADS) ga_scale_by(float *buf, ga_u64 n, const ga_boundary *b) {
    if (b->empty) {
        return;
    }
    float factor = b->second_factor;
    if (factor == 1.0f) {
        return;
    }
    for (ga_u64 i = (ga_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (ga_u64)gridDim.x * blockDim.x) {
        buf[i] = GA_MUL(buf[i], factor);
    }
}

/* Bits of ga_scaler_state.pending_found_inf: a gathered boundary overflowed / was empty. */
#define GA_PENDING_FOUND_INF 1u
#define GA_PENDING_EMPTY 2u
#define GA_PENDING_DROPPED 4u

/* Gathers one synced accumulator's agreed overflow flag for the scaler's next update. */
extern "C" __global__ void ga_scaler_gather(ga_scaler_state *s, const ga_boundary *b) {
    GA_ONE_THREAD();
    if (b->empty) {
        s->pending_found_inf |= GA_PENDING_EMPTY;
        return;
    }
    if (b->found_inf != 0) {
        s->pending_found_inf |= GA_PENDING_FOUND_INF;
    }
    if (b->dropped != 0) {
        s->pending_found_inf |= GA_PENDING_DROPPED;
    }
}

/* One optimizer step of the scaler, from the gathered flags, without a host round trip. A step
 * whose window was empty on every rank (which the CPU path refuses as EMPTY_WINDOW) is no step:
 * the state stays as it was. */
extern "C" __global__ void ga_scaler_update(ga_scaler_state *s, ga_scaler_rule rule) {
    GA_ONE_THREAD();
    ga_u32 pending = s->pending_found_inf;
    s->pending_found_inf = 0;
    if (pending & GA_PENDING_EMPTY) {
        return;
    }
    ga_scaler_next(s, &rule, (pending & GA_PENDING_FOUND_INF) != 0, (pending & GA_PENDING_DROPPED) != 0);
}

/* loss *= scale in place, each element rounded back to its dtype. */
extern "C" __global__ void __launch_bounds__(GA_THREADS) ga_scale_loss(void *loss, ga_u64 n, int dtype, const ga_scaler_state *s) {
    float scale = s->scale;
    for (ga_u64 i = (ga_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (ga_u64)gridDim.x * blockDim.x) {
        ga_scale_loss_one(loss, i, dtype, scale);
    }
}

/* ---- The optimizer step (src/backend/cuda/optimizer.rs) ---- */

/* One tensor's options in the optimizer: its learning-rate factor, weight decay on or off, and
 * the dtype of its model weights. */
typedef struct {
    float lr_scale;
    ga_u32 decays;
    int dtype;
    ga_u32 pad;
} ga_opt_tensor;

/* A piece of at most GA_CHUNK elements of one tensor, from element `start` of the tensor: `at`
 * is the index of its first element in the optimizer's held range (the step), or its byte offset
 * in the all-gather's staging (the copies). A launch's chunks list tensor after tensor. */
typedef struct {
    ga_u64 tensor;
    ga_u64 start;
    ga_u64 len;
    ga_u64 at;
} ga_opt_chunk;

/* The model weights' device addresses of up to GA_SOURCES_PER_LAUNCH consecutive tensors, passed
 * by value (as ga_sources), so that a step needs no host-to-device copy. */
typedef struct {
    ga_u64 first_tensor;
    ga_u64 count;
    ga_u64 w[GA_SOURCES_PER_LAUNCH];
} ga_weights;

/* The skip rule of the step, from the synced boundary: an empty window or one that overflowed
 * changes nothing (the CPU path refuses the one and skips the other). */
__device__ static int ga_opt_skips(const ga_boundary *b) { return b->empty != 0 || b->found_inf != 0; }

/* One optimizer step over the held range, fused: the reduced gradient `grad`, the masters and
 * state (`second` NULL for SGD) indexed by the held index, each new master written into its model
 * weight. The step count lives in `*steps` (advanced by ga_opt_advance after this launch) and the
 * learning rate in `*lr`, so the skip, the bias correction and the schedule are decided here,
 * without the host. */
extern "C" __global__ void __launch_bounds__(GA_THREADS) ga_opt_step(
    const ga_opt_tensor *tensors, const ga_opt_chunk *chunks, ga_u64 num_chunks, ga_weights weights, const float *grad,
    float *master, float *first, float *second, ga_u64 held_start, const ga_boundary *b, const ga_u64 *steps, const float *lr, ga_opt_rule rule) {
    if (ga_opt_skips(b)) {
        return;
    }
    ga_u64 t = *steps + 1;
    float base_lr = *lr;
    int stochastic = rule.rounding == GA_ROUND_STOCHASTIC;
    ga_u64 key = ga_round_key(rule.seed, t);
    int formats = rule.masters != GA_MASTERS_F32 || rule.moments != GA_MOMENTS_F32;
    ga_u64 key_m = ga_moment_key(rule.moment_seed, t);
    for (ga_u64 c = blockIdx.x; c < num_chunks; c += gridDim.x) {
        ga_opt_chunk chunk = chunks[c];
        ga_opt_tensor tensor = tensors[chunk.tensor];
        ga_opt_scalars k = ga_opt_scalars_for(&rule, base_lr, tensor.lr_scale, (int)tensor.decays, t);
        void *out = (void *)(size_t)weights.w[chunk.tensor - weights.first_tensor];
        if (formats) {
            /* Remainder masters are over bf16 weights only, where the split writes the weight; with
             * no masters the weight is read back as the master and written as FP32 masters write. */
            unsigned short *out16 = (unsigned short *)out, *rem = (unsigned short *)master;
            for (ga_u64 i = threadIdx.x; i < chunk.len; i += blockDim.x) {
                ga_u64 h = chunk.at + i, flat = held_start + h, o = chunk.start + i;
                float w;
                if (rule.masters == GA_MASTERS_REMAINDER) {
                    w = ga_join_master(out16[o], rem[h]);
                } else if (rule.masters == GA_MASTERS_NONE) {
                    w = ga_read_weight(out, o, (int)tensor.dtype);
                } else {
                    w = master[h];
                }
                ga_opt_formats_one(&rule, &k, grad[h], &w, first, second, h, key_m, flat);
                if (rule.masters == GA_MASTERS_REMAINDER) {
                    ga_split_master(w, &out16[o], &rem[h]);
                    continue;
                }
                if (rule.masters == GA_MASTERS_F32) {
                    master[h] = w;
                }
                ga_write_weight(out, o, tensor.dtype, w, stochastic, key, flat);
            }
            continue;
        }
        for (ga_u64 i = threadIdx.x; i < chunk.len; i += blockDim.x) {
            ga_u64 h = chunk.at + i;
            float w = master[h];
            if (rule.algorithm == GA_OPT_ADAMW) {
                ga_adamw_one(&k, grad[h], &w, &first[h], &second[h]);
            } else {
                ga_sgd_one(&k, grad[h], &w, &first[h]);
            }
            master[h] = w;
            ga_write_weight(out, chunk.start + i, tensor.dtype, w, stochastic, key, held_start + h);
        }
    }
}

/* Mixes the learning rate and step count a sharded optimizer step will read (as the device holds
 * them: a schedule may write them there) into this rank's claim, words 1 and 3 of
 * protocol::claim_words (the layout and its complement), so that ranks whose values differ fail
 * the claim together. */
extern "C" __global__ void ga_claim_schedule(ga_u64 *words, const ga_u32 *lr_bits, const ga_u64 *steps) {
    GA_ONE_THREAD();
    ga_u64 h = ga_mix((ga_u64)*lr_bits ^ ga_mix(*steps ^ 0xd1b54a32d192ed03ull));
    words[1] ^= h;
    words[3] ^= h;
}

/* After ga_opt_step: the step count advances unless the step was skipped. */
extern "C" __global__ void ga_opt_advance(const ga_boundary *b, ga_u64 *steps) {
    GA_ONE_THREAD();
    if (!ga_opt_skips(b)) {
        *steps += 1;
    }
}

/* Copies pieces of the model weights into the all-gather's staging (`to_staging`) or out of it,
 * in 16-bit words (every dtype is a whole number of them). */
extern "C" __global__ void __launch_bounds__(GA_THREADS) ga_opt_copy(
    const ga_opt_tensor *tensors, const ga_opt_chunk *chunks, ga_u64 num_chunks, ga_weights weights, unsigned short *staging,
    ga_u32 to_staging) {
    for (ga_u64 c = blockIdx.x; c < num_chunks; c += gridDim.x) {
        ga_opt_chunk chunk = chunks[c];
        ga_u64 words = tensors[chunk.tensor].dtype == GA_DTYPE_F32 ? 2 : 1;
        unsigned short *w = (unsigned short *)(size_t)weights.w[chunk.tensor - weights.first_tensor] + chunk.start * words;
        unsigned short *s = staging + chunk.at / 2;
        for (ga_u64 i = threadIdx.x; i < chunk.len * words; i += blockDim.x) {
            if (to_staging) {
                s[i] = w[i];
            } else {
                w[i] = s[i];
            }
        }
    }
}

/* The sizes of the structs shared with Rust, for the GPU suite to compare with the Rust layouts. */
extern "C" __global__ void ga_layout_sizes(ga_u64 *out) {
    GA_ONE_THREAD();
    out[0] = sizeof(ga_tensor);
    out[1] = sizeof(ga_chunk);
    out[2] = sizeof(ga_source);
    out[3] = sizeof(ga_boundary);
    out[4] = sizeof(ga_scaler_state);
    out[5] = sizeof(ga_scaler_rule);
    out[6] = sizeof(ga_sources);
    out[7] = sizeof(ga_opt_rule);
    out[8] = sizeof(ga_opt_tensor);
    out[9] = sizeof(ga_opt_chunk);
    out[10] = sizeof(ga_weights);
}
