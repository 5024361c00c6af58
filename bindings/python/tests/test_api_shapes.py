# docs/api-shapes.md's Python column names what the package has: every `gradacc.X` or `X.y`
# there exists.
import os
import re

import gradacc

PAGE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "api-shapes.md")


def python_names():
    rows = [line for line in open(PAGE, encoding="utf-8") if line.startswith("| ") and "---" not in line]
    header = [c.strip() for c in rows[0].strip().strip("|").split("|")]
    column = next(i for i, c in enumerate(header) if c.startswith("Python"))
    for row in rows[1:]:
        cell = [c.strip() for c in row.strip().strip("|").split("|")][column]
        yield from re.findall(r"`([A-Za-z_][A-Za-z0-9_.]*)`", cell)


def test_every_python_name_in_the_table_exists():
    names = list(python_names())
    assert len(names) > 15, names
    for name in names:
        target = gradacc
        if "." not in name and not hasattr(gradacc, name):
            # a method named alone: one of the classes has it
            assert any(hasattr(getattr(gradacc, c), name) for c in ("Scaler", "Accumulator", "Optimizer")), name
            continue
        for part in name.split("."):
            assert hasattr(target, part), f"gradacc.{name}: no {part}"
            target = getattr(target, part)
