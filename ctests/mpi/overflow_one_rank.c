/* mpi-np: 2 4 */
/* Overflow on one rank only: the last rank's fp16 gradient holds an infinity. Every rank must
 * report found_inf, skip the step, and back its scaler off to the same scale. */
#include "mpi/mpi_common.h"

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    const int rank = world_rank(), world = world_size();
    gradacc_comm_t *comm = comm_of(MPI_COMM_WORLD);
    gradacc_scaler_t *scaler = scaler_with_scale(65536.0f);
    gradacc_tensor_desc_t t[1] = {{8, GRADACC_DTYPE_F16}};
    gradacc_accumulator_t *acc = make_acc(t, 1, GRADACC_NORMALIZE_BY_COUNT, 0);
    grad_buf g = grad_alloc(GRADACC_DTYPE_F16, 8);
    double v[8] = {1e-3, 2e-3, 3e-3, 4e-3, 5e-3, 6e-3, 7e-3, 8e-3};
    for (int step = 0; step < 2; step++) {
        float before;
        REQUIRE_OK(gradacc_scaler_scale(scaler, &before));
        grad_encode(&g, v, before, NULL);
        if (step == 0 && rank == world - 1)
            grad_poke(&g, 3, 0x7c00, INFINITY);
        const void *p[1] = {g.data};
        REQUIRE_OK(gradacc_accumulator_add(acc, scaler, p, 1, 2));
        gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
        REQUIRE_OK(gradacc_accumulator_sync(acc, comm, &info));
        CHECK(info.found_inf == (step == 0), "step %d rank %d: found_inf %d", step, rank, (int)info.found_inf);
        bool skip = false;
        const gradacc_accumulator_t *accs[1] = {acc};
        EXPECT_OK(gradacc_scaler_update(scaler, accs, 1, &skip));
        CHECK(skip == (step == 0), "step %d rank %d: skip %d", step, rank, (int)skip);
        float after;
        REQUIRE_OK(gradacc_scaler_scale(scaler, &after));
        CHECK(after == (step == 0 ? before / 2 : before), "step %d: scale %g -> %g", step, before, after);
        CHECK(same_on_all_ranks(float_bits(after), MPI_COMM_WORLD), "step %d: scales differ across ranks", step);
    }
    grad_free(&g);
    gradacc_accumulator_destroy(acc);
    gradacc_scaler_destroy(scaler);
    EXPECT_OK(gradacc_comm_destroy(comm));
    return mpi_finish();
}
