#!/usr/bin/env python3
"""Generates gradacc/_ffi.py, the ctypes declarations of the C API, from include/gradacc.h.

The header is cbindgen output with a regular shape: `#define NAME value` constants, opaque
`typedef struct X X;`, integer typedefs, `typedef struct X { fields } X;` and one prototype per
function. Anything else in it is an error here, so a change of shape is noticed, not skipped.

    gen_ffi.py            rewrite gradacc/_ffi.py
    gen_ffi.py --check    exit 1, showing the diff, if the committed file differs from the output
"""
import argparse
import difflib
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
HEADER = os.path.join(HERE, "..", "..", "include", "gradacc.h")
OUTPUT = os.path.join(HERE, "gradacc", "_ffi.py")

SCALARS = {
    "void": None,
    "bool": "ctypes.c_bool",
    "char": "ctypes.c_char",
    "float": "ctypes.c_float",
    "double": "ctypes.c_double",
    "int8_t": "ctypes.c_int8",
    "int16_t": "ctypes.c_int16",
    "int32_t": "ctypes.c_int32",
    "int64_t": "ctypes.c_int64",
    "uint8_t": "ctypes.c_uint8",
    "uint16_t": "ctypes.c_uint16",
    "uint32_t": "ctypes.c_uint32",
    "uint64_t": "ctypes.c_uint64",
    "size_t": "ctypes.c_size_t",
}


# Macros of the header that are not constants: C initialisers and the export attribute.
NOT_CONSTANTS = {"GRADACC_API", "GRADACC_SYNC_INFO_INIT", "GRADACC_SCALER_STATS_INIT", "GRADACC_MESH_PART_INIT"}


class Header:
    def __init__(self):
        self.constants = []  # (name, python literal)
        self.aliases = {}  # typedef name -> ctypes expression
        self.order = []  # ("alias" | "opaque" | "struct", name) in header order
        self.structs = {}  # name -> [(field, ctype)]
        self.functions = []  # (name, restype, [(arg, ctype)])
        self.docs = {}  # name -> first sentence of its doc comment
        self.c_types = {}  # name -> its C type; struct name -> [(field, C type)];
        #                    function name -> (C return type, [(arg, C type)])


def first_sentence(doc):
    text = " ".join(line.strip().lstrip("*").strip() for line in doc.splitlines())
    text = re.sub(r"\s+", " ", text).strip()
    m = re.match(r"(.+?\.)(?:\s+(?=[A-Z`])|$)", text)
    return m.group(1) if m else text


def parse_type(decl):
    """A C type (without the declared name) as (base name, pointer depth, array length or None):
    `const struct x_t **` -> (`x_t`, 2, None), `uint8_t[128]` -> (`uint8_t`, 0, 128)."""
    array = re.fullmatch(r"(.*)\[(\d+)\]", decl)
    if array:
        base, stars, _ = parse_type(array.group(1))
        return base, stars, int(array.group(2))
    words = decl.replace("*", " * ").split()
    base = [w for w in words if w not in ("const", "struct", "enum", "*")]
    if len(base) != 1:
        raise ValueError(f"cannot read the type `{decl}`")
    return base[0], words.count("*"), None


def ctype(decl, header):
    """A C type (without the declared name) as a ctypes expression."""
    name, stars, length = parse_type(decl)
    if name == "char" and stars == 1:
        return "ctypes.c_char_p"
    if name == "void":
        if stars == 0:
            return "None"
        inner, stars = "ctypes.c_void_p", stars - 1
    elif name in SCALARS:
        inner = SCALARS[name]
    elif name in header.aliases or name in header.structs:
        inner = name
    else:
        raise ValueError(f"unknown type `{name}` in `{decl}`")
    for _ in range(stars):
        inner = f"ctypes.POINTER({inner})"
    return inner if length is None else f"({inner} * {length})"


