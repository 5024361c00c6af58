/* The dynamic loss scaler, driven the way a training loop drives it: each step adds a window to an
 * accumulator (finite, or holding an fp16 inf), syncs it, and ends the step with
 * gradacc_scaler_update. Scale traces are compared with reference models of PyTorch's GradScaler
 * (hysteresis 1), Megatron-Core's DynamicGradScaler (hysteresis > 1) and DeepSpeed's
 * consecutive_hysteresis, written here from those projects' update rules. */
#include "common.h"

/* ---- reference model ------------------------------------------------------------------------ */

typedef struct {
    float scale, growth, backoff, min_scale, max_scale;
    unsigned interval, hysteresis;
    int consecutive, dynamic;
    unsigned growth_tracker;
    int hyst_tracker;
    unsigned long long steps, skipped, growths, backoffs;
} ref_scaler;

static ref_scaler ref_new(const gradacc_scaler_config_t *c)
{
    ref_scaler r;
    memset(&r, 0, sizeof r);
    r.scale = c->init_scale;
    r.growth = c->growth_factor;
    r.backoff = c->backoff_factor;
    r.min_scale = c->min_scale;
    r.max_scale = c->max_scale;
    r.interval = c->growth_interval;
    r.hysteresis = c->hysteresis;
    r.consecutive = c->consecutive_hysteresis;
    r.dynamic = c->dynamic;
    r.hyst_tracker = (int)c->hysteresis;
    return r;
}

/* One optimizer step. Returns GRADACC_STATUS_SCALE_AT_MINIMUM (state untouched) when an overflow
 * needs a backoff with the scale already at min_scale, as gradacc documents; otherwise OK.
 *
 * PyTorch (torch/amp/grad_scaler.py, _amp_update_scale_): on inf, scale *= backoff and the growth
 * tracker resets; otherwise the tracker counts up, and on reaching growth_interval the scale grows
 * if the grown value is finite, and the tracker resets.
 * Megatron-Core (DynamicGradScaler.update): on inf the growth tracker resets and the hysteresis
 * tracker is decremented; the scale backs off (clamped at min_scale) once it is <= 0. A growth
 * refills the hysteresis tracker. DeepSpeed's consecutive_hysteresis also refills it after every
 * finite step. With hysteresis 1 the two rules coincide. */
static gradacc_status_t ref_step(ref_scaler *r, int found_inf)
{
    if (!r->dynamic) {
        r->steps++;
        r->skipped += found_inf ? 1 : 0;
        return GRADACC_STATUS_OK;
    }
    if (found_inf) {
        int h = r->hyst_tracker - 1;
        if (h <= 0) {
            if (r->scale <= r->min_scale)
                return GRADACC_STATUS_SCALE_AT_MINIMUM;
            float s = r->scale * r->backoff;
            r->scale = s > r->min_scale ? s : r->min_scale;
            r->backoffs++;
            h = 0;
        }
        r->hyst_tracker = h;
        r->growth_tracker = 0;
        r->steps++;
        r->skipped++;
        return GRADACC_STATUS_OK;
    }
    r->steps++;
    if (r->consecutive)
        r->hyst_tracker = (int)r->hysteresis;
    if (++r->growth_tracker == r->interval) {
        r->growth_tracker = 0;
        r->hyst_tracker = (int)r->hysteresis;
        float g = r->scale * r->growth;
        if (g > r->max_scale)
            g = r->max_scale;
        if (isfinite(g) && g > r->scale) {
            r->scale = g;
            r->growths++;
        }
    }
    return GRADACC_STATUS_OK;
}

/* ---- driving the library -------------------------------------------------------------------- */

