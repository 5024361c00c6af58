// Communicator failures and resumed windows through the C++ wrapper (gradacc.hpp): two saved
// windows merged into a fresh accumulator, the timeout round trip and its refused values, abort
// of a local group (also waking a peer blocked in sync), and a timeout as gradacc::TimeoutError.
// Reduce-scatter sharding: each rank's shard against an unsharded sync of the same window on
// groups of 2 and 3, and the errors of a sharded accumulator configured or synced wrongly.
// The hybrid boundary (sync_hybrid) on a 2x2 grid against a 4-rank unsharded sync, and crosswise
// replica groups failing on every rank.
// Sharded accumulation (Accumulator::sharded): shards on 2 and 3 ranks against an unsharded DDP
// sync of the same data, add and add_tensor bit for bit alike, one shard of one against the
// unsharded accumulator, and calls that fail on one rank failing on every rank.
#include <gradacc.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpp_expect.hpp"

static_assert(std::is_base_of_v<gradacc::Error, gradacc::TimeoutError>, "TimeoutError is an Error");

// The status `f` throws as a gradacc::Error, or GRADACC_STATUS_OK when it returns.
template <class F>
static gradacc_status_t status_of(F &&f)
{
    try {
        f();
    } catch (const gradacc::Error &e) {
        return e.status();
    }
    return GRADACC_STATUS_OK;
}

static gradacc::Scaler unit_scaler()
{
    gradacc::ScalerConfig config;
    config.init_scale = 1.0f;
    return gradacc::Scaler(config);
}

// The window of one rank that added one f32 micro-batch of `count` items.
static std::vector<uint8_t> saved_window(float g0, float g1, uint64_t count)
{
    gradacc::Scaler scaler = unit_scaler();
    gradacc::Accumulator acc({{2, GRADACC_DTYPE_F32}});
    const float g[2] = {g0, g1};
    acc.add(scaler, {g}, count);
    return acc.save_window();
}

static void one_microbatch(gradacc::Accumulator &acc)
{
    gradacc::Scaler scaler = unit_scaler();
    const float g[2] = {1.0f, 1.0f};
    acc.add(scaler, {g}, 1);
}

static void merge_two_windows()
{
    const std::vector<uint8_t> a = saved_window(1.0f, 2.0f, 1), b = saved_window(3.0f, 5.0f, 3);
    gradacc::LocalGroup group(1);
    gradacc::Accumulator acc({{2, GRADACC_DTYPE_F32}});
    acc.merge_window(a);
    acc.merge_window(b);
    const gradacc::SyncInfo info = acc.sync(group[0]);
    EXPECT(info.total_count == 4 && info.microbatches == 2 && !info.found_inf, "count %llu, micro-batches %llu",
           (unsigned long long)info.total_count, (unsigned long long)info.microbatches);
    // Mean losses over 1 and 3 items, normalised by the 4 items: (1 * a + 3 * b) / 4.
    const gradacc::span<float> m = acc.master(0);
    EXPECT(m[0] == 2.5f && m[1] == 4.25f, "master %g %g", m[0], m[1]);
}

static void merge_refuses_corrupt_bytes()
{
    const std::vector<uint8_t> window = saved_window(4.0f, 8.0f, 2);
    gradacc::Accumulator acc({{2, GRADACC_DTYPE_F32}});
    const std::vector<uint8_t> truncated(window.begin(), window.end() - 1);
    const uint8_t junk[] = {'n', 'o', 't', ' ', 'a', ' ', 'w', 'i', 'n', 'd', 'o', 'w'};
    EXPECT(status_of([&] { acc.merge_window(truncated); }) == GRADACC_STATUS_CORRUPT_STATE, "truncated");
    EXPECT(status_of([&] { acc.merge_window(junk); }) == GRADACC_STATUS_CORRUPT_STATE, "junk");
    acc.merge_window(window);
    const gradacc::SyncInfo info = acc.sync();
    EXPECT(info.total_count == 2 && info.microbatches == 1, "the failed merges added something");
    EXPECT(acc.master(0)[0] == 4.0f && acc.master(0)[1] == 8.0f, "master %g", acc.master(0)[0]);
}

