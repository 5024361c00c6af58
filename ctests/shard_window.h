/* Helpers of the in-process sharding tests (api_shard, api_hybrid, api_sharded): random layouts
 * of odd-sized f16 / bf16 / f32 tensors, windows of random micro-batches per rank with their f64
 * reference, and the shard cut the header documents. */
#ifndef GRADACC_CTESTS_SHARD_WINDOW_H
#define GRADACC_CTESTS_SHARD_WINDOW_H

#include "common.h"

/* WINDOW_RANKS: the most ranks a window holds (the largest grid of api_hybrid, 3 x 3). */
enum { BLOCK = 4096, MAX_TENSORS = 6, MAX_MB = 3, WINDOW_RANKS = 9 };

typedef struct {
    const char *name;
    size_t tensors;
    gradacc_tensor_desc_t desc[MAX_TENSORS];
    size_t len;                 /* elements of the flat master, the padding included */
    size_t offset[MAX_TENSORS]; /* where each tensor starts in it (layout_place) */
} layout;

/* Places `l`'s tensors in the flat master as the header documents it: each at a multiple of
 * GRADACC_MASTER_ALIGN bytes, zeros between (and after the last, up to an aligned end); and
 * checks that gradacc_accumulator_master_numel and gradacc_accumulator_offset agree. */
static inline void layout_place(layout *l)
{
    const size_t align = GRADACC_MASTER_ALIGN / sizeof(float);
    size_t at = 0;
    for (size_t t = 0; t < l->tensors; t++) {
        l->offset[t] = at;
        at = (at + l->desc[t].numel + align - 1) / align * align;
    }
    l->len = at;
    size_t numel = 777;
    REQUIRE_OK(gradacc_accumulator_master_numel(l->desc, l->tensors, &numel));
    CHECK(numel == l->len, "%s: gradacc_accumulator_master_numel gives %zu, expected %zu", l->name, numel, l->len);
    gradacc_accumulator_t *acc = NULL;
    REQUIRE_OK(gradacc_accumulator_create(NULL, l->desc, l->tensors, NULL, &acc));
    for (size_t t = 0; t < l->tensors; t++) {
        size_t off = 777;
        REQUIRE_OK(gradacc_accumulator_offset(acc, t, &off));
        CHECK(off == l->offset[t], "%s: tensor %zu at %zu, expected %zu", l->name, t, off, l->offset[t]);
    }
    gradacc_accumulator_destroy(acc);
}

typedef struct {
    gradacc_normalize_t normalize;
    gradacc_loss_reduction_t loss;
    int clip;
    gradacc_dtype_t wire;
} setup;

/* One rank's micro-batches of one window. */
typedef struct {
    int microbatches;
    uint64_t count[MAX_MB];
    grad_buf g[MAX_MB][MAX_TENSORS];
    int by_tensor; /* through begin_microbatch / add_tensor (in reverse order) / end_microbatch */
} rank_window;

/* One window of every rank, and its f64 reference. */
typedef struct {
    rank_window rank[WINDOW_RANKS];
    int overflow;
    double *sum, *magnitude; /* sum and sum of |.| of the weighted, unscaled contributions */
    double divisor;
    uint64_t items, microbatches;
} window;