/* One step through an accumulator over one fp16 tensor of 3 elements. */
static gradacc_status_t lib_step(gradacc_scaler_t *s, gradacc_accumulator_t *acc, int overflow, bool *skipped)
{
    uint16_t g[3] = {0x3c00, 0xbc00, 0x4000}; /* 1, -1, 2 */
    if (overflow)
        g[1] = 0x7c00;
    const void *grads[1] = {g};
    REQUIRE_OK(gradacc_accumulator_add(acc, s, grads, 1, 1));
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    REQUIRE_OK(gradacc_accumulator_sync(acc, NULL, &info));
    CHECK(info.found_inf == (overflow != 0), "sync's found_inf %d, window overflowed %d", info.found_inf, overflow);
    const gradacc_accumulator_t *accs[1] = {acc};
    return gradacc_scaler_update(s, accs, 1, skipped);
}

static gradacc_accumulator_t *new_acc(void)
{
    gradacc_tensor_desc_t t = {3, GRADACC_DTYPE_F16};
    gradacc_accumulator_t *acc = NULL;
    REQUIRE_OK(gradacc_accumulator_create(NULL, &t, 1, NULL, &acc));
    return acc;
}

static float get_scale(const gradacc_scaler_t *s)
{
    float v = -1.0f;
    REQUIRE_OK(gradacc_scaler_scale(s, &v));
    return v;
}

static gradacc_scaler_stats_t get_stats(const gradacc_scaler_t *s)
{
    gradacc_scaler_stats_t st = GRADACC_SCALER_STATS_INIT;
    memset(&st, 0xab, sizeof st);
    st.struct_size = sizeof st;
    REQUIRE_OK(gradacc_scaler_stats(s, &st));
    return st;
}

/* Runs `n` flags through both the library and the reference; returns the number of mismatches. */
static int compare_run(const char *what, gradacc_scaler_t *s, gradacc_accumulator_t *acc, ref_scaler *ref,
                       const int *flags, size_t n)
{
    int bad = 0;
    for (size_t i = 0; i < n && bad < 5; i++) {
        bool skipped = !flags[i];
        gradacc_status_t want = ref_step(ref, flags[i]);
        gradacc_status_t got = lib_step(s, acc, flags[i], &skipped);
        float scale = get_scale(s);
        gradacc_scaler_stats_t st = get_stats(s);
        int ok = got == want && scale == ref->scale && st.steps == ref->steps && st.skipped_steps == ref->skipped &&
                 st.growths == ref->growths && st.backoffs == ref->backoffs &&
                 (got != GRADACC_STATUS_OK || skipped == (flags[i] != 0));
        CHECK(ok,
              "%s step %zu (flag %d): status %d want %d, scale %.9g want %.9g, steps %llu/%llu skipped %llu/%llu "
              "growths %llu/%llu backoffs %llu/%llu, skipped %d",
              what, i, flags[i], got, want, scale, ref->scale, (unsigned long long)st.steps, ref->steps,
              (unsigned long long)st.skipped_steps, ref->skipped, (unsigned long long)st.growths, ref->growths,
              (unsigned long long)st.backoffs, ref->backoffs, skipped);
        bad += !ok;
    }
    return bad;
}

static gradacc_scaler_config_t default_config(void)
{
    gradacc_scaler_config_t c;
    REQUIRE_OK(gradacc_scaler_config_default(&c));
    return c;
}

/* ---- tests ---------------------------------------------------------------------------------- */

static void test_defaults(void)
{
    gradacc_scaler_config_t c = default_config();
    CHECK(c.struct_size == sizeof(gradacc_scaler_config_t), "struct_size %zu", c.struct_size);
    CHECK(c.init_scale == 65536.0f && c.growth_factor == 2.0f && c.backoff_factor == 0.5f && c.growth_interval == 2000 &&
              c.hysteresis == 1 && !c.consecutive_hysteresis && c.dynamic && c.min_scale == 1.0f && isinf(c.max_scale),
          "defaults differ from the documented ones");
}

