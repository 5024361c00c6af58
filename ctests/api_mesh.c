/* The mesh step through the C API: gradacc_mesh_sync on dp 2 x tp 2 in-process ranks (one thread
 * each), in Megatron-Core's order (tp fastest: world rank = tp + 2 * dp, data rank = dp). Each rank
 * holds one dense accumulator, reduced over its data-parallel group ({0, 2} and {1, 3}), with a
 * tensor sharded over tp (different elements on each tp rank) and one replicated over tp (the
 * same values on both tp peers), declared so (tensor_stats on).
 *
 * Values: two micro-batches per data rank (3 and 5 items at data rank 0, 2 and 4 at data rank 1),
 * f32 gradients of eighths, a sum loss normalised by the count. The job's total_count is the sum
 * over the data ranks only (14, not 28), the global norm that of an f64 reference counting every
 * distinct element once (the replicated tensor once, not twice), and the info is the same bits on
 * every rank. An inf on world rank 3 skips the step on every rank, naming world rank 3 and its
 * part. Bad arguments fail with their status and a message naming the argument on the rank that
 * gave them, and PEER_FAILURE on the others, without hanging (timeouts of 10 s would end a wait):
 * NULL parts and a struct_size of 0 on every rank (no group can be named, so every rank errs
 * alike), a NULL accumulator on one rank, a NULL replicated array with a count on one rank; tp peers that count differently fail on every rank naming them. After the
 * argument errors the windows are intact: the next sync gives the first sync's info bit for bit.
 * Also: mesh creation's argument checks and a NULL and double destroy. */
#include "common.h"

enum { RANKS = 4, TP = 2, DP = 2, N0 = 6, N1 = 3, MB = 2 };

static const uint64_t counts[DP][MB] = {{3, 5}, {2, 4}};

/* The gradient of element j of tensor t (0: tp-sharded, 1: replicated) in micro-batch mb at data
 * rank d and tp rank tp: an eighth, exact in f32. */
static double value(int d, int mb, int tp, int t, int j)
{
    int k = d * 7 + mb * 3 + (t == 0 ? tp * 5 : 0) + t * 11 + j;
    return (double)(k % 9 - 4) / 8.0;
}

/* The cases every rank runs, in order. */
enum { GOOD, INF, NULL_PARTS, SIZE_ZERO, NULL_ACC, NULL_REPLICATED, AGAIN, UNEQUAL, CASES };

typedef struct {
    int rank;
    gradacc_comm_t *world, *data;
    gradacc_status_t st[CASES];
    gradacc_sync_info_t info[CASES];
    uint32_t overflow_part[CASES];
    char error[CASES][512];
} rank_args;

static void add_window(gradacc_accumulator_t *acc, gradacc_scaler_t *scaler, int rank, int poison)
{
    int d = rank / TP, tp = rank % TP;
    float g0[N0], g1[N1];
    for (int mb = 0; mb < MB; mb++) {
        for (int j = 0; j < N0; j++)
            g0[j] = (float)value(d, mb, tp, 0, j);
        for (int j = 0; j < N1; j++)
            g1[j] = (float)value(d, mb, tp, 1, j);
        if (poison && mb == 1)
            g0[2] = INFINITY;
        const void *grads[2] = {g0, g1};
        REQUIRE_OK(gradacc_accumulator_add(acc, scaler, grads, 2, counts[d][mb]));
    }
}

static void run_case(rank_args *a, int c, gradacc_mesh_t *mesh, const gradacc_mesh_part_t *parts, size_t n)
{
    a->overflow_part[c] = 7;
    a->info[c] = (gradacc_sync_info_t)GRADACC_SYNC_INFO_INIT;
    a->st[c] = gradacc_mesh_sync(mesh, parts, n, &a->info[c], &a->overflow_part[c]);
    snprintf(a->error[c], sizeof a->error[c], "%s", a->st[c] ? gradacc_last_error() : "");
}

