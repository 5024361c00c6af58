/* Bug B4 of the design: one rank's gradient holds an inf or a NaN, the other's does not. If each
 * rank decided alone, one would skip the step and back off while the other stepped: the replicas
 * diverge. With gradacc the flag is part of the boundary's collective: both ranks report found_inf,
 * both gradacc_scaler_update calls report skipped, and both scalers back off identically. Then a
 * clean window on both ranks steps normally with the backed-off scale. */
#include "common.h"

enum { RANKS = 2, N = 6 };

typedef struct {
    gradacc_comm_t *comm;
    gradacc_dtype_t dtype;
    int bad_rank;         /* which rank gets the bad value */
    uint16_t bits;        /* the bad value for 16-bit buffers */
    float f32_value;      /* ... and for f32 buffers */
    int bad_microbatch;   /* in which micro-batch */
    int rank;
    /* outputs */
    gradacc_sync_info_t info[2];
    bool skipped[2];
    float scale[2];
    float master[N];
    gradacc_scaler_stats_t stats;
} rank_args;

static void *rank_main(void *arg)
{
    rank_args *a = arg;
    gradacc_scaler_t *scaler = NULL;
    REQUIRE_OK(gradacc_scaler_create(NULL, NULL, &scaler)); /* defaults: 65536, backoff 0.5 */
    gradacc_tensor_desc_t t[2] = {{N, a->dtype}, {1, GRADACC_DTYPE_F32}};
    gradacc_accumulator_t *acc = NULL;
    REQUIRE_OK(gradacc_accumulator_create(NULL, t, 2, NULL, &acc));
    grad_buf g = grad_alloc(a->dtype, N);
    float other = 0.0f;
    for (int window = 0; window < 2; window++) {
        for (int m = 0; m < 3; m++) {
            float scale;
            REQUIRE_OK(gradacc_scaler_scale(scaler, &scale));
            double v[N];
            for (int i = 0; i < N; i++)
                v[i] = (a->rank + 1) * 0.001 * (i + 1) * (m + 1);
            grad_encode(&g, v, scale, NULL);
            if (window == 0 && a->rank == a->bad_rank && m == a->bad_microbatch)
                grad_poke(&g, 2, a->bits, a->f32_value);
            other = scale * 0.25f;
            const void *grads[2] = {g.data, &other};
            REQUIRE_OK(gradacc_accumulator_add(acc, scaler, grads, 2, 2));
        }
        a->info[window].struct_size = sizeof a->info[window];
        REQUIRE_OK(gradacc_accumulator_sync(acc, a->comm, &a->info[window]));
        const gradacc_accumulator_t *accs[1] = {acc};
        REQUIRE_OK(gradacc_scaler_update(scaler, accs, 1, &a->skipped[window]));
        REQUIRE_OK(gradacc_scaler_scale(scaler, &a->scale[window]));
    }
    float *p;
    size_t n;
    REQUIRE_OK(gradacc_accumulator_master(acc, 0, &p, &n));
    memcpy(a->master, p, sizeof a->master);
    a->stats.struct_size = sizeof a->stats;
    REQUIRE_OK(gradacc_scaler_stats(scaler, &a->stats));
    grad_free(&g);
    gradacc_accumulator_destroy(acc);
    gradacc_scaler_destroy(scaler);
    return NULL;
}

static void run(gradacc_dtype_t dtype, const char *what, uint16_t bits, float f32_value, int bad_rank, int bad_mb)
{
    gradacc_comm_t *comms[RANKS];
    REQUIRE_OK(gradacc_comm_create_local(RANKS, comms));
    rank_args args[RANKS];
    memset(args, 0, sizeof args);
    for (int r = 0; r < RANKS; r++) {
        args[r].comm = comms[r];
        args[r].dtype = dtype;
        args[r].bad_rank = bad_rank;
        args[r].bits = bits;
        args[r].f32_value = f32_value;
        args[r].bad_microbatch = bad_mb;
        args[r].rank = r;
    }
    run_ranks(RANKS, rank_main, args, sizeof args[0]);
    for (int r = 0; r < RANKS; r++) {
        rank_args *a = &args[r];
        CHECK(a->info[0].found_inf, "%s %s on rank %d: rank %d's sync did not report found_inf", dtype_name(dtype), what,
              bad_rank, r);
        CHECK(a->skipped[0], "%s %s on rank %d: rank %d's update did not skip", dtype_name(dtype), what, bad_rank, r);
        CHECK(a->scale[0] == 32768.0f, "%s %s: rank %d's scale %g after the overflow, expected 32768", dtype_name(dtype),
              what, r, a->scale[0]);
        CHECK(!a->info[1].found_inf && !a->skipped[1] && a->scale[1] == 32768.0f,
              "%s %s: rank %d's clean window: found_inf %d skipped %d scale %g", dtype_name(dtype), what, r,
              a->info[1].found_inf, a->skipped[1], a->scale[1]);
        CHECK(a->stats.steps == 2 && a->stats.skipped_steps == 1 && a->stats.backoffs == 1 && a->stats.growths == 0,
              "rank %d stats", r);
    }
    CHECK(memcmp(args[0].master, args[1].master, sizeof args[0].master) == 0, "ranks' clean-window masters differ");
    /* the clean window's value: mean over 12 items of count-weighted means, from both ranks */
    for (int i = 0; i < N; i++) {
        double want = 0.0;
        for (int r = 0; r < RANKS; r++)
            for (int m = 0; m < 3; m++)
                want += 2.0 * (r + 1) * 0.001 * (i + 1) * (m + 1);
        want /= 12.0;
        double tol = dtype == GRADACC_DTYPE_F32 ? 1e-6 * want : dtype == GRADACC_DTYPE_F16 ? 1e-3 * want : 8e-3 * want;
        CHECK_CLOSE(args[0].master[i], want, tol, "%s clean window element %d", dtype_name(dtype), i);
    }
    for (int r = 0; r < RANKS; r++)
        EXPECT_OK(gradacc_comm_destroy(comms[r]));
}

int main(void)
{
    for (int bad_rank = 0; bad_rank < RANKS; bad_rank++) {
        for (int mb = 0; mb < 3; mb += 2) {
            run(GRADACC_DTYPE_F16, "+inf", 0x7c00, 0, bad_rank, mb);
            run(GRADACC_DTYPE_F16, "-inf", 0xfc00, 0, bad_rank, mb);
            run(GRADACC_DTYPE_F16, "NaN", 0x7e00, 0, bad_rank, mb);
            run(GRADACC_DTYPE_BF16, "+inf", 0x7f80, 0, bad_rank, mb);
            run(GRADACC_DTYPE_BF16, "NaN", 0x7fc0, 0, bad_rank, mb);
            run(GRADACC_DTYPE_F32, "inf", 0, INFINITY, bad_rank, mb);
            run(GRADACC_DTYPE_F32, "NaN", 0, NAN, bad_rank, mb);
        }
    }
    return test_finish();
}
