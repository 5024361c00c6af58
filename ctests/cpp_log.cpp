// The C++ wrapper's messages and report: set_log_callback forwards a skipped step's message with
// its scales to a lambda, an empty function turns it off, diagnostics() returns the whole report;
// Optimizer::step takes the communicator by reference, as sync does.
#include <gradacc.hpp>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "cpp_expect.hpp"

namespace {

// One window of one f32 tensor whose second value is `value`, synced over `comm`, then the
// scaler's update and the optimizer's step. Returns whether it stepped.
bool one_step(gradacc::Scaler &scaler, float value, gradacc::Communicator &comm)
{
    gradacc::Accumulator acc({{2, GRADACC_DTYPE_F32}});
    std::vector<float> w = {1.0f, 1.0f}, g = {1.0f, value};
    gradacc::Optimizer opt(acc, {w.data()});
    acc.add(scaler, {g}, 1);
    acc.sync(comm);
    scaler.update(acc);
    return opt.step(acc, {w.data()}, comm);
}

void messages()
{
    std::vector<std::string> got;
    gradacc::set_log_callback([&](gradacc_log_level_t, const char *m) { got.emplace_back(m); });
    gradacc::ScalerConfig config;
    config.init_scale = 512.0f;
    gradacc::Scaler scaler(config);
    gradacc::LocalGroup group(1);
    EXPECT(!one_step(scaler, INFINITY, group[0]), "an overflowing step stepped");
    const std::string want = "step 1 skipped: a gradient was not finite; loss scale 512 -> 256";
    EXPECT(!got.empty() && got[0] == want, "first of %zu messages: %s", got.size(),
           got.empty() ? "none" : got[0].c_str());
    gradacc::set_log_callback(nullptr);
    const std::size_t before = got.size();
    EXPECT(one_step(scaler, 2.0f, group[0]), "a finite step did not step");
    EXPECT(!one_step(scaler, INFINITY, group[0]), "an overflowing step stepped");
    EXPECT(got.size() == before, "%zu messages after turning the callback off", got.size() - before);
}

void report()
{
    const std::string r = gradacc::diagnostics();
    EXPECT(r.rfind("gradacc " + gradacc::version() + " (", 0) == 0, "%s", r.c_str());
    EXPECT(r.find("backends:") != std::string::npos && r.back() == '\n', "%s", r.c_str());
}

} // namespace

int main()
{
    try {
        messages();
        report();
    } catch (const gradacc::Error &e) {
        std::fprintf(stderr, "unexpected: %s\n", e.what());
        return 1;
    }
    if (failures) {
        std::fprintf(stderr, "%d checks failed\n", failures);
        return 1;
    }
    std::printf("all checks passed\n");
    return 0;
}
