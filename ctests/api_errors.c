/* The error contract of every entry point: NULL for each pointer argument (NULL_ARGUMENT, and the
 * last error names the argument), out-of-domain values, wrong struct_size, wrong tensor count and
 * length, misaligned buffers, destroyed / foreign / wrong-type handles, calls in the wrong state,
 * outputs left untouched on failure, and, after every error, objects that still work and give
 * exact results (an error leaves every object as it was). Also status strings, the per-thread
 * last error and the version query. */
#include "common.h"

/* ---- a reference window --------------------------------------------------------------------- */

enum { N0 = 5, N1 = 4, N2 = 3, NALL = N0 + N1 + N2 };
/* The master: each tensor starts at a multiple of GRADACC_MASTER_ALIGN bytes. */
enum { NMASTER = 3 * (GRADACC_MASTER_ALIGN / 4) };
static const gradacc_tensor_desc_t descs[3] = {{N0, GRADACC_DTYPE_F32}, {N1, GRADACC_DTYPE_F16}, {N2, GRADACC_DTYPE_BF16}};
static const float SCALE = 1024.0f;

/* micro-batch kind m: unscaled value (m + 1) * (k + 1) * 0.25 for element k of the flat layout,
 * exact in every dtype once scaled by 1024 */
static float g0[4][N0];
static uint16_t g1[4][N1], g2[4][N2];

static void init_grads(void)
{
    for (int m = 0; m < 4; m++)
        for (int k = 0; k < NALL; k++) {
            float v = (float)((m + 1) * (k + 1) * 0.25 * SCALE);
            if (k < N0)
                g0[m][k] = v;
            else if (k < N0 + N1)
                g1[m][k - N0] = f32_to_f16_bits(v);
            else
                g2[m][k - N0 - N1] = f32_to_bf16_bits(v);
        }
}

typedef struct {
    double sum[NALL];
    uint64_t count;
} window_ref;

static void ref_add(window_ref *w, int m, uint64_t count)
{
    for (int k = 0; k < NALL; k++)
        w->sum[k] += (double)count * (m + 1) * (k + 1) * 0.25;
    w->count += count;
}

static void add_mb(gradacc_accumulator_t *acc, gradacc_scaler_t *s, int m, uint64_t count, window_ref *w)
{
    const void *grads[3] = {g0[m], g1[m], g2[m]};
    REQUIRE_OK(gradacc_accumulator_add(acc, s, grads, 3, count));
    ref_add(w, m, count);
}

/* Syncs and checks the master against the reference window (BY_COUNT, MEAN); starts a new ref. */
static void finish(gradacc_accumulator_t *acc, window_ref *w, const char *what)
{
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    EXPECT_OK(gradacc_accumulator_sync(acc, NULL, &info));
    CHECK(info.total_count == w->count, "%s: total_count %llu, expected %llu", what, (unsigned long long)info.total_count,
          (unsigned long long)w->count);
    double got[NALL];
    read_master(acc, 0, got, N0);
    read_master(acc, 1, got + N0, N1);
    read_master(acc, 2, got + N0 + N1, N2);
    for (int k = 0; k < NALL; k++) {
        double want = w->sum[k] / (double)w->count;
        CHECK_CLOSE(got[k], want, 1e-6 * want, "%s: element %d after the errors", what, k);
    }
    memset(w, 0, sizeof *w);
}

static gradacc_accumulator_t *new_acc(void)
{
    gradacc_accumulator_t *a = NULL;
    REQUIRE_OK(gradacc_accumulator_create(NULL, descs, 3, NULL, &a));
    return a;
}

#define SENTINEL_PTR ((void *)(uintptr_t)0x5e5e5e50)

/* ---- creation and configuration ------------------------------------------------------------- */

