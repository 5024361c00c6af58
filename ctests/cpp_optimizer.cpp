// The optimizer through the C++ wrapper (gradacc.hpp): SGD steps on fp16 and f32 weights checked
// bit for bit against w + (-lr) * g in f32 rounded once to fp16, a step skipped for an inf
// gradient that changes nothing, the learning rate and groups taking effect, save and load, a
// two-rank reduce-scatter group whose weights are the one-rank run's, and errors as
// gradacc::Error with the argument named; adopted FP32 masters kept at creation and stepped in
// place; the clip coefficient applied inside the step (sync_for_step) writing sync()'s weights;
// E4M3 weights written by step_scaled: the scale 448 / amax and each code the nearest E4M3 value
// of the same run's masters (its f32 weights) times the scale.
#include <gradacc.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "cpp_expect.hpp"

static_assert(!std::is_copy_constructible_v<gradacc::Optimizer> &&
                  std::is_move_constructible_v<gradacc::Optimizer>,
              "Optimizer is move-only");

constexpr std::size_t N0 = 300; // fp16 weights
constexpr std::size_t N1 = 7;   // f32 bias
constexpr float LR = 0.125f;

// fp16 bits of a finite float, rounded to nearest even (the tests' values stay below 65504).
static uint16_t f16_bits(float x)
{
    const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
    const float a = std::fabs(x);
    if (a < 6.103515625e-05f) // subnormal: a multiple of 2^-24
        return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.0f)));
    int e = 0;
    std::frexp(a, &e); // a in [2^(e-1), 2^e)
    const auto q = static_cast<unsigned>(std::nearbyint(std::ldexp(a, 11 - e))); // 1024..2048
    return static_cast<uint16_t>(sign | (((e + 14) << 10) + q - 1024));
}

static float f16_value(uint16_t h)
{
    const int exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    const float m = exp == 0 ? std::ldexp(static_cast<float>(mant), -24)
                             : std::ldexp(static_cast<float>(1024 + mant), exp - 25);
    return (h & 0x8000) ? -m : m;
}

// The unscaled gradient of element i of tensor 0 (tensor 1's is 0.75 everywhere).
static float grad0(std::size_t i)
{
    return static_cast<float>(static_cast<double>(i % 7) * 0.25 - 0.5);
}

struct Model {
    std::vector<uint16_t> w0 = std::vector<uint16_t>(N0);
    std::vector<float> w1 = std::vector<float>(N1);
    Model()
    {
        for (std::size_t i = 0; i < N0; i++)
            w0[i] = f16_bits(static_cast<float>(0.01 * static_cast<double>(i) - 1.0));
        for (std::size_t i = 0; i < N1; i++)
            w1[i] = static_cast<float>(i) * 0.5f;
    }
};

// A static loss scale of 1.
static gradacc::ScalerConfig unit_scale()
{
    gradacc::ScalerConfig sc;
    sc.dynamic = false;
    sc.init_scale = 1.0f;
    return sc;
}

static gradacc::OptimizerConfig sgd_config()
{
    gradacc::OptimizerConfig c;
    c.algorithm = GRADACC_OPTIMIZER_SGD;
    c.lr = LR;
    c.weight_decay = 0.0f;
    return c;
}

// One micro-batch of the gradients times `scale` (+inf in w0[3] when `poison`), then the sync.
static gradacc::SyncInfo add_and_sync(gradacc::Accumulator &acc, const gradacc::Scaler &scaler,
                                      gradacc::Communicator *comm, bool poison)
{
    const float scale = scaler.scale();
    std::vector<uint16_t> g0(N0);
    std::vector<float> g1(N1, 0.75f * scale);
    for (std::size_t i = 0; i < N0; i++)
        g0[i] = f16_bits(grad0(i) * scale);
    if (poison)
        g0[3] = 0x7c00;
    acc.add(scaler, {g0.data(), g1.data()}, 1);
    return comm ? acc.sync(*comm) : acc.sync();
}

