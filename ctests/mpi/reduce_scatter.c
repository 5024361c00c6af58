/* mpi-np: 2 4 */
/* The seed scenarios over real MPI with GRADACC_SHARDING_REDUCE_SCATTER: each rank holds shard
 * `rank` of `world`, and beside it an unsharded accumulator gets the same micro-batches and syncs
 * on the same communicator (an all-reduce). After every boundary the shard must hold the bits of
 * the all-reduce's range, the infos must be the same bits on every rank, and the shards must tile
 * the layout in rank order (shard_common.h).
 *   apex O2:      Linear(1,1), input rank + 1, two micro-batches each; rank 0's shard holds the
 *                 whole 2-element model, each element padded to 64 (the others' shards are empty), and
 *                 the seed's right values with zeros between.
 *   overflow:     the last rank's fp16 gradient holds an infinity: every rank reports found_inf,
 *                 skips, and backs off to the same scale; the next step is clean.
 *   unequal work: rank r adds r micro-batches (rank 0 none) of r + m items, mean-reduced, BY_COUNT:
 *                 the gradient of the mean over every item, weighted by tokens.
 *   partial:      windows of 3 micro-batches per rank, then a final partial one where only the
 *                 lower half of the ranks adds one; BY_MICROBATCHES with clipping, three tensors
 *                 over several 64K-element pieces per shard, against an f64 reference. */
#include "mpi/shard_common.h"

static void apex_o2(gradacc_comm_t *comm, gradacc_normalize_t normalize, gradacc_dtype_t dtype)
{
    const int rank = world_rank(), world = world_size();
    gradacc_scaler_t *scaler = scaler_with_scale(1.0f);
    gradacc_tensor_desc_t t[2] = {{1, dtype}, {1, dtype}};
    gradacc_accumulator_t *sharded = make_shard_acc(t, 2, normalize, 0.0f, world, rank);
    gradacc_accumulator_t *plain = make_shard_acc(t, 2, normalize, 0.0f, 0, 0);
    const double grads[2] = {(double)(rank + 1), 1.0};
    grad_buf w = grad_alloc(dtype, 1), b = grad_alloc(dtype, 1);
    grad_encode(&w, &grads[0], 1.0, NULL);
    grad_encode(&b, &grads[1], 1.0, NULL);
    const void *g[2] = {w.data, b.data};
    for (int m = 0; m < 2; m++) {
        REQUIRE_OK(gradacc_accumulator_add(sharded, scaler, g, 2, 1));
        REQUIRE_OK(gradacc_accumulator_add(plain, scaler, g, 2, 1));
    }
    gradacc_sync_info_t si = GRADACC_SYNC_INFO_INIT, pi = GRADACC_SYNC_INFO_INIT;
    REQUIRE_OK(gradacc_accumulator_sync(sharded, comm, &si));
    REQUIRE_OK(gradacc_accumulator_sync(plain, comm, &pi));
    check_shard(sharded, plain, &si, &pi, 1, "apex O2");
    /* Σ_r 2 (r + 1) = world (world + 1); BY_WORLD divides by world, BY_MICROBATCHES by 2 world. */
    double want_w = normalize == GRADACC_NORMALIZE_BY_WORLD ? world + 1.0 : (world + 1.0) / 2;
    double want_b = normalize == GRADACC_NORMALIZE_BY_WORLD ? 2.0 : 1.0;
    size_t off = 9, n = 9;
    float *data = NULL;
    REQUIRE_OK(gradacc_accumulator_shard(sharded, &off, &n, &data));
    /* Each one-element tensor padded to 64 elements: the master is 128 long, all in shard 0. */
    if (rank == 0) {
        CHECK(off == 0 && n == 128 && data[0] == want_w && data[64] == want_b,
              "%s: rank 0's shard [%zu, +%zu) holds %g %g, expected [0, +128) with %g %g at 0 and 64",
              dtype_name(dtype), off, n, n ? (double)data[0] : 0.0, n > 64 ? (double)data[64] : 0.0, want_w, want_b);
        check_shard_values(sharded, t, 2, (const float[]){(float)want_w, (float)want_b}, "apex O2");
    } else {
        CHECK(off == 128 && n == 0, "rank %d: shard [%zu, +%zu), expected the empty [128, +0)", rank, off, n);
    }
    grad_free(&w);
    grad_free(&b);
    gradacc_accumulator_destroy(sharded);
    gradacc_accumulator_destroy(plain);
    gradacc_scaler_destroy(scaler);
}

