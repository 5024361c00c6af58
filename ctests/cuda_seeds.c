/* The seeds through the C API on CUDA devices with NCCL, at world size 1 and 2 (one rank per
 * device, as threads): the Apex O2 seed (both ranks 3.0 / 2.0 BY_WORLD, 1.5 / 1.0
 * BY_MICROBATCHES, bitwise equal; 2.0 / 2.0 and 1.0 / 1.0 alone), with the last micro-batch added
 * tensor by tensor so its buckets are reduced early; then the overflow seed: rank 1 alone sees an
 * inf, every rank skips the step and backs off alike. Every dtype. Gradients and masters are
 * device memory, moved with the driver API (libcuda.so.1, opened at run time).
 *
 * Needs a GPU with NCCL, or the software GPU (scripts/sim-gpu-check); skipped (77) without,
 * failed instead when GRADACC_REQUIRE_GPU=1. */
#include "common.h"

#include <dlfcn.h>

typedef int (*cu_init_t)(unsigned);
typedef int (*cu_device_count_t)(int *);
typedef int (*cu_ctx_retain_t)(void **, int);
typedef int (*cu_ctx_push_t)(void *);
typedef int (*cu_ctx_pop_t)(void **);
typedef int (*cu_stream_create_t)(void **, unsigned);
typedef int (*cu_stream_t)(void *);
typedef int (*cu_alloc_t)(uint64_t *, size_t);
typedef int (*cu_free_t)(uint64_t);
typedef int (*cu_htod_t)(uint64_t, const void *, size_t, void *);
typedef int (*cu_dtoh_t)(void *, uint64_t, size_t, void *);

static struct {
    cu_init_t init;
    cu_device_count_t device_count;
    cu_ctx_retain_t retain;
    cu_ctx_push_t push;
    cu_ctx_pop_t pop;
    cu_stream_create_t stream_create;
    cu_stream_t stream_destroy, stream_sync;
    cu_alloc_t alloc;
    cu_free_t free;
    cu_htod_t htod;
    cu_dtoh_t dtoh;
} cu;

#define CU(call) CHECK((call) == 0, "%s failed", #call)

static int load_driver(void)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib)
        return 0;
    *(void **)&cu.init = dlsym(lib, "cuInit");
    *(void **)&cu.device_count = dlsym(lib, "cuDeviceGetCount");
    *(void **)&cu.retain = dlsym(lib, "cuDevicePrimaryCtxRetain");
    *(void **)&cu.push = dlsym(lib, "cuCtxPushCurrent_v2");
    *(void **)&cu.pop = dlsym(lib, "cuCtxPopCurrent_v2");
    *(void **)&cu.stream_create = dlsym(lib, "cuStreamCreate");
    *(void **)&cu.stream_destroy = dlsym(lib, "cuStreamDestroy_v2");
    *(void **)&cu.stream_sync = dlsym(lib, "cuStreamSynchronize");
    *(void **)&cu.alloc = dlsym(lib, "cuMemAlloc_v2");
    *(void **)&cu.free = dlsym(lib, "cuMemFree_v2");
    *(void **)&cu.htod = dlsym(lib, "cuMemcpyHtoDAsync_v2");
    *(void **)&cu.dtoh = dlsym(lib, "cuMemcpyDtoHAsync_v2");
    return cu.init && cu.device_count && cu.retain && cu.push && cu.pop && cu.stream_create && cu.stream_destroy && cu.stream_sync && cu.alloc &&
           cu.free && cu.htod && cu.dtoh && cu.init(0) == 0;
}

enum { MAX_RANKS = 2, MICROBATCHES = 2 };

typedef struct {
    int rank, world;
    gradacc_nccl_unique_id_t id;
    gradacc_normalize_t normalize;
    gradacc_dtype_t dtype;
    double input;
    int overflow; /* this rank's second window has an inf in its last micro-batch */
    float weight_grad, bias_grad, scale_after_overflow;
    bool skipped_first, skipped_second;
    gradacc_sync_info_t info, overflow_info;
} rank_args;

/* Uploads one gradient value (encoded in the dtype) to a device buffer. */
static void upload(grad_buf *host, uint64_t device, double value, float scale, void *stream)
{
    grad_encode(host, &value, scale, NULL);
    CU(cu.htod(device, host->data, dtype_size(host->dtype), stream));
}

static float read_first(const float *device_ptr, void *stream)
{
    float v = NAN;
    CU(cu.dtoh(&v, (uint64_t)(uintptr_t)device_ptr, sizeof v, stream));
    CU(cu.stream_sync(stream));
    return v;
}

