/* mpi-np: 2 4 */
/* The hybrid boundary (HSDP) over MPI: gradacc_accumulator_sync_hybrid on two communicators the
 * caller split from MPI_COMM_WORLD. On every grid of S shards x R replicas with S * R = world
 * (2x1 and 1x2 at 2 processes; 4x1, 2x2 and 1x4 at 4), world rank a*S + i is rank i of shard group
 * a (MPI_Comm_split colour a) and rank a of replica group i (colour i).
 *
 * Scenarios, each on a fresh accumulator over fp16 / bf16 / f32 tensors of several 64K-element
 * pieces per shard: unequal work (one rank adds nothing, token counts, mean loss, BY_COUNT);
 * BY_MICROBATCHES with sum losses and clipping; the BF16 wire with BY_WORLD and clipping; an
 * overflow on one rank (every rank skips and backs off alike). After each sync: the infos are the
 * same bits on every rank and count every rank's items; the shards of a shard group tile the
 * layout; replicas hold the same range and bits; the shards match an f64 reference of all ranks'
 * contributions within 4e-6 of their summed magnitudes (2^-8 more with the BF16 wire); and on a
 * grid of one replica (one shard) the info and shard are the bits of a plain reduce-scatter over
 * the shard group (an unsharded sync over the replica group).
 *
 * Misuse: an unsharded accumulator (INVALID_ARGUMENT on every rank), and at 4 processes replica
 * groups split crosswise, pairing shard 0 of one shard group with shard 1 of the other
 * (SIZE_MISMATCH on every rank). Nothing is reduced: the hybrid sync on the right groups (or the
 * unsharded one's sync on the world) then gives the reference.
 *
 * MPI is initialised with MPI_Init (MPI_THREAD_SINGLE), the common case: gradacc then serialises
 * its MPI calls under one process-wide lock, and the replica group's all-reduce runs inside the
 * shard group's reduce-scatter, on the thread that holds it. */
#include "mpi/shard_common.h"

enum { T = 4 };
static const size_t numel[T] = {150001, 100003, 50001, 7};
static const gradacc_dtype_t dtypes[T] = {GRADACC_DTYPE_F16, GRADACC_DTYPE_BF16, GRADACC_DTYPE_F32, GRADACC_DTYPE_F32};
/* Each tensor at a multiple of GRADACC_MASTER_ALIGN bytes, zeros between (checked in main). */
static const size_t offset[T] = {0, 150016, 250048, 300096};
enum { LEN = 300160, BLOCK = 4096, MAX_MB = 3 };

typedef struct {
    const char *name;
    gradacc_normalize_t normalize;
    gradacc_loss_reduction_t loss;
    gradacc_dtype_t wire;
    double clip;   /* max_grad_norm as a fraction of the reference norm; 0: none */
    int overflow;  /* the last rank's first gradient holds an infinity */
    int idle_rank; /* this rank adds nothing (-1: every rank adds) */
} scenario;

static const scenario scenarios[] = {
    {"unequal work", GRADACC_NORMALIZE_BY_COUNT, GRADACC_LOSS_REDUCTION_MEAN, GRADACC_DTYPE_F32, 0.0, 0, 0},
    {"clipped", GRADACC_NORMALIZE_BY_MICROBATCHES, GRADACC_LOSS_REDUCTION_SUM, GRADACC_DTYPE_F32, 0.5, 0, -1},
    {"bf16 wire", GRADACC_NORMALIZE_BY_WORLD, GRADACC_LOSS_REDUCTION_MEAN, GRADACC_DTYPE_BF16, 0.8, 0, -1},
    {"overflow", GRADACC_NORMALIZE_BY_COUNT, GRADACC_LOSS_REDUCTION_MEAN, GRADACC_DTYPE_F32, 0.0, 1, -1},
};

/* The caller's split of the world into an S x R grid, adopted by gradacc. */
typedef struct {
    int S, R, a, i;
    MPI_Comm shard_mpi, replica_mpi;
    gradacc_comm_t *shard, *replica;
} grid;

