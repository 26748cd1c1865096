"""The docs: generated blocks are what ``camp2p-overlap docs`` writes from
``docs/results/``, every block that quotes a report names its run (command,
commit, machine, date, from the JSON), a hand edit inside one fails
``--check``, the README
keeps the two set-up-and-go commands and its troubleshooting names the
patch layer's serial reasons, section references name real headings, and
docs/design.md's folder tree lists the package's modules. The README's
Roll out climbs the plan's ladder, its troubleshooting names the layouts'
serial reasons, and its stall report excerpt is what a ``compute-side``
stall logs."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from camp2p_overlap.core.overlap.plan import LADDER
from camp2p_overlap.core.overlap.step import (
    GRAPH_COMM_SIDE_OPT_IN,
    GRAPH_OFF,
    NO_STREAMS_IN_CAPTURE,
    NOT_APPLIED,
    SERIAL_FASTER,
    SERIAL_PROBE,
)
from camp2p_overlap.tools import docgen
from camp2p_overlap.tools.cli import main
from camp2p_overlap.tools.docgen import DOC_BLOCKS, FIGURE_BLOCKS, REPORTS, RESULTS_DIR, run_docs

REPO = Path(__file__).resolve().parents[2]
MAIN_JOB = "bash scripts/setup.sh && .venv/bin/camp2p-overlap bench --scenario ffn-bound"
TEST_JOB = (
    "bash scripts/setup.sh --test && .venv/bin/ruff check . && .venv/bin/ruff format --check . "
    "&& .venv/bin/lint-imports && .venv/bin/python -m pytest -q -n auto --dist worksteal"
    " && .venv/bin/python -m pytest -q -m slow -n auto"
)


def _check(root: Path) -> tuple[int, str]:
    out = io.StringIO()
    return run_docs(root, check=True, out=out), out.getvalue()


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A copy of the files ``docs`` reads and writes."""
    for rel in DOC_BLOCKS:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, tmp_path / rel)
    shutil.copytree(REPO / RESULTS_DIR, tmp_path / RESULTS_DIR)
    return tmp_path


def _block_body(text: str, name: str) -> str:
    m = re.search(
        rf"<!-- BEGIN generated: {re.escape(name)}[^>]*-->\n(.*?)<!-- END generated: {re.escape(name)} -->", text, re.S
    )
    assert m is not None, name
    return m.group(1)


def test_the_repos_docs_are_what_docs_writes() -> None:
    code, out = _check(REPO)
    assert code == 0, out


def test_the_cli_subcommand_checks_a_checkout(checkout: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["docs", "--check", "--root", str(checkout)]) == 0
    assert "up to date" in capsys.readouterr().out


def test_a_hand_edit_inside_a_block_fails_the_check_and_docs_puts_it_back(checkout: Path) -> None:
    bench = checkout / "docs/benchmark.md"
    original = bench.read_text(encoding="utf-8")
    body = _block_body(original, "bench table")
    edited_body = re.sub(r"\d+\.\d\dx", "9.99x", body, count=1)
    assert edited_body != body
    bench.write_text(original.replace(body, edited_body), encoding="utf-8")

    code, out = _check(checkout)
    assert code == 1
    assert "docs/benchmark.md: block 'bench table' differs" in out
    assert "README.md" not in out  # only the edited block is named

    assert run_docs(checkout, check=False, out=io.StringIO()) == 0
    assert bench.read_text(encoding="utf-8") == original
    assert _check(checkout)[0] == 0


def test_text_outside_the_blocks_is_left_alone(checkout: Path) -> None:
    readme = checkout / "README.md"
    text = readme.read_text(encoding="utf-8") + "\nA note of the reader's own.\n"
    readme.write_text(text, encoding="utf-8")
    assert _check(checkout)[0] == 0
    assert run_docs(checkout, check=False, out=io.StringIO()) == 0
    assert readme.read_text(encoding="utf-8") == text


