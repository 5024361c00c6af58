/* demo_train: data-parallel mixed-precision training with gradient accumulation, done right.
 *
 * A small MLP (16 -> 448 tanh -> 1, 8065 parameters) learns a synthetic regression task on 2 ranks
 * (two threads joined by gradacc's in-process communicator). Every step, each rank runs 4
 * micro-batches of different sizes (rank 0: 5, 9, 3, 7 items; rank 1: 8, 2, 6, 4), and each
 * micro-batch's backward produces fp16 gradients of a scaled loss, as an fp16 backward does: the
 * gradient is computed in f32, multiplied by the loss scale and rounded to fp16.
 *
 * gradacc unscales each micro-batch into an FP32 master as it arrives, weights it by its item count,
 * all-reduces the master once at the boundary and divides by the global item count. Each step the
 * demo compares that gradient with an f64 reference: the full-batch gradient over all 44 items of
 * both ranks, at the same weights.
 *
 * Next to it runs the common hand-written scheme of the Apex O2 + DDP bug report (seed
 * apex-o2-ddp-accumulation-bug.md): each rank accumulates `loss / steps` gradients in fp32 locally,
 * and only the last micro-batch's fp16 gradients are averaged across ranks before being added. Its
 * gradient is wrong (mean of micro-batch means, mostly local data), and its two replicas step with
 * different gradients, so their weights drift apart.
 *
 * Beside it, the same training under the other boundary policy, on a second pair of ranks:
 * reduce-scatter (GRADACC_SHARDING_REDUCE_SCATTER), as a distributed optimizer (ZeRO-1) runs it.
 * Each rank's accumulator keeps only its shard of the reduced gradient (gradacc_accumulator_shard:
 * rank 0 the first 4096 elements of the flat layout, rank 1 the other 3969; the model is as wide
 * as it is so that both shards hold part of it), and gradacc's optimizer (gradacc_optimizer_t, SGD)
 * steps only that range of the weights' FP32 masters and all-gathers the updated weights.
 * With an FP32 wire the shard holds the all-reduce's bits, so these weights must stay bitwise
 * equal to the all-reduce's. `demo_train --wire bf16` sends bf16 in that run instead and reports
 * how far its weights move from the all-reduce's.
 *
 * And on a third pair of ranks, sharded accumulation (GRADACC_SHARDING_ACCUMULATE, ZeRO-2, made
 * with gradacc_accumulator_create_sharded): each rank holds only its shard of the gradient (the
 * same ranges) and one bucket of staging, and every micro-batch is reduce-scattered as it is
 * added; the optimizer steps and all-gathers the ranges as above. Its sums run in another order than
 * the all-reduce's, so its weights are not bitwise equal to the all-reduce's: the demo prints how
 * far they move and fails beyond 1e-5 over the 30 steps (1e-3 with `--wire bf16`, which applies
 * to this run too).
 *
 * And on 4 ranks of their own, dp 2 x tp 2 on the mesh step (gradacc_mesh_sync): Megatron-style
 * tensor parallelism of the MLP. The hidden layer is split over the 2 TP ranks (each holds 224
 * hidden units: its rows of W1 and b1, its columns of W2), b2 is replicated over them (declared
 * gradacc_replicated_t, so it enters the global norm once), and the data is split over the 2 DP
 * ranks as above. Each TP pair sums its partial outputs through shared memory (the framework's TP
 * all-reduce of activations, not gradacc's), and each rank's accumulator is reduced over its DP
 * pair, one agreement over the world of 4 for all. Its sums run in another order, so the demo
 * prints how far its weights (reassembled from the shards) and its global norm move from the
 * all-reduce's, and fails beyond 1e-5 (TP_TOL).
 *
 * And after them, the all-reduce run once per optimizer state format, on 2 ranks each: gradacc's
 * AdamW over bf16 model weights with FP32 or remainder masters and FP32 or bf16 moments (12, 10,
 * 8 and 6 bytes of state per parameter); the demo prints their final losses side by side and
 * fails when one moves more than 1e-3 (FMT_TOL) from the FP32 state's.
 *
 * Exit status: 0 if gradacc's gradient stays within tolerance of the reference at every step,
 * both ranks hold bitwise-identical gradients and weights, (FP32 wire) the reduce-scatter's
 * weights equal the all-reduce's bit for bit, and the sharded accumulation's weights stay within
 * their tolerance of the all-reduce's, skip the same steps, and are bitwise equal on its two
 * ranks, and the dp x tp run's weights and norm stay within their bounds of the all-reduce's, skip
 * the same steps, and its 4 ranks get the same report (DP replicas and b2 bitwise equal), and
 * every state format's final loss stays within its bound of the FP32 state's, with its ranks
 * bitwise equal and the same steps skipped; 1 otherwise. */
#include <gradacc.h>

#include <math.h>
#include <stdbool.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { IN = 16, HID = 448, RANKS = 2, MB = 4, STEPS = 30, ITEMS = 44, MAXN = 9 /* the largest micro-batch */ };
/* parameters, flat: W1 [HID][IN], b1 [HID], W2 [HID], b2 [1] */
enum { OFF_W1 = 0, OFF_B1 = HID * IN, OFF_W2 = OFF_B1 + HID, OFF_B2 = OFF_W2 + HID, NPARAM = OFF_B2 + 1 };
static const size_t tensor_numel[4] = {HID * IN, HID, HID, 1};
static const size_t tensor_offset[4] = {OFF_W1, OFF_B1, OFF_W2, OFF_B2};
static const int mb_size[RANKS][MB] = {{5, 9, 3, 7}, {8, 2, 6, 4}};

static const float LR = 0.1f;
static const float INIT_SCALE = 1024.0f;
static const unsigned GROWTH_INTERVAL = 10;
/* How far the sharded accumulation's weights may move from the all-reduce's over the 30 steps:
 * its gradients differ by FP32 summation order (the BF16 wire: by 2^-8 of each contribution),
 * and each step feeds the difference back. Measured 1.4e-6 (fp32 wire) and 7.6e-5 (bf16); the
 * naive scheme's replicas drift 1.7e-2 apart. */
static const double ACC_TOL_F32 = 1e-5, ACC_TOL_BF16 = 1e-3;
/* How far the dp x tp run's weights and global norm may move from the all-reduce's: its output
 * adds the TP ranks' partial sums (another f32 order), which now and then rounds a gradient
 * element to the neighbouring fp16 value, and each step feeds the difference back. Measured over
 * the 30 steps: weights 1.3e-6, norm 1.5e-6 (at step 1, at equal weights, 3.6e-8). */
static const double TP_TOL = 1e-5;

#define CHECK(call)                                                                                       \
    do {                                                                                                  \
        gradacc_status_t st_ = (call);                                                                    \
        if (st_ != GRADACC_STATUS_OK) {                                                                   \
            fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call, gradacc_last_error());  \
            exit(2);                                                                                      \
        }                                                                                                 \
    } while (0)

/* ---- fp16 ------------------------------------------------------------------------------------ */

