"""The overflow policy (``overflow=``) and the place SyncInfo reports: 4 ranks on threads, 5 fp16
tensors, 3 micro-batches per rank of 4 + m items (a mean-reduced loss), one inf in rank 3's
micro-batch 1, tensor 2; with ``tensor_stats=True``, each tensor's norm and non-finite micro-batches.
docs/overflow.md states the contract."""
import math

import numpy as np
import pytest

import gradacc
from ranks import run_ranks

RANKS, TENSORS, N, MICROBATCHES, SCALE = 4, 5, 3, 3, 1024.0
BAD = gradacc.OverflowAt(rank=3, microbatch=1, tensor=2)


def items(m):
    return 4 + m


def grad(r, m, t):
    """The true gradient of rank r's micro-batch m, tensor t: a mean over its items."""
    sign = np.array([1.0, -1.0, 1.0])[:N]
    return ((r + 1) * 0.25 + (m + 1) * 0.125 + t * 0.0625) * sign / 8.0


def scaled_f16(r, m, t):
    return (grad(r, m, t) * SCALE).astype(np.float16)


def feed(acc, scaler, r, poison):
    """Rank r's window, with inf at each (rank, micro-batch, tensor) of `poison`."""
    for m in range(MICROBATCHES):
        grads = [scaled_f16(r, m, t) for t in range(TENSORS)]
        for (pr, pm, pt) in poison:
            if (pr, pm) == (r, m):
                grads[pt][1] = np.inf
        acc.add(scaler, grads, items(m))


def run(overflow, poison):
    """Each rank's (SyncInfo, skipped, scale after the update, master) with inf at `poison`;
    `overflow` None leaves the default."""
    fields = {} if overflow is None else {"overflow": overflow}

    def rank(comm, r):
        with gradacc.Scaler(init_scale=SCALE) as scaler, \
                gradacc.Accumulator([(N, "f16")] * TENSORS, normalize="by_count", **fields) as acc:
            feed(acc, scaler, r, poison)
            info = acc.sync(comm)
            master = np.concatenate([acc.master(t).copy() for t in range(TENSORS)])
            return info, scaler.update(acc), scaler.scale, master

    return run_ranks(RANKS, rank)


def kept_mean(dropped):
    """The mean over the items of every micro-batch but `dropped`, from the fp16 gradients."""
    total, weight = np.zeros(TENSORS * N), 0
    for r in range(RANKS):
        for m in range(MICROBATCHES):
            if (r, m) in dropped:
                continue
            g = np.concatenate([scaled_f16(r, m, t).astype(np.float64) / SCALE for t in range(TENSORS)])
            total += g * items(m)
            weight += items(m)
    return total / weight


@pytest.mark.parametrize("overflow", ["drop_microbatch", "DROP_MICROBATCH", gradacc.Overflow.DROP_MICROBATCH, 1])
def test_drop_microbatch_keeps_the_rest_and_names_the_place(overflow):
    results = run(overflow, [BAD])
    for info, skipped, scale, master in results:
        assert info.overflow == BAD and isinstance(info.overflow, gradacc.OverflowAt)
        assert (info.overflow.rank, info.overflow.microbatch, info.overflow.tensor) == (3, 1, 2)
        assert not info.found_inf and not skipped
        assert info.dropped_microbatches == 1
        assert (info.microbatches, info.total_count) == (11, 55)
        assert math.isfinite(info.grad_norm)
        assert scale == SCALE / 2  # a drop backs the scale off
        np.testing.assert_array_equal(master, results[0][3])  # the same bits on every rank
    np.testing.assert_allclose(results[0][3], kept_mean({(BAD.rank, BAD.microbatch)}), rtol=1e-6)


@pytest.mark.parametrize("overflow", [None, "skip_step", gradacc.Overflow.SKIP_STEP])
def test_skip_step_names_the_same_place(overflow):
    results = run(overflow, [BAD])
    for info, skipped, scale, _ in results:
        assert info.overflow == BAD
        assert info.found_inf and skipped
        assert info.dropped_microbatches == 0
        assert (info.microbatches, info.total_count) == (12, 60)
        assert scale == SCALE / 2


def test_the_place_is_the_first_by_microbatch_then_tensor_then_rank():
    poison = [(0, 2, 0), (1, 1, 4), (2, 1, 3)]
    for overflow in ("skip_step", "drop_microbatch"):
        for info, *_ in run(overflow, poison):
            assert info.overflow == gradacc.OverflowAt(2, 1, 3), (overflow, info)
    results = run("drop_microbatch", poison)
    assert results[0][0].dropped_microbatches == 3
    np.testing.assert_allclose(results[0][3], kept_mean({(0, 2), (1, 1), (2, 1)}), rtol=1e-6)


def test_a_clean_window_and_an_overflowing_sum():
    for info, skipped, scale, master in run("drop_microbatch", []):
        assert (info.overflow, info.dropped_microbatches, info.found_inf, skipped) == (None, 0, False, False)
        assert scale == SCALE

    def rank(comm, r):  # each rank finite, their sum not
        with gradacc.Scaler(init_scale=1.0) as s, \
                gradacc.Accumulator([(2, "f32")], normalize="none", loss_reduction="sum",
                                    overflow="drop_microbatch") as a:
            a.add(s, [np.array([3e38, 1], np.float32)], 1)
            return a.sync(comm)

    for info in run_ranks(2, rank):
        assert (info.overflow, info.found_inf, info.dropped_microbatches) == ("reduction", True, 0)