static void test_accumulator_create(void)
{
    gradacc_accumulator_t *out = SENTINEL_PTR;
    gradacc_accumulator_config_t c;
    REQUIRE_OK(gradacc_accumulator_config_default(&c));
    CHECK(c.struct_size == sizeof c && c.loss_reduction == GRADACC_LOSS_REDUCTION_MEAN &&
              c.normalize == GRADACC_NORMALIZE_BY_COUNT && c.max_grad_norm == 0.0f && c.threads == 1 && c.bucket_numel > 0,
          "accumulator defaults");
    EXPECT_ERROR(gradacc_accumulator_config_default(NULL), GRADACC_STATUS_NULL_ARGUMENT, "`out`");

    EXPECT_ERROR(gradacc_accumulator_create(&c, descs, 3, NULL, NULL), GRADACC_STATUS_NULL_ARGUMENT, "`out`");
    EXPECT_ERROR(gradacc_accumulator_create(&c, NULL, 3, NULL, (gradacc_accumulator_t **)&out),
                 GRADACC_STATUS_NULL_ARGUMENT, "`tensors`");
    EXPECT_ERROR(gradacc_accumulator_create(&c, descs, 0, NULL, (gradacc_accumulator_t **)&out),
                 GRADACC_STATUS_INVALID_ARGUMENT, "`n`");
    gradacc_accumulator_config_t zeros;
    memset(&zeros, 0, sizeof zeros);
    zeros.struct_size = sizeof zeros;
    EXPECT_ERROR(gradacc_accumulator_create(&zeros, descs, 3, NULL, (gradacc_accumulator_t **)&out),
                 GRADACC_STATUS_INVALID_ARGUMENT, "gradacc_accumulator_config_default()");
    EXPECT_ERROR(gradacc_accumulator_create(&c, NULL, 0, NULL, (gradacc_accumulator_t **)&out),
                 GRADACC_STATUS_INVALID_ARGUMENT, "`n` is 0: an accumulator needs at least one tensor");

    static const size_t bad_sizes[3] = {0, sizeof(gradacc_accumulator_config_t) - 1, sizeof(gradacc_accumulator_config_t) + 8};
    for (int i = 0; i < 3; i++) {
        gradacc_accumulator_config_t b = c;
        b.struct_size = bad_sizes[i];
        EXPECT_ERROR(gradacc_accumulator_create(&b, descs, 3, NULL, (gradacc_accumulator_t **)&out),
                     GRADACC_STATUS_INVALID_ARGUMENT, "struct_size");
    }
    {
        gradacc_accumulator_config_t b = c;
        b.loss_reduction = 2;
        EXPECT_ERROR(gradacc_accumulator_create(&b, descs, 3, NULL, (gradacc_accumulator_t **)&out),
                     GRADACC_STATUS_INVALID_ARGUMENT, "loss_reduction");
        b.loss_reduction = -1;
        EXPECT_ERROR(gradacc_accumulator_create(&b, descs, 3, NULL, (gradacc_accumulator_t **)&out),
                     GRADACC_STATUS_INVALID_ARGUMENT, "loss_reduction");
        b = c;
        b.normalize = 4;
        EXPECT_ERROR(gradacc_accumulator_create(&b, descs, 3, NULL, (gradacc_accumulator_t **)&out),
                     GRADACC_STATUS_INVALID_ARGUMENT, "normalize");
        b.normalize = -7;
        EXPECT_ERROR(gradacc_accumulator_create(&b, descs, 3, NULL, (gradacc_accumulator_t **)&out),
                     GRADACC_STATUS_INVALID_ARGUMENT, "normalize");
        static const float bad_norms[3] = {-1.0f, NAN, INFINITY};
        for (int i = 0; i < 3; i++) {
            b = c;
            b.max_grad_norm = bad_norms[i];
            EXPECT_ERROR(gradacc_accumulator_create(&b, descs, 3, NULL, (gradacc_accumulator_t **)&out),
                         GRADACC_STATUS_INVALID_ARGUMENT, "max_grad_norm");
        }
        b = c;
        b.bucket_numel = 0;
        EXPECT_ERROR(gradacc_accumulator_create(&b, descs, 3, NULL, (gradacc_accumulator_t **)&out),
                     GRADACC_STATUS_INVALID_ARGUMENT, "bucket_numel");
        b = c;
        b.threads = 0;
        EXPECT_ERROR(gradacc_accumulator_create(&b, descs, 3, NULL, (gradacc_accumulator_t **)&out),
                     GRADACC_STATUS_INVALID_ARGUMENT, "threads");
        b.threads = 1025;
        EXPECT_ERROR(gradacc_accumulator_create(&b, descs, 3, NULL, (gradacc_accumulator_t **)&out),
                     GRADACC_STATUS_INVALID_ARGUMENT, "threads");
    }
    {
        gradacc_tensor_desc_t t[3] = {descs[0], descs[1], descs[2]};
        t[1].dtype = 3;
        EXPECT_ERROR(gradacc_accumulator_create(&c, t, 3, NULL, (gradacc_accumulator_t **)&out),
                     GRADACC_STATUS_INVALID_ARGUMENT, "tensors[1].dtype");
        t[1].dtype = -1;
        EXPECT_ERROR(gradacc_accumulator_create(&c, t, 3, NULL, (gradacc_accumulator_t **)&out),
                     GRADACC_STATUS_INVALID_ARGUMENT, "tensors[1].dtype");
        t[1] = descs[1];
        t[2].numel = 0;
        EXPECT_ERROR(gradacc_accumulator_create(&c, t, 3, NULL, (gradacc_accumulator_t **)&out),
                     GRADACC_STATUS_INVALID_ARGUMENT, "tensors[2]");
    }
    {
        gradacc_device_t d = {GRADACC_DEVICE_CPU, 0, NULL};
        d.kind = 2;
        EXPECT_ERROR(gradacc_accumulator_create(&c, descs, 3, &d, (gradacc_accumulator_t **)&out),
                     GRADACC_STATUS_INVALID_ARGUMENT, "device");
        d.kind = GRADACC_DEVICE_CPU;
        d.ordinal = 1;
        EXPECT_ERROR(gradacc_accumulator_create(&c, descs, 3, &d, (gradacc_accumulator_t **)&out),
                     GRADACC_STATUS_INVALID_ARGUMENT, "device");
        d.ordinal = 0;
        d.stream = &d;
        EXPECT_ERROR(gradacc_accumulator_create(&c, descs, 3, &d, (gradacc_accumulator_t **)&out),
                     GRADACC_STATUS_INVALID_ARGUMENT, "device");
        d.kind = GRADACC_DEVICE_CUDA;
        d.stream = NULL;
        gradacc_status_t st = gradacc_accumulator_create(&c, descs, 3, &d, (gradacc_accumulator_t **)&out);
        CHECK(st == GRADACC_STATUS_BACKEND_UNAVAILABLE || st == GRADACC_STATUS_OK, "CUDA device: status %d", st);
        if (st == GRADACC_STATUS_OK) {
            EXPECT_OK(gradacc_accumulator_destroy((gradacc_accumulator_t *)out));
            out = SENTINEL_PTR;
        }
        d.kind = GRADACC_DEVICE_CPU;
        gradacc_accumulator_t *ok = NULL;
        EXPECT_OK(gradacc_accumulator_create(&c, descs, 3, &d, &ok)); /* an explicit CPU device is fine */
        EXPECT_OK(gradacc_accumulator_destroy(ok));
    }
    CHECK(out == SENTINEL_PTR, "`out` was written by a failing create");

    /* create_with_buffer */
    float master[NMASTER + 1];
    EXPECT_ERROR(gradacc_accumulator_create_with_buffer(&c, descs, 3, NULL, NULL, NMASTER, (gradacc_accumulator_t **)&out),
                 GRADACC_STATUS_NULL_ARGUMENT, "`master`");
    EXPECT_ERROR(gradacc_accumulator_create_with_buffer(&c, descs, 3, NULL, master, NMASTER, NULL),
                 GRADACC_STATUS_NULL_ARGUMENT, "`out`");
    EXPECT_STATUS(gradacc_accumulator_create_with_buffer(&c, descs, 3, NULL, master, NMASTER - 1, (gradacc_accumulator_t **)&out),
                  GRADACC_STATUS_SIZE_MISMATCH);
    EXPECT_STATUS(gradacc_accumulator_create_with_buffer(&c, descs, 3, NULL, master, NMASTER + 1, (gradacc_accumulator_t **)&out),
                  GRADACC_STATUS_SIZE_MISMATCH);
    EXPECT_ERROR(gradacc_accumulator_create_with_buffer(&c, descs, 3, NULL, NULL, NMASTER, NULL), GRADACC_STATUS_NULL_ARGUMENT,
                 "NULL");
    {
        unsigned char raw[(NMASTER + 2) * 4];
        float *misaligned = (float *)(void *)(raw + 1 + (4 - ((uintptr_t)raw % 4)) % 4);
        EXPECT_STATUS(gradacc_accumulator_create_with_buffer(&c, descs, 3, NULL, misaligned, NMASTER,
                                                             (gradacc_accumulator_t **)&out),
                      GRADACC_STATUS_INVALID_ARGUMENT);
    }
    CHECK(out == SENTINEL_PTR, "`out` was written by a failing create_with_buffer");
}

static void test_scaler_create(void)
{
    gradacc_scaler_t *out = SENTINEL_PTR;
    gradacc_scaler_config_t c;
    EXPECT_ERROR(gradacc_scaler_config_default(NULL), GRADACC_STATUS_NULL_ARGUMENT, "`out`");
    REQUIRE_OK(gradacc_scaler_config_default(&c));
    EXPECT_ERROR(gradacc_scaler_create(&c, NULL, NULL), GRADACC_STATUS_NULL_ARGUMENT, "`out`");
    struct {
        const char *field;
        gradacc_scaler_config_t cfg;
    } bad[32];
    int n = 0;
#define BAD(field_name, stmt)                                                                                          \
    do {                                                                                                                \
        bad[n].field = field_name;                                                                                      \
        bad[n].cfg = c;                                                                                                 \
        {                                                                                                               \
            gradacc_scaler_config_t *b = &bad[n].cfg;                                                                   \
            stmt;                                                                                                       \
        }                                                                                                               \
        n++;                                                                                                            \
    } while (0)
    BAD("struct_size", b->struct_size = 0);
    BAD("struct_size", b->struct_size = sizeof c + 4);
    BAD("init_scale", b->init_scale = 0);
    BAD("init_scale", b->init_scale = -2);
    BAD("init_scale", b->init_scale = NAN);
    BAD("init_scale", b->init_scale = INFINITY);
    BAD("growth_factor", b->growth_factor = 1.0f);
    BAD("growth_factor", b->growth_factor = NAN);
    BAD("growth_factor", b->growth_factor = INFINITY);
    BAD("backoff_factor", b->backoff_factor = 1.0f);
    BAD("backoff_factor", b->backoff_factor = 0.0f);
    BAD("backoff_factor", b->backoff_factor = NAN);
    BAD("growth_interval", b->growth_interval = 0);
    BAD("hysteresis", b->hysteresis = 0);
    BAD("min_scale", b->min_scale = 0);
    BAD("min_scale", b->min_scale = NAN);
    BAD("min_scale", b->min_scale = b->init_scale * 2);
    BAD("max_scale", b->max_scale = b->init_scale / 2);
    BAD("max_scale", b->max_scale = NAN);
#undef BAD
    for (int i = 0; i < n; i++)
        EXPECT_ERROR(gradacc_scaler_create(&bad[i].cfg, NULL, &out), GRADACC_STATUS_INVALID_ARGUMENT, bad[i].field);
    gradacc_device_t d = {GRADACC_DEVICE_CPU, 0, NULL};
    d.kind = 9;
    EXPECT_ERROR(gradacc_scaler_create(&c, &d, &out), GRADACC_STATUS_INVALID_ARGUMENT, "device");
    d.kind = GRADACC_DEVICE_CUDA;
    gradacc_status_t st = gradacc_scaler_create(&c, &d, &out);
    CHECK(st == GRADACC_STATUS_BACKEND_UNAVAILABLE || st == GRADACC_STATUS_OK, "CUDA scaler: status %d", st);
    if (st == GRADACC_STATUS_OK) {
        EXPECT_OK(gradacc_scaler_destroy(out));
        out = SENTINEL_PTR;
    }
    CHECK(out == SENTINEL_PTR, "`out` was written by a failing scaler create");
}

/* ---- handles -------------------------------------------------------------------------------- */

