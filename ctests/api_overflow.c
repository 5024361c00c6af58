/* The overflow policies through the C ABI, on docs/overflow.md's worked example: 4 ranks, 20 fp16
 * tensors, 4 micro-batches per rank of 4 + m items each (a mean-reduced loss, BY_COUNT), and one
 * inf in tensor 17 of rank 2's third micro-batch (index 2). GRADACC_OVERFLOW_SKIP_STEP skips the
 * step on every rank; GRADACC_OVERFLOW_DROP_MICROBATCH drops that micro-batch only, and the
 * gradient is the mean over the 82 items the other 15 micro-batches hold. Both name the place
 * (rank 2, micro-batch 2, tensor 17) on every rank, and both back the scale off. Then the config's
 * and the report's argument checks. Run with GRADACC_TEST_VERBOSE=1 to print the example's table. */
#include "common.h"

enum { RANKS = 4, TENSORS = 20, N = 3, MICROBATCHES = 4, BAD_RANK = 2, BAD_MB = 2, BAD_TENSOR = 17 };

typedef struct {
    gradacc_comm_t *comm;
    gradacc_overflow_t policy;
    int rank;
    gradacc_sync_info_t info;
    bool skipped;
    float scale;
    double master[TENSORS][N];
    double norms[TENSORS];
    uint64_t nonfinite[TENSORS];
} rank_args;

/* The true gradient of rank r's micro-batch m, tensor t, element i: a mean over its items. */
static double grad_value(int r, int m, int t, int i)
{
    return ((r + 1) * 0.25 + (m + 1) * 0.125 + t * 0.0625) * (i % 2 ? -1.0 : 1.0) / 8.0;
}

static int items(int m)
{
    return 4 + m;
}

static void *rank_main(void *arg)
{
    rank_args *a = arg;
    gradacc_scaler_t *scaler = scaler_with_scale(1024.0f);
    gradacc_accumulator_config_t config;
    REQUIRE_OK(gradacc_accumulator_config_default(&config));
    config.overflow = a->policy;
    config.tensor_stats = 1;
    gradacc_tensor_desc_t t[TENSORS];
    for (int i = 0; i < TENSORS; i++)
        t[i] = (gradacc_tensor_desc_t){N, GRADACC_DTYPE_F16};
    gradacc_accumulator_t *acc = NULL;
    REQUIRE_OK(gradacc_accumulator_create(&config, t, TENSORS, NULL, &acc));
    uint16_t g[TENSORS][N];
    const void *grads[TENSORS];
    for (int m = 0; m < MICROBATCHES; m++) {
        for (int k = 0; k < TENSORS; k++) {
            for (int i = 0; i < N; i++)
                g[k][i] = f32_to_f16_bits((float)(grad_value(a->rank, m, k, i) * 1024.0));
            grads[k] = g[k];
        }
        if (a->rank == BAD_RANK && m == BAD_MB)
            g[BAD_TENSOR][1] = 0x7c00; /* +inf */
        REQUIRE_OK(gradacc_accumulator_add(acc, scaler, grads, TENSORS, (uint64_t)items(m)));
    }
    a->info.struct_size = sizeof a->info;
    REQUIRE_OK(gradacc_accumulator_sync(acc, a->comm, &a->info));
    for (int k = 0; k < TENSORS; k++)
        read_master(acc, (size_t)k, a->master[k], N);
    REQUIRE_OK(gradacc_accumulator_tensor_stats(acc, a->norms, a->nonfinite, TENSORS));
    const gradacc_accumulator_t *accs[1] = {acc};
    REQUIRE_OK(gradacc_scaler_update(scaler, accs, 1, &a->skipped));
    REQUIRE_OK(gradacc_scaler_scale(scaler, &a->scale));
    gradacc_accumulator_destroy(acc);
    gradacc_scaler_destroy(scaler);
    return NULL;
}