def test_default_and_invalid_policies():
    with gradacc.Scaler() as scaler, gradacc.Accumulator([(1, "f32")]) as acc:
        acc.add(scaler, [np.ones(1, np.float32)], 1)
        info = acc.sync()
        assert (info.overflow, info.dropped_microbatches) == (None, 0)
    with pytest.raises(gradacc.GradaccError) as e:
        gradacc.Accumulator([(1, "f32")], overflow=7)
    assert e.value.status == gradacc.Status.INVALID_ARGUMENT
    assert "`config`.overflow = 7" in e.value.message
    with pytest.raises(ValueError) as e:
        gradacc.Accumulator([(1, "f32")], overflow="drop_everything")
    assert "overflow" in str(e.value) and "'drop_microbatch'" in str(e.value)
    # The report's AT_* codes share the prefix; they are not policies.
    assert {m.name for m in gradacc.Overflow} == {"SKIP_STEP", "DROP_MICROBATCH"}
    # Sharded accumulation drops too: the poisoned micro-batch leaves the shard as it was.
    c0, = gradacc.local_group(1)
    with c0, gradacc.Accumulator([(4, "f32")], sharding="accumulate", overflow="drop_microbatch",
                                 comm=c0) as acc, gradacc.Scaler(init_scale=1.0) as scaler:
        acc.add(scaler, [np.array([1, np.inf, 3, 4], np.float32)], count=1)
        acc.add(scaler, [np.array([2, 4, 6, 8], np.float32)], count=2)
        info = acc.sync()
        assert not info.found_inf and info.dropped_microbatches == 1 and info.microbatches == 1
        assert list(acc.master(0)) == [2, 4, 6, 8]


def run_stats(overflow):
    """Each rank's (masters, tensor stats) with tensor_stats on and inf at BAD."""
    def rank(comm, r):
        with gradacc.Scaler(init_scale=SCALE) as scaler, \
                gradacc.Accumulator([(N, "f16")] * TENSORS, normalize="by_count", overflow=overflow,
                                    tensor_stats=True) as acc:
            feed(acc, scaler, r, [BAD])
            acc.sync(comm)
            return [acc.master(t).astype(np.float64) for t in range(TENSORS)], acc.tensor_stats()

    return run_ranks(RANKS, rank)


@pytest.mark.parametrize("overflow", ["drop_microbatch", "skip_step"])
def test_tensor_stats_count_the_poisoned_tensor_on_every_rank(overflow):
    results = run_stats(overflow)
    first = results[0][1]
    for masters, stats in results:
        assert len(stats) == TENSORS and all(isinstance(s, gradacc.TensorStats) for s in stats)
        assert [s.nonfinite_microbatches for s in stats] == [int(t == BAD.tensor) for t in range(TENSORS)]
        # The same bits on every rank (an infinite norm included).
        assert np.array([s.grad_norm for s in stats]).tobytes() == np.array([s.grad_norm for s in first]).tobytes()
        assert [s.nonfinite_microbatches for s in stats] == [s.nonfinite_microbatches for s in first]
    masters = results[0][0]
    if overflow == "skip_step":  # the skipped window's sum holds the inf
        assert math.isinf(first[BAD.tensor].grad_norm)
        return
    for t, s in enumerate(first):  # no clipping: each norm is its master's
        want = math.sqrt(float(np.sum(masters[t] ** 2)))
        assert abs(s.grad_norm - want) <= 1e-12 * want, (t, s.grad_norm, want)


def test_tensor_stats_refusals():
    with gradacc.Scaler(init_scale=1.0) as scaler:
        for on in (False, True):
            with gradacc.Accumulator([(2, "f32")], tensor_stats=on) as acc:
                with pytest.raises(gradacc.GradaccError) as e:
                    acc.tensor_stats()  # before the sync
                assert e.value.status == gradacc.Status.WRONG_STATE
                acc.add(scaler, [np.array([3, 4], np.float32)], 1)
                acc.sync()
                if on:
                    assert acc.tensor_stats() == [gradacc.TensorStats(5.0, 0)]
                    acc.add(scaler, [np.array([3, 4], np.float32)], 1)  # the next window began
                with pytest.raises(gradacc.GradaccError) as e:
                    acc.tensor_stats()
                assert e.value.status == gradacc.Status.WRONG_STATE
                assert "tensor_stats" in e.value.message
    with pytest.raises(gradacc.GradaccError) as e:
        gradacc.Accumulator([(1, "f32")], tensor_stats=2)
    assert e.value.status == gradacc.Status.INVALID_ARGUMENT
    assert "`config`.tensor_stats = 2" in e.value.message
    # Sharded accumulation measures its shard's tensors too.
    c0, = gradacc.local_group(1)
    with c0, gradacc.Accumulator([(2, "f32")], sharding="accumulate", tensor_stats=True,
                                 comm=c0) as acc, gradacc.Scaler(init_scale=1.0) as scaler:
        acc.add(scaler, [np.array([3, 4], np.float32)], 1)
        acc.sync()
        assert acc.tensor_stats() == [gradacc.TensorStats(5.0, 0)]
