/* The per-element arithmetic of the CUDA kernels, as plain C that compiles for the device (NVRTC)
 * and for the host (any C99 compiler). CI compiles this file on the host and checks it against
 * the contract every backend shares (src/math.rs), so the device math is tested without a GPU.
 *
 * Every function rounds exactly like its CPU twin: a rounded multiply then a rounded add (never a
 * fused multiply-add), f64 sums of squares, f32 factors rounded once from f64. On the device the
 * GA_MUL / GA_ADD macros use the explicitly rounded intrinsics, so compiler contraction cannot
 * change a bit; a host build must use -ffp-contract=off. */
#ifndef GRADACC_CUDA_MATH_CUH
#define GRADACC_CUDA_MATH_CUH

#ifdef __CUDACC__
/* unused: the host-only reference functions are not called by every kernel build. */
#define GA_HD __host__ __device__ static inline __attribute__((unused))
#else
#include <math.h>
#include <string.h>
#define GA_HD static inline __attribute__((unused))
#endif

#if defined(__CUDA_ARCH__)
#define GA_MUL(a, b) __fmul_rn((a), (b))
#define GA_ADD(a, b) __fadd_rn((a), (b))
#define GA_DMUL(a, b) __dmul_rn((a), (b))
#define GA_DADD(a, b) __dadd_rn((a), (b))
#else
#define GA_MUL(a, b) ((a) * (b))
#define GA_ADD(a, b) ((a) + (b))
#define GA_DMUL(a, b) ((a) * (b))
#define GA_DADD(a, b) ((a) + (b))
#endif

typedef unsigned int ga_u32;
typedef unsigned long long ga_u64;

/* Dtype codes, as GRADACC_DTYPE_* in the C API. */
#define GA_DTYPE_F32 0
#define GA_DTYPE_F16 1
#define GA_DTYPE_BF16 2

/* Elements per block of the deterministic sum of squares, and partial sums per block: element i
 * of a block goes to lane i % GA_NORM_LANES (math::NORM_BLOCK and math::NORM_LANES). */
#define GA_NORM_BLOCK 4096
#define GA_NORM_LANES 16

/* Lanes of the fold of the block sums (math::FOLD_LANES): block sum b goes to lane
 * b % GA_FOLD_LANES. */
#define GA_FOLD_LANES 8192

/* Normalisation modes, as GRADACC_NORMALIZE_* in the C API. */
#define GA_NORMALIZE_BY_COUNT 0
#define GA_NORMALIZE_BY_MICROBATCHES 1
#define GA_NORMALIZE_BY_WORLD 2
#define GA_NORMALIZE_NONE 3

GA_HD float ga_bits_to_f32(ga_u32 bits) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(bits);
#else
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

GA_HD ga_u32 ga_f32_to_bits(float f) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    ga_u32 bits;
    memcpy(&bits, &f, sizeof bits);
    return bits;
#endif
}

/* Not inf and not NaN, from the bits (no libm, no fast-math surprises). */
GA_HD int ga_is_finite(float v) { return (ga_f32_to_bits(v) & 0x7f800000u) != 0x7f800000u; }

/* bfloat16 bits to f32: the bits are the upper half of an f32. */
GA_HD float ga_bf16_to_f32(unsigned short bits) { return ga_bits_to_f32((ga_u32)bits << 16); }

/* IEEE binary16 bits to f32 (exact). The device uses the hardware conversion, which gives the
 * same value; the host path is the integer conversion of math::f16_to_f32. */
GA_HD float ga_f16_to_f32(unsigned short bits) {
#if defined(__CUDA_ARCH__)
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(bits));
    return f;
