// The whole mixed-precision step after the last micro-batch, gradacc against the ATen operators
// PyTorch's CPU sequence dispatches to, on the same 100M-parameter layout with bf16 weights:
//   PyTorch: GradScaler.unscale_ (_amp_foreach_non_finite_check_and_unscale_), clip_grad_norm_
//            with foreach (_foreach_norm, stack, linalg_vector_norm, the clip coefficient,
//            _foreach_mul_), GradScaler.step into AdamW(fused=True) (_foreach_add_ of the step
//            counts, _fused_adamw_ with found_inf, _foreach_sub_), the copy into the bf16
//            parameters (_foreach_copy_) and GradScaler.update (_amp_update_scale_);
//   gradacc: Accumulator::sync_for_step (normalise and measure; the clip coefficient is left to
//            the step, and the norm was measured by the last add, add_final), Scaler::update,
//            Optimizer::step (AdamW clipping and writing the bf16 weights).
// Both start from the same bf16 weights and take the same scaled bf16 gradients of one
// micro-batch; PyTorch's FP32 gradients are restored before each step and gradacc's `add_final`
// runs before it, both outside the timed region (the add's time is printed beside the table). After the first and the last step the two sides'
// bf16 weights must agree within the optimizer's documented bound (Agreement), or the program
// fails. A floor runs beside them: a plain loop moving the bytes gradacc's step must move.
//
//   bench_step_torch [--quick] [--repeats N] [--threads 1,2] [--seed N] [--json FILE]
// Prints a markdown table: median ms over N timed steps (default 5) after one warm-up step, and
// the median of the step-by-step ratios, at 1 thread and at the machine's thread count
// (at::set_num_threads and the accumulator's `threads` alike). --quick: the layout at d = 128
// (6.7M parameters). The inputs are fresh each run; --seed N repeats those of the run whose header
// printed N. --json appends one line per thread count to FILE (scripts/bench reads it).
#include <gradacc.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace {

// The bound the two sides' weights must keep (Agreement).
constexpr double kF32Rounding = 0x1p-24;
constexpr double kBoundRoundings = 2 * 8;
// gradacc sums the squares in f64 (docs/kernels.md): its norm is a few f32 roundings from the
// exact one. PyTorch sums in f32, far looser; its check only catches a wrong sequence.
constexpr double kNormError = 1e-6;
constexpr double kMaxGradNorm = 1.0;
constexpr double kInitScale = 65536.0;

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
    return std::chrono::duration<double>(Clock::now() - t).count();
}

// benches/suite.rs `transformer(d)`: a GPT-style stack of 500 tensors; d = 512 gives
// 100,084,224 elements, the layout the suite's boundary and PyTorch comparisons use.
std::vector<int64_t> transformer(int64_t d) {
    std::vector<int64_t> t = {4096 * d, 512 * d};
    for (int b = 0; b < 31; b++) {
        t.insert(t.end(), {d, d});
        for (int k = 0; k < 4; k++)
            t.insert(t.end(), {d * d, d});
        t.insert(t.end(), {d, d, 4 * d * d, 4 * d, 4 * d * d, d});
    }
    t.insert(t.end(), {d, d});
    return t;
}

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const std::size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// bf16 bits as a position on the number line: adjacent values differ by one.
int32_t ordered(uint16_t bits) {
    return bits & 0x8000 ? -static_cast<int32_t>(bits & 0x7fff) : static_cast<int32_t>(bits);
}