/* f32 -> IEEE binary16 bits, round to nearest even (what a GPU's fp16 conversion does). */
static uint16_t to_f16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    int32_t exp = (int32_t)((x >> 23) & 0xff) - 127 + 15;
    uint32_t mant = x & 0x7fffff;
    if (((x >> 23) & 0xff) == 0xff)
        return (uint16_t)(sign | 0x7c00 | (mant ? 0x200 : 0));
    if (exp >= 31)
        return (uint16_t)(sign | 0x7c00);
    if (exp <= 0) { /* subnormal or zero */
        if (exp < -10)
            return sign;
        mant |= 0x800000;
        uint32_t shift = (uint32_t)(14 - exp), half = 1u << (shift - 1), rest = mant & ((1u << shift) - 1);
        uint32_t h = mant >> shift;
        if (rest > half || (rest == half && (h & 1)))
            h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((uint32_t)exp << 10) | (mant >> 13), rest = mant & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1)))
        h++; /* may carry into the exponent, up to infinity: correct rounding */
    return (uint16_t)(sign | h);
}

static float from_f16(uint16_t h)
{
    int exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    float v = exp == 0 ? ldexpf((float)mant, -24) : exp == 31 ? (mant ? NAN : INFINITY) : ldexpf((float)(mant | 0x400), exp - 25);
    return (h & 0x8000) ? -v : v;
}

/* ---- the tensor-parallel forward's sum ------------------------------------------------------ */

/* The TP all-reduce of the output's partial sums. It is the framework's job (gradacc reduces
 * gradients, not activations): here, shared memory and a barrier between the group's threads. */
enum { TP = 2 };
typedef struct tp_group {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int arrived, round;
    float part[TP][MAXN];
} tp_group;

static void tp_barrier(tp_group *g)
{
    pthread_mutex_lock(&g->mu);
    int round = g->round;
    if (++g->arrived == TP) {
        g->arrived = 0;
        g->round++;
        pthread_cond_broadcast(&g->cv);
    }
    while (round == g->round)
        pthread_cond_wait(&g->cv, &g->mu);
    pthread_mutex_unlock(&g->mu);
}

/* out[i] = bias + the sum of the group's partial out[i], added in TP rank order: the same bits on
 * every rank of the group. */
static void tp_sum(tp_group *g, int tp, float *out, int n, float bias)
{
    memcpy(g->part[tp], out, (size_t)n * sizeof(float));
    tp_barrier(g);
    for (int i = 0; i < n; i++) {
        float s = g->part[0][i];
        for (int t = 1; t < TP; t++)
            s += g->part[t][i];
        out[i] = bias + s;
    }
    tp_barrier(g); /* every peer has read the partials before the next micro-batch writes its own */
}

/* ---- data and model ------------------------------------------------------------------------- */

static float X[STEPS][ITEMS][IN], Y[STEPS][ITEMS];

static uint64_t rng_state = 0x2545f4914f6cdd1dull;
static double uniform(double lo, double hi)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return lo + (hi - lo) * (double)(rng_state >> 11) / 9007199254740992.0;
}

/* y = sin(2 u.x) + 0.3 v.x: smooth, nonlinear, learnable by a small MLP */
static void make_data(void)
{
    double u[IN], v[IN];
    for (int j = 0; j < IN; j++) {
        u[j] = uniform(-0.5, 0.5);
        v[j] = uniform(-0.5, 0.5);
    }
    for (int s = 0; s < STEPS; s++)
        for (int i = 0; i < ITEMS; i++) {
            double ux = 0, vx = 0;
            for (int j = 0; j < IN; j++) {
                X[s][i][j] = (float)uniform(-1, 1);
                ux += u[j] * X[s][i][j];
                vx += v[j] * X[s][i][j];
            }
            Y[s][i] = (float)(sin(2.0 * ux) + 0.3 * vx);
        }
}

static void init_weights(float *w)
{
    for (int k = 0; k < NPARAM; k++)
        w[k] = 0.0f;
    for (int k = 0; k < HID * IN; k++)
        w[OFF_W1 + k] = (float)uniform(-0.25, 0.25);
    for (int k = 0; k < HID; k++)
        w[OFF_W2 + k] = (float)uniform(-1.0, 1.0) / sqrtf((float)HID);
}

/* The framework's backward: gradient of the micro-batch's mean loss 0.5 (f(x) - y)^2, in f32, of a
 * model `width` hidden units wide (w and g: W1 [width][IN], b1 [width], W2 [width], b2 [1]). With a
 * TP group, w holds this rank's hidden units (its rows of W1 and b1, its columns of W2) and the
 * output is b2 plus the sum of the group's partial outputs. */
static void backward_f32(const float *w, int width, const float (*x)[IN], const float *y, int n, float *g,
                         tp_group *group, int tp)
{
    const float *w1 = w, *b1 = w1 + width * IN, *w2 = b1 + width, *b2 = w2 + width;
    float *g1 = g, *gb1 = g1 + width * IN, *g2 = gb1 + width, *gb2 = g2 + width;
    float h[MAXN][HID], out[MAXN];
    memset(g, 0, (size_t)(width * IN + 2 * width + 1) * sizeof(float));
    for (int i = 0; i < n; i++) {
        out[i] = group ? 0.0f : *b2;
        for (int a = 0; a < width; a++) {
            float z = b1[a];
            for (int j = 0; j < IN; j++)
                z += w1[a * IN + j] * x[i][j];
            h[i][a] = tanhf(z);
            out[i] += w2[a] * h[i][a];
        }
    }
    if (group)
        tp_sum(group, tp, out, n, *b2);
    for (int i = 0; i < n; i++) {
        float r = (out[i] - y[i]) / (float)n;
        *gb2 += r;
        for (int a = 0; a < width; a++) {
            g2[a] += r * h[i][a];
            float dz = r * w2[a] * (1.0f - h[i][a] * h[i][a]);
            gb1[a] += dz;
            for (int j = 0; j < IN; j++)
                g1[a * IN + j] += dz * x[i][j];
        }
    }
}

/* The reference: the same gradient over items [lo, hi) of a step's batch, in f64; returns the loss. */
static double backward_f64(const float *w, int step, int lo, int hi, double *g)
{
    double loss = 0.0;
    int n = hi - lo;
    memset(g, 0, NPARAM * sizeof(double));
    for (int i = lo; i < hi; i++) {
        const float *x = X[step][i];
        double h[HID], out = w[OFF_B2];
        for (int a = 0; a < HID; a++) {
            double z = w[OFF_B1 + a];
            for (int j = 0; j < IN; j++)
                z += (double)w[OFF_W1 + a * IN + j] * x[j];
            h[a] = tanh(z);
            out += w[OFF_W2 + a] * h[a];
        }
        double r = out - Y[step][i];
        loss += 0.5 * r * r / n;
        r /= n;
        g[OFF_B2] += r;
        for (int a = 0; a < HID; a++) {
            g[OFF_W2 + a] += r * h[a];
            double dz = r * w[OFF_W2 + a] * (1.0 - h[a] * h[a]);
            g[OFF_B1 + a] += dz;
            for (int j = 0; j < IN; j++)
                g[OFF_W1 + a * IN + j] += dz * x[j];
        }
    }
    return loss;
}

