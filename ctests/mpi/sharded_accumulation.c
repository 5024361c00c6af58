/* mpi-np: 2 4 */
/* Sharded accumulation (ZeRO-2, GRADACC_SHARDING_ACCUMULATE) over real MPI: each rank's
 * accumulator, made with gradacc_accumulator_create_sharded on a communicator the caller adopted,
 * holds only its shard and reduce-scatters every micro-batch.
 *   training:     three fp16 / bf16 / f32 tensors over several stripes and buckets per shard;
 *                 windows of 3, 2 and 1 micro-batches (the last partial) of unequal item counts
 *                 and per-rank loss scales; BY_COUNT, BY_MICROBATCHES with clipping, and the BF16
 *                 wire with BY_WORLD and clipping. One sharded accumulator adds whole micro-batches
 *                 (add), another tensor by tensor in a per-rank shuffled order (add_tensor): the
 *                 same bits and infos. Beside them an unsharded accumulator syncs on the world (an
 *                 all-reduce): counts and overflow equal, norms within 1e-5, and each shard within
 *                 the sum of both runs' bounds against an f64 reference of every rank's
 *                 contributions (4e-6 of the summed magnitudes each, plus 2^-8 with the BF16 wire):
 *                 FP32 sums in another order, never compared bit for bit.
 *   seeds, exact: the last rank overflowing (found_inf, a skipped step and the same backed-off
 *                 scale on every rank; the next window clean, (W + 1) / 4); unequal token counts
 *                 weighted by count while the micro-batch count changes (W + 1); a partial final
 *                 window normalised by its own micro-batches ((W + 1) / 4, then (W + 1) / 8).
 *   misuse:       the last rank's invalid add (0 items of a mean loss) fails there and with
 *                 PEER_FAILURE everywhere else; rank 0 at the boundary while the others add fails
 *                 every rank; a foreign communicator at rank 0's boundary fails every rank. The
 *                 windows stay intact (the exact sum after) and training goes on.
 *   hybrid:       every grid of S shards x R replicas with S * R = world (2 x 2 among them at 4
 *                 processes), split with MPI_Comm_split as hybrid.c does: the accumulation over the
 *                 shard group, gradacc_accumulator_sync_hybrid over both groups. Counts over the
 *                 world, the same infos everywhere, replicas bitwise equal, shards within tolerance
 *                 of the all-reduce over the world and of the f64 reference. */
#include "mpi/shard_common.h"

enum { T = 3, WINDOWS = 3 };
static const size_t numel[T] = {150001, 17, 100003};
static const gradacc_dtype_t dtypes[T] = {GRADACC_DTYPE_F16, GRADACC_DTYPE_BF16, GRADACC_DTYPE_F32};
/* Each tensor at a multiple of GRADACC_MASTER_ALIGN bytes, zeros between (checked in main). */
static const size_t offset[T] = {0, 150016, 150080};
enum { LEN = 250112 };
static const int window_microbatches[WINDOWS] = {3, 2, 1};
static const double COMM_TIMEOUT_S = 30.0; /* a failure that waited for a missing rank times out, not hangs */

typedef struct {
    const char *name;
    gradacc_normalize_t normalize;
    gradacc_loss_reduction_t loss;
    gradacc_dtype_t wire;
    double clip; /* max_grad_norm as a fraction of the first window's reference norm; 0: none */
} scenario;

static const scenario scenarios[] = {
    {"by count", GRADACC_NORMALIZE_BY_COUNT, GRADACC_LOSS_REDUCTION_MEAN, GRADACC_DTYPE_F32, 0.0},
    {"by micro-batches, clipped", GRADACC_NORMALIZE_BY_MICROBATCHES, GRADACC_LOSS_REDUCTION_SUM, GRADACC_DTYPE_F32, 0.5},
    {"bf16 wire, by world, clipped", GRADACC_NORMALIZE_BY_WORLD, GRADACC_LOSS_REDUCTION_MEAN, GRADACC_DTYPE_BF16, 0.8},
};

static gradacc_comm_t *timed_comm_of(MPI_Comm comm)
{
    gradacc_comm_t *c = comm_of(comm);
    EXPECT_OK(gradacc_comm_set_timeout(c, COMM_TIMEOUT_S));
    return c;
}

static gradacc_accumulator_config_t scenario_config(const scenario *s, float max_norm)
{
    gradacc_accumulator_config_t ac;
    REQUIRE_OK(gradacc_accumulator_config_default(&ac));
    ac.normalize = s->normalize;
    ac.loss_reduction = s->loss;
    ac.max_grad_norm = max_norm;
    ac.wire_dtype = s->wire;
    ac.bucket_numel = 65536; /* several stripes per shard and buckets per micro-batch */
    return ac;
}

static gradacc_tensor_desc_t desc(int t)
{
    gradacc_tensor_desc_t d = {numel[t], dtypes[t]};
    return d;
}

/* Element i of tensor t of rank `rank`'s micro-batch `mb` of window `step` in scenario `sc`:
 * magnitudes over 2^-10..2^0, spread so that another summation order would change the bits. */
