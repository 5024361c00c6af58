"""Turns one or more runs of scripts/bench into docs/performance.md (tables), docs/performance.png
(plots) and a summary on stdout. Every number comes from the result files of those runs, one
directory per run:

  suite.jsonl   benches/suite.rs: the add sweep and its floors, the model layouts, per-call
                overhead, the in-process boundary
  peer.jsonl    benches/python/peer.py: gradacc against PyTorch on the same buffers
  mpi.txt       scripts/bench-mpi: the boundary over 2 MPI processes (its markdown table)
  env.json      the machine, when the run started and its load, written by scripts/bench

With several runs, times are the first run's; every ratio, overhead and spread shows each run's
value ("1.02 / 1.04"), and a target counts as met only when every run meets it.

Usage: report.py --dir RUN1 [--dir RUN2 ...] --md OUT.md --png OUT.png
"""
import argparse
import json
import os
import re
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

M = 1 << 20
# Bytes each element moves from or to memory in a pass that runs at bandwidth (see the method
# section): the gradient's size g, plus the master read and written.
GRAD_BYTES = {"f16": 2, "bf16": 2, "f32": 4}
# The targets the tables are held to.
FLOOR_TARGET = 1.05
BOUNDARY_TARGET = 1.10
# The bindings' prepared call over 1,000 tensors, in seconds.
BINDING_TARGET = 100e-6
# The boundary plus optimizer step against PyTorch's CPU sequence (scripts/bench-torch).
STEP_TARGET = 2.0
LAYOUT_NAMES = {"gpt2": "GPT-2-like", "transformer": "GPT-style"}


def load(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def med(rec, name):
    return rec["times"][name]["median"]


def has(rec, name):
    return rec is not None and name in rec["times"]


def spread(rec, name):
    t = rec["times"][name]
    return (t["max"] - t["min"]) / t["median"]


def floor_of(rec):
    return med(rec, "fused")


def ratio(rec, a, b):
    """Variant a's time over variant b's: the median of their round-by-round ratios where the
    benchmark recorded them (the two ran in the same round, so a change of machine state between
    rounds cancels), else the ratio of their medians."""
    paired = rec.get("ratios", {}).get(f"{a}/{b}")
    return paired["median"] if paired else med(rec, a) / med(rec, b)


def over_floor(rec):
    return ratio(rec, "gradacc", "fused")


def size(n):
    if n >= M and n % M == 0:
        return f"{n // M}M"
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}K"
    if n >= 10 ** 6 and n % 10 ** 6 == 0:
        return f"{n // 10 ** 6}e6"
    return f"{n:,}"


def millions(n):
    return f"{n / 1e6:.1f}M" if n < 10e6 else f"{n / 1e6:.0f}M"


def ms(s):
    return f"{s * 1e3:.3g}" if s < 1e-3 else f"{s * 1e3:.1f}" if s < 0.1 else f"{s * 1e3:.0f}"


def us(s):
    return f"{s * 1e6:.1f}"


def pct(x):
    return f"{x * 100:.0f}%"


def x1(x):
    return f"{x:.1f}×"


def x2(x):
    return f"{x:.2f}"


def table(header, rows, align=None):
    align = align or ["---:"] * len(header)
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def span(xs, fmt):
    """min–max of `xs` (one value when they agree to the format)."""
    lo, hi = fmt(min(xs)), fmt(max(xs))
    return lo if lo == hi else f"{lo.rstrip('×')}–{hi}"


def parse_mpi(path):
    """The rows of scripts/bench-mpi's markdown table, by column name: deferred, clipped (when
    measured), naive, bare and the all-reduce in pieces of each size, in seconds."""
    rows, header = [], None
    if not os.path.exists(path):
        return rows
    for line in open(path):
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "K":
            header = cells
            continue
        if header is None or not cells[0].isdigit():
            continue
        row = {"k": int(cells[0]), "pieces": {}, "over_fastest": {}}
        for name, cell in zip(header[1:], cells[1:]):
            over = re.fullmatch(r"(\w+) / fastest", name)
            if over:  # the median of the per-repeat ratios to the fastest all-reduce
                row["over_fastest"][{"sync": "deferred"}.get(over.group(1), over.group(1))] = float(cell)
            if "(ms)" not in name:
                continue
            v = float(cell) / 1e3
            piece = re.search(r"in (\d+ [KM]B) pieces", name)
            if piece:
                row["pieces"][piece.group(1)] = v
            else:
                row[name.split()[0].lower()] = v
        if all(k in row for k in ("deferred", "naive", "bare")):
            best = min([(row["bare"], "one call")] + [(v, f"{p} pieces") for p, v in row["pieces"].items()])
            row["fastest"], row["fastest_form"] = best
            rows.append(row)
    return rows


def over_fastest(row, name):
    """An MPI row's `name` time over the fastest all-reduce: as the benchmark computed it, the
    median of the per-repeat ratios, where its table has the column."""
    return row["over_fastest"].get(name) or row[name] / row["fastest"]


# How a record is matched across runs, per group.
KEYS = {
    "sweep": lambda r: (r["numel"], r["dtype"], r["threads"]),
    "layout": lambda r: (r["layout"], r["numel"], r["dtype"], r["threads"]),
    "overhead": lambda r: (r["tensors"], r["numel"], r["dtype"]),
    "local": lambda r: r["k"],
    "mpi": lambda r: r["k"],
    "peer": lambda r: (r["case"], r["tensors"], r["numel"], r["dtype"], r["threads"]),
    "count": lambda r: r["tensors"],
}


class Run:
    """The result files of one run of scripts/bench."""

    def __init__(self, d):
        self.dir = d
        env = os.path.join(d, "env.json")
        self.env = json.load(open(env)) if os.path.exists(env) else {}
        suite = load(os.path.join(d, "suite.jsonl"))
        peer = load(os.path.join(d, "peer.jsonl"))
        self.machine = next((r for r in suite if r["group"] == "machine"), {})
        self.sweep = [r for r in suite if r["group"] == "sweep"]
        self.layout = [r for r in suite if r["group"] == "layout"]
        self.overhead = [r for r in suite if r["group"] == "overhead"]
        self.local = [r for r in suite if r["group"] == "boundary_local"]
        self.peer_env = next((r for r in peer if r["group"] == "peer_env"), {})
        self.peer = [r for r in peer if r["group"] == "peer"]
        self.count = [r for r in peer if r["group"] == "count"]
        self.mpi = parse_mpi(os.path.join(d, "mpi.txt"))
        self.bindings = parse_bindings(d)
        self.torch_step = load(os.path.join(d, "torch_step.jsonl"))

    def floor_for(self, numel, dtype, threads):
        """The same-run floor of `numel` elements, from the sweep (one flat tensor of that size) or
        the layout rows (the plain fused loop over the layout's tensors)."""
        for r in self.sweep + self.layout:
            if r["numel"] == numel and r["dtype"] == dtype and r["threads"] == threads:
                return floor_of(r)
        return None


