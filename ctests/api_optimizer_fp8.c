/* FP8 weights on the all-gather through the C API: `config.weight_formats` and
 * gradacc_optimizer_step_scaled, on 1, 2 and 3 ranks of the in-process communicator under
 * GRADACC_SHARDING_REDUCE_SCATTER.
 *
 * Every rank adopts its shard's FP32 masters (so the test can read them), adds its micro-batch
 * of random gradients and steps AdamW twice: tensor 0 f32 in its model dtype, tensor 1 (odd
 * length, larger than a shard) E4M3 with a scale per tensor, tensor 2 MXFP8, tensor 3 bf16.
 * After each step the masters of every rank are joined, and every rank's codes and scales must
 * be bitwise those of quantising each whole tensor's masters once by this file's reference
 * (E4M3 by nearest search over the 256 codes, ties to the even code; scale 448 / amax in f64
 * rounded to f32; MXFP8's shared exponent floor(log2(block amax)) - 8).
 *
 * Misuse: an unknown format (INVALID_ARGUMENT naming `config`.weight_formats[1]), FP8 weights
 * without a sharded boundary (INVALID_ARGUMENT naming weight_formats[1]), gradacc_optimizer_step
 * of an FP8 optimizer (`scales` is NULL), a NULL scale of an FP8 tensor, and a scale given for a
 * model-dtype tensor: each refused, the step after them whole. */
#include "common.h"

#include <math.h>

enum { TENSORS = 4, MAX_RANKS = 3, STEPS = 2 };
static const size_t numel[TENSORS] = {300, 9001, 4133, 77};
static const gradacc_dtype_t dtypes[TENSORS] = {GRADACC_DTYPE_F32, GRADACC_DTYPE_BF16, GRADACC_DTYPE_F16,
                                                GRADACC_DTYPE_BF16};
static const gradacc_weight_format_t formats[TENSORS] = {GRADACC_WEIGHTS_MODEL, GRADACC_WEIGHTS_E4M3_TENSORWISE,
                                                         GRADACC_WEIGHTS_MXFP8, GRADACC_WEIGHTS_MODEL};

/* ---- The reference quantisers, from the formats' definitions ---- */

/* The value of E4M3 code c (float8_e4m3fn: no infinities, 0x7f and 0xff are NaN). */
static double e4m3_value(uint8_t c)
{
    int sign = c >> 7, e = (c >> 3) & 15, m = c & 7;
    double v = e == 0 ? ldexp(m, -9) : ldexp(8 + m, e - 10);
    return sign ? -v : v;
}

/* E4M3 of x, saturated at ±448, rounded to the nearest code, ties to the even one. */
static uint8_t e4m3_of(double x)
{
    if (isnan(x))
        return signbit(x) ? 0xff : 0x7f;
    int best = -1;
    double best_d = INFINITY;
    for (int c = 0; c < 256; c++) {
        if ((c & 0x7f) == 0x7f || (signbit(x) != 0) != (c >> 7))
            continue;
        double d = fabs(e4m3_value((uint8_t)c) - fmax(fmin(x, 448.0), -448.0));
        if (d < best_d || (d == best_d && (c & 1) == 0)) {
            best = c;
            best_d = d;
        }
    }
    return (uint8_t)best;
}

static float e4m3_scale(const float *x, size_t n)
{
    double amax = 0;
    for (size_t i = 0; i < n; i++)
        amax = fmax(amax, fabs((double)x[i]));
    return (float)(448.0 / fmax(amax, 1e-12));
}

/* ---- One rank ---- */

typedef struct {
    int rank, world;
    gradacc_comm_t *comm;
    float *whole[TENSORS];                 /* the joined masters, written by every rank */
    uint8_t *codes[TENSORS];               /* this rank's FP8 codes (tensors 1 and 2) */
    float e4m3_scale;                      /* tensor 1's scale */
    uint8_t *mx_scales;                    /* tensor 2's scales */
    uint8_t *codes_after[STEPS][TENSORS];  /* copies after each step */
    float e4m3_after[STEPS];
    uint8_t *mx_after[STEPS];
    float *masters_after[STEPS][TENSORS];  /* the whole masters after each step (rank 0 joins) */
} rank_args;

