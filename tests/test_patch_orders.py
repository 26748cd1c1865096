"""Every order of import / apply / unpatch, each in a fresh interpreter
(ddtrace-style): one wrapper of ours per target when applied, the exact
originals otherwise, and no vLLM / torch / afd-plugin import from apply()."""

from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import run_python

# The child runs the steps named in STEPS and prints one JSON snapshot per step.
CHILD = """
import importlib, json, sys, types
import wrapt
import camp2p_overlap
from camp2p_overlap.core.engine import ENGINE
from camp2p_overlap.emulation import standins

RUNNER = "afd_plugin.v1.worker.npu.ffn_model_runner"
CONNECTOR = "afd_plugin.connectors.npu.camp2p"
TARGETS = [
    (RUNNER, "AFDNPUFFNModelRunner", "_ffn_forward"),
    (CONNECTOR, "CAMP2pAFDConnector", "recv_attn_output"),
    (CONNECTOR, "CAMP2pAFDConnector", "send_ffn_output"),
]
ORIGINAL = {}
standins.install()


def snapshot(step, result):
    snap = {
        "step": step,
        "result": result,
        "applied": camp2p_overlap.is_applied(),
        "states": {t.target.rsplit(".", 1)[-1]: t.state.value for t in camp2p_overlap.status().targets},
        "imported": [m in sys.modules for m in (RUNNER, CONNECTOR)],
        "foreign": sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "torch", "torch_npu")),
        "targets": {},
    }
    for mod, cname, attr in TARGETS:
        if mod not in sys.modules:
            continue
        entry = vars(getattr(sys.modules[mod], cname))[attr]
        snap["targets"][attr] = {
            "ours": sum(1 for e in wrapt.wrapper_chain(entry) if ENGINE.is_ours(e)),
            "outer_is_ours": ENGINE.is_ours(entry),
            "plain_function": isinstance(entry, types.FunctionType) and not hasattr(entry, "__wrapped__"),
            "is_original": attr in ORIGINAL and entry is ORIGINAL[attr],
        }
    print("SNAP " + json.dumps(snap), flush=True)


for step in STEPS:
    result = None
    if step == "import":
        for mod, cname, attr in TARGETS:
            m = importlib.import_module(mod)
            if not camp2p_overlap.is_applied():
                ORIGINAL[attr] = vars(getattr(m, cname))[attr]
    elif step == "apply":
        result = camp2p_overlap.apply().applied
    elif step == "unpatch":
        result = camp2p_overlap.unpatch()
    else:
        raise SystemExit("unknown step " + step)
    snapshot(step, result)
"""


