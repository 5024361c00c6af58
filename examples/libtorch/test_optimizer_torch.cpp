// gradacc's optimizer (gradacc::Optimizer) against libtorch's own, torch::optim::AdamW and
// torch::optim::SGD, on FP32 parameters from the same gradients: 30 steps whose learning rate
// changes every step, three tensors of odd sizes. Hyperparameters are exact in float32, so both
// sides compute with the same scalars. The two trajectories are compared after every step: every
// weight within kBound float32 roundings of its tensor's largest weight per step taken so far
// (the sides round differently, and a difference in a moment carries into later steps). The
// count of bitwise-equal weights is printed: gradacc follows the operation order of torch.optim's
// single-tensor path (Python), while libtorch's C++ optimizers update the moments with fused
// multiply-adds (add_ with alpha) and AdamW's first moment as m * beta1 + (1 - beta1) * g
// instead of a lerp, so not every bit can agree.
#include <gradacc.hpp>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace {

constexpr int kSteps = 30;
constexpr double kU = 1.0 / 16777216.0; // 2^-24
constexpr double kBound = 4.0;          // roundings per step taken
const std::vector<int64_t> kSizes = {4099, 17, 1000};

struct Case {
    std::string name;
    gradacc::OptimizerConfig config;
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>, double)> torch;
};

std::vector<Case> cases() {
    std::vector<Case> out;
    gradacc::OptimizerConfig adamw;
    adamw.beta1 = 0.875f;
    adamw.beta2 = 0.998046875f;
    adamw.eps = 0x1p-20f;
    adamw.weight_decay = 0.0078125f;
    out.push_back({"AdamW", adamw, [](std::vector<torch::Tensor> p, double lr) {
                       return std::make_unique<torch::optim::AdamW>(
                           p, torch::optim::AdamWOptions(lr).betas({0.875, 0.998046875}).eps(0x1p-20).weight_decay(0.0078125));
                   }});
    gradacc::OptimizerConfig nesterov;
    nesterov.algorithm = GRADACC_OPTIMIZER_SGD;
    nesterov.momentum = 0.875f;
    nesterov.nesterov = true;
    nesterov.weight_decay = 0.0078125f;
    out.push_back({"SGD, Nesterov, weight decay", nesterov, [](std::vector<torch::Tensor> p, double lr) {
                       return std::make_unique<torch::optim::SGD>(
                           p, torch::optim::SGDOptions(lr).momentum(0.875).nesterov(true).weight_decay(0.0078125));
                   }});
    gradacc::OptimizerConfig damped;
    damped.algorithm = GRADACC_OPTIMIZER_SGD;
    damped.momentum = 0.75f;
    damped.dampening = 0.25f;
    damped.weight_decay = 0.0f;
    out.push_back({"SGD, dampening", damped, [](std::vector<torch::Tensor> p, double lr) {
                       return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(lr).momentum(0.75).dampening(0.25));
                   }});
    return out;
}

void set_lr(torch::optim::Optimizer &opt, double lr) {
    for (auto &group : opt.param_groups()) {
        if (auto *a = dynamic_cast<torch::optim::AdamWOptions *>(&group.options()))
            a->lr(lr);
        if (auto *s = dynamic_cast<torch::optim::SGDOptions *>(&group.options()))
            s->lr(lr);
    }
}

// Runs one case; returns whether every step stayed within the bound.
bool run(const Case &c) {
    torch::manual_seed(20261128);
    std::vector<torch::Tensor> params;
    std::vector<std::vector<float>> weights;
    std::vector<gradacc::TensorDesc> tensors;
    for (int64_t n : kSizes) {
        params.push_back(torch::rand({n}, torch::kFloat32) * 2 - 1);
        weights.emplace_back(params.back().data_ptr<float>(), params.back().data_ptr<float>() + n);
        params.back().set_requires_grad(true);
        tensors.push_back({static_cast<uint64_t>(n), GRADACC_DTYPE_F32});
    }
    gradacc::ScalerConfig sc;
    sc.init_scale = 1.0f;
    sc.dynamic = false;
    gradacc::Scaler scaler(sc);
    gradacc::Accumulator acc(tensors);
    std::vector<const void *> initial;
    for (auto &w : weights)
        initial.push_back(w.data());
    gradacc::OptimizerConfig config = c.config;
    config.lr = 0x1p-5f;
    gradacc::Optimizer opt(acc, gradacc::span<const void *const>(initial.data(), initial.size()), {}, config);
    auto theirs = c.torch(params, config.lr);

    long bitwise = 0, total = 0;
    double worst = 0.0;
    bool ok = true;
    for (int step = 1; step <= kSteps; step++) {
        const float lr = std::ldexp(1.0f, -4 - (step * 7) % 6);
        std::vector<torch::Tensor> grads;
        std::vector<const void *> g;
        for (int64_t n : kSizes) {
            grads.push_back((torch::rand({n}, torch::kFloat32) * 2 - 1) * std::ldexp(1.0, -(step % 8)));
            g.push_back(grads.back().data_ptr<float>());
        }
        acc.add(scaler, gradacc::span<const void *const>(g.data(), g.size()), 1);
        acc.sync();
        opt.set_lr(lr);
        set_lr(*theirs, lr);
        for (std::size_t i = 0; i < params.size(); i++)
            params[i].mutable_grad() = grads[i].clone();
        theirs->step();
        std::vector<void *> out;
        for (auto &w : weights)
            out.push_back(w.data());
        if (!opt.step(acc, gradacc::span<void *const>(out.data(), out.size()))) {
            std::printf("FAIL: %s step %d: gradacc skipped a finite step\n", c.name.c_str(), step);
            return false;
        }
        for (std::size_t i = 0; i < params.size(); i++) {
            const float *t = params[i].data_ptr<float>();
            const double magnitude = params[i].abs().max().item<double>();
            for (int64_t k = 0; k < kSizes[i]; k++) {
                const double dist = std::fabs(static_cast<double>(weights[i][k]) - t[k]) / (kU * magnitude);
                worst = std::max(worst, dist / step);
                bitwise += std::memcmp(&weights[i][k], &t[k], 4) == 0;
                total++;
                if (dist > kBound * step) {
                    std::printf("FAIL: %s step %d tensor %zu element %lld: %.2f roundings (bound %.0f per step)\n",
                                c.name.c_str(), step, i, static_cast<long long>(k), dist, kBound);
                    ok = false;
                }
            }
        }
        if (!ok)
            return false;
    }
    std::printf("ok  : %s: %ld of %ld weight-steps bitwise equal to libtorch's, worst %.3f roundings per step (bound %.0f)\n",
                c.name.c_str(), bitwise, total, worst, kBound);
    return true;
}

} // namespace

int main() {
    torch::NoGradGuard no_grad;
    int failed = 0;
    for (const Case &c : cases())
        failed += !run(c);
    return failed ? 1 : 0;
}
