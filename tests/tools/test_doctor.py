"""``camp2p-overlap doctor``: on this CPU machine (no afd-plugin, no NPU, no
GPU) it says what is missing and exits non-zero; ``--json`` lists every
manifest target with its status; stand-ins, missing attributes and changed
signatures are told apart; a malformed switch is reported, not raised."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support.child import VLLM_PYTHONS, run_cli

from camp2p_overlap.core import config as cfgmod
from camp2p_overlap.core import env_vars
from camp2p_overlap.core.overlap import rank_group
from camp2p_overlap.core.patching import versions
from camp2p_overlap.core.patching.manifest import load_manifest
from camp2p_overlap.core.patching.versions import installed_version
from camp2p_overlap.emulation import standins
from camp2p_overlap.tools import cli
from camp2p_overlap.tools.doctor import check_target, diagnose, doctor_text, group_section, vllm_ascend_check

STATUSES = {"ok", "import-error", "missing", "signature-mismatch", "stand-in"}


def _no_afd_plugin() -> None:
    if importlib.util.find_spec("afd_plugin") is not None:
        pytest.skip("a real afd_plugin is importable here")


def _has_device() -> bool:
    return torch.cuda.is_available() or importlib.util.find_spec("torch_npu") is not None


def test_doctor_says_what_is_missing_and_exits_non_zero() -> None:
    _no_afd_plugin()
    res = run_cli("doctor", timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    out = res.stdout
    assert "Traceback" not in res.stderr
    assert "afd-plugin      not installed" in out
    assert "afd-plugin is not installed (distribution vllm-afd-plugin)" in out
    assert "No module named 'afd_plugin'" in out
    assert "NOT READY" in out
    for t in load_manifest().targets():
        assert t.id in out
    for name in cfgmod.ENV_VARS:
        assert name in out
    vllm = installed_version("vllm")
    if vllm is not None and vllm.split("+")[0] == "0.19.1":
        assert "vLLM version gate: ok" in out
    else:
        assert "vLLM version gate: REFUSED" in out
    if not _has_device():
        assert "device: none" in out
        assert "configured auto -> none" in out


def test_doctor_json_lists_every_manifest_target_with_its_status() -> None:
    _no_afd_plugin()
    res = run_cli("doctor", "--json", timeout=120)
    assert res.returncode == 1, res.stderr
    d = json.loads(res.stdout)
    assert d["schema"] == "camp2p-overlap/doctor/v1"
    assert set(d) == {
        "schema",
        "ok",
        "problems",
        "notes",
        "stack",
        "stack_match",
        "versions",
        "vllm_check",
        "targets",
        "device",
        "device_detail",
        "backend",
        "config",
        "decode_graphs",
        "group",
        "cores",
        "deployment",
    }
    assert d["ok"] is False and d["problems"]
    assert d["stack"] == "vllm-0.19.1"
    assert set(d["versions"]) == {"vllm", "torch", "torch_npu", "wrapt", "afd-plugin", "vllm-ascend", "camp2p-overlap"}
    assert d["versions"]["afd-plugin"] is None
    assert d["versions"]["torch"] == installed_version("torch")
    assert d["versions"]["wrapt"] == installed_version("wrapt")
    assert set(d["vllm_check"]) == {"ok", "found", "supported", "reason"}
    assert d["vllm_check"]["supported"] == "0.19.1"
    manifest = load_manifest()
    assert [t["target"] for t in d["targets"]] == [t.id for t in manifest.targets()]
    for row, spec in zip(d["targets"], manifest.targets(), strict=True):
        assert set(row) == {"target", "module", "qualname", "action", "status", "detail"}
        assert row["module"] == spec.module and row["qualname"] == spec.qualname and row["action"] == spec.action
        assert row["status"] == "import-error"
        assert "afd_plugin" in row["detail"]
    assert set(d["backend"]) == {"configured", "resolved", "reason"}
    assert d["backend"]["configured"] == "auto"
    if not _has_device():
        assert d["device"] is None and d["backend"]["resolved"] is None
    assert d["config"]["ok"] is True and d["config"]["error"] is None
    switches = {s["name"]: s for s in d["config"]["switches"]}
    assert set(switches) == set(cfgmod.ENV_VARS)
    assert switches[env_vars.ENV_SWITCH]["raw"] is None and switches[env_vars.ENV_SWITCH]["value"] is False
    assert switches[env_vars.ENV_MIN_STAGES]["value"] == 2
    assert d["decode_graphs"]["status"] == "off"
    assert d["decode_graphs"]["reason"].startswith(
        "VLLM_CAMP2P_MULTISTREAM_GRAPH is 0: decode replays upstream's graph"
    )


def test_doctor_reports_a_malformed_switch_without_raising() -> None:
    res = run_cli(
        "doctor",
        "--json",
        env={env_vars.ENV_SWITCH: "maybe", env_vars.ENV_MIN_STAGES: "3"},
        timeout=120,
    )
    assert res.returncode == 1
    assert "Traceback" not in res.stderr
    d = json.loads(res.stdout)
    assert d["config"]["ok"] is False
    assert env_vars.ENV_SWITCH in d["config"]["error"] and "'maybe'" in d["config"]["error"]
    assert any(p.startswith("configuration:") for p in d["problems"])
    raw = {s["name"]: s["raw"] for s in d["config"]["switches"]}
    assert raw[env_vars.ENV_SWITCH] == "maybe" and raw[env_vars.ENV_MIN_STAGES] == "3"


def test_doctor_shows_parsed_switches_and_the_cpu_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env_vars.ENV_SWITCH, "on")
    monkeypatch.setenv(env_vars.ENV_BACKEND, "CPU")
    monkeypatch.setenv(env_vars.ENV_WATCHDOG, "2.5")
    d = diagnose()
    values = {s["name"]: s["value"] for s in d["config"]["switches"]}
    assert values[env_vars.ENV_SWITCH] is True
    assert values[env_vars.ENV_BACKEND] == "cpu"
    assert values[env_vars.ENV_WATCHDOG] == 2.5
    assert d["config"]["enabled"] is True
    assert d["backend"] == {
        "configured": "cpu",
        "resolved": "cpu",
        "reason": "cpu: worker-thread streams (emulation and tests only)",
    }
    assert any("cpu backend is for the emulation" in n for n in d["notes"])


def test_doctor_outside_a_worker_says_how_the_ffn_ranks_decide_together() -> None:
    """doctor runs outside the worker (no torch.distributed process group): this process is one FFN rank, and the
    line says who decides together in a worker, over which channel, with the configured timeout."""
    res = run_cli("doctor", "--json", env={env_vars.ENV_GROUP_TIMEOUT: "7.5"}, timeout=120)
    assert "Traceback" not in res.stderr
    d = json.loads(res.stdout)
    assert d["group"] == {
        "initialized": False,
        "size": 1,
        "rank": 0,
        "members": [0],
        "source": None,
        "problem": None,
        "channel": "the default process group's c10d store",
        "timeout_variable": "VLLM_CAMP2P_MULTISTREAM_GROUP_TIMEOUT_S",
        "timeout_s": 7.5,
    }
    text = run_cli("doctor", env={env_vars.ENV_GROUP_TIMEOUT: "7.5"}, timeout=120).stdout
    (line,) = [line for line in text.splitlines() if line.startswith("FFN rank group:")]
    assert line == (
        "FFN rank group: this process is one FFN rank (torch.distributed is not initialized here); in a worker with "
        "several FFN ranks, the ranks sharing the MoE's collectives (vLLM's expert-parallel group, else the "
        "torch.distributed world) decide together over the default process group's c10d store, each exchange "
        'waiting up to VLLM_CAMP2P_MULTISTREAM_GROUP_TIMEOUT_S=7.5 s; stats()["group"] shows it there'
    )


@pytest.fixture
def one_rank_world() -> Iterator[None]:
    """torch.distributed initialized in this process: a gloo world of one rank over an in-process store."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized here")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_doctor_in_a_process_group_shows_what_discovery_finds(
    one_rank_world: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = cfgmod.OverlapConfig(group_timeout_s=12.0)
    g = group_section(cfg)
    assert g["initialized"] is True and g["problem"] is None
    assert (g["size"], g["rank"], g["members"], g["source"]) == (1, 0, [0], "torch.distributed world of one rank")
    d = diagnose()
    assert d["group"]["initialized"] is True and d["group"]["source"] == "torch.distributed world of one rank"
    assert "FFN rank group: this process is one FFN rank (torch.distributed world of one rank)" in doctor_text(d)
    # Several FFN ranks: this rank's place, the members and where they were read.
    found = rank_group.Membership(4, 2, (4, 5, 6, 7), "vLLM expert-parallel group", store=object())
    monkeypatch.setattr(rank_group, "discover", lambda: found)
    g = group_section(cfg)
    assert (g["size"], g["rank"], g["members"], g["source"]) == (4, 2, [4, 5, 6, 7], "vLLM expert-parallel group")
    d = diagnose()
    (line,) = [line for line in doctor_text({**d, "group": g}).splitlines() if line.startswith("FFN rank group:")]
    assert line == (
        "FFN rank group: FFN rank 2 of 4 (vLLM expert-parallel group [4, 5, 6, 7]), deciding together over the "
        "default process group's c10d store, each exchange waiting up to "
        'VLLM_CAMP2P_MULTISTREAM_GROUP_TIMEOUT_S=12 s; stats()["group"] shows it once a step engaged'
    )
    # Its problem: named, a note (not a problem: the ranks decide alone).
    problem = "this rank (3) is not in the vLLM expert-parallel group [0, 1]"
    monkeypatch.setattr(rank_group, "discover", lambda: rank_group.Membership(problem=problem))
    d = diagnose()
    assert d["group"]["problem"] == problem and d["group"]["size"] == 1
    assert any(problem in n for n in d["notes"]) and not any(problem in p for p in d["problems"])
    assert f"FFN rank group: the FFN ranks cannot decide together here: {problem}" in doctor_text(d)


def test_doctor_does_not_mistake_the_stand_ins_for_afd_plugin() -> None:
    _no_afd_plugin()
    standins.install(standins.REAL_ROOT)
    d = diagnose()
    assert [t["status"] for t in d["targets"]] == ["stand-in"] * len(load_manifest().targets())
    assert d["ok"] is False


@pytest.fixture
def fake_module() -> Iterator[types.ModuleType]:
    name = "camp2p_doctor_fake_runner"
    mod = types.ModuleType(name)
    mod.__file__ = __file__

    class Base:
        def inherited(self, x): ...

    class AFDNPUFFNModelRunner(Base):
        def _ffn_forward(
            self, *, dp_metadata_list, aclgraph_runtime_mode=None, is_graph_capturing=False, update_connector_state=True
        ): ...

    class Changed:
        def _ffn_forward(self, *, dp_metadata_list, is_graph_capturing=False): ...

    mod.AFDNPUFFNModelRunner = AFDNPUFFNModelRunner
    mod.Changed = Changed
    sys.modules[name] = mod
    yield mod
    del sys.modules[name]


def test_check_target_tells_ok_missing_and_changed_apart(fake_module: types.ModuleType) -> None:
    from dataclasses import replace

    spec = next(t for t in load_manifest().targets() if t.qualname == "AFDNPUFFNModelRunner._ffn_forward")
    ok = check_target(replace(spec, module=fake_module.__name__))
    assert ok["status"] == "ok" and ok["detail"] == ""
    changed = check_target(replace(spec, module=fake_module.__name__, qualname="Changed._ffn_forward"))
    assert changed["status"] == "signature-mismatch"
    assert "aclgraph_runtime_mode" in changed["detail"]
    gone = check_target(replace(spec, module=fake_module.__name__, qualname="Missing._ffn_forward"))
    assert gone["status"] == "missing"
    inherited = check_target(replace(spec, module=fake_module.__name__, qualname="AFDNPUFFNModelRunner.inherited"))
    assert inherited["status"] == "missing" and "only inherited" in inherited["detail"]
    broken = check_target(replace(spec, module="camp2p_doctor_no_such_module"))
    assert broken["status"] == "import-error" and "camp2p_doctor_no_such_module" in broken["detail"]
    assert {ok["status"], changed["status"], gone["status"], broken["status"]} <= STATUSES


def test_doctor_help_documents_the_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["doctor", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for key in ("camp2p-overlap/doctor/v1", "problems", "targets", "signature-mismatch", "switches", "exit status"):
        assert key in text


# ---------------------------------------------------------------------------
# Which stack matched, and why.


def _installed(monkeypatch: pytest.MonkeyPatch, **dists: str | None) -> None:
    names = {"vllm": versions.VLLM_DIST, "afd": versions.AFD_PLUGIN_DIST, "ascend": versions.VLLM_ASCEND_DIST}
    table = {names[k]: v for k, v in dists.items()}
    monkeypatch.setattr(versions, "installed_version", lambda dist: table.get(dist))
    monkeypatch.setattr("camp2p_overlap.tools.doctor.installed_version", lambda dist: table.get(dist))


@pytest.mark.parametrize(
    ("vllm", "afd", "stack"),
    [("0.19.1", "0.19.1rc1", "vllm-0.19.1"), ("0.26.0+empty", "0.1.dev447+g2e4378f2d", "vllm-0.26.0")],
)
def test_doctor_says_which_stack_matched_and_why(
    monkeypatch: pytest.MonkeyPatch, vllm: str, afd: str, stack: str
) -> None:
    _installed(monkeypatch, vllm=vllm, afd=afd, ascend=None)
    d = diagnose()
    m = d["stack_match"]
    assert d["stack"] == m["stack"] == stack
    assert m["why"].startswith(f"vLLM {vllm} matches supported {vllm.split('+')[0]}; afd-plugin {afd} is ")
    assert {c["stack"]: c["ok"] for c in m["candidates"]} == {
        "vllm-0.19.1": stack == "vllm-0.19.1",
        "vllm-0.26.0": stack == "vllm-0.26.0",
    }
    other = next(c for c in m["candidates"] if not c["ok"])
    assert other["reason"].startswith(f"vLLM {vllm} is installed; camp2p-overlap supports vLLM ")
    text = cli_text(d)
    assert f"stack: {stack} matched: {m['describe']}" in text
    assert f"[ok] {stack}: {m['why']}" in text and f"[no] {other['stack']}: " in text


def cli_text(d: dict) -> str:
    from camp2p_overlap.tools.doctor import doctor_text

    return doctor_text(d)


def test_doctor_says_no_stack_matched_naming_both(monkeypatch: pytest.MonkeyPatch) -> None:
    _installed(monkeypatch, vllm="0.25.0", afd=None, ascend=None)
    d = diagnose()
    assert d["stack_match"]["stack"] is None and d["ok"] is False
    assert not any(c["ok"] for c in d["stack_match"]["candidates"])
    gate = next(p for p in d["problems"] if p.startswith("vLLM version gate: "))
    assert "(stack vllm-0.19.1)" in gate and "(stack vllm-0.26.0)" in gate
    assert "stack: NONE matched" in cli_text(d)


@pytest.mark.parametrize(
    ("stack", "found", "status"),
    [
        ("vllm-0.26.0", "0.19.1rc2.dev1304+g80d8c194f", "ok"),  # what that commit builds as
        ("vllm-0.26.0", "0.19.1rc2.dev1373+gcf0baa38df", "differs"),  # a later commit of its branch
        ("vllm-0.26.0", "0.26.0rc1", "unknown"),  # a release names no commit: the user must check
        ("vllm-0.26.0", None, "not-installed"),
        ("vllm-0.19.1", "0.19.1rc1", "ok"),
        ("vllm-0.19.1", "0.19.1rc1+empty", "ok"),
        ("vllm-0.19.1", "0.18.0", "differs"),
    ],
)
def test_vllm_ascend_is_compared_with_the_checked_line(stack: str, found: str | None, status: str) -> None:
    row = vllm_ascend_check(load_manifest(stack), found)
    assert row["status"] == status and row["found"] == found and row["expected"]
    if stack == "vllm-0.26.0" and found is not None:
        assert "80d8c194f" in row["detail"]


def test_a_differing_vllm_ascend_is_a_note_not_a_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    _installed(monkeypatch, vllm="0.26.0", afd=None, ascend="0.26.0rc1")
    d = diagnose()
    assert d["stack"] == "vllm-0.26.0" and d["stack_match"]["vllm_ascend"]["status"] == "unknown"
    assert any(n.startswith("vLLM-Ascend: 0.26.0rc1 names no commit") for n in d["notes"])
    assert not any("vLLM-Ascend" in p for p in d["problems"])


@pytest.mark.vllm_runtime
def test_doctor_in_the_real_vllm_0_26_0_venv_matches_that_stack() -> None:
    python = VLLM_PYTHONS["0.26.0"]
    if not Path(python).exists():
        if importlib.util.find_spec("vllm") is not None:
            pytest.fail(f"{python} is missing: run bash scripts/setup.sh --test")
        pytest.skip("the vLLM 0.26.0 venv is not set up (bash scripts/setup.sh --test)")
    res = run_cli("doctor", "--json", timeout=180, python=python)
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    d = json.loads(res.stdout)
    assert d["versions"]["vllm"] == "0.26.0"
    assert d["stack"] == d["stack_match"]["stack"] == "vllm-0.26.0"
    assert d["vllm_check"]["ok"] is True
    assert [(c["stack"], c["ok"]) for c in d["stack_match"]["candidates"]] == [
        ("vllm-0.19.1", False),
        ("vllm-0.26.0", True),
    ]