def run_steps(steps: list[str], env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    code = f"STEPS = {steps!r}\n" + CHILD
    proc = run_python(code, env={"VLLM_CAMP2P_MULTISTREAM": "1", **(env or {})}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    snaps = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("SNAP ")]
    assert [s["step"] for s in snaps] == steps, proc.stdout + proc.stderr
    for s in snaps:
        assert s["foreign"] == [], f"step {s['step']} imported {s['foreign']}"
    return snaps


def assert_wrapped_once(snap: dict[str, Any]) -> None:
    assert snap["applied"] is True
    assert len(snap["targets"]) == 3
    for attr, t in snap["targets"].items():
        assert t["ours"] == 1 and t["outer_is_ours"], (attr, t)
    assert set(snap["states"].values()) == {"wrapped", "checked"}
    assert snap["states"]["_ffn_layer_indices"] == "checked"


def assert_original(snap: dict[str, Any], *, identity: bool) -> None:
    assert snap["applied"] is False
    assert len(snap["targets"]) == 3
    for attr, t in snap["targets"].items():
        assert t["ours"] == 0 and t["plain_function"], (attr, t)
        if identity:
            assert t["is_original"], attr


def test_apply_then_import() -> None:
    apply, imp = run_steps(["apply", "import"])
    assert apply["result"] is True and apply["imported"] == [False, False]
    assert set(apply["states"].values()) == {"not-imported-yet"}
    assert_wrapped_once(imp)


def test_import_then_apply() -> None:
    imp, apply = run_steps(["import", "apply"])
    assert_original(imp, identity=True)
    assert_wrapped_once(apply)


def test_apply_twice_before_and_after_import() -> None:
    snaps = run_steps(["apply", "apply", "import", "apply", "apply"])
    for s in snaps[2:]:
        assert_wrapped_once(s)


def test_import_apply_unpatch_apply() -> None:
    _, applied, unpatched, reapplied = run_steps(["import", "apply", "unpatch", "apply"])
    assert_wrapped_once(applied)
    assert unpatched["result"] is True
    assert_original(unpatched, identity=True)
    assert set(unpatched["states"].values()) == {"inactive"}
    assert_wrapped_once(reapplied)


def test_apply_unpatch_import_hook_does_not_wrap() -> None:
    _, unpatched, imp, reapplied, unpatched2 = run_steps(["apply", "unpatch", "import", "apply", "unpatch"])
    assert unpatched["result"] is True
    assert_original(imp, identity=True)
    assert "wrapped" not in imp["states"].values()
    assert_wrapped_once(reapplied)
    assert_original(unpatched2, identity=True)


def test_apply_unpatch_apply_then_import_wraps_once() -> None:
    snaps = run_steps(["apply", "unpatch", "apply", "import"])
    assert_wrapped_once(snaps[-1])


def test_unpatch_twice() -> None:
    snaps = run_steps(["import", "apply", "unpatch", "unpatch"])
    assert snaps[2]["result"] is True and snaps[3]["result"] is True
    assert_original(snaps[2], identity=True)
    assert_original(snaps[3], identity=True)


def test_unpatch_before_apply() -> None:
    snaps = run_steps(["unpatch", "import", "unpatch", "apply"])
    assert snaps[0]["result"] is True and snaps[2]["result"] is True
    assert_original(snaps[2], identity=True)
    assert_wrapped_once(snaps[3])


def test_switched_off_apply_wraps_nothing() -> None:
    snaps = run_steps(["apply", "import", "apply"], env={"VLLM_CAMP2P_MULTISTREAM": "0"})
    assert [s["result"] for s in snaps] == [False, None, False]
    assert_original(snaps[1], identity=True)
    assert_original(snaps[2], identity=True)


def test_fork_child_inherits_exactly_one_wrapper() -> None:
    code = """
    import importlib, os, sys, wrapt
    import camp2p_overlap
    from camp2p_overlap.core.engine import ENGINE
    from camp2p_overlap.emulation import standins
    standins.install()
    camp2p_overlap.apply()
    conn = importlib.import_module("afd_plugin.connectors.npu.camp2p").CAMP2pAFDConnector
    runner = importlib.import_module("afd_plugin.v1.worker.npu.ffn_model_runner").AFDNPUFFNModelRunner

    def count():
        return [sum(1 for e in wrapt.wrapper_chain(vars(c)[a]) if ENGINE.is_ours(e))
                for c, a in ((runner, "_ffn_forward"), (conn, "recv_attn_output"), (conn, "send_ffn_output"))]

    pid = os.fork()
    if pid == 0:
        # vLLM loads plugins again in every process it starts: register() runs again.
        camp2p_overlap.register()
        camp2p_overlap.apply()
        ok = count() == [1, 1, 1] and camp2p_overlap.is_applied() and camp2p_overlap.status().engaged
        os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    print("CHILD", os.waitstatus_to_exitcode(status), "PARENT", count())
    """
    proc = run_python(code, env={"VLLM_CAMP2P_MULTISTREAM": "1"}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "CHILD 0 PARENT [1, 1, 1]" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("strict", ["0", "1"])
def test_import_of_package_and_apply_import_no_upstream_module(strict: str) -> None:
    code = """
    import sys
    import camp2p_overlap
    after_import = sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "afd_plugin", "torch_npu", "torch"))
    report = camp2p_overlap.apply()
    after_apply = sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "afd_plugin", "torch_npu", "torch"))
    print("RESULT", after_import, after_apply, report.applied, report.vllm_version)
    """
    proc = run_python(code, env={"VLLM_CAMP2P_MULTISTREAM": "1", "VLLM_CAMP2P_MULTISTREAM_STRICT": strict})
    assert proc.returncode == 0, proc.stderr
    assert "RESULT [] [] True 0.19.1" in proc.stdout, proc.stdout + proc.stderr
