/* The CUDA kernels' per-element arithmetic (src/backend/cuda/kernels/math.cuh), compiled for the
 * host, against the CPU backend through the C API, bit for bit, on random data (fresh seed each
 * run, GRADACC_TEST_SEED replays one). CI has no GPU: this is where the device math is tested.
 *   1. conversions: every f16 and bf16 bit pattern widened to f32, as the fused add reads it;
 *      f32 back to f16/bf16, as loss scaling rounds every 16-bit pattern times several scales.
 *   2. the fused add, emulated as ga_add_multi / ga_add_one run it: several micro-batches with
 *      different counts and scales, whole micro-batches and tensor-by-tensor contributions,
 *      odd tensor sizes of every dtype, injected inf/NaN: same masters, same found_inf.
 *   3. the boundary, emulated as ga_begin_boundary, ga_scale_sum_squares, ga_finish_norm and
 *      ga_scale_by run it, for every normalisation and with and without clipping: same masters,
 *      grad_norm and clip_coef as gradacc_accumulator_sync.
 *   4. the scaler rule ga_scaler_next (through the gather/update kernels' flag handling) against
 *      gradacc_scaler_update on long random overflow sequences with bursts, several configs.
 *   5. the BF16 wire, emulated as ga_to_bf16 and ga_sum_bf16 run it (each rank's values rounded by
 *      ga_f32_to_bf16, the owner's ga_sum_bf16_at over the words in rank order), against 2 and 3
 *      in-process CPU ranks synced with wire_dtype BF16: the same bits.
 *
 * NaN: on every CPU path a NaN gradient leaves the fused add quiet with its payload (the multiply
 * by the unscale factor quiets a signalling one), and so does the emulation; conversions and loss
 * scaling are compared with payloads. Masters compare a NaN only as a NaN: which payload an add
 * of two NaNs keeps depends on operand order, which neither compiler promises, and the device's
 * arithmetic returns its canonical NaN anyway; a non-finite master skips the step whatever its
 * payload.
 *
 * The CPU side is its widest SIMD path; GRADACC_CPU_ISA=scalar or avx2 runs this against the
 * others. Compiled with -ffp-contract=off (ctests/CMakeLists.txt), as math.cuh needs on the host. */
#include "common.h"

#include "../src/backend/cuda/kernels/math.cuh"

/* math.cuh rounds every operation to its type; excess precision (x87) would change bits. 16 is
 * 0 plus native _Float16 arithmetic (GCC on CPUs with AVX512-FP16). */
#if !defined(FLT_EVAL_METHOD) || (FLT_EVAL_METHOD != 0 && FLT_EVAL_METHOD != 16)
#error "the host build of math.cuh needs float and double evaluated in their own types (FLT_EVAL_METHOD 0)"
#endif

/* Mismatches printed per check before the rest are only counted. */
#define SHOWN 5

static uint32_t bits32(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static uint64_t bits64(double d)
{
    uint64_t u;
    memcpy(&u, &d, sizeof u);
    return u;
}

/* Equal bits, or both NaN (see the NaN note at the top). */
static int same32(float a, float b)
{
    return bits32(a) == bits32(b) || (a != a && b != b);
}

static int same64(double a, double b)
{
    return bits64(a) == bits64(b) || (a != a && b != b);
}

static void *xmalloc(size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    return p;
}

/* A scaler whose scale stays `scale` (min_scale = init_scale): one micro-batch's loss scale. */
static gradacc_scaler_t *scaler_at(float scale)
{
    gradacc_scaler_config_t sc;
    REQUIRE_OK(gradacc_scaler_config_default(&sc));
    sc.init_scale = scale;
    sc.min_scale = scale;
    gradacc_scaler_t *s = NULL;
    REQUIRE_OK(gradacc_scaler_create(&sc, NULL, &s));
    return s;
}

static gradacc_accumulator_t *accumulator(int reduction, int normalize, float max_grad_norm,
                                          const gradacc_tensor_desc_t *tensors, size_t n)
{
    gradacc_accumulator_config_t cfg;
    REQUIRE_OK(gradacc_accumulator_config_default(&cfg));
    cfg.loss_reduction = reduction;
    cfg.normalize = normalize;
    cfg.max_grad_norm = max_grad_norm;
    gradacc_accumulator_t *acc = NULL;
    REQUIRE_OK(gradacc_accumulator_create(&cfg, tensors, n, NULL, &acc));
    return acc;
}

/* ---------------------------------------------------------------------------------------------
 * 1. Conversions
 * ------------------------------------------------------------------------------------------- */

/* Every 16-bit pattern of `dtype`, added once with factor 1 (scale 1, weight 1: the add assigns
 * grad * 1), against ga_f16_to_f32 / ga_bf16_to_f32. The multiply by 1 is exact for every
 * number and quiets a signalling NaN, so a NaN's expected bits are the conversion's with the
 * quiet bit set. */
static void check_widening(int dtype)
{
    const char *name = dtype_name(dtype);
    uint16_t *all = xmalloc(65536 * sizeof *all);
    for (uint32_t b = 0; b < 65536; b++)
        all[b] = (uint16_t)b;
    gradacc_tensor_desc_t t = {65536, dtype};
    gradacc_accumulator_t *acc =
        accumulator(GRADACC_LOSS_REDUCTION_SUM, GRADACC_NORMALIZE_NONE, 0.0f, &t, 1);
    gradacc_scaler_t *one = scaler_at(1.0f);
    CHECK(ga_unscale_factor(1.0, 1.0f) == 1.0f, "the factor of weight 1 at scale 1");
    const void *grads[1] = {all};
    REQUIRE_OK(gradacc_accumulator_add(acc, one, grads, 1, 1));
    float *master = NULL;
    size_t numel = 0;
    REQUIRE_OK(gradacc_accumulator_master(acc, 0, &master, &numel));
    CHECK(numel == 65536, "%s: %zu elements", name, numel);
    int bad = 0, nans = 0;
    for (uint32_t b = 0; b < 65536 && numel == 65536; b++) {
        float widened = dtype == GA_DTYPE_F16 ? ga_f16_to_f32((unsigned short)b) : ga_bf16_to_f32((unsigned short)b);
        uint32_t want = bits32(widened);
        if (widened != widened) {
            want |= 0x00400000u;
            nans++;
        }
        if (bits32(master[b]) != want && bad++ < SHOWN)
            fprintf(stderr, "%s 0x%04x: CPU 0x%08x, math.cuh 0x%08x\n", name, b, bits32(master[b]), want);
    }
    CHECK(bad == 0, "%s -> f32: %d of 65536 patterns differ", name, bad);
    CHECK(nans == 2 * (dtype == GA_DTYPE_F16 ? 1023 : 127), "%s: %d NaN patterns", name, nans);
    REQUIRE_OK(gradacc_scaler_destroy(one));
    REQUIRE_OK(gradacc_accumulator_destroy(acc));
    free(all);
}

/* Loss scaling of `n` values of `dtype` at `scale`: gradacc_scaler_scale_loss against
 * ga_scale_loss_one (f32: the rounded multiply; 16-bit: widen, multiply, round back with
 * ga_f32_to_f16 / ga_f32_to_bf16). Returns the number of differing elements. */
static int check_scale_loss(int dtype, const void *values, size_t n, float scale)
{
    size_t bytes = n * (dtype == GA_DTYPE_F32 ? 4 : 2);
    void *cpu = xmalloc(bytes), *dev = xmalloc(bytes);
    memcpy(cpu, values, bytes);
    memcpy(dev, values, bytes);
    gradacc_scaler_t *s = scaler_at(scale);
    REQUIRE_OK(gradacc_scaler_scale_loss(s, cpu, n, dtype));
    REQUIRE_OK(gradacc_scaler_destroy(s));
    for (size_t i = 0; i < n; i++)
        ga_scale_loss_one(dev, i, dtype, scale);
    int bad = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t in, got, want;
        if (dtype == GA_DTYPE_F32) {
            in = ((const uint32_t *)values)[i];
            got = ((uint32_t *)cpu)[i];
            want = ((uint32_t *)dev)[i];
        } else {
            in = ((const uint16_t *)values)[i];
            got = ((uint16_t *)cpu)[i];
            want = ((uint16_t *)dev)[i];
        }
        if (got != want && bad++ < SHOWN)
            fprintf(stderr, "scale_loss %s 0x%x * %a: CPU 0x%x, math.cuh 0x%x\n", dtype_name(dtype), in,
                    (double)scale, got, want);
    }
    free(cpu);
    free(dev);
    return bad;
}

