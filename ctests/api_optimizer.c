/* The optimizer through the C ABI: the whole mixed-precision step (scale, accumulate, sync, update
 * the scale, step the FP32 masters and write the model's fp16 weights), a skipped step that
 * changes nothing, save and load, a reduce-scatter group whose ranks all-gather the weights, and
 * bad arguments refused with the argument named and nothing changed. The numbers are checked
 * against plain SGD written out here: w - lr * g in f32, rounded once to fp16. */
#include <stddef.h>
#include "common.h"

#define N0 300 /* fp16 weights */
#define N1 7   /* f32 bias */
#define LR 0.125f

static void init_weights(uint16_t *w0, float *w1)
{
    for (size_t i = 0; i < N0; i++)
        w0[i] = f32_to_f16_bits((float)(0.01 * (double)i - 1.0));
    for (size_t i = 0; i < N1; i++)
        w1[i] = (float)i * 0.5f;
}

/* The micro-batch gradients of element i, scaled by `scale`: fp16 for tensor 0, f32 for 1. */
static void gradients(uint16_t *g0, float *g1, float scale, int poison)
{
    for (size_t i = 0; i < N0; i++)
        g0[i] = f32_to_f16_bits((float)((double)(i % 7) * 0.25 - 0.5) * scale);
    for (size_t i = 0; i < N1; i++)
        g1[i] = 0.75f * scale;
    if (poison)
        g0[3] = 0x7c00; /* +inf */
}

static gradacc_optimizer_config_t sgd_config(void)
{
    gradacc_optimizer_config_t c;
    REQUIRE_OK(gradacc_optimizer_config_default(&c));
    c.algorithm = GRADACC_OPTIMIZER_SGD;
    c.lr = LR;
    c.weight_decay = 0.0f;
    return c;
}

/* One training step of the README's loop; returns whether the optimizer stepped. */
static bool train_step(gradacc_scaler_t *scaler, gradacc_accumulator_t *acc,
                       gradacc_optimizer_t *opt, uint16_t *w0, float *w1, int poison)
{
    uint16_t g0[N0];
    float g1[N1], scale;
    REQUIRE_OK(gradacc_scaler_scale(scaler, &scale));
    gradients(g0, g1, scale, poison);
    const void *grads[2] = {g0, g1};
    REQUIRE_OK(gradacc_accumulator_add(acc, scaler, grads, 2, 1));
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    REQUIRE_OK(gradacc_accumulator_sync(acc, NULL, &info));
    const gradacc_accumulator_t *accs[1] = {acc};
    bool skipped = false;
    REQUIRE_OK(gradacc_scaler_update(scaler, accs, 1, &skipped));
    CHECK(skipped == info.found_inf, "the scaler and the boundary disagree");
    void *weights[2] = {w0, w1};
    bool stepped = false;
    REQUIRE_OK(gradacc_optimizer_step(opt, acc, weights, 2, NULL, &stepped));
    return stepped;
}

