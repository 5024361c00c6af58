// The typed gradients of the C++ wrapper (gradacc.hpp): add_tensor's spans and add's lists of
// gradacc::Grad are checked against each tensor's declared dtype and numel, which the C functions
// cannot see behind a `void *`. A span of float for an F16 or BF16 tensor, 16-bit words for an F32
// one, or a wrong length throws DTYPE_MISMATCH or SIZE_MISMATCH naming the argument, the tensor
// and its dtype, and adds nothing: the window then ends with the bits it has without the refused
// call. Under sharded accumulation a refused call fails the micro-batch on every rank. The raw
// `void *` forms keep their overloads: `{w.data(), b.data()}` still compiles and adds.
#include <gradacc.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "cpp_expect.hpp"

namespace {

constexpr uint16_t F16_ONE = 0x3c00, F16_TWO = 0x4000, BF16_ONE = 0x3f80;

gradacc::Scaler unit_scaler()
{
    gradacc::ScalerConfig config;
    config.init_scale = 1.0f;
    return gradacc::Scaler(config);
}

// The status and message `f` throws, or OK and "".
template <class F>
std::pair<gradacc_status_t, std::string> refusal(F &&f)
{
    try {
        f();
    } catch (const gradacc::Error &e) {
        return {e.status(), e.message()};
    }
    return {GRADACC_STATUS_OK, std::string()};
}

bool has(const std::string &text, const char *part) { return text.find(part) != std::string::npos; }

// Every tensor's master after the boundary, one after another.
std::vector<float> synced(gradacc::Accumulator &acc, gradacc::SyncInfo &info)
{
    info = acc.sync();
    std::vector<float> all;
    for (std::size_t i = 0; i < acc.num_tensors(); i++) {
        const gradacc::span<float> m = acc.master(i);
        all.insert(all.end(), m.begin(), m.end());
    }
    return all;
}

// The first element whose bits differ, or the shorter length where none does.
std::size_t first_difference(const std::vector<float> &a, const std::vector<float> &b)
{
    std::size_t i = 0;
    while (i < a.size() && i < b.size() && std::memcmp(&a[i], &b[i], sizeof(float)) == 0)
        i++;
    return i;
}

// A span of float for a 16-bit tensor is refused before the C call, which would read the f32
// bytes as 16-bit words, and the tensor's next contribution is its first.
void float_span_for_a_16_bit_tensor(gradacc_dtype_t dtype, const char *name, uint16_t one)
{
    gradacc::Scaler scaler = unit_scaler();
    gradacc::Accumulator refused({{4, dtype}}), clean({{4, dtype}});
    const std::vector<float> floats(4, 1.0f);
    const std::vector<uint16_t> words(4, one);
    refused.begin_microbatch(1);
    clean.begin_microbatch(1);
    const auto [status, message] = refusal([&] { refused.add_tensor(scaler, 0, floats); });
    EXPECT(status == GRADACC_STATUS_DTYPE_MISMATCH, "%s tensor, span of float: %d \"%s\"", name, (int)status,
           message.c_str());
    EXPECT(has(message, "add_tensor") && has(message, "`grad`") && has(message, "float") &&
               has(message, "tensor 0") && has(message, name),
           "%s tensor, span of float: \"%s\"", name, message.c_str());
    refused.add_tensor(scaler, 0, words);
    clean.add_tensor(scaler, 0, words);
    refused.end_microbatch();
    clean.end_microbatch();
    gradacc::SyncInfo a{}, b{};
    const std::vector<float> got = synced(refused, a), want = synced(clean, b);
    const std::size_t i = first_difference(got, want);
    EXPECT(i == 4 && want.size() == 4, "%s tensor: element %zu is %g after the refused span, %g without it",
           name, i, i < got.size() ? (double)got[i] : 0.0, i < want.size() ? (double)want[i] : 0.0);
    EXPECT(got.size() == 4 && got[0] == 1.0f, "%s tensor: %g, want 1", name, got.empty() ? 0.0 : (double)got[0]);
    EXPECT(a.microbatches == 1 && a.total_count == 1, "%s tensor: %llu micro-batches, %llu items", name,
           (unsigned long long)a.microbatches, (unsigned long long)a.total_count);
}

// 16-bit words for an F32 tensor, and spans of the wrong length, are refused the same way.
void words_for_f32_and_wrong_lengths()
{
    gradacc::Scaler scaler = unit_scaler();
    const std::vector<gradacc::TensorDesc> tensors = {{4, GRADACC_DTYPE_F32}, {4, GRADACC_DTYPE_F16}};
    gradacc::Accumulator refused(tensors), clean(tensors);
    const std::vector<float> f32(4, 0.5f), short_f32(3, 0.5f);
    const std::vector<uint16_t> f16(4, F16_TWO), long_f16(5, F16_TWO), words_for_f32(4, F16_ONE);
    refused.begin_microbatch(1);
    auto [status, message] = refusal([&] { refused.add_tensor(scaler, 0, words_for_f32); });
    EXPECT(status == GRADACC_STATUS_DTYPE_MISMATCH && has(message, "uint16_t") && has(message, "tensor 0") &&
               has(message, "f32"),
           "F32 tensor, span of uint16_t: %d \"%s\"", (int)status, message.c_str());
    // The span's length is add_tensor's `numel`, which the C call checks.
    std::tie(status, message) = refusal([&] { refused.add_tensor(scaler, 0, short_f32); });
    EXPECT(status == GRADACC_STATUS_SIZE_MISMATCH && has(message, "`numel` = 3") && has(message, "tensor 0 has 4"),
           "F32 tensor, 3 floats: %d \"%s\"", (int)status, message.c_str());
    std::tie(status, message) = refusal([&] { refused.add_tensor(scaler, 1, long_f16); });
    EXPECT(status == GRADACC_STATUS_SIZE_MISMATCH && has(message, "`numel` = 5") && has(message, "tensor 1 has 4"),
           "F16 tensor, 5 words: %d \"%s\"", (int)status, message.c_str());
    // An index out of range stays the C call's refusal.
    std::tie(status, message) = refusal([&] { refused.add_tensor(scaler, 2, f32); });
    EXPECT(status == GRADACC_STATUS_INVALID_ARGUMENT && has(message, "`index`"), "index 2: %d \"%s\"", (int)status,
           message.c_str());
    refused.add_tensor(scaler, 0, f32);
    refused.add_tensor(scaler, 1, f16);
    refused.end_microbatch();
    clean.begin_microbatch(1);
    clean.add_tensor(scaler, 0, f32);
    clean.add_tensor(scaler, 1, f16);
    clean.end_microbatch();
    gradacc::SyncInfo a{}, b{};
    const std::vector<float> got = synced(refused, a), want = synced(clean, b);
    const std::size_t i = first_difference(got, want);
    EXPECT(i == 8 && want.size() == 8, "the refused spans changed element %zu: %g, want %g", i,
           i < got.size() ? (double)got[i] : 0.0, i < want.size() ? (double)want[i] : 0.0);
}

// add's typed form takes containers, spans and lists of gradacc::Grad, adds what the raw form
// adds, and refuses the whole micro-batch when any one tensor is wrong.
void typed_add()
{
    gradacc::Scaler scaler = unit_scaler();
    const std::vector<gradacc::TensorDesc> tensors = {
        {4, GRADACC_DTYPE_F16}, {2, GRADACC_DTYPE_BF16}, {3, GRADACC_DTYPE_F32}};
    gradacc::Accumulator typed(tensors), raw(tensors);
    const std::vector<uint16_t> w(4, F16_TWO), e(2, BF16_ONE);
    const std::vector<float> b = {0.5f, -0.25f, 4.0f};
    const gradacc::span<const uint16_t> sw(w.data(), w.size()), se(e.data(), e.size());
    const gradacc::span<const float> sb(b.data(), b.size());

    const auto refused_with = [&](const char *what, std::initializer_list<gradacc::Grad> grads,
                                  gradacc_status_t want, const char *argument, const char *detail) {
        const auto [status, message] = refusal([&] { typed.add(scaler, grads, 2); });
        EXPECT(status == want && has(message, "gradacc::Accumulator::add") && has(message, argument) &&
                   has(message, detail),
               "%s: %d \"%s\"", what, (int)status, message.c_str());
    };
    const std::vector<float> floats4(4, 1.0f), floats2(2, 1.0f), short_b(2, 1.0f);
    const std::vector<uint16_t> words3(3, F16_ONE);
    refused_with("the first tensor wrong", {floats4, e, b}, GRADACC_STATUS_DTYPE_MISMATCH, "`grads[0]`", "f16");
    typed.add(scaler, {w, e, b}, 2); // containers
    raw.add(scaler, {w.data(), e.data(), b.data()}, 2);
    refused_with("the middle tensor wrong", {w, floats2, b}, GRADACC_STATUS_DTYPE_MISMATCH, "`grads[1]`", "bf16");
    refused_with("the last tensor wrong", {sw, se, words3}, GRADACC_STATUS_DTYPE_MISMATCH, "`grads[2]`", "f32");
    refused_with("the last tensor short", {w, e, short_b}, GRADACC_STATUS_SIZE_MISMATCH, "`grads[2]` has 2 elements",
                 "tensor 2 has 3");
    typed.add(scaler, {sw, se, sb}, 1); // spans
    raw.add(scaler, {w.data(), e.data(), b.data()}, 1);
    const std::vector<gradacc::Grad> list = {w, e, b};
    typed.add(scaler, list, 3); // span<const Grad>
    const std::vector<const void *> ptrs = {w.data(), e.data(), b.data()};
    raw.add(scaler, ptrs, 3);
    // A wrong tensor count stays the C call's refusal.
    const auto [status, message] = refusal([&] { typed.add(scaler, {w, e}, 1); });
    EXPECT(status == GRADACC_STATUS_SIZE_MISMATCH && has(message, "gradacc_accumulator_add"),
           "two gradients for three tensors: %d \"%s\"", (int)status, message.c_str());

    gradacc::SyncInfo a{}, b_info{};
    const std::vector<float> got = synced(typed, a), want = synced(raw, b_info);
    const std::size_t i = first_difference(got, want);
    EXPECT(i == 9 && want.size() == 9, "typed and raw adds differ at element %zu: %g, want %g", i,
           i < got.size() ? (double)got[i] : 0.0, i < want.size() ? (double)want[i] : 0.0);
    EXPECT(a.microbatches == 3 && a.total_count == 6, "%llu micro-batches, %llu items: the refused adds counted",
           (unsigned long long)a.microbatches, (unsigned long long)a.total_count);
}

// Sharded accumulation over 2 ranks: rank 1's typed add with a span of float for the F16 tensor
// throws there and PEER_FAILURE on rank 0; its add_tensor with one fails the micro-batch at
// end_microbatch, WRONG_STATE there and PEER_FAILURE on rank 0. Neither waits for the other, and
// the valid micro-batch afterwards is the window's only one.
void sharded_refusal_fails_every_rank()
{
    const std::vector<gradacc::TensorDesc> tensors = {{8, GRADACC_DTYPE_F32}, {8, GRADACC_DTYPE_F16}};
    gradacc::LocalGroup group(2);
    for (gradacc::Communicator &c : group)
        c.set_timeout(std::chrono::seconds(30)); // a rank left waiting fails instead of hanging
    std::vector<gradacc_status_t> added(2), tensor_added(2), ended(2);
    std::vector<gradacc::SyncInfo> info(2);
    std::vector<std::string> errors(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; r++) {
        threads.emplace_back([&, r] {
            const std::size_t q = static_cast<std::size_t>(r);
            try {
                gradacc::Scaler scaler = unit_scaler();
                gradacc::AccumulatorConfig config;
                config.sharding = GRADACC_SHARDING_ACCUMULATE;
                config.shard_count = 2;
                config.shard_rank = static_cast<uint32_t>(r);
                gradacc::Accumulator acc = gradacc::Accumulator::sharded(tensors, group[q], config);
                const std::vector<float> g0(8, 0.5f), wrong(8, 1.0f);
                const std::vector<uint16_t> g1(8, F16_ONE);
                added[q] = refusal([&] {
                               if (r == 1)
                                   acc.add(scaler, {g0, wrong}, 2);
                               else
                                   acc.add(scaler, {g0, g1}, 2);
                           }).first;
                acc.begin_microbatch(2);
                acc.add_tensor(scaler, 0, g0);
                tensor_added[q] = refusal([&] {
                                      if (r == 1)
                                          acc.add_tensor(scaler, 1, wrong);
                                      else
                                          acc.add_tensor(scaler, 1, g1);
                                  }).first;
                ended[q] = refusal([&] { acc.end_microbatch(); }).first;
                acc.add(scaler, {g0, g1}, 2);
                info[q] = acc.sync();
            } catch (const std::exception &e) {
                errors[q] = e.what();
            }
        });
    }
    for (std::thread &t : threads)
        t.join();
    for (std::size_t q = 0; q < 2; q++) {
        EXPECT(errors[q].empty(), "rank %zu: %s", q, errors[q].c_str());
        EXPECT(info[q].microbatches == 2 && info[q].total_count == 4,
               "rank %zu: %llu micro-batches, %llu items afterwards, want 2 and 4", q,
               (unsigned long long)info[q].microbatches, (unsigned long long)info[q].total_count);
    }
    EXPECT(added[1] == GRADACC_STATUS_DTYPE_MISMATCH && added[0] == GRADACC_STATUS_PEER_FAILURE,
           "add: rank 0 %d, rank 1 %d", (int)added[0], (int)added[1]);
    EXPECT(tensor_added[1] == GRADACC_STATUS_DTYPE_MISMATCH && tensor_added[0] == GRADACC_STATUS_OK,
           "add_tensor: rank 0 %d, rank 1 %d", (int)tensor_added[0], (int)tensor_added[1]);
    EXPECT(ended[1] == GRADACC_STATUS_WRONG_STATE && ended[0] == GRADACC_STATUS_PEER_FAILURE,
           "end_microbatch: rank 0 %d, rank 1 %d", (int)ended[0], (int)ended[1]);
}

} // namespace

int main()
{
    try {
        float_span_for_a_16_bit_tensor(GRADACC_DTYPE_F16, "f16", F16_ONE);
        float_span_for_a_16_bit_tensor(GRADACC_DTYPE_BF16, "bf16", BF16_ONE);
        words_for_f32_and_wrong_lengths();
        typed_add();
        sharded_refusal_fails_every_rank();
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
