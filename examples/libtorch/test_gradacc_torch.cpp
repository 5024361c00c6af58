// Tests of gradacc_torch.hpp driving libtorch (2 in-process ranks, bf16 MLP, unequal micro-batches):
//  1. the gradient gradacc accumulates, for both feeding styles, in bf16 and in fp16, against
//     a) libtorch's own FP32 gradient of the full effective batch (29 items), normwise, within the
//        tolerances below; a plain mean of the micro-batch means is shown to fall outside them;
//     b) the same 16-bit micro-batch gradients combined in float64, elementwise, within FP32
//        accumulation rounding;
//     and a frozen parameter is left out, an unused one gets a zero gradient;
//  2. hooks, add and the two alternated give bitwise the same weights after several steps, and both
//     ranks always hold bitwise-identical 16-bit weights and FP32 masters;
//  3. an inf in one micro-batch of rank 1 skips the step on both ranks: weights, masters and the
//     Adam state stay bitwise as they were, and the loss scale is halved.
#include "loop.hpp"

#include <torch/utils.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>

namespace {

int passed = 0, failed = 0;
void check(bool ok, const std::string &what) {
    std::printf("%s: %s\n", ok ? "ok  " : "FAIL", what.c_str());
    (ok ? passed : failed)++;
}

bool same_bits(const torch::Tensor &a, const torch::Tensor &b) {
    if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type())
        return false;
    const torch::Tensor ca = a.contiguous(), cb = b.contiguous();
    return std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0;
}
bool same_bits(const std::vector<torch::Tensor> &a, const std::vector<torch::Tensor> &b) {
    if (a.size() != b.size())
        return false;
    for (std::size_t i = 0; i < a.size(); i++)
        if (!same_bits(a[i], b[i]))
            return false;
    return true;
}
std::vector<torch::Tensor> clones(const std::vector<torch::Tensor> &ts) {
    std::vector<torch::Tensor> out;
    for (const torch::Tensor &t : ts)
        out.push_back(t.detach().clone());
    return out;
}
double rel_err(const torch::Tensor &x, const torch::Tensor &ref) {
    const torch::Tensor r = ref.to(torch::kDouble);
    return (x.to(torch::kDouble) - r).norm().item<double>() / r.norm().item<double>();
}

constexpr uint64_t kDataSeed = 1, kModelSeed = 2;
// The scaler's initial scale (gradacc's default, PyTorch GradScaler's): a power of two, so scaling
// and unscaling are exact.
constexpr double kScale = 65536.0;

// bf16 keeps 8 significant bits: unit roundoff u = 2^-8. On its longest path (to fc1.weight) an
// element of the bf16 gradient is rounded about 8 times: the input, fc1's output, GELU's output,
// the logits, the logits' gradient, fc2's input gradient, GELU's input gradient, fc1's weight
// gradient (each matmul accumulates in FP32 and rounds once). First order, that bounds the
// normwise relative error by 8u = 2^-5 (3.1%); rounding errors of random sign keep the measured
// error near u (printed below).
const double kBf16Tol = 8.0 * std::ldexp(1.0, -8);
// The same 8 roundings in fp16 (11 significant bits, u = 2^-11), the scaled gradients well inside
// its range: 8u = 2^-8.
const double kFp16Tol = 8.0 * std::ldexp(1.0, -11);
// FP32 accumulation of 6 micro-batches (unscale and item weighting included): at most ~8 FP32
// roundings of unit 2^-24 per element, relative to the sum of the terms' magnitudes; 16 leaves margin.
const double kFp32Tol = 16.0 * std::ldexp(1.0, -24);

const char *name(example::Style s) {
    return s == example::Style::hooks ? "hooks" : s == example::Style::add ? "add" : "alternate";
}

