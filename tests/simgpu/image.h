/* What the software GPU reads from a module image NVRTC made: its target and, per kernel, the
 * parameter sizes and the block size limit (CUBIN: the ELF's .nv.info sections; PTX: the text). */
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <vector>

namespace sim {

struct ImageKernel {
    std::vector<size_t> param_sizes;
    unsigned max_threads = 1024;
};

struct Image {
    bool cubin = false;
    int arch = 0; /* e.g. 80 for sm_80 / compute_80 */
    std::map<std::string, ImageKernel> kernels;
};

/* Parses `data` (CUBIN, or NUL-terminated PTX); false with the reason in `why`. */
bool parse_image(const void *data, Image *image, std::string *why);

} // namespace sim