/* A random f32 bit pattern: any class (zeros, subnormals, normals, inf, NaN). */
static uint32_t any_f32(test_rng *r)
{
    uint32_t u = (uint32_t)rng_u64(r);
    switch (rng_below(r, 8)) {
    case 0: return u & 0x807fffffu;                 /* zero or subnormal */
    case 1: return (u & 0x807fffffu) | 0x7f800000u; /* inf or NaN */
    default: return u;
    }
}

static void check_narrowing(test_rng *r)
{
    /* Powers of two move 16-bit values exactly into the subnormal and overflow ranges, so the
     * rounding there (ties included) decides; 1 + 2^-11 makes ties of f16 normals; random
     * scales give products with arbitrary low bits. */
    float scales[16] = {1.0f, 0x1p-24f, 0x1p-14f, 0x1p-9f, 65536.0f, 0x1p24f, 1.0f + 0x1p-11f, 1.0f + 0x1p-8f};
    for (int k = 8; k < 16; k++)
        scales[k] = (float)exp(rng_range(r, log(0x1p-40), log(0x1p40)));
    uint16_t *all = xmalloc(65536 * sizeof *all);
    for (uint32_t b = 0; b < 65536; b++)
        all[b] = (uint16_t)b;
    enum { NF = 65537 };
    uint32_t *f = xmalloc(NF * sizeof *f);
    for (int k = 0; k < 16; k++) {
        int bad16 = check_scale_loss(GA_DTYPE_F16, all, 65536, scales[k]);
        CHECK(bad16 == 0, "scale_loss f16 at %a: %d of 65536 patterns differ", (double)scales[k], bad16);
        int badbf = check_scale_loss(GA_DTYPE_BF16, all, 65536, scales[k]);
        CHECK(badbf == 0, "scale_loss bf16 at %a: %d of 65536 patterns differ", (double)scales[k], badbf);
        for (int i = 0; i < NF; i++)
            f[i] = any_f32(r);
        int bad32 = check_scale_loss(GA_DTYPE_F32, f, NF, scales[k]);
        CHECK(bad32 == 0, "scale_loss f32 at %a: %d of %d values differ", (double)scales[k], bad32, NF);
    }
    free(f);
    free(all);
}

/* ---------------------------------------------------------------------------------------------
 * 2 and 3. Fused add and boundary, on random windows
 * ------------------------------------------------------------------------------------------- */

#define MAX_TENSORS 6
#define MAX_MICROBATCHES 5
#define MAX_CONTRIBUTIONS 3

/* One micro-batch: its item count, loss scale, and the gradients each tensor receives, each
 * given by the seed that regenerates it. */
typedef struct {
    uint64_t count;
    float scale;
    int whole;                                /* gradacc_accumulator_add, else add_tensor calls */
    int contributions[MAX_TENSORS];           /* whole: exactly 1 each */
    uint64_t seeds[MAX_TENSORS][MAX_CONTRIBUTIONS];
} microbatch;

typedef struct {
    size_t n;
    microbatch mb[MAX_MICROBATCHES];
} window;

typedef struct {
    size_t ntensors;
    gradacc_tensor_desc_t desc[MAX_TENSORS];
    size_t offset[MAX_TENSORS + 1];
    int reduction, normalize;
} layout;

/* The expected side: the flat FP32 master as the kernels leave it, and the window's state. */
typedef struct {
    float *master;
    int written[MAX_TENSORS];
    int found_inf;
    uint64_t count, microbatches;
} device_model;

static size_t random_numel(test_rng *r)
{
    static const size_t odd[] = {1, 2, 3, 5, 7, 15, 16, 17, 31, 33, 63, 65, 255, 257, 1023, 4095, 4096, 4097, 8191, 8193, 12289};
    if (rng_below(r, 4) == 0)
        return 1 + rng_below(r, 20000);
    return odd[rng_below(r, sizeof odd / sizeof odd[0])];
}

