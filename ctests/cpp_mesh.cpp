// The mesh step through the C++ wrapper (gradacc::Mesh, gradacc::MeshPart): dp 2 x tp 2 threads
// in Megatron-Core's order (world rank = tp + 2 * dp), each with one accumulator reduced over its
// data-parallel group and a tensor replicated over tp. The job's count is the data ranks' only,
// every rank gets the same report, an inf on one rank names that world rank and part 0 on every
// rank, and a null accumulator on one rank throws NULL_ARGUMENT there and PEER_FAILURE elsewhere.
// Under DROP_MICROBATCH with each micro-batch ended by Mesh::end_microbatch, an inf on rank 3
// drops its micro-batch on its tp peer, rank 2, too, and the step goes ahead on the others.
#include <gradacc.hpp>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "cpp_expect.hpp"

namespace {

constexpr int TP = 2, DP = 2, RANKS = TP * DP;

struct Outcome {
    gradacc::MeshInfo good{}, inf{}, drop{};
    bool kept[2] = {false, false};
    gradacc_status_t refused = GRADACC_STATUS_OK;
    std::string message;
};

void run_rank(int rank, gradacc::Communicator &world, gradacc::Communicator &data, Outcome &out)
{
    gradacc::ScalerConfig sc;
    sc.init_scale = 1.0f;
    gradacc::Scaler scaler(sc);
    gradacc::AccumulatorConfig ac;
    ac.loss_reduction = GRADACC_LOSS_REDUCTION_SUM;
    ac.tensor_stats = 1;
    gradacc::Accumulator acc({{4, GRADACC_DTYPE_F32}, {2, GRADACC_DTYPE_F32}}, ac);
    const int dp = rank / TP, tp = rank % TP;
    gradacc::Mesh mesh(world, static_cast<std::uint32_t>(dp), DP);
    gradacc::MeshPart part;
    part.accumulator = &acc;
    part.comm = &data;
    part.replicated = {{1, TP, 0x6e6f726d}};

    auto add = [&](bool poison) {
        float g0[4] = {0.5f * (tp + 1), -0.25f, 0.125f * dp, 1.0f};
        float g1[2] = {0.75f, -0.5f * (dp + 1)};
        if (poison)
            g0[1] = std::numeric_limits<float>::infinity();
        acc.add(scaler, {g0, g1}, static_cast<std::uint64_t>(2 + dp));
    };
    add(false);
    out.good = mesh.sync({part});
    add(rank == 3);
    out.inf = mesh.sync({part});
    add(false);
    gradacc::MeshPart bad = part;
    if (rank == 1)
        bad.accumulator = nullptr;
    try {
        mesh.sync({bad});
    } catch (const gradacc::Error &e) {
        out.refused = e.status();
        out.message = e.what();
    }

    ac.overflow = GRADACC_OVERFLOW_DROP_MICROBATCH;
    gradacc::Accumulator drop({{4, GRADACC_DTYPE_F32}, {2, GRADACC_DTYPE_F32}}, ac);
    part.accumulator = &drop;
    for (int mb = 0; mb < 2; mb++) {
        float g0[4] = {0.5f * (tp + 1), -0.25f * mb, 0.125f * dp, 1.0f};
        const float g1[2] = {0.75f, -0.5f * (dp + 1)};
        if (rank == 3 && mb == 1)
            g0[1] = std::numeric_limits<float>::infinity();
        drop.begin_microbatch(static_cast<std::uint64_t>(2 + dp));
        drop.add_tensor(scaler, 0, g0, 4);
        drop.add_tensor(scaler, 1, g1, 2);
        out.kept[mb] = mesh.end_microbatch({&drop});
    }
    out.drop = mesh.sync({part});
}

} // namespace

