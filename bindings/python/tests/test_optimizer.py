"""The optimizer (gradacc.Optimizer): SGD with momentum bit for bit against numpy in float32 for
f16, bf16 and f32 weights; AdamW against a float64 reference within a stated bound; a skipped
step that changes nothing; save and load; a two-rank reduce-scatter group whose weights are the
one-rank run's bit for bit; and bad arguments raising with the argument named."""
import numpy as np
import pytest

import gradacc
from ranks import run_ranks

U = 2.0**-24  # the unit roundoff of float32


def bf16_bits(x):
    """bfloat16 words of finite float32 values, rounded to nearest even."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_value(bits):
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def unit_scaler():
    return gradacc.Scaler(dynamic=False, init_scale=1.0)


def add_and_sync(acc, scaler, grads, comm=None):
    acc.add(scaler, grads, count=1)
    return acc.sync(comm)


# ---- SGD, exact ------------------------------------------------------------------------------

MIXED = [(300, "f16"), (200, "bf16"), (7, "f32")]


def mixed_weights():
    w0 = (np.arange(300) * 0.01 - 1.0).astype(np.float16)
    w1 = bf16_bits(np.linspace(-2.0, 2.0, 200, dtype=np.float32))
    w2 = np.arange(7, dtype=np.float32) * 0.5
    return [w0, w1, w2]


def mixed_grads(step):
    """Gradients exact in their dtypes: fp16, bf16 words, f32."""
    g0 = ((np.arange(300) % 7) * 0.25 - 0.5 + 0.125 * step).astype(np.float16)
    g1 = bf16_bits(np.cos(np.arange(200, dtype=np.float32) + step))
    g2 = np.random.default_rng(step).uniform(-1, 1, 7).astype(np.float32)
    return [g0, g1, g2]


def test_sgd_with_momentum_is_numpy_float32_bit_for_bit():
    weights = mixed_weights()
    masters = [weights[0].astype(np.float32), bf16_value(weights[1]), weights[2].copy()]
    momentum = [None] * 3
    mu = np.float32(0.9)
    with unit_scaler() as scaler, gradacc.Accumulator(MIXED) as acc, \
            gradacc.Optimizer(acc, weights, algorithm="sgd", lr=0.125, momentum=0.9) as opt:
        for step, lr in enumerate([0.125, 0.0625, 0.25]):
            opt.set_lr(lr)
            grads = mixed_grads(step)
            add_and_sync(acc, scaler, grads)
            assert opt.step() is True
            for i, g in enumerate([grads[0].astype(np.float32), bf16_value(grads[1]), grads[2]]):
                momentum[i] = g.copy() if momentum[i] is None else momentum[i] * mu + np.float32(1.0) * g
                masters[i] = masters[i] + np.float32(-lr) * momentum[i]
            assert np.array_equal(weights[0].view(np.uint16), masters[0].astype(np.float16).view(np.uint16))
            assert np.array_equal(weights[1], bf16_bits(masters[1]))
            assert np.array_equal(weights[2].view(np.uint32), masters[2].view(np.uint32))
        assert opt.steps == 3


def test_sgd_defaults_to_no_weight_decay_and_groups_apply():
    weights = [np.ones(4, np.float32), np.ones(4, np.float32)]
    with unit_scaler() as scaler, gradacc.Accumulator([(4, "f32"), (4, "f32")]) as acc, \
            gradacc.Optimizer(acc, weights, algorithm="sgd", lr=0.5,
                              groups=[(True, 1.0), {"lr_scale": 0.25}]) as opt:
        add_and_sync(acc, scaler, [np.full(4, 0.5, np.float32)] * 2)
        opt.step()
    assert np.all(weights[0] == np.float32(1.0 - 0.5 * 0.5))
    assert np.all(weights[1] == np.float32(1.0 - 0.125 * 0.5))
    weights = [np.ones(4, np.float32), np.ones(4, np.float32)]
    with unit_scaler() as scaler, gradacc.Accumulator([(4, "f32"), (4, "f32")]) as acc, \
            gradacc.Optimizer(acc, weights, algorithm="sgd", lr=0.5, weight_decay=0.5,
                              groups=[(True, 1.0), (False, 1.0)]) as opt:
        add_and_sync(acc, scaler, [np.full(4, 0.5, np.float32)] * 2)
        opt.step()
    assert np.all(weights[0] == np.float32(1.0 - 0.5 * (0.5 + 0.5)))  # L2: g + wd * w
    assert np.all(weights[1] == np.float32(1.0 - 0.5 * 0.5))


# ---- AdamW, bounded --------------------------------------------------------------------------

def test_adamw_within_the_bound_of_a_float64_reference():
    """Every weight within 8 float32 roundings per step of the magnitudes of that step's terms
    (at beta1 = 0.9, as here; docs/optimizer.md gives the bound's conditions):
    |w - w64| <= 8 u sum_t (|w_t| + lr_t |m_hat_t / (sqrt(v_hat_t) + eps)|), w64 and its terms
    from exact (float64) arithmetic on the same gradients and float32 hyperparameters. The worst
    seen is about a quarter of the bound."""
    rng = np.random.default_rng(7)
    sizes = [1000, 33]
    lr_scale = [1.0, 0.5]
    decays = [True, False]
    weights = [rng.uniform(-2, 2, n).astype(np.float32) for n in sizes]
    w64 = [w.astype(np.float64) for w in weights]
    m64 = [np.zeros(n) for n in sizes]
    v64 = [np.zeros(n) for n in sizes]
    bound = [np.zeros(n) for n in sizes]
    b1, b2, eps, wd = (float(np.float32(x)) for x in (0.9, 0.999, 1e-8, 0.01))
    with unit_scaler() as scaler, gradacc.Accumulator([(n, "f32") for n in sizes]) as acc, \
            gradacc.Optimizer(acc, weights, algorithm="adamw", groups=list(zip(decays, lr_scale))) as opt:
        for t, lr in enumerate([1e-2, 3e-3, 2e-2, 1e-3, 5e-3], start=1):
            opt.set_lr(lr)
            grads = [(rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 1, n)).astype(np.float32) for n in sizes]
            add_and_sync(acc, scaler, grads)
            assert opt.step()
            for i, g in enumerate(grads):
                g = g.astype(np.float64)
                tlr = float(np.float32(lr)) * lr_scale[i]
                w64[i] *= 1.0 - tlr * (wd if decays[i] else 0.0)
                m64[i] = b1 * m64[i] + (1 - b1) * g
                v64[i] = b2 * v64[i] + (1 - b2) * g * g
                r = (m64[i] / (1 - b1**t)) / (np.sqrt(v64[i] / (1 - b2**t)) + eps)
                w64[i] -= tlr * r
                bound[i] += 8 * U * (np.abs(w64[i]) + tlr * np.abs(r))
                err = np.abs(weights[i].astype(np.float64) - w64[i])
                worst = np.max(err / bound[i])
                assert worst <= 1.0, f"step {t} tensor {i}: {worst:.2f} of the bound"
        assert opt.steps == 5


# ---- skipped steps, saved state ----------------------------------------------------------------

def test_a_step_with_an_inf_gradient_changes_nothing():
    weights = mixed_weights()
    with gradacc.Scaler(init_scale=1024.0) as scaler, gradacc.Accumulator(MIXED) as acc, \
            gradacc.Optimizer(acc, weights, lr=0.01) as opt:
        scale = np.float32(scaler.scale)
        grads = mixed_grads(0)
        add_and_sync(acc, scaler, [grads[0] * np.float16(4), grads[1], grads[2] * scale])
        assert not scaler.update(acc) and opt.step()
        before = [w.copy() for w in weights]
        state = opt.save()
        poisoned = mixed_grads(1)
        poisoned[0][5] = np.float16(np.inf)
        info = add_and_sync(acc, scaler, poisoned)
        assert info.found_inf and scaler.update(acc)
        assert opt.step() is False
        for w, b in zip(weights, before):
            assert w.tobytes() == b.tobytes()
        assert opt.steps == 1 and opt.save() == state


def test_save_load_round_trip():
    weights = mixed_weights()
    with unit_scaler() as scaler, gradacc.Accumulator(MIXED) as acc, \
            gradacc.Optimizer(acc, weights, rounding="stochastic", seed=3, weight_decay=0.1) as opt:
        for step in range(2):
            add_and_sync(acc, scaler, mixed_grads(step))
            opt.step()
        state, at_save = opt.save(), [w.copy() for w in weights]
        add_and_sync(acc, scaler, mixed_grads(2))
        opt.step()
        after = [w.copy() for w in weights]
        corrupt = bytearray(state)
        corrupt[len(corrupt) // 2] ^= 1
        with pytest.raises(gradacc.GradaccError) as e:
            opt.load(bytes(corrupt))
        assert e.value.status == gradacc.Status.CORRUPT_STATE
        assert opt.steps == 3
        opt.load([state])  # a list of parts; one part alone also works
        assert opt.steps == 2
        for w, a in zip(weights, at_save):
            w[...] = a
        add_and_sync(acc, scaler, mixed_grads(2))
        opt.step()
        for w, a in zip(weights, after):
            assert w.tobytes() == a.tobytes()
    # Loaded into a fresh optimizer over other weights, the state is the saved one.
    fresh = [np.zeros_like(w) for w in weights]
    with gradacc.Accumulator(MIXED) as acc, \
            gradacc.Optimizer(acc, fresh, rounding="stochastic", seed=3, weight_decay=0.1) as opt:
        opt.load(state)
        assert opt.steps == 2 and opt.save() == state


# ---- sharding ------------------------------------------------------------------------------------

# 8005 elements over a flat master of 8128: 2 shards of 4096 and 4032.
SHARDED = [(5000, "f16"), (3000, "bf16"), (5, "f32")]


def sharded_weights():
    return [np.linspace(-1, 1, 5000).astype(np.float16), bf16_bits(np.linspace(3, -3, 3000, dtype=np.float32)),
            np.arange(5, dtype=np.float32)]


def sharded_grads(step):
    rng = np.random.default_rng(100 + step)
    return [rng.standard_normal(5000).astype(np.float16), bf16_bits(rng.standard_normal(3000).astype(np.float32)),
            rng.standard_normal(5).astype(np.float32)]


OPTIONS = dict(algorithm="adamw", lr=0.01, rounding="stochastic", seed=11,
               groups=[(True, 1.0), (False, 2.0), (False, 1.0)])


def test_reduce_scatter_group_matches_one_rank():
    single = sharded_weights()
    with unit_scaler() as scaler, gradacc.Accumulator(SHARDED) as acc, \
            gradacc.Optimizer(acc, single, **OPTIONS) as opt:
        for step in range(3):
            add_and_sync(acc, scaler, sharded_grads(step))
            assert opt.step()

    def rank(comm, r):
        weights = sharded_weights()
        with unit_scaler() as scaler, \
                gradacc.Accumulator(SHARDED, sharding="reduce_scatter", shard_count=2, shard_rank=r) as acc, \
                gradacc.Optimizer(acc, weights, **OPTIONS) as opt:
            assert acc.shard().numel > 0
            for step in range(3):
                add_and_sync(acc, scaler, sharded_grads(step), comm)  # the same gradient on both ranks
                assert opt.step(comm)
        return weights

    for weights in run_ranks(2, rank):
        for w, s in zip(weights, single):
            assert w.tobytes() == s.tobytes()


# ---- bad arguments -------------------------------------------------------------------------------

def test_bad_arguments_are_named():
    weights = mixed_weights()
    with gradacc.Accumulator(MIXED) as acc:
        with pytest.raises(gradacc.GradaccError) as e:
            gradacc.Optimizer(acc, weights, beta1=1.5)
        assert e.value.status == gradacc.Status.INVALID_ARGUMENT and "beta1" in e.value.message
        with pytest.raises(gradacc.GradaccError) as e:
            gradacc.Optimizer(acc, weights, groups=[(True, 1.0), (True, -1.0), (True, 1.0)])
        assert e.value.status == gradacc.Status.INVALID_ARGUMENT and "lr_scale" in e.value.message
        with gradacc.Optimizer(acc, weights) as opt, pytest.raises(gradacc.GradaccError) as e:
            opt.lr_device_ptr
        assert e.value.status == gradacc.Status.DEVICE_MISMATCH and "set_lr" in e.value.message
        with pytest.raises(ValueError, match="algorithm"):
            gradacc.Optimizer(acc, weights, algorithm="adam")
        with pytest.raises(ValueError, match="rounding"):
            gradacc.Optimizer(acc, weights, rounding="up")
        with pytest.raises(TypeError, match="betas"):
            gradacc.Optimizer(acc, weights, betas=(0.9, 0.99))
        with pytest.raises(ValueError, match="weights"):
            gradacc.Optimizer(acc, weights[:2])
        with pytest.raises(ValueError, match="groups"):
            gradacc.Optimizer(acc, weights, groups=[(True, 1.0)])
        with pytest.raises(TypeError, match=r"weights\[2\]"):
            gradacc.Optimizer(acc, weights[:2] + [np.zeros(7, np.float64)])
        with pytest.raises(ValueError, match=r"weights\[0\]"):
            gradacc.Optimizer(acc, [np.zeros(299, np.float16)] + weights[1:])
        read_only = weights[2].copy()
        read_only.flags.writeable = False
        with pytest.raises(ValueError, match=r"weights\[2\]"):
            gradacc.Optimizer(acc, weights[:2] + [read_only])
        with gradacc.Optimizer(acc, weights) as opt:
            with pytest.raises(gradacc.GradaccError) as e:
                opt.set_lr(-1.0)
            assert e.value.status == gradacc.Status.INVALID_ARGUMENT and "`lr`" in e.value.message
            with pytest.raises(gradacc.GradaccError) as e:
                opt.step()
            assert e.value.status == gradacc.Status.WRONG_STATE
        with pytest.raises(ValueError, match="closed"):
            opt.step()


# ---- adopted FP32 masters --------------------------------------------------------------------

def test_adopted_masters_are_stepped_in_place_and_loaded_into():
    """masters=: the caller's float32 values (not the weights') are the masters, SGD with momentum
    updates them in place bit for bit as numpy in float32, a refused load leaves them bit for bit
    and a load writes the saved masters back into them."""
    weights = mixed_weights()
    with gradacc.Accumulator(MIXED) as acc:
        offsets = [acc.offset(i) for i in range(3)]
        flat = np.zeros(acc.shard().numel, np.float32)
        reference = [weights[0].astype(np.float32) + np.float32(2.0**-12), bf16_value(weights[1]) * np.float32(1.001),
                     weights[2] - np.float32(1.0 / 3.0)]
        for at, m in zip(offsets, reference):
            flat[at:at + m.size] = m
        initial = flat.copy()
        with pytest.raises(gradacc.GradaccError) as e:
            gradacc.Optimizer(acc, weights, masters=flat[:-1])
        assert e.value.status == gradacc.Status.SIZE_MISMATCH and "masters" in e.value.message
        with pytest.raises(TypeError, match="masters"):
            gradacc.Optimizer(acc, weights, masters=flat.astype(np.float64))
        assert np.array_equal(flat.view(np.uint32), initial.view(np.uint32))
        momentum = [None] * 3
        with unit_scaler() as scaler, \
                gradacc.Optimizer(acc, weights, masters=flat, algorithm="sgd", lr=0.125, momentum=0.9) as opt:
            assert np.array_equal(flat.view(np.uint32), initial.view(np.uint32)), "creation wrote the masters"
            for step in range(3):
                grads = mixed_grads(step)
                add_and_sync(acc, scaler, grads)
                assert opt.step() is True
                for i, g in enumerate([grads[0].astype(np.float32), bf16_value(grads[1]), grads[2]]):
                    momentum[i] = g.copy() if momentum[i] is None else momentum[i] * np.float32(0.9) + g
                    reference[i] = reference[i] + np.float32(-0.125) * momentum[i]
                    at = offsets[i]
                    assert np.array_equal(flat[at:at + g.size].view(np.uint32), reference[i].view(np.uint32))
                assert np.array_equal(weights[1], bf16_bits(reference[1]))
            saved = opt.save()
            flat[:] = 5.0
            before = flat.copy()
            forged = bytearray(saved)
            forged[len(forged) // 2] ^= 1
            with pytest.raises(gradacc.GradaccError) as e:
                opt.load([bytes(forged)])
            assert e.value.status == gradacc.Status.CORRUPT_STATE
            assert np.array_equal(flat.view(np.uint32), before.view(np.uint32)), "a refused load wrote"
            opt.load([saved])
            for at, m in zip(offsets, reference):
                assert np.array_equal(flat[at:at + m.size].view(np.uint32), m.view(np.uint32))


# ---- smaller state formats ----------------------------------------------------------------------


def test_bf16_moments_and_remainder_masters_step_save_and_refuse():
    """Remainder masters write the FP32-master optimizer's weights (but at ties of even upper
    halves, one bf16 unit away); bf16 moments step and round-trip through save and load; and
    remainders refuse f16 weights with the tensor named."""
    layout = [(300, "bf16"), (7, "bf16")]
    start = [bf16_bits(np.linspace(-2.0, 2.0, 300, dtype=np.float32)), bf16_bits(np.arange(7) * 0.5)]
    grads = lambda step: [bf16_bits(np.cos(np.arange(n, dtype=np.float32) + step)) for n, _ in layout]
    runs = []
    for fields in ({}, {"master_format": "bf16_remainder"}, {"master_format": "bf16_remainder", "moments": "bf16", "moment_seed": 4}):
        weights = [w.copy() for w in start]
        with unit_scaler() as scaler, gradacc.Accumulator(layout) as acc, \
                gradacc.Optimizer(acc, weights, lr=0.01, **fields) as opt:
            for step in range(4):
                add_and_sync(acc, scaler, grads(step))
                assert opt.step()
            state = opt.save()
            opt.load(state)
            assert opt.steps == 4
        runs.append(weights)
    for a, b in zip(runs[0], runs[1]):
        diff = np.abs(a.astype(np.int32) - b.astype(np.int32))
        assert diff.max() <= 1 and (diff > 0).mean() < 0.01
    with gradacc.Accumulator([(3, "f16")]) as acc:
        with pytest.raises(gradacc.GradaccError) as e:
            gradacc.Optimizer(acc, [np.zeros(3, np.float16)], master_format="bf16_remainder")
        assert e.value.status == gradacc.Status.INVALID_ARGUMENT and "weights[0]" in e.value.message
        with pytest.raises(ValueError, match="moments"):
            gradacc.Optimizer(acc, [np.zeros(3, np.float16)], moments="fp8")
        # 8-bit blockwise moments take any weights.
        gradacc.Optimizer(acc, [np.zeros(3, np.float16)], moments="int8_blockwise").close()


def test_no_masters_step_the_weights_and_refuse_nearest_rounding():
    """Without masters the weights step (rounded stochastically), save and load without a
    master column; f16 weights rounded to nearest are refused naming `rounding`."""
    layout = [(300, "bf16")]
    start = bf16_bits(np.linspace(-2.0, 2.0, 300, dtype=np.float32))
    weights = [start.copy()]
    with unit_scaler() as scaler, gradacc.Accumulator(layout) as acc, \
            gradacc.Optimizer(acc, weights, lr=0.01, master_format="none", rounding="stochastic",
                              seed=3) as opt, \
            gradacc.Optimizer(acc, [start.copy()], lr=0.01, rounding="stochastic", seed=3) as fp32:
        for step in range(3):
            add_and_sync(acc, scaler, [bf16_bits(np.cos(np.arange(300, dtype=np.float32) + step))])
            assert opt.step()
        assert (weights[0] != start).mean() > 0.9
        state = opt.save()
        assert len(state) + 4 * 300 <= len(fp32.save())
        opt.load(state)
        assert opt.steps == 3
    with gradacc.Accumulator([(3, "f16")]) as acc:
        with pytest.raises(gradacc.GradaccError) as e:
            gradacc.Optimizer(acc, [np.zeros(3, np.float16)], master_format="none")
        assert e.value.status == gradacc.Status.INVALID_ARGUMENT and "`rounding`" in e.value.message
        gradacc.Optimizer(acc, [np.zeros(3, np.float16)], master_format="none",
                          rounding="stochastic").close()


@pytest.mark.parametrize("moments", ["fp32", "bf16", "int8_blockwise"])
def test_the_clip_inside_the_step_is_sync_then_step_bit_for_bit(moments):
    """sync_for_step + step against sync + step, with a norm that clips every window: the same
    weights and state bit for bit, and the same report; in memory, sync_for_step's gradient is
    the sum before normalisation and clipping (the step applies them; with one item per window
    the normalisation divides by 1)."""
    runs, grads = [], []
    for sync in ("sync", "sync_for_step"):
        weights = [w.copy() for w in mixed_weights()]
        with unit_scaler() as scaler, gradacc.Accumulator(MIXED, max_grad_norm=0.5) as acc, \
                gradacc.Optimizer(acc, weights, lr=0.01, moments=moments) as opt:
            infos = []
            for step in range(3):
                acc.add(scaler, mixed_grads(step), count=1)
                info = getattr(acc, sync)()
                assert info.clip_coef < 1.0
                infos.append((info.grad_norm, info.clip_coef, info.total_count))
                if step == 0:
                    grads.append((acc.master(2).copy(), info.clip_coef))
                assert opt.step()
            runs.append(([w.tobytes() for w in weights], opt.save(), infos))
    assert runs[0] == runs[1]
    (clipped, coef), (before, _) = grads
    assert clipped.tobytes() == (before * np.float32(coef)).tobytes()
    assert clipped.tobytes() != before.tobytes()


def test_the_last_add_measuring_the_norm_changes_no_bit():
    """add_final for each window's micro-batch against add, both before sync_for_step + step with
    a norm that clips every window: the same report, weights and state bit for bit."""
    runs = []
    for add in ("add", "add_final"):
        weights = [w.copy() for w in mixed_weights()]
        with unit_scaler() as scaler, gradacc.Accumulator(MIXED, max_grad_norm=0.5) as acc, \
                gradacc.Optimizer(acc, weights, lr=0.01) as opt:
            infos = []
            for step in range(3):
                acc.add(scaler, mixed_grads(2 * step), count=1)
                getattr(acc, add)(scaler, mixed_grads(2 * step + 1), count=2)
                info = acc.sync_for_step()
                assert info.clip_coef < 1.0
                infos.append((info.grad_norm, info.clip_coef, info.total_count))
                assert opt.step()
            runs.append(([w.tobytes() for w in weights], opt.save(), infos))
    assert runs[0] == runs[1]


# ---- FP8 weights on the all-gather ---------------------------------------------------------------

def e4m3_table():
    """The value of every E4M3 code (float8_e4m3fn), NaN for 0x7f and 0xff."""
    c = np.arange(256)
    e, m = (c >> 3) & 15, c & 7
    v = np.where(e == 0, np.ldexp(m.astype(np.float64), -9), np.ldexp((8 + m).astype(np.float64), e - 10))
    v = np.where(c >> 7 == 1, -v, v)
    v[[0x7f, 0xff]] = np.nan
    return v


def e4m3_of(x):
    """E4M3 codes of f64 `x`, saturated at ±448, nearest, ties to the even code."""
    table = e4m3_table()
    x = np.clip(x, -448.0, 448.0)
    d = np.abs(x[:, None] - table[None, :])
    d[:, [0x7f, 0xff]] = np.inf
    d[np.signbit(x)[:, None] != (np.arange(256)[None, :] >= 128)] = np.inf
    best = d.min(axis=1, keepdims=True)
    # Among the nearest codes, the even one (the lowest bit clear).
    candidates = np.where(d == best, np.arange(256)[None, :] + 1000 * (np.arange(256)[None, :] & 1), 10**6)
    return (candidates.min(axis=1) % 1000).astype(np.uint8)


FP8_TENSORS = [(5000, "f32"), (3001, "f32"), (4133, "f32")]


def fp8_weights():
    return [np.linspace(-1, 1, 5000).astype(np.float32), np.linspace(3, -3, 3001).astype(np.float32),
            (np.linspace(-2, 2, 4133) * np.exp2(np.arange(4133) % 24 - 12)).astype(np.float32)]


def fp8_grads(step, r):
    rng = np.random.default_rng(200 + 10 * step + r)
    return [rng.standard_normal(n).astype(np.float32) for n, _ in FP8_TENSORS]


def test_fp8_weights_are_the_whole_masters_quantised_once():
    """Two ranks under reduce_scatter write tensor 1 as E4M3 and tensor 2 as MXFP8: after every
    step both ranks hold the codes and scales of quantising the masters of the same run with f32
    weights (which are the masters) by this file's reference."""
    def rank(comm, r, fp8):
        weights = fp8_weights()
        buffers = {1: ("e4m3", np.zeros(3001, np.uint8), np.zeros(1, np.float32)),
                   2: ("mxfp8", np.zeros(4133, np.uint8), np.zeros(130, np.uint8))} if fp8 else None
        seen = []
        with unit_scaler() as scaler, \
                gradacc.Accumulator(FP8_TENSORS, sharding="reduce_scatter", shard_count=2, shard_rank=r) as acc, \
                gradacc.Optimizer(acc, weights, lr=0.05, fp8=buffers) as opt:
            for step in range(2):
                add_and_sync(acc, scaler, fp8_grads(step, r), comm)
                assert opt.step(comm)
                if fp8:
                    seen.append([buffers[1][1].copy(), buffers[1][2].copy(), buffers[2][1].copy(), buffers[2][2].copy()])
                else:
                    seen.append([w.copy() for w in weights])
        return seen

    masters = run_ranks(2, lambda c, r: rank(c, r, False))
    codes = run_ranks(2, lambda c, r: rank(c, r, True))
    for step in range(2):
        m1, m2 = masters[0][step][1], masters[0][step][2]
        scale = np.float32(448.0 / max(np.abs(m1.astype(np.float64)).max(), 1e-12))
        want_codes1 = e4m3_of((m1 * scale).astype(np.float64))
        blocks = [m2[b:b + 32].astype(np.float64) for b in range(0, 4133, 32)]
        exps = [int(np.clip(np.floor(np.log2(np.abs(b).max())) - 8 if np.abs(b).max() > 0 else -127, -127, 127))
                for b in blocks]
        want_codes2 = np.concatenate([e4m3_of(np.ldexp(b, -x)) for b, x in zip(blocks, exps)])
        for r in range(2):
            got1, got_scale, got2, got_scales = codes[r][step]
            assert got_scale.tobytes() == np.array([scale], np.float32).tobytes(), (step, r)
            assert (got1 == want_codes1).all(), (step, r, int((got1 != want_codes1).sum()))
            assert (got_scales == np.array(exps) + 127).all(), (step, r)
            assert (got2 == want_codes2).all(), (step, r, int((got2 != want_codes2).sum()))