#else
    ga_u32 sign = ((ga_u32)bits & 0x8000u) << 16;
    ga_u32 exp = (bits >> 10) & 0x1fu;
    ga_u32 mant = bits & 0x3ffu;
    ga_u32 magnitude;
    if (exp == 0x1f) {
        magnitude = 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        magnitude = ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        magnitude = 0;
    } else {
        magnitude = ga_f32_to_bits((float)mant * ga_bits_to_f32(0x33800000u)); /* mant * 2^-24 */
    }
    return ga_bits_to_f32(sign | magnitude);
#endif
}

/* f32 to binary16 bits, rounding to nearest even (math::f32_to_f16). Integer arithmetic on both
 * sides: it only scales a loss buffer, where speed does not matter. */
GA_HD unsigned short ga_f32_to_f16(float value) {
    ga_u32 x = ga_f32_to_bits(value);
    unsigned short sign = (unsigned short)((x >> 16) & 0x8000u);
    int exp = (int)((x >> 23) & 0xffu);
    ga_u32 mant = x & 0x7fffffu;
    if (exp == 0xff) {
        return (unsigned short)(sign | 0x7c00u | (mant != 0 ? (0x200u | (mant >> 13)) : 0u));
    }
    int e = exp - 127 + 15;
    if (e >= 0x1f) {
        return (unsigned short)(sign | 0x7c00u);
    }
    if (e <= 0) {
        if (e < -10) {
            return sign;
        }
        ga_u32 m = mant | 0x800000u;
        ga_u32 shift = (ga_u32)(14 - e);
        ga_u32 half = 1u << (shift - 1);
        ga_u32 rest = m & ((1u << shift) - 1);
        unsigned short h = (unsigned short)(m >> shift);
        if (rest > half || (rest == half && (h & 1u) == 1u)) {
            h += 1;
        }
        return (unsigned short)(sign | h);
    }
    unsigned short h = (unsigned short)(((ga_u32)e << 10) | (mant >> 13));
    ga_u32 rest = mant & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u) == 1u)) {
        h += 1; /* may carry into the exponent, up to infinity: the correct rounding */
    }
    return (unsigned short)(sign | h);
}

/* f32 to bfloat16 bits, rounding to nearest even; NaN stays NaN (math::f32_to_bf16). */
GA_HD unsigned short ga_f32_to_bf16(float value) {
    ga_u32 x = ga_f32_to_bits(value);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((x >> 16) | 0x40u);
    }
    ga_u32 rounding = 0x7fffu + ((x >> 16) & 1u);
    return (unsigned short)((x + rounding) >> 16);
}

/* Element i of a bf16 wire's reduction: `world` contributions of `n` bfloat16 words each (rank
 * q's at q * n), widened exactly and summed in FP32 in rank order, each add rounded (the CPU's
 * shares::sum_and_pass on widened words). */
GA_HD float ga_sum_bf16_at(const unsigned short *in, ga_u64 n, ga_u64 world, ga_u64 i) {
    float sum = ga_bf16_to_f32(in[i]);
    for (ga_u64 q = 1; q < world; ++q) {
        sum = GA_ADD(sum, ga_bf16_to_f32(in[q * n + i]));
    }
    return sum;
}

/* One gradient element of any dtype, widened to f32. */
GA_HD float ga_load_grad(const void *grad, ga_u64 i, int dtype) {
    if (dtype == GA_DTYPE_F32) {
        return ((const float *)grad)[i];
    }
    unsigned short bits = ((const unsigned short *)grad)[i];
    return dtype == GA_DTYPE_F16 ? ga_f16_to_f32(bits) : ga_bf16_to_f32(bits);
}

/* `weight / scale`, rounded once to f32: the multiplier of every element of a micro-batch
 * (math::unscale_factor). */
GA_HD float ga_unscale_factor(double weight, float scale) { return (float)(weight / (double)scale); }

/* One element of the fused pass: a rounded multiply, then a rounded add (math::accumulate_one). */
GA_HD float ga_accumulate_one(float master, float grad, float factor, int assign) {
    float v = GA_MUL(grad, factor);
    return assign ? v : GA_ADD(master, v);
}

