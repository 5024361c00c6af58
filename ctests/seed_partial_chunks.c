/* Seed partial-accumulation-ddp.md (bug B7): gradient accumulation over only part of a model, in
 * chunks, inside its own forward. A two-layer model x -> h = W1 x -> y = W2 h + b2 with loss
 * mean 0.5 |y - t|^2. The head (W2, b2) is the memory-hungry sub-model: its backward runs in 10
 * chunks of the batch, each adding its partial gradient with gradacc_accumulator_add_tensor inside
 * one micro-batch of accumulator `head`; the rest (W1) goes to accumulator `body` with
 * gradacc_accumulator_add. Two micro-batches per window. The result equals the unchunked full-batch
 * gradient (f64 reference).
 * Second part: add_tensor from 4 threads on distinct tensors gives bitwise the serial result. */
#include "common.h"

enum { D = 6, H = 4, V = 3, BATCH = 20, CHUNKS = 10, PER = BATCH / CHUNKS, MB = 2 };
enum { NW1 = H * D, NW2 = V * H, NB2 = V };

typedef struct {
    double W1[NW1], W2[NW2], b2[NB2];
    double x[MB][BATCH][D], t[MB][BATCH][V];
} problem;

/* Gradients of the mean loss over `BATCH` items, restricted to items [lo, hi) (so the chunks' parts
 * add up to the full-batch gradient). */
static void grads(const problem *p, int mb, int lo, int hi, double *gW1, double *gW2, double *gb2)
{
    memset(gW1, 0, NW1 * sizeof(double));
    memset(gW2, 0, NW2 * sizeof(double));
    memset(gb2, 0, NB2 * sizeof(double));
    for (int i = lo; i < hi; i++) {
        const double *x = p->x[mb][i];
        double h[H], r[V];
        for (int a = 0; a < H; a++) {
            h[a] = 0.0;
            for (int j = 0; j < D; j++)
                h[a] += p->W1[a * D + j] * x[j];
        }
        for (int o = 0; o < V; o++) {
            r[o] = p->b2[o] - p->t[mb][i][o];
            for (int a = 0; a < H; a++)
                r[o] += p->W2[o * H + a] * h[a];
        }
        for (int o = 0; o < V; o++) {
            for (int a = 0; a < H; a++)
                gW2[o * H + a] += r[o] * h[a] / BATCH;
            gb2[o] += r[o] / BATCH;
        }
        for (int a = 0; a < H; a++) {
            double dh = 0.0;
            for (int o = 0; o < V; o++)
                dh += p->W2[o * H + a] * r[o];
            for (int j = 0; j < D; j++)
                gW1[a * D + j] += dh * x[j] / BATCH;
        }
    }
}

static void check_tensor(const char *what, gradacc_accumulator_t *acc, size_t index, size_t n, gradacc_dtype_t dtype,
                         const double *truth, const double *from_inputs, const double *magnitude, double scale)
{
    double got[64];
    read_master(acc, index, got, n);
    int bad = 0;
    for (size_t k = 0; k < n && bad < 5; k++) {
        /* recursive f32 summation of CHUNKS * MB terms, a multiply each, and the final division */
        double tight = (CHUNKS * MB + 3) * ldexp(1.0, -24) * magnitude[k] + 1e-30;
        double loose = tight + dtype_half_ulp(dtype) * magnitude[k] + CHUNKS * MB * ldexp(1.0, -25) / scale;
        int ok = fabs(got[k] - from_inputs[k]) <= tight && fabs(got[k] - truth[k]) <= loose;
        CHECK(ok, "%s (%s) element %zu: got %.9g, from the given values %.9g (tol %.2g), unchunked f64 %.9g (tol %.2g)",
              what, dtype_name(dtype), k, got[k], from_inputs[k], tight, truth[k], loose);
        bad += !ok;
    }
}