static void test_handles(void)
{
    gradacc_scaler_t *s = scaler_with_scale(SCALE);
    gradacc_accumulator_t *live = new_acc();
    gradacc_accumulator_t *dead = new_acc();
    gradacc_scaler_t *dead_s = scaler_with_scale(SCALE);
    gradacc_comm_t *dead_c[1];
    REQUIRE_OK(gradacc_comm_create_local(1, dead_c));
    EXPECT_OK(gradacc_accumulator_destroy(dead));
    EXPECT_OK(gradacc_scaler_destroy(dead_s));
    EXPECT_OK(gradacc_comm_destroy(dead_c[0]));
    window_ref w;
    memset(&w, 0, sizeof w);
    add_mb(live, s, 0, 4, &w);
    finish(live, &w, "before the invalid handles"); /* synced: scaler_update accepts it */

    /* NULL destroys are no-ops */
    EXPECT_OK(gradacc_accumulator_destroy(NULL));
    EXPECT_OK(gradacc_scaler_destroy(NULL));
    EXPECT_OK(gradacc_comm_destroy(NULL));
    /* double destroys are detected */
    EXPECT_ERROR(gradacc_accumulator_destroy(dead), GRADACC_STATUS_INVALID_HANDLE, "`acc`");
    EXPECT_ERROR(gradacc_scaler_destroy(dead_s), GRADACC_STATUS_INVALID_HANDLE, "`scaler`");
    EXPECT_ERROR(gradacc_comm_destroy(dead_c[0]), GRADACC_STATUS_INVALID_HANDLE, "`comm`");
    /* handles of another type, and pointers that never were handles */
    int not_a_handle = 0;
    gradacc_accumulator_t *as_acc[3] = {(gradacc_accumulator_t *)(void *)s, (gradacc_accumulator_t *)(void *)&not_a_handle,
                                        dead};
    for (int i = 0; i < 3; i++) {
        gradacc_accumulator_t *a = as_acc[i];
        const void *grads[3] = {g0[0], g1[0], g2[0]};
        float *p = SENTINEL_PTR;
        size_t n = 777;
        unsigned char buf[16];
        EXPECT_ERROR(gradacc_accumulator_add(a, s, grads, 3, 1), GRADACC_STATUS_INVALID_HANDLE, "`acc`");
        EXPECT_ERROR(gradacc_accumulator_begin_microbatch(a, 1), GRADACC_STATUS_INVALID_HANDLE, "`acc`");
        EXPECT_ERROR(gradacc_accumulator_add_tensor(a, s, 0, g0[0], N0), GRADACC_STATUS_INVALID_HANDLE, "`acc`");
        EXPECT_ERROR(gradacc_accumulator_end_microbatch(a), GRADACC_STATUS_INVALID_HANDLE, "`acc`");
        EXPECT_ERROR(gradacc_accumulator_sync(a, NULL, NULL), GRADACC_STATUS_INVALID_HANDLE, "`acc`");
        EXPECT_ERROR(gradacc_accumulator_master(a, 0, &p, &n), GRADACC_STATUS_INVALID_HANDLE, "`acc`");
        EXPECT_ERROR(gradacc_accumulator_num_tensors(a, &n), GRADACC_STATUS_INVALID_HANDLE, "`acc`");
        EXPECT_ERROR(gradacc_accumulator_reset(a), GRADACC_STATUS_INVALID_HANDLE, "`acc`");
        EXPECT_ERROR(gradacc_accumulator_save_window(a, NULL, 0, &n), GRADACC_STATUS_INVALID_HANDLE, "`acc`");
        EXPECT_ERROR(gradacc_accumulator_load_window(a, buf, sizeof buf), GRADACC_STATUS_INVALID_HANDLE, "`acc`");
        CHECK(p == SENTINEL_PTR && n == 777, "outputs written through an invalid accumulator handle");
        if (i != 2)
            EXPECT_ERROR(gradacc_accumulator_destroy(a), GRADACC_STATUS_INVALID_HANDLE, "`acc`");
        const gradacc_accumulator_t *list[2] = {live, a};
        bool skipped = true;
        EXPECT_ERROR(gradacc_scaler_update(s, list, 2, &skipped), GRADACC_STATUS_INVALID_HANDLE, "accumulators[1]");
    }
    gradacc_scaler_t *as_scaler[3] = {(gradacc_scaler_t *)(void *)live, (gradacc_scaler_t *)(void *)&not_a_handle, dead_s};
    for (int i = 0; i < 3; i++) {
        gradacc_scaler_t *x = as_scaler[i];
        float f = -3.0f;
        gradacc_scaler_stats_t st = GRADACC_SCALER_STATS_INIT;
        memset(&st, 0x5a, sizeof st);
        st.struct_size = sizeof st;
        size_t n = 777;
        unsigned char buf[64];
        const gradacc_accumulator_t *list[1] = {live};
        const void *grads[3] = {g0[0], g1[0], g2[0]};
        EXPECT_ERROR(gradacc_scaler_scale(x, &f), GRADACC_STATUS_INVALID_HANDLE, "`scaler`");
        EXPECT_ERROR(gradacc_scaler_scale_loss(x, &f, 1, GRADACC_DTYPE_F32), GRADACC_STATUS_INVALID_HANDLE, "`scaler`");
        EXPECT_ERROR(gradacc_scaler_update(x, list, 1, NULL), GRADACC_STATUS_INVALID_HANDLE, "`scaler`");
        EXPECT_ERROR(gradacc_scaler_stats(x, &st), GRADACC_STATUS_INVALID_HANDLE, "`scaler`");
        EXPECT_ERROR(gradacc_scaler_save(x, NULL, 0, &n), GRADACC_STATUS_INVALID_HANDLE, "`scaler`");
        EXPECT_ERROR(gradacc_scaler_load(x, buf, sizeof buf), GRADACC_STATUS_INVALID_HANDLE, "`scaler`");
        EXPECT_ERROR(gradacc_accumulator_add(live, x, grads, 3, 1), GRADACC_STATUS_INVALID_HANDLE, "`scaler`");
        if (i != 2)
            EXPECT_ERROR(gradacc_scaler_destroy(x), GRADACC_STATUS_INVALID_HANDLE, "`scaler`");
        CHECK(f == -3.0f && n == 777 && st.steps == 0x5a5a5a5a5a5a5a5aull, "outputs written through an invalid scaler");
    }
    gradacc_comm_t *as_comm[3] = {(gradacc_comm_t *)(void *)live, (gradacc_comm_t *)(void *)&not_a_handle, dead_c[0]};
    for (int i = 0; i < 3; i++) {
        int32_t n = 777;
        EXPECT_ERROR(gradacc_comm_rank(as_comm[i], &n), GRADACC_STATUS_INVALID_HANDLE, "`comm`");
        EXPECT_ERROR(gradacc_comm_world_size(as_comm[i], &n), GRADACC_STATUS_INVALID_HANDLE, "`comm`");
        EXPECT_ERROR(gradacc_accumulator_sync(live, as_comm[i], NULL), GRADACC_STATUS_INVALID_HANDLE, "`comm`");
        if (i != 2)
            EXPECT_ERROR(gradacc_comm_destroy(as_comm[i]), GRADACC_STATUS_INVALID_HANDLE, "`comm`");
        CHECK(n == 777, "outputs written through an invalid communicator");
    }
    /* the live objects are unharmed */
    {
        const gradacc_accumulator_t *list[1] = {live};
        bool skipped = true;
        EXPECT_OK(gradacc_scaler_update(s, list, 1, &skipped));
        CHECK(!skipped, "skipped");
    }
    add_mb(live, s, 1, 2, &w);
    add_mb(live, s, 2, 6, &w);
    finish(live, &w, "after invalid handles");
    EXPECT_OK(gradacc_accumulator_destroy(live));
    EXPECT_OK(gradacc_scaler_destroy(s));
}

/* ---- arguments and states of the accumulator ------------------------------------------------ */