/* `v * v` in f64 (exact: the product of two f32 values fits an f64). */
GA_HD double ga_square(float v) { return GA_DMUL((double)v, (double)v); }

/* Combines per-lane sums by halving, lane j += lane j + w for w = 8, 4, 2, 1 (math::combine_lanes). */
GA_HD double ga_combine_lanes(double *lanes) {
    for (int width = GA_NORM_LANES / 2; width > 0; width /= 2) {
        for (int j = 0; j < width; ++j) {
            lanes[j] = GA_DADD(lanes[j], lanes[j + width]);
        }
    }
    return lanes[0];
}

/* Sum of squares of one block of at most GA_NORM_BLOCK elements (math::block_sum_squares). */
GA_HD double ga_block_sum_squares(const float *block, ga_u32 n) {
    double lanes[GA_NORM_LANES];
    for (int j = 0; j < GA_NORM_LANES; ++j) {
        lanes[j] = 0.0;
    }
    for (ga_u32 i = 0; i < n; ++i) {
        lanes[i % GA_NORM_LANES] = GA_DADD(lanes[i % GA_NORM_LANES], ga_square(block[i]));
    }
    return ga_combine_lanes(lanes);
}

/* The first width of the fold's halving over `used` lanes: half the smallest power of two that
 * covers them, 0 for one lane or none (math::fold_first_width). */
GA_HD ga_u64 ga_fold_first_width(ga_u64 used) {
    ga_u64 covering = 1;
    while (covering < used) {
        covering *= 2;
    }
    return covering / 2;
}

/* The sum of squares from `n` block sums (cpu::fold_block_sums): sum b into lane
 * b % GA_FOLD_LANES, each lane in block order from 0, then the lanes halved from
 * ga_fold_first_width. `lanes` is scratch of GA_FOLD_LANES values. ga_finish_norm adds in exactly
 * this order, in parallel; this serial copy is the host tests' reference. */
GA_HD double ga_fold_block_sums(const double *sums, ga_u64 n, double *lanes) {
    for (ga_u64 j = 0; j < GA_FOLD_LANES; ++j) {
        lanes[j] = 0.0;
    }
    for (ga_u64 b = 0; b < n; ++b) {
        lanes[b % GA_FOLD_LANES] = GA_DADD(lanes[b % GA_FOLD_LANES], sums[b]);
    }
    for (ga_u64 width = ga_fold_first_width(n < GA_FOLD_LANES ? n : GA_FOLD_LANES); width > 0; width /= 2) {
        for (ga_u64 j = 0; j < width; ++j) {
            lanes[j] = GA_DADD(lanes[j], lanes[j + width]);
        }
    }
    return lanes[0];
}

/* What the boundary divides the summed gradient by; 0 means an empty window. */
GA_HD ga_u64 ga_divisor(int normalize, ga_u64 total_count, ga_u64 total_microbatches, ga_u64 world) {
    switch (normalize) {
    case GA_NORMALIZE_BY_COUNT: return total_count;
    case GA_NORMALIZE_BY_MICROBATCHES: return total_microbatches;
    case GA_NORMALIZE_BY_WORLD: return world;
    default: return 1;
    }
}

/* The normalisation multiplier `1 / divisor`, rounded once to f32. */
GA_HD float ga_normalize_factor(ga_u64 divisor) { return (float)(1.0 / (double)divisor); }

/* The clip coefficient for a global norm: max / (norm + 1e-6), at most 1; 1 for a non-finite norm
 * (an overflowing step is skipped anyway) or when clipping is off (max_norm 0). */
GA_HD double ga_clip_coef(double grad_norm, double max_norm) {
    if (max_norm == 0.0 || !(grad_norm - grad_norm == 0.0)) {
        return 1.0;
    }
    double coef = max_norm / (grad_norm + 1e-6);
    return coef < 1.0 ? coef : 1.0;
}

