/* The dp 2 x tp 2 case of the mesh tests (api_mesh in-process, mpi/mesh over MPI), in
 * Megatron-Core's order (world rank = tp + 2 * dp, data rank = dp): one accumulator per rank with
 * a tensor sharded over tp (tensor 0, different elements on each tp rank) and one replicated over
 * tp (tensor 1, the same values on both tp peers). Two micro-batches per data rank (3 and 5 items
 * at data rank 0, 2 and 4 at data rank 1) of f32 gradients of eighths, a sum loss normalised by
 * the count: the job's total is 14, the data ranks' only. */
#ifndef GRADACC_CTESTS_MESH_CASE_H
#define GRADACC_CTESTS_MESH_CASE_H

#include "common.h"

#include <math.h>

enum { TP = 2, DP = 2, N0 = 6, N1 = 3, MB = 2 };

static const uint64_t counts[DP][MB] = {{3, 5}, {2, 4}};

/* The gradient of element j of tensor t in micro-batch mb at data rank d and tp rank tp: an
 * eighth, exact in f32. */
static inline double value(int d, int mb, int tp, int t, int j)
{
    int k = d * 7 + mb * 3 + (t == 0 ? tp * 5 : 0) + t * 11 + j;
    return (double)(k % 9 - 4) / 8.0;
}

/* Element j of tensor t at tp rank tp after the step: the sum over the data ranks, normalised by
 * the job's total. */
static inline double reference(int tp, int t, int j)
{
    double g = 0, total = 0;
    for (int d = 0; d < DP; d++)
        for (int mb = 0; mb < MB; mb++) {
            g += value(d, mb, tp, t, j);
            total += (double)counts[d][mb];
        }
    return g / total;
}

/* The f64 global norm: each tp shard of tensor 0, and tensor 1 once (not once per tp rank). */
static inline double reference_norm(void)
{
    double squares = 0;
    for (int tp = 0; tp < TP; tp++)
        for (int t = 0; t < 2; t++)
            for (int j = 0; j < (t == 0 ? N0 : N1) && !(t == 1 && tp > 0); j++)
                squares += reference(tp, t, j) * reference(tp, t, j);
    return sqrt(squares);
}

/* World rank `rank`'s window: its data rank's two micro-batches, an inf in tensor 0 of the
 * second one when `poison`. */
static inline void add_window(gradacc_accumulator_t *acc, gradacc_scaler_t *scaler, int rank, int poison)
{
    int d = rank / TP, tp = rank % TP;
    float g0[N0], g1[N1];
    for (int mb = 0; mb < MB; mb++) {
        for (int j = 0; j < N0; j++)
            g0[j] = (float)value(d, mb, tp, 0, j);
        for (int j = 0; j < N1; j++)
            g1[j] = (float)value(d, mb, tp, 1, j);
        if (poison && mb == 1)
            g0[2] = INFINITY;
        const void *grads[2] = {g0, g1};
        REQUIRE_OK(gradacc_accumulator_add(acc, scaler, grads, 2, counts[d][mb]));
    }
}

/* World rank `rank`'s accumulator of the case: sum loss, tensor_stats on (it declares tensor 1
 * replicated). */
static inline gradacc_accumulator_t *mesh_case_accumulator(void)
{
    gradacc_accumulator_config_t ac;
    REQUIRE_OK(gradacc_accumulator_config_default(&ac));
    ac.loss_reduction = GRADACC_LOSS_REDUCTION_SUM;
    ac.tensor_stats = 1;
    gradacc_tensor_desc_t t[2] = {{N0, GRADACC_DTYPE_F32}, {N1, GRADACC_DTYPE_F32}};
    gradacc_accumulator_t *acc = NULL;
    REQUIRE_OK(gradacc_accumulator_create(&ac, t, 2, NULL, &acc));
    return acc;
}

/* Tensor 1, replicated over the TP copies. */
static const gradacc_replicated_t mesh_case_norm = {.tensor = 1, .copies = TP, .key = 0x6e6f726d};

#endif