static void sgd_steps_bit_for_bit()
{
    gradacc::ScalerConfig sc;
    sc.init_scale = 1024.0f;
    gradacc::Scaler scaler(sc);
    gradacc::Accumulator acc({{N0, GRADACC_DTYPE_F16}, {N1, GRADACC_DTYPE_F32}});
    Model m;
    gradacc::Optimizer opt(acc, {m.w0.data(), m.w1.data()}, {}, sgd_config());
    std::vector<float> m0(N0), m1(m.w1);
    for (std::size_t i = 0; i < N0; i++)
        m0[i] = f16_value(m.w0[i]);
    for (int step = 0; step < 4; step++) {
        const bool poison = step == 2;
        const Model before = m;
        const gradacc::SyncInfo info = add_and_sync(acc, scaler, nullptr, poison);
        EXPECT(scaler.update(acc) == poison && info.found_inf == poison, "step %d: overflow not agreed", step);
        const bool stepped = opt.step(acc, {m.w0.data(), m.w1.data()});
        EXPECT(stepped == !poison, "step %d stepped %d", step, static_cast<int>(stepped));
        if (poison) {
            EXPECT(m.w0 == before.w0 && m.w1 == before.w1, "a skipped step changed the weights");
            continue;
        }
        for (std::size_t i = 0; i < N0; i++) {
            m0[i] = m0[i] + (-LR) * grad0(i);
            EXPECT(m.w0[i] == f16_bits(m0[i]), "step %d w0[%zu] = %#x, expected %#x", step, i, m.w0[i],
                   f16_bits(m0[i]));
        }
        for (std::size_t i = 0; i < N1; i++) {
            m1[i] = m1[i] + (-LR) * 0.75f;
            EXPECT(m.w1[i] == m1[i], "step %d w1[%zu] = %g, expected %g", step, i, m.w1[i], m1[i]);
        }
    }
    EXPECT(opt.steps() == 3, "steps = %llu", static_cast<unsigned long long>(opt.steps()));

    // A second step from one window is refused and changes nothing.
    try {
        opt.step(acc, {m.w0.data(), m.w1.data()});
        EXPECT(false, "a second step from one window was taken");
    } catch (const gradacc::Error &e) {
        EXPECT(e.status() == GRADACC_STATUS_WRONG_STATE, "%s", e.what());
    }

    // Save, step on, load: the next step from the loaded state repeats the same bits.
    const std::vector<uint8_t> saved = opt.save();
    add_and_sync(acc, scaler, nullptr, false);
    const Model at_save = m;
    opt.step(acc, {m.w0.data(), m.w1.data()});
    const Model after = m;
    std::vector<uint8_t> corrupt = saved;
    corrupt[corrupt.size() / 2] ^= 1;
    try {
        opt.load({corrupt});
        EXPECT(false, "corrupt state loaded");
    } catch (const gradacc::Error &e) {
        EXPECT(e.status() == GRADACC_STATUS_CORRUPT_STATE, "%s", e.what());
    }
    EXPECT(opt.steps() == 4, "a refused load changed the steps: %llu", static_cast<unsigned long long>(opt.steps()));
    opt.load({saved});
    EXPECT(opt.steps() == 3, "steps after load = %llu", static_cast<unsigned long long>(opt.steps()));
    m = at_save;
    add_and_sync(acc, scaler, nullptr, false);
    opt.step(acc, {m.w0.data(), m.w1.data()});
    EXPECT(m.w0 == after.w0 && m.w1 == after.w1, "the step after load differs");

    // Moving keeps the one handle.
    gradacc_optimizer_t *handle = opt.get();
    gradacc::Optimizer moved = std::move(opt);
    EXPECT(moved.get() == handle && moved.steps() == 4, "the move lost the optimizer");
}

// A learning rate set before a step, and a group with half the rate and no weight decay.
static void lr_and_groups()
{
    gradacc::Scaler scaler(unit_scale());
    gradacc::Accumulator acc({{N0, GRADACC_DTYPE_F16}, {N1, GRADACC_DTYPE_F32}});
    Model m;
    gradacc::OptimizerConfig c = sgd_config();
    c.weight_decay = 0.5f;
    const std::vector<uint16_t> bits0 = m.w0;
    gradacc::Optimizer opt(acc, {m.w0.data(), m.w1.data()}, {GRADACC_DTYPE_F16, GRADACC_DTYPE_F32}, c,
                           {{true, 1.0f}, {false, 0.5f}});
    opt.set_lr(0.25f);
    add_and_sync(acc, scaler, nullptr, false);
    EXPECT(opt.step(acc, {m.w0.data(), m.w1.data()}), "no step");
    for (std::size_t i = 0; i < N0; i++) {
        const float w = f16_value(bits0[i]);
        const float d = grad0(i) + 0.5f * w; // L2 decay: g + wd * w
        EXPECT(m.w0[i] == f16_bits(w + (-0.25f) * d), "w0[%zu] = %#x", i, m.w0[i]);
    }
    for (std::size_t i = 0; i < N1; i++) {
        const float want = static_cast<float>(i) * 0.5f + (-0.125f) * 0.75f;
        EXPECT(m.w1[i] == want, "w1[%zu] = %g, expected %g", i, m.w1[i], want);
    }
}