static grid grid_split(int S, int crosswise)
{
    grid g;
    const int rank = world_rank();
    g.S = S;
    g.R = world_size() / S;
    g.a = rank / S;
    g.i = rank % S;
    MPI_Comm_split(MPI_COMM_WORLD, g.a, g.i, &g.shard_mpi);
    /* Crosswise: replica group j takes shard (j + a) % S of shard group a, so its ranks hold
     * different shards (with S and R >= 2). */
    MPI_Comm_split(MPI_COMM_WORLD, crosswise ? (g.i + g.a) % S : g.i, g.a, &g.replica_mpi);
    g.shard = comm_of(g.shard_mpi);
    g.replica = comm_of(g.replica_mpi);
    /* A failure that waited for a missing rank would end in a timeout, not a hang. */
    EXPECT_OK(gradacc_comm_set_timeout(g.shard, 30.0));
    EXPECT_OK(gradacc_comm_set_timeout(g.replica, 30.0));
    return g;
}

static void grid_free(grid *g)
{
    EXPECT_OK(gradacc_comm_destroy(g->shard));
    EXPECT_OK(gradacc_comm_destroy(g->replica));
    MPI_Comm_free(&g->shard_mpi);
    MPI_Comm_free(&g->replica_mpi);
}

/* Element i of tensor t of rank `rank`'s micro-batch `mb` in scenario `sc`: magnitudes over
 * 2^-10..2^0, spread so that another summation order would change the bits. */
static double value(int sc, int rank, int mb, int t, size_t i)
{
    uint64_t z = ((uint64_t)sc << 52) ^ ((uint64_t)rank << 44) ^ ((uint64_t)mb << 36) ^ ((uint64_t)t << 30) ^ (uint64_t)i;
    test_rng r = {z * 0x9e3779b97f4a7c15ull + 11};
    return ldexp(rng_range(&r, -1.0, 1.0), -(int)rng_below(&r, 11));
}

static int microbatches_of(const scenario *s, int rank) { return rank == s->idle_rank ? 0 : 1 + (rank + 1) % MAX_MB; }
static uint64_t count_of(int rank, int mb) { return 1 + (uint64_t)((5 * rank + 3 * mb) % 7); }
static double scale_of(int rank) { return ldexp(1.0, 6 + rank); }

/* One micro-batch of rank `rank` in each tensor's dtype, scaled by its loss scale; `exact`
 * (optional, LEN elements) receives the values it carries once unscaled, each tensor's at its
 * offset in the master. */
static void make_grads(int sc, const scenario *s, int rank, int mb, grad_buf *g, double *exact)
{
    double *v = malloc(numel[0] * sizeof(double));
    for (int t = 0; t < T; t++) {
        for (size_t i = 0; i < numel[t]; i++)
            v[i] = value(sc, rank, mb, t, i);
        grad_encode(&g[t], v, scale_of(rank), exact ? exact + offset[t] : NULL);
    }
    if (s->overflow && rank == world_size() - 1 && mb == 0)
        grad_poke(&g[0], 12345, 0x7c00, INFINITY);
    free(v);
}

/* Scenario `sc`'s values, for `reference_of`. */
typedef struct {
    int sc;
} scenario_args;

static int args_microbatches(const void *ctx, int rank) { return microbatches_of(&scenarios[((const scenario_args *)ctx)->sc], rank); }

static void scenario_exact(const void *ctx, int rank, int mb, double *exact)
{
    const int sc = ((const scenario_args *)ctx)->sc;
    grad_buf g[T];
    for (int t = 0; t < T; t++)
        g[t] = grad_alloc(dtypes[t], numel[t]);
    make_grads(sc, &scenarios[sc], rank, mb, g, exact);
    for (int t = 0; t < T; t++)
        grad_free(&g[t]);
}

/* The f64 reference of scenario `sc` over every rank of the world. */
static reference make_reference(int sc)
{
    const scenario *s = &scenarios[sc];
    scenario_args a = {sc};
    window_of_ranks w = {args_microbatches, count_of, scenario_exact, &a};
    return reference_of(&w, LEN, world_size(), s->normalize, s->loss);
}

static gradacc_accumulator_t *make_hybrid_acc(const scenario *s, float max_norm, int shards, int rank)
{
    gradacc_tensor_desc_t t[T];
    for (int k = 0; k < T; k++) {
        t[k].numel = numel[k];
        t[k].dtype = dtypes[k];
    }
    gradacc_accumulator_config_t ac;
    REQUIRE_OK(gradacc_accumulator_config_default(&ac));
    ac.normalize = s->normalize;
    ac.loss_reduction = s->loss;
    ac.max_grad_norm = max_norm;
    ac.wire_dtype = s->wire;
    if (shards) {
        ac.sharding = GRADACC_SHARDING_REDUCE_SCATTER;
        ac.shard_count = (uint32_t)shards;
        ac.shard_rank = (uint32_t)rank;
    }
    gradacc_accumulator_t *a = NULL;
    REQUIRE_OK(gradacc_accumulator_create(&ac, t, T, NULL, &a));
    return a;
}