/* first item of micro-batch m of rank r within a step's batch of 44 */
static int mb_start(int r, int m)
{
    int start = 0;
    for (int q = 0; q < r; q++)
        for (int k = 0; k < MB; k++)
            start += mb_size[q][k];
    for (int k = 0; k < m; k++)
        start += mb_size[r][k];
    return start;
}

/* ---- one rank with gradacc ------------------------------------------------------------------ */

typedef struct rank_state {
    int rank, step;
    gradacc_comm_t *comm;
    gradacc_scaler_t *scaler;
    gradacc_accumulator_t *acc;
    /* Room for the master's length: each tensor's master starts at a multiple of
     * GRADACC_MASTER_ALIGN bytes, which here are the packed offsets (every size but the last is a
     * multiple of 64), and the last shard runs to the end of the last tensor's padding. */
    float w[(NPARAM + 63) / 64 * 64];    /* this replica's weights */
    float grad[(NPARAM + 63) / 64 * 64]; /* the boundary's gradient (under reduce-scatter: only the shard) */
    bool skipped;
    gradacc_sync_info_t info; /* the boundary's report */
    uint16_t g16[NPARAM];     /* one micro-batch's fp16 gradients */
    /* the sharded runs only: gradacc's optimizer, which steps the shard and all-gathers over
     * `gather` (the communicator sync took; NULL: the sharded accumulation's own) */
    gradacc_optimizer_t *opt;
    gradacc_comm_t *gather;
} rank_state;

/* Plain SGD at LR over `acc`'s four tensors, whose f32 weights sit in `w` (the masters start as
 * them, and each step writes them back). */
static gradacc_optimizer_t *sgd_over(gradacc_accumulator_t *acc, float *w)
{
    gradacc_optimizer_config_t oc;
    CHECK(gradacc_optimizer_config_default(&oc));
    oc.algorithm = GRADACC_OPTIMIZER_SGD;
    oc.lr = LR;
    oc.weight_decay = 0.0f;
    const void *weights[4];
    const gradacc_dtype_t f32[4] = {GRADACC_DTYPE_F32, GRADACC_DTYPE_F32, GRADACC_DTYPE_F32, GRADACC_DTYPE_F32};
    for (int t = 0; t < 4; t++)
        weights[t] = &w[tensor_offset[t]];
    gradacc_optimizer_t *opt = NULL;
    CHECK(gradacc_optimizer_create(acc, &oc, NULL, weights, f32, 4, &opt));
    return opt;
}

/* One micro-batch's gradient g, `total` floats, as an fp16 backward gives it (the gradient of the
 * scaled loss rounded to fp16), added to `acc`'s four tensors, which start at `offset`. */
static void add_f16(gradacc_accumulator_t *acc, gradacc_scaler_t *scaler, float scale, const float *g, size_t total,
                    uint16_t *g16, const size_t *offset, int n)
{
    for (size_t k = 0; k < total; k++)
        g16[k] = to_f16(g[k] * scale);
    const void *grads[4];
    for (int t = 0; t < 4; t++)
        grads[t] = &g16[offset[t]];
    CHECK(gradacc_accumulator_add(acc, scaler, grads, 4, (uint64_t)n));
}

/* The boundary's gradient, out of `acc`'s four masters into grad (at `offset`), and plain SGD on the
 * `total` weights unless the step is skipped. */
static void sgd_from_masters(const gradacc_accumulator_t *acc, const size_t *offset, size_t total, float *grad,
                             float *w, bool skipped)
{
    for (int t = 0; t < 4; t++) {
        float *master;
        size_t numel;
        CHECK(gradacc_accumulator_master(acc, (size_t)t, &master, &numel));
        memcpy(&grad[offset[t]], master, numel * sizeof(float));
    }
    if (!skipped)
        for (size_t k = 0; k < total; k++)
            w[k] -= LR * grad[k];
}

static void *rank_step(void *arg)
{
    rank_state *rs = arg;
    float g[NPARAM];
    for (int m = 0; m < MB; m++) {
        int lo = mb_start(rs->rank, m), n = mb_size[rs->rank][m];
        float scale;
        CHECK(gradacc_scaler_scale(rs->scaler, &scale));
        backward_f32(rs->w, HID, &X[rs->step][lo], &Y[rs->step][lo], n, g, NULL, 0);
        add_f16(rs->acc, rs->scaler, scale, g, NPARAM, rs->g16, tensor_offset, n);
    }
    rs->info = (gradacc_sync_info_t)GRADACC_SYNC_INFO_INIT;
    CHECK(gradacc_accumulator_sync(rs->acc, rs->comm, &rs->info)); /* the boundary: one all-reduce (or reduce-scatter) */
    const gradacc_accumulator_t *accs[1] = {rs->acc};
    CHECK(gradacc_scaler_update(rs->scaler, accs, 1, &rs->skipped));
    if (rs->opt) {
        /* A sharded boundary: this rank holds only its shard of the gradient, and the optimizer
         * steps only those weights' FP32 masters (its state is sharded the same way), then
         * all-gathers the weights: over the communicator sync took, or the sharded
         * accumulation's own. */
        size_t off, n;
        float *shard;
        CHECK(gradacc_accumulator_shard(rs->acc, &off, &n, &shard));
        memcpy(&rs->grad[off], shard, n * sizeof(float));
        void *weights[4];
        for (int t = 0; t < 4; t++)
            weights[t] = &rs->w[tensor_offset[t]];
        bool stepped = false;
        CHECK(gradacc_optimizer_step(rs->opt, rs->acc, weights, 4, rs->gather, &stepped));
        if (stepped == rs->skipped) {
            fprintf(stderr, "rank %d: the optimizer and the scaler disagree on the skip\n", rs->rank);
            exit(2);
        }
        return NULL;
    }
    sgd_from_masters(rs->acc, tensor_offset, NPARAM, rs->grad, rs->w, rs->skipped);
    return NULL;
}

/* ---- the naive scheme, both replicas -------------------------------------------------------- */

/* Each replica: grads of loss / MB accumulated locally in fp32, the last micro-batch's fp16 grads
 * averaged over ranks first (DDP's all-reduce, enabled only on the last micro-step). */
static void naive_step(float w[RANKS][NPARAM], int step, float scale, float grad[RANKS][NPARAM], bool skipped[RANKS])
{
    static uint16_t last16[RANKS][NPARAM];
    float g[NPARAM];
    for (int r = 0; r < RANKS; r++) {
        memset(grad[r], 0, sizeof grad[r]);
        for (int m = 0; m < MB; m++) {
            int lo = mb_start(r, m);
            backward_f32(w[r], HID, &X[step][lo], &Y[step][lo], mb_size[r][m], g, NULL, 0);
            for (int k = 0; k < NPARAM; k++) {
                uint16_t h = to_f16(g[k] * scale);
                if (m == MB - 1)
                    last16[r][k] = h;
                else
                    grad[r][k] += from_f16(h) / scale / MB;
            }
        }
    }
    for (int k = 0; k < NPARAM; k++) {
        float avg = from_f16(to_f16((from_f16(last16[0][k]) + from_f16(last16[1][k])) / RANKS));
        for (int r = 0; r < RANKS; r++)
            grad[r][k] += avg / scale / MB;
    }
    for (int r = 0; r < RANKS; r++) {
        skipped[r] = false;
        for (int k = 0; k < NPARAM; k++)
            skipped[r] |= !isfinite(grad[r][k]);
        if (!skipped[r])
            for (int k = 0; k < NPARAM; k++)
                w[r][k] -= LR * grad[r][k];
    }
}