static void test_whole_step(void)
{
    gradacc_scaler_config_t sc;
    REQUIRE_OK(gradacc_scaler_config_default(&sc));
    sc.init_scale = 1024.0f; /* the gradients times the scale stay finite in fp16 */
    gradacc_scaler_t *scaler = NULL;
    REQUIRE_OK(gradacc_scaler_create(&sc, NULL, &scaler));
    gradacc_tensor_desc_t tensors[2] = {{N0, GRADACC_DTYPE_F16}, {N1, GRADACC_DTYPE_F32}};
    gradacc_accumulator_config_t ac;
    REQUIRE_OK(gradacc_accumulator_config_default(&ac));
    gradacc_accumulator_t *acc = NULL;
    REQUIRE_OK(gradacc_accumulator_create(&ac, tensors, 2, NULL, &acc));

    uint16_t w0[N0];
    float w1[N1];
    init_weights(w0, w1);
    const void *initial[2] = {w0, w1};
    gradacc_optimizer_config_t oc = sgd_config();
    gradacc_optimizer_t *opt = NULL;
    REQUIRE_OK(gradacc_optimizer_create(acc, &oc, NULL, initial, NULL, 2, &opt));

    /* The reference: FP32 masters, SGD, fp16 written by rounding to nearest even. */
    float m0[N0], m1[N1];
    for (size_t i = 0; i < N0; i++)
        m0[i] = f16_bits_to_f32(w0[i]);
    memcpy(m1, w1, sizeof m1);
    for (int step = 0; step < 4; step++) {
        int poison = step == 2;
        uint16_t before0[N0];
        memcpy(before0, w0, sizeof w0);
        bool stepped = train_step(scaler, acc, opt, w0, w1, poison);
        CHECK(stepped == !poison, "step %d stepped %d", step, (int)stepped);
        if (poison) {
            CHECK(memcmp(before0, w0, sizeof w0) == 0, "a skipped step changed the weights");
            continue;
        }
        for (size_t i = 0; i < N0; i++) {
            float g = (float)((double)(i % 7) * 0.25 - 0.5);
            m0[i] = m0[i] + (-LR) * g;
            CHECK(w0[i] == f32_to_f16_bits(m0[i]), "step %d w0[%zu] = %#x, expected %#x", step, i,
                  w0[i], f32_to_f16_bits(m0[i]));
        }
        for (size_t i = 0; i < N1; i++) {
            m1[i] = m1[i] + (-LR) * 0.75f;
            CHECK(w1[i] == m1[i], "step %d w1[%zu] = %g, expected %g", step, i, w1[i], m1[i]);
        }
    }
    uint64_t steps = 0;
    EXPECT_OK(gradacc_optimizer_steps(opt, &steps));
    CHECK(steps == 3, "steps = %llu", (unsigned long long)steps);

    /* A second step from the same window, and save/load: refused and restored exactly. */
    void *weights[2] = {w0, w1};
    EXPECT_ERROR(gradacc_optimizer_step(opt, acc, weights, 2, NULL, NULL), GRADACC_STATUS_WRONG_STATE,
                 "already stepped");
    size_t len = 0;
    REQUIRE_OK(gradacc_optimizer_save(opt, NULL, 0, &len));
    uint8_t *saved = malloc(len);
    REQUIRE_OK(gradacc_optimizer_save(opt, saved, len, &len));
    const uint8_t *parts[1] = {saved};
    size_t lens[1] = {len};
    saved[len / 2] ^= 1;
    EXPECT_ERROR(gradacc_optimizer_load(opt, parts, lens, 1), GRADACC_STATUS_CORRUPT_STATE, "checksum");
    saved[len / 2] ^= 1;
    EXPECT_OK(gradacc_optimizer_load(opt, parts, lens, 1));
    EXPECT_OK(gradacc_optimizer_steps(opt, &steps));
    CHECK(steps == 3, "steps after load = %llu", (unsigned long long)steps);

    /* The same part twice: refused, and a fresh optimizer keeps its state byte for byte. */
    gradacc_optimizer_t *fresh = NULL;
    REQUIRE_OK(gradacc_optimizer_create(acc, &oc, NULL, initial, NULL, 2, &fresh));
    size_t fresh_len = 0;
    REQUIRE_OK(gradacc_optimizer_save(fresh, NULL, 0, &fresh_len));
    uint8_t *fresh_before = malloc(fresh_len), *fresh_after = malloc(fresh_len);
    REQUIRE_OK(gradacc_optimizer_save(fresh, fresh_before, fresh_len, &fresh_len));
    const uint8_t *twice[2] = {saved, saved};
    size_t twice_lens[2] = {len, len};
    EXPECT_ERROR(gradacc_optimizer_load(fresh, twice, twice_lens, 2), GRADACC_STATUS_INVALID_ARGUMENT,
                 "part 1 is part 0 given twice");
    REQUIRE_OK(gradacc_optimizer_save(fresh, fresh_after, fresh_len, &fresh_len));
    CHECK(memcmp(fresh_before, fresh_after, fresh_len) == 0, "a refused load changed the state");
    EXPECT_OK(gradacc_optimizer_steps(fresh, &steps));
    CHECK(steps == 0, "steps after a refused load = %llu", (unsigned long long)steps);
    free(fresh_before);
    free(fresh_after);
    EXPECT_OK(gradacc_optimizer_destroy(fresh));
    free(saved);

    /* Bad arguments, each named. */
    gradacc_optimizer_t *bad = NULL;
    gradacc_optimizer_config_t wrong = oc;
    wrong.algorithm = GRADACC_OPTIMIZER_ADAMW;
    wrong.beta1 = 1.5f;
    EXPECT_ERROR(gradacc_optimizer_create(acc, &wrong, NULL, initial, NULL, 2, &bad),
                 GRADACC_STATUS_INVALID_ARGUMENT, "beta1");
    /* Remainder masters only over bf16 weights; w0 is f16. */
    wrong = oc;
    wrong.masters = GRADACC_MASTERS_BF16_REMAINDER;
    EXPECT_ERROR(gradacc_optimizer_create(acc, &wrong, NULL, initial, NULL, 2, &bad),
                 GRADACC_STATUS_INVALID_ARGUMENT, "`weights[0]` is f16");
    wrong = oc;
    wrong.moments = 9;
    EXPECT_ERROR(gradacc_optimizer_create(acc, &wrong, NULL, initial, NULL, 2, &bad),
                 GRADACC_STATUS_INVALID_ARGUMENT, "`config`.moments");
    /* A caller built before the formats: its struct_size ends at `seed`, so they are FP32. */
    gradacc_optimizer_t *older = NULL;
    wrong = oc;
    wrong.masters = GRADACC_MASTERS_BF16_REMAINDER;
    wrong.struct_size = offsetof(gradacc_optimizer_config_t, masters);
    REQUIRE_OK(gradacc_optimizer_create(acc, &wrong, NULL, initial, NULL, 2, &older));
    EXPECT_OK(gradacc_optimizer_destroy(older));
    /* No masters: the f16 weight w0 rounded to nearest is refused naming `rounding`, rounded
     * stochastically taken. */
    wrong = oc;
    wrong.masters = GRADACC_MASTERS_NONE;
    wrong.rounding = GRADACC_ROUNDING_NEAREST_EVEN;
    EXPECT_ERROR(gradacc_optimizer_create(acc, &wrong, NULL, initial, NULL, 2, &bad),
                 GRADACC_STATUS_INVALID_ARGUMENT, "`rounding`");
    wrong.rounding = GRADACC_ROUNDING_STOCHASTIC;
    REQUIRE_OK(gradacc_optimizer_create(acc, &wrong, NULL, initial, NULL, 2, &older));
    EXPECT_OK(gradacc_optimizer_destroy(older));
    /* bf16 and 8-bit blockwise moments take any weights. */
    wrong = oc;
    wrong.moments = GRADACC_MOMENTS_BF16;
    wrong.moment_seed = 5;
    REQUIRE_OK(gradacc_optimizer_create(acc, &wrong, NULL, initial, NULL, 2, &older));
    EXPECT_OK(gradacc_optimizer_destroy(older));
    wrong.moments = GRADACC_MOMENTS_INT8_BLOCKWISE;
    REQUIRE_OK(gradacc_optimizer_create(acc, &wrong, NULL, initial, NULL, 2, &older));
    EXPECT_OK(gradacc_optimizer_destroy(older));
    wrong = oc;
    wrong.algorithm = 7;
    EXPECT_ERROR(gradacc_optimizer_create(acc, &wrong, NULL, initial, NULL, 2, &bad),
                 GRADACC_STATUS_INVALID_ARGUMENT, "`config`.algorithm");
    EXPECT_ERROR(gradacc_optimizer_create(acc, &oc, NULL, initial, NULL, 1, &bad),
                 GRADACC_STATUS_SIZE_MISMATCH, "`n`");
    const void *holes[2] = {w0, NULL};
    EXPECT_ERROR(gradacc_optimizer_create(acc, &oc, NULL, holes, NULL, 2, &bad),
                 GRADACC_STATUS_NULL_ARGUMENT, "weights[1]");
    CHECK(bad == NULL, "a failed create wrote a handle");
    gradacc_optimizer_t *defaults = NULL;
    REQUIRE_OK(gradacc_optimizer_create(acc, NULL, NULL, initial, NULL, 2, &defaults));
    EXPECT_OK(gradacc_optimizer_destroy(defaults));
    EXPECT_ERROR(gradacc_optimizer_set_lr(opt, -1.0f), GRADACC_STATUS_INVALID_ARGUMENT, "`lr`");
    void *lr_at = (void *)&lr_at;
    EXPECT_ERROR(gradacc_optimizer_lr_device_ptr(opt, &lr_at), GRADACC_STATUS_DEVICE_MISMATCH, "set_lr");
    CHECK(lr_at == (void *)&lr_at, "a refused call wrote its output");
    EXPECT_ERROR(gradacc_optimizer_lr_device_ptr(opt, NULL), GRADACC_STATUS_NULL_ARGUMENT, "out");
    EXPECT_ERROR(gradacc_optimizer_step(NULL, acc, weights, 2, NULL, NULL), GRADACC_STATUS_NULL_ARGUMENT,
                 "opt");

    EXPECT_OK(gradacc_optimizer_destroy(opt));
    EXPECT_STATUS(gradacc_optimizer_destroy(opt), GRADACC_STATUS_INVALID_HANDLE);
    EXPECT_OK(gradacc_accumulator_destroy(acc));
    EXPECT_OK(gradacc_scaler_destroy(scaler));
}

