"""The Python binding's per-call cost of Accumulator.add over 1,000 tensors: the plain form, the
bound form (Accumulator.bind), and the bare C call it makes, taking turns, 200 rounds after 20
warm-up calls each. Usage: bind.py [--out FILE] [elements per tensor, default 4 (so the C work
itself is small)]. --out writes one JSON line for benches/python/report.py (seconds per call)."""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bindings", "python"))
import gradacc  # noqa: E402


def interleaved(calls, rounds=200, warmup=20):
    """Each call's times over `rounds` rounds in which the calls take turns, after warm-up calls."""
    for call in calls.values():
        for _ in range(warmup):
            call()
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return times


def stats(ts):
    return {"median": statistics.median(ts), "min": min(ts), "max": max(ts), "n": len(ts)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("numel", nargs="?", type=int, default=4)
    ap.add_argument("--out")
    args = ap.parse_args()
    tensors = [(args.numel, "f16")] * 1000
    grads = [np.ones(args.numel, dtype=np.float16) for _ in tensors]
    with gradacc.Accumulator(tensors) as acc, gradacc.Scaler(init_scale=1.0) as scaler:
        bound = acc.bind(grads)
        times = interleaved({
            "plain": lambda: acc.add(scaler, grads, 1),
            "bound": lambda: acc.add(scaler, bound, 1),
            "bare": lambda: gradacc._core.ffi.gradacc_accumulator_add(
                acc._handle(), scaler._handle(), bound._array, len(bound), 1),
        })
    med = {name: statistics.median(ts) * 1e6 for name, ts in times.items()}
    print(f"1000 tensors of {args.numel} f16 elements: plain add {med['plain']:.0f} us, bound add {med['bound']:.0f} us, "
          f"the C call alone {med['bare']:.0f} us")
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps({"group": "binding", "language": "python", "tensors": len(tensors), "numel": args.numel,
                                "times": {name: stats(ts) for name, ts in times.items()}}) + "\n")


if __name__ == "__main__":
    main()