static float random_scale(test_rng *r)
{
    switch (rng_below(r, 4)) {
    case 0: return ldexpf(1.0f, (int)rng_below(r, 29) - 4);
    case 1: return 65536.0f;
    default: return (float)exp(rng_range(r, log(1e-3), log(1e7))); /* not a power of two: the factor rounds */
    }
}

static uint64_t random_count(test_rng *r, int reduction)
{
    if (rng_below(r, 8) == 0)
        return 1 + (rng_u64(r) >> 24); /* up to 2^40: weight / scale and 1 / divisor round in f64 first */
    if (reduction == GRADACC_LOSS_REDUCTION_SUM && rng_below(r, 8) == 0)
        return 0;
    return 1 + rng_below(r, 1000);
}

/* A gradient of `dtype` from `seed`: finite values of a random magnitude band, sometimes any
 * finite pattern from the subnormals up (to 2^64 for f32 and bf16, or to the largest finite
 * value, which the multiply by the factor may turn into inf), and sometimes a few inf/NaN of
 * either sign with random payloads, signalling ones included. */
static void fill_grad(void *buf, size_t n, int dtype, uint64_t seed)
{
    test_rng r = {seed};
    int wild = rng_below(&r, 12) == 0;
    uint32_t top = rng_below(&r, 4) == 0 ? 255 : 127 + 65;
    int center = (int)rng_below(&r, 41) - 20, spread = (int)rng_below(&r, 13);
    for (size_t i = 0; i < n; i++) {
        uint32_t u = (uint32_t)rng_u64(&r);
        int e = center + (spread ? (int)rng_below(&r, 2 * (uint32_t)spread + 1) - spread : 0);
        int zero = rng_below(&r, 64) == 0;
        if (dtype == GA_DTYPE_F32) {
            uint32_t ef = wild ? rng_below(&r, top) : (uint32_t)(127 + e);
            ((uint32_t *)buf)[i] = zero ? (u & 0x80000000u) : (u & 0x807fffffu) | (ef << 23);
        } else if (dtype == GA_DTYPE_F16) {
            int ef = wild ? (int)rng_below(&r, 31) : 15 + e;
            ef = ef < 0 ? 0 : ef > 30 ? 30 : ef; /* the ends of the band pile up on subnormals / the top binade */
            ((uint16_t *)buf)[i] = (uint16_t)(zero ? (u & 0x8000u) : (u & 0x83ffu) | ((uint32_t)ef << 10));
        } else {
            uint32_t ef = wild ? rng_below(&r, top) : (uint32_t)(127 + e);
            ((uint16_t *)buf)[i] = (uint16_t)(zero ? (u & 0x8000u) : (u & 0x807fu) | (ef << 7));
        }
    }
    if (rng_below(&r, 64) == 0) {
        int k = 1 + (int)rng_below(&r, 3);
        while (k--) {
            /* half of them among the first elements, so that contributions meet (inf - inf, NaN + NaN) */
            size_t i = (size_t)(rng_u64(&r) % (rng_below(&r, 2) && n > 3 ? 3 : n));
            uint32_t u = (uint32_t)rng_u64(&r);
            int nan = rng_below(&r, 2);
            if (dtype == GA_DTYPE_F32) {
                uint32_t m = nan ? (u & 0x7fffffu) | 1u : 0u;
                ((uint32_t *)buf)[i] = (u & 0x80000000u) | 0x7f800000u | m;
            } else if (dtype == GA_DTYPE_F16) {
                uint32_t m = nan ? (u & 0x3ffu) | 1u : 0u;
                ((uint16_t *)buf)[i] = (uint16_t)((u & 0x8000u) | 0x7c00u | m);
            } else {
                uint32_t m = nan ? (u & 0x7fu) | 1u : 0u;
                ((uint16_t *)buf)[i] = (uint16_t)((u & 0x8000u) | 0x7f80u | m);
            }
        }
    }
}

static void *make_grad(const layout *L, size_t t, uint64_t seed)
{
    size_t n = L->desc[t].numel;
    void *g = xmalloc(n * (L->desc[t].dtype == GA_DTYPE_F32 ? 4 : 2));
    fill_grad(g, n, L->desc[t].dtype, seed);
    return g;
}

static window random_window(test_rng *r, const layout *L)
{
    window w;
    memset(&w, 0, sizeof w);
    w.n = rng_below(r, 20) == 0 ? 0 : 1 + rng_below(r, MAX_MICROBATCHES);
    for (size_t m = 0; m < w.n; m++) {
        microbatch *mb = &w.mb[m];
        mb->count = random_count(r, L->reduction);
        mb->scale = random_scale(r);
        mb->whole = rng_below(r, 2);
        for (size_t t = 0; t < L->ntensors; t++) {
            /* a tensor may get nothing (its master then reads 0 at the boundary), or several
             * contributions, as a chunked backward delivers them */
            mb->contributions[t] = mb->whole ? 1 : rng_below(r, 4) == 0 ? 0 : 1 + (int)rng_below(r, MAX_CONTRIBUTIONS);
            for (int c = 0; c < MAX_CONTRIBUTIONS; c++)
                mb->seeds[t][c] = rng_u64(r);
        }
    }
    return w;
}

/* The add kernels' work on one tensor's range (ga_add_range, per element): returns whether a
 * written value is not finite. */
static int emulate_add(float *master, const void *grad, size_t n, int dtype, float factor, int assign)
{
    int bad = 0;
    for (size_t i = 0; i < n; i++) {
        float m = ga_accumulate_one(assign ? 0.0f : master[i], ga_load_grad(grad, i, dtype), factor, assign);
        bad |= !ga_is_finite(m);
        master[i] = m;
    }
    return bad;
}

static void model_start_window(device_model *d)
{
    memset(d->written, 0, sizeof d->written);
    d->found_inf = 0;
    d->count = 0;
    d->microbatches = 0;
}

