// gradacc's FP8 weights against PyTorch's own float8_e4m3fn conversion (at::kFloat8_e4m3fn, the
// CPU cast): one rank under a reduce-scatter boundary steps AdamW with a learning rate of 0 and
// zero gradients, so the masters stay the initial weights, which this program chooses:
// - an MXFP8 tensor whose every block of 32 holds 300, so its shared exponent is 0 and each code
//   is the E4M3 of the value itself: every E4M3 value, every midpoint between neighbours and the
//   f32 on either side of it, E4M3's subnormals and what lies below them, the saturation range up
//   to 464 and past it, and random values of all magnitudes below 512, with both signs. PyTorch's
//   cast does not saturate (it gives NaN past 464), so its input is clamped to ±448 first, which is
//   the OCP rule gradacc follows;
// - an E4M3 tensor with a scale per tensor over random values: the scale must be
//   f32(448 / amax) and the codes PyTorch's cast of clamp(x * scale, ±448).
// Every code must be PyTorch's, bit for bit.
#include <gradacc.hpp>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

namespace {

// PyTorch's E4M3 codes of f32 `x`, clamped to ±448 first.
std::vector<uint8_t> torch_e4m3(const std::vector<float> &x)
{
    torch::Tensor t = torch::from_blob(const_cast<float *>(x.data()), {static_cast<int64_t>(x.size())},
                                       torch::kFloat32)
                          .clamp(-448.0, 448.0)
                          .to(at::kFloat8_e4m3fn)
                          .view(torch::kUInt8)
                          .contiguous();
    const uint8_t *p = t.data_ptr<uint8_t>();
    return std::vector<uint8_t>(p, p + x.size());
}

// E4M3's value of code c (no NaN codes asked for).
double e4m3_value(int c)
{
    const int e = (c >> 3) & 15, m = c & 7;
    const double v = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
    return (c >> 7) ? -v : v;
}

// The values the MXFP8 tensor's blocks test, 31 per block beside the anchor 300.
std::vector<float> probes()
{
    std::vector<float> v;
    for (int c = 0; c < 0x7f; c++) { // every finite non-negative code and what lies around it
        const float x = static_cast<float>(e4m3_value(c));
        v.insert(v.end(), {x, std::nextafter(x, 0.0f), std::nextafter(x, 1e9f)});
        if (c + 1 < 0x7f) {
            const float mid = static_cast<float>((e4m3_value(c) + e4m3_value(c + 1)) / 2);
            v.insert(v.end(), {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)});
        }
    }
    for (float x : {1e-30f, 1e-5f, 4.5e-3f, 449.0f, 463.9f, 464.0f, 464.1f, 480.0f, 500.0f, 511.9f})
        v.push_back(x);
    std::mt19937_64 rng(20261203);
    std::uniform_real_distribution<double> exponent(-40.0, 8.99);
    for (int i = 0; i < 3000; i++)
        v.push_back(static_cast<float>(std::exp2(exponent(rng))));
    const std::size_t n = v.size();
    for (std::size_t i = 0; i < n; i++)
        v.push_back(-v[i]);
    return v;
}

} // namespace

int main()
{
    torch::manual_seed(0);
    // Tensor 0: MXFP8 blocks of [300, 31 probes]; tensor 1: E4M3 with a scale per tensor.
    const std::vector<float> p = probes();
    std::vector<float> mx;
    for (std::size_t i = 0; i < p.size(); i++) {
        if (mx.size() % 32 == 0)
            mx.push_back(300.0f);
        mx.push_back(p[i]);
    }
    std::vector<float> tw(5003);
    std::mt19937_64 rng(7);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    for (float &x : tw)
        x = normal(rng);

    gradacc::AccumulatorConfig ac;
    ac.sharding = GRADACC_SHARDING_REDUCE_SCATTER;
    ac.shard_count = 1;
    gradacc::Accumulator acc({{mx.size(), GRADACC_DTYPE_F32}, {tw.size(), GRADACC_DTYPE_F32}}, ac);
    gradacc::OptimizerConfig oc;
    oc.lr = 0.0f;
    const gradacc_weight_format_t formats[2] = {GRADACC_WEIGHTS_MXFP8, GRADACC_WEIGHTS_E4M3_TENSORWISE};
    oc.weight_formats = formats;
    gradacc::Optimizer opt(acc, {mx.data(), tw.data()}, {}, oc);
    gradacc::ScalerConfig sc;
    sc.dynamic = false;
    sc.init_scale = 1.0f;
    gradacc::Scaler scaler(sc);
    gradacc::LocalGroup one(1);
    std::vector<float> g0(mx.size(), 0.0f), g1(tw.size(), 0.0f);
    acc.add(scaler, {g0.data(), g1.data()}, 1);
    acc.sync(one[0]);
    std::vector<uint8_t> mx_codes(mx.size()), mx_scales((mx.size() + 31) / 32), tw_codes(tw.size());
    float scale = 0.0f;
    if (!opt.step_scaled(acc, {mx_codes.data(), tw_codes.data()}, {mx_scales.data(), &scale}, one[0])) {
        std::fprintf(stderr, "the step was skipped\n");
        return 1;
    }

    int failures = 0;
    std::size_t exponents = 0;
    for (uint8_t s : mx_scales)
        exponents += s != 127; // 2^0: every block's amax is 300
    if (exponents) {
        std::fprintf(stderr, "%zu MXFP8 blocks have a shared exponent other than 0\n", exponents);
        failures++;
    }
    const std::vector<uint8_t> want_mx = torch_e4m3(mx);
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < mx.size(); i++) {
        if (mx_codes[i] != want_mx[i] && wrong++ < 5)
            std::fprintf(stderr, "MXFP8 element %zu (%.9g): gradacc 0x%02x, PyTorch 0x%02x\n", i,
                         static_cast<double>(mx[i]), mx_codes[i], want_mx[i]);
    }
    double amax = 0.0;
    for (float x : tw)
        amax = std::fmax(amax, std::fabs(static_cast<double>(x)));
    const float want_scale = static_cast<float>(448.0 / std::fmax(amax, 1e-12));
    if (std::memcmp(&scale, &want_scale, sizeof scale) != 0) {
        std::fprintf(stderr, "E4M3 scale %.9g, want %.9g\n", static_cast<double>(scale), static_cast<double>(want_scale));
        failures++;
    }
    std::vector<float> scaled(tw.size());
    for (std::size_t i = 0; i < tw.size(); i++)
        scaled[i] = tw[i] * want_scale;
    const std::vector<uint8_t> want_tw = torch_e4m3(scaled);
    for (std::size_t i = 0; i < tw.size(); i++) {
        if (tw_codes[i] != want_tw[i] && wrong++ < 10)
            std::fprintf(stderr, "E4M3 element %zu (%.9g): gradacc 0x%02x, PyTorch 0x%02x\n", i,
                         static_cast<double>(scaled[i]), tw_codes[i], want_tw[i]);
    }
    if (wrong) {
        std::fprintf(stderr, "%zu codes differ from PyTorch's\n", wrong);
        failures++;
    }
    if (failures)
        return 1;
    std::printf("%zu MXFP8 and %zu E4M3 codes equal PyTorch's float8_e4m3fn cast, and the scales\n", mx.size(),
                tw.size());
    return 0;
}
