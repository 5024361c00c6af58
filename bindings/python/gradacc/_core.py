"""The Pythonic layer over the generated ctypes declarations (_ffi.py): owned handles, statuses
turned into GradaccError, and buffers taken from numpy arrays and other array-like objects."""
import contextlib
import ctypes
import dataclasses
import enum
import numbers
import typing

import numpy as np

from . import _ffi as ffi


def _constants(prefix):
    return {k[len(prefix):]: v for k, v in vars(ffi).items() if k.startswith(prefix) and isinstance(v, int)}


# Built from the header's constants, so a code added to the C API appears here by regeneration.
Status = enum.IntEnum("Status", _constants("GRADACC_STATUS_"), module=__name__)
DType = enum.IntEnum("DType", _constants("GRADACC_DTYPE_"), module=__name__)
Normalize = enum.IntEnum("Normalize", _constants("GRADACC_NORMALIZE_"), module=__name__)
LossReduction = enum.IntEnum("LossReduction", _constants("GRADACC_LOSS_REDUCTION_"), module=__name__)
Sharding = enum.IntEnum("Sharding", _constants("GRADACC_SHARDING_"), module=__name__)
# GRADACC_OVERFLOW_AT_* share the prefix: they are the report's, read into SyncInfo.overflow.
Overflow = enum.IntEnum("Overflow", {k: v for k, v in _constants("GRADACC_OVERFLOW_").items()
                                     if not k.startswith("AT_")}, module=__name__)
Algorithm = enum.IntEnum("Algorithm", _constants("GRADACC_OPTIMIZER_"), module=__name__)
Rounding = enum.IntEnum("Rounding", _constants("GRADACC_ROUNDING_"), module=__name__)
Masters = enum.IntEnum("Masters", _constants("GRADACC_MASTERS_"), module=__name__)
Moments = enum.IntEnum("Moments", _constants("GRADACC_MOMENTS_"), module=__name__)


class GradaccError(Exception):
    """A gradacc call failed: ``status`` (a :class:`Status`) and ``message``, the calling thread's
    gradacc_last_error() read right after the call (it names the argument and the value)."""

    def __init__(self, status, message):
        try:
            status = Status(status)
        except ValueError:
            pass
        self.status = status
        self.message = message
        name = ffi.gradacc_status_string(int(status)).decode()
        super().__init__(f"{name}: {message}")


class GradaccTimeoutError(GradaccError, TimeoutError):
    """A collective did not complete within the communicator's timeout (status
    :attr:`Status.TIMEOUT`); the communicator was aborted. Also a built-in ``TimeoutError``."""


class GradaccDtypeError(GradaccError, TypeError):
    """A buffer of another element type than its tensor's (status :attr:`Status.DTYPE_MISMATCH`),
    found by this binding or by the library. Also a built-in ``TypeError``."""


class GradaccSizeError(GradaccError, ValueError):
    """A buffer or list of another length than its tensor's or the accumulator's (status
    :attr:`Status.SIZE_MISMATCH`), found by this binding or by the library. Also a built-in
    ``ValueError``."""


# Statuses raised as a subclass of GradaccError; every other status raises GradaccError itself.
_ERRORS = {
    ffi.GRADACC_STATUS_TIMEOUT: GradaccTimeoutError,
    ffi.GRADACC_STATUS_DTYPE_MISMATCH: GradaccDtypeError,
    ffi.GRADACC_STATUS_SIZE_MISMATCH: GradaccSizeError,
}


def _check(status):
    # Read the message at once, on this thread: it is per thread and the next failure replaces it.
    if status != ffi.GRADACC_STATUS_OK:
        raise _ERRORS.get(status, GradaccError)(status, ffi.gradacc_last_error().decode("utf-8", "replace"))


def _unsigned(value, what):
    """``value`` as the C calls take an unsigned argument: a negative or non-integral one raises
    ValueError naming it, instead of wrapping to 2**64 - 1 on its way to C."""
    if not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"`{what}` = {value!r}: an integer >= 0")
    return int(value)


# A count the library refuses on every rank of a sharded accumulation (past the window's limit),
# passed after this binding refused the caller's, so the other ranks fail at once.
_REFUSED_COUNT = 2**64 - 1


def version():
    """The loaded library's version string ("MAJOR.MINOR.PATCH")."""
    return ffi.gradacc_version_string().decode()


def _check_version():
    loaded = version().split("-")[0].split(".")[:2]
    header = [str(ffi.GRADACC_VERSION_MAJOR), str(ffi.GRADACC_VERSION_MINOR)]
    if loaded != header:
        raise ImportError(f"the gradacc library is version {version()}, but this binding was generated "
                          f"from the {ffi.GRADACC_VERSION_STRING} header")


_check_version()


class OverflowAt(typing.NamedTuple):
    """Where a window first went non-finite (:attr:`SyncInfo.overflow`): the rank, its window's
    micro-batch and the tensor index, each counted from 0 (dropped micro-batches included)."""
    rank: int
    microbatch: int
    tensor: int


@dataclasses.dataclass(frozen=True)
class SyncInfo:
    """What the boundary reports; identical on every rank.

    ``dropped_microbatches``: micro-batches dropped over all ranks under
    ``overflow='drop_microbatch'`` (not counted in ``total_count`` and ``microbatches``).
    ``overflow``: where the window first went non-finite, first in the order micro-batch, then
    tensor, then rank: ``None`` (it stayed finite), an :class:`OverflowAt` (a gradient value),
    or ``"reduction"`` (every rank was finite, their sum was not). docs/overflow.md states the
    contract."""
    found_inf: bool
    total_count: int
    microbatches: int
    grad_norm: float
    clip_coef: float
    dropped_microbatches: int = 0
    overflow: typing.Union[None, OverflowAt, str] = None


class TensorStats(typing.NamedTuple):
    """One tensor's telemetry of the last boundary (:meth:`Accumulator.tensor_stats`), the same
    on every rank: the L2 norm of its reduced, normalised gradient before clipping, and in how
    many micro-batches, over every rank, it held a non-finite value (dropped ones included)."""
    grad_norm: float
    nonfinite_microbatches: int


class Shard(typing.NamedTuple):
    """This rank's shard of the flat FP32 master (:meth:`Accumulator.shard`): elements
    ``offset`` to ``offset + numel`` of the tensors laid out one after another, and ``data``, a
    float32 view of them."""
    offset: int
    numel: int
    data: np.ndarray


@dataclasses.dataclass(frozen=True)
class ScalerStats:
    steps: int
    skipped_steps: int
    growths: int
    backoffs: int


def _from_struct(cls, s):
    return cls(**{f.name: getattr(s, f.name) for f in dataclasses.fields(cls)})


def _sync_info(s):
    if s.overflow_at == ffi.GRADACC_OVERFLOW_AT_GRADIENT:
        overflow = OverflowAt(s.overflow_rank, s.overflow_microbatch, s.overflow_tensor)
    elif s.overflow_at == ffi.GRADACC_OVERFLOW_AT_REDUCTION:
        overflow = "reduction"
    else:
        overflow = None
    return SyncInfo(s.found_inf, s.total_count, s.microbatches, s.grad_norm, s.clip_coef,
                    s.dropped_microbatches, overflow)


def _out_struct(struct_type):
    """An output struct with its struct_size set, as the C API requires."""
    out = struct_type()
    out.struct_size = ctypes.sizeof(struct_type)
    return out


# ---- buffers --------------------------------------------------------------------------------

