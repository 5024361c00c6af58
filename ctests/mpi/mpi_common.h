/* Helpers shared by the MPI tests (run under mpirun): a gradacc communicator over an MPI
 * communicator, a check that a float buffer has the same bits on every rank, and a finish that
 * fails every rank if any rank failed a check. */
#ifndef GRADACC_CTESTS_MPI_COMMON_H
#define GRADACC_CTESTS_MPI_COMMON_H

#include "common.h"

#include <mpi.h>

/* A gradacc communicator adopting `comm` through its Fortran handle, as mpi4py and MPI.jl pass it.
 * GRADACC_TEST_MPI_SHARED_MEMORY=0 (CTest's *_messages runs) turns shared memory off, so the
 * boundary's data travels as MPI messages. */
static inline gradacc_comm_t *comm_of(MPI_Comm comm)
{
    gradacc_mpi_config_t cfg;
    REQUIRE_OK(gradacc_mpi_config_default(&cfg));
    const char *shm = getenv("GRADACC_TEST_MPI_SHARED_MEMORY");
    if (shm)
        cfg.shared_memory = (uint32_t)atoi(shm);
    gradacc_comm_t *c = NULL;
    REQUIRE_OK(gradacc_comm_create_mpi((int64_t)MPI_Comm_c2f(comm), &cfg, &c));
    return c;
}

/* Whether every rank of `comm` runs on one host, as MPI sees hosts (MPI_COMM_TYPE_SHARED: for Open
 * MPI, the node a rank was launched on; under scripts/sim-hosts each simulated host is one). */
static inline int all_on_one_host(MPI_Comm comm)
{
    MPI_Comm local;
    int size = 0, local_size = 0;
    MPI_Comm_size(comm, &size);
    MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &local);
    MPI_Comm_size(local, &local_size);
    MPI_Comm_free(&local);
    int mine = local_size == size, all = 0;
    MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, comm);
    return all;
}

/* On Linux, checks that this process maps gradacc's shared memory (a memfd, which has no name in
 * /dev/shm) exactly when the test asked for shared memory and every rank of `comm` is on this
 * host: a group on one host that fell back to MPI messages would otherwise test the messages
 * path twice, and a group across hosts (scripts/sim-hosts) must never take ranks of another host
 * for local ones. Collective over `comm`. */
static inline void check_transport(MPI_Comm comm)
{
#ifdef __linux__
    const char *want = getenv("GRADACC_TEST_MPI_SHARED_MEMORY");
    if (!want)
        return;
    int one_host = all_on_one_host(comm), expect = atoi(want) != 0 && one_host;
    FILE *maps = fopen("/proc/self/maps", "r");
    if (!maps)
        return;
    char line[512];
    int mapped = 0;
    while (fgets(line, sizeof line, maps))
        mapped |= strstr(line, "/memfd:gradacc-") != NULL || strstr(line, "/dev/shm/gradacc-") != NULL;
    fclose(maps);
    CHECK(mapped == expect, "shared memory %s, ranks on %s, but a gradacc object is %smapped", want,
          one_host ? "one host" : "several hosts", mapped ? "" : "not ");
#else
    (void)comm;
#endif
}

/* FNV-1a over the bits of `n` floats. */
static inline uint64_t bits_hash(const float *p, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull;
    const unsigned char *b = (const unsigned char *)p;
    for (size_t i = 0; i < n * sizeof(float); i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

static inline uint64_t float_bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

/* True on every rank iff every rank of `comm` holds the same value. */
static inline int same_on_all_ranks(uint64_t v, MPI_Comm comm)
{
    uint64_t lo = 0, hi = 0;
    MPI_Allreduce(&v, &lo, 1, MPI_UINT64_T, MPI_MIN, comm);
    MPI_Allreduce(&v, &hi, 1, MPI_UINT64_T, MPI_MAX, comm);
    return lo == hi;
}

/* Checks that tensor `index` of `acc` has the same bits on every rank of `comm`. */
static inline void check_master_agrees(gradacc_accumulator_t *acc, size_t index, MPI_Comm comm, const char *what)
{
    float *p = NULL;
    size_t n = 0;
    REQUIRE_OK(gradacc_accumulator_master(acc, index, &p, &n));
    CHECK(same_on_all_ranks(bits_hash(p, n), comm), "%s: tensor %zu differs bitwise between ranks", what, index);
}

static inline int world_rank(void)
{
    int r = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    return r;
}

static inline int world_size(void)
{
    int n = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    return n;
}

/* Ends an MPI test: 0 on every rank only if no rank failed a check. */
static inline int mpi_finish(void)
{
    int mine = test_failures, any = 0;
    MPI_Allreduce(&mine, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    int rc = test_finish();
    if (any && !rc)
        fprintf(stderr, "rank %d: another rank failed\n", world_rank());
    MPI_Finalize();
    return any ? 1 : rc;
}

/* A scaler with a fixed initial scale and an accumulator over `n` tensors. */
static inline gradacc_accumulator_t *make_acc(const gradacc_tensor_desc_t *t, size_t n, gradacc_normalize_t normalize,
                                              uint64_t bucket_numel)
{
    gradacc_accumulator_config_t ac;
    REQUIRE_OK(gradacc_accumulator_config_default(&ac));
    ac.normalize = normalize;
    if (bucket_numel)
        ac.bucket_numel = bucket_numel;
    gradacc_accumulator_t *a = NULL;
    REQUIRE_OK(gradacc_accumulator_create(&ac, t, n, NULL, &a));
    return a;
}

#endif
