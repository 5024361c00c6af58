// The example's model, data and data-parallel training loop, shared by train.cpp and
// test_gradacc_torch.cpp: a 2-layer MLP classifier trained in bf16 (or fp16) on the CPU by 2 ranks
// (threads of one process in a gradacc::LocalGroup), each with micro-batches of different sizes,
// FP32 master weights stepped by torch::optim::Adam (or by gradacc's optimizer: the same Adam
// rule, AdamW without weight decay), gradients through gradacc_torch::Binding.
#pragma once

#include "gradacc_torch.hpp"

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <cmath>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace example {

struct MlpImpl : torch::nn::Module {
    MlpImpl(int64_t in, int64_t hidden, int64_t out)
        : fc1(register_module("fc1", torch::nn::Linear(in, hidden))),
          fc2(register_module("fc2", torch::nn::Linear(hidden, out))) {}
    torch::Tensor forward(const torch::Tensor &x) { return fc2(torch::gelu(fc1(x))); }
    torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Mlp);

constexpr int64_t kIn = 16, kHidden = 64, kClasses = 4;
constexpr int kRanks = 2;
// Items per micro-batch, per rank: unequal sizes and counts, 29 items per step in all.
inline const std::vector<std::vector<int64_t>> kMicrobatches = {{5, 3, 8}, {2, 7, 4}};
inline int64_t items_per_step() {
    int64_t n = 0;
    for (const auto &rank : kMicrobatches)
        for (int64_t m : rank)
            n += m;
    return n;
}

// FP32 inputs and labels of every step (a fixed random linear teacher labels the points).
struct Data {
    torch::Tensor x; // [steps, items_per_step, kIn]
    torch::Tensor y; // [steps, items_per_step], int64
    // Rank r's micro-batch k of step s: rows [offset, offset + size) of step s.
    int64_t offset(int rank, std::size_t k) const {
        int64_t o = 0;
        for (int r = 0; r < rank; r++)
            for (int64_t m : kMicrobatches[r])
                o += m;
        for (std::size_t j = 0; j < k; j++)
            o += kMicrobatches[rank][j];
        return o;
    }
};

inline Data make_data(int steps, uint64_t seed) {
    torch::manual_seed(seed);
    Data d;
    d.x = torch::randn({steps, items_per_step(), kIn});
    torch::Tensor teacher = torch::randn({kIn, kClasses});
    d.y = torch::matmul(d.x, teacher).argmax(-1);
    return d;
}

// A freshly initialised model in FP32 (the same for the same seed).
inline Mlp make_model(uint64_t seed) {
    torch::manual_seed(seed);
    return Mlp(kIn, kHidden, kClasses);
}

enum class Style { hooks, add, alternate };
inline Style style_of(int rank, int step, Style s) {
    if (s != Style::alternate)
        return s;
    return (rank + step) % 2 == 0 ? Style::hooks : Style::add;
}

struct Options {
    Style style = Style::hooks;
    // Step with gradacc's optimizer instead of torch::optim::Adam.
    bool gradacc_optimizer = false;
    torch::ScalarType dtype = torch::kBFloat16;
    int steps = 20;
    double lr = 1e-2;
    // An inf in the first input of (inject_rank, micro-batch inject_microbatch) at inject_step.
    int inject_step = -1, inject_rank = 0;
    std::size_t inject_microbatch = 0;
};

// What a rank reports to its caller; called on the rank's own thread.
struct Observer {
    std::function<void(int rank, int step, const gradacc::SyncInfo &, gradacc_torch::Binding &)> after_sync;
    // loss_sum: the sum over this rank's items of their FP32 loss, before the step.
    std::function<void(int rank, int step, bool stepped, float scale_after, double loss_sum,
                       gradacc_torch::Binding &, torch::optim::Adam &, Mlp &)>
        after_step;
};

// One rank: `model` is this rank's replica (already in opt.dtype), `comm` its endpoint.
inline void run_rank(int rank, Mlp model, gradacc::Communicator &comm, const Data &data,
                     const Options &opt, const Observer &obs) {
    gradacc::Scaler scaler; // PyTorch GradScaler's defaults: 65536, x0.5 on overflow
    gradacc_torch::Binding binding(*model, scaler);
    torch::optim::Adam adam(binding.master_weights(), torch::optim::AdamOptions(opt.lr));
    gradacc::OptimizerConfig config; // AdamW's betas and eps, as torch's Adam defaults
    config.lr = static_cast<float>(opt.lr);
    config.weight_decay = 0.0f; // torch::optim::Adam's default: none
    std::unique_ptr<gradacc::Optimizer> own;
    if (opt.gradacc_optimizer)
        own = std::make_unique<gradacc::Optimizer>(binding.make_optimizer(config));
    for (int step = 0; step < opt.steps; step++) {
        const Style style = style_of(rank, step, opt.style);
        double loss_sum = 0.0;
        for (std::size_t k = 0; k < kMicrobatches[rank].size(); k++) {
            const int64_t n = kMicrobatches[rank][k], o = data.offset(rank, k);
            torch::Tensor x = data.x[step].slice(0, o, o + n).to(opt.dtype, false, true);
            const torch::Tensor y = data.y[step].slice(0, o, o + n);
            if (step == opt.inject_step && rank == opt.inject_rank && k == opt.inject_microbatch)
                x[0][0] = std::numeric_limits<float>::infinity();
            // The loss in FP32 (mean over the micro-batch's items) from 16-bit logits.
            torch::Tensor loss = torch::nn::functional::cross_entropy(model(x).to(torch::kFloat), y);
            loss_sum += loss.item<double>() * static_cast<double>(n);
            if (style == Style::hooks) {
                binding.begin_microbatch(static_cast<uint64_t>(n));
                binding.scale_loss(loss).backward();
                binding.end_microbatch();
            } else {
                binding.scale_loss(loss).backward();
                binding.add(static_cast<uint64_t>(n));
            }
        }
        const gradacc::SyncInfo info = binding.sync(&comm);
        if (obs.after_sync)
            obs.after_sync(rank, step, info, binding);
        // The ranks are threads of one process here, and libtorch's Adam step run on two threads
        // at once gave one rank a different result now and then from bitwise-equal weights and
        // gradients (3-9 runs in 100 of `train --style hooks --dtype fp16`; an instrumented build
        // kept gradacc's buffers read-only through the step and still failed), so the ranks take turns. Ranks in processes of their own need no such lock.
        const bool stepped = [&] {
            if (own)
                return binding.step(*own);
            static std::mutex one_step_at_a_time;
            std::lock_guard<std::mutex> lock(one_step_at_a_time);
            return binding.step(adam);
        }();
        if (obs.after_step)
            obs.after_step(rank, step, stepped, scaler.scale(), loss_sum, binding, adam, model);
    }
}

// Runs every rank on its own thread; `models[r]` is rank r's replica. Rethrows a rank's exception.
inline void run_ranks(std::vector<Mlp> &models, const Data &data, const Options &opt,
                      const Observer &obs) {
    gradacc::LocalGroup group(kRanks);
    std::vector<std::exception_ptr> errors(kRanks);
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; r++)
        threads.emplace_back([&, r] {
            try {
                run_rank(r, models[r], group[r], data, opt, obs);
            } catch (...) {
                errors[r] = std::current_exception();
                try {
                    group[r].abort(); // the other rank's sync fails instead of waiting
                } catch (...) {
                }
            }
        });
    for (std::thread &t : threads)
        t.join();
    for (const std::exception_ptr &e : errors)
        if (e)
            std::rethrow_exception(e);
}

// Rank replicas: the same initial weights, cast to `dtype`.
inline std::vector<Mlp> make_replicas(uint64_t seed, torch::ScalarType dtype) {
    std::vector<Mlp> models;
    for (int r = 0; r < kRanks; r++) {
        models.push_back(make_model(seed));
        models.back()->to(dtype);
    }
    return models;
}

} // namespace example
