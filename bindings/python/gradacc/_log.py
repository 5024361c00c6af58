"""What the library tells the user: its messages (a skipped step and the loss scale it backed
off to, a dropped micro-batch, a CUDA library loaded or not, a SIMD path other than the one asked
for) sent to a Python callable or to the ``logging`` module, and the library's diagnostic report
(gradacc_diagnostics, also printed by ``python -m gradacc``)."""
import ctypes
import enum
import logging
import threading

from . import _ffi as ffi
from ._core import _check, _constants

LogLevel = enum.IntEnum("LogLevel", _constants("GRADACC_LOG_"), module=__name__)

# The callback the library holds: kept alive here for as long as it is set.
_held = None
_lock = threading.Lock()

_TO_LOGGING = {LogLevel.ERROR: logging.ERROR, LogLevel.WARN: logging.WARNING,
               LogLevel.INFO: logging.INFO, LogLevel.DEBUG: logging.DEBUG}


def set_log_callback(callback, level=LogLevel.INFO):
    """Sends the library's messages at ``level`` and more severe ones to ``callback(level,
    message)`` (a :class:`LogLevel` and a str), on the thread whose call produced them; ``None``
    (or ``LogLevel.OFF``) turns them off, back to the default (nothing, or stderr at the level
    the environment variable GRADACC_LOG names). An exception the callback raises is printed and
    dropped: it cannot cross the library."""
    global _held
    level = LogLevel(level)

    def forward(_user, code, message):
        callback(LogLevel(code), message.decode("utf-8", "replace"))

    with _lock:
        c_callback = ffi.gradacc_log_fn(forward) if callback is not None else ffi.gradacc_log_fn()
        _check(ffi.gradacc_set_log_callback(c_callback, None, int(level)))
        _held = c_callback if callback is not None else None


def log_to_logging(logger=None, level=LogLevel.INFO):
    """Sends the library's messages at ``level`` and above to ``logger`` (default: the logger
    named "gradacc" of the ``logging`` module), each at its ``logging`` level."""
    logger = logger or logging.getLogger("gradacc")
    set_log_callback(lambda lv, message: logger.log(_TO_LOGGING[lv], message), level)


def diagnostics():
    """The library's diagnostic report (gradacc_diagnostics): its version and file, the host's
    SIMD path, each backend available or why not, the CUDA driver, NVRTC and NCCL found or why
    not, and every environment variable the library reads."""
    needed = ctypes.c_size_t()
    _check(ffi.gradacc_diagnostics(None, 0, ctypes.byref(needed)))
    buf = ctypes.create_string_buffer(needed.value)
    _check(ffi.gradacc_diagnostics(buf, needed.value, None))
    return buf.value.decode("utf-8", "replace")