static inline uint64_t dbits(double x)
{
    uint64_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static inline int same_info(const gradacc_sync_info_t *a, const gradacc_sync_info_t *b)
{
    return a->found_inf == b->found_inf && a->total_count == b->total_count && a->microbatches == b->microbatches &&
           dbits(a->grad_norm) == dbits(b->grad_norm) && dbits(a->clip_coef) == dbits(b->clip_coef);
}

static inline void add_window(gradacc_accumulator_t *acc, gradacc_scaler_t *scaler, const layout *l, const rank_window *w)
{
    for (int m = 0; m < w->microbatches; m++) {
        if (w->by_tensor) {
            REQUIRE_OK(gradacc_accumulator_begin_microbatch(acc, w->count[m]));
            for (size_t t = l->tensors; t-- > 0;)
                REQUIRE_OK(gradacc_accumulator_add_tensor(acc, scaler, t, w->g[m][t].data, w->g[m][t].n));
            REQUIRE_OK(gradacc_accumulator_end_microbatch(acc));
        } else {
            const void *p[MAX_TENSORS];
            for (size_t t = 0; t < l->tensors; t++)
                p[t] = w->g[m][t].data;
            REQUIRE_OK(gradacc_accumulator_add(acc, scaler, p, l->tensors, w->count[m]));
        }
    }
}

/* The configuration of `s`, unsharded. */
static inline gradacc_accumulator_config_t setup_config(const setup *s, float max_norm)
{
    gradacc_accumulator_config_t ac;
    REQUIRE_OK(gradacc_accumulator_config_default(&ac));
    ac.normalize = s->normalize;
    ac.loss_reduction = s->loss;
    ac.max_grad_norm = max_norm;
    ac.wire_dtype = s->wire;
    ac.bucket_numel = 5000; /* several buckets, edges inside blocks */
    return ac;
}

/* An accumulator over `l`; `shards` 0 means unsharded, otherwise shard `rank` of `shards`. */
static inline gradacc_accumulator_t *make_acc(const layout *l, const setup *s, float max_norm, int shards, int rank)
{
    gradacc_accumulator_config_t ac = setup_config(s, max_norm);
    if (shards) {
        ac.sharding = GRADACC_SHARDING_REDUCE_SCATTER;
        ac.shard_count = (uint32_t)shards;
        ac.shard_rank = (uint32_t)rank;
    }
    gradacc_accumulator_t *a = NULL;
    REQUIRE_OK(gradacc_accumulator_create(&ac, l->desc, l->tensors, NULL, &a));
    return a;
}

/* Fills one window of `ranks` ranks with random micro-batches; rank r's loss scale is 2^(8 + r).
 * `microbatches` 0 to MAX_MB gives every rank that many (as sharded accumulation needs: every rank
 * makes the same calls); -1 draws each rank's number (some ranks may add none). */
static inline void make_window_of(test_rng *rng, const layout *l, const setup *s, int ranks, int overflow, int microbatches,
                                  window *w)
{
    memset(w, 0, sizeof *w);
    w->sum = calloc(l->len, sizeof(double));
    w->magnitude = calloc(l->len, sizeof(double));
    double *v = malloc(l->len * sizeof(double)), *exact = malloc(l->len * sizeof(double));
    for (int r = 0; r < ranks; r++) {
        rank_window *rw = &w->rank[r];
        rw->microbatches = (int)rng_below(rng, MAX_MB + 1);
        if (microbatches >= 0)
            rw->microbatches = microbatches;
        else if (r == ranks - 1 && w->microbatches == 0 && rw->microbatches == 0)
            rw->microbatches = 1; /* some rank adds something */
        rw->by_tensor = (int)rng_below(rng, 2);
        double scale = ldexp(1.0, 8 + r);
        for (int m = 0; m < rw->microbatches; m++) {
            rw->count[m] = 1 + rng_below(rng, 9);
            double weight = s->loss == GRADACC_LOSS_REDUCTION_MEAN && s->normalize == GRADACC_NORMALIZE_BY_COUNT
                                ? (double)rw->count[m]
                                : 1.0;
            w->items += rw->count[m];
            w->microbatches++;
            for (size_t t = 0; t < l->tensors; t++) {
                size_t n = l->desc[t].numel, at = l->offset[t];
                rw->g[m][t] = grad_alloc(l->desc[t].dtype, n);
                for (size_t i = 0; i < n; i++)
                    v[i] = ldexp(rng_range(rng, -1.0, 1.0), -(int)rng_below(rng, 9));
                grad_encode(&rw->g[m][t], v, scale, exact);
                for (size_t i = 0; i < n; i++) {
                    w->sum[at + i] += weight * exact[i];
                    w->magnitude[at + i] += fabs(weight * exact[i]);
                }
            }
        }
    }
    if (overflow) {
        int r = (int)rng_below(rng, (uint32_t)ranks);
        while (w->rank[r].microbatches == 0)
            r = (r + 1) % ranks;
        size_t t = rng_below(rng, (uint32_t)l->tensors);
        grad_poke(&w->rank[r].g[0][t], rng_below(rng, (uint32_t)l->desc[t].numel),
                  l->desc[t].dtype == GRADACC_DTYPE_BF16 ? 0x7f80 : 0x7c00, INFINITY);
    }
    w->overflow = overflow;
    w->divisor = s->normalize == GRADACC_NORMALIZE_BY_COUNT         ? (double)w->items
                 : s->normalize == GRADACC_NORMALIZE_BY_MICROBATCHES ? (double)w->microbatches
                 : s->normalize == GRADACC_NORMALIZE_BY_WORLD        ? (double)ranks
                                                                     : 1.0;
    free(v);
    free(exact);
}

static inline void make_window(test_rng *rng, const layout *l, const setup *s, int ranks, int overflow, window *w)
{
    make_window_of(rng, l, s, ranks, overflow, -1, w);
}

static inline void free_window(window *w, const layout *l, int ranks)
{
    for (int r = 0; r < ranks; r++)
        for (int m = 0; m < w->rank[r].microbatches; m++)
            for (size_t t = 0; t < l->tensors; t++)
                grad_free(&w->rank[r].g[m][t]);
    free(w->sum);
    free(w->magnitude);
}

/* The f64 reference's norm of the normalised gradient. */
static inline double reference_norm(const window *w, size_t len)
{
    double s = 0.0;
    for (size_t i = 0; i < len; i++)
        s += (w->sum[i] / w->divisor) * (w->sum[i] / w->divisor);
    return sqrt(s);
}

/* The shard of rank `rank` of `ranks` over `len` elements, as the header documents it. */
static inline void expected_shard(size_t len, int ranks, int rank, size_t *offset, size_t *numel)
{
    size_t size = (len + (size_t)ranks - 1) / (size_t)ranks;
    size = (size + BLOCK - 1) / BLOCK * BLOCK;
    size_t lo = (size_t)rank * size, hi = lo + size;
    *offset = lo < len ? lo : len;
    *numel = (hi < len ? hi : len) - *offset;
}

/* A random layout: `small` is less than one block; otherwise up to 6 tensors of 1..12000 elements. */
static inline layout random_layout(test_rng *rng, int small)
{
    static const gradacc_dtype_t dtypes[3] = {GRADACC_DTYPE_F16, GRADACC_DTYPE_BF16, GRADACC_DTYPE_F32};
    layout l;
    memset(&l, 0, sizeof l);
    l.name = small ? "small" : "odd tensors";
    l.tensors = small ? 1 + rng_below(rng, 3) : 2 + rng_below(rng, MAX_TENSORS - 1);
    for (size_t t = 0; t < l.tensors; t++) {
        l.desc[t].numel = small ? 1 + rng_below(rng, 1300) : 1 + rng_below(rng, 12000);
        l.desc[t].numel |= 1; /* odd */
        l.desc[t].dtype = dtypes[rng_below(rng, 3)];
    }
    layout_place(&l);
    return l;
}

static inline const char *normalize_name(gradacc_normalize_t n)
{
    return n == GRADACC_NORMALIZE_BY_COUNT ? "by count"
           : n == GRADACC_NORMALIZE_BY_MICROBATCHES ? "by micro-batches"
           : n == GRADACC_NORMALIZE_BY_WORLD ? "by world"
                                             : "none";
}

#endif
