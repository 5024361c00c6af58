/* Bug B6 of the design: the last window of an epoch is partial. 4 micro-batches were planned, only
 * 3 came (counts 4, 6, 5). The boundary must normalise by what was actually added: the exact mean
 * over the 15 items (BY_COUNT) or over the 3 micro-batches (BY_MICROBATCHES), never by the
 * planned 4. A full window of 4 precedes it in the same accumulator, so nothing may carry over.
 * Then two ranks where one has no data left for the last window. */
#include "common.h"

enum { NA = 10, NB = 7, NP = NA + NB, MAXMB = 4 };

static void run(test_rng *rng, gradacc_normalize_t normalize)
{
    const float scale = 512.0f;
    gradacc_scaler_t *scaler = scaler_with_scale(scale);
    gradacc_accumulator_config_t ac;
    REQUIRE_OK(gradacc_accumulator_config_default(&ac));
    ac.normalize = normalize;
    gradacc_tensor_desc_t t[2] = {{NA, GRADACC_DTYPE_F16}, {NB, GRADACC_DTYPE_BF16}};
    gradacc_accumulator_t *acc = NULL;
    REQUIRE_OK(gradacc_accumulator_create(&ac, t, 2, NULL, &acc));
    grad_buf ga = grad_alloc(GRADACC_DTYPE_F16, NA), gb = grad_alloc(GRADACC_DTYPE_BF16, NB);
    const char *how = normalize == GRADACC_NORMALIZE_BY_COUNT ? "BY_COUNT" : "BY_MICROBATCHES";

    static const uint64_t counts[2][MAXMB] = {{8, 8, 8, 8}, {4, 6, 5, 0}};
    static const int added[2] = {4, 3};
    for (int window = 0; window < 2; window++) {
        double truth[NP] = {0}, from_inputs[NP] = {0}, magnitude[NP] = {0};
        uint64_t items = 0;
        for (int m = 0; m < added[window]; m++) {
            double mean[NP], exact[NP]; /* the micro-batch's mean-loss gradient */
            for (int k = 0; k < NP; k++)
                mean[k] = rng_range(rng, -2, 2) + (window ? 0 : 50.0); /* window 0 far away: a leftover shows */
            grad_encode(&ga, mean, scale, exact);
            grad_encode(&gb, mean + NA, scale, exact + NA);
            double w = normalize == GRADACC_NORMALIZE_BY_COUNT ? (double)counts[window][m] : 1.0;
            for (int k = 0; k < NP; k++) {
                truth[k] += w * mean[k];
                from_inputs[k] += w * exact[k];
                magnitude[k] += fabs(w * exact[k]);
            }
            items += counts[window][m];
            const void *grads[2] = {ga.data, gb.data};
            REQUIRE_OK(gradacc_accumulator_add(acc, scaler, grads, 2, counts[window][m]));
        }
        double div = normalize == GRADACC_NORMALIZE_BY_COUNT ? (double)items : (double)added[window];
        gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
        REQUIRE_OK(gradacc_accumulator_sync(acc, NULL, &info));
        CHECK(info.total_count == items && info.microbatches == (uint64_t)added[window],
              "%s window %d: total_count %llu (want %llu), microbatches %llu (want %d)", how, window,
              (unsigned long long)info.total_count, (unsigned long long)items, (unsigned long long)info.microbatches,
              added[window]);
        double got[NP];
        read_master(acc, 0, got, NA);
        read_master(acc, 1, got + NA, NB);
        for (int k = 0; k < NP; k++) {
            double unit = k < NA ? ldexp(1.0, -11) : ldexp(1.0, -8);
            double tight = 1e-6 * magnitude[k] / div + 1e-30;
            double loose = tight + unit * magnitude[k] / div + ldexp(1.0, -25) / scale;
            CHECK_CLOSE(got[k], from_inputs[k] / div, tight, "%s window %d element %d vs the given values", how, window, k);
            CHECK_CLOSE(got[k], truth[k] / div, loose, "%s window %d element %d vs the f64 mean", how, window, k);
        }
        if (window == 1) {
            /* what dividing by the planned 4 (or the planned item count) would have given */
            double planned = normalize == GRADACC_NORMALIZE_BY_COUNT ? (double)(items + 5) : 4.0;
            int differs = 0;
            for (int k = 0; k < NP; k++)
                differs |= fabs(got[k] - truth[k] / planned) > 1e-3;
            CHECK(differs, "%s: the partial window looks normalised by the planned size", how);
        }
    }
    grad_free(&ga);
    grad_free(&gb);
    gradacc_accumulator_destroy(acc);
    gradacc_scaler_destroy(scaler);
}

