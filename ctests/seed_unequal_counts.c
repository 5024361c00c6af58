/* Bug B2 of the design: mean-reduced losses over micro-batches of different sizes. Two ranks (the
 * in-process communicator, one thread per rank) with micro-batches of 3, 7, 1 items on rank 0 and
 * 5, 2, 9 on rank 1. BY_COUNT must give the gradient of the mean loss over all 27 items; the usual
 * `loss / steps` + DDP mean (BY_MICROBATCHES) gives the mean of the 6 micro-batch means, which is
 * a different vector. Both are checked against f64, and the two are checked to differ. */
#include "common.h"

enum { RANKS = 2, MB = 3, IN = 4, OUT = 2, NW = OUT * IN, NB = OUT, NP = NW + NB, ITEMS = 27 };

static const int sizes[RANKS][MB] = {{3, 7, 1}, {5, 2, 9}};

typedef struct {
    double W[NW], b[NB];
    double x[ITEMS][IN], t[ITEMS][OUT];
} problem;

/* Summed gradient of 0.5 |W x + b - t|^2 over items [lo, hi). */
static void grad_sum(const problem *p, int lo, int hi, double *g)
{
    memset(g, 0, NP * sizeof(double));
    for (int i = lo; i < hi; i++) {
        for (int o = 0; o < OUT; o++) {
            double r = p->b[o] - p->t[i][o];
            for (int j = 0; j < IN; j++)
                r += p->W[o * IN + j] * p->x[i][j];
            for (int j = 0; j < IN; j++)
                g[o * IN + j] += r * p->x[i][j];
            g[NW + o] += r;
        }
    }
}

typedef struct {
    const problem *p;
    gradacc_comm_t *comm;
    gradacc_normalize_t normalize;
    gradacc_dtype_t dw, db;
    int rank;
    /* outputs */
    float master[NP];
    gradacc_sync_info_t info;
    gradacc_status_t status;
    double sum_by_count[NP], sum_of_means[NP], magnitude[NP]; /* from the values actually given */
} rank_args;

static void *rank_main(void *arg)
{
    rank_args *a = arg;
    const float scale = 4096.0f;
    gradacc_scaler_t *scaler = scaler_with_scale(scale);
    gradacc_accumulator_config_t ac;
    REQUIRE_OK(gradacc_accumulator_config_default(&ac));
    ac.normalize = a->normalize;
    ac.loss_reduction = GRADACC_LOSS_REDUCTION_MEAN;
    gradacc_tensor_desc_t t[2] = {{NW, a->dw}, {NB, a->db}};
    gradacc_accumulator_t *acc = NULL;
    REQUIRE_OK(gradacc_accumulator_create(&ac, t, 2, NULL, &acc));
    grad_buf gw = grad_alloc(a->dw, NW), gb = grad_alloc(a->db, NB);

    int first = a->rank == 0 ? 0 : sizes[0][0] + sizes[0][1] + sizes[0][2];
    for (int m = 0; m < MB; m++) {
        int n = sizes[a->rank][m];
        double g[NP], exact[NP];
        grad_sum(a->p, first, first + n, g);
        first += n;
        for (int k = 0; k < NP; k++)
            g[k] /= n; /* mean-reduced micro-batch loss */
        grad_encode(&gw, g, scale, exact);
        grad_encode(&gb, g + NW, scale, exact + NW);
        for (int k = 0; k < NP; k++) {
            a->sum_by_count[k] += n * exact[k];
            a->sum_of_means[k] += exact[k];
            a->magnitude[k] += fabs(n * exact[k]) + fabs(exact[k]);
        }
        const void *grads[2] = {gw.data, gb.data};
        REQUIRE_OK(gradacc_accumulator_add(acc, scaler, grads, 2, (uint64_t)n));
    }
    a->info.struct_size = sizeof a->info;
    a->status = gradacc_accumulator_sync(acc, a->comm, &a->info);
    if (a->status == GRADACC_STATUS_OK) {
        float *p0, *p1;
        size_t n0, n1;
        REQUIRE_OK(gradacc_accumulator_master(acc, 0, &p0, &n0));
        REQUIRE_OK(gradacc_accumulator_master(acc, 1, &p1, &n1));
        memcpy(a->master, p0, NW * sizeof(float));
        memcpy(a->master + NW, p1, NB * sizeof(float));
    }
    grad_free(&gw);
    grad_free(&gb);
    gradacc_accumulator_destroy(acc);
    gradacc_scaler_destroy(scaler);
    return NULL;
}