// Test 1: one step; the masters right after the boundary.
void test_gradient(example::Style style, torch::ScalarType dtype) {
    const example::Data data = example::make_data(1, kDataSeed);
    std::vector<example::Mlp> models = example::make_replicas(kModelSeed, dtype);
    example::Options opt;
    opt.style = style;
    opt.dtype = dtype;
    opt.steps = 1;
    std::vector<std::vector<torch::Tensor>> master(example::kRanks);
    std::vector<gradacc::SyncInfo> info(example::kRanks);
    example::Observer obs;
    obs.after_sync = [&](int rank, int, const gradacc::SyncInfo &i, gradacc_torch::Binding &b) {
        info[rank] = i;
        for (std::size_t t = 0; t < b.master_weights().size(); t++)
            master[rank].push_back(b.master_grad(t).clone());
    };
    example::run_ranks(models, data, opt, obs);
    const bool bf16 = dtype == torch::kBFloat16;
    const double tol = bf16 ? kBf16Tol : kFp16Tol;
    const std::string s = std::string(name(style)) + (bf16 ? " bf16" : " fp16");
    check(same_bits(master[0], master[1]), s + ": both ranks hold the same master gradient bits");
    check(info[0].total_count == 29 && info[0].microbatches == 6 && !info[0].found_inf,
          s + ": the boundary counts 29 items in 6 micro-batches");

    // a) libtorch's FP32 gradient of the mean loss over all 29 items, at the same (bf16) weights.
    example::Mlp ref = example::make_model(kModelSeed);
    ref->to(dtype);
    ref->to(torch::kFloat);
    torch::nn::functional::cross_entropy(ref(data.x[0]), data.y[0]).backward();
    // The plain mean of the micro-batch mean gradients (unequal sizes weighted alike), in FP32.
    example::Mlp naive = example::make_model(kModelSeed);
    naive->to(dtype);
    naive->to(torch::kFloat);
    // b) the bf16 micro-batch gradients, unscaled, weighted by items, summed in float64.
    example::Mlp half = example::make_model(kModelSeed);
    half->to(dtype);
    const auto rp = ref->parameters(), np = naive->parameters(), hp = half->parameters();
    std::vector<torch::Tensor> exact, magnitude, naive_sum;
    for (const torch::Tensor &p : hp) {
        exact.push_back(torch::zeros(p.sizes(), torch::kDouble));
        magnitude.push_back(torch::zeros(p.sizes(), torch::kDouble));
        naive_sum.push_back(torch::zeros(p.sizes(), torch::kDouble));
    }
    for (int r = 0; r < example::kRanks; r++)
        for (std::size_t k = 0; k < example::kMicrobatches[r].size(); k++) {
            const int64_t n = example::kMicrobatches[r][k], o = data.offset(r, k);
            const torch::Tensor x = data.x[0].slice(0, o, o + n), y = data.y[0].slice(0, o, o + n);
            torch::nn::functional::cross_entropy(naive(x), y).backward();
            (torch::nn::functional::cross_entropy(half(x.to(dtype)).to(torch::kFloat), y) *
             kScale)
                .backward();
            for (std::size_t t = 0; t < hp.size(); t++) {
                const torch::Tensor g = hp[t].grad().to(torch::kDouble) * (double(n) / kScale);
                exact[t] += g;
                magnitude[t] += g.abs();
                naive_sum[t] += np[t].grad().to(torch::kDouble);
                hp[t].mutable_grad().reset();
                np[t].mutable_grad().reset();
            }
        }
    const double N = double(example::items_per_step()), M = 6.0;
    double worst = 0.0, worst_naive = 1e300, worst_exact = 0.0;
    for (std::size_t t = 0; t < hp.size(); t++) {
        worst = std::max(worst, rel_err(master[0][t], rp[t].grad()));
        worst_naive = std::min(worst_naive, rel_err(naive_sum[t] / M, rp[t].grad()));
        const torch::Tensor excess = (master[0][t].to(torch::kDouble) - exact[t] / N).abs() -
                                     kFp32Tol * magnitude[t] / N;
        worst_exact = std::max(worst_exact, excess.max().item<double>());
    }
    char line[200];
    std::snprintf(line, sizeof line,
                  "%s: vs FP32 full-batch gradient, worst normwise error %.2e <= %.2e (8u)",
                  s.c_str(), worst, tol);
    check(worst <= tol, line);
    std::snprintf(line, sizeof line,
                  "%s: a plain mean of micro-batch means is off by at least %.2e > 2 x tolerance",
                  s.c_str(), worst_naive);
    check(worst_naive > 2.0 * tol, line);
    check(worst_exact <= 0.0,
          s + ": equals the 16-bit micro-batch gradients combined in float64 within 16 FP32 ulps");
}