/* ---- two ranks under a reduce-scatter boundary: every rank ends with the unsharded weights --- */

typedef struct {
    gradacc_comm_t *comm;
    int rank;
    int refused; /* the rank whose first step passes no weights, or -1 */
    uint16_t w0[N0];
    float w1[N1];
} rank_args;

static void *sharded_rank(void *p)
{
    rank_args *a = p;
    gradacc_scaler_config_t sc;
    REQUIRE_OK(gradacc_scaler_config_default(&sc));
    sc.dynamic = false;
    sc.init_scale = 1.0f;
    gradacc_scaler_t *scaler = NULL;
    REQUIRE_OK(gradacc_scaler_create(&sc, NULL, &scaler));
    gradacc_tensor_desc_t tensors[2] = {{N0, GRADACC_DTYPE_F16}, {N1, GRADACC_DTYPE_F32}};
    gradacc_accumulator_config_t ac;
    REQUIRE_OK(gradacc_accumulator_config_default(&ac));
    ac.sharding = GRADACC_SHARDING_REDUCE_SCATTER;
    ac.shard_count = 2;
    ac.shard_rank = (uint32_t)a->rank;
    gradacc_accumulator_t *acc = NULL;
    REQUIRE_OK(gradacc_accumulator_create(&ac, tensors, 2, NULL, &acc));
    init_weights(a->w0, a->w1);
    const void *initial[2] = {a->w0, a->w1};
    gradacc_optimizer_config_t oc = sgd_config();
    gradacc_optimizer_t *opt = NULL;
    REQUIRE_OK(gradacc_optimizer_create(acc, &oc, NULL, initial, NULL, 2, &opt));
    uint16_t g0[N0];
    float g1[N1];
    gradients(g0, g1, 1.0f, 0);
    const void *grads[2] = {g0, g1};
    REQUIRE_OK(gradacc_accumulator_add(acc, scaler, grads, 2, 1));
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    REQUIRE_OK(gradacc_accumulator_sync(acc, a->comm, &info));
    void *weights[2] = {a->w0, a->w1};
    bool stepped = false;
    if (a->refused >= 0) {
        /* Refused on one rank: that rank's error there, PEER_FAILURE at once on the other. */
        if (a->rank == a->refused)
            EXPECT_ERROR(gradacc_optimizer_step(opt, acc, NULL, 2, a->comm, &stepped),
                         GRADACC_STATUS_NULL_ARGUMENT, "weights");
        else
            EXPECT_ERROR(gradacc_optimizer_step(opt, acc, weights, 2, a->comm, &stepped),
                         GRADACC_STATUS_PEER_FAILURE, "another rank");
        CHECK(!stepped, "rank %d stepped", a->rank);
    }
    REQUIRE_OK(gradacc_optimizer_step(opt, acc, weights, 2, a->comm, &stepped));
    CHECK(stepped, "rank %d did not step", a->rank);
    EXPECT_OK(gradacc_optimizer_destroy(opt));
    EXPECT_OK(gradacc_accumulator_destroy(acc));
    EXPECT_OK(gradacc_scaler_destroy(scaler));
    return NULL;
}