static void test_accumulator_calls(void)
{
    gradacc_scaler_t *s = scaler_with_scale(SCALE);
    gradacc_accumulator_t *a = new_acc();
    window_ref w;
    memset(&w, 0, sizeof w);
    const void *good[3] = {g0[0], g1[0], g2[0]};
    /* misaligned copies of valid gradients */
    static unsigned char raw[64 + 4 * N0];
    unsigned char *base = raw + (16 - ((uintptr_t)raw % 16)) % 16;
    float *f32_mis = (float *)(void *)(base + 2);
    uint16_t *f16_mis = (uint16_t *)(void *)(base + 33);
    memcpy(f32_mis, g0[0], sizeof g0[0]);
    memcpy(f16_mis, g1[0], sizeof g1[0]);

    /* empty window */
    EXPECT_ERROR(gradacc_accumulator_end_microbatch(a), GRADACC_STATUS_WRONG_STATE, "begin_microbatch");
    EXPECT_ERROR(gradacc_accumulator_add_tensor(a, s, 0, g0[0], N0), GRADACC_STATUS_WRONG_STATE, "begin_microbatch");
    {
        gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
        memset(&info, 0x5a, sizeof info);
        info.struct_size = sizeof info;
        gradacc_sync_info_t before = info;
        EXPECT_STATUS(gradacc_accumulator_sync(a, NULL, &info), GRADACC_STATUS_EMPTY_WINDOW);
        CHECK(memcmp(&info, &before, sizeof info) == 0, "out_info written by a failing sync");
        const gradacc_accumulator_t *list[1] = {a};
        bool skipped = true;
        EXPECT_STATUS(gradacc_scaler_update(s, list, 1, &skipped), GRADACC_STATUS_WRONG_STATE);
    }

    /* open window: argument errors of add */
    add_mb(a, s, 0, 3, &w);
    {
        const void *grads[3] = {g0[1], g1[1], g2[1]};
        EXPECT_ERROR(gradacc_accumulator_add(NULL, s, grads, 3, 1), GRADACC_STATUS_NULL_ARGUMENT, "`acc`");
        EXPECT_ERROR(gradacc_accumulator_add(a, NULL, grads, 3, 1), GRADACC_STATUS_NULL_ARGUMENT, "`scaler`");
        EXPECT_ERROR(gradacc_accumulator_add(a, s, NULL, 3, 1), GRADACC_STATUS_NULL_ARGUMENT, "`grads`");
        EXPECT_STATUS(gradacc_accumulator_add(a, s, grads, 2, 1), GRADACC_STATUS_SIZE_MISMATCH);
        EXPECT_STATUS(gradacc_accumulator_add(a, s, grads, 4, 1), GRADACC_STATUS_SIZE_MISMATCH);
        EXPECT_ERROR(gradacc_accumulator_add(a, s, grads, 3, 0), GRADACC_STATUS_INVALID_ARGUMENT, "count");
        EXPECT_ERROR(gradacc_accumulator_add(a, s, grads, 3, UINT64_MAX), GRADACC_STATUS_INVALID_ARGUMENT, "count");
        for (int i = 0; i < 3; i++) {
            const void *with_null[3] = {grads[0], grads[1], grads[2]};
            with_null[i] = NULL;
            char name[16];
            snprintf(name, sizeof name, "`grads[%d]`", i);
            EXPECT_ERROR(gradacc_accumulator_add(a, s, with_null, 3, 1), GRADACC_STATUS_NULL_ARGUMENT, name);
        }
        const void *mis0[3] = {f32_mis, grads[1], grads[2]};
        EXPECT_ERROR(gradacc_accumulator_add(a, s, mis0, 3, 1), GRADACC_STATUS_INVALID_ARGUMENT, "grads[0]");
        const void *mis1[3] = {grads[0], f16_mis, grads[2]};
        EXPECT_ERROR(gradacc_accumulator_add(a, s, mis1, 3, 1), GRADACC_STATUS_INVALID_ARGUMENT, "grads[1]");
        const void *mis2[3] = {grads[0], grads[1], f16_mis};
        EXPECT_ERROR(gradacc_accumulator_add(a, s, mis2, 3, 1), GRADACC_STATUS_INVALID_ARGUMENT, "grads[2]");
    }
    add_mb(a, s, 1, 5, &w);
    finish(a, &w, "add errors in an open window");

    /* micro-batch: state errors and add_tensor argument errors */
    add_mb(a, s, 2, 1, &w);
    REQUIRE_OK(gradacc_accumulator_begin_microbatch(a, 7));
    EXPECT_ERROR(gradacc_accumulator_begin_microbatch(a, 7), GRADACC_STATUS_WRONG_STATE, "end_microbatch");
    EXPECT_ERROR(gradacc_accumulator_add(a, s, good, 3, 1), GRADACC_STATUS_WRONG_STATE, "add_tensor");
    EXPECT_ERROR(gradacc_accumulator_sync(a, NULL, NULL), GRADACC_STATUS_WRONG_STATE, "end_microbatch");
    {
        size_t len = 999;
        unsigned char buf[4096];
        EXPECT_STATUS(gradacc_accumulator_save_window(a, buf, sizeof buf, &len), GRADACC_STATUS_WRONG_STATE);
        CHECK(len == 999, "out_len written by a failing save_window");
    }
    EXPECT_ERROR(gradacc_accumulator_add_tensor(NULL, s, 0, g0[3], N0), GRADACC_STATUS_NULL_ARGUMENT, "`acc`");
    EXPECT_ERROR(gradacc_accumulator_add_tensor(a, NULL, 0, g0[3], N0), GRADACC_STATUS_NULL_ARGUMENT, "`scaler`");
    EXPECT_ERROR(gradacc_accumulator_add_tensor(a, s, 0, NULL, N0), GRADACC_STATUS_NULL_ARGUMENT, "`grad`");
    EXPECT_ERROR(gradacc_accumulator_add_tensor(a, s, 3, g0[3], N0), GRADACC_STATUS_INVALID_ARGUMENT, "`index`");
    EXPECT_ERROR(gradacc_accumulator_add_tensor(a, s, (size_t)-1, g0[3], N0), GRADACC_STATUS_INVALID_ARGUMENT, "`index`");
    EXPECT_ERROR(gradacc_accumulator_add_tensor(a, s, 0, g0[3], N0 - 1), GRADACC_STATUS_SIZE_MISMATCH, "`numel`");
    EXPECT_ERROR(gradacc_accumulator_add_tensor(a, s, 1, g1[3], N0), GRADACC_STATUS_SIZE_MISMATCH, "`numel`");
    EXPECT_ERROR(gradacc_accumulator_add_tensor(a, s, 0, f32_mis, N0), GRADACC_STATUS_INVALID_ARGUMENT, "`grad`");
    EXPECT_ERROR(gradacc_accumulator_add_tensor(a, s, 1, f16_mis, N1), GRADACC_STATUS_INVALID_ARGUMENT, "`grad`");
    EXPECT_OK(gradacc_accumulator_add_tensor(a, s, 0, g0[3], N0));
    EXPECT_OK(gradacc_accumulator_add_tensor(a, s, 1, g1[3], N1));
    EXPECT_OK(gradacc_accumulator_add_tensor(a, s, 2, g2[3], N2));
    REQUIRE_OK(gradacc_accumulator_end_microbatch(a));
    ref_add(&w, 3, 7);
    EXPECT_ERROR(gradacc_accumulator_end_microbatch(a), GRADACC_STATUS_WRONG_STATE, "begin_microbatch");
    EXPECT_ERROR(gradacc_accumulator_begin_microbatch(NULL, 1), GRADACC_STATUS_NULL_ARGUMENT, "`acc`");
    EXPECT_ERROR(gradacc_accumulator_begin_microbatch(a, 0), GRADACC_STATUS_INVALID_ARGUMENT, "count");
    EXPECT_ERROR(gradacc_accumulator_end_microbatch(NULL), GRADACC_STATUS_NULL_ARGUMENT, "`acc`");
    finish(a, &w, "errors inside a micro-batch");

    /* synced window: errors that must keep the synced result intact. A sync right after a sync
     * closes a new, empty window (documented), so alone it fails with EMPTY_WINDOW. */
    {
        double before[NALL];
        read_master(a, 0, before, N0);
        read_master(a, 1, before + N0, N1);
        read_master(a, 2, before + N0 + N1, N2);
        gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
        memset(&info, 0x3c, sizeof info);
        info.struct_size = sizeof info;
        gradacc_sync_info_t copy = info;
        EXPECT_ERROR(gradacc_accumulator_sync(a, NULL, &info), GRADACC_STATUS_EMPTY_WINDOW, "empty");
        CHECK(memcmp(&info, &copy, sizeof info) == 0, "out_info written by a failing sync");
        size_t len = 999;
        EXPECT_STATUS(gradacc_accumulator_save_window(a, NULL, 0, &len), GRADACC_STATUS_WRONG_STATE);
        EXPECT_ERROR(gradacc_accumulator_add(a, s, good, 2, 1), GRADACC_STATUS_SIZE_MISMATCH, "`n`");
        EXPECT_ERROR(gradacc_accumulator_add(a, s, good, 3, 0), GRADACC_STATUS_INVALID_ARGUMENT, "count");
        EXPECT_ERROR(gradacc_accumulator_begin_microbatch(a, 0), GRADACC_STATUS_INVALID_ARGUMENT, "count");
        EXPECT_STATUS(gradacc_accumulator_add_tensor(a, s, 0, g0[0], N0), GRADACC_STATUS_WRONG_STATE);
        EXPECT_STATUS(gradacc_accumulator_end_microbatch(a), GRADACC_STATUS_WRONG_STATE);
        double after[NALL];
        read_master(a, 0, after, N0);
        read_master(a, 1, after + N0, N1);
        read_master(a, 2, after + N0 + N1, N2);
        CHECK(memcmp(before, after, sizeof before) == 0, "a failing call changed the synced masters");
        const gradacc_accumulator_t *list[1] = {a};
        bool skipped = true;
        EXPECT_OK(gradacc_scaler_update(s, list, 1, &skipped)); /* still synced */
        CHECK(!skipped, "skipped");
    }

    /* master / num_tensors / reset arguments */
    {
        float *p = SENTINEL_PTR;
        size_t n = 777;
        EXPECT_ERROR(gradacc_accumulator_master(NULL, 0, &p, &n), GRADACC_STATUS_NULL_ARGUMENT, "`acc`");
        EXPECT_ERROR(gradacc_accumulator_master(a, 0, NULL, &n), GRADACC_STATUS_NULL_ARGUMENT, "`out_data`");
        EXPECT_ERROR(gradacc_accumulator_master(a, 0, &p, NULL), GRADACC_STATUS_NULL_ARGUMENT, "`out_numel`");
        EXPECT_ERROR(gradacc_accumulator_master(a, 3, &p, &n), GRADACC_STATUS_INVALID_ARGUMENT, "index");
        CHECK(p == SENTINEL_PTR && n == 777, "master outputs written on failure");
        EXPECT_ERROR(gradacc_accumulator_num_tensors(NULL, &n), GRADACC_STATUS_NULL_ARGUMENT, "`acc`");
        EXPECT_ERROR(gradacc_accumulator_num_tensors(a, NULL), GRADACC_STATUS_NULL_ARGUMENT, "`out`");
        EXPECT_OK(gradacc_accumulator_num_tensors(a, &n));
        CHECK(n == 3, "num_tensors %zu", n);
        gradacc_tensor_desc_t d = {777, 777};
        EXPECT_ERROR(gradacc_accumulator_tensor(NULL, 0, &d), GRADACC_STATUS_NULL_ARGUMENT, "`acc`");
        EXPECT_ERROR(gradacc_accumulator_tensor(a, 0, NULL), GRADACC_STATUS_NULL_ARGUMENT, "`out`");
        EXPECT_ERROR(gradacc_accumulator_tensor(a, 3, &d), GRADACC_STATUS_INVALID_ARGUMENT, "index");
        CHECK(d.numel == 777 && d.dtype == 777, "tensor outputs written on failure");
        for (size_t i = 0; i < 3; i++) {
            EXPECT_OK(gradacc_accumulator_tensor(a, i, &d));
            CHECK(d.numel == descs[i].numel && d.dtype == descs[i].dtype, "tensor %zu: %llu/%d", i,
                  (unsigned long long)d.numel, (int)d.dtype);
        }
        EXPECT_ERROR(gradacc_accumulator_reset(NULL), GRADACC_STATUS_NULL_ARGUMENT, "`acc`");
        EXPECT_ERROR(gradacc_accumulator_sync(NULL, NULL, NULL), GRADACC_STATUS_NULL_ARGUMENT, "`acc`");
    }

    /* reset, then every state call on the empty window again; then it works */
    EXPECT_OK(gradacc_accumulator_reset(a));
    EXPECT_STATUS(gradacc_accumulator_sync(a, NULL, NULL), GRADACC_STATUS_EMPTY_WINDOW);
    {
        const gradacc_accumulator_t *list[1] = {a};
        EXPECT_STATUS(gradacc_scaler_update(s, list, 1, NULL), GRADACC_STATUS_WRONG_STATE);
    }
    add_mb(a, s, 3, 2, &w);
    add_mb(a, s, 0, 2, &w);
    finish(a, &w, "after reset and empty-window errors");

    /* save_window / load_window errors */
    {
        add_mb(a, s, 1, 4, &w);
        size_t need = 0, len = 999;
        REQUIRE_OK(gradacc_accumulator_save_window(a, NULL, 0, &need));
        unsigned char *buf = malloc(need + 8), *bad = malloc(need + 8);
        if (!buf || !bad)
            exit(1);
        memset(buf, 0xee, need + 8);
        EXPECT_ERROR(gradacc_accumulator_save_window(a, buf, need - 1, &len), GRADACC_STATUS_SIZE_MISMATCH, "capacity");
        CHECK(len == 999 && buf[0] == 0xee && buf[need - 2] == 0xee, "buffer or out_len written by a failing save_window");
        EXPECT_ERROR(gradacc_accumulator_save_window(a, buf, need, NULL), GRADACC_STATUS_NULL_ARGUMENT, "`out_len`");
        EXPECT_ERROR(gradacc_accumulator_save_window(NULL, buf, need, &len), GRADACC_STATUS_NULL_ARGUMENT, "`acc`");
        REQUIRE_OK(gradacc_accumulator_save_window(a, buf, need, &len));
        CHECK(len == need, "save_window wrote %zu of %zu", len, need);
        EXPECT_ERROR(gradacc_accumulator_load_window(a, NULL, len), GRADACC_STATUS_NULL_ARGUMENT, "`bytes`");
        EXPECT_ERROR(gradacc_accumulator_load_window(NULL, buf, len), GRADACC_STATUS_NULL_ARGUMENT, "`acc`");
        int accepted = 0;
        for (size_t i = 0; i < len; i++) {
            memcpy(bad, buf, len);
            bad[i] ^= 0x10;
            gradacc_status_t st = gradacc_accumulator_load_window(a, bad, len);
            accepted += st != GRADACC_STATUS_CORRUPT_STATE && st != GRADACC_STATUS_SIZE_MISMATCH;
        }
        CHECK(accepted == 0, "%d corrupted windows were accepted", accepted);
        EXPECT_STATUS(gradacc_accumulator_load_window(a, buf, len - 1), GRADACC_STATUS_CORRUPT_STATE);
        EXPECT_STATUS(gradacc_accumulator_load_window(a, buf, 0), GRADACC_STATUS_CORRUPT_STATE);
        /* a window of another layout */
        gradacc_tensor_desc_t other_t[2] = {{N0, GRADACC_DTYPE_F32}, {N1 + N2, GRADACC_DTYPE_F16}};
        gradacc_accumulator_t *other = NULL;
        REQUIRE_OK(gradacc_accumulator_create(NULL, other_t, 2, NULL, &other));
        EXPECT_STATUS(gradacc_accumulator_load_window(other, buf, len), GRADACC_STATUS_SIZE_MISMATCH);
        /* inside a micro-batch */
        gradacc_accumulator_t *twin = new_acc();
        REQUIRE_OK(gradacc_accumulator_begin_microbatch(twin, 1));
        EXPECT_STATUS(gradacc_accumulator_load_window(twin, buf, len), GRADACC_STATUS_WRONG_STATE);
        REQUIRE_OK(gradacc_accumulator_end_microbatch(twin));
        /* a valid load into the twin: both finish identically */
        EXPECT_OK(gradacc_accumulator_load_window(twin, buf, len));
        window_ref w2 = w;
        add_mb(a, s, 2, 4, &w);
        add_mb(twin, s, 2, 4, &w2);
        finish(a, &w, "after load_window errors");
        finish(twin, &w2, "restored window");
        EXPECT_OK(gradacc_accumulator_destroy(other));
        EXPECT_OK(gradacc_accumulator_destroy(twin));
        free(buf);
        free(bad);
    }

    /* a window whose global item count is 0 (sum-reduced losses of 0 items): EMPTY_WINDOW, and the
     * window stays open */
    {
        gradacc_accumulator_config_t c;
        REQUIRE_OK(gradacc_accumulator_config_default(&c));
        c.loss_reduction = GRADACC_LOSS_REDUCTION_SUM;
        gradacc_accumulator_t *sum = NULL;
        REQUIRE_OK(gradacc_accumulator_create(&c, descs, 3, NULL, &sum));
        REQUIRE_OK(gradacc_accumulator_add(sum, s, good, 3, 0));
        EXPECT_STATUS(gradacc_accumulator_sync(sum, NULL, NULL), GRADACC_STATUS_EMPTY_WINDOW);
        const void *g3[3] = {g0[3], g1[3], g2[3]};
        REQUIRE_OK(gradacc_accumulator_add(sum, s, g3, 3, 4));
        gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
        EXPECT_OK(gradacc_accumulator_sync(sum, NULL, &info));
        CHECK(info.total_count == 4 && info.microbatches == 2, "count %llu micro-batches %llu",
              (unsigned long long)info.total_count, (unsigned long long)info.microbatches);
        double got[N0];
        read_master(sum, 0, got, N0);
        for (int k = 0; k < N0; k++) /* SUM: (mb 0 + mb 3) / 4 items */
            CHECK_CLOSE(got[k], (1 + 4) * (k + 1) * 0.25 / 4, 1e-6, "sum-reduced element %d", k);
        EXPECT_OK(gradacc_accumulator_destroy(sum));
    }
    EXPECT_OK(gradacc_accumulator_destroy(a));
    EXPECT_OK(gradacc_scaler_destroy(s));
}