float widen(uint16_t bits) {
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

// The inputs both sides share: the model's initial bf16 weights and one micro-batch's scaled
// bf16 gradients, one tensor per parameter; and the unscaled gradients' L2 norm summed in f64.
struct Inputs {
    std::vector<torch::Tensor> weights, grads;
    double norm = 0.0;
};

double reference_norm(const std::vector<torch::Tensor> &grads) {
    double sum = 0.0;
    for (const torch::Tensor &g : grads) {
        const auto *bits = static_cast<const uint16_t *>(g.data_ptr());
        for (int64_t k = 0; k < g.numel(); k++) {
            const double x = widen(bits[k]) / kInitScale;
            sum += x * x;
        }
    }
    return std::sqrt(sum);
}

Inputs make_inputs(const std::vector<int64_t> &sizes, uint64_t seed) {
    torch::manual_seed(seed);
    Inputs in;
    for (int64_t n : sizes) {
        in.weights.push_back((torch::randn({n}) * 0.02).to(torch::kBFloat16));
        // Times a power of two: the scaled values are exact, so both unscale to the same FP32.
        in.grads.push_back((torch::randn({n}) * (1e-3 * kInitScale)).to(torch::kBFloat16));
    }
    in.norm = reference_norm(in.grads);
    return in;
}

std::vector<torch::Tensor> clones(const std::vector<torch::Tensor> &ts, torch::ScalarType dtype) {
    std::vector<torch::Tensor> out;
    for (const torch::Tensor &t : ts)
        out.push_back(t.to(dtype, false, true));
    return out;
}

// PyTorch's step, the operators its Python sequence dispatches to, in its order.
struct TorchStep {
    std::vector<torch::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps, model;
    torch::Tensor scale, growth_tracker, total_norm, found;
    gradacc::OptimizerConfig opt;
    std::vector<double> phase; // unscale, clip, AdamW, copy, update: seconds of the last step

    TorchStep(const Inputs &in, const gradacc::OptimizerConfig &config)
        : params(clones(in.weights, torch::kFloat)), grads(clones(in.grads, torch::kFloat)),
          model(clones(in.weights, torch::kBFloat16)), scale(torch::full({}, kInitScale)),
          growth_tracker(torch::zeros({}, torch::kInt)), opt(config), phase(5) {
        for (const torch::Tensor &p : params) {
            exp_avgs.push_back(torch::zeros_like(p));
            exp_avg_sqs.push_back(torch::zeros_like(p));
            steps.push_back(torch::zeros({})); // fused AdamW keeps float32 step counts
        }
    }

    // The accumulated FP32 gradients (the scaled bf16 ones, widened), as backward leaves them.
    void restore(const Inputs &in) { at::_foreach_copy_(grads, in.grads); }

    void step() {
        auto t = Clock::now();
        // GradScaler.unscale_: the reciprocal in f64, then one in-place pass with the check.
        const torch::Tensor inv_scale = scale.to(torch::kDouble).reciprocal().to(torch::kFloat);
        torch::Tensor found_inf = torch::full({}, 0.0);
        at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale);
        phase[0] = seconds_since(t);

        t = Clock::now();
        // clip_grad_norm_(foreach=True): torch/nn/utils/clip_grad.py, _get_total_norm and
        // _clip_grads_with_norm_.
        const std::vector<torch::Tensor> norms = at::_foreach_norm(grads, 2.0);
        total_norm = at::linalg_vector_norm(at::stack(norms), 2.0);
        const torch::Tensor coef = (total_norm + 1e-6).reciprocal() * kMaxGradNorm;
        at::_foreach_mul_(grads, at::clamp(coef, std::nullopt, 1.0));
        phase[1] = seconds_since(t);

        t = Clock::now();
        // GradScaler.step with a fused optimizer after unscale_: found_inf summed over devices
        // (sum() adds it to 0), then torch/optim/adam.py's _fused_adam.
        found = found_inf + 0;
        at::_foreach_add_(steps, 1);
        at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, {}, steps, opt.lr, opt.beta1, opt.beta2,
                          opt.weight_decay, opt.eps, false, false, std::nullopt, found);
        at::_foreach_sub_(steps, std::vector<torch::Tensor>(steps.size(), found));
        phase[2] = seconds_since(t);

        t = Clock::now();
        at::_foreach_copy_(model, params);
        phase[3] = seconds_since(t);

        t = Clock::now();
        at::_amp_update_scale_(scale, growth_tracker, found, 2.0, 0.5, 2000);
        phase[4] = seconds_since(t);
    }
    // The norm clip_grad_norm_ measured; exits if the step was skipped or not clipped.
    double norm() const {
        const double n = total_norm.item<double>();
        if (found.item<float>() != 0.0f || n <= kMaxGradNorm) {
            std::fprintf(stderr, "PyTorch skipped the step or did not clip (norm %g)\n", n);
            std::exit(1);
        }
        return n;
    }
};

