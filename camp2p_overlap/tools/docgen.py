"""``camp2p-overlap docs [--check]``: every benchmark figure and the
configuration table of the docs come from one source and are written, never
copied by hand.

The sources are the JSON reports in ``docs/results/`` that the tools write
themselves (``bench --json``, ``sweep --json``, ``overhead --json``; schemas
in docs/benchmark.md, "JSON schemas"), ``docs/results/runs.json`` (how a
report was made, for a report that does not record its own ``run``), and the
declarative table of environment variables (``core.env_vars``). Every block
that quotes a report carries that report's run line (:meth:`Results.run_line`:
command, commit, machine, date, all read from the JSON), and a block whose
body lacks it is an error (:data:`FIGURE_BLOCKS`). A generated block of a
Markdown file lies between two marker lines::

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
    "ranks": ("ranks.json", "camp2p-overlap/bench-ranks/v1"),
}
#: How each report's command begins, where that is not ``camp2p-overlap <name> ``.
COMMANDS = {"ranks": "camp2p-overlap bench --ffn-ranks "}


def report_command(name: str) -> str:
    """How the command that writes report ``name`` begins."""
    return COMMANDS.get(name, f"camp2p-overlap {name} ")


#: The files with generated blocks, and the blocks each must hold.
DOC_BLOCKS: dict[str, tuple[str, ...]] = {
    "README.md": ("configuration table",),
    "docs/benchmark.md": (
        "headline figures",
        "bench table",
        "sweep tables",
        "overhead table",
        "ranks table",
    ),
}

_BEGIN = re.compile(r"^<!-- BEGIN generated: (?P<head>.+?) -->$")
_END = re.compile(r"^<!-- END generated: (?P<name>.+?) -->$")


class DocsError(Exception):
    """An input is missing or malformed, or a file's markers do not pair up."""


#: How a report was made: the command, the code it ran (a commit) and the
#: date; the report's own ``run`` (what the tools record), or else its entry
#: of runs.json. A null value is printed as not recorded. The machine is
#: the report's own ``env`` (:data:`MACHINE_KEYS`).
RUN_KEYS = ("command", "commit", "date")
#: The report's ``env`` keys the run line names the machine by, in order,
#: with how each is printed.
MACHINE_KEYS: tuple[tuple[str, Callable[[Any], str], str], ...] = (
    ("cpu_count", lambda n: f"{n} CPU{'' if n == 1 else 's'}", "CPU count"),
    ("machine", str, "architecture"),
    ("python", lambda v: f"Python {v}", "Python version"),
    ("torch", lambda v: f"torch {v}", "torch version"),
    ("torch_threads", lambda n: f"{n} torch thread{'' if n == 1 else 's'}", "torch threads"),
)
#: The blocks that quote figures, and the reports each quotes: each body
#: must hold the run line of every one of them.
FIGURE_BLOCKS: dict[str, tuple[str, ...]] = {
    "headline figures": ("bench", "ranks", "sweep", "overhead"),
    "bench table": ("bench",),
    "sweep tables": ("sweep",),
    "overhead table": ("overhead",),
    "ranks table": ("ranks",),
}


@dataclass(frozen=True)
class Results:
    """The generators' inputs, read once."""

    root: Path
    runs: Mapping[str, Mapping[str, Any]]
    reports: Mapping[str, Mapping[str, Any]]

    def report(self, name: str) -> Mapping[str, Any]:
        return self.reports[name]

    def run_line(self, name: str) -> str:
        """How report ``name`` was made: its command, commit and date (the
        report's ``run``, else runs.json), the machine (the report's
        ``env``) and its own ``wall_s``."""
        run = self.runs[name]
        report = self.reports[name]
        commit = run["commit"] or "not recorded"
        date = run["date"] or "not recorded"
        wall = report.get("wall_s")
        took = f"; {wall:.0f} s" if isinstance(wall, (int, float)) else ""
        line = (
            f"Run: `{run['command']}`; commit {commit}; machine: {machine_words(report.get('env') or {})}; "
            f"date {date}{took}."
        )
        note = run.get("note")
        return line + (f" {note}" if note else "")


def machine_words(env: Mapping[str, Any]) -> str:
    """The machine of a report's ``env``, each missing key said to be not
    recorded, and which keys were filled in after the run (``filled``)."""
    parts = []
    for key, fmt, what in MACHINE_KEYS:
        value = env.get(key)
        parts.append(fmt(value) if value not in (None, "") else f"{what} not recorded")
    filled = env.get("filled")
    if isinstance(filled, Mapping) and filled.get("keys"):
        parts[-1] += f" ({', '.join(filled['keys'])}: filled in after the run, from {filled['source']})"
    return ", ".join(parts)


