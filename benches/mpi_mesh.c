/* The mesh step's latency over MPI (scripts/bench-mpi --mesh): dp x tp on NP processes of one
 * host (8 by default: dp 4 x tp 2, Megatron-Core's order, groups from gradacc's mesh shape), one
 * accumulator per rank of N bf16 elements (default 4096: a latency, not a bandwidth) reduced
 * over its data-parallel group. Per step, after one micro-batch is added and the world passes a
 * barrier, each rank times:
 *   plain    gradacc_accumulator_sync over the data-parallel group (what a framework runs per
 *            accumulator without the mesh: no job-wide agreement)
 *   mesh     gradacc_mesh_sync of the same accumulator (the group's control step, the world's
 *            agreement, the reduction, the world's gather of the norm)
 *   gather   a bare MPI_Allgather of 15 words over the world: one agreement's collective
 * Each step runs all three in turn, so load falls on all alike. The table gives, per pattern,
 * the median over STEPS steps after WARMUP, of the slowest rank's time in each step. */
#include <gradacc.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { WARMUP = 50, STEPS = 400, PATTERNS = 3, TP = 2 };

static const char *NAMES[PATTERNS] = {"plain sync", "mesh step", "bare allgather"};

#define OK(call)                                                                                           \
    do {                                                                                                   \
        if ((call) != GRADACC_STATUS_OK) {                                                                 \
            fprintf(stderr, "%s failed: %s\n", #call, gradacc_last_error());                               \
            MPI_Abort(MPI_COMM_WORLD, 1);                                                                  \
        }                                                                                                  \
    } while (0)

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank = 0, np = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &np);
    size_t n = argc > 1 ? (size_t)strtoull(argv[1], NULL, 10) : 4096;
    if (np % TP != 0 || n == 0) {
        if (rank == 0)
            fprintf(stderr, "usage: mpirun -np <multiple of %d> mpi_mesh [elements]\n", TP);
        MPI_Finalize();
        return 2;
    }

    gradacc_comm_t *world = NULL, *data = NULL;
    OK(gradacc_comm_create_mpi(GRADACC_MPI_COMM_WORLD, NULL, &world));
    gradacc_mesh_shape_t *shape = NULL;
    OK(gradacc_mesh_shape_create((uint32_t)np, TP, 1, 1, 1, 1, NULL, &shape));
    OK(gradacc_mesh_shape_split(shape, world, "cp-dp", &data));
    uint32_t data_rank = 0, data_size = 0;
    OK(gradacc_mesh_shape_group(shape, (uint32_t)rank, "cp-dp", NULL, &data_rank, &data_size));
    gradacc_mesh_t *mesh = NULL;
    OK(gradacc_mesh_create(world, data_rank, data_size, 0.0f, &mesh));

    gradacc_scaler_t *scaler = NULL;
    OK(gradacc_scaler_create(NULL, NULL, &scaler));
    gradacc_tensor_desc_t t = {n, GRADACC_DTYPE_BF16};
    gradacc_accumulator_t *acc = NULL;
    OK(gradacc_accumulator_create(NULL, &t, 1, NULL, &acc));
    uint16_t *g = calloc(n, sizeof *g);
    for (size_t i = 0; i < n; i++)
        g[i] = 0x3c00 + (uint16_t)(i % 64); /* small bf16 values */
    const void *grads[1] = {g};
    gradacc_mesh_part_t part = GRADACC_MESH_PART_INIT;
    part.accumulator = acc;
    part.comm = data;

    static double times[PATTERNS][STEPS];
    uint64_t words[15] = {0}, *all = calloc((size_t)np * 15, sizeof *all);
    for (int step = 0; step < WARMUP + STEPS; step++) {
        for (int p = 0; p < PATTERNS; p++) {
            if (p < 2)
                OK(gradacc_accumulator_add(acc, scaler, grads, 1, 1));
            MPI_Barrier(MPI_COMM_WORLD);
            double t0 = MPI_Wtime();
            if (p == 0)
                OK(gradacc_accumulator_sync(acc, data, NULL));
            else if (p == 1)
                OK(gradacc_mesh_sync(mesh, &part, 1, NULL, NULL));
            else
                MPI_Allgather(words, 15, MPI_UINT64_T, all, 15, MPI_UINT64_T, MPI_COMM_WORLD);
            double dt = MPI_Wtime() - t0, slowest = 0;
            MPI_Allreduce(&dt, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
            if (step >= WARMUP)
                times[p][step - WARMUP] = slowest;
        }
    }
    if (rank == 0) {
        printf("| %d processes (dp %d x tp %d), %zu bf16 elements | median | p10 | p90 |\n", np, np / TP, TP, n);
        printf("|---|---|---|---|\n");
        double med[PATTERNS];
        for (int p = 0; p < PATTERNS; p++) {
            qsort(times[p], STEPS, sizeof(double), cmp);
            med[p] = times[p][STEPS / 2];
            printf("| %s | %.1f us | %.1f us | %.1f us |\n", NAMES[p], 1e6 * med[p], 1e6 * times[p][STEPS / 10],
                   1e6 * times[p][STEPS * 9 / 10]);
        }
        printf("| mesh step - plain sync | %.1f us | | |\n", 1e6 * (med[1] - med[0]));
    }
    free(all);
    free(g);
    OK(gradacc_accumulator_destroy(acc));
    gradacc_scaler_destroy(scaler);
    OK(gradacc_mesh_destroy(mesh));
    OK(gradacc_mesh_shape_destroy(shape));
    OK(gradacc_comm_destroy(data));
    OK(gradacc_comm_destroy(world));
    MPI_Finalize();
    return 0;
}
