/* Config structs across header versions: a caller built against an older gradacc.h passes a
 * shorter struct (its struct_size is the sizeof of the fields it knows). Every size that ends on a
 * field is accepted, and the fields past it take their defaults; a size inside a field, 0, or one
 * larger than this library's struct (a newer header) is refused with a message naming the argument
 * and the value. The older structs are declared here, as an old header would have them, and passed
 * by cast. Output structs follow the same rule: the library writes only the fields the caller's
 * struct_size covers. */
#include "common.h"

#include <stddef.h>

/* gradacc_accumulator_config_t cut after max_grad_norm: no bucket_numel, no threads. */
typedef struct {
    size_t struct_size;
    gradacc_loss_reduction_t loss_reduction;
    gradacc_normalize_t normalize;
    float max_grad_norm;
} old_accumulator_config_t;

/* gradacc_scaler_config_t cut after growth_factor. */
typedef struct {
    size_t struct_size;
    float init_scale;
    float growth_factor;
} old_scaler_config_t;

/* Cut after init_scale: sizeof is 16, the end of growth_factor, so only the unpadded size (12)
 * says that growth_factor is missing. */
typedef struct {
    size_t struct_size;
    float init_scale;
} older_scaler_config_t;

/* Only the size: every field takes its default. */
typedef struct {
    size_t struct_size;
} bare_config_t;

/* A config from a newer header, with a field this library does not know. */
typedef struct {
    gradacc_scaler_config_t known;
    uint64_t newer_field;
} newer_scaler_config_t;

static float scale_of(const gradacc_scaler_t *s)
{
    float scale = 0;
    REQUIRE_OK(gradacc_scaler_scale(s, &scale));
    return scale;
}

static void older_scaler_config(void)
{
    old_scaler_config_t old = {sizeof old, 1024.0f, 4.0f};
    gradacc_scaler_t *s = NULL;
    EXPECT_OK(gradacc_scaler_create((const gradacc_scaler_config_t *)&old, NULL, &s));
    CHECK(scale_of(s) == 1024.0f, "init_scale from the older struct: %g", scale_of(s));
    EXPECT_OK(gradacc_scaler_destroy(s));

    /* The unpadded end of a field is a boundary too (offsetof + sizeof). */
    older_scaler_config_t older = {offsetof(older_scaler_config_t, init_scale) + sizeof(float), 512.0f};
    s = NULL;
    EXPECT_OK(gradacc_scaler_create((const gradacc_scaler_config_t *)&older, NULL, &s));
    CHECK(s != NULL && scale_of(s) == 512.0f, "unpadded size %zu", older.struct_size);
    EXPECT_OK(gradacc_scaler_destroy(s));

    bare_config_t bare = {sizeof bare};
    gradacc_scaler_config_t d;
    REQUIRE_OK(gradacc_scaler_config_default(&d));
    s = NULL;
    EXPECT_OK(gradacc_scaler_create((const gradacc_scaler_config_t *)&bare, NULL, &s));
    CHECK(scale_of(s) == d.init_scale, "only struct_size: the default scale, got %g", scale_of(s));
    EXPECT_OK(gradacc_scaler_destroy(s));
}

static void older_accumulator_config(void)
{
    /* Sum-reduced, not normalised, clipped to norm 1: a gradient of norm 5 comes out scaled by 1/5,
     * so every field of the older struct was read. */
    old_accumulator_config_t old = {sizeof old, GRADACC_LOSS_REDUCTION_SUM, GRADACC_NORMALIZE_NONE, 1.0f};
    gradacc_tensor_desc_t t[1] = {{2, GRADACC_DTYPE_F32}};
    gradacc_accumulator_t *acc = NULL;
    REQUIRE_OK(gradacc_accumulator_create((const gradacc_accumulator_config_t *)&old, t, 1, NULL, &acc));
    gradacc_scaler_t *s = scaler_with_scale(1.0f);
    const float g[2] = {3.0f, 4.0f};
    const void *grads[1] = {g};
    EXPECT_OK(gradacc_accumulator_add(acc, s, grads, 1, 4));
    EXPECT_OK(gradacc_accumulator_sync(acc, NULL, NULL));
    float *m = NULL;
    size_t n = 0;
    EXPECT_OK(gradacc_accumulator_master(acc, 0, &m, &n));
    CHECK(n == 2 && fabsf(m[0] - 0.6f) < 1e-6f && fabsf(m[1] - 0.8f) < 1e-6f, "master %g %g", m[0], m[1]);
    EXPECT_OK(gradacc_accumulator_destroy(acc));
    EXPECT_OK(gradacc_scaler_destroy(s));
}