/* The trace from the PyTorch GradScaler semantics, through accumulators. */
static void test_fixed_trace(void)
{
    static const int flags[11] = {0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 0};
    static const float want[11] = {65536, 65536, 131072, 65536, 65536, 65536, 131072, 131072, 65536, 32768, 32768};
    gradacc_scaler_config_t c = default_config();
    c.growth_interval = 3;
    gradacc_scaler_t *s = NULL;
    REQUIRE_OK(gradacc_scaler_create(&c, NULL, &s));
    gradacc_accumulator_t *acc = new_acc();
    for (int i = 0; i < 11; i++) {
        bool skipped = !flags[i];
        EXPECT_OK(lib_step(s, acc, flags[i], &skipped));
        CHECK(skipped == (flags[i] != 0), "step %d: skipped %d", i, skipped);
        float got = get_scale(s);
        CHECK(got == want[i], "step %d: scale %g, expected %g", i, got, want[i]);
    }
    gradacc_scaler_stats_t st = get_stats(s);
    CHECK(st.steps == 11 && st.skipped_steps == 3 && st.growths == 2 && st.backoffs == 3,
          "stats steps %llu skipped %llu growths %llu backoffs %llu", (unsigned long long)st.steps,
          (unsigned long long)st.skipped_steps, (unsigned long long)st.growths, (unsigned long long)st.backoffs);
    gradacc_accumulator_destroy(acc);
    gradacc_scaler_destroy(s);
}

/* Random sequences and configurations against the reference models. */
static void test_random(test_rng *rng)
{
    enum { STEPS = 300 };
    int flags[STEPS];
    static const struct {
        const char *name;
        unsigned hysteresis;
        int consecutive;
    } kinds[] = {
        {"pytorch (hysteresis 1)", 1, 0},
        {"megatron (hysteresis 2)", 2, 0},
        {"megatron (hysteresis 3)", 3, 0},
        {"deepspeed (hysteresis 2, consecutive)", 2, 1},
        {"deepspeed (hysteresis 4, consecutive)", 4, 1},
    };
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        for (int trial = 0; trial < 4; trial++) {
            gradacc_scaler_config_t c = default_config();
            c.hysteresis = kinds[k].hysteresis;
            c.consecutive_hysteresis = kinds[k].consecutive;
            c.growth_interval = 1 + rng_below(rng, 6);
            c.init_scale = (float)ldexp(1.0, 4 + (int)rng_below(rng, 20));
            if (trial == 3) { /* non-power-of-two factors: the rounding must follow f32 arithmetic */
                c.growth_factor = 1.5f;
                c.backoff_factor = 0.3f;
                c.min_scale = 0.75f;
            }
            if (trial >= 2)
                c.max_scale = c.init_scale * 8.0f;
            double p = rng_range(rng, 0.05, 0.6);
            for (int i = 0; i < STEPS; i++)
                flags[i] = rng_unit(rng) < p;
            /* long finite runs test growth, long overflow runs test min_scale */
            int at = (int)rng_below(rng, STEPS - 40);
            int burst = rng_unit(rng) < 0.5;
            for (int i = at; i < at + 40; i++)
                flags[i] = burst;
            gradacc_scaler_t *s = NULL;
            REQUIRE_OK(gradacc_scaler_create(&c, NULL, &s));
            gradacc_accumulator_t *acc = new_acc();
            ref_scaler ref = ref_new(&c);
            char what[128];
            snprintf(what, sizeof what, "%s, interval %u, init %g, trial %d", kinds[k].name, c.growth_interval,
                     c.init_scale, trial);
            compare_run(what, s, acc, &ref, flags, STEPS);
            gradacc_accumulator_destroy(acc);
            gradacc_scaler_destroy(s);
        }
    }
}

/* Megatron's hysteresis 2, by hand: the first overflow is tolerated, the second backs off, and a
 * third right after backs off again (the tracker is not refilled by a backoff). */