/* Adds this rank's micro-batches of scenario `sc` to each accumulator of `accs` (NULL ends). */
static void add_window(int sc, gradacc_scaler_t *scaler, gradacc_accumulator_t *const *accs)
{
    const scenario *s = &scenarios[sc];
    const int rank = world_rank();
    grad_buf g[T];
    const void *p[T];
    for (int t = 0; t < T; t++) {
        g[t] = grad_alloc(dtypes[t], numel[t]);
        p[t] = g[t].data;
    }
    for (int m = 0; m < microbatches_of(s, rank); m++) {
        make_grads(sc, s, rank, m, g, NULL);
        for (int k = 0; accs[k]; k++)
            REQUIRE_OK(gradacc_accumulator_add(accs[k], scaler, p, T, count_of(rank, m)));
    }
    for (int t = 0; t < T; t++)
        grad_free(&g[t]);
}

/* After a successful hybrid sync of `acc` with `info` on grid `g`: the checks of the file's
 * comment (the values only without an overflow). */
static void check_hybrid(const char *what, const grid *g, const scenario *s, const reference *ref, float max_norm,
                         gradacc_accumulator_t *acc, const gradacc_sync_info_t *info)
{
    const int rank = world_rank(), world = world_size();
    CHECK(same_on_all_ranks(double_bits(info->grad_norm), MPI_COMM_WORLD) &&
              same_on_all_ranks(double_bits(info->clip_coef), MPI_COMM_WORLD) &&
              same_on_all_ranks(info->total_count, MPI_COMM_WORLD) &&
              same_on_all_ranks(info->microbatches, MPI_COMM_WORLD) && same_on_all_ranks(info->found_inf, MPI_COMM_WORLD),
          "%s: the infos differ between ranks", what);
    CHECK(info->total_count == ref->items && info->microbatches == ref->microbatches &&
              info->found_inf == (s->overflow != 0),
          "%s rank %d: count %llu, micro-batches %llu, found_inf %d; expected %llu, %llu, %d over all %d ranks", what, rank,
          (unsigned long long)info->total_count, (unsigned long long)info->microbatches, (int)info->found_inf,
          (unsigned long long)ref->items, (unsigned long long)ref->microbatches, s->overflow, world);

    size_t off = 0, n = 0;
    float *data = NULL;
    REQUIRE_OK(gradacc_accumulator_shard(acc, &off, &n, &data));
    /* The shard group's shards tile the layout in rank order, as the reduce-scatter cuts it. */
    unsigned long long mine[2] = {off, n}, all[2 * 4];
    MPI_Allgather(mine, 2, MPI_UNSIGNED_LONG_LONG, all, 2, MPI_UNSIGNED_LONG_LONG, g->shard_mpi);
    size_t size = ((LEN + (size_t)g->S - 1) / (size_t)g->S + BLOCK - 1) / BLOCK * BLOCK;
    unsigned long long next = 0;
    for (int k = 0; k < g->S; k++) {
        unsigned long long want_n = (unsigned long long)(k + 1) * size < LEN ? size : LEN - next;
        CHECK(all[2 * k] == next && all[2 * k + 1] == want_n, "%s: shard %d of %d is [%llu, +%llu), expected [%llu, +%llu)",
              what, k, g->S, all[2 * k], all[2 * k + 1], next, want_n);
        next = all[2 * k] + all[2 * k + 1];
    }
    CHECK(next == LEN, "%s: the shards end at %llu of %d", what, next, LEN);
    /* Replicas hold the same range and the same bits. */
    CHECK(same_on_all_ranks(off, g->replica_mpi) && same_on_all_ranks(n, g->replica_mpi) &&
              same_on_all_ranks(bits_hash(data, n), g->replica_mpi),
          "%s rank %d: replica %d of shard %d differs from the other replicas", what, rank, g->a, g->i);
    if (s->overflow)
        return;

    const double wire = s->wire == GRADACC_DTYPE_BF16 && world > 1 ? ldexp(1.0, -8) : 0.0;
    const double norm_tol = 1e-5 * ref->norm + wire * ref->spread;
    const double coef = max_norm == 0.0f ? 1.0 : fmin(1.0, (double)max_norm / (ref->norm + 1e-6));
    CHECK_CLOSE(info->grad_norm, ref->norm, norm_tol, "%s: norm", what);
    CHECK_CLOSE(info->clip_coef, coef, coef * (1e-5 + norm_tol / ref->norm), "%s: clip coefficient", what);
    CHECK(max_norm == 0.0f || info->clip_coef < 1.0, "%s: clip coefficient %g, expected clipping", what, info->clip_coef);
    const double coef_error = fabs(info->clip_coef - coef);
    int shown = 0;
    for (size_t k = 0; k < n && off + k < LEN; k++) {
        const size_t e = off + k;
        const double want = ref->sum[e] / ref->divisor * coef;
        const double tol = (4e-6 + wire) * ref->magnitude[e] / ref->divisor * coef + fabs(ref->sum[e] / ref->divisor) * coef_error + 1e-30;
        if (!(fabs((double)data[k] - want) <= tol) && shown++ < 3)
            CHECK(0, "%s rank %d element %zu: %.9g, f64 reference %.9g (tol %.2g)", what, rank, e, (double)data[k], want, tol);
    }
    CHECK(shown == 0, "%s rank %d: %d elements off the f64 reference", what, rank, shown);
}

