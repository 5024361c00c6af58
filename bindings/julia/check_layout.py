#!/usr/bin/env python3
"""Checks that every struct of GradAcc/src/libgradacc.jl has the C compiler's layout, without Julia.

Julia lays out an isbits struct like C (each field at its natural alignment, the size rounded up
to the largest alignment), so the offsets and sizes are computed here from the generated Julia
field types and compared with offsetof/sizeof from a C program compiled against
include/gradacc.h. Exits 1 on the first difference.
"""
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
LAYER = os.path.join(HERE, "GradAcc", "src", "libgradacc.jl")

# (size, alignment) of the Julia scalar types gen_wrap.py emits, on the 64-bit targets gradacc builds for.
SCALARS = {
    "Bool": (1, 1), "Cchar": (1, 1), "Int8": (1, 1), "UInt8": (1, 1), "Int16": (2, 2), "UInt16": (2, 2),
    "Int32": (4, 4), "UInt32": (4, 4), "Cfloat": (4, 4), "Int64": (8, 8), "UInt64": (8, 8),
    "Cdouble": (8, 8), "Csize_t": (8, 8),
}


def read_layer(text):
    aliases = dict(re.findall(r"^const (\w+) = (\w+)$", text, re.M))
    structs = {}
    for name, body in re.findall(r"^struct (\w+)\n(.*?)^end$", text, re.M | re.S):
        structs[name] = re.findall(r"^\s+(\w+)::(.+)$", body, re.M)
    return aliases, structs


def layout(t, aliases, structs, memo):
    """(size, alignment) of a Julia field type."""
    t = aliases.get(t, t)
    if t in SCALARS:
        return SCALARS[t]
    if t.startswith("Ptr{"):
        return (8, 8)
    m = re.fullmatch(r"NTuple\{(\d+), (.+)\}", t)
    if m:
        size, align = layout(m.group(2), aliases, structs, memo)
        return (int(m.group(1)) * size, align)
    if t in structs:
        return struct_layout(t, aliases, structs, memo)[:2]
    raise ValueError(f"no layout for Julia type {t}")


def struct_layout(name, aliases, structs, memo):
    """(size, alignment, [(field, offset)]) of a generated struct."""
    if name not in memo:
        off, align, fields = 0, 1, []
        for fname, ftype in structs[name]:
            size, a = layout(ftype, aliases, structs, memo)
            off = (off + a - 1) // a * a
            fields.append((fname, off))
            off += size
            align = max(align, a)
        memo[name] = ((off + align - 1) // align * align, align, fields)
    return memo[name]


def main():
    with open(LAYER) as f:
        aliases, structs = read_layer(f.read())
    memo = {}
    expected, lines = [], ['#include <stddef.h>', '#include <stdio.h>', '#include "gradacc.h"', "int main(void) {"]
    for name in structs:
        size, _, fields = struct_layout(name, aliases, structs, memo)
        expected.append(f"{name} size {size}")
        lines.append(f'    printf("{name} size %zu\\n", sizeof(struct {name}));')
        for fname, off in fields:
            expected.append(f"{name}.{fname} offset {off}")
            lines.append(f'    printf("{name}.{fname} offset %zu\\n", offsetof(struct {name}, {fname}));')
    lines += ["    return 0;", "}"]
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "layout.c"), os.path.join(tmp, "layout")
        with open(src, "w") as f:
            f.write("\n".join(lines) + "\n")
        cc = os.environ.get("CC", "cc")
        subprocess.run([cc, "-std=c11", "-I", os.path.join(ROOT, "include"), src, "-o", exe], check=True)
        actual = subprocess.run([exe], check=True, capture_output=True, text=True).stdout.splitlines()
    for e, a in zip(expected, actual):
        if e != a:
            print(f"error: Julia layout {e!r}, C compiler {a!r}", file=sys.stderr)
            return 1
    if len(expected) != len(actual):
        print("error: the C program printed a different number of lines", file=sys.stderr)
        return 1
    print(f"{len(structs)} Julia structs match the C layout ({len(expected)} sizes and offsets)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
