// gradacc.hpp is header-only: included from two translation units of one program (this file and
// b.cpp), its inline functions must link without duplicate symbols and behave the same in both.
#include <gradacc.hpp>
#include <gradacc.hpp> // and twice in one unit

// Defined here, called from b.cpp: a scaler built in this unit, an accumulator in the other.
float add_one_microbatch(gradacc::Accumulator &acc, float grad)
{
    gradacc::ScalerConfig config;
    config.init_scale = 1.0f;
    gradacc::Scaler scaler(config);
    const float g[1] = {grad};
    acc.add(scaler, {g}, 1);
    return scaler.scale();
}
