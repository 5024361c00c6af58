/* mpi-np: 2 3 */
/* ZeRO-1 and ZeRO-2 over MPI: each rank steps only its shard of the FP32 masters and AdamW's
 * moments, then the ranks all-gather the model's weights. After every step every rank's weights
 * must be the bits of the unsharded optimizer, run beside it on the same communicator with the
 * same micro-batches; stochastic rounding included. Layout: tensors of odd sizes in every dtype,
 * spread over several shards; a step with an overflow on the last rank changes nothing. */
#include "mpi/shard_common.h"

enum { TENSORS = 4, STEPS = 4 };
static const size_t NUMEL[TENSORS] = {70001, 333, 9001, 5};
static const gradacc_dtype_t DTYPE[TENSORS] = {GRADACC_DTYPE_BF16, GRADACC_DTYPE_F32,
                                               GRADACC_DTYPE_F16, GRADACC_DTYPE_BF16};

typedef struct {
    gradacc_accumulator_t *acc;
    gradacc_optimizer_t *opt;
    grad_buf weights[TENSORS];
} run;

static run make_run(gradacc_accumulator_t *acc, gradacc_rounding_t rounding)
{
    run r;
    r.acc = acc;
    const void *initial[TENSORS];
    for (int t = 0; t < TENSORS; t++) {
        r.weights[t] = grad_alloc(DTYPE[t], NUMEL[t]);
        double *v = malloc(NUMEL[t] * sizeof *v);
        for (size_t i = 0; i < NUMEL[t]; i++)
            v[i] = sin((double)i + t) * 0.5;
        grad_encode(&r.weights[t], v, 1.0, NULL);
        free(v);
        initial[t] = r.weights[t].data;
    }
    gradacc_optimizer_config_t oc;
    REQUIRE_OK(gradacc_optimizer_config_default(&oc));
    oc.lr = 0.01f;
    oc.rounding = rounding;
    oc.seed = 12345;
    REQUIRE_OK(gradacc_optimizer_create(acc, &oc, NULL, initial, NULL, TENSORS, &r.opt));
    return r;
}

static void free_run(run *r)
{
    EXPECT_OK(gradacc_optimizer_destroy(r->opt));
    EXPECT_OK(gradacc_accumulator_destroy(r->acc));
    for (int t = 0; t < TENSORS; t++)
        grad_free(&r->weights[t]);
}

/* One step of `r` from this rank's micro-batch of step `s`; returns whether it stepped. */
static bool step(run *r, gradacc_scaler_t *scaler, gradacc_comm_t *comm, int s, int sync_on_comm)
{
    const int rank = world_rank(), world = world_size();
    grad_buf g[TENSORS];
    const void *grads[TENSORS];
    for (int t = 0; t < TENSORS; t++) {
        g[t] = grad_alloc(DTYPE[t], NUMEL[t]);
        double *v = malloc(NUMEL[t] * sizeof *v);
        for (size_t i = 0; i < NUMEL[t]; i++)
            v[i] = cos((double)(i * 7 + (size_t)rank * 13 + (size_t)s * 31 + (size_t)t)) * 0.25;
        grad_encode(&g[t], v, 1.0, NULL);
        free(v);
        grads[t] = g[t].data;
    }
    if (s == 2 && rank == world - 1)
        grad_poke(&g[0], 17, 0x7f80, INFINITY);
    REQUIRE_OK(gradacc_accumulator_add(r->acc, scaler, grads, TENSORS, (uint64_t)rank + 1));
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    REQUIRE_OK(gradacc_accumulator_sync(r->acc, sync_on_comm ? comm : NULL, &info));
    void *weights[TENSORS];
    for (int t = 0; t < TENSORS; t++) {
        weights[t] = r->weights[t].data;
        grad_free(&g[t]);
    }
    bool stepped = false;
    REQUIRE_OK(gradacc_optimizer_step(r->opt, r->acc, weights, TENSORS, sync_on_comm ? comm : NULL,
                                      &stepped));
    return stepped;
}

static void against_unsharded(gradacc_comm_t *comm, int policy, gradacc_rounding_t rounding)
{
    const int rank = world_rank(), world = world_size();
    gradacc_tensor_desc_t t[TENSORS];
    for (int i = 0; i < TENSORS; i++) {
        t[i].numel = NUMEL[i];
        t[i].dtype = DTYPE[i];
    }
    gradacc_scaler_t *scaler = scaler_with_scale(1.0f);
    gradacc_accumulator_config_t ac;
    REQUIRE_OK(gradacc_accumulator_config_default(&ac));
    run plain = make_run(make_shard_acc(t, TENSORS, GRADACC_NORMALIZE_BY_COUNT, 0.0f, 0, 0), rounding);
    run sharded = make_run(policy == GRADACC_SHARDING_ACCUMULATE
                               ? make_accumulate_acc(ac, t, TENSORS, comm)
                               : make_shard_acc(t, TENSORS, GRADACC_NORMALIZE_BY_COUNT, 0.0f, world, rank),
                           rounding);
    for (int s = 0; s < STEPS; s++) {
        bool a = step(&plain, scaler, comm, s, 1);
        bool b = step(&sharded, scaler, comm, s, policy != GRADACC_SHARDING_ACCUMULATE);
        CHECK(a == b && a == (s != 2), "step %d: stepped %d (unsharded) and %d (sharded)", s, a, b);
        for (int i = 0; i < TENSORS; i++) {
            size_t bytes = NUMEL[i] * dtype_size(DTYPE[i]);
            CHECK(memcmp(plain.weights[i].data, sharded.weights[i].data, bytes) == 0,
                  "policy %d rounding %d step %d: tensor %d differs from the unsharded weights", policy,
                  rounding, s, i);
            uint64_t h = 0;
            for (size_t k = 0; k < bytes; k++)
                h = (h ^ ((const uint8_t *)sharded.weights[i].data)[k]) * 0x100000001b3ull;
            CHECK(same_on_all_ranks(h, MPI_COMM_WORLD), "tensor %d differs between ranks", i);
        }
    }
    free_run(&plain);
    free_run(&sharded);
    EXPECT_OK(gradacc_scaler_destroy(scaler));
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    gradacc_comm_t *comm = comm_of(MPI_COMM_WORLD);
    for (int rounding = 0; rounding < 2; rounding++) {
        against_unsharded(comm, GRADACC_SHARDING_REDUCE_SCATTER, rounding);
        against_unsharded(comm, GRADACC_SHARDING_ACCUMULATE, rounding);
    }
    if (world_rank() == 0)
        printf("%d ranks: every rank's weights are the unsharded optimizer's bits\n", world_size());
    EXPECT_OK(gradacc_comm_destroy(comm));
    return mpi_finish();
}
