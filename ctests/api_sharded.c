/* Sharded accumulation (ZeRO-2) through the C API: GRADACC_SHARDING_ACCUMULATE and
 * gradacc_accumulator_create_sharded, on 2 and 3 ranks of the in-process communicator (one
 * thread each).
 *
 * Creation: a NULL or destroyed communicator, another policy, a shard count or rank that is not
 * the communicator's, a CUDA device, and gradacc_accumulator_create(_with_buffer) with ACCUMULATE
 * over more than one shard fail with the exact status, leave the output alone, and the last error
 * names the argument or value.
 *
 * Training: random layouts of odd-sized f16 / bf16 / f32 tensors (one smaller than a block, so
 * that a shard is empty), every normalisation, with and without clipping and the BF16 wire,
 * windows of 3, 2, 3 and 1 micro-batches on every rank (the count changes between windows and
 * the last window is partial), one window with an overflow. Each rank adds the same window to
 * three sharded accumulators, each on its own group, every rank the same way: through add;
 * through begin_microbatch / add_tensor / end_microbatch with the tensors in reverse order; the
 * same in a shuffled order. The three give the same bits and sync infos on every rank (synced
 * with their communicator or NULL). Beside them an unsharded accumulator (DDP, each rank adding
 * its own way) syncs on a fourth group: the infos' counts and overflow flags are equal, the norms within 1e-5 (and the
 * BF16 wire's 2^-8 of the magnitudes), and the shards equal the same range of the all-reduced
 * master within the sum of both runs' bounds against an f64 reference (4e-6 of the summed
 * magnitudes each, plus 2^-8 with the BF16 wire): FP32 sums in another order, never compared
 * bit for bit. The shards tile the layout as the header documents; gradacc_accumulator_master
 * gives a tensor wholly inside the shard (at its place in the shard) and refuses any other with
 * INVALID_ARGUMENT.
 *
 * Seeds, with exact numbers: one rank overflowing (found_inf and a skipped step on every rank,
 * the next window clean); unequal token counts weighted by count while the micro-batch count
 * changes (3 then 3.0 exactly); a partial final window normalised by its own micro-batches.
 *
 * Misuse on 3 ranks: one rank's invalid add or begin_microbatch fails there (INVALID_ARGUMENT)
 * and with PEER_FAILURE on the others; ranks at different steps all fail; a second contribution
 * to a tensor is WRONG_STATE; a foreign communicator at the boundary fails on every rank. The
 * windows stay intact (the exact sums after) and training goes on.
 *
 * Checkpoints: a shard's saved window resumes on the same shard to the same bits; another rank's
 * shard, or it loaded into an unsharded accumulator, is CORRUPT_STATE and changes nothing. */
#include "shard_window.h"

enum { MAX_RANKS = 3, WINDOWS = 4, WAYS = 3 };
static const int window_microbatches[WINDOWS] = {3, 2, 3, 1};
static const double COMM_TIMEOUT_S = 30.0; /* a rank that waits for a missing peer fails, not hangs */

#define SENTINEL_PTR ((void *)(uintptr_t)0x5e5e5e50)

/* The ways the ranks of a sharded accumulation add their micro-batches (every rank the same way). */
enum { WAY_ADD, WAY_REVERSE, WAY_SHUFFLED };
static const char *const way_name[WAYS] = {"add", "add_tensor in reverse order", "add_tensor in shuffled order"};

/* Rank `rank` of `world` of a new sharded accumulation on `comm` with `ac`'s other settings. */
static gradacc_accumulator_t *make_sharded(gradacc_accumulator_config_t ac, const gradacc_tensor_desc_t *t, size_t n,
                                           gradacc_comm_t *comm)
{
    int32_t rank = -1, world = -1;
    REQUIRE_OK(gradacc_comm_rank(comm, &rank));
    REQUIRE_OK(gradacc_comm_world_size(comm, &world));
    ac.sharding = GRADACC_SHARDING_ACCUMULATE;
    ac.shard_count = (uint32_t)world;
    ac.shard_rank = (uint32_t)rank;
    gradacc_accumulator_t *a = NULL;
    REQUIRE_OK(gradacc_accumulator_create_sharded(&ac, t, n, NULL, comm, &a));
    return a;
}

static void make_group(int ranks, gradacc_comm_t **comms)
{
    REQUIRE_OK(gradacc_comm_create_local(ranks, comms));
    for (int r = 0; r < ranks; r++)
        EXPECT_OK(gradacc_comm_set_timeout(comms[r], COMM_TIMEOUT_S));
}

static void destroy_group(int ranks, gradacc_comm_t **comms)
{
    for (int r = 0; r < ranks; r++)
        EXPECT_OK(gradacc_comm_destroy(comms[r]));
}

/* ---------------------------------------------------------------------------------------------
 * Creation
 * ------------------------------------------------------------------------------------------- */

