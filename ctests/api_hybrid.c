/* The hybrid boundary (HSDP) through the C API: gradacc_accumulator_sync_hybrid on grids of
 * S shards x R replicas of in-process ranks (one thread each). Rank a*S + i holds shard i of shard
 * group a (a local group of S) and is replica a of replica group i (a local group of R).
 *
 * Values: grids 2x2, 3x2, 2x3, 1x3 and 3x1, each with the FP32 and the BF16 wire; random layouts
 * of odd-sized f16 / bf16 / f32 tensors (some smaller than a 4096-element block, so some shards
 * are empty), three windows of random micro-batches (none on some ranks) of random counts, every
 * normalisation, mean and sum losses, clipped and not, a window with an overflow. After each
 * sync: every rank reports the same info, with the counts of every rank of the grid; the shards
 * of a shard group tile the layout as the reduce-scatter cuts it; replicas hold the same range
 * and bits; the concatenated shards match an f64 reference of the normalised, clipped gradient
 * over all S*R ranks within 4e-6 of the summed magnitudes of the contributions (plus 2^-8 of them
 * with the BF16 wire, which rounds each contribution once). With R = 1 every rank's info and
 * shard are the bits of a plain reduce-scatter sync on the shard group; with S = 1 those of an
 * unsharded sync over the replica group.
 *
 * Misuse, on a 2x2 grid with timeouts of 2 s so a rank left waiting cannot hang the test: replica
 * groups that pair different shards fail with SIZE_MISMATCH on every rank; an unsharded
 * accumulator with INVALID_ARGUMENT on every rank; a NULL or wrong-type shard_comm or
 * replica_comm, or a NULL acc, on one rank fails that rank naming the argument, and every other
 * rank fails too (PEER_FAILURE, or TIMEOUT / COMM_FAILURE where that rank cannot tell it) without
 * hanging. Each time the windows stay intact: a plain sync on a shard group, or the hybrid sync on
 * the right groups, gives the exact sums afterwards. */
#include "shard_window.h"

enum { MAX_S = 3, MAX_R = 3, MAX_RANKS = MAX_S * MAX_R, WINDOWS = 3 };
typedef char window_holds_every_rank[(int)MAX_RANKS <= (int)WINDOW_RANKS ? 1 : -1];

/* The communicators of an S x R grid: shard[a][i] is rank i of shard group a, replica[i][a] rank a
 * of replica group i. */
typedef struct {
    int S, R;
    gradacc_comm_t *shard[MAX_R][MAX_S];
    gradacc_comm_t *replica[MAX_S][MAX_R];
} grid;

typedef struct {
    const layout *l;
    gradacc_scaler_t *scaler;
    const rank_window *w; /* NULL: add nothing */
    gradacc_accumulator_t *adds_to[2]; /* the accumulators the window is added to (NULL: none) */
    /* gradacc_accumulator_sync_hybrid(acc, shard_comm, replica_comm, info) when `hybrid`, all
     * passed as they are (NULL or a wrong handle included); info NULL when `no_info`. */
    int hybrid, no_info;
    gradacc_accumulator_t *acc;
    gradacc_comm_t *shard_comm, *replica_comm;
    /* then gradacc_accumulator_sync(plain, plain_comm) when `plain` is set */
    gradacc_accumulator_t *plain;
    gradacc_comm_t *plain_comm;
    /* outputs */
    gradacc_status_t st, st_plain;
    gradacc_sync_info_t info, info_plain;
    char error[512]; /* the hybrid sync's last error */
} rank_args;

#define INFO_FMT "{inf %d count %llu mb %llu norm %.17g clip %.17g}"
#define INFO_ARGS(x)                                                                                                   \
    (int)(x).found_inf, (unsigned long long)(x).total_count, (unsigned long long)(x).microbatches, (x).grad_norm,     \
        (x).clip_coef