/* Every scenario on the S x (world / S) grid. */
static void run_grid(int S)
{
    grid g = grid_split(S, 0);
    const int rank = world_rank();
    for (int sc = 0; sc < (int)(sizeof scenarios / sizeof scenarios[0]); sc++) {
        const scenario *s = &scenarios[sc];
        char what[128];
        snprintf(what, sizeof what, "%d shards x %d replicas, %s", g.S, g.R, s->name);
        reference ref = make_reference(sc);
        const float max_norm = s->clip > 0.0 ? (float)(s->clip * ref.norm) : 0.0f;
        gradacc_scaler_t *scaler = scaler_with_scale((float)scale_of(rank)), *plain_scaler = NULL;
        gradacc_accumulator_t *acc = make_hybrid_acc(s, max_norm, g.S, g.i), *plain = NULL;
        /* The plain boundary a degenerate grid must equal bit for bit. */
        gradacc_comm_t *plain_comm = g.R == 1 ? g.shard : g.S == 1 ? g.replica : NULL;
        if (plain_comm) {
            plain = make_hybrid_acc(s, max_norm, g.R == 1 ? g.S : 0, g.R == 1 ? g.i : 0);
            plain_scaler = scaler_with_scale((float)scale_of(rank));
        }
        gradacc_accumulator_t *accs[3] = {acc, plain, NULL};
        add_window(sc, scaler, accs);

        gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
        gradacc_status_t st = gradacc_accumulator_sync_hybrid(acc, g.shard, g.replica, &info);
        EXPECT_OK(st);
        if (st == GRADACC_STATUS_OK)
            check_hybrid(what, &g, s, &ref, max_norm, acc, &info);

        /* Every rank takes the same step decision, and its scaler moves alike. */
        bool skip = false;
        const gradacc_accumulator_t *synced[1] = {acc};
        EXPECT_OK(gradacc_scaler_update(scaler, synced, 1, &skip));
        float after = 0.0f;
        REQUIRE_OK(gradacc_scaler_scale(scaler, &after));
        CHECK(skip == (s->overflow != 0) && after == (float)(s->overflow ? scale_of(rank) / 2 : scale_of(rank)),
              "%s rank %d: skip %d, scale %g -> %g", what, rank, (int)skip, scale_of(rank), (double)after);

        if (plain) {
            gradacc_sync_info_t pinfo = GRADACC_SYNC_INFO_INIT;
            EXPECT_OK(gradacc_accumulator_sync(plain, plain_comm, &pinfo));
            size_t off = 0, n = 0, poff = 1, pn = 0;
            float *data = NULL, *pdata = NULL;
            REQUIRE_OK(gradacc_accumulator_shard(acc, &off, &n, &data));
            REQUIRE_OK(gradacc_accumulator_shard(plain, &poff, &pn, &pdata));
            CHECK(same_info(&info, &pinfo), "%s rank %d: the info differs from the plain boundary's", what, rank);
            CHECK(off == poff && n == pn && (n == 0 || s->overflow || memcmp(data, pdata, n * sizeof(float)) == 0),
                  "%s rank %d: the shard [%zu, +%zu) is not the plain boundary's [%zu, +%zu) bit for bit", what, rank, off, n,
                  poff, pn);
            gradacc_accumulator_destroy(plain);
            gradacc_scaler_destroy(plain_scaler);
        }
        gradacc_accumulator_destroy(acc);
        gradacc_scaler_destroy(scaler);
        free_reference(&ref);
    }
    grid_free(&g);
}