def parse_bindings(d):
    """The bindings' per-call costs of one run, seconds per call by language and form (plain, bound,
    bare): Python from bind.py's JSON line, Go from `go test -bench` (the median of its -count lines)."""
    out = {}
    for r in load(os.path.join(d, "bind.jsonl")):
        out[r["language"]] = {name: t["median"] for name, t in r["times"].items()}
    path = os.path.join(d, "go-bench.txt")
    if os.path.exists(path):
        samples = {}
        for line in open(path):
            m = re.match(r"BenchmarkAdd/(\w+)(?:-\d+)?\s+\d+\s+([\d.]+) ns/op", line)
            if m:
                samples.setdefault(m.group(1), []).append(float(m.group(2)) * 1e-9)
        if samples:
            out["go"] = {name: statistics.median(v) for name, v in samples.items()}
    return out


def best_effort(rec):
    name = min((n for n in rec["times"] if n.startswith("torch_be_")), key=lambda n: med(rec, n))
    return name, med(rec, name)


def row_label(rec):
    """A sweep or layout row, in a few words."""
    if "layout" in rec:
        return f"{LAYOUT_NAMES.get(rec['layout'], rec['layout'])} d = {rec.get('d', '?')}, {rec['dtype']}, {rec['threads']} T"
    return f"flat {size(rec['numel'])}, {rec['dtype']}, {rec['threads']} T"


