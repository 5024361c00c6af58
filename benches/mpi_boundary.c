/* The MPI boundary at 2 processes (scripts/bench-mpi): 16M fp16 parameters, K micro-batches per
 * step. Times per step, median over repeats after warm-up repeats, the slowest rank's time:
 *   deferred  gradacc_accumulator_sync once per step (control reduction, all-reduce of the FP32
 *             master, normalisation, norm), its data through shared memory (the default on one
 *             host)
 *   clipped   the same with clipping that applies (max_grad_norm below the norm)
 *   messages  the deferred sync over a communicator whose data travels as MPI messages
 *             (shared_memory = 0), as between hosts
 *   naive     an MPI_Allreduce of the FP32 gradient after every micro-batch (K per step)
 *   bare      one MPI_Allreduce of the same bytes, nothing else
 *   pieces    MPI_Allreduce of the same bytes in calls of PIECES[i] elements, nothing else, for
 *             each size: what the MPI library's own all-reduce can do when it is not handed one
 *             large message. The fastest size (by median) is the floor the syncs are held to.
 * Each repeat times them all in turn, so load from other work falls on all of them alike. The
 * fused adds are the same in every pattern and are not timed.
 *
 * With --reduce-scatter (scripts/bench-mpi --reduce-scatter runs it at 2 and 4 processes, 16M and
 * 64M parameters) it times instead, one micro-batch per step, at any number of processes:
 *   all-reduce      gradacc_accumulator_sync of an unsharded accumulator (GRADACC_SHARDING_NONE)
 *   reduce-scatter  the same sync of an accumulator holding shard `rank` of `size`
 *                   (GRADACC_SHARDING_REDUCE_SCATTER); the table gives its median over the
 *                   all-reduce's median, and the median and quartiles of the ratio taken within
 *                   each repeat
 *   floors          MPI_Allreduce, MPI_Reduce_scatter_block and MPI_Reduce_scatter (equal counts)
 *                   of the same bytes, each as one call and in calls of 4 MB; each sync is also
 *                   given over the fastest form of its own collective (the reduce-scatter's: of
 *                   either reduce-scatter call; Open MPI 4.1 runs MPI_Reduce_scatter_block as a
 *                   reduce to one rank and a scatter, MPI_Reduce_scatter by its tuned algorithms).
 *
 * With --wire (scripts/bench-mpi --wire) it times both syncs with FP32 and with BF16 on the wire,
 * and measures each result's error against f64 (see wire_table).
 *
 * With --zero2 (scripts/bench-mpi --zero2) it times one micro-batch of sharded accumulation
 * (GRADACC_SHARDING_ACCUMULATE: convert into staging, reduce-scatter, add into the shard, bucket
 * by bucket) against gradacc_accumulator_add of an unsharded accumulator plus the fastest bare
 * reduce-scatter of the same FP32 bytes (see zero2_table). */
#include <gradacc.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* With a single warm-up repeat the first K measured ran up to 15% slower than the same K measured
 * later in the run (old and new boundary alike); three bring it level. */
enum { REPEATS = 15, WARMUP = 3 };

/* Elements per MPI_Allreduce call of the "pieces" columns: 256 KB to 16 MB. */
enum { NPIECES = 4 };
static const size_t PIECES[NPIECES] = {(size_t)1 << 16, (size_t)1 << 18, (size_t)1 << 20, (size_t)1 << 22};

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp);
    return v[n / 2];
}

/* The median of a[i] / b[i] over n <= REPEATS paired repeats, leaving a and b as they are: the two
   ran in the same repeat, so a change of machine state between repeats cancels in each ratio. */
static double median_ratio(const double *a, const double *b, int n)
{
    double r[REPEATS];
    for (int i = 0; i < n; i++)
        r[i] = a[i] / b[i];
    return median(r, n);
}

/* The median of n <= REPEATS values, leaving them in their order. */
static double median_of(const double *v, int n)
{
    double c[REPEATS];
    memcpy(c, v, (size_t)n * sizeof *c);
    return median(c, n);
}

/* The q-quantile of n sorted values (nearest rank). */
static double quantile(const double *sorted, int n, double q)
{
    int i = (int)(q * (n - 1) + 0.5);
    return sorted[i];
}