# numpy dtype names accepted for each gradacc dtype. 16-bit words as uint16 are accepted for fp16
# and bf16 (numpy has no bfloat16; ml_dtypes' is named "bfloat16").
_ACCEPTED = {
    DType.F32: ("float32",),
    DType.F16: ("float16", "uint16"),
    DType.BF16: ("bfloat16", "uint16"),
}
# The same as numpy dtype objects: a set lookup, where reading `dtype.name` costs microseconds,
# which over a thousand tensors per add was most of a call.
_ACCEPTED_NUMPY = {d: {np.dtype(n) for n in names if n != "bfloat16"} for d, names in _ACCEPTED.items()}
_DTYPE_NAMES = {
    "f32": DType.F32, "float32": DType.F32, "float": DType.F32, "fp32": DType.F32,
    "f16": DType.F16, "float16": DType.F16, "half": DType.F16, "fp16": DType.F16,
    "bf16": DType.BF16, "bfloat16": DType.BF16,
}


def _dtype(value):
    if isinstance(value, str):
        key = value.lower().rsplit(".", 1)[-1]  # also "torch.float16"
        if key in _DTYPE_NAMES:
            return _DTYPE_NAMES[key]
        raise ValueError(f"unknown dtype {value!r}: use 'f32', 'f16' or 'bf16'")
    if isinstance(value, (np.dtype, type)):
        return _dtype(np.dtype(value).name)
    return DType(value)


def _enum(cls, value, field):
    if not isinstance(value, str):
        return int(value)  # the C API validates ints
    try:
        return cls[value.upper()]
    except KeyError:
        names = ", ".join(repr(m.name.lower()) for m in cls)
        raise ValueError(f"unknown {field} {value!r}: use one of {names}") from None


def _wire_dtype(value):
    # A name or a numpy dtype as for tensors; an int goes in as is, the C API validates it.
    return int(value) if isinstance(value, int) else int(_dtype(value))


def _buffer(obj, dtype, what, writable=False):
    """(address, numel or None, object to keep alive) of a buffer: a numpy array, an object with
    __array_interface__ or data_ptr() (e.g. a torch tensor), or a raw address as an int."""
    if isinstance(obj, int) and not isinstance(obj, bool):
        return obj, None, None
    if isinstance(obj, np.ndarray) or hasattr(obj, "__array_interface__"):
        arr = obj if isinstance(obj, np.ndarray) else np.asarray(obj)  # no copy: same memory
        if not arr.flags.c_contiguous:
            raise ValueError(f"{what} must be C-contiguous (got strides {arr.strides})")
        if writable and not arr.flags.writeable:
            raise ValueError(f"{what} must be writable")
        if dtype is not None and arr.dtype not in _ACCEPTED_NUMPY[dtype] and arr.dtype.name not in _ACCEPTED[dtype]:
            raise GradaccDtypeError(ffi.GRADACC_STATUS_DTYPE_MISMATCH, f"{what} has dtype {arr.dtype.name}, but the tensor is declared "
                            f"{dtype.name} (accepted: {', '.join(_ACCEPTED[dtype])})")
        return arr.ctypes.data, arr.size, arr
    if hasattr(obj, "data_ptr"):
        if hasattr(obj, "is_contiguous") and not obj.is_contiguous():
            raise ValueError(f"{what} must be contiguous")
        name = str(getattr(obj, "dtype", "")).rsplit(".", 1)[-1]
        if dtype is not None and name in _DTYPE_NAMES and _DTYPE_NAMES[name] != dtype:
            raise GradaccDtypeError(ffi.GRADACC_STATUS_DTYPE_MISMATCH, f"{what} has dtype {name}, but the tensor is declared {dtype.name}")
        numel = obj.numel() if hasattr(obj, "numel") else None
        return int(obj.data_ptr()), numel, obj
    raise TypeError(f"{what}: expected a numpy array, an object with __array_interface__ or "
                    f"data_ptr(), or an address (int); got {type(obj).__name__}")


def _device(device):
    d = ffi.gradacc_device_t()
    if device is None or device == "cpu":
        d.kind = ffi.GRADACC_DEVICE_CPU
    elif isinstance(device, tuple) and device and device[0] == "cuda":
        d.kind = ffi.GRADACC_DEVICE_CUDA
        d.ordinal = device[1] if len(device) > 1 else 0
        d.stream = device[2] if len(device) > 2 else None
    else:
        raise ValueError(f"device must be None, 'cpu' or ('cuda', ordinal, stream); got {device!r}")
    return d


def _config(struct, default_fn, config, fields, enums):
    if config is None:
        config = struct()
        _check(default_fn(ctypes.byref(config)))
    else:
        config = struct.from_buffer_copy(config)
    names = {n for n, _ in struct._fields_} - {"struct_size"}
    for key, value in fields.items():
        if key not in names:
            raise TypeError(f"unknown {struct.__name__} field {key!r} (fields: {', '.join(sorted(names))})")
        conv = enums.get(key)
        if isinstance(conv, type) and issubclass(conv, enum.Enum):
            value = _enum(conv, value, key)
        elif conv is not None:
            value = conv(value)
        setattr(config, key, value)
    return config


# ---- owned handles --------------------------------------------------------------------------

class _Managed:
    """Owns one C handle: close() (idempotent), ``with``, and __del__ all free it exactly once."""
    _ptr = None
    _destroy = None

    def close(self):
        ptr, self._ptr = self._ptr, None
        if ptr:
            type(self)._destroy(ptr)  # single ownership: the handle is known, so this succeeds

    @property
    def closed(self):
        return self._ptr is None

    def _handle(self):
        if self._ptr is None:
            raise ValueError(f"this {type(self).__name__} is closed")
        return self._ptr

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown may have torn the module down already
            pass


class Communicator(_Managed):
    """One rank's endpoint of a data-parallel group (see :func:`local_group`)."""
    _destroy = staticmethod(lambda p: ffi.gradacc_comm_destroy(p))

    def __init__(self, handle):
        self._ptr = handle

    @property
    def rank(self):
        out = ctypes.c_int32()
        _check(ffi.gradacc_comm_rank(self._handle(), ctypes.byref(out)))
        return out.value

    @property
    def world_size(self):
        out = ctypes.c_int32()
        _check(ffi.gradacc_comm_world_size(self._handle(), ctypes.byref(out)))
        return out.value

    @property
    def timeout(self):
        """How long a collective may wait for the other ranks, in seconds (default 600); None
        waits forever (as does 0, the C API's value for it). Past it, the sync raises
        :class:`GradaccTimeoutError` and the communicator is aborted. Setting it applies to the
        collectives that start later; negative, NaN and infinite values raise GradaccError
        (INVALID_ARGUMENT)."""
        out = ctypes.c_double()
        _check(ffi.gradacc_comm_timeout(self._handle(), ctypes.byref(out)))
        return out.value or None

    @timeout.setter
    def timeout(self, seconds):
        _check(ffi.gradacc_comm_set_timeout(self._handle(), 0.0 if seconds is None else float(seconds)))

    def abort(self):
        """Aborts this rank's communicator (after a peer died): a sync blocked in it on another
        thread, and every later one, raises GradaccError with COMM_FAILURE. In-process, every
        rank of the group fails. The handle still needs close()."""
        _check(ffi.gradacc_comm_abort(self._handle()))

    def split(self, color, key):
        """This rank's communicator of a split: the ranks that pass the same ``color`` form a
        group, ranked by ``key`` (MPI_Comm_split for an MPI communicator; an in-process one
        raises INVALID_ARGUMENT). Collective: every rank of the group calls it."""
        out = ctypes.POINTER(ffi.gradacc_comm_t)()
        _check(ffi.gradacc_comm_split(self._handle(), _u32(color, "color"), _u32(key, "key"), ctypes.byref(out)))
        return Communicator(out)


