/* mpi-np: 2 */
/* A real MPI failure comes back as GRADACC_STATUS_COMM_FAILURE with MPI's own error text, not as
 * an abort: every communicator gradacc creates is an MPI_Comm_dup, and once the program holds as
 * many communicators as the MPI library has context ids (65532 in Open MPI 4.1, with its default
 * ob1 messaging layer), the duplication fails. The failure goes through the error handler of the
 * program's communicator, set here to MPI_ERRORS_RETURN. Once the program frees its own
 * communicators, gradacc_comm_create_mpi works again and so does a boundary. */
#include "mpi/mpi_common.h"

/* A bound on the search, far above any MPI library's number of context ids. */
enum { MAX_COMMS = 1 << 20 };

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    const int world = world_size();
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);

    /* Use up the context ids. Every rank stops at the same count: the duplication is collective
     * and agrees on the id. */
    MPI_Comm *held = malloc(MAX_COMMS * sizeof *held);
    if (!held) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    int n = 0;
    while (n < MAX_COMMS && MPI_Comm_dup(MPI_COMM_WORLD, &held[n]) == MPI_SUCCESS)
        n++;
    if (n == MAX_COMMS) {
        fprintf(stderr, "this MPI library never ran out of communicators; skipping\n");
        for (int i = 0; i < n; i++)
            MPI_Comm_free(&held[i]);
        free(held);
        MPI_Finalize();
        return 77;
    }

    gradacc_comm_t *comm = NULL;
    EXPECT_ERROR(gradacc_comm_create_mpi(GRADACC_MPI_COMM_WORLD, NULL, &comm), GRADACC_STATUS_COMM_FAILURE,
                 "MPI_Comm_dup failed");
    CHECK(comm == NULL, "output written on failure");
    EXPECT_ERROR(gradacc_comm_create_mpi((int64_t)MPI_Comm_c2f(held[0]), NULL, &comm), GRADACC_STATUS_COMM_FAILURE,
                 "MPI_Comm_dup failed");
    CHECK(comm == NULL, "output written on failure");

    /* Free one and gradacc gets it. */
    MPI_Comm_free(&held[--n]);
    REQUIRE_OK(gradacc_comm_create_mpi(GRADACC_MPI_COMM_WORLD, NULL, &comm));
    gradacc_scaler_t *scaler = scaler_with_scale(1.0f);
    gradacc_tensor_desc_t t[1] = {{3, GRADACC_DTYPE_F32}};
    gradacc_accumulator_t *acc = make_acc(t, 1, GRADACC_NORMALIZE_NONE, 0);
    float g[3] = {1, 2, 3};
    const void *p[1] = {g};
    REQUIRE_OK(gradacc_accumulator_add(acc, scaler, p, 1, 1));
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    REQUIRE_OK(gradacc_accumulator_sync(acc, comm, &info));
    double got[3];
    read_master(acc, 0, got, 3);
    CHECK(got[0] == world && got[2] == 3.0 * world, "after the failures: %g %g, expected %d %d", got[0], got[2], world,
          3 * world);

    gradacc_accumulator_destroy(acc);
    gradacc_scaler_destroy(scaler);
    EXPECT_OK(gradacc_comm_destroy(comm));
    for (int i = 0; i < n; i++)
        MPI_Comm_free(&held[i]);
    free(held);
    if (world_rank() == 0)
        printf("%d communicators held: gradacc_comm_create_mpi failed with COMM_FAILURE, then worked once one was freed\n", n);
    return mpi_finish();
}