/* The slowest rank's elapsed time since t0. */
static double slowest(double t0)
{
    double mine = MPI_Wtime() - t0, max = 0;
    MPI_Allreduce(&mine, &max, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return max;
}

#define OK(call)                                                                                   \
    do {                                                                                           \
        if ((call) != GRADACC_STATUS_OK) {                                                         \
            fprintf(stderr, "%s: %s\n", #call, gradacc_last_error());                              \
            MPI_Abort(MPI_COMM_WORLD, 1);                                                          \
        }                                                                                          \
    } while (0)

/* Elements per call of the floors' "in pieces" form: 4 MB. */
enum { RS_PIECE = 1 << 20 };

enum { ALLREDUCE, REDUCE_SCATTER_BLOCK, REDUCE_SCATTER, FLOORS };
static const char *const FLOOR_NAMES[FLOORS] = {"MPI_Allreduce", "MPI_Reduce_scatter_block", "MPI_Reduce_scatter"};

/* One collective of kind `kind` over len floats at buf (out receives a reduce-scatter's part). */
static void collective(int kind, float *buf, float *out, size_t len, int size)
{
    int part = (int)(len / (size_t)size), counts[64];
    switch (kind) {
    case ALLREDUCE:
        MPI_Allreduce(MPI_IN_PLACE, buf, (int)len, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        break;
    case REDUCE_SCATTER_BLOCK:
        MPI_Reduce_scatter_block(buf, out, part, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        break;
    default:
        for (int q = 0; q < size; q++)
            counts[q] = part;
        MPI_Reduce_scatter(buf, out, counts, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    }
}

/* A collective of `kind` over n floats as one call and in calls of 4 MB: the slowest rank's times. */
static void time_floor(int kind, float *buf, float *out, size_t n, int size, double *one, double *pieces)
{
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    collective(kind, buf, out, n, size);
    *one = slowest(t0);
    MPI_Barrier(MPI_COMM_WORLD);
    t0 = MPI_Wtime();
    for (size_t s = 0; s < n; s += RS_PIECE)
        collective(kind, buf + s, out, n - s < RS_PIECE ? n - s : RS_PIECE, size);
    *pieces = slowest(t0);
}

static void reduce_scatter_table(size_t n, gradacc_comm_t *comm, gradacc_scaler_t *scaler)
{
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (n % ((size_t)size * RS_PIECE) != 0 || size > 64) {
        if (rank == 0)
            fprintf(stderr, "--reduce-scatter needs at most 64 processes and a parameter count that is a multiple "
                            "of %d x 2^20\n", size);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    gradacc_tensor_desc_t t = {n, GRADACC_DTYPE_F16};
    gradacc_accumulator_config_t ac;
    OK(gradacc_accumulator_config_default(&ac));
    gradacc_accumulator_t *ar, *rs;
    OK(gradacc_accumulator_create(&ac, &t, 1, NULL, &ar));
    ac.sharding = GRADACC_SHARDING_REDUCE_SCATTER;
    ac.shard_count = (uint32_t)size;
    ac.shard_rank = (uint32_t)rank;
    OK(gradacc_accumulator_create(&ac, &t, 1, NULL, &rs));
    uint16_t *g = malloc(n * 2);
    float *plain = malloc(n * 4), *out = malloc(n / (size_t)size * 4);
    for (size_t i = 0; i < n; i++) {
        g[i] = (uint16_t)(0x3c00 + (i % 512)); /* 1.0 .. 1.5 */
        plain[i] = 1.0f;
    }
    const void *grads[1] = {g};
    double t_ar[REPEATS], t_rs[REPEATS], ratio[REPEATS], floor_t[2 * FLOORS][REPEATS];
    for (int rep = -WARMUP; rep < REPEATS; rep++) { /* negative repeats warm up */
        OK(gradacc_accumulator_add(ar, scaler, grads, 1, 1));
        OK(gradacc_accumulator_add(rs, scaler, grads, 1, 1));
        gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        OK(gradacc_accumulator_sync(ar, comm, &info));
        double a = slowest(t0);
        MPI_Barrier(MPI_COMM_WORLD);
        t0 = MPI_Wtime();
        OK(gradacc_accumulator_sync(rs, comm, &info));
        double r = slowest(t0);
        double f[2 * FLOORS];
        for (int k = 0; k < FLOORS; k++)
            time_floor(k, plain, out, n, size, &f[2 * k], &f[2 * k + 1]);
        for (size_t i = 0; i < n; i++) /* keep the values finite */
            plain[i] = 1.0f;
        if (rep >= 0) {
            t_ar[rep] = a;
            t_rs[rep] = r;
            ratio[rep] = r / a;
            for (int k = 0; k < 2 * FLOORS; k++)
                floor_t[k][rep] = f[k];
        }
    }
    double a = median(t_ar, REPEATS), r = median(t_rs, REPEATS), f[2 * FLOORS];
    median(ratio, REPEATS); /* sorts */
    for (int k = 0; k < 2 * FLOORS; k++)
        f[k] = median(floor_t[k], REPEATS);
    double fastest_ar = f[0] < f[1] ? f[0] : f[1], fastest_rs = f[2];
    for (int k = 3; k < 2 * FLOORS; k++)
        fastest_rs = f[k] < fastest_rs ? f[k] : fastest_rs;
    if (rank == 0) {
        printf("| processes | fp16 parameters | all-reduce sync (ms) | reduce-scatter sync (ms) | reduce-scatter / "
               "all-reduce | the same per repeat: median [quartiles] |");
        for (int k = 0; k < FLOORS; k++)
            printf(" %s (ms) | %s in 4 MB pieces (ms) |", FLOOR_NAMES[k], FLOOR_NAMES[k]);
        printf(" all-reduce sync / fastest all-reduce | reduce-scatter sync / fastest reduce-scatter |\n|");
        for (int k = 0; k < 8 + 2 * FLOORS; k++)
            printf("---|");
        printf("\n| %d | %zuM | %.1f | %.1f | %.2f | %.2f [%.2f-%.2f] |", size, n >> 20, a * 1e3, r * 1e3, r / a,
               quantile(ratio, REPEATS, 0.5), quantile(ratio, REPEATS, 0.25), quantile(ratio, REPEATS, 0.75));
        for (int k = 0; k < 2 * FLOORS; k++)
            printf(" %.1f |", f[k] * 1e3);
        printf(" %.2f | %.2f |\n", a / fastest_ar, r / fastest_rs);
    }
    free(g);
    free(plain);
    free(out);
    gradacc_accumulator_destroy(ar);
    gradacc_accumulator_destroy(rs);
}

/* With --zero2: per micro-batch, sharded accumulation's add against an unsharded add plus the
 * fastest bare reduce-scatter of the FP32 gradient (MPI_Reduce_scatter_block or MPI_Reduce_scatter,
 * as one call or in 4 MB pieces), over tensors of 1M fp16 elements in the default 4M-element
 * buckets; also the sharded boundary's time and each rank's FP32 memory. */
static void zero2_table(size_t n, gradacc_comm_t *comm, gradacc_scaler_t *scaler)
{
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    enum { TENSOR = 1 << 20, MAX_TENSORS = 256 };
    size_t nt = n / TENSOR;
    if (n % ((size_t)size * RS_PIECE) != 0 || n % TENSOR != 0 || nt > MAX_TENSORS || size > 64) {
        if (rank == 0)
            fprintf(stderr, "--zero2 needs at most 64 processes and a parameter count that is a multiple of %d x 2^20, "
                            "at most 256 x 2^20\n", size);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    gradacc_tensor_desc_t t[MAX_TENSORS];
    for (size_t i = 0; i < nt; i++)
        t[i] = (gradacc_tensor_desc_t){TENSOR, GRADACC_DTYPE_F16};
    gradacc_accumulator_config_t ac;
    OK(gradacc_accumulator_config_default(&ac));
    gradacc_accumulator_t *plain_acc, *z;
    OK(gradacc_accumulator_create(&ac, t, nt, NULL, &plain_acc));
    ac.sharding = GRADACC_SHARDING_ACCUMULATE;
    ac.shard_count = (uint32_t)size;
    ac.shard_rank = (uint32_t)rank;
    OK(gradacc_accumulator_create_sharded(&ac, t, nt, NULL, comm, &z));
    uint16_t *g = malloc(n * 2);
    float *plain = malloc(n * 4), *out = malloc(n / (size_t)size * 4);
    for (size_t i = 0; i < n; i++) {
        g[i] = (uint16_t)(0x3c00 + (i % 512)); /* 1.0 .. 1.5 */
        plain[i] = 1.0f;
    }
    const void *grads[MAX_TENSORS];
    for (size_t i = 0; i < nt; i++)
        grads[i] = g + i * TENSOR;
    double t_add[REPEATS], t_z[REPEATS], t_sync[REPEATS], ratio[REPEATS], floor_t[4][REPEATS];
    for (int rep = -WARMUP; rep < REPEATS; rep++) { /* negative repeats warm up */
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        OK(gradacc_accumulator_add(plain_acc, scaler, grads, nt, 1));
        double a = slowest(t0);
        double f[4];
        time_floor(REDUCE_SCATTER_BLOCK, plain, out, n, size, &f[0], &f[1]);
        time_floor(REDUCE_SCATTER, plain, out, n, size, &f[2], &f[3]);
        for (size_t i = 0; i < n; i++) /* keep the values finite */
            plain[i] = 1.0f;
        MPI_Barrier(MPI_COMM_WORLD);
        t0 = MPI_Wtime();
        OK(gradacc_accumulator_add(z, scaler, grads, nt, 1));
        double zt = slowest(t0);
        gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
        MPI_Barrier(MPI_COMM_WORLD);
        t0 = MPI_Wtime();
        OK(gradacc_accumulator_sync(z, comm, &info));
        double st = slowest(t0);
        OK(gradacc_accumulator_reset(plain_acc)); /* each micro-batch the window's first, as z's */
        if (rep >= 0) {
            double fastest = f[0];
            for (int k = 1; k < 4; k++)
                fastest = f[k] < fastest ? f[k] : fastest;
            t_add[rep] = a;
            t_z[rep] = zt;
            t_sync[rep] = st;
            ratio[rep] = zt / (a + fastest);
            for (int k = 0; k < 4; k++)
                floor_t[k][rep] = f[k];
        }
    }
    double a = median(t_add, REPEATS), zt = median(t_z, REPEATS), st = median(t_sync, REPEATS), f[4];
    median(ratio, REPEATS); /* sorts */
    for (int k = 0; k < 4; k++)
        f[k] = median(floor_t[k], REPEATS);
    double fastest = f[0];
    for (int k = 1; k < 4; k++)
        fastest = f[k] < fastest ? f[k] : fastest;
    size_t offset, shard_numel;
    float *data;
    OK(gradacc_accumulator_shard(z, &offset, &shard_numel, &data));
    if (rank == 0) {
        printf("| processes | fp16 parameters | add, unsharded (ms) | fastest reduce-scatter (ms) | sharded add (ms) | "
               "sharded add / (add + reduce-scatter) | the same per repeat: median [quartiles] | sharded sync (ms) | "
               "FP32 held per rank by layout, sharded / unsharded (MB) |\n|---|---|---|---|---|---|---|---|---|\n");
        printf("| %d | %zuM | %.1f | %.1f | %.1f | %.2f | %.2f [%.2f-%.2f] | %.2f | %.0f / %.0f |\n", size, n >> 20, a * 1e3,
               fastest * 1e3, zt * 1e3, zt / (a + fastest), quantile(ratio, REPEATS, 0.5), quantile(ratio, REPEATS, 0.25),
               quantile(ratio, REPEATS, 0.75), st * 1e3, (double)(shard_numel + 4 * (size_t)TENSOR) * 4 / 1e6,
               (double)n * 4 / 1e6);
    }
    free(g);
    free(plain);
    free(out);
    gradacc_accumulator_destroy(plain_acc);
    gradacc_accumulator_destroy(z);
}

/* A contribution of rank r to element i: magnitudes from 1e-3 to 1e3 across ranks, both signs. */
static float wire_value(int r, size_t i)
{
    static const float scale[4] = {1.0f, 1e3f, 1e-3f, 7.0f};
    unsigned long long h = (unsigned long long)i * 2654435761ull + (unsigned long long)r * 40503ull;
    return ((float)(h % 100003) / 100003.0f - 0.5f) * scale[r % 4];
}

/* With --wire: the all-reduce and the reduce-scatter sync with FP32 and with BF16 on the wire, one
 * micro-batch of FP32 gradients per step, and the largest error of each result against the f64
 * sum, in units of 2^-8 times the element's magnitude (the sum of the contributions' absolute
 * values): the BF16 wire's bound is 1 in those units, whatever the process count. */
static void wire_table(size_t n, gradacc_comm_t *comm)
{
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    gradacc_scaler_config_t sc;
    OK(gradacc_scaler_config_default(&sc));
    sc.init_scale = 1.0f;
    gradacc_scaler_t *one;
    OK(gradacc_scaler_create(&sc, NULL, &one));
    gradacc_tensor_desc_t t = {n, GRADACC_DTYPE_F32};
    gradacc_accumulator_t *accs[4]; /* all-reduce f32, all-reduce bf16, reduce-scatter f32, bf16 */
    for (int k = 0; k < 4; k++) {
        gradacc_accumulator_config_t ac;
        OK(gradacc_accumulator_config_default(&ac));
        ac.wire_dtype = k % 2 ? GRADACC_DTYPE_BF16 : GRADACC_DTYPE_F32;
        if (k >= 2) {
            ac.sharding = GRADACC_SHARDING_REDUCE_SCATTER;
            ac.shard_count = (uint32_t)size;
            ac.shard_rank = (uint32_t)rank;
        }
        OK(gradacc_accumulator_create(&ac, &t, 1, NULL, &accs[k]));
    }
    float *g = malloc(n * 4);
    for (size_t i = 0; i < n; i++)
        g[i] = wire_value(rank, i);
    const void *grads[1] = {g};
    double times[4][REPEATS];
    for (int rep = -WARMUP; rep < REPEATS; rep++) {
        for (int k = 0; k < 4; k++) {
            OK(gradacc_accumulator_add(accs[k], one, grads, 1, 1));
            gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
            MPI_Barrier(MPI_COMM_WORLD);
            double t0 = MPI_Wtime();
            OK(gradacc_accumulator_sync(accs[k], comm, &info));
            double e = slowest(t0);
            if (rep >= 0)
                times[k][rep] = e;
        }
    }
    double err[4];
    for (int k = 0; k < 4; k++) {
        size_t offset, numel;
        float *data;
        OK(gradacc_accumulator_shard(accs[k], &offset, &numel, &data));
        double worst = 0;
        for (size_t j = 0; j < numel; j++) {
            double exact = 0, magnitude = 0;
            for (int r = 0; r < size; r++) {
                double x = wire_value(r, offset + j);
                exact += x;
                magnitude += x < 0 ? -x : x;
            }
            double d = (double)data[j] * size - exact; /* the sync divided by the item count */
            d = d < 0 ? -d : d;
            if (magnitude > 0 && d / magnitude > worst)
                worst = d / magnitude;
        }
        MPI_Allreduce(&worst, &err[k], 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    }
    if (rank == 0) {
        printf("| processes | fp32 parameters | wire | all-reduce sync (ms) | reduce-scatter sync (ms) | largest error / "
               "(2^-8 x magnitude), all-reduce | the same, reduce-scatter |\n|---|---|---|---|---|---|---|\n");
        for (int w = 0; w < 2; w++)
            printf("| %d | %zuM | %s | %.1f | %.1f | %.6f | %.6f |\n", size, n >> 20, w ? "bf16" : "fp32",
                   median(times[w], REPEATS) * 1e3, median(times[2 + w], REPEATS) * 1e3, err[w] * 256, err[2 + w] * 256);
    }
    free(g);
    for (int k = 0; k < 4; k++)
        gradacc_accumulator_destroy(accs[k]);
    gradacc_scaler_destroy(one);
}

/* Bytes this process's host sent on its link so far: eth0's transmit counter, the one
 * /sys/class/net/eth0/statistics/tx_bytes gives, read from /proc/net/dev, which (unlike the /sys
 * a simulated host of scripts/sim-hosts inherits) shows the network namespace of the reader. */
static double host_tx_bytes(void)
{
    FILE *f = fopen("/proc/net/dev", "r");
    char line[512];
    double v = -1;
    while (f && fgets(line, sizeof line, f)) {
        char *at = strstr(line, "eth0:");
        double rx[8];
        if (at && sscanf(at + 5, "%lf %lf %lf %lf %lf %lf %lf %lf %lf", &rx[0], &rx[1], &rx[2], &rx[3], &rx[4],
                         &rx[5], &rx[6], &rx[7], &v) == 9)
            break;
    }
    if (f)
        fclose(f);
    if (v < 0) {
        fprintf(stderr, "--hosts needs eth0 in /proc/net/dev\n");
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    return v;
}

/* With --hosts (scripts/bench-mpi --hosts, ranks on `hosts` simulated hosts): the sync of an FP32
 * accumulator of n parameters, FP32 and BF16 wire, in K = 1, 4, 8 buckets, against the fastest
 * bare MPI_Allreduce of the same wire bytes (one call or 4 MB calls), and the bytes the hosts
 * sent per sync (every host's link, summed) over the hierarchical ideal: each host sends
 * (hosts - 1) / hosts of the buffer at the wire's width (the partial sums) and as much again in
 * FP32 (the finished sums), so (hosts - 1) n (wire bytes + 4) in all. One row per wire and K. */
static void hosts_table(size_t n, gradacc_comm_t *comm, const char *path, int hosts)
{
    enum { HREPEATS = 5, HWARMUP = 1 };
    int rank, size, local;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    MPI_Comm node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
    MPI_Comm_rank(node, &local);
    MPI_Comm_free(&node);
    gradacc_scaler_config_t sc;
    OK(gradacc_scaler_config_default(&sc));
    sc.init_scale = 1.0f;
    gradacc_scaler_t *one;
    OK(gradacc_scaler_create(&sc, NULL, &one));
    gradacc_tensor_desc_t t = {n, GRADACC_DTYPE_F32};
    float *g = malloc(n * 4), *plain = malloc(n * 4);
    for (size_t i = 0; i < n; i++)
        g[i] = 1.0f + (float)(i % 512) / 1024.0f;
    const void *grads[1] = {g};
    const size_t piece = (size_t)1 << 20;
    const int ks[3] = {1, 4, 8};
    for (int w = 0; w < 2; w++) {
        size_t floats = w ? n / 2 : n; /* the wire's bytes, as FP32 */
        for (int ki = 0; ki < 3; ki++) {
            gradacc_accumulator_config_t ac;
            OK(gradacc_accumulator_config_default(&ac));
            ac.wire_dtype = w ? GRADACC_DTYPE_BF16 : GRADACC_DTYPE_F32;
            ac.bucket_numel = (n + (size_t)ks[ki] - 1) / (size_t)ks[ki];
            gradacc_accumulator_t *acc;
            OK(gradacc_accumulator_create(&ac, &t, 1, NULL, &acc));
            double sync[HREPEATS], bare[HREPEATS], pieces[HREPEATS], sent = 0;
            for (int rep = -HWARMUP; rep < HREPEATS; rep++) {
                OK(gradacc_accumulator_add(acc, one, grads, 1, 1));
                gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
                MPI_Barrier(MPI_COMM_WORLD);
                double tx = local == 0 ? host_tx_bytes() : 0;
                double t0 = MPI_Wtime();
                OK(gradacc_accumulator_sync(acc, comm, &info));
                double s = slowest(t0);
                double mine = local == 0 ? host_tx_bytes() - tx : 0, all = 0;
                MPI_Allreduce(&mine, &all, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
                MPI_Barrier(MPI_COMM_WORLD);
                t0 = MPI_Wtime();
                MPI_Allreduce(MPI_IN_PLACE, plain, (int)floats, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
                double b = slowest(t0);
                MPI_Barrier(MPI_COMM_WORLD);
                t0 = MPI_Wtime();
                for (size_t at = 0; at < floats; at += piece)
                    MPI_Allreduce(MPI_IN_PLACE, plain + at, (int)(floats - at < piece ? floats - at : piece), MPI_FLOAT,
                                  MPI_SUM, MPI_COMM_WORLD);
                double p = slowest(t0);
                for (size_t i = 0; i < n; i++) /* keep the values finite */
                    plain[i] = 1.0f;
                if (rep >= 0) {
                    sync[rep] = s;
                    bare[rep] = b;
                    pieces[rep] = p;
                    sent += all / HREPEATS;
                }
            }
            double b = median_of(bare, HREPEATS), p = median_of(pieces, HREPEATS);
            const double *best = b <= p ? bare : pieces;
            if (rank == 0)
                printf("| %d | %s | %zuM | %s | %d | %.1f | %.1f | %.1f | %.3f | %.1f | %.3f |\n", size, path, n >> 20,
                       w ? "bf16" : "fp32", ks[ki], median_of(sync, HREPEATS) * 1e3, b * 1e3, p * 1e3,
                       median_ratio(sync, best, HREPEATS), sent / 1e6, sent / ((hosts - 1) * (double)n * (w ? 6 : 8)));
            gradacc_accumulator_destroy(acc);
        }
    }
    free(g);
    free(plain);
    gradacc_scaler_destroy(one);
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    int sharding = argc > 1 && strcmp(argv[1], "--reduce-scatter") == 0;
    int wire = argc > 1 && strcmp(argv[1], "--wire") == 0;
    int zero2 = argc > 1 && strcmp(argv[1], "--zero2") == 0;
    int hosts = argc > 1 && strcmp(argv[1], "--hosts") == 0;
    const char *path = NULL;
    int host_count = 0;
    if (hosts) { /* --hosts PATH HOSTS N */
        if (argc < 5) {
            fprintf(stderr, "usage: mpi_boundary --hosts PATH HOSTS N\n");
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
        path = argv[2];
        host_count = atoi(argv[3]);
        argc -= 3;
        argv += 3;
    }
    if (sharding || wire || zero2) {
        argc--;
        argv++;
    }
    size_t n = argc > 1 ? (size_t)strtoull(argv[1], NULL, 0) : (size_t)16 << 20;

    gradacc_mpi_config_t mc;
    OK(gradacc_mpi_config_default(&mc));
    gradacc_comm_t *comm;
    OK(gradacc_comm_create_mpi((int64_t)MPI_Comm_c2f(MPI_COMM_WORLD), &mc, &comm));
    gradacc_scaler_t *scaler;
    OK(gradacc_scaler_create(NULL, NULL, &scaler));
    if (hosts) {
        hosts_table(n, comm, path, host_count);
        gradacc_scaler_destroy(scaler);
        gradacc_comm_destroy(comm);
        MPI_Finalize();
        return 0;
    }
    if (sharding || wire || zero2) {
        if (sharding)
            reduce_scatter_table(n, comm, scaler);
        else if (zero2)
            zero2_table(n, comm, scaler);
        else
            wire_table(n, comm);
        gradacc_scaler_destroy(scaler);
        gradacc_comm_destroy(comm);
        MPI_Finalize();
        return 0;
    }
    gradacc_tensor_desc_t t = {n, GRADACC_DTYPE_F16};
    gradacc_accumulator_t *acc;
    gradacc_accumulator_config_t ac;
    OK(gradacc_accumulator_config_default(&ac));
    if (getenv("GRADACC_BENCH_BUCKET"))
        ac.bucket_numel = strtoull(getenv("GRADACC_BENCH_BUCKET"), NULL, 0);
    OK(gradacc_accumulator_create(&ac, &t, 1, NULL, &acc));
    /* The gradients, 1.0-1.5 unscaled by the default scale of 65536, make a norm of about
     * 0.08 at 16M parameters: a clipping norm of 1e-3 applies at any size from 1M up. */
    ac.max_grad_norm = 1e-3f;
    gradacc_accumulator_t *clip;
    OK(gradacc_accumulator_create(&ac, &t, 1, NULL, &clip));
    ac.max_grad_norm = 0.0f;
    gradacc_accumulator_t *msg;
    OK(gradacc_accumulator_create(&ac, &t, 1, NULL, &msg));
    mc.shared_memory = 0;
    gradacc_comm_t *messages;
    OK(gradacc_comm_create_mpi((int64_t)MPI_Comm_c2f(MPI_COMM_WORLD), &mc, &messages));
    uint16_t *g = malloc(n * 2);
    float *plain = malloc(n * 4);
    for (size_t i = 0; i < n; i++) {
        g[i] = (uint16_t)(0x3c00 + (i % 512)); /* 1.0 .. 1.5 */
        plain[i] = 1.0f + (float)(i % 512) / 1024.0f;
    }
    const void *grads[1] = {g};

    if (rank == 0) {
        printf("| K | deferred sync (ms) | clipped sync (ms) | messages sync (ms) | naive K x all-reduce (ms) | "
               "naive / deferred | bare MPI_Allreduce (ms) |");
        for (int i = 0; i < NPIECES; i++)
            printf(" in %zu KB pieces (ms) |", PIECES[i] * 4 >> 10);
        printf(" sync / fastest | clipped / fastest | messages / fastest |\n|---|---|---|---|---|---|---|");
        for (int i = 0; i < NPIECES; i++)
            printf("---|");
        printf("---|---|---|\n");
    }
    const int ks[3] = {1, 4, 8};
    for (int ki = 0; ki < 3; ki++) {
        int k = ks[ki];
        double deferred[REPEATS], clipped[REPEATS], messaged[REPEATS], naive[REPEATS], bare[REPEATS],
            pieces[NPIECES][REPEATS];
        for (int rep = -WARMUP; rep < REPEATS; rep++) { /* negative repeats warm up */
            for (int m = 0; m < k; m++) {
                OK(gradacc_accumulator_add(acc, scaler, grads, 1, 1));
                OK(gradacc_accumulator_add(clip, scaler, grads, 1, 1));
                OK(gradacc_accumulator_add(msg, scaler, grads, 1, 1));
            }
            MPI_Barrier(MPI_COMM_WORLD);
            double t0 = MPI_Wtime();
            gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
            OK(gradacc_accumulator_sync(acc, comm, &info));
            double d = slowest(t0);

            MPI_Barrier(MPI_COMM_WORLD);
            t0 = MPI_Wtime();
            OK(gradacc_accumulator_sync(clip, comm, &info));
            double c = slowest(t0);
            if (info.clip_coef >= 1.0) {
                fprintf(stderr, "clipping did not apply (norm %g)\n", info.grad_norm);
                MPI_Abort(MPI_COMM_WORLD, 1);
            }

            MPI_Barrier(MPI_COMM_WORLD);
            t0 = MPI_Wtime();
            OK(gradacc_accumulator_sync(msg, messages, &info));
            double ms = slowest(t0);

            MPI_Barrier(MPI_COMM_WORLD);
            t0 = MPI_Wtime();
            for (int m = 0; m < k; m++)
                MPI_Allreduce(MPI_IN_PLACE, plain, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            double nv = slowest(t0);

            MPI_Barrier(MPI_COMM_WORLD);
            t0 = MPI_Wtime();
            MPI_Allreduce(MPI_IN_PLACE, plain, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            double b = slowest(t0);

            for (int i = 0; i < NPIECES; i++) {
                size_t piece = PIECES[i];
                MPI_Barrier(MPI_COMM_WORLD);
                t0 = MPI_Wtime();
                for (size_t s = 0; s < n; s += piece)
                    MPI_Allreduce(MPI_IN_PLACE, plain + s, (int)(n - s < piece ? n - s : piece), MPI_FLOAT, MPI_SUM,
                                  MPI_COMM_WORLD);
                double p = slowest(t0);
                if (rep >= 0)
                    pieces[i][rep] = p;
            }
            for (size_t i = 0; i < n; i++) /* keep the values finite */
                plain[i] = 1.0f;
            if (rep >= 0) {
                deferred[rep] = d;
                clipped[rep] = c;
                messaged[rep] = ms;
                naive[rep] = nv;
                bare[rep] = b;
            }
        }
        double d = median_of(deferred, REPEATS), c = median_of(clipped, REPEATS), ms = median_of(messaged, REPEATS);
        double nv = median_of(naive, REPEATS);
        double b = median_of(bare, REPEATS), p[NPIECES], fastest = b;
        const double *best = bare; /* the fastest way, by median; the ratios are per repeat against it */
        for (int i = 0; i < NPIECES; i++) {
            p[i] = median_of(pieces[i], REPEATS);
            if (p[i] < fastest) {
                fastest = p[i];
                best = pieces[i];
            }
        }
        if (rank == 0) {
            printf("| %d | %.1f | %.1f | %.1f | %.1f | %.2f | %.1f |", k, d * 1e3, c * 1e3, ms * 1e3, nv * 1e3, nv / d,
                   b * 1e3);
            for (int i = 0; i < NPIECES; i++)
                printf(" %.1f |", p[i] * 1e3);
            /* Three decimals: the report rounds for display, but holds the target to these. */
            printf(" %.3f | %.3f | %.3f |\n", median_ratio(deferred, best, REPEATS), median_ratio(clipped, best, REPEATS),
                   median_ratio(messaged, best, REPEATS));
        }
    }
    free(g);
    free(plain);
    gradacc_accumulator_destroy(acc);
    gradacc_accumulator_destroy(clip);
    gradacc_accumulator_destroy(msg);
    gradacc_scaler_destroy(scaler);
    gradacc_comm_destroy(messages);
    gradacc_comm_destroy(comm);
    MPI_Finalize();
    return 0;
}