def local_group(world_size):
    """An in-process group of ``world_size`` ranks: a list of communicators, rank 0 first. Give
    communicator r to the thread that runs rank r; every rank must take part in every sync."""
    # int32_t in the C API: ctypes would truncate a larger value silently, so it goes in as -1 and
    # the library reports it.
    n = world_size if -(2**31) <= world_size < 2**31 else -1
    raw = (ctypes.POINTER(ffi.gradacc_comm_t) * (max(world_size, 1) if n == world_size else 1))()
    _check(ffi.gradacc_comm_create_local(n, raw))
    return [Communicator(raw[r]) for r in range(world_size)]


class Scaler(_Managed):
    """A dynamic loss scaler. ``Scaler(init_scale=1024.0, hysteresis=2, ...)`` changes fields of
    the default config (gradacc_scaler_config_default); ``config=`` takes a whole
    ``gradacc_scaler_config_t``. ``device``: None / 'cpu', or ('cuda', ordinal, stream)."""
    _destroy = staticmethod(lambda p: ffi.gradacc_scaler_destroy(p))

    def __init__(self, config=None, *, device=None, **fields):
        cfg = _config(ffi.gradacc_scaler_config_t, ffi.gradacc_scaler_config_default, config, fields, {})
        out = ctypes.POINTER(ffi.gradacc_scaler_t)()
        _check(ffi.gradacc_scaler_create(ctypes.byref(cfg), ctypes.byref(_device(device)), ctypes.byref(out)))
        self._ptr = out

    @property
    def scale(self):
        """The current loss scale (synchronises with the stream on CUDA)."""
        out = ctypes.c_float()
        _check(ffi.gradacc_scaler_scale(self._handle(), ctypes.byref(out)))
        return out.value

    def scale_loss(self, loss, dtype=None, numel=None):
        """Multiplies the loss buffer in place by the current scale. The dtype comes from the
        array (float32 / float16 / bfloat16); give it for uint16 words or a raw address."""
        dt = _dtype(dtype) if dtype is not None else None
        if dt is None:
            name = getattr(getattr(loss, "dtype", None), "name", str(getattr(loss, "dtype", "")))
            name = name.rsplit(".", 1)[-1]
            if name not in _DTYPE_NAMES:
                raise TypeError(f"cannot tell the loss dtype from {name or type(loss).__name__!r}: pass dtype=")
            dt = _DTYPE_NAMES[name]
        ptr, n, keep = _buffer(loss, dt, "loss", writable=True)
        n = numel if numel is not None else n
        if n is None:
            raise TypeError("pass numel= with a raw address")
        _check(ffi.gradacc_scaler_scale_loss(self._handle(), ptr, n, dt))
        del keep

    def update(self, *accumulators):
        """Ends an optimizer step from the synced accumulators; True means: skip the step."""
        arr = (ctypes.POINTER(ffi.gradacc_accumulator_t) * len(accumulators))(
            *(a._handle() for a in accumulators))
        skipped = ctypes.c_bool()
        _check(ffi.gradacc_scaler_update(self._handle(), arr, len(accumulators), ctypes.byref(skipped)))
        return skipped.value

    @property
    def stats(self):
        out = _out_struct(ffi.gradacc_scaler_stats_t)
        _check(ffi.gradacc_scaler_stats(self._handle(), ctypes.byref(out)))
        return _from_struct(ScalerStats, out)

    def save(self):
        """The complete state as versioned bytes."""
        n = ctypes.c_size_t()
        _check(ffi.gradacc_scaler_save(self._handle(), None, 0, ctypes.byref(n)))
        buf = (ctypes.c_uint8 * n.value)()
        _check(ffi.gradacc_scaler_save(self._handle(), buf, n.value, ctypes.byref(n)))
        return bytes(buf)[: n.value]

    def load(self, state):
        data = bytes(state)
        _check(ffi.gradacc_scaler_load(self._handle(), (ctypes.c_uint8 * len(data)).from_buffer_copy(data), len(data)))


class BoundGrads:
    """Gradient buffers checked and converted once by :meth:`Accumulator.bind`."""

    __slots__ = ("_acc", "_array", "_keep")

    def __init__(self, acc, array, keep):
        self._acc, self._array, self._keep = acc, array, keep

    def __len__(self):
        return len(self._array)