static void test_hysteresis_by_hand(void)
{
    gradacc_scaler_config_t c = default_config();
    c.hysteresis = 2;
    c.growth_interval = 2;
    c.init_scale = 1024;
    gradacc_scaler_t *s = NULL;
    REQUIRE_OK(gradacc_scaler_create(&c, NULL, &s));
    gradacc_accumulator_t *acc = new_acc();
    static const int flags[] = {1, 1, 1, 0, 0, 1, 0, 1, 1};
    static const float want[] = {1024, 512, 256, 256, 512, 512, 512, 256, 128};
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++) {
        bool skipped = false;
        EXPECT_OK(lib_step(s, acc, flags[i], &skipped));
        CHECK(skipped == (flags[i] != 0), "step %zu skipped %d", i, skipped);
        CHECK(get_scale(s) == want[i], "step %zu: scale %g, expected %g", i, get_scale(s), want[i]);
    }
    gradacc_accumulator_destroy(acc);
    gradacc_scaler_destroy(s);

    /* consecutive: a finite step between two overflows refills the tracker, so neither backs off */
    c.consecutive_hysteresis = true;
    c.growth_interval = 100;
    REQUIRE_OK(gradacc_scaler_create(&c, NULL, &s));
    acc = new_acc();
    static const int flags2[] = {1, 0, 1, 0, 1, 1};
    static const float want2[] = {1024, 1024, 1024, 1024, 1024, 512};
    for (size_t i = 0; i < sizeof flags2 / sizeof flags2[0]; i++) {
        bool skipped = false;
        EXPECT_OK(lib_step(s, acc, flags2[i], &skipped));
        CHECK(skipped == (flags2[i] != 0), "consecutive step %zu skipped %d", i, skipped);
        CHECK(get_scale(s) == want2[i], "consecutive step %zu: scale %g, expected %g", i, get_scale(s), want2[i]);
    }
    gradacc_accumulator_destroy(acc);
    gradacc_scaler_destroy(s);
}

static void test_min_max(void)
{
    /* min_scale: 8 -> 4 -> 3 (clamped) -> SCALE_AT_MINIMUM, nothing changed */
    gradacc_scaler_config_t c = default_config();
    c.init_scale = 8;
    c.min_scale = 3;
    gradacc_scaler_t *s = NULL;
    REQUIRE_OK(gradacc_scaler_create(&c, NULL, &s));
    gradacc_accumulator_t *acc = new_acc();
    bool skipped = false;
    EXPECT_OK(lib_step(s, acc, 1, &skipped));
    CHECK(skipped && get_scale(s) == 4.0f, "scale %g", get_scale(s));
    EXPECT_OK(lib_step(s, acc, 1, &skipped));
    CHECK(skipped && get_scale(s) == 3.0f, "clamped backoff: scale %g, expected 3", get_scale(s));
    gradacc_scaler_stats_t before = get_stats(s);
    skipped = false;
    EXPECT_ERROR(lib_step(s, acc, 1, &skipped), GRADACC_STATUS_SCALE_AT_MINIMUM, "min_scale");
    CHECK(!skipped, "out_skipped written on failure");
    gradacc_scaler_stats_t after = get_stats(s);
    CHECK(get_scale(s) == 3.0f, "scale moved to %g on SCALE_AT_MINIMUM", get_scale(s));
    CHECK(memcmp(&before, &after, sizeof before) == 0, "stats changed on SCALE_AT_MINIMUM");
    /* a finite step still works afterwards */
    EXPECT_OK(lib_step(s, acc, 0, &skipped));
    CHECK(!skipped && get_stats(s).steps == before.steps + 1, "finite step after SCALE_AT_MINIMUM");
    gradacc_accumulator_destroy(acc);
    gradacc_scaler_destroy(s);

    /* max_scale clamps growth: 100 -> 200 -> 250 -> 250 */
    c = default_config();
    c.init_scale = 100;
    c.max_scale = 250;
    c.growth_interval = 1;
    REQUIRE_OK(gradacc_scaler_create(&c, NULL, &s));
    acc = new_acc();
    static const float want[] = {200, 250, 250, 250};
    for (int i = 0; i < 4; i++) {
        EXPECT_OK(lib_step(s, acc, 0, &skipped));
        CHECK(get_scale(s) == want[i], "max_scale step %d: scale %g, expected %g", i, get_scale(s), want[i]);
    }
    CHECK(get_stats(s).growths == 2, "growths %llu, expected 2 (no growth counted at the cap)",
          (unsigned long long)get_stats(s).growths);
    gradacc_accumulator_destroy(acc);
    gradacc_scaler_destroy(s);

    /* As PyTorch: never grow into infinity (max_scale left at +inf) */
    c = default_config();
    c.init_scale = (float)ldexp(1.0, 127);
    c.growth_interval = 1;
    REQUIRE_OK(gradacc_scaler_create(&c, NULL, &s));
    acc = new_acc();
    EXPECT_OK(lib_step(s, acc, 0, &skipped));
    CHECK(get_scale(s) == (float)ldexp(1.0, 127), "scale grew to %g", get_scale(s));
    gradacc_accumulator_destroy(acc);
    gradacc_scaler_destroy(s);
}