static void test_chunked(const problem *p, gradacc_dtype_t d_w1, gradacc_dtype_t d_w2, gradacc_dtype_t d_b2)
{
    const float scale = 1024.0f;
    gradacc_scaler_t *scaler = scaler_with_scale(scale);
    gradacc_tensor_desc_t th[2] = {{NW2, d_w2}, {NB2, d_b2}};
    gradacc_tensor_desc_t tb = {NW1, d_w1};
    gradacc_accumulator_t *head = NULL, *body = NULL;
    REQUIRE_OK(gradacc_accumulator_create(NULL, th, 2, NULL, &head)); /* MEAN, BY_COUNT */
    REQUIRE_OK(gradacc_accumulator_create(NULL, &tb, 1, NULL, &body));

    double truth_w1[NW1] = {0}, truth_w2[NW2] = {0}, truth_b2[NB2] = {0};
    double in_w1[NW1] = {0}, in_w2[NW2] = {0}, in_b2[NB2] = {0};
    double mag_w1[NW1] = {0}, mag_w2[NW2] = {0}, mag_b2[NB2] = {0};
    grad_buf gw1 = grad_alloc(d_w1, NW1), gw2 = grad_alloc(d_w2, NW2), gb2 = grad_alloc(d_b2, NB2);
    for (int mb = 0; mb < MB; mb++) {
        double w1[NW1], w2[NW2], b2[NB2], e[NW1];
        /* the unchunked reference: mean over both micro-batches of each full-batch gradient */
        grads(p, mb, 0, BATCH, w1, w2, b2);
        for (int k = 0; k < NW1; k++)
            truth_w1[k] += w1[k] / MB;
        for (int k = 0; k < NW2; k++)
            truth_w2[k] += w2[k] / MB;
        for (int k = 0; k < NB2; k++)
            truth_b2[k] += b2[k] / MB;
        /* the body: one add per micro-batch (count BATCH: weighted by BATCH / (MB * BATCH)) */
        grad_encode(&gw1, w1, scale, e);
        for (int k = 0; k < NW1; k++) {
            in_w1[k] += e[k] / MB;
            mag_w1[k] += fabs(e[k]) / MB;
        }
        const void *g1[1] = {gw1.data};
        REQUIRE_OK(gradacc_accumulator_add(body, scaler, g1, 1, BATCH));
        /* the head: CHUNKS partial gradients per tensor inside one micro-batch */
        REQUIRE_OK(gradacc_accumulator_begin_microbatch(head, BATCH));
        for (int c = 0; c < CHUNKS; c++) {
            grads(p, mb, c * PER, (c + 1) * PER, w1, w2, b2);
            grad_encode(&gw2, w2, scale, e);
            for (int k = 0; k < NW2; k++) {
                in_w2[k] += e[k] / MB;
                mag_w2[k] += fabs(e[k]) / MB;
            }
            EXPECT_OK(gradacc_accumulator_add_tensor(head, scaler, 0, gw2.data, NW2));
            grad_encode(&gb2, b2, scale, e);
            for (int k = 0; k < NB2; k++) {
                in_b2[k] += e[k] / MB;
                mag_b2[k] += fabs(e[k]) / MB;
            }
            EXPECT_OK(gradacc_accumulator_add_tensor(head, scaler, 1, gb2.data, NB2));
        }
        REQUIRE_OK(gradacc_accumulator_end_microbatch(head));
    }
    gradacc_sync_info_t ih = GRADACC_SYNC_INFO_INIT, ib = GRADACC_SYNC_INFO_INIT;
    REQUIRE_OK(gradacc_accumulator_sync(head, NULL, &ih));
    REQUIRE_OK(gradacc_accumulator_sync(body, NULL, &ib));
    CHECK(ih.total_count == MB * BATCH && ih.microbatches == MB && !ih.found_inf, "head: count %llu micro-batches %llu",
          (unsigned long long)ih.total_count, (unsigned long long)ih.microbatches);
    CHECK(ib.total_count == MB * BATCH && ib.microbatches == MB && !ib.found_inf, "body sync info");
    const gradacc_accumulator_t *both[2] = {head, body};
    bool skipped = true;
    EXPECT_OK(gradacc_scaler_update(scaler, both, 2, &skipped));
    CHECK(!skipped, "skipped");
    check_tensor("W2 (chunked)", head, 0, NW2, d_w2, truth_w2, in_w2, mag_w2, scale);
    check_tensor("b2 (chunked)", head, 1, NB2, d_b2, truth_b2, in_b2, mag_b2, scale);
    check_tensor("W1 (whole)", body, 0, NW1, d_w1, truth_w1, in_w1, mag_w1, scale);
    grad_free(&gw1);
    grad_free(&gw2);
    grad_free(&gb2);
    gradacc_accumulator_destroy(head);
    gradacc_accumulator_destroy(body);
    gradacc_scaler_destroy(scaler);
}

/* ---- concurrency ---------------------------------------------------------------------------- */

enum { NT = 8, THREADS = 4, PARTS = 3 };
static const size_t sizes[NT] = {1000, 600001, 17, 4096, 70000, 1, 530000, 999};
static const gradacc_dtype_t kinds[NT] = {GRADACC_DTYPE_F16,  GRADACC_DTYPE_F16, GRADACC_DTYPE_BF16, GRADACC_DTYPE_F32,
                                          GRADACC_DTYPE_BF16, GRADACC_DTYPE_F32, GRADACC_DTYPE_F32,  GRADACC_DTYPE_F16};
static grad_buf contrib[NT][PARTS];

typedef struct {
    gradacc_accumulator_t *acc;
    gradacc_scaler_t *scaler;
    int thread;
    pthread_barrier_t *start;
} worker_args;

static void *worker(void *arg)
{
    worker_args *w = arg;
    pthread_barrier_wait(w->start);
    for (int t = w->thread; t < NT; t += THREADS)
        for (int c = 0; c < PARTS; c++)
            EXPECT_OK(gradacc_accumulator_add_tensor(w->acc, w->scaler, (size_t)t, contrib[t][c].data, sizes[t]));
    return NULL;
}