// A frozen parameter is left out; one the loss does not use gets a zero gradient in both styles.
struct ThreeImpl : torch::nn::Module {
    ThreeImpl() {
        used = register_parameter("used", torch::ones({3}, torch::kBFloat16));
        unused = register_parameter("unused", torch::ones({2}, torch::kBFloat16));
        frozen = register_parameter("frozen", torch::ones({4}, torch::kBFloat16), false);
    }
    torch::Tensor used, unused, frozen;
};
TORCH_MODULE(Three);

void test_frozen_and_unused() {
    for (example::Style style : {example::Style::hooks, example::Style::add}) {
        Three m;
        gradacc::Scaler scaler;
        gradacc_torch::Binding b(*m, scaler);
        const torch::Tensor x = torch::tensor({0.5f, -2.0f, 3.0f});
        // The mean over 2 items of a loss whose gradient is x for each: x.
        torch::Tensor loss = (m->used.to(torch::kFloat) * x).sum() * (m->frozen.to(torch::kFloat).sum() / 4.0f);
        if (style == example::Style::hooks) {
            b.begin_microbatch(2);
            b.scale_loss(loss).backward();
            b.end_microbatch();
        } else {
            b.scale_loss(loss).backward();
            b.add(2);
        }
        b.sync();
        const std::string s = name(style);
        check(b.master_weights().size() == 2, s + ": a frozen parameter gets no master");
        check(same_bits(b.master_grad(0), x) && same_bits(b.master_grad(1), torch::zeros({2})),
              s + ": the used parameter's master gradient is exact, the unused one's is zero");
    }
}

struct Snapshot {
    bool stepped = false;
    float scale = 0.0f;
    std::vector<torch::Tensor> weights, masters, exp_avg, exp_avg_sq;
    std::vector<int64_t> adam_steps;
};
using Run = std::vector<std::vector<Snapshot>>; // [rank][step]

Run run(example::Style style, int steps, int inject_step, std::vector<std::vector<bool>> *found_inf) {
    const example::Data data = example::make_data(steps, kDataSeed);
    std::vector<example::Mlp> models = example::make_replicas(kModelSeed, torch::kBFloat16);
    example::Options opt;
    opt.style = style;
    opt.steps = steps;
    opt.inject_step = inject_step;
    opt.inject_rank = 1;
    opt.inject_microbatch = 1;
    Run out(example::kRanks, std::vector<Snapshot>(steps));
    example::Observer obs;
    if (found_inf) {
        found_inf->assign(example::kRanks, std::vector<bool>(steps));
        obs.after_sync = [&](int rank, int step, const gradacc::SyncInfo &i, gradacc_torch::Binding &) {
            (*found_inf)[rank][step] = i.found_inf;
        };
    }
    obs.after_step = [&](int rank, int step, bool stepped, float scale, double,
                         gradacc_torch::Binding &b, torch::optim::Adam &adam, example::Mlp &model) {
        Snapshot &s = out[rank][step];
        s.stepped = stepped;
        s.scale = scale;
        s.weights = clones(model->parameters());
        s.masters = clones(b.master_weights());
        for (const torch::Tensor &m : b.master_weights()) {
            auto it = adam.state().find(m.unsafeGetTensorImpl());
            if (it == adam.state().end()) {
                s.adam_steps.push_back(-1);
                continue;
            }
            const auto &st = static_cast<const torch::optim::AdamParamState &>(*it->second);
            s.adam_steps.push_back(st.step());
            s.exp_avg.push_back(st.exp_avg().clone());
            s.exp_avg_sq.push_back(st.exp_avg_sq().clone());
        }
    };
    example::run_ranks(models, data, opt, obs);
    return out;
}