static void refused_sizes(void)
{
    gradacc_scaler_t *s = (gradacc_scaler_t *)0x5;
    newer_scaler_config_t newer;
    REQUIRE_OK(gradacc_scaler_config_default(&newer.known));
    newer.known.struct_size = sizeof newer;
    newer.newer_field = 1;
    char want[64];
    snprintf(want, sizeof want, "`config`.struct_size = %zu", sizeof newer);
    EXPECT_ERROR(gradacc_scaler_create(&newer.known, NULL, &s), GRADACC_STATUS_INVALID_ARGUMENT, want);
    CHECK(strstr(gradacc_last_error(), "newer") != NULL, "the message says the header is newer");

    old_scaler_config_t inside = {sizeof(size_t) + 2, 8.0f, 2.0f}; /* ends inside init_scale */
    snprintf(want, sizeof want, "`config`.struct_size = %zu", inside.struct_size);
    EXPECT_ERROR(gradacc_scaler_create((const gradacc_scaler_config_t *)&inside, NULL, &s),
                 GRADACC_STATUS_INVALID_ARGUMENT, want);

    bare_config_t zero = {0};
    EXPECT_ERROR(gradacc_scaler_create((const gradacc_scaler_config_t *)&zero, NULL, &s),
                 GRADACC_STATUS_INVALID_ARGUMENT, "`config`.struct_size = 0");
    /* The message names what sets the size: a config's default function. */
    EXPECT_ERROR(gradacc_scaler_create((const gradacc_scaler_config_t *)&zero, NULL, &s),
                 GRADACC_STATUS_INVALID_ARGUMENT, "(gradacc_scaler_config_default() does)");
    CHECK(s == (gradacc_scaler_t *)0x5, "output written on failure");

    old_accumulator_config_t acc_inside = {sizeof(size_t) + 6, GRADACC_LOSS_REDUCTION_MEAN, GRADACC_NORMALIZE_BY_COUNT, 0};
    gradacc_tensor_desc_t t[1] = {{2, GRADACC_DTYPE_F32}};
    gradacc_accumulator_t *acc = (gradacc_accumulator_t *)0x5;
    EXPECT_ERROR(gradacc_accumulator_create((const gradacc_accumulator_config_t *)&acc_inside, t, 1, NULL, &acc),
                 GRADACC_STATUS_INVALID_ARGUMENT, "`config`.struct_size = 14");
    CHECK(acc == (gradacc_accumulator_t *)0x5, "output written on failure");
}

/* gradacc_sync_info_t as an older header might have had it, followed by bytes that must stay. */
typedef struct {
    size_t struct_size;
    bool found_inf;
    uint64_t total_count;
} old_sync_info_t;

typedef struct {
    old_sync_info_t info;
    unsigned char canary[64];
} guarded_sync_info_t;