/* One window: a whole-batch add, then the final micro-batch tensor by tensor (bias first, as
 * backward produces it), then the boundary and the scaler's step. */
static void window(rank_args *a, gradacc_accumulator_t *acc, gradacc_scaler_t *scaler, gradacc_comm_t *comm, uint64_t w, uint64_t b,
                   grad_buf *hw, grad_buf *hb, void *stream, int inf, gradacc_sync_info_t *info, bool *skipped)
{
    float scale;
    REQUIRE_OK(gradacc_scaler_scale(scaler, &scale));
    upload(hw, w, a->input, scale, stream);
    upload(hb, b, 1.0, scale, stream);
    const void *g[2] = {(const void *)(uintptr_t)w, (const void *)(uintptr_t)b};
    REQUIRE_OK(gradacc_accumulator_add(acc, scaler, g, 2, 1));
    /* The next upload overwrites the buffers: the add must have read them (stream order). */
    upload(hw, w, inf ? INFINITY : a->input, scale, stream);
    upload(hb, b, 1.0, scale, stream);
    REQUIRE_OK(gradacc_accumulator_begin_final_microbatch(acc, 1, comm));
    REQUIRE_OK(gradacc_accumulator_add_tensor(acc, scaler, 1, g[1], 1));
    REQUIRE_OK(gradacc_accumulator_add_tensor(acc, scaler, 0, g[0], 1));
    REQUIRE_OK(gradacc_accumulator_end_microbatch(acc));
    info->struct_size = sizeof *info;
    REQUIRE_OK(gradacc_accumulator_sync(acc, comm, info));
    const gradacc_accumulator_t *accs[1] = {acc};
    REQUIRE_OK(gradacc_scaler_update(scaler, accs, 1, skipped));
}

static void *rank_main(void *p)
{
    rank_args *a = p;
    void *ctx = NULL, *stream = NULL;
    CU(cu.retain(&ctx, a->rank));
    CU(cu.push(ctx));
    CU(cu.stream_create(&stream, 1));
    gradacc_device_t dev = {GRADACC_DEVICE_CUDA, a->rank, stream};
    gradacc_comm_t *comm = NULL;
    REQUIRE_OK(gradacc_comm_create_nccl(&a->id, a->rank, a->world, a->rank, &comm));
    gradacc_scaler_config_t sc;
    REQUIRE_OK(gradacc_scaler_config_default(&sc));
    sc.init_scale = 2.0f; /* exact in every dtype; min_scale 1 leaves room for one backoff */
    gradacc_scaler_t *scaler = NULL;
    REQUIRE_OK(gradacc_scaler_create(&sc, &dev, &scaler));
    gradacc_accumulator_config_t ac;
    REQUIRE_OK(gradacc_accumulator_config_default(&ac));
    ac.normalize = a->normalize;
    ac.bucket_numel = 1; /* one bucket per tensor: the final micro-batch reduces them early */
    gradacc_tensor_desc_t t[2] = {{1, a->dtype}, {1, a->dtype}};
    gradacc_accumulator_t *acc = NULL;
    REQUIRE_OK(gradacc_accumulator_create(&ac, t, 2, &dev, &acc));
    uint64_t w = 0, b = 0;
    CU(cu.alloc(&w, 16));
    CU(cu.alloc(&b, 16));
    grad_buf hw = grad_alloc(a->dtype, 1), hb = grad_alloc(a->dtype, 1);

    window(a, acc, scaler, comm, w, b, &hw, &hb, stream, 0, &a->info, &a->skipped_first);
    float *p0 = NULL, *p1 = NULL;
    size_t n0 = 0, n1 = 0;
    REQUIRE_OK(gradacc_accumulator_master(acc, 0, &p0, &n0));
    REQUIRE_OK(gradacc_accumulator_master(acc, 1, &p1, &n1));
    a->weight_grad = read_first(p0, stream);
    a->bias_grad = read_first(p1, stream);

    window(a, acc, scaler, comm, w, b, &hw, &hb, stream, a->overflow, &a->overflow_info, &a->skipped_second);
    REQUIRE_OK(gradacc_scaler_scale(scaler, &a->scale_after_overflow));

    CU(cu.stream_sync(stream));
    grad_free(&hw);
    grad_free(&hb);
    gradacc_accumulator_destroy(acc);
    gradacc_scaler_destroy(scaler);
    EXPECT_OK(gradacc_comm_destroy(comm));
    CU(cu.stream_sync(stream));
    CU(cu.free(w));
    CU(cu.free(b));
    CU(cu.stream_destroy(stream));
    CU(cu.pop(&ctx));
    return NULL;
}

