/* The reduce-scatter boundary through the C API: GRADACC_SHARDING_REDUCE_SCATTER in the config and
 * gradacc_accumulator_shard, on 1 to 5 ranks of the in-process communicator (one thread each).
 *
 * Equivalence: every rank adds the same micro-batches to a sharded accumulator (synced on one
 * group) and to an unsharded one (synced on a second group). Random layouts of odd-sized f16 /
 * bf16 / f32 tensors, one of them smaller than a 4096-element block (so some shards are empty),
 * several windows with random numbers of micro-batches (none on some ranks) of random counts,
 * every normalisation, with and without clipping, a window with an overflow. After each sync:
 * the shards tile the layout in rank order (equal parts rounded up to whole blocks, as the header
 * says); each shard holds the bits of the same range of the all-reduced master; the sync info is
 * the all-reduce's, on every rank; and the concatenated shards match an f64 reference of the
 * normalised, clipped gradient within 4e-6 of the summed magnitudes of the contributions.
 *
 * Misuse: the config's sharding fields and wire_dtype are checked by both constructors (the
 * message names the field and the value); gradacc_accumulator_shard's NULL and dead arguments;
 * a sharded accumulator synced with no communicator, on groups of other sizes, or on ranks in
 * the wrong order fails on every rank (a rank whose own call is valid with PEER_FAILURE) and
 * leaves the window intact: a sync on the right group afterwards gives the right answer. */
#include "shard_window.h"

enum { MAX_RANKS = 5, WINDOWS = 4 };

#define SENTINEL_PTR ((void *)(uintptr_t)0x5e5e5e50)

typedef struct {
    const layout *l;
    gradacc_scaler_t *scaler;
    gradacc_accumulator_t *sharded, *plain;
    gradacc_comm_t *shard_comm, *plain_comm; /* shard_comm may be NULL */
    const rank_window *w;                    /* NULL: add nothing */
    int sync_sharded, sync_plain;
    /* outputs */
    gradacc_status_t st_sharded, st_plain;
    gradacc_sync_info_t info_sharded, info_plain;
    char error[512]; /* the sharded sync's last error */
} rank_args;

static void *rank_main(void *arg)
{
    rank_args *a = arg;
    if (a->w) {
        add_window(a->sharded, a->scaler, a->l, a->w);
        if (a->plain)
            add_window(a->plain, a->scaler, a->l, a->w);
    }
    if (a->sync_sharded) {
        a->info_sharded.struct_size = sizeof a->info_sharded;
        a->st_sharded = gradacc_accumulator_sync(a->sharded, a->shard_comm, &a->info_sharded);
        snprintf(a->error, sizeof a->error, "%s", a->st_sharded ? gradacc_last_error() : "");
    }
    if (a->sync_plain) {
        a->info_plain.struct_size = sizeof a->info_plain;
        a->st_plain = gradacc_accumulator_sync(a->plain, a->plain_comm, &a->info_plain);
    }
    return NULL;
}

/* After a successful sync of every rank's sharded and unsharded accumulator: the checks of the
 * file's comment. Returns the clipping coefficient applied. */
