/* mpi-np: 2 4 */
/* Unequal work: rank r adds r micro-batches (rank 0 none at all), of r + k items each, with a
 * mean-reduced loss whose per-item gradient is the item's global index. BY_COUNT must give the
 * global per-item mean on every rank; rank 0 still takes part in the boundary. */
#include "mpi/mpi_common.h"

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    const int rank = world_rank(), world = world_size();
    gradacc_comm_t *comm = comm_of(MPI_COMM_WORLD);
    gradacc_scaler_t *scaler = scaler_with_scale(1.0f);
    gradacc_tensor_desc_t t[1] = {{4, GRADACC_DTYPE_F32}};
    gradacc_accumulator_t *acc = make_acc(t, 1, GRADACC_NORMALIZE_BY_COUNT, 0);

    /* Items are numbered globally 1, 2, 3, ... in (rank, micro-batch, item) order. */
    double sum = 0.0;
    uint64_t items = 0, next = 1;
    for (int r = 0; r < world; r++)
        for (int m = 0; m < r; m++) {
            int n = r + m;
            double mean = 0.0;
            for (int k = 0; k < n; k++, next++)
                mean += (double)next;
            sum += mean;
            items += (uint64_t)n;
            mean /= n;
            if (r == rank) {
                float g[4] = {(float)mean, (float)mean, (float)mean, (float)-mean};
                const void *p[1] = {g};
                REQUIRE_OK(gradacc_accumulator_add(acc, scaler, p, 1, (uint64_t)n));
            }
        }
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    REQUIRE_OK(gradacc_accumulator_sync(acc, comm, &info));
    double got[4] = {0};
    read_master(acc, 0, got, 4);
    double want = sum / (double)items;
    CHECK(info.total_count == items, "total_count %llu, expected %llu", (unsigned long long)info.total_count,
          (unsigned long long)items);
    CHECK(fabs(got[0] - want) <= 1e-5 * want && got[3] == -got[0], "rank %d: %.9g, expected the global mean %.9g", rank,
          got[0], want);
    check_master_agrees(acc, 0, MPI_COMM_WORLD, "unequal work");

    gradacc_accumulator_destroy(acc);
    gradacc_scaler_destroy(scaler);
    EXPECT_OK(gradacc_comm_destroy(comm));
    return mpi_finish();
}
