"""What the GPU bundle runs on: the devices, the driver, NVRTC, NCCL and gradacc, each with the
file it was loaded from, as Markdown lines. Loads the libraries as gradacc finds them (the
environment the bundle's run script sets); never fails: a library that does not load says why."""
import ctypes
import os
import sys


class DlInfo(ctypes.Structure):
    _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p), ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]


def file_of(lib, symbol):
    """The file `symbol` of a loaded library comes from (dladdr), resolved."""
    try:
        info = DlInfo()
        address = ctypes.cast(getattr(lib, symbol), ctypes.c_void_p)
        if ctypes.CDLL(None).dladdr(address, ctypes.byref(info)) and info.fname:
            return os.path.realpath(info.fname.decode())
    except (AttributeError, OSError):
        pass
    return "?"


def load(names):
    """The first of `names` that loads, and why each failed otherwise."""
    errors = []
    for name in names:
        if not name:
            continue
        try:
            return ctypes.CDLL(name), None
        except OSError as e:
            errors.append(f"{name}: {e}")
    return None, "; ".join(errors)


def main():
    print(f"- python {sys.version.split()[0]}")
    cu, why = load(["libcuda.so.1"])
    if cu is None:
        print(f"- driver: not loaded ({why})")
    else:
        version, count = ctypes.c_int(), ctypes.c_int()
        cu.cuDriverGetVersion(ctypes.byref(version))
        status = cu.cuInit(0)
        if status == 0:
            cu.cuDeviceGetCount(ctypes.byref(count))
        print(f"- driver: CUDA {version.value // 1000}.{version.value % 1000 // 10} (cuInit {status}), {count.value} device(s), {file_of(cu, 'cuInit')}")
        for d in range(count.value):
            try:
                dev, name, mem = ctypes.c_int(), ctypes.create_string_buffer(256), ctypes.c_size_t()
                major, minor = ctypes.c_int(), ctypes.c_int()
                cu.cuDeviceGet(ctypes.byref(dev), d)
                cu.cuDeviceGetName(name, 256, dev)
                cu.cuDeviceTotalMem_v2(ctypes.byref(mem), dev)
                cu.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)  # compute capability major
                cu.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)
                print(f"- device {d}: {name.value.decode()}, sm_{major.value}{minor.value}, {mem.value / 2**30:.1f} GiB")
            except AttributeError as e:
                print(f"- device {d}: ({e})")
    nvrtc, why = load([os.environ.get("GRADACC_NVRTC_LIBRARY"), "libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"])
    if nvrtc is None:
        print(f"- NVRTC: not loaded ({why})")
    else:
        major, minor, n = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        nvrtc.nvrtcGetNumSupportedArchs(ctypes.byref(n))
        archs = (ctypes.c_int * n.value)()
        nvrtc.nvrtcGetSupportedArchs(archs)
        print(f"- NVRTC {major.value}.{minor.value} (sm_{archs[0]}..sm_{archs[n.value - 1]}), {file_of(nvrtc, 'nvrtcVersion')}")
    nccl, why = load([os.environ.get("GRADACC_NCCL_LIBRARY"), "libnccl.so.2", "libnccl.so"])
    if nccl is None:
        print(f"- NCCL: not loaded ({why})")
    else:
        version = ctypes.c_int()
        nccl.ncclGetVersion(ctypes.byref(version))
        v = version.value
        print(f"- NCCL {v // 10000}.{v // 100 % 100}.{v % 100}, {file_of(nccl, 'ncclGetVersion')}")
    lib, why = load([os.environ.get("GRADACC_LIBRARY")])
    if lib is None:
        print(f"- gradacc: not loaded ({why})")
        return
    lib.gradacc_version_string.restype = ctypes.c_char_p
    available = []
    for code, backend in enumerate(["local", "MPI", "NCCL", "CUDA"]):  # GRADACC_BACKEND_*
        out = ctypes.c_bool()
        if lib.gradacc_backend_available(code, ctypes.byref(out)) == 0 and out.value:
            available.append(backend)
    print(f"- gradacc {lib.gradacc_version_string().decode()}: backends {', '.join(available) or 'none'}, {file_of(lib, 'gradacc_version_string')}")


if __name__ == "__main__":
    main()
