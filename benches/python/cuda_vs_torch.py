"""gradacc's CUDA path against PyTorch on the same device buffers.

1. Bit for bit against torch.amp.GradScaler. FP32 parameters whose `.grad` accumulates each
   micro-batch's scaled gradient (f16, bf16 or f32, converted as autograd accumulates into an FP32
   leaf), then GradScaler's unscale_, step and update; gradacc adds the same gradient buffers and
   its scaler updates from the synced window. Every window's found_inf, the scale trace and the
   FP32 masters (gradacc's, read in place through __cuda_array_interface__) must equal
   GradScaler's: odd sizes, an inf and a NaN injected in two windows. The scales are powers of two
   and the values stay normal, so unscaling each micro-batch (gradacc) and unscaling their sum
   (PyTorch) round identically: a binary scaling commutes with rounding.
2. Speed: gradacc's `add` against what a PyTorch user runs per micro-batch on the same buffers,
   `torch._amp_foreach_non_finite_check_and_unscale_` on the grads then `torch._foreach_add_`
   into the FP32 masters (for f16: 22 bytes moved per element against gradacc's 10), for one
   flat tensor of 16M to 256M elements and a 500-tensor transformer layout. CUDA events, median of
   15 after a warm-up.

Run by the GPU bundle (and scripts/gpu-check) when PyTorch with CUDA is importable. Prints
Markdown; exits 1 when a bitwise check fails."""

import ctypes
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bindings", "python"))
from gradacc import _ffi as ffi  # noqa: E402

REPEATS = 15
DTYPES = {torch.float16: ffi.GRADACC_DTYPE_F16, torch.bfloat16: ffi.GRADACC_DTYPE_BF16, torch.float32: ffi.GRADACC_DTYPE_F32}


def ok(status):
    if status != ffi.GRADACC_STATUS_OK:
        raise RuntimeError(ffi.gradacc_last_error().decode())


class DeviceFloats:
    """`n` FP32 values at a device address, for torch.as_tensor without a copy."""

    def __init__(self, ptr, n):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "<f4", "data": (ptr, False), "version": 3, "strides": None}


class Gradacc:
    """A CUDA scaler and accumulator on PyTorch's current stream, and views of the masters."""

    def __init__(self, sizes, dtype, scaler_config=None, normalize=None):
        stream = torch.cuda.current_stream().cuda_stream
        self.device = ffi.gradacc_device_t(ffi.GRADACC_DEVICE_CUDA, torch.cuda.current_device(), stream)
        config = ffi.gradacc_scaler_config_t()
        ok(ffi.gradacc_scaler_config_default(ctypes.byref(config)))
        for name, value in (scaler_config or {"init_scale": 1024.0}).items():
            setattr(config, name, value)
        acc_config = ffi.gradacc_accumulator_config_t()
        ok(ffi.gradacc_accumulator_config_default(ctypes.byref(acc_config)))
        if normalize is not None:
            acc_config.normalize = normalize
        self.scaler, self.acc = ctypes.POINTER(ffi.gradacc_scaler_t)(), ctypes.POINTER(ffi.gradacc_accumulator_t)()
        ok(ffi.gradacc_scaler_create(ctypes.byref(config), ctypes.byref(self.device), ctypes.byref(self.scaler)))
        descs = (ffi.gradacc_tensor_desc_t * len(sizes))(*[ffi.gradacc_tensor_desc_t(n, DTYPES[dtype]) for n in sizes])
        ok(ffi.gradacc_accumulator_create(ctypes.byref(acc_config), descs, len(sizes), ctypes.byref(self.device), ctypes.byref(self.acc)))
        self.masters = []
        for i in range(len(sizes)):
            ptr, numel = ctypes.POINTER(ctypes.c_float)(), ctypes.c_size_t()
            ok(ffi.gradacc_accumulator_master(self.acc, i, ctypes.byref(ptr), ctypes.byref(numel)))
            address = ctypes.cast(ptr, ctypes.c_void_p).value
            self.masters.append(torch.as_tensor(DeviceFloats(address, numel.value), device="cuda"))

    def add(self, grads):
        pointers = (ctypes.c_void_p * len(grads))(*[g.data_ptr() for g in grads])
        ok(ffi.gradacc_accumulator_add(self.acc, self.scaler, pointers, len(grads), 1))

    def sync(self):
        info = ffi.gradacc_sync_info_t()
        info.struct_size = ctypes.sizeof(info)
        ok(ffi.gradacc_accumulator_sync(self.acc, None, ctypes.byref(info)))
        return info

    def update(self):
        accs = (ctypes.POINTER(ffi.gradacc_accumulator_t) * 1)(self.acc)
        skipped = ctypes.c_bool()
        ok(ffi.gradacc_scaler_update(self.scaler, accs, 1, ctypes.byref(skipped)))
        return skipped.value

    def scale(self):
        out = ctypes.c_float()
        ok(ffi.gradacc_scaler_scale(self.scaler, ctypes.byref(out)))
        return out.value

    def close(self):
        self.masters = []
        ok(ffi.gradacc_accumulator_destroy(self.acc))
        ok(ffi.gradacc_scaler_destroy(self.scaler))


