/* mpi-np: 2 4 */
/* gradacc_comm_abort never makes a rank wait forever.
 *
 * 1. The last rank aborts its own handle instead of syncing: its later syncs fail at once with
 *    COMM_FAILURE ("aborted"); every other rank's sync fails (TIMEOUT, since MPI cannot tell them)
 *    within the timeout (0.5 s) + 1 s, keeps its window, and then fails at once too.
 * 2. Abort from another thread: rank 0 syncs with no timeout at all (0: wait forever) while no
 *    other rank syncs; a second thread aborts the handle after 0.3 s and the sync returns
 *    COMM_FAILURE within 1 s of that, keeping the window.
 * Every rank destroys its handles and finalises MPI: mpirun ends with 0. */
#include "mpi/timeout_common.h"

#include <pthread.h>

static const double TIMEOUT = 0.5;

static void *abort_later(void *arg)
{
    sleep_s(0.3);
    EXPECT_OK(gradacc_comm_abort((gradacc_comm_t *)arg));
    return NULL;
}

int main(int argc, char **argv)
{
    int provided = 0;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    const int rank = world_rank(), world = world_size(), quitter = world - 1;
    gradacc_scaler_t *scaler = scaler_with_scale(1.0f);
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;

    /* 1. A rank aborts instead of syncing. */
    gradacc_comm_t *comm = comm_of(MPI_COMM_WORLD);
    EXPECT_OK(gradacc_comm_set_timeout(comm, TIMEOUT));
    gradacc_accumulator_t *acc = window_of(scaler, rank, 3 + (uint64_t)rank);
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == quitter) {
        EXPECT_OK(gradacc_comm_abort(comm));
        EXPECT_OK(gradacc_comm_abort(comm));
        check_fails_at_once(acc, comm, rank, "the aborting rank");
        check_window_intact(acc, rank, 3 + (uint64_t)rank, "the aborting rank");
    } else {
        double t0 = now_s();
        gradacc_status_t st = gradacc_accumulator_sync(acc, comm, &info);
        double took = now_s() - t0;
        CHECK(st == GRADACC_STATUS_TIMEOUT || st == GRADACC_STATUS_COMM_FAILURE,
              "rank %d: sync returned %d, expected TIMEOUT or COMM_FAILURE (%s)", rank, (int)st, gradacc_last_error());
        CHECK(took < TIMEOUT + 1.0, "rank %d: the sync failed after %.3f s, timeout %.1f s", rank, took, TIMEOUT);
        CHECK(strstr(gradacc_last_error(), "control exchange") != NULL, "rank %d: the error names no phase: %s", rank,
              gradacc_last_error());
        if (rank == 0)
            printf("rank 0 after %.3f s: %s\n", took, gradacc_last_error());
        check_window_intact(acc, rank, 3 + (uint64_t)rank, "after the peer's abort");
        check_fails_at_once(acc, comm, rank, "after the peer's abort");
    }
    gradacc_accumulator_destroy(acc);
    double t0 = now_s();
    EXPECT_OK(gradacc_comm_destroy(comm));
    CHECK(now_s() - t0 < 0.5, "rank %d: destroying the aborted communicator took %.3f s", rank, now_s() - t0);

    /* 2. Abort from another thread while a sync with no timeout waits. */
    comm = comm_of(MPI_COMM_WORLD);
    EXPECT_OK(gradacc_comm_set_timeout(comm, 0.0));
    double t = -1.0;
    EXPECT_OK(gradacc_comm_timeout(comm, &t));
    CHECK(t == 0.0, "timeout %g after setting 0 (forever)", t);
    acc = window_of(scaler, rank, 2);
    if (rank == 0 && provided == MPI_THREAD_MULTIPLE) {
        pthread_t th;
        t0 = now_s(); /* before the thread starts its 0.3 s sleep, which may begin at once */
        pthread_create(&th, NULL, abort_later, comm);
        gradacc_status_t st = gradacc_accumulator_sync(acc, comm, &info);
        double took = now_s() - t0;
        pthread_join(th, NULL);
        CHECK(st == GRADACC_STATUS_COMM_FAILURE, "sync returned %d, expected COMM_FAILURE (%s)", (int)st,
              gradacc_last_error());
        CHECK(strstr(gradacc_last_error(), "aborted") != NULL, "the error does not say aborted: %s", gradacc_last_error());
        CHECK(took >= 0.3 && took < 1.3, "the sync returned %.3f s after it started, the abort came after 0.3 s", took);
        printf("rank 0, aborted from another thread after %.3f s: %s\n", took, gradacc_last_error());
        check_window_intact(acc, rank, 2, "after the abort from another thread");
        check_fails_at_once(acc, comm, rank, "after the abort from another thread");
    }
    gradacc_accumulator_destroy(acc);
    EXPECT_OK(gradacc_comm_destroy(comm));
    gradacc_scaler_destroy(scaler);
    return mpi_finish();
}