static double value(int sc, int step, int rank, int mb, int t, size_t i)
{
    uint64_t z = ((uint64_t)sc << 58) ^ ((uint64_t)step << 52) ^ ((uint64_t)rank << 44) ^ ((uint64_t)mb << 36) ^
                 ((uint64_t)t << 30) ^ (uint64_t)i;
    test_rng r = {z * 0x9e3779b97f4a7c15ull + 7};
    return ldexp(rng_range(&r, -1.0, 1.0), -(int)rng_below(&r, 11));
}

static uint64_t count_of(int rank, int mb) { return 1 + (uint64_t)((5 * rank + 3 * mb) % 7); }
static double scale_of(int rank) { return ldexp(1.0, 6 + rank); }

/* One micro-batch of rank `rank`, scaled by its loss scale; `exact` (optional, LEN elements)
 * receives the values it carries once unscaled, each tensor's at its offset in the master. */
static void make_grads(int sc, int step, int rank, int mb, grad_buf *g, double *exact)
{
    double *v = malloc(numel[0] * sizeof(double));
    for (int t = 0; t < T; t++) {
        for (size_t i = 0; i < numel[t]; i++)
            v[i] = value(sc, step, rank, mb, t, i);
        grad_encode(&g[t], v, scale_of(rank), exact ? exact + offset[t] : NULL);
    }
    free(v);
}

/* One window of scenario `sc` (step `step`, `microbatches` on every rank) for `reference_of`. */
typedef struct {
    int sc, step, microbatches;
} window_args;

static int window_microbatches_of(const void *ctx, int rank)
{
    (void)rank;
    return ((const window_args *)ctx)->microbatches;
}

static void window_exact(const void *ctx, int rank, int mb, double *exact)
{
    const window_args *a = ctx;
    grad_buf g[T];
    for (int t = 0; t < T; t++)
        g[t] = grad_alloc(dtypes[t], numel[t]);
    make_grads(a->sc, a->step, rank, mb, g, exact);
    for (int t = 0; t < T; t++)
        grad_free(&g[t]);
}

/* The f64 reference of one window over the world's ranks. */
static reference make_reference(int sc, int step, int microbatches)
{
    const scenario *s = &scenarios[sc];
    window_args a = {sc, step, microbatches};
    window_of_ranks w = {window_microbatches_of, count_of, window_exact, &a};
    return reference_of(&w, LEN, world_size(), s->normalize, s->loss);
}

/* Adds this rank's micro-batches of one window: to `whole` through add, to `hooked` through
 * add_tensor in a shuffled order (per rank and micro-batch), to `plain` (if any) through add. */
static void add_window(int sc, int step, int microbatches, gradacc_scaler_t *scaler, gradacc_accumulator_t *whole,
                       gradacc_accumulator_t *hooked, gradacc_accumulator_t *plain)
{
    const int rank = world_rank();
    grad_buf g[T];
    const void *p[T];
    for (int t = 0; t < T; t++) {
        g[t] = grad_alloc(dtypes[t], numel[t]);
        p[t] = g[t].data;
    }
    for (int m = 0; m < microbatches; m++) {
        make_grads(sc, step, rank, m, g, NULL);
        EXPECT_OK(gradacc_accumulator_add(whole, scaler, p, T, count_of(rank, m)));
        if (hooked) {
            EXPECT_OK(gradacc_accumulator_begin_microbatch(hooked, count_of(rank, m)));
            for (int k = 0; k < T; k++) {
                size_t t = (size_t)((k + rank + m) % T);
                EXPECT_OK(gradacc_accumulator_add_tensor(hooked, scaler, t, g[t].data, numel[t]));
            }
            EXPECT_OK(gradacc_accumulator_end_microbatch(hooked));
        }
        if (plain)
            EXPECT_OK(gradacc_accumulator_add(plain, scaler, p, T, count_of(rank, m)));
    }
    for (int t = 0; t < T; t++)
        grad_free(&g[t]);
}

/* A synced accumulation's shard against the all-reduced master `flat` (tolerance) and the f64
 * reference, with the infos. `group` holds the shard group (whose shards tile the layout),
 * `replicas` the ranks holding the same shard (bitwise equal), MPI_COMM_NULL for none. Returns
 * the largest |shard - all-reduce| over the element's summed magnitude, normalised. */
