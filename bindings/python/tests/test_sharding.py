"""Reduce-scatter sharding: each rank's shard after a sharded sync against an unsharded sync of the
same window, the shards' layout, and the errors of a sharded accumulator used wrongly. The hybrid
boundary (sync_hybrid) on a 2x2 grid against a 4-rank unsharded sync, and its misuse. Sharded
accumulation (comm= at creation): shards against an unsharded DDP sync, add and add_tensor alike,
one shard of one, its communicator kept alive, and misuse failing on every rank."""
import gc
import threading
import time
import weakref

import numpy as np
import pytest

import gradacc

# 18003 elements at 0, 7040, 12096 and 18112 (each tensor at a multiple of MASTER_ALIGN bytes): a
# flat master of 18176, 2 shards of 12288 and 5888, 3 of 8192, 8192 and 1792 (blocks of 4096).
TENSORS = [(7000, "f16"), (5000, "f32"), (6000, "bf16"), (3, "f32")]
OFFSETS = [0, 7040, 12096, 18112]
TOTAL = 18176


def flat_master(acc):
    """The flat master of ``acc``: each tensor's master at its offset, zeros in the padding."""
    flat = np.zeros(TOTAL, np.float32)
    for i, (n, _) in enumerate(TENSORS):
        flat[acc.offset(i):acc.offset(i) + n] = acc.master(i)
    return flat


def test_each_tensor_starts_at_an_aligned_offset():
    assert gradacc.MASTER_ALIGN == 256
    assert gradacc.Accumulator.master_numel(TENSORS) == TOTAL
    with gradacc.Accumulator(TENSORS) as acc:
        assert [acc.offset(i) for i in range(len(TENSORS))] == OFFSETS
        with pytest.raises(gradacc.GradaccError) as e:
            acc.offset(len(TENSORS))
        assert e.value.status == gradacc.Status.INVALID_ARGUMENT and "index" in str(e.value)


def run_ranks(world, body):
    """body(rank) on one thread per rank; the results in rank order (an exception re-raised)."""
    results = [None] * world

    def target(r):
        try:
            results[r] = ("ok", body(r))
        except BaseException as e:  # re-raised on the main thread
            results[r] = ("raised", e)

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank hangs"
    return results


