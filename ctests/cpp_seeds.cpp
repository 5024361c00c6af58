// The seed scenarios of ctests/seed_apex_o2.c and seed_accelerate.c through the C++ wrapper
// (gradacc.hpp): RAII objects, a local group driven by std::thread, sync() returning the info
// struct, master(i) as a view; and an error path whose gradacc::Error carries status and message.
#include <gradacc.hpp>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "cpp_expect.hpp"

static_assert(!std::is_copy_constructible_v<gradacc::Scaler> && std::is_move_constructible_v<gradacc::Scaler>,
              "Scaler is move-only");
static_assert(!std::is_copy_constructible_v<gradacc::Accumulator> &&
                  std::is_move_constructible_v<gradacc::Accumulator>,
              "Accumulator is move-only");
static_assert(!std::is_copy_constructible_v<gradacc::Communicator> &&
                  std::is_move_constructible_v<gradacc::Communicator>,
              "Communicator is move-only");

// fp16 words of small integers (exact in fp16): 1.0 = 0x3c00, 2.0 = 0x4000.
static uint16_t f16_of_small_int(int v)
{
    return v == 1 ? 0x3c00 : v == 2 ? 0x4000 : 0x0000;
}

struct RankResult {
    float weight = NAN, bias = NAN;
    gradacc::SyncInfo info{};
    std::string error;
};

// Seed apex-o2: Linear(1,1), loss = mean(output), inputs 1.0 and 2.0 on two ranks, two micro-batches
// each with fp16 gradients (weight grad = input, bias grad = 1), loss scale 1.
static void apex_rank(gradacc::Communicator &comm, double input, gradacc_normalize_t normalize, RankResult &out)
{
    try {
        gradacc::ScalerConfig sc;
        sc.init_scale = 1.0f;
        gradacc::Scaler scaler(sc);
        gradacc::AccumulatorConfig ac;
        ac.normalize = normalize;
        gradacc::Accumulator acc({{1, GRADACC_DTYPE_F16}, {1, GRADACC_DTYPE_F16}}, ac);
        const uint16_t w = f16_of_small_int(static_cast<int>(input)), b = f16_of_small_int(1);
        for (int m = 0; m < 2; m++)
            acc.add(scaler, {&w, &b}, 1);
        out.info = acc.sync(comm);
        out.weight = acc.master(0)[0];
        out.bias = acc.master(1)[0];
        bool skipped = scaler.update(acc);
        if (skipped)
            out.error = "step skipped";
    } catch (const gradacc::Error &e) {
        out.error = e.what();
    }
}

static void apex_o2(gradacc_normalize_t normalize, float want_w, float want_b, const char *how)
{
    gradacc::LocalGroup group(2);
    EXPECT(group.size() == 2 && group[1].rank() == 1 && group[0].world_size() == 2, "local group of 2");
    RankResult results[2];
    std::vector<std::thread> threads;
    for (std::size_t r = 0; r < group.size(); r++)
        threads.emplace_back(apex_rank, std::ref(group[r]), r == 0 ? 1.0 : 2.0, normalize, std::ref(results[r]));
    for (std::thread &t : threads)
        t.join();
    for (int r = 0; r < 2; r++) {
        EXPECT(results[r].error.empty(), "%s rank %d: %s", how, r, results[r].error.c_str());
        EXPECT(results[r].weight == want_w && results[r].bias == want_b,
               "%s rank %d: weight grad %g bias grad %g, expected %g and %g", how, r, results[r].weight,
               results[r].bias, want_w, want_b);
        EXPECT(!results[r].info.found_inf && results[r].info.total_count == 4 && results[r].info.microbatches == 4,
               "%s rank %d: sync info", how, r);
    }
    EXPECT(std::memcmp(&results[0].weight, &results[1].weight, sizeof(float)) == 0, "%s: ranks differ", how);
    std::printf("apex-o2 %-15s: both ranks weight grad %g, bias grad %g\n", how, results[0].weight, results[0].bias);
}

