"""gradacc's `add` against what a PyTorch user runs instead, on the same buffers, in one process.

Both sides read the same gradient tensors and write the same FP32 master buffer: gradacc adopts
PyTorch's flat master tensor (gradacc_accumulator_create_with_buffer) and is handed the gradients'
data pointers. Each micro-batch must be unscaled, checked for inf/NaN and accumulated into FP32:

  gradacc            gradacc_accumulator_add through ctypes, with the pointer array built once
                     (as a framework integration holds it); one fused pass per tensor
  gradacc_binding    the Python binding's Accumulator.add, which builds that array on every call
  torch_gradscaler   the GradScaler sequence: torch._amp_foreach_non_finite_check_and_unscale_ on
                     the grads, then master.add_(g.float()) per tensor
  torch_plain        per tensor, no foreach: u = g.float() * inv_scale; a non-finite check of u;
                     master.add_(u)
  torch_be_*         best-effort candidates with no per-step allocation (see CANDIDATES); the report
                     takes the fastest one per configuration as PyTorch's best effort

Timing: every variant is called once untimed, then the variants take turns for a number of rounds;
calls shorter than MIN_SAMPLE are repeated within a sample; the median over rounds is reported with
the fastest and slowest. `torch.set_num_threads(t)` and gradacc's `threads = t` are set alike.

The unscale kernels write the gradients in place, so calls alternate inv_scale between 2^-10 and
2^10: the values return to where they started, every multiply still runs (PyTorch skips it only
for exactly 1.0), and no value drifts into subnormals or overflow. Gradient magnitudes lie in
[0.5, 1.5), normal in every format at both scales.

Usage: peer.py --out FILE [--quick] [--only flat,layout,small,count]
"""
import argparse
import ctypes
import json
import os
import platform
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bindings", "python"))
import gradacc  # noqa: E402
from gradacc import _ffi as ffi  # noqa: E402

DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}
INV_SCALES = (2.0 ** -10, 2.0 ** 10)


def transformer(d):
    """The same 500-tensor GPT-style layout as benches/suite.rs (d = 512: 100,084,224 elements)."""
    t = [4096 * d, 512 * d]
    for _ in range(31):
        t += [d, d]
        for _ in range(4):
            t += [d * d, d]
        t += [d, d, 4 * d * d, 4 * d, 4 * d * d, d]
    return t + [d, d]