/* ---- scaler calls --------------------------------------------------------------------------- */

static void test_scaler_calls(void)
{
    gradacc_scaler_t *s = scaler_with_scale(SCALE);
    gradacc_accumulator_t *a = new_acc(), *b = new_acc();
    window_ref w;
    memset(&w, 0, sizeof w);
    float f = -3.0f;
    EXPECT_ERROR(gradacc_scaler_scale(NULL, &f), GRADACC_STATUS_NULL_ARGUMENT, "`scaler`");
    EXPECT_ERROR(gradacc_scaler_scale(s, NULL), GRADACC_STATUS_NULL_ARGUMENT, "`out`");
    CHECK(f == -3.0f, "get_scale output written on failure");
    gradacc_scaler_stats_t st = GRADACC_SCALER_STATS_INIT;
    EXPECT_ERROR(gradacc_scaler_stats(NULL, &st), GRADACC_STATUS_NULL_ARGUMENT, "`scaler`");
    EXPECT_ERROR(gradacc_scaler_stats(s, NULL), GRADACC_STATUS_NULL_ARGUMENT, "`out`");

    /* scale_loss */
    {
        static unsigned char raw[64];
        unsigned char *base = raw + (16 - ((uintptr_t)raw % 16)) % 16;
        float one = 1.0f;
        EXPECT_ERROR(gradacc_scaler_scale_loss(NULL, &one, 1, GRADACC_DTYPE_F32), GRADACC_STATUS_NULL_ARGUMENT, "`scaler`");
        EXPECT_ERROR(gradacc_scaler_scale_loss(s, NULL, 1, GRADACC_DTYPE_F32), GRADACC_STATUS_NULL_ARGUMENT, "`loss`");
        EXPECT_ERROR(gradacc_scaler_scale_loss(s, &one, 1, 3), GRADACC_STATUS_INVALID_ARGUMENT, "`dtype`");
        EXPECT_ERROR(gradacc_scaler_scale_loss(s, &one, 1, -1), GRADACC_STATUS_INVALID_ARGUMENT, "`dtype`");
        memcpy(base + 2, &one, 4);
        EXPECT_ERROR(gradacc_scaler_scale_loss(s, base + 2, 1, GRADACC_DTYPE_F32), GRADACC_STATUS_INVALID_ARGUMENT, "`loss`");
        base[9] = 0x00;
        base[10] = 0x3c;
        EXPECT_ERROR(gradacc_scaler_scale_loss(s, base + 9, 1, GRADACC_DTYPE_F16), GRADACC_STATUS_INVALID_ARGUMENT, "`loss`");
        EXPECT_ERROR(gradacc_scaler_scale_loss(s, base + 9, 1, GRADACC_DTYPE_BF16), GRADACC_STATUS_INVALID_ARGUMENT, "`loss`");
        float check;
        memcpy(&check, base + 2, 4);
        CHECK(check == 1.0f && one == 1.0f && base[9] == 0 && base[10] == 0x3c, "a failing scale_loss wrote the buffer");
        EXPECT_OK(gradacc_scaler_scale_loss(s, &one, 1, GRADACC_DTYPE_F32));
        CHECK(one == SCALE, "scale_loss still works: %g", one);
    }

    /* update: arguments and states; the scaler must be unchanged by each failure */
    add_mb(a, s, 0, 1, &w);
    REQUIRE_OK(gradacc_accumulator_sync(a, NULL, NULL));
    memset(&w, 0, sizeof w);
    gradacc_scaler_stats_t before = GRADACC_SCALER_STATS_INIT;
    REQUIRE_OK(gradacc_scaler_stats(s, &before));
    {
        const gradacc_accumulator_t *list[2] = {a, b};
        bool skipped = true;
        EXPECT_ERROR(gradacc_scaler_update(NULL, list, 1, &skipped), GRADACC_STATUS_NULL_ARGUMENT, "`scaler`");
        EXPECT_ERROR(gradacc_scaler_update(s, NULL, 1, &skipped), GRADACC_STATUS_NULL_ARGUMENT, "`accumulators`");
        EXPECT_ERROR(gradacc_scaler_update(s, list, 0, &skipped), GRADACC_STATUS_INVALID_ARGUMENT, "`n`");
        EXPECT_ERROR(gradacc_scaler_update(s, list, 2, &skipped), GRADACC_STATUS_WRONG_STATE, "accumulators[1]");
        const gradacc_accumulator_t *with_null[2] = {a, NULL};
        EXPECT_ERROR(gradacc_scaler_update(s, with_null, 2, &skipped), GRADACC_STATUS_NULL_ARGUMENT, "`accumulators[1]`");
        CHECK(skipped, "out_skipped written by a failing update");
        gradacc_scaler_stats_t after = GRADACC_SCALER_STATS_INIT;
        REQUIRE_OK(gradacc_scaler_stats(s, &after));
        REQUIRE_OK(gradacc_scaler_scale(s, &f));
        CHECK(memcmp(&before, &after, sizeof before) == 0 && f == SCALE, "a failing update changed the scaler");
        EXPECT_OK(gradacc_scaler_update(s, list, 1, NULL)); /* out_skipped may be NULL */
        REQUIRE_OK(gradacc_scaler_stats(s, &after));
        CHECK(after.steps == before.steps + 1, "steps %llu", (unsigned long long)after.steps);
    }

    /* save / load arguments */
    {
        size_t need = 0, len = 999;
        REQUIRE_OK(gradacc_scaler_save(s, NULL, 0, &need));
        unsigned char buf[512];
        memset(buf, 0xee, sizeof buf);
        EXPECT_ERROR(gradacc_scaler_save(NULL, buf, sizeof buf, &len), GRADACC_STATUS_NULL_ARGUMENT, "`scaler`");
        EXPECT_ERROR(gradacc_scaler_save(s, buf, sizeof buf, NULL), GRADACC_STATUS_NULL_ARGUMENT, "`out_len`");
        EXPECT_ERROR(gradacc_scaler_save(s, buf, need - 1, &len), GRADACC_STATUS_SIZE_MISMATCH, "capacity");
        CHECK(len == 999 && buf[0] == 0xee, "a failing save wrote its outputs");
        REQUIRE_OK(gradacc_scaler_save(s, buf, sizeof buf, &len));
        EXPECT_ERROR(gradacc_scaler_load(NULL, buf, len), GRADACC_STATUS_NULL_ARGUMENT, "`scaler`");
        EXPECT_ERROR(gradacc_scaler_load(s, NULL, len), GRADACC_STATUS_NULL_ARGUMENT, "`bytes`");
        EXPECT_STATUS(gradacc_scaler_load(s, buf, 3), GRADACC_STATUS_CORRUPT_STATE);
        EXPECT_OK(gradacc_scaler_load(s, buf, len));
    }

    /* the scaler and accumulators still work, with exact results */
    add_mb(a, s, 2, 3, &w);
    add_mb(a, s, 3, 5, &w);
    finish(a, &w, "after scaler errors");
    add_mb(b, s, 1, 1, &w);
    finish(b, &w, "second accumulator after scaler errors");
    EXPECT_OK(gradacc_accumulator_destroy(a));
    EXPECT_OK(gradacc_accumulator_destroy(b));
    EXPECT_OK(gradacc_scaler_destroy(s));
}

