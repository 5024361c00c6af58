/* One rank of tests/simhosts/faults: syncs a boundary of NUMEL f32 elements again and again over
 * MPI_COMM_WORLD until a sync fails, then writes when it returned (CLOCK_MONOTONIC, which every
 * process of the machine shares, namespaces or not), its status, the error text and whether its
 * window is still intact to $FAULTS_DIR/result.<rank>, the intact window's saved bytes to
 * window.<rank>, and waits for $FAULTS_DIR/done before it exits (without MPI_Finalize: peers are
 * gone). After 3 good syncs it writes ready.<rank>.
 * With FAULTS_ROUNDS=N (a healthy run) it syncs N times, writes each sync's seconds to
 * bench.<rank>, and exits normally after MPI_Finalize; a failure is written as above.
 * With FAULTS_RESUME=r,s,... (the ranks that survived a fault, in rank order) it is one rank of the
 * resume on the surviving hosts: rank j of this smaller world takes survivors j, j + size,
 * j + 2 size, ...: it loads or merges each one's saved window, replays the micro-batch of each
 * one whose window was discarded, syncs over MPI_COMM_WORLD, and writes to resume.<j> "ok" when
 * every element is exactly the f64 sum of the survivors' gradients (integers, exact in f32) and
 * the window counts one item per survivor, or what differs.
 * Environment: FAULTS_DIR, FAULTS_TIMEOUT (s, the communicator's timeout), FAULTS_NUMEL. */
#include "mpi/timeout_common.h"

#include <unistd.h>

static void write_bytes(const char *dir, const char *what, int rank, const void *data, size_t len)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s.%d", dir, what, rank);
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f)
        return;
    size_t wrote = fwrite(data, 1, len, f);
    if (fclose(f) == 0 && wrote == len)
        rename(tmp, path);
}

static void write_file(const char *dir, const char *what, int rank, const char *text)
{
    write_bytes(dir, what, rank, text, strlen(text));
}

/* The whole of $dir/window.<rank>, or NULL when there is none. */
static uint8_t *read_window(const char *dir, int rank, size_t *len)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/window.%d", dir, rank);
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    *len = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *bytes = malloc(*len ? *len : 1);
    if (fread(bytes, 1, *len, f) != *len) {
        free(bytes);
        bytes = NULL;
    }
    fclose(f);
    return bytes;
}

/* Rank `rank`'s gradient: small integers, so every sum of them is exact in f32. */
static void gradient_of(int rank, float *g, size_t numel)
{
    for (size_t i = 0; i < numel; i++)
        g[i] = (float)((int)(i % 97) - 48 + rank);
}

/* FAULTS_RESUME: this rank's share of the survivors' work, synced over the world (see the top). */
static int resume(const char *dir, const char *list, size_t numel)
{
    int survivors[64], n = 0;
    for (const char *c = list; *c && n < 64; c++) {
        survivors[n++] = atoi(c);
        while (*c && *c != ',')
            c++;
        if (!*c)
            break;
    }
    const int me = world_rank(), size = world_size();
    gradacc_comm_t *comm = comm_of(MPI_COMM_WORLD);
    gradacc_scaler_t *scaler = scaler_with_scale(1.0f);
    gradacc_tensor_desc_t t[1] = {{numel, GRADACC_DTYPE_F32}};
    gradacc_accumulator_t *acc = make_acc(t, 1, GRADACC_NORMALIZE_NONE, 0);
    float *g = malloc(numel * sizeof *g);
    const void *p[1] = {g};
    int loaded = 0, replayed = 0;
    for (int k = me; k < n; k += size) {
        size_t len = 0;
        uint8_t *bytes = read_window(dir, survivors[k], &len);
        if (bytes) {
            REQUIRE_OK(loaded ? gradacc_accumulator_merge_window(acc, bytes, len)
                              : gradacc_accumulator_load_window(acc, bytes, len));
            loaded++;
            free(bytes);
        }
    }
    for (int k = me; k < n; k += size) {
        char path[4096];
        snprintf(path, sizeof path, "%s/window.%d", dir, survivors[k]);
        if (access(path, F_OK) != 0) {
            gradient_of(survivors[k], g, numel);
            REQUIRE_OK(gradacc_accumulator_add(acc, scaler, p, 1, 1));
            replayed++;
        }
    }
    gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
    REQUIRE_OK(gradacc_accumulator_sync(acc, comm, &info));
    float *m;
    size_t len;
    REQUIRE_OK(gradacc_accumulator_master(acc, 0, &m, &len));
    char text[512];
    snprintf(text, sizeof text, "ok %d loaded %d replayed\n", loaded, replayed);
    if (info.total_count != (uint64_t)n)
        snprintf(text, sizeof text, "total_count %llu, expected %d\n", (unsigned long long)info.total_count, n);
    for (size_t i = 0; i < len; i++) {
        double want = 0.0;
        for (int k = 0; k < n; k++)
            want += (double)((int)(i % 97) - 48 + survivors[k]);
        if ((double)m[i] != want) {
            snprintf(text, sizeof text, "element %zu: %.9g, expected %.9g\n", i, (double)m[i], want);
            break;
        }
    }
    write_file(dir, "resume", me, text);
    gradacc_accumulator_destroy(acc);
    gradacc_scaler_destroy(scaler);
    free(g);
    gradacc_comm_destroy(comm);
    MPI_Finalize();
    return 0;
}