// gradacc's step: an accumulator over the same layout with bf16 gradients, its optimizer
// writing bf16 weights.
struct GradaccStep {
    gradacc::Scaler scaler;
    gradacc::Accumulator acc;
    std::vector<torch::Tensor> model;
    std::vector<const void *> grad_ptrs;
    std::vector<void *> weight_ptrs;
    gradacc::Optimizer opt;
    std::vector<double> phase; // sync, scaler update, optimizer step
    gradacc::SyncInfo info{};

    GradaccStep(const Inputs &in, const gradacc::OptimizerConfig &config, unsigned threads)
        : acc(make_accumulator(in, threads)), model(clones(in.weights, torch::kBFloat16)),
          grad_ptrs(ptrs<const void *>(in.grads)), weight_ptrs(ptrs<void *>(model)),
          opt(acc, gradacc::span<const void *const>(weight_ptrs), {}, config), phase(3) {}

    static gradacc::Accumulator make_accumulator(const Inputs &in, unsigned threads) {
        std::vector<gradacc::TensorDesc> descs;
        for (const torch::Tensor &g : in.grads)
            descs.push_back({static_cast<uint64_t>(g.numel()), GRADACC_DTYPE_BF16});
        gradacc::AccumulatorConfig c;
        c.max_grad_norm = static_cast<float>(kMaxGradNorm);
        c.threads = threads;
        return gradacc::Accumulator(descs, c);
    }
    template <class P> static std::vector<P> ptrs(const std::vector<torch::Tensor> &ts) {
        std::vector<P> out;
        for (const torch::Tensor &t : ts)
            out.push_back(t.data_ptr());
        return out;
    }

    // The window's last micro-batch, outside the timed region: unscale, check and accumulate in
    // one pass, which also measures the norm's blocks for the boundary. Returns its seconds.
    double add() {
        const auto t = Clock::now();
        acc.add_final(scaler, gradacc::span<const void *const>(grad_ptrs), 1);
        return seconds_since(t);
    }

    void step() {
        auto t = Clock::now();
        info = acc.sync_for_step();
        phase[0] = seconds_since(t);
        t = Clock::now();
        const bool skip = scaler.update(acc);
        phase[1] = seconds_since(t);
        t = Clock::now();
        const bool stepped = opt.step(acc, gradacc::span<void *const>(weight_ptrs));
        phase[2] = seconds_since(t);
        if (skip || !stepped || info.clip_coef >= 1.0) {
            std::fprintf(stderr, "gradacc skipped the step or did not clip (norm %g)\n", info.grad_norm);
            std::exit(1);
        }
    }
    double norm() const { return info.grad_norm; }
};

// How far apart the two sides' bf16 weights are after `steps` steps from the same `initial` ones.
// Each side's master is within 8 f32 roundings per step of its terms' magnitudes, the weight plus
// the update (docs/optimizer.md, at this benchmark's beta1 = 0.9; the update is lr times at most
// 1 with a gradient that is the same every step), and each rounds it to the nearest bf16. The
// sides also clip by coefficients a relative `clip_diff` apart (PyTorch sums the norm in f32),
// which moves an update by at most that fraction (through eps only: Adam's update does not
// depend on the gradient's scale otherwise). So a weight may differ by 1 bf16 ulp (the masters
// straddle a rounding boundary), or by more only where the result is far smaller than its terms
// (a weight cancelled to near zero), and then by at most steps x (2 x 8 f32 roundings of the
// terms + lr x clip_diff).
struct Agreement {
    int ulps = 0;           // the largest distance, in bf16 ulps
    int64_t unequal = 0;    // weights whose bits differ (the worst comparison's count)
    int64_t beyond_ulp = 0; // weights more than 1 ulp apart (likewise)
    double of_bound = 0.0;  // their largest distance, as a fraction of the bound above
    bool ok() const { return of_bound <= 1.0; }
    void merge(const Agreement &o) {
        ulps = std::max(ulps, o.ulps);
        unequal = std::max(unequal, o.unequal);
        beyond_ulp = std::max(beyond_ulp, o.beyond_ulp);
        of_bound = std::max(of_bound, o.of_bound);
    }