/* One micro-batch into the model and, when `acc` is not NULL, through the C API. */
static void run_microbatch(const layout *L, const microbatch *mb, device_model *d, gradacc_accumulator_t *acc)
{
    /* The kernels read the scale from the scaler's state; the multiplier is weight / scale, the
     * weight the count only for a mean-reduced loss normalised by the count. */
    int by_count = L->reduction == GRADACC_LOSS_REDUCTION_MEAN && L->normalize == GRADACC_NORMALIZE_BY_COUNT;
    float factor = ga_unscale_factor(by_count ? (double)mb->count : 1.0, mb->scale);
    gradacc_scaler_t *scaler = acc ? scaler_at(mb->scale) : NULL;
    if (scaler) {
        float s = 0.0f;
        REQUIRE_OK(gradacc_scaler_scale(scaler, &s));
        CHECK(bits32(s) == bits32(mb->scale), "scale %a, expected %a", (double)s, (double)mb->scale);
    }
    if (mb->whole) {
        const void *grads[MAX_TENSORS];
        for (size_t t = 0; t < L->ntensors; t++)
            grads[t] = make_grad(L, t, mb->seeds[t][0]);
        if (acc)
            EXPECT_OK(gradacc_accumulator_add(acc, scaler, grads, L->ntensors, mb->count));
        for (size_t t = 0; t < L->ntensors; t++) {
            d->found_inf |= emulate_add(d->master + L->offset[t], grads[t], L->desc[t].numel, L->desc[t].dtype, factor,
                                        !d->written[t]);
            d->written[t] = 1;
            free((void *)grads[t]);
        }
    } else {
        if (acc)
            EXPECT_OK(gradacc_accumulator_begin_microbatch(acc, mb->count));
        for (size_t t = 0; t < L->ntensors; t++) {
            for (int c = 0; c < mb->contributions[t]; c++) {
                void *g = make_grad(L, t, mb->seeds[t][c]);
                if (acc)
                    EXPECT_OK(gradacc_accumulator_add_tensor(acc, scaler, t, g, L->desc[t].numel));
                d->found_inf |= emulate_add(d->master + L->offset[t], g, L->desc[t].numel, L->desc[t].dtype, factor,
                                            !d->written[t]);
                d->written[t] = 1;
                free(g);
            }
        }
        if (acc)
            EXPECT_OK(gradacc_accumulator_end_microbatch(acc));
    }
    if (scaler)
        REQUIRE_OK(gradacc_scaler_destroy(scaler));
    d->count += mb->count;
    d->microbatches += 1;
}

/* What the boundary kernels leave in their ga_boundary record. */
typedef struct {
    uint64_t divisor;
    int empty;
    double grad_norm, clip_coef;
    float second_factor;
} boundary;

/* The boundary as the kernels run it (comm NULL: world 1, the control words are this rank's):
 * the sum-of-squares pass normalises when clipping is off; with clipping on, the clipping pass
 * applies clip / divisor at once. */
static boundary emulate_boundary(float *buf, size_t n, int normalize, uint64_t count, uint64_t microbatches,
                                 double max_norm)
{
    boundary b;
    /* ga_begin_boundary */
    b.divisor = ga_divisor(normalize, count, microbatches, 1);
    b.empty = microbatches == 0 || b.divisor == 0;
    b.grad_norm = 0.0;
    b.clip_coef = 1.0;
    b.second_factor = 1.0f;
    if (b.empty)
        return b;
    /* ga_scale_sum_squares: block sums of the buffer as on entry, then the normalisation */
    float factor = ga_normalize_factor(b.divisor);
    int scale = max_norm == 0.0 && factor != 1.0f;
    size_t blocks = (n + GA_NORM_BLOCK - 1) / GA_NORM_BLOCK;
    double *partials = xmalloc(blocks * sizeof *partials);
    for (size_t k = 0; k < blocks; k++) {
        size_t start = k * GA_NORM_BLOCK, len = n - start < GA_NORM_BLOCK ? n - start : GA_NORM_BLOCK;
        partials[k] = ga_block_sum_squares(buf + start, (ga_u32)len);
        if (scale)
            for (size_t i = start; i < start + len; i++)
                buf[i] = GA_MUL(buf[i], factor);
    }
    /* ga_finish_norm: the block sums folded in the fixed shape */
    double *lanes = xmalloc(GA_FOLD_LANES * sizeof *lanes);
    double sum = ga_fold_block_sums(partials, blocks, lanes);
    free(lanes);
    free(partials);
    b.grad_norm = sqrt(sum) / (double)b.divisor;
    if (max_norm != 0.0) {
        b.clip_coef = ga_clip_coef(b.grad_norm, max_norm);
        b.second_factor = (float)(b.clip_coef / (double)b.divisor);
    }
    /* ga_scale_by */
    if (b.second_factor != 1.0f)
        for (size_t i = 0; i < n; i++)
            buf[i] = GA_MUL(buf[i], b.second_factor);
    return b;
}

/* Compares tensor t's master from the C API with the model. Returns the number of mismatches. */
static int compare_tensor(const char *when, int trial, const layout *L, size_t t, const device_model *d,
                          gradacc_accumulator_t *acc)
{
    float *p = NULL;
    size_t numel = 0;
    REQUIRE_OK(gradacc_accumulator_master(acc, t, &p, &numel));
    CHECK(numel == L->desc[t].numel, "tensor %zu: %zu elements, declared %llu", t, numel,
          (unsigned long long)L->desc[t].numel);
    int bad = 0;
    const float *want = d->master + L->offset[t];
    for (size_t i = 0; i < numel && i < L->desc[t].numel; i++) {
        if (!same32(p[i], want[i]) && bad++ < SHOWN)
            fprintf(stderr, "trial %d %s: tensor %zu (%s, %llu) element %zu: CPU %a (0x%08x), math.cuh %a (0x%08x)\n",
                    trial, when, t, dtype_name(L->desc[t].dtype), (unsigned long long)L->desc[t].numel, i,
                    (double)p[i], bits32(p[i]), (double)want[i], bits32(want[i]));
    }
    return bad;
}

