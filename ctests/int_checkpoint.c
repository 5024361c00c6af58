/* A run interrupted in the middle of an accumulation window (scaler and window saved, both objects
 * destroyed, new ones created and loaded, the run continued) is bitwise identical to the same run
 * uninterrupted: every step's master gradients, sync info, scale and statistics, over steps that
 * include overflows (injected and natural) and growths. Interruptions are tried at every step and
 * after every micro-batch count, the empty window included. Damaged bytes (another format version,
 * a flipped bit, truncation, another object's state, another layout) are refused with
 * GRADACC_STATUS_CORRUPT_STATE (SIZE_MISMATCH for another layout) and leave the objects as they were. */
#include "common.h"

enum { STEPS = 10, MICRO = 4, N0 = 37, N1 = 11, N2 = 13, NALL = N0 + N1 + N2 };
static const gradacc_tensor_desc_t descs[3] = {{N0, GRADACC_DTYPE_F16}, {N1, GRADACC_DTYPE_BF16}, {N2, GRADACC_DTYPE_F32}};

typedef struct {
    float master[NALL];
    gradacc_sync_info_t info;
    float scale;
    gradacc_scaler_stats_t stats;
    bool skipped;
} step_result;

static gradacc_scaler_t *new_scaler(void)
{
    gradacc_scaler_config_t c;
    REQUIRE_OK(gradacc_scaler_config_default(&c));
    c.init_scale = 32768.0f;
    c.growth_interval = 2;
    c.hysteresis = 2;
    gradacc_scaler_t *s = NULL;
    REQUIRE_OK(gradacc_scaler_create(&c, NULL, &s));
    return s;
}

static gradacc_accumulator_t *new_acc(void)
{
    gradacc_accumulator_config_t c;
    REQUIRE_OK(gradacc_accumulator_config_default(&c));
    c.max_grad_norm = 5.0f;
    gradacc_accumulator_t *a = NULL;
    REQUIRE_OK(gradacc_accumulator_create(&c, descs, 3, NULL, &a));
    return a;
}

/* Micro-batch m of step t: values up to ~3, so some scales overflow fp16 naturally; steps 3 and 7
 * carry an injected infinity. */
static void add_micro(gradacc_accumulator_t *acc, gradacc_scaler_t *s, int t, int m)
{
    float scale;
    REQUIRE_OK(gradacc_scaler_scale(s, &scale));
    uint16_t g0[N0], g1[N1];
    float g2[N2];
    for (int k = 0; k < NALL; k++) {
        double v = sin(0.37 * k + 1.3 * t + 0.71 * m) * (1.0 + (k % 3)) + 0.01 * t;
        float x = (float)(v * scale);
        if (k < N0)
            g0[k] = f32_to_f16_bits(x);
        else if (k < N0 + N1)
            g1[k - N0] = f32_to_bf16_bits(x);
        else
            g2[k - N0 - N1] = x;
    }
    if ((t == 3 || t == 7) && m == 1)
        g0[5] = 0x7c00;
    const void *grads[3] = {g0, g1, g2};
    REQUIRE_OK(gradacc_accumulator_add(acc, s, grads, 3, (uint64_t)(3 + m)));
}

static void finish_step(gradacc_accumulator_t *acc, gradacc_scaler_t *s, step_result *r)
{
    r->info.struct_size = sizeof r->info;
    REQUIRE_OK(gradacc_accumulator_sync(acc, NULL, &r->info));
    for (int i = 0; i < 3; i++) {
        float *p;
        size_t n;
        REQUIRE_OK(gradacc_accumulator_master(acc, (size_t)i, &p, &n));
        memcpy(r->master + (i == 0 ? 0 : i == 1 ? N0 : N0 + N1), p, n * sizeof(float));
    }
    const gradacc_accumulator_t *list[1] = {acc};
    REQUIRE_OK(gradacc_scaler_update(s, list, 1, &r->skipped));
    REQUIRE_OK(gradacc_scaler_scale(s, &r->scale));
    r->stats.struct_size = sizeof r->stats;
    REQUIRE_OK(gradacc_scaler_stats(s, &r->stats));
}

static uint8_t *save(gradacc_status_t (*fn)(const void *, uint8_t *, size_t, size_t *), const void *obj, size_t *len)
{
    REQUIRE_OK(fn(obj, NULL, 0, len));
    uint8_t *b = malloc(*len);
    REQUIRE_OK(fn(obj, b, *len, len));
    return b;
}

