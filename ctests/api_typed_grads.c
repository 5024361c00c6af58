/* The typed adds, gradacc_accumulator_add_grads and gradacc_accumulator_add_tensor_grad: a
 * gradient of another dtype or length is refused, naming the tensor and both values, with the
 * master unchanged; a right one gives the bits gradacc_accumulator_add gives; under sharded
 * accumulation a refusal on one rank fails the other instead of leaving it waiting. */
#include "common.h"

enum { N0 = 5, N1 = 3 };
static const gradacc_tensor_desc_t TENSORS[2] = {{N0, GRADACC_DTYPE_F32}, {N1, GRADACC_DTYPE_F16}};

static gradacc_accumulator_t *make(void)
{
    gradacc_accumulator_t *a = NULL;
    REQUIRE_OK(gradacc_accumulator_create(NULL, TENSORS, 2, NULL, &a));
    return a;
}

/* Both tensors' masters, one after the other: N0 + N1 floats. */
static void master_of(gradacc_accumulator_t *a, float *out)
{
    for (size_t i = 0; i < 2; i++) {
        float *m = NULL;
        size_t numel = 0;
        REQUIRE_OK(gradacc_accumulator_master(a, i, &m, &numel));
        memcpy(out, m, numel * sizeof *m);
        out += numel;
    }
}

static void test_refusals_and_bits(gradacc_scaler_t *s)
{
    float g0[N0] = {1, 2, 3, 4, 5}, other[N0 + N1];
    uint16_t g1[N1] = {f32_to_f16_bits(0.5f), f32_to_f16_bits(-1.0f), f32_to_f16_bits(2.0f)};
    gradacc_accumulator_t *typed = make(), *plain = make();
    const size_t len = N0 + N1;
    float before[N0 + N1], after[N0 + N1];

    gradacc_grad_t grads[2] = {{g0, N0, GRADACC_DTYPE_F32}, {g1, N1, GRADACC_DTYPE_F16}};
    REQUIRE_OK(gradacc_accumulator_add_grads(typed, s, grads, 2, 4));
    master_of(typed, before);

    /* Another dtype, another length, NULL data: refused, nothing added. */
    gradacc_grad_t wrong[2] = {{g0, N0, GRADACC_DTYPE_F32}, {g0, N1, GRADACC_DTYPE_F32}};
    EXPECT_ERROR(gradacc_accumulator_add_grads(typed, s, wrong, 2, 4), GRADACC_STATUS_DTYPE_MISMATCH,
                 "`grads[1].dtype` is f32, but tensor 1 is declared f16");
    gradacc_grad_t shorter[2] = {{g0, N0 - 1, GRADACC_DTYPE_F32}, {g1, N1, GRADACC_DTYPE_F16}};
    EXPECT_ERROR(gradacc_accumulator_add_grads(typed, s, shorter, 2, 4), GRADACC_STATUS_SIZE_MISMATCH,
                 "`grads[0].numel` = 4, but tensor 0 has 5 elements");
    gradacc_grad_t null_data[2] = {{NULL, N0, GRADACC_DTYPE_F32}, {g1, N1, GRADACC_DTYPE_F16}};
    EXPECT_ERROR(gradacc_accumulator_add_grads(typed, s, null_data, 2, 4), GRADACC_STATUS_NULL_ARGUMENT,
                 "`grads[0].data`");
    EXPECT_ERROR(gradacc_accumulator_add_grads(typed, s, grads, 1, 4), GRADACC_STATUS_SIZE_MISMATCH, "`n` = 1");
    EXPECT_ERROR(gradacc_accumulator_add_grads(typed, s, NULL, 2, 4), GRADACC_STATUS_NULL_ARGUMENT, "`grads`");
    gradacc_grad_t bad_code[2] = {{g0, N0, 9}, {g1, N1, GRADACC_DTYPE_F16}};
    EXPECT_ERROR(gradacc_accumulator_add_grads(typed, s, bad_code, 2, 4), GRADACC_STATUS_INVALID_ARGUMENT,
                 "grads[0].dtype");
    master_of(typed, after);
    CHECK(memcmp(before, after, len * sizeof(float)) == 0, "a refused add changed the master");

    /* The same bits as the untyped add, whole and tensor by tensor. */
    const void *raw[2] = {g0, g1};
    REQUIRE_OK(gradacc_accumulator_add(plain, s, raw, 2, 4));
    master_of(plain, other);
    CHECK(memcmp(before, other, len * sizeof(float)) == 0, "typed and untyped adds differ");

    REQUIRE_OK(gradacc_accumulator_begin_microbatch(typed, 2));
    REQUIRE_OK(gradacc_accumulator_begin_microbatch(plain, 2));
    EXPECT_ERROR(gradacc_accumulator_add_tensor_grad(typed, s, 1, &wrong[1]), GRADACC_STATUS_DTYPE_MISMATCH,
                 "`grad.dtype` is f32, but tensor 1 is declared f16");
    EXPECT_ERROR(gradacc_accumulator_add_tensor_grad(typed, s, 0, &shorter[0]), GRADACC_STATUS_SIZE_MISMATCH,
                 "`grad.numel` = 4, but tensor 0 has 5 elements");
    EXPECT_ERROR(gradacc_accumulator_add_tensor_grad(typed, s, 2, &grads[0]), GRADACC_STATUS_INVALID_ARGUMENT,
                 "`index` = 2");
    EXPECT_ERROR(gradacc_accumulator_add_tensor_grad(typed, s, 0, NULL), GRADACC_STATUS_NULL_ARGUMENT, "`grad`");
    for (size_t i = 0; i < 2; i++) {
        REQUIRE_OK(gradacc_accumulator_add_tensor_grad(typed, s, i, &grads[i]));
        REQUIRE_OK(gradacc_accumulator_add_tensor(plain, s, i, raw[i], TENSORS[i].numel));
    }
    REQUIRE_OK(gradacc_accumulator_end_microbatch(typed));
    REQUIRE_OK(gradacc_accumulator_end_microbatch(plain));
    master_of(typed, after);
    master_of(plain, other);
    CHECK(memcmp(after, other, len * sizeof(float)) == 0, "typed and untyped add_tensor differ");
    EXPECT_OK(gradacc_accumulator_destroy(typed));
    EXPECT_OK(gradacc_accumulator_destroy(plain));
}