static void *rank_main(void *arg)
{
    rank_args *a = arg;
    if (a->w)
        for (int k = 0; k < 2; k++)
            if (a->adds_to[k])
                add_window(a->adds_to[k], a->scaler, a->l, a->w);
    if (a->hybrid) {
        memset(&a->info, 0, sizeof a->info);
        a->info.struct_size = sizeof a->info;
        a->st = gradacc_accumulator_sync_hybrid(a->acc, a->shard_comm, a->replica_comm, a->no_info ? NULL : &a->info);
        snprintf(a->error, sizeof a->error, "%s", a->st ? gradacc_last_error() : "");
    }
    if (a->plain) {
        memset(&a->info_plain, 0, sizeof a->info_plain);
        a->info_plain.struct_size = sizeof a->info_plain;
        a->st_plain = gradacc_accumulator_sync(a->plain, a->plain_comm, &a->info_plain);
    }
    return NULL;
}

static void grid_create(grid *g, int S, int R, double timeout)
{
    memset(g, 0, sizeof *g);
    g->S = S;
    g->R = R;
    for (int a = 0; a < R; a++)
        REQUIRE_OK(gradacc_comm_create_local(S, g->shard[a]));
    for (int i = 0; i < S; i++)
        REQUIRE_OK(gradacc_comm_create_local(R, g->replica[i]));
    for (int a = 0; a < R; a++)
        for (int i = 0; i < S; i++) {
            REQUIRE_OK(gradacc_comm_set_timeout(g->shard[a][i], timeout));
            REQUIRE_OK(gradacc_comm_set_timeout(g->replica[i][a], timeout));
        }
}

static void grid_destroy(grid *g)
{
    for (int a = 0; a < g->R; a++)
        for (int i = 0; i < g->S; i++) {
            EXPECT_OK(gradacc_comm_destroy(g->shard[a][i]));
            EXPECT_OK(gradacc_comm_destroy(g->replica[i][a]));
        }
}

/* After a successful hybrid sync (and, on a degenerate grid, a plain sync) of every rank of an
 * S x R grid: the checks of the file's comment. Returns the clipping coefficient applied. */
