/* mpi-np: 2 4 */
/* The MPI boundary cuts the master buffer into chunks of one share per rank (64K elements each,
 * whole 4096-element norm blocks), and each rank sums, normalises and measures its share. This
 * test checks that cut against the single-process boundary, bit for bit: every rank adds one
 * micro-batch; a second accumulator on each rank adds every rank's micro-batch in rank order and
 * syncs with no communicator. Both sum the same f32 products in the same order, so masters, norm
 * and clip factor must be the same bits. Layouts: several chunks and a short last one, less than
 * a block, fewer blocks than ranks, and many tensors of odd sizes in several buckets whose edges
 * fall inside norm blocks; with and without clipping, normalised or not. */
#include "mpi/mpi_common.h"

enum { MAX_TENSORS = 8, SHARE = 65536, BLOCK = 4096 };

typedef struct {
    const char *name;
    size_t tensors;
    size_t numel[MAX_TENSORS];
    gradacc_dtype_t dtype[MAX_TENSORS];
    uint64_t bucket_numel; /* 0: the default */
} layout;

typedef struct {
    const char *name;
    gradacc_normalize_t normalize;
    float max_grad_norm;
    uint32_t threads;
} setup;

/* Rank `rank`'s gradient for element i of tensor t: magnitudes over 2^-12..2^4 (finite in fp16 at
 * the scale of 1024), spread wide enough that a different summation order changes the bits. */
static double value(int rank, int t, size_t i)
{
    test_rng r = {((uint64_t)rank << 40 ^ (uint64_t)t << 32 ^ (uint64_t)i) * 0x9e3779b97f4a7c15ull + 7};
    double m = rng_range(&r, -1.0, 1.0);
    return ldexp(m, (int)rng_below(&r, 17) - 12);
}

static gradacc_accumulator_t *make(const layout *l, const setup *s)
{
    gradacc_tensor_desc_t t[MAX_TENSORS];
    for (size_t i = 0; i < l->tensors; i++) {
        t[i].numel = l->numel[i];
        t[i].dtype = l->dtype[i];
    }
    gradacc_accumulator_config_t ac;
    REQUIRE_OK(gradacc_accumulator_config_default(&ac));
    ac.normalize = s->normalize;
    ac.max_grad_norm = s->max_grad_norm;
    ac.threads = s->threads;
    if (l->bucket_numel)
        ac.bucket_numel = l->bucket_numel;
    gradacc_accumulator_t *a = NULL;
    REQUIRE_OK(gradacc_accumulator_create(&ac, t, l->tensors, NULL, &a));
    return a;
}

/* Adds rank `rank`'s micro-batch (count rank + 1) to `acc`. */
static void add_rank(gradacc_accumulator_t *acc, gradacc_scaler_t *scaler, const layout *l, int rank)
{
    grad_buf g[MAX_TENSORS];
    const void *p[MAX_TENSORS];
    for (size_t t = 0; t < l->tensors; t++) {
        g[t] = grad_alloc(l->dtype[t], l->numel[t]);
        double *v = malloc(l->numel[t] * sizeof(double));
        for (size_t i = 0; i < l->numel[t]; i++)
            v[i] = value(rank, (int)t, i);
        grad_encode(&g[t], v, 1024.0, NULL);
        free(v);
        p[t] = g[t].data;
    }
    REQUIRE_OK(gradacc_accumulator_add(acc, scaler, p, l->tensors, (uint64_t)rank + 1));
    for (size_t t = 0; t < l->tensors; t++)
        grad_free(&g[t]);
}