class Report:
    def __init__(self, dirs):
        self.runs = [Run(d) for d in dirs]
        first = self.runs[0]
        # Tables list the first run's rows and times; `each` adds every run's ratios.
        self.env, self.machine, self.peer_env = first.env, first.machine, first.peer_env
        self.sweep, self.layout, self.overhead, self.local = first.sweep, first.layout, first.overhead, first.local
        self.peer, self.count, self.mpi = first.peer, first.count, first.mpi
        self.mpi_n = self.env.get("mpi_numel")
        self.targets = []

    # ---- helpers ----------------------------------------------------------------------------------

    def across(self, group, rec):
        """`rec` (a row of the first run) and the same row in every run, None where a run lacks it."""
        key = KEYS[group](rec)
        return [next((r for r in getattr(run, group) if KEYS[group](r) == key), None) for run in self.runs]

    def values(self, group, rec, f):
        """f(row) in every run (None where a run lacks the row or f fails on it)."""
        out = []
        for r in self.across(group, rec):
            try:
                out.append(None if r is None else f(r))
            except KeyError:
                out.append(None)
        return out

    def each(self, group, rec, f, fmt, bold=False):
        """f(row) of every run, formatted and joined: "1.02 / 1.04"."""
        vals = self.values(group, rec, f)
        if all(v is None for v in vals):
            return "–"
        text = " / ".join("–" if v is None else fmt(v) for v in vals)
        return f"**{text}**" if bold else text

    def per_run(self, xs, fmt):
        return " / ".join(fmt(x) for x in xs)

    def verdict(self, oks):
        """A target is met only when every run meets it."""
        if all(oks):
            return "met"
        if len(oks) > 1 and any(oks):
            return "missed in run " + ", ".join(str(i + 1) for i, ok in enumerate(oks) if not ok)
        return "missed"

    def dram_floor(self, dtype, threads):
        """Seconds per element of the floor for the largest flat size in the sweep (streamed from
        memory): the floor for runs whose buffers the competitors' traffic keeps out of the caches."""
        rs = [r for r in self.sweep if r["dtype"] == dtype and r["threads"] == threads]
        if not rs:
            return None
        r = max(rs, key=lambda r: r["numel"])
        return floor_of(r) / r["numel"], r["numel"]

    def layout_name(self):
        lay = [r for r in self.peer if r["case"] == "transformer"]
        return f"the {lay[0]['numel'] / 1e6:.0f}M-element layout" if lay else "the layout"

    def floor_for(self, numel, dtype, threads):
        return self.runs[0].floor_for(numel, dtype, threads)

    def when(self):
        """When each run started, and the machine's load at its start and end, as a sentence."""
        def load(env):
            return f"{env.get('load_start', '?')} at its start, {env.get('load_end', '?')} at its end"
        if len(self.runs) == 1:
            env = self.runs[0].env
            return ((f"The run started {env['started']}; " if env.get("started") else "") + f"load average (1 min) {load(env)}")
        return "; ".join(f"{'R' if i == 0 else 'r'}un {i + 1} started {run.env.get('started', '?')} (load average, 1 min: {load(run.env)})"
                         for i, run in enumerate(self.runs))

    # ---- sections ---------------------------------------------------------------------------------

    def headline(self):
        rows = []
        lay = [r for r in self.peer if r["case"] == "transformer"]
        for r in lay:
            g = med(r, "gradacc")
            rows.append([r["dtype"], r["threads"], ms(g), ms(med(r, "torch_gradscaler")),
                         self.each("peer", r, lambda r: med(r, "torch_gradscaler") / med(r, "gradacc"), x1, bold=True),
                         ms(best_effort(r)[1]), self.each("peer", r, lambda r: best_effort(r)[1] / med(r, "gradacc"), x1, bold=True),
                         ms(med(r, "torch_plain")), self.each("peer", r, lambda r: med(r, "torch_plain") / med(r, "gradacc"), x1)])
        if not rows:
            return ""
        n = lay[0]["numel"]
        return (f"### One micro-batch of a {n / 1e6:.0f}M-parameter model ({lay[0]['tensors']} tensors), same buffers\n\n"
                f"{lay[0]['tensors']} tensors, {n:,} elements: time of one `add` (unscale, check, accumulate "
                "into FP32) per micro-batch, median" + (" (run 1)" if len(self.runs) > 1 else "")
                + "; × = how many times longer PyTorch takes" + (", in each run" if len(self.runs) > 1 else "") + ".\n\n"
                + table(["grads", "threads", "gradacc ms", "GradScaler seq. ms", "×",
                         "PyTorch best effort ms", "×", "per-tensor plain ms", "×"],
                        rows, ["---", "---:"] + ["---:"] * 7))

    def floor_rows(self, run):
        """The rows the floor target covers: flat tensors from 1M elements and the layouts from 1M."""
        return [r for r in run.sweep + run.layout if r["numel"] >= M]

    def targets_section(self):
        t = []
        runs = self.runs
        # 1. add at the plain fused loop, flat and per layout, 1 and 2 threads, from 1M elements.
        per = [self.floor_rows(run) for run in runs]
        if all(per):
            worst = [max(rows, key=over_floor) for rows in per]
            worst_ratio = [over_floor(w) for w in worst]
            over = [sum(over_floor(r) > FLOOR_TARGET for r in rows) for rows in per]
            flat = sum("layout" not in r for r in per[0])
            measured = (f"worst {self.per_run([f'{x:.2f}× ({row_label(w)})' for x, w in zip(worst_ratio, worst)], str)}, over "
                        f"{len(per[0])} rows ({flat} flat, {len(per[0]) - flat} layout)")
            if any(over):
                measured += f"; rows above {FLOOR_TARGET:.2f}×: {self.per_run(over, str)}"
                # A row a single run puts above the target may be noise; one every run does is not.
                above = [{row_label(r) for r in rows if over_floor(r) > FLOOR_TARGET} for rows in per]
                every = sorted(set.intersection(*above)) if len(per) > 1 else []
                measured += (f"; above it in every run: {', '.join(every)}" if every else
                             "; no row above it in every run" if len(per) > 1 else "")
            t.append([f"`add` ≤ {FLOOR_TARGET:.2f}× the plain fused loop per layout, 1 and 2 threads, ≥ 1M elements", measured,
                      self.verdict([n == 0 for n in over])])
        # 2, 3. against PyTorch, on the 16-bit (mixed-precision) configurations; a configuration
        # meets a goal only when it does in every run.
        mixed = [r for r in self.peer if r["dtype"] != "f32"]
        if mixed:
            def ratios(rs, f):
                return [[v for v in self.values("peer", r, f) if v is not None] for r in rs]

            def verdict(vals, goal):
                hit = sum(all(v >= goal for v in vs) for vs in vals)
                return "met" if hit == len(vals) else f"met in {hit} of {len(vals)}" if hit else "missed"

            def spans(vals):
                return self.per_run([span([vs[i] for vs in vals if i < len(vs)], x1) for i in range(len(runs))], str)

            lay = [r for r in mixed if r["case"] == "transformer"]
            for goal, f, what in ((5, lambda r: med(r, "torch_gradscaler") / med(r, "gradacc"), "PyTorch's GradScaler sequence"),
                                  (2.5, lambda r: best_effort(r)[1] / med(r, "gradacc"), "PyTorch's best effort")):
                al, ly = ratios(mixed, f), ratios(lay, f)
                measured = f"all {len(al)} configurations: {spans(al)}"
                if ly:
                    measured = f"{self.layout_name()}: {spans(ly)} ({verdict(ly, goal)}); " + measured
                t.append([f"≥ {goal:g}× faster than {what} (f16/bf16 grads)", measured,
                          (f"layout {verdict(ly, goal)}; all: " if ly else "") + verdict(al, goal)])
        # 4. overhead of 1000 small tensors.
        per = [[r for r in run.overhead if r["tensors"] == 1000 and r["numel"] == 1000] for run in runs]
        if all(per):
            worst = [max(rows, key=lambda r: med(r, "c_abi") - floor_of(r)) for rows in per]
            over = [med(w, "c_abi") - floor_of(w) for w in worst]
            tiny = [max((med(r, "c_abi") for r in run.overhead if r["tensors"] == 1000 and r["numel"] == 1), default=0) for run in runs]
            t.append(["per-call overhead, 1,000 tensors × 1,000 elements, below 50 µs",
                      f"{self.per_run([f'{x * 1e6:.1f} µs (' + w['dtype'] + ')' for x, w in zip(over, worst)], str)} through the C ABI "
                      f"(worst dtype); 1,000 × 1 element: {self.per_run(tiny, lambda x: f'{x * 1e6:.1f}')} µs per call",
                      self.verdict([x < 50e-6 for x in over])])
        # 4b. the bindings' prepared call over 1,000 tensors.
        for lang, name, call in (("python", "Python", "`Accumulator.add` of bound gradients"), ("go", "Go", "`AddBound`")):
            per = [run.bindings.get(lang) for run in runs]
            if all(per):
                t.append([f"{name}: {call}, 1,000 tensors, ≤ {BINDING_TARGET * 1e6:.0f} µs per call",
                          f"{self.per_run([b['bound'] for b in per], us)} µs (the bare C call: "
                          f"{self.per_run([b['bare'] for b in per], us)} µs; the plain call: {self.per_run([b['plain'] for b in per], us)} µs)",
                          self.verdict([b["bound"] <= BINDING_TARGET for b in per])])
        # 5. the in-process boundary against a bare all-reduce of the same bytes.
        if all(run.local for run in runs):
            parts, oks = [], []
            for name, what in (("deferred", "`sync`"), ("clipped", "with clipping")):
                if not all(all(has(r, name) for r in run.local) for run in runs):
                    continue
                worst = [max(ratio(r, name, "bare") for r in run.local) for run in runs]
                parts.append(f"{what} {self.per_run(worst, x2)}")
                if name == "deferred":
                    oks.append([w <= BOUNDARY_TARGET for w in worst])
            t.append([f"in-process boundary (2 ranks), `sync` ≤ {BOUNDARY_TARGET:.2f}× a bare all-reduce of the same bytes "
                      "(with clipping shown beside it: one more pass over the rank's own shares)",
                      "worst over K = 1, 4, 8: " + "; ".join(parts),
                      self.verdict([all(ok) for ok in zip(*oks)])])
        # 6. the MPI boundary against the fastest all-reduce of the same bytes (one call or pieces).
        if all(run.mpi for run in runs):
            parts, oks = [], []
            for name, what in (("deferred", "`sync`"), ("clipped", "with clipping"), ("messages", "as MPI messages")):
                if not all(all(name in r for r in run.mpi) for run in runs):
                    continue
                worst = [max(over_fastest(r, name) for r in run.mpi) for run in runs]
                parts.append(f"{what} {self.per_run(worst, x2)}")
                if name == "deferred":
                    oks.append([w <= BOUNDARY_TARGET for w in worst])
            t.append([f"MPI boundary (2 processes), `sync` ≤ {BOUNDARY_TARGET:.2f}× the fastest `MPI_Allreduce` of the same "
                      "bytes (one call or pieces; with clipping, and with the data as MPI messages instead of shared memory, "
                      "shown beside it)", "worst over K = 1, 4, 8: " + "; ".join(parts),
                      self.verdict([all(ok) for ok in zip(*oks)])])
        # 7. the boundary plus optimizer step against PyTorch's CPU sequence, per thread count.
        if all(run.torch_step for run in runs):
            threads = sorted({r["threads"] for r in runs[0].torch_step})
            parts, oks = [], []
            for n in threads:
                x = [next((r["speedup"] for r in run.torch_step if r["threads"] == n), 0.0) for run in runs]
                parts.append(f"{n} thread{'s' if n > 1 else ''}: {self.per_run(x, x2)}×")
                oks.append([v >= STEP_TARGET for v in x])
            numel = runs[0].torch_step[0]["numel"]
            t.append([f"≥ {STEP_TARGET:g}× faster than PyTorch's CPU sequence for the boundary plus optimizer step "
                      "(`GradScaler.unscale_`, `clip_grad_norm_`, `AdamW(fused=True)`, the copy into the bf16 parameters; "
                      f"{numel:,} parameters, `scripts/bench-torch`; docs/optimizer.md, \"Against PyTorch's step\")",
                      "; ".join(parts), self.verdict([all(ok) for ok in zip(*oks)])])
        self.targets = t
        lead = ""
        if len(runs) > 1:
            lead = (f"Each measured value is given for every run, run 1 / run {len(runs)}" if len(runs) == 2 else
                    f"Each measured value is given for every run, run 1 / … / run {len(runs)}")
            lead += "; a target counts as met only when every run meets it.\n\n"
        return lead + table(["target", "measured", ""], t, ["---", "---", "---"])

    def limits(self):
        text = LIMITS
        lay = [r for r in self.layout if r["dtype"] != "f32" and r["layout"] == "transformer"
               and any(p["case"] == "transformer" and p["numel"] == r["numel"] for p in self.peer)]
        peer = [r for r in self.peer if r["case"] == "transformer" and r["dtype"] != "f32"]
        if lay and peer:
            at = [v for r in lay for v in self.values("layout", r, over_floor) if v is not None]
            # PyTorch's best effort against its own bound: the floor's time scaled from gradacc's
            # 10 B per element to the 14 B the best form moves.
            own = []
            for r in peer:
                for run, p in zip(self.runs, self.across("peer", r)):
                    fl = run.floor_for(r["numel"], r["dtype"], r["threads"]) if p else None
                    if fl:
                        own.append(best_effort(p)[1] / (fl * 14 / 10))
            runs = (" (both runs; table below)" if len(self.runs) == 2 else f" (all {len(self.runs)} runs; table below)" if len(self.runs) > 2
                    else " (table below)")
            text += (f"\n\nOn {self.layout_name()} with 16-bit gradients, gradacc ran at {min(at):.2f}–{max(at):.2f}× "
                     f"the plain fused loop of the same run{runs}"
                     + (f", and PyTorch's best effort at {min(own):.1f}–{max(own):.1f}× the "
                        "time its 14 B per element would take at that loop's bandwidth" if own else "") + ".")
            mixed = [r for r in self.peer if r["dtype"] != "f32"]
            missed = any(med(r, "torch_gradscaler") < 5 * med(r, "gradacc") or best_effort(r)[1] < 2.5 * med(r, "gradacc")
                         for r in mixed)
            if missed:
                text += (" Where a ratio stays under its target, gradacc is at its floor and PyTorch is within a small "
                         "factor of its own: the ratio is bounded by the bytes each side must move, and no change "
                         "inside gradacc can move fewer than the g + 8 B per element the fused pass needs. The targets "
                         "are reached where PyTorch falls further below bandwidth: fresh pages for large temporaries "
                         "(flat tensors of 16M elements and more) and per-tensor dispatch (many small tensors).")
        return text

    def sweep_section(self):
        rows = []
        for r in sorted(self.sweep, key=lambda r: (r["dtype"] != "f16", r["dtype"] != "bf16", r["threads"], r["numel"])):
            n, fl = r["numel"], floor_of(r)
            g = med(r, "gradacc")
            rows.append([size(n), r["dtype"], r["threads"], f"{g * 1e9 / n:.3f}", f"{r['bytes'] / g / 1e9:.1f}",
                         f"{med(r, 'copy') * 1e9 / n:.3f}", f"{med(r, 'triad') * 1e9 / n:.3f}",
                         f"{fl * 1e9 / n:.3f}", f"{r['bytes'] / fl / 1e9:.1f}",
                         self.each("sweep", r, over_floor, x2, bold=True),
                         self.each("sweep", r, lambda r: spread(r, "gradacc"), pct)])
        return table(["elements", "grads", "threads", "gradacc ns/elem", "gradacc GB/s", "copy ns/elem", "triad ns/elem",
                      "plain fused ns/elem", "floor GB/s", "gradacc ÷ floor", "spread"],
                     rows, ["---:", "---", "---:"] + ["---:"] * 8)

    def layout_section(self):
        rows = []
        key = lambda r: (list(LAYOUT_NAMES).index(r["layout"]) if r["layout"] in LAYOUT_NAMES else 9, r["numel"],
                         ["f16", "bf16", "f32"].index(r["dtype"]), r["threads"])
        for r in sorted(self.layout, key=key):
            g, fl = med(r, "gradacc"), floor_of(r)
            rows.append([f"{LAYOUT_NAMES.get(r['layout'], r['layout'])}, d = {r.get('d', '?')}", r["tensors"], millions(r["numel"]),
                         r["dtype"], r["threads"], ms(g), ms(fl),
                         self.each("layout", r, over_floor, x2, bold=True),
                         ms(med(r, "triad")), f"{r['bytes'] / g / 1e9:.1f}",
                         self.each("layout", r, lambda r: spread(r, "gradacc"), pct)])
        if not rows:
            return ""
        peer = next((p for p in self.peer if p["case"] == "transformer"), None)
        d = next((r.get("d") for r in self.layout if r["layout"] == "transformer" and peer and r["numel"] == peer["numel"]), None)
        return (LAYOUT_METHOD + (f" The GPT-style layout at d = {d} is the one of the PyTorch comparison." if d else "") + "\n\n"
                + table(["layout", "tensors", "elements", "grads", "threads", "gradacc ms", "plain fused ms", "÷ plain fused",
                         "triad, flat ms", "gradacc GB/s", "spread"], rows, ["---", "---:", "---:", "---", "---:"] + ["---:"] * 6))

    def peer_section(self):
        rows = []
        order = {"flat": 0, "transformer": 1, "small": 2}
        for r in sorted(self.peer, key=lambda r: (order[r["case"]], r["numel"] // r["tensors"] if r["case"] == "small" else 0,
                                                  r["numel"], ["f16", "bf16", "f32"].index(r["dtype"]), r["threads"])):
            g = med(r, "gradacc")
            be_name, be = best_effort(r)
            layout = (f"1 × {size(r['numel'])}" if r["case"] == "flat" else
                      f"{r['tensors']} × {size(r['numel'] // r['tensors'])}" if r["case"] == "small" else
                      f"transformer, {r['tensors']} tensors")
            rows.append([layout, r["dtype"], r["threads"], ms(g), ms(med(r, "gradacc_binding")),
                         ms(med(r, "torch_gradscaler")), self.each("peer", r, lambda r: med(r, "torch_gradscaler") / med(r, "gradacc"), x1),
                         ms(med(r, "torch_plain")), self.each("peer", r, lambda r: med(r, "torch_plain") / med(r, "gradacc"), x1),
                         ms(be), self.each("peer", r, lambda r: best_effort(r)[1] / med(r, "gradacc"), x1),
                         be_name.replace("torch_be_", ""), self.each("peer", r, lambda r: spread(r, "gradacc"), pct)])
        return table(["tensors", "grads", "threads", "gradacc ms", "gradacc via `Accumulator.add` ms", "GradScaler seq. ms", "×",
                      "plain ms", "×", "best effort ms", "×", "fastest best-effort form", "spread"],
                     rows, ["---", "---", "---:"] + ["---:"] * 8 + ["---", "---:"])

    def candidates_section(self):
        names = sorted({n for r in self.peer for n in r["times"] if n.startswith("torch_be_")})
        rows = []
        for r in self.peer:
            if r["case"] != "transformer":
                continue
            rows.append([r["dtype"], r["threads"]]
                        + [f"{med(r, n) * 1e3:.1f} ({self.each('peer', r, lambda r, n=n: med(r, n) / med(r, 'gradacc'), x1)})"
                           for n in names])
        if not rows:
            return ""
        return table(["grads", "threads"] + [f"`{n.replace('torch_be_', '')}` ms (×)" for n in names], rows,
                     ["---", "---:"] + ["---:"] * len(names))

    def overhead_section(self):
        rows = []
        for r in self.overhead:
            fl = floor_of(r)
            c = med(r, "c_abi")
            py = next((p for p in self.peer if p["case"] in ("small", "flat") and p["tensors"] == r["tensors"]
                       and p["numel"] == r["tensors"] * r["numel"] and p["dtype"] == r["dtype"] and p["threads"] == 1), None)
            rows.append([f"{r['tensors']:,} × {r['numel']:,}", r["dtype"], us(med(r, "rust_api")), us(c), us(fl),
                         self.each("overhead", r, lambda r: med(r, "c_abi") - floor_of(r), us, bold=True),
                         self.each("overhead", r, lambda r: (med(r, "c_abi") - floor_of(r)) / r["tensors"] * 1e9, lambda x: f"{x:.0f}")
                         if r["tensors"] > 1 else "–",
                         self.each("overhead", r, lambda r: spread(r, "c_abi"), pct),
                         us(med(py, "gradacc")) if py else "–", us(med(py, "gradacc_binding")) if py else "–",
                         self.each("peer", py, lambda r: spread(r, "gradacc_binding"), pct) if py else "–"])
        return table(["tensors × elements", "grads", "Rust API µs", "C ABI µs", "floor µs", "C ABI − floor µs",
                      "per tensor ns", "C ABI spread", "Python, ctypes µs", "Python, `Accumulator.add` µs",
                      "`Accumulator.add` spread"], rows, ["---", "---"] + ["---:"] * 9)

    def bindings_section(self):
        rows = []
        for lang, name in (("python", "Python (`Accumulator.add`)"), ("go", "Go (`Accumulator.Add`)")):
            per = [run.bindings.get(lang) for run in self.runs]
            if not all(per):
                continue
            rows.append([name] + [self.per_run([b[form] for b in per], us) for form in ("plain", "bound", "bare")]
                        + [self.per_run([b["bound"] - b["bare"] for b in per], us)])
        if not rows:
            return "Not measured in this run."
        return table(["binding", "plain call µs", "bound call µs", "bare C call µs", "bound − bare µs"], rows,
                     ["---"] + ["---:"] * 4)

    def count_section(self):
        rows = []
        for r in sorted(self.count, key=lambda r: r["tensors"]):
            g = med(r, "gradacc")
            be_name, be = best_effort(r)
            n = r["numel"]
            rows.append([f"{r['tensors']:,}", f"{n // r['tensors']:,}", f"{g * 1e9 / n:.3f}", f"{med(r, 'gradacc_binding') * 1e9 / n:.3f}",
                         f"{med(r, 'torch_gradscaler') * 1e9 / n:.2f}", f"{be * 1e9 / n:.2f}", be_name.replace("torch_be_", ""),
                         self.each("count", r, lambda r: med(r, "torch_gradscaler") / med(r, "gradacc"), x1),
                         self.each("count", r, lambda r: best_effort(r)[1] / med(r, "gradacc"), x1)])
        if not rows:
            return ""
        n = self.count[0]["numel"]
        fl = self.dram_floor("f16", 1)
        lead = (f"{size(n)} f16 elements in all, cut into equal tensors, 1 thread; ns per element. PyTorch's "
                "temporaries and staging push the buffers out of the caches between calls, so the floor to compare with is "
                "the one streamed from memory" + (f": {fl[0] * 1e9:.3f} ns/element (the {size(fl[1])} row of the sweep)" if fl else "")
                + ".\n\n")
        one, most = min(self.count, key=lambda r: r["tensors"]), max(self.count, key=lambda r: r["tensors"])
        per = (med(most, "gradacc") - med(one, "gradacc")) / (most["tensors"] - one["tensors"])
        tail = (f"\n\nFrom {one['tensors']:,} to {most['tensors']:,} tensors gradacc's call grows by {per * 1e9:.0f} ns per "
                "tensor (the ctypes call included): the per-call checks, and each tensor's unaligned head and "
                "short tail, which the SIMD loops hand to the scalar kernel (up to 15 elements each).")
        return lead + table(["tensors", "elements each", "gradacc", "gradacc via `Accumulator.add`", "GradScaler seq.",
                             "best effort", "fastest form", "GradScaler ×", "best effort ×"], rows,
                            ["---:", "---:", "---:", "---:", "---:", "---:", "---", "---:", "---:"]) + tail

    def boundary_section(self):
        out = []
        if self.local:
            n = self.local[0]["numel"]
            rows = [[r["k"], ms(med(r, "deferred")), ms(med(r, "clipped")) if has(r, "clipped") else "–", ms(med(r, "naive")),
                     self.each("local", r, lambda r: med(r, "naive") / med(r, "deferred"), x2), ms(med(r, "bare")),
                     self.each("local", r, lambda r: ratio(r, "deferred", "bare"), x2, bold=True),
                     self.each("local", r, lambda r: ratio(r, "clipped", "bare"), x2, bold=True),
                     self.each("local", r, lambda r: spread(r, "deferred"), pct)]
                    for r in self.local]
            header = ["K", "deferred `sync` ms", "clipped `sync` ms", "all-reduce per micro-batch ms",
                      "per-micro-batch ÷ deferred", "bare all-reduce ms", "sync ÷ bare", "clipped ÷ bare", "spread"]
            # The reduce-scatter's sync (each rank keeps only its shard), where the run timed it.
            if all(has(r, "reduce_scatter") for r in self.local):
                header[3:3] = ["reduce-scatter `sync` ms", "reduce-scatter ÷ deferred"]
                for row, r in zip(rows, self.local):
                    row[3:3] = [ms(med(r, "reduce_scatter")),
                                self.each("local", r, lambda r: ratio(r, "reduce_scatter", "deferred"), x2, bold=True)]
            out.append(f"In-process communicator, 2 ranks (one thread each), {n:,} fp16 parameters in one tensor:\n\n"
                       + table(header, rows))
        if self.mpi:
            rows = [[r["k"], ms(r["deferred"]), ms(r["clipped"]) if "clipped" in r else "–",
                     ms(r["messages"]) if "messages" in r else "–", ms(r["naive"]),
                     self.each("mpi", r, lambda r: r["naive"] / r["deferred"], x2), ms(r["bare"]),
                     f"{ms(r['fastest'])} ({r['fastest_form']})",
                     self.each("mpi", r, lambda r: over_fastest(r, "deferred"), x2, bold=True),
                     self.each("mpi", r, lambda r: over_fastest(r, "clipped"), x2, bold=True),
                     self.each("mpi", r, lambda r: over_fastest(r, "messages"), x2) if "messages" in r else "–"]
                    for r in self.mpi]
            n = f"{self.mpi_n:,}" if self.mpi_n else "the same number of"
            out.append(f"Open MPI, 2 processes on this host (`scripts/bench-mpi {self.mpi_n}`), {n} fp16 parameters in one tensor; "
                       "*fastest all-reduce* is the fastest way `MPI_Allreduce` moved the same bytes in that run, one call or "
                       "pieces of one size, by median; each ratio to it is the median of the per-repeat ratios:\n\n"
                       + table(["K", "deferred `sync` ms", "clipped `sync` ms", "messages `sync` ms",
                                "`MPI_Allreduce` per micro-batch ms", "per-micro-batch ÷ deferred", "bare `MPI_Allreduce` ms",
                                "fastest all-reduce ms", "sync ÷ fastest", "clipped ÷ fastest", "messages ÷ fastest"], rows))
        return "\n\n".join(out)

    # ---- plot -------------------------------------------------------------------------------------

    def plot(self, path):
        fig, ax = plt.subplots(2, 2, figsize=(13, 9.5))
        colors = {"f16": "tab:blue", "bf16": "tab:green", "f32": "tab:orange"}

        a = ax[0][0]
        for dtype in ("f16", "bf16", "f32"):
            rs = sorted((r for r in self.sweep if r["dtype"] == dtype and r["threads"] == 1), key=lambda r: r["numel"])
            if not rs:
                continue
            x = [r["numel"] for r in rs]
            a.plot(x, [med(r, "gradacc") * 1e9 / r["numel"] for r in rs], "o-", color=colors[dtype], label=f"gradacc {dtype}")
            a.plot(x, [floor_of(r) * 1e9 / r["numel"] for r in rs], "--", color=colors[dtype], alpha=0.6, label=f"floor (plain fused) {dtype}")
        rs = sorted((r for r in self.sweep if r["dtype"] == "f16" and r["threads"] == 2), key=lambda r: r["numel"])
        if rs:
            a.plot([r["numel"] for r in rs], [med(r, "gradacc") * 1e9 / r["numel"] for r in rs], "s:", color="tab:purple",
                   label="gradacc f16, 2 threads")
        for cache, b in (("L2", 2 * M), ("L3 (reported)", 300 * M)):
            # The element count at which the fused pass's f16 working set (10 B/element) fills the cache.
            n = b / 10
            if self.sweep and n <= max(r["numel"] for r in self.sweep):
                a.axvline(n, color="grey", lw=0.8, ls=":")
                a.text(n, 0.98, f" {cache} full (f16)", rotation=90, va="top", fontsize=7,
                       transform=a.get_xaxis_transform())
        a.set_xscale("log", base=2)
        a.set_yscale("log")
        a.set_xlabel("elements (one flat tensor)")
        a.set_ylabel("ns per element")
        a.set_title("add: time per element vs size, 1 thread")
        a.legend(fontsize=7)
        a.grid(True, which="both", alpha=0.3)

        a = ax[0][1]
        lay = [r for r in self.peer if r["case"] == "transformer"]
        if lay:
            labels = [f"{r['dtype']}\n{r['threads']}T" for r in lay]
            series = [("gradacc", lambda r: med(r, "gradacc")), ("PyTorch best effort", lambda r: best_effort(r)[1]),
                      ("GradScaler sequence", lambda r: med(r, "torch_gradscaler")), ("per-tensor plain", lambda r: med(r, "torch_plain"))]
            w = 0.2
            for i, (name, f) in enumerate(series):
                a.bar([j + (i - 1.5) * w for j in range(len(lay))], [f(r) * 1e3 for r in lay], w, label=name)
            fl = [self.floor_for(r["numel"], r["dtype"], r["threads"]) for r in lay]
            a.scatter([j - 1.5 * w for j in range(len(lay))], [f * 1e3 if f else 0 for f in fl], marker="_", s=300, color="black",
                      zorder=3, label="floor (same bytes)")
            a.set_xticks(range(len(lay)))
            a.set_xticklabels(labels)
            a.set_yscale("log")
            a.set_ylabel("ms per micro-batch (log scale)")
            a.set_title(f"one add of the {lay[0]['numel'] / 1e6:.0f}M-parameter layout ({lay[0]['tensors']} tensors)")
            a.legend(fontsize=7)
            a.grid(True, axis="y", alpha=0.3)

        a = ax[1][0]
        cs = sorted(self.count, key=lambda r: r["tensors"])
        if cs:
            x = [r["tensors"] for r in cs]
            n = cs[0]["numel"]
            a.plot(x, [med(r, "gradacc") * 1e9 / n for r in cs], "o-", label="gradacc (C ABI through ctypes)")
            a.plot(x, [med(r, "gradacc_binding") * 1e9 / n for r in cs], "o:", label="gradacc (Accumulator.add)")
            a.plot(x, [best_effort(r)[1] * 1e9 / n for r in cs], "s-", label="PyTorch best effort")
            a.plot(x, [med(r, "torch_gradscaler") * 1e9 / n for r in cs], "^-", label="PyTorch GradScaler sequence")
            fl = self.dram_floor("f16", 1)
            if fl:
                a.axhline(fl[0] * 1e9, color="black", ls="--", lw=1, label=f"floor from memory ({size(fl[1])} flat)")
            a.set_xscale("log")
            a.set_yscale("log")
            a.set_xlabel(f"tensors ({size(n)} f16 elements in all)")
            a.set_ylabel("ns per element")
            a.set_title("add: time per element vs tensor count, 1 thread")
            a.legend(fontsize=7)
            a.grid(True, which="both", alpha=0.3)

        a = ax[1][1]
        groups = []
        if self.local:
            groups.append(("in-process, 2 ranks", {r["k"]: (med(r, "deferred"), med(r, "naive")) for r in self.local}))
        if self.mpi:
            groups.append(("MPI, 2 processes", {r["k"]: (r["deferred"], r["naive"]) for r in self.mpi}))
        ks = [1, 4, 8]
        w = 0.2
        for gi, (name, vals) in enumerate(groups):
            off = (gi - (len(groups) - 1) / 2) * 2 * w
            a.bar([k + off - w / 2 for k in range(len(ks))], [vals.get(k, (0, 0))[0] * 1e3 for k in ks], w, label=f"{name}: deferred sync")
            a.bar([k + off + w / 2 for k in range(len(ks))], [vals.get(k, (0, 0))[1] * 1e3 for k in ks], w,
                  label=f"{name}: all-reduce per micro-batch", alpha=0.6)
        a.set_xticks(range(len(ks)))
        a.set_xticklabels([f"K = {k}" for k in ks])
        a.set_ylabel("ms per optimizer step (communication part)")
        n = self.local[0]["numel"] if self.local else 0
        a.set_title(f"boundary: {n / 1e6:.0f}M fp16 parameters, K micro-batches per step")
        a.legend(fontsize=7)
        a.grid(True, axis="y", alpha=0.3)

        fig.suptitle(f"gradacc on {self.env.get('cpu', 'this machine')}, {self.env.get('cores', '?')} cores"
                     + (f" (run 1 of {len(self.runs)})" if len(self.runs) > 1 else ""), fontsize=11)
        fig.tight_layout()
        fig.savefig(path, dpi=110)

    # ---- the page ---------------------------------------------------------------------------------

    def markdown(self, png_name):
        env = self.env
        pe = self.peer_env
        quick = self.machine.get("quick")
        runs = "one run" if len(self.runs) == 1 else f"{len(self.runs)} runs"
        parts = [
            "# Performance",
            "",
            f"<!-- Generated by scripts/bench (benches/python/report.py) from {runs}; do not edit by hand. -->",
            "",
            "What gradacc costs next to the machine's memory-bandwidth floor and next to what a PyTorch user runs "
            f"instead, measured in {runs} of `scripts/bench`" + (" **(a --quick smoke run: smaller sizes, fewer rounds)**" if quick else "")
            + (". Tables give the times of run 1 and, for every ratio, overhead and spread, the value of each run in turn "
               f"({' / '.join(f'run {i + 1}' for i in range(len(self.runs)))}); a target counts as met only when every run meets it."
               if len(self.runs) > 1 else "."),
            "",
            f"Machine: {env.get('cpu', '?')} ({env.get('cores', '?')} cores, {env.get('memory', '?')} RAM"
            + (f", {env['virtualization']}" if env.get("virtualization") else "") + f"), kernels on the `{self.machine.get('isa', '?')}` path; "
            f"{env.get('rustc', 'rustc ?')}; PyTorch {pe.get('torch', '?')} from PyPI ({pe.get('torch_cpu_capability', '?')} kernels, "
            f"{pe.get('torch_parallel', '').replace('ATen parallel backend: ', '')} threads), Python {pe.get('python', '?')}. "
            f"{self.when()}. The machine is shared, so the 2-thread rows compete with other work for the second core.",
            "",
            f"![gradacc performance]({png_name})",
            "",
            self.headline(),
            "",
            "## Targets",
            "",
            self.targets_section(),
            "",
            self.limits(),
            "",
            "## `add` against the memory-bandwidth floor",
            "",
            FLOOR_METHOD,
            "",
            self.sweep_section(),
            "",
            "### Model layouts",
            "",
            self.layout_section(),
            "",
            "## `add` against PyTorch, same buffers",
            "",
            PEER_METHOD,
            "",
            self.peer_section(),
            "",
            f"The best-effort candidates on {self.layout_name()} (each one's time, and × gradacc):",
            "",
            self.candidates_section(),
            "",
            "## Per-call overhead",
            "",
            OVERHEAD_METHOD,
            "",
            self.overhead_section(),
            "",
            "### The bindings' hot call",
            "",
            BINDINGS_METHOD,
            "",
            self.bindings_section(),
            "",
            "## Scale with tensor count",
            "",
            self.count_section(),
            "",
            "## The boundary",
            "",
            BOUNDARY_METHOD,
            "",
            self.boundary_section(),
            "",
            "## Method",
            "",
            METHOD,
        ]
        return "\n".join(p for p in parts) + "\n"

    def summary(self):
        lines = ["", f"Targets ({len(self.runs)} run{'s' if len(self.runs) > 1 else ''}):"]
        for name, measured, verdict in self.targets:
            lines.append(f"  [{verdict}] {name}: {measured}")
        lay = [r for r in self.peer if r["case"] == "transformer"]
        if lay:
            lines.append("")
            lines.append(f"{self.layout_name()}, one add (ms, run 1; x in every run): gradacc | GradScaler sequence | PyTorch best effort")
            for r in lay:
                g = med(r, "gradacc")
                gs = self.each("peer", r, lambda r: med(r, "torch_gradscaler") / med(r, "gradacc"), lambda x: f"{x:.1f}x")
                be = self.each("peer", r, lambda r: best_effort(r)[1] / med(r, "gradacc"), lambda x: f"{x:.1f}x")
                lines.append(f"  {r['dtype']:>4} {r['threads']}T  {g * 1e3:7.1f} | {med(r, 'torch_gradscaler') * 1e3:7.1f} ({gs}) | "
                             f"{best_effort(r)[1] * 1e3:7.1f} ({be})")
        return "\n".join(lines)


