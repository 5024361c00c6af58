/* gradacc_backend_available and, in a build without MPI, gradacc_comm_create_mpi's
 * BACKEND_UNAVAILABLE: the header is the same in every build, the answer says what is built in. */
#include "common.h"

int main(void)
{
    bool yes = false;
    EXPECT_OK(gradacc_backend_available(GRADACC_BACKEND_LOCAL, &yes));
    CHECK(yes, "the local backend is in every build");
    EXPECT_OK(gradacc_backend_available(GRADACC_BACKEND_NCCL, &yes));
    CHECK(!yes, "no NCCL backend yet");
    EXPECT_OK(gradacc_backend_available(GRADACC_BACKEND_CUDA, &yes));
    CHECK(!yes, "no CUDA backend yet");
    EXPECT_ERROR(gradacc_backend_available(99, &yes), GRADACC_STATUS_INVALID_ARGUMENT, "backend");
    EXPECT_ERROR(gradacc_backend_available(GRADACC_BACKEND_LOCAL, NULL), GRADACC_STATUS_NULL_ARGUMENT, "out");

    gradacc_mpi_config_t cfg;
    EXPECT_OK(gradacc_mpi_config_default(&cfg));
    CHECK(cfg.struct_size == sizeof cfg && cfg.max_in_flight == 8, "defaults: size %zu, max_in_flight %u",
          cfg.struct_size, cfg.max_in_flight);
    EXPECT_OK(gradacc_backend_available(GRADACC_BACKEND_MPI, &yes));
    if (!yes) {
        gradacc_comm_t *c = NULL;
        EXPECT_ERROR(gradacc_comm_create_mpi(GRADACC_MPI_COMM_WORLD, NULL, &c), GRADACC_STATUS_BACKEND_UNAVAILABLE,
                     "GRADACC_WITH_MPI");
        CHECK(c == NULL, "output written on failure");
    }
    return test_finish();
}