static void older_output_structs(void)
{
    gradacc_tensor_desc_t t[1] = {{2, GRADACC_DTYPE_F32}};
    gradacc_accumulator_t *acc = NULL;
    REQUIRE_OK(gradacc_accumulator_create(NULL, t, 1, NULL, &acc));
    gradacc_scaler_t *s = scaler_with_scale(1.0f);
    const float g[2] = {1.0f, 2.0f};
    const void *grads[1] = {g};

    guarded_sync_info_t out;
    memset(&out, 0xee, sizeof out);
    out.info.struct_size = sizeof out.info;
    EXPECT_OK(gradacc_accumulator_add(acc, s, grads, 1, 3));
    EXPECT_OK(gradacc_accumulator_sync(acc, NULL, (gradacc_sync_info_t *)&out.info));
    CHECK(out.info.struct_size == sizeof out.info, "struct_size changed to %zu", out.info.struct_size);
    CHECK(!out.info.found_inf && out.info.total_count == 3, "found_inf %d total_count %llu", out.info.found_inf,
          (unsigned long long)out.info.total_count);
    int intact = 1;
    for (size_t i = 0; i < sizeof out.canary; i++)
        intact &= out.canary[i] == 0xee;
    CHECK(intact, "bytes past the caller's struct_size were written");

    /* 0, inside a field, larger than the library's: refused before anything happens, the window stays. */
    const size_t bad[3] = {0, sizeof(size_t) + 4, sizeof(gradacc_sync_info_t) + 8};
    for (int i = 0; i < 3; i++) {
        memset(&out, 0xee, sizeof out);
        out.info.struct_size = bad[i];
        char want[64];
        snprintf(want, sizeof want, "`out_info`.struct_size = %zu", bad[i]);
        EXPECT_OK(gradacc_accumulator_add(acc, s, grads, 1, 1));
        EXPECT_ERROR(gradacc_accumulator_sync(acc, NULL, (gradacc_sync_info_t *)&out.info),
                     GRADACC_STATUS_INVALID_ARGUMENT, want);
        CHECK(out.info.total_count == 0xeeeeeeeeeeeeeeeeull, "written on failure");
        EXPECT_OK(gradacc_accumulator_reset(acc));
    }

    /* The scaler's statistics: cut after `steps`; then refused sizes. */
    struct {
        size_t struct_size;
        uint64_t steps;
        uint64_t canary;
    } st = {sizeof(size_t) + sizeof(uint64_t), 99, 7};
    EXPECT_OK(gradacc_scaler_stats(s, (gradacc_scaler_stats_t *)&st));
    CHECK(st.steps == 0 && st.canary == 7, "steps %llu, canary %llu", (unsigned long long)st.steps,
          (unsigned long long)st.canary);
    st.struct_size = 0;
    EXPECT_ERROR(gradacc_scaler_stats(s, (gradacc_scaler_stats_t *)&st), GRADACC_STATUS_INVALID_ARGUMENT,
                 "`out`.struct_size = 0");
    /* An output struct's is its *_INIT macro. */
    EXPECT_ERROR(gradacc_scaler_stats(s, (gradacc_scaler_stats_t *)&st), GRADACC_STATUS_INVALID_ARGUMENT,
                 "(GRADACC_SCALER_STATS_INIT does)");
    gradacc_scaler_stats_t full = GRADACC_SCALER_STATS_INIT;
    full.struct_size += 8;
    EXPECT_ERROR(gradacc_scaler_stats(s, &full), GRADACC_STATUS_INVALID_ARGUMENT, "`out`.struct_size");

    EXPECT_OK(gradacc_accumulator_destroy(acc));
    EXPECT_OK(gradacc_scaler_destroy(s));
}

/* 0.1's gradacc_mpi_config_t had an ignored max_in_flight where 0.2 has shared_memory (0 or 1):
 * a 0.1 struct with its default of 8 is refused, naming the field (before the backend is looked
 * at), and so is any value but 0 and 1. */
static void removed_mpi_field(void)
{
    struct {
        size_t struct_size;
        uint32_t max_in_flight;
    } v01 = {sizeof v01, 8};
    gradacc_comm_t *c = (gradacc_comm_t *)0x5;
    EXPECT_ERROR(gradacc_comm_create_mpi(GRADACC_MPI_COMM_WORLD, (const gradacc_mpi_config_t *)&v01, &c),
                 GRADACC_STATUS_INVALID_ARGUMENT, "`config.shared_memory` = 8");
    CHECK(c == (gradacc_comm_t *)0x5, "output written on failure");
    gradacc_mpi_config_t cfg;
    EXPECT_OK(gradacc_mpi_config_default(&cfg));
    CHECK(cfg.shared_memory == 1, "shared memory is on by default");
    cfg.shared_memory = 2;
    EXPECT_ERROR(gradacc_comm_create_mpi(GRADACC_MPI_COMM_WORLD, &cfg, &c), GRADACC_STATUS_INVALID_ARGUMENT,
                 "`config.shared_memory` = 2");
    CHECK(c == (gradacc_comm_t *)0x5, "output written on failure");
}

int main(void)
{
    older_scaler_config();
    older_accumulator_config();
    refused_sizes();
    older_output_structs();
    removed_mpi_field();
    return test_finish();
}