/* ---- dp 2 x tp 2 on the mesh step ---------------------------------------------------------- */

/* World rank = tp + TP * dp (Megatron-Core's order, TP fastest). Each rank holds TPH hidden units,
 * flat as the model's: W1 rows [TPH][IN], b1 [TPH], W2 [TPH], then b2, replicated over TP. */
enum { DP = RANKS, TP_RANKS = TP * DP, TPH = HID / TP, TP_NPARAM = TPH * IN + 2 * TPH + 1 };
static const size_t tp_numel[4] = {TPH * IN, TPH, TPH, 1};
static const size_t tp_offset[4] = {0, TPH * IN, TPH * IN + TPH, TPH * IN + 2 * TPH};
static const gradacc_replicated_t tp_b2 = {.tensor = 3, .copies = TP, .key = 0x6232 /* "b2" */};

typedef struct tp_rank {
    int rank, step;
    tp_group *group; /* its TP group's forward sum */
    gradacc_comm_t *world, *dp;
    gradacc_mesh_t *mesh;
    gradacc_scaler_t *scaler;
    gradacc_accumulator_t *acc;
    float w[TP_NPARAM], grad[TP_NPARAM];
    uint16_t g16[TP_NPARAM];
    gradacc_sync_info_t info;
    bool skipped;
} tp_rank;

typedef struct tp_run {
    tp_rank ranks[TP_RANKS];
    tp_group groups[DP];
    /* against the all-reduce run, over the steps: the largest gaps of the weights and the norm */
    double w_gap, norm_gap;
    int reports_differ, skips_differ, replicas_differ;
} tp_run;

static void *tp_step(void *arg)
{
    tp_rank *rs = arg;
    int tp = rs->rank % TP, d = rs->rank / TP;
    float g[TP_NPARAM];
    for (int m = 0; m < MB; m++) { /* both TP ranks of data rank d see its micro-batches */
        int lo = mb_start(d, m), n = mb_size[d][m];
        float scale;
        CHECK(gradacc_scaler_scale(rs->scaler, &scale));
        backward_f32(rs->w, TPH, &X[rs->step][lo], &Y[rs->step][lo], n, g, rs->group, tp);
        add_f16(rs->acc, rs->scaler, scale, g, TP_NPARAM, rs->g16, tp_offset, n);
    }
    /* The boundary: the accumulator reduced over its DP group, normalised by the job's count (the
     * data ranks' items, 44) and measured into one global norm, b2 counted once over its copies;
     * one agreement over the world of 4 on all of it. */
    gradacc_mesh_part_t part = GRADACC_MESH_PART_INIT;
    part.accumulator = rs->acc;
    part.comm = rs->dp;
    part.replicated = &tp_b2;
    part.replicated_count = 1;
    rs->info = (gradacc_sync_info_t)GRADACC_SYNC_INFO_INIT;
    CHECK(gradacc_mesh_sync(rs->mesh, &part, 1, &rs->info, NULL));
    const gradacc_accumulator_t *accs[1] = {rs->acc};
    CHECK(gradacc_scaler_update(rs->scaler, accs, 1, &rs->skipped));
    sgd_from_masters(rs->acc, tp_offset, TP_NPARAM, rs->grad, rs->w, rs->skipped);
    return NULL;
}

/* Where element k of TP rank tp's weights sits in the full model's (b2, not sharded, on every rank). */
static size_t tp_full_index(int tp, size_t k)
{
    int t = 3;
    while (k < tp_offset[t])
        t--;
    return tensor_offset[t] + (t < 3 ? (size_t)tp * tp_numel[t] : 0) + (k - tp_offset[t]);
}

/* The full model's weights out of TP ranks 0.. TP - 1 (one data rank's). */
static void tp_gather(const tp_rank *tp_ranks, float *full)
{
    for (int t = 0; t < TP; t++)
        for (size_t k = 0; k < TP_NPARAM; k++)
            full[tp_full_index(t, k)] = tp_ranks[t].w[k];
}

static void tp_setup(tp_run *run, const float *w0, const gradacc_scaler_config_t *sc,
                     const gradacc_accumulator_config_t *ac)
{
    gradacc_comm_t *world[TP_RANKS], *dp[TP][DP]; /* DP groups {0, 2} and {1, 3} */
    CHECK(gradacc_comm_create_local(TP_RANKS, world));
    for (int t = 0; t < TP; t++)
        CHECK(gradacc_comm_create_local(DP, dp[t]));
    gradacc_accumulator_config_t tac = *ac;
    tac.max_grad_norm = 0.0f; /* the mesh clips, with the global norm */
    tac.tensor_stats = 1;     /* a part with a replicated tensor measures its tensors */
    gradacc_tensor_desc_t tensors[4];
    for (int t = 0; t < 4; t++) {
        tensors[t].numel = tp_numel[t];
        tensors[t].dtype = GRADACC_DTYPE_F16;
    }
    for (int d = 0; d < DP; d++)
        if (pthread_mutex_init(&run->groups[d].mu, NULL) != 0 || pthread_cond_init(&run->groups[d].cv, NULL) != 0)
            exit(2);
    for (int r = 0; r < TP_RANKS; r++) {
        tp_rank *rs = &run->ranks[r];
        int tp = r % TP, d = r / TP;
        rs->rank = r;
        rs->group = &run->groups[d];
        rs->world = world[r];
        rs->dp = dp[tp][d];
        CHECK(gradacc_mesh_create(world[r], (uint32_t)d, DP, ac->max_grad_norm, &rs->mesh));
        CHECK(gradacc_scaler_create(sc, NULL, &rs->scaler));
        CHECK(gradacc_accumulator_create(&tac, tensors, 4, NULL, &rs->acc));
        for (size_t k = 0; k < TP_NPARAM; k++)
            rs->w[k] = w0[tp_full_index(tp, k)];
    }
}

/* Every field the same bits (the padding is not compared). */
static bool same_info(const gradacc_sync_info_t *x, const gradacc_sync_info_t *y)
{
    return x->found_inf == y->found_inf && x->total_count == y->total_count && x->microbatches == y->microbatches &&
           memcmp(&x->grad_norm, &y->grad_norm, sizeof x->grad_norm) == 0 &&
           memcmp(&x->clip_coef, &y->clip_coef, sizeof x->clip_coef) == 0 &&
           x->dropped_microbatches == y->dropped_microbatches && x->overflow_at == y->overflow_at &&
           x->overflow_rank == y->overflow_rank && x->overflow_microbatch == y->overflow_microbatch &&
           x->overflow_tensor == y->overflow_tensor;
}

/* After a step: the full weights reassembled from data rank 0's TP shards against the all-reduce
 * run's (`ddp`), the norm against its norm, and the four ranks against each other. */