class Accumulator(_Managed):
    """FP32 master gradients of a list of tensors, each ``(numel, dtype)`` with dtype 'f32',
    'f16', 'bf16' (or a DType, or a numpy dtype). Config fields are keywords
    (``normalize='by_world'``, ``loss_reduction='sum'``, ``max_grad_norm=1.0``, ...).

    ``sharding='reduce_scatter', shard_count=n, shard_rank=r`` makes the boundary a
    reduce-scatter: :meth:`sync` takes a communicator of ``n`` ranks on which this is rank
    ``r``, and after it only :meth:`shard` holds the reduced gradient (the bits an unsharded
    sync leaves in that range); the norm and clipping are still the whole gradient's.
    :meth:`sync_hybrid` takes such a shard group and a replica group (HSDP).
    ``wire_dtype`` ('f32', the default, or 'bf16') is the dtype the reductions send.
    ``overflow`` is what a non-finite gradient costs: 'skip_step' (the default) skips the
    window's step; 'drop_microbatch' drops only the micro-batch that held it, on the rank that
    fed it, and
    :meth:`sync`'s :class:`SyncInfo` says how many were dropped and where.
    ``tensor_stats=True`` has every boundary also measure each tensor, read with
    :meth:`tensor_stats` (a value other than 0 or 1 raises INVALID_ARGUMENT). Both run on
    every device and sharding policy. docs/overflow.md states the contract.

    ``sharding='accumulate', shard_count=n, shard_rank=r, comm=c`` is sharded accumulation
    (ZeRO-2) over ``c``, a communicator of ``n`` ranks on which this is rank ``r``: the
    accumulator holds only its shard (:meth:`shard`, or :meth:`shard_ptr` on CUDA), and every
    micro-batch and :meth:`sync` is a collective over ``c``, each rank calling from its own
    thread. docs/sharding.md ("Sharded accumulation (ZeRO-2)") states the contract: what each
    rank holds, the calls every rank makes, how a failure ends and what the result equals. A
    failure the library reports raises :class:`GradaccError` with the page's status
    (``Status.PEER_FAILURE`` for GRADACC_STATUS_PEER_FAILURE); the checks of :meth:`add` and
    :meth:`sync` themselves (gradient count or length, a closed scaler or communicator) raise
    ``ValueError`` or ``TypeError`` here and still fail the other ranks at once. The accumulator
    keeps ``c`` referenced, and the library keeps the group: ``c.close()`` releases only ``c``'s
    handle, and :meth:`sync` then goes on without it. ``master=`` cannot be adopted."""
    _destroy = staticmethod(lambda p: ffi.gradacc_accumulator_destroy(p))
    _comm = None

    def __init__(self, tensors, config=None, *, device=None, master=None, comm=None, **fields):
        specs = [(int(numel), _dtype(dtype)) for numel, dtype in tensors]
        cfg = _config(ffi.gradacc_accumulator_config_t, ffi.gradacc_accumulator_config_default, config, fields,
                      {"normalize": Normalize, "loss_reduction": LossReduction, "sharding": Sharding,
                       "wire_dtype": _wire_dtype, "overflow": Overflow, "tensor_stats": int})
        descs = (ffi.gradacc_tensor_desc_t * len(specs))(*specs)
        dev = _device(device)
        out = ctypes.POINTER(ffi.gradacc_accumulator_t)()
        self._master_keep = self._comm = None
        if comm is not None:
            if master is not None:
                raise ValueError("a sharded accumulation (comm=) owns its shard: it cannot adopt master=")
            _check(ffi.gradacc_accumulator_create_sharded(ctypes.byref(cfg), descs, len(specs), ctypes.byref(dev),
                                                          comm._handle(), ctypes.byref(out)))
            self._comm = comm  # every micro-batch reduces over it (the library keeps the group too)
        elif master is None:
            _check(ffi.gradacc_accumulator_create(ctypes.byref(cfg), descs, len(specs), ctypes.byref(dev),
                                                  ctypes.byref(out)))
        else:
            ptr, n, keep = _buffer(master, DType.F32, "master", writable=True)
            if n is None:
                n = Accumulator.master_numel(specs)  # the tensors with the padding that aligns each
            _check(ffi.gradacc_accumulator_create_with_buffer(
                ctypes.byref(cfg), descs, len(specs), ctypes.byref(dev),
                ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), n, ctypes.byref(out)))
            self._master_keep = keep  # the adopted buffer must outlive the accumulator
        self._ptr = out
        self._tensors = specs
        self._on_host = dev.kind == ffi.GRADACC_DEVICE_CPU

    def close(self):
        super().close()
        self._comm = None  # the handle is gone, and with it the need for its communicator

    @property
    def tensors(self):
        """The declared ``(numel, DType)`` of each tensor."""
        return list(self._tensors)

    def __len__(self):
        return len(self._tensors)

    def add(self, scaler, grads, count):
        """One micro-batch of ``count`` items: ``grads[i]`` is tensor i's gradient, or ``grads``
        is what :meth:`bind` returned for the same buffers (one C call, nothing converted)."""
        self._add(scaler, grads, count, ffi.gradacc_accumulator_add)

    def add_final(self, scaler, grads, count):
        """:meth:`add` of the window's last micro-batch, which the boundary follows: on the CPU
        the add also measures the norm, so a boundary that reduces nothing between ranks reads
        the master no more. The same bits as :meth:`add` (docs/optimizer.md, "The norm inside
        the last add")."""
        self._add(scaler, grads, count, ffi.gradacc_accumulator_add_final)

    def _add(self, scaler, grads, count, add):
        try:
            count = _unsigned(count, "count")
            bound = grads if isinstance(grads, BoundGrads) else self.bind(grads)
            if bound._acc is not self:
                raise ValueError("these gradients were bound to another accumulator")
            s = scaler._handle()
        except Exception:
            self._refuse_add(scaler)
            raise
        _check(add(self._handle(), s, bound._array, len(bound._array), count))

    def _refuse_add(self, scaler):
        """After add's own checks refused its arguments: a C add that the library refuses on every
        rank (no gradients), so that a sharded accumulation's other ranks, already in this
        micro-batch's reduction, fail at once instead of at their timeout. Elsewhere it only fails
        here (its status is dropped: the caller raises its own error)."""
        if self._ptr is not None:
            s = scaler._ptr if isinstance(scaler, Scaler) else None  # None once closed
            ffi.gradacc_accumulator_add(self._ptr, s, None, 0, 0)

    def bind(self, grads):
        """Checks and converts the gradient buffers once (dtype, length, contiguity) for
        :meth:`add`: a training loop whose backward writes into the same buffers every
        micro-batch passes the result to each ``add``. The buffers are referenced, not copied,
        and kept alive by the result; ``add`` reads what they hold when it is called."""
        if len(grads) != len(self._tensors):
            raise GradaccSizeError(ffi.GRADACC_STATUS_SIZE_MISMATCH, f"{len(grads)} gradients for {len(self._tensors)} tensors")
        ptrs, keep = [], []
        for i, (g, (numel, dt)) in enumerate(zip(grads, self._tensors)):
            ptr, n, k = _buffer(g, dt, f"grads[{i}]")
            # add() takes no lengths, so a short buffer would be read past its end: check here.
            if n is not None and n != numel:
                raise GradaccSizeError(ffi.GRADACC_STATUS_SIZE_MISMATCH, f"grads[{i}] has {n} elements, but tensor {i} has {numel}")
            ptrs.append(ptr)
            keep.append(k)
        return BoundGrads(self, (ctypes.c_void_p * len(ptrs))(*ptrs), keep)

    def begin_microbatch(self, count):
        try:
            count = _unsigned(count, "count")
        except ValueError:
            if self._ptr is not None:
                ffi.gradacc_accumulator_begin_microbatch(self._ptr, _REFUSED_COUNT)
            raise
        _check(ffi.gradacc_accumulator_begin_microbatch(self._handle(), count))

    def add_tensor(self, scaler, index, grad, numel=None):
        """One contribution to tensor ``index`` of the open micro-batch (several may be summed)."""
        try:
            dt = self._tensors[index][1] if 0 <= index < len(self._tensors) else None
            ptr, n, keep = _buffer(grad, dt, "grad")
            n = numel if numel is not None else n
            if n is None:
                raise TypeError("pass numel= with a raw address")
            index, n = _unsigned(index, "index"), _unsigned(n, "numel")
            s = scaler._handle()
        except Exception:
            self._refuse_tensor(scaler)
            raise
        _check(ffi.gradacc_accumulator_add_tensor(self._handle(), s, index, ptr, n))
        del keep

    def _refuse_tensor(self, scaler):
        """After add_tensor's own checks refused its arguments: a C add_tensor that the library
        refuses (no gradient), so that a sharded accumulation's micro-batch fails on every rank
        when it ends instead of counting this tensor as zeros on the others. Elsewhere it only
        fails here (its status is dropped: the caller raises its own error)."""
        if self._ptr is not None:
            s = scaler._ptr if isinstance(scaler, Scaler) else None  # None once closed
            ffi.gradacc_accumulator_add_tensor(self._ptr, s, 0, None, 0)

    def end_microbatch(self):
        _check(ffi.gradacc_accumulator_end_microbatch(self._handle()))

    @contextlib.contextmanager
    def microbatch(self, count):
        """``with acc.microbatch(n): acc.add_tensor(...)``: begin, then end if the block succeeds
        (on an exception the micro-batch stays open: reset() discards the window)."""
        self.begin_microbatch(count)
        yield self
        self.end_microbatch()

    def sync(self, comm=None):
        """The boundary; with ``comm`` every rank of its group calls it, each on its own thread.
        A sharded accumulation (``comm=`` at creation) syncs over its own communicator: ``comm``
        is None or that one (another raises INVALID_ARGUMENT there, PEER_FAILURE elsewhere)."""
        return self._sync_with(ffi.gradacc_accumulator_sync, comm)

    def sync_for_step(self, comm=None):
        """:meth:`sync` for an :class:`Optimizer` that steps right after: the clip coefficient
        is applied inside the step's pass (bitwise as after :meth:`sync`), saving a pass over the
        gradient, so :meth:`master` and :meth:`shard` then hold the sum before normalisation and
        clipping (the step applies both as one factor): read the reduced gradient yourself only after :meth:`sync`
        (gradacc_accumulator_sync_for_step)."""
        return self._sync_with(ffi.gradacc_accumulator_sync_for_step, comm)

    def _sync_with(self, call, comm):
        info = _out_struct(ffi.gradacc_sync_info_t)
        try:
            c = comm._handle() if comm is not None else None
        except Exception:
            if self._ptr is not None:
                # A sharded accumulation's other ranks are already in the boundary: a C sync
                # with struct_size 0 is refused on every rank, so they fail at once.
                call(self._ptr, None, ctypes.byref(ffi.gradacc_sync_info_t()))
            raise
        _check(call(self._handle(), c, ctypes.byref(info)))
        return _sync_info(info)

    def sync_hybrid(self, shard_comm, replica_comm):
        """The hybrid boundary (HSDP) of an accumulator with ``sharding='reduce_scatter'`` or
        ``'accumulate'``: a reduce-scatter over ``shard_comm`` (its shard group: ``shard_count``
        ranks, this one ``shard_rank``; for a sharded accumulation, its own communicator, which
        reduced every micro-batch already), then an all-reduce of the shard over
        ``replica_comm``, the ranks that hold the same shard in the other shard groups. Every
        rank of both groups calls it, each on its own thread. Counts, overflow and the norm are
        the whole grid's, the same on every rank, and replicas hold the same bits
        (:meth:`shard`). Replica groups pairing different shards raise SIZE_MISMATCH, and an
        unsharded accumulator INVALID_ARGUMENT, on every rank with the window intact. Which
        communicators a device takes: gradacc_accumulator_sync_hybrid and docs/sharding.md
        ("Hybrid groups")."""
        info = _out_struct(ffi.gradacc_sync_info_t)
        objs = (shard_comm, replica_comm)
        if self._ptr is None or not all(isinstance(c, Communicator) and c._ptr is not None for c in objs):
            # The C call still takes part in the open groups' exchange, so their ranks fail at once.
            ffi.gradacc_accumulator_sync_hybrid(
                self._ptr, *(c._ptr if isinstance(c, Communicator) else None for c in objs), ctypes.byref(info))
            for x in (self, *objs):
                x._handle()  # raises the binding's error for the closed one
        _check(ffi.gradacc_accumulator_sync_hybrid(self._handle(), shard_comm._handle(), replica_comm._handle(),
                                                   ctypes.byref(info)))
        return _sync_info(info)

    def tensor_stats(self):
        """Each tensor's :class:`TensorStats` ``(grad_norm, nonfinite_microbatches)`` of the last
        boundary, a list in tensor order; they last until the next window's first micro-batch.
        Raises :class:`GradaccError` with WRONG_STATE when the accumulator was created without
        ``tensor_stats=True``, and before a sync."""
        n = len(self._tensors)
        norms, counts = (ctypes.c_double * n)(), (ctypes.c_uint64 * n)()
        _check(ffi.gradacc_accumulator_tensor_stats(self._handle(), norms, counts, n))
        return [TensorStats(norms[i], counts[i]) for i in range(n)]

    def master_ptr(self, index):
        """(address, numel) of tensor ``index``'s FP32 master (a device pointer on CUDA)."""
        p = ctypes.POINTER(ctypes.c_float)()
        n = ctypes.c_size_t()
        _check(ffi.gradacc_accumulator_master(self._handle(), _unsigned(index, "index"), ctypes.byref(p),
                                              ctypes.byref(n)))
        return ctypes.cast(p, ctypes.c_void_p).value, n.value

    def master(self, index):
        """Tensor ``index``'s FP32 master gradient as a writable 1-D float32 numpy view (no copy).

        The view keeps this Accumulator object alive, but not its C buffer past close(): it is
        valid until the accumulator is closed (or collected after its last reference, view
        included, is gone). It holds the boundary's result after sync() and a window in progress
        otherwise; do not read it while another thread adds. Copy it (``.copy()``) to keep it.
        A sharded accumulation holds only its shard: a tensor not wholly inside it raises
        INVALID_ARGUMENT (use :meth:`shard`)."""
        if not self._on_host:
            raise ValueError("master() views host memory; use master_ptr() for a CUDA accumulator")
        addr, n = self.master_ptr(index)
        if n == 0:
            return np.zeros(0, np.float32)
        raw = (ctypes.c_float * n).from_address(addr)
        raw._owner = self  # the numpy view's base is `raw`, which keeps the accumulator alive
        return np.frombuffer(raw, dtype=np.float32)

    @staticmethod
    def master_numel(tensors):
        """The flat master's length, in float32 elements, of an accumulator over ``tensors``
        (``(numel, dtype)`` pairs): each tensor starts at a multiple of :data:`MASTER_ALIGN`
        bytes, with zeros between and after the last. What an adopted ``master=`` must hold."""
        specs = [(int(numel), _dtype(dtype)) for numel, dtype in tensors]
        descs = (ffi.gradacc_tensor_desc_t * len(specs))(*specs)
        total = ctypes.c_size_t()
        _check(ffi.gradacc_accumulator_master_numel(descs, len(specs), ctypes.byref(total)))
        return total.value

    def offset(self, index):
        """Where tensor ``index`` starts in the flat master, in elements (a multiple of
        :data:`MASTER_ALIGN` / 4): with :meth:`shard`'s range it tells which tensors a shard
        holds."""
        out = ctypes.c_size_t()
        _check(ffi.gradacc_accumulator_offset(self._handle(), _unsigned(index, "index"), ctypes.byref(out)))
        return out.value

    def shard_ptr(self):
        """(offset, numel, address) of this rank's shard of the flat FP32 master (a device
        pointer on CUDA); see :meth:`shard`."""
        offset, n = ctypes.c_size_t(), ctypes.c_size_t()
        p = ctypes.POINTER(ctypes.c_float)()
        _check(ffi.gradacc_accumulator_shard(self._handle(), ctypes.byref(offset), ctypes.byref(n), ctypes.byref(p)))
        return offset.value, n.value, ctypes.cast(p, ctypes.c_void_p).value

    def shard(self):
        """This rank's shard of the master as a :class:`Shard` ``(offset, numel, data)``: its
        element range in the flat layout (the tensors one after another, each at :meth:`offset`,
        zeros between) and a writable float32
        numpy view of it (no copy), valid as :meth:`master`'s views are. Without sharding it is
        the whole master. With ``sharding='reduce_scatter'``, after a sync only the shard holds
        the reduced gradient; the rest of the master is unspecified until the next window's
        first micro-batch. With ``sharding='accumulate'`` the shard is all the accumulator holds:
        the window's sum over the ranks while accumulating, the reduced gradient after a sync.
        Shards are cut in whole blocks of 4096 elements, so the last ones may be shorter or
        empty. The range never changes."""
        if not self._on_host:
            raise ValueError("shard() views host memory; use shard_ptr() for a CUDA accumulator")
        offset, n, addr = self.shard_ptr()
        if n == 0:
            return Shard(offset, 0, np.zeros(0, np.float32))
        raw = (ctypes.c_float * n).from_address(addr)
        raw._owner = self  # as in master(): the view keeps the accumulator object alive
        return Shard(offset, n, np.frombuffer(raw, dtype=np.float32))

    def reset(self):
        _check(ffi.gradacc_accumulator_reset(self._handle()))

    def save_window(self):
        """The window in progress as versioned bytes (not inside a micro-batch nor after sync). A
        sharded accumulation saves its shard: the bytes load only into the same shard of an
        accumulation over as many ranks (anything else raises CORRUPT_STATE)."""
        n = ctypes.c_size_t()
        _check(ffi.gradacc_accumulator_save_window(self._handle(), None, 0, ctypes.byref(n)))
        buf = (ctypes.c_uint8 * n.value)()
        _check(ffi.gradacc_accumulator_save_window(self._handle(), buf, n.value, ctypes.byref(n)))
        return bytes(buf)[: n.value]

    def load_window(self, state):
        data = bytes(state)
        _check(ffi.gradacc_accumulator_load_window(
            self._handle(), (ctypes.c_uint8 * len(data)).from_buffer_copy(data), len(data)))

    def merge_window(self, state):
        """Adds a window written by save_window() (of an accumulator with the same tensors, on any
        rank or device) into the current one: masters, counts and micro-batches add, overflow
        flags OR. Windows saved on N ranks resume on M. Corrupt bytes raise (CORRUPT_STATE) and
        leave the window unchanged."""
        data = bytes(state)
        _check(ffi.gradacc_accumulator_merge_window(
            self._handle(), (ctypes.c_uint8 * len(data)).from_buffer_copy(data), len(data)))


