/* mpi-np: 2 4 */
/* A short training run over real MPI: three fp16 tensors in three buckets,
 * ranks with different numbers of micro-batches of different sizes, a mean-reduced loss,
 * BY_COUNT. Every rank must end each step with bitwise-identical master gradients equal to the f64
 * full-batch gradient (the mean over every item of every rank) within f32 accumulation error. */
#include "mpi/mpi_common.h"

enum { TENSORS = 3, STEPS = 3, MAX_ITEMS = 7 };
static const size_t numel[TENSORS] = {300, 17, 700};

/* The gradient of item `item`'s loss for element i of tensor t: any deterministic function. */
static double item_grad(int step, int rank, int mb, int item, int t, size_t i)
{
    uint64_t z = ((uint64_t)step << 48) ^ ((uint64_t)rank << 40) ^ ((uint64_t)mb << 32) ^ ((uint64_t)item << 24) ^
                 ((uint64_t)t << 20) ^ (uint64_t)i;
    test_rng r = {z * 0x9e3779b97f4a7c15ull + 1};
    return rng_range(&r, -1.0, 1.0);
}

static int microbatches_of(int step, int rank) { return 1 + (rank + step) % 3; }
static int items_of(int step, int rank, int mb) { return 1 + (rank * 3 + mb * 5 + step) % MAX_ITEMS; }

/* Fills g (one micro-batch's fp16 gradients of loss*scale) and adds count * exact into ref. */
static void microbatch(int step, int rank, int mb, double scale, grad_buf *g, double **ref)
{
    int items = items_of(step, rank, mb);
    for (int t = 0; t < TENSORS; t++) {
        double *mean = calloc(numel[t], sizeof(double)), *exact = calloc(numel[t], sizeof(double));
        for (size_t i = 0; i < numel[t]; i++) {
            for (int k = 0; k < items; k++)
                mean[i] += item_grad(step, rank, mb, k, t, i);
            mean[i] /= items;
        }
        grad_encode(&g[t], mean, scale, exact);
        if (ref)
            for (size_t i = 0; i < numel[t]; i++)
                ref[t][i] += items * exact[i];
        free(mean);
        free(exact);
    }
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    const int rank = world_rank(), world = world_size();
    gradacc_comm_t *comm = comm_of(MPI_COMM_WORLD);
    gradacc_scaler_t *scaler = scaler_with_scale(1024.0f);
    gradacc_tensor_desc_t t[TENSORS];
    grad_buf g[TENSORS];
    double *ref[TENSORS], *got[TENSORS];
    for (int i = 0; i < TENSORS; i++) {
        t[i].numel = numel[i];
        t[i].dtype = GRADACC_DTYPE_F16;
        g[i] = grad_alloc(GRADACC_DTYPE_F16, numel[i]);
        ref[i] = calloc(numel[i], sizeof(double));
        got[i] = calloc(numel[i], sizeof(double));
    }
    gradacc_accumulator_t *acc = make_acc(t, TENSORS, GRADACC_NORMALIZE_BY_COUNT, 1); /* a bucket per tensor */

    for (int step = 0; step < STEPS; step++) {
        float scale;
        REQUIRE_OK(gradacc_scaler_scale(scaler, &scale));
        for (int i = 0; i < TENSORS; i++)
            memset(ref[i], 0, numel[i] * sizeof(double));
        uint64_t total = 0;
        /* The reference: every rank's micro-batches, replayed here in f64. */
        for (int r = 0; r < world; r++)
            for (int m = 0; m < microbatches_of(step, r); m++) {
                microbatch(step, r, m, scale, g, ref);
                total += (uint64_t)items_of(step, r, m);
                if (r == rank) {
                    const void *p[TENSORS] = {g[0].data, g[1].data, g[2].data};
                    REQUIRE_OK(gradacc_accumulator_add(acc, scaler, p, TENSORS, (uint64_t)items_of(step, r, m)));
                }
            }
        gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
        REQUIRE_OK(gradacc_accumulator_sync(acc, comm, &info));
        CHECK(info.total_count == total && !info.found_inf, "step %d: total_count %llu, expected %llu", step,
              (unsigned long long)info.total_count, (unsigned long long)total);
        for (int i = 0; i < TENSORS; i++) {
            read_master(acc, (size_t)i, got[i], numel[i]);
            for (size_t e = 0; e < numel[i]; e++)
                ref[i][e] /= (double)total;
            double err = max_abs_diff(got[i], ref[i], numel[i]);
            CHECK(err <= 2e-6, "step %d tensor %d: max |gradacc - f64 reference| = %.3g", step, i, err);
            check_master_agrees(acc, (size_t)i, MPI_COMM_WORLD, "training");
        }
        bool skip = true;
        const gradacc_accumulator_t *accs[1] = {acc};
        EXPECT_OK(gradacc_scaler_update(scaler, accs, 1, &skip));
        CHECK(!skip, "step %d skipped", step);
        CHECK(same_on_all_ranks(float_bits(scale), MPI_COMM_WORLD), "loss scales differ");
    }
    if (rank == 0)
        printf("%d ranks, %d steps: masters bitwise equal across ranks and within 2e-6 of the f64 reference\n", world, STEPS);
    for (int i = 0; i < TENSORS; i++) {
        grad_free(&g[i]);
        free(ref[i]);
        free(got[i]);
    }
    gradacc_accumulator_destroy(acc);
    gradacc_scaler_destroy(scaler);
    EXPECT_OK(gradacc_comm_destroy(comm));
    return mpi_finish();
}