static void run(int world, gradacc_normalize_t normalize, gradacc_dtype_t dtype, float want_w, float want_b)
{
    rank_args args[MAX_RANKS];
    memset(args, 0, sizeof args);
    gradacc_nccl_unique_id_t id;
    REQUIRE_OK(gradacc_nccl_unique_id(&id));
    for (int r = 0; r < world; r++) {
        args[r] = (rank_args){.rank = r, .world = world, .id = id, .normalize = normalize, .dtype = dtype};
        args[r].input = r == 0 ? 1.0 : 2.0;
        args[r].overflow = r == world - 1;
    }
    run_ranks((size_t)world, rank_main, args, sizeof args[0]);
    const char *how = normalize == GRADACC_NORMALIZE_BY_WORLD ? "BY_WORLD" : "BY_MICROBATCHES";
    for (int r = 0; r < world; r++) {
        rank_args *a = &args[r];
        CHECK(a->weight_grad == want_w && a->bias_grad == want_b, "world %d %s %s rank %d: weight grad %.9g bias grad %.9g, expected %g and %g",
              world, how, dtype_name(dtype), r, a->weight_grad, a->bias_grad, want_w, want_b);
        CHECK(!a->info.found_inf && a->info.total_count == (uint64_t)(MICROBATCHES * world) &&
                  a->info.microbatches == (uint64_t)(MICROBATCHES * world) && !a->skipped_first,
              "world %d rank %d first window: found_inf %d count %llu skipped %d", world, r, a->info.found_inf,
              (unsigned long long)a->info.total_count, a->skipped_first);
        /* The overflow seed: one rank's inf, every rank's skip and backoff (2 -> 1). */
        CHECK(a->overflow_info.found_inf && a->skipped_second && a->scale_after_overflow == 1.0f,
              "world %d rank %d overflow window: found_inf %d skipped %d scale %g", world, r, a->overflow_info.found_inf, a->skipped_second,
              a->scale_after_overflow);
    }
    if (world == 2)
        CHECK(memcmp(&args[0].weight_grad, &args[1].weight_grad, sizeof(float)) == 0 &&
                  memcmp(&args[0].bias_grad, &args[1].bias_grad, sizeof(float)) == 0 &&
                  args[0].info.grad_norm == args[1].info.grad_norm,
              "ranks differ (%s %s)", how, dtype_name(dtype));
}

int main(void)
{
    bool cuda = false, nccl = false;
    int have = load_driver();
    if (have) {
        EXPECT_OK(gradacc_backend_available(GRADACC_BACKEND_CUDA, &cuda));
        EXPECT_OK(gradacc_backend_available(GRADACC_BACKEND_NCCL, &nccl));
    }
    if (!have || !cuda || !nccl) {
        const char *require = getenv("GRADACC_REQUIRE_GPU");
        fprintf(stderr, "no CUDA device with NCCL (driver %d, CUDA %d, NCCL %d)\n", have, cuda, nccl);
        return require && strcmp(require, "1") == 0 ? 1 : 77;
    }
    static const gradacc_dtype_t dtypes[3] = {GRADACC_DTYPE_F16, GRADACC_DTYPE_BF16, GRADACC_DTYPE_F32};
    /* One rank per device: with one GPU the two-rank cases are not run (the software GPU always
     * has two, so there they must run). */
    int devices = 0;
    cu.device_count(&devices);
    const char *simgpu = getenv("GRADACC_SIMGPU");
    bool two = devices >= 2 || (simgpu && strcmp(simgpu, "1") == 0);
    if (!two)
        fprintf(stderr, "not run: needs 2 devices (%d visible): the two-rank seeds\n", devices);
    for (int d = 0; d < 3; d++) {
        run(1, GRADACC_NORMALIZE_BY_WORLD, dtypes[d], 2.0f, 2.0f);
        run(1, GRADACC_NORMALIZE_BY_MICROBATCHES, dtypes[d], 1.0f, 1.0f);
        if (two) {
            run(2, GRADACC_NORMALIZE_BY_WORLD, dtypes[d], 3.0f, 2.0f);
            run(2, GRADACC_NORMALIZE_BY_MICROBATCHES, dtypes[d], 1.5f, 1.0f);
        }
    }
    if (two)
        printf("Apex O2 seed through NCCL: both ranks 3.0 / 2.0 (BY_WORLD), 1.5 / 1.0 (BY_MICROBATCHES), bitwise equal;\n"
               "overflow on one rank: every rank skips and backs off to 1\n");
    else
        printf("Apex O2 seed through NCCL at world size 1: 2.0 / 2.0 (BY_WORLD), 1.0 / 1.0 (BY_MICROBATCHES)\n");
    return test_finish();
}
