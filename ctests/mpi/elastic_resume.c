/* mpi-np: 2 3 4 */
/* A poisoned micro-batch dropped, a checkpoint in the middle of the window, and the window resumed
 * on fewer ranks, over real MPI (and, under scripts/sim-hosts, across hosts):
 * - every rank adds micro-batches 0 and 1 of three bf16 tensors under GRADACC_OVERFLOW_DROP_MICROBATCH;
 *   the last rank's micro-batch 1 holds an infinity, so it is dropped;
 * - every rank saves its window (the checkpoint) and all ranks exchange the bytes;
 * - every rank adds micro-batch 2 and syncs over the world. The result must have the bits of the
 *   same job run in this process on gradacc's in-process communicator (the one-host run), the
 *   same bits on every rank, one dropped micro-batch, the dropped items out of the count, and be
 *   within f64 accuracy of the reference without the poisoned micro-batch;
 * - then the first S = ceil(W / 2) ranks resume from the checkpoint as if the others were lost:
 *   survivor s loads its own window, merges the lost ranks s + S, s + 2S, ..., replays their
 *   micro-batch 2 after its own, and syncs over the survivors. Its sums run in another order, so
 *   the result is held to the f64 reference (and bitwise across the survivors), with the original
 *   count. */
#include "mpi/mpi_common.h"

enum { TENSORS = 3, MB = 3, MAX_ITEMS = 6, POISONED_MB = 1 };
static const size_t numel[TENSORS] = {257, 3, 1100};

static double item_grad(int rank, int mb, int item, int t, size_t i)
{
    uint64_t z = ((uint64_t)rank << 40) ^ ((uint64_t)mb << 32) ^ ((uint64_t)item << 24) ^ ((uint64_t)t << 20) ^ (uint64_t)i;
    test_rng r = {z * 0x9e3779b97f4a7c15ull + 7};
    return rng_range(&r, -1.0, 1.0);
}

static int items_of(int rank, int mb) { return 1 + (rank * 5 + mb * 3) % MAX_ITEMS; }

static int poisoned(int world, int rank, int mb) { return rank == world - 1 && mb == POISONED_MB; }

/* Micro-batch `mb` of `rank`: its bf16 gradients of the mean loss times `scale` in g, and, unless
 * poisoned, items * the exact unscaled values added into ref. */
static void microbatch(int world, int rank, int mb, double scale, grad_buf *g, double **ref)
{
    int items = items_of(rank, mb);
    for (int t = 0; t < TENSORS; t++) {
        double *mean = calloc(numel[t], sizeof(double)), *exact = calloc(numel[t], sizeof(double));
        for (size_t i = 0; i < numel[t]; i++) {
            for (int k = 0; k < items; k++)
                mean[i] += item_grad(rank, mb, k, t, i);
            mean[i] /= items;
        }
        grad_encode(&g[t], mean, scale, exact);
        if (ref && !poisoned(world, rank, mb))
            for (size_t i = 0; i < numel[t]; i++)
                ref[t][i] += items * exact[i];
        free(mean);
        free(exact);
    }
    if (poisoned(world, rank, mb))
        grad_poke(&g[1], 2, 0x7f80 /* bf16 +inf */, INFINITY);
}

static void add(gradacc_accumulator_t *acc, gradacc_scaler_t *scaler, int world, int rank, int mb, grad_buf *g)
{
    float scale;
    REQUIRE_OK(gradacc_scaler_scale(scaler, &scale));
    microbatch(world, rank, mb, scale, g, NULL);
    const void *p[TENSORS] = {g[0].data, g[1].data, g[2].data};
    REQUIRE_OK(gradacc_accumulator_add(acc, scaler, p, TENSORS, (uint64_t)items_of(rank, mb)));
}

static gradacc_accumulator_t *make(const gradacc_tensor_desc_t *t)
{
    gradacc_accumulator_config_t ac;
    REQUIRE_OK(gradacc_accumulator_config_default(&ac));
    ac.overflow = GRADACC_OVERFLOW_DROP_MICROBATCH;
    ac.bucket_numel = 512; /* several buckets, one of them inside the last tensor */
    gradacc_accumulator_t *a = NULL;
    REQUIRE_OK(gradacc_accumulator_create(&ac, t, TENSORS, NULL, &a));
    return a;
}