static void test_threads(test_rng *rng)
{
    gradacc_scaler_t *scaler = scaler_with_scale(512);
    gradacc_tensor_desc_t t[NT];
    for (int i = 0; i < NT; i++) {
        t[i].numel = sizes[i];
        t[i].dtype = kinds[i];
    }
    gradacc_accumulator_config_t serial_cfg, parallel_cfg;
    REQUIRE_OK(gradacc_accumulator_config_default(&serial_cfg));
    parallel_cfg = serial_cfg;
    parallel_cfg.threads = 3; /* kernels split over threads too: results must not depend on it */
    gradacc_accumulator_t *serial = NULL, *parallel = NULL;
    REQUIRE_OK(gradacc_accumulator_create(&serial_cfg, t, NT, NULL, &serial));
    REQUIRE_OK(gradacc_accumulator_create(&parallel_cfg, t, NT, NULL, &parallel));
    double *vals = malloc(600001 * sizeof(double));
    if (!vals)
        exit(1);
    for (int window = 0; window < 3; window++) {
        for (int i = 0; i < NT; i++)
            for (int c = 0; c < PARTS; c++) {
                for (size_t k = 0; k < sizes[i]; k++)
                    vals[k] = rng_range(rng, -1, 1) * ldexp(1.0, (int)rng_below(rng, 12) - 8);
                if (window == 0)
                    contrib[i][c] = grad_alloc(kinds[i], sizes[i]);
                grad_encode(&contrib[i][c], vals, 512.0, NULL);
            }
        uint64_t count = 5 + (uint64_t)window;
        for (int mb = 0; mb < 2; mb++) {
            REQUIRE_OK(gradacc_accumulator_begin_microbatch(serial, count + (uint64_t)mb));
            for (int i = 0; i < NT; i++)
                for (int c = 0; c < PARTS; c++)
                    EXPECT_OK(gradacc_accumulator_add_tensor(serial, scaler, (size_t)i, contrib[i][c].data, sizes[i]));
            REQUIRE_OK(gradacc_accumulator_end_microbatch(serial));

            REQUIRE_OK(gradacc_accumulator_begin_microbatch(parallel, count + (uint64_t)mb));
            pthread_barrier_t start;
            pthread_barrier_init(&start, NULL, THREADS);
            worker_args w[THREADS];
            for (int k = 0; k < THREADS; k++) {
                w[k].acc = parallel;
                w[k].scaler = scaler;
                w[k].thread = k;
                w[k].start = &start;
            }
            run_ranks(THREADS, worker, w, sizeof w[0]);
            pthread_barrier_destroy(&start);
            REQUIRE_OK(gradacc_accumulator_end_microbatch(parallel));
        }
        gradacc_sync_info_t is = GRADACC_SYNC_INFO_INIT, ip = GRADACC_SYNC_INFO_INIT;
        REQUIRE_OK(gradacc_accumulator_sync(serial, NULL, &is));
        REQUIRE_OK(gradacc_accumulator_sync(parallel, NULL, &ip));
        CHECK(is.grad_norm == ip.grad_norm && is.total_count == ip.total_count, "window %d: norms %.17g / %.17g", window,
              is.grad_norm, ip.grad_norm);
        for (int i = 0; i < NT; i++) {
            float *a, *b;
            size_t na, nb;
            REQUIRE_OK(gradacc_accumulator_master(serial, (size_t)i, &a, &na));
            REQUIRE_OK(gradacc_accumulator_master(parallel, (size_t)i, &b, &nb));
            CHECK(na == nb && memcmp(a, b, na * sizeof(float)) == 0,
                  "window %d tensor %d (%s, %zu elements): concurrent add_tensor differs from serial", window, i,
                  dtype_name(kinds[i]), sizes[i]);
        }
    }
    for (int i = 0; i < NT; i++)
        for (int c = 0; c < PARTS; c++)
            grad_free(&contrib[i][c]);
    free(vals);
    gradacc_accumulator_destroy(serial);
    gradacc_accumulator_destroy(parallel);
    gradacc_scaler_destroy(scaler);
}

int main(void)
{
    test_rng rng = rng_fresh("seed_partial_chunks");
    static problem p;
    for (int k = 0; k < NW1; k++)
        p.W1[k] = rng_range(&rng, -0.6, 0.6);
    for (int k = 0; k < NW2; k++)
        p.W2[k] = rng_range(&rng, -0.6, 0.6);
    for (int k = 0; k < NB2; k++)
        p.b2[k] = rng_range(&rng, -0.5, 0.5);
    for (int mb = 0; mb < MB; mb++)
        for (int i = 0; i < BATCH; i++) {
            for (int j = 0; j < D; j++)
                p.x[mb][i][j] = rng_range(&rng, -1, 1);
            for (int o = 0; o < V; o++)
                p.t[mb][i][o] = rng_range(&rng, -1, 1);
        }
    test_chunked(&p, GRADACC_DTYPE_F32, GRADACC_DTYPE_F32, GRADACC_DTYPE_F32);
    test_chunked(&p, GRADACC_DTYPE_F32, GRADACC_DTYPE_F16, GRADACC_DTYPE_BF16);
    test_chunked(&p, GRADACC_DTYPE_BF16, GRADACC_DTYPE_BF16, GRADACC_DTYPE_F16);
    test_threads(&rng);
    return test_finish();
}
