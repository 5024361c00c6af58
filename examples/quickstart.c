/* A whole mixed-precision loop: two ranks (threads) fit y = x.w with bf16 weights and gradients, a
 * dynamic loss scale, FP32 accumulation of two micro-batches of different sizes, one all-reduce per
 * step, SGD on FP32 masters. Exits 0 when the ranks' weights are equal and the loss fell 100-fold. */
#include <gradacc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Every call returns a status; the per-thread message names the argument and the value. */
#define CHECK(call) do { gradacc_status_t s_ = (call); if (s_ != GRADACC_STATUS_OK) { \
    fprintf(stderr, "%s: %s\n", #call, gradacc_last_error()); exit(1); } } while (0)
enum { DIM = 4, STEPS = 40, EVAL = 64 };
static const float W_TRUE[DIM] = {1.0f, -2.0f, 0.5f, 3.0f};
typedef struct { gradacc_comm_t *comm; int rank; uint16_t w[DIM]; float loss0, loss; } rank_t;
/* bf16 is the top half of an f32, rounded to nearest even: C needs no 16-bit type for it. */
static uint16_t to_bf16(float f) { uint32_t u; memcpy(&u, &f, 4); return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); }
static float from_bf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
/* Feature j of item i in [-1, 1): a hash, the same in every language's quickstart. */
static float feature(int i, int j) {
    uint32_t h = (uint32_t)(DIM * i + j) * 2654435761u; return (float)(h ^ (h >> 15)) / 2147483648.0f - 1.0f; }
/* Mean loss 0.5 (x.w - x.w_true)^2 over items first..first+n-1; its gradient times `scale` into g. */
static float loss_grad(const uint16_t *w, int first, int n, float scale, uint16_t *g) {
    float sum[DIM] = {0}, loss = 0.0f;
    for (int i = first; i < first + n; i++) {
        float err = 0.0f;
        for (int j = 0; j < DIM; j++) err += feature(i, j) * (from_bf16(w[j]) - W_TRUE[j]);
        loss += 0.5f * err * err / (float)n;
        for (int j = 0; j < DIM; j++) sum[j] += err * feature(i, j) / (float)n;
    }
    for (int j = 0; g && j < DIM; j++) g[j] = to_bf16(sum[j] * scale);
    return loss;
}
static void *train(void *arg) {
    rank_t *r = arg;
    gradacc_scaler_t *scaler; gradacc_accumulator_t *acc; gradacc_optimizer_t *opt;
    gradacc_tensor_desc_t tensor = {DIM, GRADACC_DTYPE_BF16};
    gradacc_optimizer_config_t oc;
    CHECK(gradacc_scaler_create(NULL, NULL, &scaler)); /* GradScaler's defaults, on the CPU */
    CHECK(gradacc_accumulator_create(NULL, &tensor, 1, NULL, &acc)); /* mean losses, by count */
    CHECK(gradacc_optimizer_config_default(&oc));
    oc.algorithm = GRADACC_OPTIMIZER_SGD; oc.lr = 0.5f; oc.weight_decay = 0.0f;
    void *weights[1] = {r->w}; /* the FP32 masters start from these bf16 weights */
    CHECK(gradacc_optimizer_create(acc, &oc, NULL, (const void *const *)weights, NULL, 1, &opt));
    r->loss0 = loss_grad(r->w, 0, EVAL, 1.0f, NULL);
    for (int step = 0; step < STEPS; step++) {
        for (int k = 0; k < 2; k++) { /* micro-batches of 3 and 5 items, other items per rank */
            int n = k ? 5 : 3, first = 100000 * (r->rank + 1) + 8 * step + 3 * k; float scale; uint16_t g[DIM];
            CHECK(gradacc_scaler_scale(scaler, &scale));
            loss_grad(r->w, first, n, scale, g); /* the backward of (loss * scale) */
            const void *grads[1] = {g};
            CHECK(gradacc_accumulator_add(acc, scaler, grads, 1, (uint64_t)n));
        }
        gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
        CHECK(gradacc_accumulator_sync(acc, r->comm, &info)); /* all-reduce; mean over 16 items */
        const gradacc_accumulator_t *accs[1] = {acc};
        CHECK(gradacc_scaler_update(scaler, accs, 1, NULL)); /* every rank decides alike */
        CHECK(gradacc_optimizer_step(opt, acc, weights, 1, r->comm, NULL)); /* no-op on overflow */
    }
    r->loss = loss_grad(r->w, 0, EVAL, 1.0f, NULL);
    CHECK(gradacc_optimizer_destroy(opt)); CHECK(gradacc_accumulator_destroy(acc)); CHECK(gradacc_scaler_destroy(scaler));
    return NULL;
}
int main(void) {
    gradacc_comm_t *comms[2];
    rank_t ranks[2] = {{0}};
    pthread_t threads[2];
    CHECK(gradacc_comm_create_local(2, comms)); /* an in-process group: one handle per rank */
    for (int r = 0; r < 2; r++) {
        ranks[r].comm = comms[r]; ranks[r].rank = r;
        if (pthread_create(&threads[r], NULL, train, &ranks[r]) != 0) return fprintf(stderr, "pthread_create\n"), 1;
    }
    for (int r = 0; r < 2; r++) if (pthread_join(threads[r], NULL) != 0) return fprintf(stderr, "pthread_join\n"), 1;
    for (int r = 0; r < 2; r++) CHECK(gradacc_comm_destroy(comms[r]));
    int same = memcmp(ranks[0].w, ranks[1].w, sizeof ranks[0].w) == 0, fell = ranks[0].loss < ranks[0].loss0 / 100.0f;
    printf("loss %.4f -> %.6f, w[3] %g (true 3), ranks %s\n", ranks[0].loss0, ranks[0].loss,
           from_bf16(ranks[0].w[3]), same ? "equal" : "DIFFER");
    return same && fell ? 0 : 1;
}
