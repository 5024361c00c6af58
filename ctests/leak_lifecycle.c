/* Create/destroy cycles of every object and every error path, run under valgrind (or ASan's leak
 * checker in the sanitizer build): scalers, accumulators (owned and adopted buffers), in-process
 * communicator groups, saved scaler and window state, failing calls (whose per-thread message is
 * replaced each time) and threads that fail a call and exit. Nothing may leak, and 10,000 cycles
 * must not grow the heap: destroyed handles leave nothing behind in the handle registry. */
#include "common.h"

#include <malloc.h>

enum { CYCLES = 10000, WARMUP = 200 };

static const gradacc_tensor_desc_t descs[2] = {{5, GRADACC_DTYPE_F16}, {3, GRADACC_DTYPE_F32}};

/* One pass over every object's life, with its error paths. */
static void cycle(unsigned i)
{
    gradacc_scaler_t *s = NULL;
    gradacc_scaler_config_t sc;
    REQUIRE_OK(gradacc_scaler_config_default(&sc));
    sc.init_scale = 1024.0f;
    REQUIRE_OK(gradacc_scaler_create(&sc, NULL, &s));

    gradacc_accumulator_t *acc = NULL;
    float adopted[2 * (GRADACC_MASTER_ALIGN / 4)]; /* each tensor padded to the alignment */
    if (i % 2)
        REQUIRE_OK(gradacc_accumulator_create(NULL, descs, 2, NULL, &acc));
    else
        REQUIRE_OK(gradacc_accumulator_create_with_buffer(NULL, descs, 2, NULL, adopted, 2 * (GRADACC_MASTER_ALIGN / 4), &acc));

    size_t world = 1 + i % 3;
    gradacc_comm_t *comms[3] = {NULL, NULL, NULL};
    REQUIRE_OK(gradacc_comm_create_local(world, comms));

    uint16_t g0[5];
    float g1[3];
    for (int k = 0; k < 5; k++)
        g0[k] = f32_to_f16_bits((float)(k + 1) * 1024.0f);
    for (int k = 0; k < 3; k++)
        g1[k] = (float)(k - 1) * 1024.0f;
    const void *grads[2] = {g0, g1};
    REQUIRE_OK(gradacc_accumulator_add(acc, s, grads, 2, 4));

    /* saved state, into buffers the caller allocates and frees */
    size_t len = 0;
    REQUIRE_OK(gradacc_accumulator_save_window(acc, NULL, 0, &len));
    uint8_t *window = malloc(len);
    REQUIRE_OK(gradacc_accumulator_save_window(acc, window, len, &len));
    REQUIRE_OK(gradacc_accumulator_load_window(acc, window, len));
    window[len / 2] ^= 1;
    EXPECT_STATUS(gradacc_accumulator_load_window(acc, window, len), GRADACC_STATUS_CORRUPT_STATE);
    free(window);

    REQUIRE_OK(gradacc_scaler_save(s, NULL, 0, &len));
    uint8_t *state = malloc(len);
    REQUIRE_OK(gradacc_scaler_save(s, state, len, &len));
    REQUIRE_OK(gradacc_scaler_load(s, state, len));
    EXPECT_STATUS(gradacc_scaler_load(s, state, len - 1), GRADACC_STATUS_CORRUPT_STATE);
    free(state);

    /* error paths: each replaces the thread's last-error message */
    EXPECT_STATUS(gradacc_accumulator_add(acc, s, grads, 3, 4), GRADACC_STATUS_SIZE_MISMATCH);
    EXPECT_STATUS(gradacc_accumulator_add(acc, (gradacc_scaler_t *)acc, grads, 2, 4), GRADACC_STATUS_INVALID_HANDLE);
    EXPECT_STATUS(gradacc_accumulator_end_microbatch(acc), GRADACC_STATUS_WRONG_STATE);
    EXPECT_STATUS(gradacc_accumulator_create(NULL, descs, 0, NULL, &acc), GRADACC_STATUS_INVALID_ARGUMENT);
    EXPECT_STATUS(gradacc_comm_create_local(0, comms), GRADACC_STATUS_INVALID_ARGUMENT);
    CHECK(gradacc_last_error()[0] != '\0', "an error leaves a message");

    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    REQUIRE_OK(gradacc_accumulator_sync(acc, world == 1 ? comms[0] : NULL, &info));
    bool skipped = true;
    const gradacc_accumulator_t *list[1] = {acc};
    REQUIRE_OK(gradacc_scaler_update(s, list, 1, &skipped));
    CHECK(!skipped && info.total_count == 4, "cycle %u: a finite window of 4 items", i);

    for (size_t r = 0; r < world; r++)
        REQUIRE_OK(gradacc_comm_destroy(comms[r]));
    REQUIRE_OK(gradacc_accumulator_destroy(acc));
    REQUIRE_OK(gradacc_scaler_destroy(s));
    /* destroyed handles are refused, not freed twice */
    EXPECT_STATUS(gradacc_accumulator_destroy(acc), GRADACC_STATUS_INVALID_HANDLE);
    EXPECT_STATUS(gradacc_scaler_destroy(s), GRADACC_STATUS_INVALID_HANDLE);
    EXPECT_STATUS(gradacc_comm_destroy(comms[0]), GRADACC_STATUS_INVALID_HANDLE);
}

/* A thread that fails calls (so it owns a last-error message) and exits. */
static void *failing_thread(void *arg)
{
    (void)arg;
    for (int k = 0; k < 10; k++)
        EXPECT_STATUS(gradacc_scaler_destroy((gradacc_scaler_t *)(uintptr_t)(0x10 + 16 * k)), GRADACC_STATUS_INVALID_HANDLE);
    CHECK(strstr(gradacc_last_error(), "gradacc_scaler_destroy") != NULL, "message on the failing thread");
    return NULL;
}

static size_t heap_in_use(void)
{
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
    return mallinfo2().uordblks;
#else
    return 0;
#endif
}

int main(void)
{
    /* GRADACC_LEAK_CYCLES overrides the cycle count (e.g. for a longer soak). */
    const char *env = getenv("GRADACC_LEAK_CYCLES");
    unsigned cycles = env ? (unsigned)strtoul(env, NULL, 10) : CYCLES;
    for (unsigned i = 0; i < WARMUP; i++)
        cycle(i);
    size_t before = heap_in_use();
    for (unsigned i = 0; i < cycles; i++)
        cycle(i);
    size_t after = heap_in_use();
    /* glibc's heap accounting (zero under valgrind and ASan, which replace malloc: then the leak
     * checkers judge instead). The native run sets GRADACC_HEAP_ACCOUNTING, so it cannot skip. */
    CHECK(before != 0 || getenv("GRADACC_HEAP_ACCOUNTING") == NULL, "no heap accounting in a native run");
    if (before != 0) {
        long growth = (long)after - (long)before;
        printf("heap in use: %zu bytes before, %zu after %u cycles (growth %ld)\n", before, after, cycles, growth);
        CHECK(growth < 64 * 1024, "the heap grew by %ld bytes over %u create/destroy cycles", growth, cycles);
    }
    for (int t = 0; t < 8; t++) {
        pthread_t th;
        if (pthread_create(&th, NULL, failing_thread, NULL) != 0)
            return 1;
        pthread_join(th, NULL);
    }
    printf("%u create/destroy cycles\n", WARMUP + cycles);
    return test_finish();
}