static double check_synced(const char *what, const layout *l, const setup *s, const window *w, float max_norm, int S,
                           int R, rank_args *args)
{
    const int world = S * R;
    int failed = 0;
    for (int r = 0; r < world; r++) {
        EXPECT_OK(args[r].st);
        if (args[r].st)
            fprintf(stderr, "    %s rank %d: %s\n", what, r, args[r].error);
        if (args[r].plain)
            EXPECT_OK(args[r].st_plain);
        failed |= args[r].st || (args[r].plain && args[r].st_plain);
    }
    if (failed)
        return 1.0;

    const gradacc_sync_info_t *info = &args[0].info;
    for (int r = 0; r < world; r++) {
        CHECK(same_info(&args[r].info, info), "%s rank %d: info " INFO_FMT ", rank 0's " INFO_FMT, what, r,
              INFO_ARGS(args[r].info), INFO_ARGS(*info));
        if (args[r].plain)
            CHECK(same_info(&args[r].info, &args[r].info_plain), "%s rank %d: info " INFO_FMT ", the plain boundary's " INFO_FMT,
                  what, r, INFO_ARGS(args[r].info), INFO_ARGS(args[r].info_plain));
    }
    CHECK(info->found_inf == (w->overflow != 0), "%s: found_inf %d, overflow %d", what, (int)info->found_inf, w->overflow);
    CHECK(info->total_count == w->items && info->microbatches == w->microbatches,
          "%s: count %llu and micro-batches %llu, expected %llu and %llu over all %d ranks", what,
          (unsigned long long)info->total_count, (unsigned long long)info->microbatches, (unsigned long long)w->items,
          (unsigned long long)w->microbatches, world);

    double *got = malloc((l->len ? l->len : 1) * sizeof(double));
    size_t next = 0;
    for (int a = 0; a < R; a++) {
        size_t group_next = 0;
        for (int i = 0; i < S; i++) {
            const int r = a * S + i;
            size_t off = 777, n = 777, want_off, want_n, base_n = 0;
            float *data = NULL, *base = NULL;
            REQUIRE_OK(gradacc_accumulator_shard(args[r].acc, &off, &n, &data));
            REQUIRE_OK(gradacc_accumulator_master(args[r].acc, 0, &base, &base_n));
            expected_shard(l->len, S, i, &want_off, &want_n);
            CHECK(off == group_next && off == want_off && n == want_n,
                  "%s rank %d (shard %d of %d): shard [%zu, +%zu), expected [%zu, +%zu) right after the previous one at %zu",
                  what, r, i, S, off, n, want_off, want_n, group_next);
            CHECK(data == base + off, "%s rank %d: shard address %p, master %p + %zu", what, r, (void *)data, (void *)base, off);
            group_next = off + n;

            /* Replicas: the same range and bits as shard group 0's rank holding this shard. */
            if (a > 0) {
                size_t off0 = 0, n0 = 0;
                float *data0 = NULL;
                REQUIRE_OK(gradacc_accumulator_shard(args[i].acc, &off0, &n0, &data0));
                CHECK(off0 == off && n0 == n && (n == 0 || memcmp(data0, data, n * sizeof(float)) == 0),
                      "%s: rank %d (replica %d of shard %d) differs from rank %d: [%zu, +%zu) vs [%zu, +%zu)", what, r,
                      a, i, i, off, n, off0, n0);
            }
            /* Degenerate grids: the plain boundary's bits. */
            if (args[r].plain) {
                size_t poff = 0, pn = 0;
                float *pdata = NULL;
                REQUIRE_OK(gradacc_accumulator_shard(args[r].plain, &poff, &pn, &pdata));
                size_t bad = 0, first = 0;
                for (size_t k = 0; k < n && poff == off && pn == n; k++)
                    if (memcmp(&data[k], &pdata[k], sizeof(float)) != 0 && !bad++)
                        first = k;
                CHECK(poff == off && pn == n && bad == 0,
                      "%s rank %d: [%zu, +%zu) vs the plain boundary's [%zu, +%zu): %zu elements differ, first at %zu", what,
                      r, off, n, poff, pn, bad, off + first);
            }
            if (a == 0 && off == next && off + n <= l->len) {
                for (size_t k = 0; k < n; k++)
                    got[off + k] = data[k];
                next = off + n;
            }
        }
        CHECK(group_next == l->len, "%s: shard group %d covers %zu of %zu elements", what, a, group_next, l->len);
    }

    double coef = 1.0;
    if (!w->overflow && next == l->len) {
        /* The BF16 wire rounds each rank's contribution to bf16 once (relative error <= 2^-8). */
        const double wire = s->wire == GRADACC_DTYPE_BF16 && world > 1 ? ldexp(1.0, -8) : 0.0;
        double norm = reference_norm(w, l->len), spread = 0.0;
        for (size_t k = 0; k < l->len; k++)
            spread += (w->magnitude[k] / w->divisor) * (w->magnitude[k] / w->divisor);
        const double norm_tol = 1e-5 * norm + wire * sqrt(spread) + 1e-30;
        coef = max_norm == 0.0f ? 1.0 : fmin(1.0, (double)max_norm / (norm + 1e-6));
        CHECK_CLOSE(info->grad_norm, norm, norm_tol, "%s: norm", what);
        CHECK_CLOSE(info->clip_coef, coef, coef * (1e-5 + norm_tol / (norm + 1e-30)), "%s: clip coefficient", what);
        const double coef_error = fabs(info->clip_coef - coef);
        int shown = 0;
        for (size_t k = 0; k < l->len; k++) {
            double want = w->sum[k] / w->divisor * coef;
            double tol = (4e-6 + wire) * w->magnitude[k] / w->divisor * coef + fabs(w->sum[k] / w->divisor) * coef_error + 1e-30;
            if (!(fabs(got[k] - want) <= tol) && shown++ < 3)
                CHECK(0, "%s element %zu: %.9g, f64 reference %.9g (tol %.2g)", what, k, got[k], want, tol);
        }
        CHECK(shown == 0, "%s: %d elements off the f64 reference", what, shown);
    }
    free(got);
    return coef;
}