/* Element i of tensor t of rank `rank`'s micro-batch `mb` of window `step`: magnitudes over
 * 2^-10..2^0, spread so that another summation order would change the bits. */
static double value(int step, int rank, int mb, int t, size_t i)
{
    uint64_t z = ((uint64_t)step << 52) ^ ((uint64_t)rank << 44) ^ ((uint64_t)mb << 36) ^ ((uint64_t)t << 30) ^ (uint64_t)i;
    test_rng r = {z * 0x9e3779b97f4a7c15ull + 3};
    return ldexp(rng_range(&r, -1.0, 1.0), -(int)rng_below(&r, 11));
}

static void overflow_one_rank(gradacc_comm_t *comm)
{
    enum { N = 5 * 4096 + 3 };
    const int rank = world_rank(), world = world_size();
    gradacc_scaler_t *s_sharded = scaler_with_scale(65536.0f), *s_plain = scaler_with_scale(65536.0f);
    gradacc_tensor_desc_t t[1] = {{N, GRADACC_DTYPE_F16}};
    gradacc_accumulator_t *sharded = make_shard_acc(t, 1, GRADACC_NORMALIZE_BY_COUNT, 0.0f, world, rank);
    gradacc_accumulator_t *plain = make_shard_acc(t, 1, GRADACC_NORMALIZE_BY_COUNT, 0.0f, 0, 0);
    grad_buf g = grad_alloc(GRADACC_DTYPE_F16, N);
    double *v = malloc(N * sizeof(double));
    for (int step = 0; step < 2; step++) {
        float before;
        REQUIRE_OK(gradacc_scaler_scale(s_sharded, &before));
        for (size_t i = 0; i < N; i++)
            v[i] = value(step, rank, 0, 0, i) * 1e-2;
        grad_encode(&g, v, before, NULL);
        if (step == 0 && rank == world - 1)
            grad_poke(&g, N - 7, 0x7c00, INFINITY);
        const void *p[1] = {g.data};
        REQUIRE_OK(gradacc_accumulator_add(sharded, s_sharded, p, 1, 2));
        REQUIRE_OK(gradacc_accumulator_add(plain, s_plain, p, 1, 2));
        gradacc_sync_info_t si = GRADACC_SYNC_INFO_INIT, pi = GRADACC_SYNC_INFO_INIT;
        REQUIRE_OK(gradacc_accumulator_sync(sharded, comm, &si));
        REQUIRE_OK(gradacc_accumulator_sync(plain, comm, &pi));
        CHECK(si.found_inf == (step == 0), "step %d rank %d: found_inf %d", step, rank, (int)si.found_inf);
        check_shard(sharded, plain, &si, &pi, step > 0, step ? "after the overflow" : "overflow");
        bool skip_sharded = false, skip_plain = false;
        const gradacc_accumulator_t *a1[1] = {sharded}, *a2[1] = {plain};
        EXPECT_OK(gradacc_scaler_update(s_sharded, a1, 1, &skip_sharded));
        EXPECT_OK(gradacc_scaler_update(s_plain, a2, 1, &skip_plain));
        CHECK(skip_sharded == (step == 0) && skip_plain == skip_sharded, "step %d rank %d: skip %d (all-reduce %d)", step,
              rank, (int)skip_sharded, (int)skip_plain);
        float after, after_plain;
        REQUIRE_OK(gradacc_scaler_scale(s_sharded, &after));
        REQUIRE_OK(gradacc_scaler_scale(s_plain, &after_plain));
        CHECK(after == (step == 0 ? before / 2 : before) && after == after_plain, "step %d: scale %g -> %g (all-reduce %g)",
              step, before, after, after_plain);
        CHECK(same_on_all_ranks(float_bits(after), MPI_COMM_WORLD), "step %d: scales differ across ranks", step);
    }
    free(v);
    grad_free(&g);
    gradacc_accumulator_destroy(sharded);
    gradacc_accumulator_destroy(plain);
    gradacc_scaler_destroy(s_sharded);
    gradacc_scaler_destroy(s_plain);
}

