"""The binding itself: errors, handle lifetimes, buffers of every accepted kind."""
import ctypes
import gc
import importlib.metadata
import os
import re
import threading

import numpy as np
import pytest

import gradacc


ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
INSTALLED = os.environ.get("GRADACC_TEST_INSTALLED") == "1"


def test_version_matches_header():
    assert gradacc.version() == gradacc.__version__


def test_version_is_cargo_version():
    """Cargo.toml's version is the one source: the header and the ctypes layer (__version__), the
    library's gradacc_version_string(), and the installed distribution's metadata."""
    with open(os.path.join(ROOT, "Cargo.toml"), encoding="utf-8") as f:
        cargo = re.search(r'^version\s*=\s*"([^"]+)"', f.read(), re.MULTILINE).group(1)
    assert gradacc.__version__ == cargo
    assert gradacc.version() == cargo
    if INSTALLED:
        assert importlib.metadata.version("gradacc") == cargo


@pytest.mark.skipif(not INSTALLED, reason="tests the installed wheel (GRADACC_TEST_INSTALLED=1)")
def test_installed_package_loads_its_bundled_library():
    package = os.path.dirname(os.path.abspath(gradacc.__file__))
    assert not package.startswith(ROOT + os.sep), package  # not the source tree
    assert os.path.dirname(gradacc._lib.path) == package, gradacc._lib.path


def test_error_carries_status_and_message():
    with gradacc.Scaler() as scaler, gradacc.Accumulator([(4, "f16")]) as acc:
        acc.begin_microbatch(1)
        with pytest.raises(gradacc.GradaccError) as e:
            acc.add_tensor(scaler, 0, np.zeros(8, np.float16))
        assert e.value.status == gradacc.Status.SIZE_MISMATCH
        assert "`numel` = 8" in e.value.message
        assert "GRADACC_STATUS_SIZE_MISMATCH" in str(e.value)
        with pytest.raises(gradacc.GradaccError) as e:
            acc.sync()  # inside a micro-batch
        assert e.value.status == gradacc.Status.WRONG_STATE


def test_invalid_config_and_empty_window():
    with pytest.raises(gradacc.GradaccError) as e:
        gradacc.Accumulator([(1, "f32")], normalize=99)
    assert e.value.status == gradacc.Status.INVALID_ARGUMENT and "normalize" in e.value.message
    with pytest.raises(TypeError):
        gradacc.Scaler(no_such_field=1)
    with gradacc.Accumulator([(1, "f32")]) as acc:
        with pytest.raises(gradacc.GradaccError) as e:
            acc.sync()
        assert e.value.status == gradacc.Status.EMPTY_WINDOW


