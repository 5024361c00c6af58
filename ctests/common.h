/* Helpers shared by the C tests: checks that print file:line and gradacc's last error, a seeded
 * PRNG that prints its seed, 16-bit float converters written independently of the library (so a
 * test can produce fp16/bf16 gradients and decode them exactly for its f64 reference), and a
 * helper that runs one function per rank on its own thread.
 *
 * Include this header first: it sets the POSIX feature level the tests use. */
#ifndef GRADACC_CTESTS_COMMON_H
#define GRADACC_CTESTS_COMMON_H

#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif

#include <gradacc.h>

#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ---------------------------------------------------------------------------------------------
 * Checks. Each failed check prints where it is and what went wrong, and counts; a test ends with
 * `return test_finish();`, which prints a summary and returns non-zero if any check failed.
 * The counter is atomic so checks may run on several threads.
 * ------------------------------------------------------------------------------------------- */

static volatile int test_failures = 0;
static volatile int test_checks = 0;

static inline void test_count(int ok)
{
    __sync_fetch_and_add(&test_checks, 1);
    if (!ok)
        __sync_fetch_and_add(&test_failures, 1);
}

/* CHECK(cond, printf-style message...) */
#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        int check_ok_ = (cond) ? 1 : 0;                                                            \
        test_count(check_ok_);                                                                     \
        if (!check_ok_) {                                                                          \
            fprintf(stderr, "%s:%d: FAILED: %s: ", __FILE__, __LINE__, #cond);                     \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n    last error: %s\n", gradacc_last_error());                      \
        }                                                                                          \
    } while (0)

/* EXPECT_STATUS(call, status): the call returns exactly `status`. */
#define EXPECT_STATUS(call, expected)                                                              \
    do {                                                                                           \
        gradacc_status_t got_st_ = (call);                                                         \
        gradacc_status_t want_st_ = (expected);                                                    \
        test_count(got_st_ == want_st_);                                                           \
        if (got_st_ != want_st_) {                                                                 \
            fprintf(stderr, "%s:%d: FAILED: %s\n    returned %d (%s)\n    expected %d (%s)\n",   \
                    __FILE__, __LINE__, #call, (int)got_st_, gradacc_status_string(got_st_),       \
                    (int)want_st_, gradacc_status_string(want_st_));                               \
            fprintf(stderr, "    last error: %s\n", gradacc_last_error());                         \
        }                                                                                          \
    } while (0)

#define EXPECT_OK(call) EXPECT_STATUS(call, GRADACC_STATUS_OK)

