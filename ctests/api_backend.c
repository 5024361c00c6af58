/* gradacc_backend_available and, where a backend is missing, its constructors' BACKEND_UNAVAILABLE:
 * the header is the same in every build; the answer says what this build and machine can use. */
#include "common.h"

int main(void)
{
    bool yes = false;
    EXPECT_OK(gradacc_backend_available(GRADACC_BACKEND_LOCAL, &yes));
    CHECK(yes, "the local backend is in every build");
    /* CUDA answers for this machine: a CUDA scaler can be created exactly when it says yes. */
    EXPECT_OK(gradacc_backend_available(GRADACC_BACKEND_CUDA, &yes));
    gradacc_device_t cuda = {GRADACC_DEVICE_CUDA, 0, NULL};
    gradacc_scaler_t *s = NULL;
    gradacc_status_t st = gradacc_scaler_create(NULL, &cuda, &s);
    CHECK(yes ? st == GRADACC_STATUS_OK : st == GRADACC_STATUS_BACKEND_UNAVAILABLE,
          "backend_available(CUDA) = %d but creating a CUDA scaler gave %s", yes, gradacc_status_string(st));
    EXPECT_OK(gradacc_scaler_destroy(s));
    bool nccl = false;
    EXPECT_OK(gradacc_backend_available(GRADACC_BACKEND_NCCL, &nccl));
    if (!nccl) {
        gradacc_nccl_unique_id_t id;
        EXPECT_ERROR(gradacc_nccl_unique_id(&id), GRADACC_STATUS_BACKEND_UNAVAILABLE, "NCCL");
    }
    EXPECT_ERROR(gradacc_backend_available(99, &yes), GRADACC_STATUS_INVALID_ARGUMENT, "backend");
    EXPECT_ERROR(gradacc_backend_available(GRADACC_BACKEND_LOCAL, NULL), GRADACC_STATUS_NULL_ARGUMENT, "out");

    gradacc_mpi_config_t cfg;
    EXPECT_OK(gradacc_mpi_config_default(&cfg));
    CHECK(cfg.struct_size == sizeof cfg, "defaults: size %zu", cfg.struct_size);
    EXPECT_OK(gradacc_backend_available(GRADACC_BACKEND_MPI, &yes));
    if (!yes) {
        gradacc_comm_t *c = NULL;
        EXPECT_ERROR(gradacc_comm_create_mpi(GRADACC_MPI_COMM_WORLD, NULL, &c), GRADACC_STATUS_BACKEND_UNAVAILABLE,
                     "GRADACC_WITH_MPI");
        CHECK(c == NULL, "output written on failure");
    }
    return test_finish();
}