static void tp_check(tp_run *run, const rank_state *ddp)
{
    float full[NPARAM];
    tp_gather(run->ranks, full);
    for (int k = 0; k < NPARAM; k++) {
        double d = fabs((double)full[k] - ddp->w[k]);
        run->w_gap = d > run->w_gap || d != d ? d : run->w_gap;
    }
    const tp_rank *r0 = &run->ranks[0];
    if (!r0->skipped) {
        double d = fabs(r0->info.grad_norm - ddp->info.grad_norm);
        run->norm_gap = d > run->norm_gap || d != d ? d : run->norm_gap;
    }
    run->skips_differ += r0->skipped != ddp->skipped;
    run->reports_differ += r0->info.total_count != ITEMS; /* the data ranks' items, not 88 */
    for (int r = 1; r < TP_RANKS; r++) {
        const tp_rank *rs = &run->ranks[r];
        run->reports_differ += !same_info(&r0->info, &rs->info) || rs->skipped != r0->skipped;
        run->replicas_differ += (r >= TP && memcmp(rs->w, run->ranks[r - TP].w, sizeof rs->w) != 0) ||
                                memcmp(&rs->w[TP_NPARAM - 1], &r0->w[TP_NPARAM - 1], sizeof(float)) != 0;
    }
}

/* The run's verdict lines; returns 1 when it missed its bound or its ranks disagree. */
static int tp_verdict(const tp_run *run, const rank_state *ddp, double ddp_loss)
{
    float full[NPARAM];
    static double scratch[NPARAM];
    tp_gather(run->ranks, full);
    double loss = backward_f64(full, STEPS - 1, 0, ITEMS, scratch), final_gap = 0.0;
    for (int k = 0; k < NPARAM; k++)
        final_gap = fmax(final_gap, fabs((double)full[k] - ddp->w[k]));
    printf("  dp 2 x tp 2 (mesh step, 4 ranks; bound %.0e): weights reassembled from the TP shards vs the all-reduce's:\n"
           "           max |diff| %.3g at any step (%.3g at the end); final loss %.7f, %.2g from the all-reduce's;\n"
           "           global norm vs the all-reduce's: max |diff| %.3g; the same steps skipped: %s; the same report\n"
           "           (total count 44) on its 4 ranks at every step: %s; DP replicas and b2 bitwise equal: %s\n",
           TP_TOL, run->w_gap, final_gap, loss, fabs(loss - ddp_loss), run->norm_gap, run->skips_differ ? "NO" : "yes",
           run->reports_differ ? "NO" : "yes", run->replicas_differ ? "NO" : "yes");
    return run->skips_differ || run->reports_differ || run->replicas_differ || !(run->w_gap <= TP_TOL) ||
           !(run->norm_gap <= TP_TOL);
}

static void tp_destroy(tp_run *run)
{
    for (int r = 0; r < TP_RANKS; r++) {
        tp_rank *rs = &run->ranks[r];
        CHECK(gradacc_mesh_destroy(rs->mesh));
        CHECK(gradacc_accumulator_destroy(rs->acc));
        CHECK(gradacc_scaler_destroy(rs->scaler));
        CHECK(gradacc_comm_destroy(rs->dp));
        CHECK(gradacc_comm_destroy(rs->world));
    }
}

/* ---- optimizer state formats ------------------------------------------------------------- */

/* The all-reduce run's training again, with gradacc's AdamW over bf16 model weights, on one pair
 * of ranks per state format: FP32 or remainder masters (the bf16 weight plus a 16-bit remainder,
 * the FP32 master exactly) times FP32 or bf16 moments, 12 down to 6 bytes of state per
 * parameter. The forward and backward read the bf16 weights. */
enum { FORMATS = 4 };
static const float ADAM_LR = 1e-2f;
/* How far a smaller state's final loss may move from the FP32 state's after the 30 steps: bf16
 * moments round stochastically, and remainder masters round the weight's ties away from zero
 * (not to even), and each step feeds the difference back. Measured: 4.4e-5 at most (bf16
 * moments), 1.9e-5 (remainder masters with FP32 moments). */
static const double FMT_TOL = 1e-3;

typedef struct fmt_rank {
    int rank, step;
    gradacc_comm_t *comm;
    gradacc_scaler_t *scaler;
    gradacc_accumulator_t *acc;
    gradacc_optimizer_t *opt;
    uint16_t w[NPARAM]; /* the model's bf16 weights */
    float wf[NPARAM];   /* the same weights in f32, as the forward reads them */
    uint16_t g16[NPARAM];
    bool skipped;
} fmt_rank;

typedef struct fmt_run {
    const char *name;
    fmt_rank ranks[RANKS];
    int replicas_differ, skips;
} fmt_run;

static void *fmt_step(void *arg)
{
    fmt_rank *rs = arg;
    float g[NPARAM];
    for (int m = 0; m < MB; m++) {
        int lo = mb_start(rs->rank, m), n = mb_size[rs->rank][m];
        float scale;
        CHECK(gradacc_scaler_scale(rs->scaler, &scale));
        backward_f32(rs->wf, HID, &X[rs->step][lo], &Y[rs->step][lo], n, g, NULL, 0);
        add_f16(rs->acc, rs->scaler, scale, g, NPARAM, rs->g16, tensor_offset, n);
    }
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    CHECK(gradacc_accumulator_sync(rs->acc, rs->comm, &info));
    const gradacc_accumulator_t *accs[1] = {rs->acc};
    CHECK(gradacc_scaler_update(rs->scaler, accs, 1, &rs->skipped));
    void *weights[4];
    for (int t = 0; t < 4; t++)
        weights[t] = &rs->w[tensor_offset[t]];
    CHECK(gradacc_optimizer_step(rs->opt, rs->acc, weights, 4, rs->comm, NULL));
    CHECK(gradacc_bf16_to_f32(rs->w, rs->wf, NPARAM));
    return NULL;
}

static void fmt_setup(fmt_run *run, const char *name, gradacc_masters_t masters, gradacc_moments_t moments,
                      const float *w0, const gradacc_scaler_config_t *sc, const gradacc_accumulator_config_t *ac,
                      const gradacc_tensor_desc_t *tensors)
{
    run->name = name;
    gradacc_comm_t *comms[RANKS];
    CHECK(gradacc_comm_create_local(RANKS, comms));
    gradacc_optimizer_config_t oc;
    CHECK(gradacc_optimizer_config_default(&oc)); /* AdamW */
    oc.lr = ADAM_LR;
    oc.masters = masters;
    oc.moments = moments;
    oc.moment_seed = 7;
    const gradacc_dtype_t bf16[4] = {GRADACC_DTYPE_BF16, GRADACC_DTYPE_BF16, GRADACC_DTYPE_BF16, GRADACC_DTYPE_BF16};
    for (int r = 0; r < RANKS; r++) {
        fmt_rank *rs = &run->ranks[r];
        rs->rank = r;
        rs->comm = comms[r];
        CHECK(gradacc_scaler_create(sc, NULL, &rs->scaler));
        CHECK(gradacc_accumulator_create(ac, tensors, 4, NULL, &rs->acc));
        CHECK(gradacc_f32_to_bf16(w0, rs->w, NPARAM));
        CHECK(gradacc_bf16_to_f32(rs->w, rs->wf, NPARAM));
        const void *weights[4];
        for (int t = 0; t < 4; t++)
            weights[t] = &rs->w[tensor_offset[t]];
        CHECK(gradacc_optimizer_create(rs->acc, &oc, NULL, weights, bf16, 4, &rs->opt));
    }
}

