/* Seed amp-gradscaler-guide.md, "multiple models, losses and optimizers": one scaler serves two
 * parameter groups (two accumulators). An inf in either group must skip the step of both, and the
 * scale must back off once per step, not once per group: one gradacc_scaler_update call takes both
 * accumulators. And gradient clipping must see unscaled gradients: the boundary's grad_norm is the
 * f64 norm of the unscaled, normalised gradient whatever the loss scale, and
 * clip_coef = max_grad_norm / (grad_norm + 1e-6), as torch.nn.utils.clip_grad_norm_. */
#include "common.h"

enum { NA = 5, NB1 = 4, NB2 = 3 };

static gradacc_scaler_t *scaler;
static gradacc_accumulator_t *acc_a, *acc_b;

/* One step: a window of two micro-batches (counts 3 and 5) in each group; `inf_a` / `inf_b` put an
 * fp16 / bf16 infinity into that group's second micro-batch. */
static void step(int inf_a, int inf_b, bool *skipped, gradacc_sync_info_t *ia, gradacc_sync_info_t *ib)
{
    grad_buf a = grad_alloc(GRADACC_DTYPE_F16, NA), b1 = grad_alloc(GRADACC_DTYPE_BF16, NB1),
             b2 = grad_alloc(GRADACC_DTYPE_F32, NB2);
    for (int m = 0; m < 2; m++) {
        float scale;
        REQUIRE_OK(gradacc_scaler_scale(scaler, &scale));
        double v[NA];
        for (int i = 0; i < NA; i++)
            v[i] = 0.01 * (i + 1) * (m + 1);
        grad_encode(&a, v, scale, NULL);
        grad_encode(&b1, v, scale, NULL);
        grad_encode(&b2, v, scale, NULL);
        if (m == 1 && inf_a)
            grad_poke(&a, 3, 0x7c00, 0);
        if (m == 1 && inf_b)
            grad_poke(&b1, 0, 0xff80, 0); /* bf16 -inf */
        const void *ga[1] = {a.data};
        const void *gb[2] = {b1.data, b2.data};
        REQUIRE_OK(gradacc_accumulator_add(acc_a, scaler, ga, 1, m == 0 ? 3 : 5));
        REQUIRE_OK(gradacc_accumulator_add(acc_b, scaler, gb, 2, m == 0 ? 3 : 5));
    }
    REQUIRE_OK(gradacc_accumulator_sync(acc_a, NULL, ia));
    REQUIRE_OK(gradacc_accumulator_sync(acc_b, NULL, ib));
    const gradacc_accumulator_t *both[2] = {acc_a, acc_b};
    REQUIRE_OK(gradacc_scaler_update(scaler, both, 2, skipped));
    grad_free(&a);
    grad_free(&b1);
    grad_free(&b2);
}

static void test_skip_together(void)
{
    static const struct {
        int inf_a, inf_b;
        float scale_after;
    } cases[] = {{1, 0, 32768}, {0, 1, 16384}, {0, 0, 16384}, {1, 1, 8192}, {0, 0, 8192}};
    REQUIRE_OK(gradacc_scaler_create(NULL, NULL, &scaler));
    gradacc_tensor_desc_t ta = {NA, GRADACC_DTYPE_F16};
    gradacc_tensor_desc_t tb[2] = {{NB1, GRADACC_DTYPE_BF16}, {NB2, GRADACC_DTYPE_F32}};
    REQUIRE_OK(gradacc_accumulator_create(NULL, &ta, 1, NULL, &acc_a));
    REQUIRE_OK(gradacc_accumulator_create(NULL, tb, 2, NULL, &acc_b));
    unsigned long long backoffs = 0;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        bool skipped = false;
        gradacc_sync_info_t ia = GRADACC_SYNC_INFO_INIT, ib = GRADACC_SYNC_INFO_INIT;
        step(cases[c].inf_a, cases[c].inf_b, &skipped, &ia, &ib);
        int any = cases[c].inf_a || cases[c].inf_b;
        CHECK(ia.found_inf == (cases[c].inf_a != 0) && ib.found_inf == (cases[c].inf_b != 0),
              "case %zu: groups' found_inf %d %d", c, ia.found_inf, ib.found_inf);
        CHECK(skipped == (any != 0), "case %zu (inf in a: %d, in b: %d): skipped = %d", c, cases[c].inf_a,
              cases[c].inf_b, skipped);
        float scale;
        REQUIRE_OK(gradacc_scaler_scale(scaler, &scale));
        CHECK(scale == cases[c].scale_after, "case %zu: scale %g, expected %g (one backoff per step)", c, scale,
              cases[c].scale_after);
        backoffs += any ? 1 : 0;
        gradacc_scaler_stats_t st = GRADACC_SCALER_STATS_INIT;
        REQUIRE_OK(gradacc_scaler_stats(scaler, &st));
        CHECK(st.steps == c + 1 && st.backoffs == backoffs, "case %zu: steps %llu backoffs %llu, expected %zu and %llu",
              c, (unsigned long long)st.steps, (unsigned long long)st.backoffs, c + 1, backoffs);
        if (!any) { /* a clean step: both groups hold the count-weighted mean, (3*v + 5*2v) / 8 */
            double got[NA];
            read_master(acc_a, 0, got, NA);
            for (int i = 0; i < NA; i++)
                CHECK_CLOSE(got[i], 0.01 * (i + 1) * 13.0 / 8.0, 1e-3 * 0.01 * (i + 1) * 13.0 / 8.0, "group a element %d", i);
        }
    }
    gradacc_accumulator_destroy(acc_a);
    gradacc_accumulator_destroy(acc_b);
    gradacc_scaler_destroy(scaler);
}

