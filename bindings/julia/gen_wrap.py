#!/usr/bin/env python3
"""Generates GradAcc/src/libgradacc.jl, the ccall layer of the Julia package, from
include/gradacc.h, with the header parser of bindings/python/gen_ffi.py (one parser, two outputs).

    gen_wrap.py            rewrite GradAcc/src/libgradacc.jl
    gen_wrap.py --check    exit 1, showing the diff, if the committed file differs from the output
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
import gen_ffi  # noqa: E402

OUTPUT = os.path.join(HERE, "GradAcc", "src", "libgradacc.jl")

SCALARS = {
    "void": "Cvoid", "bool": "Bool", "char": "Cchar", "float": "Cfloat", "double": "Cdouble",
    "int8_t": "Int8", "int16_t": "Int16", "int32_t": "Int32", "int64_t": "Int64",
    "uint8_t": "UInt8", "uint16_t": "UInt16", "uint32_t": "UInt32", "uint64_t": "UInt64",
    "size_t": "Csize_t",
}


def jltype(decl, known, result=False):
    name, stars, length = gen_ffi.parse_type(decl)
    if name == "char" and stars == 1:
        return "Cstring" if result else "Ptr{Cchar}"
    if name in SCALARS:
        t = SCALARS[name]
    elif name in known:
        t = name
    else:
        raise ValueError(f"unknown type `{name}` in `{decl}`")
    for _ in range(stars):
        t = f"Ptr{{{t}}}"
    return t if length is None else f"NTuple{{{length}, {t}}}"


def jlstr(text):
    """A Julia string literal (docstrings use the header's first sentence)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$") + '"'


def render(h):
    known = set(h.aliases) | set(h.structs)
    out = [
        "# ccall declarations of the gradacc C API.",
        "#",
        "# Generated from include/gradacc.h by bindings/julia/gen_wrap.py. Do not edit by hand:",
        "# change src/ffi/, run scripts/gen-header, then bindings/julia/gen_wrap.py.",
        "# `libgradacc` (the library path) is defined by the including module.",
        "",
    ]
    for name, value in h.constants:
        if name == "GRADACC_H":
            continue
        doc = h.docs.get(name)
        out.append(f"const {name} = {value}" + (f"  # {doc}" if doc else ""))
    for kind, name in h.order:
        out.append("")
        doc = h.docs.get(name)
        if doc:
            out.append(jlstr(doc))
        if kind == "alias":
            out.append(f"const {name} = {jltype(h.c_types[name], known)}")
        elif kind == "opaque":
            out.append(f"mutable struct {name} end")
        else:
            out.append(f"struct {name}")
            for fname, ftype in h.c_types[name]:
                out.append(f"    {fname}::{jltype(ftype, known)}")
            out.append("end")
    for name, (ret, args) in ((n, h.c_types[n]) for n, _, _ in h.functions):
        out.append("")
        doc = h.docs.get(name)
        if doc:
            out.append(jlstr(doc))
        names = [a for a, _ in args]
        types = [jltype(t, known) for _, t in args]
        tuple_ = "(" + ", ".join(types) + ("," if len(types) == 1 else "") + ")"
        out.append(f"function {name}({', '.join(names)})")
        call_args = "".join(", " + a for a in names)
        out.append(f"    ccall((:{name}, libgradacc), {jltype(ret, known, result=True)}, {tuple_}{call_args})")
        out.append("end")
    out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(gen_ffi.generate(__doc__, render, OUTPUT, "bindings/julia/GradAcc/src/libgradacc.jl"))
