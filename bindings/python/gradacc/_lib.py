"""Finds and loads the gradacc shared library.

Order: the file named by the GRADACC_LIBRARY environment variable; the copy bundled in this package
by its wheel (libgradacc.so.<abi>, the library's SONAME); the build of the repository this package
sits in (target/release, then target/debug); then the system's search path.

NVRTC and NCCL from the `nvidia-*` wheels of this environment (gradacc[cuda12] / gradacc[cuda13])
are loaded first, by path, unless GRADACC_NVRTC_LIBRARY / GRADACC_NCCL_LIBRARY name files: the
library then finds them by the names it tries (libnvrtc.so.13, libnvrtc.so.12, libnccl.so.2)
without LD_LIBRARY_PATH, which a running process cannot change.
"""
import glob
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


# The wheels' libraries, newest first: (environment variable that overrides them, patterns under
# the `nvidia` namespace package, whether only the first found is loaded). Every NVRTC is loaded
# (each major version has its own SONAME, and the library picks the one the driver takes); one
# NCCL only, since both wheels' files are libnccl.so.2 and another library of the process (torch)
# could bind to the wrong one.
_WHEELS = (
    ("GRADACC_NVRTC_LIBRARY", ("cu13/lib/libnvrtc.so.13", "cuda_nvrtc/lib/libnvrtc.so.12"), False),
    ("GRADACC_NCCL_LIBRARY", ("cu13/lib/libnccl.so.2", "nccl/lib/libnccl.so.2"), True),
)


def _wheel_files():
    """The NVRTC and NCCL files of this environment's nvidia-* wheels (none without them)."""
    try:
        import nvidia  # the namespace package the wheels install into
    except ImportError:
        return []
    files = []
    for variable, patterns, first_only in _WHEELS:
        if os.environ.get(variable):
            continue
        found = [f for pattern in patterns for root in nvidia.__path__ for f in sorted(glob.glob(os.path.join(root, pattern)))]
        files.extend(found[:1] if first_only else found)
    return files


def _preload():
    """Loads the wheels' NVRTC and NCCL (RTLD_GLOBAL), so the library's lookups by name find
    them; returns the files loaded. A file that does not load is left to the library's own
    search, which reports what it tried."""
    loaded = []
    for f in _wheel_files():
        try:
            ctypes.CDLL(f, mode=ctypes.RTLD_GLOBAL)
            loaded.append(f)
        except OSError:
            pass
    return loaded


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


preloaded = _preload()  # the wheels' NVRTC and NCCL files, loaded before the library
path, dll = _load()  # path: the file loaded