static void timeout_round_trip()
{
    gradacc::LocalGroup group(2);
    gradacc::Communicator &c = group[0];
    EXPECT(c.timeout() == 600.0, "default %g", c.timeout());
    c.set_timeout(2.5);
    EXPECT(c.timeout() == 2.5, "got %g", c.timeout());
    EXPECT(group[1].timeout() == 600.0, "per handle: %g", group[1].timeout());
    c.set_timeout(std::chrono::milliseconds(1500));
    EXPECT(c.timeout() == 1.5, "chrono: %g", c.timeout());
    c.set_timeout(0.0);
    EXPECT(c.timeout() == 0.0, "forever: %g", c.timeout());
    for (double bad : {-1.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
        try {
            c.set_timeout(bad);
            EXPECT(false, "%g accepted", bad);
        } catch (const gradacc::Error &e) {
            EXPECT(e.status() == GRADACC_STATUS_INVALID_ARGUMENT, "%g: %s", bad, e.what());
            EXPECT(!e.message().empty(), "%g: no message", bad);
        }
    }
    EXPECT(c.timeout() == 0.0, "a refused value changed it: %g", c.timeout());
}

static void abort_then_sync_fails()
{
    gradacc::LocalGroup group(1);
    gradacc::Accumulator acc({{2, GRADACC_DTYPE_F32}});
    one_microbatch(acc);
    group[0].abort();
    for (int i = 0; i < 2; i++)
        EXPECT(status_of([&] { acc.sync(group[0]); }) == GRADACC_STATUS_COMM_FAILURE, "sync %d after abort", i);
}

static void abort_wakes_a_blocked_peer()
{
    gradacc::LocalGroup group(2);
    group[0].set_timeout(std::chrono::seconds(60)); // a broken abort fails instead of hanging
    gradacc::Accumulator acc({{2, GRADACC_DTYPE_F32}});
    one_microbatch(acc);
    gradacc_status_t seen = GRADACC_STATUS_OK;
    std::thread rank0([&] { seen = status_of([&] { acc.sync(group[0]); }); }); // rank 1 never syncs
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    group[1].abort(); // rank 1 gives up: the whole in-process group fails
    rank0.join();
    EXPECT(seen == GRADACC_STATUS_COMM_FAILURE, "blocked sync ended with %d", (int)seen);
}

static void timeout_throws_timeout_error()
{
    gradacc::LocalGroup group(2);
    group[0].set_timeout(std::chrono::milliseconds(200));
    gradacc::Accumulator acc({{2, GRADACC_DTYPE_F32}});
    one_microbatch(acc);
    bool timed_out = false;
    try {
        acc.sync(group[0]); // rank 1 never syncs
    } catch (const gradacc::TimeoutError &e) {
        timed_out = e.status() == GRADACC_STATUS_TIMEOUT;
    } catch (const gradacc::Error &e) {
        EXPECT(false, "not a TimeoutError: %s", e.what());
    }
    EXPECT(timed_out, "the lone sync did not time out");
    EXPECT(status_of([&] { acc.sync(group[0]); }) == GRADACC_STATUS_COMM_FAILURE, "after the timeout");
}

// ---- reduce-scatter sharding ---------------------------------------------------------------

// 18003 elements at 0, 7040, 12096 and 18112 (each at a multiple of GRADACC_MASTER_ALIGN bytes):
// a flat master of 18176, 2 shards of 12288 and 5888, 3 of 8192, 8192 and 1792 (blocks of 4096).
static const std::vector<gradacc::TensorDesc> kShardTensors = {
    {7000, GRADACC_DTYPE_F16}, {5000, GRADACC_DTYPE_F32}, {6000, GRADACC_DTYPE_BF16}, {3, GRADACC_DTYPE_F32}};
static const std::size_t kShardOffsets[] = {0, 7040, 12096, 18112};
static const std::size_t kShardTotal = 18176;

// The flat master of `acc` over kShardTensors: each tensor's master at Accumulator::offset, zeros
// in the padding.
static std::vector<float> flat_master(const gradacc::Accumulator &acc)
{
    std::vector<float> flat(kShardTotal, 0.0f);
    for (std::size_t i = 0; i < acc.num_tensors(); i++) {
        const gradacc::span<float> m = acc.master(i);
        std::copy(m.begin(), m.end(), flat.begin() + static_cast<std::ptrdiff_t>(acc.offset(i)));
    }
    return flat;
}

static bool same_bits(const float *a, const float *b, std::size_t n)
{
    return n == 0 || std::memcmp(a, b, n * sizeof(float)) == 0;
}

static bool same_info(const gradacc::SyncInfo &a, const gradacc::SyncInfo &b)
{
    return a.found_inf == b.found_inf && a.total_count == b.total_count && a.microbatches == b.microbatches &&
           std::memcmp(&a.grad_norm, &b.grad_norm, sizeof a.grad_norm) == 0 &&
           std::memcmp(&a.clip_coef, &b.clip_coef, sizeof a.clip_coef) == 0;
}

// One micro-batch of loss-scaled random gradients: f32 values, f16 and bf16 words (finite).
struct RandomGrads {
    std::vector<std::vector<float>> f32;
    std::vector<std::vector<uint16_t>> words;
    std::vector<const void *> ptrs;

    explicit RandomGrads(std::mt19937 &rng)
    {
        f32.reserve(kShardTensors.size()); // no reallocation: ptrs point into these buffers
        words.reserve(kShardTensors.size());
        std::normal_distribution<float> normal(0.0f, 64.0f);
        for (const gradacc::TensorDesc &t : kShardTensors) {
            std::vector<float> g(t.numel);
            for (float &x : g)
                x = normal(rng);
            if (t.dtype == GRADACC_DTYPE_F32) {
                f32.push_back(std::move(g));
                ptrs.push_back(f32.back().data());
                continue;
            }
            std::vector<uint16_t> w(t.numel);
            for (std::size_t i = 0; i < w.size(); i++) {
                uint32_t bits;
                std::memcpy(&bits, &g[i], sizeof bits);
                if (t.dtype == GRADACC_DTYPE_BF16) {
                    w[i] = static_cast<uint16_t>(bits >> 16);
                } else { // fp16 of |x| < 2^14 by truncation (magnitudes below 2^-14 flush to zero)
                    const int e = static_cast<int>((bits >> 23) & 0xff) - 127 + 15;
                    const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
                    w[i] = e <= 0 ? sign : static_cast<uint16_t>(sign | (std::min(e, 29) << 10) | ((bits >> 13) & 0x3ff));
                }
            }
            words.push_back(std::move(w));
            ptrs.push_back(words.back().data());
        }
    }
};

struct ShardRank {
    std::string error; // an unexpected exception on the rank's thread
    gradacc::SyncInfo sharded_info{}, plain_info{};
    std::size_t offset = 0, numel = 0;
    bool address_is_flat_master_at_offset = false;
    std::vector<float> shard, plain; // the shard's values; the unsharded flat master
};

static uint64_t microbatch_count(int rank, int m) { return 1 + static_cast<uint64_t>((3 * rank + m) % 5); }

// Every rank adds the same three random micro-batches to a sharded and an unsharded accumulator
// and syncs each on its own group: the shard must be the unsharded master's range, bit for bit.
static void sharded_sync_matches_unsharded(int world, float max_grad_norm)
{
    gradacc::LocalGroup sharded_group(world), plain_group(world);
    std::vector<ShardRank> ranks(static_cast<std::size_t>(world));
    std::vector<std::thread> threads;
    for (int r = 0; r < world; r++) {
        threads.emplace_back([&, r] {
            ShardRank &out = ranks[static_cast<std::size_t>(r)];
            try {
                gradacc::ScalerConfig sc;
                sc.init_scale = 1024.0f;
                gradacc::Scaler scaler(sc);
                gradacc::AccumulatorConfig plain_config;
                plain_config.max_grad_norm = max_grad_norm;
                gradacc::AccumulatorConfig sharded_config = plain_config;
                sharded_config.sharding = GRADACC_SHARDING_REDUCE_SCATTER;
                sharded_config.shard_count = static_cast<uint32_t>(world);
                sharded_config.shard_rank = static_cast<uint32_t>(r);
                gradacc::Accumulator sharded(kShardTensors, sharded_config), plain(kShardTensors, plain_config);
                std::mt19937 rng(static_cast<uint32_t>(100 * world + r));
                for (int m = 0; m < 3; m++) {
                    const RandomGrads g(rng);
                    sharded.add(scaler, g.ptrs, microbatch_count(r, m));
                    plain.add(scaler, g.ptrs, microbatch_count(r, m));
                }
                out.sharded_info = sharded.sync(sharded_group[static_cast<std::size_t>(r)]);
                out.plain_info = plain.sync(plain_group[static_cast<std::size_t>(r)]);
                const gradacc::Shard s = sharded.shard();
                out.offset = s.offset;
                out.numel = s.numel();
                out.shard.assign(s.data.begin(), s.data.end());
                out.address_is_flat_master_at_offset = s.data.data() == sharded.master(0).data() + s.offset;
                out.plain = flat_master(plain);
            } catch (const std::exception &e) {
                out.error = e.what();
            }
        });
    }
    for (std::thread &t : threads)
        t.join();

    uint64_t total_count = 0;
    for (int r = 0; r < world; r++)
        for (int m = 0; m < 3; m++)
            total_count += microbatch_count(r, m);
    std::size_t next = 0; // the shards tile the layout in rank order
    for (int r = 0; r < world; r++) {
        const ShardRank &x = ranks[static_cast<std::size_t>(r)];
        EXPECT(x.error.empty(), "world %d rank %d: %s", world, r, x.error.c_str());
        if (!x.error.empty())
            continue;
        EXPECT(x.offset == next, "world %d rank %d: shard at %zu, the previous ended at %zu", world, r, x.offset, next);
        EXPECT(x.numel > 0 && x.numel < kShardTotal, "world %d rank %d: %zu elements", world, r, x.numel);
        next = x.offset + x.numel;
        EXPECT(x.address_is_flat_master_at_offset, "world %d rank %d: the shard's address", world, r);
        EXPECT(same_info(x.sharded_info, x.plain_info), "world %d rank %d: norm %.9g vs %.9g, clip %.9g vs %.9g",
               world, r, x.sharded_info.grad_norm, x.plain_info.grad_norm, x.sharded_info.clip_coef,
               x.plain_info.clip_coef);
        EXPECT(same_info(x.sharded_info, ranks[0].sharded_info), "world %d rank %d: info differs from rank 0", world, r);
        EXPECT(x.sharded_info.total_count == total_count && x.sharded_info.microbatches == 3u * world &&
                   !x.sharded_info.found_inf,
               "world %d rank %d: count %llu, micro-batches %llu", world, r,
               (unsigned long long)x.sharded_info.total_count, (unsigned long long)x.sharded_info.microbatches);
        EXPECT((x.sharded_info.clip_coef < 1.0) == (max_grad_norm > 0.0f), "world %d: clip_coef %g", world,
               x.sharded_info.clip_coef);
        EXPECT(x.plain.size() == kShardTotal && x.offset + x.numel <= x.plain.size() &&
                   same_bits(x.shard.data(), x.plain.data() + x.offset, x.numel),
               "world %d rank %d: the shard is not the unsharded master's elements %zu..%zu", world, r, x.offset,
               x.offset + x.numel);
        bool any_nonzero = false;
        for (float v : x.shard)
            any_nonzero = any_nonzero || v != 0.0f;
        EXPECT(any_nonzero, "world %d rank %d: an all-zero shard", world, r);
        EXPECT(x.plain.size() == ranks[0].plain.size() && same_bits(x.plain.data(), ranks[0].plain.data(), x.plain.size()),
               "world %d rank %d: the unsharded masters differ", world, r);
    }
    EXPECT(next == kShardTotal, "world %d: the shards end at %zu of %zu", world, next, kShardTotal);
}

static void unsharded_shard_is_the_whole_master()
{
    gradacc::Scaler scaler = unit_scaler();
    gradacc::Accumulator acc(kShardTensors);
    std::mt19937 rng(7);
    const RandomGrads g(rng);
    acc.add(scaler, g.ptrs, 4);
    acc.sync();
    const gradacc::Shard s = acc.shard();
    EXPECT(s.offset == 0 && s.numel() == kShardTotal, "offset %zu, %zu elements", s.offset, s.numel());
    EXPECT(s.data.data() == acc.master(0).data(), "not the master's address");
    EXPECT(gradacc::Accumulator::master_numel(kShardTensors) == kShardTotal, "master_numel %zu",
           gradacc::Accumulator::master_numel(kShardTensors));
    for (std::size_t i = 0; i < acc.num_tensors(); i++) {
        const gradacc::span<float> m = acc.master(i);
        const std::size_t at = acc.offset(i);
        EXPECT(at == kShardOffsets[i], "tensor %zu at %zu", i, at);
        EXPECT(at + m.size() <= s.numel() && m.data() == s.data.data() + at, "tensor %zu is not in the shard", i);
        for (std::size_t k = at + m.size(); k < (i + 1 < acc.num_tensors() ? kShardOffsets[i + 1] : kShardTotal); k++)
            EXPECT(s.data[k] == 0.0f && !std::signbit(s.data[k]), "padding element %zu is %g", k, s.data[k]);
    }
    EXPECT(status_of([&] { acc.offset(acc.num_tensors()); }) == GRADACC_STATUS_INVALID_ARGUMENT, "offset past the end");
}

// The INVALID_ARGUMENT that creating an accumulator with `config` throws, or "" if it succeeds.
static std::string refused(const gradacc::AccumulatorConfig &config)
{
    try {
        gradacc::Accumulator acc(kShardTensors, config);
    } catch (const gradacc::Error &e) {
        EXPECT(e.status() == GRADACC_STATUS_INVALID_ARGUMENT, "%s", e.what());
        return e.message();
    }
    return "";
}

static void bad_sharding_configs_are_refused()
{
    const uint32_t bad[][2] = {{2, 2}, {3, 7}, {0, 0}};
    for (const auto &cr : bad) {
        gradacc::AccumulatorConfig c;
        c.sharding = GRADACC_SHARDING_REDUCE_SCATTER;
        c.shard_count = cr[0];
        c.shard_rank = cr[1];
        const std::string m = refused(c);
        EXPECT(m.find("shard_rank") != std::string::npos, "rank %u of %u: \"%s\"", cr[1], cr[0], m.c_str());
    }
    gradacc::AccumulatorConfig no_policy;
    no_policy.shard_count = 2;
    no_policy.shard_rank = 1;
    std::string m = refused(no_policy);
    EXPECT(m.find("sharding") != std::string::npos, "no policy: \"%s\"", m.c_str());
    gradacc::AccumulatorConfig unknown;
    unknown.sharding = 7;
    m = refused(unknown);
    EXPECT(m.find("sharding") != std::string::npos, "policy 7: \"%s\"", m.c_str());
    gradacc::AccumulatorConfig f16_wire;
    f16_wire.wire_dtype = GRADACC_DTYPE_F16;
    m = refused(f16_wire);
    EXPECT(m.find("wire_dtype") != std::string::npos, "f16 wire: \"%s\"", m.c_str());
}

// Each rank of a local group of `world` syncs an accumulator holding shard `shard_rank[r]` of
// `shard_count`: the status each rank's sync threw (GRADACC_STATUS_OK if none) and its message.
static std::vector<std::pair<gradacc_status_t, std::string>> sharded_sync_statuses(int world, uint32_t shard_count,
                                                                                     const std::vector<uint32_t> &shard_rank)
{
    gradacc::LocalGroup group(world);
    for (gradacc::Communicator &c : group)
        c.set_timeout(std::chrono::seconds(30)); // a rank left waiting fails instead of hanging
    std::vector<std::pair<gradacc_status_t, std::string>> seen(static_cast<std::size_t>(world));
    std::vector<std::thread> threads;
    for (int r = 0; r < world; r++) {
        threads.emplace_back([&, r] {
            const std::size_t q = static_cast<std::size_t>(r);
            try {
                gradacc::AccumulatorConfig c;
                c.sharding = GRADACC_SHARDING_REDUCE_SCATTER;
                c.shard_count = shard_count;
                c.shard_rank = shard_rank[q];
                gradacc::Accumulator acc({{2, GRADACC_DTYPE_F32}}, c);
                one_microbatch(acc);
                acc.sync(group[q]);
                seen[q] = {GRADACC_STATUS_OK, ""};
            } catch (const gradacc::Error &e) {
                seen[q] = {e.status(), e.message()};
            }
        });
    }
    for (std::thread &t : threads)
        t.join();
    return seen;
}

static void sharded_sync_on_the_wrong_group_fails_every_rank()
{
    const auto wrong_size = sharded_sync_statuses(2, 3, {0, 1});
    for (std::size_t r = 0; r < wrong_size.size(); r++) {
        EXPECT(wrong_size[r].first == GRADACC_STATUS_INVALID_ARGUMENT, "3 shards on 2 ranks, rank %zu: status %d",
               r, (int)wrong_size[r].first);
        EXPECT(wrong_size[r].second.find("of 3") != std::string::npos &&
                   wrong_size[r].second.find("of 2") != std::string::npos,
               "rank %zu: \"%s\"", r, wrong_size[r].second.c_str());
    }
    const auto one_wrong = sharded_sync_statuses(2, 2, {0, 0}); // rank 1 claims shard 0 too
    EXPECT(one_wrong[1].first == GRADACC_STATUS_INVALID_ARGUMENT &&
               one_wrong[1].second.find("shard 0 of 2") != std::string::npos,
           "rank 1: %d \"%s\"", (int)one_wrong[1].first, one_wrong[1].second.c_str());
    EXPECT(one_wrong[0].first == GRADACC_STATUS_PEER_FAILURE, "rank 0, whose shard is right: status %d",
           (int)one_wrong[0].first);

    gradacc::AccumulatorConfig c;
    c.sharding = GRADACC_SHARDING_REDUCE_SCATTER;
    c.shard_count = 2;
    gradacc::Accumulator acc({{2, GRADACC_DTYPE_F32}}, c);
    one_microbatch(acc);
    EXPECT(status_of([&] { acc.sync(); }) == GRADACC_STATUS_INVALID_ARGUMENT, "a sharded sync with no communicator");
}

// ---- hybrid boundary (HSDP) ------------------------------------------------------------------

// The communicators of a 2x2 grid: rank a * 2 + i is rank i of shard group a and rank a of
// replica group i. `crosswise` joins shard group 1 to the replica groups the other way round, so
// each replica group holds shards 0 and 1.
struct HybridGrid {
    static constexpr int S = 2, R = 2, W = S * R;
    std::vector<gradacc::LocalGroup> shard_groups, replica_groups;
    bool crosswise;

    explicit HybridGrid(bool crosswise_ = false) : crosswise(crosswise_)
    {
        for (int k = 0; k < R; k++)
            shard_groups.emplace_back(S);
        for (int k = 0; k < S; k++)
            replica_groups.emplace_back(R);
        for (auto *groups : {&shard_groups, &replica_groups})
            for (gradacc::LocalGroup &g : *groups)
                for (gradacc::Communicator &c : g)
                    c.set_timeout(std::chrono::seconds(30)); // a rank left waiting fails, not hangs
    }
    gradacc::Communicator &shard(int g) { return shard_groups[static_cast<std::size_t>(g / S)][static_cast<std::size_t>(g % S)]; }
    gradacc::Communicator &replicas(int g)
    {
        const int a = g / S, i = g % S, j = crosswise && a == 1 ? S - 1 - i : i;
        return replica_groups[static_cast<std::size_t>(j)][static_cast<std::size_t>(a)];
    }
};

struct HybridRank {
    std::string error;
    gradacc::SyncInfo hybrid_info{}, ddp_info{};
    std::size_t offset = 0;
    std::vector<float> shard, ddp; // the hybrid shard; the unsharded 4-rank master
};

// Every rank of a 2x2 grid adds the same three random micro-batches to a sharded accumulator
// (synced with sync_hybrid) and to an unsharded one (synced over all 4 ranks, as DDP): the shards
// must match the DDP master within the rounding of another summation order, replicas must hold
// the same bits, and the infos must agree.
static void hybrid_matches_ddp(float max_grad_norm)
{
    HybridGrid grid;
    gradacc::LocalGroup ddp_group(HybridGrid::W);
    std::vector<HybridRank> ranks(HybridGrid::W);
    std::vector<std::thread> threads;
    for (int g = 0; g < HybridGrid::W; g++) {
        threads.emplace_back([&, g] {
            HybridRank &out = ranks[static_cast<std::size_t>(g)];
            try {
                gradacc::ScalerConfig sc;
                sc.init_scale = 1024.0f;
                gradacc::Scaler scaler(sc);
                gradacc::AccumulatorConfig ddp_config;
                ddp_config.max_grad_norm = max_grad_norm;
                gradacc::AccumulatorConfig hybrid_config = ddp_config;
                hybrid_config.sharding = GRADACC_SHARDING_REDUCE_SCATTER;
                hybrid_config.shard_count = HybridGrid::S;
                hybrid_config.shard_rank = static_cast<uint32_t>(g % HybridGrid::S);
                gradacc::Accumulator hybrid(kShardTensors, hybrid_config), ddp(kShardTensors, ddp_config);
                std::mt19937 rng(static_cast<uint32_t>(500 + g));
                for (int m = 0; m < 3; m++) {
                    const RandomGrads grads(rng);
                    hybrid.add(scaler, grads.ptrs, microbatch_count(g, m));
                    ddp.add(scaler, grads.ptrs, microbatch_count(g, m));
                }
                out.hybrid_info = hybrid.sync_hybrid(grid.shard(g), grid.replicas(g));
                out.ddp_info = ddp.sync(ddp_group[static_cast<std::size_t>(g)]);
                const gradacc::Shard s = hybrid.shard();
                out.offset = s.offset;
                out.shard.assign(s.data.begin(), s.data.end());
                out.ddp = flat_master(ddp);
            } catch (const std::exception &e) {
                out.error = e.what();
            }
        });
    }
    for (std::thread &t : threads)
        t.join();

    uint64_t total_count = 0;
    for (int g = 0; g < HybridGrid::W; g++)
        for (int m = 0; m < 3; m++)
            total_count += microbatch_count(g, m);
    bool raised = false;
    for (const HybridRank &x : ranks) {
        EXPECT(x.error.empty(), "%s", x.error.c_str());
        raised = raised || !x.error.empty();
    }
    if (raised)
        return;
    const std::vector<float> &ddp = ranks[0].ddp;
    float largest = 0.0f;
    for (float v : ddp)
        largest = std::max(largest, std::fabs(v));
    std::size_t next = 0;
    for (int g = 0; g < HybridGrid::W; g++) {
        const HybridRank &x = ranks[static_cast<std::size_t>(g)];
        const gradacc::SyncInfo &h = x.hybrid_info, &d = x.ddp_info;
        EXPECT(same_info(h, ranks[0].hybrid_info), "rank %d: the hybrid info differs from rank 0's", g);
        EXPECT(h.total_count == total_count && d.total_count == total_count && h.microbatches == 12 && !h.found_inf,
               "rank %d: count %llu (DDP %llu), micro-batches %llu", g, (unsigned long long)h.total_count,
               (unsigned long long)d.total_count, (unsigned long long)h.microbatches);
        EXPECT(std::fabs(h.grad_norm - d.grad_norm) <= 1e-5 * d.grad_norm &&
                   std::fabs(h.clip_coef - d.clip_coef) <= 1e-5 * d.clip_coef,
               "rank %d: norm %.9g (DDP %.9g), clip %.9g (DDP %.9g)", g, h.grad_norm, d.grad_norm, h.clip_coef,
               d.clip_coef);
        EXPECT((h.clip_coef < 1.0) == (max_grad_norm > 0.0f), "rank %d: clip_coef %g", g, h.clip_coef);
        if (g >= HybridGrid::S) { // a replica: the bits of the shard group 0 rank holding its shard
            const HybridRank &twin = ranks[static_cast<std::size_t>(g % HybridGrid::S)];
            EXPECT(x.offset == twin.offset && x.shard.size() == twin.shard.size() &&
                       same_bits(x.shard.data(), twin.shard.data(), x.shard.size()),
                   "rank %d differs from its replica, rank %d", g, g % HybridGrid::S);
            continue;
        }
        EXPECT(x.offset == next && !x.shard.empty(), "rank %d: shard at %zu, the previous ended at %zu", g, x.offset, next);
        next = x.offset + x.shard.size();
        std::size_t bad = 0;
        for (std::size_t k = 0; k < x.shard.size() && x.offset + k < ddp.size(); k++)
            bad += !(std::fabs(x.shard[k] - ddp[x.offset + k]) <= 1e-5f * largest);
        EXPECT(bad == 0, "rank %d: %zu of %zu shard elements differ from the DDP master by more than %g", g, bad,
               x.shard.size(), 1e-5 * largest);
    }
    EXPECT(next == kShardTotal, "the shards end at %zu of %zu", next, kShardTotal);
}

// Replica groups that pair different shards throw SIZE_MISMATCH on every rank; the window stays
// intact, so sync_hybrid on the right groups then counts every rank's micro-batch.
static void crosswise_replicas_fail_every_rank()
{
    HybridGrid wrong(true), right;
    std::vector<std::pair<gradacc_status_t, std::string>> seen(HybridGrid::W);
    std::vector<gradacc::SyncInfo> after(HybridGrid::W);
    std::vector<std::thread> threads;
    for (int g = 0; g < HybridGrid::W; g++) {
        threads.emplace_back([&, g] {
            const std::size_t q = static_cast<std::size_t>(g);
            try {
                gradacc::AccumulatorConfig c;
                c.sharding = GRADACC_SHARDING_REDUCE_SCATTER;
                c.shard_count = HybridGrid::S;
                c.shard_rank = static_cast<uint32_t>(g % HybridGrid::S);
                gradacc::Accumulator acc({{2, GRADACC_DTYPE_F32}}, c);
                one_microbatch(acc);
                try {
                    acc.sync_hybrid(wrong.shard(g), wrong.replicas(g));
                    seen[q] = {GRADACC_STATUS_OK, ""};
                } catch (const gradacc::Error &e) {
                    seen[q] = {e.status(), e.message()};
                }
                after[q] = acc.sync_hybrid(right.shard(g), right.replicas(g));
            } catch (const gradacc::Error &e) {
                seen[q] = {e.status(), std::string("afterwards: ") + e.message()};
            }
        });
    }
    for (std::thread &t : threads)
        t.join();
    for (int g = 0; g < HybridGrid::W; g++) {
        const auto &x = seen[static_cast<std::size_t>(g)];
        EXPECT(x.first == GRADACC_STATUS_SIZE_MISMATCH && x.second.find("replica groups") != std::string::npos,
               "rank %d: status %d \"%s\"", g, (int)x.first, x.second.c_str());
        EXPECT(after[static_cast<std::size_t>(g)].microbatches == HybridGrid::W, "rank %d: %llu micro-batches afterwards", g,
               (unsigned long long)after[static_cast<std::size_t>(g)].microbatches);
    }
}

// ---- sharded accumulation (ZeRO-2) ------------------------------------------------------------

static gradacc::AccumulatorConfig accumulate_config(uint32_t shards, uint32_t rank, float max_grad_norm = 0.0f)
{
    gradacc::AccumulatorConfig c;
    c.sharding = GRADACC_SHARDING_ACCUMULATE;
    c.shard_count = shards;
    c.shard_rank = rank;
    c.max_grad_norm = max_grad_norm;
    c.bucket_numel = 4096; // several buckets, so micro-batches are reduced piece by piece
    return c;
}

// The elements of `shard` as a vector.
static std::vector<float> copied(const gradacc::Shard &shard) { return {shard.data.begin(), shard.data.end()}; }

struct AccumulateRank {
    std::string error;
    gradacc::SyncInfo by_add{}, by_tensor{}, ddp_info{};
    std::size_t offset = 0;
    std::vector<float> shard, tensor_shard, ddp; // shards filled by add and by add_tensor; DDP's flat master
    std::vector<bool> readable;                  // master(i) succeeds: tensor i lies wholly in the shard
};

// Every rank adds the same three random micro-batches to two sharded accumulations (one through
// add, one tensor by tensor in backward order through add_tensor) and to an unsharded one synced
// over the whole group (DDP). The two ways must give the same bits, and the shards DDP's values
// within the rounding of another summation order.
static void sharded_accumulation_matches_ddp(int world, float max_grad_norm)
{
    gradacc::LocalGroup add_group(world), tensor_group(world), ddp_group(world);
    for (gradacc::LocalGroup *g : {&add_group, &tensor_group})
        for (gradacc::Communicator &c : *g)
            c.set_timeout(std::chrono::seconds(60)); // a rank out of step fails instead of hanging
    std::vector<AccumulateRank> ranks(static_cast<std::size_t>(world));
    std::vector<std::thread> threads;
    for (int r = 0; r < world; r++) {
        threads.emplace_back([&, r] {
            const std::size_t q = static_cast<std::size_t>(r);
            AccumulateRank &out = ranks[q];
            try {
                gradacc::ScalerConfig sc;
                sc.init_scale = 1024.0f;
                gradacc::Scaler scaler(sc);
                const gradacc::AccumulatorConfig config = accumulate_config(static_cast<uint32_t>(world), static_cast<uint32_t>(r), max_grad_norm);
                gradacc::Accumulator by_add = gradacc::Accumulator::sharded(kShardTensors, add_group[q], config);
                gradacc::Accumulator by_tensor = gradacc::Accumulator::sharded(kShardTensors, tensor_group[q], config);
                gradacc::AccumulatorConfig ddp_config;
                ddp_config.max_grad_norm = max_grad_norm;
                gradacc::Accumulator ddp(kShardTensors, ddp_config);
                std::mt19937 rng(static_cast<uint32_t>(900 + 10 * world + r));
                for (int m = 0; m < 3; m++) {
                    const RandomGrads g(rng);
                    const uint64_t count = microbatch_count(r, m);
                    by_add.add(scaler, g.ptrs, count);
                    by_tensor.begin_microbatch(count);
                    for (std::size_t i = kShardTensors.size(); i-- > 0;)
                        by_tensor.add_tensor(scaler, i, g.ptrs[i], kShardTensors[i].numel);
                    by_tensor.end_microbatch();
                    ddp.add(scaler, g.ptrs, count);
                }
                out.by_add = by_add.sync();                   // NULL: the creation communicator
                out.by_tensor = by_tensor.sync(tensor_group[q]); // or the same handle
                out.ddp_info = ddp.sync(ddp_group[q]);
                const gradacc::Shard s = by_add.shard();
                out.offset = s.offset;
                out.shard = copied(s);
                out.tensor_shard = copied(by_tensor.shard());
                out.ddp = flat_master(ddp);
                for (std::size_t i = 0; i < ddp.num_tensors(); i++) {
                    const gradacc_status_t st = status_of([&] { by_add.master(i); });
                    EXPECT(st == GRADACC_STATUS_OK || st == GRADACC_STATUS_INVALID_ARGUMENT, "rank %d tensor %zu: %d", r, i, (int)st);
                    out.readable.push_back(st == GRADACC_STATUS_OK);
                }
            } catch (const std::exception &e) {
                out.error = e.what();
            }
        });
    }
    for (std::thread &t : threads)
        t.join();

    uint64_t total_count = 0;
    for (int r = 0; r < world; r++)
        for (int m = 0; m < 3; m++)
            total_count += microbatch_count(r, m);
    for (int r = 0; r < world; r++)
        EXPECT(ranks[static_cast<std::size_t>(r)].error.empty(), "world %d rank %d: %s", world, r,
               ranks[static_cast<std::size_t>(r)].error.c_str());
    for (const AccumulateRank &x : ranks)
        if (!x.error.empty())
            return;
    const std::vector<float> &ddp = ranks[0].ddp;
    float largest = 0.0f;
    for (float v : ddp)
        largest = std::max(largest, std::fabs(v));
    std::size_t next = 0;
    for (int r = 0; r < world; r++) {
        const AccumulateRank &x = ranks[static_cast<std::size_t>(r)];
        const gradacc::SyncInfo &h = x.by_add, &d = x.ddp_info;
        EXPECT(same_info(h, x.by_tensor) && x.shard.size() == x.tensor_shard.size() &&
                   same_bits(x.shard.data(), x.tensor_shard.data(), x.shard.size()),
               "world %d rank %d: add_tensor differs from add", world, r);
        EXPECT(same_info(h, ranks[0].by_add), "world %d rank %d: the info differs from rank 0's", world, r);
        EXPECT(h.total_count == total_count && d.total_count == total_count && h.microbatches == 3u * world &&
                   !h.found_inf,
               "world %d rank %d: count %llu (DDP %llu), micro-batches %llu", world, r,
               (unsigned long long)h.total_count, (unsigned long long)d.total_count,
               (unsigned long long)h.microbatches);
        EXPECT(std::fabs(h.grad_norm - d.grad_norm) <= 1e-5 * d.grad_norm &&
                   std::fabs(h.clip_coef - d.clip_coef) <= 1e-5 * d.clip_coef,
               "world %d rank %d: norm %.9g (DDP %.9g), clip %.9g (DDP %.9g)", world, r, h.grad_norm, d.grad_norm,
               h.clip_coef, d.clip_coef);
        EXPECT((h.clip_coef < 1.0) == (max_grad_norm > 0.0f), "world %d: clip_coef %g", world, h.clip_coef);
        EXPECT(x.offset == next && !x.shard.empty() && x.shard.size() < kShardTotal,
               "world %d rank %d: shard %zu..%zu, the previous ended at %zu", world, r, x.offset,
               x.offset + x.shard.size(), next);
        next = x.offset + x.shard.size();
        std::size_t bad = 0;
        for (std::size_t k = 0; k < x.shard.size() && x.offset + k < ddp.size(); k++) {
            const float want = ddp[x.offset + k];
            bad += !(std::fabs(x.shard[k] - want) <= 1e-5f * std::fabs(want) + 1e-6f * largest);
        }
        EXPECT(bad == 0, "world %d rank %d: %zu of %zu shard elements differ from DDP's", world, r, bad, x.shard.size());
        // master(i) works exactly for the tensors wholly inside the shard.
        for (std::size_t i = 0; i < kShardTensors.size(); i++) {
            const std::size_t at = kShardOffsets[i], end = at + kShardTensors[i].numel;
            const bool inside = x.offset <= at && end <= x.offset + x.shard.size();
            EXPECT(x.readable[i] == inside, "world %d rank %d: master(%zu) %s", world, r, i,
                   inside ? "refused inside the shard" : "given outside the shard");
        }
    }
    EXPECT(next == kShardTotal, "world %d: the shards end at %zu of %zu", world, next, kShardTotal);
}

// One shard of one, created without a communicator, is the unsharded accumulator bit for bit.
static void one_shard_is_the_unsharded_accumulator()
{
    gradacc::ScalerConfig sc;
    sc.init_scale = 1024.0f;
    gradacc::Scaler scaler(sc);
    gradacc::AccumulatorConfig plain_config;
    plain_config.bucket_numel = 4096;
    gradacc::Accumulator one(kShardTensors, accumulate_config(1, 0)), plain(kShardTensors, plain_config);
    std::mt19937 rng(11);
    for (int m = 0; m < 3; m++) {
        const RandomGrads g(rng);
        one.add(scaler, g.ptrs, microbatch_count(0, m));
        plain.add(scaler, g.ptrs, microbatch_count(0, m));
    }
    const gradacc::SyncInfo a = one.sync(), b = plain.sync();
    const gradacc::Shard s = one.shard(), t = plain.shard();
    EXPECT(same_info(a, b), "norm %.9g vs %.9g", a.grad_norm, b.grad_norm);
    EXPECT(s.offset == 0 && s.numel() == kShardTotal && t.numel() == kShardTotal &&
               same_bits(s.data.data(), t.data.data(), kShardTotal),
           "one shard of one: %zu elements at %zu differ from the unsharded master", s.numel(), s.offset);
}

// The sharded creation path refuses what does not fit: the policy, the communicator, the device.
static void sharded_creation_is_checked()
{
    gradacc::LocalGroup group(2);
    const auto refused_with = [&](const gradacc::AccumulatorConfig &c, const gradacc::Device &device = gradacc::Device()) {
        try {
            gradacc::Accumulator::sharded(kShardTensors, group[0], c, device);
        } catch (const gradacc::Error &e) {
            return std::make_pair(e.status(), e.message());
        }
        return std::make_pair(GRADACC_STATUS_OK, std::string());
    };
    auto [status, message] = refused_with(accumulate_config(2, 1)); // the communicator is rank 0
    EXPECT(status == GRADACC_STATUS_INVALID_ARGUMENT && message.find("shard 1 of 2") != std::string::npos,
           "rank 1 on rank 0's communicator: %d \"%s\"", (int)status, message.c_str());
    std::tie(status, message) = refused_with(accumulate_config(3, 0));
    EXPECT(status == GRADACC_STATUS_INVALID_ARGUMENT, "3 shards on 2 ranks: %d \"%s\"", (int)status, message.c_str());
    gradacc::AccumulatorConfig rs = accumulate_config(2, 0);
    rs.sharding = GRADACC_SHARDING_REDUCE_SCATTER;
    std::tie(status, message) = refused_with(rs);
    EXPECT(status == GRADACC_STATUS_INVALID_ARGUMENT && message.find("GRADACC_SHARDING_ACCUMULATE") != std::string::npos,
           "another policy: %d \"%s\"", (int)status, message.c_str());
    std::tie(status, message) = refused_with(accumulate_config(2, 0), gradacc::Device::cuda(0, nullptr));
    EXPECT(status == GRADACC_STATUS_BACKEND_UNAVAILABLE, "CUDA: %d \"%s\"", (int)status, message.c_str());
    // Over several ranks the plain constructor has no communicator to reduce the micro-batches on.
    const std::string m = refused(accumulate_config(2, 0));
    EXPECT(m.find("communicator") != std::string::npos, "no communicator: \"%s\"", m.c_str());
}

// Rank 1's micro-batch is invalid (no items for a mean loss): it throws there and PEER_FAILURE
// on rank 0, with nothing added on either. Then rank 0 syncs on a stranger communicator:
// INVALID_ARGUMENT there, PEER_FAILURE on rank 1. The window survives both, and the sync
// afterwards counts only the valid micro-batches.
static void a_bad_call_on_one_rank_fails_every_rank()
{
    gradacc::LocalGroup group(2), stranger(1);
    for (gradacc::Communicator &c : group)
        c.set_timeout(std::chrono::seconds(30)); // a rank left waiting fails instead of hanging
    std::vector<std::pair<gradacc_status_t, std::string>> add_seen(2), sync_seen(2);
    std::vector<bool> unchanged(2, false);
    std::vector<gradacc::SyncInfo> after(2);
    std::vector<std::string> errors(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; r++) {
        threads.emplace_back([&, r] {
            const std::size_t q = static_cast<std::size_t>(r);
            const auto caught = [](auto &&f) {
                try {
                    f();
                } catch (const gradacc::Error &e) {
                    return std::make_pair(e.status(), e.message());
                }
                return std::make_pair(GRADACC_STATUS_OK, std::string());
            };
            try {
                gradacc::Scaler scaler = unit_scaler();
                gradacc::Accumulator acc = gradacc::Accumulator::sharded(kShardTensors, group[q], accumulate_config(2, static_cast<uint32_t>(r)));
                std::mt19937 rng(static_cast<uint32_t>(40 + r));
                const RandomGrads g(rng);
                acc.add(scaler, g.ptrs, 2);
                const std::vector<float> before = copied(acc.shard());
                add_seen[q] = caught([&] { acc.add(scaler, g.ptrs, r == 1 ? 0 : 2); });
                sync_seen[q] = caught([&] { r == 0 ? acc.sync(stranger[0]) : acc.sync(); });
                const std::vector<float> now = copied(acc.shard());
                unchanged[q] = now.size() == before.size() && same_bits(now.data(), before.data(), now.size());
                after[q] = acc.sync(group[q]);
            } catch (const std::exception &e) {
                errors[q] = e.what();
            }
        });
    }
    for (std::thread &t : threads)
        t.join();
    for (int r = 0; r < 2; r++) {
        const std::size_t q = static_cast<std::size_t>(r);
        EXPECT(errors[q].empty(), "rank %d: %s", r, errors[q].c_str());
        EXPECT(unchanged[q], "rank %d: the failed calls changed the shard", r);
        EXPECT(after[q].microbatches == 2 && after[q].total_count == 4, "rank %d: %llu micro-batches, %llu items afterwards", r,
               (unsigned long long)after[q].microbatches, (unsigned long long)after[q].total_count);
    }
    EXPECT(add_seen[1].first == GRADACC_STATUS_INVALID_ARGUMENT && add_seen[1].second.find("count") != std::string::npos,
           "rank 1's add of 0 items: %d \"%s\"", (int)add_seen[1].first, add_seen[1].second.c_str());
    EXPECT(add_seen[0].first == GRADACC_STATUS_PEER_FAILURE, "rank 0's valid add: %d \"%s\"", (int)add_seen[0].first,
           add_seen[0].second.c_str());
    EXPECT(sync_seen[0].first == GRADACC_STATUS_INVALID_ARGUMENT, "rank 0's sync on a stranger: %d \"%s\"",
           (int)sync_seen[0].first, sync_seen[0].second.c_str());
    EXPECT(sync_seen[1].first == GRADACC_STATUS_PEER_FAILURE, "rank 1's sync: %d \"%s\"", (int)sync_seen[1].first,
           sync_seen[1].second.c_str());
}

int main()
{
    try {
        merge_two_windows();
        merge_refuses_corrupt_bytes();
        timeout_round_trip();
        abort_then_sync_fails();
        abort_wakes_a_blocked_peer();
        timeout_throws_timeout_error();
        for (int world : {2, 3})
            for (float max_grad_norm : {0.0f, 0.25f})
                sharded_sync_matches_unsharded(world, max_grad_norm);
        unsharded_shard_is_the_whole_master();
        bad_sharding_configs_are_refused();
        sharded_sync_on_the_wrong_group_fails_every_rank();
        for (float max_grad_norm : {0.0f, 0.25f})
            hybrid_matches_ddp(max_grad_norm);
        crosswise_replicas_fail_every_rank();
        for (int world : {2, 3})
            for (float max_grad_norm : {0.0f, 0.25f})
                sharded_accumulation_matches_ddp(world, max_grad_norm);
        one_shard_is_the_unsharded_accumulator();
        sharded_creation_is_checked();
        a_bad_call_on_one_rank_fails_every_rank();
    } catch (const gradacc::Error &e) {
        std::fprintf(stderr, "unexpected: %s\n", e.what());
        return 1;
    }
    if (failures) {
        std::fprintf(stderr, "%d failure(s)\n", failures);
        return 1;
    }
    std::printf("ok\n");
    return 0;
}