/* The norm the window's boundary reports: a clipping threshold near it makes clipping a close call. */
static double window_norm(const layout *L, const window *w)
{
    size_t total = L->offset[L->ntensors];
    device_model d;
    d.master = xmalloc(total * sizeof(float));
    memset(d.master, 0, total * sizeof(float)); /* the padding between tensors stays zero */
    model_start_window(&d);
    for (size_t m = 0; m < w->n; m++)
        run_microbatch(L, &w->mb[m], &d, NULL);
    for (size_t t = 0; t < L->ntensors; t++)
        if (!d.written[t])
            memset(d.master + L->offset[t], 0, L->desc[t].numel * sizeof(float));
    boundary b = emulate_boundary(d.master, total, L->normalize, d.count, d.microbatches, 0.0);
    free(d.master);
    return b.empty ? 0.0 : b.grad_norm;
}

/* Trial `trial`: a random layout, the normalisation and clipping picked by the trial number (so
 * every combination runs), one or two windows on one accumulator. */
static void check_windows(test_rng *r, int trial, int *windows_synced, int *clipped, int *overflowed)
{
    layout L;
    memset(&L, 0, sizeof L);
    L.normalize = trial % 4;
    L.reduction = (trial / 4) % 2 ? GRADACC_LOSS_REDUCTION_SUM : GRADACC_LOSS_REDUCTION_MEAN;
    int clip_mode = (trial / 8) % 3; /* 0: off, 1: near the first window's norm, 2: anywhere */
    L.ntensors = 1 + rng_below(r, MAX_TENSORS);
    for (size_t t = 0; t < L.ntensors; t++) {
        L.desc[t].numel = random_numel(r);
        L.desc[t].dtype = (gradacc_dtype_t)rng_below(r, 3);
        /* each tensor at a multiple of GRADACC_MASTER_ALIGN bytes, zeros between: the norm sums
         * the master in blocks of its flat positions, so the model pads as the library does */
        const size_t align = GRADACC_MASTER_ALIGN / sizeof(float);
        L.offset[t + 1] = (L.offset[t] + L.desc[t].numel + align - 1) / align * align;
    }
    size_t total = L.offset[L.ntensors];
    int nwindows = 1 + (int)rng_below(r, 2);
    window w[2];
    for (int k = 0; k < nwindows; k++)
        w[k] = random_window(r, &L);
    if (L.reduction == GRADACC_LOSS_REDUCTION_MEAN && L.normalize == GRADACC_NORMALIZE_BY_COUNT && w[0].n > 0) {
        /* a weight and scale whose quotient rounded once from f64 differs from an f32 division */
        microbatch *mb = &w[0].mb[0];
        do {
            mb->count = 1 + (rng_u64(r) >> 24);
            mb->scale = (float)exp(rng_range(r, log(1e-3), log(1e7)));
        } while ((float)((double)mb->count / (double)mb->scale) == (float)mb->count / mb->scale);
    }
    if (L.reduction == GRADACC_LOSS_REDUCTION_SUM && L.normalize == GRADACC_NORMALIZE_BY_COUNT && w[0].n > 0) {
        /* a total count whose 1 / count rounded once from f64 differs from an f32 division */
        uint64_t rest = 0, sum;
        for (size_t m = 1; m < w[0].n; m++)
            rest += w[0].mb[m].count;
        do
            sum = rest + (((uint64_t)1 << 33) | rng_u64(r) >> 31);
        while ((float)(1.0 / (double)sum) == 1.0f / (float)sum);
        w[0].mb[0].count = sum - rest;
    }

    float max_norm = 0.0f;
    if (clip_mode == 1) {
        double guess = window_norm(&L, &w[0]) * exp2(rng_range(r, -1.5, 1.5));
        max_norm = guess > 0.0 && guess < 1e30 ? (float)guess : 1.0f;
    } else if (clip_mode == 2) {
        max_norm = (float)exp(rng_range(r, log(1e-30), log(1e30)));
    }
    gradacc_accumulator_t *acc = accumulator(L.reduction, L.normalize, max_norm, L.desc, L.ntensors);
    for (size_t t = 0; t < L.ntensors; t++) {
        size_t at = 777;
        REQUIRE_OK(gradacc_accumulator_offset(acc, t, &at));
        CHECK(at == L.offset[t], "trial %d: tensor %zu at %zu, the model's at %zu", trial, t, at, L.offset[t]);
    }

    device_model d;
    d.master = xmalloc(total * sizeof(float));
    memset(d.master, 0, total * sizeof(float));
    for (int k = 0; k < nwindows; k++) {
        model_start_window(&d);
        for (size_t m = 0; m < w[k].n; m++)
            run_microbatch(&L, &w[k].mb[m], &d, acc);
        int bad = 0;
        for (size_t t = 0; t < L.ntensors; t++)
            if (d.written[t]) /* a tensor not yet written in this window holds nothing defined */
                bad += compare_tensor("after the adds", trial, &L, t, &d, acc);
        CHECK(bad == 0, "trial %d window %d: %d master elements differ after the adds", trial, k, bad);

        for (size_t t = 0; t < L.ntensors; t++)
            if (!d.written[t])
                memset(d.master + L.offset[t], 0, L.desc[t].numel * sizeof(float));
        boundary b = emulate_boundary(d.master, total, L.normalize, d.count, d.microbatches, (double)max_norm);
        gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
        memset(&info, 0, sizeof info);
        info.struct_size = sizeof info;
        gradacc_status_t st = gradacc_accumulator_sync(acc, NULL, &info);
        if (b.empty) {
            EXPECT_STATUS(st, GRADACC_STATUS_EMPTY_WINDOW);
            /* the failed boundary leaves the window open; start the next one afresh */
            REQUIRE_OK(gradacc_accumulator_reset(acc));
            continue;
        }
        EXPECT_OK(st);
        if (st != GRADACC_STATUS_OK)
            break;
        (*windows_synced)++;
        *clipped += b.clip_coef < 1.0;
        *overflowed += d.found_inf;
        CHECK(info.found_inf == (d.found_inf != 0), "trial %d window %d: found_inf CPU %d, math.cuh %d", trial, k,
              (int)info.found_inf, d.found_inf);
        CHECK(info.total_count == d.count && info.microbatches == d.microbatches,
              "trial %d window %d: count %llu/%llu, micro-batches %llu/%llu", trial, k,
              (unsigned long long)info.total_count, (unsigned long long)d.count,
              (unsigned long long)info.microbatches, (unsigned long long)d.microbatches);
        CHECK(same64(info.grad_norm, b.grad_norm), "trial %d window %d: grad_norm CPU %a, math.cuh %a", trial, k,
              info.grad_norm, b.grad_norm);
        CHECK(same64(info.clip_coef, b.clip_coef), "trial %d window %d: clip_coef CPU %a, math.cuh %a (max %a)", trial,
              k, info.clip_coef, b.clip_coef, (double)max_norm);
        bad = 0;
        for (size_t t = 0; t < L.ntensors; t++)
            bad += compare_tensor("after the boundary", trial, &L, t, &d, acc);
        CHECK(bad == 0, "trial %d window %d (normalize %d, reduction %d, max_grad_norm %a): %d master elements differ "
                        "after the boundary", trial, k, L.normalize, L.reduction, (double)max_norm, bad);
    }
    free(d.master);
    REQUIRE_OK(gradacc_accumulator_destroy(acc));
}