static gradacc_status_t save_scaler(const void *o, uint8_t *b, size_t c, size_t *l)
{
    return gradacc_scaler_save((const gradacc_scaler_t *)o, b, c, l);
}

static gradacc_status_t save_window(const void *o, uint8_t *b, size_t c, size_t *l)
{
    return gradacc_accumulator_save_window((const gradacc_accumulator_t *)o, b, c, l);
}

/* The bytes of the object's state now equal `want`. */
static void check_unchanged(gradacc_status_t (*fn)(const void *, uint8_t *, size_t, size_t *), const void *obj,
                            const uint8_t *want, size_t want_len, const char *what)
{
    size_t len;
    uint8_t *now = save(fn, obj, &len);
    CHECK(len == want_len && memcmp(now, want, len) == 0, "%s changed after a refused load", what);
    free(now);
}

/* Every kind of damaged bytes is refused and changes nothing. */
static void check_rejections(gradacc_accumulator_t *acc, gradacc_scaler_t *s, const uint8_t *win, size_t wlen,
                             const uint8_t *sst, size_t slen)
{
    size_t acc_len, s_len;
    uint8_t *acc_before = save(save_window, acc, &acc_len);
    uint8_t *s_before = save(save_scaler, s, &s_len);
    uint8_t *w = malloc(wlen), *c = malloc(slen);
    /* a format version no release wrote (a flip to an older one that still loads, 6 to 4, is caught
     * by the checksum instead) */
    memcpy(w, win, wlen);
    w[4] ^= 0x08;
    EXPECT_STATUS(gradacc_accumulator_load_window(acc, w, wlen), GRADACC_STATUS_CORRUPT_STATE);
    CHECK(strstr(gradacc_last_error(), "version") != NULL, "the message names the version");
    memcpy(c, sst, slen);
    c[4] ^= 0x02;
    EXPECT_STATUS(gradacc_scaler_load(s, c, slen), GRADACC_STATUS_CORRUPT_STATE);
    CHECK(strstr(gradacc_last_error(), "version") != NULL, "the message names the version");
    /* a flipped bit anywhere */
    for (size_t i = 0; i < wlen; i += 7) {
        memcpy(w, win, wlen);
        w[i] ^= (uint8_t)(1u << (i % 8));
        EXPECT_STATUS(gradacc_accumulator_load_window(acc, w, wlen), GRADACC_STATUS_CORRUPT_STATE);
    }
    for (size_t i = 0; i < slen; i++) {
        memcpy(c, sst, slen);
        c[i] ^= (uint8_t)(1u << (i % 8));
        EXPECT_STATUS(gradacc_scaler_load(s, c, slen), GRADACC_STATUS_CORRUPT_STATE);
    }
    /* truncated, empty, and the other object's state */
    EXPECT_STATUS(gradacc_accumulator_load_window(acc, win, wlen - 1), GRADACC_STATUS_CORRUPT_STATE);
    EXPECT_STATUS(gradacc_accumulator_load_window(acc, win, 0), GRADACC_STATUS_CORRUPT_STATE);
    EXPECT_STATUS(gradacc_scaler_load(s, sst, slen / 2), GRADACC_STATUS_CORRUPT_STATE);
    EXPECT_STATUS(gradacc_accumulator_load_window(acc, sst, slen), GRADACC_STATUS_CORRUPT_STATE);
    EXPECT_STATUS(gradacc_scaler_load(s, win, wlen), GRADACC_STATUS_CORRUPT_STATE);
    /* another layout */
    gradacc_tensor_desc_t other[2] = {{N0 + N1, GRADACC_DTYPE_F16}, {N2, GRADACC_DTYPE_F32}};
    gradacc_accumulator_config_t ac;
    REQUIRE_OK(gradacc_accumulator_config_default(&ac));
    ac.bucket_numel = 8;
    gradacc_accumulator_t *o = NULL;
    REQUIRE_OK(gradacc_accumulator_create(&ac, other, 2, NULL, &o));
    EXPECT_STATUS(gradacc_accumulator_load_window(o, win, wlen), GRADACC_STATUS_SIZE_MISMATCH);
    REQUIRE_OK(gradacc_accumulator_destroy(o));
    free(w);
    free(c);
    check_unchanged(save_window, acc, acc_before, acc_len, "the window");
    check_unchanged(save_scaler, s, s_before, s_len, "the scaler");
    free(acc_before);
    free(s_before);
}

