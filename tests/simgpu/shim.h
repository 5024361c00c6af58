/* The CUDA built-ins the project's kernels use, for compiling kernels.cu as host C++ inside the
 * software GPU: qualifiers vanish, __shared__ is per OS thread (a block runs on one), and the
 * thread indices, barriers, shuffles and atomics go to the fiber scheduler (fiber.cpp). */
#pragma once

#include <cmath>
#include <cstddef>
#include <cstring>

#include "sim.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static thread_local

struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
static inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

#define threadIdx (::sim::thread_idx())
#define blockIdx (::sim::block_idx())
#define blockDim (::sim::block_dim())
#define gridDim (::sim::grid_dim())

static inline int __syncthreads_or(int predicate) { return ::sim::barrier(predicate); }
static inline void __syncthreads() { ::sim::barrier(0); }

template <typename T>
static inline T __shfl_down_sync(unsigned mask, T value, unsigned delta, int width = 32) {
    static_assert(sizeof(T) <= 8, "shuffled values are at most 8 bytes");
    uint64_t bits = 0;
    std::memcpy(&bits, &value, sizeof value);
    bits = ::sim::shuffle_down(bits, mask, delta, width);
    std::memcpy(&value, &bits, sizeof value);
    return value;
}

static inline unsigned atomicOr(unsigned *address, unsigned value) { return __atomic_fetch_or(address, value, __ATOMIC_RELAXED); }

using std::sqrt;
