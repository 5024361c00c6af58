/* The log callback and the diagnostic report: a skipped step and its backoff reach the callback at
 * INFO with the scales, a grown scale only at DEBUG, a dropped micro-batch names its tensor, NULL
 * or GRADACC_LOG_OFF silence it, an unknown level is refused; the report names every part and
 * behaves as snprintf does. */
#include "common.h"

enum { KEPT = 32, LEN = 256 };
typedef struct {
    int count;
    int levels[KEPT];
    char messages[KEPT][LEN];
} sink_t;

static void on_log(void *user, gradacc_log_level_t level, const char *message)
{
    sink_t *s = user;
    if (s->count < KEPT) {
        s->levels[s->count] = level;
        snprintf(s->messages[s->count], LEN, "%s", message);
    }
    s->count++;
}

/* The first message at `level` holding `text`, or -1. */
static int find(const sink_t *s, int level, const char *text)
{
    for (int i = 0; i < s->count && i < KEPT; i++)
        if (s->levels[i] == level && strstr(s->messages[i], text))
            return i;
    return -1;
}

/* One step of one f32 tensor whose gradient is `value` (inf overflows), under `overflow`. */
static void step(gradacc_scaler_t *scaler, float value, gradacc_overflow_t overflow)
{
    gradacc_tensor_desc_t t = {3, GRADACC_DTYPE_F32};
    gradacc_accumulator_config_t c;
    gradacc_accumulator_t *acc = NULL;
    EXPECT_OK(gradacc_accumulator_config_default(&c));
    c.overflow = overflow;
    EXPECT_OK(gradacc_accumulator_create(&c, &t, 1, NULL, &acc));
    float good[3] = {1.0f, 2.0f, 3.0f}, bad[3] = {1.0f, value, 3.0f};
    const void *g1[1] = {good}, *g2[1] = {bad};
    EXPECT_OK(gradacc_accumulator_add(acc, scaler, g1, 1, 1));
    EXPECT_OK(gradacc_accumulator_add(acc, scaler, g2, 1, 1));
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    EXPECT_OK(gradacc_accumulator_sync(acc, NULL, &info));
    const gradacc_accumulator_t *accs[1] = {acc};
    bool skipped = false;
    EXPECT_OK(gradacc_scaler_update(scaler, accs, 1, &skipped));
    EXPECT_OK(gradacc_accumulator_destroy(acc));
}

static void test_levels_and_messages(void)
{
    sink_t s = {0};
    gradacc_scaler_config_t sc;
    gradacc_scaler_t *scaler = NULL;
    EXPECT_OK(gradacc_scaler_config_default(&sc));
    sc.init_scale = 1024.0f;
    sc.growth_interval = 1;
    EXPECT_OK(gradacc_scaler_create(&sc, NULL, &scaler));

    EXPECT_OK(gradacc_set_log_callback(on_log, &s, GRADACC_LOG_INFO));
    step(scaler, INFINITY, GRADACC_OVERFLOW_SKIP_STEP);
    CHECK(find(&s, GRADACC_LOG_INFO, "step 1 skipped") >= 0, "%d messages, first: %s", s.count,
          s.messages[0]);
    CHECK(find(&s, GRADACC_LOG_INFO, "1024 -> 512") >= 0, "the backoff's scales: %s", s.messages[0]);
    int before = s.count;
    step(scaler, 2.0f, GRADACC_OVERFLOW_SKIP_STEP); /* grows 512 -> 1024: DEBUG, not sent */
    CHECK(s.count == before, "a growth at INFO level: %s", s.messages[before < KEPT ? before : 0]);

    EXPECT_OK(gradacc_set_log_callback(on_log, &s, GRADACC_LOG_DEBUG));
    step(scaler, 2.0f, GRADACC_OVERFLOW_SKIP_STEP);
    CHECK(find(&s, GRADACC_LOG_DEBUG, "grew 1024 -> 2048") >= 0, "no growth message in %d", s.count);

    step(scaler, NAN, GRADACC_OVERFLOW_DROP_MICROBATCH);
    CHECK(find(&s, GRADACC_LOG_INFO, "micro-batch 2 of the window dropped: tensor 0") >= 0,
          "no drop message in %d", s.count);

    /* Off, by NULL and by GRADACC_LOG_OFF: nothing more arrives. */
    EXPECT_OK(gradacc_set_log_callback(NULL, NULL, GRADACC_LOG_DEBUG));
    before = s.count;
    step(scaler, INFINITY, GRADACC_OVERFLOW_SKIP_STEP);
    EXPECT_OK(gradacc_set_log_callback(on_log, &s, GRADACC_LOG_OFF));
    step(scaler, INFINITY, GRADACC_OVERFLOW_SKIP_STEP);
    CHECK(s.count == before, "%d messages after turning the callback off", s.count - before);

    /* An unknown level is refused and changes nothing: the callback stays off. */
    EXPECT_STATUS(gradacc_set_log_callback(on_log, &s, 7), GRADACC_STATUS_INVALID_ARGUMENT);
    CHECK(strstr(gradacc_last_error(), "`level` = 7") != NULL, "%s", gradacc_last_error());
    step(scaler, INFINITY, GRADACC_OVERFLOW_SKIP_STEP);
    CHECK(s.count == before, "a refused call turned the callback on");
    EXPECT_OK(gradacc_scaler_destroy(scaler));
}

static void test_diagnostics(void)
{
    size_t needed = 0;
    EXPECT_OK(gradacc_diagnostics(NULL, 0, &needed));
    CHECK(needed > 100, "needed %zu", needed);
    char *full = malloc(needed);
    CHECK(full != NULL, "malloc");
    if (!full)
        return;
    size_t again = 0;
    EXPECT_OK(gradacc_diagnostics(full, needed, &again));
    CHECK(again == needed && strlen(full) == needed - 1, "needed %zu then %zu, length %zu", needed,
          again, strlen(full));
    CHECK(strncmp(full, "gradacc ", 8) == 0, "%s", full);
    CHECK(strstr(full, gradacc_version_string()) != NULL, "no version in %s", full);
    const char *parts[] = {"SIMD path: ", "backends:", "MPI: ", "CUDA: ", "NCCL: ",
                           "libraries:", "NVRTC: ", "GRADACC_CPU_ISA", "GRADACC_LOG"};
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++)
        CHECK(strstr(full, parts[i]) != NULL, "no %s in\n%s", parts[i], full);

    /* Truncated as snprintf truncates: size - 1 characters and a NUL, the whole size told. */
    char small[16];
    memset(small, 'x', sizeof small);
    EXPECT_OK(gradacc_diagnostics(small, sizeof small, &again));
    CHECK(again == needed, "needed %zu, told %zu", needed, again);
    CHECK(small[15] == '\0' && strncmp(small, full, 15) == 0, "truncated to %.16s", small);
    EXPECT_OK(gradacc_diagnostics(small, 1, NULL));
    CHECK(small[0] == '\0', "a buffer of 1 holds only the NUL");
    EXPECT_STATUS(gradacc_diagnostics(NULL, 8, &again), GRADACC_STATUS_NULL_ARGUMENT);
    CHECK(strstr(gradacc_last_error(), "`buf`") != NULL, "%s", gradacc_last_error());
    free(full);
}

int main(void)
{
    test_levels_and_messages();
    test_diagnostics();
    return test_finish();
}