static void test_reduce_scatter_group(int refused)
{
    gradacc_comm_t *comms[2];
    REQUIRE_OK(gradacc_comm_create_local(2, comms));
    rank_args args[2];
    memset(args, 0, sizeof args);
    for (int r = 0; r < 2; r++) {
        args[r].comm = comms[r];
        args[r].rank = r;
        args[r].refused = refused;
    }
    run_ranks(2, sharded_rank, args, sizeof args[0]);
    /* Both ranks' gradients are the same micro-batch, summed and averaged over 2 items: the mean
     * is the one gradient, so each weight is one SGD step of it. */
    for (size_t i = 0; i < N0; i++)
        CHECK(args[0].w0[i] == args[1].w0[i], "w0[%zu] differs between ranks", i);
    uint16_t w0[N0];
    float w1[N1];
    init_weights(w0, w1);
    for (size_t i = 0; i < N0; i++) {
        float g = (float)((double)(i % 7) * 0.25 - 0.5);
        uint16_t want = f32_to_f16_bits(f16_bits_to_f32(w0[i]) + (-LR) * g);
        CHECK(args[1].w0[i] == want, "w0[%zu] = %#x, expected %#x", i, args[1].w0[i], want);
    }
    for (size_t i = 0; i < N1; i++)
        CHECK(args[0].w1[i] == w1[i] + (-LR) * 0.75f && args[1].w1[i] == args[0].w1[i],
              "w1[%zu] = %g / %g", i, args[0].w1[i], args[1].w1[i]);
    for (int r = 0; r < 2; r++)
        EXPECT_OK(gradacc_comm_destroy(comms[r]));
}