def random_grads(rng):
    """One micro-batch of loss-scaled gradients in each tensor's dtype (bf16 as uint16 words)."""
    out = []
    for numel, dtype in TENSORS:
        g = (rng.standard_normal(numel) * 64.0).astype(np.float32)
        if dtype == "f16":
            out.append(g.astype(np.float16))
        elif dtype == "bf16":
            out.append((g.view(np.uint32) >> 16).astype(np.uint16))
        else:
            out.append(g)
    return out


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.25], ids=["unclipped", "clipped"])
@pytest.mark.parametrize("world", [2, 3])
def test_each_shard_is_the_unsharded_masters_range_bit_for_bit(world, max_grad_norm):
    sharded_group, plain_group = gradacc.local_group(world), gradacc.local_group(world)

    def rank(r):
        rng = np.random.default_rng(100 * world + r)
        with gradacc.Scaler(init_scale=1024.0) as scaler, \
                gradacc.Accumulator(TENSORS, sharding="reduce_scatter", shard_count=world, shard_rank=r,
                                    max_grad_norm=max_grad_norm) as sharded, \
                gradacc.Accumulator(TENSORS, max_grad_norm=max_grad_norm) as plain:
            for m in range(3):
                grads = random_grads(rng)
                count = 1 + (3 * r + m) % 5
                sharded.add(scaler, grads, count)
                plain.add(scaler, grads, count)
            info_sharded = sharded.sync(sharded_group[r])
            info_plain = plain.sync(plain_group[r])
            offset, numel, data = sharded.shard()
            _, _, address = sharded.shard_ptr()
            flat = flat_master(plain)
            return dict(info=(info_sharded, info_plain), offset=offset, numel=numel, shard=data.copy(),
                        plain=flat, address=(address, sharded.master_ptr(0)[0] + 4 * offset))

    results = run_ranks(world, rank)
    for c in sharded_group + plain_group:
        c.close()
    for status, value in results:
        if status == "raised":
            raise value
    ranks = [value for _, value in results]

    # The shards tile the layout in rank order.
    assert ranks[0]["offset"] == 0
    for a, b in zip(ranks, ranks[1:]):
        assert a["offset"] + a["numel"] == b["offset"]
    assert ranks[-1]["offset"] + ranks[-1]["numel"] == TOTAL
    assert all(0 < x["numel"] < TOTAL for x in ranks)

    for r, x in enumerate(ranks):
        info_sharded, info_plain = x["info"]
        assert info_sharded == info_plain, f"rank {r}"
        assert info_sharded == ranks[0]["info"][0], f"rank {r} disagrees with rank 0"
        assert info_sharded.total_count == sum(1 + (3 * q + m) % 5 for q in range(world) for m in range(3))
        assert info_sharded.microbatches == 3 * world and not info_sharded.found_inf
        assert (info_sharded.clip_coef < 1.0) == (max_grad_norm > 0), info_sharded
        # The shard's address is the flat master's at its offset.
        assert x["address"][0] == x["address"][1], f"rank {r}"
        # Bit for bit what the unsharded sync left in the same range.
        want = x["plain"][x["offset"]:x["offset"] + x["numel"]]
        assert x["shard"].shape == want.shape
        assert np.array_equal(x["shard"].view(np.uint32), want.view(np.uint32)), f"rank {r}"
        assert np.any(want != 0)
        # Every rank's unsharded master is the same: the shards together are the whole gradient.
        assert np.array_equal(x["plain"].view(np.uint32), ranks[0]["plain"].view(np.uint32))


def test_an_unsharded_accumulators_shard_is_the_whole_master():
    rng = np.random.default_rng(7)
    with gradacc.Scaler(init_scale=1024.0) as scaler, gradacc.Accumulator(TENSORS) as acc:
        acc.add(scaler, random_grads(rng), 4)
        acc.sync()
        offset, numel, data = acc.shard()
        assert (offset, numel) == (0, TOTAL)
        assert acc.shard_ptr() == (0, TOTAL, acc.master_ptr(0)[0])
        flat = flat_master(acc)
        assert np.array_equal(data.view(np.uint32), flat.view(np.uint32))  # +0 in the padding
        assert np.shares_memory(data, acc.master(0))  # a view, not a copy
        data[0] = 123.0
        assert acc.master(0)[0] == 123.0
    assert gradacc.Sharding.NONE == 0 and gradacc.Sharding.REDUCE_SCATTER == 1


def test_config_keywords_take_names_and_values():
    with gradacc.Accumulator(TENSORS, sharding=gradacc.Sharding.REDUCE_SCATTER, shard_count=3, shard_rank=2,
                             wire_dtype=np.float32) as a, \
            gradacc.Accumulator(TENSORS, sharding="REDUCE_SCATTER", shard_count=2, shard_rank=1,
                                wire_dtype="f32") as b:
        assert a.shard()[:2] == (16384, TOTAL - 16384)
        assert b.shard()[:2] == (12288, TOTAL - 12288)


def expect_invalid(word, **config):
    with pytest.raises(gradacc.GradaccError) as e:
        gradacc.Accumulator(TENSORS, **config)
    assert e.value.status == gradacc.Status.INVALID_ARGUMENT
    assert word in e.value.message, e.value.message


@pytest.mark.parametrize("count,rank", [(2, 2), (3, 7), (0, 0)])
def test_shard_rank_not_below_shard_count_is_refused(count, rank):
    expect_invalid("shard_rank", sharding="reduce_scatter", shard_count=count, shard_rank=rank)