static void test_fixed_scale(void)
{
    gradacc_scaler_config_t c = default_config();
    c.dynamic = false;
    c.init_scale = 512;
    c.growth_interval = 1;
    gradacc_scaler_t *s = NULL;
    REQUIRE_OK(gradacc_scaler_create(&c, NULL, &s));
    gradacc_accumulator_t *acc = new_acc();
    static const int flags[] = {0, 0, 1, 1, 1, 0, 1};
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++) {
        bool skipped = !flags[i];
        EXPECT_OK(lib_step(s, acc, flags[i], &skipped));
        CHECK(skipped == (flags[i] != 0), "fixed scale: step %zu still reports skipped = %d", i, skipped);
        CHECK(get_scale(s) == 512.0f, "fixed scale moved to %g", get_scale(s));
    }
    gradacc_scaler_stats_t st = get_stats(s);
    CHECK(st.steps == 7 && st.skipped_steps == 4 && st.growths == 0 && st.backoffs == 0, "fixed-scale stats");
    gradacc_accumulator_destroy(acc);
    gradacc_scaler_destroy(s);
}

static size_t save(const gradacc_scaler_t *s, unsigned char *buf, size_t cap)
{
    size_t need = 0, len = 0;
    REQUIRE_OK(gradacc_scaler_save(s, NULL, 0, &need));
    CHECK(need > 0 && need <= cap, "state size %zu", need);
    REQUIRE_OK(gradacc_scaler_save(s, buf, cap, &len));
    CHECK(len == need, "wrote %zu bytes, size query said %zu", len, need);
    return len;
}

