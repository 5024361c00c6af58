/* Seed apex-o2-ddp-accumulation-bug.md: Linear(1,1), loss = mean(output), two ranks with inputs
 * 1.0 and 2.0, two micro-batches each, loss scale 1. With Apex O2 and the all-reduce skipped on
 * the first micro-batch, only the last micro-batch's fp16 model grads are averaged while the FP32
 * master grads accumulate locally: rank 0 steps with weight grad 2.5, rank 1 with 3.5.
 * gradacc reduces the accumulated FP32 master once, at the boundary: both ranks hold bitwise
 * identical gradients, weight 3.0 / bias 2.0 (sum over micro-batches, mean over ranks, as DDP
 * without loss division) or 1.5 / 1.0 (divided by the 4 micro-batches). */
#include "common.h"

enum { RANKS = 2, MICROBATCHES = 2 };

typedef struct {
    gradacc_comm_t *comm;
    gradacc_normalize_t normalize;
    gradacc_dtype_t dtype;
    double input;
    float weight_grad, bias_grad;
    gradacc_sync_info_t info;
    gradacc_status_t status;
} rank_args;

/* d(mean(w*x + b))/dw = x, d/db = 1, for one item. */
static void *rank_main(void *p)
{
    rank_args *a = p;
    gradacc_scaler_t *scaler = scaler_with_scale(1.0f);
    gradacc_accumulator_config_t ac;
    REQUIRE_OK(gradacc_accumulator_config_default(&ac));
    ac.normalize = a->normalize;
    gradacc_tensor_desc_t t[2] = {{1, a->dtype}, {1, a->dtype}};
    gradacc_accumulator_t *acc = NULL;
    REQUIRE_OK(gradacc_accumulator_create(&ac, t, 2, NULL, &acc));

    const double grads[2] = {a->input, 1.0};
    grad_buf w = grad_alloc(a->dtype, 1), b = grad_alloc(a->dtype, 1);
    for (int m = 0; m < MICROBATCHES; m++) {
        float scale;
        REQUIRE_OK(gradacc_scaler_scale(scaler, &scale));
        grad_encode(&w, &grads[0], scale, NULL);
        grad_encode(&b, &grads[1], scale, NULL);
        const void *g[2] = {w.data, b.data};
        REQUIRE_OK(gradacc_accumulator_add(acc, scaler, g, 2, 1));
    }
    a->info.struct_size = sizeof a->info;
    a->status = gradacc_accumulator_sync(acc, a->comm, &a->info);
    if (a->status == GRADACC_STATUS_OK) {
        float *p0 = NULL, *p1 = NULL;
        size_t n0 = 0, n1 = 0;
        REQUIRE_OK(gradacc_accumulator_master(acc, 0, &p0, &n0));
        REQUIRE_OK(gradacc_accumulator_master(acc, 1, &p1, &n1));
        a->weight_grad = *p0;
        a->bias_grad = *p1;
    }
    grad_free(&w);
    grad_free(&b);
    gradacc_accumulator_destroy(acc);
    gradacc_scaler_destroy(scaler);
    return NULL;
}

static void run(gradacc_normalize_t normalize, gradacc_dtype_t dtype, float want_w, float want_b)
{
    gradacc_comm_t *comms[RANKS];
    REQUIRE_OK(gradacc_comm_create_local(RANKS, comms));
    rank_args args[RANKS];
    memset(args, 0, sizeof args);
    for (int r = 0; r < RANKS; r++) {
        args[r].comm = comms[r];
        args[r].normalize = normalize;
        args[r].dtype = dtype;
        args[r].input = r == 0 ? 1.0 : 2.0;
    }
    run_ranks(RANKS, rank_main, args, sizeof args[0]);
    const char *how = normalize == GRADACC_NORMALIZE_BY_WORLD ? "BY_WORLD" : "BY_MICROBATCHES";
    for (int r = 0; r < RANKS; r++) {
        EXPECT_OK(args[r].status);
        CHECK(args[r].weight_grad == want_w && args[r].bias_grad == want_b,
              "%s %s rank %d: weight grad %.9g bias grad %.9g, expected %g and %g", how, dtype_name(dtype), r,
              args[r].weight_grad, args[r].bias_grad, want_w, want_b);
        CHECK(!args[r].info.found_inf && args[r].info.total_count == 4 && args[r].info.microbatches == 4,
              "rank %d info: found_inf %d total_count %llu microbatches %llu", r, args[r].info.found_inf,
              (unsigned long long)args[r].info.total_count, (unsigned long long)args[r].info.microbatches);
    }
    CHECK(memcmp(&args[0].weight_grad, &args[1].weight_grad, sizeof(float)) == 0 &&
              memcmp(&args[0].bias_grad, &args[1].bias_grad, sizeof(float)) == 0,
          "ranks differ bitwise (%s %s)", how, dtype_name(dtype));
    CHECK(args[0].info.found_inf == args[1].info.found_inf && args[0].info.total_count == args[1].info.total_count &&
              args[0].info.microbatches == args[1].info.microbatches && args[0].info.grad_norm == args[1].info.grad_norm,
          "ranks' sync info differs");
    for (int r = 0; r < RANKS; r++)
        EXPECT_OK(gradacc_comm_destroy(comms[r]));
}

/* What Apex O2 + DDP with require_backward_grad_sync off on the first micro-step computes (the
 * seed's printout): the first micro-batch's fp16 grads go to the local master unreduced, the last
 * micro-batch's are averaged over ranks first. */
static void naive(double out_weight[RANKS])
{
    const double input[RANKS] = {1.0, 2.0};
    for (int r = 0; r < RANKS; r++) {
        double master = 0.0;
        for (int m = 0; m < MICROBATCHES; m++) {
            double model_grad = input[r];
            if (m == MICROBATCHES - 1) { /* sync on: DDP averages the model grads */
                double sum = 0.0;
                for (int q = 0; q < RANKS; q++)
                    sum += input[q];
                model_grad = sum / RANKS;
            }
            master += model_grad;
        }
        out_weight[r] = master;
    }
}

int main(void)
{
    static const gradacc_dtype_t dtypes[3] = {GRADACC_DTYPE_F16, GRADACC_DTYPE_BF16, GRADACC_DTYPE_F32};
    for (int d = 0; d < 3; d++) {
        run(GRADACC_NORMALIZE_BY_WORLD, dtypes[d], 3.0f, 2.0f);
        run(GRADACC_NORMALIZE_BY_MICROBATCHES, dtypes[d], 1.5f, 1.0f);
    }

    double w[RANKS];
    naive(w);
    CHECK(w[0] == 2.5 && w[1] == 3.5, "naive scheme: rank 0 %g, rank 1 %g; the seed shows 2.5 and 3.5", w[0], w[1]);
    CHECK(w[0] != w[1], "the naive scheme's ranks should disagree");
    printf("naive Apex O2 scheme: rank 0 weight grad %.1f, rank 1 %.1f (ranks diverge)\n", w[0], w[1]);
    printf("gradacc:              both ranks 3.0 (BY_WORLD), 1.5 (BY_MICROBATCHES), bitwise equal\n");
    return test_finish();
}