class Buffers:
    """Separately allocated gradients (like param.grad), one flat FP32 master with per-tensor
    views, FP32 staging for the candidates that need it, and gradacc over the same memory."""

    def __init__(self, numels, dtype, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.numels = list(numels)
        self.dtype = dtype
        self.grads = []
        for n in self.numels:
            mag = torch.rand(n, generator=gen) + 0.5
            sign = torch.randint(0, 2, (n,), generator=gen, dtype=torch.int8) * 2 - 1
            self.grads.append((mag * sign).to(DTYPES[dtype]))
        self.flat = torch.zeros(sum(self.numels), dtype=torch.float32)
        self.masters = list(self.flat.split(self.numels))
        self.staging = None
        self.found_inf = torch.zeros(1)
        self.inv = [torch.full((1,), s) for s in INV_SCALES]
        self.one = torch.ones(1)
        self.turn = 0
        self.accs = {}
        self.scaler = gradacc.Scaler(init_scale=1.0 / INV_SCALES[0])
        self.ptrs = (ctypes.c_void_p * len(self.grads))(*[g.data_ptr() for g in self.grads])

    def staged(self):
        if self.staging is None:
            self.staging = [torch.empty(n) for n in self.numels]
        return self.staging

    def next_inv(self):
        self.turn ^= 1
        return self.inv[self.turn]

    def next_inv_float(self):
        self.turn ^= 1
        return INV_SCALES[self.turn]

    def acc(self, threads):
        if threads not in self.accs:
            self.accs[threads] = gradacc.Accumulator([(n, self.dtype) for n in self.numels], master=self.flat,
                                                     threads=threads)
        return self.accs[threads]

    def close(self):
        for a in self.accs.values():
            a.close()
        self.scaler.close()


# ---- the variants -------------------------------------------------------------------------------

def gradacc_raw(b, threads):
    acc, scaler, n, ptrs = b.acc(threads)._handle(), b.scaler._handle(), len(b.grads), b.ptrs
    add = ffi.gradacc_accumulator_add

    def run():
        if add(acc, scaler, ptrs, n, 1) != 0:
            raise gradacc.GradaccError(-1, ffi.gradacc_last_error().decode())
    return run


def gradacc_binding(b, threads):
    acc = b.acc(threads)
    return lambda: acc.add(b.scaler, b.grads, 1)


def torch_gradscaler(b, threads):
    def run():
        torch._amp_foreach_non_finite_check_and_unscale_(b.grads, b.found_inf, b.next_inv())
        for m, g in zip(b.masters, b.grads):
            m.add_(g.float())
    return run


def torch_plain(b, threads):
    def run():
        inv = b.next_inv_float()
        bad = torch.zeros((), dtype=torch.bool)
        for m, g in zip(b.masters, b.grads):
            u = g.float() * inv
            bad |= ~torch.isfinite(u).all()
            m.add_(u)
        b.found_inf.copy_(bad)
    return run


def be_unscale_foreach_add(b, threads):
    """Unscale the grads in place, then one foreach add of 16-bit into FP32 (no temporaries)."""
    def run():
        torch._amp_foreach_non_finite_check_and_unscale_(b.grads, b.found_inf, b.next_inv())
        torch._foreach_add_(b.masters, b.grads)
    return run


def be_staging(b, threads):
    """Widen into preallocated FP32 staging, unscale and check it there, foreach-add it."""
    staging = b.staged()

    def run():
        torch._foreach_copy_(staging, b.grads)
        torch._amp_foreach_non_finite_check_and_unscale_(staging, b.found_inf, b.next_inv())
        torch._foreach_add_(b.masters, staging)
    return run


def be_check_add_alpha(b, threads):
    """Check the 16-bit grads (the unscale kernel at 1.0 only checks), then a foreach add with the
    unscale folded into alpha."""
    def run():
        torch._amp_foreach_non_finite_check_and_unscale_(b.grads, b.found_inf, b.one)
        torch._foreach_add_(b.masters, b.grads, alpha=b.next_inv_float())
    return run


def be_unscale_add_per_tensor(b, threads):
    """Unscale the grads in place, then a per-tensor add_ of 16-bit into FP32."""
    def run():
        torch._amp_foreach_non_finite_check_and_unscale_(b.grads, b.found_inf, b.next_inv())
        for m, g in zip(b.masters, b.grads):
            m.add_(g)
    return run


CANDIDATES = {
    "torch_be_unscale_foreach_add": be_unscale_foreach_add,
    "torch_be_staging": be_staging,
    "torch_be_check_add_alpha": be_check_add_alpha,
    "torch_be_unscale_add_per_tensor": be_unscale_add_per_tensor,
}
VARIANTS = {
    "gradacc": gradacc_raw,
    "gradacc_binding": gradacc_binding,
    "torch_gradscaler": torch_gradscaler,
    "torch_plain": torch_plain,
    **CANDIDATES,
}


def validate():
    """Each variant, from a zero master, must leave master = g * 2^-10 and flag no overflow on clean
    gradients, and flag an inf: the comparison only counts variants that do the whole job."""
    for dtype in DTYPES:
        for name, make in VARIANTS.items():
            b = Buffers([3, 4099, 70000], dtype, seed=1)
            want = [g.float() * INV_SCALES[0] for g in b.grads]
            run = make(b, 1)
            b.turn = 1  # the next call uses 2^-10
            run()
            for m, w in zip(b.masters, want):
                if not torch.allclose(m, w, rtol=1e-6, atol=0):
                    raise SystemExit(f"{name} ({dtype}) computes a different master")
            if name.startswith("gradacc"):
                if b.acc(1).sync().found_inf:
                    raise SystemExit(f"{name} ({dtype}) flags clean gradients")
            elif b.found_inf.item() != 0:
                raise SystemExit(f"{name} ({dtype}) flags clean gradients")
            b.grads[2][1234] = float("inf")
            run()
            flagged = b.acc(1).sync().found_inf if name.startswith("gradacc") else b.found_inf.item() != 0
            if not flagged:
                raise SystemExit(f"{name} ({dtype}) misses an inf")
            b.close()


# ---- timing -------------------------------------------------------------------------------------

class Timer:
    def __init__(self, rounds, min_sample, pause):
        self.rounds = rounds
        self.min_sample = min_sample
        self.pause = pause

    def measure(self, runs):
        """runs: {name: callable}. Returns {name: {median, min, max, n}} in seconds per call."""
        calls, slowest = {}, 0.0
        for name, run in runs.items():
            time.sleep(self.pause)
            t = time.perf_counter()
            run()
            once = max(time.perf_counter() - t, 1e-9)
            slowest = max(slowest, once)
            calls[name] = max(1, min(100000, int(np.ceil(self.min_sample / once))))
        samples = {name: [] for name in runs}
        # Configurations where a variant takes over a quarter second a call get fewer rounds, so the
        # whole run stays within minutes; the medians of those rows rest on 5 samples.
        rounds = self.rounds if slowest < 0.25 else min(self.rounds, 5)
        for _ in range(rounds):
            for name, run in runs.items():
                # A pause first, so PyTorch's OpenMP workers stop spinning before the next variant.
                time.sleep(self.pause)
                k = calls[name]
                t = time.perf_counter()
                for _ in range(k):
                    run()
                samples[name].append((time.perf_counter() - t) / k)
        out = {}
        for name, s in samples.items():
            s = sorted(s)
            out[name] = {"median": s[len(s) // 2], "min": s[0], "max": s[-1], "n": len(s)}
        return out


def emit(out, group, fields, times):
    rec = {"group": group, **fields, "times": times}
    out.write(json.dumps(rec) + "\n")
    out.flush()


def compare(out, timer, group, fields, numels, dtype, threads_list, variants):
    b = Buffers(numels, dtype)
    try:
        for threads in threads_list:
            torch.set_num_threads(threads)
            runs = {name: VARIANTS[name](b, threads) for name in variants}
            times = timer.measure(runs)
            emit(out, group, {**fields, "tensors": len(numels), "numel": sum(numels), "dtype": dtype,
                              "threads": threads}, times)
            best = min((t["median"], n) for n, t in times.items() if n in CANDIDATES)
            g, s = times["gradacc"]["median"], times["torch_gradscaler"]["median"]
            print(f"{fields.get('case', group):>12} {len(numels):>6} x {sum(numels) // len(numels):<9} {dtype:>4} "
                  f"{threads}T  gradacc {g * 1e3:9.3f} ms | GradScaler {s / g:5.1f}x | best effort "
                  f"{best[0] / g:5.1f}x ({best[1][9:]})", flush=True)
    finally:
        b.close()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only")
    args = p.parse_args()
    only = set(args.only.split(",")) if args.only else None

    def wants(part):
        return only is None or part in only

    validate()
    timer = Timer(rounds=3 if args.quick else 7, min_sample=0.005 if args.quick else 0.02, pause=0.005)
    M = 1 << 20
    with open(args.out, "w") as out:
        emit(out, "peer_env", {"torch": torch.__version__, "numpy": np.__version__, "python": platform.python_version(),
                               "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                               "torch_parallel": torch.__config__.parallel_info().splitlines()[-1].strip()}, {})
        every = list(VARIANTS)
        if wants("flat"):
            for n in ([M, 4 * M] if args.quick else [M, 16 * M, 64 * M]):
                for dtype in DTYPES:
                    compare(out, timer, "peer", {"case": "flat"}, [n], dtype, (1, 2), every)
        if wants("layout"):
            layout = transformer(128 if args.quick else 512)
            for dtype in DTYPES:
                compare(out, timer, "peer", {"case": "transformer"}, layout, dtype, (1, 2), every)
        if wants("small"):
            for numel in (1000, 1):
                for dtype in ("f16", "f32"):
                    compare(out, timer, "peer", {"case": "small"}, [numel] * 1000, dtype, (1, 2), every)
        if wants("count"):
            total = 4 * M if args.quick else 16 * M
            counts = [1, 100, 10000] if args.quick else [1, 10, 100, 1000, 10000, 100000]
            for count in counts:
                numels = [total // count] * count
                compare(out, timer, "count", {"case": "count"}, numels, "f16", (1,), every)


if __name__ == "__main__":
    main()
