/* One rank of tests/simhosts/faults: syncs a boundary of NUMEL f32 elements again and again over
 * MPI_COMM_WORLD until a sync fails, then writes when it returned (CLOCK_MONOTONIC, which every
 * process of the machine shares, namespaces or not), its status, the error text and whether its
 * window is still intact to $FAULTS_DIR/result.<rank>, and waits for $FAULTS_DIR/done before it
 * exits (without MPI_Finalize: peers are gone). After 3 good syncs it writes ready.<rank>.
 * With FAULTS_ROUNDS=N (a healthy run) it syncs N times, writes each sync's seconds to
 * bench.<rank>, and exits normally after MPI_Finalize; a failure is written as above.
 * Environment: FAULTS_DIR, FAULTS_TIMEOUT (s, the communicator's timeout), FAULTS_NUMEL. */
#include "mpi/timeout_common.h"

#include <unistd.h>

static void write_file(const char *dir, const char *what, int rank, const char *text)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s.%d", dir, what, rank);
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f)
        return;
    fputs(text, f);
    fclose(f);
    rename(tmp, path);
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
    const int rank = world_rank();
    char host[256] = "";
    gethostname(host, sizeof host - 1);
    gradacc_comm_t *comm = comm_of(MPI_COMM_WORLD);
    REQUIRE_OK(gradacc_comm_set_timeout(comm, timeout));
    gradacc_scaler_t *scaler = scaler_with_scale(1.0f);
    gradacc_tensor_desc_t t[1] = {{numel, GRADACC_DTYPE_F32}};
    float *g = malloc(numel * sizeof *g);
    for (size_t i = 0; i < numel; i++)
        g[i] = (float)((int)(i % 97) - 48 + rank);
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
