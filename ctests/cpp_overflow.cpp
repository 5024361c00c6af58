// The overflow policies through the C++ wrapper (gradacc.hpp): 4 ranks on threads, 6 f32 tensors,
// 3 micro-batches per rank of 4 + m items (a mean-reduced loss, BY_COUNT), and one inf in tensor 4
// of rank 2's micro-batch 1. SKIP_STEP skips the step; DROP_MICROBATCH drops that micro-batch and
// leaves the mean over the 55 items of the other 11. Both name the place in SyncInfo on every rank
// and back the scale off. With tensor_stats on, every rank reports tensor 4 non-finite in one
// micro-batch and the others in none, and under DROP_MICROBATCH each tensor's norm is its
// master's. Then the config values the constructor refuses, and tensor_stats() where it throws.
#include <gradacc.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "cpp_expect.hpp"

namespace {

constexpr int RANKS = 4, TENSORS = 6, N = 3, MICROBATCHES = 3, BAD_RANK = 2, BAD_MB = 1, BAD_TENSOR = 4;
constexpr float SCALE = 1024.0f;

// The true gradient of rank r's micro-batch m, tensor t, element i: exact in f32, also scaled.
double grad_value(int r, int m, int t, int i)
{
    return ((r + 1) * 0.25 + (m + 1) * 0.125 + t * 0.0625) * (i % 2 ? -1.0 : 1.0) / 8.0;
}

int items(int m) { return 4 + m; }

struct RankResult {
    gradacc::SyncInfo info{};
    bool skipped = false;
    float scale = 0.0f;
    std::vector<float> master;
    std::vector<gradacc::TensorStats> stats;
};

// One rank's tensor stats: one per tensor, tensor BAD_TENSOR non-finite in one micro-batch (over
// every rank) and the others in none, and the same bits as rank 0's.
void check_stats(const std::vector<gradacc::TensorStats> &stats, const std::vector<gradacc::TensorStats> &first,
                 const char *name, int rank)
{
    EXPECT(stats.size() == TENSORS, "%s, rank %d: %zu tensor stats", name, rank, stats.size());
    for (std::size_t t = 0; t < stats.size() && t < first.size(); t++) {
        const uint64_t want = t == BAD_TENSOR ? 1 : 0;
        EXPECT(stats[t].nonfinite_microbatches == want, "%s, rank %d: tensor %zu non-finite in %llu micro-batches",
               name, rank, t, (unsigned long long)stats[t].nonfinite_microbatches);
        EXPECT(std::memcmp(&stats[t].grad_norm, &first[t].grad_norm, sizeof(double)) == 0 &&
                   stats[t].nonfinite_microbatches == first[t].nonfinite_microbatches,
               "%s, rank %d: tensor %zu's stats differ from rank 0's", name, rank, t);
    }
}

RankResult run_rank(gradacc::Communicator &comm, int rank, gradacc_overflow_t policy)
{
    gradacc::ScalerConfig sc;
    sc.init_scale = SCALE;
    gradacc::Scaler scaler(sc);
    gradacc::AccumulatorConfig config;
    config.overflow = policy;
    config.tensor_stats = 1;
    std::vector<gradacc::TensorDesc> tensors(TENSORS, gradacc::TensorDesc{N, GRADACC_DTYPE_F32});
    gradacc::Accumulator acc(tensors, config);
    std::vector<std::vector<float>> g(TENSORS, std::vector<float>(N));
    std::vector<const void *> grads(TENSORS);
    for (int m = 0; m < MICROBATCHES; m++) {
        for (int t = 0; t < TENSORS; t++) {
            for (int i = 0; i < N; i++)
                g[t][i] = static_cast<float>(grad_value(rank, m, t, i) * SCALE);
            grads[t] = g[t].data();
        }
        if (rank == BAD_RANK && m == BAD_MB)
            g[BAD_TENSOR][1] = std::numeric_limits<float>::infinity();
        acc.add(scaler, grads, static_cast<uint64_t>(items(m)));
    }
    RankResult out;
    out.info = acc.sync(comm);
    for (int t = 0; t < TENSORS; t++)
        for (float v : acc.master(static_cast<std::size_t>(t)))
            out.master.push_back(v);
    out.stats = acc.tensor_stats();
    out.skipped = scaler.update(acc);
    out.scale = scaler.scale();
    return out;
}

void run(gradacc_overflow_t policy, const char *name)
{
    gradacc::LocalGroup group(RANKS);
    std::vector<RankResult> results(RANKS);
    std::vector<std::thread> threads;
    for (int r = 0; r < RANKS; r++)
        threads.emplace_back([&, r] { results[r] = run_rank(group[r], r, policy); });
    for (std::thread &t : threads)
        t.join();
    const bool drop = policy == GRADACC_OVERFLOW_DROP_MICROBATCH;
    for (int r = 0; r < RANKS; r++) {
        const gradacc::SyncInfo &info = results[r].info;
        EXPECT(info.overflow_at == GRADACC_OVERFLOW_AT_GRADIENT && info.overflow_rank == BAD_RANK &&
                   info.overflow_microbatch == BAD_MB && info.overflow_tensor == BAD_TENSOR,
               "%s, rank %d: overflow at %d (rank %llu, micro-batch %llu, tensor %llu)", name, r, info.overflow_at,
               (unsigned long long)info.overflow_rank, (unsigned long long)info.overflow_microbatch,
               (unsigned long long)info.overflow_tensor);
        EXPECT(info.found_inf == !drop && results[r].skipped == !drop, "%s, rank %d: found_inf %d skipped %d", name,
               r, info.found_inf, results[r].skipped);
        EXPECT(info.dropped_microbatches == (drop ? 1u : 0u), "%s, rank %d: %llu dropped", name, r,
               (unsigned long long)info.dropped_microbatches);
        EXPECT(info.microbatches == (drop ? 11u : 12u) && info.total_count == (drop ? 55u : 60u),
               "%s, rank %d: %llu micro-batches, %llu items", name, r, (unsigned long long)info.microbatches,
               (unsigned long long)info.total_count);
        EXPECT(results[r].scale == SCALE / 2, "%s, rank %d: scale %g after the update", name, r, results[r].scale);
        EXPECT(results[r].master == results[0].master, "%s: rank %d's gradient differs", name, r);
        check_stats(results[r].stats, results[0].stats, name, r);
    }
    // A skipped step's norm holds the inf; a dropped micro-batch leaves each tensor's norm its
    // master's (no clipping here).
    const double bad_norm = results[0].stats.at(BAD_TENSOR).grad_norm;
    EXPECT(drop == std::isfinite(bad_norm), "%s: tensor %d's norm %g", name, BAD_TENSOR, bad_norm);
    if (!drop)
        return;
    for (int t = 0; t < TENSORS; t++) {
        double sq = 0.0;
        for (int i = 0; i < N; i++) {
            const double v = results[0].master[static_cast<std::size_t>(t * N + i)];
            sq += v * v;
        }
        const double got = results[0].stats.at(static_cast<std::size_t>(t)).grad_norm;
        EXPECT(std::fabs(got - std::sqrt(sq)) <= 1e-12 * std::sqrt(sq), "tensor %d's norm %.17g, want %.17g", t,
               got, std::sqrt(sq));
    }
    // The mean over the 55 kept items: each micro-batch's mean weighted by its items.
    for (int t = 0; t < TENSORS; t++) {
        for (int i = 0; i < N; i++) {
            double sum = 0.0;
            for (int r = 0; r < RANKS; r++)
                for (int m = 0; m < MICROBATCHES; m++)
                    if (!(r == BAD_RANK && m == BAD_MB))
                        sum += grad_value(r, m, t, i) * items(m);
            const double want = sum / 55.0, got = results[0].master[static_cast<std::size_t>(t * N + i)];
            EXPECT(std::fabs(got - want) <= 1e-6 * std::fabs(want), "tensor %d element %d: %.9g, want %.9g", t, i,
                   got, want);
        }
    }
}

// The status and message gradacc::Accumulator's constructor throws for `config`.
gradacc::Error refusal(const gradacc::AccumulatorConfig &config, gradacc::Communicator *comm = nullptr)
{
    gradacc::TensorDesc tensors[1] = {{4, GRADACC_DTYPE_F32}};
    try {
        if (comm)
            gradacc::Accumulator::sharded(tensors, *comm, config);
        else
            gradacc::Accumulator acc(tensors, config);
    } catch (const gradacc::Error &e) {
        return e;
    }
    return gradacc::Error(GRADACC_STATUS_OK, "accepted");
}

void refused_configs()
{
    gradacc::AccumulatorConfig config;
    EXPECT(config.overflow == GRADACC_OVERFLOW_SKIP_STEP, "the default policy is %d", config.overflow);
    config.overflow = 7;
    gradacc::Error e = refusal(config);
    EXPECT(e.status() == GRADACC_STATUS_INVALID_ARGUMENT &&
               e.message().find("`config`.overflow = 7") != std::string::npos,
           "overflow 7: %s", e.what());
    gradacc::LocalGroup one(1);
    config.overflow = GRADACC_OVERFLOW_DROP_MICROBATCH;
    config.sharding = GRADACC_SHARDING_ACCUMULATE;
    e = refusal(config, &one[0]);
    EXPECT(e.status() == GRADACC_STATUS_OK, "DROP_MICROBATCH with sharded accumulation: %s", e.what());
    config.overflow = GRADACC_OVERFLOW_SKIP_STEP;
    config.tensor_stats = 1;
    e = refusal(config, &one[0]);
    EXPECT(e.status() == GRADACC_STATUS_OK, "tensor_stats with sharded accumulation: %s", e.what());
    config = gradacc::AccumulatorConfig();
    EXPECT(config.tensor_stats == 0, "tensor_stats is on by default: %u", config.tensor_stats);
    config.tensor_stats = 2;
    e = refusal(config);
    EXPECT(e.status() == GRADACC_STATUS_INVALID_ARGUMENT &&
               e.message().find("`config`.tensor_stats = 2") != std::string::npos,
           "tensor_stats 2: %s", e.what());
}

// The status and message acc.tensor_stats() throws.
gradacc::Error stats_refusal(const gradacc::Accumulator &acc)
{
    try {
        acc.tensor_stats();
    } catch (const gradacc::Error &e) {
        return e;
    }
    return gradacc::Error(GRADACC_STATUS_OK, "returned");
}

// tensor_stats() throws WRONG_STATE when the config left it off, and before the first sync.
void stats_refusals()
{
    gradacc::ScalerConfig sc;
    sc.init_scale = 1.0f;
    gradacc::Scaler scaler(sc);
    gradacc::AccumulatorConfig config;
    for (uint32_t on : {0u, 1u}) {
        config.tensor_stats = on;
        gradacc::Accumulator acc({{2, GRADACC_DTYPE_F32}}, config);
        gradacc::Error e = stats_refusal(acc);
        EXPECT(e.status() == GRADACC_STATUS_WRONG_STATE, "tensor_stats %u, before the sync: %s", on, e.what());
        const float g[2] = {3.0f, 4.0f};
        acc.add(scaler, {g}, 1);
        acc.sync();
        e = stats_refusal(acc);
        if (on) {
            EXPECT(e.status() == GRADACC_STATUS_OK, "tensor_stats 1, after the sync: %s", e.what());
            const std::vector<gradacc::TensorStats> stats = acc.tensor_stats();
            EXPECT(stats.size() == 1, "one process: %zu tensor stats", stats.size());
            EXPECT(!stats.empty() && stats[0].grad_norm == 5.0 && stats[0].nonfinite_microbatches == 0,
                   "one process: the norm of [3, 4] is not 5, or it counted non-finite values");
        } else {
            EXPECT(e.status() == GRADACC_STATUS_WRONG_STATE &&
                       e.message().find("tensor_stats") != std::string::npos,
                   "tensor_stats 0, after the sync: %s", e.what());
        }
    }
}

} // namespace

int main()
{
    run(GRADACC_OVERFLOW_SKIP_STEP, "SKIP_STEP");
    run(GRADACC_OVERFLOW_DROP_MICROBATCH, "DROP_MICROBATCH");
    refused_configs();
    stats_refusals();
    if (failures) {
        std::fprintf(stderr, "%d failure(s)\n", failures);
        return 1;
    }
    std::printf("ok\n");
    return 0;
}
