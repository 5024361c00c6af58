#!/usr/bin/env python3
"""Seed apex-o2-ddp-accumulation-bug.md, side by side: two ranks (threads), Linear(1,1),
loss = mean(output), inputs 1.0 on rank 0 and 2.0 on rank 1, two micro-batches each, fp16
gradients, loss scale 1.

naive (Apex O2 + DDP with the all-reduce skipped on the first micro-step): the first micro-batch's
fp16 grads go into the local FP32 master unreduced; only the last micro-batch's are averaged
over ranks. Rank 0 steps with weight grad 2.5, rank 1 with 3.5: the replicas diverge.

gradacc: the accumulated FP32 master is all-reduced once, at the boundary (BY_WORLD: sum over
micro-batches, mean over ranks, as DDP without loss division): 3.0 on both ranks, bitwise equal.

Run: python3 examples/python/apex_o2_side_by_side.py (finds bindings/python and target/release).
"""
import os
import sys
import threading

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bindings", "python"))
import gradacc  # noqa: E402

RANKS, MICROBATCHES = 2, 2
INPUTS = [1.0, 2.0]


def grads(rank):
    """fp16 model grads of mean(w x + b) for one item: d/dw = x, d/db = 1."""
    return np.array([INPUTS[rank]], np.float16), np.array([1.0], np.float16)


def naive():
    """Apex O2 + DDP, sync off on the first micro-step: returns each rank's (weight, bias) master grad."""
    barrier = threading.Barrier(RANKS)
    shared = [None] * RANKS
    out = [None] * RANKS

    def rank_main(r):
        master = np.zeros(2, np.float32)  # FP32 master grads, accumulated locally
        for m in range(MICROBATCHES):
            model = np.concatenate(grads(r))  # fp16 model grads, reset every micro-step
            if m == MICROBATCHES - 1:  # require_backward_grad_sync: the fp16 grads are averaged
                shared[r] = model
                barrier.wait()
                model = (sum(g.astype(np.float32) for g in shared) / RANKS).astype(np.float16)
                barrier.wait()
            master += model.astype(np.float32)
        out[r] = master

    run(rank_main)
    return out


def with_gradacc():
    comms = gradacc.local_group(RANKS)
    out = [None] * RANKS

    def rank_main(r):
        with gradacc.Scaler(init_scale=1.0) as scaler, \
                gradacc.Accumulator([(1, "f16"), (1, "f16")], normalize="by_world") as acc:
            for _ in range(MICROBATCHES):
                acc.add(scaler, list(grads(r)), count=1)
            acc.sync(comms[r])
            out[r] = np.concatenate([acc.master(0), acc.master(1)])  # a copy: the views end with acc

    run(rank_main)
    for c in comms:
        c.close()
    return out


def run(fn):
    threads = [threading.Thread(target=fn, args=(r,)) for r in range(RANKS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main():
    a, b = naive(), with_gradacc()
    print(f"{'':6} {'naive Apex O2 weight/bias':>27} {'gradacc weight/bias':>22}")
    for r in range(RANKS):
        print(f"rank {r} {a[r][0]:>17.1f} / {a[r][1]:<7.1f} {b[r][0]:>12.1f} / {b[r][1]:<7.1f}")
    ok = (a[0][0], a[1][0]) == (2.5, 3.5) and all(x[0] == 3.0 and x[1] == 2.0 for x in b) \
        and b[0].tobytes() == b[1].tobytes()
    print("naive ranks diverge; gradacc ranks agree bitwise" if ok else "UNEXPECTED RESULT")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