    void add(const std::vector<torch::Tensor> &a, const std::vector<torch::Tensor> &b,
             const std::vector<torch::Tensor> &initial, int steps, float lr, double clip_diff) {
        for (std::size_t i = 0; i < a.size(); i++) {
            const auto *x = static_cast<const uint16_t *>(a[i].data_ptr());
            const auto *y = static_cast<const uint16_t *>(b[i].data_ptr());
            const auto *w = static_cast<const uint16_t *>(initial[i].data_ptr());
            for (int64_t k = 0; k < a[i].numel(); k++) {
                const int d = std::abs(ordered(x[k]) - ordered(y[k]));
                ulps = std::max(ulps, d);
                unequal += d != 0;
                if (d <= 1)
                    continue;
                beyond_ulp++;
                const double terms = std::fabs(widen(w[k])) + steps * static_cast<double>(lr);
                const double dist = std::fabs(static_cast<double>(widen(x[k])) - widen(y[k]));
                const double bound = steps * (kBoundRoundings * kF32Rounding * terms + lr * clip_diff);
                of_bound = std::max(of_bound, dist / bound);
            }
        }
    }
};

// The floor, in the same run: a plain loop over the bytes gradacc's step must move per element
// (read the gradient, read and write the master and both moments, write the bf16 weight: 30 B),
// one add per value, its elements cut into one run per thread as gradacc's pass cuts them.
struct Floor {
    std::vector<float> g, x, m, v;
    std::vector<uint16_t> w;
    explicit Floor(std::size_t n) : g(n, 0.25f), x(n, 0.5f), m(n), v(n), w(n) {}

    void run(std::size_t lo, std::size_t hi) {
        for (std::size_t i = lo; i < hi; i++) {
            m[i] += g[i];
            v[i] += g[i];
            x[i] += m[i] + v[i];
            uint32_t bits;
            std::memcpy(&bits, &x[i], sizeof bits);
            w[i] = static_cast<uint16_t>(bits >> 16);
        }
    }
    double time(unsigned threads) {
        const std::size_t n = g.size();
        const auto t = Clock::now();
        std::vector<std::thread> pool;
        for (unsigned k = 1; k < threads; k++)
            pool.emplace_back([this, n, k, threads] { run(n * k / threads, n * (k + 1) / threads); });
        run(0, n / threads);
        for (std::thread &th : pool)
            th.join();
        g[0] = -g[0]; // keep the values bounded from step to step
        return seconds_since(t);
    }
};

struct Options {
    bool quick = false;
    int repeats = 5;
    // Fresh inputs every run unless --seed repeats a run's (the header prints the seed).
    uint64_t seed = static_cast<uint64_t>(Clock::now().time_since_epoch().count());
    std::vector<unsigned> threads;
    std::string json;
};

Options parse(int argc, char **argv) {
    Options o;
    for (int i = 1; i < argc; i++) {
        const std::string a = argv[i];
        if (a == "--quick") {
            o.quick = true;
        } else if (a == "--repeats" && i + 1 < argc) {
            o.repeats = std::max(1, std::atoi(argv[++i]));
        } else if (a == "--seed" && i + 1 < argc) {
            o.seed = std::strtoull(argv[++i], nullptr, 10);
        } else if (a == "--json" && i + 1 < argc) {
            o.json = argv[++i];
        } else if (a == "--threads" && i + 1 < argc) {
            for (const char *p = argv[++i]; *p;) {
                char *end = nullptr;
                const unsigned long t = std::strtoul(p, &end, 10);
                if (end == p || t == 0)
                    break;
                o.threads.push_back(static_cast<unsigned>(t));
                p = *end == ',' ? end + 1 : end;
            }
        } else {
            std::fprintf(stderr, "usage: bench_step_torch [--quick] [--repeats N] [--threads 1,2] [--seed N] "
                                 "[--json FILE]\n");
            std::exit(2);
        }
    }
    if (o.threads.empty()) {
        o.threads.push_back(1);
        const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
        if (hw > 1)
            o.threads.push_back(hw);
    }
    return o;
}