/* Every format's 30 steps, its ranks checked against each other after each. */
static void fmt_train(fmt_run *runs)
{
    for (int step = 0; step < STEPS; step++) {
        pthread_t threads[FORMATS * RANKS];
        for (int f = 0; f < FORMATS; f++)
            for (int r = 0; r < RANKS; r++) {
                runs[f].ranks[r].step = step;
                if (pthread_create(&threads[f * RANKS + r], NULL, fmt_step, &runs[f].ranks[r]) != 0)
                    exit(2);
            }
        for (int k = 0; k < FORMATS * RANKS; k++)
            pthread_join(threads[k], NULL);
        for (int f = 0; f < FORMATS; f++) {
            const fmt_rank *a = &runs[f].ranks[0], *b = &runs[f].ranks[1];
            runs[f].replicas_differ += memcmp(a->w, b->w, sizeof a->w) != 0 || a->skipped != b->skipped;
            runs[f].skips += a->skipped;
        }
    }
}

/* The formats' final losses side by side; returns 1 when one left the bound or its ranks differ. */
static int fmt_verdict(const fmt_run *runs)
{
    static double scratch[NPARAM];
    double loss[FORMATS];
    int failed = 0;
    printf("  optimizer state (AdamW over bf16 weights, lr %g, all-reduce; bound on the final loss %.0e):\n",
           (double)ADAM_LR, FMT_TOL);
    for (int f = 0; f < FORMATS; f++) {
        loss[f] = backward_f64(runs[f].ranks[0].wf, STEPS - 1, 0, ITEMS, scratch);
        printf("           %-46s final loss %.7f (%+.2g); %d skipped; ranks bitwise equal: %s\n", runs[f].name,
               loss[f], loss[f] - loss[0], runs[f].skips, runs[f].replicas_differ ? "NO" : "yes");
        failed |= runs[f].replicas_differ || runs[f].skips != runs[0].skips || !(fabs(loss[f] - loss[0]) <= FMT_TOL);
    }
    return failed;
}

static void fmt_destroy(fmt_run *runs)
{
    for (int f = 0; f < FORMATS; f++)
        for (int r = 0; r < RANKS; r++) {
            fmt_rank *rs = &runs[f].ranks[r];
            CHECK(gradacc_optimizer_destroy(rs->opt));
            CHECK(gradacc_accumulator_destroy(rs->acc));
            CHECK(gradacc_scaler_destroy(rs->scaler));
            CHECK(gradacc_comm_destroy(rs->comm));
        }
}

/* ---- main ----------------------------------------------------------------------------------- */

static double max_gap(const float *a, const double *b)
{
    double m = 0.0;
    for (int k = 0; k < NPARAM; k++) {
        double d = fabs((double)a[k] - b[k]);
        m = d > m || d != d ? d : m;
    }
    return m;
}