static void unequal_work(gradacc_comm_t *comm)
{
    enum { T = 2 };
    const int rank = world_rank(), world = world_size();
    static const size_t numel[T] = {3 * 4096 + 11, 2 * 4096 - 1};
    static const gradacc_dtype_t dtype[T] = {GRADACC_DTYPE_BF16, GRADACC_DTYPE_F16};
    gradacc_tensor_desc_t t[T] = {{numel[0], dtype[0]}, {numel[1], dtype[1]}};
    gradacc_scaler_t *scaler = scaler_with_scale(256.0f);
    gradacc_accumulator_t *sharded = make_shard_acc(t, T, GRADACC_NORMALIZE_BY_COUNT, 0.0f, world, rank);
    gradacc_accumulator_t *plain = make_shard_acc(t, T, GRADACC_NORMALIZE_BY_COUNT, 0.0f, 0, 0);
    grad_buf g[T] = {grad_alloc(dtype[0], numel[0]), grad_alloc(dtype[1], numel[1])};
    uint64_t items = 0;
    for (int r = 0; r < world; r++)
        for (int m = 0; m < r; m++) {
            items += (uint64_t)(r + m);
            if (r != rank)
                continue;
            for (int k = 0; k < T; k++) {
                double *v = malloc(numel[k] * sizeof(double));
                for (size_t i = 0; i < numel[k]; i++)
                    v[i] = value(0, r, m, k, i);
                grad_encode(&g[k], v, 256.0, NULL);
                free(v);
            }
            const void *p[T] = {g[0].data, g[1].data};
            REQUIRE_OK(gradacc_accumulator_add(sharded, scaler, p, T, (uint64_t)(r + m)));
            REQUIRE_OK(gradacc_accumulator_add(plain, scaler, p, T, (uint64_t)(r + m)));
        }
    gradacc_sync_info_t si = GRADACC_SYNC_INFO_INIT, pi = GRADACC_SYNC_INFO_INIT;
    REQUIRE_OK(gradacc_accumulator_sync(sharded, comm, &si));
    REQUIRE_OK(gradacc_accumulator_sync(plain, comm, &pi));
    CHECK(si.total_count == items && si.microbatches == (uint64_t)(world * (world - 1) / 2),
          "rank %d: total_count %llu, micro-batches %llu; expected %llu and %d", rank, (unsigned long long)si.total_count,
          (unsigned long long)si.microbatches, (unsigned long long)items, world * (world - 1) / 2);
    check_shard(sharded, plain, &si, &pi, 1, "unequal work");
    grad_free(&g[0]);
    grad_free(&g[1]);
    gradacc_accumulator_destroy(sharded);
    gradacc_accumulator_destroy(plain);
    gradacc_scaler_destroy(scaler);
}

