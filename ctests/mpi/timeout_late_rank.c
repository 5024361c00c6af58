/* mpi-np: 2 4 */
/* A rank that arrives late, past the communicator's timeout, never makes the others wait forever.
 * The last rank sleeps 2 s before its sync; with a timeout of 0.5 s every other rank's sync
 * fails with GRADACC_STATUS_TIMEOUT within the timeout + 1 s, naming the control exchange, and
 * keeps its window (the control exchange comes before any reduction); a second sync on the same
 * handle fails at once with COMM_FAILURE. The late rank's own sync then fails too: it times out
 * in the control exchange, or in the share reduction if the others' abandoned control requests
 * matched its own, where over shared memory the others' abort stops it at once (COMM_FAILURE),
 * and so does across hosts the beacon's news of it, which may also reach another waiting rank
 * just before its own timeout. Every rank finalises MPI: mpirun ends with 0. */
#include "mpi/timeout_common.h"

#include <stdlib.h>

static const double TIMEOUT = 0.5, LATE = 2.0;

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    const int rank = world_rank(), world = world_size(), late = world - 1;
    gradacc_comm_t *comm = comm_of(MPI_COMM_WORLD);
    double t = 0.0;
    EXPECT_OK(gradacc_comm_timeout(comm, &t));
    CHECK(t == 600.0, "default timeout %g s, expected 600", t);
    EXPECT_OK(gradacc_comm_set_timeout(comm, TIMEOUT));
    EXPECT_OK(gradacc_comm_timeout(comm, &t));
    CHECK(t == TIMEOUT, "timeout %g s after setting %g", t, TIMEOUT);
    gradacc_scaler_t *scaler = scaler_with_scale(1.0f);

    /* A healthy boundary under the short timeout. */
    gradacc_accumulator_t *acc = window_of(scaler, rank, 5);
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    EXPECT_OK(gradacc_accumulator_sync(acc, comm, &info));
    CHECK(info.total_count == 5u * (uint64_t)world, "healthy sync: %llu items", (unsigned long long)info.total_count);
    gradacc_accumulator_destroy(acc);

    /* The late rank. */
    acc = window_of(scaler, rank, 7 + (uint64_t)rank);
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == late) {
        sleep_s(LATE);
        gradacc_status_t st = gradacc_accumulator_sync(acc, comm, &info);
        /* COMM_FAILURE: the others' abort, over shared memory or (across hosts) the beacon's news. */
        CHECK(st == GRADACC_STATUS_TIMEOUT ||
                  (st == GRADACC_STATUS_COMM_FAILURE && (strstr(gradacc_last_error(), "another rank") ||
                                                         strstr(gradacc_last_error(), "aborted the communicator"))),
              "late rank: sync returned %d, expected TIMEOUT, or COMM_FAILURE from another rank (%s)", (int)st,
              gradacc_last_error());
        CHECK(strstr(gradacc_last_error(), "control exchange") || strstr(gradacc_last_error(), "share reduction"),
              "late rank: the error names no phase: %s", gradacc_last_error());
        if (rank == 0 || world == 2)
            printf("late rank %d: %s\n", rank, gradacc_last_error());
    } else {
        double t0 = now_s();
        gradacc_status_t st = gradacc_accumulator_sync(acc, comm, &info);
        double took = now_s() - t0;
        /* Across hosts a rank may hear of another's timeout (the beacon's news) just before its own. */
        const int news = st == GRADACC_STATUS_COMM_FAILURE && strstr(gradacc_last_error(), "aborted the communicator");
        CHECK(st == GRADACC_STATUS_TIMEOUT || news, "rank %d: sync returned %d, expected TIMEOUT (%s)", rank, (int)st,
              gradacc_last_error());
        CHECK(took >= (news ? 0.8 : 1.0) * TIMEOUT && took < TIMEOUT + 1.0,
              "rank %d: the sync failed after %.3f s, timeout %.1f s", rank, took, TIMEOUT);
        CHECK(strstr(gradacc_last_error(), "control exchange") != NULL, "rank %d: the error names no phase: %s", rank,
              gradacc_last_error());
        CHECK(news || strstr(gradacc_last_error(), "waited") != NULL, "rank %d: the error does not say how long it waited: %s",
              rank, gradacc_last_error());
        if (rank == 0)
            printf("rank 0 after %.3f s: %s\n", took, gradacc_last_error());
        check_window_intact(acc, rank, 7 + (uint64_t)rank, "after the timeout");
        check_fails_at_once(acc, comm, rank, "after the timeout");
        check_window_intact(acc, rank, 7 + (uint64_t)rank, "after the second sync");
    }
    /* Aborting again is harmless, and the handle is destroyed without waiting for anything. */
    EXPECT_OK(gradacc_comm_abort(comm));
    double t0 = now_s();
    gradacc_accumulator_destroy(acc);
    EXPECT_OK(gradacc_comm_destroy(comm));
    CHECK(now_s() - t0 < 0.5, "rank %d: destroying the failed communicator took %.3f s", rank, now_s() - t0);

    /* A fresh communicator on the same processes works. */
    comm = comm_of(MPI_COMM_WORLD);
    acc = window_of(scaler, rank, 1);
    EXPECT_OK(gradacc_accumulator_sync(acc, comm, &info));
    CHECK(info.total_count == (uint64_t)world, "a fresh communicator: %llu items", (unsigned long long)info.total_count);
    gradacc_accumulator_destroy(acc);
    EXPECT_OK(gradacc_comm_destroy(comm));
    gradacc_scaler_destroy(scaler);
    return mpi_finish();
}