// Two ranks under a reduce-scatter boundary end with the one-rank run's weights.
static void reduce_scatter_group()
{
    Model single;
    {
        gradacc::Scaler scaler(unit_scale());
        gradacc::Accumulator acc({{N0, GRADACC_DTYPE_F16}, {N1, GRADACC_DTYPE_F32}});
        gradacc::Optimizer opt(acc, {single.w0.data(), single.w1.data()}, {}, sgd_config());
        add_and_sync(acc, scaler, nullptr, false);
        opt.step(acc, {single.w0.data(), single.w1.data()});
    }
    gradacc::LocalGroup group(2);
    Model ranks[2];
    std::string errors[2];
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; r++) {
        threads.emplace_back([&, r] {
            try {
                gradacc::Scaler scaler(unit_scale());
                gradacc::AccumulatorConfig ac;
                ac.sharding = GRADACC_SHARDING_REDUCE_SCATTER;
                ac.shard_count = 2;
                ac.shard_rank = static_cast<uint32_t>(r);
                gradacc::Accumulator acc({{N0, GRADACC_DTYPE_F16}, {N1, GRADACC_DTYPE_F32}}, ac);
                Model &m = ranks[r];
                gradacc::Optimizer opt(acc, {m.w0.data(), m.w1.data()}, {}, sgd_config());
                add_and_sync(acc, scaler, &group[static_cast<std::size_t>(r)], false);
                if (!opt.step(acc, {m.w0.data(), m.w1.data()}, &group[static_cast<std::size_t>(r)]))
                    errors[r] = "did not step";
            } catch (const gradacc::Error &e) {
                errors[r] = e.what();
            }
        });
    }
    for (std::thread &t : threads)
        t.join();
    for (int r = 0; r < 2; r++) {
        EXPECT(errors[r].empty(), "rank %d: %s", r, errors[r].c_str());
        EXPECT(ranks[r].w0 == single.w0 && ranks[r].w1 == single.w1, "rank %d differs from one rank", r);
    }
}

static void errors_name_the_argument()
{
    gradacc::Accumulator acc({{N0, GRADACC_DTYPE_F16}, {N1, GRADACC_DTYPE_F32}});
    Model m;
    gradacc::OptimizerConfig bad;
    bad.beta1 = 1.5f;
    try {
        gradacc::Optimizer opt(acc, {m.w0.data(), m.w1.data()}, {}, bad);
        EXPECT(false, "beta1 = 1.5 accepted");
    } catch (const gradacc::Error &e) {
        EXPECT(e.status() == GRADACC_STATUS_INVALID_ARGUMENT && e.message().find("beta1") != std::string::npos,
               "%s", e.what());
    }
    try {
        gradacc::Optimizer opt(acc, {m.w0.data()});
        EXPECT(false, "one weight for two tensors accepted");
    } catch (const gradacc::Error &e) {
        EXPECT(e.status() == GRADACC_STATUS_SIZE_MISMATCH && e.message().find("`n`") != std::string::npos, "%s",
               e.what());
    }
    gradacc::Optimizer opt(acc, {m.w0.data(), m.w1.data()});
    try {
        opt.set_lr(-1.0f);
        EXPECT(false, "lr = -1 accepted");
    } catch (const gradacc::Error &e) {
        EXPECT(e.status() == GRADACC_STATUS_INVALID_ARGUMENT && e.message().find("lr") != std::string::npos, "%s",
               e.what());
    }
    try {
        opt.lr_device_ptr();
        EXPECT(false, "a CPU optimizer gave a device learning rate");
    } catch (const gradacc::Error &e) {
        EXPECT(e.status() == GRADACC_STATUS_DEVICE_MISMATCH, "%s", e.what());
    }
    try {
        opt.step(acc, {m.w0.data(), m.w1.data()});
        EXPECT(false, "a step before any sync was taken");
    } catch (const gradacc::Error &e) {
        EXPECT(e.status() == GRADACC_STATUS_WRONG_STATE, "%s", e.what());
    }
}