int main(int argc, char **argv)
{
    gradacc_dtype_t wire = GRADACC_DTYPE_F32;
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc && strcmp(argv[i], "--wire") == 0 ? argv[++i] : NULL;
        if (v && strcmp(v, "bf16") == 0) {
            wire = GRADACC_DTYPE_BF16;
        } else if (!v || strcmp(v, "f32") != 0) {
            fprintf(stderr, "usage: %s [--wire f32|bf16]   (the sharded runs' wire dtype; default f32)\n", argv[0]);
            return 2;
        }
    }
    make_data();
    static rank_state ranks[RANKS], sharded[RANKS], accum[RANKS];
    static tp_run tp;
    static float naive_w[RANKS][NPARAM], naive_grad[RANKS][NPARAM];
    float w0[NPARAM];
    init_weights(w0);

    gradacc_comm_t *comms[RANKS], *shard_comms[RANKS], *accum_comms[RANKS];
    CHECK(gradacc_comm_create_local(RANKS, comms));
    CHECK(gradacc_comm_create_local(RANKS, shard_comms));
    CHECK(gradacc_comm_create_local(RANKS, accum_comms));
    gradacc_scaler_config_t sc;
    CHECK(gradacc_scaler_config_default(&sc));
    sc.init_scale = INIT_SCALE;
    sc.growth_interval = GROWTH_INTERVAL;
    gradacc_accumulator_config_t ac;
    CHECK(gradacc_accumulator_config_default(&ac)); /* mean-reduced losses, normalised by item count */
    gradacc_tensor_desc_t tensors[4];
    for (int t = 0; t < 4; t++) {
        tensors[t].numel = tensor_numel[t];
        tensors[t].dtype = GRADACC_DTYPE_F16;
    }
    for (int r = 0; r < RANKS; r++) {
        ranks[r].rank = r;
        ranks[r].comm = comms[r];
        CHECK(gradacc_scaler_create(&sc, NULL, &ranks[r].scaler)); /* one scaler per rank */
        CHECK(gradacc_accumulator_create(&ac, tensors, 4, NULL, &ranks[r].acc));
        for (size_t t = 0; t < 4; t++) { /* the shard copies below index the flat master */
            size_t at;
            CHECK(gradacc_accumulator_offset(ranks[r].acc, t, &at));
            if (at != tensor_offset[t]) {
                fprintf(stderr, "tensor %zu starts at %zu in the master, not %zu\n", t, at, tensor_offset[t]);
                exit(2);
            }
        }
        memcpy(ranks[r].w, w0, sizeof w0);
        memcpy(naive_w[r], w0, sizeof w0);
    }
    /* The reduce-scatter run: the same model, data and settings, shard r of RANKS on rank r. */
    gradacc_accumulator_config_t sharded_ac = ac;
    sharded_ac.sharding = GRADACC_SHARDING_REDUCE_SCATTER;
    sharded_ac.shard_count = RANKS;
    sharded_ac.wire_dtype = wire;
    size_t shard_off[RANKS], shard_n[RANKS], acc_off[RANKS], acc_n[RANKS];
    for (int r = 0; r < RANKS; r++) {
        sharded[r].rank = r;
        sharded[r].comm = shard_comms[r];
        sharded[r].gather = shard_comms[r];
        sharded_ac.shard_rank = (uint32_t)r;
        CHECK(gradacc_scaler_create(&sc, NULL, &sharded[r].scaler));
        CHECK(gradacc_accumulator_create(&sharded_ac, tensors, 4, NULL, &sharded[r].acc));
        float *unused;
        CHECK(gradacc_accumulator_shard(sharded[r].acc, &shard_off[r], &shard_n[r], &unused));
        memcpy(sharded[r].w, w0, sizeof w0);
        sharded[r].opt = sgd_over(sharded[r].acc, sharded[r].w);
    }
    /* The sharded accumulation run: each rank holds only its shard of the gradient (the same
     * ranges), reduce-scattered over its communicator at every micro-batch. */
    gradacc_accumulator_config_t accum_ac = ac;
    accum_ac.sharding = GRADACC_SHARDING_ACCUMULATE;
    accum_ac.shard_count = RANKS;
    accum_ac.wire_dtype = wire;
    for (int r = 0; r < RANKS; r++) {
        accum[r].rank = r;
        accum[r].comm = accum_comms[r];
        accum_ac.shard_rank = (uint32_t)r;
        CHECK(gradacc_scaler_create(&sc, NULL, &accum[r].scaler));
        CHECK(gradacc_accumulator_create_sharded(&accum_ac, tensors, 4, NULL, accum_comms[r], &accum[r].acc));
        float *unused;
        CHECK(gradacc_accumulator_shard(accum[r].acc, &acc_off[r], &acc_n[r], &unused));
        memcpy(accum[r].w, w0, sizeof w0);
        accum[r].opt = sgd_over(accum[r].acc, accum[r].w);
    }

    tp_setup(&tp, w0, &sc, &ac); /* dp 2 x tp 2 on the mesh step: 4 ranks of their own */
    static fmt_run formats[FORMATS]; /* AdamW's state formats: 2 ranks each, trained after the table */
    fmt_setup(&formats[0], "FP32 masters, FP32 moments (12 B/param):", GRADACC_MASTERS_FP32, GRADACC_MOMENTS_FP32, w0,
              &sc, &ac, tensors);
    fmt_setup(&formats[1], "FP32 masters, bf16 moments (8 B/param):", GRADACC_MASTERS_FP32, GRADACC_MOMENTS_BF16, w0,
              &sc, &ac, tensors);
    fmt_setup(&formats[2], "remainder masters, FP32 moments (10 B/param):", GRADACC_MASTERS_BF16_REMAINDER,
              GRADACC_MOMENTS_FP32, w0, &sc, &ac, tensors);
    fmt_setup(&formats[3], "remainder masters, bf16 moments (6 B/param):", GRADACC_MASTERS_BF16_REMAINDER,
              GRADACC_MOMENTS_BF16, w0, &sc, &ac, tensors);

    printf("gradacc %s demo: MLP %d-%d-1 (%d parameters), 2 ranks on threads, fp16 gradients\n",
           gradacc_version_string(), IN, HID, NPARAM);
    printf("micro-batches per step: rank 0 = 5, 9, 3, 7 items; rank 1 = 8, 2, 6, 4 items (44 in all)\n");
    printf("boundary policies, each on its own 2 ranks: all-reduce (DDP; the table); reduce-scatter (ZeRO-1, %s wire;\n"
           "rank 0 steps weights [%zu, %zu), rank 1 [%zu, %zu), then the ranks all-gather them); sharded accumulation\n"
           "(ZeRO-2, %s wire: the same shards, each micro-batch reduce-scattered as it is added); and dp 2 x tp 2 on 4 ranks\n"
           "(the mesh step: each TP rank holds 224 hidden units, b2 replicated, each DP pair reduces its gradients)\n",
           wire == GRADACC_DTYPE_F32 ? "fp32" : "bf16", shard_off[0], shard_off[0] + shard_n[0], shard_off[1],
           shard_off[1] + shard_n[1], wire == GRADACC_DTYPE_F32 ? "fp32" : "bf16");
    printf("gap = max |gradient - f64 full-batch gradient over the 44 items, at the same weights|\n");
    printf("tol = 1e-3 x largest micro-batch gradient element (fp16 rounding is 4.9e-4 of it at most)\n\n");
    printf("%4s %9s %6s | %10s %10s %9s | %10s %10s\n", "step", "loss", "scale", "gradacc", "tol", "rank diff",
           "naive", "replicas");
    printf("%4s %9s %6s | %10s %10s %9s | %10s %10s\n", "", "", "", "gap", "", "", "gap", "w drift");

    int failures = 0, over_tol = 0, skipped_steps = 0, rs_replicas_differ = 0, rs_not_ddp = 0;
    double rs_gap = 0.0, acc_gap = 0.0, acc_grad_gap = 0.0;
    int acc_replicas_differ = 0, acc_skips_differ = 0;
    double worst_ratio = 0.0, worst_naive_rel = 0.0, drift = 0.0;
    for (int step = 0; step < STEPS; step++) {
        float scale;
        CHECK(gradacc_scaler_scale(ranks[0].scaler, &scale));

        /* references at gradacc's weights, and the largest micro-batch gradient (the tolerance's scale) */
        double ref[NPARAM], g_mb[NPARAM], big = 0.0;
        double loss = backward_f64(ranks[0].w, step, 0, ITEMS, ref);
        for (int r = 0; r < RANKS; r++)
            for (int m = 0; m < MB; m++) {
                int lo = mb_start(r, m);
                backward_f64(ranks[0].w, step, lo, lo + mb_size[r][m], g_mb);
                for (int k = 0; k < NPARAM; k++)
                    big = fabs(g_mb[k]) > big ? fabs(g_mb[k]) : big;
            }
        double tol = 1e-3 * big;

        /* gradacc: both ranks of each policy, one thread each */
        pthread_t threads[3 * RANKS + TP_RANKS];
        for (int r = 0; r < RANKS; r++) {
            ranks[r].step = sharded[r].step = accum[r].step = step;
            if (pthread_create(&threads[r], NULL, rank_step, &ranks[r]) != 0 ||
                pthread_create(&threads[RANKS + r], NULL, rank_step, &sharded[r]) != 0 ||
                pthread_create(&threads[2 * RANKS + r], NULL, rank_step, &accum[r]) != 0)
                return 2;
        }
        for (int r = 0; r < TP_RANKS; r++) {
            tp.ranks[r].step = step;
            if (pthread_create(&threads[3 * RANKS + r], NULL, tp_step, &tp.ranks[r]) != 0)
                return 2;
        }
        for (int r = 0; r < 3 * RANKS + TP_RANKS; r++)
            pthread_join(threads[r], NULL);
        tp_check(&tp, &ranks[0]);

        /* reduce-scatter: replicas equal to each other, and (fp32 wire) to the all-reduce's bits */
        double gap_rs = 0.0;
        for (int k = 0; k < NPARAM; k++) {
            double d = fabs((double)sharded[0].w[k] - ranks[0].w[k]);
            gap_rs = d > gap_rs || d != d ? d : gap_rs;
        }
        rs_gap = gap_rs > rs_gap ? gap_rs : rs_gap;
        if (memcmp(sharded[0].w, sharded[1].w, sizeof sharded[0].w) != 0 || sharded[0].skipped != sharded[1].skipped)
            rs_replicas_differ++;
        if (memcmp(sharded[0].w, ranks[0].w, sizeof ranks[0].w) != 0 || sharded[0].skipped != ranks[0].skipped)
            rs_not_ddp++;

        /* sharded accumulation: replicas equal to each other, and the all-reduce's within tolerance */
        for (int k = 0; k < NPARAM; k++) {
            double d = fabs((double)accum[0].w[k] - ranks[0].w[k]);
            acc_gap = d > acc_gap || d != d ? d : acc_gap;
        }
        for (int r = 0; r < RANKS && !ranks[0].skipped; r++) /* each rank's gradient holds its shard */
            for (size_t k = acc_off[r]; k < acc_off[r] + acc_n[r]; k++) {
                double d = fabs((double)accum[r].grad[k] - ranks[0].grad[k]);
                acc_grad_gap = d > acc_grad_gap || d != d ? d : acc_grad_gap;
            }
        if (memcmp(accum[0].w, accum[1].w, sizeof accum[0].w) != 0 || accum[0].skipped != accum[1].skipped)
            acc_replicas_differ++;
        if (accum[0].skipped != ranks[0].skipped)
            acc_skips_differ++;

        /* the naive scheme, each replica measured against the reference at its own weights */
        double naive_gap = 0.0;
        bool naive_skipped[RANKS];
        double naive_ref[RANKS][NPARAM];
        for (int r = 0; r < RANKS; r++)
            backward_f64(naive_w[r], step, 0, ITEMS, naive_ref[r]);
        naive_step(naive_w, step, scale, naive_grad, naive_skipped);
        for (int r = 0; r < RANKS; r++) {
            double gap = max_gap(naive_grad[r], naive_ref[r]);
            naive_gap = gap > naive_gap ? gap : naive_gap;
        }
        drift = 0.0;
        for (int k = 0; k < NPARAM; k++)
            drift = fabs(naive_w[0][k] - naive_w[1][k]) > drift ? fabs(naive_w[0][k] - naive_w[1][k]) : drift;

        /* gradacc's ranks must agree bit for bit, on the gradient and on the weights */
        double rank_diff = 0.0;
        for (int k = 0; k < NPARAM; k++) {
            double d = fabs((double)ranks[0].grad[k] - ranks[1].grad[k]);
            rank_diff = d > rank_diff || d != d ? d : rank_diff;
        }
        int identical = memcmp(ranks[0].grad, ranks[1].grad, sizeof ranks[0].grad) == 0 &&
                        memcmp(ranks[0].w, ranks[1].w, sizeof ranks[0].w) == 0 && ranks[0].skipped == ranks[1].skipped;
        if (!identical)
            failures++;

        if (ranks[0].skipped) {
            skipped_steps++;
            printf("%4d %9.5f %6.0f | %10s %10.2e %9s | %10.2e %10.2e\n", step + 1, loss, scale, "skipped", tol,
                   identical ? "0" : "DIFFER", naive_gap, drift);
            continue;
        }
        double gap = max_gap(ranks[0].grad, ref);
        if (!(gap <= tol)) {
            failures++;
            over_tol++;
        }
        worst_ratio = gap / tol > worst_ratio ? gap / tol : worst_ratio;
        worst_naive_rel = naive_gap / big > worst_naive_rel ? naive_gap / big : worst_naive_rel;
        char diff[16];
        snprintf(diff, sizeof diff, identical ? "0" : "%.2e", rank_diff);
        printf("%4d %9.5f %6.0f | %10.2e %10.2e %9s | %10.2e %10.2e%s\n", step + 1, loss, scale, gap, tol, diff,
               naive_gap, drift, gap <= tol ? "" : "  <- gradacc over tolerance");
    }

    static double scratch[NPARAM];
    double final_loss = backward_f64(ranks[0].w, STEPS - 1, 0, ITEMS, scratch);
    printf("\nverdict (final loss %.5f, %d step%s skipped for overflow):\n", final_loss, skipped_steps,
           skipped_steps == 1 ? "" : "s");
    if (over_tol)
        printf("  gradacc: gap > tol at %d step%s (worst gap/tol %.3f)\n", over_tol, over_tol == 1 ? "" : "s", worst_ratio);
    else
        printf("  gradacc: gap <= tol at every step (worst gap/tol %.3f)\n", worst_ratio);
    printf("  gradacc: ranks bitwise identical (gradients and weights) at every step: %s\n",
           failures > over_tol ? "NO" : "yes");
    printf("  naive:   gap up to %.1f%% of the gradient scale (%.0fx gradacc's tolerance); replicas drifted %.2e apart\n",
           100.0 * worst_naive_rel, worst_naive_rel / 1e-3, drift);
    double final_rs = 0.0;
    for (int k = 0; k < NPARAM; k++)
        final_rs = fmax(final_rs, fabs((double)sharded[0].w[k] - ranks[0].w[k]));
    printf("  reduce-scatter (%s wire): final weights vs the all-reduce's: max |diff| %.3g (largest at any step %.3g);\n"
           "           bitwise equal at every step: %s; its two replicas bitwise equal at every step: %s\n",
           wire == GRADACC_DTYPE_F32 ? "fp32" : "bf16", final_rs, rs_gap, rs_not_ddp ? "no" : "yes",
           rs_replicas_differ ? "NO" : "yes");
    int rs_failed = rs_replicas_differ || (wire == GRADACC_DTYPE_F32 && rs_not_ddp);
    const double acc_tol = wire == GRADACC_DTYPE_F32 ? ACC_TOL_F32 : ACC_TOL_BF16;
    printf("  sharded accumulation (%s wire): weights vs the all-reduce's: max |diff| %.3g at any step (tolerance %.0e);\n"
           "           gradients %.3g apart at most; its two replicas bitwise equal at every step: %s\n",
           wire == GRADACC_DTYPE_F32 ? "fp32" : "bf16", acc_gap, acc_tol, acc_grad_gap, acc_replicas_differ ? "NO" : "yes");
    int acc_failed = acc_replicas_differ || acc_skips_differ || !(acc_gap <= acc_tol);
    int tp_failed = tp_verdict(&tp, &ranks[0], final_loss);
    fmt_train(formats);
    int fmt_failed = fmt_verdict(formats);
    printf("%s\n", failures     ? "FAILED: gradacc missed its tolerance or its ranks differ"
                    : rs_failed  ? "FAILED: the reduce-scatter run's weights differ from the all-reduce's or between its ranks"
                    : acc_failed ? "FAILED: the sharded accumulation's weights left the all-reduce's tolerance or differ between its ranks"
                    : tp_failed  ? "FAILED: the dp x tp run left the all-reduce's bound or its ranks disagree"
                    : fmt_failed ? "FAILED: a state format's final loss left its bound or its ranks differ"
                                 : "PASS: gradacc gives the full-batch gradient on every rank; the naive scheme does not");
    failures += rs_failed + acc_failed + tp_failed + fmt_failed;

    for (int r = 0; r < RANKS; r++) {
        CHECK(gradacc_accumulator_destroy(ranks[r].acc));
        CHECK(gradacc_scaler_destroy(ranks[r].scaler));
        CHECK(gradacc_comm_destroy(comms[r]));
        CHECK(gradacc_optimizer_destroy(sharded[r].opt));
        CHECK(gradacc_accumulator_destroy(sharded[r].acc));
        CHECK(gradacc_scaler_destroy(sharded[r].scaler));
        CHECK(gradacc_comm_destroy(shard_comms[r]));
        CHECK(gradacc_optimizer_destroy(accum[r].opt));
        CHECK(gradacc_accumulator_destroy(accum[r].acc));
        CHECK(gradacc_scaler_destroy(accum[r].scaler));
        CHECK(gradacc_comm_destroy(accum_comms[r]));
    }
    tp_destroy(&tp);
    fmt_destroy(formats);
    return failures ? 1 : 0;
}