def test_bad_sharding_settings_are_refused():
    expect_invalid("sharding", shard_count=2, shard_rank=1)  # no policy
    expect_invalid("sharding", sharding=7)
    expect_invalid("wire_dtype", wire_dtype="f16")
    expect_invalid("wire_dtype", wire_dtype=9)


def sharded_sync_errors(world, shard_count, shard_rank_of):
    """Each rank of a local group of ``world`` syncs an accumulator holding shard
    ``shard_rank_of(r)`` of ``shard_count``: the GradaccError each rank raised (None if none)."""
    group = gradacc.local_group(world)
    for c in group:
        c.timeout = 30  # a rank left waiting fails instead of hanging the test

    def rank(r):
        with gradacc.Scaler(init_scale=1.0) as scaler, \
                gradacc.Accumulator([(5, "f32")], sharding="reduce_scatter", shard_count=shard_count,
                                    shard_rank=shard_rank_of(r)) as acc:
            acc.add(scaler, [np.ones(5, np.float32)], 1)
            try:
                acc.sync(group[r])
            except gradacc.GradaccError as e:
                return e
            return None

    results = run_ranks(world, rank)
    for c in group:
        c.close()
    for status, value in results:
        if status == "raised":
            raise value
    return [value for _, value in results]


def test_a_communicator_of_the_wrong_size_fails_every_rank():
    errors = sharded_sync_errors(2, 3, lambda r: r)
    for r, e in enumerate(errors):
        assert e is not None, f"rank {r} synced 3 shards on 2 ranks"
        assert e.status == gradacc.Status.INVALID_ARGUMENT, e
        assert "shard" in e.message and "of 3" in e.message and "of 2" in e.message, e.message


def test_one_rank_holding_the_wrong_shard_fails_every_rank():
    errors = sharded_sync_errors(2, 2, lambda r: 0)  # rank 1 claims shard 0 too
    assert all(e is not None for e in errors), errors
    assert errors[1].status == gradacc.Status.INVALID_ARGUMENT and "shard 0 of 2" in errors[1].message
    assert errors[0].status == gradacc.Status.PEER_FAILURE, errors[0]


def test_a_sharded_sync_without_its_communicator_fails():
    with gradacc.Scaler(init_scale=1.0) as scaler, \
            gradacc.Accumulator([(5, "f32")], sharding="reduce_scatter", shard_count=2, shard_rank=0) as acc:
        acc.add(scaler, [np.ones(5, np.float32)], 1)
        with pytest.raises(gradacc.GradaccError) as e:
            acc.sync()
        assert e.value.status == gradacc.Status.INVALID_ARGUMENT
        assert "no communicator" in e.value.message


# ---- the hybrid boundary (HSDP) ---------------------------------------------------------------

S, R = 2, 2  # rank a * S + i: rank i of shard group a, rank a of replica group i