# ---- the optimizer --------------------------------------------------------------------------

_ALGORITHM_NAMES = {"adamw": Algorithm.ADAMW, "sgd": Algorithm.SGD}
_ROUNDING_NAMES = {"nearest": Rounding.NEAREST_EVEN, "nearest_even": Rounding.NEAREST_EVEN,
                   "stochastic": Rounding.STOCHASTIC}
_MASTERS_NAMES = {"fp32": Masters.FP32, "bf16_remainder": Masters.BF16_REMAINDER,
                  "none": Masters.NONE}
_MOMENTS_NAMES = {"fp32": Moments.FP32, "bf16": Moments.BF16,
                  "int8_blockwise": Moments.INT8_BLOCKWISE}
# FP8 weight formats: (the C value, the bytes of one scale, scales for `numel` elements).
_FP8_FORMATS = {"e4m3": (ffi.GRADACC_WEIGHTS_E4M3_TENSORWISE, 4, lambda numel: 1),
                "mxfp8": (ffi.GRADACC_WEIGHTS_MXFP8, 1, lambda numel: -(-numel // 32))}


def _fp8_array(obj, itemsize, numel, what):
    """(address, object to keep alive) of a writable buffer of `numel` items of `itemsize` bytes."""
    ptr, size, keep = _buffer(obj, None, what, writable=True)
    if isinstance(keep, np.ndarray) and keep.itemsize != itemsize:
        raise GradaccDtypeError(ffi.GRADACC_STATUS_DTYPE_MISMATCH,
                                f"{what} has {keep.itemsize}-byte items ({keep.dtype.name}), but takes {itemsize}-byte ones")
    if size is not None and size != numel:
        raise GradaccSizeError(ffi.GRADACC_STATUS_SIZE_MISMATCH, f"{what} has {size} elements, but takes {numel}")
    return ptr, keep


def _choice(names, what, value):
    """An enum value from a name (case-insensitive) or an int (the C API validates ints)."""
    if isinstance(value, str):
        key = value.lower()
        if key not in names:
            raise ValueError(f"{what}={value!r}: use {' or '.join(repr(n) for n in names)}")
        return int(names[key])
    return int(value)


def _weight_dtype(w, declared, i):
    """The dtype of model weight ``i``: float32 / float16 / bfloat16 from the array, and 16-bit
    words (uint16, or a raw address) as the tensor's gradient dtype when that is 16-bit."""
    name = str(getattr(w, "dtype", "")).rsplit(".", 1)[-1]
    if name in _DTYPE_NAMES:
        return _DTYPE_NAMES[name]
    if name in ("uint16", "") and declared != DType.F32:
        return declared
    raise TypeError(f"weights[{i}]: cannot tell its dtype from {name or type(w).__name__!r}; "
                    f"pass dtypes= (uint16 words are f16 or bf16)")


def _group(g, i):
    if isinstance(g, dict):
        unknown = set(g) - {"weight_decay", "lr_scale"}
        if unknown:
            raise TypeError(f"groups[{i}]: unknown key(s) {', '.join(sorted(unknown))} "
                            "(keys: weight_decay, lr_scale)")
        return bool(g.get("weight_decay", True)), float(g.get("lr_scale", 1.0))
    weight_decay, lr_scale = g
    return bool(weight_decay), float(lr_scale)


class Optimizer(_Managed):
    """FP32 master weights and AdamW or SGD state for the tensors of ``acc``, stepped after each
    sync; it writes the model's ``weights`` (one writable, C-contiguous array per tensor: float32,
    float16, or bfloat16 / uint16 words) in place.

    ``Optimizer(acc, weights, algorithm="adamw", lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
    weight_decay=0.01)`` or ``algorithm="sgd"`` with ``momentum``, ``dampening``, ``nesterov`` and
    ``weight_decay`` (0 unless given, as in ``torch.optim.SGD``); ``rounding="nearest"`` or
    ``"stochastic"`` with ``seed``; ``moments="bf16"`` (with ``moment_seed``) keeps the moments in
    bf16, rounded stochastically, ``moments="int8_blockwise"`` in 8-bit blocks (CPU only), and
    ``master_format="bf16_remainder"`` keeps each master as its bf16
    weight plus a 16-bit remainder (bf16 weights only), ``master_format="none"`` keeps no
    masters (the weights are; 16-bit weights need ``rounding="stochastic"``; docs/optimizer.md,
    "Smaller state").
    ``config=`` takes a whole ``gradacc_optimizer_config_t``.
    ``groups`` gives each tensor ``(weight_decay, lr_scale)`` (or a dict of those keys);
    ``dtypes`` the weights' dtypes where the arrays do not say. The masters start as the weights'
    values (for this rank's shard under a sharded boundary). On a CUDA accumulator the weights are
    device memory: addresses (ints, with ``dtypes``) or objects with ``data_ptr()`` such as torch
    CUDA tensors; the masters and state then live in device memory and ``step`` is enqueued on the
    accumulator's stream.

    The contract is gradacc_optimizer_create's and gradacc_optimizer_step's (include/gradacc.h)
    and docs/optimizer.md: one step per synced window, a skipped window changes nothing, and under
    sharding every rank steps and all-gathers the weights. The weights are referenced, not
    copied: they must stay the model's buffers for the optimizer's life.

    ``masters=`` adopts the caller's FP32 master weights (gradacc_optimizer_create_with_masters):
    a writable, C-contiguous float32 array (a device address, or an object with ``data_ptr()``,
    on a CUDA accumulator) of this rank's range of the flat layout, ``acc.shard()``'s length
    (tensor i at ``acc.offset(i) - shard.offset``). Its values are the masters, not overwritten
    from the weights; every step updates it in place, and ``load`` writes into it. It is
    referenced, not copied, and must not be written while a call runs.

    ``fp8={i: (format, codes, scales)}`` makes the step write tensor i as FP8 for the all-gather
    of a sharded boundary (docs/optimizer.md, "FP8 weights on the all-gather"): ``format``
    ``"e4m3"`` (one float32 scale per tensor) or ``"mxfp8"`` (one E8M0 byte per block of 32),
    ``codes`` a writable uint8 array of the tensor's length, ``scales`` a float32 array of 1 or a
    uint8 array of ``ceil(numel / 32)``; ``weights[i]`` then gives only the initial values. Every
    step writes the codes and scales in place, the same bits on every rank."""
    _destroy = staticmethod(lambda p: ffi.gradacc_optimizer_destroy(p))

    def __init__(self, acc, weights, *, config=None, groups=None, dtypes=None, masters=None,
                 master_format=None, fp8=None, **fields):
        n = len(acc)
        if master_format is not None:
            fields["masters"] = master_format  # the config's field; `masters=` adopts a buffer
        if len(weights) != n:
            raise ValueError(f"weights: {len(weights)} arrays for {n} tensors")
        for what, seq in (("groups", groups), ("dtypes", dtypes)):
            if seq is not None and len(seq) != n:
                raise ValueError(f"{what}: {len(seq)} entries for {n} tensors")
        algorithm = fields.get("algorithm")
        if config is None and "weight_decay" not in fields and algorithm is not None \
                and _choice(_ALGORITHM_NAMES, "algorithm", algorithm) == Algorithm.SGD:
            fields["weight_decay"] = 0.0  # torch.optim.SGD's default, not AdamW's 0.01
        cfg = _config(ffi.gradacc_optimizer_config_t, ffi.gradacc_optimizer_config_default, config, fields,
                      {"algorithm": lambda v: _choice(_ALGORITHM_NAMES, "algorithm", v),
                       "rounding": lambda v: _choice(_ROUNDING_NAMES, "rounding", v),
                       "masters": lambda v: _choice(_MASTERS_NAMES, "master_format", v),
                       "moments": lambda v: _choice(_MOMENTS_NAMES, "moments", v)})
        fp8 = dict(fp8 or {})
        formats = (ffi.gradacc_weight_format_t * n)()
        codes_at, scales_at = [None] * n, [None] * n
        fp8_keep = []
        for i, spec in fp8.items():
            if not isinstance(i, int) or not 0 <= i < n:
                raise ValueError(f"fp8: {i!r} is not a tensor index (0 to {n - 1})")
            format_, codes_buf, scales_buf = spec
            if format_ not in _FP8_FORMATS:
                raise ValueError(f"fp8[{i}]: format {format_!r} is not one of {', '.join(_FP8_FORMATS)}")
            value, scale_bytes, scales_of = _FP8_FORMATS[format_]
            numel = acc.tensors[i][0]
            formats[i] = value
            codes_at[i], k1 = _fp8_array(codes_buf, 1, numel, f"fp8[{i}] codes")
            scales_at[i], k2 = _fp8_array(scales_buf, scale_bytes, scales_of(numel), f"fp8[{i}] scales")
            fp8_keep += [k1, k2]
        if fp8:
            cfg.weight_formats = ctypes.cast(formats, ctypes.POINTER(ffi.gradacc_weight_format_t))
        ptrs, keep, codes = [], [], []
        for i, (w, (numel, declared)) in enumerate(zip(weights, acc.tensors)):
            dt = _dtype(dtypes[i]) if dtypes is not None else _weight_dtype(w, declared, i)
            ptr, size, k = _buffer(w, dt, f"weights[{i}]", writable=True)
            # The C API takes no lengths, so a short buffer would be read past its end.
            if size is not None and size != numel:
                raise GradaccSizeError(ffi.GRADACC_STATUS_SIZE_MISMATCH, f"weights[{i}] has {size} elements, but tensor {i} has {numel}")
            ptrs.append(ptr)
            keep.append(k)
            codes.append(int(dt))
        grp = None
        if groups is not None:
            grp = (ffi.gradacc_tensor_group_t * n)(*(_group(g, i) for i, g in enumerate(groups)))
        self._weights = (ctypes.c_void_p * n)(*ptrs)
        self._keep = keep  # the weights must outlive the optimizer: step writes them
        out = ctypes.POINTER(ffi.gradacc_optimizer_t)()
        codes = (ffi.gradacc_dtype_t * n)(*codes)
        self._masters_keep = None
        if masters is None:
            _check(ffi.gradacc_optimizer_create(acc._handle(), ctypes.byref(cfg), grp, self._weights, codes, n,
                                                ctypes.byref(out)))
        else:
            ptr, size, keep = _buffer(masters, DType.F32, "masters", writable=True)
            if size is None:
                size = acc.shard_ptr()[1]  # a device address: the shard's length
            _check(ffi.gradacc_optimizer_create_with_masters(
                acc._handle(), ctypes.byref(cfg), grp, self._weights, codes, n,
                ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), size, ctypes.byref(out)))
            self._masters_keep = keep  # the adopted masters must outlive the optimizer
        self._ptr = out
        self._acc = acc
        # From now on the step writes an FP8 tensor's codes and scales, not its initial weights.
        self._scales = None
        if fp8:
            for i in fp8:
                self._weights[i] = codes_at[i]
            self._scales = (ctypes.c_void_p * n)(*scales_at)
            self._keep = keep + fp8_keep

    def step(self, comm=None):
        """The step after ``acc.sync()``: writes the weights in place and returns True, or returns
        False and changes nothing when the window held a non-finite value. Under a sharded
        boundary every rank calls it with the communicator its sync took (None: a sharded
        accumulation's own)."""
        stepped = ctypes.c_bool()
        c = comm._handle() if comm is not None else None
        _check(ffi.gradacc_optimizer_step_scaled(self._handle(), self._acc._handle(), self._weights, self._scales,
                                                 len(self._weights), c, ctypes.byref(stepped)))
        return stepped.value

    def set_lr(self, lr):
        """The learning rate of the steps from the next one on."""
        _check(ffi.gradacc_optimizer_set_lr(self._handle(), lr))

    @property
    def lr_device_ptr(self):
        """On a CUDA accumulator, the device address (an int) of the learning rate every step
        reads when it runs, for a schedule on the device (see gradacc_optimizer_lr_device_ptr);
        raises DEVICE_MISMATCH on a CPU accumulator."""
        out = ctypes.c_void_p()
        _check(ffi.gradacc_optimizer_lr_device_ptr(self._handle(), ctypes.byref(out)))
        return out.value or 0

    @property
    def steps(self):
        """The number of steps taken (a skipped step is not one)."""
        out = ctypes.c_uint64()
        _check(ffi.gradacc_optimizer_steps(self._handle(), ctypes.byref(out)))
        return out.value

    def save(self):
        """This rank's state as versioned bytes."""
        n = ctypes.c_size_t()
        _check(ffi.gradacc_optimizer_save(self._handle(), None, 0, ctypes.byref(n)))
        buf = (ctypes.c_uint8 * n.value)()
        _check(ffi.gradacc_optimizer_save(self._handle(), buf, n.value, ctypes.byref(n)))
        return bytes(buf)[: n.value]

    def load(self, parts):
        """Restores the state from what :meth:`save` returned: one part, or a list of the parts
        saved on any number of ranks (together covering this rank's elements, each rank's once).
        Bad parts raise (CORRUPT_STATE), a part given twice too (INVALID_ARGUMENT); either way
        nothing changes."""
        if isinstance(parts, (bytes, bytearray, memoryview)):
            parts = [parts]
        bufs = [(ctypes.c_uint8 * len(d)).from_buffer_copy(d) for d in map(bytes, parts)]
        ptrs = (ctypes.POINTER(ctypes.c_uint8) * len(bufs))(*(ctypes.cast(b, ctypes.POINTER(ctypes.c_uint8))
                                                              for b in bufs))
        lens = (ctypes.c_size_t * len(bufs))(*(len(b) for b in bufs))
        _check(ffi.gradacc_optimizer_load(self._handle(), ptrs, lens, len(bufs)))


# ---- the mesh step --------------------------------------------------------------------------

class MeshPart(typing.NamedTuple):
    """One accumulator of a mesh step and the group it reduces over: ``comm`` None when it is
    alone or for a sharded accumulation's own communicator, ``replicas`` a hybrid boundary's
    replica group, ``replicated`` its replicated tensors as ``(tensor, key, copies)``: a tensor
    ``copies`` model-parallel ranks hold alike (at one data-parallel rank), the same ``key`` on
    every copy, which enters the global norm once."""
    accumulator: "Accumulator"
    comm: typing.Optional[Communicator] = None
    replicas: typing.Optional[Communicator] = None
    replicated: typing.Sequence[typing.Tuple[int, int, int]] = ()


@dataclasses.dataclass(frozen=True)
class MeshInfo(SyncInfo):
    """A mesh step's :class:`SyncInfo`, the same on every rank: the totals over the data axes,
    the global norm, an overflow's rank a world rank; ``overflow_part`` is the part of that
    rank's step it names (None when there is none)."""
    overflow_part: typing.Optional[int] = None


def _u32(value, what):
    value = _unsigned(value, what)
    if value >= 2**32:
        raise ValueError(f"`{what}` = {value}: below 2**32")
    return value


class MeshGroup(typing.NamedTuple):
    """Where a rank sits in its group over some axes: the group's smallest world rank
    (``color``, a split's color), the rank's index in it (``key``: its rank there) and the
    group's ``size``."""
    color: int
    key: int
    size: int


class MeshShape(_Managed):
    """A mesh's shape for frameworks without their own parallel state: ``world_size`` ranks,
    ``tp``, ``pp``, ``cp`` ranks on those axes (data parallel takes the rest), the experts of each
    pipeline stage over ``ep`` x ``etp`` of its ranks; ``order`` the dense axes' rank order,
    fastest first, as Megatron-Core writes it (None: its ``"tp-cp-dp-pp"``). Axis lists are
    names joined by '-': ``"cp-dp"`` (the data axes), ``"tp"``, ``"edp"``."""
    _destroy = staticmethod(lambda p: ffi.gradacc_mesh_shape_destroy(p))

    def __init__(self, world_size, tp=1, pp=1, cp=1, ep=1, etp=1, order=None):
        out = ctypes.POINTER(ffi.gradacc_mesh_shape_t)()
        sizes = [_u32(v, n) for v, n in zip((world_size, tp, pp, cp, ep, etp),
                                             ("world_size", "tp", "pp", "cp", "ep", "etp"))]
        _check(ffi.gradacc_mesh_shape_create(*sizes, None if order is None else order.encode(),
                                             ctypes.byref(out)))
        self._ptr = out

    def group(self, rank, axes):
        """World rank ``rank``'s :class:`MeshGroup` over ``axes``. For :class:`Mesh`,
        ``data_rank`` and ``data_size`` are the key and the size over ``"cp-dp"``."""
        color, key, size = ctypes.c_uint32(), ctypes.c_uint32(), ctypes.c_uint32()
        _check(ffi.gradacc_mesh_shape_group(self._handle(), _u32(rank, "rank"), axes.encode(), ctypes.byref(color),
                                            ctypes.byref(key), ctypes.byref(size)))
        return MeshGroup(color.value, key.value, size.value)

    def split(self, world, axes):
        """This rank's group over ``axes``, split from ``world`` (an MPI communicator of every
        rank of the mesh, ranked as the world). Collective: every rank calls it, with the same
        axes."""
        out = ctypes.POINTER(ffi.gradacc_comm_t)()
        _check(ffi.gradacc_mesh_shape_split(self._handle(), world._handle(), axes.encode(), ctypes.byref(out)))
        return Communicator(out)


class Mesh(_Managed):
    """One boundary over a job's accumulators: ``world``, a communicator of every rank of the
    job, and this rank's data-parallel rank ``data_rank`` of ``data_size`` (the ranks that see
    different data: data-parallel x context-parallel; in Megatron-Core's order, tensor-parallel
    fastest, then context, data, pipeline: ``data_rank = cp + CP * dp``). ``max_grad_norm``
    clips the global norm (0: off). gradacc_mesh_create and gradacc_mesh_sync state the rules."""
    _destroy = staticmethod(lambda p: ffi.gradacc_mesh_destroy(p))

    def __init__(self, world, data_rank, data_size, max_grad_norm=0.0):
        out = ctypes.POINTER(ffi.gradacc_mesh_t)()
        _check(ffi.gradacc_mesh_create(world._handle(), _u32(data_rank, "data_rank"), _u32(data_size, "data_size"),
                                       float(max_grad_norm), ctypes.byref(out)))
        self._ptr = out

    def sync(self, parts):
        """The mesh step over this rank's parts (:class:`MeshPart`), every rank of the world on
        its own thread or process; returns a :class:`MeshInfo`. Every part's window reports it,
        so ``scaler.update`` and each optimizer's step follow it. A closed object in a part is
        passed on as NULL, so that the library refuses the step on every rank, then raises."""
        parts = [p if isinstance(p, MeshPart) else MeshPart(*p) for p in parts]
        raw = (ffi.gradacc_mesh_part_t * max(len(parts), 1))()
        keep, closed = [], None
        for i, p in enumerate(parts):
            objs = (p.accumulator, p.comm, p.replicas)
            if any(o is not None and o._ptr is None for o in objs):
                closed = closed or next(o for o in objs if o is not None and o._ptr is None)
            entries = [(_u32(t, f"parts[{i}].replicated[{j}] tensor"), _u32(c, f"parts[{i}].replicated[{j}] copies"),
                        int(k)) for j, (t, k, c) in enumerate(p.replicated)]
            arr = (ffi.gradacc_replicated_t * max(len(entries), 1))(
                *(ffi.gradacc_replicated_t(tensor=t, copies=c, key=k % 2**64) for t, c, k in entries))
            keep.append(arr)
            r = raw[i]
            r.struct_size = ctypes.sizeof(ffi.gradacc_mesh_part_t)
            # A closed accumulator goes in as NULL: its groups are still told.
            r.accumulator = p.accumulator._ptr if p.accumulator is not None and closed is None else None
            r.comm = p.comm._ptr if p.comm is not None else None
            r.replicas = p.replicas._ptr if p.replicas is not None else None
            if entries:
                r.replicated = ctypes.cast(arr, ctypes.POINTER(ffi.gradacc_replicated_t))
            r.replicated_count = len(entries)
        info = _out_struct(ffi.gradacc_sync_info_t)
        part = ctypes.c_uint32()
        status = ffi.gradacc_mesh_sync(self._handle(), raw if parts else None, len(parts), ctypes.byref(info),
                                       ctypes.byref(part))
        if closed is not None:
            closed._handle()  # raises the binding's error for the closed one
        _check(status)
        s = _sync_info(info)
        overflow_part = None if part.value == 2**32 - 1 else part.value
        return MeshInfo(**{f.name: getattr(s, f.name) for f in dataclasses.fields(SyncInfo)},
                        overflow_part=overflow_part)

    def end_microbatch(self, *accumulators):
        """Ends the open micro-batch of each of this rank's ``accumulators`` (DROP_MICROBATCH,
        fed tensor by tensor), its drop agreed over the world first (gradacc_mesh_end_microbatch);
        every rank calls it once per micro-batch. True: this rank kept it. A closed accumulator
        is passed on as NULL, so that the library fails every rank, then raises."""
        closed = next((a for a in accumulators if a._ptr is None), None)
        arr = (ctypes.POINTER(ffi.gradacc_accumulator_t) * max(len(accumulators), 1))(
            *(a._ptr for a in accumulators))
        kept = ctypes.c_uint32()
        status = ffi.gradacc_mesh_end_microbatch(self._handle(), arr, len(accumulators), ctypes.byref(kept))
        if closed is not None:
            closed._handle()  # raises the binding's error for the closed one
        _check(status)
        return kept.value == 1