def test_fp8_buffers_of_the_wrong_shape_are_refused():
    with gradacc.Accumulator(FP8_TENSORS, sharding="reduce_scatter", shard_count=1, shard_rank=0) as acc:
        weights = fp8_weights()
        with pytest.raises(gradacc.GradaccError) as e:
            gradacc.Optimizer(acc, weights, fp8={1: ("e4m3", np.zeros(3000, np.uint8), np.zeros(1, np.float32))})
        assert e.value.status == gradacc.Status.SIZE_MISMATCH and "fp8[1] codes" in e.value.message
        with pytest.raises(gradacc.GradaccError) as e:
            gradacc.Optimizer(acc, weights, fp8={2: ("mxfp8", np.zeros(4133, np.uint8), np.zeros(130, np.float32))})
        assert e.value.status == gradacc.Status.DTYPE_MISMATCH and "fp8[2] scales" in e.value.message
        with pytest.raises(ValueError, match="format"):
            gradacc.Optimizer(acc, weights, fp8={1: ("e5m2", np.zeros(3001, np.uint8), np.zeros(1, np.float32))})
    with gradacc.Accumulator(FP8_TENSORS) as acc, pytest.raises(gradacc.GradaccError) as e:
        gradacc.Optimizer(acc, fp8_weights(), fp8={1: ("e4m3", np.zeros(3001, np.uint8), np.zeros(1, np.float32))})
    assert e.value.status == gradacc.Status.INVALID_ARGUMENT and "weight_formats[1]" in e.value.message