bool ranks_agree(const Run &r) {
    for (std::size_t step = 0; step < r[0].size(); step++)
        if (!same_bits(r[0][step].weights, r[1][step].weights) ||
            !same_bits(r[0][step].masters, r[1][step].masters))
            return false;
    return true;
}

// Test 2.
void test_styles_agree() {
    const int steps = 6;
    std::map<std::string, Run> runs;
    for (example::Style s : {example::Style::hooks, example::Style::add, example::Style::alternate}) {
        runs[name(s)] = run(s, steps, -1, nullptr);
        const Run &r = runs[name(s)];
        check(ranks_agree(r), std::string(name(s)) + ": both ranks bitwise identical after each of 6 steps");
        bool cast = true;
        for (std::size_t i = 0; i < r[0].back().weights.size(); i++)
            cast = cast && same_bits(r[0].back().weights[i], r[0].back().masters[i].to(torch::kBFloat16));
        check(cast, std::string(name(s)) + ": the bf16 weights are the FP32 masters rounded");
    }
    check(same_bits(runs["hooks"][0].back().masters, runs["add"][0].back().masters) &&
              same_bits(runs["hooks"][0].back().masters, runs["alternate"][0].back().masters),
          "hooks, add and alternate reach bitwise the same masters after 6 steps");
    check(!same_bits(runs["hooks"][0][0].weights, runs["hooks"][0][steps - 1].weights),
          "the weights do change");
}

// Test 3.
void test_overflow_skips() {
    const int steps = 4, bad = 2;
    std::vector<std::vector<bool>> found_inf;
    const Run r = run(example::Style::alternate, steps, bad, &found_inf);
    check(found_inf[0][bad] && found_inf[1][bad] && !found_inf[0][bad - 1] && !found_inf[1][bad + 1],
          "an inf in rank 1's micro-batch is seen by both ranks' boundary, that step only");
    bool skipped = true, unchanged = true, halved = true;
    for (int rank = 0; rank < example::kRanks; rank++) {
        const Snapshot &before = r[rank][bad - 1], &at = r[rank][bad], &after = r[rank][bad + 1];
        skipped = skipped && before.stepped && !at.stepped && after.stepped;
        unchanged = unchanged && same_bits(before.weights, at.weights) &&
                    same_bits(before.masters, at.masters) && before.adam_steps == at.adam_steps &&
                    same_bits(before.exp_avg, at.exp_avg) && same_bits(before.exp_avg_sq, at.exp_avg_sq);
        halved = halved && at.scale == 0.5f * before.scale && before.scale == float(kScale);
    }
    check(skipped, "both ranks skip the step with the inf, and step again after it");
    check(unchanged, "the skipped step leaves weights, masters and Adam state (step, moments) bitwise unchanged");
    check(halved, "the loss scale backs off from 65536 to 32768 on both ranks");
    check(r[0][bad - 1].adam_steps[0] == bad && r[0][bad + 1].adam_steps[0] == bad + 1,
          "Adam counts only the steps taken");
    check(ranks_agree(r), "both ranks bitwise identical at every step, the skipped one included");
}

} // namespace

int main() {
    torch::set_num_threads(1);
    try {
        for (torch::ScalarType dtype : {torch::kBFloat16, torch::kHalf})
            for (example::Style style : {example::Style::hooks, example::Style::add})
                test_gradient(style, dtype);
        test_frozen_and_unused();
        test_styles_agree();
        test_overflow_skips();
    } catch (const std::exception &e) {
        std::printf("FAIL: exception: %s\n", e.what());
        failed++;
    }
    std::printf("%d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