static void run(gradacc_overflow_t policy, const char *name, bool verbose)
{
    gradacc_comm_t *comms[RANKS];
    REQUIRE_OK(gradacc_comm_create_local(RANKS, comms));
    rank_args args[RANKS];
    memset(args, 0, sizeof args);
    for (int r = 0; r < RANKS; r++)
        args[r] = (rank_args){.comm = comms[r], .policy = policy, .rank = r};
    run_ranks(RANKS, rank_main, args, sizeof args[0]);
    bool drop = policy == GRADACC_OVERFLOW_DROP_MICROBATCH;
    for (int r = 0; r < RANKS; r++) {
        const gradacc_sync_info_t *info = &args[r].info;
        CHECK(info->overflow_at == GRADACC_OVERFLOW_AT_GRADIENT && info->overflow_rank == BAD_RANK &&
                  info->overflow_microbatch == BAD_MB && info->overflow_tensor == BAD_TENSOR,
              "%s, rank %d: overflow at %d (rank %llu, micro-batch %llu, tensor %llu)", name, r, info->overflow_at,
              (unsigned long long)info->overflow_rank, (unsigned long long)info->overflow_microbatch,
              (unsigned long long)info->overflow_tensor);
        CHECK(info->found_inf == !drop && args[r].skipped == !drop, "%s, rank %d: found_inf %d skipped %d", name, r,
              info->found_inf, args[r].skipped);
        CHECK(info->dropped_microbatches == (drop ? 1u : 0u), "%s, rank %d: %llu dropped", name, r,
              (unsigned long long)info->dropped_microbatches);
        CHECK(info->microbatches == (drop ? 15u : 16u) && info->total_count == (drop ? 82u : 88u),
              "%s, rank %d: %llu micro-batches, %llu items", name, r, (unsigned long long)info->microbatches,
              (unsigned long long)info->total_count);
        CHECK(args[r].scale == 512.0f, "%s, rank %d: scale %g after the update, expected 512", name, r, args[r].scale);
        CHECK(memcmp(args[r].master, args[0].master, sizeof args[0].master) == 0, "%s: rank %d's gradient differs",
              name, r);
        CHECK(memcmp(args[r].norms, args[0].norms, sizeof args[0].norms) == 0, "%s: rank %d's norms differ", name,
              r);
        for (int k = 0; k < TENSORS; k++)
            CHECK(args[r].nonfinite[k] == (k == BAD_TENSOR), "%s, rank %d: tensor %d non-finite in %llu micro-batches",
                  name, r, k, (unsigned long long)args[r].nonfinite[k]);
    }
    /* Each tensor's norm is its gradient's (no clipping here): the master's, under DROP_MICROBATCH. */
    for (int k = 0; k < TENSORS && drop; k++) {
        double sq = 0.0;
        for (int i = 0; i < N; i++)
            sq += args[0].master[k][i] * args[0].master[k][i];
        CHECK_CLOSE(args[0].norms[k], sqrt(sq), 1e-12 * sqrt(sq), "tensor %d's norm", k);
    }
    if (drop) {
        /* The mean over the 82 kept items: each micro-batch's mean weighted by its items. */
        for (int k = 0; k < TENSORS; k++) {
            for (int i = 0; i < N; i++) {
                double sum = 0.0;
                for (int r = 0; r < RANKS; r++)
                    for (int m = 0; m < MICROBATCHES; m++)
                        if (!(r == BAD_RANK && m == BAD_MB))
                            sum += (double)f16_bits_to_f32(f32_to_f16_bits((float)(grad_value(r, m, k, i) * 1024.0))) /
                                   1024.0 * items(m);
                CHECK_CLOSE(args[0].master[k][i], sum / 82.0, 1e-6 * fabs(sum / 82.0), "tensor %d element %d", k, i);
            }
        }
    }
    if (verbose) {
        const gradacc_sync_info_t *info = &args[0].info;
        printf("%-16s found_inf %d  skipped %d  micro-batches %2llu  items %2llu  dropped %llu  "
               "overflow at rank %llu micro-batch %llu tensor %llu  scale -> %g  tensor 17 = [%.6f %.6f %.6f] "
               "norm %.6f, non-finite in %llu\n",
               name, info->found_inf, args[0].skipped, (unsigned long long)info->microbatches,
               (unsigned long long)info->total_count, (unsigned long long)info->dropped_microbatches,
               (unsigned long long)info->overflow_rank, (unsigned long long)info->overflow_microbatch,
               (unsigned long long)info->overflow_tensor, args[0].scale, args[0].master[17][0],
               args[0].master[17][1], args[0].master[17][2], args[0].norms[17],
               (unsigned long long)args[0].nonfinite[17]);
    }
    for (int r = 0; r < RANKS; r++)
        gradacc_comm_destroy(comms[r]);
}

