/* mpi-np: 2 4 */
/* Misuse across ranks: accumulators of different sizes on different ranks, or an invalid call on
 * one rank, must fail on every rank with the same status, without hanging and without touching
 * the master buffers; afterwards a correct boundary on the same communicator still works. Also
 * the argument checks of gradacc_comm_create_mpi, and an intercommunicator, which it refuses. */
#include "mpi/mpi_common.h"

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    const int rank = world_rank(), world = world_size();
    gradacc_comm_t *comm = comm_of(MPI_COMM_WORLD);
    gradacc_scaler_t *scaler = scaler_with_scale(1.0f);

    /* Sizes differ: rank r has 4 + (r == last) elements. */
    size_t n = 4 + (rank == world - 1);
    gradacc_tensor_desc_t t[1] = {{n, GRADACC_DTYPE_F32}};
    gradacc_accumulator_t *bad = make_acc(t, 1, GRADACC_NORMALIZE_NONE, 0);
    float g[5] = {1, 2, 3, 4, 5};
    const void *p[1] = {g};
    REQUIRE_OK(gradacc_accumulator_add(bad, scaler, p, 1, 1));
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    EXPECT_ERROR(gradacc_accumulator_sync(bad, comm, &info), GRADACC_STATUS_SIZE_MISMATCH, "differ");
    double got[5] = {0};
    read_master(bad, 0, got, n);
    CHECK(got[0] == 1 && got[n - 1] == (double)n, "rank %d: the failed sync changed the master", rank);

    /* An invalid call on rank 0 only (sync inside a micro-batch): the others get PEER_FAILURE. */
    gradacc_tensor_desc_t t4[1] = {{4, GRADACC_DTYPE_F32}};
    gradacc_accumulator_t *acc = make_acc(t4, 1, GRADACC_NORMALIZE_NONE, 0);
    REQUIRE_OK(gradacc_accumulator_add(acc, scaler, p, 1, 1));
    if (rank == 0) {
        REQUIRE_OK(gradacc_accumulator_begin_microbatch(acc, 1));
        EXPECT_STATUS(gradacc_accumulator_sync(acc, comm, &info), GRADACC_STATUS_WRONG_STATE);
        REQUIRE_OK(gradacc_accumulator_end_microbatch(acc));
    } else {
        EXPECT_STATUS(gradacc_accumulator_sync(acc, comm, &info), GRADACC_STATUS_PEER_FAILURE);
    }

    /* The communicator is still usable: a correct boundary sums the accumulated window. */
    REQUIRE_OK(gradacc_accumulator_sync(acc, comm, &info));
    read_master(acc, 0, got, 4);
    CHECK(got[0] == world && got[3] == 4.0 * world, "rank %d: after the failures %g %g, expected %d %d", rank, got[0],
          got[3], world, 4 * world);

    /* Arguments. */
    gradacc_comm_t *c = NULL;
    EXPECT_ERROR(gradacc_comm_create_mpi(GRADACC_MPI_COMM_WORLD, NULL, NULL), GRADACC_STATUS_NULL_ARGUMENT, "out_comm");
    EXPECT_ERROR(gradacc_comm_create_mpi(-2, NULL, &c), GRADACC_STATUS_INVALID_ARGUMENT, "fortran_comm");
    EXPECT_ERROR(gradacc_comm_create_mpi((int64_t)1 << 40, NULL, &c), GRADACC_STATUS_INVALID_ARGUMENT, "MPI_Fint");
    gradacc_mpi_config_t cfg;
    REQUIRE_OK(gradacc_mpi_config_default(&cfg));
    cfg.struct_size = 3;
    EXPECT_ERROR(gradacc_comm_create_mpi(GRADACC_MPI_COMM_WORLD, &cfg, &c), GRADACC_STATUS_INVALID_ARGUMENT, "struct_size");
    CHECK(c == NULL, "output written on failure");

    /* An intercommunicator between the lower and the upper half of the ranks: its collectives
     * combine the other group's data, so it cannot be a data-parallel group. */
    MPI_Comm half, inter;
    int upper = rank >= world / 2;
    MPI_Comm_split(MPI_COMM_WORLD, upper, rank, &half);
    MPI_Intercomm_create(half, 0, MPI_COMM_WORLD, upper ? 0 : world / 2, 17, &inter);
    EXPECT_ERROR(gradacc_comm_create_mpi((int64_t)MPI_Comm_c2f(inter), NULL, &c), GRADACC_STATUS_INVALID_ARGUMENT,
                 "intercommunicator");
    CHECK(c == NULL, "output written on failure");
    MPI_Comm_free(&inter);
    MPI_Comm_free(&half);

    bool avail = false;
    EXPECT_OK(gradacc_backend_available(GRADACC_BACKEND_MPI, &avail));
    CHECK(avail, "an MPI build must report the MPI backend");

    gradacc_accumulator_destroy(bad);
    gradacc_accumulator_destroy(acc);
    gradacc_scaler_destroy(scaler);
    EXPECT_OK(gradacc_comm_destroy(comm));
    EXPECT_STATUS(gradacc_comm_destroy(comm), GRADACC_STATUS_INVALID_HANDLE);
    return mpi_finish();
}
