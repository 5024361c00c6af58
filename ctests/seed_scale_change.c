/* Bug B3 of the design (amp guide): the loss scale changes inside an accumulation window, and
 * scaled and unscaled gradients get mixed. gradacc unscales each micro-batch as it is added, with
 * the scale that produced it, so a scale change between micro-batches changes nothing beyond f32
 * rounding:
 *  - the scaler is updated in the middle of a window (another accumulator's step overflows, then
 *    grows back), and the next micro-batches are produced and added at the new scale;
 *  - two scalers with different scales (one not a power of two) feed one window.
 * And a tensor that received nothing in a window reads 0 at the boundary, not last window's value. */
#include "common.h"

enum { N = 33 };

static void compare(const char *what, gradacc_accumulator_t *acc, const double *from_inputs, const double *truth,
                    const double *magnitude)
{
    double got[N];
    read_master(acc, 0, got, N);
    for (int k = 0; k < N; k++) {
        CHECK_CLOSE(got[k], from_inputs[k], 1e-6 * magnitude[k] + 1e-30, "%s element %d vs the given values", what, k);
        CHECK_CLOSE(got[k], truth[k], 1e-6 * magnitude[k] + ldexp(1.0, -11) * magnitude[k] + 1e-9,
                    "%s element %d vs the f64 mean", what, k);
    }
}

static void test_update_mid_window(test_rng *rng)
{
    gradacc_scaler_config_t sc;
    REQUIRE_OK(gradacc_scaler_config_default(&sc));
    sc.growth_interval = 1;
    gradacc_scaler_t *scaler = NULL;
    REQUIRE_OK(gradacc_scaler_create(&sc, NULL, &scaler)); /* 65536 */
    gradacc_tensor_desc_t t = {N, GRADACC_DTYPE_F16};
    gradacc_accumulator_t *main_acc = NULL, *other = NULL;
    REQUIRE_OK(gradacc_accumulator_create(NULL, &t, 1, NULL, &main_acc));
    REQUIRE_OK(gradacc_accumulator_create(NULL, &t, 1, NULL, &other));
    grad_buf g = grad_alloc(GRADACC_DTYPE_F16, N);
    static const uint64_t counts[3] = {3, 1, 4};
    static const float scales[3] = {65536, 32768, 65536};
    double truth[N] = {0}, from_inputs[N] = {0}, magnitude[N] = {0}, final_scale_view[N] = {0};
    for (int m = 0; m < 3; m++) {
        if (m > 0) { /* another accumulator's step: overflow (backoff), then finite (growth) */
            const uint16_t bad[N] = {[5] = 0x7c00};
            const uint16_t fine[N] = {0};
            const void *gg[1] = {m == 1 ? bad : fine};
            REQUIRE_OK(gradacc_accumulator_add(other, scaler, gg, 1, 1));
            REQUIRE_OK(gradacc_accumulator_sync(other, NULL, NULL));
            const gradacc_accumulator_t *o[1] = {other};
            bool skipped;
            REQUIRE_OK(gradacc_scaler_update(scaler, o, 1, &skipped));
            CHECK(skipped == (m == 1), "helper step %d skipped %d", m, skipped);
        }
        float scale;
        REQUIRE_OK(gradacc_scaler_scale(scaler, &scale));
        CHECK(scale == scales[m], "micro-batch %d: scale %g, expected %g", m, scale, scales[m]);
        double v[N], exact[N];
        for (int k = 0; k < N; k++)
            v[k] = rng_range(rng, -0.9, 0.9);
        grad_encode(&g, v, scale, exact);
        for (int k = 0; k < N; k++) {
            truth[k] += counts[m] * v[k] / 8.0;
            from_inputs[k] += counts[m] * exact[k] / 8.0;
            magnitude[k] += fabs(counts[m] * exact[k]) / 8.0;
            /* the mixed-scale mistake: everything unscaled by the scale in force at the end */
            final_scale_view[k] += counts[m] * exact[k] * scale / 65536.0 / 8.0;
        }
        const void *gg[1] = {g.data};
        REQUIRE_OK(gradacc_accumulator_add(main_acc, scaler, gg, 1, counts[m]));
    }
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    REQUIRE_OK(gradacc_accumulator_sync(main_acc, NULL, &info));
    CHECK(!info.found_inf, "the main window has no overflow");
    compare("scale changed mid-window", main_acc, from_inputs, truth, magnitude);
    double got[N];
    read_master(main_acc, 0, got, N);
    CHECK(max_abs_diff(got, final_scale_view, N) > 1e-3, "result looks unscaled with one scale for all micro-batches");
    grad_free(&g);
    gradacc_accumulator_destroy(main_acc);
    gradacc_accumulator_destroy(other);
    gradacc_scaler_destroy(scaler);
}