LIMITS = """\
What bounds the ratios to PyTorch. Each sequence is bandwidth-bound, so its cost is the bytes it moves
per element. gradacc's fused pass moves g + 8 B (g = 2 for f16/bf16, 4 for f32: read the gradient,
read and write the master). The GradScaler sequence moves 4 B (unscale the 16-bit gradient in
place), then 2 + 4 B plus the new temporary's pages (`g.float()`), then 12 B (`master.add_`): 22 B
and more against 10 B, **2.2× at equal bandwidth**. The best PyTorch forms without temporaries move
4 + 10 = 14 B (`_amp_foreach_non_finite_check_and_unscale_` in place, then an add of the 16-bit
gradient into FP32): **1.4× at equal bandwidth**. With f32 gradients the GradScaler sequence moves
8 + 12 = 20 B against 12 B: **1.7×**. Ratios above these come from PyTorch's kernels running below
bandwidth (mixed-dtype adds through TensorIterator's casting loop, per-tensor dispatch, fresh pages
for every temporary), not from gradacc moving fewer bytes than the fused pass needs."""

BINDINGS_METHOD = """\
A training loop's per-micro-batch call from Python and Go over 1,000 tensors of 4 fp16 elements (so
the C work itself is small): the *plain* call, which checks and converts every gradient buffer each
time; the *bound* call, over buffers checked once (`Accumulator.bind` in Python, `Bind` and
`AddBound` in Go); and the *bare* C call `gradacc_accumulator_add` that both make, from the same
language. Python: `benches/python/bind.py`, the three taking turns, median of 200 calls each. Go:
`go test -bench BenchmarkAdd -benchtime 2000x -count 5` in `bindings/go`, the median of the five."""