static uint64_t monotonic_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    const char *dir = getenv("FAULTS_DIR");
    const double timeout = getenv("FAULTS_TIMEOUT") ? atof(getenv("FAULTS_TIMEOUT")) : 20.0;
    const size_t numel = getenv("FAULTS_NUMEL") ? (size_t)atoll(getenv("FAULTS_NUMEL")) : (size_t)1 << 20;
    if (!dir) {
        fprintf(stderr, "FAULTS_DIR is not set\n");
        return 2;
    }
    if (getenv("FAULTS_RESUME"))
        return resume(dir, getenv("FAULTS_RESUME"), numel);
    const int rank = world_rank();
    char host[256] = "";
    gethostname(host, sizeof host - 1);
    gradacc_comm_t *comm = comm_of(MPI_COMM_WORLD);
    REQUIRE_OK(gradacc_comm_set_timeout(comm, timeout));
    gradacc_scaler_t *scaler = scaler_with_scale(1.0f);
    gradacc_tensor_desc_t t[1] = {{numel, GRADACC_DTYPE_F32}};
    float *g = malloc(numel * sizeof *g);
    gradient_of(rank, g, numel);
    const void *p[1] = {g};
    const int rounds = getenv("FAULTS_ROUNDS") ? atoi(getenv("FAULTS_ROUNDS")) : 0;
    char *bench = calloc((size_t)rounds * 16 + 1, 1);
    size_t bench_len = 0;
    char text[8192];
    for (int round = 0;; round++) {
        gradacc_accumulator_t *acc = make_acc(t, 1, GRADACC_NORMALIZE_NONE, 0);
        REQUIRE_OK(gradacc_accumulator_add(acc, scaler, p, 1, 1));
        size_t before = 0;
        REQUIRE_OK(gradacc_accumulator_save_window(acc, NULL, 0, &before));
        gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;
        uint64_t t0 = monotonic_ns();
        gradacc_status_t st = gradacc_accumulator_sync(acc, comm, &info);
        uint64_t t1 = monotonic_ns();
        if (st != GRADACC_STATUS_OK) {
            /* Intact: the window saves as before and says so in the error. */
            int intact = strstr(gradacc_last_error(), "discarded") == NULL;
            snprintf(text, sizeof text, "%llu\t%s\t%d\t%.3f\t%d\t%s\t%s\n", (unsigned long long)t1,
                     gradacc_status_string((int32_t)st), intact, (double)(t1 - t0) * 1e-9, round, host, gradacc_last_error());
            if (intact) {
                size_t len = 0;
                REQUIRE_OK(gradacc_accumulator_save_window(acc, NULL, 0, &len));
                uint8_t *bytes = malloc(len);
                REQUIRE_OK(gradacc_accumulator_save_window(acc, bytes, len, &len));
                write_bytes(dir, "window", rank, bytes, len);
                free(bytes);
            }
            write_file(dir, "result", rank, text);
            break;
        }
        gradacc_accumulator_destroy(acc);
        if (rounds > 0) {
            bench_len += (size_t)snprintf(bench + bench_len, 16, "%.6f\n", (double)(t1 - t0) * 1e-9);
            if (round + 1 == rounds) {
                write_file(dir, "bench", rank, bench);
                gradacc_comm_destroy(comm);
                MPI_Finalize();
                return 0;
            }
            continue;
        }
        if (round == 2) {
            snprintf(text, sizeof text, "%d %s\n", (int)getpid(), host);
            write_file(dir, "ready", rank, text);
        }
    }
    char done[4096];
    snprintf(done, sizeof done, "%s/done", dir);
    for (int i = 0; i < 6000 && access(done, F_OK) != 0; i++)
        sleep_s(0.01);
    _exit(0);
}
