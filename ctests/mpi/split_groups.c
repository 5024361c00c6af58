/* mpi-np: 4 */
/* A communicator adopted from the caller's MPI_Comm_split: ranks {0,1} and {2,3} form two groups.
 * Each reduces only within its group (sums 1+2 and 3+4), and the caller's communicator is freed
 * right after gradacc adopted it (gradacc works on its own duplicate). */
#include "mpi/mpi_common.h"

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    const int rank = world_rank();
    MPI_Comm half;
    MPI_Comm_split(MPI_COMM_WORLD, rank / 2, rank, &half);
    gradacc_comm_t *comm = comm_of(half);
    MPI_Comm_free(&half);
    int32_t r = 99, n = 99;
    EXPECT_OK(gradacc_comm_rank(comm, &r));
    EXPECT_OK(gradacc_comm_world_size(comm, &n));
    CHECK(r == rank % 2 && n == 2, "world rank %d: group rank %d of %d", rank, r, n);

    gradacc_scaler_t *scaler = scaler_with_scale(1.0f);
    gradacc_tensor_desc_t t[1] = {{3, GRADACC_DTYPE_F32}};
    gradacc_accumulator_t *acc = make_acc(t, 1, GRADACC_NORMALIZE_NONE, 0);
    float g[3] = {(float)(rank + 1), 10.0f * (float)(rank + 1), -1.0f};
    const void *p[1] = {g};
    REQUIRE_OK(gradacc_accumulator_add(acc, scaler, p, 1, 1));
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    REQUIRE_OK(gradacc_accumulator_sync(acc, comm, &info));
    double got[3] = {0};
    read_master(acc, 0, got, 3);
    double want = rank < 2 ? 3.0 : 7.0;
    CHECK(got[0] == want && got[1] == 10 * want && got[2] == -2.0, "rank %d: %g %g %g, expected %g %g -2", rank, got[0],
          got[1], got[2], want, 10 * want);
    CHECK(info.microbatches == 2, "rank %d: %llu micro-batches, expected the group's 2", rank,
          (unsigned long long)info.microbatches);

    gradacc_accumulator_destroy(acc);
    gradacc_scaler_destroy(scaler);
    EXPECT_OK(gradacc_comm_destroy(comm));
    return mpi_finish();
}