static void test_save_load(test_rng *rng)
{
    enum { PREFIX = 37, FUTURE = 120 };
    gradacc_scaler_config_t c = default_config();
    c.hysteresis = 2;
    c.growth_interval = 4;
    c.init_scale = 4096;
    c.min_scale = 2;
    gradacc_scaler_t *a = NULL, *b = NULL;
    REQUIRE_OK(gradacc_scaler_create(&c, NULL, &a));
    REQUIRE_OK(gradacc_scaler_create(NULL, NULL, &b)); /* a fresh scaler with other settings */
    gradacc_accumulator_t *acc_a = new_acc(), *acc_b = new_acc();
    bool skipped;
    for (int i = 0; i < PREFIX; i++) {
        gradacc_status_t st = lib_step(a, acc_a, rng_unit(rng) < 0.3, &skipped);
        CHECK(st == GRADACC_STATUS_OK || st == GRADACC_STATUS_SCALE_AT_MINIMUM, "prefix step status %d", st);
    }
    unsigned char bytes[4096];
    size_t len = save(a, bytes, sizeof bytes);

    /* too small a buffer: SIZE_MISMATCH, length output untouched */
    size_t sentinel = 12345;
    EXPECT_STATUS(gradacc_scaler_save(a, bytes, len - 1, &sentinel), GRADACC_STATUS_SIZE_MISMATCH);
    CHECK(sentinel == 12345, "out_len written on failure");

    EXPECT_OK(gradacc_scaler_load(b, bytes, len));
    CHECK(get_scale(a) == get_scale(b), "loaded scale %g, saved %g", get_scale(b), get_scale(a));
    gradacc_scaler_stats_t sa = get_stats(a), sb = get_stats(b);
    CHECK(memcmp(&sa, &sb, sizeof sa) == 0, "loaded stats differ");
    unsigned char again[4096];
    size_t len2 = save(b, again, sizeof again);
    CHECK(len2 == len && memcmp(again, bytes, len) == 0, "save(load(x)) != x");

    /* identical futures */
    for (int i = 0; i < FUTURE; i++) {
        int f = rng_unit(rng) < 0.35;
        bool ka = false, kb = false;
        gradacc_status_t st_a = lib_step(a, acc_a, f, &ka);
        gradacc_status_t st_b = lib_step(b, acc_b, f, &kb);
        CHECK(st_a == st_b && ka == kb && get_scale(a) == get_scale(b),
              "future step %d: status %d/%d skipped %d/%d scale %g/%g", i, st_a, st_b, ka, kb, get_scale(a),
              get_scale(b));
    }
    sa = get_stats(a);
    sb = get_stats(b);
    CHECK(memcmp(&sa, &sb, sizeof sa) == 0, "stats differ after identical futures");

    /* corruption: every byte flipped, every truncation, one extra byte: CORRUPT_STATE, b unchanged */
    len = save(b, bytes, sizeof bytes);
    float scale_before = get_scale(b);
    gradacc_scaler_stats_t stats_before = get_stats(b);
    int accepted = 0;
    for (size_t i = 0; i < len; i++) {
        for (int pattern = 0; pattern < 2; pattern++) {
            unsigned char bad[4096];
            memcpy(bad, bytes, len);
            bad[i] ^= pattern ? 0xff : (unsigned char)(1u << (i % 8));
            gradacc_status_t st = gradacc_scaler_load(b, bad, len);
            if (st != GRADACC_STATUS_CORRUPT_STATE) {
                accepted++;
                CHECK(st == GRADACC_STATUS_CORRUPT_STATE, "byte %zu ^ %s: status %d", i, pattern ? "0xff" : "one bit", st);
            }
        }
    }
    CHECK(accepted == 0, "%d corrupted states were not rejected", accepted);
    for (size_t cut = 0; cut < len; cut++)
        EXPECT_STATUS(gradacc_scaler_load(b, bytes, cut), GRADACC_STATUS_CORRUPT_STATE);
    {
        unsigned char longer[4097];
        memcpy(longer, bytes, len);
        longer[len] = 0;
        EXPECT_STATUS(gradacc_scaler_load(b, longer, len + 1), GRADACC_STATUS_CORRUPT_STATE);
    }
    /* another object's state (an accumulator window) is foreign */
    {
        unsigned char win[4096];
        size_t wlen = 0;
        REQUIRE_OK(gradacc_accumulator_reset(acc_b));
        const uint16_t g[3] = {0x3c00, 0x3c00, 0x3c00};
        const void *grads[1] = {g};
        REQUIRE_OK(gradacc_accumulator_add(acc_b, b, grads, 1, 1));
        REQUIRE_OK(gradacc_accumulator_save_window(acc_b, win, sizeof win, &wlen));
        EXPECT_STATUS(gradacc_scaler_load(b, win, wlen), GRADACC_STATUS_CORRUPT_STATE);
    }
    CHECK(get_scale(b) == scale_before, "scale changed by rejected loads");
    gradacc_scaler_stats_t stats_after = get_stats(b);
    CHECK(memcmp(&stats_before, &stats_after, sizeof stats_before) == 0, "stats changed by rejected loads");
    size_t len3 = save(b, again, sizeof again);
    CHECK(len3 == len && memcmp(again, bytes, len) == 0, "state changed by rejected loads");

    gradacc_accumulator_destroy(acc_a);
    gradacc_accumulator_destroy(acc_b);
    gradacc_scaler_destroy(a);
    gradacc_scaler_destroy(b);
}

