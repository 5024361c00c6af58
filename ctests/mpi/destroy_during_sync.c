/* mpi-np: 2 */
/* Destroys while another thread is blocked in a sync, over MPI with no timeout (0: wait forever).
 * Rank 0 syncs on a second thread while no other rank syncs:
 * 1. gradacc_accumulator_destroy of the syncing accumulator is refused with WRONG_STATE, and the
 *    accumulator stays usable;
 * 2. gradacc_comm_destroy of its communicator fails the sync with COMM_FAILURE within 1 s (and
 *    waits until the sync is done with it); the window is intact (the control exchange never
 *    completed) and the accumulator is then destroyed normally.
 * Every rank then meets at a barrier and finalises MPI: mpirun ends with 0. */
#include "mpi/timeout_common.h"

#include <pthread.h>

struct syncing {
    gradacc_accumulator_t *acc;
    gradacc_comm_t *comm;
    gradacc_status_t status;
    char message[512];
    double returned_at;
    volatile int done;
};

static void *sync_thread(void *arg)
{
    struct syncing *s = arg;
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    s->status = gradacc_accumulator_sync(s->acc, s->comm, &info);
    snprintf(s->message, sizeof s->message, "%s", gradacc_last_error());
    s->returned_at = now_s();
    __atomic_store_n(&s->done, 1, __ATOMIC_RELEASE);
    return NULL;
}

int main(int argc, char **argv)
{
    int provided = 0;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    const int rank = world_rank();
    if (provided != MPI_THREAD_MULTIPLE) {
        fprintf(stderr, "this MPI has no MPI_THREAD_MULTIPLE; skipping\n");
        MPI_Finalize();
        return 77;
    }
    gradacc_scaler_t *scaler = scaler_with_scale(1.0f);
    gradacc_comm_t *comm = comm_of(MPI_COMM_WORLD);
    EXPECT_OK(gradacc_comm_set_timeout(comm, 0.0));
    gradacc_accumulator_t *acc = window_of(scaler, rank, 5);
    if (rank == 0) {
        struct syncing s = {acc, comm, GRADACC_STATUS_OK, "", 0.0, 0};
        pthread_t th;
        pthread_create(&th, NULL, sync_thread, &s);
        sleep_s(0.3);
        CHECK(!__atomic_load_n(&s.done, __ATOMIC_ACQUIRE), "the sync returned %d with no peer: %s", (int)s.status,
              s.message);

        /* 1. The accumulator cannot go while its sync runs. */
        EXPECT_ERROR(gradacc_accumulator_destroy(acc), GRADACC_STATUS_WRONG_STATE, "in a sync on another thread");
        size_t n = 0;
        EXPECT_OK(gradacc_accumulator_num_tensors(acc, &n));
        CHECK(n == 1, "the refused accumulator has %zu tensors", n);

        /* 2. The communicator can: the sync fails first. */
        double t0 = now_s();
        gradacc_status_t st = gradacc_comm_destroy(comm);
        double destroyed_at = now_s();
        CHECK(st == GRADACC_STATUS_OK, "destroy returned %d: %s", (int)st, gradacc_last_error());
        /* Bounded: without the fix the sync never returns. */
        while (!__atomic_load_n(&s.done, __ATOMIC_ACQUIRE) && now_s() - t0 < 10.0)
            sleep_s(0.01);
        if (!__atomic_load_n(&s.done, __ATOMIC_ACQUIRE)) {
            fprintf(stderr, "FAIL: the sync still waits 10 s after its communicator was destroyed\n");
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
        pthread_join(th, NULL);
        CHECK(s.status == GRADACC_STATUS_COMM_FAILURE, "the sync returned %d, expected COMM_FAILURE (%s)", (int)s.status,
              s.message);
        CHECK(s.returned_at - t0 < 1.0, "the sync returned %.3f s after the destroy began", s.returned_at - t0);
        printf("rank 0: destroy took %.3f s; the sync returned: %s\n", destroyed_at - t0, s.message);
        check_window_intact(acc, rank, 5, "after the destroy during the sync");
        EXPECT_ERROR(gradacc_comm_abort(comm), GRADACC_STATUS_INVALID_HANDLE, "not a live");
        EXPECT_OK(gradacc_accumulator_destroy(acc));
    } else {
        EXPECT_OK(gradacc_accumulator_destroy(acc));
        EXPECT_OK(gradacc_comm_destroy(comm));
    }
    gradacc_scaler_destroy(scaler);
    MPI_Barrier(MPI_COMM_WORLD);
    return mpi_finish();
}