/* The dynamic loss scaler's state and rule (src/scaler.rs); the layout is shared with Rust. */
typedef struct {
    float scale;
    ga_u32 growth_tracker;
    ga_u32 hysteresis_tracker;
    /* Sticky: an overflow needed a backoff at min_scale (the state was left as it was). */
    ga_u32 at_minimum;
    ga_u64 steps;
    ga_u64 skipped_steps;
    ga_u64 growths;
    ga_u64 backoffs;
    /* The flag the last update applied (the step was skipped). */
    ga_u32 last_skipped;
    /* Flags gathered from accumulators for the next update (GA_PENDING_* in kernels.cu). */
    ga_u32 pending_found_inf;
} ga_scaler_state;

typedef struct {
    float growth_factor;
    float backoff_factor;
    float min_scale;
    float max_scale;
    ga_u32 growth_interval;
    ga_u32 hysteresis;
    ga_u32 consecutive_hysteresis;
    ga_u32 dynamic;
} ga_scaler_rule;

/* One optimizer step's update of the scaler (scaler::next_state): a window that dropped
 * micro-batches (`dropped`) backs off as an overflow does, but its step is taken and a drop at
 * min_scale keeps the scale. Returns 0, or 1 when an overflow needs a backoff at min_scale: then
 * only `at_minimum` is raised. */
GA_HD int ga_scaler_next(ga_scaler_state *s, const ga_scaler_rule *c, int found_inf, int dropped) {
    ga_scaler_state n = *s;
    n.steps += 1;
    n.last_skipped = found_inf ? 1u : 0u;
    n.skipped_steps += found_inf ? 1u : 0u;
    if (!c->dynamic) {
        *s = n;
        return 0;
    }
    if (found_inf || dropped) {
        n.growth_tracker = 0;
        n.hysteresis_tracker = s->hysteresis_tracker > 0 ? s->hysteresis_tracker - 1 : 0;
        if (n.hysteresis_tracker == 0 && (found_inf || s->scale > c->min_scale)) {
            if (s->scale <= c->min_scale) {
                s->at_minimum = 1;
                return 1;
            }
            float backed = GA_MUL(s->scale, c->backoff_factor);
            n.scale = backed > c->min_scale ? backed : c->min_scale;
            n.backoffs += 1;
        }
    } else {
        if (c->consecutive_hysteresis) {
            n.hysteresis_tracker = c->hysteresis;
        }
        n.growth_tracker = s->growth_tracker + 1;
        if (n.growth_tracker == c->growth_interval) {
            n.growth_tracker = 0;
            n.hysteresis_tracker = c->hysteresis;
            float grown = GA_MUL(s->scale, c->growth_factor);
            grown = grown < c->max_scale ? grown : c->max_scale;
            /* As PyTorch: never grow into infinity. */
            if (ga_is_finite(grown) && grown > s->scale) {
                n.scale = grown;
                n.growths += 1;
            }
        }
    }
    *s = n;
    return 0;
}

/* One loss element times the scale, rounded back to its dtype (Scaler::scale_loss). */
GA_HD void ga_scale_loss_one(void *loss, ga_u64 i, int dtype, float scale) {
    if (dtype == GA_DTYPE_F32) {
        float *p = (float *)loss + i;
        *p = GA_MUL(*p, scale);
    } else if (dtype == GA_DTYPE_F16) {
        unsigned short *p = (unsigned short *)loss + i;
        *p = ga_f32_to_f16(GA_MUL(ga_f16_to_f32(*p), scale));
    } else {
        unsigned short *p = (unsigned short *)loss + i;
        *p = ga_f32_to_bf16(GA_MUL(ga_bf16_to_f32(*p), scale));
    }
}

/* ---- The optimizer step (src/optimizer/update.rs and rounding.rs) ---- */