/* ---------------------------------------------------------------------------------------------
 * 4. Scaler
 * ------------------------------------------------------------------------------------------- */

/* Two synced one-element accumulators, one whose window overflowed and one whose did not: the
 * C API's update reads its overflow flag from synced accumulators. */
typedef struct {
    gradacc_accumulator_t *finite, *overflowed;
} flag_sources;

static flag_sources make_flag_sources(void)
{
    flag_sources f;
    gradacc_tensor_desc_t t = {1, GRADACC_DTYPE_F32};
    f.finite = accumulator(GRADACC_LOSS_REDUCTION_SUM, GRADACC_NORMALIZE_NONE, 0.0f, &t, 1);
    f.overflowed = accumulator(GRADACC_LOSS_REDUCTION_SUM, GRADACC_NORMALIZE_NONE, 0.0f, &t, 1);
    gradacc_scaler_t *s = scaler_at(1.0f);
    float one = 1.0f, inf = INFINITY;
    const void *g1[1] = {&one}, *g2[1] = {&inf};
    REQUIRE_OK(gradacc_accumulator_add(f.finite, s, g1, 1, 1));
    REQUIRE_OK(gradacc_accumulator_add(f.overflowed, s, g2, 1, 1));
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    REQUIRE_OK(gradacc_accumulator_sync(f.finite, NULL, &info));
    CHECK(!info.found_inf, "the finite window has no overflow");
    REQUIRE_OK(gradacc_accumulator_sync(f.overflowed, NULL, &info));
    CHECK(info.found_inf, "the overflowed window has one");
    REQUIRE_OK(gradacc_scaler_destroy(s));
    return f;
}

/* The state a new scaler starts from (scaler.rs Scaler::new). */
static void scaler_model(const gradacc_scaler_config_t *c, ga_scaler_state *s, ga_scaler_rule *rule)
{
    memset(s, 0, sizeof *s);
    s->scale = c->init_scale;
    s->hysteresis_tracker = c->hysteresis;
    rule->growth_factor = c->growth_factor;
    rule->backoff_factor = c->backoff_factor;
    rule->min_scale = c->min_scale;
    rule->max_scale = c->max_scale;
    rule->growth_interval = c->growth_interval;
    rule->hysteresis = c->hysteresis;
    rule->consecutive_hysteresis = c->consecutive_hysteresis;
    rule->dynamic = c->dynamic;
}

static int same_scaler(const ga_scaler_state *a, const ga_scaler_state *b)
{
    return bits32(a->scale) == bits32(b->scale) && a->growth_tracker == b->growth_tracker &&
           a->hysteresis_tracker == b->hysteresis_tracker && a->at_minimum == b->at_minimum && a->steps == b->steps &&
           a->skipped_steps == b->skipped_steps && a->growths == b->growths && a->backoffs == b->backoffs &&
           a->last_skipped == b->last_skipped && a->pending_found_inf == b->pending_found_inf;
}

typedef struct {
    int steps, overflows, growths, backoffs, at_minimum, capped; /* capped: a growth due but refused */
} trace_counts;

/* `steps` updates with random overflow flags in calm stretches and bursts, each from 1 to 3
 * accumulators: gradacc_scaler_update against the gather kernel's flag handling followed by
 * ga_scaler_next. */
