"""The seed scenarios (../../../../shared seeds, replayed in ctests/seed_*.c) through the Python
binding, with the seeds' exact numbers."""

import numpy as np
import pytest

import gradacc
from ranks import run_ranks


@pytest.mark.parametrize("dtype, np_dtype", [("f16", np.float16), ("f32", np.float32), ("bf16", None)])
@pytest.mark.parametrize("normalize, want_w, want_b", [("by_world", 3.0, 2.0), ("by_microbatches", 1.5, 1.0)])
def test_apex_o2_two_ranks(dtype, np_dtype, normalize, want_w, want_b):
    # Linear(1,1), loss = mean(output): weight grad = input (1.0 on rank 0, 2.0 on rank 1), bias
    # grad = 1; two micro-batches per rank, loss scale 1. Apex O2 gives 2.5 / 3.5.
    def rank(comm, r):
        with gradacc.Scaler(init_scale=1.0) as scaler, \
                gradacc.Accumulator([(1, dtype), (1, dtype)], normalize=normalize) as acc:
            x = 1.0 + r
            if np_dtype is None:  # bf16 words: the upper half of the f32 (exact for 1.0 and 2.0)
                w = (np.array([x], np.float32).view(np.uint32) >> 16).astype(np.uint16)
                b = (np.array([1.0], np.float32).view(np.uint32) >> 16).astype(np.uint16)
            else:
                w, b = np.array([x], np_dtype), np.array([1.0], np_dtype)
            for _ in range(2):
                acc.add(scaler, [w, b], count=1)
            info = acc.sync(comm)
            assert comm.rank == r and comm.world_size == 2
            return info, acc.master(0).copy(), acc.master(1).copy(), scaler.update(acc)

    results = run_ranks(2, rank)
    for info, w, b, skipped in results:
        assert not skipped and not info.found_inf
        assert (info.total_count, info.microbatches) == (4, 4)
        assert w[0] == want_w and b[0] == want_b
    assert results[0][1].tobytes() == results[1][1].tobytes()  # bitwise identical across ranks
    assert results[0][0] == results[1][0]


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_accelerate_weight_2_04(dtype):
    # x = 1..8, y = 2x, w = 0, MSE, 4 micro-batches of 2, SGD lr 0.02: w = 2.04 as the full batch.
    x = np.arange(1, 9, dtype=np.float64)
    y = 2 * x
    w = np.float32(0.0)
    scale = 1.0 if dtype == "f32" else 128.0
    with gradacc.Scaler(init_scale=scale) as scaler, gradacc.Accumulator([(1, dtype)]) as acc:
        for m in range(4):
            xb, yb = x[2 * m:2 * m + 2], y[2 * m:2 * m + 2]
            g = np.mean(2 * (w * xb - yb) * xb)  # gradient of this micro-batch's mean loss
            acc.add(scaler, [np.array([g * scaler.scale], np.float32 if dtype == "f32" else np.float16)], count=2)
        info = acc.sync()
        assert not scaler.update(acc)
        assert (info.total_count, info.microbatches) == (8, 4)
        assert acc.master(0)[0] == -102.0
        w = np.float32(w - 0.02 * acc.master(0)[0])
    assert abs(float(w) - 2.04) <= 2.04 * np.finfo(np.float32).eps
    full = 0.0 - 0.02 * np.mean(2 * (0.0 * x - y) * x)
    assert full == pytest.approx(2.04, abs=1e-12)


def linear_problem(seed=5):
    rng = np.random.default_rng(seed)
    W, b = rng.normal(size=(3, 5)), rng.normal(size=3)
    X, T = rng.normal(size=(32, 5)), rng.normal(size=(32, 3))
    return W, b, X, T


def grad_sum(W, b, X, T):
    """Gradient of sum_i 0.5 |W x_i + b - t_i|^2, in f64."""
    R = X @ W.T + b - T
    return R.T @ X, R.sum(axis=0)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fastai_32_as_8x4_equals_full_batch(reduction):
    W, b, X, T = linear_problem()
    full_W, full_b = (g / 32 for g in grad_sum(W, b, X, T))
    with gradacc.Scaler(init_scale=1.0) as scaler, \
            gradacc.Accumulator([(15, "f32"), (3, "f32")], loss_reduction=reduction, normalize="by_count") as acc:
        for m in range(4):
            gW, gb = grad_sum(W, b, X[8 * m:8 * m + 8], T[8 * m:8 * m + 8])
            if reduction == "mean":
                gW, gb = gW / 8, gb / 8
            acc.add(scaler, [gW.astype(np.float32).ravel(), gb.astype(np.float32)], count=8)
        info = acc.sync()
        assert info.total_count == 32
        np.testing.assert_allclose(acc.master(0), full_W.ravel(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(acc.master(1), full_b, rtol=1e-5, atol=1e-6)


def test_fastai_float16_grads():
    # numpy float16 gradients at loss scale 1024: the result is the f64 mean of exactly the values
    # the library was given (decoded fp16 / scale), and close to the true full-batch gradient.
    W, b, X, T = linear_problem(7)
    full_W, full_b = (g / 32 for g in grad_sum(W, b, X, T))
    scale = 1024.0
    given_W, given_b = np.zeros(15), np.zeros(3)
    with gradacc.Scaler(init_scale=scale) as scaler, gradacc.Accumulator([(15, np.float16), (3, np.float16)]) as acc:
        for m in range(4):
            gW, gb = (g / 8 for g in grad_sum(W, b, X[8 * m:8 * m + 8], T[8 * m:8 * m + 8]))
            hW, hb = (gW.ravel() * scale).astype(np.float16), (gb * scale).astype(np.float16)
            given_W += hW.astype(np.float64) / scale * 8 / 32
            given_b += hb.astype(np.float64) / scale * 8 / 32
            acc.add(scaler, [hW, hb], count=8)
        acc.sync()
        np.testing.assert_allclose(acc.master(0), given_W, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(acc.master(1), given_b, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(acc.master(0), full_W.ravel(), rtol=2e-3, atol=2e-3)


def test_example_apex_o2_side_by_side():
    import os
    import subprocess
    import sys
    root = os.path.join(os.path.dirname(__file__), "..", "..", "..")
    script = os.path.join(root, "examples", "python", "apex_o2_side_by_side.py")
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rank 0               2.5" in out.stdout and "rank 1               3.5" in out.stdout


def test_example_quickstart():
    import os
    import subprocess
    import sys
    root = os.path.join(os.path.dirname(__file__), "..", "..", "..")
    script = os.path.join(root, "examples", "python", "quickstart.py")
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ranks equal" in out.stdout