/* Algorithm and rounding codes of ga_opt_rule. */
#define GA_OPT_ADAMW 1
#define GA_OPT_SGD 2
#define GA_ROUND_NEAREST 0
#define GA_ROUND_STOCHASTIC 1
/* State format codes of ga_opt_rule (format::StateFormat::codes). */
#define GA_MASTERS_F32 0
#define GA_MASTERS_REMAINDER 1
#define GA_MASTERS_NONE 2
#define GA_MOMENTS_F32 0
#define GA_MOMENTS_BF16 1

/* An optimizer's hyperparameters and rounding (the learning rate lives in device memory, so a
 * captured step replays with a schedule); the layout is shared with Rust. */
typedef struct {
    ga_u32 algorithm; /* GA_OPT_* */
    ga_u32 nesterov;
    float beta1, beta2, eps, weight_decay;
    float momentum, dampening;
    ga_u32 rounding; /* GA_ROUND_* */
    ga_u64 seed;
    ga_u32 masters; /* GA_MASTERS_* */
    ga_u32 moments; /* GA_MOMENTS_* */
    ga_u64 moment_seed;
} ga_opt_rule;

/* One tensor's scalars for one step (update::Scalars): AdamW's or SGD's fields. */
typedef struct {
    float decay, lerp, beta2, one_minus_beta2, correction2_sqrt, eps, neg_step; /* AdamW */
    float weight_decay, momentum, keep, neg_lr;                                 /* SGD */
    int nesterov, first;
} ga_opt_scalars;

/* a^t by binary powering, each multiply rounded (update::powi_steps, compiler-rt's __powidf2). */
GA_HD double ga_powi(double a, ga_u32 t) {
    double r = 1.0;
    for (;;) {
        if (t & 1u) {
            r = GA_DMUL(r, a);
        }
        t >>= 1;
        if (t == 0) {
            break;
        }
        a = GA_DMUL(a, a);
    }
    return r;
}

/* The scalars of step `t` (1 for the first step taken) at learning rate `base_lr` for a tensor of
 * learning-rate factor `lr_scale`, with weight decay or not: in f64, each rounded to f32 once
 * (Scalars::new). */
GA_HD ga_opt_scalars ga_opt_scalars_for(const ga_opt_rule *r, float base_lr, float lr_scale, int decays, ga_u64 t) {
    ga_opt_scalars k = {0};
    double lr = GA_DMUL((double)base_lr, (double)lr_scale);
    if (r->algorithm == GA_OPT_ADAMW) {
        double beta1 = (double)r->beta1, beta2 = (double)r->beta2;
        double wd = decays ? (double)r->weight_decay : 0.0;
        ga_u32 steps = t > 0x7fffffffull ? 0x7fffffffu : (ga_u32)t;
        k.decay = (float)(1.0 - GA_DMUL(lr, wd));
        k.lerp = (float)(1.0 - beta1);
        k.beta2 = r->beta2;
        k.one_minus_beta2 = (float)(1.0 - beta2);
        k.correction2_sqrt = (float)sqrt(1.0 - ga_powi(beta2, steps));
        k.eps = r->eps;
        k.neg_step = (float)(-lr / (1.0 - ga_powi(beta1, steps)));
    } else {
        k.weight_decay = decays ? r->weight_decay : 0.0f;
        k.momentum = r->momentum;
        k.keep = (float)(1.0 - (double)r->dampening);
        k.nesterov = r->nesterov != 0;
        k.first = t == 1;
        k.neg_lr = (float)(-lr);
    }
    return k;
}

/* torch.lerp on the CPU: from the nearer end, so that weight 1 gives `end` (update::lerp). */
GA_HD float ga_lerp(float start, float end, float weight) {
    if (weight < 0.5f && weight > -0.5f) {
        return GA_ADD(start, GA_MUL(weight, end - start));
    }
    return end - GA_MUL(end - start, 1.0f - weight);
}

