"""`python -m gradacc`: what this installation is and what it found, as text to paste into a bug
report. It never raises: every library that does not load or backend that is unavailable is
reported with the reason the loader or the library gave.
"""
import ctypes
import os
import platform
import sys

# GRADACC_BACKEND_* in the order of their values.
_BACKENDS = ("local", "MPI", "NCCL", "CUDA")
_ENVIRONMENT = ("GRADACC_LIBRARY", "GRADACC_NVRTC_LIBRARY", "GRADACC_NCCL_LIBRARY", "LD_LIBRARY_PATH",
                "CUDA_VISIBLE_DEVICES")


class _DlInfo(ctypes.Structure):
    _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p), ("sname", ctypes.c_char_p),
                ("saddr", ctypes.c_void_p)]


def _file_of(lib, symbol):
    """The file a loaded library's `symbol` comes from (dladdr), or None."""
    try:
        info = _DlInfo()
        address = ctypes.cast(getattr(lib, symbol), ctypes.c_void_p)
        if ctypes.CDLL(None).dladdr(address, ctypes.byref(info)) and info.fname:
            return os.path.realpath(info.fname.decode())
    except (AttributeError, OSError, TypeError):
        pass
    return None


def _open(names):
    """The first of `names` that loads (it is already loaded when the package preloaded it), or
    None and why each failed."""
    errors = []
    for name in names:
        try:
            return ctypes.CDLL(name), None
        except OSError as e:
            errors.append(str(e))
    return None, "; ".join(errors)


def _driver():
    cu, why = _open(["libcuda.so.1", "libcuda.so"])
    if cu is None:
        return f"not found ({why})"
    version = ctypes.c_int()
    cu.cuDriverGetVersion(ctypes.byref(version))
    v = version.value
    return f"CUDA {v // 1000}.{v % 1000 // 10}, {_file_of(cu, 'cuDriverGetVersion')}"


def _nvrtc(env_name):
    names = [os.environ[env_name]] if os.environ.get(env_name) else ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    lib, why = _open(names)
    if lib is None:
        return f"not found ({why}); installing the wheel with its extra, `pip install '<gradacc wheel>[cuda12]'` (or `[cuda13]`), provides it"
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}, {_file_of(lib, 'nvrtcVersion')}"


def _nccl(env_name):
    names = [os.environ[env_name]] if os.environ.get(env_name) else ["libnccl.so.2", "libnccl.so"]
    lib, why = _open(names)
    if lib is None:
        return f"not found ({why}); installing the wheel with its extra, `pip install '<gradacc wheel>[cuda12]'` (or `[cuda13]`), provides it"
    version = ctypes.c_int()
    lib.ncclGetVersion(ctypes.byref(version))
    v = version.value
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}, {_file_of(lib, 'ncclGetVersion')}"


def _mapped(prefix):
    """The files whose name starts with `prefix` mapped into this process (Linux only)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if len(line.split()) >= 6}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith(prefix))


def _why_unavailable(backend):
    """The library's own message for an unavailable backend: it names what it tried to load."""
    import gradacc
    from . import _ffi as ffi

    try:
        if backend == "CUDA":
            gradacc.Scaler(device=("cuda", 0)).close()
        elif backend == "NCCL":
            gradacc._core._check(ffi.gradacc_nccl_unique_id(ctypes.byref(ffi.gradacc_nccl_unique_id_t())))
            return "NCCL loads, but it needs a CUDA device too (see CUDA)"
        elif backend == "MPI":
            return "this build has no MPI communicator (build with CMake -DGRADACC_WITH_MPI=ON or cargo --features mpi)"
    except Exception as e:  # the report must go on, whatever the library says
        return str(e)
    return "unavailable"


def report():
    """The report's lines."""
    lines = [f"python {sys.version.split()[0]} ({sys.executable}), {platform.platform()}"]
    try:
        import gradacc
        from . import _ffi as ffi, _lib
    except Exception as e:  # ImportError from the loader lists every file it tried
        return lines + [f"gradacc: cannot be imported: {e}"]
    lines.append(f"gradacc {gradacc.__version__} (package {os.path.dirname(gradacc.__file__)})")
    lines.append(f"library: {_lib.path}, version {gradacc.version()}")
    lines.append("preloaded from the nvidia-* wheels: " + (", ".join(_lib.preloaded) or "none"))
    lines.append("backends:")
    for code, backend in enumerate(_BACKENDS):
        out = ctypes.c_bool()
        if ffi.gradacc_backend_available(code, ctypes.byref(out)) == 0 and out.value:
            lines.append(f"  {backend}: available")
        else:
            lines.append(f"  {backend}: unavailable: {_why_unavailable(backend)}")
    lines.append("libraries:")
    lines.append(f"  CUDA driver: {_driver()}")
    lines.append(f"  NVRTC: {_nvrtc('GRADACC_NVRTC_LIBRARY')}")
    lines.append(f"  NCCL: {_nccl('GRADACC_NCCL_LIBRARY')}")
    mpi = _mapped("libmpi")
    lines.append(f"  MPI: {', '.join(mpi) if mpi else 'not loaded (only a build with MPI links it)'}")
    lines.append("environment:")
    for name in _ENVIRONMENT:
        lines.append(f"  {name}={os.environ[name]}" if name in os.environ else f"  {name} not set")
    lines.append("the library's own report (gradacc_diagnostics, as gradacc-info prints it):")
    try:
        lines.extend("  " + line for line in gradacc.diagnostics().splitlines())
    except Exception as e:  # the report must go on, whatever the library says
        lines.append(f"  unavailable: {e}")
    return lines


def main():
    print("\n".join(report()))
    return 0
