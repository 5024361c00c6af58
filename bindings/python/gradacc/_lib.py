"""Finds and loads the gradacc shared library.

Order: the file named by the GRADACC_LIBRARY environment variable; the build of the repository this
package sits in (target/release, then target/debug); then the system's search path.
"""
import ctypes
import ctypes.util
import os
import sys

_NAMES = {"darwin": "libgradacc.dylib", "win32": "gradacc.dll"}
_FILE = _NAMES.get(sys.platform, "libgradacc.so")


def _candidates():
    env = os.environ.get("GRADACC_LIBRARY")
    if env:
        yield env
        return  # an explicit choice that fails must not fall back to another copy
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    for profile in ("release", "debug"):
        path = os.path.join(root, "target", profile, _FILE)
        if os.path.exists(path):
            yield path
    found = ctypes.util.find_library("gradacc")
    if found:
        yield found


def _load():
    tried = []
    for path in _candidates():
        try:
            return ctypes.CDLL(path)
        except OSError as e:
            tried.append(f"{path}: {e}")
    raise ImportError(
        "cannot load the gradacc library; set GRADACC_LIBRARY to the path of " + _FILE
        + " or build it with `cargo build --release`"
        + ("".join("\n  tried " + t for t in tried) if tried else ""))


dll = _load()