/* Two ranks, and one of them runs out of data: in the last window rank 1 adds nothing but still
 * takes part in the boundary (a sync right after its previous sync). Both ranks must end with the
 * mean over rank 0's items only, bitwise identical; rank 1's previous window must not leak in. */
typedef struct {
    int rank;
    gradacc_comm_t *comm;
    const double (*values)[NP]; /* [window * MAXMB + m] */
    float master[2][NP];
    gradacc_sync_info_t info[2];
} rank_args;

static void *rank_main(void *arg)
{
    rank_args *a = arg;
    gradacc_scaler_t *scaler = scaler_with_scale(512.0f);
    gradacc_tensor_desc_t t[2] = {{NA, GRADACC_DTYPE_F16}, {NB, GRADACC_DTYPE_BF16}};
    gradacc_accumulator_t *acc = NULL;
    REQUIRE_OK(gradacc_accumulator_create(NULL, t, 2, NULL, &acc));
    grad_buf ga = grad_alloc(GRADACC_DTYPE_F16, NA), gb = grad_alloc(GRADACC_DTYPE_BF16, NB);
    for (int window = 0; window < 2; window++) {
        int n = window == 0 ? MAXMB : (a->rank == 0 ? 3 : 0);
        for (int m = 0; m < n; m++) {
            const double *v = a->values[(a->rank * 2 + window) * MAXMB + m];
            grad_encode(&ga, v, 512.0, NULL);
            grad_encode(&gb, v + NA, 512.0, NULL);
            const void *grads[2] = {ga.data, gb.data};
            REQUIRE_OK(gradacc_accumulator_add(acc, scaler, grads, 2, 4));
        }
        a->info[window].struct_size = sizeof a->info[window];
        REQUIRE_OK(gradacc_accumulator_sync(acc, a->comm, &a->info[window]));
        float *p;
        size_t numel;
        REQUIRE_OK(gradacc_accumulator_master(acc, 0, &p, &numel));
        memcpy(a->master[window], p, NA * sizeof(float));
        REQUIRE_OK(gradacc_accumulator_master(acc, 1, &p, &numel));
        memcpy(a->master[window] + NA, p, NB * sizeof(float));
    }
    grad_free(&ga);
    grad_free(&gb);
    gradacc_accumulator_destroy(acc);
    gradacc_scaler_destroy(scaler);
    return NULL;
}

static void run_rank_out_of_data(test_rng *rng)
{
    static double values[2 * 2 * MAXMB][NP];
    for (int i = 0; i < 2 * 2 * MAXMB; i++)
        for (int k = 0; k < NP; k++) /* exact in f16 and bf16 at scale 512: multiples of 1/8 below 16 */
            values[i][k] = ldexp(round(rng_range(rng, -15, 15) * 8), -3);
    gradacc_comm_t *comms[2];
    REQUIRE_OK(gradacc_comm_create_local(2, comms));
    rank_args a[2];
    memset(a, 0, sizeof a);
    for (int r = 0; r < 2; r++) {
        a[r].rank = r;
        a[r].comm = comms[r];
        a[r].values = (const double(*)[NP])values;
    }
    run_ranks(2, rank_main, a, sizeof a[0]);
    CHECK(memcmp(a[0].master, a[1].master, sizeof a[0].master) == 0, "ranks differ bitwise");
    CHECK(a[0].info[1].total_count == 12 && a[1].info[1].total_count == 12 && a[1].info[1].microbatches == 3,
          "last window: total_count %llu / %llu, micro-batches %llu", (unsigned long long)a[0].info[1].total_count,
          (unsigned long long)a[1].info[1].total_count, (unsigned long long)a[1].info[1].microbatches);
    for (int k = 0; k < NP; k++) {
        double want = 0.0;
        for (int m = 0; m < 3; m++)
            want += values[(0 * 2 + 1) * MAXMB + m][k] / 3.0;
        CHECK_CLOSE(a[1].master[1][k], want, 1e-6 * 16, "rank 1 (no data) last window element %d", k);
    }
    for (int r = 0; r < 2; r++)
        EXPECT_OK(gradacc_comm_destroy(comms[r]));
}

int main(void)
{
    test_rng rng = rng_fresh("seed_partial_window");
    run(&rng, GRADACC_NORMALIZE_BY_COUNT);
    run(&rng, GRADACC_NORMALIZE_BY_MICROBATCHES);
    run_rank_out_of_data(&rng);
    return test_finish();
}