static void partial_final_window(gradacc_comm_t *comm)
{
    enum { T = 3, WINDOWS = 3, MB = 3 };
    const int rank = world_rank(), world = world_size();
    static const size_t numel[T] = {300001, 17, 200003};
    static const gradacc_dtype_t dtype[T] = {GRADACC_DTYPE_F16, GRADACC_DTYPE_BF16, GRADACC_DTYPE_F32};
    /* Each tensor at a multiple of GRADACC_MASTER_ALIGN bytes, zeros between. */
    static const size_t offset[T] = {0, 300032, 300096};
    const size_t len = 500160;
    gradacc_tensor_desc_t t[T];
    grad_buf g[T];
    for (int k = 0; k < T; k++) {
        t[k].numel = numel[k];
        t[k].dtype = dtype[k];
        g[k] = grad_alloc(dtype[k], numel[k]);
    }
    check_placement(t, T, offset, len);
    const float max_norm = 5.0f; /* the windows' norms are 40 and more: clipping applies */
    gradacc_scaler_t *scaler = scaler_with_scale(1024.0f);
    gradacc_accumulator_t *sharded = make_shard_acc(t, T, GRADACC_NORMALIZE_BY_MICROBATCHES, max_norm, world, rank);
    gradacc_accumulator_t *plain = make_shard_acc(t, T, GRADACC_NORMALIZE_BY_MICROBATCHES, max_norm, 0, 0);
    double *ref = malloc(len * sizeof(double)), *mag = malloc(len * sizeof(double)), *v = malloc(len * sizeof(double));
    double *exact = malloc(len * sizeof(double));
    for (int step = 0; step < WINDOWS; step++) {
        const int final = step == WINDOWS - 1;
        memset(ref, 0, len * sizeof(double));
        memset(mag, 0, len * sizeof(double));
        uint64_t microbatches = 0;
        /* Every rank's micro-batches, replayed here in f64 for the reference. */
        for (int r = 0; r < world; r++) {
            int mbs = final ? (r < world / 2) : MB;
            for (int m = 0; m < mbs; m++, microbatches++) {
                for (int k = 0; k < T; k++) {
                    const size_t at = offset[k];
                    for (size_t i = 0; i < numel[k]; i++)
                        v[i] = value(step, r, m, k, i);
                    grad_encode(&g[k], v, 1024.0, exact);
                    for (size_t i = 0; i < numel[k]; i++) {
                        ref[at + i] += exact[i];
                        mag[at + i] += fabs(exact[i]);
                    }
                }
                if (r == rank) {
                    const void *p[T] = {g[0].data, g[1].data, g[2].data};
                    REQUIRE_OK(gradacc_accumulator_add(sharded, scaler, p, T, 1));
                    REQUIRE_OK(gradacc_accumulator_add(plain, scaler, p, T, 1));
                }
            }
        }
        gradacc_sync_info_t si = GRADACC_SYNC_INFO_INIT, pi = GRADACC_SYNC_INFO_INIT;
        REQUIRE_OK(gradacc_accumulator_sync(sharded, comm, &si));
        REQUIRE_OK(gradacc_accumulator_sync(plain, comm, &pi));
        char what[64];
        snprintf(what, sizeof what, "%s window %d", final ? "partial" : "full", step);
        CHECK(si.microbatches == microbatches, "%s: %llu micro-batches, expected %llu", what,
              (unsigned long long)si.microbatches, (unsigned long long)microbatches);
        check_shard(sharded, plain, &si, &pi, 1, what);

        double norm = 0.0;
        for (size_t i = 0; i < len; i++) {
            ref[i] /= (double)microbatches;
            norm += ref[i] * ref[i];
        }
        norm = sqrt(norm);
        double coef = fmin(1.0, max_norm / (norm + 1e-6));
        CHECK(coef < 1.0, "%s: clipping did not apply (norm %g)", what, norm);
        CHECK_CLOSE(si.grad_norm, norm, 1e-5 * norm, "%s: norm", what);
        CHECK_CLOSE(si.clip_coef, coef, 1e-5 * coef, "%s: clip coefficient", what);
        size_t off = 0, n = 0;
        float *data = NULL;
        REQUIRE_OK(gradacc_accumulator_shard(sharded, &off, &n, &data));
        int shown = 0;
        for (size_t i = 0; i < n; i++) {
            double want = ref[off + i] * coef, tol = 4e-6 * mag[off + i] / (double)microbatches * coef + 1e-30;
            if (!(fabs(data[i] - want) <= tol) && shown++ < 3)
                CHECK(0, "%s rank %d element %zu: %.9g, f64 reference %.9g (tol %.2g)", what, rank, off + i,
                      (double)data[i], want, tol);
        }
        CHECK(shown == 0, "%s rank %d: %d shard elements off the f64 reference", what, rank, shown);
    }
    free(ref);
    free(mag);
    free(v);
    free(exact);
    for (int k = 0; k < T; k++)
        grad_free(&g[k]);
    gradacc_accumulator_destroy(sharded);
    gradacc_accumulator_destroy(plain);
    gradacc_scaler_destroy(scaler);
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    gradacc_comm_t *comm = comm_of(MPI_COMM_WORLD);
    static const gradacc_dtype_t dtypes[3] = {GRADACC_DTYPE_F16, GRADACC_DTYPE_BF16, GRADACC_DTYPE_F32};
    for (int d = 0; d < 3; d++) {
        apex_o2(comm, GRADACC_NORMALIZE_BY_WORLD, dtypes[d]);
        apex_o2(comm, GRADACC_NORMALIZE_BY_MICROBATCHES, dtypes[d]);
    }
    overflow_one_rank(comm);
    unequal_work(comm);
    partial_final_window(comm);
    if (world_rank() == 0)
        printf("%d ranks: every shard holds the all-reduce's bits, infos agree\n", world_size());
    EXPECT_OK(gradacc_comm_destroy(comm));
    return mpi_finish();
}
