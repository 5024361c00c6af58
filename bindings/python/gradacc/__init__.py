"""gradacc: correct mixed-precision gradient accumulation (Python binding over the C ABI).

    import numpy as np, gradacc

    with gradacc.Scaler() as scaler, gradacc.Accumulator([(4096, "f16"), (64, "f16")]) as acc:
        for batch in micro_batches:
            w_grad, b_grad = backward(batch, scaler.scale)     # numpy float16 arrays
            acc.add(scaler, [w_grad, b_grad], count=len(batch))
        info = acc.sync()                                     # the boundary (comm=None: one process)
        if not scaler.update(acc):
            w -= lr * acc.master(0)                           # a float32 view of the master

numpy has float16 but no bfloat16: bf16 buffers are uint16 arrays of the bits (or ml_dtypes'
``bfloat16`` arrays), and :func:`f32_to_bf16` / :func:`bf16_to_f32` convert float32 to and
from those bits, rounding to nearest even.

Objects own their C handle: ``close()`` (idempotent) or a ``with`` block frees it, ``__del__``
frees it otherwise. Failing calls raise :class:`GradaccError` with the status and the message of
the calling thread. The C header include/gradacc.h states every function's semantics and thread
rules; this layer adds none of its own.
"""
from ._core import (
    Accumulator,
    Algorithm,
    BoundGrads,
    Communicator,
    DType,
    GradaccDtypeError,
    GradaccError,
    GradaccSizeError,
    GradaccTimeoutError,
    LossReduction,
    Mesh,
    MeshGroup,
    MeshInfo,
    MeshPart,
    MeshShape,
    Normalize,
    Masters,
    Moments,
    Optimizer,
    Overflow,
    OverflowAt,
    Rounding,
    Scaler,
    ScalerStats,
    Shard,
    Sharding,
    Status,
    SyncInfo,
    TensorStats,
    local_group,
    version,
)
from ._convert import bf16_to_f32, f32_to_bf16
from ._ffi import GRADACC_MASTER_ALIGN as MASTER_ALIGN
from ._log import LogLevel, diagnostics, log_to_logging, set_log_callback
from ._ffi import GRADACC_VERSION_STRING as HEADER_VERSION

__version__ = HEADER_VERSION
__all__ = [
    "Accumulator",
    "Algorithm",
    "BoundGrads",
    "Communicator",
    "DType",
    "GradaccDtypeError",
    "GradaccError",
    "GradaccSizeError",
    "GradaccTimeoutError",
    "LogLevel",
    "LossReduction",
    "Mesh",
    "MeshGroup",
    "MeshInfo",
    "MeshPart",
    "MeshShape",
    "MASTER_ALIGN",
    "Normalize",
    "Masters",
    "Moments",
    "Optimizer",
    "Overflow",
    "OverflowAt",
    "Rounding",
    "Scaler",
    "ScalerStats",
    "Shard",
    "Sharding",
    "Status",
    "SyncInfo",
    "TensorStats",
    "bf16_to_f32",
    "diagnostics",
    "f32_to_bf16",
    "local_group",
    "log_to_logging",
    "set_log_callback",
    "version",
]