def hybrid_grid(crosswise=False):
    """The communicators of a 2x2 grid: (shard communicator, replica communicator) per rank, and
    every communicator. ``crosswise`` joins shard group 1 to the replica groups the other way
    round, so each replica group holds shards 0 and 1."""
    shard_groups = [gradacc.local_group(S) for _ in range(R)]
    replica_groups = [gradacc.local_group(R) for _ in range(S)]
    every = [c for g in shard_groups + replica_groups for c in g]
    for c in every:
        c.timeout = 30  # a rank left waiting fails instead of hanging the test
    per_rank = []
    for g in range(S * R):
        a, i = divmod(g, S)
        j = S - 1 - i if crosswise and a == 1 else i
        per_rank.append((shard_groups[a][i], replica_groups[j][a]))
    return per_rank, every


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.25], ids=["unclipped", "clipped"])
def test_a_hybrid_grid_matches_ddp_over_every_rank(max_grad_norm):
    grid, comms = hybrid_grid()
    ddp_group = gradacc.local_group(S * R)

    def rank(g):
        rng = np.random.default_rng(500 + g)
        with gradacc.Scaler(init_scale=1024.0) as scaler, \
                gradacc.Accumulator(TENSORS, sharding="reduce_scatter", shard_count=S, shard_rank=g % S,
                                    max_grad_norm=max_grad_norm) as hybrid, \
                gradacc.Accumulator(TENSORS, max_grad_norm=max_grad_norm) as ddp:
            for m in range(3):
                grads = random_grads(rng)
                count = 1 + (3 * g + m) % 5
                hybrid.add(scaler, grads, count)
                ddp.add(scaler, grads, count)
            info = hybrid.sync_hybrid(*grid[g])
            ddp_info = ddp.sync(ddp_group[g])
            offset, numel, data = hybrid.shard()
            flat = flat_master(ddp)
            return dict(info=info, ddp_info=ddp_info, offset=offset, shard=data.copy(), ddp=flat)

    results = run_ranks(S * R, rank)
    for c in comms + ddp_group:
        c.close()
    for status, value in results:
        if status == "raised":
            raise value
    ranks = [value for _, value in results]

    total = sum(1 + (3 * g + m) % 5 for g in range(S * R) for m in range(3))
    ddp = ranks[0]["ddp"]
    for g, x in enumerate(ranks):
        info, ddp_info = x["info"], x["ddp_info"]
        assert info == ranks[0]["info"], f"rank {g} disagrees with rank 0"
        assert info.total_count == ddp_info.total_count == total and info.microbatches == 3 * S * R
        assert not info.found_inf
        assert info.grad_norm == pytest.approx(ddp_info.grad_norm, rel=1e-5)
        assert info.clip_coef == pytest.approx(ddp_info.clip_coef, rel=1e-5)
        assert (info.clip_coef < 1.0) == (max_grad_norm > 0), info
        twin = ranks[g % S]  # shard group 0's rank holding the same shard
        assert x["offset"] == twin["offset"]
        assert np.array_equal(x["shard"].view(np.uint32), twin["shard"].view(np.uint32)), f"rank {g} vs its replica"
    # Shard group 0's shards tile the gradient and match DDP's within the rounding of another
    # summation order.
    flat = np.concatenate([ranks[i]["shard"] for i in range(S)])
    assert [ranks[i]["offset"] for i in range(S)] == [0, len(ranks[0]["shard"])] and flat.size == TOTAL
    np.testing.assert_allclose(flat, ddp, rtol=0, atol=1e-5 * np.abs(ddp).max())


def hybrid_errors(crosswise, config):
    """Each rank g of a 2x2 grid syncs a one-micro-batch accumulator with ``config(g)`` through
    sync_hybrid: the GradaccError each rank raised (None if none), and the info of a sync_hybrid
    on the right groups afterwards (None if that raised too)."""
    wrong, wrong_comms = hybrid_grid(crosswise)
    right, right_comms = hybrid_grid()

    def rank(g):
        with gradacc.Scaler(init_scale=1.0) as scaler, \
                gradacc.Accumulator([(5, "f32")], **config(g)) as acc:
            acc.add(scaler, [np.ones(5, np.float32)], 1)
            try:
                acc.sync_hybrid(*wrong[g])
                error = None
            except gradacc.GradaccError as e:
                error = e
            try:
                return error, acc.sync_hybrid(*right[g])
            except gradacc.GradaccError:
                return error, None

    results = run_ranks(S * R, rank)
    for c in wrong_comms + right_comms:
        c.close()
    for status, value in results:
        if status == "raised":
            raise value
    return [value for _, value in results]


def test_crosswise_replica_groups_fail_every_rank_and_keep_the_window():
    results = hybrid_errors(True, lambda g: dict(sharding="reduce_scatter", shard_count=S, shard_rank=g % S))
    for g, (error, after) in enumerate(results):
        assert error is not None and error.status == gradacc.Status.SIZE_MISMATCH, f"rank {g}: {error}"
        assert "replica groups" in error.message
        assert after is not None and after.microbatches == S * R, f"rank {g}: the window was not intact: {after}"


