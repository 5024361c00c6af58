"""Communicator failures (abort, timeouts) and resuming saved windows on fewer ranks."""
import math
import threading

import numpy as np
import pytest

import gradacc
from ranks import run_ranks


def saved_window(grad, count):
    """The window of one rank that added one micro-batch of ``count`` items."""
    with gradacc.Scaler(init_scale=1.0) as s, gradacc.Accumulator([(2, "f32")]) as acc:
        acc.add(s, [np.array(grad, np.float32)], count)
        return acc.save_window()


def test_merge_windows_of_two_ranks_into_one():
    a, b = saved_window([1.0, 2.0], 1), saved_window([3.0, 5.0], 3)
    (comm,) = gradacc.local_group(1)
    with comm, gradacc.Accumulator([(2, "f32")]) as acc:
        acc.merge_window(a)
        acc.merge_window(b)
        info = acc.sync(comm)
        assert (info.total_count, info.microbatches, info.found_inf) == (4, 2, False)
        # Mean losses over 1 and 3 items, normalised by the 4 items: (1*g_a + 3*g_b) / 4.
        assert acc.master(0).tolist() == [2.5, 4.25]


def test_merge_adds_to_the_window_in_progress_and_refuses_corrupt_bytes():
    window = saved_window([4.0, 8.0], 2)
    with gradacc.Scaler(init_scale=1.0) as s, gradacc.Accumulator([(2, "f32")]) as acc:
        acc.add(s, [np.array([2.0, 2.0], np.float32)], 2)
        for bad in (b"", b"not a window", window[:-1], window[:8] + bytes(len(window) - 8)):
            with pytest.raises(gradacc.GradaccError) as e:
                acc.merge_window(bad)
            assert e.value.status == gradacc.Status.CORRUPT_STATE
        with gradacc.Accumulator([(3, "f32")]) as other, pytest.raises(gradacc.GradaccError):
            other.merge_window(window)  # another accumulator's tensors
        acc.merge_window(window)
        info = acc.sync()
        assert (info.total_count, info.microbatches) == (4, 2)  # the failed merges added nothing
        assert acc.master(0).tolist() == [3.0, 5.0]


def test_timeout_round_trip_and_invalid_values():
    c0, c1 = gradacc.local_group(2)
    with c0, c1:
        assert c0.timeout == 600.0  # the default
        c0.timeout = 2.5
        assert c0.timeout == 2.5
        assert c1.timeout == 600.0  # per handle
        c0.timeout = None
        assert c0.timeout is None  # waits forever
        c0.timeout = 7
        c0.timeout = 0  # the C API's "forever"
        assert c0.timeout is None
        for bad in (-1.0, math.nan, math.inf):
            with pytest.raises(gradacc.GradaccError) as e:
                c0.timeout = bad
            assert e.value.status == gradacc.Status.INVALID_ARGUMENT
            assert "seconds" in e.value.message
        assert c0.timeout is None  # a refused value changes nothing
    with pytest.raises(ValueError, match="closed"):
        c0.timeout = 1.0


def one_microbatch(acc):
    with gradacc.Scaler(init_scale=1.0) as s:
        acc.add(s, [np.ones(2, np.float32)], 1)


def test_abort_then_sync_fails():
    (comm,) = gradacc.local_group(1)
    with comm, gradacc.Accumulator([(2, "f32")]) as acc:
        one_microbatch(acc)
        comm.abort()
        with pytest.raises(gradacc.GradaccError) as e:
            acc.sync(comm)
        assert e.value.status == gradacc.Status.COMM_FAILURE
        comm.abort()  # again: still aborted
        with pytest.raises(gradacc.GradaccError) as e:
            acc.sync(comm)
        assert e.value.status == gradacc.Status.COMM_FAILURE


def test_abort_wakes_a_peer_blocked_in_sync():
    c0, c1 = gradacc.local_group(2)
    c0.timeout = 60  # a broken abort fails the test instead of hanging it
    seen = {}

    def rank0():
        with gradacc.Accumulator([(2, "f32")]) as acc:
            one_microbatch(acc)
            try:
                acc.sync(c0)  # rank 1 never syncs
            except gradacc.GradaccError as e:
                seen["status"] = e.status

    t = threading.Thread(target=rank0)
    t.start()
    t.join(0.2)
    c1.abort()  # rank 1 gives up: the whole in-process group fails
    t.join()
    assert seen["status"] == gradacc.Status.COMM_FAILURE
    c0.close()
    c1.close()


def test_timeout_raises_a_timeout_error_and_aborts():
    c0, c1 = gradacc.local_group(2)
    with c0, c1, gradacc.Accumulator([(2, "f32")]) as acc:
        c0.timeout = 0.2
        one_microbatch(acc)
        with pytest.raises(gradacc.GradaccTimeoutError) as e:
            acc.sync(c0)  # rank 1 never syncs
        assert isinstance(e.value, TimeoutError) and isinstance(e.value, gradacc.GradaccError)
        assert e.value.status == gradacc.Status.TIMEOUT
        with pytest.raises(gradacc.GradaccError) as e:
            acc.sync(c0)  # the timeout aborted the communicator
        assert e.value.status == gradacc.Status.COMM_FAILURE


def test_an_overflowing_reduction_skips_on_every_rank():
    """Each rank's window is finite, their sum is not: every rank finds it and skips."""

    def rank(comm, r):
        with gradacc.Scaler(init_scale=1.0, min_scale=2.0**-20) as s, gradacc.Accumulator(
            [(4, "f32")], normalize="none", loss_reduction="sum"
        ) as a:
            a.add(s, [np.array([3e38, 1, 1, 1], np.float32)], 1)
            info = a.sync(comm)
            return (info.found_inf, math.isfinite(info.grad_norm), s.update(a), s.scale)

    assert run_ranks(2, rank) == [(True, False, True, 0.5)] * 2