def test_the_figures_come_from_the_reports(checkout: Path) -> None:
    path = checkout / RESULTS_DIR / "bench.json"
    report = json.loads(path.read_text(encoding="utf-8"))
    overlap = next(p for p in report["policies"] if p["policy"] == "overlap")
    overlap["speedup"] = 7.77
    path.write_text(json.dumps(report), encoding="utf-8")

    code, out = _check(checkout)
    assert code == 1
    for stale in ("docs/benchmark.md: block 'headline figures'", "docs/benchmark.md: block 'bench table'"):
        assert stale in out
    assert "sweep tables" not in out and "overhead table" not in out and "README.md" not in out
    run_docs(checkout, check=False, out=io.StringIO())
    assert "7.77x" in _block_body((checkout / "docs/benchmark.md").read_text(encoding="utf-8"), "headline figures")


def test_the_widest_shapes_pass_through_sentence_reads_our_frames_alone(checkout: Path) -> None:
    """The overhead block's sentence on the widest shape gives our frames
    alone (the figure that does not move with the loop's placement) and the
    whole step's paired figure, each from the report."""
    path = checkout / RESULTS_DIR / "overhead.json"
    report = json.loads(path.read_text(encoding="utf-8"))
    widest = max(report["shapes"], key=lambda s: (s["layers"] * s["stages"], s["stages"]))
    widest["passthrough_frames_us_per_step"]["decided serial"]["median"] = 1.23
    widest["passthrough_paired_us_per_step"]["median"] = 4.56
    path.write_text(json.dumps(report), encoding="utf-8")
    run_docs(checkout, check=False, out=io.StringIO())
    body = _block_body((checkout / "docs/benchmark.md").read_text(encoding="utf-8"), "overhead table")
    assert "1.2 µs of our own frames per passed-through step" in body and "(paired): 4.6 µs" in body


def test_broken_markers_and_missing_inputs_are_errors(checkout: Path) -> None:
    readme = checkout / "README.md"
    text = readme.read_text(encoding="utf-8")
    readme.write_text(text.replace("<!-- END generated: configuration table -->\n", ""), encoding="utf-8")
    code, out = _check(checkout)
    assert code == 2 and "README.md" in out and "'configuration table'" in out

    typo = text.replace("generated: configuration table", "generated: headline typo")
    readme.write_text(typo, encoding="utf-8")
    code, out = _check(checkout)
    assert code == 2 and "no generator for block(s) 'headline typo'" in out

    readme.write_text(text, encoding="utf-8")
    (checkout / RESULTS_DIR / "overhead.json").unlink()
    code, out = _check(checkout)
    assert code == 2 and "overhead.json is missing" in out and "camp2p-overlap overhead" in out


# ---------------------------------------------------------------------------
# every figure names its run
_RUN_LINE = re.compile(
    r"^ *Run: `(camp2p-overlap \w+ [^`]*)`; commit [^;]+; machine: [^;]+; date [^;]+(?:; \d+ s)?\.", re.M
)


def _report_of(command: str) -> str:
    """The report a run line's command writes: the one whose command prefix it starts with (the longest)."""
    names = [n for n in REPORTS if command.startswith(docgen.report_command(n))]
    return max(names, key=lambda n: len(docgen.report_command(n)))


def test_every_figure_block_of_the_docs_names_its_run() -> None:
    """Read from the files, not from the generators: each block that quotes
    a report holds a run line (command, commit, machine, date) per report."""
    text = (REPO / "docs/benchmark.md").read_text(encoding="utf-8")
    assert set(FIGURE_BLOCKS) | set(docgen.NO_FIGURES) == set(docgen.GENERATORS)
    for block, quoted in FIGURE_BLOCKS.items():
        named = [_report_of(m.group(1)) for m in _RUN_LINE.finditer(_block_body(text, block))]
        assert named == list(quoted), f"block {block!r} names the runs {named}, quotes {list(quoted)}"
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "Run: `" not in readme and not re.search(r"\d\.\d\dx\b", readme), "run figures belong in benchmark.md"


