/* The project's kernels, compiled for the host: looked up by name, with each parameter's size
 * (compared with the image NVRTC made) and a launch that copies the arguments as the driver does. */
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "sim.h"

namespace sim {

struct BoundKernel {
    std::function<void(Footprint &)> footprint; /* the memory the launch touches */
    std::function<void()> body;                 /* one CUDA thread's work */
};

struct KernelInfo {
    std::string name;
    std::vector<size_t> param_sizes;
    /* Copies the arguments from the driver's `void **` array; checks every pointer argument
     * against the live allocations of `device` (a violation otherwise). */
    std::function<BoundKernel(void **args, int device)> bind;
};

const KernelInfo *find_kernel(const std::string &name);

} // namespace sim
