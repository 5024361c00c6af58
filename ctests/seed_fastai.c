/* Seed fastai-accumulation-sum-vs-mean.md: accumulating 4 micro-batches of 8 must give the
 * gradient of a batch of 32, "but we often use reduction=mean". With gradacc the caller says how
 * its loss was reduced (LOSS_REDUCTION_MEAN or SUM) and the boundary divides by the global item
 * count: both give the f64 full-batch mean gradient. A linear model y = W x + b with per-item loss
 * 0.5 |y - t|^2 on random data (fresh seed). */
#include "common.h"

enum { IN = 5, OUT = 3, BATCH = 32, MB = 4, PER = BATCH / MB, NW = OUT * IN, NB = OUT };

typedef struct {
    double W[NW], b[NB];
    double x[BATCH][IN], t[BATCH][OUT];
} problem;

/* Gradient of the per-item losses over items [lo, hi), summed (not averaged). */
static void grad_sum(const problem *p, int lo, int hi, double *gW, double *gb)
{
    memset(gW, 0, NW * sizeof(double));
    memset(gb, 0, NB * sizeof(double));
    for (int i = lo; i < hi; i++) {
        for (int o = 0; o < OUT; o++) {
            double r = p->b[o] - p->t[i][o];
            for (int j = 0; j < IN; j++)
                r += p->W[o * IN + j] * p->x[i][j];
            for (int j = 0; j < IN; j++)
                gW[o * IN + j] += r * p->x[i][j];
            gb[o] += r;
        }
    }
}

static void run(const problem *p, gradacc_loss_reduction_t reduction, gradacc_dtype_t dw, gradacc_dtype_t db)
{
    const float scale = 1024.0f;
    gradacc_scaler_t *scaler = scaler_with_scale(scale);
    gradacc_accumulator_config_t ac;
    REQUIRE_OK(gradacc_accumulator_config_default(&ac));
    ac.loss_reduction = reduction;
    ac.normalize = GRADACC_NORMALIZE_BY_COUNT;
    gradacc_tensor_desc_t t[2] = {{NW, dw}, {NB, db}};
    gradacc_accumulator_t *acc = NULL;
    REQUIRE_OK(gradacc_accumulator_create(&ac, t, 2, NULL, &acc));

    /* references: the true full-batch mean gradient, the same from the values the library was
     * actually given (decoded 16-bit values), and the magnitude of the summed terms */
    double full[NW + NB], from_inputs[NW + NB], magnitude[NW + NB];
    grad_sum(p, 0, BATCH, full, full + NW);
    for (int k = 0; k < NW + NB; k++) {
        full[k] /= BATCH;
        from_inputs[k] = magnitude[k] = 0.0;
    }
    grad_buf gw = grad_alloc(dw, NW), gb = grad_alloc(db, NB);
    for (int m = 0; m < MB; m++) {
        double g[NW + NB], exact[NW + NB];
        grad_sum(p, m * PER, (m + 1) * PER, g, g + NW);
        if (reduction == GRADACC_LOSS_REDUCTION_MEAN)
            for (int k = 0; k < NW + NB; k++)
                g[k] /= PER; /* the micro-batch's own mean loss */
        grad_encode(&gw, g, scale, exact);
        grad_encode(&gb, g + NW, scale, exact + NW);
        double weight = reduction == GRADACC_LOSS_REDUCTION_MEAN ? PER : 1.0;
        for (int k = 0; k < NW + NB; k++) {
            from_inputs[k] += weight * exact[k] / BATCH;
            magnitude[k] += fabs(weight * exact[k]) / BATCH;
        }
        const void *grads[2] = {gw.data, gb.data};
        REQUIRE_OK(gradacc_accumulator_add(acc, scaler, grads, 2, PER));
    }
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    REQUIRE_OK(gradacc_accumulator_sync(acc, NULL, &info));
    CHECK(info.total_count == BATCH && info.microbatches == MB && !info.found_inf, "sync info");

    double got[NW + NB];
    read_master(acc, 0, got, NW);
    read_master(acc, 1, got + NW, NB);
    const char *red = reduction == GRADACC_LOSS_REDUCTION_MEAN ? "MEAN" : "SUM";
    int bad = 0;
    double norm2 = 0.0;
    for (int k = 0; k < NW + NB && bad < 5; k++) {
        gradacc_dtype_t d = k < NW ? dw : db;
        /* f32 arithmetic on the given values: a few roundings of terms of this magnitude */
        double tight = 1e-6 * magnitude[k] + 1e-30;
        /* against the true gradient: plus the rounding of the gradient to its dtype (half an ulp:
         * 2^-24 for f32, 2^-11 for f16, 2^-8 for bf16) */
        double unit = dtype_half_ulp(d);
        double loose = tight + unit * magnitude[k] + ldexp(1.0, -25) / scale; /* + fp16 subnormal spacing */
        int ok = fabs(got[k] - from_inputs[k]) <= tight && fabs(got[k] - full[k]) <= loose;
        CHECK(ok,
              "%s W:%s b:%s element %d: got %.9g, f64 from the given values %.9g (tol %.2g), f64 full batch %.9g "
              "(tol %.2g)",
              red, dtype_name(dw), dtype_name(db), k, got[k], from_inputs[k], tight, full[k], loose);
        bad += !ok;
        norm2 += from_inputs[k] * from_inputs[k];
    }
    CHECK_CLOSE(info.grad_norm, sqrt(norm2), 1e-6 * sqrt(norm2), "grad_norm");
    if (dw == GRADACC_DTYPE_F32 && db == GRADACC_DTYPE_F32) {
        double rel = 0.0;
        for (int k = 0; k < NW + NB; k++)
            if (fabs(got[k] - full[k]) / magnitude[k] > rel)
                rel = fabs(got[k] - full[k]) / magnitude[k];
        printf("%-4s f32: max |accumulated - full batch| / magnitude = %.2g\n", red, rel);
    }
    grad_free(&gw);
    grad_free(&gb);
    gradacc_accumulator_destroy(acc);
    gradacc_scaler_destroy(scaler);
}

int main(void)
{
    test_rng rng = rng_fresh("seed_fastai");
    static problem p;
    for (int k = 0; k < NW; k++)
        p.W[k] = rng_range(&rng, -0.5, 0.5);
    for (int k = 0; k < NB; k++)
        p.b[k] = rng_range(&rng, -0.5, 0.5);
    for (int i = 0; i < BATCH; i++) {
        for (int j = 0; j < IN; j++)
            p.x[i][j] = rng_range(&rng, -1, 1);
        for (int o = 0; o < OUT; o++)
            p.t[i][o] = rng_range(&rng, -1, 1);
    }
    static const gradacc_dtype_t pairs[4][2] = {{GRADACC_DTYPE_F32, GRADACC_DTYPE_F32},
                                                {GRADACC_DTYPE_F16, GRADACC_DTYPE_BF16},
                                                {GRADACC_DTYPE_BF16, GRADACC_DTYPE_F16},
                                                {GRADACC_DTYPE_F16, GRADACC_DTYPE_F32}};
    for (int k = 0; k < 4; k++) {
        run(&p, GRADACC_LOSS_REDUCTION_MEAN, pairs[k][0], pairs[k][1]);
        run(&p, GRADACC_LOSS_REDUCTION_SUM, pairs[k][0], pairs[k][1]);
    }
    return test_finish();
}