FLOOR_METHOD = """\
One flat tensor, gradacc's `Accumulator::add` (`assign = false`: a window in progress) against three
loops on the same 64-byte-aligned master and the same gradient buffer, with the same ISA and the
same threads (`benches/suite.rs`, loops in `benches/common/mod.rs`):

- **copy** `m[i] = widen(g[i])`: reads the gradient, writes the master (the store reads each master
  line in first on this CPU, so it moves about the same bytes; it shows the bandwidth of a plain
  stream);
- **triad** `m[i] = m[i] + widen(g[i]) * s`: the fused pass's traffic and arithmetic without its
  non-finite check;
- **plain fused**: the plainest loop that does the whole fused pass (per vector: widen, multiply,
  add, store, keep the largest exponent field; no unrolling, alignment or prefetch), one call per
  tensor, the loop a user would write instead of calling `add`; with 2 threads it cuts the
  elements into two runs of equal length, as `add` does.

The **floor** is the plain fused loop, here and for the model layouts below; GB/s counts g + 8 B per
element. Sizes below about 200K elements (f16) fit in L2, larger ones in L3 up to the L3 size
`lscpu` reports, and the rest stream from DRAM. Below `MIN_ELEMENTS_PER_THREAD` (256K elements per
thread) both gradacc and the floors run on one thread, so the 2-thread rows equal the 1-thread
ones there."""

