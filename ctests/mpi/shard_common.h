/* Helpers of the MPI sharding tests: the f64 reference of a window over the world's ranks, an
 * accumulator holding this rank's shard of the world (at the boundary, or accumulated), and the
 * check that a sharded boundary left the all-reduce's bits in the shard. */
#ifndef GRADACC_CTESTS_MPI_SHARD_COMMON_H
#define GRADACC_CTESTS_MPI_SHARD_COMMON_H

#include "mpi/mpi_common.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The f64 reference of one window over the world's ranks: the sum and the sum of magnitudes per
 * element, the divisor, the norm of the normalised gradient and of the magnitudes. */
typedef struct {
    double *sum, *magnitude, divisor, norm, spread; /* spread: the norm of the magnitudes, normalised */
    uint64_t items, microbatches;
} reference;

/* One rank's part of a window for `reference_of`: how many micro-batches rank `rank` adds, each
 * one's item count, and its values once unscaled (`len` elements, written to `exact`). */
typedef struct {
    int (*microbatches)(const void *ctx, int rank);
    uint64_t (*count)(int rank, int mb);
    void (*exact)(const void *ctx, int rank, int mb, double *exact);
    const void *ctx;
} window_of_ranks;

/* The reference of window `w` over `world` ranks and `len` elements, as the library normalises
 * it with `normalize` and `loss`. */
static inline reference reference_of(const window_of_ranks *w, size_t len, int world, gradacc_normalize_t normalize,
                                     gradacc_loss_reduction_t loss)
{
    reference ref;
    memset(&ref, 0, sizeof ref);
    ref.sum = calloc(len, sizeof(double));
    ref.magnitude = calloc(len, sizeof(double));
    double *exact = calloc(len, sizeof(double)); /* the padding between tensors stays 0 */
    for (int r = 0; r < world; r++)
        for (int m = 0; m < w->microbatches(w->ctx, r); m++) {
            w->exact(w->ctx, r, m, exact);
            double weight = loss == GRADACC_LOSS_REDUCTION_MEAN && normalize == GRADACC_NORMALIZE_BY_COUNT ? (double)w->count(r, m) : 1.0;
            for (size_t i = 0; i < len; i++) {
                ref.sum[i] += weight * exact[i];
                ref.magnitude[i] += fabs(weight * exact[i]);
            }
            ref.items += w->count(r, m);
            ref.microbatches++;
        }
    ref.divisor = normalize == GRADACC_NORMALIZE_BY_COUNT         ? (double)ref.items
                  : normalize == GRADACC_NORMALIZE_BY_MICROBATCHES ? (double)ref.microbatches
                  : normalize == GRADACC_NORMALIZE_BY_WORLD        ? (double)world
                                                                   : 1.0;
    for (size_t i = 0; i < len; i++) {
        ref.norm += (ref.sum[i] / ref.divisor) * (ref.sum[i] / ref.divisor);
        ref.spread += (ref.magnitude[i] / ref.divisor) * (ref.magnitude[i] / ref.divisor);
    }
    ref.norm = sqrt(ref.norm);
    ref.spread = sqrt(ref.spread);
    free(exact);
    return ref;
}

/* Checks that the `n` tensors `t` lie in the flat master at `offset` (each at a multiple of
 * GRADACC_MASTER_ALIGN bytes, as the header documents) and that it is `len` long: what the
 * tests' references are laid out by. */
static inline void check_placement(const gradacc_tensor_desc_t *t, size_t n, const size_t *offset, size_t len)
{
    const size_t align = GRADACC_MASTER_ALIGN / sizeof(float);
    size_t at = 0, numel = 0;
    for (size_t i = 0; i < n; i++) {
        CHECK(offset[i] == at, "tensor %zu is placed at %zu, the layout puts it at %zu", i, offset[i], at);
        at = (at + t[i].numel + align - 1) / align * align;
    }
    CHECK(len == at, "the master is taken as %zu elements, the layout has %zu", len, at);
    REQUIRE_OK(gradacc_accumulator_master_numel(t, n, &numel));
    CHECK(numel == len, "gradacc_accumulator_master_numel gives %zu, expected %zu", numel, len);
    gradacc_accumulator_t *acc = NULL;
    REQUIRE_OK(gradacc_accumulator_create(NULL, t, n, NULL, &acc));
    for (size_t i = 0; i < n; i++) {
        size_t got = 0;
        REQUIRE_OK(gradacc_accumulator_offset(acc, i, &got));
        CHECK(got == offset[i], "gradacc_accumulator_offset gives tensor %zu at %zu, expected %zu", i, got, offset[i]);
    }
    REQUIRE_OK(gradacc_accumulator_destroy(acc));
}

/* Every element of this rank's shard of `acc` (over the `n` tensors `t`) inside tensor i holds
 * want[i]; every element of the padding between tensors (gradacc_accumulator_offset) holds +0. */
static inline void check_shard_values(gradacc_accumulator_t *acc, const gradacc_tensor_desc_t *t, size_t n,
                                      const float *want, const char *what)
{
    size_t off = 0, len = 0, start[8];
    float *data = NULL, expected = 0.0f;
    REQUIRE_OK(gradacc_accumulator_shard(acc, &off, &len, &data));
    for (size_t i = 0; i < n && i < 8; i++)
        REQUIRE_OK(gradacc_accumulator_offset(acc, i, &start[i]));
    size_t bad = 0, first = 0;
    for (size_t k = 0; k < len; k++) {
        float w = 0.0f;
        for (size_t i = 0; i < n && i < 8; i++)
            if (off + k >= start[i] && off + k < start[i] + t[i].numel)
                w = want[i];
        if (float_bits(data[k]) != float_bits(w) && !bad++) {
            first = k;
            expected = w;
        }
    }
    CHECK(bad == 0, "%s rank %d: %zu of the %zu shard elements differ, first at %zu: %.9g, expected %.9g", what, world_rank(),
          bad, len, off + first, bad ? (double)data[first] : 0.0, (double)expected);
}