/* The run; with stop_step >= 0 it is interrupted after `stop_micro` micro-batches of that step. */
static void run(step_result *out, int stop_step, int stop_micro)
{
    gradacc_scaler_t *s = new_scaler();
    gradacc_accumulator_t *acc = new_acc();
    for (int t = 0; t < STEPS; t++) {
        for (int m = 0; m < MICRO; m++) {
            if (t == stop_step && m == stop_micro && m == 0 && t > 0) {
                /* between steps the window is synced and has nothing to save (documented): a
                 * checkpoint there is the scaler's state and a fresh accumulator */
                size_t wlen, slen;
                EXPECT_STATUS(gradacc_accumulator_save_window(acc, NULL, 0, &wlen), GRADACC_STATUS_WRONG_STATE);
                uint8_t *sst = save(save_scaler, s, &slen);
                REQUIRE_OK(gradacc_accumulator_destroy(acc));
                REQUIRE_OK(gradacc_scaler_destroy(s));
                REQUIRE_OK(gradacc_scaler_create(NULL, NULL, &s));
                acc = new_acc();
                REQUIRE_OK(gradacc_scaler_load(s, sst, slen));
                free(sst);
            } else if (t == stop_step && m == stop_micro) {
                size_t wlen, slen;
                uint8_t *win = save(save_window, acc, &wlen);
                uint8_t *sst = save(save_scaler, s, &slen);
                check_rejections(acc, s, win, wlen, sst, slen);
                REQUIRE_OK(gradacc_accumulator_destroy(acc));
                REQUIRE_OK(gradacc_scaler_destroy(s));
                /* fresh objects, the scaler with another config: the loaded state brings its own */
                REQUIRE_OK(gradacc_scaler_create(NULL, NULL, &s));
                acc = new_acc();
                /* a few refusals on the fresh objects, too */
                check_rejections(acc, s, win, wlen, sst, slen);
                REQUIRE_OK(gradacc_scaler_load(s, sst, slen));
                REQUIRE_OK(gradacc_accumulator_load_window(acc, win, wlen));
                free(win);
                free(sst);
            }
            add_micro(acc, s, t, m);
        }
        finish_step(acc, s, &out[t]);
    }
    REQUIRE_OK(gradacc_accumulator_destroy(acc));
    REQUIRE_OK(gradacc_scaler_destroy(s));
}

int main(void)
{
    step_result ref[STEPS], got[STEPS];
    run(ref, -1, -1);
    int overflows = 0, growths = (int)ref[STEPS - 1].stats.growths;
    for (int t = 0; t < STEPS; t++)
        overflows += ref[t].info.found_inf;
    printf("reference: %d steps, %d overflowed, %d growths, final scale %g\n", STEPS, overflows, growths, ref[STEPS - 1].scale);
    CHECK(overflows >= 2 && growths >= 1, "the run has overflow steps and growth (%d, %d)", overflows, growths);
    int runs = 0;
    for (int t = 0; t < STEPS; t++) {
        for (int m = 0; m < MICRO; m++) {
            memset(got, 0xa5, sizeof got);
            run(got, t, m);
            runs++;
            for (int u = 0; u < STEPS; u++) {
                CHECK(memcmp(got[u].master, ref[u].master, sizeof ref[u].master) == 0,
                      "interrupted at step %d after %d micro-batches: step %d masters differ", t, m, u);
                CHECK(got[u].info.found_inf == ref[u].info.found_inf && got[u].info.total_count == ref[u].info.total_count &&
                          got[u].info.microbatches == ref[u].info.microbatches &&
                          memcmp(&got[u].info.grad_norm, &ref[u].info.grad_norm, sizeof(double)) == 0 &&
                          memcmp(&got[u].info.clip_coef, &ref[u].info.clip_coef, sizeof(double)) == 0,
                      "interrupted at step %d after %d: step %d sync info differs", t, m, u);
                CHECK(memcmp(&got[u].scale, &ref[u].scale, sizeof(float)) == 0 && got[u].skipped == ref[u].skipped &&
                          memcmp(&got[u].stats, &ref[u].stats, sizeof ref[u].stats) == 0,
                      "interrupted at step %d after %d: step %d scale %g vs %g, or skip or statistics differ", t, m, u,
                      got[u].scale, ref[u].scale);
            }
        }
    }
    printf("%d interrupted runs, each bitwise identical to the uninterrupted one\n", runs);
    return test_finish();
}