static void *rank_main(void *arg)
{
    rank_args *a = arg;
    gradacc_scaler_t *scaler = scaler_with_scale(1.0f);
    gradacc_accumulator_config_t ac;
    REQUIRE_OK(gradacc_accumulator_config_default(&ac));
    ac.loss_reduction = GRADACC_LOSS_REDUCTION_SUM;
    ac.tensor_stats = 1;
    gradacc_tensor_desc_t t[2] = {{N0, GRADACC_DTYPE_F32}, {N1, GRADACC_DTYPE_F32}};
    gradacc_accumulator_t *acc = NULL;
    REQUIRE_OK(gradacc_accumulator_create(&ac, t, 2, NULL, &acc));
    gradacc_mesh_t *mesh = NULL;
    REQUIRE_OK(gradacc_mesh_create(a->world, (uint32_t)(a->rank / TP), DP, 0.0f, &mesh));

    gradacc_replicated_t norm = {.tensor = 1, .copies = TP, .key = 0x6e6f726d};
    gradacc_mesh_part_t part = GRADACC_MESH_PART_INIT;
    part.accumulator = acc;
    part.comm = a->data;
    part.replicated = &norm;
    part.replicated_count = 1;

    add_window(acc, scaler, a->rank, 0);
    run_case(a, GOOD, mesh, &part, 1);
    add_window(acc, scaler, a->rank, a->rank == 3);
    run_case(a, INF, mesh, &part, 1);

    add_window(acc, scaler, a->rank, 0);
    run_case(a, NULL_PARTS, mesh, NULL, 1);
    gradacc_mesh_part_t bad = part;
    bad.struct_size = 0;
    run_case(a, SIZE_ZERO, mesh, &bad, 1);
    bad = part;
    if (a->rank == 1)
        bad.accumulator = NULL;
    run_case(a, NULL_ACC, mesh, &bad, 1);
    bad = part;
    if (a->rank == 2)
        bad.replicated = NULL;
    run_case(a, NULL_REPLICATED, mesh, &bad, 1);
    run_case(a, AGAIN, mesh, &part, 1);

    add_window(acc, scaler, a->rank, 0);
    if (a->rank == 1) {
        float g0[N0] = {0}, g1[N1] = {0};
        const void *grads[2] = {g0, g1};
        REQUIRE_OK(gradacc_accumulator_add(acc, scaler, grads, 2, 1));
    }
    run_case(a, UNEQUAL, mesh, &part, 1);

    REQUIRE_OK(gradacc_mesh_destroy(mesh));
    REQUIRE_OK(gradacc_accumulator_destroy(acc));
    gradacc_scaler_destroy(scaler);
    return NULL;
}

/* The f64 global norm of the normalised gradient: each tp shard of tensor 0 and tensor 1 once. */
static double reference_norm(void)
{
    double total = 0, squares = 0;
    for (int d = 0; d < DP; d++)
        for (int mb = 0; mb < MB; mb++)
            total += (double)counts[d][mb];
    for (int tp = 0; tp < TP; tp++)
        for (int t = 0; t < 2; t++) {
            if (t == 1 && tp > 0)
                continue; /* the replicated tensor, once */
            for (int j = 0; j < (t == 0 ? N0 : N1); j++) {
                double g = 0;
                for (int d = 0; d < DP; d++)
                    for (int mb = 0; mb < MB; mb++)
                        g += value(d, mb, tp, t, j);
                g /= total;
                squares += g * g;
            }
        }
    return sqrt(squares);
}

static void check_creation(gradacc_comm_t *world)
{
    gradacc_mesh_t *mesh = (gradacc_mesh_t *)0x1;
    EXPECT_ERROR(gradacc_mesh_create(NULL, 0, 2, 0.0f, &mesh), GRADACC_STATUS_NULL_ARGUMENT, "`world`");
    EXPECT_ERROR(gradacc_mesh_create(world, 2, 2, 0.0f, &mesh), GRADACC_STATUS_INVALID_ARGUMENT,
                 "`data_rank` = 2 is not below `data_size` = 2");
    EXPECT_ERROR(gradacc_mesh_create(world, 0, 3, 0.0f, &mesh), GRADACC_STATUS_INVALID_ARGUMENT,
                 "`data_size` = 3 does not divide");
    EXPECT_ERROR(gradacc_mesh_create(world, 0, 2, -1.0f, &mesh), GRADACC_STATUS_INVALID_ARGUMENT,
                 "`max_grad_norm` = -1");
    EXPECT_ERROR(gradacc_mesh_create(world, 0, 2, 0.0f, NULL), GRADACC_STATUS_NULL_ARGUMENT, "`out_mesh`");
    CHECK(mesh == (gradacc_mesh_t *)0x1, "a failed create leaves *out_mesh alone");
    EXPECT_OK(gradacc_mesh_destroy(NULL));
    REQUIRE_OK(gradacc_mesh_create(world, 0, 2, 1.0f, &mesh));
    EXPECT_OK(gradacc_mesh_destroy(mesh));
    EXPECT_ERROR(gradacc_mesh_destroy(mesh), GRADACC_STATUS_INVALID_HANDLE, "`mesh`");
    EXPECT_ERROR(gradacc_mesh_sync(mesh, NULL, 0, NULL, NULL), GRADACC_STATUS_INVALID_HANDLE, "`mesh`");
}

/* Every field the same bits (the padding is not compared). */
static int same_info(const gradacc_sync_info_t *x, const gradacc_sync_info_t *y)
{
    return x->found_inf == y->found_inf && x->total_count == y->total_count && x->microbatches == y->microbatches &&
           memcmp(&x->grad_norm, &y->grad_norm, sizeof x->grad_norm) == 0 &&
           memcmp(&x->clip_coef, &y->clip_coef, sizeof x->clip_coef) == 0 &&
           x->dropped_microbatches == y->dropped_microbatches && x->overflow_at == y->overflow_at &&
           x->overflow_rank == y->overflow_rank && x->overflow_microbatch == y->overflow_microbatch &&
           x->overflow_tensor == y->overflow_tensor;
}

