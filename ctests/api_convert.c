/* The array conversions gradacc_f32_to_f16, gradacc_f16_to_f32, gradacc_f32_to_bf16 and
 * gradacc_bf16_to_f32 against the converters of common.h, written independently of the library
 * in f64 arithmetic: every 16-bit pattern widened; f32 values rounded (each pattern's value and
 * its midpoint to the next with their f32 neighbours, random bit patterns, NaNs with payloads);
 * odd lengths at every source and destination element offset up to 7, each on its own, so the
 * vector loops' heads and tails all run, with the elements around the output untouched; and the refused arguments, each named in the message,
 * with the output untouched. */
#include "common.h"

static void *xmalloc(size_t bytes)
{
    void *p = malloc(bytes);
    if (!p) {
        fprintf(stderr, "out of memory (%zu bytes)\n", bytes);
        exit(1);
    }
    return p;
}

static uint32_t bits_of(float f)
{
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

static float float_of(uint32_t b)
{
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

static int is_nan16(uint16_t h, int bf16)
{
    return bf16 ? (h & 0x7fff) > 0x7f80 : (h & 0x7fff) > 0x7c00;
}

/* The widening's expected bits: the exact value, or for a NaN its sign and payload (f16: quieted,
 * as F16C does; bf16: as it is). */
static uint32_t widened(uint16_t h, int bf16)
{
    if (is_nan16(h, bf16)) {
        uint32_t sign = (uint32_t)(h & 0x8000) << 16;
        return bf16 ? (uint32_t)h << 16 : sign | 0x7fc00000u | (uint32_t)(h & 0x3ff) << 13;
    }
    return bits_of(bf16 ? bf16_bits_to_f32(h) : f16_bits_to_f32(h));
}

/* The rounding's expected bits: common.h's encoder, or for a NaN its sign, the quiet bit and the
 * upper bits of its payload. */
static uint16_t rounded(float x, int bf16)
{
    uint32_t b = bits_of(x);
    if (isnan(x))
        return bf16 ? (uint16_t)((b >> 16) | 0x40) : (uint16_t)(((b >> 16) & 0x8000) | 0x7e00 | ((b & 0x7fffff) >> 13));
    return bf16 ? f32_to_bf16_bits(x) : f32_to_f16_bits(x);
}

static void check_widening(int bf16)
{
    const char *name = bf16 ? "bf16" : "f16";
    uint16_t *all = xmalloc(65536 * sizeof *all);
    float *out = xmalloc(65536 * sizeof *out);
    for (uint32_t b = 0; b < 65536; b++)
        all[b] = (uint16_t)b;
    EXPECT_OK(bf16 ? gradacc_bf16_to_f32(all, out, 65536) : gradacc_f16_to_f32(all, out, 65536));
    int bad = 0;
    for (uint32_t b = 0; b < 65536; b++) {
        uint32_t want = widened((uint16_t)b, bf16);
        if (bits_of(out[b]) != want && bad++ < 5)
            fprintf(stderr, "%s 0x%04x: got 0x%08x, want 0x%08x\n", name, b, bits_of(out[b]), want);
    }
    CHECK(bad == 0, "%s -> f32: %d of 65536 patterns differ", name, bad);
    free(out);
    free(all);
}

/* Each pattern's value and its midpoint to the next, with their f32 neighbours and both signs;
 * random bit patterns; random NaNs. Returns the count written to `v` (room for 13 * 65536 +
 * 2 * `random`). */
static size_t rounding_cases(float *v, int bf16, test_rng *rng, size_t random)
{
    size_t n = 0;
    uint16_t inf = bf16 ? 0x7f80 : 0x7c00;
    for (uint16_t p = 0; p < inf; p++) {
        double lo = bf16 ? bf16_bits_to_f32(p) : f16_bits_to_f32(p);
        double hi = p + 1 == inf ? (bf16 ? ldexp(1.0, 128) : 65536.0)
                                 : (bf16 ? bf16_bits_to_f32((uint16_t)(p + 1)) : f16_bits_to_f32((uint16_t)(p + 1)));
        float at[2] = {(float)lo, (float)((lo + hi) / 2.0)};
        for (int k = 0; k < 2; k++) {
            uint32_t b = bits_of(at[k]);
            uint32_t near[3] = {b, b + 1, b ? b - 1 : 0};
            for (int j = 0; j < 3; j++) {
                v[n++] = float_of(near[j]);
                v[n++] = float_of(near[j] | 0x80000000u);
            }
        }
    }
    for (size_t i = 0; i < random; i++) {
        uint64_t r = rng_u64(rng);
        v[n++] = float_of((uint32_t)r);
        v[n++] = float_of((uint32_t)(r >> 32) | 0x7f800000u); /* inf or a NaN with a payload */
    }
    return n;
}

static void check_rounding(int bf16, test_rng *rng)
{
    const char *name = bf16 ? "bf16" : "f16";
    size_t random = 1000000, room = 13 * 65536 + 2 * random;
    float *v = xmalloc(room * sizeof *v);
    size_t n = rounding_cases(v, bf16, rng, random);
    uint16_t *out = xmalloc(n * sizeof *out);
    EXPECT_OK(bf16 ? gradacc_f32_to_bf16(v, out, n) : gradacc_f32_to_f16(v, out, n));
    int bad = 0;
    for (size_t i = 0; i < n; i++) {
        uint16_t want = rounded(v[i], bf16);
        if (out[i] != want && bad++ < 5)
            fprintf(stderr, "%s of %a (0x%08x): got 0x%04x, want 0x%04x\n", name, (double)v[i], bits_of(v[i]),
                    out[i], want);
    }
    CHECK(bad == 0, "f32 -> %s: %d of %zu values differ", name, bad, n);
    free(out);
    free(v);
}

/* Every length up to 70 and a few long odd ones, at element offsets 0 to 7 of both arrays: the
 * results are the reference's and the 8 elements on each side of the output keep their value. */
static void check_lengths_and_offsets(test_rng *rng)
{
    enum { GUARD = 8, MAX = 4099 };
    float *f = xmalloc((MAX + 2 * GUARD) * sizeof *f);
    uint16_t *h = xmalloc((MAX + 2 * GUARD) * sizeof *h);
    float *back = xmalloc((MAX + 2 * GUARD) * sizeof *back);
    size_t lengths[75];
    size_t count = 0;
    for (size_t n = 1; n <= 70; n++)
        lengths[count++] = n;
    size_t longer[5] = {127, 129, 1001, 4095, MAX};
    for (size_t i = 0; i < 5; i++)
        lengths[count++] = longer[i];
    int bad = 0;
    for (int bf16 = 0; bf16 < 2; bf16++) {
        for (size_t li = 0; li < count; li++) {
            size_t n = lengths[li];
            for (size_t i = 0; i < MAX + 2 * GUARD; i++)
                f[i] = (float)rng_range(rng, -70000.0, 70000.0) * (float)ldexp(1.0, (int)(rng_u64(rng) % 40) - 30);
            /* Every source and destination offset within a vector's width, each on its own. */
            for (size_t so = 0; so < GUARD; so++) {
                for (size_t doff = 0; doff < GUARD; doff++) {
                    for (size_t i = 0; i < MAX + 2 * GUARD; i++) {
                        h[i] = 0xabcd;
                        back[i] = -7.0f;
                    }
                    const float *src = f + so;
                    uint16_t *dst = h + GUARD + doff;
                    EXPECT_OK(bf16 ? gradacc_f32_to_bf16(src, dst, n) : gradacc_f32_to_f16(src, dst, n));
                    EXPECT_OK(bf16 ? gradacc_bf16_to_f32(dst, back + GUARD + doff, n)
                                   : gradacc_f16_to_f32(dst, back + GUARD + doff, n));
                    for (size_t i = 0; i < n; i++) {
                        bad += dst[i] != rounded(src[i], bf16);
                        bad += bits_of(back[GUARD + doff + i]) != widened(dst[i], bf16);
                    }
                    for (size_t i = 0; i < MAX + 2 * GUARD; i++) {
                        int inside = i >= GUARD + doff && i < GUARD + doff + n;
                        bad += !inside && (h[i] != 0xabcd || back[i] != -7.0f);
                    }
                }
            }
        }
    }
    CHECK(bad == 0, "%d wrong or overwritten elements over %zu lengths and offsets", bad, count);
    free(back);
    free(h);
    free(f);
}

/* `status` and a message that names `argument`; the `bytes` at `out` as they were (`before`). */
static void check_refused(gradacc_status_t status, gradacc_status_t want, const char *argument,
                          const void *out, const void *before, size_t bytes, const char *what)
{
    CHECK(status == want, "%s: status %d, want %d", what, (int)status, (int)want);
    char quoted[32];
    snprintf(quoted, sizeof quoted, "`%s`", argument);
    CHECK(strstr(gradacc_last_error(), quoted) != NULL, "%s: the message names %s", what, quoted);
    CHECK(memcmp(out, before, bytes) == 0, "%s: the output was written", what);
}

static void check_bad_arguments(void)
{
    /* Sentinels that any conversion would change: 0x1111 is no f16 or bf16 of these floats, and
     * -7 is no widening of 0x1111. */
    float src[8] = {1, 2, 3, 4, 5, 6, 7, 8}, wide[8], wide0[8], both[8], both0[8];
    uint16_t dst[8], dst0[8];
    for (int i = 0; i < 8; i++) {
        dst[i] = 0x1111;
        wide[i] = -7.0f;
        both[i] = (float)(i + 1);
    }
    memcpy(dst0, dst, sizeof dst);
    memcpy(wide0, wide, sizeof wide);
    memcpy(both0, both, sizeof both);
    EXPECT_OK(gradacc_f32_to_f16(NULL, NULL, 0));
    EXPECT_OK(gradacc_f16_to_f32(NULL, NULL, 0));
    EXPECT_OK(gradacc_f32_to_bf16(NULL, dst, 0));
    EXPECT_OK(gradacc_bf16_to_f32(dst, NULL, 0));
    CHECK(memcmp(dst, dst0, sizeof dst) == 0, "n = 0 wrote into dst");
    check_refused(gradacc_f32_to_f16(NULL, dst, 4), GRADACC_STATUS_NULL_ARGUMENT, "src", dst, dst0, sizeof dst,
                  "NULL src");
    check_refused(gradacc_f32_to_bf16(src, NULL, 4), GRADACC_STATUS_NULL_ARGUMENT, "dst", dst, dst0, sizeof dst,
                  "NULL dst");
    check_refused(gradacc_f16_to_f32(NULL, wide, 1), GRADACC_STATUS_NULL_ARGUMENT, "src", wide, wide0,
                  sizeof wide, "NULL src, widening");
    check_refused(gradacc_bf16_to_f32(dst, NULL, 1), GRADACC_STATUS_NULL_ARGUMENT, "dst", dst, dst0, sizeof dst,
                  "NULL dst, widening");
    /* A pointer not aligned to its element, an impossible length, overlapping arrays. */
    const float *odd_src = (const float *)(const void *)((const char *)src + 1);
    check_refused(gradacc_f32_to_f16(odd_src, dst, 2), GRADACC_STATUS_INVALID_ARGUMENT, "src", dst, dst0,
                  sizeof dst, "misaligned src");
    uint16_t *odd_dst = (uint16_t *)(void *)((char *)wide + 1);
    check_refused(gradacc_f32_to_bf16(src, odd_dst, 2), GRADACC_STATUS_INVALID_ARGUMENT, "dst", wide, wide0,
                  sizeof wide, "misaligned dst");
    check_refused(gradacc_f32_to_f16(src, dst, SIZE_MAX / 2), GRADACC_STATUS_INVALID_ARGUMENT, "n", dst, dst0,
                  sizeof dst, "huge n");
    check_refused(gradacc_f32_to_f16(both, (uint16_t *)(void *)(both + 1), 4), GRADACC_STATUS_INVALID_ARGUMENT,
                  "dst", both, both0, sizeof both, "overlapping arrays");
}

int main(void)
{
    test_rng rng = rng_fresh("api_convert");
    check_widening(0);
    check_widening(1);
    check_rounding(0, &rng);
    check_rounding(1, &rng);
    check_lengths_and_offsets(&rng);
    check_bad_arguments();
    return test_finish();
}