/* One element of AdamW: master `w`, moments `m` and `v`, gradient `g` (AdamW::step). */
GA_HD void ga_adamw_one(const ga_opt_scalars *k, float g, float *w, float *m, float *v) {
    if (k->decay != 1.0f) {
        *w = GA_MUL(*w, k->decay);
    }
    *m = ga_lerp(*m, g, k->lerp);
    *v = GA_ADD(GA_MUL(*v, k->beta2), GA_MUL(GA_MUL(k->one_minus_beta2, g), g));
    float denom = GA_ADD(sqrtf(*v) / k->correction2_sqrt, k->eps);
    *w = GA_ADD(*w, GA_MUL(k->neg_step, *m) / denom);
}

/* One element of SGD: master `w`, momentum buffer `b`, gradient `g` (Sgd::step). */
GA_HD void ga_sgd_one(const ga_opt_scalars *k, float g, float *w, float *b) {
    float d = k->weight_decay != 0.0f ? GA_ADD(g, GA_MUL(k->weight_decay, *w)) : g;
    float moved = k->first ? d : GA_ADD(GA_MUL(*b, k->momentum), GA_MUL(k->keep, d));
    int with_momentum = k->momentum != 0.0f;
    if (with_momentum) {
        *b = moved;
        d = k->nesterov ? GA_ADD(d, GA_MUL(k->momentum, *b)) : *b;
    }
    *w = GA_ADD(*w, GA_MUL(k->neg_lr, d));
}