/* One layout on an S x R grid, WINDOWS windows (window 1 overflows when `overflow`). */
static void run_case(test_rng *rng, const layout *l, const setup *s, int S, int R, int overflow)
{
    const int world = S * R;
    static window w[WINDOWS];
    for (int k = 0; k < WINDOWS; k++)
        make_window(rng, l, s, world, overflow && k == 1, &w[k]);
    /* Clip to 0.7 of the first window's norm: it clips; later windows may not. */
    float max_norm = s->clip ? (float)(0.7 * reference_norm(&w[0], l->len)) : 0.0f;

    grid g;
    grid_create(&g, S, R, 60.0);
    /* The plain boundary beside a degenerate grid: with one replica a reduce-scatter over a second
     * shard group, with one shard an unsharded sync over a second replica group. */
    gradacc_comm_t *plain_comms[MAX_RANKS] = {NULL};
    const int degenerate = R == 1 || S == 1;
    if (degenerate)
        REQUIRE_OK(gradacc_comm_create_local(world, plain_comms));
    rank_args args[MAX_RANKS];
    memset(args, 0, sizeof args);
    for (int a = 0; a < R; a++)
        for (int i = 0; i < S; i++) {
            rank_args *x = &args[a * S + i];
            x->l = l;
            x->scaler = scaler_with_scale((float)ldexp(1.0, 8 + a * S + i));
            x->acc = x->adds_to[0] = make_acc(l, s, max_norm, S, i);
            x->shard_comm = g.shard[a][i];
            x->replica_comm = g.replica[i][a];
            x->hybrid = 1;
            if (degenerate) {
                x->plain = x->adds_to[1] = make_acc(l, s, max_norm, R == 1 ? S : 0, R == 1 ? i : 0);
                x->plain_comm = plain_comms[a * S + i];
            }
        }
    char what[200];
    int clipped = 0;
    for (int k = 0; k < WINDOWS; k++) {
        for (int r = 0; r < world; r++)
            args[r].w = &w[k].rank[r];
        run_ranks((size_t)world, rank_main, args, sizeof args[0]);
        snprintf(what, sizeof what, "%s (%zu elements), %d shards x %d replicas, %s wire, %s, %s loss%s, window %d%s",
                 l->name, l->len, S, R, dtype_name(s->wire), normalize_name(s->normalize),
                 s->loss == GRADACC_LOSS_REDUCTION_MEAN ? "mean" : "sum", s->clip ? ", clipped" : "", k,
                 w[k].overflow ? " (overflow)" : "");
        clipped += check_synced(what, l, s, &w[k], max_norm, S, R, args) < 1.0;
    }
    CHECK(!s->clip || clipped > 0, "%s: clipping never applied", what);
    for (int r = 0; r < world; r++) {
        EXPECT_OK(gradacc_accumulator_destroy(args[r].acc));
        EXPECT_OK(gradacc_accumulator_destroy(args[r].plain));
        gradacc_scaler_destroy(args[r].scaler);
        if (degenerate)
            EXPECT_OK(gradacc_comm_destroy(plain_comms[r]));
    }
    grid_destroy(&g);
    for (int k = 0; k < WINDOWS; k++)
        free_window(&w[k], l, world);
}

/* ---- misuse on a 2x2 grid ------------------------------------------------------------------ */

/* Shard 0 of 2: [0, 8192), shard 1: [8192, 12352), the tensor padded to a multiple of
 * GRADACC_MASTER_ALIGN bytes. */
enum { MN = 3 * BLOCK + 5 };

/* Rank g's gradient: multiples of 1/8 in [-1, 1], so every sum here is exact in f32. */
static float misuse_value(int g, size_t i)
{
    return (float)(((double)((i * 7 + (size_t)g * 13) % 17) - 8.0) / 8.0);
}

typedef struct {
    layout l;
    setup s;
    rank_window rw[4];
    gradacc_scaler_t *scaler;
} misuse_world;

static void misuse_world_create(misuse_world *m)
{
    memset(m, 0, sizeof *m);
    m->l.name = "misuse";
    m->l.tensors = 1;
    m->l.desc[0].numel = MN;
    m->l.desc[0].dtype = GRADACC_DTYPE_F32;
    layout_place(&m->l);
    m->s.normalize = GRADACC_NORMALIZE_NONE;
    m->s.loss = GRADACC_LOSS_REDUCTION_SUM;
    m->s.wire = GRADACC_DTYPE_F32;
    m->scaler = scaler_with_scale(1.0f);
    for (int g = 0; g < 4; g++) {
        m->rw[g].microbatches = 1;
        m->rw[g].count[0] = (uint64_t)g + 1;
        m->rw[g].g[0][0] = grad_alloc(GRADACC_DTYPE_F32, MN);
        for (size_t i = 0; i < MN; i++)
            ((float *)m->rw[g].g[0][0].data)[i] = misuse_value(g, i);
    }
}

