// The 16-bit conversions of the C++ wrapper (gradacc.hpp): known values in both directions, ties
// to even, overflow to infinity and subnormals, the vector and in-place forms over std::vector,
// std::array and spans at odd lengths, and a dst of the wrong length refused with SIZE_MISMATCH
// before anything is written. The bits themselves are api_convert's subject.
#include <gradacc.hpp>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

#include "cpp_expect.hpp"

namespace {

uint32_t bits(float f)
{
    uint32_t b;
    std::memcpy(&b, &f, sizeof b);
    return b;
}

void known_values()
{
    // 1, -2, 65504 (the largest f16), 65520 (ties to infinity), 1 + 2^-11 (ties to even: 1),
    // 2^-24 (the smallest subnormal), 2^-25 (ties to 0), infinity.
    const std::vector<float> x = {1.0f, -2.0f, 65504.0f, 65520.0f, 1.0f + 0x1p-11f, 0x1p-24f, 0x1p-25f,
                                  std::numeric_limits<float>::infinity()};
    const std::vector<uint16_t> f16 = {0x3c00, 0xc000, 0x7bff, 0x7c00, 0x3c00, 0x0001, 0x0000, 0x7c00};
    const std::vector<uint16_t> got = gradacc::f32_to_f16(x);
    for (std::size_t i = 0; i < x.size(); i++)
        EXPECT(got[i] == f16[i], "f16 of %a: %#06x, want %#06x", (double)x[i], got[i], f16[i]);
    // A temporary container converts too, as std::span<const T> would view it.
    const std::vector<uint16_t> ones = gradacc::f32_to_f16(std::vector<float>(3, 1.0f));
    EXPECT(ones == std::vector<uint16_t>(3, 0x3c00), "f16 of a temporary: %zu values", ones.size());
    // bf16: 1 + 2^-8 ties to even (1), 1 + 3 * 2^-8 ties up, the largest finite and past it.
    const std::array<float, 4> y = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 0x1.fep127f, 0x1.ffp127f};
    const std::array<uint16_t, 4> bf16 = {0x3f80, 0x3f82, 0x7f7f, 0x7f80};
    std::array<uint16_t, 4> out{};
    gradacc::f32_to_bf16(y, out);
    for (std::size_t i = 0; i < y.size(); i++)
        EXPECT(out[i] == bf16[i], "bf16 of %a: %#06x, want %#06x", (double)y[i], out[i], bf16[i]);
    const std::vector<float> back = gradacc::bf16_to_f32(out);
    EXPECT(back[0] == 1.0f && back[1] == 1.0f + 0x1p-6f && std::isinf(back[3]), "bf16 widened");
    const std::vector<float> wide = gradacc::f16_to_f32(got);
    EXPECT(wide[2] == 65504.0f && wide[5] == 0x1p-24f && std::signbit(wide[1]), "f16 widened");
}

void odd_lengths_round_trip()
{
    for (std::size_t n : {1u, 3u, 7u, 9u, 17u, 31u, 33u, 1001u}) {
        std::vector<float> x(n);
        for (std::size_t i = 0; i < n; i++)
            x[i] = (float)((int)(i % 511) - 255) / 8.0f; // 8 significant bits at most: exact in both
        std::vector<float> f(n), b(n);
        const std::vector<uint16_t> h = gradacc::f32_to_f16(x);
        const std::vector<uint16_t> w = gradacc::f32_to_bf16(gradacc::span<const float>(x.data(), n));
        gradacc::f16_to_f32(h, gradacc::span<float>(f));
        gradacc::bf16_to_f32(w, b);
        int bad = 0;
        for (std::size_t i = 0; i < n; i++)
            bad += bits(f[i]) != bits(x[i]) || bits(b[i]) != bits(x[i]);
        EXPECT(bad == 0, "n = %zu: %d values changed in the round trip", n, bad);
    }
}

void wrong_lengths_are_refused()
{
    const std::vector<float> x = {1.0f, 2.0f, 3.0f};
    std::vector<uint16_t> short_dst(2, 0x1111);
    try {
        gradacc::f32_to_f16(x, short_dst);
        EXPECT(false, "a short dst was accepted");
    } catch (const gradacc::Error &e) {
        EXPECT(e.status() == GRADACC_STATUS_SIZE_MISMATCH, "status %d", (int)e.status());
        EXPECT(e.message().find("`dst` has 2 elements, `src` 3") != std::string::npos, "%s", e.what());
    }
    EXPECT(short_dst[0] == 0x1111 && short_dst[1] == 0x1111, "the short dst was written");
    const std::vector<float> none;
    const std::vector<uint16_t> no_words;
    EXPECT(gradacc::f32_to_bf16(none).empty() && gradacc::f16_to_f32(no_words).empty(), "empty");
}

} // namespace

int main()
{
    known_values();
    odd_lengths_round_trip();
    wrong_lengths_are_refused();
    if (failures)
        std::fprintf(stderr, "%d checks FAILED\n", failures);
    return failures ? 1 : 0;
}