/* Misuse on the S x R grid (crosswise replica groups where S and R are 2 or more): every rank
 * fails alike, and the window then reduces on the right communicators. */
static void misuse(int S)
{
    const int rank = world_rank(), world = world_size();
    const int sc = 1; /* the clipped scenario, without its clipping */
    const scenario *s = &scenarios[sc];
    reference ref = make_reference(sc);
    gradacc_scaler_t *scaler = scaler_with_scale((float)scale_of(rank));
    grid g = grid_split(S, 0);
    char what[128];

    /* An unsharded accumulator: INVALID_ARGUMENT everywhere; then an all-reduce over the world. */
    gradacc_accumulator_t *unsharded = make_hybrid_acc(s, 0.0f, 0, 0);
    gradacc_accumulator_t *accs[2] = {unsharded, NULL};
    add_window(sc, scaler, accs);
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    info.total_count = 12345;
    gradacc_status_t st = gradacc_accumulator_sync_hybrid(unsharded, g.shard, g.replica, &info);
    CHECK(st == GRADACC_STATUS_INVALID_ARGUMENT && strstr(gradacc_last_error(), "sharded accumulator"),
          "unsharded on %d x %d, rank %d: status %d (%s): %s", g.S, g.R, rank, (int)st, gradacc_status_string(st),
          gradacc_last_error());
    CHECK(info.total_count == 12345, "unsharded, rank %d: the info was written on failure", rank);
    CHECK(same_on_all_ranks((uint64_t)st, MPI_COMM_WORLD), "unsharded: the ranks' statuses differ");
    gradacc_comm_t *world_comm = comm_of(MPI_COMM_WORLD);
    EXPECT_OK(gradacc_accumulator_sync(unsharded, world_comm, &info));
    /* An all-reduce: one shard (the whole master), replicated on every rank. */
    grid all = {1, world, rank, 0, MPI_COMM_SELF, MPI_COMM_WORLD, NULL, NULL};
    snprintf(what, sizeof what, "unsharded, after the failure, synced on the world");
    check_hybrid(what, &all, s, &ref, 0.0f, unsharded, &info);
    gradacc_accumulator_destroy(unsharded);
    EXPECT_OK(gradacc_comm_destroy(world_comm));

    if (g.S >= 2 && g.R >= 2) {
        grid cross = grid_split(S, 1);
        gradacc_accumulator_t *acc = make_hybrid_acc(s, 0.0f, g.S, g.i);
        accs[0] = acc;
        add_window(sc, scaler, accs);
        st = gradacc_accumulator_sync_hybrid(acc, cross.shard, cross.replica, NULL);
        CHECK(st == GRADACC_STATUS_SIZE_MISMATCH && strstr(gradacc_last_error(), "replica groups"),
              "crosswise on %d x %d, rank %d: status %d (%s): %s", g.S, g.R, rank, (int)st, gradacc_status_string(st),
              gradacc_last_error());
        CHECK(same_on_all_ranks((uint64_t)st, MPI_COMM_WORLD), "crosswise: the ranks' statuses differ");
        info = (gradacc_sync_info_t)GRADACC_SYNC_INFO_INIT;
        EXPECT_OK(gradacc_accumulator_sync_hybrid(acc, g.shard, g.replica, &info));
        snprintf(what, sizeof what, "%d shards x %d replicas, after the crosswise failure", g.S, g.R);
        check_hybrid(what, &g, s, &ref, 0.0f, acc, &info);
        gradacc_accumulator_destroy(acc);
        grid_free(&cross);
    }
    grid_free(&g);
    gradacc_scaler_destroy(scaler);
    free_reference(&ref);
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    const int world = world_size();
    if (world > 4) {
        if (world_rank() == 0)
            fprintf(stderr, "hybrid: written for up to 4 processes, got %d\n", world);
        MPI_Finalize();
        return 77;
    }
    gradacc_tensor_desc_t layout[T];
    for (int t = 0; t < T; t++)
        layout[t] = (gradacc_tensor_desc_t){numel[t], dtypes[t]};
    check_placement(layout, T, offset, LEN);
    for (int S = 1; S <= world; S++) {
        if (world % S != 0)
            continue;
        run_grid(S);
        misuse(S);
    }
    if (world_rank() == 0)
        printf("%d processes: hybrid boundaries on every grid matched the reference; misuse failed everywhere\n", world);
    return mpi_finish();
}