static void test_two_scalers(test_rng *rng)
{
    static const float scales[2] = {1024.0f, 3.0f};
    gradacc_scaler_t *s[2];
    for (int i = 0; i < 2; i++) {
        gradacc_scaler_config_t sc;
        REQUIRE_OK(gradacc_scaler_config_default(&sc));
        sc.init_scale = scales[i];
        REQUIRE_OK(gradacc_scaler_create(&sc, NULL, &s[i]));
    }
    static const gradacc_dtype_t dtypes[3] = {GRADACC_DTYPE_F16, GRADACC_DTYPE_BF16, GRADACC_DTYPE_F32};
    for (int d = 0; d < 3; d++) {
        gradacc_tensor_desc_t t = {N, dtypes[d]};
        gradacc_accumulator_t *acc = NULL;
        REQUIRE_OK(gradacc_accumulator_create(NULL, &t, 1, NULL, &acc));
        grad_buf g = grad_alloc(dtypes[d], N);
        double truth[N] = {0}, from_inputs[N] = {0}, magnitude[N] = {0};
        for (int m = 0; m < 4; m++) {
            double v[N], exact[N];
            for (int k = 0; k < N; k++)
                v[k] = rng_range(rng, -4, 4);
            grad_encode(&g, v, scales[m % 2], exact);
            for (int k = 0; k < N; k++) {
                truth[k] += 2.0 * v[k] / 8.0;
                from_inputs[k] += 2.0 * exact[k] / 8.0;
                magnitude[k] += fabs(2.0 * exact[k]) / 8.0;
            }
            const void *gg[1] = {g.data};
            REQUIRE_OK(gradacc_accumulator_add(acc, s[m % 2], gg, 1, 2));
        }
        REQUIRE_OK(gradacc_accumulator_sync(acc, NULL, NULL));
        double got[N];
        read_master(acc, 0, got, N);
        double unit = dtype_half_ulp(dtypes[d]);
        for (int k = 0; k < N; k++) {
            CHECK_CLOSE(got[k], from_inputs[k], 1e-6 * magnitude[k] + 1e-30, "two scalers (%s) element %d",
                        dtype_name(dtypes[d]), k);
            CHECK_CLOSE(got[k], truth[k], (1e-6 + unit) * magnitude[k] + ldexp(1.0, -24) / 3.0,
                        "two scalers (%s) element %d vs f64 truth", dtype_name(dtypes[d]), k);
        }
        grad_free(&g);
        gradacc_accumulator_destroy(acc);
    }
    gradacc_scaler_destroy(s[0]);
    gradacc_scaler_destroy(s[1]);
}

/* A tensor that gets nothing in a window is 0 at that boundary, whatever it held before, also in a
 * buffer the caller lent (whose initial contents must be ignored). */
