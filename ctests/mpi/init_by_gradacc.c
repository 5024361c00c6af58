/* mpi-np: 2 */
/* The caller never initialises MPI: gradacc does, on the first communicator over MPI_COMM_WORLD.
 * Communicators can then be destroyed and created again, and gradacc finalises MPI at exit (a
 * process that initialised MPI and exits without finalising makes mpirun fail the run). */
#include "mpi/mpi_common.h"

int main(void)
{
    int initialized = 1;
    MPI_Initialized(&initialized);
    CHECK(!initialized, "MPI should not be initialised yet");
    for (int round = 0; round < 2; round++) {
        gradacc_comm_t *comm = NULL;
        REQUIRE_OK(gradacc_comm_create_mpi(GRADACC_MPI_COMM_WORLD, NULL, &comm));
        MPI_Initialized(&initialized);
        CHECK(initialized, "gradacc should have initialised MPI");
        gradacc_scaler_t *scaler = scaler_with_scale(1.0f);
        gradacc_tensor_desc_t t[1] = {{2, GRADACC_DTYPE_F32}};
        gradacc_accumulator_t *acc = make_acc(t, 1, GRADACC_NORMALIZE_NONE, 0);
        float g[2] = {1.0f, 2.0f};
        const void *p[1] = {g};
        REQUIRE_OK(gradacc_accumulator_add(acc, scaler, p, 1, 1));
        gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
        REQUIRE_OK(gradacc_accumulator_sync(acc, comm, &info));
        double got[2] = {0};
        read_master(acc, 0, got, 2);
        CHECK(got[0] == 2.0 && got[1] == 4.0, "round %d: %g %g", round, got[0], got[1]);
        gradacc_accumulator_destroy(acc);
        gradacc_scaler_destroy(scaler);
        EXPECT_OK(gradacc_comm_destroy(comm));
    }
    int finalized = 1;
    MPI_Finalized(&finalized);
    CHECK(!finalized, "destroying communicators must not finalise MPI");
    return test_finish(); /* no MPI_Finalize: gradacc's exit handler does it */
}
