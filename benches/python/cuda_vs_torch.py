"""gradacc's CUDA `add` against what a PyTorch user runs per micro-batch, on the same device
buffers: `torch._amp_foreach_non_finite_check_and_unscale_` on the grads followed by the FP32
accumulation `master.add_(grad.float())` (the GradScaler sequence), for one flat tensor of 16M to
256M elements and a many-tensor layout. Times with CUDA events, median of 15 after a warm-up.
Run by scripts/gpu-check when PyTorch with CUDA is importable; prints a Markdown table."""

import ctypes
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


def compare(sizes, dtype):
    grads = [torch.randn(n, device="cuda", dtype=dtype) * 1024 for n in sizes]
    masters = [torch.zeros(n, device="cuda", dtype=torch.float32) for n in sizes]
    found_inf = torch.zeros(1, device="cuda")
    inv_scale = torch.full((1,), 1 / 1024.0, device="cuda")

    def pytorch():
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        for m, g in zip(masters, grads):
            m.add_(g.float())

    stream = torch.cuda.current_stream().cuda_stream
    device = ffi.gradacc_device_t(ffi.GRADACC_DEVICE_CUDA, torch.cuda.current_device(), stream)
    config = ffi.gradacc_scaler_config_t()
    ok(ffi.gradacc_scaler_config_default(ctypes.byref(config)))
    config.init_scale = 1024.0
    scaler, acc = ctypes.POINTER(ffi.gradacc_scaler_t)(), ctypes.POINTER(ffi.gradacc_accumulator_t)()
    ok(ffi.gradacc_scaler_create(ctypes.byref(config), ctypes.byref(device), ctypes.byref(scaler)))
    descs = (ffi.gradacc_tensor_desc_t * len(sizes))(*[ffi.gradacc_tensor_desc_t(n, DTYPES[dtype]) for n in sizes])
    ok(ffi.gradacc_accumulator_create(None, descs, len(sizes), ctypes.byref(device), ctypes.byref(acc)))
    pointers = (ctypes.c_void_p * len(sizes))(*[g.data_ptr() for g in grads])

    def gradacc():
        ok(ffi.gradacc_accumulator_add(acc, scaler, pointers, len(sizes), 1))

    result = timed(pytorch), timed(gradacc)
    ok(ffi.gradacc_accumulator_destroy(acc))
    ok(ffi.gradacc_scaler_destroy(scaler))
    return result


def main():
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| layout | dtype | PyTorch GradScaler sequence (ms) | gradacc add (ms) | speed-up |")
    print("|---|---|---|---|---|")
    transformer = [50_000_000, 25_000_000] + [50_000] * 498
    for name, sizes in [("16M flat", [1 << 24]), ("64M flat", [1 << 26]), ("256M flat", [1 << 28]), ("500 tensors, 100M", transformer)]:
        for dtype in DTYPES:
            torch_ms, gradacc_ms = compare(sizes, dtype)
            print(f"| {name} | {str(dtype).replace('torch.', '')} | {torch_ms:.3f} | {gradacc_ms:.3f} | {torch_ms / gradacc_ms:.2f} |")


if __name__ == "__main__":
    main()