static double check_synced(const char *what, const layout *l, const window *w, float max_norm, int ranks, rank_args *args)
{
    for (int r = 0; r < ranks; r++) {
        EXPECT_OK(args[r].st_sharded);
        EXPECT_OK(args[r].st_plain);
        if (args[r].st_sharded || args[r].st_plain)
            return 1.0;
    }
    const gradacc_sync_info_t *info = &args[0].info_plain;
    for (int r = 0; r < ranks; r++) {
        CHECK(same_info(&args[r].info_sharded, info) && same_info(&args[r].info_plain, info),
              "%s rank %d: sharded info {inf %d count %llu mb %llu norm %.17g clip %.17g}, all-reduce {inf %d count %llu mb "
              "%llu norm %.17g clip %.17g}",
              what, r, (int)args[r].info_sharded.found_inf, (unsigned long long)args[r].info_sharded.total_count,
              (unsigned long long)args[r].info_sharded.microbatches, args[r].info_sharded.grad_norm,
              args[r].info_sharded.clip_coef, (int)info->found_inf, (unsigned long long)info->total_count,
              (unsigned long long)info->microbatches, info->grad_norm, info->clip_coef);
    }
    CHECK(info->found_inf == (w->overflow != 0), "%s: found_inf %d, overflow %d", what, (int)info->found_inf, w->overflow);

    double *got = malloc(l->len * sizeof(double));
    size_t next = 0;
    for (int r = 0; r < ranks; r++) {
        size_t off = 777, n = 777, want_off, want_n;
        float *data = NULL, *base = NULL, *flat = NULL;
        size_t base_n = 0, flat_off = 777, flat_n = 777;
        REQUIRE_OK(gradacc_accumulator_shard(args[r].sharded, &off, &n, &data));
        REQUIRE_OK(gradacc_accumulator_master(args[r].sharded, 0, &base, &base_n));
        REQUIRE_OK(gradacc_accumulator_shard(args[r].plain, &flat_off, &flat_n, &flat));
        expected_shard(l->len, ranks, r, &want_off, &want_n);
        CHECK(off == next && off == want_off && n == want_n,
              "%s rank %d of %d: shard [%zu, +%zu), expected [%zu, +%zu) right after the previous one at %zu", what, r,
              ranks, off, n, want_off, want_n, next);
        CHECK(data == base + off, "%s rank %d: shard address %p, master %p + %zu", what, r, (void *)data, (void *)base, off);
        CHECK(flat_off == 0 && flat_n == l->len, "%s rank %d: the unsharded shard is [%zu, +%zu) of %zu", what, r,
              flat_off, flat_n, l->len);
        next = off + n;
        if (off + n > l->len || w->overflow)
            continue;
        size_t bad = 0, first = 0;
        for (size_t i = 0; i < n; i++)
            if (memcmp(&data[i], &flat[off + i], sizeof(float)) != 0 && !bad++)
                first = i;
        CHECK(bad == 0, "%s rank %d: %zu of %zu shard elements differ from the all-reduce, first at %zu: %.9g vs %.9g", what,
              r, bad, n, off + first, (double)data[first], (double)flat[off + first]);
        for (size_t i = 0; i < n; i++)
            got[off + i] = data[i];
    }
    CHECK(next == l->len, "%s: the shards cover %zu of %zu elements", what, next, l->len);

    double coef = 1.0;
    if (!w->overflow && next == l->len) {
        double norm = reference_norm(w, l->len);
        coef = max_norm == 0.0f ? 1.0 : fmin(1.0, (double)max_norm / (norm + 1e-6));
        CHECK_CLOSE(info->grad_norm, norm, 1e-5 * norm + 1e-30, "%s: norm", what);
        CHECK_CLOSE(info->clip_coef, coef, 1e-5 * coef, "%s: clip coefficient", what);
        int shown = 0;
        for (size_t i = 0; i < l->len; i++) {
            double want = w->sum[i] / w->divisor * coef;
            double tol = 4e-6 * w->magnitude[i] / w->divisor * coef + 1e-30;
            if (!(fabs(got[i] - want) <= tol) && shown++ < 3)
                CHECK(0, "%s element %zu: %.9g, f64 reference %.9g (tol %.2g)", what, i, got[i], want, tol);
        }
        CHECK(shown == 0, "%s: %d elements off the f64 reference", what, shown);
    }
    free(got);
    return coef;
}