static trace_counts check_trace(test_rng *r, const char *name, const gradacc_scaler_config_t *c, int steps,
                                const flag_sources *src)
{
    trace_counts n = {0, 0, 0, 0, 0, 0};
    gradacc_scaler_t *scaler = NULL;
    EXPECT_OK(gradacc_scaler_create(c, NULL, &scaler));
    if (!scaler) {
        fprintf(stderr, "scaler config %s rejected\n", name);
        return n;
    }
    ga_scaler_state s;
    ga_scaler_rule rule;
    scaler_model(c, &s, &rule);
    int burst = 0, bad = 0;
    for (int step = 0; step < steps && bad < SHOWN; step++) {
        if (rng_below(r, 100) < 6)
            burst = !burst;
        int overflow = rng_below(r, 100) < (burst ? 85u : 4u);
        const gradacc_accumulator_t *accs[3];
        size_t nacc = 1 + rng_below(r, 3);
        for (size_t k = 0; k < nacc; k++)
            accs[k] = overflow && rng_below(r, 2) ? src->overflowed : src->finite;
        if (overflow)
            accs[rng_below(r, (uint32_t)nacc)] = src->overflowed;

        float scale_before = 0.0f;
        gradacc_scaler_stats_t stats_before = GRADACC_SCALER_STATS_INIT;
        REQUIRE_OK(gradacc_scaler_scale(scaler, &scale_before));
        REQUIRE_OK(gradacc_scaler_stats(scaler, &stats_before));
        bool skipped = !overflow;
        gradacc_status_t st = gradacc_scaler_update(scaler, accs, nacc, &skipped);

        ga_scaler_state before = s;
        for (size_t k = 0; k < nacc; k++) /* ga_scaler_gather, one per accumulator */
            if (accs[k] == src->overflowed)
                s.pending_found_inf = 1;
        int found_inf = s.pending_found_inf != 0; /* ga_scaler_update */
        s.pending_found_inf = 0;
        int at_min = ga_scaler_next(&s, &rule, found_inf, 0); /* SKIP_STEP accumulators: no drops */

        float scale = 0.0f;
        gradacc_scaler_stats_t stats = GRADACC_SCALER_STATS_INIT;
        REQUIRE_OK(gradacc_scaler_scale(scaler, &scale));
        REQUIRE_OK(gradacc_scaler_stats(scaler, &stats));
        int ok;
        if (at_min) {
            /* ga_scaler_next raises only at_minimum; the C API fails and changes nothing */
            ga_scaler_state only_flag = before;
            only_flag.at_minimum = 1;
            ok = st == GRADACC_STATUS_SCALE_AT_MINIMUM && same_scaler(&s, &only_flag) &&
                 bits32(scale) == bits32(scale_before) && memcmp(&stats, &stats_before, sizeof stats) == 0 &&
                 bits32(s.scale) == bits32(scale);
            n.at_minimum++;
        } else {
            ok = st == GRADACC_STATUS_OK && skipped == (found_inf != 0) && s.last_skipped == (ga_u32)found_inf &&
                 bits32(scale) == bits32(s.scale) && stats.steps == s.steps && stats.skipped_steps == s.skipped_steps &&
                 stats.growths == s.growths && stats.backoffs == s.backoffs;
            n.growths += s.growths != before.growths;
            n.capped += rule.dynamic && !found_inf && before.growth_tracker + 1 == rule.growth_interval &&
                        s.growths == before.growths;
            n.backoffs += s.backoffs != before.backoffs;
        }
        n.steps++;
        n.overflows += overflow;
        if (!ok && bad++ < SHOWN)
            fprintf(stderr,
                    "scaler %s step %d (overflow %d): C API status %d scale %a steps %llu skipped %llu growths %llu "
                    "backoffs %llu; math.cuh returned %d scale %a steps %llu skipped %llu growths %llu backoffs %llu "
                    "(scale before %a)\n",
                    name, step, overflow, (int)st, (double)scale, (unsigned long long)stats.steps,
                    (unsigned long long)stats.skipped_steps, (unsigned long long)stats.growths,
                    (unsigned long long)stats.backoffs, at_min, (double)s.scale, (unsigned long long)s.steps,
                    (unsigned long long)s.skipped_steps, (unsigned long long)s.growths, (unsigned long long)s.backoffs,
                    (double)scale_before);
    }
    CHECK(bad == 0, "scaler %s: the C API and math.cuh parted", name);
    REQUIRE_OK(gradacc_scaler_destroy(scaler));
    return n;
}

static void check_scaler(test_rng *r)
{
    flag_sources src = make_flag_sources();
    gradacc_scaler_config_t base;
    REQUIRE_OK(gradacc_scaler_config_default(&base));
    enum { FIXED = 8, RANDOM = 8 };
    gradacc_scaler_config_t c[FIXED + RANDOM];
    const char *names[FIXED + RANDOM];
    char random_names[RANDOM][16];
    for (int k = 0; k < FIXED + RANDOM; k++)
        c[k] = base;
    names[0] = "pytorch (hysteresis 1, growth_interval 3)";
    c[0].growth_interval = 3;
    c[0].init_scale = 1024.0f;
    names[1] = "megatron (hysteresis 3)";
    c[1].growth_interval = 5;
    c[1].hysteresis = 3;
    c[1].init_scale = 4096.0f;
    names[2] = "deepspeed (hysteresis 2, consecutive)";
    c[2].growth_interval = 4;
    c[2].hysteresis = 2;
    c[2].consecutive_hysteresis = true;
    names[3] = "finite max_scale (not a power-of-two multiple)";
    c[3].growth_interval = 2;
    c[3].init_scale = 256.0f;
    c[3].max_scale = 256.0f * 5.5f;
    names[4] = "fixed scale";
    c[4].dynamic = false;
    c[4].init_scale = 3.0f;
    c[4].min_scale = 3.0f;
    names[5] = "min_scale reached (min_scale not on the backoff grid)";
    c[5].init_scale = 64.0f;
    c[5].min_scale = 3.0f;
    c[5].growth_interval = 50;
    names[6] = "growth towards infinity (stops at the largest finite step)";
    c[6].init_scale = 1e30f;
    c[6].growth_factor = 1e4f;
    c[6].growth_interval = 1;
    names[7] = "odd factors (growth 3.7, backoff 0.3, hysteresis 2)";
    c[7].init_scale = 1000.0f;
    c[7].growth_factor = 3.7f;
    c[7].backoff_factor = 0.3f;
    c[7].growth_interval = 2;
    c[7].hysteresis = 2;
    c[7].min_scale = 0.01f;
    for (int k = FIXED; k < FIXED + RANDOM; k++) {
        gradacc_scaler_config_t *x = &c[k];
        snprintf(random_names[k - FIXED], sizeof random_names[0], "random %d", k - FIXED + 1);
        names[k] = random_names[k - FIXED];
        x->init_scale = rng_below(r, 2) ? ldexpf(1.0f, (int)rng_below(r, 25)) : (float)exp(rng_range(r, 0.0, log(1e7)));
        x->growth_factor = rng_below(r, 2) ? 2.0f : (float)rng_range(r, 1.001, 8.0);
        x->backoff_factor = rng_below(r, 2) ? 0.5f : (float)rng_range(r, 0.05, 0.95);
        x->growth_interval = 1 + rng_below(r, 10);
        x->hysteresis = 1 + rng_below(r, 4);
        x->consecutive_hysteresis = rng_below(r, 2);
        x->min_scale = rng_below(r, 2) ? ldexpf(x->init_scale, -(int)rng_below(r, 13))
                                       : x->init_scale * (float)rng_range(r, 0.001, 1.0);
        x->max_scale = rng_below(r, 2) ? INFINITY : x->init_scale * (float)rng_range(r, 1.0, 1000.0);
        x->dynamic = rng_below(r, 8) != 0;
    }
    trace_counts total = {0, 0, 0, 0, 0, 0};
    for (int k = 0; k < FIXED + RANDOM; k++) {
        trace_counts n = check_trace(r, names[k], &c[k], 3000, &src);
        total.steps += n.steps;
        total.overflows += n.overflows;
        total.growths += n.growths;
        total.backoffs += n.backoffs;
        total.at_minimum += n.at_minimum;
        if (k == 5)
            CHECK(n.at_minimum > 0, "the min_scale config never reached min_scale");
        if (k == 3 || k == 6)
            CHECK(n.capped > 0, "%s: no growth was ever refused", names[k]);
    }
    printf("scaler: %d updates (%d overflowing), %d growths, %d backoffs, %d overflows at min_scale\n", total.steps,
           total.overflows, total.growths, total.backoffs, total.at_minimum);
    REQUIRE_OK(gradacc_accumulator_destroy(src.finite));
    REQUIRE_OK(gradacc_accumulator_destroy(src.overflowed));
}