static void misuse_world_destroy(misuse_world *m)
{
    for (int g = 0; g < 4; g++)
        grad_free(&m->rw[g].g[0][0]);
    gradacc_scaler_destroy(m->scaler);
}

/* Checks that `acc`'s shard holds the exact sum of the gradients of the ranks in `ranks` (a bit
 * mask), and that `info` counts their items. */
static void check_exact(const char *what, int rank, gradacc_accumulator_t *acc, const gradacc_sync_info_t *info,
                        unsigned ranks)
{
    uint64_t items = 0, microbatches = 0;
    for (int g = 0; g < 4; g++)
        if (ranks >> g & 1) {
            items += (uint64_t)g + 1;
            microbatches++;
        }
    if (info)
        CHECK(info->total_count == items && info->microbatches == microbatches && !info->found_inf,
              "%s rank %d: count %llu, micro-batches %llu, expected %llu and %llu", what, rank,
              (unsigned long long)info->total_count, (unsigned long long)info->microbatches, (unsigned long long)items,
              (unsigned long long)microbatches);
    size_t off = 0, n = 0;
    float *data = NULL;
    REQUIRE_OK(gradacc_accumulator_shard(acc, &off, &n, &data));
    size_t bad = 0, first = 0;
    for (size_t k = 0; k < n; k++) {
        float want = 0.0f; /* and +0 in the padding after the tensor */
        for (int g = 0; g < 4 && off + k < MN; g++)
            if (ranks >> g & 1)
                want += misuse_value(g, off + k);
        if (memcmp(&want, &data[k], sizeof want) != 0 && !bad++)
            first = k;
    }
    CHECK(n > 0 && bad == 0, "%s rank %d: %zu of %zu elements of [%zu, +%zu) are not the exact sum, first at %zu", what, rank,
          bad, n, off, n, off + first);
}

/* Sets up four ranks for one hybrid sync over `g`: each adds its window to `accs[r]` when `add`. */
static void misuse_args(rank_args *args, misuse_world *m, gradacc_accumulator_t **accs, const grid *g, int add)
{
    memset(args, 0, 4 * sizeof *args);
    for (int r = 0; r < 4; r++) {
        const int a = r / 2, i = r % 2;
        args[r].l = &m->l;
        args[r].scaler = m->scaler;
        args[r].w = add ? &m->rw[r] : NULL;
        args[r].adds_to[0] = accs[r];
        args[r].hybrid = 1;
        args[r].acc = accs[r];
        args[r].shard_comm = g->shard[a][i];
        args[r].replica_comm = g->replica[i][a];
    }
}

/* A plain sync of every rank's accumulator on its shard group of `g` (the window must be intact):
 * each shard holds the exact sum over its shard group. */
static void plain_sync_on_shard_groups(const char *what, misuse_world *m, gradacc_accumulator_t **accs, const grid *g)
{
    rank_args args[4];
    misuse_args(args, m, accs, g, 0);
    for (int r = 0; r < 4; r++) {
        args[r].hybrid = 0;
        args[r].plain = accs[r];
        args[r].plain_comm = g->shard[r / 2][r % 2];
    }
    run_ranks(4, rank_main, args, sizeof args[0]);
    for (int r = 0; r < 4; r++) {
        EXPECT_OK(args[r].st_plain);
        if (args[r].st_plain == GRADACC_STATUS_OK)
            check_exact(what, r, accs[r], &args[r].info_plain, r < 2 ? 0x3u : 0xcu);
    }
}

static int is_failure_of_a_peer(gradacc_status_t st)
{
    return st == GRADACC_STATUS_PEER_FAILURE || st == GRADACC_STATUS_TIMEOUT || st == GRADACC_STATUS_COMM_FAILURE;
}