static void test_creation(void)
{
    gradacc_tensor_desc_t t[2] = {{5001, GRADACC_DTYPE_F16}, {3999, GRADACC_DTYPE_F32}};
    gradacc_comm_t *pair[2], *dead[1];
    REQUIRE_OK(gradacc_comm_create_local(2, pair));
    REQUIRE_OK(gradacc_comm_create_local(1, dead));
    EXPECT_OK(gradacc_comm_destroy(dead[0]));
    gradacc_accumulator_config_t c;
    REQUIRE_OK(gradacc_accumulator_config_default(&c));
    c.sharding = GRADACC_SHARDING_ACCUMULATE;
    c.shard_count = 2;
    c.shard_rank = 0;

    struct {
        const char *name;
        gradacc_sharding_t sharding;
        uint32_t count, rank;
        gradacc_comm_t *comm;
        gradacc_status_t status;
        const char *text, *text2;
    } bad[] = {
        {"NULL comm", GRADACC_SHARDING_ACCUMULATE, 2, 0, NULL, GRADACC_STATUS_NULL_ARGUMENT, "`comm`", "NULL"},
        {"destroyed comm", GRADACC_SHARDING_ACCUMULATE, 2, 0, dead[0], GRADACC_STATUS_INVALID_HANDLE, "`comm`", "`comm`"},
        {"policy NONE", GRADACC_SHARDING_NONE, 1, 0, pair[0], GRADACC_STATUS_INVALID_ARGUMENT, "`config`.sharding",
         "GRADACC_SHARDING_ACCUMULATE"},
        {"policy REDUCE_SCATTER", GRADACC_SHARDING_REDUCE_SCATTER, 2, 0, pair[0], GRADACC_STATUS_INVALID_ARGUMENT,
         "`config`.sharding", "GRADACC_SHARDING_ACCUMULATE"},
        {"policy 7", 7, 2, 0, pair[0], GRADACC_STATUS_INVALID_ARGUMENT, "`config`.sharding = 7", "`config`.sharding = 7"},
        {"3 shards on 2 ranks", GRADACC_SHARDING_ACCUMULATE, 3, 0, pair[0], GRADACC_STATUS_INVALID_ARGUMENT,
         "shard 0 of 3", "rank 0 of 2"},
        {"shard 1 on rank 0", GRADACC_SHARDING_ACCUMULATE, 2, 1, pair[0], GRADACC_STATUS_INVALID_ARGUMENT, "shard 1 of 2",
         "rank 0 of 2"},
        {"shard 0 on rank 1", GRADACC_SHARDING_ACCUMULATE, 2, 0, pair[1], GRADACC_STATUS_INVALID_ARGUMENT, "shard 0 of 2",
         "rank 1 of 2"},
        {"1 shard on 2 ranks", GRADACC_SHARDING_ACCUMULATE, 1, 0, pair[0], GRADACC_STATUS_INVALID_ARGUMENT, "shard 0 of 1",
         "rank 0 of 2"},
        {"shard_rank = shard_count", GRADACC_SHARDING_ACCUMULATE, 2, 2, pair[0], GRADACC_STATUS_INVALID_ARGUMENT,
         "`config`.shard_rank = 2", "`config`.shard_count = 2"},
        {"shard_count 0", GRADACC_SHARDING_ACCUMULATE, 0, 0, pair[0], GRADACC_STATUS_INVALID_ARGUMENT,
         "`config`.shard_count = 0", "`config`.shard_count = 0"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        gradacc_accumulator_config_t b = c;
        b.sharding = bad[i].sharding;
        b.shard_count = bad[i].count;
        b.shard_rank = bad[i].rank;
        gradacc_accumulator_t *out = SENTINEL_PTR;
        EXPECT_ERROR(gradacc_accumulator_create_sharded(&b, t, 2, NULL, bad[i].comm, &out), bad[i].status, bad[i].text);
        CHECK(strstr(gradacc_last_error(), bad[i].text2) != NULL, "%s: the error should mention \"%s\"", bad[i].name,
              bad[i].text2);
        CHECK(out == SENTINEL_PTR, "%s: output written on failure", bad[i].name);
    }
    /* NULL config: the defaults, which do not shard. */
    gradacc_accumulator_t *out = SENTINEL_PTR;
    EXPECT_ERROR(gradacc_accumulator_create_sharded(NULL, t, 2, NULL, pair[0], &out), GRADACC_STATUS_INVALID_ARGUMENT,
                 "GRADACC_SHARDING_ACCUMULATE");
    EXPECT_ERROR(gradacc_accumulator_create_sharded(&c, t, 2, NULL, pair[0], NULL), GRADACC_STATUS_NULL_ARGUMENT, "`out`");
    EXPECT_ERROR(gradacc_accumulator_create_sharded(&c, NULL, 2, NULL, pair[0], &out), GRADACC_STATUS_NULL_ARGUMENT,
                 "`tensors`");

    /* A CUDA device with a host communicator: a CUDA accumulation needs NCCL (where there is no
     * driver, CUDA itself is what is unavailable). */
    bool cuda = false;
    EXPECT_OK(gradacc_backend_available(GRADACC_BACKEND_CUDA, &cuda));
    gradacc_device_t gpu = {GRADACC_DEVICE_CUDA, 0, NULL};
    if (cuda)
        EXPECT_STATUS(gradacc_accumulator_create_sharded(&c, t, 2, &gpu, pair[0], &out), GRADACC_STATUS_DEVICE_MISMATCH);
    else
        EXPECT_ERROR(gradacc_accumulator_create_sharded(&c, t, 2, &gpu, pair[0], &out), GRADACC_STATUS_BACKEND_UNAVAILABLE, "CUDA");
    gradacc_device_t cpu = {GRADACC_DEVICE_CPU, 0, NULL};
    CHECK(out == SENTINEL_PTR, "output written on failure");

    /* The plain constructors cannot make a sharded accumulation over several ranks: it reduces
     * every micro-batch, so it needs its communicator from the start. */
    EXPECT_ERROR(gradacc_accumulator_create(&c, t, 2, NULL, &out), GRADACC_STATUS_INVALID_ARGUMENT, "over 2 ranks");
    float buffer[5056 + 4032]; /* 5001 f16 and 3999 f32 values, each padded to the alignment */
    EXPECT_ERROR(gradacc_accumulator_create_with_buffer(&c, t, 2, NULL, buffer, 5056 + 4032, &out), GRADACC_STATUS_INVALID_ARGUMENT,
                 "sharded accumulation");
    CHECK(out == SENTINEL_PTR, "output written on failure");

    /* Shard 0 of 1: the plain constructor will do, and it is the unsharded boundary bit for bit. */
    gradacc_accumulator_config_t one_c = c;
    one_c.shard_count = 1;
    gradacc_accumulator_t *one = NULL, *plain = NULL;
    REQUIRE_OK(gradacc_accumulator_create(&one_c, t, 2, NULL, &one));
    REQUIRE_OK(gradacc_accumulator_create(NULL, t, 2, NULL, &plain));
    /* Both ranks' accumulations may be created from one thread (creation is not collective),
     * on an explicit CPU device too. */
    gradacc_accumulator_t *both[2] = {NULL, NULL};
    REQUIRE_OK(gradacc_accumulator_create_sharded(&c, t, 2, &cpu, pair[0], &both[0]));
    c.shard_rank = 1;
    REQUIRE_OK(gradacc_accumulator_create_sharded(&c, t, 2, NULL, pair[1], &both[1]));
    gradacc_scaler_t *scaler = scaler_with_scale(8.0f);
    uint16_t g0[5001];
    float g1[3999];
    for (size_t i = 0; i < 5001; i++)
        g0[i] = f32_to_f16_bits((float)((int)(i % 7) - 3) * 8.0f);
    for (size_t i = 0; i < 3999; i++)
        g1[i] = (float)i * 0.125f;
    const void *p[2] = {g0, g1};
    for (int m = 0; m < 2; m++) {
        REQUIRE_OK(gradacc_accumulator_add(one, scaler, p, 2, 3));
        REQUIRE_OK(gradacc_accumulator_add(plain, scaler, p, 2, 3));
    }
    gradacc_sync_info_t i1 = GRADACC_SYNC_INFO_INIT, i2 = GRADACC_SYNC_INFO_INIT;
    EXPECT_OK(gradacc_accumulator_sync(one, NULL, &i1));
    EXPECT_OK(gradacc_accumulator_sync(plain, NULL, &i2));
    CHECK(same_info(&i1, &i2) && i1.total_count == 6 && i1.microbatches == 2, "one shard: info {count %llu, mb %llu}",
          (unsigned long long)i1.total_count, (unsigned long long)i1.microbatches);
    size_t off = 7, n = 7, poff = 7, pn = 7;
    float *d1 = NULL, *d2 = NULL;
    EXPECT_OK(gradacc_accumulator_shard(one, &off, &n, &d1));
    EXPECT_OK(gradacc_accumulator_shard(plain, &poff, &pn, &d2));
    CHECK(off == 0 && n == 5056 + 4032 && poff == 0 && pn == n && memcmp(d1, d2, n * sizeof(float)) == 0,
          "one shard: [%zu, +%zu), not the unsharded master's bits", off, n);
    /* (element 3998 of tensor 1, at 5056: 3 items' mean of 3998 / 8 / 8 each micro-batch, weighted by 3) */
    size_t o1 = 0;
    EXPECT_OK(gradacc_accumulator_offset(one, 1, &o1));
    CHECK(o1 == 5056 && d1[o1 + 3998] == 3998.0f / 64.0f, "one shard: tensor 1 at %zu ends with %.9g, expected %.9g", o1,
          (double)d1[o1 + 3998], 3998.0 / 64.0);
    EXPECT_OK(gradacc_scaler_destroy(scaler));
    EXPECT_OK(gradacc_accumulator_destroy(one));
    EXPECT_OK(gradacc_accumulator_destroy(plain));
    EXPECT_OK(gradacc_accumulator_destroy(both[0]));
    EXPECT_OK(gradacc_accumulator_destroy(both[1]));
    destroy_group(2, pair);
}

/* ---------------------------------------------------------------------------------------------
 * Training: four ways of adding, against each other (bits) and against DDP (tolerance)
 * ------------------------------------------------------------------------------------------- */

typedef struct {
    const layout *l;
    gradacc_scaler_t *scaler;
    gradacc_accumulator_t *sharded[WAYS], *ddp;
    gradacc_comm_t *comm[WAYS], *ddp_comm;
    const rank_window *w;
    size_t order[MAX_MB][MAX_TENSORS]; /* WAY_SHUFFLED's tensor order per micro-batch */
    /* outputs */
    gradacc_status_t st[WAYS], st_ddp;
    gradacc_sync_info_t info[WAYS], info_ddp;
} train_args;

static void add_way(gradacc_accumulator_t *acc, gradacc_scaler_t *scaler, const layout *l, const rank_window *w, int way,
                    const size_t (*order)[MAX_TENSORS])
{
    if (way == WAY_SHUFFLED) {
        for (int m = 0; m < w->microbatches; m++) {
            REQUIRE_OK(gradacc_accumulator_begin_microbatch(acc, w->count[m]));
            for (size_t k = 0; k < l->tensors; k++) {
                size_t t = order[m][k];
                REQUIRE_OK(gradacc_accumulator_add_tensor(acc, scaler, t, w->g[m][t].data, w->g[m][t].n));
            }
            REQUIRE_OK(gradacc_accumulator_end_microbatch(acc));
        }
        return;
    }
    rank_window copy = *w; /* the same gradient buffers */
    copy.by_tensor = way == WAY_REVERSE;
    add_window(acc, scaler, l, &copy);
}

static void *train_rank(void *arg)
{
    train_args *a = arg;
    for (int way = 0; way < WAYS; way++) {
        add_way(a->sharded[way], a->scaler, a->l, a->w, way, (const size_t(*)[MAX_TENSORS])a->order);
        a->info[way].struct_size = sizeof a->info[way];
        /* the creation communicator or NULL: the same boundary */
        a->st[way] = gradacc_accumulator_sync(a->sharded[way], way % 2 ? NULL : a->comm[way], &a->info[way]);
    }
    add_window(a->ddp, a->scaler, a->l, a->w);
    a->info_ddp.struct_size = sizeof a->info_ddp;
    a->st_ddp = gradacc_accumulator_sync(a->ddp, a->ddp_comm, &a->info_ddp);
    return NULL;
}

/* gradacc_accumulator_master on every tensor of a sharded accumulation holding [off, off + n). */
static void check_master_access(const char *what, const layout *l, gradacc_accumulator_t *acc, int rank, size_t off, size_t n,
                                const float *data)
{
    for (size_t t = 0; t < l->tensors; t++) {
        size_t numel = l->desc[t].numel, at = l->offset[t];
        float *p = SENTINEL_PTR;
        size_t got_n = 777;
        if (at >= off && at + numel <= off + n) {
            EXPECT_OK(gradacc_accumulator_master(acc, t, &p, &got_n));
            CHECK(p == data + (at - off) && got_n == numel, "%s rank %d: tensor %zu at %p (%zu elements), expected %p (%zu)", what,
                  rank, t, (void *)p, got_n, (const void *)(data + (at - off)), numel);
        } else {
            EXPECT_ERROR(gradacc_accumulator_master(acc, t, &p, &got_n), GRADACC_STATUS_INVALID_ARGUMENT, "shard");
            CHECK(p == SENTINEL_PTR && got_n == 777, "%s rank %d: tensor %zu: outputs written on failure", what, rank, t);
        }
    }
    float *p = SENTINEL_PTR;
    size_t got_n = 777;
    EXPECT_ERROR(gradacc_accumulator_master(acc, l->tensors, &p, &got_n), GRADACC_STATUS_INVALID_ARGUMENT, "`index`");
}

/* After every rank's syncs of one window: the checks of the file's comment. Returns the largest
 * |sharded - DDP| over the summed magnitude of the element's contributions (normalised). */
static double check_window(const char *what, const layout *l, const setup *s, const window *w, float max_norm, int ranks,
                           train_args *args)
{
    for (int r = 0; r < ranks; r++) {
        for (int way = 0; way < WAYS; way++)
            EXPECT_OK(args[r].st[way]);
        EXPECT_OK(args[r].st_ddp);
        for (int way = 0; way < WAYS; way++)
            if (args[r].st[way] != GRADACC_STATUS_OK)
                return 0.0;
        if (args[r].st_ddp != GRADACC_STATUS_OK)
            return 0.0;
    }
    const gradacc_sync_info_t *info = &args[0].info[0], *ddp = &args[0].info_ddp;
    for (int r = 0; r < ranks; r++)
        for (int way = 0; way < WAYS; way++)
            CHECK(same_info(&args[r].info[way], info),
                  "%s rank %d, %s: info {inf %d count %llu mb %llu norm %.17g clip %.17g}, rank 0 by add {inf %d count %llu "
                  "mb %llu norm %.17g clip %.17g}",
                  what, r, way_name[way], (int)args[r].info[way].found_inf, (unsigned long long)args[r].info[way].total_count,
                  (unsigned long long)args[r].info[way].microbatches, args[r].info[way].grad_norm,
                  args[r].info[way].clip_coef, (int)info->found_inf, (unsigned long long)info->total_count,
                  (unsigned long long)info->microbatches, info->grad_norm, info->clip_coef);
    CHECK(info->found_inf == (w->overflow != 0) && ddp->found_inf == info->found_inf, "%s: found_inf %d (DDP %d), overflow %d",
          what, (int)info->found_inf, (int)ddp->found_inf, w->overflow);
    CHECK(info->total_count == w->items && info->microbatches == w->microbatches && ddp->total_count == w->items &&
              ddp->microbatches == w->microbatches,
          "%s: count %llu, micro-batches %llu (DDP %llu, %llu); expected %llu, %llu", what,
          (unsigned long long)info->total_count, (unsigned long long)info->microbatches,
          (unsigned long long)ddp->total_count, (unsigned long long)ddp->microbatches, (unsigned long long)w->items,
          (unsigned long long)w->microbatches);

    const double wire = s->wire == GRADACC_DTYPE_BF16 ? ldexp(1.0, -8) : 0.0;
    double norm = 0.0, spread = 0.0, coef = 1.0;
    for (size_t i = 0; i < l->len; i++) {
        norm += (w->sum[i] / w->divisor) * (w->sum[i] / w->divisor);
        spread += (w->magnitude[i] / w->divisor) * (w->magnitude[i] / w->divisor);
    }
    norm = sqrt(norm);
    spread = sqrt(spread);
    const double norm_tol = 1e-5 * norm + wire * spread + 1e-30;
    if (!w->overflow) {
        coef = max_norm == 0.0f ? 1.0 : fmin(1.0, (double)max_norm / (norm + 1e-6));
        CHECK_CLOSE(info->grad_norm, norm, norm_tol, "%s: norm against the f64 reference", what);
        CHECK_CLOSE(info->grad_norm, ddp->grad_norm, 2 * norm_tol, "%s: norm against DDP's", what);
        CHECK_CLOSE(info->clip_coef, coef, coef * (1e-5 + norm_tol / norm), "%s: clip coefficient", what);
        CHECK_CLOSE(info->clip_coef, ddp->clip_coef, coef * 2 * (1e-5 + norm_tol / norm), "%s: clip coefficient (DDP)", what);
    }

    size_t flat_off = 1, flat_n = 0;
    float *flat = NULL;
    REQUIRE_OK(gradacc_accumulator_shard(args[0].ddp, &flat_off, &flat_n, &flat));
    CHECK(flat_off == 0 && flat_n == l->len, "%s: DDP's shard is [%zu, +%zu) of %zu", what, flat_off, flat_n, l->len);
    double worst = 0.0;
    size_t next = 0;
    for (int r = 0; r < ranks; r++) {
        size_t want_off, want_n, off = 777, n = 777;
        float *data = NULL;
        expected_shard(l->len, ranks, r, &want_off, &want_n);
        REQUIRE_OK(gradacc_accumulator_shard(args[r].sharded[0], &off, &n, &data));
        CHECK(off == next && off == want_off && n == want_n,
              "%s rank %d of %d: shard [%zu, +%zu), expected [%zu, +%zu) right after the previous one at %zu", what, r, ranks,
              off, n, want_off, want_n, next);
        if (off != want_off || n != want_n)
            return worst;
        next = off + n;
        for (int way = 1; way < WAYS; way++) {
            size_t o2 = 777, n2 = 777;
            float *d2 = NULL;
            REQUIRE_OK(gradacc_accumulator_shard(args[r].sharded[way], &o2, &n2, &d2));
            CHECK(o2 == off && n2 == n && (n == 0 || w->overflow || memcmp(d2, data, n * sizeof(float)) == 0),
                  "%s rank %d: %s gives other bits than add (shard [%zu, +%zu))", what, r, way_name[way], o2, n2);
        }
        check_master_access(what, l, args[r].sharded[0], r, off, n, data);
        if (w->overflow)
            continue;
        const double coef_error = fabs(info->clip_coef - coef), ddp_coef_error = fabs(ddp->clip_coef - coef);
        int shown = 0;
        for (size_t k = 0; k < n; k++) {
            const size_t e = off + k;
            const double want = w->sum[e] / w->divisor * coef, mag = w->magnitude[e] / w->divisor * coef;
            const double tol = (4e-6 + wire) * mag + fabs(w->sum[e] / w->divisor) * coef_error + 1e-30;
            const double ddp_tol = (4e-6 + wire) * mag + fabs(w->sum[e] / w->divisor) * ddp_coef_error + 1e-30;
            const double diff = fabs((double)data[k] - (double)flat[e]);
            if (mag > 0.0 && diff / mag > worst)
                worst = diff / mag;
            if (!(fabs((double)data[k] - want) <= tol) && shown++ < 3)
                CHECK(0, "%s rank %d element %zu: %.9g, f64 reference %.9g (tol %.2g)", what, r, e, (double)data[k], want, tol);
            if (!(diff <= tol + ddp_tol) && shown++ < 3)
                CHECK(0, "%s rank %d element %zu: %.9g, DDP %.9g (tol %.2g)", what, r, e, (double)data[k], (double)flat[e],
                      tol + ddp_tol);
        }
        CHECK(shown == 0, "%s rank %d: %d elements off the reference or DDP", what, r, shown);
    }
    CHECK(next == l->len, "%s: the shards cover %zu of %zu elements", what, next, l->len);
    return worst;
}

static void run_training(test_rng *rng, const layout *l, const setup *s, int ranks, int overflow_window)
{
    static window w[WINDOWS];
    for (int k = 0; k < WINDOWS; k++)
        make_window_of(rng, l, s, ranks, k == overflow_window, window_microbatches[k], &w[k]);
    /* Clip to 0.7 of the first window's norm: it clips; later windows may not. */
    const float max_norm = s->clip ? (float)(0.7 * reference_norm(&w[0], l->len)) : 0.0f;
    const gradacc_accumulator_config_t ac = setup_config(s, max_norm);

    gradacc_comm_t *comms[WAYS][MAX_RANKS], *ddp_comms[MAX_RANKS];
    for (int way = 0; way < WAYS; way++)
        make_group(ranks, comms[way]);
    make_group(ranks, ddp_comms);
    static train_args args[MAX_RANKS];
    memset(args, 0, sizeof args);
    for (int r = 0; r < ranks; r++) {
        args[r].l = l;
        args[r].scaler = scaler_with_scale((float)ldexp(1.0, 8 + r));
        for (int way = 0; way < WAYS; way++) {
            args[r].comm[way] = comms[way][r];
            args[r].sharded[way] = make_sharded(ac, l->desc, l->tensors, comms[way][r]);
        }
        args[r].ddp = make_acc(l, s, max_norm, 0, 0);
        args[r].ddp_comm = ddp_comms[r];
    }
    double worst = 0.0;
    for (int k = 0; k < WINDOWS; k++) {
        for (int r = 0; r < ranks; r++) {
            args[r].w = &w[k].rank[r];
            for (int m = 0; m < MAX_MB; m++) {
                for (size_t t = 0; t < l->tensors; t++)
                    args[r].order[m][t] = t;
                for (size_t t = l->tensors; t-- > 1;) {
                    size_t j = rng_below(rng, (uint32_t)(t + 1)), x = args[r].order[m][t];
                    args[r].order[m][t] = args[r].order[m][j];
                    args[r].order[m][j] = x;
                }
            }
        }
        run_ranks((size_t)ranks, train_rank, args, sizeof args[0]);
        char what[192];
        snprintf(what, sizeof what, "%s (%zu elements), %d ranks, %s, %s loss%s%s, window %d of %d micro-batches%s", l->name,
                 l->len, ranks, normalize_name(s->normalize), s->loss == GRADACC_LOSS_REDUCTION_MEAN ? "mean" : "sum",
                 s->clip ? ", clipped" : "", s->wire == GRADACC_DTYPE_BF16 ? ", bf16 wire" : "", k, window_microbatches[k],
                 w[k].overflow ? " (overflow)" : "");
        double d = check_window(what, l, s, &w[k], max_norm, ranks, args);
        worst = d > worst ? d : worst;
    }
    printf("%s, %d ranks, %s%s: max |sharded - DDP| = %.2g of the summed magnitudes\n", l->name, ranks,
           normalize_name(s->normalize), s->wire == GRADACC_DTYPE_BF16 ? ", bf16 wire" : "", worst);
    for (int r = 0; r < ranks; r++) {
        for (int way = 0; way < WAYS; way++)
            EXPECT_OK(gradacc_accumulator_destroy(args[r].sharded[way]));
        EXPECT_OK(gradacc_accumulator_destroy(args[r].ddp));
        EXPECT_OK(gradacc_scaler_destroy(args[r].scaler));
    }
    for (int way = 0; way < WAYS; way++)
        destroy_group(ranks, comms[way]);
    destroy_group(ranks, ddp_comms);
    for (int k = 0; k < WINDOWS; k++)
        free_window(&w[k], l, ranks);
}

/* ---------------------------------------------------------------------------------------------
 * Seeds, exact
 * ------------------------------------------------------------------------------------------- */

typedef struct {
    int rank;
    gradacc_comm_t *comm;
} seed_args;

/* Every element of this rank's shard holds `want` for tensor elements [lo, hi) of the layout. */
/* Every element of the shard of `acc` (over the `n` tensors `t`) inside tensor i holds want[i];
 * every element of the padding between tensors (gradacc_accumulator_offset) holds +0. */
static void check_shard_values(gradacc_accumulator_t *acc, const gradacc_tensor_desc_t *t, size_t n, const float *want,
                               const char *what, int rank)
{
    size_t off = 0, len = 0, start[MAX_TENSORS];
    float *data = NULL;
    REQUIRE_OK(gradacc_accumulator_shard(acc, &off, &len, &data));
    for (size_t i = 0; i < n; i++)
        REQUIRE_OK(gradacc_accumulator_offset(acc, i, &start[i]));
    size_t bad = 0, first = 0;
    float expected = 0.0f;
    for (size_t k = 0; k < len; k++) {
        float w = 0.0f;
        for (size_t i = 0; i < n; i++)
            if (off + k >= start[i] && off + k < start[i] + t[i].numel)
                w = want[i];
        if (memcmp(&data[k], &w, sizeof w) != 0 && !bad++) {
            first = k;
            expected = w;
        }
    }
    CHECK(bad == 0, "%s rank %d: %zu of the %zu shard elements differ, first at %zu: %.9g, expected %.9g", what, rank, bad, len,
          off + first, bad ? (double)data[first] : 0.0, (double)expected);
}

/* Three ranks, fp16 + bf16; rank 1's first micro-batch holds an infinity. */
static void *overflow_rank(void *arg)
{
    seed_args *a = arg;
    const int r = a->rank;
    gradacc_tensor_desc_t t[2] = {{5000, GRADACC_DTYPE_F16}, {300, GRADACC_DTYPE_BF16}};
    gradacc_accumulator_config_t ac;
    REQUIRE_OK(gradacc_accumulator_config_default(&ac));
    ac.bucket_numel = 1000;
    gradacc_accumulator_t *acc = make_sharded(ac, t, 2, a->comm);
    gradacc_scaler_t *scaler = scaler_with_scale(1024.0f);
    uint16_t *halves = malloc(5000 * sizeof(uint16_t)), small[300];
    for (int step = 0; step < 2; step++) {
        float scale = 0.0f;
        REQUIRE_OK(gradacc_scaler_scale(scaler, &scale));
        /* rank r's gradients: 0.5 (r + 1) and 0.25 (r + 1), times the scale */
        for (int i = 0; i < 5000; i++)
            halves[i] = f32_to_f16_bits(0.5f * (float)(r + 1) * scale);
        for (int i = 0; i < 300; i++)
            small[i] = f32_to_bf16_bits(0.25f * (float)(r + 1) * scale);
        if (step == 0 && r == 1)
            halves[4321] = 0x7c00;
        const void *p[2] = {halves, small};
        EXPECT_OK(gradacc_accumulator_add(acc, scaler, p, 2, 2));
        halves[4321] = f32_to_f16_bits(0.5f * (float)(r + 1) * scale);
        if (step == 0)
            EXPECT_OK(gradacc_accumulator_add(acc, scaler, p, 2, 2));
        gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
        EXPECT_OK(gradacc_accumulator_sync(acc, a->comm, &info));
        bool skip = false;
        const gradacc_accumulator_t *accs[1] = {acc};
        EXPECT_OK(gradacc_scaler_update(scaler, accs, 1, &skip));
        float after = 0.0f;
        REQUIRE_OK(gradacc_scaler_scale(scaler, &after));
        if (step == 0) {
            CHECK(info.found_inf && skip && after == 512.0f && info.total_count == 12 && info.microbatches == 6,
                  "overflow rank %d: found_inf %d, skip %d, scale %g, count %llu, mb %llu; expected 1, 1, 512, 12, 6", r,
                  (int)info.found_inf, (int)skip, (double)after, (unsigned long long)info.total_count,
                  (unsigned long long)info.microbatches);
        } else {
            /* one micro-batch of 2 items per rank: (2 * 0.5 * (1 + 2 + 3)) / 6 = 1, and 0.5 */
            CHECK(!info.found_inf && !skip && after == 512.0f && info.total_count == 6 && info.microbatches == 3,
                  "after the overflow, rank %d: found_inf %d, skip %d, scale %g, count %llu, mb %llu; expected 0, 0, 512, 6, 3",
                  r, (int)info.found_inf, (int)skip, (double)after, (unsigned long long)info.total_count,
                  (unsigned long long)info.microbatches);
            check_shard_values(acc, t, 2, (const float[]){1.0f, 0.5f}, "after the overflow", r);
        }
    }
    free(halves);
    EXPECT_OK(gradacc_accumulator_destroy(acc));
    EXPECT_OK(gradacc_scaler_destroy(scaler));
    return NULL;
}

/* Two ranks; per-token mean losses, unequal token counts, two then three micro-batches. Rank r's
 * gradient per item is mean x (r + 1): both windows average to 3 exactly. */
static void *unequal_counts_rank(void *arg)
{
    seed_args *a = arg;
    const int r = a->rank;
    gradacc_tensor_desc_t t[2] = {{4099, GRADACC_DTYPE_F32}, {4097, GRADACC_DTYPE_F16}};
    gradacc_accumulator_config_t ac;
    REQUIRE_OK(gradacc_accumulator_config_default(&ac));
    ac.bucket_numel = 4096;
    gradacc_accumulator_t *acc = make_sharded(ac, t, 2, a->comm);
    gradacc_scaler_t *scaler = scaler_with_scale(4.0f);
    static const struct {
        int n;
        uint64_t count[3];
        float mean[3];
    } windows[2] = {{2, {3, 1}, {1.0f, 5.0f}}, {3, {2, 2, 4}, {2.0f, 4.0f, 1.0f}}};
    float *g = malloc(4099 * sizeof(float));
    uint16_t *h = malloc(4097 * sizeof(uint16_t));
    for (int k = 0; k < 2; k++) {
        for (int m = 0; m < windows[k].n; m++) {
            float v = windows[k].mean[m] * (float)(r + 1);
            for (int i = 0; i < 4099; i++)
                g[i] = v * 4.0f;
            for (int i = 0; i < 4097; i++)
                h[i] = f32_to_f16_bits(v * 4.0f);
            if (k == 0) {
                const void *p[2] = {g, h};
                EXPECT_OK(gradacc_accumulator_add(acc, scaler, p, 2, windows[k].count[m]));
            } else {
                EXPECT_OK(gradacc_accumulator_begin_microbatch(acc, windows[k].count[m]));
                EXPECT_OK(gradacc_accumulator_add_tensor(acc, scaler, 1, h, 4097));
                EXPECT_OK(gradacc_accumulator_add_tensor(acc, scaler, 0, g, 4099));
                EXPECT_OK(gradacc_accumulator_end_microbatch(acc));
            }
        }
        gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
        EXPECT_OK(gradacc_accumulator_sync(acc, k ? NULL : a->comm, &info));
        /* window 1: (3 * 1 + 1 * 5) * 3 / (4 * 2) = 3; window 2: (2 * 2 + 2 * 4 + 4 * 1) * 3 / (8 * 2) = 3 */
        const uint64_t items = k ? 16 : 8, mbs = k ? 6 : 4;
        CHECK(!info.found_inf && info.total_count == items && info.microbatches == mbs,
              "unequal counts, window %d, rank %d: count %llu, mb %llu; expected %llu, %llu", k, r,
              (unsigned long long)info.total_count, (unsigned long long)info.microbatches, (unsigned long long)items,
              (unsigned long long)mbs);
        check_shard_values(acc, t, 2, (const float[]){3.0f, 3.0f},
                           k ? "unequal counts, window 2 (add_tensor)" : "unequal counts, window 1", r);
    }
    free(g);
    free(h);
    EXPECT_OK(gradacc_accumulator_destroy(acc));
    EXPECT_OK(gradacc_scaler_destroy(scaler));
    return NULL;
}

/* Three ranks, sum losses normalised by micro-batches: two windows of 3, then a partial one of 1.
 * Rank r's micro-batch m is (m + 1)(r + 1) / 4 everywhere: a full window averages
 * 6 * 6 / 4 / 9 = 1, the partial one 6 / 4 / 3 = 0.5, both exact. */
static void *partial_window_rank(void *arg)
{
    seed_args *a = arg;
    const int r = a->rank;
    enum { N0 = 9001, N1 = 33 };
    gradacc_tensor_desc_t t[2] = {{N0, GRADACC_DTYPE_F16}, {N1, GRADACC_DTYPE_BF16}};
    gradacc_accumulator_config_t ac;
    REQUIRE_OK(gradacc_accumulator_config_default(&ac));
    ac.loss_reduction = GRADACC_LOSS_REDUCTION_SUM;
    ac.normalize = GRADACC_NORMALIZE_BY_MICROBATCHES;
    ac.bucket_numel = 3000;
    gradacc_accumulator_t *acc = make_sharded(ac, t, 2, a->comm);
    gradacc_scaler_t *scaler = scaler_with_scale(256.0f);
    uint16_t *h = malloc(N0 * sizeof(uint16_t)), b[N1];
    static const int mbs[3] = {3, 3, 1};
    for (int k = 0; k < 3; k++) {
        for (int m = 0; m < mbs[k]; m++) {
            float v = (float)((m + 1) * (r + 1)) * 0.25f * 256.0f;
            for (int i = 0; i < N0; i++)
                h[i] = f32_to_f16_bits(v);
            for (int i = 0; i < N1; i++)
                b[i] = f32_to_bf16_bits(v);
            const void *p[2] = {h, b};
            EXPECT_OK(gradacc_accumulator_add(acc, scaler, p, 2, 5));
        }
        gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
        EXPECT_OK(gradacc_accumulator_sync(acc, a->comm, &info));
        CHECK(!info.found_inf && info.microbatches == (uint64_t)(3 * mbs[k]) && info.total_count == (uint64_t)(15 * mbs[k]),
              "window %d, rank %d: count %llu, mb %llu; expected %d, %d", k, r, (unsigned long long)info.total_count,
              (unsigned long long)info.microbatches, 15 * mbs[k], 3 * mbs[k]);
        const float v = mbs[k] == 3 ? 1.0f : 0.5f;
        check_shard_values(acc, t, 2, (const float[]){v, v}, mbs[k] == 3 ? "full window" : "partial final window", r);
    }
    free(h);
    EXPECT_OK(gradacc_accumulator_destroy(acc));
    EXPECT_OK(gradacc_scaler_destroy(scaler));
    return NULL;
}

static void run_seed(int ranks, void *(*fn)(void *))
{
    gradacc_comm_t *comms[MAX_RANKS];
    make_group(ranks, comms);
    seed_args args[MAX_RANKS];
    for (int r = 0; r < ranks; r++) {
        args[r].rank = r;
        args[r].comm = comms[r];
    }
    run_ranks((size_t)ranks, fn, args, sizeof args[0]);
    destroy_group(ranks, comms);
}

/* ---------------------------------------------------------------------------------------------
 * Misuse: one rank's invalid call fails every rank, and the windows stay
 * ------------------------------------------------------------------------------------------- */

/* Tensor 0 lies in shard 0, tensor 1 across shards 0 and 1, tensor 2 in shard 1; shard 2 is empty. */
static const gradacc_tensor_desc_t misuse_tensors[3] = {{100, GRADACC_DTYPE_F32}, {5900, GRADACC_DTYPE_F16}, {10, GRADACC_DTYPE_F32}};
/* Tensors at 0, 128 and 6080 (each at a multiple of GRADACC_MASTER_ALIGN bytes): 6144 elements. */
enum { MISUSE_RANKS = 3, MISUSE_LEN = 6144 };

typedef struct {
    float f0[100], f2[10];
    uint16_t h1[5900];
} misuse_grads;

static void fill_misuse(misuse_grads *g, float v)
{
    for (int i = 0; i < 100; i++)
        g->f0[i] = v;
    for (int i = 0; i < 5900; i++)
        g->h1[i] = f32_to_f16_bits(v);
    for (int i = 0; i < 10; i++)
        g->f2[i] = v;
}

/* The shard's bits now. */
static uint64_t shard_hash(gradacc_accumulator_t *acc)
{
    size_t off = 0, n = 0;
    float *data = NULL;
    REQUIRE_OK(gradacc_accumulator_shard(acc, &off, &n, &data));
    uint64_t h = 0xcbf29ce484222325ull;
    const unsigned char *b = (const unsigned char *)data;
    for (size_t i = 0; i < n * sizeof(float); i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

static void *misuse_rank(void *arg)
{
    seed_args *a = arg;
    const int r = a->rank;
    gradacc_accumulator_t *acc = make_sharded(setup_config(&(setup){GRADACC_NORMALIZE_BY_COUNT, GRADACC_LOSS_REDUCTION_MEAN, 0,
                                                                    GRADACC_DTYPE_F32},
                                                           0.0f),
                                              misuse_tensors, 3, a->comm);
    gradacc_scaler_t *scaler = scaler_with_scale(1.0f);
    static misuse_grads grads[MISUSE_RANKS];
    misuse_grads *g = &grads[r];
    fill_misuse(g, (float)(r + 1));
    const void *p[3] = {g->f0, g->h1, g->f2};
    const gradacc_status_t peer = GRADACC_STATUS_PEER_FAILURE;

    EXPECT_OK(gradacc_accumulator_add(acc, scaler, p, 3, 1));
    const uint64_t before = shard_hash(acc);

    /* Rank 1 adds a micro-batch of 0 items (a mean-reduced loss needs one). */
    gradacc_status_t st = gradacc_accumulator_add(acc, scaler, p, 3, r == 1 ? 0 : 1);
    if (r == 1)
        CHECK(st == GRADACC_STATUS_INVALID_ARGUMENT && strstr(gradacc_last_error(), "count is 0"),
              "invalid add, rank 1: status %d (%s): %s", (int)st, gradacc_status_string(st), gradacc_last_error());
    else
        CHECK(st == peer && strstr(gradacc_last_error(), "another rank"), "invalid add on rank 1, rank %d: status %d (%s): %s",
              r, (int)st, gradacc_status_string(st), gradacc_last_error());
    CHECK(shard_hash(acc) == before, "rank %d: the invalid add changed the shard", r);

    /* Arguments refused before the micro-batch's control step still reach it: rank 1 passes a
     * wrong tensor count, then a NULL gradient, then a misaligned one. */
    st = gradacc_accumulator_add(acc, scaler, p, r == 1 ? 2 : 3, 1);
    CHECK(st == (r == 1 ? GRADACC_STATUS_SIZE_MISMATCH : peer), "wrong n on rank 1, rank %d: status %d (%s): %s", r, (int)st,
          gradacc_status_string(st), gradacc_last_error());
    const void *holed[3] = {g->f0, r == 1 ? NULL : (const void *)g->h1, g->f2};
    st = gradacc_accumulator_add(acc, scaler, holed, 3, 1);
    CHECK(st == (r == 1 ? GRADACC_STATUS_NULL_ARGUMENT : peer), "NULL grads[1] on rank 1, rank %d: status %d (%s): %s", r,
          (int)st, gradacc_status_string(st), gradacc_last_error());
    const void *skewed[3] = {r == 1 ? (const void *)((const char *)g->f0 + 1) : (const void *)g->f0, g->h1, g->f2};
    st = gradacc_accumulator_add(acc, scaler, skewed, 3, 1);
    CHECK(st == (r == 1 ? GRADACC_STATUS_INVALID_ARGUMENT : peer), "misaligned grads[0] on rank 1, rank %d: status %d (%s): %s",
          r, (int)st, gradacc_status_string(st), gradacc_last_error());
    CHECK(shard_hash(acc) == before, "rank %d: the refused adds changed the shard", r);

    /* Rank 2 opens a micro-batch of 0 items: nothing opens anywhere. */
    st = gradacc_accumulator_begin_microbatch(acc, r == 2 ? 0 : 1);
    CHECK(st == (r == 2 ? GRADACC_STATUS_INVALID_ARGUMENT : peer), "invalid begin_microbatch on rank 2, rank %d: status %d (%s)",
          r, (int)st, gradacc_status_string(st));
    EXPECT_STATUS(gradacc_accumulator_end_microbatch(acc), GRADACC_STATUS_WRONG_STATE);
    CHECK(shard_hash(acc) == before, "rank %d: the invalid begin_microbatch changed the shard", r);

    /* Rank 0 at the boundary while the others add: every rank fails, nothing is reduced. */
    st = r == 0 ? gradacc_accumulator_sync(acc, a->comm, NULL) : gradacc_accumulator_add(acc, scaler, p, 3, 1);
    CHECK(st == GRADACC_STATUS_SIZE_MISMATCH && (r == 0 || strstr(gradacc_last_error(), "same step")),
          "rank 0 at the boundary, the others adding, rank %d: status %d (%s): %s", r, (int)st, gradacc_status_string(st),
          gradacc_last_error());
    CHECK(shard_hash(acc) == before, "rank %d: the mismatched step changed the shard", r);

    /* A micro-batch tensor by tensor, whole. */
    EXPECT_OK(gradacc_accumulator_begin_microbatch(acc, 1));
    EXPECT_OK(gradacc_accumulator_add_tensor(acc, scaler, 2, g->f2, 10));
    EXPECT_OK(gradacc_accumulator_add_tensor(acc, scaler, 0, g->f0, 100));
    EXPECT_OK(gradacc_accumulator_add_tensor(acc, scaler, 1, g->h1, 5900));
    EXPECT_OK(gradacc_accumulator_end_microbatch(acc));

    /* Rank 1's info struct has a size no header ever had; the others sync on the creation
     * communicator (NULL): every rank fails, nothing is reduced. */
    gradacc_sync_info_t odd = GRADACC_SYNC_INFO_INIT;
    if (r == 1)
        odd.struct_size = 3;
    st = gradacc_accumulator_sync(acc, NULL, &odd);
    CHECK(st == (r == 1 ? GRADACC_STATUS_INVALID_ARGUMENT : peer), "odd out_info on rank 1, rank %d: status %d (%s): %s", r,
          (int)st, gradacc_status_string(st), gradacc_last_error());

    /* Rank 0 names a foreign communicator at the boundary: every rank fails. */
    gradacc_comm_t *stranger[1] = {NULL};
    if (r == 0)
        REQUIRE_OK(gradacc_comm_create_local(1, stranger));
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    info.total_count = 12345;
    st = gradacc_accumulator_sync(acc, r == 0 ? stranger[0] : NULL, &info);
    CHECK(st == (r == 0 ? GRADACC_STATUS_INVALID_ARGUMENT : peer) && info.total_count == 12345,
          "a foreign communicator on rank 0, rank %d: status %d (%s), info %s", r, (int)st, gradacc_status_string(st),
          info.total_count == 12345 ? "untouched" : "written");
    if (r == 0)
        EXPECT_OK(gradacc_comm_destroy(stranger[0]));

    /* The windows survived: two micro-batches of 1 item on each rank, (1 + 2 + 3) * 2 / 6 = 2. */
    EXPECT_OK(gradacc_accumulator_sync(acc, r == 2 ? NULL : a->comm, &info));
    CHECK(!info.found_inf && info.total_count == 6 && info.microbatches == 6,
          "after the failures, rank %d: count %llu, mb %llu; expected 6, 6", r, (unsigned long long)info.total_count,
          (unsigned long long)info.microbatches);
    check_shard_values(acc, misuse_tensors, 3, (const float[]){2.0f, 2.0f, 2.0f}, "after the failures", r);
    size_t off = 0, n = 0;
    float *data = NULL;
    EXPECT_OK(gradacc_accumulator_shard(acc, &off, &n, &data));
    layout l = {"misuse", 3, {misuse_tensors[0], misuse_tensors[1], misuse_tensors[2]}, 0, {0}};
    layout_place(&l);
    CHECK(l.len == MISUSE_LEN, "the misuse layout has %zu elements", l.len);
    check_master_access("misuse", &l, acc, r, off, n, data);
    CHECK(off == (r == 0 ? 0u : r == 1 ? 4096u : 6144u) && n == (r == 0 ? 4096u : r == 1 ? 2048u : 0u),
          "rank %d: shard [%zu, +%zu)", r, off, n);

    /* Training goes on: one micro-batch of 2 items of 3 (r + 1): 36 / 6 = 6. */
    fill_misuse(g, 3.0f * (float)(r + 1));
    EXPECT_OK(gradacc_accumulator_add(acc, scaler, p, 3, 2));
    EXPECT_OK(gradacc_accumulator_sync(acc, a->comm, &info));
    CHECK(info.total_count == 6 && info.microbatches == 3, "next window, rank %d: count %llu, mb %llu", r,
          (unsigned long long)info.total_count, (unsigned long long)info.microbatches);
    check_shard_values(acc, misuse_tensors, 3, (const float[]){6.0f, 6.0f, 6.0f}, "the window after the failures", r);

    /* A second contribution to a tensor within one micro-batch, on rank 2, is refused (each
     * tensor takes one per micro-batch), and a NULL one on rank 1: the micro-batch fails on every
     * rank when it ends, and the windows are discarded. */
    EXPECT_OK(gradacc_accumulator_begin_microbatch(acc, 1));
    EXPECT_OK(gradacc_accumulator_add_tensor(acc, scaler, 2, g->f2, 10));
    if (r == 2)
        EXPECT_ERROR(gradacc_accumulator_add_tensor(acc, scaler, 2, g->f2, 10), GRADACC_STATUS_WRONG_STATE, "tensor 2");
    if (r == 1)
        EXPECT_STATUS(gradacc_accumulator_add_tensor(acc, scaler, 0, NULL, 100), GRADACC_STATUS_NULL_ARGUMENT);
    st = gradacc_accumulator_end_microbatch(acc);
    CHECK(st == (r == 0 ? peer : GRADACC_STATUS_WRONG_STATE) && strstr(gradacc_last_error(), "window was discarded"),
          "refused contributions on ranks 1 and 2, rank %d: status %d (%s): %s", r, (int)st, gradacc_status_string(st),
          gradacc_last_error());
    EXPECT_STATUS(gradacc_accumulator_sync(acc, NULL, &info), GRADACC_STATUS_EMPTY_WINDOW);
    EXPECT_OK(gradacc_accumulator_destroy(acc));
    EXPECT_OK(gradacc_scaler_destroy(scaler));
    return NULL;
}

/* ---------------------------------------------------------------------------------------------
 * Checkpoints of a shard's window
 * ------------------------------------------------------------------------------------------- */

static const gradacc_tensor_desc_t ckpt_tensors[3] = {{5001, GRADACC_DTYPE_F16}, {3999, GRADACC_DTYPE_BF16}, {7, GRADACC_DTYPE_F32}};
enum { CKPT_RANKS = 3 };

typedef struct {
    int rank;
    gradacc_comm_t *comm[4];
    grad_buf g[2][3]; /* two micro-batches */
    uint8_t *saved;   /* after micro-batch 0 */
    size_t saved_len;
    gradacc_sync_info_t info; /* of the whole window */
    float *bits;              /* the whole window's shard */
    size_t n;
    const uint8_t *other; /* another rank's saved window */
    size_t other_len;
} ckpt_args;

static gradacc_accumulator_config_t ckpt_config(void)
{
    setup s = {GRADACC_NORMALIZE_BY_COUNT, GRADACC_LOSS_REDUCTION_MEAN, 0, GRADACC_DTYPE_F32};
    return setup_config(&s, 0.5f);
}

static void add_ckpt(gradacc_accumulator_t *acc, gradacc_scaler_t *scaler, ckpt_args *a, int m)
{
    const void *p[3] = {a->g[m][0].data, a->g[m][1].data, a->g[m][2].data};
    EXPECT_OK(gradacc_accumulator_add(acc, scaler, p, 3, (uint64_t)(2 + a->rank + m)));
}

/* Phase 1: the whole window; the window saved after its first micro-batch, and resumed. */
static void *ckpt_save_rank(void *arg)
{
    ckpt_args *a = arg;
    gradacc_scaler_t *scaler = scaler_with_scale(64.0f);
    gradacc_accumulator_t *whole = make_sharded(ckpt_config(), ckpt_tensors, 3, a->comm[0]);
    add_ckpt(whole, scaler, a, 0);
    add_ckpt(whole, scaler, a, 1);
    a->info.struct_size = sizeof a->info;
    EXPECT_OK(gradacc_accumulator_sync(whole, a->comm[0], &a->info));
    size_t off = 0;
    float *data = NULL;
    EXPECT_OK(gradacc_accumulator_shard(whole, &off, &a->n, &data));
    a->bits = malloc((a->n ? a->n : 1) * sizeof(float));
    memcpy(a->bits, data, a->n * sizeof(float));
    size_t len = 1;
    EXPECT_STATUS(gradacc_accumulator_save_window(whole, NULL, 0, &len), GRADACC_STATUS_WRONG_STATE); /* after sync */

    gradacc_accumulator_t *before = make_sharded(ckpt_config(), ckpt_tensors, 3, a->comm[1]);
    add_ckpt(before, scaler, a, 0);
    EXPECT_OK(gradacc_accumulator_save_window(before, NULL, 0, &a->saved_len));
    CHECK(a->saved_len > a->n * sizeof(float), "rank %d: the saved window takes %zu bytes for a shard of %zu elements", a->rank,
          a->saved_len, a->n);
    a->saved = malloc(a->saved_len);
    EXPECT_OK(gradacc_accumulator_save_window(before, a->saved, a->saved_len, &len));
    CHECK(len == a->saved_len, "rank %d: saved %zu bytes, sized %zu", a->rank, len, a->saved_len);

    gradacc_accumulator_t *after = make_sharded(ckpt_config(), ckpt_tensors, 3, a->comm[2]);
    EXPECT_OK(gradacc_accumulator_load_window(after, a->saved, a->saved_len));
    add_ckpt(after, scaler, a, 1);
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    EXPECT_OK(gradacc_accumulator_sync(after, NULL, &info));
    EXPECT_OK(gradacc_accumulator_shard(after, &off, &len, &data));
    CHECK(same_info(&info, &a->info) && len == a->n && memcmp(data, a->bits, a->n * sizeof(float)) == 0,
          "rank %d: the resumed window differs from the whole one (count %llu vs %llu, norm %.17g vs %.17g)", a->rank,
          (unsigned long long)info.total_count, (unsigned long long)a->info.total_count, info.grad_norm, a->info.grad_norm);
    EXPECT_OK(gradacc_accumulator_destroy(whole));
    EXPECT_OK(gradacc_accumulator_destroy(before));
    EXPECT_OK(gradacc_accumulator_destroy(after));
    EXPECT_OK(gradacc_scaler_destroy(scaler));
    return NULL;
}

/* Phase 2: another rank's shard, and an unsharded accumulator, refuse the bytes and stay as they
 * were: the accumulation then resumes from its own bytes to the whole window's bits. */
static void *ckpt_foreign_rank(void *arg)
{
    ckpt_args *a = arg;
    gradacc_scaler_t *scaler = scaler_with_scale(64.0f);
    gradacc_accumulator_t *acc = make_sharded(ckpt_config(), ckpt_tensors, 3, a->comm[3]);
    EXPECT_ERROR(gradacc_accumulator_load_window(acc, a->other, a->other_len), GRADACC_STATUS_CORRUPT_STATE, "shard");
    EXPECT_ERROR(gradacc_accumulator_merge_window(acc, a->other, a->other_len), GRADACC_STATUS_CORRUPT_STATE, "shard");
    gradacc_accumulator_config_t plain_c = ckpt_config();
    gradacc_accumulator_t *plain = NULL;
    REQUIRE_OK(gradacc_accumulator_create(&plain_c, ckpt_tensors, 3, NULL, &plain));
    EXPECT_ERROR(gradacc_accumulator_load_window(plain, a->saved, a->saved_len), GRADACC_STATUS_CORRUPT_STATE, "shard");
    EXPECT_OK(gradacc_accumulator_destroy(plain));

    EXPECT_OK(gradacc_accumulator_load_window(acc, a->saved, a->saved_len));
    add_ckpt(acc, scaler, a, 1);
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    EXPECT_OK(gradacc_accumulator_sync(acc, a->comm[3], &info));
    size_t off = 0, n = 0;
    float *data = NULL;
    EXPECT_OK(gradacc_accumulator_shard(acc, &off, &n, &data));
    CHECK(same_info(&info, &a->info) && n == a->n && memcmp(data, a->bits, n * sizeof(float)) == 0,
          "rank %d: after the refused loads, the resumed window differs from the whole one", a->rank);
    EXPECT_OK(gradacc_accumulator_destroy(acc));
    EXPECT_OK(gradacc_scaler_destroy(scaler));
    return NULL;
}

static void test_checkpoint(test_rng *rng)
{
    gradacc_comm_t *comms[4][CKPT_RANKS];
    for (int k = 0; k < 4; k++)
        make_group(CKPT_RANKS, comms[k]);
    ckpt_args args[CKPT_RANKS];
    memset(args, 0, sizeof args);
    double *v = malloc(5001 * sizeof(double));
    for (int r = 0; r < CKPT_RANKS; r++) {
        args[r].rank = r;
        for (int k = 0; k < 4; k++)
            args[r].comm[k] = comms[k][r];
        for (int m = 0; m < 2; m++)
            for (int t = 0; t < 3; t++) {
                args[r].g[m][t] = grad_alloc(ckpt_tensors[t].dtype, ckpt_tensors[t].numel);
                for (size_t i = 0; i < ckpt_tensors[t].numel; i++)
                    v[i] = rng_range(rng, -1.0, 1.0);
                grad_encode(&args[r].g[m][t], v, 64.0, NULL);
            }
    }
    free(v);
    run_ranks(CKPT_RANKS, ckpt_save_rank, args, sizeof args[0]);
    for (int r = 0; r < CKPT_RANKS; r++) {
        args[r].other = args[(r + 1) % CKPT_RANKS].saved;
        args[r].other_len = args[(r + 1) % CKPT_RANKS].saved_len;
    }
    if (args[0].saved && args[1].saved && args[2].saved)
        run_ranks(CKPT_RANKS, ckpt_foreign_rank, args, sizeof args[0]);
    for (int r = 0; r < CKPT_RANKS; r++) {
        free(args[r].saved);
        free(args[r].bits);
        for (int m = 0; m < 2; m++)
            for (int t = 0; t < 3; t++)
                grad_free(&args[r].g[m][t]);
    }
    for (int k = 0; k < 4; k++)
        destroy_group(CKPT_RANKS, comms[k]);
}

int main(void)
{
    test_rng rng = rng_fresh("api_sharded");
    test_creation();

    run_seed(3, overflow_rank);
    run_seed(2, unequal_counts_rank);
    run_seed(3, partial_window_rank);
    run_seed(MISUSE_RANKS, misuse_rank);
    test_checkpoint(&rng);

    /* 2 and 3 ranks; every normalisation, clipping, the BF16 wire; every other layout smaller
     * than a block (so shards past the first are empty); an overflow in window 1 of some. */
    static const struct {
        int ranks;
        gradacc_normalize_t normalize;
        gradacc_loss_reduction_t loss;
        int clip;
        gradacc_dtype_t wire;
        int small, overflow_window;
    } cases[] = {
        {2, GRADACC_NORMALIZE_BY_COUNT, GRADACC_LOSS_REDUCTION_MEAN, 0, GRADACC_DTYPE_F32, 0, 1},
        {3, GRADACC_NORMALIZE_BY_MICROBATCHES, GRADACC_LOSS_REDUCTION_SUM, 1, GRADACC_DTYPE_F32, 0, -1},
        {2, GRADACC_NORMALIZE_BY_WORLD, GRADACC_LOSS_REDUCTION_MEAN, 1, GRADACC_DTYPE_BF16, 1, -1},
        {3, GRADACC_NORMALIZE_NONE, GRADACC_LOSS_REDUCTION_SUM, 0, GRADACC_DTYPE_F32, 1, 1},
        {3, GRADACC_NORMALIZE_BY_COUNT, GRADACC_LOSS_REDUCTION_MEAN, 1, GRADACC_DTYPE_F32, 0, 1},
        {2, GRADACC_NORMALIZE_BY_COUNT, GRADACC_LOSS_REDUCTION_MEAN, 0, GRADACC_DTYPE_BF16, 0, -1},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        setup s = {cases[c].normalize, cases[c].loss, cases[c].clip, cases[c].wire};
        layout l = random_layout(&rng, cases[c].small);
        run_training(&rng, &l, &s, cases[c].ranks, cases[c].overflow_window);
    }
    return test_finish();
}
