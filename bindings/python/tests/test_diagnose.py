# `python -m gradacc`, the report a user pastes into a bug report: it runs on any machine (no CUDA,
# no MPI), exits 0, and names the version, the library and every backend with its state.
import os
import subprocess
import sys

import gradacc


def run_report():
    env = dict(os.environ)
    package_parent = os.path.dirname(os.path.dirname(gradacc.__file__))
    # The same package as this test imported: the source tree's, or the installed one.
    env["PYTHONPATH"] = package_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return subprocess.run([sys.executable, "-m", "gradacc"], env=env, capture_output=True, text=True, timeout=120)


def test_report_names_version_library_and_backends():
    done = run_report()
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert f"gradacc {gradacc.__version__} " in out
    assert f"library: {gradacc._lib.path}, version {gradacc.version()}" in out
    assert "  local: available" in out
    for backend in ("MPI", "NCCL", "CUDA"):
        assert f"  {backend}: available" in out or f"  {backend}: unavailable: " in out, backend
    for library in ("CUDA driver", "NVRTC", "NCCL", "MPI"):
        assert f"  {library}: " in out, library


def test_unavailable_backend_says_why():
    out = run_report().stdout
    for line in out.splitlines():
        if line.startswith("  ") and ": unavailable: " in line:
            assert len(line.split(": unavailable: ", 1)[1]) > 20, line