/* --- 5. the BF16 wire --------------------------------------------------------------------- */

enum { WIRE_N = 5003 };

typedef struct {
    gradacc_comm_t *comm;
    const float *x;
    float *out;
} wire_rank;

/* One CPU rank: its values summed over the group on the BF16 wire, unnormalised, at scale 1. */
static void *wire_rank_sync(void *arg)
{
    wire_rank *w = arg;
    gradacc_accumulator_config_t c;
    REQUIRE_OK(gradacc_accumulator_config_default(&c));
    c.normalize = GRADACC_NORMALIZE_NONE;
    c.loss_reduction = GRADACC_LOSS_REDUCTION_SUM;
    c.wire_dtype = GRADACC_DTYPE_BF16;
    gradacc_tensor_desc_t t = {WIRE_N, GRADACC_DTYPE_F32};
    gradacc_accumulator_t *acc = NULL;
    REQUIRE_OK(gradacc_accumulator_create(&c, &t, 1, NULL, &acc));
    gradacc_scaler_t *scaler = scaler_with_scale(1.0f);
    const void *grads[1] = {w->x};
    REQUIRE_OK(gradacc_accumulator_add(acc, scaler, grads, 1, 1));
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    REQUIRE_OK(gradacc_accumulator_sync(acc, w->comm, &info));
    float *master = NULL;
    size_t n = 0;
    REQUIRE_OK(gradacc_accumulator_master(acc, 0, &master, &n));
    memcpy(w->out, master, n * sizeof(float));
    gradacc_accumulator_destroy(acc);
    gradacc_scaler_destroy(scaler);
    return NULL;
}

static void check_bf16_wire(test_rng *r)
{
    for (int world = 2; world <= 3; world++) {
        float *x = xmalloc((size_t)world * WIRE_N * sizeof(float));
        float *out = xmalloc((size_t)world * WIRE_N * sizeof(float));
        unsigned short *words = xmalloc((size_t)world * WIRE_N * sizeof(unsigned short));
        for (size_t i = 0; i < (size_t)world * WIRE_N; i++) {
            float v = (float)(exp(rng_range(r, log(1e-3), log(1e3))) * (rng_below(r, 2) ? -1.0 : 1.0));
            if (i % 7 == 0) {
                /* a tie between two bf16 values: round to even */
                uint32_t b = bits32(v);
                b = (b & 0xffff0000u) | 0x8000u;
                memcpy(&v, &b, sizeof v);
            }
            x[i] = v;
            words[i] = ga_f32_to_bf16(v);
        }
        gradacc_comm_t *comms[3] = {NULL, NULL, NULL};
        REQUIRE_OK(gradacc_comm_create_local(world, comms));
        wire_rank args[3];
        for (int q = 0; q < world; q++)
            args[q] = (wire_rank){comms[q], x + (size_t)q * WIRE_N, out + (size_t)q * WIRE_N};
        run_ranks((size_t)world, wire_rank_sync, args, sizeof args[0]);
        int bad = 0;
        for (int q = 0; q < world; q++)
            for (size_t i = 0; i < WIRE_N; i++) {
                float want = ga_sum_bf16_at(words, WIRE_N, (ga_u64)world, i);
                if (bits32(out[(size_t)q * WIRE_N + i]) != bits32(want) && bad++ < SHOWN)
                    fprintf(stderr, "bf16 wire, %d ranks: rank %d element %zu: CPU %a, math.cuh %a\n", world, q, i,
                            out[(size_t)q * WIRE_N + i], want);
            }
        CHECK(bad == 0, "bf16 wire, %d ranks: %d sums differ", world, bad);
        for (int q = 0; q < world; q++)
            gradacc_comm_destroy(comms[q]);
        free(x);
        free(out);
        free(words);
    }
}

int main(void)
{
    test_rng rng = rng_fresh("cuda_math_host");

    /* The codes math.cuh hard-codes are the C API's. */
    CHECK(GA_DTYPE_F32 == GRADACC_DTYPE_F32 && GA_DTYPE_F16 == GRADACC_DTYPE_F16 && GA_DTYPE_BF16 == GRADACC_DTYPE_BF16,
          "dtype codes");
    CHECK(GA_NORMALIZE_BY_COUNT == GRADACC_NORMALIZE_BY_COUNT &&
              GA_NORMALIZE_BY_MICROBATCHES == GRADACC_NORMALIZE_BY_MICROBATCHES &&
              GA_NORMALIZE_BY_WORLD == GRADACC_NORMALIZE_BY_WORLD && GA_NORMALIZE_NONE == GRADACC_NORMALIZE_NONE,
          "normalize codes");

    /* (1 + 2^-12)^2 - (1 + 2^-11) is 2^-24 when fused, 0 when the product is rounded first. */
    volatile float near_one = 1.0f + 0x1p-12f, minus = -(1.0f + 0x1p-11f);
    CHECK(ga_accumulate_one(minus, near_one, near_one, 0) == 0.0f,
          "math.cuh was compiled with multiply-add contraction: build it with -ffp-contract=off");

    check_widening(GA_DTYPE_F16);
    check_widening(GA_DTYPE_BF16);
    check_narrowing(&rng);

    enum { TRIALS = 96 }; /* every normalisation x reduction x clipping mode, four times */
    int synced = 0, clipped = 0, overflowed = 0;
    for (int trial = 0; trial < TRIALS; trial++)
        check_windows(&rng, trial, &synced, &clipped, &overflowed);
    printf("accumulate + boundary: %d trials, %d windows synced, %d clipped, %d overflowed\n", TRIALS, synced,
           clipped, overflowed);

    check_scaler(&rng);
    check_bf16_wire(&rng);
    return test_finish();
}