def test_messages_are_per_thread():
    # Each thread's error carries its own message, even when both fail at the same time.
    barrier, seen = threading.Barrier(2), {}

    def fail(r):
        with gradacc.Accumulator([(r + 1, "f32")]) as acc, gradacc.Scaler() as s:
            acc.begin_microbatch(1)
            barrier.wait()
            try:
                acc.add_tensor(s, 0, np.zeros(10 + r, np.float32))
            except gradacc.GradaccError as e:
                seen[r] = e.message

    threads = [threading.Thread(target=fail, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert "`numel` = 10" in seen[0] and "`numel` = 11" in seen[1]


def test_close_is_idempotent_and_closed_objects_refuse():
    s = gradacc.Scaler()
    s.close()
    s.close()
    assert s.closed
    with pytest.raises(ValueError, match="closed"):
        s.scale
    comms = gradacc.local_group(3)
    assert [c.rank for c in comms] == [0, 1, 2]
    for c in comms:
        c.close()
        c.close()


def test_master_view_keeps_the_accumulator_alive():
    acc = gradacc.Accumulator([(3, "f32")])
    with gradacc.Scaler(init_scale=2.0) as s:
        acc.add(s, [np.array([2, 4, 6], np.float32)], count=1)
        acc.sync()
    view = acc.master(0)
    del acc
    gc.collect()
    assert view.tolist() == [1.0, 2.0, 3.0]  # the object lives as long as the view
    view[0] = 5.0  # writable


def test_buffer_kinds():
    class Interface:  # any object with __array_interface__
        def __init__(self, a):
            self.a = a
            self.__array_interface__ = a.__array_interface__

    class Tensorish:  # a torch-like tensor
        def __init__(self, a):
            self.a, self.dtype = a, "torch.float16"

        def data_ptr(self):
            return self.a.ctypes.data

        def numel(self):
            return self.a.size

        def is_contiguous(self):
            return True

    g = np.array([1.0, 2.0], np.float16)
    with gradacc.Scaler(init_scale=1.0) as s, gradacc.Accumulator([(2, "f16")], normalize="none") as acc:
        acc.add(s, [g], 1)
        acc.add(s, [Interface(g)], 1)
        acc.add(s, [Tensorish(g)], 1)
        acc.add(s, [g.ctypes.data], 1)  # a raw address: the declared numel is used
        acc.add(s, [g.view(np.uint16)], 1)  # fp16 words
        with acc.microbatch(1):
            acc.add_tensor(s, 0, g.ctypes.data, numel=2)
        acc.sync()
        assert acc.master(0).tolist() == [6.0, 12.0]
        with pytest.raises(TypeError, match="float32"):
            acc.add(s, [g.astype(np.float32)], 1)
        with pytest.raises(ValueError, match="contiguous"):
            acc.add(s, [np.zeros(4, np.float16)[::2]], 1)
        with pytest.raises(ValueError, match="elements"):
            acc.add(s, [np.zeros(3, np.float16)], 1)


def test_bf16_words_and_scale_loss():
    bits = (np.array([3.0, -1.5], np.float32).view(np.uint32) >> 16).astype(np.uint16)
    with gradacc.Scaler(init_scale=4.0) as s, gradacc.Accumulator([(2, "bf16")]) as acc:
        loss = np.array([0.5], np.float32)
        s.scale_loss(loss)
        assert loss[0] == 2.0
        half = np.array([0.25], np.float16)
        s.scale_loss(half)
        assert half[0] == 1.0
        with pytest.raises(TypeError, match="dtype"):
            s.scale_loss(np.zeros(1, np.uint16))
        acc.add(s, [bits], 1)
        acc.sync()
        assert acc.master(0).tolist() == [0.75, -0.375]


def bf16_reference(x):
    """Nearest-even bf16 bits of float32 ``x`` in integers, independently of the library; NaNs
    keep their upper bits with the quiet bit set."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    up = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((b >> 16) | 0x40).astype(np.uint16), up)


def test_bf16_conversions():
    rng = np.random.default_rng(45)
    x = rng.integers(0, 2**32, 7 * 14_287, dtype=np.uint64).astype(np.uint32).view(np.float32).reshape(7, -1)
    words = gradacc.f32_to_bf16(x)
    assert words.dtype == np.uint16 and words.shape == x.shape
    assert (words == bf16_reference(x)).all()
    back = gradacc.bf16_to_f32(words[:, 1::3])  # a strided view: copied, then converted
    assert (back.view(np.uint32) == words[:, 1::3].astype(np.uint32) << 16).all()
    assert gradacc.f32_to_bf16([1.0, 1 + 2**-8, 3.4e38]).tolist() == [0x3F80, 0x3F80, 0x7F80]
    assert gradacc.bf16_to_f32(np.zeros(0, np.uint16)).size == 0
    with pytest.raises(TypeError, match="uint16"):
        gradacc.bf16_to_f32(np.zeros(2, np.float32))
    with gradacc.Scaler(init_scale=1.0) as s, gradacc.Accumulator([(3, "bf16")]) as acc:
        acc.add(s, [gradacc.f32_to_bf16([0.5, -2.0, 3.0])], 1)
        acc.sync()
        assert acc.master(0).tolist() == [0.5, -2.0, 3.0]


def test_adopted_master_buffer_and_state_round_trip():
    # Each tensor starts at a multiple of GRADACC_MASTER_ALIGN bytes (64 f32 values).
    master = np.full(128, np.nan, np.float32)
    with gradacc.Scaler(init_scale=1.0) as s, gradacc.Accumulator([(1, "f32"), (2, "f32")], master=master) as acc:
        acc.add(s, [np.array([1], np.float32), np.array([2, 3], np.float32)], 1)
        window = acc.save_window()
        acc.reset()
        acc.load_window(window)
        acc.sync()
        assert master[[0, 64, 65]].tolist() == [1.0, 2.0, 3.0]
        assert not master[1:64].any() and not master[66:].any(), "the padding is zeroed"
        assert acc.master(1).ctypes.data == master.ctypes.data + 256
        state = s.save()
        s.update(acc)
        s.load(state)
        assert s.stats.steps == 0
        with pytest.raises(gradacc.GradaccError) as e:
            s.load(b"not a state")
        assert e.value.status == gradacc.Status.CORRUPT_STATE


def test_ctypes_declarations_match_the_header():
    from gradacc import _ffi
    # 0.2's 48 bytes, then dropped_microbatches, overflow_at (+4 padding) and the place: the C
    # compiler's sizeof on x86_64 and aarch64.
    assert ctypes.sizeof(_ffi.gradacc_sync_info_t) == 88
    assert ctypes.sizeof(_ffi.gradacc_accumulator_config_t) == 64
    assert _ffi.gradacc_status_string(5).decode().startswith("GRADACC_STATUS_SIZE_MISMATCH")


def test_bound_gradients_add_what_the_buffers_hold_at_each_add():
    """bind() converts once; each add reads the buffers as they are then (a backward that writes
    into the same arrays every micro-batch), and equals the plain add bit for bit."""
    rng = np.random.default_rng()
    tensors = [(3, "f32"), (1001, "f16"), (17, "bf16"), (64, "f32")]
    grads = [np.zeros(n, dtype=np.float32 if dt != "f16" else np.float16) for n, dt in tensors]
    grads[2] = np.zeros(17, dtype=np.uint16)  # bf16 travels as its bits
    scaler = gradacc.Scaler(init_scale=1.0)
    plain, bound_acc = gradacc.Accumulator(tensors), gradacc.Accumulator(tensors)
    bound = bound_acc.bind(grads)
    assert len(bound) == 4
    for count in (3, 5):
        for g in grads:
            if g.dtype == np.uint16:
                g[:] = (rng.standard_normal(g.size).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
            else:
                g[:] = rng.standard_normal(g.size).astype(g.dtype)
        plain.add(scaler, grads, count)
        bound_acc.add(scaler, bound, count)
    assert plain.sync() == bound_acc.sync()
    for i in range(len(tensors)):
        assert np.array_equal(plain.master(i).view(np.uint32), bound_acc.master(i).view(np.uint32))
    with pytest.raises(ValueError, match="another accumulator"):
        plain.add(scaler, bound, 1)
    with pytest.raises(ValueError, match="4 tensors"):
        bound_acc.bind(grads[:3])


def test_a_negative_count_is_named_not_wrapped():
    """count=-1 is refused as itself (not as 2**64 - 1), and the window is left as it was."""
    tensors = [(3, "f32")]
    scaler = gradacc.Scaler(init_scale=1.0)
    acc = gradacc.Accumulator(tensors)
    grad = np.ones(3, np.float32)
    for bad in (-1, 2.5):
        with pytest.raises(ValueError, match=re.escape(f"`count` = {bad!r}")):
            acc.add(scaler, [grad], bad)
        with pytest.raises(ValueError, match=re.escape(f"`count` = {bad!r}")):
            acc.begin_microbatch(bad)
    acc.add(scaler, [grad], np.int64(2))
    info = acc.sync()
    assert (info.total_count, info.microbatches) == (2, 1)


def test_the_wheels_nvrtc_is_loaded_without_a_library_path():
    """With the nvidia-cuda-nvrtc wheel in the environment, its NVRTC is loaded at import, so
    the library finds it by name with no LD_LIBRARY_PATH."""
    import glob
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    roots = [] if spec is None else spec.submodule_search_locations
    wheels = [f for root in roots for f in glob.glob(os.path.join(root, "*", "lib", "libnvrtc.so.1*"))]
    if not wheels or os.environ.get("GRADACC_NVRTC_LIBRARY"):
        pytest.skip("no NVRTC wheel in this environment, or NVRTC named by GRADACC_NVRTC_LIBRARY")
    with open("/proc/self/maps") as maps:
        mapped = maps.read()
    assert all(os.path.realpath(f) in mapped for f in wheels), wheels


def test_a_negative_unsigned_argument_is_named_not_wrapped():
    with gradacc.Scaler() as s, gradacc.Accumulator([(3, "f32")]) as acc:
        with pytest.raises(ValueError, match=r"`index` = -1"):
            acc.master_ptr(-1)
        acc.begin_microbatch(1)
        with pytest.raises(ValueError, match=r"`numel` = -1"):
            acc.add_tensor(s, 0, np.ones(3, np.float32), numel=-1)
        with pytest.raises(ValueError, match=r"`index` = -2"):
            acc.add_tensor(s, -2, np.ones(3, np.float32))
        acc.add_tensor(s, 0, np.ones(3, np.float32))
        acc.end_microbatch()


def test_a_buffer_of_the_wrong_dtype_or_length_carries_the_status():
    with gradacc.Scaler() as s, gradacc.Accumulator([(4, "f16")]) as acc:
        with pytest.raises(gradacc.GradaccDtypeError) as e:
            acc.add(s, [np.ones(4, np.float32)], 1)
        assert e.value.status == gradacc.Status.DTYPE_MISMATCH and isinstance(e.value, TypeError)
        with pytest.raises(gradacc.GradaccSizeError) as e:
            acc.add(s, [np.ones(3, np.float16)], 1)
        assert e.value.status == gradacc.Status.SIZE_MISMATCH and isinstance(e.value, ValueError)
        assert "grads[0] has 3 elements, but tensor 0 has 4" in str(e.value)
        # The library's own SIZE_MISMATCH raises the same class.
        acc.begin_microbatch(1)
        with pytest.raises(gradacc.GradaccSizeError, match="gradacc_accumulator_add_tensor"):
            acc.add_tensor(s, 0, np.ones(3, np.float16))


def test_the_dtype_names_ml_code_types():
    with gradacc.Accumulator([(2, "fp16"), (2, "fp32"), (2, "bf16")]) as acc:
        assert [d for _, d in acc.tensors] == [gradacc.DType.F16, gradacc.DType.F32, gradacc.DType.BF16]