struct Row {
    unsigned threads;
    double torch_ms, gradacc_ms, floor_ms, add_ms;
    double speedup, over_floor; // medians of the step-by-step ratios
    std::vector<double> torch_phases, gradacc_phases; // medians, ms
    Agreement agreement;
    double torch_norm_err, gradacc_norm_err; // relative, against the f64 reference
};

std::vector<double> phase_medians(const std::vector<std::vector<double>> &runs) {
    std::vector<double> out;
    for (std::size_t p = 0; p < runs.front().size(); p++) {
        std::vector<double> v;
        for (const auto &r : runs)
            v.push_back(r[p] * 1e3);
        out.push_back(median(v));
    }
    return out;
}

template <class Side> double timed(Side &side) {
    const auto t = Clock::now();
    side.step();
    return seconds_since(t);
}

// One thread count: a warm-up step and `repeats` timed ones, the three taking turns first.
Row measure(const Inputs &in, std::size_t total, unsigned threads, int repeats) {
    at::set_num_threads(static_cast<int>(threads));
    const gradacc::OptimizerConfig config;
    TorchStep theirs(in, config);
    GradaccStep ours(in, config, threads);
    Floor floor(total);
    std::vector<double> t_torch, t_ours, t_floor, t_add, speedup, over_floor;
    std::vector<std::vector<double>> p_torch, p_ours;
    Row row{threads, 0, 0, 0, 0, 0, 0, {}, {}, {}, 0, 0};
    for (int r = 0; r <= repeats; r++) {
        theirs.restore(in);
        const double added = ours.add();
        double a = 0, b = 0, f = 0;
        for (int turn = 0; turn < 3; turn++) {
            switch ((turn + r) % 3) {
            case 0: a = timed(theirs); break;
            case 1: b = timed(ours); break;
            default: f = floor.time(threads); break;
            }
        }
        if (r > 0) {
            t_torch.push_back(a);
            t_ours.push_back(b);
            t_floor.push_back(f);
            t_add.push_back(added);
            speedup.push_back(a / b);
            over_floor.push_back(b / f);
            p_torch.push_back(theirs.phase);
            p_ours.push_back(ours.phase);
        }
        if (r == 0 || r == repeats) {
            Agreement now;
            const double clip_diff = std::fabs(theirs.norm() - ours.norm()) / ours.norm();
            now.add(theirs.model, ours.model, in.weights, r + 1, config.lr, clip_diff);
            row.agreement.merge(now);
            row.torch_norm_err = std::max(row.torch_norm_err, std::fabs(theirs.norm() / in.norm - 1));
            row.gradacc_norm_err = std::max(row.gradacc_norm_err, std::fabs(ours.norm() / in.norm - 1));
        }
    }
    row.torch_ms = median(t_torch) * 1e3;
    row.gradacc_ms = median(t_ours) * 1e3;
    row.floor_ms = median(t_floor) * 1e3;
    row.add_ms = median(t_add) * 1e3;
    row.speedup = median(speedup);
    row.over_floor = median(over_floor);
    row.torch_phases = phase_medians(p_torch);
    row.gradacc_phases = phase_medians(p_ours);
    return row;
}