// Optimizer::with_masters: the caller's values are the masters (not the weights'), each step
// updates them in place bit for bit as SGD in f32, and a wrong length is refused naming `masters`.
static void adopted_masters()
{
    gradacc::ScalerConfig sc;
    sc.init_scale = 1024.0f;
    gradacc::Scaler scaler(sc);
    gradacc::Accumulator acc({{N0, GRADACC_DTYPE_F16}, {N1, GRADACC_DTYPE_F32}});
    Model m;
    std::vector<float> masters(acc.shard().data.size(), 0.0f);
    const std::size_t at1 = acc.offset(1);
    for (std::size_t i = 0; i < N0; i++)
        masters[i] = f16_value(m.w0[i]) + 1.0f / 1024.0f; // a value the fp16 weight does not hold
    for (std::size_t i = 0; i < N1; i++)
        masters[at1 + i] = m.w1[i] - 0.25f;
    std::vector<float> expected = masters;
    try {
        gradacc::Optimizer::with_masters(acc, {m.w0.data(), m.w1.data()},
                                         gradacc::span<float>(masters.data(), masters.size() - 1));
        EXPECT(false, "masters one element short accepted");
    } catch (const gradacc::Error &e) {
        EXPECT(e.status() == GRADACC_STATUS_SIZE_MISMATCH && e.message().find("masters") != std::string::npos,
               "%s", e.what());
    }
    gradacc::Optimizer opt = gradacc::Optimizer::with_masters(
        acc, {m.w0.data(), m.w1.data()}, gradacc::span<float>(masters.data(), masters.size()), {}, sgd_config());
    EXPECT(masters == expected, "creation wrote the masters");
    for (int step = 0; step < 3; step++) {
        add_and_sync(acc, scaler, nullptr, false);
        scaler.update(acc);
        EXPECT(opt.step(acc, {m.w0.data(), m.w1.data()}), "step %d skipped", step);
        for (std::size_t i = 0; i < N0; i++) {
            expected[i] = expected[i] + (-LR) * grad0(i);
            EXPECT(masters[i] == expected[i] && m.w0[i] == f16_bits(expected[i]), "step %d w0[%zu]", step, i);
        }
        for (std::size_t i = 0; i < N1; i++) {
            expected[at1 + i] = expected[at1 + i] + (-LR) * 0.75f;
            EXPECT(masters[at1 + i] == expected[at1 + i] && m.w1[i] == expected[at1 + i], "step %d w1[%zu]", step,
                   i);
        }
    }
}

// sync_for_step (the clip coefficient inside AdamW's pass) writes the weights of sync() then the
// step, bit for bit, clipping every window.
static void clip_in_step()
{
    gradacc::ScalerConfig sc;
    sc.init_scale = 1024.0f;
    sc.dynamic = false;
    gradacc::AccumulatorConfig ac;
    ac.max_grad_norm = 0.01f;
    const std::vector<gradacc::TensorDesc> tensors = {{N0, GRADACC_DTYPE_F16}, {N1, GRADACC_DTYPE_F32}};
    gradacc::Scaler s0(sc), s1(sc);
    gradacc::Accumulator a0(tensors, ac), a1(tensors, ac);
    Model m0, m1;
    gradacc::Optimizer o0(a0, {m0.w0.data(), m0.w1.data()}), o1(a1, {m1.w0.data(), m1.w1.data()});
    std::vector<uint16_t> g0(N0);
    for (std::size_t i = 0; i < N0; i++)
        g0[i] = f16_bits(grad0(i) * sc.init_scale);
    const std::vector<float> g1(N1, 0.75f * sc.init_scale);
    for (int step = 0; step < 3; step++) {
        a0.add(s0, {g0.data(), g1.data()}, 1);
        a1.add(s1, {g0.data(), g1.data()}, 1);
        const gradacc::SyncInfo i0 = a0.sync(), i1 = a1.sync_for_step();
        EXPECT(i0.clip_coef == i1.clip_coef && i0.clip_coef < 1.0, "step %d: clip_coef %g / %g", step,
               i0.clip_coef, i1.clip_coef);
        o0.step(a0, {m0.w0.data(), m0.w1.data()});
        o1.step(a1, {m1.w0.data(), m1.w1.data()});
        EXPECT(m0.w0 == m1.w0 && m0.w1 == m1.w1, "step %d: the clip inside the step wrote other weights",
               step);
    }
}

