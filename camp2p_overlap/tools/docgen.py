"""``camp2p-overlap docs [--check]``: every benchmark figure and the
configuration table of the docs come from one source and are written, never
copied by hand.

The sources are the JSON reports in ``docs/results/`` that the tools write
themselves (``bench --json``, ``sweep --json``, ``overhead --json``; schemas
in docs/benchmark.md, "JSON schemas"), ``docs/results/runs.json`` (how each
report was made: command, machine, date), and the declarative table of
environment variables (``core.env_vars``). A generated block of a Markdown
file lies between two marker lines::

    <!-- BEGIN generated: NAME (optional note) -->
    ...
    <!-- END generated: NAME -->

``docs`` rewrites the body of every block from :data:`GENERATORS`, with the
tools' own renderers (``bench_table``, ``sweep_markdown``,
``format_overhead``); ``--check`` writes nothing and fails, naming the file
and the block, when a file differs from what ``docs`` would write. Text
outside the blocks is never touched.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from camp2p_overlap.core.env_vars import FALSE_WORDS, TABLE, TRUE_WORDS, plain

RESULTS_DIR = "docs/results"
RUNS_SCHEMA = "camp2p-overlap/runs/v1"
#: The reports, by run name: file in RESULTS_DIR and its schema.
REPORTS = {
    "bench": ("bench.json", "camp2p-overlap/bench/v1"),
    "sweep": ("sweep.json", "camp2p-overlap/sweep/v1"),
    "overhead": ("overhead.json", "camp2p-overlap/overhead/v1"),
}
#: The files with generated blocks, and the blocks each must hold.
DOC_BLOCKS: dict[str, tuple[str, ...]] = {
    "README.md": ("headline figures", "configuration table"),
    "docs/benchmark.md": (
        "headline figures",
        "bench table",
        "sweep tables",
        "overhead table",
    ),
}

_BEGIN = re.compile(r"^<!-- BEGIN generated: (?P<head>.+?) -->$")
_END = re.compile(r"^<!-- END generated: (?P<name>.+?) -->$")


class DocsError(Exception):
    """An input is missing or malformed, or a file's markers do not pair up."""


#: What every entry of runs.json names: the command, the code it ran (a
#: commit), the machine and the date.
RUN_KEYS = ("command", "commit", "machine", "date")


@dataclass(frozen=True)
class Results:
    """The generators' inputs, read once."""

    root: Path
    runs: Mapping[str, Mapping[str, Any]]
    reports: Mapping[str, Mapping[str, Any]]

    def report(self, name: str) -> Mapping[str, Any]:
        return self.reports[name]

    def run_line(self, name: str) -> str:
        """How report ``name`` was made, from runs.json and the report's own ``wall_s``."""
        run = self.runs[name]
        wall = self.reports[name].get("wall_s")
        took = f", {wall:.0f} s" if isinstance(wall, (int, float)) else ""
        line = f"Run: `{run['command']}` at commit {run['commit']} on {run['machine']}, {run['date']}{took}."
        note = run.get("note")
        return line + (f" {note}" if note else "")


def load_results(root: Path) -> Results:
    """Read ``runs.json`` and every report; raises :class:`DocsError` naming
    the file and the command that writes it."""
    results = root / RESULTS_DIR
    runs_path = results / "runs.json"
    runs_doc = _read_json(runs_path)
    if runs_doc.get("schema") != RUNS_SCHEMA:
        raise DocsError(f"{runs_path}: schema is {runs_doc.get('schema')!r}, expected {RUNS_SCHEMA!r}")
    runs = runs_doc.get("runs", {})
    reports = {}
    for name, (file, schema) in REPORTS.items():
        run = runs.get(name)
        missing = [k for k in RUN_KEYS if not (run or {}).get(k)]
        if missing:
            raise DocsError(f"{runs_path}: run {name!r} lacks {', '.join(missing)}")
        path = results / file
        if not path.exists():
            raise DocsError(f"{path} is missing: write it with `{run['command']}`")  # type: ignore[index]
        report = _read_json(path)
        if report.get("schema") != schema:
            raise DocsError(f"{path}: schema is {report.get('schema')!r}, expected {schema!r}")
        reports[name] = report
    return Results(root, runs, reports)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DocsError(f"{path} is missing") from None
    except json.JSONDecodeError as exc:
        raise DocsError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise DocsError(f"{path}: expected a JSON object")
    return data


