/* The optimizer over the caller's FP32 masters through the C ABI: creation keeps the caller's
 * values, every step updates them in place (checked against plain SGD written out here: the
 * caller's master - lr * g in f32, the fp16 weight its nearest), a skipped step and a refused load
 * leave them bit for bit, a load writes into them, and each bad argument is refused with its name
 * and nothing created. */
#include "common.h"

#define N0 301 /* fp16 weights */
#define N1 7   /* f32 bias */
#define LR 0.125f

static float grad0(size_t i) { return (float)((double)(i % 5) * 0.25 - 0.5); }

/* One window of gradients (fp16 for tensor 0, f32 for 1), synced; `poison` makes it overflow. */
static void window(gradacc_accumulator_t *acc, gradacc_scaler_t *scaler, int poison)
{
    uint16_t g0[N0];
    float g1[N1];
    for (size_t i = 0; i < N0; i++)
        g0[i] = f32_to_f16_bits(grad0(i));
    for (size_t i = 0; i < N1; i++)
        g1[i] = 0.75f;
    if (poison)
        g0[5] = 0x7c00; /* +inf */
    const void *grads[2] = {g0, g1};
    REQUIRE_OK(gradacc_accumulator_add(acc, scaler, grads, 2, 1));
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    REQUIRE_OK(gradacc_accumulator_sync(acc, NULL, &info));
    CHECK(info.found_inf == (poison != 0), "found_inf %d", (int)info.found_inf);
}

static void test_adopted_masters(void)
{
    gradacc_scaler_config_t sc;
    REQUIRE_OK(gradacc_scaler_config_default(&sc));
    sc.dynamic = false;
    sc.init_scale = 1.0f;
    gradacc_scaler_t *scaler = NULL;
    REQUIRE_OK(gradacc_scaler_create(&sc, NULL, &scaler));
    gradacc_tensor_desc_t tensors[2] = {{N0, GRADACC_DTYPE_F16}, {N1, GRADACC_DTYPE_F32}};
    gradacc_accumulator_config_t ac;
    REQUIRE_OK(gradacc_accumulator_config_default(&ac));
    gradacc_accumulator_t *acc = NULL;
    REQUIRE_OK(gradacc_accumulator_create(&ac, tensors, 2, NULL, &acc));
    size_t numel = 0, at1 = 0;
    REQUIRE_OK(gradacc_accumulator_master_numel(tensors, 2, &numel));
    REQUIRE_OK(gradacc_accumulator_offset(acc, 1, &at1));

    /* The caller's masters hold more than the fp16 weights: 1/3-steps the weights round away. */
    float *masters = calloc(numel + 1, sizeof(float));
    uint16_t w0[N0];
    float w1[N1];
    for (size_t i = 0; i < N0; i++) {
        masters[i] = (float)(0.01 * (double)i - 1.0) + 1.0f / 3.0f;
        w0[i] = f32_to_f16_bits(masters[i]);
    }
    for (size_t i = 0; i < N1; i++)
        masters[at1 + i] = w1[i] = (float)i * 0.5f + 1.0f / 3.0f;
    float *expected = malloc(numel * sizeof(float));
    memcpy(expected, masters, numel * sizeof(float));

    gradacc_optimizer_config_t oc;
    REQUIRE_OK(gradacc_optimizer_config_default(&oc));
    oc.algorithm = GRADACC_OPTIMIZER_SGD;
    oc.lr = LR;
    oc.weight_decay = 0.0f;
    const void *initial[2] = {w0, w1};
    w1[0] = 99.0f; /* a weight that is not the master: creation must keep the caller's master */

    /* Bad arguments: each named, nothing created, the masters untouched. */
    gradacc_optimizer_t *bad = NULL;
    EXPECT_ERROR(gradacc_optimizer_create_with_masters(acc, &oc, NULL, initial, NULL, 2, NULL, numel, &bad),
                 GRADACC_STATUS_NULL_ARGUMENT, "masters");
    float *misaligned = (float *)((char *)masters + 2);
    EXPECT_ERROR(gradacc_optimizer_create_with_masters(acc, &oc, NULL, initial, NULL, 2, misaligned, numel,
                                                       &bad),
                 GRADACC_STATUS_INVALID_ARGUMENT, "aligned");
    EXPECT_ERROR(gradacc_optimizer_create_with_masters(acc, &oc, NULL, initial, NULL, 2, masters, numel - 1,
                                                       &bad),
                 GRADACC_STATUS_SIZE_MISMATCH, "`masters`");
    EXPECT_ERROR(gradacc_optimizer_create_with_masters(acc, &oc, NULL, initial, NULL, 2, masters, numel + 1,
                                                       &bad),
                 GRADACC_STATUS_SIZE_MISMATCH, "`masters`");
    EXPECT_ERROR(gradacc_optimizer_create_with_masters(NULL, &oc, NULL, initial, NULL, 2, masters, numel, &bad),
                 GRADACC_STATUS_NULL_ARGUMENT, "acc");
    EXPECT_ERROR(gradacc_optimizer_create_with_masters(acc, &oc, NULL, initial, NULL, 1, masters, numel, &bad),
                 GRADACC_STATUS_SIZE_MISMATCH, "`n`");
    const void *holes[2] = {w0, NULL};
    EXPECT_ERROR(gradacc_optimizer_create_with_masters(acc, &oc, NULL, holes, NULL, 2, masters, numel, &bad),
                 GRADACC_STATUS_NULL_ARGUMENT, "weights[1]");
    gradacc_optimizer_config_t wrong = oc;
    wrong.rounding = 9;
    EXPECT_ERROR(gradacc_optimizer_create_with_masters(acc, &wrong, NULL, initial, NULL, 2, masters, numel,
                                                       &bad),
                 GRADACC_STATUS_INVALID_ARGUMENT, "rounding");
    EXPECT_ERROR(gradacc_optimizer_create_with_masters(acc, &oc, NULL, initial, NULL, 2, masters, numel, NULL),
                 GRADACC_STATUS_NULL_ARGUMENT, "out");
    CHECK(bad == NULL, "a failed create wrote a handle");

    gradacc_optimizer_t *opt = NULL;
    REQUIRE_OK(gradacc_optimizer_create_with_masters(acc, &oc, NULL, initial, NULL, 2, masters, numel, &opt));
    CHECK(memcmp(masters, expected, numel * sizeof(float)) == 0, "creation wrote the masters");
    w1[0] = expected[at1];

    void *weights[2] = {w0, w1};
    for (int step = 0; step < 5; step++) {
        int poison = step == 2;
        window(acc, scaler, poison);
        bool stepped = false;
        REQUIRE_OK(gradacc_optimizer_step(opt, acc, weights, 2, NULL, &stepped));
        CHECK(stepped == !poison, "step %d stepped %d", step, (int)stepped);
        if (!poison) {
            for (size_t i = 0; i < N0; i++)
                expected[i] = expected[i] + (-LR) * grad0(i);
            for (size_t i = 0; i < N1; i++)
                expected[at1 + i] = expected[at1 + i] + (-LR) * 0.75f;
        }
        for (size_t i = 0; i < N0; i++) {
            CHECK(masters[i] == expected[i], "step %d master %zu = %.9g, expected %.9g", step, i,
                  masters[i], expected[i]);
            CHECK(w0[i] == f32_to_f16_bits(expected[i]), "step %d w0[%zu]", step, i);
        }
        for (size_t i = 0; i < N1; i++)
            CHECK(masters[at1 + i] == expected[at1 + i] && w1[i] == expected[at1 + i],
                  "step %d w1[%zu] = %g, master %g, expected %g", step, i, w1[i], masters[at1 + i],
                  expected[at1 + i]);
    }

    /* Save; a refused load leaves the masters bit for bit; a load writes the saved ones back. */
    size_t len = 0;
    REQUIRE_OK(gradacc_optimizer_save(opt, NULL, 0, &len));
    uint8_t *saved = malloc(len);
    REQUIRE_OK(gradacc_optimizer_save(opt, saved, len, &len));
    for (size_t i = 0; i < N0; i++)
        masters[i] = -7.0f; /* the caller's own write between calls */
    memcpy(expected, masters, numel * sizeof(float));
    const uint8_t *parts[1] = {saved};
    size_t lens[1] = {len};
    saved[len / 2] ^= 4;
    EXPECT_ERROR(gradacc_optimizer_load(opt, parts, lens, 1), GRADACC_STATUS_CORRUPT_STATE, "checksum");
    CHECK(memcmp(masters, expected, numel * sizeof(float)) == 0, "a refused load wrote the masters");
    saved[len / 2] ^= 4;
    EXPECT_OK(gradacc_optimizer_load(opt, parts, lens, 1));
    for (size_t i = 0; i < N0; i++)
        CHECK(f32_to_f16_bits(masters[i]) == w0[i], "loaded master %zu = %g", i, masters[i]);
    free(saved);

    EXPECT_OK(gradacc_optimizer_destroy(opt));
    CHECK(masters[numel] == 0.0f, "written past the masters");
    free(masters);
    free(expected);
    EXPECT_OK(gradacc_accumulator_destroy(acc));
    EXPECT_OK(gradacc_scaler_destroy(scaler));
}