// The value of E4M3 code c (float8_e4m3fn; 0x7f and 0xff are NaN).
static double e4m3_value(int c)
{
    const int e = (c >> 3) & 15, m = c & 7;
    const double v = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
    return (c >> 7) ? -v : v;
}

// E4M3 of x, saturated at ±448, the nearest code, ties to the even one.
static uint8_t e4m3_of(double x)
{
    x = std::fmax(std::fmin(x, 448.0), -448.0);
    int best = -1;
    double best_d = INFINITY;
    for (int c = 0; c < 256; c++) {
        if ((c & 0x7f) == 0x7f || std::signbit(x) != ((c >> 7) == 1))
            continue;
        const double d = std::fabs(e4m3_value(c) - x);
        if (d < best_d || (d == best_d && (c & 1) == 0)) {
            best = c;
            best_d = d;
        }
    }
    return static_cast<uint8_t>(best);
}

// One rank under a reduce-scatter boundary writes tensor 1 as E4M3 through step_scaled: its scale
// and codes are the reference quantisation of the same run's masters with f32 weights.
static void fp8_step_scaled()
{
    const std::size_t n[2] = {N0, 1001};
    auto run = [&](bool fp8, std::vector<float> &masters, std::vector<uint8_t> &codes, float &scale) {
        gradacc::Scaler scaler(unit_scale());
        gradacc::AccumulatorConfig ac;
        ac.sharding = GRADACC_SHARDING_REDUCE_SCATTER;
        ac.shard_count = 1;
        gradacc::Accumulator acc({{n[0], GRADACC_DTYPE_F32}, {n[1], GRADACC_DTYPE_F32}}, ac);
        std::vector<float> w0(n[0], 0.5f), w1(n[1]);
        for (std::size_t i = 0; i < n[1]; i++)
            w1[i] = static_cast<float>(std::sin(static_cast<double>(i)) * 3.0);
        gradacc::OptimizerConfig oc = sgd_config();
        const gradacc_weight_format_t formats[2] = {GRADACC_WEIGHTS_MODEL, GRADACC_WEIGHTS_E4M3_TENSORWISE};
        if (fp8)
            oc.weight_formats = formats;
        gradacc::Optimizer opt(acc, {w0.data(), w1.data()}, {}, oc);
        gradacc::LocalGroup one(1);
        std::vector<float> g0(n[0], 0.25f), g1(n[1]);
        for (std::size_t i = 0; i < n[1]; i++)
            g1[i] = static_cast<float>(std::cos(static_cast<double>(i)));
        acc.add(scaler, {g0.data(), g1.data()}, 1);
        acc.sync(one[0]);
        codes.assign(n[1], 0);
        const bool stepped = fp8 ? opt.step_scaled(acc, {w0.data(), codes.data()}, {nullptr, &scale}, one[0])
                                 : opt.step(acc, {w0.data(), w1.data()}, one[0]);
        EXPECT(stepped, "fp8 %d: not stepped", static_cast<int>(fp8));
        masters = w1;
    };
    std::vector<float> masters, unused;
    std::vector<uint8_t> codes, none;
    float scale = 0.0f, no_scale = 0.0f;
    run(false, masters, none, no_scale);
    run(true, unused, codes, scale);
    double amax = 0.0;
    for (float m : masters)
        amax = std::fmax(amax, std::fabs(static_cast<double>(m)));
    const float want = static_cast<float>(448.0 / std::fmax(amax, 1e-12));
    EXPECT(std::memcmp(&scale, &want, sizeof scale) == 0, "E4M3 scale %.9g, want %.9g", static_cast<double>(scale),
           static_cast<double>(want));
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < n[1]; i++)
        wrong += codes[i] != e4m3_of(static_cast<double>(masters[i] * want));
    EXPECT(wrong == 0, "%zu of %zu E4M3 codes differ from the reference", wrong, n[1]);
}

int main()
{
    try {
        sgd_steps_bit_for_bit();
        clip_in_step();
        adopted_masters();
        lr_and_groups();
        reduce_scatter_group();
        fp8_step_scaled();
        errors_name_the_argument();
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