def test_an_unsharded_accumulator_has_no_hybrid_boundary():
    results = hybrid_errors(False, lambda g: {})
    for g, (error, _) in enumerate(results):
        assert error is not None and error.status == gradacc.Status.INVALID_ARGUMENT, f"rank {g}: {error}"
        assert "sharded accumulator" in error.message


# ---- sharded accumulation (ZeRO-2) ------------------------------------------------------------

def accumulate(r, world, comm, **config):
    """Rank ``r``'s sharded accumulation over ``comm``, with buckets small enough that every
    micro-batch is reduced in several pieces."""
    return gradacc.Accumulator(TENSORS, sharding="accumulate", shard_count=world, shard_rank=r, comm=comm,
                               bucket_numel=4096, **config)


def results_of(results):
    for status, value in results:
        if status == "raised":
            raise value
    return [value for _, value in results]


def inside(offset, numel):
    """Whether each tensor lies wholly in the flat range offset..offset+numel."""
    return [offset <= at and at + n <= offset + numel for (n, _), at in zip(TENSORS, OFFSETS)]


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.25], ids=["unclipped", "clipped"])
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_accumulation_matches_ddp(world, max_grad_norm):
    add_group, tensor_group, ddp_group = (gradacc.local_group(world) for _ in range(3))
    for c in add_group + tensor_group:
        c.timeout = 60  # a rank out of step fails instead of hanging the test

    def rank(r):
        rng = np.random.default_rng(900 + 10 * world + r)
        with gradacc.Scaler(init_scale=1024.0) as scaler, \
                accumulate(r, world, add_group[r], max_grad_norm=max_grad_norm) as by_add, \
                accumulate(r, world, tensor_group[r], max_grad_norm=max_grad_norm) as by_tensor, \
                gradacc.Accumulator(TENSORS, max_grad_norm=max_grad_norm) as ddp:
            for m in range(3):
                grads = random_grads(rng)
                count = 1 + (3 * r + m) % 5
                by_add.add(scaler, grads, count)
                with by_tensor.microbatch(count):
                    for i in reversed(range(len(TENSORS))):  # as a backward pass produces them
                        by_tensor.add_tensor(scaler, i, grads[i])
                ddp.add(scaler, grads, count)
            infos = (by_add.sync(), by_tensor.sync(tensor_group[r]), ddp.sync(ddp_group[r]))
            offset, numel, data = by_add.shard()
            readable = []
            for i, start in enumerate(OFFSETS):
                try:
                    view = by_add.master(i)
                except gradacc.GradaccError as e:
                    assert e.status == gradacc.Status.INVALID_ARGUMENT, e
                    readable.append(False)
                    continue
                at = start - offset  # a view of the shard's elements of the tensor
                readable.append(np.shares_memory(view, data) and np.array_equal(view, data[at:at + view.size]))
            return dict(infos=infos, offset=offset, numel=numel, shard=data.copy(),
                        tensor_shard=by_tensor.shard().data.copy(), readable=readable,
                        ddp=flat_master(ddp))

    ranks = results_of(run_ranks(world, rank))
    for c in add_group + tensor_group + ddp_group:
        c.close()

    total = sum(1 + (3 * q + m) % 5 for q in range(world) for m in range(3))
    ddp = ranks[0]["ddp"]
    assert ranks[0]["offset"] == 0 and ranks[-1]["offset"] + ranks[-1]["numel"] == TOTAL
    for a, b in zip(ranks, ranks[1:]):
        assert a["offset"] + a["numel"] == b["offset"]  # the shards tile the layout in rank order
    for r, x in enumerate(ranks):
        info, tensor_info, ddp_info = x["infos"]
        assert info == tensor_info and np.array_equal(x["shard"].view(np.uint32), x["tensor_shard"].view(np.uint32)), \
            f"rank {r}: add_tensor differs from add"
        assert info == ranks[0]["infos"][0], f"rank {r} disagrees with rank 0"
        assert info.total_count == ddp_info.total_count == total and info.microbatches == 3 * world
        assert not info.found_inf
        assert info.grad_norm == pytest.approx(ddp_info.grad_norm, rel=1e-5)
        assert info.clip_coef == pytest.approx(ddp_info.clip_coef, rel=1e-5)
        assert (info.clip_coef < 1.0) == (max_grad_norm > 0), info
        want = ddp[x["offset"]:x["offset"] + x["numel"]]
        np.testing.assert_allclose(x["shard"], want, rtol=1e-5, atol=1e-6 * np.abs(ddp).max(), err_msg=f"rank {r}")
        # master(i) gives exactly the tensors wholly inside the shard, as views of it.
        assert x["readable"] == inside(x["offset"], x["numel"]), f"rank {r}"