// Seed accelerate: x = 1..8, y = 2x, w = 0, MSE, 4 micro-batches of 2, SGD lr 0.02 -> w = 2.04.
static void accelerate()
{
    double x[8], y[8];
    for (int i = 0; i < 8; i++) {
        x[i] = i + 1;
        y[i] = 2 * x[i];
    }
    gradacc::ScalerConfig sc;
    sc.init_scale = 1.0f;
    gradacc::Scaler scaler(sc);
    gradacc::Accumulator acc({{1, GRADACC_DTYPE_F32}}); // BY_COUNT, mean-reduced losses
    float w = 0.0f;
    for (int m = 0; m < 4; m++) {
        double g = 0.0;
        for (int i = 2 * m; i < 2 * m + 2; i++)
            g += 2.0 * (w * x[i] - y[i]) * x[i];
        float grad = static_cast<float>(g / 2.0) * scaler.scale();
        acc.add(scaler, {&grad}, 2);
    }
    gradacc::SyncInfo info = acc.sync();
    EXPECT(!scaler.update(acc), "step skipped");
    EXPECT(info.total_count == 8 && info.microbatches == 4, "count %llu micro-batches %llu",
           (unsigned long long)info.total_count, (unsigned long long)info.microbatches);
    gradacc::span<float> g = acc.master(0);
    EXPECT(g.size() == 1 && g[0] == -102.0f, "accumulated gradient %g, expected -102", g[0]);
    w = static_cast<float>(w - 0.02 * g[0]);
    EXPECT(std::fabs(w - 2.04) <= 2.04 * 1.2e-7, "weight %.9g, expected 2.04", w);
    std::printf("accelerate: weight after one accumulated step %.5f\n", w);
}

// An fp16 gradient passed to an accumulator declared with fewer elements: the exception carries
// the status and the thread's message, which names the argument.
static void error_path()
{
    gradacc::Scaler scaler;
    gradacc::Accumulator acc({{4, GRADACC_DTYPE_F16}});
    const uint16_t grad[8] = {};
    acc.begin_microbatch(1);
    bool thrown = false;
    try {
        acc.add_tensor(scaler, 0, gradacc::span<const uint16_t>(grad, 8));
    } catch (const gradacc::Error &e) {
        thrown = true;
        EXPECT(e.status() == GRADACC_STATUS_SIZE_MISMATCH, "status %d (%s)", e.status(),
               gradacc_status_string(e.status()));
        EXPECT(!e.message().empty() && e.message() == gradacc_last_error(), "message \"%s\"", e.message().c_str());
        EXPECT(std::string(e.what()).find(e.message()) != std::string::npos, "what() \"%s\"", e.what());
        std::printf("error path: %s\n", e.what());
    }
    EXPECT(thrown, "a too-long gradient must throw gradacc::Error");

    thrown = false;
    try {
        gradacc::AccumulatorConfig ac;
        ac.normalize = 99;
        gradacc::Accumulator bad({{1, GRADACC_DTYPE_F32}}, ac);
    } catch (const gradacc::Error &e) {
        thrown = true;
        EXPECT(e.status() == GRADACC_STATUS_INVALID_ARGUMENT, "status %d", e.status());
        EXPECT(e.message().find("normalize") != std::string::npos, "message \"%s\"", e.message().c_str());
    }
    EXPECT(thrown, "an invalid config must throw");
}

// Moves transfer ownership: the moved-to object works, and each handle is destroyed once.
static void moves()
{
    gradacc::Scaler a;
    gradacc::Scaler b(std::move(a));
    EXPECT(a.get() == nullptr && b.get() != nullptr, "moved-from scaler keeps no handle");
    EXPECT(b.scale() == 65536.0f, "default scale %g", b.scale());
    gradacc::Accumulator acc({{3, GRADACC_DTYPE_F32}});
    gradacc::span<float> view = acc.master(0);
    gradacc::Accumulator moved(std::move(acc));
    EXPECT(moved.master(0).data() == view.data() && moved.num_tensors() == 1, "the buffer does not move");
    std::vector<uint8_t> state = b.save();
    b.load(state);
    EXPECT(b.stats().steps == 0, "stats after load");
}

int main()
{
    apex_o2(GRADACC_NORMALIZE_BY_WORLD, 3.0f, 2.0f, "BY_WORLD");
    apex_o2(GRADACC_NORMALIZE_BY_MICROBATCHES, 1.5f, 1.0f, "BY_MICROBATCHES");
    accelerate();
    error_path();
    moves();
    if (failures) {
        std::fprintf(stderr, "%d checks FAILED\n", failures);
        return 1;
    }
    std::printf("all checks passed\n");
    return 0;
}