static void bad_arguments(void)
{
    gradacc_tensor_desc_t t = {4, GRADACC_DTYPE_F32};
    gradacc_accumulator_config_t config;
    REQUIRE_OK(gradacc_accumulator_config_default(&config));
    CHECK(config.overflow == GRADACC_OVERFLOW_SKIP_STEP && config.tensor_stats == 0, "the defaults: %d, %u",
          config.overflow, config.tensor_stats);
    gradacc_accumulator_t *acc = NULL;
    config.overflow = 7;
    EXPECT_ERROR(gradacc_accumulator_create(&config, &t, 1, NULL, &acc), GRADACC_STATUS_INVALID_ARGUMENT,
                 "`config`.overflow = 7");
    CHECK(acc == NULL, "a refused creation leaves *out alone");
    config.overflow = GRADACC_OVERFLOW_SKIP_STEP;
    config.tensor_stats = 2;
    EXPECT_ERROR(gradacc_accumulator_create(&config, &t, 1, NULL, &acc), GRADACC_STATUS_INVALID_ARGUMENT,
                 "`config`.tensor_stats = 2");
    config.tensor_stats = 0;
    /* Under sharded accumulation a micro-batch is dropped, and the shard's tensors measured. */
    gradacc_comm_t *one = NULL;
    REQUIRE_OK(gradacc_comm_create_local(1, &one));
    config.sharding = GRADACC_SHARDING_ACCUMULATE;
    config.tensor_stats = 1;
    config.overflow = GRADACC_OVERFLOW_DROP_MICROBATCH;
    REQUIRE_OK(gradacc_accumulator_create_sharded(&config, &t, 1, NULL, one, &acc));
    {
        gradacc_scaler_t *unit = scaler_with_scale(1.0f);
        float bad[4] = {1, INFINITY, 3, 4}, good[4] = {2, 4, 6, 8};
        const void *poisoned[1] = {bad}, *clean[1] = {good};
        REQUIRE_OK(gradacc_accumulator_add(acc, unit, poisoned, 1, 1));
        REQUIRE_OK(gradacc_accumulator_add(acc, unit, clean, 1, 2));
        gradacc_sync_info_t info = {.struct_size = sizeof info};
        REQUIRE_OK(gradacc_accumulator_sync(acc, NULL, &info));
        CHECK(!info.found_inf && info.dropped_microbatches == 1 && info.microbatches == 1 &&
                  info.total_count == 2 && info.overflow_at == GRADACC_OVERFLOW_AT_GRADIENT &&
                  info.overflow_microbatch == 0 && info.overflow_tensor == 0,
              "sharded drop: found_inf %d, dropped %llu, micro-batches %llu, count %llu", (int)info.found_inf,
              (unsigned long long)info.dropped_microbatches, (unsigned long long)info.microbatches,
              (unsigned long long)info.total_count);
        float *master = NULL;
        size_t numel = 0;
        REQUIRE_OK(gradacc_accumulator_master(acc, 0, &master, &numel));
        CHECK(numel == 4, "sharded drop: %zu elements", numel);
        for (size_t i = 0; i < numel; i++)
            CHECK(master[i] == good[i], "sharded drop: master[%zu] = %g, want %g", i, master[i], good[i]);
        double norm = 0;
        uint64_t nonfinite = 0;
        REQUIRE_OK(gradacc_accumulator_tensor_stats(acc, &norm, &nonfinite, 1));
        CHECK(fabs(norm - sqrt(120.0)) < 1e-6 && nonfinite == 1, "sharded stats: norm %g, %llu non-finite",
              norm, (unsigned long long)nonfinite);
        gradacc_scaler_destroy(unit);
    }
    EXPECT_OK(gradacc_accumulator_destroy(acc));
    acc = NULL;
    config.overflow = GRADACC_OVERFLOW_SKIP_STEP;
    config.tensor_stats = 0;
    gradacc_comm_destroy(one);
    /* A clean window reports no place, under the report's struct_size of 0.2 too. */
    config.sharding = GRADACC_SHARDING_NONE;
    REQUIRE_OK(gradacc_accumulator_create(&config, &t, 1, NULL, &acc));
    gradacc_scaler_t *scaler = scaler_with_scale(1.0f);
    float g[4] = {1, 2, 3, 4};
    const void *grads[1] = {g};
    REQUIRE_OK(gradacc_accumulator_add(acc, scaler, grads, 1, 1));
    gradacc_sync_info_t info;
    memset(&info, 0xab, sizeof info);
    info.struct_size = offsetof(gradacc_sync_info_t, dropped_microbatches);
    REQUIRE_OK(gradacc_accumulator_sync(acc, NULL, &info));
    CHECK(info.total_count == 1 && !info.found_inf, "the 0.2 fields are written");
    CHECK(info.dropped_microbatches == 0xababababababababull && info.overflow_at == (int32_t)0xabababab,
          "the fields past an older struct_size stay untouched");
    /* Without tensor_stats nothing was measured; a wrong count or a misaligned array is refused,
     * and nothing is written. */
    double norm = -1.0;
    EXPECT_ERROR(gradacc_accumulator_tensor_stats(acc, &norm, NULL, 1), GRADACC_STATUS_WRONG_STATE, "tensor_stats");
    EXPECT_ERROR(gradacc_accumulator_tensor_stats(acc, &norm, NULL, 2), GRADACC_STATUS_SIZE_MISMATCH, "`n` = 2");
    uint64_t counts[2] = {7, 7};
    EXPECT_ERROR(gradacc_accumulator_tensor_stats(acc, NULL, (uint64_t *)((char *)counts + 1), 1),
                 GRADACC_STATUS_INVALID_ARGUMENT, "nonfinite_microbatches");
    CHECK(norm == -1.0 && counts[0] == 7, "nothing written on failure");
    gradacc_scaler_destroy(scaler);
    gradacc_accumulator_destroy(acc);
}

int main(void)
{
    bool verbose = getenv("GRADACC_TEST_VERBOSE") != NULL;
    run(GRADACC_OVERFLOW_SKIP_STEP, "SKIP_STEP", verbose);
    run(GRADACC_OVERFLOW_DROP_MICROBATCH, "DROP_MICROBATCH", verbose);
    bad_arguments();
    return test_finish();
}
