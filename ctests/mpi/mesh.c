/* mpi-np: 4 */
/* The mesh step over MPI: the dp 2 x tp 2 case of mesh_case.h on 4 processes, every group made
 * by gradacc's mesh shape (the data-parallel groups {0, 2} and {1, 3} split from the world). The
 * shape's groups are checked against MPI_Comm_split by hand, and its argument errors. The job's
 * total is 14 (not 28); every element each rank holds equals the f64 reference within an f32
 * rounding; the norm is the f64 global norm with the replicated tensor once, the same bits on
 * every rank. An inf on world rank 3 skips the step everywhere naming world rank 3 and part 0;
 * tp peers that count differently fail on every rank with INVALID_ARGUMENT naming both ranks; and
 * a rank that never calls ends the others at their 2 s timeout with TIMEOUT. */
#include "mesh_case.h"
#include "mpi/mpi_common.h"

/* The shape's groups against MPI's own split, and its argument errors. */
static void check_shape(const gradacc_mesh_shape_t *shape, int rank)
{
    uint32_t color = 99, key = 99, size = 99;
    REQUIRE_OK(gradacc_mesh_shape_group(shape, (uint32_t)rank, "cp-dp", &color, &key, &size));
    CHECK(color == (uint32_t)(rank % TP) && key == (uint32_t)(rank / TP) && size == DP,
          "rank %d: data group color %u key %u size %u", rank, color, key, size);
    REQUIRE_OK(gradacc_mesh_shape_group(shape, (uint32_t)rank, "tp", &color, &key, NULL));
    CHECK(color == (uint32_t)(rank / TP * TP) && key == (uint32_t)(rank % TP), "rank %d: tp color %u key %u",
          rank, color, key);
    /* The same group as MPI_Comm_split by hand: tp peers share a color. */
    MPI_Comm by_hand;
    MPI_Comm_split(MPI_COMM_WORLD, (int)color, (int)key, &by_hand);
    int r = -1;
    MPI_Comm_rank(by_hand, &r);
    CHECK(r == (int)key, "rank %d: MPI ranks it %d in its tp group, the shape %u", rank, r, key);
    MPI_Comm_free(&by_hand);

    EXPECT_ERROR(gradacc_mesh_shape_group(shape, 4, "tp", &color, NULL, NULL), GRADACC_STATUS_INVALID_ARGUMENT,
                 "`rank` = 4 is not below the mesh's 4 ranks");
    EXPECT_ERROR(gradacc_mesh_shape_group(shape, 0, "tp-xp", &color, NULL, NULL), GRADACC_STATUS_INVALID_ARGUMENT,
                 "\"xp\" is none of");
    EXPECT_ERROR(gradacc_mesh_shape_group(shape, 0, "tp-ep", &color, NULL, NULL), GRADACC_STATUS_INVALID_ARGUMENT,
                 "mix the dense view");
    EXPECT_ERROR(gradacc_mesh_shape_group(shape, 0, NULL, &color, NULL, NULL), GRADACC_STATUS_NULL_ARGUMENT,
                 "`axes`");
    gradacc_mesh_shape_t *bad = (gradacc_mesh_shape_t *)0x1;
    EXPECT_ERROR(gradacc_mesh_shape_create(6, 4, 1, 1, 1, 1, NULL, &bad), GRADACC_STATUS_INVALID_ARGUMENT,
                 "cannot hold tp 4");
    EXPECT_ERROR(gradacc_mesh_shape_create(4, 2, 1, 1, 1, 1, "tp-cp-dp", &bad), GRADACC_STATUS_INVALID_ARGUMENT,
                 "a permutation of tp, cp, dp and pp");
    CHECK(bad == (gradacc_mesh_shape_t *)0x1, "a failed create leaves *out_shape alone");
    /* Another order: data parallel fastest. */
    REQUIRE_OK(gradacc_mesh_shape_create(4, 2, 1, 1, 1, 1, "dp-tp-cp-pp", &bad));
    REQUIRE_OK(gradacc_mesh_shape_group(bad, (uint32_t)rank, "dp", &color, &key, NULL));
    CHECK(color == (uint32_t)(rank / DP * DP) && key == (uint32_t)(rank % DP), "rank %d: dp-first color %u key %u",
          rank, color, key);
    EXPECT_OK(gradacc_mesh_shape_destroy(bad));
    EXPECT_ERROR(gradacc_mesh_shape_destroy(bad), GRADACC_STATUS_INVALID_HANDLE, "`shape`");
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    const int rank = world_rank();
    gradacc_comm_t *world = comm_of(MPI_COMM_WORLD);
    gradacc_mesh_shape_t *shape = NULL;
    REQUIRE_OK(gradacc_mesh_shape_create((uint32_t)world_size(), TP, 1, 1, 1, 1, NULL, &shape));
    check_shape(shape, rank);
    gradacc_comm_t *data = NULL;
    REQUIRE_OK(gradacc_mesh_shape_split(shape, world, "cp-dp", &data));
    uint32_t data_rank = 0, data_size = 0;
    REQUIRE_OK(gradacc_mesh_shape_group(shape, (uint32_t)rank, "cp-dp", NULL, &data_rank, &data_size));

    gradacc_scaler_t *scaler = scaler_with_scale(1.0f);
    gradacc_accumulator_t *acc = mesh_case_accumulator();
    gradacc_mesh_t *mesh = NULL;
    REQUIRE_OK(gradacc_mesh_create(world, data_rank, data_size, 0.0f, &mesh));
    gradacc_mesh_part_t part = GRADACC_MESH_PART_INIT;
    part.accumulator = acc;
    part.comm = data;
    part.replicated = &mesh_case_norm;
    part.replicated_count = 1;

    /* A clean step against the reference, the same bits everywhere. */
    add_window(acc, scaler, rank, 0);
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    uint32_t overflow_part = 7;
    EXPECT_OK(gradacc_mesh_sync(mesh, &part, 1, &info, &overflow_part));
    double want = reference_norm();
    CHECK(info.total_count == 14 && info.microbatches == DP * MB && !info.found_inf, "rank %d: count %llu, mb %llu",
          rank, (unsigned long long)info.total_count, (unsigned long long)info.microbatches);
    CHECK_CLOSE(info.grad_norm, want, 1e-6 * want, "rank %d: the global norm", rank);
    CHECK(overflow_part == UINT32_MAX, "rank %d: overflow part %u", rank, overflow_part);
    CHECK(same_on_all_ranks(float_bits((float)info.grad_norm) ^ (uint64_t)info.total_count << 32, MPI_COMM_WORLD),
          "rank %d: the norm's bits differ between ranks", rank);
    for (int tensor = 0; tensor < 2; tensor++) {
        double got[N0] = {0};
        size_t n = tensor == 0 ? N0 : N1;
        read_master(acc, (size_t)tensor, got, n);
        for (size_t j = 0; j < n; j++) {
            double g = reference(rank % TP, tensor, (int)j);
            CHECK_CLOSE(got[j], g, 1e-6 * fabs(g) + 1e-30, "rank %d: tensor %d element %zu", rank, tensor, j);
        }
    }

    /* An inf on world rank 3 skips the step on every rank. */
    add_window(acc, scaler, rank, rank == 3);
    info = (gradacc_sync_info_t)GRADACC_SYNC_INFO_INIT;
    EXPECT_OK(gradacc_mesh_sync(mesh, &part, 1, &info, &overflow_part));
    CHECK(info.found_inf && info.overflow_at == GRADACC_OVERFLOW_AT_GRADIENT && info.overflow_rank == 3 &&
              info.overflow_tensor == 0 && overflow_part == 0,
          "rank %d: found_inf %d at %d rank %llu tensor %llu part %u", rank, (int)info.found_inf, (int)info.overflow_at,
          (unsigned long long)info.overflow_rank, (unsigned long long)info.overflow_tensor, overflow_part);

    /* Tp peers that count differently: world rank 1 adds one more item than its peer 0. */
    add_window(acc, scaler, rank, 0);
    if (rank == 1) {
        float g0[N0] = {0}, g1[N1] = {0};
        const void *grads[2] = {g0, g1};
        REQUIRE_OK(gradacc_accumulator_add(acc, scaler, grads, 2, 1));
    }
    EXPECT_ERROR(gradacc_mesh_sync(mesh, &part, 1, NULL, NULL), GRADACC_STATUS_INVALID_ARGUMENT,
                 "world ranks 0 and 1 share data-parallel rank 0");

    /* A rank that never calls: the others end at their timeout, or (across hosts) at the news of
     * another rank's timeout, a little earlier. The window is intact, so rank 3 still holds one
     * to sync; it does not. */
    REQUIRE_OK(gradacc_comm_set_timeout(world, 2.0));
    REQUIRE_OK(gradacc_comm_set_timeout(data, 2.0));
    if (rank != 3) {
        double t0 = MPI_Wtime();
        gradacc_status_t st = gradacc_mesh_sync(mesh, &part, 1, NULL, NULL);
        const int news = st == GRADACC_STATUS_COMM_FAILURE && strstr(gradacc_last_error(), "aborted the communicator");
        CHECK(st == GRADACC_STATUS_TIMEOUT || news, "rank %d: mesh sync returned %d, expected TIMEOUT (%s)", rank,
              (int)st, gradacc_last_error());
        CHECK(MPI_Wtime() - t0 >= (news ? 1.5 : 1.9), "rank %d: failed after %.2f s, before its 2 s", rank,
              MPI_Wtime() - t0);
    }

    EXPECT_OK(gradacc_mesh_destroy(mesh));
    EXPECT_OK(gradacc_accumulator_destroy(acc));
    gradacc_scaler_destroy(scaler);
    EXPECT_OK(gradacc_mesh_shape_destroy(shape));
    EXPECT_OK(gradacc_comm_destroy(data));
    EXPECT_OK(gradacc_comm_destroy(world));
    return mpi_finish();
}