def split_decl(decl):
    """`const struct x_t *name` -> (`const struct x_t *`, `name`); an array field
    `uint8_t name[128]` -> (`uint8_t[128]`, `name`)."""
    m = re.match(r"^(.*?)([A-Za-z_][A-Za-z0-9_]*)\s*\[(\d+)\]$", decl.strip())
    if m:
        return f"{m.group(1).strip()}[{m.group(3)}]", m.group(2)
    m = re.match(r"^(.*?)([A-Za-z_][A-Za-z0-9_]*)$", decl.strip())
    if not m:
        raise ValueError(f"cannot read the declaration `{decl}`")
    return m.group(1).strip(), m.group(2)


def parse(text):
    h = Header()
    # Doc comments are kept to name what each item does; then every comment goes.
    # The C++ linkage block around the prototypes is not a declaration.
    text = re.sub(r'^\s*extern\s+"C"\s*\{.*$|^\}\s*//\s*extern\s+"C".*$', "", text, flags=re.M)
    pending_doc = None
    items = []
    token = re.compile(r"/\*\*(.*?)\*/|/\*.*?\*/|//[^\n]*|#[^\n]*|\s+|[^;{}#/\s][^;{}#/]*(?:\{[^}]*\})?[^;{}#/]*;?", re.S)
    for m in token.finditer(text):
        chunk = m.group(0)
        if chunk.startswith("/**"):
            pending_doc = m.group(1)
            continue
        if chunk.startswith("/*") or chunk.startswith("//") or not chunk.strip():
            continue
        items.append((chunk.strip(), pending_doc))
        pending_doc = None

    for item, doc in items:
        if item.startswith("#"):
            m = re.match(r"#define\s+([A-Za-z_][A-Za-z0-9_]*)\s+(.+)$", item)
            if m and m.group(1) in NOT_CONSTANTS:
                continue
            if m:
                name, value = m.group(1), m.group(2).strip()
                if not re.fullmatch(r'-?\d+|"[^"\\]*"', value):
                    raise ValueError(f"cannot read the value of #define {name}: {value}")
                h.constants.append((name, value))
                if doc:
                    h.docs[name] = first_sentence(doc)
            continue
        flat = re.sub(r"\s+", " ", item)
        m = re.fullmatch(r"typedef struct (\w+) (\w+);", flat)
        if m and m.group(1) == m.group(2):
            h.structs[m.group(1)] = None
            h.order.append(("opaque", m.group(1)))
            if doc:
                h.docs[m.group(1)] = first_sentence(doc)
            continue
        m = re.fullmatch(r"typedef struct (\w+) \{(.*)\} (\w+);", flat)
        if m and m.group(1) == m.group(3):
            name = m.group(1)
            fields, raw = [], []
            body = re.sub(r"/\*.*?\*/", "", m.group(2), flags=re.S)
            for field in filter(None, (f.strip() for f in body.split(";"))):
                ftype, fname = split_decl(field)
                fields.append((fname, ctype(ftype, h)))
                raw.append((fname, ftype))
            h.structs[name] = fields
            h.c_types[name] = raw
            h.order.append(("struct", name))
            if doc:
                h.docs[name] = first_sentence(doc)
            continue
        # A C enum (gradacc_status_t): its values become constants, the type an int32_t alias
        # (a C enum is an int, 32 bits on every platform gradacc supports).
        m = re.fullmatch(r"typedef enum (\w+) \{(.*)\} (\w+);", flat)
        if m and m.group(1) == m.group(3):
            raw_body = re.search(r"\{(.*)\}", item, re.S).group(1)  # with its line breaks, for the docs
            for vdoc, vname, value in re.findall(r"(?:/\*\*(.*?)\*/\s*)?(\w+) = (-?\d+),?", raw_body, re.S):
                h.constants.append((vname, value))
                if vdoc:
                    h.docs[vname] = first_sentence(vdoc)
            h.aliases[m.group(1)] = ctype("int32_t", h)
            h.c_types[m.group(1)] = "int32_t"
            h.order.append(("alias", m.group(1)))
            if doc:
                h.docs[m.group(1)] = first_sentence(doc)
            continue
        # A callback type: a ctypes CFUNCTYPE here, an address (`void *`) to other generators.
        m = re.fullmatch(r"typedef (.+?) \(\*(\w+)\)\((.*)\);", flat)
        if m:
            name, params = m.group(2), [p for p in m.group(3).split(",") if p.strip() not in ("", "void")]
            types = [ctype(m.group(1), h)] + [ctype(split_decl(p)[0], h) for p in params]
            h.aliases[name] = f"ctypes.CFUNCTYPE({', '.join(types)})"
            h.c_types[name] = "void *"
            h.order.append(("alias", name))
            if doc:
                h.docs[name] = first_sentence(doc)
            continue
        m = re.fullmatch(r"typedef ([\w ]+?) (\w+);", flat)
        if m:
            h.aliases[m.group(2)] = ctype(m.group(1), h)
            h.c_types[m.group(2)] = m.group(1)
            h.order.append(("alias", m.group(2)))
            if doc:
                h.docs[m.group(2)] = first_sentence(doc)
            continue
        flat = re.sub(r"^GRADACC_API ", "", flat)  # the export macro, not part of the type
        m = re.fullmatch(r"(.+?)\b(\w+)\((.*)\);", flat)
        if m:
            restype = ctype(m.group(1), h)
            args, raw = [], []
            params = m.group(3).strip()
            if params and params != "void":
                for p in params.split(","):
                    ptype, pname = split_decl(p)
                    args.append((pname, ctype(ptype, h)))
                    raw.append((pname, ptype))
            h.functions.append((m.group(2), restype, args))
            h.c_types[m.group(2)] = (m.group(1).strip(), raw)
            if doc:
                h.docs[m.group(2)] = first_sentence(doc)
            continue
        raise ValueError(f"unexpected declaration in the header: {flat[:120]}")
    return h