/* One layout, `ranks` ranks, WINDOWS windows (window 2 overflows when `overflow`). */
static void run_case(test_rng *rng, const layout *l, const setup *s, int ranks, int overflow)
{
    static window w[WINDOWS];
    for (int k = 0; k < WINDOWS; k++)
        make_window(rng, l, s, ranks, overflow && k == 2, &w[k]);
    /* Clip to 0.7 of the first window's norm: it clips; later windows may not. */
    float max_norm = s->clip ? (float)(0.7 * reference_norm(&w[0], l->len)) : 0.0f;

    gradacc_comm_t *shard_comms[MAX_RANKS], *plain_comms[MAX_RANKS];
    REQUIRE_OK(gradacc_comm_create_local(ranks, shard_comms));
    REQUIRE_OK(gradacc_comm_create_local(ranks, plain_comms));
    rank_args args[MAX_RANKS];
    memset(args, 0, sizeof args);
    for (int r = 0; r < ranks; r++) {
        args[r].l = l;
        args[r].scaler = scaler_with_scale((float)ldexp(1.0, 8 + r));
        args[r].sharded = make_acc(l, s, max_norm, ranks, r);
        args[r].plain = make_acc(l, s, max_norm, 0, 0);
        args[r].plain_comm = plain_comms[r];
        args[r].sync_sharded = args[r].sync_plain = 1;
    }
    int clipped = 0;
    for (int k = 0; k < WINDOWS; k++) {
        for (int r = 0; r < ranks; r++) {
            args[r].w = &w[k].rank[r];
            /* one rank of one shard: the boundary needs no communicator (every other window) */
            args[r].shard_comm = ranks == 1 && k % 2 ? NULL : shard_comms[r];
        }
        run_ranks((size_t)ranks, rank_main, args, sizeof args[0]);
        char what[160];
        snprintf(what, sizeof what, "%s (%zu elements), %d rank%s, %s, %s loss%s, window %d%s", l->name, l->len, ranks,
                 ranks == 1 ? "" : "s", normalize_name(s->normalize),
                 s->loss == GRADACC_LOSS_REDUCTION_MEAN ? "mean" : "sum", s->clip ? ", clipped" : "", k,
                 w[k].overflow ? " (overflow)" : "");
        clipped += check_synced(what, l, &w[k], max_norm, ranks, args) < 1.0;
    }
    CHECK(!s->clip || clipped > 0, "%s, %d ranks: clipping never applied", l->name, ranks);
    for (int r = 0; r < ranks; r++) {
        EXPECT_OK(gradacc_accumulator_destroy(args[r].sharded));
        EXPECT_OK(gradacc_accumulator_destroy(args[r].plain));
        gradacc_scaler_destroy(args[r].scaler);
        EXPECT_OK(gradacc_comm_destroy(shard_comms[r]));
        EXPECT_OK(gradacc_comm_destroy(plain_comms[r]));
    }
    for (int k = 0; k < WINDOWS; k++)
        free_window(&w[k], l, ranks);
}