/* The one-host run: the whole job on `world` threads of this process over an in-process group. */
typedef struct {
    int world, rank;
    const gradacc_tensor_desc_t *t;
    gradacc_comm_t *comm;
    float *out[TENSORS]; /* rank 0's synced masters */
} local_rank;

static void *local_job(void *arg)
{
    local_rank *lr = arg;
    gradacc_scaler_t *scaler = scaler_with_scale(256.0f);
    gradacc_accumulator_t *acc = make(lr->t);
    grad_buf g[TENSORS];
    for (int i = 0; i < TENSORS; i++)
        g[i] = grad_alloc(GRADACC_DTYPE_BF16, numel[i]);
    for (int m = 0; m < MB; m++)
        add(acc, scaler, lr->world, lr->rank, m, g);
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    REQUIRE_OK(gradacc_accumulator_sync(acc, lr->comm, &info));
    for (int i = 0; i < TENSORS && lr->rank == 0; i++) {
        float *p;
        size_t n;
        REQUIRE_OK(gradacc_accumulator_master(acc, (size_t)i, &p, &n));
        memcpy(lr->out[i], p, n * sizeof(float));
    }
    for (int i = 0; i < TENSORS; i++)
        grad_free(&g[i]);
    gradacc_accumulator_destroy(acc);
    gradacc_scaler_destroy(scaler);
    EXPECT_OK(gradacc_comm_destroy(lr->comm));
    return NULL;
}

static int bits_equal(gradacc_accumulator_t *acc, float *const *want)
{
    for (int i = 0; i < TENSORS; i++) {
        float *p;
        size_t n;
        REQUIRE_OK(gradacc_accumulator_master(acc, (size_t)i, &p, &n));
        if (memcmp(p, want[i], n * sizeof(float)) != 0)
            return 0;
    }
    return 1;
}

