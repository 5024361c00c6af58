"""The mesh step (gradacc.Mesh) on dp 2 x tp 2 threads in Megatron-Core's order (world rank =
tp + 2 * dp): one accumulator per rank reduced over its data-parallel group, with a tensor
sharded over tp and one replicated over tp. The job's count is the data ranks' only, the norm an
f64 reference's with every distinct element once, the report the same on every rank; an inf on
one rank names that world rank and part everywhere; bad arguments fail on every rank."""
import math
import threading

import numpy as np
import pytest

import gradacc

TP, DP = 2, 2
COUNTS = [[3, 5], [2, 4]]  # per data rank, per micro-batch


def grads(d, mb, tp):
    """Tensor 0 (tp-sharded) and tensor 1 (replicated: no tp term), eighths exact in f32."""
    g0 = np.array([((d * 7 + mb * 3 + tp * 5 + j) % 9 - 4) / 8 for j in range(6)], np.float32)
    g1 = np.array([((d * 7 + mb * 3 + 11 + j) % 9 - 4) / 8 for j in range(3)], np.float32)
    return g0, g1


def reference_norm(dropped=()):
    """The f64 global norm without the (data rank, micro-batch) pairs in ``dropped``."""
    kept = [(d, mb) for d in range(DP) for mb in range(2) if (d, mb) not in dropped]
    total = sum(COUNTS[d][mb] for d, mb in kept)
    squares = 0.0
    for tp in range(TP):
        for t in (0, 1):
            if t == 1 and tp > 0:
                continue  # the replicated tensor, once
            g = sum(grads(d, mb, tp)[t].astype(np.float64) for d, mb in kept) / total
            squares += float(np.dot(g, g))
    return math.sqrt(squares)


def run_mesh(body, **config):
    """body(rank, mesh, acc, scaler, data) on every rank of a dp 2 x tp 2 world; the results."""
    world = gradacc.local_group(TP * DP)
    data = [gradacc.local_group(DP) for _ in range(TP)]
    results, errors = [None] * (TP * DP), []

    def rank_main(r):
        try:
            d, tp = divmod(r, TP)
            comm = data[tp][d]
            comm.timeout = world[r].timeout = 10
            with gradacc.Scaler(init_scale=1.0) as s, \
                    gradacc.Accumulator([(6, "f32"), (3, "f32")], loss_reduction="sum", tensor_stats=True,
                                        **config) as acc, \
                    gradacc.Mesh(world[r], d, DP) as mesh:
                results[r] = body(r, mesh, acc, s, comm)
        except BaseException as e:  # reported on the main thread
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(TP * DP)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in world + [c for g in data for c in g]:
        c.close()
    if errors:
        raise errors[0]
    return results


def add_window(acc, s, r, poison=False):
    d, tp = divmod(r, TP)
    for mb, n in enumerate(COUNTS[d]):
        g0, g1 = grads(d, mb, tp)
        if poison and mb == 1:
            g0[2] = np.inf
        acc.add(s, [g0, g1], n)


def test_the_job_counts_data_ranks_once_and_agrees_everywhere():
    def body(r, mesh, acc, s, comm):
        part = gradacc.MeshPart(acc, comm, replicated=[(1, 0x6e6f726d, TP)])
        add_window(acc, s, r)
        good = mesh.sync([part])
        add_window(acc, s, r, poison=r == 3)
        return good, mesh.sync([part])

    results = run_mesh(body)
    norm = reference_norm()
    for good, inf in results:
        assert isinstance(good, gradacc.MeshInfo)
        assert (good.total_count, good.microbatches, good.found_inf) == (14, 4, False)
        assert good.grad_norm == pytest.approx(norm, rel=1e-6)
        assert good.overflow is None and good.overflow_part is None
        assert good == results[0][0]  # every field, the norm's bits included
        assert inf.found_inf and inf.overflow.rank == 3 and inf.overflow.tensor == 0
        assert inf.overflow_part == 0
        assert inf == results[0][1]