static double check_against(const char *what, const scenario *s, const reference *ref, float max_norm,
                            gradacc_accumulator_t *acc, const gradacc_sync_info_t *info, const float *flat,
                            const gradacc_sync_info_t *flat_info, MPI_Comm group, MPI_Comm replicas)
{
    const int rank = world_rank();
    CHECK(same_on_all_ranks(double_bits(info->grad_norm), MPI_COMM_WORLD) &&
              same_on_all_ranks(double_bits(info->clip_coef), MPI_COMM_WORLD) &&
              same_on_all_ranks(info->total_count, MPI_COMM_WORLD) &&
              same_on_all_ranks(info->microbatches, MPI_COMM_WORLD) && same_on_all_ranks(info->found_inf, MPI_COMM_WORLD),
          "%s: the infos differ between ranks", what);
    CHECK(!info->found_inf && info->total_count == ref->items && info->microbatches == ref->microbatches &&
              flat_info->total_count == ref->items && flat_info->microbatches == ref->microbatches && !flat_info->found_inf,
          "%s rank %d: found_inf %d, count %llu, micro-batches %llu (all-reduce %d, %llu, %llu); expected 0, %llu, %llu", what,
          rank, (int)info->found_inf, (unsigned long long)info->total_count, (unsigned long long)info->microbatches,
          (int)flat_info->found_inf, (unsigned long long)flat_info->total_count,
          (unsigned long long)flat_info->microbatches, (unsigned long long)ref->items,
          (unsigned long long)ref->microbatches);

    size_t off = 0, n = 0;
    float *data = NULL;
    REQUIRE_OK(gradacc_accumulator_shard(acc, &off, &n, &data));
    int group_size = 0;
    MPI_Comm_size(group, &group_size);
    unsigned long long mine[2] = {off, n}, all[2 * 64];
    if (group_size <= 64) {
        MPI_Allgather(mine, 2, MPI_UNSIGNED_LONG_LONG, all, 2, MPI_UNSIGNED_LONG_LONG, group);
        size_t size = ((LEN + (size_t)group_size - 1) / (size_t)group_size + 4095) / 4096 * 4096;
        unsigned long long next = 0;
        for (int k = 0; k < group_size; k++) {
            unsigned long long want_n = (unsigned long long)(k + 1) * size < LEN ? size : LEN - next;
            CHECK(all[2 * k] == next && all[2 * k + 1] == want_n, "%s: shard %d of %d is [%llu, +%llu), expected [%llu, +%llu)",
                  what, k, group_size, all[2 * k], all[2 * k + 1], next, want_n);
            next = all[2 * k] + all[2 * k + 1];
        }
        CHECK(next == LEN, "%s: the shards end at %llu of %d", what, next, LEN);
    }
    if (replicas != MPI_COMM_NULL)
        CHECK(same_on_all_ranks(off, replicas) && same_on_all_ranks(n, replicas) &&
                  same_on_all_ranks(bits_hash(data, n), replicas),
              "%s rank %d: the replicas of this shard differ", what, rank);
    if (off + n > LEN)
        return INFINITY;

    const double wire = s->wire == GRADACC_DTYPE_BF16 ? ldexp(1.0, -8) : 0.0;
    const double norm_tol = 1e-5 * ref->norm + wire * ref->spread;
    const double coef = max_norm == 0.0f ? 1.0 : fmin(1.0, (double)max_norm / (ref->norm + 1e-6));
    CHECK_CLOSE(info->grad_norm, ref->norm, norm_tol, "%s: norm", what);
    CHECK_CLOSE(info->grad_norm, flat_info->grad_norm, 2 * norm_tol, "%s: norm against the all-reduce's", what);
    CHECK_CLOSE(info->clip_coef, coef, coef * (1e-5 + norm_tol / ref->norm), "%s: clip coefficient", what);
    CHECK(coef > 0.999 || info->clip_coef < 1.0, "%s: clip coefficient %g, expected clipping (%g)", what, info->clip_coef,
          coef);
    const double coef_error = fabs(info->clip_coef - coef), flat_coef_error = fabs(flat_info->clip_coef - coef);
    double worst = 0.0;
    int shown = 0;
    for (size_t k = 0; k < n; k++) {
        const size_t e = off + k;
        const double want = ref->sum[e] / ref->divisor * coef, mag = ref->magnitude[e] / ref->divisor * coef;
        const double tol = (4e-6 + wire) * mag + fabs(ref->sum[e] / ref->divisor) * coef_error + 1e-30;
        const double flat_tol = (4e-6 + wire) * mag + fabs(ref->sum[e] / ref->divisor) * flat_coef_error + 1e-30;
        const double diff = fabs((double)data[k] - (double)flat[e]);
        if (mag > 0.0 && diff / mag > worst)
            worst = diff / mag;
        if (!(fabs((double)data[k] - want) <= tol) && shown++ < 3)
            CHECK(0, "%s rank %d element %zu: %.9g, f64 reference %.9g (tol %.2g)", what, rank, e, (double)data[k], want, tol);
        if (!(diff <= tol + flat_tol) && shown++ < 3)
            CHECK(0, "%s rank %d element %zu: %.9g, all-reduce %.9g (tol %.2g)", what, rank, e, (double)data[k],
                  (double)flat[e], tol + flat_tol);
    }
    CHECK(shown == 0, "%s rank %d: %d shard elements off the reference or the all-reduce", what, rank, shown);
    return worst;
}

/* The training windows of one scenario: add and add_tensor bitwise equal, both within tolerance
 * of the all-reduce. */