static double seconds_since(const struct timespec *t0)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)(t.tv_sec - t0->tv_sec) + 1e-9 * (double)(t.tv_nsec - t0->tv_nsec);
}

/* Replica groups that pair different shards, and an unsharded accumulator: every rank fails
 * alike, and the window then reduces on the shard group. */
static void test_wrong_groups(void)
{
    misuse_world m;
    misuse_world_create(&m);
    grid g;
    grid_create(&g, 2, 2, 2.0);
    rank_args args[4];

    /* Crosswise: shard group 1 joins replica group j with its shard 1 - j, so replica group 0
     * holds shards 0 and 1. Each group on its own is valid. */
    gradacc_accumulator_t *sharded[4];
    for (int r = 0; r < 4; r++)
        sharded[r] = make_acc(&m.l, &m.s, 0.0f, 2, r % 2);
    misuse_args(args, &m, sharded, &g, 1);
    args[2].replica_comm = g.replica[1][1];
    args[3].replica_comm = g.replica[0][1];
    run_ranks(4, rank_main, args, sizeof args[0]);
    for (int r = 0; r < 4; r++)
        CHECK(args[r].st == GRADACC_STATUS_SIZE_MISMATCH && strstr(args[r].error, "replica groups"),
              "crosswise replica groups, rank %d: status %d (%s), expected SIZE_MISMATCH naming the replica groups: %s", r,
              (int)args[r].st, gradacc_status_string(args[r].st), args[r].error);
    plain_sync_on_shard_groups("after the crosswise failure", &m, sharded, &g);

    /* Unsharded accumulators: a hybrid boundary needs a shard. */
    gradacc_accumulator_t *unsharded[4];
    for (int r = 0; r < 4; r++)
        unsharded[r] = make_acc(&m.l, &m.s, 0.0f, 0, 0);
    misuse_args(args, &m, unsharded, &g, 1);
    run_ranks(4, rank_main, args, sizeof args[0]);
    for (int r = 0; r < 4; r++)
        CHECK(args[r].st == GRADACC_STATUS_INVALID_ARGUMENT && strstr(args[r].error, "sharded accumulator"),
              "unsharded, rank %d: status %d (%s), expected INVALID_ARGUMENT asking for a sharded accumulator: %s", r,
              (int)args[r].st, gradacc_status_string(args[r].st), args[r].error);
    plain_sync_on_shard_groups("unsharded, after the failure", &m, unsharded, &g);

    for (int r = 0; r < 4; r++) {
        EXPECT_OK(gradacc_accumulator_destroy(sharded[r]));
        EXPECT_OK(gradacc_accumulator_destroy(unsharded[r]));
    }
    grid_destroy(&g);
    misuse_world_destroy(&m);
}

/* One rank passes a bad argument: it fails naming it; the others fail without hanging; the
 * windows are intact. */