/* Clipping per group on the unscaled gradient: the same gradient at two loss scales gives the same
 * norm, clip_coef and clipped master. */
static void test_clip_unscaled(test_rng *rng)
{
    enum { N = 37 };
    const float max_norm = 0.5f;
    double v[2][N];
    for (int m = 0; m < 2; m++)
        for (int i = 0; i < N; i++)
            v[m][i] = rng_range(rng, -0.6, 0.6);
    static const float scales[2] = {65536.0f, 8.0f};
    float masters[2][N];
    double norms[2];
    for (int s = 0; s < 2; s++) {
        for (int big = 0; big < 2; big++) { /* big = 0: norm above max_norm, clipped; 1: not clipped */
            double mult = big ? 0.05 : 1.0;
            gradacc_scaler_t *sclr = scaler_with_scale(scales[s]);
            gradacc_accumulator_config_t ac;
            REQUIRE_OK(gradacc_accumulator_config_default(&ac));
            ac.max_grad_norm = max_norm;
            gradacc_tensor_desc_t t = {N, GRADACC_DTYPE_F16};
            gradacc_accumulator_t *acc = NULL;
            REQUIRE_OK(gradacc_accumulator_create(&ac, &t, 1, NULL, &acc));
            grad_buf g = grad_alloc(GRADACC_DTYPE_F16, N);
            double unscaled[N];
            for (int i = 0; i < N; i++)
                unscaled[i] = 0.0;
            for (int m = 0; m < 2; m++) {
                double w[N], exact[N];
                for (int i = 0; i < N; i++) /* values exact in fp16 at both scales: multiples of 2^-8 */
                    w[i] = ldexp(round(ldexp(v[m][i] * mult, 8)), -8);
                grad_encode(&g, w, scales[s], exact);
                for (int i = 0; i < N; i++) {
                    CHECK(exact[i] == w[i], "value not exact in fp16");
                    unscaled[i] += exact[i] * 4.0 / 8.0; /* count 4 each, 8 items */
                }
                const void *grads[1] = {g.data};
                REQUIRE_OK(gradacc_accumulator_add(acc, sclr, grads, 1, 4));
            }
            gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
            REQUIRE_OK(gradacc_accumulator_sync(acc, NULL, &info));
            double norm = 0.0;
            for (int i = 0; i < N; i++)
                norm += unscaled[i] * unscaled[i];
            norm = sqrt(norm);
            CHECK_CLOSE(info.grad_norm, norm, 1e-6 * norm, "grad_norm at scale %g (the unscaled gradient's norm)", scales[s]);
            double coef = norm > max_norm ? max_norm / (norm + 1e-6) : 1.0;
            CHECK(big ? norm < max_norm : norm > max_norm, "test data: norm %g", norm);
            CHECK_CLOSE(info.clip_coef, coef, 1e-6 * coef, "clip_coef at scale %g, norm %g", scales[s], norm);
            double got[N];
            read_master(acc, 0, got, N);
            for (int i = 0; i < N; i++)
                CHECK_CLOSE(got[i], unscaled[i] * coef, 1e-6 * fabs(unscaled[i]) + 1e-12, "clipped element %d", i);
            if (!big) {
                float *p;
                size_t n;
                REQUIRE_OK(gradacc_accumulator_master(acc, 0, &p, &n));
                memcpy(masters[s], p, sizeof masters[s]);
                norms[s] = info.grad_norm;
                double clipped = 0.0;
                for (int i = 0; i < N; i++)
                    clipped += got[i] * got[i];
                CHECK_CLOSE(sqrt(clipped), max_norm, 1e-5, "norm after clipping");
            }
            grad_free(&g);
            gradacc_accumulator_destroy(acc);
            gradacc_scaler_destroy(sclr);
        }
    }
    CHECK(norms[0] == norms[1], "grad_norm depends on the loss scale: %.17g at 65536, %.17g at 8", norms[0], norms[1]);
    CHECK(memcmp(masters[0], masters[1], sizeof masters[0]) == 0, "clipped masters depend on the loss scale");
}

int main(void)
{
    test_rng rng = rng_fresh("seed_amp_two_optimizers");
    test_skip_together();
    test_clip_unscaled(&rng);
    return test_finish();
}