def same_bits(a, b):
    """Bitwise equal FP32 tensors, any NaN matching any NaN; the number of elements that differ."""
    both_nan = torch.isnan(a) & torch.isnan(b)
    differ = (a.view(torch.int32) != b.view(torch.int32)) & ~both_nan
    return int(differ.sum().item())


def against_grad_scaler(dtype, sizes, windows=6, microbatches=2):
    """One run of `windows` optimizer steps through both; a list of what differed (empty when
    every window matched) and the scale trace."""
    generator = torch.Generator(device="cuda").manual_seed(20261127 + DTYPES[dtype])
    scaler_config = {"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2}
    mine = Gradacc(sizes, dtype, scaler_config, normalize=ffi.GRADACC_NORMALIZE_NONE)
    params = [torch.zeros(n, device="cuda", dtype=torch.float32, requires_grad=True) for n in sizes]
    optimizer = torch.optim.SGD(params, lr=0.0)
    theirs = torch.amp.GradScaler("cuda", init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)
    problems, trace = [], []
    try:
        for w in range(windows):
            scale = theirs.get_scale()
            for m in range(microbatches):
                grads = [(torch.randn(n, device="cuda", generator=generator) * (1e-3 * scale)).to(dtype) for n in sizes]
                if (w, m) == (2, 1):
                    grads[-1][len(grads[-1]) // 2] = math.inf
                if (w, m) == (4, 0):
                    grads[0][0] = math.nan
                for p, g in zip(params, grads):
                    if p.grad is None:
                        p.grad = g.float()
                    else:
                        p.grad.add_(g)
                mine.add(grads)
            info = mine.sync()
            theirs.unscale_(optimizer)
            torch.cuda.synchronize()
            for i, (p, master) in enumerate(zip(params, mine.masters)):
                differ = same_bits(master, p.grad)
                if differ:
                    problems.append(f"window {w}: tensor {i} ({sizes[i]} elements): {differ} masters differ")
            before = theirs.get_scale()
            theirs.step(optimizer)
            theirs.update()
            their_found_inf = theirs.get_scale() < before
            mine.update()
            if bool(info.found_inf) != their_found_inf:
                problems.append(f"window {w}: found_inf {bool(info.found_inf)}, GradScaler's {their_found_inf}")
            if mine.scale() != theirs.get_scale():
                problems.append(f"window {w}: scale {mine.scale()}, GradScaler's {theirs.get_scale()}")
            trace.append(theirs.get_scale())
            optimizer.zero_grad(set_to_none=True)
    finally:
        mine.close()
    return problems, trace


def timed(fn):
    fn()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def speed(sizes, dtype):
    grads = [torch.randn(n, device="cuda", dtype=dtype) * 1024 for n in sizes]
    masters = [torch.zeros(n, device="cuda", dtype=torch.float32) for n in sizes]
    found_inf = torch.zeros(1, device="cuda")
    inv_scale = torch.full((1,), 1 / 1024.0, device="cuda")

    def pytorch():
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        torch._foreach_add_(masters, grads)

    mine = Gradacc(sizes, dtype)
    try:
        return timed(pytorch), timed(lambda: mine.add(grads))
    finally:
        mine.close()


def transformer_layout(hidden=1024, layers=31, vocab=50257, positions=2048):
    """A GPT-style layout of 500 tensors: embeddings, then per layer two layer norms, the fused
    QKV and output projections and the MLP, each weight with its bias, then the final norm."""
    sizes = [vocab * hidden, positions * hidden]
    for _ in range(layers):
        sizes += [hidden, hidden, 3 * hidden * hidden, 3 * hidden, hidden * hidden, hidden, hidden, hidden]
        sizes += [4 * hidden * hidden, 4 * hidden, 4 * hidden * hidden, hidden, hidden, hidden, hidden, hidden]
    return sizes + [hidden, hidden]


def main():
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print()
    print("| gradients vs torch.amp.GradScaler (6 windows of 2 micro-batches, inf and NaN injected) | result | scale trace |")
    print("|---|---|---|")
    odd = [1, 3, 4097, 65537, 1_000_003]
    failed = False
    for dtype in DTYPES:
        problems, trace = against_grad_scaler(dtype, odd)
        verdict = "bitwise equal" if not problems else "**DIFFER**: " + "; ".join(problems[:5])
        failed |= bool(problems)
        print(f"| {str(dtype).replace('torch.', '')}, sizes {odd} | {verdict} | {' '.join(f'{s:g}' for s in trace)} |")
    print()
    print("| layout | dtype | PyTorch unscale + _foreach_add_ (ms) | gradacc add (ms) | speed-up |")
    print("|---|---|---|---|---|")
    transformer = transformer_layout()
    layouts = [("16M flat", [1 << 24]), ("64M flat", [1 << 26]), ("256M flat", [1 << 28])]
    layouts.append((f"{len(transformer)} tensors, {sum(transformer) / 1e6:.0f}M", transformer))
    for name, sizes in layouts:
        for dtype in DTYPES:
            torch_ms, gradacc_ms = speed(sizes, dtype)
            print(f"| {name} | {str(dtype).replace('torch.', '')} | {torch_ms:.3f} | {gradacc_ms:.3f} | {torch_ms / gradacc_ms:.2f} |")
            torch.cuda.empty_cache()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