# ---------------------------------------------------------------------------
# the generators: one per block name
def _policy(report: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
    return next((p for p in report["policies"] if p["policy"] == name), None)


def _speedup(p: Mapping[str, Any], *, ci: bool = False) -> str:
    interval = p.get("speedup_ci95") if ci else None
    text = f"{p['speedup']:.2f}x" + (f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else "")
    return text + ("" if p.get("eta") is None else f" (eta {p['eta']:.2f})")


def headline_figures(res: Results) -> str:
    """The one-paragraph result, in the README and in docs/benchmark.md alike."""
    from camp2p_overlap.tools.bench.sweep import adaptive_worst

    bench = res.report("bench")
    parts = []
    for name, label in (("overlap", "`overlap`"), ("overlap-fixed", "`overlap-fixed`"), ("e2a-only", "E2A-only")):
        p = _policy(bench, name)
        if p is not None:
            steady = " at its steady state" if (p.get("learning") or {}).get("decision") else ""
            parts.append(f"{label}{steady} {_speedup(p, ci=name == 'overlap')}")
    equal = "bitwise equal" if bench["outputs_equal"] else "NOT all equal to serial"
    text = [
        f"One run of `bench --scenario ffn-bound` ({res.runs['bench']['date']}), per layer over serial: "
        + ", ".join(parts)
        + f"; outputs {equal}."
    ]
    worst = adaptive_worst(res.report("sweep"))
    if worst is not None:
        text.append(f"Adaptive `overlap` at its slowest in `sweep`: {worst[0]:.2f}x of serial ({worst[1]}).")
    ovh = res.report("overhead")
    engaged = ovh["engaged_us_per_layer_stage"]["median"]
    per_step = ovh.get("passthrough_us_per_step")
    if isinstance(per_step, Mapping):
        passed = f"{per_step['median']:.2f} µs per passed-through step"
    else:
        passed = f"{ovh['passthrough_us_per_call']['median']:.2f} µs per passed-through wrapped call"
    text.append(
        f"Host cost of our code (`overhead`, pooled medians): {engaged:.2f} µs per (layer, stage) engaged, {passed}."
    )
    text.append("CPU emulation: only the ratios carry over to an NPU.")
    return " ".join(text) + "\n"


def configuration_table(res: Results) -> str:
    return markdown_table()


# ---------------------------------------------------------------------------
# the variable table (core.env_vars.TABLE) rendered: the README's Markdown
# table, and the plain listing of `camp2p-overlap --help`
def markdown_table() -> str:
    """The README's configuration table (variable | default | meaning),
    followed by how switches are spelled and what a bad value does."""
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    rows += [f"| `{v.name}` | {v.default_text()} | {v.meaning()} |" for v in TABLE]
    rows += ["", reading_rules()]
    return "\n".join(rows) + "\n"


def reading_rules(markdown: bool = True) -> str:
    """How every variable is read: the spellings of a switch, unset, a bad value."""
    spellings = ", ".join(f"`{t}`/`{f}`" for t, f in zip(TRUE_WORDS, FALSE_WORDS, strict=True))
    text = (
        f"An on/off switch accepts {spellings} in any case. An unset or empty variable takes its default."
        " Any other value is an error that names the variable and the value (logged, or raised in strict mode)."
    )
    return text if markdown else plain(text)


def help_listing(indent: str = "  ", width: int = 79) -> str:
    """Every variable with its default and help, as plain text for the CLI."""
    lines = []
    for v in TABLE:
        lines.append(f"{indent}{v.name} (default {v.default_text(markdown=False)})")
        more = indent + "    "
        lines += textwrap.wrap(v.meaning(markdown=False), width, initial_indent=more, subsequent_indent=more)
    return "\n".join(lines)


def bench_block(res: Results) -> str:
    from camp2p_overlap.tools.bench.tables import bench_table

    return f"{res.run_line('bench')}\n\n```text\n{bench_table(res.report('bench'))}\n```\n"


def sweep_block(res: Results) -> str:
    from camp2p_overlap.tools.bench.sweep import sweep_markdown

    return f"{res.run_line('sweep')}\n\n{sweep_markdown(res.report('sweep'))}"


def overhead_block(res: Results) -> str:
    from camp2p_overlap.tools.overhead import format_overhead

    ovh = res.report("overhead")
    lines = [res.run_line("overhead"), "", "```text", format_overhead(dict(ovh)), "```"]
    widest = max(ovh["shapes"], key=lambda s: (s["layers"] * s["stages"], s["stages"]), default=None)
    if widest is not None:
        pairs = widest["layers"] * widest["stages"]
        engaged = widest["engaged_us_per_layer_stage"]["median"]
        per_step = widest.get("passthrough_us_per_step")
        if isinstance(per_step, Mapping):
            passed = per_step["median"]
        else:
            passed = widest["wrapped_calls_per_step"] * widest["passthrough_us_per_call"]["median"]
        lines += [
            "",
            f"At {widest['layers']} layers × {widest['stages']} stages ({pairs} (layer, stage) pairs), by the "
            f"medians above: about {pairs * engaged / 1000:.2f} ms of our host time per engaged step and "
            f"{passed:.1f} µs per passed-through step.",
        ]
    return "\n".join(lines) + "\n"


GENERATORS: dict[str, Callable[[Results], str]] = {
    "headline figures": headline_figures,
    "configuration table": configuration_table,
    "bench table": bench_block,
    "sweep tables": sweep_block,
    "overhead table": overhead_block,
}


# ---------------------------------------------------------------------------
# blocks in a file
@dataclass(frozen=True)
class Block:
    name: str
    begin: int  # index of the BEGIN line
    end: int  # index of the END line


def find_blocks(lines: Sequence[str], where: str) -> list[Block]:
    """Every generated block of ``lines`` (without line ends). The name is
    the BEGIN text up to an optional trailing ``(note)``; the END line must
    repeat it. Raises :class:`DocsError` on unpaired or nested markers."""
    blocks: list[Block] = []
    open_at: tuple[str, int] | None = None
    for i, line in enumerate(lines):
        begin, end = _BEGIN.match(line), _END.match(line)
        if begin:
            if open_at is not None:
                raise DocsError(f"{where}:{i + 1}: block {begin['head']!r} opens inside block {open_at[0]!r}")
            open_at = (re.sub(r"\s*\([^()]*\)$", "", begin["head"]).strip(), i)
        elif end:
            if open_at is None or end["name"].strip() != open_at[0]:
                raise DocsError(f"{where}:{i + 1}: END of block {end['name']!r} without its BEGIN")
            blocks.append(Block(open_at[0], open_at[1], i))
            open_at = None
    if open_at is not None:
        raise DocsError(f"{where}:{open_at[1] + 1}: block {open_at[0]!r} is never closed")
    return blocks


def render_file(text: str, where: str, res: Results) -> tuple[str, list[str]]:
    """``text`` with every block's body regenerated, and the names of the
    blocks whose body changed."""
    lines = text.split("\n")
    blocks = find_blocks(lines, where)
    names = [b.name for b in blocks]
    unknown = [n for n in names if n not in GENERATORS]
    if unknown:
        raise DocsError(f"{where}: no generator for block(s) {', '.join(map(repr, unknown))}")
    missing = [n for n in DOC_BLOCKS.get(where, ()) if n not in names]
    if missing:
        raise DocsError(f"{where}: generated block(s) {', '.join(map(repr, missing))} are missing")
    out: list[str] = []
    changed: list[str] = []
    pos = 0
    for b in blocks:
        body = GENERATORS[b.name](res).rstrip("\n").split("\n")
        if lines[b.begin + 1 : b.end] != body:
            changed.append(b.name)
        out += lines[pos : b.begin + 1] + body + [lines[b.end]]
        pos = b.end + 1
    out += lines[pos:]
    return "\n".join(out), changed


def run_docs(root: Path, *, check: bool, out: Any = None) -> int:
    """Regenerate (or, with ``check``, compare) every file of
    :data:`DOC_BLOCKS` under ``root``; messages go to ``out`` (stdout).
    Returns the exit status: 0, 1 (``check``: a block differs) or 2 (an
    input or a marker is wrong)."""
    out = sys.stdout if out is None else out
    try:
        res = load_results(root)
        stale = []
        for rel in DOC_BLOCKS:
            path = root / rel
            text = path.read_text(encoding="utf-8")
            new, changed = render_file(text, rel, res)
            for name in changed:
                stale.append(f"{rel}: block {name!r}")
            if new != text and not check:
                path.write_text(new, encoding="utf-8")
    except (DocsError, OSError) as exc:
        print(f"camp2p-overlap docs: error: {exc}", file=out)
        return 2
    if check and stale:
        for what in stale:
            print(f"{what} differs from what `camp2p-overlap docs` writes", file=out)
        print("run `camp2p-overlap docs` to regenerate it from docs/results/", file=out)
        return 1
    verb = "up to date" if check or not stale else "regenerated: " + "; ".join(stale)
    print(f"camp2p-overlap docs: {verb}", file=out)
    return 0