static pthread_barrier_t joined;

static void *rank_main(void *arg)
{
    rank_args *a = arg;
    gradacc_tensor_desc_t t[TENSORS];
    for (int i = 0; i < TENSORS; i++)
        t[i] = (gradacc_tensor_desc_t){numel[i], dtypes[i]};
    gradacc_accumulator_config_t ac;
    REQUIRE_OK(gradacc_accumulator_config_default(&ac));
    ac.sharding = GRADACC_SHARDING_REDUCE_SCATTER;
    ac.shard_count = (uint32_t)a->world;
    ac.shard_rank = (uint32_t)a->rank;
    gradacc_accumulator_t *acc = NULL;
    REQUIRE_OK(gradacc_accumulator_create(&ac, t, TENSORS, NULL, &acc));
    size_t start = 0, len = 0, offset[TENSORS];
    float *unused = NULL;
    REQUIRE_OK(gradacc_accumulator_shard(acc, &start, &len, &unused));
    for (int i = 0; i < TENSORS; i++)
        REQUIRE_OK(gradacc_accumulator_offset(acc, (size_t)i, &offset[i]));

    /* The initial weights, the same on every rank, and this rank's adopted masters from them. */
    test_rng r = rng_fresh("api_optimizer_fp8 weights");
    grad_buf w[TENSORS];
    float *masters = calloc(len ? len : 1, sizeof(float));
    for (int i = 0; i < TENSORS; i++) {
        w[i] = grad_alloc(dtypes[i], numel[i]);
        for (size_t e = 0; e < numel[i]; e++) {
            double v = rng_range(&r, -2.0, 2.0) * (i == 2 ? ldexp(1.0, (int)(e % 24) - 12) : 1.0);
            if (dtypes[i] == GRADACC_DTYPE_F32)
                ((float *)w[i].data)[e] = (float)v;
            else if (dtypes[i] == GRADACC_DTYPE_BF16)
                ((uint16_t *)w[i].data)[e] = f32_to_bf16_bits((float)v);
            else
                ((uint16_t *)w[i].data)[e] = f32_to_f16_bits((float)v);
            size_t flat = offset[i] + e;
            if (flat >= start && flat < start + len)
                masters[flat - start] = dtypes[i] == GRADACC_DTYPE_F32    ? ((float *)w[i].data)[e]
                                        : dtypes[i] == GRADACC_DTYPE_BF16 ? bf16_bits_to_f32(((uint16_t *)w[i].data)[e])
                                                                           : f16_bits_to_f32(((uint16_t *)w[i].data)[e]);
        }
    }
    gradacc_optimizer_config_t oc;
    REQUIRE_OK(gradacc_optimizer_config_default(&oc));
    oc.lr = 0.05f;
    oc.weight_formats = formats;
    const void *init[TENSORS] = {w[0].data, w[1].data, w[2].data, w[3].data};
    gradacc_optimizer_t *opt = NULL;
    REQUIRE_OK(gradacc_optimizer_create_with_masters(acc, &oc, NULL, init, NULL, TENSORS, masters, len, &opt));

    a->codes[1] = calloc(numel[1], 1);
    a->codes[2] = calloc(numel[2], 1);
    a->mx_scales = calloc((numel[2] + 31) / 32, 1);
    void *weights[TENSORS] = {w[0].data, a->codes[1], a->codes[2], w[3].data};
    void *scales[TENSORS] = {NULL, &a->e4m3_scale, a->mx_scales, NULL};
    gradacc_scaler_t *scaler = scaler_with_scale(1.0f);
    test_rng g = rng_fresh("api_optimizer_fp8 gradients");
    for (int step = 0; step < STEPS; step++) {
        grad_buf grads[TENSORS];
        const void *p[TENSORS];
        for (int i = 0; i < TENSORS; i++) {
            grads[i] = grad_alloc(dtypes[i], numel[i]);
            double *v = calloc(numel[i], sizeof(double));
            for (size_t e = 0; e < numel[i]; e++)
                v[e] = rng_range(&g, -1.0, 1.0) * (1 + a->rank);
            grad_encode(&grads[i], v, 1.0, NULL);
            free(v);
            p[i] = grads[i].data;
        }
        REQUIRE_OK(gradacc_accumulator_add(acc, scaler, p, TENSORS, 1));
        gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
        REQUIRE_OK(gradacc_accumulator_sync(acc, a->comm, &info));
        if (step == 0) {
            /* Misuse, each refused with the step still to come. */
            EXPECT_ERROR(gradacc_optimizer_step(opt, acc, weights, TENSORS, a->comm, NULL),
                         GRADACC_STATUS_INVALID_ARGUMENT, "`scales` is NULL");
            void *no_scale[TENSORS] = {NULL, NULL, a->mx_scales, NULL};
            EXPECT_ERROR(gradacc_optimizer_step_scaled(opt, acc, weights, no_scale, TENSORS, a->comm, NULL),
                         GRADACC_STATUS_NULL_ARGUMENT, "scales[1]");
            void *extra[TENSORS] = {&a->e4m3_scale, &a->e4m3_scale, a->mx_scales, NULL};
            EXPECT_ERROR(gradacc_optimizer_step_scaled(opt, acc, weights, extra, TENSORS, a->comm, NULL),
                         GRADACC_STATUS_INVALID_ARGUMENT, "`scales[0]`");
        }
        bool stepped = false;
        REQUIRE_OK(gradacc_optimizer_step_scaled(opt, acc, weights, scales, TENSORS, a->comm, &stepped));
        CHECK(stepped, "rank %d, step %d: not stepped", a->rank, step);
        for (int i = 0; i < TENSORS; i++) {
            size_t from = offset[i] > start ? offset[i] : start;
            size_t to = offset[i] + numel[i] < start + len ? offset[i] + numel[i] : start + len;
            for (size_t flat = from; flat < to; flat++)
                a->whole[i][flat - offset[i]] = masters[flat - start];
            grad_free(&grads[i]);
        }
        for (int i = 1; i <= 2; i++) {
            a->codes_after[step][i] = malloc(numel[i]);
            memcpy(a->codes_after[step][i], a->codes[i], numel[i]);
        }
        a->e4m3_after[step] = a->e4m3_scale;
        a->mx_after[step] = malloc((numel[2] + 31) / 32);
        memcpy(a->mx_after[step], a->mx_scales, (numel[2] + 31) / 32);
        pthread_barrier_wait(&joined);
        if (a->rank == 0)
            for (int i = 0; i < TENSORS; i++) {
                a->masters_after[step][i] = malloc(numel[i] * sizeof(float));
                memcpy(a->masters_after[step][i], a->whole[i], numel[i] * sizeof(float));
            }
        pthread_barrier_wait(&joined);
    }
    gradacc_optimizer_destroy(opt);
    gradacc_scaler_destroy(scaler);
    gradacc_accumulator_destroy(acc);
    for (int i = 0; i < TENSORS; i++)
        grad_free(&w[i]);
    free(masters);
    free(a->codes[1]);
    free(a->codes[2]);
    free(a->mx_scales);
    return NULL;
}