def test_one_shard_of_one_is_the_unsharded_accumulator():
    rng = np.random.default_rng(11)
    with gradacc.Scaler(init_scale=1024.0) as scaler, \
            gradacc.Accumulator(TENSORS, sharding=gradacc.Sharding.ACCUMULATE, bucket_numel=4096) as one, \
            gradacc.Accumulator(TENSORS, bucket_numel=4096) as plain:
        for m in range(3):
            grads = random_grads(rng)
            one.add(scaler, grads, 1 + m)
            plain.add(scaler, grads, 1 + m)
        assert one.sync() == plain.sync()
        offset, numel, data = one.shard()
        assert (offset, numel) == (0, TOTAL)
        assert np.array_equal(data.view(np.uint32), plain.shard().data.view(np.uint32))
    assert gradacc.Sharding.ACCUMULATE == 2


def test_sharded_creation_is_checked():
    c0, c1 = gradacc.local_group(2)
    with c0, c1:
        for config, word in ((dict(sharding="ACCUMULATE", shard_count=2, shard_rank=1), "shard 1 of 2"),
                             (dict(sharding="accumulate", shard_count=3, shard_rank=0), "shard 0 of 3"),
                             (dict(sharding="reduce_scatter", shard_count=2, shard_rank=0),
                              "GRADACC_SHARDING_ACCUMULATE")):
            with pytest.raises(gradacc.GradaccError) as e:
                gradacc.Accumulator(TENSORS, comm=c0, **config)  # c0 is rank 0 of 2
            assert e.value.status == gradacc.Status.INVALID_ARGUMENT and word in e.value.message, e.value
        # Over several ranks, micro-batches need the communicator from the start.
        with pytest.raises(gradacc.GradaccError) as e:
            gradacc.Accumulator(TENSORS, sharding="accumulate", shard_count=2, shard_rank=0)
        assert e.value.status == gradacc.Status.INVALID_ARGUMENT and "communicator" in e.value.message
        with pytest.raises(ValueError, match="master="):
            gradacc.Accumulator(TENSORS, sharding="accumulate", shard_count=2, shard_rank=0, comm=c0,
                                master=np.zeros(TOTAL, np.float32))
        c1.close()
        with pytest.raises(ValueError, match="closed"):
            gradacc.Accumulator(TENSORS, sharding="accumulate", shard_count=2, shard_rank=1, comm=c1)


def test_the_accumulator_keeps_its_communicator_alive():
    comms = gradacc.local_group(2)
    accs = [gradacc.Accumulator([(5, "f32")], sharding="accumulate", shard_count=2, shard_rank=r, comm=c)
            for r, c in enumerate(comms)]
    refs = [weakref.ref(c) for c in comms]
    del comms
    gc.collect()
    assert all(ref() is not None and not ref().closed for ref in refs)

    def rank(r):
        with gradacc.Scaler(init_scale=1.0) as scaler:
            accs[r].add(scaler, [np.full(5, r + 1.0, np.float32)], 1)
            return accs[r].sync(), accs[r].shard()

    (info, (offset, numel, data)), _ = results_of(run_ranks(2, rank))
    # Rank 0's shard is the whole master: the tensor padded to 64 elements.
    assert (info.total_count, info.microbatches, offset, numel) == (2, 2, 0, 64)
    assert data.tolist() == [1.5] * 5 + [0.0] * 59  # (1 + 2) / 2 items, zeros in the padding
    for a in accs:
        a.close()
    gc.collect()
    assert all(ref() is None for ref in refs)  # closing the accumulators released them