static uint64_t double_bits(double x)
{
    uint64_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static void check_case(gradacc_comm_t *comm, gradacc_scaler_t *scaler, const layout *l, const setup *s)
{
    const int rank = world_rank(), world = world_size();
    gradacc_accumulator_t *acc = make(l, s), *ref = make(l, s);
    add_rank(acc, scaler, l, rank);
    for (int r = 0; r < world; r++)
        add_rank(ref, scaler, l, r);
    gradacc_sync_info_t got = GRADACC_SYNC_INFO_INIT, want = GRADACC_SYNC_INFO_INIT;
    REQUIRE_OK(gradacc_accumulator_sync(acc, comm, &got));
    REQUIRE_OK(gradacc_accumulator_sync(ref, NULL, &want));

    CHECK(got.total_count == want.total_count && got.microbatches == want.microbatches && !got.found_inf,
          "%s / %s: count %llu, micro-batches %llu, found_inf %d", l->name, s->name,
          (unsigned long long)got.total_count, (unsigned long long)got.microbatches, (int)got.found_inf);
    CHECK(double_bits(got.grad_norm) == double_bits(want.grad_norm), "%s / %s: norm %.17g, single process %.17g",
          l->name, s->name, got.grad_norm, want.grad_norm);
    CHECK(double_bits(got.clip_coef) == double_bits(want.clip_coef), "%s / %s: clip %.17g, single process %.17g",
          l->name, s->name, got.clip_coef, want.clip_coef);
    CHECK(same_on_all_ranks(double_bits(got.grad_norm), MPI_COMM_WORLD), "%s / %s: norms differ between ranks",
          l->name, s->name);
    for (size_t t = 0; t < l->tensors; t++) {
        float *a = NULL, *b = NULL;
        size_t na = 0, nb = 0;
        REQUIRE_OK(gradacc_accumulator_master(acc, t, &a, &na));
        REQUIRE_OK(gradacc_accumulator_master(ref, t, &b, &nb));
        size_t bad = 0, first = 0;
        for (size_t i = 0; i < na; i++)
            if (float_bits(a[i]) != float_bits(b[i]) && !bad++)
                first = i;
        CHECK(bad == 0, "%s / %s: tensor %zu: %zu of %zu elements differ from the single process, first %zu: %.9g vs %.9g",
              l->name, s->name, t, bad, na, first, (double)a[first], (double)b[first]);
        check_master_agrees(acc, t, MPI_COMM_WORLD, l->name);
    }
    gradacc_accumulator_destroy(acc);
    gradacc_accumulator_destroy(ref);
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    const size_t world = (size_t)world_size();
    gradacc_comm_t *comm = comm_of(MPI_COMM_WORLD);
    check_transport(MPI_COMM_WORLD);
    gradacc_scaler_t *scaler = scaler_with_scale(1024.0f);
    const gradacc_dtype_t F16 = GRADACC_DTYPE_F16, F32 = GRADACC_DTYPE_F32, BF16 = GRADACC_DTYPE_BF16;
    const layout layouts[] = {
        {"three chunks and a short one", 1, {3 * world * SHARE + 2 * BLOCK + 123}, {F16}, 0},
        {"less than a block", 1, {100}, {F32}, 0},
        {"fewer blocks than ranks", 1, {(world - 1) * BLOCK - 5}, {F32}, 0},
        {"odd tensors in several buckets", 7, {1, 4095, 4097, 70001, SHARE, 2 * SHARE - 1, 9}, {F16, F32, BF16, F16, F32, BF16, F16},
         50000},
    };
    const setup setups[] = {
        {"by count", GRADACC_NORMALIZE_BY_COUNT, 0.0f, 1},
        {"sum", GRADACC_NORMALIZE_NONE, 0.0f, 1},
        {"by micro-batches, clipped, 2 threads", GRADACC_NORMALIZE_BY_MICROBATCHES, 0.5f, 2},
    };
    for (size_t l = 0; l < sizeof layouts / sizeof layouts[0]; l++)
        for (size_t s = 0; s < sizeof setups / sizeof setups[0]; s++)
            check_case(comm, scaler, &layouts[l], &setups[s]);
    if (world_rank() == 0)
        printf("%zu ranks: masters, norms and clip factors bitwise equal to the single-process boundary\n", world);
    gradacc_scaler_destroy(scaler);
    EXPECT_OK(gradacc_comm_destroy(comm));
    return mpi_finish();
}