/* Every rank's codes and scales after each step against the reference of the joined masters. */
static void check_world(int world)
{
    /* On the heap: the ranks' count is only known here. */
    gradacc_comm_t **comms = calloc((size_t)world, sizeof *comms);
    REQUIRE_OK(gradacc_comm_create_local(world, comms));
    float *whole[TENSORS];
    for (int i = 0; i < TENSORS; i++)
        whole[i] = calloc(numel[i], sizeof(float));
    rank_args *args = calloc((size_t)world, sizeof *args);
    pthread_barrier_init(&joined, NULL, (unsigned)world);
    for (int q = 0; q < world; q++) {
        args[q].rank = q;
        args[q].world = world;
        args[q].comm = comms[q];
        for (int i = 0; i < TENSORS; i++)
            args[q].whole[i] = whole[i];
    }
    run_ranks((size_t)world, rank_main, args, sizeof args[0]);
    pthread_barrier_destroy(&joined);
    for (int step = 0; step < STEPS; step++) {
        float *const *m = args[0].masters_after[step];
        float scale = e4m3_scale(m[1], numel[1]);
        size_t code_errors = 0, scale_errors = 0;
        for (int q = 0; q < world; q++) {
            scale_errors += memcmp(&args[q].e4m3_after[step], &scale, sizeof scale) != 0;
            for (size_t e = 0; e < numel[1]; e++)
                code_errors += args[q].codes_after[step][1][e] != e4m3_of((double)(m[1][e] * scale));
            for (size_t b = 0; b * 32 < numel[2]; b++) {
                size_t end = (b + 1) * 32 < numel[2] ? (b + 1) * 32 : numel[2];
                double amax = 0;
                for (size_t e = b * 32; e < end; e++)
                    amax = fmax(amax, fabs((double)m[2][e]));
                int x = amax > 0 ? (int)floor(log2(amax)) - 8 : -127;
                x = x < -127 ? -127 : x > 127 ? 127 : x;
                scale_errors += args[q].mx_after[step][b] != (uint8_t)(x + 127);
                for (size_t e = b * 32; e < end; e++)
                    code_errors += args[q].codes_after[step][2][e] != e4m3_of(ldexp((double)m[2][e], -x));
            }
        }
        CHECK(code_errors == 0 && scale_errors == 0,
              "%d ranks, step %d: %zu codes and %zu scales differ from quantising the whole masters", world, step,
              code_errors, scale_errors);
        for (int i = 0; i < TENSORS; i++)
            free(args[0].masters_after[step][i]);
        for (int q = 0; q < world; q++) {
            free(args[q].codes_after[step][1]);
            free(args[q].codes_after[step][2]);
            free(args[q].mx_after[step]);
        }
    }
    for (int q = 0; q < world; q++)
        EXPECT_OK(gradacc_comm_destroy(comms[q]));
    free(comms);
    free(args);
    for (int i = 0; i < TENSORS; i++)
        free(whole[i]);
}

