"""bfloat16 for numpy, which has no such dtype: the bits as uint16 words, which every call that
takes a bf16 buffer accepts (as it accepts ml_dtypes' ``bfloat16`` arrays). float16 is numpy's
own (``astype(np.float16)`` rounds to nearest even too). The conversions run the C library's
vectorised loops (gradacc_f32_to_bf16, gradacc_bf16_to_f32)."""
import ctypes

import numpy as np

from . import _ffi as ffi
from ._core import _check


def f32_to_bf16(x):
    """``x`` (anything numpy reads as float32) rounded to bfloat16, to nearest even: a uint16 array
    of its shape holding the bits, the words a bf16 tensor's gradient or weight is made of
    (``.view(ml_dtypes.bfloat16)`` gives the same values typed)."""
    src = np.ascontiguousarray(x, dtype=np.float32)
    dst = np.empty(src.shape, dtype=np.uint16)
    _check(ffi.gradacc_f32_to_bf16(src.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                   dst.ctypes.data_as(ctypes.POINTER(ctypes.c_uint16)), src.size))
    return dst


def bf16_to_f32(words):
    """The float32 values of bfloat16 ``words`` (uint16 bits, or an ml_dtypes ``bfloat16``
    array), exactly: an array of their shape."""
    src = np.ascontiguousarray(words)
    if src.dtype.name == "bfloat16":
        src = src.view(np.uint16)
    if src.dtype != np.uint16:
        raise TypeError(f"bf16_to_f32 takes uint16 words or bfloat16 values, not {src.dtype}")
    dst = np.empty(src.shape, dtype=np.float32)
    _check(ffi.gradacc_bf16_to_f32(src.ctypes.data_as(ctypes.POINTER(ctypes.c_uint16)),
                                   dst.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), src.size))
    return dst
