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

/* One optimizer step's update of the scaler (scaler::next_state). Returns 0, or 1 when an
 * overflow needs a backoff at min_scale: then only `at_minimum` is raised. */
GA_HD int ga_scaler_next(ga_scaler_state *s, const ga_scaler_rule *c, int found_inf) {
    ga_scaler_state n = *s;
    n.steps += 1;
    n.last_skipped = found_inf ? 1u : 0u;
    if (!c->dynamic) {
        n.skipped_steps += found_inf ? 1u : 0u;
        *s = n;
        return 0;
    }
    if (found_inf) {
        n.skipped_steps += 1;
        n.growth_tracker = 0;
        n.hysteresis_tracker = s->hysteresis_tracker > 0 ? s->hysteresis_tracker - 1 : 0;
        if (n.hysteresis_tracker == 0) {
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

#endif