def test_a_figure_block_without_its_run_line_is_an_error(checkout: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = docgen.GENERATORS["bench table"]

    def without_run_line(res: docgen.Results) -> str:
        return real(res).replace(res.run_line("bench"), "Run: somewhere, some day.")

    monkeypatch.setitem(docgen.GENERATORS, "bench table", without_run_line)
    for check in (True, False):
        out = io.StringIO()
        assert run_docs(checkout, check=check, out=out) == 2
        assert "docs/benchmark.md: block 'bench table' quotes bench.json without its run line" in out.getvalue()


def _edit_json(path: Path, edit: Any) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    edit(data)
    path.write_text(json.dumps(data), encoding="utf-8")


def test_the_run_line_reads_the_json(checkout: Path) -> None:
    """A report's own ``run`` names its run and needs no runs.json entry;
    an entry contradicting it is an error; an unrecorded date or machine key
    is said to be so, never made up."""
    results = checkout / RESULTS_DIR
    for name in ("sweep", "overhead"):  # these two as reports that record no run, with an entry each
        _edit_json(results / f"{name}.json", lambda d: d.pop("run", None))

    def entry(name: str) -> dict[str, str]:
        return {"command": f"camp2p-overlap {name} --json x.json", "commit": "0000000", "date": "2026-01-01"}

    # ranks.json records its own run: an entry for it would contradict it
    _edit_json(
        results / "runs.json", lambda d: [d["runs"].setdefault(n, entry(n)) for n in ("bench", "sweep", "overhead")]
    )
    own = {"command": "camp2p-overlap bench --scenario ffn-bound", "commit": "abc1234+", "date": "2027-01-02T03:04:05Z"}
    _edit_json(results / "bench.json", lambda d: d.update(run=own))
    out = io.StringIO()
    assert run_docs(checkout, check=True, out=out) == 2
    assert "run 'bench' differs from the run bench.json records: delete the entry" in out.getvalue()
    _edit_json(results / "runs.json", lambda d: d["runs"].pop("bench"))
    assert _check(checkout)[0] == 1, "the bench blocks now name the report's own run"

    def unrecorded(d: dict[str, Any]) -> None:
        d["runs"]["overhead"]["date"] = None
        d["runs"]["overhead"]["commit"] = None

    _edit_json(results / "runs.json", unrecorded)
    _edit_json(results / "sweep.json", lambda d: d["env"].pop("machine"))
    assert run_docs(checkout, check=False, out=io.StringIO()) == 0
    text = (checkout / "docs/benchmark.md").read_text(encoding="utf-8")
    bench = _block_body(text, "bench table")
    assert "Run: `camp2p-overlap bench --scenario ffn-bound`; commit abc1234+;" in bench
    assert "; date 2027-01-02T03:04:05Z;" in bench
    overhead = _block_body(text, "overhead table")
    assert "; commit not recorded;" in overhead and "; date not recorded;" in overhead
    assert "architecture not recorded" in _block_body(text, "sweep tables")
    for block, quoted in FIGURE_BLOCKS.items():
        assert len(_RUN_LINE.findall(_block_body(text, block))) == len(quoted), block

    _edit_json(results / "runs.json", lambda d: d["runs"].pop("sweep"))
    out = io.StringIO()
    assert run_docs(checkout, check=True, out=out) == 2
    assert "sweep.json records no run and" in out.getvalue() and "has no entry 'sweep'" in out.getvalue()


def test_every_report_of_the_docs_says_how_it_was_made() -> None:
    """Each report records its run, or runs.json has its entry; each names
    its machine in ``env``, and a key filled in after the run says from where."""
    runs = json.loads((REPO / RESULTS_DIR / "runs.json").read_text(encoding="utf-8"))["runs"]
    for name, (file, _) in REPORTS.items():
        report = json.loads((REPO / RESULTS_DIR / file).read_text(encoding="utf-8"))
        run = report.get("run") or runs[name]
        assert set(docgen.RUN_KEYS) <= set(run) and run["command"].startswith(docgen.report_command(name))
        env = report["env"]
        filled = env.get("filled", {"keys": []})
        assert set(filled["keys"]) <= set(env) and (not filled["keys"] or filled["source"])


def test_the_readme_keeps_the_two_commands_ci_runs() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert f"```bash\n{MAIN_JOB}\n```" in readme
    assert f"```bash\n{TEST_JOB}\n```" in readme
    ci = (REPO / ".ci/run").read_text(encoding="utf-8").strip().splitlines()
    assert ci[-1] == TEST_JOB


def test_the_readme_is_a_users_page_in_the_order_a_user_works() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.encode("utf-8")) <= 14_600
    headings = [line[3:] for line in readme.splitlines() if line.startswith("## ")]
    order = ["Install and switch on", "Verify", "Roll out", "Tune", "Troubleshoot", "Limits"]
    assert [h for h in headings if h in order] == order
    assert headings.index("Limits") < next(i for i, h in enumerate(headings) if h.startswith("For developers"))
    assert "pip install camp2p-overlap" not in readme  # it is on no package index