def test_a_bad_call_on_one_rank_fails_every_rank_and_keeps_the_window():
    group, (stranger,) = gradacc.local_group(2), gradacc.local_group(1)
    for c in group:
        c.timeout = 30  # a rank left waiting fails instead of hanging the test

    def caught(f, *args):
        try:
            f(*args)
        except gradacc.GradaccError as e:
            return e
        return None

    def rank(r):
        rng = np.random.default_rng(40 + r)
        with gradacc.Scaler(init_scale=1.0) as scaler, accumulate(r, 2, group[r]) as acc:
            grads = random_grads(rng)
            acc.add(scaler, grads, 2)
            before = acc.shard().data.copy()
            bad_add = caught(acc.add, scaler, grads, 0 if r == 1 else 2)  # rank 1: no items for a mean loss
            bad_sync = caught(acc.sync, stranger if r == 0 else None)  # rank 0: another communicator
            unchanged = np.array_equal(acc.shard().data.view(np.uint32), before.view(np.uint32))
            return bad_add, bad_sync, unchanged, acc.sync(group[r])

    results = results_of(run_ranks(2, rank))
    for c in group + [stranger]:
        c.close()
    (add0, sync0, _, _), (add1, sync1, _, _) = results
    assert add1 is not None and add1.status == gradacc.Status.INVALID_ARGUMENT and "count" in add1.message, add1
    assert add0 is not None and add0.status == gradacc.Status.PEER_FAILURE, add0
    assert sync0 is not None and sync0.status == gradacc.Status.INVALID_ARGUMENT, sync0
    assert sync1 is not None and sync1.status == gradacc.Status.PEER_FAILURE, sync1
    for r, (_, _, unchanged, after) in enumerate(results):
        assert unchanged, f"rank {r}: a failed call changed the shard"
        assert (after.microbatches, after.total_count) == (2, 4), f"rank {r}: {after}"


def test_arguments_the_binding_refuses_fail_the_other_rank_at_once():
    """A call add or sync refuses before the C call (a gradient count or length that does not
    fit, grads bound to another accumulator, a closed scaler or communicator) raises there and
    PEER_FAILURE on the other rank at once, not at the communicator's timeout; both ranks then add
    and sync as before."""
    group, (closed_comm,) = gradacc.local_group(2), gradacc.local_group(1)
    closed_comm.close()
    for c in group:
        c.timeout = 5  # without the refusal rank 0 would wait this long
    other = gradacc.Accumulator(TENSORS)
    closed_scaler = gradacc.Scaler()
    closed_scaler.close()

    def short(grads):
        return grads[:1] + [grads[1][:-1]] + grads[2:]

    steps = [  # (what, rank 1's call, the exception it raises)
        ("3 of 4 gradients", lambda acc, s, g: acc.add(s, g[:3], 2), gradacc.GradaccSizeError),
        ("a short gradient", lambda acc, s, g: acc.add(s, short(g), 2), gradacc.GradaccSizeError),
        ("another accumulator's bound grads", lambda acc, s, g: acc.add(s, other.bind(g), 2), ValueError),
        ("a closed scaler", lambda acc, s, g: acc.add(closed_scaler, g, 2), ValueError),
        ("sync on a closed communicator", lambda acc, s, g: acc.sync(closed_comm), ValueError),
    ]

    def rank(r):
        rng = np.random.default_rng(60 + r)
        out = []
        with gradacc.Scaler(init_scale=1.0) as scaler, accumulate(r, 2, group[r]) as acc:
            grads = random_grads(rng)
            acc.add(scaler, grads, 2)
            for what, bad, _ in steps:
                start = time.monotonic()
                try:
                    if r == 1:
                        bad(acc, scaler, grads)
                    elif what.startswith("sync"):
                        acc.sync()
                    else:
                        acc.add(scaler, grads, 2)
                    out.append((None, time.monotonic() - start))
                except Exception as e:  # compared below
                    out.append((e, time.monotonic() - start))
            acc.add(scaler, grads, 2)
            return out, acc.sync()

    results = results_of(run_ranks(2, rank))
    for c in group:
        c.close()
    other.close()
    (caught0, after0), (caught1, after1) = results
    for (what, _, raised), (e0, took0), (e1, _) in zip(steps, caught0, caught1):
        assert type(e1) is raised, f"{what}: rank 1 raised {e1!r}"
        assert isinstance(e0, gradacc.GradaccError) and e0.status == gradacc.Status.PEER_FAILURE, f"{what}: {e0!r}"
        assert took0 < 2, f"{what}: rank 0 failed after {took0:.2f} s"
    for r, after in enumerate((after0, after1)):
        assert (after.microbatches, after.total_count) == (4, 8), f"rank {r}: {after}"