/* ---- communicator calls --------------------------------------------------------------------- */

static void test_comm_calls(void)
{
    gradacc_comm_t *comms[2] = {SENTINEL_PTR, SENTINEL_PTR};
    EXPECT_ERROR(gradacc_comm_create_local(2, NULL), GRADACC_STATUS_NULL_ARGUMENT, "`out_comms`");
    EXPECT_ERROR(gradacc_comm_create_local(0, comms), GRADACC_STATUS_INVALID_ARGUMENT, "`world_size`");
    EXPECT_ERROR(gradacc_comm_create_local(4097, comms), GRADACC_STATUS_INVALID_ARGUMENT, "`world_size`");
    EXPECT_ERROR(gradacc_comm_create_local(-1, comms), GRADACC_STATUS_INVALID_ARGUMENT, "`world_size` = -1");
    CHECK(comms[0] == SENTINEL_PTR && comms[1] == SENTINEL_PTR, "out_comms written by a failing create");
    REQUIRE_OK(gradacc_comm_create_local(1, comms));
    CHECK(comms[1] == SENTINEL_PTR, "create_local(1) wrote past its one handle");
    int32_t n = 777;
    EXPECT_ERROR(gradacc_comm_rank(NULL, &n), GRADACC_STATUS_NULL_ARGUMENT, "`comm`");
    EXPECT_ERROR(gradacc_comm_rank(comms[0], NULL), GRADACC_STATUS_NULL_ARGUMENT, "`out`");
    EXPECT_ERROR(gradacc_comm_world_size(NULL, &n), GRADACC_STATUS_NULL_ARGUMENT, "`comm`");
    EXPECT_ERROR(gradacc_comm_world_size(comms[0], NULL), GRADACC_STATUS_NULL_ARGUMENT, "`out`");
    CHECK(n == 777, "rank/world_size output written on failure");
    EXPECT_OK(gradacc_comm_rank(comms[0], &n));
    CHECK(n == 0, "rank %d", n);
    EXPECT_OK(gradacc_comm_world_size(comms[0], &n));
    CHECK(n == 1, "world size %d", n);
    /* a one-rank group works as a boundary, also after the errors */
    gradacc_scaler_t *s = scaler_with_scale(SCALE);
    gradacc_accumulator_t *a = new_acc();
    window_ref w;
    memset(&w, 0, sizeof w);
    add_mb(a, s, 1, 3, &w);
    add_mb(a, s, 2, 1, &w);
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    EXPECT_OK(gradacc_accumulator_sync(a, comms[0], &info));
    CHECK(info.total_count == 4, "total_count");
    double got[N0];
    read_master(a, 0, got, N0);
    for (int k = 0; k < N0; k++)
        CHECK_CLOSE(got[k], w.sum[k] / 4.0, 1e-6, "one-rank comm sync element %d", k);
    EXPECT_OK(gradacc_comm_destroy(comms[0]));
    EXPECT_OK(gradacc_accumulator_destroy(a));
    EXPECT_OK(gradacc_scaler_destroy(s));
}