static void test_bad_argument_on_one_rank(void)
{
    misuse_world m;
    misuse_world_create(&m);
    gradacc_accumulator_t *foreign = make_acc(&m.l, &m.s, 0.0f, 0, 0); /* a handle of another type */
    enum { NULL_SHARD, NULL_REPLICA, FOREIGN_SHARD, FOREIGN_REPLICA, NULL_ACC, CASES };
    static const char *const names[CASES] = {"NULL shard_comm", "NULL replica_comm", "an accumulator as shard_comm",
                                             "an accumulator as replica_comm", "NULL acc"};
    for (int c = 0; c < CASES; c++) {
        const int bad = c % 4; /* the rank that passes it */
        grid g;
        grid_create(&g, 2, 2, 2.0);
        gradacc_accumulator_t *accs[4];
        for (int r = 0; r < 4; r++)
            accs[r] = make_acc(&m.l, &m.s, 0.0f, 2, r % 2);
        rank_args args[4];
        misuse_args(args, &m, accs, &g, 1);
        gradacc_status_t want = GRADACC_STATUS_NULL_ARGUMENT;
        const char *argument = "`shard_comm`";
        switch (c) {
        case NULL_SHARD:
            args[bad].shard_comm = NULL;
            break;
        case NULL_REPLICA:
            args[bad].replica_comm = NULL;
            argument = "`replica_comm`";
            break;
        case FOREIGN_SHARD:
            args[bad].shard_comm = (gradacc_comm_t *)(void *)foreign;
            want = GRADACC_STATUS_INVALID_HANDLE;
            break;
        case FOREIGN_REPLICA:
            args[bad].replica_comm = (gradacc_comm_t *)(void *)foreign;
            want = GRADACC_STATUS_INVALID_HANDLE;
            argument = "`replica_comm`";
            break;
        default:
            args[bad].acc = NULL;
            argument = "`acc`";
            break;
        }
        struct timespec t0;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        run_ranks(4, rank_main, args, sizeof args[0]);
        const double took = seconds_since(&t0);
        CHECK(args[bad].st == want && strstr(args[bad].error, argument),
              "%s on rank %d: status %d (%s), expected %d (%s) naming %s: %s", names[c], bad, (int)args[bad].st,
              gradacc_status_string(args[bad].st), (int)want, gradacc_status_string(want), argument, args[bad].error);
        for (int r = 0; r < 4; r++)
            if (r != bad)
                CHECK(is_failure_of_a_peer(args[r].st),
                      "%s on rank %d: rank %d: status %d (%s), expected PEER_FAILURE, TIMEOUT or COMM_FAILURE: %s", names[c],
                      bad, r, (int)args[r].st, gradacc_status_string(args[r].st), args[r].error);
        /* Every rank returned within a few of its 2 s timeouts (one per group it waits in). */
        CHECK(took < 15.0, "%s on rank %d: the ranks took %.1f s to fail", names[c], bad, took);
        if (c == NULL_ACC) {
            /* The refusal reached every rank (nobody waited for a timeout), so the groups still
             * work and the hybrid sync on them gives the whole sum (rank 3 without an info). */
            for (int r = 1; r < 4; r++)
                CHECK(args[r].st == GRADACC_STATUS_PEER_FAILURE, "NULL acc on rank 0: rank %d: status %d (%s)", r,
                      (int)args[r].st, gradacc_status_string(args[r].st));
            misuse_args(args, &m, accs, &g, 0);
            args[3].no_info = 1;
            run_ranks(4, rank_main, args, sizeof args[0]);
            for (int r = 0; r < 4; r++) {
                EXPECT_OK(args[r].st);
                if (args[r].st == GRADACC_STATUS_OK)
                    check_exact("the hybrid sync after a NULL acc", r, accs[r], r == 3 ? NULL : &args[r].info, 0xfu);
            }
        } else {
            /* A rank that timed out aborted its groups: the windows reduce on new ones. */
            grid fresh;
            grid_create(&fresh, 2, 2, 10.0);
            plain_sync_on_shard_groups(names[c], &m, accs, &fresh);
            grid_destroy(&fresh);
        }
        for (int r = 0; r < 4; r++)
            EXPECT_OK(gradacc_accumulator_destroy(accs[r]));
        grid_destroy(&g);
    }
    EXPECT_OK(gradacc_accumulator_destroy(foreign));
    misuse_world_destroy(&m);
}

int main(void)
{
    test_rng rng = rng_fresh("api_hybrid");
    test_wrong_groups();
    test_bad_argument_on_one_rank();
    /* Every grid with both wires; normalisations, clipping and overflow vary across them, and one
     * layout in four is smaller than a block (shards past the first are empty). */
    static const int grids[][2] = {{2, 2}, {3, 2}, {2, 3}, {1, 3}, {3, 1}};
    for (int c = 0; c < 10; c++) {
        setup s = {(gradacc_normalize_t)(c % 4),
                   rng_below(&rng, 2) ? GRADACC_LOSS_REDUCTION_MEAN : GRADACC_LOSS_REDUCTION_SUM, (c + c / 5) % 2,
                   c < 5 ? GRADACC_DTYPE_F32 : GRADACC_DTYPE_BF16};
        layout l = random_layout(&rng, c % 4 == 3);
        run_case(&rng, &l, &s, grids[c % 5][0], grids[c % 5][1], c % 3 == 1);
    }
    return test_finish();
}
