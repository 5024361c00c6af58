// gradacc_torch.hpp: gradacc for a torch::nn::Module (libtorch, CPU). Copy it into your project.
//
// A Binding owns one gradacc accumulator over a module's trainable parameters (bf16, fp16 or fp32,
// on the CPU) and their FP32 master weights, whose .grad() IS gradacc's FP32 master gradient
// (torch::from_blob, no copy). Feed it either from backward hooks, tensor by tensor as autograd
// produces the gradients (begin_microbatch / backward / end_microbatch), or with one add() after
// backward(). step() runs a stock torch::optim optimizer built over master_weights() and copies the
// weights back to the module, unless the scaler says the step must be skipped (an inf or NaN on
// any rank). Do not build the optimizer over the module's own parameters. Or step with gradacc's
// own optimizer (make_optimizer): one fused pass over its FP32 masters and state that writes the
// module's 16-bit parameters, with no copy back.
#pragma once

#include <gradacc.hpp>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <stdexcept>
#include <vector>

namespace gradacc_torch {

inline gradacc_dtype_t dtype_of(const torch::Tensor &t) {
    switch (t.scalar_type()) {
    case torch::kFloat: return GRADACC_DTYPE_F32;
    case torch::kHalf: return GRADACC_DTYPE_F16;
    case torch::kBFloat16: return GRADACC_DTYPE_BF16;
    default: throw std::invalid_argument("gradacc_torch: a parameter is not float, half or bfloat16");
    }
}

// Not copyable or movable: the hooks hold `this`. The scaler must outlive the Binding.
class Binding {
public:
    Binding(torch::nn::Module &model, gradacc::Scaler &scaler,
            const gradacc::AccumulatorConfig &config = gradacc::AccumulatorConfig())
        : params_(trainable(model)), scaler_(scaler), acc_(make_accumulator(params_, config)) {
        torch::NoGradGuard no_grad;
        for (std::size_t i = 0; i < params_.size(); i++) {
            masters_.push_back(params_[i].detach().to(torch::kFloat, false, true).requires_grad_());
            hooks_.push_back(params_[i].register_hook([this, i](const torch::Tensor &grad) {
                if (!open_)
                    return;
                const torch::Tensor g = grad.contiguous();
                acc_.add_tensor(scaler_, i, g.data_ptr(), static_cast<std::size_t>(g.numel()));
            }));
        }
        attach_grads();
    }
    Binding(const Binding &) = delete;
    Binding &operator=(const Binding &) = delete;
    ~Binding() {
        for (std::size_t i = 0; i < params_.size(); i++) {
            params_[i].remove_hook(hooks_[i]);
            masters_[i].mutable_grad().reset(); // it points into the accumulator
        }
    }

    // The FP32 master weights: build the optimizer over these, not over the module's parameters.
    const std::vector<torch::Tensor> &master_weights() const { return masters_; }
    // Parameter i's FP32 master gradient (the boundary's result after sync), a view of gradacc's buffer.
    const torch::Tensor &master_grad(std::size_t i) const { return masters_[i].grad(); }
    gradacc::Accumulator &accumulator() { return acc_; }

    // The loss times the current loss scale: call backward() on this.
    torch::Tensor scale_loss(const torch::Tensor &loss) const { return loss * scaler_.scale(); }

    // (a) Hooks: gradients go to gradacc as backward() produces them, between these two calls.
    void begin_microbatch(std::uint64_t count) {
        acc_.begin_microbatch(count);
        open_ = true;
    }
    void end_microbatch() {
        open_ = false;
        acc_.end_microbatch();
        drop_grads();
    }
    // (b) After backward(): one fused add of every parameter's .grad().
    void add(std::uint64_t count) {
        std::vector<torch::Tensor> grads;
        std::vector<const void *> ptrs;
        for (const torch::Tensor &p : params_) { // a parameter the loss did not use adds zeros
            grads.push_back(p.grad().defined() ? p.grad().contiguous() : torch::zeros_like(p));
            ptrs.push_back(grads.back().data_ptr());
        }
        acc_.add(scaler_, ptrs, count);
        drop_grads();
    }

    // The boundary: every rank of `comm`'s group calls it (nullptr: one process).
    gradacc::SyncInfo sync(gradacc::Communicator *comm = nullptr) {
        return comm ? acc_.sync(*comm) : acc_.sync();
    }
    // gradacc's optimizer over the module's parameters, its FP32 masters initialised from them
    // (master_weights() is not used then). Step it with step(gradacc::Optimizer &).
    gradacc::Optimizer make_optimizer(const gradacc::OptimizerConfig &config) {
        std::vector<const void *> weights;
        for (const torch::Tensor &p : params_)
            weights.push_back(p.data_ptr());
        return gradacc::Optimizer(acc_, weights, {}, config);
    }
    // After sync(): updates the scaler, then steps gradacc's `optimizer`, which writes the
    // module's parameters. Returns false, touching neither, when the step must be skipped.
    bool step(gradacc::Optimizer &optimizer) {
        scaler_.update(acc_);
        std::vector<void *> weights;
        for (const torch::Tensor &p : params_)
            weights.push_back(p.data_ptr());
        torch::NoGradGuard no_grad;
        return optimizer.step(acc_, weights);
    }

    // After sync(): updates the scaler, then steps `optimizer` and copies the master weights to
    // the module's parameters. Returns false, touching neither, when the step must be skipped.
    bool step(torch::optim::Optimizer &optimizer) {
        if (scaler_.update(acc_))
            return false;
        attach_grads(); // in case optimizer.zero_grad() dropped them
        optimizer.step();
        torch::NoGradGuard no_grad;
        for (std::size_t i = 0; i < params_.size(); i++)
            params_[i].copy_(masters_[i]);
        return true;
    }

private:
    static std::vector<torch::Tensor> trainable(torch::nn::Module &model) {
        std::vector<torch::Tensor> params;
        for (const torch::Tensor &p : model.parameters())
            if (p.requires_grad())
                params.push_back(p);
        return params;
    }
    static gradacc::Accumulator make_accumulator(const std::vector<torch::Tensor> &params,
                                                 const gradacc::AccumulatorConfig &config) {
        std::vector<gradacc::TensorDesc> descs;
        for (const torch::Tensor &p : params) {
            if (!p.device().is_cpu())
                throw std::invalid_argument("gradacc_torch: this adapter handles CPU parameters");
            descs.push_back({static_cast<std::uint64_t>(p.numel()), dtype_of(p)});
        }
        return gradacc::Accumulator(descs, config);
    }
    void attach_grads() {
        for (std::size_t i = 0; i < params_.size(); i++)
            masters_[i].mutable_grad() =
                torch::from_blob(acc_.master(i).data(), params_[i].sizes(), torch::kFloat);
    }
    void drop_grads() {
        for (const torch::Tensor &p : params_)
            p.mutable_grad().reset();
    }

    std::vector<torch::Tensor> params_, masters_;
    gradacc::Scaler &scaler_;
    gradacc::Accumulator acc_;
    std::vector<unsigned> hooks_;
    bool open_ = false;
};

} // namespace gradacc_torch