def test_an_add_tensor_the_binding_refuses_fails_the_micro_batch_on_every_rank():
    """An add_tensor the binding refuses before the C call (a gradient of another dtype, a closed
    scaler) raises there, and the micro-batch then fails on every rank at end_microbatch (the
    windows are discarded) instead of summing the refused tensor as zeros on the other rank."""
    group = gradacc.local_group(2)
    closed_scaler = gradacc.Scaler()
    closed_scaler.close()
    steps = [  # (what, rank 1's call for tensor 1)
        ("a float16 gradient for an f32 tensor", lambda acc, s, g: acc.add_tensor(s, 1, g[1].astype(np.float16))),
        ("a closed scaler", lambda acc, s, g: acc.add_tensor(closed_scaler, 1, g[1])),
    ]

    def rank(r):
        out = []
        with gradacc.Scaler(init_scale=1.0) as scaler, accumulate(r, 2, group[r]) as acc:
            grads = random_grads(np.random.default_rng(70 + r))
            for _, bad in steps:
                acc.begin_microbatch(2)
                refused = None
                for i in range(len(TENSORS)):
                    try:
                        if (r, i) == (1, 1):
                            bad(acc, scaler, grads)
                        else:
                            acc.add_tensor(scaler, i, grads[i])
                    except Exception as e:  # compared below
                        refused = e
                try:
                    acc.end_microbatch()
                    out.append((refused, None))
                except gradacc.GradaccError as e:
                    out.append((refused, e))
            acc.add(scaler, grads, 2)
            return out, acc.sync()

    results = results_of(run_ranks(2, rank))
    for c in group:
        c.close()
    (out0, after0), (out1, after1) = results
    for (what, _), (refused0, ended0), (refused1, ended1) in zip(steps, out0, out1):
        assert refused0 is None and refused1 is not None, f"{what}: {refused0!r} {refused1!r}"
        # The binding's own error (its dtype check's, or a plain one), not the library's status.
        own = (gradacc.GradaccDtypeError, gradacc.GradaccSizeError)
        assert isinstance(refused1, own) or not isinstance(refused1, gradacc.GradaccError), f"{what}: {refused1!r}"
        assert ended1 is not None and ended1.status == gradacc.Status.WRONG_STATE, f"{what}: rank 1 {ended1!r}"
        assert ended0 is not None and ended0.status == gradacc.Status.PEER_FAILURE, f"{what}: rank 0 {ended0!r}"
    for r, after in enumerate((after0, after1)):
        # Only the last micro-batch of each rank: the failed ones' windows were discarded.
        assert (after.microbatches, after.total_count) == (2, 4), f"rank {r}: {after}"