// One JSON line per row, appended to `path`: times in seconds, as benches/python/report.py reads them.
void write_json(const std::string &path, const std::vector<Row> &rows, std::size_t tensors, int64_t total) {
    std::FILE *f = std::fopen(path.c_str(), "a");
    if (!f) {
        std::fprintf(stderr, "cannot open %s\n", path.c_str());
        std::exit(1);
    }
    for (const Row &r : rows)
        std::fprintf(f,
                     "{\"group\":\"torch_step\",\"tensors\":%zu,\"numel\":%lld,\"threads\":%u,\"torch\":%.6g,"
                     "\"gradacc\":%.6g,\"floor\":%.6g,\"speedup\":%.4f,\"over_floor\":%.4f,\"ulps\":%d,"
                     "\"of_bound\":%.4f}\n",
                     tensors, static_cast<long long>(total), r.threads, r.torch_ms * 1e-3, r.gradacc_ms * 1e-3,
                     r.floor_ms * 1e-3, r.speedup, r.over_floor, r.agreement.ulps, r.agreement.of_bound);
    std::fclose(f);
}

} // namespace

int main(int argc, char **argv) {
    const Options o = parse(argc, argv);
    torch::NoGradGuard no_grad;
    const std::vector<int64_t> sizes = transformer(o.quick ? 128 : 512);
    int64_t total = 0;
    for (int64_t n : sizes)
        total += n;
    const Inputs in = make_inputs(sizes, o.seed);

    std::vector<Row> rows;
    for (unsigned t : o.threads)
        rows.push_back(measure(in, static_cast<std::size_t>(total), t, o.repeats));

    if (!o.json.empty())
        write_json(o.json, rows, sizes.size(), total);

    std::printf("Boundary + AdamW step, %zu tensors, %lld parameters, bf16 weights and gradients, clipped "
                "to %g; median of %d steps after a warm-up, ms; libtorch %d.%d.%d; seed %llu\n\n",
                sizes.size(), static_cast<long long>(total), kMaxGradNorm, o.repeats, TORCH_VERSION_MAJOR,
                TORCH_VERSION_MINOR, TORCH_VERSION_PATCH, static_cast<unsigned long long>(o.seed));
    std::printf("| threads | PyTorch | unscale_ | clip | AdamW | copy | gradacc | sync | step | floor | "
                "PyTorch / gradacc | gradacc / floor | bf16 ulps, max (unequal) | > 1 ulp (of bound) | norm error, "
                "PyTorch / gradacc | add_final (untimed) |\n");
    std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    bool ok = true;
    for (const Row &r : rows) {
        const auto &p = r.torch_phases;
        const auto &q = r.gradacc_phases;
        const Agreement &a = r.agreement;
        std::printf("| %u | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | **%.2f×** | %.2f | "
                    "%d (%lld) | %lld (%.2f) | %.1e / %.1e | %.1f |\n",
                    r.threads, r.torch_ms, p[0], p[1], p[2], p[3], r.gradacc_ms, q[0], q[2], r.floor_ms,
                    r.speedup, r.over_floor, a.ulps,
                    static_cast<long long>(a.unequal), static_cast<long long>(a.beyond_ulp), a.of_bound,
                    r.torch_norm_err, r.gradacc_norm_err, r.add_ms);
        ok = ok && a.ok() && r.gradacc_norm_err < kNormError && r.torch_norm_err < 1e3 * kNormError;
    }
    std::printf("\nPyTorch's phases: GradScaler.unscale_, clip_grad_norm_, AdamW(fused=True) through "
                "GradScaler.step, the copy into the bf16 parameters (GradScaler.update: the rest). "
                "gradacc's: sync_for_step (its norm measured by the last add, add_final, whose time is the "
                "last column and is not in gradacc's) and the optimizer step, which clips (Scaler::update: "
                "the rest). The floor moves the 30 B per element of gradacc's step, one add per value. Ratios: "
                "the median of the step-by-step ratios (the three take turns within a step). "
                "Weights compared after the first and the last step (the worse of the two); gradient norms "
                "against their sum of squares in f64.\n");
    if (!ok) {
        std::printf("\nFAIL: weights more than 1 bf16 ulp apart beyond the bound, or a gradient norm off "
                    "(gradacc: by over %.0e; PyTorch: by over %.0e)\n",
                    kNormError, 1e3 * kNormError);
        return 1;
    }
    return 0;
}