/* The config's sharding fields and wire dtype, and gradacc_accumulator_shard's arguments. */
static void test_arguments(void)
{
    gradacc_tensor_desc_t t[2] = {{5001, GRADACC_DTYPE_F16}, {3999, GRADACC_DTYPE_F32}};
    gradacc_accumulator_config_t c;
    REQUIRE_OK(gradacc_accumulator_config_default(&c));
    CHECK(c.sharding == GRADACC_SHARDING_NONE && c.shard_count == 1 && c.shard_rank == 0 &&
              c.wire_dtype == GRADACC_DTYPE_F32,
          "defaults: sharding %d, shard_count %u, shard_rank %u, wire_dtype %d", (int)c.sharding, c.shard_count,
          c.shard_rank, (int)c.wire_dtype);

    struct {
        gradacc_sharding_t sharding;
        uint32_t count, rank;
        gradacc_dtype_t wire;
        const char *text;
    } bad[] = {
        {7, 1, 0, GRADACC_DTYPE_F32, "`config`.sharding = 7"},
        {-1, 2, 0, GRADACC_DTYPE_F32, "`config`.sharding = -1"},
        {GRADACC_SHARDING_REDUCE_SCATTER, 3, 3, GRADACC_DTYPE_F32, "`config`.shard_rank = 3"},
        {GRADACC_SHARDING_REDUCE_SCATTER, 2, 9, GRADACC_DTYPE_F32, "`config`.shard_rank = 9"},
        {GRADACC_SHARDING_REDUCE_SCATTER, 0, 0, GRADACC_DTYPE_F32, "`config`.shard_count = 0"},
        {GRADACC_SHARDING_NONE, 2, 0, GRADACC_DTYPE_F32, "`config`.shard_count = 2"},
        {GRADACC_SHARDING_NONE, 1, 1, GRADACC_DTYPE_F32, "`config`.shard_rank = 1"},
        {GRADACC_SHARDING_NONE, 1, 0, GRADACC_DTYPE_F16, "`config`.wire_dtype = 1"},
        {GRADACC_SHARDING_REDUCE_SCATTER, 2, 1, GRADACC_DTYPE_F16, "`config`.wire_dtype = 1"},
        {GRADACC_SHARDING_NONE, 1, 0, 9, "`config`.wire_dtype = 9"},
    };
    /* 5001 f16 and 3999 f32 values, each padded to GRADACC_MASTER_ALIGN bytes. */
    float buffer[5056 + 4032];
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        gradacc_accumulator_config_t b = c;
        b.sharding = bad[i].sharding;
        b.shard_count = bad[i].count;
        b.shard_rank = bad[i].rank;
        b.wire_dtype = bad[i].wire;
        gradacc_accumulator_t *out = SENTINEL_PTR;
        EXPECT_ERROR(gradacc_accumulator_create(&b, t, 2, NULL, &out), GRADACC_STATUS_INVALID_ARGUMENT, bad[i].text);
        EXPECT_ERROR(gradacc_accumulator_create_with_buffer(&b, t, 2, NULL, buffer, 5056 + 4032, &out),
                     GRADACC_STATUS_INVALID_ARGUMENT, bad[i].text);
        CHECK(out == SENTINEL_PTR, "case %zu: output written on failure", i);
    }

    /* Unsharded: the whole master. One shard of one: the whole master too, synced without a
     * communicator. */
    gradacc_accumulator_t *plain = NULL, *one = NULL, *adopted = NULL;
    REQUIRE_OK(gradacc_accumulator_create(&c, t, 2, NULL, &plain));
    gradacc_accumulator_config_t s = c;
    s.sharding = GRADACC_SHARDING_REDUCE_SCATTER;
    REQUIRE_OK(gradacc_accumulator_create(&s, t, 2, NULL, &one));
    s.shard_count = 3;
    s.shard_rank = 1;
    REQUIRE_OK(gradacc_accumulator_create_with_buffer(&s, t, 2, NULL, buffer, 5056 + 4032, &adopted));
    gradacc_accumulator_t *accs[3] = {plain, one, adopted};
    for (int i = 0; i < 3; i++) {
        size_t off = 777, n = 777;
        float *data = NULL, *base = NULL;
        size_t base_n = 0;
        REQUIRE_OK(gradacc_accumulator_shard(accs[i], &off, &n, &data));
        REQUIRE_OK(gradacc_accumulator_master(accs[i], 0, &base, &base_n));
        size_t want_off = i < 2 ? 0 : 4096, want_n = i < 2 ? 5056 + 4032 : 4096;
        CHECK(off == want_off && n == want_n && data == base + off, "accumulator %d: shard [%zu, +%zu) at %p, master %p", i,
              off, n, (void *)data, (void *)base);
        if (i == 2)
            CHECK(data == buffer + 4096, "the adopted buffer's shard is at %p, not %p", (void *)data, (void *)(buffer + 4096));
    }
    {
        gradacc_scaler_t *scaler = scaler_with_scale(1.0f);
        uint16_t g0[5001];
        float g1[3999];
        for (size_t i = 0; i < 5001; i++)
            g0[i] = f32_to_f16_bits((float)(i % 7) - 3.0f);
        for (size_t i = 0; i < 3999; i++)
            g1[i] = (float)i;
        const void *p[2] = {g0, g1};
        REQUIRE_OK(gradacc_accumulator_add(one, scaler, p, 2, 1));
        gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
        EXPECT_OK(gradacc_accumulator_sync(one, NULL, &info));
        float *m = NULL;
        size_t n = 0;
        REQUIRE_OK(gradacc_accumulator_master(one, 1, &m, &n));
        CHECK(n == 3999 && m[3998] == 3998.0f, "one shard of one: tensor 1 ends with %g", (double)m[n - 1]);
        /* A shard of three with no communicator fails, and keeps the window. */
        REQUIRE_OK(gradacc_accumulator_add(adopted, scaler, p, 2, 1));
        EXPECT_ERROR(gradacc_accumulator_sync(adopted, NULL, &info), GRADACC_STATUS_INVALID_ARGUMENT, "shard 1 of 3");
        gradacc_scaler_destroy(scaler);
    }

    size_t off = 777, n = 777;
    float *data = SENTINEL_PTR;
    EXPECT_ERROR(gradacc_accumulator_shard(NULL, &off, &n, &data), GRADACC_STATUS_NULL_ARGUMENT, "`acc`");
    EXPECT_ERROR(gradacc_accumulator_shard(plain, NULL, &n, &data), GRADACC_STATUS_NULL_ARGUMENT, "`out_offset`");
    EXPECT_ERROR(gradacc_accumulator_shard(plain, &off, NULL, &data), GRADACC_STATUS_NULL_ARGUMENT, "`out_numel`");
    EXPECT_ERROR(gradacc_accumulator_shard(plain, &off, &n, NULL), GRADACC_STATUS_NULL_ARGUMENT, "`out_data`");
    CHECK(off == 777 && n == 777 && data == SENTINEL_PTR, "shard outputs written on failure");
    EXPECT_OK(gradacc_accumulator_destroy(plain));
    EXPECT_OK(gradacc_accumulator_destroy(one));
    EXPECT_OK(gradacc_accumulator_destroy(adopted));
    EXPECT_ERROR(gradacc_accumulator_shard(plain, &off, &n, &data), GRADACC_STATUS_INVALID_HANDLE, "`acc`");
    CHECK(off == 777 && n == 777 && data == SENTINEL_PTR, "shard outputs written through a destroyed handle");
}