static void test_untouched_tensor_is_zero(void)
{
    gradacc_scaler_t *scaler = scaler_with_scale(256);
    gradacc_tensor_desc_t t[3] = {{4, GRADACC_DTYPE_F16}, {5, GRADACC_DTYPE_BF16}, {3, GRADACC_DTYPE_F32}};
    float lent[3 * (GRADACC_MASTER_ALIGN / 4)]; /* each tensor padded to the alignment */
    for (int i = 0; i < 3 * (GRADACC_MASTER_ALIGN / 4); i++)
        lent[i] = 123.0f + i;
    gradacc_accumulator_t *accs[2] = {NULL, NULL};
    REQUIRE_OK(gradacc_accumulator_create(NULL, t, 3, NULL, &accs[0]));
    REQUIRE_OK(gradacc_accumulator_create_with_buffer(NULL, t, 3, NULL, lent, 3 * (GRADACC_MASTER_ALIGN / 4), &accs[1]));
    const uint16_t g0[4] = {0x5c00, 0x5c00, 0x5c00, 0x5c00}; /* 256: unscaled 1 */
    const uint16_t g1[5] = {0x4400, 0x4400, 0x4400, 0x4400, 0x4400}; /* bf16 512: unscaled 2 */
    const float g2[3] = {768, 768, 768}; /* unscaled 3 */
    for (int a = 0; a < 2; a++) {
        gradacc_accumulator_t *acc = accs[a];
        const char *kind = a ? "lent buffer" : "own buffer";
        /* window 1: tensor 1 only (tensors 0 and 2, never written, must read 0 too) */
        REQUIRE_OK(gradacc_accumulator_begin_microbatch(acc, 1));
        REQUIRE_OK(gradacc_accumulator_add_tensor(acc, scaler, 1, g1, 5));
        REQUIRE_OK(gradacc_accumulator_end_microbatch(acc));
        REQUIRE_OK(gradacc_accumulator_sync(acc, NULL, NULL));
        double m[5];
        read_master(acc, 0, m, 4);
        for (int i = 0; i < 4; i++)
            CHECK(m[i] == 0.0, "%s, window 1: unwritten tensor 0 reads %g", kind, m[i]);
        read_master(acc, 1, m, 5);
        for (int i = 0; i < 5; i++)
            CHECK(m[i] == 2.0, "%s, window 1: tensor 1 reads %g, expected 2", kind, m[i]);
        read_master(acc, 2, m, 3);
        for (int i = 0; i < 3; i++)
            CHECK(m[i] == 0.0, "%s, window 1: unwritten tensor 2 reads %g", kind, m[i]);
        /* window 2: tensors 0 and 2 only; tensor 1 must read 0, not 2 */
        REQUIRE_OK(gradacc_accumulator_begin_microbatch(acc, 1));
        REQUIRE_OK(gradacc_accumulator_add_tensor(acc, scaler, 0, g0, 4));
        REQUIRE_OK(gradacc_accumulator_add_tensor(acc, scaler, 2, g2, 3));
        REQUIRE_OK(gradacc_accumulator_end_microbatch(acc));
        REQUIRE_OK(gradacc_accumulator_sync(acc, NULL, NULL));
        read_master(acc, 0, m, 4);
        for (int i = 0; i < 4; i++)
            CHECK(m[i] == 1.0, "%s, window 2: tensor 0 reads %g, expected 1", kind, m[i]);
        read_master(acc, 1, m, 5);
        for (int i = 0; i < 5; i++)
            CHECK(m[i] == 0.0, "%s, window 2: tensor 1 got nothing but reads %g (last window's value is 2)", kind, m[i]);
        read_master(acc, 2, m, 3);
        for (int i = 0; i < 3; i++)
            CHECK(m[i] == 3.0, "%s, window 2: tensor 2 reads %g, expected 3", kind, m[i]);
        /* window 3, after an explicit reset of a window in progress: the discarded values must not
         * leak into the next window either */
        REQUIRE_OK(gradacc_accumulator_begin_microbatch(acc, 1));
        REQUIRE_OK(gradacc_accumulator_add_tensor(acc, scaler, 1, g1, 5));
        REQUIRE_OK(gradacc_accumulator_end_microbatch(acc));
        REQUIRE_OK(gradacc_accumulator_reset(acc));
        REQUIRE_OK(gradacc_accumulator_begin_microbatch(acc, 1));
        REQUIRE_OK(gradacc_accumulator_add_tensor(acc, scaler, 0, g0, 4));
        REQUIRE_OK(gradacc_accumulator_end_microbatch(acc));
        REQUIRE_OK(gradacc_accumulator_sync(acc, NULL, NULL));
        read_master(acc, 1, m, 5);
        for (int i = 0; i < 5; i++)
            CHECK(m[i] == 0.0, "%s, after reset: discarded tensor 1 reads %g", kind, m[i]);
        read_master(acc, 2, m, 3);
        for (int i = 0; i < 3; i++)
            CHECK(m[i] == 0.0, "%s, after reset: tensor 2 reads %g (value from two windows ago)", kind, m[i]);
        read_master(acc, 0, m, 4);
        for (int i = 0; i < 4; i++)
            CHECK(m[i] == 1.0, "%s, after reset: tensor 0 reads %g", kind, m[i]);
    }
    gradacc_accumulator_destroy(accs[0]);
    gradacc_accumulator_destroy(accs[1]);
    gradacc_scaler_destroy(scaler);
}

int main(void)
{
    test_rng rng = rng_fresh("seed_scale_change");
    test_update_mid_window(&rng);
    test_two_scalers(&rng);
    test_untouched_tensor_is_zero();
    return test_finish();
}