/* SplitMix64's finaliser (rounding::mix). */
GA_HD ga_u64 ga_mix(ga_u64 z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* The key of one step's draws (rounding::key). */
GA_HD ga_u64 ga_round_key(ga_u64 seed, ga_u64 step) { return ga_mix(seed ^ ga_mix(step + 0x9e3779b97f4a7c15ull)); }

/* The random 32 bits of element `index` in the step of `key` (rounding::draw). */
GA_HD ga_u32 ga_round_draw(ga_u64 key, ga_u64 index) { return (ga_u32)(ga_mix(key + index * 0x9e3779b97f4a7c15ull) >> 32); }

/* Stochastic rounding to f16 from the neighbours' values (rounding::by_neighbours). */
GA_HD unsigned short ga_stochastic_f16(float x, ga_u32 r) {
    unsigned short n = ga_f32_to_f16(x);
    float nv = ga_f16_to_f32(n);
    if (!ga_is_finite(x) || x == 0.0f || nv == x) {
        return n;
    }
    float ax = x < 0.0f ? -x : x, an = nv < 0.0f ? -nv : nv;
    unsigned short down = an > ax ? (unsigned short)(n - 1) : n;
    unsigned short up = an > ax ? n : (unsigned short)(n + 1);
    float lo32 = ga_f16_to_f32(down), hi32 = ga_f16_to_f32(up);
    double lo = (double)(lo32 < 0.0f ? -lo32 : lo32), hi = (double)(hi32 < 0.0f ? -hi32 : hi32);
    if (!(hi - hi == 0.0)) {
        return n;
    }
    double p = ((double)ax - lo) / (hi - lo);
    return (double)r < GA_DMUL(p, 4294967296.0) ? up : down;
}

/* Stochastic rounding to bf16 in integers (rounding::stochastic_bf16). */
GA_HD unsigned short ga_stochastic_bf16(float x, ga_u32 r) {
    ga_u32 bits = ga_f32_to_bits(x);
    unsigned short down = (unsigned short)(bits >> 16);
    if ((down & 0x7f80u) == 0x7f80u || (down & 0x7fffu) == 0x7f7fu) {
        return ga_f32_to_bf16(x);
    }
    return (unsigned short)(down + (r < ((bits & 0xffffu) << 16) ? 1 : 0));
}

/* The key of one step's draws for the bf16 moments (rounding::moment_key): an element's 64 random
 * bits round its first moment with their upper half, its second with their lower half. */
GA_HD ga_u64 ga_moment_key(ga_u64 seed, ga_u64 step) { return ga_round_key(ga_mix(seed ^ 0xd6e8feb86659fd93ull), step); }

/* The master of a bf16 weight and its remainder (format::join_master). */
GA_HD float ga_join_master(unsigned short weight, unsigned short rem) {
    unsigned short hi = (unsigned short)(weight - (rem >> 15));
    return ga_bits_to_f32(((ga_u32)hi << 16) | rem);
}

/* A master's bf16 weight and remainder (format::split_master): the lower half, and the upper
 * half plus one when the lower half is 0x8000 or more. */
GA_HD void ga_split_master(float x, unsigned short *weight, unsigned short *rem) {
    ga_u32 bits = ga_f32_to_bits(x);
    *rem = (unsigned short)bits;
    *weight = (unsigned short)((bits >> 16) + ((bits >> 15) & 1u));
}

/* A model weight of `dtype` at `out[i]` widened exactly: the master when none is kept. */
GA_HD float ga_read_weight(const void *out, ga_u64 i, int dtype) {
    if (dtype == GA_DTYPE_F32) {
        return ((const float *)out)[i];
    }
    unsigned short h = ((const unsigned short *)out)[i];
    return dtype == GA_DTYPE_F16 ? ga_f16_to_f32(h) : ga_bf16_to_f32(h);
}

/* One element's step with the smaller formats (pass::formats): the master `*w` (read by the caller
 * in its format) and the moments from bf16 or f32, all stepped in f32 as the FP32 state is, the
 * moments stored back, the bf16 ones rounded stochastically with the draws of flat element `flat`
 * under `key` (rounding::draws_at). */
GA_HD void ga_opt_formats_one(const ga_opt_rule *rule, const ga_opt_scalars *k, float g, float *w, void *first, void *second,
                              ga_u64 h, ga_u64 key, ga_u64 flat) {
    int adamw = rule->algorithm == GA_OPT_ADAMW;
    if (rule->moments == GA_MOMENTS_BF16) {
        unsigned short *m16 = (unsigned short *)first, *v16 = (unsigned short *)second;
        ga_u64 r = ga_mix(key + flat * 0x9e3779b97f4a7c15ull);
        float m = ga_bf16_to_f32(m16[h]);
        if (adamw) {
            float v = ga_bf16_to_f32(v16[h]);
            ga_adamw_one(k, g, w, &m, &v);
            m16[h] = ga_stochastic_bf16(m, (ga_u32)(r >> 32));
            v16[h] = ga_stochastic_bf16(v, (ga_u32)r);
        } else {
            ga_sgd_one(k, g, w, &m);
            m16[h] = ga_stochastic_bf16(m, (ga_u32)(r >> 32));
        }
    } else if (adamw) {
        ga_adamw_one(k, g, w, &((float *)first)[h], &((float *)second)[h]);
    } else {
        ga_sgd_one(k, g, w, &((float *)first)[h]);
    }
}

/* A master weight written into a model weight of `dtype` at `out[i]`: as it is (f32), rounded to
 * nearest even, or stochastically with the draw of flat element `flat` under `key`. */
GA_HD void ga_write_weight(void *out, ga_u64 i, int dtype, float w, int stochastic, ga_u64 key, ga_u64 flat) {
    if (dtype == GA_DTYPE_F32) {
        ((float *)out)[i] = w;
        return;
    }
    unsigned short h;
    if (stochastic) {
        ga_u32 r = ga_round_draw(key, flat);
        h = dtype == GA_DTYPE_F16 ? ga_stochastic_f16(w, r) : ga_stochastic_bf16(w, r);
    } else {
        h = dtype == GA_DTYPE_F16 ? ga_f32_to_f16(w) : ga_f32_to_bf16(w);
    }
    ((unsigned short *)out)[i] = h;
}

#endif