/* gradacc_accumulator_sync_for_step, the clip coefficient applied inside AdamW's pass, after
 * gradacc_accumulator_add_final, which measured the norm as it added, steps the weights to the
 * bits of gradacc_accumulator_add, gradacc_accumulator_sync then the step, clipping every
 * window. */
static void test_clip_in_step(void)
{
    gradacc_scaler_config_t sc;
    REQUIRE_OK(gradacc_scaler_config_default(&sc));
    sc.init_scale = 1024.0f;
    sc.dynamic = false;
    gradacc_tensor_desc_t tensors[2] = {{N0, GRADACC_DTYPE_F16}, {N1, GRADACC_DTYPE_F32}};
    gradacc_accumulator_config_t ac;
    REQUIRE_OK(gradacc_accumulator_config_default(&ac));
    ac.max_grad_norm = 0.01f;
    uint16_t w0[2][N0];
    float w1[2][N1];
    gradacc_scaler_t *scaler[2];
    gradacc_accumulator_t *acc[2];
    gradacc_optimizer_t *opt[2];
    gradacc_optimizer_config_t oc;
    REQUIRE_OK(gradacc_optimizer_config_default(&oc));
    for (int k = 0; k < 2; k++) {
        REQUIRE_OK(gradacc_scaler_create(&sc, NULL, &scaler[k]));
        REQUIRE_OK(gradacc_accumulator_create(&ac, tensors, 2, NULL, &acc[k]));
        init_weights(w0[k], w1[k]);
        const void *initial[2] = {w0[k], w1[k]};
        REQUIRE_OK(gradacc_optimizer_create(acc[k], &oc, NULL, initial, NULL, 2, &opt[k]));
    }
    for (int step = 0; step < 3; step++) {
        double coef[2];
        for (int k = 0; k < 2; k++) {
            uint16_t g0[N0];
            float g1[N1], scale;
            REQUIRE_OK(gradacc_scaler_scale(scaler[k], &scale));
            gradients(g0, g1, scale, 0);
            const void *grads[2] = {g0, g1};
            REQUIRE_OK(k ? gradacc_accumulator_add_final(acc[k], scaler[k], grads, 2, 1)
                         : gradacc_accumulator_add(acc[k], scaler[k], grads, 2, 1));
            gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
            REQUIRE_OK(k ? gradacc_accumulator_sync_for_step(acc[k], NULL, &info)
                         : gradacc_accumulator_sync(acc[k], NULL, &info));
            coef[k] = info.clip_coef;
            void *weights[2] = {w0[k], w1[k]};
            REQUIRE_OK(gradacc_optimizer_step(opt[k], acc[k], weights, 2, NULL, NULL));
        }
        CHECK(coef[0] == coef[1] && coef[0] < 1.0, "step %d: clip_coef %g / %g", step, coef[0],
              coef[1]);
        CHECK(memcmp(w0[0], w0[1], sizeof w0[0]) == 0 && memcmp(w1[0], w1[1], sizeof w1[0]) == 0,
              "step %d: the clip inside the step wrote other weights", step);
    }
    for (int k = 0; k < 2; k++) {
        EXPECT_OK(gradacc_optimizer_destroy(opt[k]));
        EXPECT_OK(gradacc_accumulator_destroy(acc[k]));
        EXPECT_OK(gradacc_scaler_destroy(scaler[k]));
    }
}

int main(void)
{
    test_whole_step();
    test_clip_in_step();
    test_reduce_scatter_group(-1);
    test_reduce_scatter_group(1);
    return test_finish();
}
