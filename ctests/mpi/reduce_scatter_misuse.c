/* mpi-np: 2 4 */
/* Misuse of a sharded boundary over MPI. Each rank's accumulator holds shard `rank` of `world`;
 * synced on a communicator that does not match (the caller's MPI_Comm_split into halves, as
 * split_groups does, so groups of world / 2; the world with the ranks in reverse order; no
 * communicator at all) it must fail on every rank with GRADACC_STATUS_INVALID_ARGUMENT naming its
 * shard, without hanging; ranks whose accumulators differ in sharding fail together. Each time
 * the window stays intact: the sync on the right communicator afterwards leaves the all-reduce's
 * bits in every shard (an unsharded accumulator with the same micro-batch beside it). */
#include "mpi/shard_common.h"

enum { N = 7 * 4096 + 5 };

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    const int rank = world_rank(), world = world_size();
    gradacc_comm_t *comm = comm_of(MPI_COMM_WORLD);
    MPI_Comm half_mpi, reversed_mpi;
    MPI_Comm_split(MPI_COMM_WORLD, rank < world / 2, rank, &half_mpi);
    MPI_Comm_split(MPI_COMM_WORLD, 0, world - 1 - rank, &reversed_mpi);
    gradacc_comm_t *half = comm_of(half_mpi), *reversed = comm_of(reversed_mpi);
    MPI_Comm_free(&half_mpi);
    MPI_Comm_free(&reversed_mpi);
    /* A failure that waited for a missing rank would end in a timeout, not a hang. */
    EXPECT_OK(gradacc_comm_set_timeout(comm, 30.0));
    EXPECT_OK(gradacc_comm_set_timeout(half, 30.0));
    EXPECT_OK(gradacc_comm_set_timeout(reversed, 30.0));

    gradacc_scaler_t *scaler = scaler_with_scale(512.0f);
    gradacc_tensor_desc_t t[1] = {{N, GRADACC_DTYPE_F16}};
    gradacc_accumulator_t *sharded = make_shard_acc(t, 1, GRADACC_NORMALIZE_BY_COUNT, 0.0f, world, rank);
    gradacc_accumulator_t *plain = make_shard_acc(t, 1, GRADACC_NORMALIZE_BY_COUNT, 0.0f, 0, 0);
    grad_buf g = grad_alloc(GRADACC_DTYPE_F16, N);
    double *v = malloc(N * sizeof(double));
    for (size_t i = 0; i < N; i++)
        v[i] = ((double)((i * 7919 + (size_t)rank * 104729) % 2001) - 1000.0) / 997.0;
    grad_encode(&g, v, 512.0, NULL);
    const void *p[1] = {g.data};
    REQUIRE_OK(gradacc_accumulator_add(sharded, scaler, p, 1, (uint64_t)rank + 1));
    REQUIRE_OK(gradacc_accumulator_add(plain, scaler, p, 1, (uint64_t)rank + 1));

    char own[64];
    snprintf(own, sizeof own, "shard %d of %d", rank, world);
    struct {
        const char *name;
        gradacc_comm_t *comm;
    } wrong[] = {{"halves", half}, {"reversed ranks", reversed}, {"no communicator", NULL}};
    for (size_t k = 0; k < sizeof wrong / sizeof wrong[0]; k++) {
        gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
        info.total_count = 12345;
        gradacc_status_t st = gradacc_accumulator_sync(sharded, wrong[k].comm, &info);
        CHECK(st == GRADACC_STATUS_INVALID_ARGUMENT && strstr(gradacc_last_error(), own),
              "%s: rank %d: status %d (%s), expected INVALID_ARGUMENT naming \"%s\"", wrong[k].name, rank, (int)st,
              gradacc_status_string(st), own);
        CHECK(info.total_count == 12345, "%s: rank %d: the info was written on failure", wrong[k].name, rank);
        CHECK(same_on_all_ranks((uint64_t)st, MPI_COMM_WORLD), "%s: the ranks' statuses differ", wrong[k].name);
    }

    /* The last rank unsharded, the others sharded, on the right communicator: every rank fails
     * (their settings differ), and nothing is reduced. */
    gradacc_accumulator_t *odd = make_shard_acc(t, 1, GRADACC_NORMALIZE_BY_COUNT, 0.0f, rank == world - 1 ? 0 : world, rank);
    REQUIRE_OK(gradacc_accumulator_add(odd, scaler, p, 1, 1));
    gradacc_status_t st = gradacc_accumulator_sync(odd, comm, NULL);
    CHECK(st != GRADACC_STATUS_OK && same_on_all_ranks((uint64_t)st, MPI_COMM_WORLD),
          "mixed sharding: rank %d: status %d (%s), expected the same failure on every rank", rank, (int)st,
          gradacc_status_string(st));

    /* The window is intact: the right communicator gives the all-reduce's bits. */
    gradacc_sync_info_t si = GRADACC_SYNC_INFO_INIT, pi = GRADACC_SYNC_INFO_INIT;
    EXPECT_OK(gradacc_accumulator_sync(sharded, comm, &si));
    EXPECT_OK(gradacc_accumulator_sync(plain, comm, &pi));
    uint64_t items = (uint64_t)world * (uint64_t)(world + 1) / 2;
    CHECK(si.total_count == items && si.microbatches == (uint64_t)world, "rank %d: count %llu, micro-batches %llu", rank,
          (unsigned long long)si.total_count, (unsigned long long)si.microbatches);
    check_shard(sharded, plain, &si, &pi, 1, "after the failed syncs");
    /* The communicators that failed still work for a boundary that fits them: the half groups
     * with an accumulator of world / 2 shards. */
    int32_t hr = -1, hn = -1;
    EXPECT_OK(gradacc_comm_rank(half, &hr));
    EXPECT_OK(gradacc_comm_world_size(half, &hn));
    gradacc_accumulator_t *halved = make_shard_acc(t, 1, GRADACC_NORMALIZE_BY_COUNT, 0.0f, hn, hr);
    REQUIRE_OK(gradacc_accumulator_add(halved, scaler, p, 1, 1));
    EXPECT_OK(gradacc_accumulator_sync(halved, half, NULL));

    if (rank == 0)
        printf("%d ranks: wrong communicators failed everywhere, the windows stayed intact\n", world);
    free(v);
    grad_free(&g);
    gradacc_accumulator_destroy(sharded);
    gradacc_accumulator_destroy(plain);
    gradacc_accumulator_destroy(odd);
    gradacc_accumulator_destroy(halved);
    gradacc_scaler_destroy(scaler);
    EXPECT_OK(gradacc_comm_destroy(half));
    EXPECT_OK(gradacc_comm_destroy(reversed));
    EXPECT_OK(gradacc_comm_destroy(comm));
    return mpi_finish();
}
