"""`python -m gradacc`: what this installation is and what it found, as text to paste into a bug
report. It never raises: every library that does not load or backend that is unavailable is
reported with the reason the library gave (its own report, gradacc_diagnostics).
"""
import os
import platform
import sys

# The variables this binding reads; the library's report lists its own.
_ENVIRONMENT = ("GRADACC_LIBRARY",)


def report():
    """The report's lines: this binding's (Python, the package, the library file it loaded and
    the CUDA wheels it preloaded), then the library's own (gradacc_diagnostics: its SIMD path,
    backends, CUDA libraries and environment), so that each fact is said once."""
    lines = [f"python {sys.version.split()[0]} ({sys.executable}), {platform.platform()}"]
    try:
        import gradacc
        from . import _lib
    except Exception as e:  # ImportError from the loader lists every file it tried
        return lines + [f"gradacc: cannot be imported: {e}"]
    lines.append(f"gradacc {gradacc.__version__} (package {os.path.dirname(gradacc.__file__)})")
    lines.append(f"library: {_lib.path}, version {gradacc.version()}")
    lines.append("preloaded from the nvidia-* wheels: " + (", ".join(_lib.preloaded) or "none"))
    for name in _ENVIRONMENT:
        lines.append(f"{name}={os.environ[name]}" if name in os.environ else f"{name} not set")
    try:
        lines.extend(gradacc.diagnostics().splitlines())
    except Exception as e:  # the report must go on, whatever the library says
        lines.append(f"the library's report is unavailable: {e}")
    return lines


def main():
    print("\n".join(report()))
    return 0
