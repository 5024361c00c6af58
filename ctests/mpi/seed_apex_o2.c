/* mpi-np: 2 */
/* Seed apex-o2-ddp-accumulation-bug.md over real MPI: Linear(1,1), loss = mean(output), two
 * processes with inputs 1.0 and 2.0, two micro-batches each, loss scale 1. Apex O2 + DDP gives
 * rank 0 weight grad 2.5 and rank 1 3.5; gradacc gives both 3.0 / 2.0 (BY_WORLD) or 1.5 / 1.0
 * (BY_MICROBATCHES), bitwise equal. */
#include "mpi/mpi_common.h"

static void run(gradacc_comm_t *comm, gradacc_normalize_t normalize, gradacc_dtype_t dtype, float want_w, float want_b)
{
    const double input = world_rank() == 0 ? 1.0 : 2.0;
    gradacc_scaler_t *scaler = scaler_with_scale(1.0f);
    gradacc_tensor_desc_t t[2] = {{1, dtype}, {1, dtype}};
    gradacc_accumulator_t *acc = make_acc(t, 2, normalize, 0);
    const double grads[2] = {input, 1.0};
    grad_buf w = grad_alloc(dtype, 1), b = grad_alloc(dtype, 1);
    for (int m = 0; m < 2; m++) {
        grad_encode(&w, &grads[0], 1.0, NULL);
        grad_encode(&b, &grads[1], 1.0, NULL);
        const void *g[2] = {w.data, b.data};
        REQUIRE_OK(gradacc_accumulator_add(acc, scaler, g, 2, 1));
    }
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    EXPECT_OK(gradacc_accumulator_sync(acc, comm, &info));
    double got[2] = {0};
    read_master(acc, 0, &got[0], 1);
    read_master(acc, 1, &got[1], 1);
    CHECK(got[0] == want_w && got[1] == want_b, "%s rank %d: weight %g bias %g, expected %g %g", dtype_name(dtype),
          world_rank(), got[0], got[1], want_w, want_b);
    CHECK(info.total_count == 4 && info.microbatches == 4 && !info.found_inf, "info: count %llu micro-batches %llu",
          (unsigned long long)info.total_count, (unsigned long long)info.microbatches);
    check_master_agrees(acc, 0, MPI_COMM_WORLD, "weight");
    check_master_agrees(acc, 1, MPI_COMM_WORLD, "bias");
    grad_free(&w);
    grad_free(&b);
    gradacc_accumulator_destroy(acc);
    gradacc_scaler_destroy(scaler);
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    gradacc_comm_t *comm = comm_of(MPI_COMM_WORLD);
    int32_t rank = 99, size = 99;
    EXPECT_OK(gradacc_comm_rank(comm, &rank));
    EXPECT_OK(gradacc_comm_world_size(comm, &size));
    CHECK(rank == world_rank() && size == 2, "rank %d of %d", rank, size);
    static const gradacc_dtype_t dtypes[3] = {GRADACC_DTYPE_F16, GRADACC_DTYPE_BF16, GRADACC_DTYPE_F32};
    for (int d = 0; d < 3; d++) {
        run(comm, GRADACC_NORMALIZE_BY_WORLD, dtypes[d], 3.0f, 2.0f);
        run(comm, GRADACC_NORMALIZE_BY_MICROBATCHES, dtypes[d], 1.5f, 1.0f);
    }
    EXPECT_OK(gradacc_comm_destroy(comm));
    return mpi_finish();
}
