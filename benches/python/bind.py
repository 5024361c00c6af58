"""The Python binding's per-call cost of Accumulator.add over 1,000 tensors: the plain form, the
bound form (Accumulator.bind), and the bare C call it makes, as medians of 200 calls after 20
warm-up calls. Usage: bind.py [elements per tensor, default 4 (so the C work itself is small)]."""
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bindings", "python"))
import gradacc  # noqa: E402


def median_us(call, reps=200, warmup=20):
    for _ in range(warmup):
        call()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main():
    numel = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    tensors = [(numel, "f16")] * 1000
    grads = [np.ones(numel, dtype=np.float16) for _ in tensors]
    with gradacc.Accumulator(tensors) as acc, gradacc.Scaler(init_scale=1.0) as scaler:
        bound = acc.bind(grads)
        plain = median_us(lambda: acc.add(scaler, grads, 1))
        bound_us = median_us(lambda: acc.add(scaler, bound, 1))
        bare = median_us(lambda: gradacc._core.ffi.gradacc_accumulator_add(
            acc._handle(), scaler._handle(), bound._array, len(bound), 1))
    print(f"1000 tensors of {numel} f16 elements: plain add {plain:.0f} us, bound add {bound_us:.0f} us, "
          f"the C call alone {bare:.0f} us")


if __name__ == "__main__":
    main()