def test_a_poisoned_microbatch_drops_on_both_tensor_parallel_peers():
    def body(r, mesh, acc, s, comm):
        part = gradacc.MeshPart(acc, comm, replicated=[(1, 0x6e6f726d, TP)])
        d, tp = divmod(r, TP)
        kept = []
        for mb, n in enumerate(COUNTS[d]):
            g0, g1 = grads(d, mb, tp)
            if r == 3 and mb == 1:
                g0[2] = np.inf  # on world rank 3 only; its peer, rank 2, drops it too
            acc.begin_microbatch(n)
            acc.add_tensor(s, 0, g0)
            acc.add_tensor(s, 1, g1)
            kept.append(mesh.end_microbatch(acc))
        return kept, mesh.sync([part])

    results = run_mesh(body, overflow="drop_microbatch")
    for r, (kept, info) in enumerate(results):
        assert kept == [True, r < 2], (r, kept)
        assert (info.total_count, info.microbatches, info.dropped_microbatches) == (10, 3, 1)
        assert not info.found_inf and info.overflow.rank == 3 and info.overflow.microbatch == 1
        assert info.grad_norm == pytest.approx(reference_norm(dropped=[(1, 1)]), rel=1e-6)
        assert info == results[0][1]


def test_bad_arguments_fail_on_every_rank():
    def body(r, mesh, acc, s, comm):
        add_window(acc, s, r)
        part = gradacc.MeshPart(acc, comm, replicated=[(1, 0x6e6f726d, TP)])
        out = []
        for parts in ([], [part if r != 1 else part._replace(accumulator=None)],
                      [part._replace(replicated=[(9, 1, TP)]) if r == 2 else part]):
            with pytest.raises(gradacc.GradaccError) as e:
                mesh.sync(parts)
            out.append((e.value.status, str(e.value)))
        out.append(mesh.sync([part]).total_count)  # the window is intact
        return out

    results = run_mesh(body)
    for r, (empty, null, tensor, count) in enumerate(results):
        assert empty[0] == gradacc.Status.NULL_ARGUMENT and "`parts` is NULL" in empty[1]
        if r == 1:
            assert null[0] == gradacc.Status.NULL_ARGUMENT and "`parts[0].accumulator` is NULL" in null[1]
        else:
            assert null[0] == gradacc.Status.PEER_FAILURE, null
        if r == 2:
            assert tensor[0] == gradacc.Status.INVALID_ARGUMENT and "parts[0].replicated[0]" in tensor[1]
        else:
            assert tensor[0] == gradacc.Status.PEER_FAILURE, tensor
        assert count == 14


def test_mesh_arguments_are_checked():
    (comm,) = gradacc.local_group(1)
    with comm:
        with pytest.raises(gradacc.GradaccError, match="`data_rank` = 1 is not below `data_size` = 1"):
            gradacc.Mesh(comm, 1, 1)
        with pytest.raises(ValueError):
            gradacc.Mesh(comm, -1, 1)
        with gradacc.Mesh(comm, 0, 1, max_grad_norm=1.0) as mesh:
            mesh.close()
            assert mesh.closed
            mesh.close()  # idempotent


def test_mesh_shape_gives_megatron_groups():
    # World 16, tp 2, pp 2: tp groups [0, 1], [2, 3], ...; dp groups [1, 3, 5, 7], ...; pp [5, 13].
    with gradacc.MeshShape(16, tp=2, pp=2) as shape:
        assert shape.group(5, "tp") == gradacc.MeshGroup(color=4, key=1, size=2)
        assert shape.group(5, "dp") == (1, 2, 4)
        assert shape.group(5, "pp") == (5, 0, 2)
        assert shape.group(5, "cp-dp")[1:] == (2, 4)  # data_rank 2 of 4
        with pytest.raises(gradacc.GradaccError, match='"xp" is none of'):
            shape.group(0, "tp-xp")
        with pytest.raises(gradacc.GradaccError, match="`rank` = 16 is not below"):
            shape.group(16, "tp")
    # Data parallel fastest.
    with gradacc.MeshShape(4, tp=2, order="dp-tp-cp-pp") as shape:
        assert [shape.group(r, "tp").color for r in range(4)] == [0, 1, 0, 1]
    with pytest.raises(gradacc.GradaccError, match="a permutation of tp, cp, dp and pp"):
        gradacc.MeshShape(4, tp=2, order="tp-dp")
    with pytest.raises(gradacc.GradaccError, match="cannot hold tp 4"):
        gradacc.MeshShape(6, tp=4)


def test_in_process_communicators_are_not_split():
    (comm,) = gradacc.local_group(1)
    with comm:
        with pytest.raises(gradacc.GradaccError, match="cannot be split") as e:
            comm.split(0, 0)
        assert e.value.status == gradacc.Status.INVALID_ARGUMENT
        with gradacc.MeshShape(1) as shape, pytest.raises(gradacc.GradaccError, match="cannot be split"):
            shape.split(comm, "dp")