LAYOUT_METHOD = """\
Two stacks of tensors at several widths d, in parameter order, gradients allocated one by one:
*GPT-2-like*, 148 tensors (token embedding 64·d × d, position embedding 1024 × d, 12 blocks of
LayerNorm, attention (d × 3d, d × d) and MLP (d × 4d, 4d × d) weights with their biases, a final
LayerNorm: 98 tensors of d to 4d elements), and *GPT-style*, 500 tensors (embeddings 4096·d × d and
512 × d, 31 blocks with separate q/k/v/o projections: 310 tensors of d or 4d elements). gradacc's `add` writes one flat master (the
layout `Accumulator::new` makes, in an adopted 64-byte-aligned buffer); the floor is the **plain fused loop run per tensor over
per-tensor masters, each allocated on its own** (what a user's own parameters are), reading the
same gradients; *triad, flat* is the triad over gradacc's flat master. Both sides' masters are
allocated together, for each model, so that neither gets its memory in another state of the
machine. The three take turns. GB/s counts g + 8 B per element."""

PEER_METHOD = """\
`benches/python/peer.py`, one process: the gradients are PyTorch tensors allocated one per parameter,
the FP32 master is one flat PyTorch tensor split into per-parameter views, and gradacc adopts that
very tensor as its master (`gradacc_accumulator_create_with_buffer`) and reads the gradients through
their data pointers, so both sides touch the same memory. Per micro-batch each variant must unscale,
detect inf/NaN and accumulate into FP32; the script first checks every variant on small tensors for
the right master values, no false alarm and a detected inf.

- **gradacc**: `gradacc_accumulator_add` through ctypes, the pointer array built once (the
  *`Accumulator.add`* column is the Python binding's method, which rebuilds it from the tensors on
  every call);
- **GradScaler sequence**: `torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)`,
  then `master.add_(g.float())` per tensor: what GradScaler plus an FP32 master accumulation runs;
- **plain**: per tensor, `u = g.float() * inv_scale`, `~torch.isfinite(u).all()` into the flag,
  `master.add_(u)`;
- **best effort**: the fastest, per configuration, of four forms with no per-step allocation:
  `unscale_foreach_add` (unscale in place, `torch._foreach_add_(masters, grads)`), `staging`
  (`torch._foreach_copy_` into preallocated FP32 staging, unscale there, `_foreach_add_`),
  `check_add_alpha` (the unscale kernel at 1.0 as a pure check, then `_foreach_add_(masters, grads,
  alpha=inv_scale)`), `unscale_add_per_tensor` (unscale in place, `master.add_(g)` per tensor).

`torch.set_num_threads(t)` and gradacc's `threads = t` match. "×" is PyTorch's time ÷ gradacc's."""