/* ---- sync's collective error paths, two ranks ----------------------------------------------- */

typedef struct {
    int rank;
    gradacc_comm_t *comm;
    gradacc_scaler_t *scaler;
    gradacc_accumulator_t *acc;
    gradacc_status_t st[4];
    double first[N0], local[N0];
} sync_rank;

static void *sync_rank_main(void *arg)
{
    sync_rank *r = arg;
    window_ref w;
    memset(&w, 0, sizeof w);
    /* 1. rank 0 calls sync inside a micro-batch: it fails with WRONG_STATE, rank 1 with
     *    PEER_FAILURE, nothing is reduced; rank 0 then closes its micro-batch and both retry. */
    if (r->rank == 0) {
        REQUIRE_OK(gradacc_accumulator_begin_microbatch(r->acc, 2));
    } else {
        const void *grads[3] = {g0[1], g1[1], g2[1]};
        REQUIRE_OK(gradacc_accumulator_add(r->acc, r->scaler, grads, 3, 2));
    }
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    memset(&info, 0x5a, sizeof info);
    info.struct_size = sizeof info;
    unsigned char untouched[sizeof info];
    memcpy(untouched, &info, sizeof info);
    r->st[0] = gradacc_accumulator_sync(r->acc, r->comm, &info);
    CHECK(memcmp(&info, untouched, sizeof info) == 0, "rank %d: out_info written by a failing sync", r->rank);
    if (r->rank == 0) {
        EXPECT_OK(gradacc_accumulator_add_tensor(r->acc, r->scaler, 0, g0[0], N0));
        EXPECT_OK(gradacc_accumulator_add_tensor(r->acc, r->scaler, 1, g1[0], N1));
        EXPECT_OK(gradacc_accumulator_add_tensor(r->acc, r->scaler, 2, g2[0], N2));
        REQUIRE_OK(gradacc_accumulator_end_microbatch(r->acc));
    }
    r->st[1] = gradacc_accumulator_sync(r->acc, r->comm, &info);
    read_master(r->acc, 0, r->first, N0);
    return NULL;
}

/* Ranks whose accumulators have different layouts: SIZE_MISMATCH on both, windows intact. */
static void *mismatch_rank_main(void *arg)
{
    sync_rank *r = arg;
    const void *grads[3] = {g0[r->rank], g1[r->rank], g2[r->rank]};
    size_t n = r->rank == 0 ? 3 : 1;
    REQUIRE_OK(gradacc_accumulator_add(r->acc, r->scaler, grads, n, 1));
    r->st[2] = gradacc_accumulator_sync(r->acc, r->comm, NULL);
    r->st[3] = gradacc_accumulator_sync(r->acc, NULL, NULL); /* alone, the window is still there */
    read_master(r->acc, 0, r->local, N0);
    return NULL;
}

static void test_sync_across_ranks(void)
{
    gradacc_comm_t *comms[2];
    REQUIRE_OK(gradacc_comm_create_local(2, comms));
    sync_rank r[2];
    memset(r, 0, sizeof r);
    for (int i = 0; i < 2; i++) {
        r[i].rank = i;
        r[i].comm = comms[i];
        r[i].scaler = scaler_with_scale(SCALE);
        r[i].acc = new_acc();
    }
    run_ranks(2, sync_rank_main, r, sizeof r[0]);
    EXPECT_STATUS(r[0].st[0], GRADACC_STATUS_WRONG_STATE);
    EXPECT_STATUS(r[1].st[0], GRADACC_STATUS_PEER_FAILURE);
    EXPECT_OK(r[0].st[1]);
    EXPECT_OK(r[1].st[1]);
    for (int k = 0; k < N0; k++) { /* (2 * mb0 + 2 * mb1) / 4 */
        double want = (1 + 2) * (k + 1) * 0.25 / 2.0;
        CHECK(r[0].first[k] == want && r[1].first[k] == want, "retried sync element %d: %g / %g, expected %g", k,
              r[0].first[k], r[1].first[k], want);
    }
    gradacc_accumulator_destroy(r[1].acc);
    gradacc_tensor_desc_t one = {N0, GRADACC_DTYPE_F32};
    REQUIRE_OK(gradacc_accumulator_create(NULL, &one, 1, NULL, &r[1].acc));
    run_ranks(2, mismatch_rank_main, r, sizeof r[0]);
    for (int i = 0; i < 2; i++) {
        EXPECT_STATUS(r[i].st[2], GRADACC_STATUS_SIZE_MISMATCH);
        EXPECT_OK(r[i].st[3]);
        for (int k = 0; k < N0; k++)
            CHECK(r[i].local[k] == (i + 1) * (k + 1) * 0.25, "rank %d: local window after a failed collective sync: %g",
                  i, r[i].local[k]);
    }
    for (int i = 0; i < 2; i++) {
        EXPECT_OK(gradacc_accumulator_destroy(r[i].acc));
        EXPECT_OK(gradacc_scaler_destroy(r[i].scaler));
        EXPECT_OK(gradacc_comm_destroy(comms[i]));
    }
}

