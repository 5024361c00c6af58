// Trains the example MLP in bf16 (or fp16) on 2 in-process ranks through gradacc, then checks that
// the loss went down and that both ranks hold bitwise-identical weights.
//   train [--style hooks|add|alternate] [--dtype bf16|fp16] [--steps N] [--optimizer torch|gradacc]
// hooks: every parameter's gradient goes to gradacc from its autograd hook as backward produces
// it; add: one add of all gradients after backward(); alternate: the two by rank and step.
// --optimizer: torch::optim::Adam over FP32 masters (default), or gradacc's optimizer (the same
// rule in one fused pass that writes the 16-bit parameters).
#include "loop.hpp"

#include <torch/utils.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

int main(int argc, char **argv) {
    example::Options opt;
    for (int i = 1; i + 1 < argc; i += 2) {
        const std::string key = argv[i], value = argv[i + 1];
        if (key == "--style" && (value == "hooks" || value == "add" || value == "alternate"))
            opt.style = value == "hooks" ? example::Style::hooks
                        : value == "add" ? example::Style::add
                                         : example::Style::alternate;
        else if (key == "--dtype" && (value == "bf16" || value == "fp16"))
            opt.dtype = value == "bf16" ? torch::kBFloat16 : torch::kHalf;
        else if (key == "--steps" && std::atoi(value.c_str()) > 0)
            opt.steps = std::atoi(value.c_str());
        else if (key == "--optimizer" && (value == "torch" || value == "gradacc"))
            opt.gradacc_optimizer = value == "gradacc";
        else {
            std::fprintf(stderr,
                         "usage: %s [--style hooks|add|alternate] [--dtype bf16|fp16] [--steps N] "
                         "[--optimizer torch|gradacc]\n",
                         argv[0]);
            return 2;
        }
    }
    torch::set_num_threads(1); // one core per rank

    const example::Data data = example::make_data(opt.steps, 1);
    std::vector<example::Mlp> models = example::make_replicas(2, opt.dtype);
    std::vector<double> loss(opt.steps, 0.0); // item-weighted over both ranks
    std::vector<std::vector<float>> scale(example::kRanks, std::vector<float>(opt.steps));
    example::Observer obs;
    obs.after_step = [&](int rank, int step, bool stepped, float s, double loss_sum,
                         gradacc_torch::Binding &, torch::optim::Adam &, example::Mlp &) {
        scale[rank][step] = s;
        if (!stepped)
            std::printf("rank %d: step %d skipped\n", rank, step);
        static std::mutex m;
        std::lock_guard<std::mutex> lock(m);
        loss[step] += loss_sum / static_cast<double>(example::items_per_step());
    };
    example::run_ranks(models, data, opt, obs);

    for (int s = 0; s < opt.steps; s++)
        std::printf("step %2d  loss %.4f  scale %g\n", s, loss[s], scale[0][s]);
    const auto p0 = models[0]->parameters(), p1 = models[1]->parameters();
    for (std::size_t i = 0; i < p0.size(); i++)
        if (!torch::equal(p0[i], p1[i])) {
            std::fprintf(stderr, "FAIL: parameter %zu differs between the ranks\n", i);
            return 1;
        }
    if (!(loss.back() < 0.8 * loss.front())) {
        std::fprintf(stderr, "FAIL: the loss went from %.4f to %.4f\n", loss.front(), loss.back());
        return 1;
    }
    std::printf("ok: loss %.4f -> %.4f over %d steps, both ranks' weights identical\n", loss.front(),
                loss.back(), opt.steps);
    return 0;
}
