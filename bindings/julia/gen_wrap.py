#!/usr/bin/env python3
"""Generates GradAcc/src/libgradacc.jl, the ccall layer of the Julia package, from
include/gradacc.h, with the header parser of bindings/python/gen_ffi.py (one parser, two outputs).

    gen_wrap.py            rewrite GradAcc/src/libgradacc.jl
    gen_wrap.py --check    exit 1, showing the diff, if the committed file differs from the output
"""
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
import gen_ffi  # noqa: E402

OUTPUT = os.path.join(HERE, "GradAcc", "src", "libgradacc.jl")
PROJECT = os.path.join(HERE, "GradAcc", "Project.toml")

SCALARS = {
    "void": "Cvoid", "bool": "Bool", "char": "Cchar", "float": "Cfloat", "double": "Cdouble",
    "int8_t": "Int8", "int16_t": "Int16", "int32_t": "Int32", "int64_t": "Int64",
    "uint8_t": "UInt8", "uint16_t": "UInt16", "uint32_t": "UInt32", "uint64_t": "UInt64",
    "size_t": "Csize_t",
}

# Functions that can wait on other ranks or threads (collectives, barriers, an NCCL finalise).
# They run in the GC-safe state: a thread blocked in a plain ccall cannot stop for a collection,
# so a collection started by another rank's thread would wait for it forever (JuliaLang/julia#51574).
# Under sharded accumulation every micro-batch call is a collective too.
BLOCKING = {
    "gradacc_accumulator_sync",
    "gradacc_accumulator_sync_for_step",
    "gradacc_accumulator_sync_hybrid",
    "gradacc_accumulator_begin_final_microbatch",
    "gradacc_accumulator_begin_microbatch",
    "gradacc_accumulator_add",
    "gradacc_accumulator_add_final",
    "gradacc_accumulator_add_tensor",
    "gradacc_accumulator_end_microbatch",
    "gradacc_comm_create_mpi",
    "gradacc_comm_create_nccl",
    "gradacc_comm_adopt_nccl",
    "gradacc_comm_destroy",
    "gradacc_comm_abort",
    "gradacc_comm_split",
    "gradacc_mesh_end_microbatch",
    "gradacc_mesh_shape_split",
    "gradacc_mesh_sync",
    "gradacc_optimizer_step",
    "gradacc_scaler_update",
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


def gcsafe_body(name, names, types, rtype, tuple_):
    """The body of a blocking function: symbol lookup and argument conversion (which may allocate)
    before the thread enters the GC-safe state, only the foreign call inside it."""
    body = ["    # blocks: GC-safe call", f"    fptr = Libdl.dlsym(libgradacc_handle(), :{name})"]
    body += [f"    c_{a} = Base.cconvert({t}, {a})" for a, t in zip(names, types)]
    roots = " ".join(f"c_{a}" for a in names)
    body.append(f"    GC.@preserve {roots} begin" if roots else "    begin")
    body += [f"        p_{a} = Base.unsafe_convert({t}, c_{a})" for a, t in zip(names, types)]
    call_args = "".join(", p_" + a for a in names)
    body += [
        "        gc_state = ccall(:jl_gc_safe_enter, Int8, ())",
        f"        ret = ccall(fptr, {rtype}, {tuple_}{call_args})",
        "        ccall(:jl_gc_safe_leave, Cvoid, (Int8,), gc_state)",
        "        ret",
        "    end",
    ]
    return body


def check_project_version(h):
    """GradAcc/Project.toml's version is the header's (one version number, Cargo.toml's)."""
    header = dict(h.constants)["GRADACC_VERSION_STRING"].strip('"')
    with open(PROJECT) as f:
        m = re.search(r'^version = "([^"]*)"', f.read(), re.M)
    if not m or m.group(1) != header:
        raise ValueError(f"bindings/julia/GradAcc/Project.toml has version {m.group(1) if m else '(none)'}, "
                         f"the header {header} (from Cargo.toml): update Project.toml")


def render(h):
    check_project_version(h)
    known = set(h.aliases) | set(h.structs)
    missing = BLOCKING - {n for n, _, _ in h.functions}
    if missing:  # a renamed or removed function must not silently lose its GC-safe call
        raise ValueError(f"BLOCKING names functions not in the header: {sorted(missing)}")
    out = [
        "# ccall declarations of the gradacc C API.",
        "#",
        "# Generated from include/gradacc.h by bindings/julia/gen_wrap.py. Do not edit by hand:",
        "# change capi/src/, run scripts/gen-header, then bindings/julia/gen_wrap.py.",
        "# `libgradacc()` (the library path) and `libgradacc_handle()` (its dlopen handle) are",
        "# defined by the including module and set when it loads. Functions marked \"blocks\" can",
        "# wait on other ranks: they convert their arguments first, then call with the thread in the",
        "# GC-safe state (jl_gc_safe_enter/leave around the call, as CUDA.jl's @gcsafe_ccall), so that",
        "# a collection started by another thread does not wait for them (JuliaLang/julia#51574).",
        "# The library never calls back into Julia, which the GC-safe state requires.",
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
        rtype = jltype(ret, known, result=True)
        out.append(f"function {name}({', '.join(names)})")
        if name in BLOCKING:
            out.extend(gcsafe_body(name, names, types, rtype, tuple_))
        else:
            call_args = "".join(", " + a for a in names)
            out.append(f"    ccall((:{name}, libgradacc()), {rtype}, {tuple_}{call_args})")
        out.append("end")
    out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(gen_ffi.generate(__doc__, render, OUTPUT, "bindings/julia/GradAcc/src/libgradacc.jl"))