OVERHEAD_METHOD = """\
Overhead = the call's time minus the floor's time for the same bytes: the plain fused loop over one
flat buffer of the same element count, taking turns with the call so both run from the same cache level
(`benches/suite.rs`, 1 thread, gradients allocated one by one). *C ABI* is `gradacc_accumulator_add`,
what every binding calls; *Rust API* is `Accumulator::add`. The Python columns come from
`peer.py` and include the ctypes call (and, for `Accumulator.add`, building the pointer array)."""

BOUNDARY_METHOD = """\
`sync` time per optimizer step: *deferred* is gradacc's boundary (control reduction, all-reduce of
the FP32 master, normalisation and norm) once per K micro-batches; *clipped* is the same with
`max_grad_norm` below the gradient's norm, so clipping applies; *all-reduce per micro-batch* is the
pattern without deferral, an all-reduce of an FP32 gradient of the same size after every
micro-batch; *bare* is one all-reduce of the same bytes and nothing else; *reduce-scatter* (in
process) is `sync` with `Sharding::ReduceScatter`, after which each rank holds only its shard. The
target is `sync`
within 1.10× of the bare all-reduce (over MPI: of the fastest all-reduce of the same bytes; the MPI
`sync` moves its data through shared memory, the ranks being on one host, and *messages* is the same
`sync` with `shared_memory = 0`, its data as MPI messages as between hosts). With
clipping the factor needs the global norm, so each rank passes over its own shares once more, after
the block sums are shared and before the shares are: 1/world of the buffer, where a second pass
over the whole reduced buffer used to run on every rank. The adds are the same in both patterns and not timed; each time is the slowest
rank's, median over repeats."""