def load_results(root: Path) -> Results:
    """Read ``runs.json`` and every report; raises :class:`DocsError` naming
    the file and the command that writes it."""
    results = root / RESULTS_DIR
    runs_path = results / "runs.json"
    runs_doc = _read_json(runs_path)
    if runs_doc.get("schema") != RUNS_SCHEMA:
        raise DocsError(f"{runs_path}: schema is {runs_doc.get('schema')!r}, expected {RUNS_SCHEMA!r}")
    listed = runs_doc.get("runs", {})
    runs: dict[str, Mapping[str, Any]] = {}
    reports = {}
    for name, (file, schema) in REPORTS.items():
        path = results / file
        entry = listed.get(name)
        if not path.exists():
            how = f": write it with `{entry['command']}`" if (entry or {}).get("command") else ""
            raise DocsError(f"{path} is missing{how} (`camp2p-overlap {name} --json {path.relative_to(root)}`)")
        report = _read_json(path)
        if report.get("schema") != schema:
            raise DocsError(f"{path}: schema is {report.get('schema')!r}, expected {schema!r}")
        own = report.get("run")
        if own is not None:
            if entry is not None and any(entry.get(k) != own.get(k) for k in RUN_KEYS):
                raise DocsError(
                    f"{runs_path}: run {name!r} differs from the run {file} records: delete the entry"
                    " (a report that records its run needs none)"
                )
            run, where = own, f"{path}: run"
        else:
            run, where = entry, f"{runs_path}: run {name!r}"
        if run is None:
            raise DocsError(f"{path} records no run and {runs_path} has no entry {name!r}")
        missing = [k for k in RUN_KEYS if k not in run]
        if missing or not run.get("command"):
            raise DocsError(f"{where} lacks {', '.join(missing or ['command'])} (null: not recorded)")
        runs[name] = run
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
    if p.get("eta") is None:
        return text
    fd = p.get("eta_fill_drain")
    return text + f" (eta {p['eta']:.2f}" + ("" if fd is None else f"; {fd:.2f} against the fill/drain floor") + ")"


#: The bench policies the headline quotes, in order, with their labels (``overlap-fixed``: a report from before
#: the layouts were named).
HEADLINE_POLICIES = (
    ("overlap", "`overlap` (compute-side, adaptive)"),
    ("compute-side-fixed", "`compute-side-fixed`"),
    ("comm-side-fixed", "`comm-side-fixed`"),
    ("overlap-fixed", "`overlap-fixed`"),
    ("e2a-only", "E2A-only"),
)


def headline_figures(res: Results) -> str:
    """The result in three figures, each with the run it comes from."""
    from camp2p_overlap.tools.bench.sweep import adaptive_worst

    bench = res.report("bench")
    parts = []
    new = any("eta_fill_drain" in p for p in bench["policies"])  # a report with the layouts named
    for name, label in HEADLINE_POLICIES:
        if not new and name == "overlap":
            label = "`overlap`"
        p = _policy(bench, name)
        if p is not None:
            steady = " at its steady state" if (p.get("learning") or {}).get("decision") else ""
            parts.append(f"{label}{steady} {_speedup(p, ci=name == 'overlap')}")
    equal = "bitwise equal" if bench["outputs_equal"] else "NOT all equal to serial"
    items = [(f"`bench --scenario ffn-bound`, per layer over serial: {', '.join(parts)}; outputs {equal}.", "bench")]
    ranks = res.report("ranks")
    adaptive, straggler = ranks["summary"]["adaptive"], ranks["summary"]["straggler"]
    items.append(
        (
            f"The multi-rank main job (`bench --ffn-ranks {ranks['params']['ffn_ranks']}`): adaptive `overlap` "
            f"{adaptive['speedup']['median']:.2f}x of serial, {straggler['speedup']['median']:.2f}x with a "
            f"straggler FFN rank; the FFN ranks ran different paths at "
            f"{adaptive['parted_steps'] + straggler['parted_steps']} of {adaptive['steps'] + straggler['steps']} "
            "steps.",
            "ranks",
        )
    )
    worst = adaptive_worst(res.report("sweep"))
    if worst is not None:
        slowest = f"Adaptive `overlap` at its slowest in `sweep`: {worst[0]:.2f}x of serial ({worst[1]})."
        items.append((slowest, "sweep"))
    ovh = res.report("overhead")
    engaged = ovh["engaged_us_per_layer_stage"]["median"]
    per_step = ovh.get("passthrough_us_per_step")
    if isinstance(per_step, Mapping):
        passed = f"{per_step['median']:.2f} µs per passed-through step"
    else:
        passed = f"{ovh['passthrough_us_per_call']['median']:.2f} µs per passed-through wrapped call"
    cost = f"Host cost of our code (`overhead`, pooled medians): {engaged:.2f} µs per (layer, stage) engaged, {passed}."
    items.append((cost, "overhead"))
    lines = [line for text, name in items for line in (f"- {text}", f"  {res.run_line(name)}")]
    return "\n".join([*lines, "", "CPU emulation: only the ratios carry over to an NPU."]) + "\n"


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