def test_the_troubleshooting_names_the_layers_fixed_serial_reasons() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    troubleshoot = readme[readme.index("## Troubleshoot") : readme.index("## Limits")]
    for reason in (NOT_APPLIED, SERIAL_PROBE, SERIAL_FASTER, GRAPH_OFF, NO_STREAMS_IN_CAPTURE):
        assert reason.split(";")[0] in troubleshoot, reason
    assert GRAPH_COMM_SIDE_OPT_IN.split(",")[0] in troubleshoot


def _roll_out() -> list[str]:
    """The README's Roll out rungs, in order (each numbered item's text)."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Roll out") : readme.index("## Tune")]
    return [m.group(1) for m in re.finditer(r"^\d+\. (.*?)(?=^\d+\. |\n\n(?!   ))", section, re.M | re.S)]


def test_the_roll_out_climbs_the_plans_ladder_then_decode_graphs() -> None:
    """Each rung of ``plan.LADDER`` is a rung of its own, in the ladder's
    order, before decode graphs; ``reorder`` says what a stall there means,
    ``comm-side`` is the opt-in list, and the graph rung names the
    ``comm-side`` graph opt-in."""
    items = _roll_out()
    first = []
    for rung in LADDER:
        first.append(next(i for i, text in enumerate(items) if f"`{rung}`" in text or f"={rung}`" in text))
    assert first == sorted(first) and len(set(first)) == len(LADDER), (first, items)
    graphs = next(i for i, text in enumerate(items) if text.startswith("Decode graphs"))
    assert graphs > first[-1]
    assert "stay\n   on `parity`" in items[first[1]] or "stay on `parity`" in items[first[1]]
    assert "VLLM_CAMP2P_MULTISTREAM_LAYOUT=compute-side,comm-side" in items[first[3]]
    assert "VLLM_CAMP2P_MULTISTREAM_GRAPH_COMM_SIDE=1" in items[graphs]


def test_the_readmes_stall_report_is_what_a_compute_side_stall_logs(make_world: Any) -> None:
    """The README's excerpt, line by line, in a real report of a stopped
    attention peer in ``compute-side`` (times and ``(...)`` left open)."""
    from camp2p_overlap.core.config import OverlapConfig
    from camp2p_overlap.core.log import logger
    from camp2p_overlap.core.patch_layer import build_patch_layer
    from camp2p_overlap.emulation.faults import Fault, FaultPlan, run_step_bounded

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    troubleshoot = readme[readme.index("## Troubleshoot") : readme.index("## Limits")]
    block = troubleshoot[troubleshoot.index("```text\n") + 8 :]
    excerpt = [line for line in block[: block.index("```")].splitlines() if line.strip()]
    assert len(excerpt) >= 3 and any("FFN stream: F" in line for line in excerpt)

    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    keep, level = Keep(), logger.level
    logger.addHandler(keep)
    logger.setLevel(logging.DEBUG)
    layer = build_patch_layer()
    try:
        w = make_world(layers=3, stage_ids=(0, 1), tokens=8, op_timeout_s=1.2)
        layer.engine.apply(
            config=OverlapConfig(enabled=True, backend="cpu", adaptive=False, watchdog_s=0.25), strict=True
        )
        with FaultPlan(w, [Fault("stop", "a2e", 1, 1)]) as plan:
            plan.arm()
            out = run_step_bounded(w, 5, 30.0)
        assert not out.hung and out.error is not None
    finally:
        layer.engine.unpatch(timeout=10)
        logger.removeHandler(keep)
        logger.setLevel(level)
    (report,) = [m for m in messages if "has not finished after" in m]
    for line in excerpt:
        pattern = re.escape(line).replace(re.escape("(...)"), r"\(.*?\)")
        pattern = re.sub(r"\d+\\\.\d+", r"[\\d.]+", pattern)
        assert re.search("^" + pattern, report, re.M), (line, report)


_CITATION = re.compile(
    r"(docs/(?:design|benchmark|validation)\.md|README(?:\.md)?)`{0,2}\)?(?:,\s*\(?|\s*\()\s*\"([^\"]+)\"",
)


def _headings(path: Path) -> list[str]:
    return [
        line.lstrip("#").strip().replace("`", "")
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.startswith("#")
    ]


def _names(heading: str, cited: str) -> bool:
    return heading == cited or heading.startswith((cited + " (", cited + ":"))


def test_section_references_name_real_headings() -> None:
    files = [REPO / "README.md"]
    for root in ("camp2p_overlap", "docs", "patches", "tests", "scripts"):
        files += [p for p in (REPO / root).rglob("*") if p.suffix in (".py", ".md", ".toml", ".sh")]
    docs = {"README": REPO / "README.md", "README.md": REPO / "README.md"}
    docs.update({f"docs/{n}.md": REPO / f"docs/{n}.md" for n in ("design", "benchmark", "validation")})
    headings = {key: _headings(path) for key, path in docs.items()}
    found, broken = 0, []
    for path in files:
        if path.resolve() == Path(__file__).resolve() or "__pycache__" in path.parts:
            continue
        text = re.sub(r"\s+", " ", path.read_text(encoding="utf-8"))
        for m in _CITATION.finditer(text):
            doc, cited = m.group(1), m.group(2).replace("`", "").strip()
            found += 1
            if not any(_names(h, cited) for h in headings[doc]):
                broken.append(f"{path.relative_to(REPO)}: {doc} {cited!r}")
    assert found >= 10
    assert broken == []


def _tree_modules(design: str) -> set[str]:
    """The modules the folder tree under "Layout" lists, as paths relative
    to the package; a folder listed without children stands for all of it."""
    block = design[design.index("## Layout") :]
    block = block[block.index("```\n") + 4 :]
    block = block[: block.index("```")]
    listed: set[str] = set()
    stack: list[tuple[int, str]] = []
    for line in block.splitlines()[1:]:  # below "camp2p_overlap/"
        name = line.strip().split()[0]
        depth = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= depth:
            stack.pop()
        path = "/".join([*(p for _, p in stack), name.rstrip("/")])
        if name.endswith("/"):
            stack.append((depth, name.rstrip("/")))
            listed.add(path + "/")
        else:
            listed.add(path)
    return listed


def test_the_design_tree_lists_exactly_the_packages_modules() -> None:
    listed = _tree_modules((REPO / "docs/design.md").read_text(encoding="utf-8"))
    package = REPO / "camp2p_overlap"
    on_disk = set()
    for dirpath, dirnames, filenames in os.walk(package):  # does not follow the patches/ link
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        rel = Path(dirpath).relative_to(package)
        on_disk |= {(rel / f).as_posix() for f in filenames if f.endswith(".py")}
    folders = {f for f in listed if f.endswith("/")}
    collapsed = {f for f in folders if not any(m.startswith(f) and m != f for m in listed)}
    covered = {m for m in on_disk if any(m.startswith(f) for f in collapsed)}
    modules = {m for m in listed if not m.endswith("/")}
    assert sorted(on_disk - covered - modules) == [], "modules missing from the tree"
    assert sorted(modules - on_disk) == [], "the tree lists modules that do not exist"
    assert len(modules) > 40