/* Every rank failed with `want`, except `rank` (-1: none), which failed with `own` naming `text`. */
static void expect_failed(const rank_args *args, int c, const char *what, int rank, gradacc_status_t own,
                          const char *text, gradacc_status_t want, const char *want_text)
{
    for (int r = 0; r < RANKS; r++) {
        gradacc_status_t st = r == rank ? own : want;
        const char *t = r == rank ? text : want_text;
        CHECK(args[r].st[c] == st && strstr(args[r].error[c], t) != NULL,
              "%s, rank %d: status %d (want %d), error \"%s\" (want \"%s\")", what, r, (int)args[r].st[c], (int)st,
              args[r].error[c], t);
        CHECK(args[r].overflow_part[c] == 7, "%s, rank %d: overflow_part written on failure", what, r);
    }
}

int main(void)
{
    gradacc_comm_t *world[RANKS], *data[TP][DP];
    REQUIRE_OK(gradacc_comm_create_local(RANKS, world));
    for (int tp = 0; tp < TP; tp++)
        REQUIRE_OK(gradacc_comm_create_local(DP, data[tp]));
    check_creation(world[0]);
    static rank_args args[RANKS];
    for (int r = 0; r < RANKS; r++) {
        args[r].rank = r;
        args[r].world = world[r];
        args[r].data = data[r % TP][r / TP];
        REQUIRE_OK(gradacc_comm_set_timeout(args[r].world, 10.0));
        REQUIRE_OK(gradacc_comm_set_timeout(args[r].data, 10.0));
    }
    run_ranks(RANKS, rank_main, args, sizeof args[0]);

    double norm = reference_norm();
    for (int r = 0; r < RANKS; r++) {
        const gradacc_sync_info_t *i = &args[r].info[GOOD];
        EXPECT_OK(args[r].st[GOOD]);
        CHECK(i->total_count == 14 && i->microbatches == DP * MB && !i->found_inf, "rank %d: count %llu, mb %llu",
              r, (unsigned long long)i->total_count, (unsigned long long)i->microbatches);
        CHECK_CLOSE(i->grad_norm, norm, 1e-6 * norm, "rank %d: the global norm", r);
        CHECK(i->overflow_at == GRADACC_OVERFLOW_AT_NONE && args[r].overflow_part[GOOD] == UINT32_MAX,
              "rank %d: overflow_at %d part %u", r, (int)i->overflow_at, args[r].overflow_part[GOOD]);
        CHECK(same_info(i, &args[0].info[GOOD]), "rank %d: the info differs from rank 0's", r);

        const gradacc_sync_info_t *f = &args[r].info[INF];
        EXPECT_OK(args[r].st[INF]);
        CHECK(f->found_inf && f->overflow_at == GRADACC_OVERFLOW_AT_GRADIENT && f->overflow_rank == 3 &&
                  f->overflow_tensor == 0 && args[r].overflow_part[INF] == 0,
              "rank %d: found_inf %d at %d rank %llu tensor %llu part %u", r, (int)f->found_inf, (int)f->overflow_at,
              (unsigned long long)f->overflow_rank, (unsigned long long)f->overflow_tensor,
              args[r].overflow_part[INF]);
        CHECK(same_info(f, &args[0].info[INF]), "rank %d: the inf info differs from rank 0's", r);

        EXPECT_OK(args[r].st[AGAIN]);
        CHECK(same_info(&args[r].info[AGAIN], i),
              "rank %d: after the refused calls the window was not intact", r);
    }
    expect_failed(args, NULL_PARTS, "NULL parts", -1, 0, "", GRADACC_STATUS_NULL_ARGUMENT,
                  "gradacc_mesh_sync: argument `parts` is NULL");
    expect_failed(args, SIZE_ZERO, "struct_size 0", -1, 0, "", GRADACC_STATUS_INVALID_ARGUMENT,
                  "`parts[0]`.struct_size = 0");
    expect_failed(args, NULL_ACC, "NULL accumulator", 1, GRADACC_STATUS_NULL_ARGUMENT,
                  "argument `parts[0].accumulator` is NULL", GRADACC_STATUS_PEER_FAILURE, "no rank reduced");
    expect_failed(args, NULL_REPLICATED, "NULL replicated", 2, GRADACC_STATUS_NULL_ARGUMENT,
                  "argument `parts[0].replicated` is NULL", GRADACC_STATUS_PEER_FAILURE, "no rank reduced");
    expect_failed(args, UNEQUAL, "unequal counts", -1, 0, "", GRADACC_STATUS_INVALID_ARGUMENT,
                  "world ranks 0 and 1 share data-parallel rank 0");

    for (int r = 0; r < RANKS; r++)
        EXPECT_OK(gradacc_comm_destroy(world[r]));
    for (int tp = 0; tp < TP; tp++)
        for (int d = 0; d < DP; d++)
            EXPECT_OK(gradacc_comm_destroy(data[tp][d]));
    return test_finish();
}
