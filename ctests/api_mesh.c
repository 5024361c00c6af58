/* The mesh step through the C API: gradacc_mesh_sync on the dp 2 x tp 2 case of mesh_case.h,
 * each rank a thread, each accumulator reduced over its data-parallel group ({0, 2} and {1, 3}).
 * The job's total_count is 14 (not 28), the global norm the f64 reference's with the replicated
 * tensor once, and the info the same bits on every rank. An inf on world rank 3 skips the step on
 * every rank, naming world rank 3 and its part. Bad arguments fail with their status and a
 * message naming the argument on the rank that gave them, and PEER_FAILURE on the others,
 * without hanging (timeouts of 10 s would end a wait): NULL parts and a struct_size of 0 on every
 * rank (no group can be named, so every rank errs alike), a NULL accumulator on one rank, a NULL
 * replicated array with a count on one rank; tp peers that count differently fail on every rank
 * naming them. After the argument errors the windows are intact: the next sync gives the first
 * sync's info bit for bit. Under DROP_MICROBATCH, each micro-batch ended by
 * gradacc_mesh_end_microbatch: a NULL accumulator on rank 1 fails every rank with the micro-batch
 * still open; then an inf in micro-batch 1 on world rank 3 drops it on its tp peer, rank 2, too,
 * and the step goes ahead on 10 items in 3 micro-batches, the same info on every rank.
 * Also: mesh creation's argument checks and a NULL and double destroy. */
#include "mesh_case.h"

enum { RANKS = TP * DP };

/* The cases every rank runs, in order. */
enum { GOOD, INF, NULL_PARTS, SIZE_ZERO, NULL_ACC, NULL_REPLICATED, AGAIN, UNEQUAL, DROP, CASES };

typedef struct {
    int rank;
    gradacc_comm_t *world, *data;
    gradacc_status_t st[CASES];
    gradacc_sync_info_t info[CASES];
    uint32_t overflow_part[CASES];
    char error[CASES][512];
    gradacc_status_t end_null; /* gradacc_mesh_end_microbatch with rank 1's accumulator NULL */
    char end_null_error[512];
    uint32_t kept[MB];
} rank_args;

static void run_case(rank_args *a, int c, gradacc_mesh_t *mesh, const gradacc_mesh_part_t *parts, size_t n)
{
    a->overflow_part[c] = 7;
    a->info[c] = (gradacc_sync_info_t)GRADACC_SYNC_INFO_INIT;
    a->st[c] = gradacc_mesh_sync(mesh, parts, n, &a->info[c], &a->overflow_part[c]);
    snprintf(a->error[c], sizeof a->error[c], "%s", a->st[c] ? gradacc_last_error() : "");
}

static void drop_window(rank_args *a, gradacc_mesh_t *mesh, gradacc_scaler_t *scaler)
{
    gradacc_accumulator_config_t ac;
    REQUIRE_OK(gradacc_accumulator_config_default(&ac));
    ac.loss_reduction = GRADACC_LOSS_REDUCTION_SUM;
    ac.tensor_stats = 1;
    ac.overflow = GRADACC_OVERFLOW_DROP_MICROBATCH;
    gradacc_tensor_desc_t t[2] = {{N0, GRADACC_DTYPE_F32}, {N1, GRADACC_DTYPE_F32}};
    gradacc_accumulator_t *acc = NULL;
    REQUIRE_OK(gradacc_accumulator_create(&ac, t, 2, NULL, &acc));
    int d = a->rank / TP, tp = a->rank % TP;
    for (int mb = 0; mb < MB; mb++) {
        float g0[N0], g1[N1];
        for (int j = 0; j < N0; j++)
            g0[j] = (float)value(d, mb, tp, 0, j);
        for (int j = 0; j < N1; j++)
            g1[j] = (float)value(d, mb, tp, 1, j);
        if (a->rank == 3 && mb == 1)
            g0[2] = INFINITY;
        REQUIRE_OK(gradacc_accumulator_begin_microbatch(acc, counts[d][mb]));
        REQUIRE_OK(gradacc_accumulator_add_tensor(acc, scaler, 0, g0, N0));
        REQUIRE_OK(gradacc_accumulator_add_tensor(acc, scaler, 1, g1, N1));
        if (mb == 0) {
            gradacc_accumulator_t *mine = a->rank == 1 ? NULL : acc;
            a->end_null = gradacc_mesh_end_microbatch(mesh, &mine, 1, NULL);
            snprintf(a->end_null_error, sizeof a->end_null_error, "%s", gradacc_last_error());
        }
        REQUIRE_OK(gradacc_mesh_end_microbatch(mesh, &acc, 1, &a->kept[mb]));
    }
    gradacc_mesh_part_t part = GRADACC_MESH_PART_INIT;
    part.accumulator = acc;
    part.comm = a->data;
    part.replicated = &mesh_case_norm;
    part.replicated_count = 1;
    run_case(a, DROP, mesh, &part, 1);
    REQUIRE_OK(gradacc_accumulator_destroy(acc));
}

static void *rank_main(void *arg)
{
    rank_args *a = arg;
    gradacc_scaler_t *scaler = scaler_with_scale(1.0f);
    gradacc_accumulator_t *acc = mesh_case_accumulator();
    gradacc_mesh_t *mesh = NULL;
    REQUIRE_OK(gradacc_mesh_create(a->world, (uint32_t)(a->rank / TP), DP, 0.0f, &mesh));

    gradacc_mesh_part_t part = GRADACC_MESH_PART_INIT;
    part.accumulator = acc;
    part.comm = a->data;
    part.replicated = &mesh_case_norm;
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
    drop_window(a, mesh, scaler);

    REQUIRE_OK(gradacc_mesh_destroy(mesh));
    REQUIRE_OK(gradacc_accumulator_destroy(acc));
    gradacc_scaler_destroy(scaler);
    return NULL;
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

        const gradacc_sync_info_t *dr = &args[r].info[DROP];
        EXPECT_OK(args[r].st[DROP]);
        CHECK(dr->total_count == 10 && dr->microbatches == 3 && dr->dropped_microbatches == 1 && !dr->found_inf &&
                  dr->overflow_at == GRADACC_OVERFLOW_AT_GRADIENT && dr->overflow_rank == 3 &&
                  dr->overflow_microbatch == 1,
              "rank %d: the drop's count %llu, mb %llu, dropped %llu, found_inf %d", r,
              (unsigned long long)dr->total_count, (unsigned long long)dr->microbatches,
              (unsigned long long)dr->dropped_microbatches, (int)dr->found_inf);
        CHECK(args[r].kept[0] == 1 && args[r].kept[1] == (r < 2), "rank %d: kept %u %u", r, args[r].kept[0],
              args[r].kept[1]);
        CHECK(same_info(dr, &args[0].info[DROP]), "rank %d: the drop's info differs from rank 0's", r);
        gradacc_status_t want = r == 1 ? GRADACC_STATUS_NULL_ARGUMENT : GRADACC_STATUS_PEER_FAILURE;
        const char *says = r == 1 ? "argument `accumulators[0]` is NULL" : "micro-batch is still open";
        CHECK(args[r].end_null == want && strstr(args[r].end_null_error, says) != NULL,
              "rank %d: end_microbatch with a NULL accumulator on rank 1: %d %s", r, (int)args[r].end_null,
              args[r].end_null_error);

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
