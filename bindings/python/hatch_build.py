"""hatchling hooks that make the wheel: its version from Cargo.toml, and the gradacc shared library
built by cargo (the crate: two levels up, or rust/ in an sdist) inside the package.

GRADACC_PREBUILT_LIBRARY=<path of libgradacc.so> bundles that file instead of running cargo (the
test scripts use it to reuse target/release), and GRADACC_WHEEL_PLATFORM gives the platform tag
of a library built for another machine (scripts/build-wheel's aarch64 wheel). Either way the library must report Cargo.toml's
version, and so must the generated ctypes layer, or the build fails.
"""
import ctypes
import json
import os
import re
import shutil
import subprocess
import sys

from hatchling.builders.hooks.plugin.interface import BuildHookInterface
from hatchling.metadata.plugin.interface import MetadataHookInterface

HERE = os.path.dirname(os.path.abspath(__file__))
# The crate: the repository two levels up, or in an sdist the copy under rust/ (pyproject.toml).
CRATE = next((d for d in (os.path.join(HERE, "rust"), os.path.normpath(os.path.join(HERE, "..", "..")))
              if os.path.isfile(os.path.join(d, "Cargo.toml"))), os.path.join(HERE, "rust"))
MANIFEST = os.path.join(CRATE, "Cargo.toml")


def cargo_version():
    """The crate's version: the first `version =` line of Cargo.toml ([workspace.package] comes first)."""
    try:
        with open(MANIFEST, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise RuntimeError(f"{MANIFEST} not found: build the wheel from the gradacc repository "
                           "(pip install ./bindings/python) or from its sdist") from None
    m = re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE)
    if not m:
        raise RuntimeError(f"no version in {MANIFEST}")
    return m.group(1)


def ffi_version():
    """GRADACC_VERSION_STRING of the generated ctypes layer (gradacc.__version__)."""
    with open(os.path.join(HERE, "gradacc", "_ffi.py"), encoding="utf-8") as f:
        return re.search(r'^GRADACC_VERSION_STRING = "([^"]+)"', f.read(), re.MULTILINE).group(1)


def library_version(path):
    """gradacc_version_string() of the library at path, or None where it cannot be loaded here."""
    try:
        lib = ctypes.CDLL(os.path.abspath(path))
    except OSError:
        return None  # a cross build: nothing to compare with
    lib.gradacc_version_string.restype = ctypes.c_char_p
    return lib.gradacc_version_string().decode()


def cargo_build():
    """Runs `cargo build --release --lib` on the crate; returns the path of the shared library."""
    cargo = os.environ.get("CARGO") or shutil.which("cargo")
    if not cargo:
        raise RuntimeError("building the gradacc wheel needs a Rust toolchain (cargo on PATH, see "
                           "https://rustup.rs), or GRADACC_PREBUILT_LIBRARY set to an already built "
                           "libgradacc shared library")
    cmd = [cargo, "build", "--release", "--lib", "--manifest-path", MANIFEST,
           "--message-format=json-render-diagnostics"]
    # Progress and diagnostics go to stderr; stdout carries one JSON message per line.
    out = subprocess.run(cmd, stdout=subprocess.PIPE, check=True, text=True).stdout
    suffix = {"darwin": ".dylib", "win32": ".dll"}.get(sys.platform, ".so")
    for line in out.splitlines():
        msg = json.loads(line) if line.startswith("{") else {}
        if msg.get("reason") == "compiler-artifact" and "cdylib" in msg["target"]["crate_types"]:
            for f in msg["filenames"]:
                if f.endswith(suffix):
                    return f
    raise RuntimeError("cargo built no gradacc shared library")


def abi_version(version):
    """The part of the version the SONAME carries (build.rs): the major version, or 0.<minor>
    while the major is 0, as a 0.x minor release may break the ABI."""
    major, minor = version.split(".")[:2]
    return f"0.{minor}" if major == "0" else major


def bundled_name():
    """The library's file name inside the package: on ELF systems its SONAME, libgradacc.so.<abi>
    (build.rs), as a wheel cannot hold the libgradacc.so link; elsewhere cargo's file name."""
    if sys.platform == "darwin":
        return "libgradacc.dylib"
    if sys.platform == "win32":
        return "gradacc.dll"
    return "libgradacc.so." + abi_version(cargo_version())


def platform_tag():
    """This machine's platform tag, without the manylinux / musllinux claims (nothing here audits
    the library's symbol versions), as hatchling infers it."""
    from packaging.tags import sys_tags

    return next(t.platform for t in sys_tags() if "manylinux" not in t.platform and "musllinux" not in t.platform)


class VersionHook(MetadataHookInterface):
    def update(self, metadata):
        metadata["version"] = cargo_version()


class LibraryHook(BuildHookInterface):
    def initialize(self, version, build_data):
        if self.target_name != "wheel":
            return
        expected = cargo_version()
        if ffi_version() != expected:
            raise RuntimeError(f"gradacc/_ffi.py is for version {ffi_version()} but Cargo.toml says "
                               f"{expected}: run scripts/gen-header, then bindings/python/gen_ffi.py")
        library = os.environ.get("GRADACC_PREBUILT_LIBRARY") or cargo_build()
        if not os.path.isfile(library):
            raise RuntimeError(f"GRADACC_PREBUILT_LIBRARY={library}: no such file")
        found = library_version(library)
        if found is not None and found != expected:
            raise RuntimeError(f"{library} is version {found}, Cargo.toml says {expected}: rebuild it")
        if version == "editable":
            return  # the package stays in the source tree, which finds target/release itself
        build_data["pure_python"] = False
        # ctypes needs no particular Python or ABI; only the library is platform specific.
        # GRADACC_WHEEL_PLATFORM names the platform of a cross-built library (linux_aarch64).
        build_data["tag"] = "py3-none-" + (os.environ.get("GRADACC_WHEEL_PLATFORM") or platform_tag())
        build_data["force_include"][library] = "gradacc/" + bundled_name()