/* Two ranks of a sharded accumulation; rank 1 passes an f32 buffer for the f16 tensor. */
typedef struct {
    gradacc_comm_t *comm;
    int rank;
    gradacc_status_t status;
} rank_t;

static void *sharded_rank(void *arg)
{
    rank_t *r = arg;
    gradacc_accumulator_config_t ac;
    gradacc_scaler_t *s = NULL;
    gradacc_accumulator_t *a = NULL;
    REQUIRE_OK(gradacc_accumulator_config_default(&ac));
    ac.sharding = GRADACC_SHARDING_ACCUMULATE;
    ac.shard_count = 2;
    ac.shard_rank = (uint32_t)r->rank;
    REQUIRE_OK(gradacc_scaler_create(NULL, NULL, &s));
    REQUIRE_OK(gradacc_accumulator_create_sharded(&ac, TENSORS, 2, NULL, r->comm, &a));
    float g0[N0] = {1, 2, 3, 4, 5};
    uint16_t g1[N1] = {0};
    gradacc_grad_t grads[2] = {{g0, N0, GRADACC_DTYPE_F32}, {g1, N1, GRADACC_DTYPE_F16}};
    if (r->rank == 1)
        grads[1] = (gradacc_grad_t){g0, N1, GRADACC_DTYPE_F32};
    r->status = gradacc_accumulator_add_grads(a, s, grads, 2, 1);
    EXPECT_OK(gradacc_accumulator_destroy(a));
    EXPECT_OK(gradacc_scaler_destroy(s));
    return NULL;
}

static void test_a_sharded_refusal_fails_every_rank(void)
{
    gradacc_comm_t *comms[2];
    REQUIRE_OK(gradacc_comm_create_local(2, comms));
    rank_t ranks[2];
    for (int r = 0; r < 2; r++) {
        EXPECT_OK(gradacc_comm_set_timeout(comms[r], 60.0)); /* a hang fails, not blocks CI */
        ranks[r] = (rank_t){comms[r], r, GRADACC_STATUS_OK};
    }
    run_ranks(2, sharded_rank, ranks, sizeof ranks[0]);
    CHECK(ranks[1].status == GRADACC_STATUS_DTYPE_MISMATCH, "rank 1: %d", (int)ranks[1].status);
    CHECK(ranks[0].status == GRADACC_STATUS_PEER_FAILURE, "rank 0: %d (%s)", (int)ranks[0].status,
          gradacc_status_string(ranks[0].status));
    for (int r = 0; r < 2; r++)
        EXPECT_OK(gradacc_comm_destroy(comms[r]));
}

int main(void)
{
    gradacc_scaler_t *s = NULL;
    REQUIRE_OK(gradacc_scaler_create(NULL, NULL, &s));
    test_refusals_and_bits(s);
    EXPECT_OK(gradacc_scaler_destroy(s));
    test_a_sharded_refusal_fails_every_rank();
    return test_finish();
}