/* REQUIRE_OK(call): like EXPECT_OK, but a failure ends the test at once (the rest depends on it). */
#define REQUIRE_OK(call)                                                                           \
    do {                                                                                           \
        gradacc_status_t req_st_ = (call);                                                         \
        if (req_st_ != GRADACC_STATUS_OK) {                                                        \
            fprintf(stderr, "%s:%d: FATAL: %s\n    returned %d (%s)\n    last error: %s\n",     \
                    __FILE__, __LINE__, #call, (int)req_st_, gradacc_status_string(req_st_),       \
                    gradacc_last_error());                                                         \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

/* EXPECT_ERROR(call, status, text): the call fails with `status`, and the thread's last error
 * contains `text` (e.g. the argument's name in backquotes). */
#define EXPECT_ERROR(call, expected, text)                                                         \
    do {                                                                                           \
        EXPECT_STATUS(call, expected);                                                             \
        CHECK(strstr(gradacc_last_error(), (text)) != NULL, "last error should mention \"%s\"",  \
              (text));                                                                             \
    } while (0)

/* |got - want| <= tol, with both printed on failure. */
#define CHECK_CLOSE(got, want, tol, ...)                                                           \
    do {                                                                                           \
        double cg_ = (double)(got), cw_ = (double)(want), ct_ = (double)(tol);                     \
        int cc_ok_ = fabs(cg_ - cw_) <= ct_;                                                       \
        test_count(cc_ok_);                                                                        \
        if (!cc_ok_) {                                                                             \
            fprintf(stderr, "%s:%d: FAILED: %s = %.17g, expected %.17g (diff %.3g > tol %.3g): ",   \
                    __FILE__, __LINE__, #got, cg_, cw_, fabs(cg_ - cw_), ct_);                     \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n");                                                                 \
        }                                                                                          \
    } while (0)

static inline int test_finish(void)
{
    if (test_failures) {
        fprintf(stderr, "%d of %d checks FAILED\n", test_failures, test_checks);
        return 1;
    }
    printf("all %d checks passed\n", test_checks);
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * PRNG: splitmix64. Seeded from GRADACC_TEST_SEED if set (to replay a failure), otherwise from
 * the clock and the pid; the seed is printed either way.
 * ------------------------------------------------------------------------------------------- */

typedef struct {
    uint64_t state;
} test_rng;

static inline uint64_t rng_u64(test_rng *r)
{
    uint64_t z = (r->state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline test_rng rng_fresh(const char *what)
{
    test_rng r;
    const char *env = getenv("GRADACC_TEST_SEED");
    uint64_t seed;
    if (env && *env) {
        seed = strtoull(env, NULL, 0);
    } else {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        seed = (uint64_t)ts.tv_sec * 1000000007ull ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)getpid() << 32);
    }
    printf("%s: seed %llu (replay with GRADACC_TEST_SEED=%llu)\n", what, (unsigned long long)seed,
           (unsigned long long)seed);
    r.state = seed;
    return r;
}

/* Uniform in [0, 1). */
static inline double rng_unit(test_rng *r)
{
    return (double)(rng_u64(r) >> 11) * (1.0 / 9007199254740992.0);
}

/* Uniform in [lo, hi). */
static inline double rng_range(test_rng *r, double lo, double hi)
{
    return lo + (hi - lo) * rng_unit(r);
}

/* Uniform integer in [0, n). */
static inline uint32_t rng_below(test_rng *r, uint32_t n)
{
    return (uint32_t)(rng_u64(r) % n);
}

/* ---------------------------------------------------------------------------------------------
 * fp16 / bf16 conversions, by arithmetic on doubles (not by bit tricks as in the library), so the
 * two implementations can check each other. Rounding is to nearest, ties to even.
 * ------------------------------------------------------------------------------------------- */

/* Rounds a non-negative double holding an integer plus a fraction to the nearest integer, ties to even. */
static inline double round_half_even(double q)
{
    double fl = floor(q);
    double d = q - fl;
    if (d > 0.5)
        return fl + 1.0;
    if (d < 0.5)
        return fl;
    return fmod(fl, 2.0) == 0.0 ? fl : fl + 1.0;
}

/* Rounds |x| to a binary format with `mant_bits` stored mantissa bits, minimum normal exponent
 * `emin` and overflow threshold `overflow_at` (the first magnitude that rounds to infinity).
 * Returns the biased encoding without sign, or -1 for infinity. */
static inline long encode_magnitude(double a, int mant_bits, int emin, int bias, double overflow_at)
{
    if (a >= overflow_at)
        return -1;
    if (a < ldexp(1.0, emin)) {
        /* subnormal: multiples of 2^(emin - mant_bits); may round up to the smallest normal,
         * whose encoding is the next integer, so no special case is needed */
        return (long)round_half_even(ldexp(a, mant_bits - emin));
    }
    int e;
    double m = frexp(a, &e); /* a = m * 2^e, m in [0.5, 1) */
    int E = e - 1;           /* a = s * 2^E, s in [1, 2) */
    double frac = round_half_even((ldexp(m, 1) - 1.0) * ldexp(1.0, mant_bits));
    if (frac == ldexp(1.0, mant_bits)) {
        frac = 0.0;
        E += 1;
    }
    return ((long)(E + bias) << mant_bits) | (long)frac;
}

static inline uint16_t f32_to_f16_bits(float x)
{
    double v = (double)x;
    uint16_t sign = signbit(v) ? 0x8000 : 0;
    if (isnan(v))
        return (uint16_t)(sign | 0x7e00);
    /* max finite 65504 = (2 - 2^-10) * 2^15; halfway to 2^16 is 65520, which ties to even: inf */
    long enc = encode_magnitude(fabs(v), 10, -14, 15, 65520.0);
    if (enc < 0 || enc >= 0x7c00)
        return (uint16_t)(sign | 0x7c00);
    return (uint16_t)(sign | (uint16_t)enc);
}

static inline float f16_bits_to_f32(uint16_t h)
{
    int sign = (h & 0x8000) ? -1 : 1;
    int exp = (h >> 10) & 0x1f;
    int mant = h & 0x3ff;
    if (exp == 0x1f)
        return mant ? NAN : (float)(sign * INFINITY);
    if (exp == 0)
        return (float)(sign * ldexp((double)mant, -24));
    return (float)(sign * ldexp((double)(1024 + mant), exp - 25));
}

static inline uint16_t f32_to_bf16_bits(float x)
{
    double v = (double)x;
    uint16_t sign = signbit(v) ? 0x8000 : 0;
    if (isnan(v))
        return (uint16_t)(sign | 0x7fc0);
    /* max finite (2 - 2^-7) * 2^127; halfway above it, (2 - 2^-8) * 2^127, ties to even: inf */
    long enc = encode_magnitude(fabs(v), 7, -126, 127, ldexp(2.0 - 1.0 / 256.0, 127));
    if (enc < 0 || enc >= 0x7f80)
        return (uint16_t)(sign | 0x7f80);
    return (uint16_t)(sign | (uint16_t)enc);
}

static inline float bf16_bits_to_f32(uint16_t b)
{
    int sign = (b & 0x8000) ? -1 : 1;
    int exp = (b >> 7) & 0xff;
    int mant = b & 0x7f;
    if (exp == 0xff)
        return mant ? NAN : (float)(sign * INFINITY);
    if (exp == 0)
        return (float)(sign * ldexp((double)mant, -133));
    return (float)(sign * ldexp((double)(128 + mant), exp - 134));
}

/* ---------------------------------------------------------------------------------------------
 * Gradients in a given dtype. A grad_buf holds `n` elements of `dtype`; encode() fills it from
 * f64 values times a loss scale, the way a backward pass in that precision produces them (the
 * value computed, multiplied by the scale, rounded once), and returns through `exact` the value
 * each element really carries once unscaled (exact decoded value / scale, in f64), which is what
 * a reference must use to test the library's arithmetic rather than the 16-bit rounding.
 * ------------------------------------------------------------------------------------------- */

typedef struct {
    gradacc_dtype_t dtype;
    size_t n;
    void *data; /* float* or uint16_t*, suitably aligned */
} grad_buf;

static inline size_t dtype_size(gradacc_dtype_t dtype)
{
    return dtype == GRADACC_DTYPE_F32 ? 4 : 2;
}

/* Half an ulp at 1 of `dtype` (its unit roundoff): the relative error of rounding a value to it. */
static inline double dtype_half_ulp(gradacc_dtype_t dtype)
{
    return dtype == GRADACC_DTYPE_F32 ? ldexp(1.0, -24) : dtype == GRADACC_DTYPE_F16 ? ldexp(1.0, -11) : ldexp(1.0, -8);
}

static inline const char *dtype_name(gradacc_dtype_t dtype)
{
    return dtype == GRADACC_DTYPE_F32 ? "f32" : dtype == GRADACC_DTYPE_F16 ? "f16" : "bf16";
}

static inline grad_buf grad_alloc(gradacc_dtype_t dtype, size_t n)
{
    grad_buf g;
    g.dtype = dtype;
    g.n = n;
    g.data = calloc(n ? n : 1, 4); /* 4-byte aligned for every dtype */
    if (!g.data) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    return g;
}

static inline void grad_free(grad_buf *g)
{
    free(g->data);
    g->data = NULL;
}

/* Encodes the f32 rounding of values[i] * scale into element i. */
static inline void grad_encode(grad_buf *g, const double *values, double scale, double *exact)
{
    for (size_t i = 0; i < g->n; i++) {
        float v = (float)(values[i] * scale);
        double back;
        switch (g->dtype) {
        case GRADACC_DTYPE_F16: {
            uint16_t h = f32_to_f16_bits(v);
            ((uint16_t *)g->data)[i] = h;
            back = f16_bits_to_f32(h);
            break;
        }
        case GRADACC_DTYPE_BF16: {
            uint16_t b = f32_to_bf16_bits(v);
            ((uint16_t *)g->data)[i] = b;
            back = bf16_bits_to_f32(b);
            break;
        }
        default:
            ((float *)g->data)[i] = v;
            back = v;
            break;
        }
        if (exact)
            exact[i] = back / scale;
    }
}

/* Overwrites element i: a 16-bit buffer gets the raw bits `bits16` (e.g. 0x7c00, fp16 infinity),
 * an f32 buffer gets `f32_value`. */
static inline void grad_poke(grad_buf *g, size_t i, uint16_t bits16, float f32_value)
{
    if (g->dtype == GRADACC_DTYPE_F32)
        ((float *)g->data)[i] = f32_value;
    else
        ((uint16_t *)g->data)[i] = bits16;
}

/* ---------------------------------------------------------------------------------------------
 * Ranks on threads: run_ranks(n, fn, args, stride) starts fn(args + r * stride) for r = 0..n-1,
 * one thread each, and joins them.
 * ------------------------------------------------------------------------------------------- */

static inline void run_ranks(size_t n, void *(*fn)(void *), void *args, size_t stride)
{
    pthread_t threads[64];
    if (n > 64) {
        fprintf(stderr, "run_ranks: too many ranks\n");
        exit(1);
    }
    for (size_t r = 0; r < n; r++) {
        if (pthread_create(&threads[r], NULL, fn, (char *)args + r * stride) != 0) {
            fprintf(stderr, "pthread_create failed\n");
            exit(1);
        }
    }
    for (size_t r = 0; r < n; r++)
        pthread_join(threads[r], NULL);
}

/* A CPU scaler with default settings except its starting scale. */
static inline gradacc_scaler_t *scaler_with_scale(float init_scale)
{
    gradacc_scaler_config_t sc;
    REQUIRE_OK(gradacc_scaler_config_default(&sc));
    sc.init_scale = init_scale;
    gradacc_scaler_t *scaler = NULL;
    REQUIRE_OK(gradacc_scaler_create(&sc, NULL, &scaler));
    return scaler;
}

/* Reads tensor `index` of `acc` into a double array (n elements expected). */
static inline void read_master(gradacc_accumulator_t *acc, size_t index, double *out, size_t n)
{
    float *p = NULL;
    size_t numel = 0;
    REQUIRE_OK(gradacc_accumulator_master(acc, index, &p, &numel));
    CHECK(numel == n, "tensor %zu has %zu elements, expected %zu", index, numel, n);
    for (size_t i = 0; i < n && i < numel; i++)
        out[i] = p[i];
}

/* Max |a - b| over n elements (NaN counts as infinite). */
static inline double max_abs_diff(const double *a, const double *b, size_t n)
{
    double m = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs(a[i] - b[i]);
        if (d != d)
            return INFINITY;
        if (d > m)
            m = d;
    }
    return m;
}

#endif