static inline void free_reference(reference *ref)
{
    free(ref->sum);
    free(ref->magnitude);
}

/* An accumulator over `n` tensors; `shards` 0 means unsharded, otherwise shard `rank` of `shards`. */
static inline gradacc_accumulator_t *make_shard_acc(const gradacc_tensor_desc_t *t, size_t n, gradacc_normalize_t normalize,
                                                    float max_grad_norm, int shards, int rank)
{
    gradacc_accumulator_config_t ac;
    REQUIRE_OK(gradacc_accumulator_config_default(&ac));
    ac.normalize = normalize;
    ac.max_grad_norm = max_grad_norm;
    if (shards) {
        ac.sharding = GRADACC_SHARDING_REDUCE_SCATTER;
        ac.shard_count = (uint32_t)shards;
        ac.shard_rank = (uint32_t)rank;
    }
    gradacc_accumulator_t *a = NULL;
    REQUIRE_OK(gradacc_accumulator_create(&ac, t, n, NULL, &a));
    return a;
}

/* Sharded accumulation (GRADACC_SHARDING_ACCUMULATE) with `ac`'s other settings: this rank's
 * shard of `comm`'s ranks, reduced over `comm` every micro-batch. */
static inline gradacc_accumulator_t *make_accumulate_acc(gradacc_accumulator_config_t ac, const gradacc_tensor_desc_t *t,
                                                         size_t n, gradacc_comm_t *comm)
{
    int32_t rank = -1, size = -1;
    REQUIRE_OK(gradacc_comm_rank(comm, &rank));
    REQUIRE_OK(gradacc_comm_world_size(comm, &size));
    ac.sharding = GRADACC_SHARDING_ACCUMULATE;
    ac.shard_count = (uint32_t)size;
    ac.shard_rank = (uint32_t)rank;
    gradacc_accumulator_t *a = NULL;
    REQUIRE_OK(gradacc_accumulator_create_sharded(&ac, t, n, NULL, comm, &a));
    return a;
}

static inline uint64_t double_bits(double x)
{
    uint64_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static inline int same_info(const gradacc_sync_info_t *a, const gradacc_sync_info_t *b)
{
    return a->found_inf == b->found_inf && a->total_count == b->total_count && a->microbatches == b->microbatches &&
           double_bits(a->grad_norm) == double_bits(b->grad_norm) && double_bits(a->clip_coef) == double_bits(b->clip_coef);
}

/* After `sharded` (shard world_rank() of world_size()) and `plain` (unsharded), holding the same
 * window, synced on MPI_COMM_WORLD with infos `si` and `pi`: the infos are the same bits, on
 * every rank; the shards tile the master in rank order; and this rank's shard holds the bits of
 * the same range of the all-reduced master (not compared when `values` is 0: an overflow). */
static inline void check_shard(gradacc_accumulator_t *sharded, gradacc_accumulator_t *plain, const gradacc_sync_info_t *si,
                               const gradacc_sync_info_t *pi, int values, const char *what)
{
    const int rank = world_rank(), world = world_size();
    CHECK(same_info(si, pi), "%s rank %d: sharded info {inf %d count %llu mb %llu norm %.17g clip %.17g}, all-reduce "
                             "{inf %d count %llu mb %llu norm %.17g clip %.17g}",
          what, rank, (int)si->found_inf, (unsigned long long)si->total_count, (unsigned long long)si->microbatches,
          si->grad_norm, si->clip_coef, (int)pi->found_inf, (unsigned long long)pi->total_count,
          (unsigned long long)pi->microbatches, pi->grad_norm, pi->clip_coef);
    CHECK(same_on_all_ranks(double_bits(si->grad_norm), MPI_COMM_WORLD) &&
              same_on_all_ranks(double_bits(si->clip_coef), MPI_COMM_WORLD) &&
              same_on_all_ranks(si->total_count, MPI_COMM_WORLD) && same_on_all_ranks(si->found_inf, MPI_COMM_WORLD),
          "%s: the sharded infos differ between ranks", what);

    size_t off = 0, n = 0, flat_off = 1, len = 0;
    float *data = NULL, *flat = NULL;
    REQUIRE_OK(gradacc_accumulator_shard(sharded, &off, &n, &data));
    REQUIRE_OK(gradacc_accumulator_shard(plain, &flat_off, &len, &flat));
    CHECK(flat_off == 0, "%s: the unsharded accumulator's shard starts at %zu", what, flat_off);
    unsigned long long mine[2] = {off, n}, all[2 * 64];
    if (world <= 64) {
        MPI_Allgather(mine, 2, MPI_UNSIGNED_LONG_LONG, all, 2, MPI_UNSIGNED_LONG_LONG, MPI_COMM_WORLD);
        unsigned long long next = 0;
        for (int r = 0; r < world; r++) {
            CHECK(all[2 * r] == next, "%s: rank %d's shard starts at %llu, the previous one ends at %llu", what, r,
                  all[2 * r], next);
            next = all[2 * r] + all[2 * r + 1];
        }
        CHECK(next == len, "%s: the shards end at %llu of %zu", what, next, len);
    }
    if (!values || off + n > len)
        return;
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < n; i++)
        if (float_bits(data[i]) != float_bits(flat[off + i]) && !bad++)
            first = i;
    CHECK(bad == 0, "%s rank %d: %zu of %zu shard elements differ from the all-reduce, first at %zu: %.9g vs %.9g", what,
          rank, bad, n, off + first, (double)data[first], (double)flat[off + first]);
}

#endif
