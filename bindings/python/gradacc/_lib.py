"""Finds and loads the gradacc shared library.

Order: the file named by the GRADACC_LIBRARY environment variable; the copy bundled in this package
by its wheel (libgradacc.so.<major>, the library's SONAME); the build of the repository this package
sits in (target/release, then target/debug); then the system's search path.
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
    here = os.path.dirname(os.path.abspath(__file__))
    for name in sorted(os.listdir(here)):
        if name == _FILE or name.startswith(_FILE + "."):
            yield os.path.join(here, name)
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
            return path, ctypes.CDLL(path)
        except OSError as e:
            tried.append(f"{path}: {e}")
    raise ImportError(
        "cannot load the gradacc library; set GRADACC_LIBRARY to the path of " + _FILE
        + " or build it with `cargo build --release`"
        + ("".join("\n  tried " + t for t in tried) if tried else ""))


path, dll = _load()  # path: the file loaded
