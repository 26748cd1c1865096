"""``camp2p-overlap doctor``'s line on decode graphs: ``off`` at
``VLLM_CAMP2P_MULTISTREAM_GRAPH=0`` (naming the Roll-out rung that switches
it), ``refused`` when graph variants are asked for and the installed
torch_npu lacks the multi-stream capture fix (or another refusal says no),
``ok`` otherwise; a refusal is a problem, so the doctor exits non-zero."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.child import run_cli
from support.fake_torch_npu import FakeTorchNpu

from camp2p_overlap.core import config as cfgmod
from camp2p_overlap.core import env_vars
from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.observe.decode_graphs import GRAPH_RUNG, GRAPH_RUNG_SETTING
from camp2p_overlap.core.patching import torch_npu_capture as tnc
from camp2p_overlap.core.patching import versions
from camp2p_overlap.core.patching.torch_npu_capture import NOT_INSTALLED, judge_capture_fix
from camp2p_overlap.tools import doctor
from camp2p_overlap.tools.doctor import decode_graph_line, diagnose, doctor_text, main_doctor, torch_npu_verdict

REPO = Path(__file__).resolve().parents[2]
OFF = (
    "decode graphs: off: VLLM_CAMP2P_MULTISTREAM_GRAPH is 0: decode replays upstream's graph for every key; "
    "Roll out rung 6 (VLLM_CAMP2P_MULTISTREAM_GRAPH=adaptive) switches it"
)
UNFIXED = judge_capture_fix("2.9.0", None)
FIXED = judge_capture_fix("2.10.0.post2", None)


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeTorchNpu]:
    tnc.reset_cache()
    yield FakeTorchNpu(tmp_path, monkeypatch)
    tnc.reset_cache()


def test_graph_0_is_off_and_names_the_rung_that_switches_it() -> None:
    for verdict in (None, UNFIXED, FIXED):
        line = decode_graph_line(OverlapConfig(graph="0"), verdict, extra_refusal="anything")
        assert line.status == "off" and line.line == OFF


def test_the_rung_named_is_the_readmes_graph_rung() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    roll_out = readme[readme.index("## Roll out") : readme.index("## Tune")]
    assert f"\n{GRAPH_RUNG}. Decode graphs: `{GRAPH_RUNG_SETTING}`" in roll_out


@pytest.mark.parametrize("graph", ["1", "adaptive"])
def test_graph_variants_on_a_torch_npu_without_the_fix_are_refused(graph: str) -> None:
    line = decode_graph_line(OverlapConfig(graph=graph), UNFIXED)
    assert line.status == "refused"
    assert line.reason == (
        f"VLLM_CAMP2P_MULTISTREAM_GRAPH={graph}, but torch_npu 2.9.0 lacks the multi-stream graph capture fix "
        "(Ascend/pytorch !32803), first in 2.9.0.post2 (tag v26.0.0-pytorch2.9.0) on the 2.9 line; "
        "the eager overlap stays on, and decode graphs capture upstream's serial graph only"
    )
    assert line.line == f"decode graphs: refused: {line.reason}"


@pytest.mark.parametrize(("graph", "what"), [("1", "the layer's step for every key"), ("adaptive", "both variants")])
def test_graph_variants_with_the_fix_or_without_torch_npu_are_ok(graph: str, what: str) -> None:
    ok = decode_graph_line(OverlapConfig(graph=graph), FIXED)
    assert ok.status == "ok" and what in ok.reason and FIXED.reason in ok.reason
    no_npu = decode_graph_line(OverlapConfig(graph=graph), None)
    assert no_npu.status == "ok" and "no torch_npu is installed" in no_npu.reason


def test_another_refusal_is_refused_too_and_both_are_named() -> None:
    extra = "_capture_graphs is missing: decode graph variants are refused; the eager overlap is applied"
    alone = decode_graph_line(OverlapConfig(graph="adaptive"), FIXED, extra_refusal=extra)
    assert alone.status == "refused" and alone.reason == f"VLLM_CAMP2P_MULTISTREAM_GRAPH=adaptive, but {extra}"
    both = decode_graph_line(OverlapConfig(graph="adaptive"), UNFIXED, extra_refusal=extra)
    assert both.status == "refused" and extra in both.reason and UNFIXED.reason in both.reason


def test_a_refused_configuration_is_off() -> None:
    line = decode_graph_line(None, UNFIXED)
    assert line.status == "off" and "configuration is refused" in line.reason


def test_the_npu_is_judged_where_torch_npu_is_installed_or_the_backend_is_npu(fake: FakeTorchNpu) -> None:
    fake.absent()
    assert torch_npu_verdict("auto") is None and torch_npu_verdict("cuda") is None
    assert torch_npu_verdict("npu") == NOT_INSTALLED
    assert decode_graph_line(OverlapConfig(graph="1", backend="npu"), torch_npu_verdict("npu")).status == "refused"
    fake.monkeypatch.undo()
    fake.install("2.9.0", None)
    for backend in ("auto", "cuda", "cpu", "npu", None):
        assert torch_npu_verdict(backend) == UNFIXED


# ---------------------------------------------------------------------------
# diagnose(), the text and the exit status.


@pytest.fixture
def ready_box(monkeypatch: pytest.MonkeyPatch) -> None:
    """Everything but decode graphs passes: the 0.19.1 stack installed, every
    target ok, a CUDA device."""
    table = {versions.VLLM_DIST: "0.19.1", versions.AFD_PLUGIN_DIST: "0.19.1rc1"}
    monkeypatch.setattr(versions, "installed_version", lambda dist: table.get(dist))
    monkeypatch.setattr(doctor, "installed_version", lambda dist: table.get(dist))
    monkeypatch.setattr(
        doctor, "check_target", lambda t: {"target": t.id, "status": "ok", "detail": "", "action": "wrap"}
    )
    monkeypatch.setattr(doctor, "_device", lambda: ("cuda", "CUDA: 1 GPU(s) (faked)"))
    monkeypatch.setattr(
        doctor, "_backend", lambda configured, device: {"configured": configured, "resolved": "cuda", "reason": "cuda"}
    )
    for name in cfgmod.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(env_vars.ENV_SWITCH, "1")


def _run() -> tuple[int, str]:
    out = io.StringIO()
    return main_doctor(as_json=False, out=out), out.getvalue()


def test_doctor_exits_non_zero_only_for_graph_variants_the_stack_refuses(
    ready_box: None, fake: FakeTorchNpu, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.install("2.9.0", None)
    rc, text = _run()
    assert rc == 0 and OFF in text.splitlines(), text
    monkeypatch.setenv(env_vars.ENV_GRAPH, "adaptive")
    rc, text = _run()
    refused = decode_graph_line(OverlapConfig(graph="adaptive"), UNFIXED).line
    assert rc == 1 and refused in text.splitlines() and f"  - {refused}" in text, text
    fake.install("2.10.0.post2", None)
    rc, text = _run()
    assert rc == 0, text
    assert [line for line in text.splitlines() if line.startswith("decode graphs: ")] == [
        decode_graph_line(OverlapConfig(graph="adaptive"), FIXED).line
    ]


def test_diagnose_reports_decode_graphs_in_json(
    ready_box: None, fake: FakeTorchNpu, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.install("2.10.0", None)  # which 2.10.0 cannot be told
    monkeypatch.setenv(env_vars.ENV_GRAPH, "1")
    d = diagnose()
    assert d["decode_graphs"]["status"] == "refused"
    assert "hasCapturesUnderway" in d["decode_graphs"]["reason"]
    assert d["ok"] is False and any(p.startswith("decode graphs: refused: ") for p in d["problems"])
    assert doctor_text(d).count("decode graphs: refused: ") == 2  # the line, and the problem


def test_the_cli_prints_the_line_on_a_box_without_an_npu() -> None:
    res = run_cli("doctor", timeout=120)
    assert "Traceback" not in res.stderr
    assert OFF in res.stdout.splitlines(), res.stdout[-2000:]