def ranks_block(res: Results) -> str:
    from camp2p_overlap.tools.bench.ranks import rank_bench_table

    return f"{res.run_line('ranks')}\n\n```text\n{rank_bench_table(res.report('ranks'))}\n```\n"


def sweep_block(res: Results) -> str:
    from camp2p_overlap.tools.bench.sweep import sweep_markdown

    sweep = res.report("sweep")
    points = [pt for key in _SWEEP_POINTS for pt in sweep.get(key, [])]
    reports = [pt[k] for pt in points for k in ("report", "graph_report") if k in pt]
    untimed = ""
    if reports and not any("timing" in r for r in reports):
        untimed = (
            "\n\nIts points' reports carry no `timing`: the code that ran them had no timing model, so their"
            ' kernels took wall-clock time ("Timing model").'
        )
    return f"{res.run_line('sweep')}{untimed}\n\n{sweep_markdown(sweep)}"


_SWEEP_POINTS = ("ratio_points", "stage_points", "comm_core_points", "work_points")


def overhead_block(res: Results) -> str:
    from camp2p_overlap.tools.overhead import format_overhead

    ovh = res.report("overhead")
    lines = [res.run_line("overhead"), "", "```text", format_overhead(dict(ovh)), "```"]
    widest = max(ovh["shapes"], key=lambda s: (s["layers"] * s["stages"], s["stages"]), default=None)
    if widest is not None:
        pairs = widest["layers"] * widest["stages"]
        engaged = widest["engaged_us_per_layer_stage"]["median"]
        per_step = widest.get("passthrough_us_per_step")
        paired = (widest.get("passthrough_paired_us_per_step") or {}).get("median")
        if paired is not None:
            passed, how = paired, " (paired)"
        elif isinstance(per_step, Mapping):
            passed, how = per_step["median"], ""
        else:
            passed, how = widest["wrapped_calls_per_step"] * widest["passthrough_us_per_call"]["median"], ""
        frames = (widest.get("passthrough_frames_us_per_step") or {}).get("decided serial") or {}
        if frames.get("median") is not None:  # our frames alone: the figure that does not move with the loop
            passed_text = (
                f"{frames['median']:.1f} µs of our own frames per passed-through step (decided serial, around a "
                f"no-op original; the whole step{how or ''}: {passed:.1f} µs)"
            )
        else:
            passed_text = f"{passed:.1f} µs per passed-through step{how}"
        lines += [
            "",
            f"At {widest['layers']} layers × {widest['stages']} stages ({pairs} (layer, stage) pairs), by the "
            f"medians above: about {pairs * engaged / 1000:.2f} ms of our host time per engaged step and "
            f"{passed_text}.",
        ]
    ab = ovh.get("decided_serial_ab")
    interval = ((ab or {}).get("extra_pct") or {}).get("ci95")
    if interval:
        lo, hi = interval
        verdict = (
            "includes 0: this run does not tell a decided-serial step's cost apart from noise"
            if lo <= 0 <= hi
            else "excludes 0: a difference beyond this run's noise"
        )
        lines += ["", f"The decided-serial A/B's 95 % interval [{lo:+.2f}, {hi:+.2f}] % {verdict}."]
        control = (ab or {}).get("control")
        if control:
            clo, chi = control["ci95"]
            lines[-1] += (
                f" Its A/A control, the same pairs with both copies unpatched, reads {control['median']:+.2f} % "
                f"[{clo:+.2f}, {chi:+.2f}]: the method's own bias."
            )
    return "\n".join(lines) + "\n"


GENERATORS: dict[str, Callable[[Results], str]] = {
    "headline figures": headline_figures,
    "configuration table": configuration_table,
    "bench table": bench_block,
    "sweep tables": sweep_block,
    "overhead table": overhead_block,
    "ranks table": ranks_block,
}


#: The blocks that quote no report.
NO_FIGURES = ("configuration table",)


def runs_not_named(block: str, body: str, res: Results) -> list[str]:
    """The reports block ``block`` quotes whose run line ``body`` lacks; a
    block neither in :data:`FIGURE_BLOCKS` nor in :data:`NO_FIGURES` is
    taken to quote every report."""
    quoted = () if block in NO_FIGURES else FIGURE_BLOCKS.get(block, tuple(REPORTS))
    return [f"{REPORTS[name][0]}" for name in quoted if res.run_line(name) not in body]


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
        text_of_block = GENERATORS[b.name](res)
        unnamed = runs_not_named(b.name, text_of_block, res)
        if unnamed:
            raise DocsError(
                f"{where}: block {b.name!r} quotes {', '.join(unnamed)} without its run line"
                " (command, commit, machine, date: Results.run_line)"
            )
        body = text_of_block.rstrip("\n").split("\n")
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
