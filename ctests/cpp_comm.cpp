// Communicator failures and resumed windows through the C++ wrapper (gradacc.hpp): two saved
// windows merged into a fresh accumulator, the timeout round trip and its refused values, abort
// of a local group (also waking a peer blocked in sync), and a timeout as gradacc::TimeoutError.
#include <gradacc.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <thread>
#include <type_traits>
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

int main()
{
    try {
        merge_two_windows();
        merge_refuses_corrupt_bytes();
        timeout_round_trip();
        abort_then_sync_fails();
        abort_wakes_a_blocked_peer();
        timeout_throws_timeout_error();
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