/* What an optimizer of FP8 weights cannot be created with, each refused naming it. */
static void check_creation(void)
{
    gradacc_tensor_desc_t t[TENSORS];
    for (int i = 0; i < TENSORS; i++)
        t[i] = (gradacc_tensor_desc_t){numel[i], dtypes[i]};
    grad_buf w[TENSORS];
    const void *init[TENSORS];
    for (int i = 0; i < TENSORS; i++) {
        w[i] = grad_alloc(dtypes[i], numel[i]);
        init[i] = w[i].data;
    }
    gradacc_optimizer_config_t oc;
    REQUIRE_OK(gradacc_optimizer_config_default(&oc));
    CHECK(oc.weight_formats == NULL, "the default weight_formats is NULL");
    gradacc_accumulator_t *plain = NULL;
    REQUIRE_OK(gradacc_accumulator_create(NULL, t, TENSORS, NULL, &plain));
    gradacc_optimizer_t *opt = NULL;
    oc.weight_formats = formats;
    EXPECT_ERROR(gradacc_optimizer_create(plain, &oc, NULL, init, NULL, TENSORS, &opt), GRADACC_STATUS_INVALID_ARGUMENT,
                 "`weight_formats[1]`");
    const gradacc_weight_format_t unknown[TENSORS] = {0, 7, 0, 0};
    oc.weight_formats = unknown;
    EXPECT_ERROR(gradacc_optimizer_create(plain, &oc, NULL, init, NULL, TENSORS, &opt), GRADACC_STATUS_INVALID_ARGUMENT,
                 "`config`.weight_formats[1] = 7");
    CHECK(opt == NULL, "a refused creation leaves the output alone");
    gradacc_accumulator_destroy(plain);
    for (int i = 0; i < TENSORS; i++)
        grad_free(&w[i]);
}

int main(void)
{
    check_creation();
    for (int world = 1; world <= MAX_RANKS; world++)
        check_world(world);
    return test_finish();
}