/* ---- status strings, last error, version ---------------------------------------------------- */

static void test_status_strings(void)
{
    static const char *names[18] = {"GRADACC_STATUS_OK",
                                    "GRADACC_STATUS_NULL_ARGUMENT",
                                    "GRADACC_STATUS_INVALID_ARGUMENT",
                                    "GRADACC_STATUS_INVALID_HANDLE",
                                    "GRADACC_STATUS_DTYPE_MISMATCH",
                                    "GRADACC_STATUS_SIZE_MISMATCH",
                                    "GRADACC_STATUS_DEVICE_MISMATCH",
                                    "GRADACC_STATUS_WRONG_STATE",
                                    "GRADACC_STATUS_EMPTY_WINDOW",
                                    "GRADACC_STATUS_SCALE_AT_MINIMUM",
                                    "GRADACC_STATUS_BACKEND_UNAVAILABLE",
                                    "GRADACC_STATUS_COMM_FAILURE",
                                    "GRADACC_STATUS_PEER_FAILURE",
                                    "GRADACC_STATUS_CORRUPT_STATE",
                                    "GRADACC_STATUS_OUT_OF_MEMORY",
                                    "GRADACC_STATUS_INTERNAL",
                                    "GRADACC_STATUS_DEVICE_FAILURE",
                                    "GRADACC_STATUS_TIMEOUT"};
    static const gradacc_status_t codes[18] = {
        GRADACC_STATUS_OK,           GRADACC_STATUS_NULL_ARGUMENT,   GRADACC_STATUS_INVALID_ARGUMENT,
        GRADACC_STATUS_INVALID_HANDLE, GRADACC_STATUS_DTYPE_MISMATCH, GRADACC_STATUS_SIZE_MISMATCH,
        GRADACC_STATUS_DEVICE_MISMATCH, GRADACC_STATUS_WRONG_STATE,   GRADACC_STATUS_EMPTY_WINDOW,
        GRADACC_STATUS_SCALE_AT_MINIMUM, GRADACC_STATUS_BACKEND_UNAVAILABLE, GRADACC_STATUS_COMM_FAILURE,
        GRADACC_STATUS_PEER_FAILURE,  GRADACC_STATUS_CORRUPT_STATE,   GRADACC_STATUS_OUT_OF_MEMORY,
        GRADACC_STATUS_INTERNAL,      GRADACC_STATUS_DEVICE_FAILURE,  GRADACC_STATUS_TIMEOUT};
    for (int i = 0; i < 18; i++) {
        const char *s = gradacc_status_string(codes[i]);
        size_t len = strlen(names[i]);
        CHECK(s != NULL && strncmp(s, names[i], len) == 0 && (s[len] == ':' || s[len] == '\0'),
              "status %d: \"%s\" should start with %s", codes[i], s ? s : "(null)", names[i]);
        CHECK((int)codes[i] == i, "%s = %d", names[i], (int)codes[i]);
    }
    static const int32_t unknown[5] = {18, 19, -1, 1000, INT32_MIN};
    for (int i = 0; i < 5; i++) {
        const char *s = gradacc_status_string(unknown[i]);
        CHECK(s != NULL && strstr(s, "unknown") != NULL, "unknown status %d: \"%s\"", unknown[i], s ? s : "(null)");
    }
}

typedef struct {
    int which;
    pthread_barrier_t *barrier;
    int ok;
} thread_args;

static void *error_thread(void *arg)
{
    thread_args *t = arg;
    const char *initial = gradacc_last_error();
    int fresh = initial != NULL && initial[0] == '\0';
    gradacc_status_t st;
    if (t->which == 0) {
        float f;
        st = gradacc_scaler_scale(NULL, &f);
    } else {
        gradacc_comm_t *c[1];
        st = gradacc_comm_create_local(0, c);
    }
    pthread_barrier_wait(t->barrier); /* both errors happened before either reads */
    const char *msg = gradacc_last_error();
    const char *want = t->which == 0 ? "`scaler`" : "`world_size`";
    const char *other = t->which == 0 ? "world_size" : "scaler";
    /* a successful call leaves the message alone */
    gradacc_scaler_config_t c;
    gradacc_status_t ok_st = gradacc_scaler_config_default(&c);
    const char *msg2 = gradacc_last_error();
    t->ok = fresh && st == (t->which == 0 ? GRADACC_STATUS_NULL_ARGUMENT : GRADACC_STATUS_INVALID_ARGUMENT) &&
            strstr(msg, want) != NULL && strstr(msg, other) == NULL && ok_st == GRADACC_STATUS_OK &&
            strstr(msg2, want) != NULL;
    if (!t->ok)
        fprintf(stderr, "thread %d: fresh %d, status %d, last error \"%s\", after a success \"%s\"\n", t->which, fresh, st,
                msg, msg2);
    pthread_barrier_wait(t->barrier);
    return NULL;
}

static void test_last_error_per_thread(void)
{
    /* the main thread's own error, which the threads must not overwrite */
    EXPECT_ERROR(gradacc_accumulator_num_tensors(NULL, NULL), GRADACC_STATUS_NULL_ARGUMENT, "`acc`");
    pthread_barrier_t barrier;
    pthread_barrier_init(&barrier, NULL, 2);
    thread_args t[2] = {{0, &barrier, 0}, {1, &barrier, 0}};
    run_ranks(2, error_thread, t, sizeof t[0]);
    pthread_barrier_destroy(&barrier);
    CHECK(t[0].ok && t[1].ok, "each thread reads its own last error (%d, %d)", t[0].ok, t[1].ok);
    CHECK(strstr(gradacc_last_error(), "gradacc_accumulator_num_tensors") != NULL &&
              strstr(gradacc_last_error(), "`acc`") != NULL,
          "the main thread's last error was overwritten by another thread's: \"%s\"", gradacc_last_error());
}

static void test_version(void)
{
    CHECK(strcmp(gradacc_version_string(), GRADACC_VERSION_STRING) == 0, "library %s, header %s",
          gradacc_version_string(), GRADACC_VERSION_STRING);
    unsigned want = GRADACC_VERSION_MAJOR * 10000u + GRADACC_VERSION_MINOR * 100u + GRADACC_VERSION_PATCH;
    CHECK(gradacc_version_number() == want, "version number %u, macros give %u", gradacc_version_number(), want);
    CHECK(gradacc_version_number() == (uint32_t)GRADACC_VERSION_NUMBER, "version number %u, GRADACC_VERSION_NUMBER %u",
          gradacc_version_number(), (unsigned)GRADACC_VERSION_NUMBER);
    char buf[64];
    snprintf(buf, sizeof buf, "%d.%d.%d", GRADACC_VERSION_MAJOR, GRADACC_VERSION_MINOR, GRADACC_VERSION_PATCH);
    CHECK(strncmp(GRADACC_VERSION_STRING, buf, strlen(buf)) == 0, "GRADACC_VERSION_STRING %s vs macros %s",
          GRADACC_VERSION_STRING, buf);
}

int main(void)
{
    init_grads();
    test_version();
    test_status_strings();
    test_accumulator_create();
    test_scaler_create();
    test_handles();
    test_accumulator_calls();
    test_scaler_calls();
    test_comm_calls();
    test_sync_across_ranks();
    test_last_error_per_thread();
    return test_finish();
}