int main()
{
    gradacc::LocalGroup world(RANKS);
    std::vector<gradacc::LocalGroup> data;
    for (int tp = 0; tp < TP; tp++)
        data.emplace_back(DP);
    std::vector<Outcome> out(RANKS);
    std::vector<std::thread> threads;
    for (int r = 0; r < RANKS; r++) {
        world[r].set_timeout(10.0);
        data[r % TP][r / TP].set_timeout(10.0);
        threads.emplace_back(run_rank, r, std::ref(world[r]), std::ref(data[r % TP][r / TP]), std::ref(out[r]));
    }
    for (std::thread &t : threads)
        t.join();

    // Per data rank: 2 + dp items; tp peers count once.
    for (int r = 0; r < RANKS; r++) {
        const gradacc::SyncInfo &g = out[r].good.info;
        EXPECT(g.total_count == 5 && !g.found_inf && !out[r].good.overflow_part, "rank %d: count %llu", r,
               static_cast<unsigned long long>(g.total_count));
        EXPECT(std::memcmp(&g.grad_norm, &out[0].good.info.grad_norm, sizeof g.grad_norm) == 0,
               "rank %d: norm %.17g, rank 0's %.17g", r, g.grad_norm, out[0].good.info.grad_norm);
        const gradacc::SyncInfo &f = out[r].inf.info;
        EXPECT(f.found_inf && f.overflow_at == GRADACC_OVERFLOW_AT_GRADIENT && f.overflow_rank == 3 &&
                   out[r].inf.overflow_part == std::optional<std::size_t>(0),
               "rank %d: inf %d rank %llu", r, static_cast<int>(f.found_inf),
               static_cast<unsigned long long>(f.overflow_rank));
        const gradacc_status_t want = r == 1 ? GRADACC_STATUS_NULL_ARGUMENT : GRADACC_STATUS_PEER_FAILURE;
        EXPECT(out[r].refused == want, "rank %d: status %d, want %d (%s)", r, static_cast<int>(out[r].refused),
               static_cast<int>(want), out[r].message.c_str());
    }
    for (int r = 0; r < RANKS; r++) {
        const gradacc::SyncInfo &d = out[r].drop.info;
        // Data rank 0 keeps 2 + 2 items, data rank 1 drops its second micro-batch: 3 of 3 + 3.
        EXPECT(d.total_count == 7 && d.microbatches == 3 && d.dropped_microbatches == 1 && !d.found_inf &&
                   d.overflow_rank == 3 && out[r].kept[0] && out[r].kept[1] == (r < 2),
               "rank %d: the drop's count %llu, mb %llu, dropped %llu", r,
               static_cast<unsigned long long>(d.total_count), static_cast<unsigned long long>(d.microbatches),
               static_cast<unsigned long long>(d.dropped_microbatches));
        EXPECT(std::memcmp(&d.grad_norm, &out[0].drop.info.grad_norm, sizeof d.grad_norm) == 0,
               "rank %d: the drop's norm differs from rank 0's", r);
    }
    EXPECT(out[1].message.find("`parts[0].accumulator` is NULL") != std::string::npos, "%s",
           out[1].message.c_str());

    // The shape: Megatron-Core's groups of world 4, tp 2, and what it refuses.
    const gradacc::MeshShape shape(RANKS, TP);
    for (std::uint32_t r = 0; r < RANKS; r++) {
        const gradacc::MeshGroup d = shape.group(r, "cp-dp"), t = shape.group(r, "tp");
        EXPECT(d.color == r % TP && d.key == r / TP && d.size == DP, "rank %u: data group %u %u %u", r, d.color,
               d.key, d.size);
        EXPECT(t.color == r / TP * TP && t.key == r % TP && t.size == TP, "rank %u: tp group %u %u %u", r, t.color,
               t.key, t.size);
    }
    bool refused = false;
    try {
        (void)shape.group(0, "tp-xp");
    } catch (const gradacc::Error &e) {
        refused = e.status() == GRADACC_STATUS_INVALID_ARGUMENT && std::strstr(e.what(), "\"xp\"") != nullptr;
    }
    EXPECT(refused, "an unknown axis is refused, naming it");
    refused = false;
    try {
        (void)world[0].split(0, 0);
    } catch (const gradacc::Error &e) {
        refused = e.status() == GRADACC_STATUS_INVALID_ARGUMENT;
    }
    EXPECT(refused, "an in-process communicator is not split");
    if (failures) {
        std::fprintf(stderr, "%d checks FAILED\n", failures);
        return 1;
    }
    return 0;
}