static void training(int sc)
{
    const scenario *s = &scenarios[sc];
    const int rank = world_rank();
    gradacc_comm_t *whole_comm = timed_comm_of(MPI_COMM_WORLD), *hooked_comm = timed_comm_of(MPI_COMM_WORLD);
    gradacc_comm_t *plain_comm = timed_comm_of(MPI_COMM_WORLD);
    gradacc_tensor_desc_t t[T] = {desc(0), desc(1), desc(2)};
    reference first = make_reference(sc, 0, window_microbatches[0]);
    const float max_norm = s->clip > 0.0 ? (float)(s->clip * first.norm) : 0.0f;
    free_reference(&first);
    const gradacc_accumulator_config_t ac = scenario_config(s, max_norm);
    gradacc_accumulator_t *whole = make_accumulate_acc(ac, t, T, whole_comm);
    gradacc_accumulator_t *hooked = make_accumulate_acc(ac, t, T, hooked_comm);
    gradacc_accumulator_t *plain = NULL;
    REQUIRE_OK(gradacc_accumulator_create(&ac, t, T, NULL, &plain));
    gradacc_scaler_t *scaler = scaler_with_scale((float)scale_of(rank));
    double worst = 0.0;
    for (int step = 0; step < WINDOWS; step++) {
        const int mbs = window_microbatches[step];
        char what[128];
        snprintf(what, sizeof what, "%s, window %d of %d micro-batches", s->name, step, mbs);
        reference ref = make_reference(sc, step, mbs);
        add_window(sc, step, mbs, scaler, whole, hooked, plain);
        gradacc_sync_info_t wi = GRADACC_SYNC_INFO_INIT, hi = GRADACC_SYNC_INFO_INIT, pi = GRADACC_SYNC_INFO_INIT;
        /* the creation communicator or NULL: the same boundary */
        gradacc_status_t st1 = gradacc_accumulator_sync(whole, step % 2 ? NULL : whole_comm, &wi);
        gradacc_status_t st2 = gradacc_accumulator_sync(hooked, step % 2 ? hooked_comm : NULL, &hi);
        gradacc_status_t st3 = gradacc_accumulator_sync(plain, plain_comm, &pi);
        EXPECT_OK(st1);
        EXPECT_OK(st2);
        EXPECT_OK(st3);
        if (st1 == GRADACC_STATUS_OK && st2 == GRADACC_STATUS_OK && st3 == GRADACC_STATUS_OK) {
            size_t o1 = 0, n1 = 0, o2 = 1, n2 = 1, po = 1, pn = 0;
            float *d1 = NULL, *d2 = NULL, *flat = NULL;
            REQUIRE_OK(gradacc_accumulator_shard(whole, &o1, &n1, &d1));
            REQUIRE_OK(gradacc_accumulator_shard(hooked, &o2, &n2, &d2));
            REQUIRE_OK(gradacc_accumulator_shard(plain, &po, &pn, &flat));
            CHECK(same_info(&wi, &hi), "%s rank %d: add and add_tensor report differently", what, rank);
            CHECK(o1 == o2 && n1 == n2 && memcmp(d1, d2, n1 * sizeof(float)) == 0,
                  "%s rank %d: add and add_tensor hold other bits in shard [%zu, +%zu)", what, rank, o1, n1);
            CHECK(po == 0 && pn == LEN, "%s: the all-reduce's shard is [%zu, +%zu)", what, po, pn);
            double d = check_against(what, s, &ref, max_norm, whole, &wi, flat, &pi, MPI_COMM_WORLD, MPI_COMM_NULL);
            worst = d > worst ? d : worst;
        }
        free_reference(&ref);
    }
    double all = 0.0;
    MPI_Allreduce(&worst, &all, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (rank == 0)
        printf("%d ranks, %s: max |sharded - all-reduce| = %.2g of the summed magnitudes\n", world_size(), s->name, all);
    EXPECT_OK(gradacc_accumulator_destroy(whole));
    EXPECT_OK(gradacc_accumulator_destroy(hooked));
    EXPECT_OK(gradacc_accumulator_destroy(plain));
    EXPECT_OK(gradacc_scaler_destroy(scaler));
    EXPECT_OK(gradacc_comm_destroy(whole_comm));
    EXPECT_OK(gradacc_comm_destroy(hooked_comm));
    EXPECT_OK(gradacc_comm_destroy(plain_comm));
}

/* ---- seeds, exact ---------------------------------------------------------------------------- */

/* The last rank's first micro-batch holds an infinity. Rank r's gradients are 0.5 (r + 1) (fp16)
 * and 0.25 (r + 1) (bf16): a clean window of one micro-batch of 2 items per rank averages
 * (W + 1) / 4 and (W + 1) / 8. */
static void overflow_one_rank(void)
{
    enum { N0 = 20483, N1 = 301 };
    const int rank = world_rank(), world = world_size();
    gradacc_comm_t *comm = timed_comm_of(MPI_COMM_WORLD);
    gradacc_tensor_desc_t t[2] = {{N0, GRADACC_DTYPE_F16}, {N1, GRADACC_DTYPE_BF16}};
    gradacc_accumulator_config_t ac;
    REQUIRE_OK(gradacc_accumulator_config_default(&ac));
    ac.bucket_numel = 4096;
    gradacc_accumulator_t *acc = make_accumulate_acc(ac, t, 2, comm);
    gradacc_scaler_t *scaler = scaler_with_scale(1024.0f);
    uint16_t *h = malloc(N0 * sizeof(uint16_t)), b[N1];
    for (int step = 0; step < 2; step++) {
        float scale = 0.0f;
        REQUIRE_OK(gradacc_scaler_scale(scaler, &scale));
        for (int i = 0; i < N0; i++)
            h[i] = f32_to_f16_bits(0.5f * (float)(rank + 1) * scale);
        for (int i = 0; i < N1; i++)
            b[i] = f32_to_bf16_bits(0.25f * (float)(rank + 1) * scale);
        if (step == 0 && rank == world - 1)
            h[N0 - 7] = 0x7c00;
        const void *p[2] = {h, b};
        EXPECT_OK(gradacc_accumulator_add(acc, scaler, p, 2, 2));
        gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
        EXPECT_OK(gradacc_accumulator_sync(acc, comm, &info));
        bool skip = false;
        const gradacc_accumulator_t *accs[1] = {acc};
        EXPECT_OK(gradacc_scaler_update(scaler, accs, 1, &skip));
        float after = 0.0f;
        REQUIRE_OK(gradacc_scaler_scale(scaler, &after));
        CHECK(info.found_inf == (step == 0) && skip == (step == 0) && after == 512.0f &&
                  info.total_count == (uint64_t)(2 * world) && info.microbatches == (uint64_t)world,
              "overflow, step %d, rank %d: found_inf %d, skip %d, scale %g, count %llu, mb %llu", step, rank,
              (int)info.found_inf, (int)skip, (double)after, (unsigned long long)info.total_count,
              (unsigned long long)info.microbatches);
        CHECK(same_on_all_ranks(float_bits(after), MPI_COMM_WORLD), "overflow, step %d: the scales differ", step);
        if (step == 1) {
            check_shard_values(acc, t, 2, (const float[]){(float)(world + 1) / 4.0f, (float)(world + 1) / 8.0f},
                               "after the overflow");
        }
    }
    free(h);
    EXPECT_OK(gradacc_accumulator_destroy(acc));
    EXPECT_OK(gradacc_scaler_destroy(scaler));
    EXPECT_OK(gradacc_comm_destroy(comm));
}

/* Per-token mean losses with unequal token counts; two micro-batches, then three (through
 * add_tensor). Rank r's gradient per item is mean x (r + 1): both windows average to W + 1. */
static void unequal_counts(void)
{
    enum { N0 = 12289, N1 = 4097 };
    const int rank = world_rank(), world = world_size();
    gradacc_comm_t *comm = timed_comm_of(MPI_COMM_WORLD);
    gradacc_tensor_desc_t t[2] = {{N0, GRADACC_DTYPE_F32}, {N1, GRADACC_DTYPE_F16}};
    gradacc_accumulator_config_t ac;
    REQUIRE_OK(gradacc_accumulator_config_default(&ac));
    ac.bucket_numel = 4096;
    gradacc_accumulator_t *acc = make_accumulate_acc(ac, t, 2, comm);
    gradacc_scaler_t *scaler = scaler_with_scale(4.0f);
    static const struct {
        int n;
        uint64_t count[3];
        float mean[3];
    } windows[2] = {{2, {3, 1}, {1.0f, 5.0f}}, {3, {2, 2, 4}, {2.0f, 4.0f, 1.0f}}};
    float *g = malloc(N0 * sizeof(float));
    uint16_t *h = malloc(N1 * sizeof(uint16_t));
    for (int k = 0; k < 2; k++) {
        for (int m = 0; m < windows[k].n; m++) {
            float v = windows[k].mean[m] * (float)(rank + 1) * 4.0f;
            for (int i = 0; i < N0; i++)
                g[i] = v;
            for (int i = 0; i < N1; i++)
                h[i] = f32_to_f16_bits(v);
            if (k == 0) {
                const void *p[2] = {g, h};
                EXPECT_OK(gradacc_accumulator_add(acc, scaler, p, 2, windows[k].count[m]));
            } else {
                EXPECT_OK(gradacc_accumulator_begin_microbatch(acc, windows[k].count[m]));
                EXPECT_OK(gradacc_accumulator_add_tensor(acc, scaler, 1, h, N1));
                EXPECT_OK(gradacc_accumulator_add_tensor(acc, scaler, 0, g, N0));
                EXPECT_OK(gradacc_accumulator_end_microbatch(acc));
            }
        }
        gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
        EXPECT_OK(gradacc_accumulator_sync(acc, comm, &info));
        /* (3 * 1 + 1 * 5) W (W + 1) / 2 / (4 W) = W + 1; (2 * 2 + 2 * 4 + 4 * 1) W (W + 1) / 2 / (8 W) = W + 1 */
        const uint64_t items = (uint64_t)world * (k ? 8 : 4), mbs = (uint64_t)world * (uint64_t)windows[k].n;
        CHECK(!info.found_inf && info.total_count == items && info.microbatches == mbs,
              "unequal counts, window %d, rank %d: count %llu, mb %llu; expected %llu, %llu", k, rank,
              (unsigned long long)info.total_count, (unsigned long long)info.microbatches, (unsigned long long)items,
              (unsigned long long)mbs);
        check_shard_values(acc, t, 2, (const float[]){(float)(world + 1), (float)(world + 1)},
                           k ? "unequal counts, window 2" : "unequal counts, window 1");
    }
    free(g);
    free(h);
    EXPECT_OK(gradacc_accumulator_destroy(acc));
    EXPECT_OK(gradacc_scaler_destroy(scaler));
    EXPECT_OK(gradacc_comm_destroy(comm));
}

/* Sum losses normalised by micro-batches: two windows of 3, then a partial one of 1. Rank r's
 * micro-batch m is (m + 1)(r + 1) / 4: a full window averages (W + 1) / 4, the partial one
 * (W + 1) / 8. */
static void partial_final_window(void)
{
    enum { N0 = 30001, N1 = 33 };
    const int rank = world_rank(), world = world_size();
    gradacc_comm_t *comm = timed_comm_of(MPI_COMM_WORLD);
    gradacc_tensor_desc_t t[2] = {{N0, GRADACC_DTYPE_F16}, {N1, GRADACC_DTYPE_BF16}};
    gradacc_accumulator_config_t ac;
    REQUIRE_OK(gradacc_accumulator_config_default(&ac));
    ac.loss_reduction = GRADACC_LOSS_REDUCTION_SUM;
    ac.normalize = GRADACC_NORMALIZE_BY_MICROBATCHES;
    ac.bucket_numel = 10000;
    gradacc_accumulator_t *acc = make_accumulate_acc(ac, t, 2, comm);
    gradacc_scaler_t *scaler = scaler_with_scale(256.0f);
    uint16_t *h = malloc(N0 * sizeof(uint16_t)), b[N1];
    static const int mbs[3] = {3, 3, 1};
    for (int k = 0; k < 3; k++) {
        for (int m = 0; m < mbs[k]; m++) {
            float v = (float)((m + 1) * (rank + 1)) * 0.25f * 256.0f;
            for (int i = 0; i < N0; i++)
                h[i] = f32_to_f16_bits(v);
            for (int i = 0; i < N1; i++)
                b[i] = f32_to_bf16_bits(v);
            const void *p[2] = {h, b};
            EXPECT_OK(gradacc_accumulator_add(acc, scaler, p, 2, 5));
        }
        gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
        EXPECT_OK(gradacc_accumulator_sync(acc, comm, &info));
        CHECK(!info.found_inf && info.microbatches == (uint64_t)(world * mbs[k]) &&
                  info.total_count == (uint64_t)(5 * world * mbs[k]),
              "window %d, rank %d: count %llu, mb %llu; expected %d, %d", k, rank, (unsigned long long)info.total_count,
              (unsigned long long)info.microbatches, 5 * world * mbs[k], world * mbs[k]);
        const float v = (float)(world + 1) / (mbs[k] == 3 ? 4.0f : 8.0f);
        check_shard_values(acc, t, 2, (const float[]){v, v}, mbs[k] == 3 ? "full window" : "partial final window");
    }
    free(h);
    EXPECT_OK(gradacc_accumulator_destroy(acc));
    EXPECT_OK(gradacc_scaler_destroy(scaler));
    EXPECT_OK(gradacc_comm_destroy(comm));
}

/* ---- misuse ---------------------------------------------------------------------------------- */

static uint64_t shard_hash(gradacc_accumulator_t *acc)
{
    size_t off = 0, n = 0;
    float *data = NULL;
    REQUIRE_OK(gradacc_accumulator_shard(acc, &off, &n, &data));
    return bits_hash(data, n);
}

/* Rank r adds r + 1 everywhere, one item per micro-batch: W ranks, two micro-batches each,
 * average 2 (W + 1) W / 2 / (2 W) = (W + 1) / 2. */
static void misuse(void)
{
    enum { N0 = 9001, N1 = 11 };
    const int rank = world_rank(), world = world_size();
    gradacc_comm_t *comm = timed_comm_of(MPI_COMM_WORLD);
    gradacc_tensor_desc_t t[2] = {{N0, GRADACC_DTYPE_F16}, {N1, GRADACC_DTYPE_F32}};
    gradacc_accumulator_config_t ac;
    REQUIRE_OK(gradacc_accumulator_config_default(&ac));
    ac.bucket_numel = 4096;
    gradacc_accumulator_t *acc = make_accumulate_acc(ac, t, 2, comm);
    gradacc_scaler_t *scaler = scaler_with_scale(2.0f);
    uint16_t *h = malloc(N0 * sizeof(uint16_t));
    float f[N1];
    for (int i = 0; i < N0; i++)
        h[i] = f32_to_f16_bits(2.0f * (float)(rank + 1));
    for (int i = 0; i < N1; i++)
        f[i] = 2.0f * (float)(rank + 1);
    const void *p[2] = {h, f};
    const int last = world - 1;
    EXPECT_OK(gradacc_accumulator_add(acc, scaler, p, 2, 1));
    const uint64_t before = shard_hash(acc);

    /* The last rank adds a micro-batch of 0 items. */
    gradacc_status_t st = gradacc_accumulator_add(acc, scaler, p, 2, rank == last ? 0 : 1);
    CHECK(st == (rank == last ? GRADACC_STATUS_INVALID_ARGUMENT : GRADACC_STATUS_PEER_FAILURE),
          "an invalid add on rank %d, rank %d: status %d (%s): %s", last, rank, (int)st, gradacc_status_string(st),
          gradacc_last_error());
    CHECK(rank == last || strstr(gradacc_last_error(), "another rank"), "rank %d: the error should blame another rank: %s",
          rank, gradacc_last_error());
    CHECK(shard_hash(acc) == before, "rank %d: the failed add changed the shard", rank);

    /* Rank 0 at the boundary while the others add: every rank fails, nothing is reduced. */
    st = rank == 0 ? gradacc_accumulator_sync(acc, comm, NULL) : gradacc_accumulator_add(acc, scaler, p, 2, 1);
    CHECK(st == GRADACC_STATUS_SIZE_MISMATCH, "rank 0 at the boundary, the others adding, rank %d: status %d (%s): %s", rank,
          (int)st, gradacc_status_string(st), gradacc_last_error());
    CHECK(same_on_all_ranks((uint64_t)st, MPI_COMM_WORLD), "mismatched steps: the ranks' statuses differ");
    CHECK(shard_hash(acc) == before, "rank %d: the mismatched step changed the shard", rank);

    /* A second micro-batch, tensor by tensor. */
    EXPECT_OK(gradacc_accumulator_begin_microbatch(acc, 1));
    EXPECT_OK(gradacc_accumulator_add_tensor(acc, scaler, 1, f, N1));
    EXPECT_OK(gradacc_accumulator_add_tensor(acc, scaler, 0, h, N0));
    EXPECT_OK(gradacc_accumulator_end_microbatch(acc));

    /* Rank 0 names a foreign communicator at the boundary: every rank fails. */
    gradacc_comm_t *self = rank == 0 ? timed_comm_of(MPI_COMM_SELF) : NULL;
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    info.total_count = 12345;
    st = gradacc_accumulator_sync(acc, rank == 0 ? self : comm, &info);
    CHECK(st == (rank == 0 ? GRADACC_STATUS_INVALID_ARGUMENT : GRADACC_STATUS_PEER_FAILURE) && info.total_count == 12345,
          "a foreign communicator on rank 0, rank %d: status %d (%s), info %s: %s", rank, (int)st, gradacc_status_string(st),
          info.total_count == 12345 ? "untouched" : "written", gradacc_last_error());
    if (self)
        EXPECT_OK(gradacc_comm_destroy(self));

    /* The windows are intact. */
    EXPECT_OK(gradacc_accumulator_sync(acc, rank % 2 ? NULL : comm, &info));
    CHECK(!info.found_inf && info.total_count == (uint64_t)(2 * world) && info.microbatches == (uint64_t)(2 * world),
          "after the failures, rank %d: count %llu, mb %llu; expected %d, %d", rank, (unsigned long long)info.total_count,
          (unsigned long long)info.microbatches, 2 * world, 2 * world);
    const float half = (float)(world + 1) / 2.0f;
    check_shard_values(acc, t, 2, (const float[]){half, half}, "after the failures");

    /* Training goes on: one micro-batch of 3 items, (W + 1) / 2 again. */
    EXPECT_OK(gradacc_accumulator_add(acc, scaler, p, 2, 3));
    EXPECT_OK(gradacc_accumulator_sync(acc, comm, &info));
    CHECK(info.total_count == (uint64_t)(3 * world) && info.microbatches == (uint64_t)world,
          "the next window, rank %d: count %llu, mb %llu", rank, (unsigned long long)info.total_count,
          (unsigned long long)info.microbatches);
    check_shard_values(acc, t, 2, (const float[]){half, half}, "the window after the failures");

    /* A second contribution to a tensor on the last rank is refused (each tensor takes one per
     * micro-batch): the micro-batch fails on every rank when it ends, the windows discarded. */
    EXPECT_OK(gradacc_accumulator_begin_microbatch(acc, 1));
    EXPECT_OK(gradacc_accumulator_add_tensor(acc, scaler, 1, f, N1));
    if (rank == world - 1)
        EXPECT_ERROR(gradacc_accumulator_add_tensor(acc, scaler, 1, f, N1), GRADACC_STATUS_WRONG_STATE, "tensor 1");
    EXPECT_OK(gradacc_accumulator_add_tensor(acc, scaler, 0, h, N0));
    st = gradacc_accumulator_end_microbatch(acc);
    CHECK(st == (rank == world - 1 ? GRADACC_STATUS_WRONG_STATE : GRADACC_STATUS_PEER_FAILURE) &&
              strstr(gradacc_last_error(), "window was discarded"),
          "a refused contribution on the last rank, rank %d: status %d (%s): %s", rank, (int)st, gradacc_status_string(st),
          gradacc_last_error());
    EXPECT_STATUS(gradacc_accumulator_sync(acc, NULL, &info), GRADACC_STATUS_EMPTY_WINDOW);
    free(h);
    EXPECT_OK(gradacc_accumulator_destroy(acc));
    EXPECT_OK(gradacc_scaler_destroy(scaler));
    EXPECT_OK(gradacc_comm_destroy(comm));
}

/* ---- hybrid ---------------------------------------------------------------------------------- */

/* World rank a*S + i is rank i of shard group a and rank a of replica group i. */
static void hybrid(int S)
{
    const int rank = world_rank(), world = world_size(), R = world / S, a = rank / S, i = rank % S;
    const int sc = 1; /* by micro-batches, clipped */
    const scenario *s = &scenarios[sc];
    MPI_Comm shard_mpi, replica_mpi;
    MPI_Comm_split(MPI_COMM_WORLD, a, i, &shard_mpi);
    MPI_Comm_split(MPI_COMM_WORLD, i, a, &replica_mpi);
    gradacc_comm_t *shard = timed_comm_of(shard_mpi), *replica = timed_comm_of(replica_mpi);
    gradacc_comm_t *world_comm = timed_comm_of(MPI_COMM_WORLD);
    gradacc_tensor_desc_t t[T] = {desc(0), desc(1), desc(2)};
    char what[96];
    for (int step = 0; step < 2; step++) {
        const int mbs = window_microbatches[step];
        reference ref = make_reference(sc, 10 + step, mbs);
        const float max_norm = (float)(s->clip * ref.norm);
        const gradacc_accumulator_config_t ac = scenario_config(s, max_norm);
        gradacc_accumulator_t *acc = make_accumulate_acc(ac, t, T, shard), *plain = NULL;
        REQUIRE_OK(gradacc_accumulator_create(&ac, t, T, NULL, &plain));
        gradacc_scaler_t *scaler = scaler_with_scale((float)scale_of(rank));
        add_window(sc, 10 + step, mbs, scaler, acc, NULL, plain);
        gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT, pi = GRADACC_SYNC_INFO_INIT;
        gradacc_status_t st = gradacc_accumulator_sync_hybrid(acc, shard, replica, &info);
        EXPECT_OK(st);
        EXPECT_OK(gradacc_accumulator_sync(plain, world_comm, &pi));
        snprintf(what, sizeof what, "hybrid %d shards x %d replicas, window %d", S, R, step);
        if (st == GRADACC_STATUS_OK) {
            size_t po = 1, pn = 0;
            float *flat = NULL;
            REQUIRE_OK(gradacc_accumulator_shard(plain, &po, &pn, &flat));
            double d = check_against(what, s, &ref, max_norm, acc, &info, flat, &pi, shard_mpi, replica_mpi), all = 0.0;
            MPI_Allreduce(&d, &all, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
            if (rank == 0 && step == 1)
                printf("%d ranks, hybrid %d x %d: max |sharded - all-reduce| = %.2g of the summed magnitudes\n", world, S, R,
                       all);
        }
        EXPECT_OK(gradacc_accumulator_destroy(acc));
        EXPECT_OK(gradacc_accumulator_destroy(plain));
        EXPECT_OK(gradacc_scaler_destroy(scaler));
        free_reference(&ref);
    }
    EXPECT_OK(gradacc_comm_destroy(shard));
    EXPECT_OK(gradacc_comm_destroy(replica));
    EXPECT_OK(gradacc_comm_destroy(world_comm));
    MPI_Comm_free(&shard_mpi);
    MPI_Comm_free(&replica_mpi);
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    const int world = world_size();
    if (world > 64) {
        if (world_rank() == 0)
            fprintf(stderr, "sharded_accumulation: written for up to 64 processes, got %d\n", world);
        MPI_Finalize();
        return 77;
    }
    gradacc_tensor_desc_t layout[T];
    for (int t = 0; t < T; t++)
        layout[t] = (gradacc_tensor_desc_t){numel[t], dtypes[t]};
    check_placement(layout, T, offset, LEN);
    for (int sc = 0; sc < (int)(sizeof scenarios / sizeof scenarios[0]); sc++)
        training(sc);
    overflow_one_rank();
    unequal_counts();
    partial_final_window();
    misuse();
    for (int S = 1; S <= world; S++)
        if (world % S == 0)
            hybrid(S);
    if (world_rank() == 0)
        printf("%d ranks: sharded accumulation within tolerance of the all-reduce; seeds exact; misuse failed everywhere\n",
               world);
    return mpi_finish();
}
