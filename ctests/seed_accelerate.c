/* Seed accelerate-gradient-accumulation.md: x = 1..8, y = 2x, one weight starting at 0, MSE loss
 * (mean), 4 micro-batches of 2, SGD with lr 0.02. One accumulated step must give weight 2.04,
 * the same as one full-batch step. Through gradacc: mean-reduced micro-batch losses, each added
 * with its item count (BY_COUNT), and also BY_MICROBATCHES, which agrees here because the
 * micro-batches have equal sizes. Gradients arrive as f32, and as f16 / bf16 at loss scale 128
 * (every micro-batch gradient is a small integer, exact in both formats). */
#include "common.h"

enum { N = 8, MB = 4, PER = 2 };

static const double lr = 0.02;

/* d/dw mean((w x - y)^2) over items [lo, hi) */
static double grad_mse(double w, const double *x, const double *y, int lo, int hi)
{
    double g = 0.0;
    for (int i = lo; i < hi; i++)
        g += 2.0 * (w * x[i] - y[i]) * x[i];
    return g / (hi - lo);
}

static void run(gradacc_normalize_t normalize, gradacc_dtype_t dtype, const double *x, const double *y, double want_w)
{
    gradacc_scaler_t *scaler = scaler_with_scale(dtype == GRADACC_DTYPE_F32 ? 1.0f : 128.0f);
    gradacc_accumulator_config_t ac;
    REQUIRE_OK(gradacc_accumulator_config_default(&ac));
    ac.normalize = normalize;
    ac.loss_reduction = GRADACC_LOSS_REDUCTION_MEAN;
    gradacc_tensor_desc_t t = {1, dtype};
    gradacc_accumulator_t *acc = NULL;
    REQUIRE_OK(gradacc_accumulator_create(&ac, &t, 1, NULL, &acc));

    float weight = 0.0f;
    grad_buf g = grad_alloc(dtype, 1);
    for (int m = 0; m < MB; m++) {
        double gm = grad_mse(weight, x, y, m * PER, (m + 1) * PER);
        float scale;
        REQUIRE_OK(gradacc_scaler_scale(scaler, &scale));
        double exact;
        grad_encode(&g, &gm, scale, &exact);
        CHECK(exact == gm, "micro-batch %d gradient %g is not exact in %s", m, gm, dtype_name(dtype));
        const void *grads[1] = {g.data};
        REQUIRE_OK(gradacc_accumulator_add(acc, scaler, grads, 1, PER));
    }
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    REQUIRE_OK(gradacc_accumulator_sync(acc, NULL, &info));
    const gradacc_accumulator_t *accs[1] = {acc};
    bool skipped = true;
    REQUIRE_OK(gradacc_scaler_update(scaler, accs, 1, &skipped));
    CHECK(!skipped && !info.found_inf, "step skipped");
    CHECK(info.total_count == N && info.microbatches == MB, "info: count %llu, micro-batches %llu",
          (unsigned long long)info.total_count, (unsigned long long)info.microbatches);

    double grad = NAN;
    read_master(acc, 0, &grad, 1);
    const char *how = normalize == GRADACC_NORMALIZE_BY_COUNT ? "BY_COUNT" : "BY_MICROBATCHES";
    CHECK(grad == -102.0, "%s %s: accumulated gradient %.9g, expected -102 (the full-batch gradient)", how,
          dtype_name(dtype), grad);
    weight = (float)(weight - lr * grad);
    CHECK_CLOSE(weight, want_w, 2.04 * FLT_EPSILON, "%s %s: weight after one step", how, dtype_name(dtype));
    CHECK_CLOSE(weight, 2.04, 2.04 * FLT_EPSILON, "%s %s: the seed's 2.04", how, dtype_name(dtype));
    printf("%-15s %-4s: weight after one accumulated step %.5f\n", how, dtype_name(dtype), weight);

    grad_free(&g);
    gradacc_accumulator_destroy(acc);
    gradacc_scaler_destroy(scaler);
}

int main(void)
{
    double x[N], y[N];
    for (int i = 0; i < N; i++) {
        x[i] = i + 1;
        y[i] = 2.0 * x[i];
    }
    /* the reference: one full-batch step in f64 */
    double full = 0.0 - lr * grad_mse(0.0, x, y, 0, N);
    CHECK_CLOSE(full, 2.04, 1e-12, "full-batch step");
    printf("full batch          : weight after one step %.5f\n", full);

    static const gradacc_dtype_t dtypes[3] = {GRADACC_DTYPE_F32, GRADACC_DTYPE_F16, GRADACC_DTYPE_BF16};
    for (int d = 0; d < 3; d++) {
        run(GRADACC_NORMALIZE_BY_COUNT, dtypes[d], x, y, full);
        run(GRADACC_NORMALIZE_BY_MICROBATCHES, dtypes[d], x, y, full);
    }
    return test_finish();
}
