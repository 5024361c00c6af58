// examples/quickstart.c through the C++ wrapper: two ranks (threads) fit y = x.w with bf16 weights and
// gradients, a dynamic loss scale, FP32 accumulation, one all-reduce per step, SGD on FP32 masters; a
// failing call throws gradacc::Error. Exits 0 when the ranks' weights are equal and the loss fell 100-fold.
#include <gradacc.hpp>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>
namespace {
constexpr int DIM = 4, STEPS = 40, EVAL = 64;
constexpr float W_TRUE[DIM] = {1.0f, -2.0f, 0.5f, 3.0f};
using Weights = std::array<std::uint16_t, DIM>;

// bf16 is the top half of an f32, rounded to nearest even.
std::uint16_t to_bf16(float f) { std::uint32_t u; std::memcpy(&u, &f, 4); return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16; }
float from_bf16(std::uint16_t h) { std::uint32_t u = std::uint32_t{h} << 16; float f; std::memcpy(&f, &u, 4); return f; }
// Feature j of item i in [-1, 1): a hash, the same in every language's quickstart.
float feature(int i, int j) {
    std::uint32_t h = static_cast<std::uint32_t>(DIM * i + j) * 2654435761u;
    return static_cast<float>(h ^ (h >> 15)) / 2147483648.0f - 1.0f;
}
// Mean loss 0.5 (x.w - x.w_true)^2 over items first..first+n-1, and its gradient times `scale`.
float loss_grad(const Weights &w, int first, int n, float scale, std::vector<std::uint16_t> *g) {
    float sum[DIM] = {}, loss = 0.0f;
    for (int i = first; i < first + n; i++) {
        float err = 0.0f;
        for (int j = 0; j < DIM; j++) err += feature(i, j) * (from_bf16(w[j]) - W_TRUE[j]);
        loss += 0.5f * err * err / n;
        for (int j = 0; j < DIM; j++) sum[j] += err * feature(i, j) / n;
    }
    for (int j = 0; g && j < DIM; j++) (*g)[j] = to_bf16(sum[j] * scale);
    return loss;
}
void train(gradacc::Communicator &comm, int rank, Weights &w) {
    gradacc::Scaler scaler;                                  // GradScaler's defaults, on the CPU
    gradacc::Accumulator acc({{DIM, GRADACC_DTYPE_BF16}});   // mean losses, normalised by count
    gradacc::OptimizerConfig oc;                             // from gradacc_optimizer_config_default
    oc.algorithm = GRADACC_OPTIMIZER_SGD, oc.lr = 0.5f, oc.weight_decay = 0.0f;
    gradacc::Optimizer opt(acc, {w.data()}, {}, oc);         // FP32 masters from the bf16 weights
    std::vector<std::uint16_t> g(DIM);
    for (int step = 0; step < STEPS; step++) {
        for (int k = 0; k < 2; k++) {                        // 3 and 5 items, other items per rank
            int n = k ? 5 : 3, first = 100000 * (rank + 1) + 8 * step + 3 * k;
            loss_grad(w, first, n, scaler.scale(), &g);      // the backward of (loss * scale)
            acc.add(scaler, {g}, n);                         // dtype and length checked
        }
        acc.sync(comm);                                      // all-reduce; mean over 16 items
        scaler.update(acc);                                  // every rank decides alike
        opt.step(acc, {w.data()}, &comm);                    // changes nothing on overflow
    }
}
} // namespace

int main() {
    gradacc::LocalGroup group(2);                            // an in-process group of 2 ranks
    std::array<Weights, 2> w{};
    std::array<bool, 2> ok{};
    std::array<float, 2> loss0{}, loss{};
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; r++)
        threads.emplace_back([&, r] {
            try {
                loss0[r] = loss_grad(w[r], 0, EVAL, 1.0f, nullptr);
                train(group[r], r, w[r]);
                loss[r] = loss_grad(w[r], 0, EVAL, 1.0f, nullptr);
                ok[r] = true;
            } catch (const gradacc::Error &e) {
                std::fprintf(stderr, "rank %d: %s\n", r, e.what());
                (void)gradacc_comm_abort(group[r].get());     // so the other rank stops waiting; the error is above
            }
        });
    for (auto &t : threads) t.join();
    bool same = w[0] == w[1], fell = loss[0] < loss0[0] / 100.0f;
    std::printf("loss %.4f -> %.6f, w[3] %g (true 3), ranks %s\n", loss0[0], loss[0], from_bf16(w[0][3]),
                same ? "equal" : "DIFFER");
    return ok[0] && ok[1] && same && fell ? 0 : 1;
}