static void test_scale_loss(test_rng *rng)
{
    /* Scale 1000: an f16 (11 significant bits) or bf16 (8) value times 1000 (10 bits) is exact in
     * f32, so one rounding to the 16-bit format is the only rounding, as in the f64 reference. */
    gradacc_scaler_config_t c = default_config();
    c.init_scale = 1000;
    gradacc_scaler_t *s = NULL;
    REQUIRE_OK(gradacc_scaler_create(&c, NULL, &s));
    enum { N = 257 };
    float f[N];
    uint16_t h[N], b[N], h0[N], b0[N];
    for (int i = 0; i < N; i++) {
        double v = rng_range(rng, -1, 1) * ldexp(1.0, (int)rng_below(rng, 40) - 30);
        if (i == 0)
            v = 70.0; /* 70000 overflows fp16: inf, as a real fp16 loss would */
        if (i == 1)
            v = ldexp(1.0, -30); /* scaled into the fp16 subnormals */
        f[i] = (float)v;
        h0[i] = h[i] = f32_to_f16_bits((float)v);
        b0[i] = b[i] = f32_to_bf16_bits((float)v);
    }
    float f0[N];
    memcpy(f0, f, sizeof f);
    EXPECT_OK(gradacc_scaler_scale_loss(s, f, N, GRADACC_DTYPE_F32));
    EXPECT_OK(gradacc_scaler_scale_loss(s, h, N, GRADACC_DTYPE_F16));
    EXPECT_OK(gradacc_scaler_scale_loss(s, b, N, GRADACC_DTYPE_BF16));
    int bad = 0;
    for (int i = 0; i < N && bad < 5; i++) {
        float wf = (float)((double)f0[i] * 1000.0);
        uint16_t wh = f32_to_f16_bits((float)((double)f16_bits_to_f32(h0[i]) * 1000.0));
        uint16_t wb = f32_to_bf16_bits((float)((double)bf16_bits_to_f32(b0[i]) * 1000.0));
        int ok = f[i] == wf && h[i] == wh && b[i] == wb;
        CHECK(ok, "element %d: f32 %.9g want %.9g, f16 %#06x want %#06x, bf16 %#06x want %#06x", i, f[i], wf, h[i], wh,
              b[i], wb);
        bad += !ok;
    }
    CHECK(h[0] == 0x7c00, "fp16 70 * 1000 should be +inf, got %#06x", h[0]);
    /* NaN stays NaN */
    float fn = NAN;
    uint16_t hn = 0x7e00, bn = 0x7fc0;
    EXPECT_OK(gradacc_scaler_scale_loss(s, &fn, 1, GRADACC_DTYPE_F32));
    EXPECT_OK(gradacc_scaler_scale_loss(s, &hn, 1, GRADACC_DTYPE_F16));
    EXPECT_OK(gradacc_scaler_scale_loss(s, &bn, 1, GRADACC_DTYPE_BF16));
    CHECK(isnan(fn) && (hn & 0x7c00) == 0x7c00 && (hn & 0x3ff) && (bn & 0x7f80) == 0x7f80 && (bn & 0x7f),
          "NaN not preserved: %g %#06x %#06x", fn, hn, bn);
    /* the scale used is the current one */
    gradacc_accumulator_t *acc = new_acc();
    bool skipped;
    EXPECT_OK(lib_step(s, acc, 1, &skipped)); /* 1000 -> 500 */
    float one = 1.0f;
    EXPECT_OK(gradacc_scaler_scale_loss(s, &one, 1, GRADACC_DTYPE_F32));
    CHECK(one == 500.0f, "scale_loss after a backoff gave %g, expected 500", one);
    gradacc_accumulator_destroy(acc);
    gradacc_scaler_destroy(s);
}

int main(void)
{
    test_rng rng = rng_fresh("api_scaler");
    test_defaults();
    test_fixed_trace();
    test_hysteresis_by_hand();
    test_random(&rng);
    test_min_max();
    test_fixed_scale();
    test_save_load(&rng);
    test_scale_loss(&rng);
    return test_finish();
}
