#include <gradacc.hpp>

#include <cstdio>
#include <cstring>

float add_one_microbatch(gradacc::Accumulator &acc, float grad);

int main()
{
    gradacc::Accumulator acc({{1, GRADACC_DTYPE_F32}});
    float scale = add_one_microbatch(acc, 3.0f);
    add_one_microbatch(acc, 5.0f);
    gradacc::SyncInfo info = acc.sync();
    const float got = acc.master(0)[0];
    if (scale != 1.0f || got != 4.0f || info.total_count != 2 || info.microbatches != 2) {
        std::fprintf(stderr, "scale %g, master %g, count %llu, micro-batches %llu; expected 1, 4, 2, 2\n",
                     scale, got, (unsigned long long)info.total_count, (unsigned long long)info.microbatches);
        return 1;
    }
    if (std::strcmp(gradacc::version().c_str(), GRADACC_VERSION_STRING) != 0) {
        std::fprintf(stderr, "library %s, header %s\n", gradacc::version().c_str(), GRADACC_VERSION_STRING);
        return 1;
    }
    std::printf("gradacc.hpp from two translation units: master %g\n", got);
    return 0;
}
