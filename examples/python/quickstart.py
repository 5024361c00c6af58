#!/usr/bin/env python3
"""examples/quickstart.c in Python: two ranks (threads) fit y = x.w with fp16 weights and gradients,
the dynamic loss scale (its first steps overflow fp16 and are skipped while it backs off), FP32
accumulation of micro-batches of 3 and 5 items, one all-reduce per step, SGD on FP32 masters.
Exits non-zero unless both ranks end with the same weights and the loss fell 100-fold.

Run: python3 examples/python/quickstart.py (after `cargo build --release`; or with gradacc installed).
"""
import os
import sys
import threading

import numpy as np

# The repository's copy of the package, when run from a clone; an installed gradacc otherwise.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bindings", "python"))
import gradacc  # noqa: E402

W_TRUE = np.array([1.0, -2.0, 0.5, 3.0], np.float32)
STEPS = 40


def features(first, n):
    """Features of items first..first+n-1 in [-1, 1): a hash, the same in every language's quickstart."""
    h = (4 * np.arange(first, first + n)[:, None] + np.arange(4)).astype(np.uint32) * np.uint32(2654435761)
    return (h ^ (h >> np.uint32(15))).astype(np.float32) / np.float32(2**31) - np.float32(1)


def loss_grad(w, first, n, scale=1.0):
    """Mean loss 0.5 (x.w - x.w_true)^2 over the items, and its gradient times `scale` in fp16."""
    x = features(first, n)
    err = x @ (w.astype(np.float32) - W_TRUE)
    with np.errstate(over="ignore"):  # an fp16 gradient that overflows is the scaler's to handle
        return float(0.5 * np.mean(err * err)), (x.T @ err / n * np.float32(scale)).astype(np.float16)


def train(comm, rank, w, skipped):
    with gradacc.Scaler() as scaler, gradacc.Accumulator([(4, "f16")]) as acc:  # defaults; by count
        with gradacc.Optimizer(acc, [w], algorithm="sgd", lr=0.5) as opt:  # FP32 masters from w
            for step in range(STEPS):
                for k, n in enumerate((3, 5)):  # other items on each rank
                    _, g = loss_grad(w, 100000 * (rank + 1) + 8 * step + 3 * k, n, scaler.scale)
                    acc.add(scaler, [g], count=n)  # the backward of loss * scale, in fp16
                acc.sync(comm)  # the all-reduce; the mean over all 16 items
                skipped[rank] += scaler.update(acc)  # every rank decides alike
                opt.step(comm)  # writes w in place; a no-op on overflow


def main():
    comms = gradacc.local_group(2)  # an in-process group: one communicator per rank
    w = [np.zeros(4, np.float16) for _ in comms]
    skipped, errors = [0, 0], []

    def rank_main(r):
        try:
            train(comms[r], r, w[r], skipped)
        except Exception as e:  # the other rank must not wait for this one
            errors.append(e)
            comms[r].abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in comms:
        c.close()
    if errors:
        raise errors[0]
    loss0, loss = loss_grad(np.zeros(4, np.float16), 0, 64)[0], loss_grad(w[0], 0, 64)[0]
    same = np.array_equal(w[0].view(np.uint16), w[1].view(np.uint16))
    print(f"loss {loss0:.4f} -> {loss:.6f}, w {w[0]}, skipped steps {skipped}, ranks {'equal' if same else 'DIFFER'}")
    return 0 if same and loss < loss0 / 100 and skipped[0] == skipped[1] else 1


if __name__ == "__main__":
    sys.exit(main())