/* Every tensor within f64 accuracy of ref / total. */
static void check_reference(gradacc_accumulator_t *acc, double **ref, uint64_t total, const char *what)
{
    for (int i = 0; i < TENSORS; i++) {
        double *got = calloc(numel[i], sizeof(double)), *want = calloc(numel[i], sizeof(double));
        read_master(acc, (size_t)i, got, numel[i]);
        for (size_t e = 0; e < numel[i]; e++)
            want[e] = ref[i][e] / (double)total;
        double err = max_abs_diff(got, want, numel[i]);
        CHECK(err <= 2e-6, "%s, tensor %d: max |gradacc - f64 reference| = %.3g", what, i, err);
        free(got);
        free(want);
    }
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    const int rank = world_rank(), world = world_size(), survivors = (world + 1) / 2;
    gradacc_tensor_desc_t t[TENSORS];
    grad_buf g[TENSORS];
    double *ref[TENSORS];
    float *one_host[TENSORS];
    for (int i = 0; i < TENSORS; i++) {
        t[i].numel = numel[i];
        t[i].dtype = GRADACC_DTYPE_BF16;
        g[i] = grad_alloc(GRADACC_DTYPE_BF16, numel[i]);
        ref[i] = calloc(numel[i], sizeof(double));
        one_host[i] = calloc(numel[i], sizeof(float));
    }
    /* The reference: every rank's kept micro-batches in f64 (the scale is exact in bf16 and the
     * same for every micro-batch: a dropped micro-batch does not change it). */
    uint64_t total = 0;
    for (int r = 0; r < world; r++)
        for (int m = 0; m < MB; m++) {
            microbatch(world, r, m, 256.0, g, ref);
            total += poisoned(world, r, m) ? 0 : (uint64_t)items_of(r, m);
        }
    local_rank lr[8];
    gradacc_comm_t *local[8];
    REQUIRE_OK(gradacc_comm_create_local(world, local));
    for (int r = 0; r < world; r++)
        lr[r] = (local_rank){.world = world, .rank = r, .t = t, .comm = local[r], .out = {one_host[0], one_host[1], one_host[2]}};
    run_ranks((size_t)world, local_job, lr, sizeof lr[0]);

    /* The job over MPI, with a checkpoint after micro-batch 1. */
    gradacc_comm_t *comm = comm_of(MPI_COMM_WORLD);
    gradacc_scaler_t *scaler = scaler_with_scale(256.0f);
    gradacc_accumulator_t *acc = make(t);
    for (int m = 0; m < 2; m++)
        add(acc, scaler, world, rank, m, g);
    size_t len = 0;
    REQUIRE_OK(gradacc_accumulator_save_window(acc, NULL, 0, &len));
    int mine = (int)len, *lens = calloc((size_t)world, sizeof(int)), *at = calloc((size_t)world, sizeof(int));
    MPI_Allgather(&mine, 1, MPI_INT, lens, 1, MPI_INT, MPI_COMM_WORLD);
    int all_len = 0;
    for (int r = 0; r < world; r++) {
        at[r] = all_len;
        all_len += lens[r];
    }
    uint8_t *saved = malloc(len), *windows = malloc((size_t)all_len);
    REQUIRE_OK(gradacc_accumulator_save_window(acc, saved, len, &len));
    MPI_Allgatherv(saved, mine, MPI_BYTE, windows, lens, at, MPI_BYTE, MPI_COMM_WORLD);
    add(acc, scaler, world, rank, 2, g);
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    REQUIRE_OK(gradacc_accumulator_sync(acc, comm, &info));
    CHECK(!info.found_inf && info.dropped_microbatches == 1 && info.total_count == total,
          "the synced window: found_inf %d, %llu dropped, total_count %llu (expected 0, 1, %llu)", (int)info.found_inf,
          (unsigned long long)info.dropped_microbatches, (unsigned long long)info.total_count,
          (unsigned long long)total);
    CHECK(bits_equal(acc, one_host), "the boundary over MPI differs bitwise from the same job on one host");
    check_reference(acc, ref, total, "the synced window");
    for (int i = 0; i < TENSORS; i++)
        check_master_agrees(acc, (size_t)i, MPI_COMM_WORLD, "the synced window");

    /* The resume on the first `survivors` ranks, from the checkpoint. */
    MPI_Comm alive;
    MPI_Comm_split(MPI_COMM_WORLD, rank < survivors ? 0 : MPI_UNDEFINED, rank, &alive);
    if (rank < survivors) {
        gradacc_comm_t *comm2 = comm_of(alive);
        gradacc_scaler_t *scaler2 = scaler_with_scale(256.0f);
        gradacc_accumulator_t *acc2 = make(t);
        REQUIRE_OK(gradacc_accumulator_load_window(acc2, windows + at[rank], (size_t)lens[rank]));
        for (int lost = rank + survivors; lost < world; lost += survivors)
            REQUIRE_OK(gradacc_accumulator_merge_window(acc2, windows + at[lost], (size_t)lens[lost]));
        add(acc2, scaler2, world, rank, 2, g);
        for (int lost = rank + survivors; lost < world; lost += survivors)
            add(acc2, scaler2, world, lost, 2, g);
        gradacc_sync_info_t info2 = GRADACC_SYNC_INFO_INIT;
        REQUIRE_OK(gradacc_accumulator_sync(acc2, comm2, &info2));
        CHECK(!info2.found_inf && info2.total_count == total,
              "the resumed window: found_inf %d, total_count %llu (expected 0, %llu)", (int)info2.found_inf,
              (unsigned long long)info2.total_count, (unsigned long long)total);
        check_reference(acc2, ref, total, "the resumed window");
        for (int i = 0; i < TENSORS; i++)
            check_master_agrees(acc2, (size_t)i, alive, "the resumed window");
        gradacc_accumulator_destroy(acc2);
        gradacc_scaler_destroy(scaler2);
        EXPECT_OK(gradacc_comm_destroy(comm2));
        MPI_Comm_free(&alive);
    }
    if (rank == 0)
        printf("%d ranks: the dropped micro-batch's window bitwise as on one host; resumed on %d ranks within 2e-6 "
               "of the f64 reference\n",
               world, survivors);
    for (int i = 0; i < TENSORS; i++) {
        grad_free(&g[i]);
        free(ref[i]);
        free(one_host[i]);
    }
    free(saved);
    free(windows);
    free(lens);
    free(at);
    gradacc_accumulator_destroy(acc);
    gradacc_scaler_destroy(scaler);
    EXPECT_OK(gradacc_comm_destroy(comm));
    return mpi_finish();
}