METHOD = """\
- `scripts/bench` builds in release mode, runs `benches/suite.rs` (`cargo bench --bench suite`),
  `benches/python/peer.py` in `.venv-bench` (PyTorch, numpy and matplotlib from PyPI),
  `scripts/bench-mpi` and `scripts/bench-torch` (libtorch from PyPI in `.venv`), then this report; `scripts/bench --quick` is a smoke run of the same code on
  smaller sizes that writes under `target/bench/quick/` and leaves `docs/` alone.
- `scripts/bench --runs N` (2 by default, 1 with `--quick`) repeats the measurements N times, a
  pause apart, into `target/bench/full/run1`, `run2`, …, and this page is made from all of them:
  a ratio is published with every run's value, and a target is met only when every run meets it.
  On a shared machine one run can be lucky or unlucky; two that agree are a result.
- Every measurement: one untimed call of each variant, then the variants take turns for a number of
  rounds (15 in the Rust suite, 9 for layouts of over 32M elements and 7 over 128M; 7 in the
  PyTorch comparison, 5 where some variant takes over a quarter second a call; 15 for the
  in-process boundary; 15 after 3 warm-up steps for the MPI one); calls shorter than 10
  milliseconds are repeated within a sample; the median over rounds is reported. *Spread* is
  (slowest − fastest) ÷ median over the rounds, for gradacc's column.
- Taking turns keeps the floor and the competitors in the same machine state as gradacc, which
  matters on a shared 2-core machine: other work moves single rows by several percent from run to
  run, and the 2-thread rows most.
- The ratios of the Rust suite (÷ floor, and the in-process boundary's ÷ bare and reduce-scatter ÷
  deferred) are the median of the round-by-round ratios: the two variants ran in the same round,
  so a change of machine state between rounds moves both and cancels, where it would not cancel
  in a ratio of two medians. So are the MPI boundary's ratios to its fastest
  all-reduce (that form chosen by median). The times shown are the medians; the PyTorch
  comparison's ratios are ratios of medians."""


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dir", action="append", required=True, help="a run's result directory; repeat for several runs")
    p.add_argument("--md", required=True)
    p.add_argument("--png", required=True)
    args = p.parse_args()
    r = Report(args.dir)
    md = r.markdown(os.path.basename(args.png))
    with open(args.md, "w") as f:
        f.write(md)
    r.plot(args.png)
    print(r.summary())
    print(f"\nwrote {args.md} and {args.png}")


if __name__ == "__main__":
    main()