/* Under a reduce-scatter boundary the masters are the rank's shard: the whole layout is refused. */
static void test_sharded_length(void)
{
    gradacc_tensor_desc_t tensors[2] = {{N0, GRADACC_DTYPE_F16}, {N1, GRADACC_DTYPE_F32}};
    gradacc_accumulator_config_t ac;
    REQUIRE_OK(gradacc_accumulator_config_default(&ac));
    ac.sharding = GRADACC_SHARDING_REDUCE_SCATTER;
    ac.shard_count = 2;
    ac.shard_rank = 1;
    gradacc_accumulator_t *acc = NULL;
    REQUIRE_OK(gradacc_accumulator_create(&ac, tensors, 2, NULL, &acc));
    size_t whole = 0, start = 0, numel = 0;
    float *data = NULL;
    REQUIRE_OK(gradacc_accumulator_master_numel(tensors, 2, &whole));
    REQUIRE_OK(gradacc_accumulator_shard(acc, &start, &numel, &data));
    CHECK(numel < whole, "rank 1 holds %zu of %zu", numel, whole);
    float *masters = calloc(whole, sizeof(float));
    uint16_t w0[N0] = {0};
    float w1[N1] = {0};
    const void *initial[2] = {w0, w1};
    gradacc_optimizer_t *opt = NULL;
    EXPECT_ERROR(gradacc_optimizer_create_with_masters(acc, NULL, NULL, initial, NULL, 2, masters, whole, &opt),
                 GRADACC_STATUS_SIZE_MISMATCH, "gradacc_accumulator_shard");
    CHECK(opt == NULL, "a failed create wrote a handle");
    REQUIRE_OK(gradacc_optimizer_create_with_masters(acc, NULL, NULL, initial, NULL, 2, masters, numel, &opt));
    EXPECT_OK(gradacc_optimizer_destroy(opt));
    free(masters);
    EXPECT_OK(gradacc_accumulator_destroy(acc));
}

int main(void)
{
    test_adopted_masters();
    test_sharded_length();
    return test_finish();
}