/* Runs both ranks; returns the (rank 0) master in `out`. */
static void run(const problem *p, gradacc_normalize_t normalize, gradacc_dtype_t dw, gradacc_dtype_t db, double *out,
                double *from_inputs, double *magnitude)
{
    gradacc_comm_t *comms[RANKS];
    REQUIRE_OK(gradacc_comm_create_local(RANKS, comms));
    static rank_args args[RANKS];
    memset(args, 0, sizeof args);
    for (int r = 0; r < RANKS; r++) {
        args[r].p = p;
        args[r].comm = comms[r];
        args[r].normalize = normalize;
        args[r].dw = dw;
        args[r].db = db;
        args[r].rank = r;
    }
    run_ranks(RANKS, rank_main, args, sizeof args[0]);
    const char *how = normalize == GRADACC_NORMALIZE_BY_COUNT ? "BY_COUNT" : "BY_MICROBATCHES";
    for (int r = 0; r < RANKS; r++) {
        EXPECT_OK(args[r].status);
        CHECK(args[r].info.total_count == ITEMS && args[r].info.microbatches == RANKS * MB && !args[r].info.found_inf,
              "%s rank %d: total_count %llu microbatches %llu", how, r, (unsigned long long)args[r].info.total_count,
              (unsigned long long)args[r].info.microbatches);
    }
    CHECK(memcmp(args[0].master, args[1].master, sizeof args[0].master) == 0, "%s %s/%s: ranks differ bitwise", how,
          dtype_name(dw), dtype_name(db));
    CHECK(args[0].info.grad_norm == args[1].info.grad_norm, "ranks' grad_norm differ");
    for (int k = 0; k < NP; k++) {
        out[k] = args[0].master[k];
        double s = 0.0, m = 0.0;
        for (int r = 0; r < RANKS; r++) {
            s += normalize == GRADACC_NORMALIZE_BY_COUNT ? args[r].sum_by_count[k] : args[r].sum_of_means[k];
            m += args[r].magnitude[k];
        }
        from_inputs[k] = normalize == GRADACC_NORMALIZE_BY_COUNT ? s / ITEMS : s / (RANKS * MB);
        magnitude[k] = m;
    }
    for (int r = 0; r < RANKS; r++)
        EXPECT_OK(gradacc_comm_destroy(comms[r]));
}

static void check(const char *what, gradacc_dtype_t dw, gradacc_dtype_t db, const double *got, const double *from_inputs,
                  const double *truth, const double *magnitude)
{
    int bad = 0;
    for (int k = 0; k < NP && bad < 5; k++) {
        gradacc_dtype_t d = k < NW ? dw : db;
        double unit = dtype_half_ulp(d);
        double tight = 1e-6 * magnitude[k] + 1e-30;
        double loose = tight + unit * magnitude[k] + ldexp(1.0, -25) / 4096.0;
        int ok = fabs(got[k] - from_inputs[k]) <= tight && fabs(got[k] - truth[k]) <= loose;
        CHECK(ok, "%s W:%s b:%s element %d: got %.9g, f64 from given values %.9g (tol %.2g), f64 truth %.9g (tol %.2g)",
              what, dtype_name(dw), dtype_name(db), k, got[k], from_inputs[k], tight, truth[k], loose);
        bad += !ok;
    }
}

int main(void)
{
    test_rng rng = rng_fresh("seed_unequal_counts");
    static problem p;
    for (int k = 0; k < NW; k++)
        p.W[k] = rng_range(&rng, -0.5, 0.5);
    for (int k = 0; k < NB; k++)
        p.b[k] = rng_range(&rng, -0.5, 0.5);
    for (int i = 0; i < ITEMS; i++) {
        for (int j = 0; j < IN; j++)
            p.x[i][j] = rng_range(&rng, -1, 1);
        for (int o = 0; o < OUT; o++)
            p.t[i][o] = rng_range(&rng, -1, 1) + (i % 5); /* item-dependent targets: means differ */
    }

    /* f64 truths: the per-item global mean, and the mean of the 6 micro-batch means */
    double per_item[NP], mean_of_means[NP], g[NP];
    grad_sum(&p, 0, ITEMS, per_item);
    for (int k = 0; k < NP; k++) {
        per_item[k] /= ITEMS;
        mean_of_means[k] = 0.0;
    }
    int first = 0;
    for (int r = 0; r < RANKS; r++)
        for (int m = 0; m < MB; m++) {
            grad_sum(&p, first, first + sizes[r][m], g);
            for (int k = 0; k < NP; k++)
                mean_of_means[k] += g[k] / sizes[r][m] / (RANKS * MB);
            first += sizes[r][m];
        }

    static const gradacc_dtype_t pairs[3][2] = {
        {GRADACC_DTYPE_F32, GRADACC_DTYPE_F32}, {GRADACC_DTYPE_F16, GRADACC_DTYPE_BF16}, {GRADACC_DTYPE_BF16, GRADACC_DTYPE_F16}};
    for (int d = 0; d < 3; d++) {
        double by_count[NP], by_mb[NP], in_count[NP], in_mb[NP], mag_count[NP], mag_mb[NP];
        run(&p, GRADACC_NORMALIZE_BY_COUNT, pairs[d][0], pairs[d][1], by_count, in_count, mag_count);
        run(&p, GRADACC_NORMALIZE_BY_MICROBATCHES, pairs[d][0], pairs[d][1], by_mb, in_mb, mag_mb);
        check("BY_COUNT", pairs[d][0], pairs[d][1], by_count, in_count, per_item, mag_count);
        check("BY_MICROBATCHES", pairs[d][0], pairs[d][1], by_mb, in_mb, mean_of_means, mag_mb);
        double gap = max_abs_diff(by_count, by_mb, NP);
        double truth_gap = max_abs_diff(per_item, mean_of_means, NP);
        CHECK(gap > 0.01 && gap > 0.5 * truth_gap, "BY_COUNT and BY_MICROBATCHES should differ: max gap %g (f64 %g)", gap,
              truth_gap);
        if (d == 0)
            printf("max |per-item mean - mean of micro-batch means| = %.4f (f64: %.4f)\n", gap, truth_gap);
    }
    return test_finish();
}