def render(h):
    out = [
        '"""ctypes declarations of the gradacc C API.',
        "",
        "Generated from include/gradacc.h by bindings/python/gen_ffi.py. Do not edit by hand:",
        "change capi/src/, run scripts/gen-header, then bindings/python/gen_ffi.py.",
        '"""',
        "# fmt: off",
        "import ctypes",
        "",
        "from ._lib import dll",
        "",
    ]
    for name, value in h.constants:
        if name == "GRADACC_H":
            continue
        doc = h.docs.get(name)
        out.append(f"{name} = {value}" + (f"  # {doc}" if doc else ""))
    out.append("")
    for kind, name in h.order:
        doc = h.docs.get(name)
        if doc:
            out.append("")
            out.append(f"# {doc}")
        if kind == "alias":
            out.append(f"{name} = {h.aliases[name]}")
        elif kind == "opaque":
            out.append(f"class {name}(ctypes.Structure):")
            out.append("    pass")
        else:
            out.append(f"class {name}(ctypes.Structure):")
            out.append("    _fields_ = [")
            for fname, ftype in h.structs[name]:
                out.append(f'        ("{fname}", {ftype}),')
            out.append("    ]")
    out.append("")
    for name, restype, args in h.functions:
        out.append("")
        doc = h.docs.get(name)
        if doc:
            out.append(f"# {doc}")
        out.append(f"{name} = dll.{name}")
        out.append(f"{name}.restype = {restype}")
        out.append(f"{name}.argtypes = [{', '.join(t for _, t in args)}]")
        if args:
            out.append(f"# arguments: {', '.join(a for a, _ in args)}")
    out.append("")
    return "\n".join(out)


def generate(description, render_fn, default_output, label):
    """Writes render_fn(parse(header)) to the output, or with --check fails if the committed file differs."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="fail if the committed file is out of date")
    ap.add_argument("--header", default=HEADER)
    ap.add_argument("--output", default=default_output)
    args = ap.parse_args()
    with open(args.header) as f:
        generated = render_fn(parse(f.read()))
    if args.check:
        try:
            with open(args.output) as f:
                committed = f.read()
        except FileNotFoundError:
            committed = ""
        if committed != generated:
            sys.stdout.writelines(difflib.unified_diff(
                committed.splitlines(True), generated.splitlines(True), label, "generated"))
            print(f"error: {label} is out of date with include/gradacc.h: "
                  f"run {os.path.relpath(sys.argv[0])} and commit the result", file=sys.stderr)
            return 1
        print(f"{label} is up to date")
        return 0
    with open(args.output, "w") as f:
        f.write(generated)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(generate(__doc__, render, OUTPUT, "bindings/python/gradacc/_ffi.py"))