/* Wrong communicators for 3 shards fail on every rank and keep the window. */
static void test_wrong_groups(test_rng *rng)
{
    enum { R = 3 };
    layout l = {"misuse", 2, {{5001, GRADACC_DTYPE_F16}, {3999, GRADACC_DTYPE_BF16}}, 0, {0}};
    layout_place(&l);
    setup s = {GRADACC_NORMALIZE_BY_COUNT, GRADACC_LOSS_REDUCTION_MEAN, 0, GRADACC_DTYPE_F32};
    window w;
    memset(&w, 0, sizeof w);
    make_window(rng, &l, &s, R, 0, &w);

    gradacc_comm_t *right[R], *plain[R], *pair[2], *alone[1], *turned[R], *four[R + 1];
    REQUIRE_OK(gradacc_comm_create_local(R, right));
    REQUIRE_OK(gradacc_comm_create_local(R, plain));
    REQUIRE_OK(gradacc_comm_create_local(2, pair));
    REQUIRE_OK(gradacc_comm_create_local(1, alone));
    REQUIRE_OK(gradacc_comm_create_local(R, turned));
    REQUIRE_OK(gradacc_comm_create_local(R + 1, four));
    rank_args args[R + 1];
    memset(args, 0, sizeof args);
    for (int r = 0; r < R; r++) {
        args[r].l = &l;
        args[r].scaler = scaler_with_scale((float)ldexp(1.0, 8 + r));
        args[r].sharded = make_acc(&l, &s, 0.0f, R, r);
        args[r].plain = make_acc(&l, &s, 0.0f, 0, 0);
        args[r].plain_comm = plain[r];
        args[r].w = &w.rank[r];
        args[r].sync_sharded = 1;
        args[r].shard_comm = NULL;
    }
    /* A fourth participant of the four-rank group: shard 3 of 4, valid on its own. */
    args[R].l = &l;
    args[R].scaler = args[0].scaler;
    args[R].sharded = make_acc(&l, &s, 0.0f, R + 1, R);
    args[R].w = &w.rank[0];
    args[R].shard_comm = four[R];
    args[R].sync_sharded = 1;

    struct {
        const char *name;
        gradacc_comm_t *comm[R];
        int ranks;
    } wrong[] = {
        {"no communicator", {NULL, NULL, NULL}, R},
        {"groups of 2 and 1", {pair[0], pair[1], alone[0]}, R},
        {"ranks turned round", {turned[1], turned[2], turned[0]}, R},
        {"a group of 4", {four[0], four[1], four[2]}, R + 1},
    };
    for (size_t k = 0; k < sizeof wrong / sizeof wrong[0]; k++) {
        for (int r = 0; r < R; r++) {
            args[r].shard_comm = wrong[k].comm[r];
            args[r].st_sharded = GRADACC_STATUS_OK;
        }
        args[R].st_sharded = GRADACC_STATUS_OK;
        run_ranks((size_t)wrong[k].ranks, rank_main, args, sizeof args[0]);
        for (int r = 0; r < R; r++) {
            args[r].w = NULL; /* added once, in the first round */
            CHECK(args[r].st_sharded == GRADACC_STATUS_INVALID_ARGUMENT && strstr(args[r].error, "shard") &&
                      strstr(args[r].error, "of 3"),
                  "%s: rank %d: status %d (%s), expected INVALID_ARGUMENT naming its shard of 3: %s", wrong[k].name, r,
                  (int)args[r].st_sharded, gradacc_status_string(args[r].st_sharded), args[r].error);
        }
        if (wrong[k].ranks > R)
            CHECK(args[R].st_sharded == GRADACC_STATUS_PEER_FAILURE, "%s: the fourth rank (valid on its own): status %d (%s)",
                  wrong[k].name, (int)args[R].st_sharded, gradacc_status_string(args[R].st_sharded));
    }
    /* The windows are intact: the right group gives the all-reduce's bits and the reference. */
    for (int r = 0; r < R; r++) {
        args[r].w = NULL;
        args[r].shard_comm = right[r];
        args[r].sync_plain = 1; /* the unsharded accumulators got the same adds in the first round */
    }
    run_ranks(R, rank_main, args, sizeof args[0]);
    check_synced("after the failed syncs", &l, &w, 0.0f, R, args);
    for (int r = 0; r < R; r++)
        CHECK(args[r].info_sharded.microbatches == args[r].info_plain.microbatches,
              "rank %d: %llu micro-batches after the failures, %llu in the reference", r,
              (unsigned long long)args[r].info_sharded.microbatches, (unsigned long long)args[r].info_plain.microbatches);

    for (int r = 0; r < R; r++) {
        EXPECT_OK(gradacc_accumulator_destroy(args[r].sharded));
        EXPECT_OK(gradacc_accumulator_destroy(args[r].plain));
        gradacc_scaler_destroy(args[r].scaler);
        EXPECT_OK(gradacc_comm_destroy(right[r]));
        EXPECT_OK(gradacc_comm_destroy(plain[r]));
        EXPECT_OK(gradacc_comm_destroy(turned[r]));
    }
    EXPECT_OK(gradacc_accumulator_destroy(args[R].sharded));
    for (int r = 0; r < R + 1; r++)
        EXPECT_OK(gradacc_comm_destroy(four[r]));
    EXPECT_OK(gradacc_comm_destroy(pair[0]));
    EXPECT_OK(gradacc_comm_destroy(pair[1]));
    EXPECT_OK(gradacc_comm_destroy(alone[0]));
    free_window(&w, &l, R);
}

int main(void)
{
    test_rng rng = rng_fresh("api_shard");
    test_arguments();
    test_wrong_groups(&rng);
    /* Every normalisation with and without clipping, on 1 to 5 ranks; every third layout is
     * smaller than a block, so ranks past the first hold empty shards. */
    for (int c = 0; c < 10; c++) {
        setup s = {(gradacc_normalize_t)(c % 4), rng_below(&rng, 2) ? GRADACC_LOSS_REDUCTION_MEAN : GRADACC_LOSS_REDUCTION_SUM,
                   (c / 4) % 2, GRADACC_DTYPE_F32};
        int ranks = 1 + c % MAX_RANKS;
        layout l = random_layout(&rng, c % 3 == 0);
        run_case(&rng, &l, &s, ranks, c % 2);
    }
    return test_finish();
}
