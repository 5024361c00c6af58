/* Helpers of the timeout and abort tests: a clock, an accumulator holding one known window, and
 * the checks that a failed sync left that window intact and that the failed handle now fails at
 * once. */
#ifndef GRADACC_CTESTS_MPI_TIMEOUT_COMMON_H
#define GRADACC_CTESTS_MPI_TIMEOUT_COMMON_H

#include "mpi/mpi_common.h"

#include <time.h>

enum { TENSOR_NUMEL = 3 * 4096 + 5 };

static inline double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline void sleep_s(double s)
{
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

/* The gradient rank `rank` adds: small integers, exact in f32. */
static inline float grad_value(int rank, size_t i)
{
    return (float)((int)(i % 97) - 48 + rank);
}

/* An accumulator (NORMALIZE_NONE) holding one micro-batch of `items` items from rank `rank`. */
static inline gradacc_accumulator_t *window_of(gradacc_scaler_t *scaler, int rank, uint64_t items)
{
    gradacc_tensor_desc_t t[1] = {{TENSOR_NUMEL, GRADACC_DTYPE_F32}};
    gradacc_accumulator_t *acc = make_acc(t, 1, GRADACC_NORMALIZE_NONE, 0);
    float *g = malloc(TENSOR_NUMEL * sizeof *g);
    for (size_t i = 0; i < TENSOR_NUMEL; i++)
        g[i] = grad_value(rank, i);
    const void *p[1] = {g};
    REQUIRE_OK(gradacc_accumulator_add(acc, scaler, p, 1, items));
    free(g);
    return acc;
}

/* The window of `acc` still holds what window_of added: saved, loaded into a fresh accumulator
 * and synced there alone, it gives the gradient and the item count back. */
static inline void check_window_intact(gradacc_accumulator_t *acc, int rank, uint64_t items, const char *what)
{
    size_t len = 0;
    REQUIRE_OK(gradacc_accumulator_save_window(acc, NULL, 0, &len));
    uint8_t *bytes = malloc(len);
    EXPECT_OK(gradacc_accumulator_save_window(acc, bytes, len, &len));
    gradacc_tensor_desc_t t[1] = {{TENSOR_NUMEL, GRADACC_DTYPE_F32}};
    gradacc_accumulator_t *copy = make_acc(t, 1, GRADACC_NORMALIZE_NONE, 0);
    EXPECT_OK(gradacc_accumulator_load_window(copy, bytes, len));
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    EXPECT_OK(gradacc_accumulator_sync(copy, NULL, &info));
    CHECK(info.total_count == items && info.microbatches == 1, "%s: rank %d: saved window has %llu items in %llu micro-batches",
          what, rank, (unsigned long long)info.total_count, (unsigned long long)info.microbatches);
    double *got = malloc(TENSOR_NUMEL * sizeof *got);
    read_master(copy, 0, got, TENSOR_NUMEL);
    size_t bad = 0;
    for (size_t i = 0; i < TENSOR_NUMEL; i++)
        bad += got[i] != (double)grad_value(rank, i);
    CHECK(bad == 0, "%s: rank %d: %zu elements of the saved window differ from what was added", what, rank, bad);
    free(got);
    free(bytes);
    gradacc_accumulator_destroy(copy);
}

/* A sync on a handle that failed fails at once (COMM_FAILURE, "aborted") and keeps the window. */
static inline void check_fails_at_once(gradacc_accumulator_t *acc, gradacc_comm_t *comm, int rank, const char *what)
{
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    double t0 = now_s();
    EXPECT_ERROR(gradacc_accumulator_sync(acc, comm, &info), GRADACC_STATUS_COMM_FAILURE, "aborted");
    double took = now_s() - t0;
    CHECK(took < 0.05, "%s: rank %d: a sync on the failed handle took %.3f s", what, rank, took);
}

#endif
