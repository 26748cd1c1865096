"""Every reason to stay off: the original runs with the very same arguments,
no session is opened, and the reason is logged once per distinct reason.
``CASES`` holds 19 set-ups, each refused with its own reason: no two
texts are equal or one a prefix of the other, and each logged reason
starts with exactly one case's text. Every test runs once per supported
stack (``standin_stack``)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from support.logs import PackageLogs
from support.overlap import (
    Schedule,
    SessionSpy,
    assert_same,
    assert_stack,
    bounded,
    serial_results,
    spy_forward,
    world,
)

from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.observe import trace
from camp2p_overlap.core.patch_layer import PatchLayer
from camp2p_overlap.emulation.world import World
from camp2p_overlap.verify import edges

pytestmark = pytest.mark.usefixtures("standin_stack")

GATE = "running the serial FFN path"
SENTINEL = object()  # passed as aclgraph_runtime_mode: must reach the original as is


class CAMAsyncAFDConnector:
    """Another connector class (the asynchronous CAM one): delegates to a
    CAMP2P connector so the loop still works, but is not one."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.control_plane = inner.control_plane

    def recv_attn_output(self, ubatch_idx: int = 0, **kwargs: Any) -> Any:
        return self._inner.recv_attn_output(ubatch_idx, **kwargs)

    def send_ffn_output(self, ffn_output: Any, context: Any, **kwargs: Any) -> None:
        return self._inner.send_ffn_output(ffn_output, context, **kwargs)


@dataclass
class Case:
    reason: str
    stages: tuple[int, ...] = (0, 1)
    config: dict[str, Any] = field(default_factory=dict)
    forward: dict[str, Any] = field(default_factory=dict)
    before_apply: Callable[[World, pytest.MonkeyPatch], None] | None = None
    after_apply: Callable[[World, pytest.MonkeyPatch], None] | None = None
    error: type[BaseException] | None = None
    strict: bool = True
    skip_if: Callable[[], str | None] | None = None
    #: Whether the serial reference (made before the case's set-up) applies.
    compare: bool = True
    #: Switch the applied layer's configuration off before the steps.
    switch_off_after_apply: bool = False


def _camasync(w: World, mp: pytest.MonkeyPatch) -> None:
    mp.setattr(w.runner, "connector", CAMAsyncAFDConnector(w.connector))


def _attention_role(w: World, mp: pytest.MonkeyPatch) -> None:
    mp.setattr(w.runner.afd_config, "role", "attention")


def _cuda_device(w: World, mp: pytest.MonkeyPatch) -> None:
    mp.setattr(w.runner, "device", torch.device("cuda"))


def _change_connector_signature(w: World, mp: pytest.MonkeyPatch) -> None:
    cls = type(w.connector)
    original = vars(cls)["send_ffn_output"]

    def send_ffn_output(self: Any, ffn_output: Any, context: Any, *, ubatch_idx: int = 0, **kwargs: Any) -> None:
        return original(self, ffn_output, context, ubatch_idx=ubatch_idx, **kwargs)

    cls.send_ffn_output = send_ffn_output  # the manifest's signature no longer matches: module refused


def _connector_module_not_imported(w: World, mp: pytest.MonkeyPatch) -> None:
    # The world keeps its connector; the module is "not imported yet" for the engine.
    mp.delitem(sys.modules, w.modules[1].__name__)


def _repeated_layers(w: World, mp: pytest.MonkeyPatch) -> None:
    mp.setattr(w.modules[0], "_ffn_layer_indices", lambda runner: [0, 1, 1])


def _no_moe_layers(w: World, mp: pytest.MonkeyPatch) -> None:
    # Gate on attention with the first 3 layers dense: none of the 3 layers runs on FFN.
    mp.setattr(w.runner.afd_config, "compute_gate_on_attention", True)
    mp.setattr(w.runner.model_config.hf_config, "first_k_dense_replace", 3)


def _num_ubatches(w: World, mp: pytest.MonkeyPatch, n: int) -> None:
    """The connector's group fields as the real connector fills them for ``n`` micro-batches."""
    mp.setattr(w.connector, "hccl_comm_name2", "afd1" if n > 1 else w.connector.hccl_comm_name)
    mp.setattr(w.connector, "hccl_comm_name3", "afd2" if n > 2 else "")


def _uninitialized(w: World, mp: pytest.MonkeyPatch) -> None:
    for name in ("hccl_comm_name", "hccl_comm_name2", "hccl_comm_name3"):
        mp.setattr(w.connector, name, "")


#: The stack's refusal names the first target that is not patched.
STACK_INCOMPLETE = "not every target of the stack is patched (afd_plugin.connectors.npu.camp2p"


def _no_cuda() -> str | None:
    return "CUDA is available here" if torch.cuda.is_available() else None


CASES: dict[str, Case] = {
    "switched-off": Case("switched off", switch_off_after_apply=True),
    "not-camp2p": Case("connector is CAMAsyncAFDConnector, not CAMP2pAFDConnector", after_apply=_camasync),
    "role-attention": Case("AFD role is 'attention', not 'ffn'", after_apply=_attention_role),
    "one-stage": Case("1 stage(s), fewer than the minimum 2", stages=(0,)),
    "min-stages-3": Case("2 stage(s), fewer than the minimum 3", config={"min_stages": 3}),
    # Upstream's connector maps stage 3 to its first group: the serial path runs.
    "four-stages": Case("stage ids [0, 1, 2, 3] do not fit CAMP2P's 3 stage groups", stages=(0, 1, 2, 3)),
    "stage-id-3": Case("stage ids [0, 3] do not fit CAMP2P's 3 stage groups", stages=(0, 3)),
    # num_ubatches=1: stage 1 falls back to the first group, as upstream's connector does.
    "aliased-groups": Case(
        "HCCL group check: stages 0, 1 share HCCL group 'afd'", before_apply=lambda w, mp: _num_ubatches(w, mp, 1)
    ),
    # num_ubatches=2: stage 2 has no group; upstream's connector raises on its first A2E.
    "missing-group": Case(
        "HCCL group check: stage 2 has no third HCCL group",
        stages=(0, 1, 2),
        before_apply=lambda w, mp: _num_ubatches(w, mp, 2),
        error=RuntimeError,
    ),
    "uninitialized-connector": Case(
        "HCCL group check: stage 0: hccl_comm_name is empty", after_apply=_uninitialized, compare=False
    ),
    "graph-capture": Case(
        "inside graph capture and VLLM_CAMP2P_MULTISTREAM_GRAPH is off", forward={"is_graph_capturing": True}
    ),
    "auto-backend-cpu-device": Case("runner device 'cpu' has no device streams", config={"backend": "auto"}),
    "cuda-backend-cpu-device": Case(
        "backend 'cuda' was asked for but the runner's device is 'cpu'", config={"backend": "cuda"}
    ),
    "cuda-backend-no-cuda": Case(
        "backend 'cuda' unavailable: torch.cuda reports no CUDA device",
        config={"backend": "cuda"},
        after_apply=_cuda_device,
        skip_if=_no_cuda,
    ),
    # The direction switches refine comm-side only: with comm-side the only layout listed, both off leaves
    # nothing to engage (compute-side with both off still engages: test_both_directions_off_keep_compute_side).
    "both-directions-off": Case(
        "the comm-side layout with both directions switched off (A2E=0 and E2A=0)",
        config={"layouts": ("comm-side",), "a2e_on_side_stream": False, "e2a_on_side_stream": False},
    ),
    "connector-module-refused": Case(
        f"{STACK_INCOMPLETE}.CAMP2pAFDConnector.recv_attn_output is refused",
        before_apply=_change_connector_signature,
        strict=False,
    ),
    "connector-module-not-imported": Case(
        f"{STACK_INCOMPLETE}.CAMP2pAFDConnector.recv_attn_output is not-imported-yet",
        before_apply=_connector_module_not_imported,
    ),
    "repeated-layers": Case("layer list repeats a layer: [0, 1, 1]", after_apply=_repeated_layers, compare=False),
    "no-ffn-layers": Case("the step has no FFN layers", after_apply=_no_moe_layers, compare=False),
}


def test_every_case_has_its_own_reason() -> None:
    texts = [c.reason for c in CASES.values()]
    assert len(texts) == 19
    assert len(set(texts)) == len(texts)
    # No text starts another, so a logged reason identifies one case.
    assert not [(a, b) for a in texts for b in texts if a != b and b.startswith(a)]


def _run(w: World, stages: tuple[int, ...], step: int, forward: dict[str, Any]) -> tuple[Any, Any]:
    sched = Schedule(w.spec.layers, stages, (6,) * len(stages), step)
    dp = sched.dp()
    w.steps_run = step
    w.transport.begin_step(step, w.layer_list(), sorted(dp))
    try:
        w.runner._ffn_forward(dp_metadata_list=dp, aclgraph_runtime_mode=SENTINEL, **forward)
    except BaseException:
        w.settle()
        raise
    w.synchronize()
    return dict(w.transport.results), dp


@pytest.mark.parametrize("name", list(CASES))
def test_gate_runs_the_original_with_the_same_arguments(
    monkeypatch: pytest.MonkeyPatch,
    logs: PackageLogs,
    name: str,
    patch_layer: PatchLayer,
) -> None:
    case = CASES[name]
    if case.skip_if is not None and (why := case.skip_if()):
        pytest.skip(why)
    w = world(layers=3, stage_ids=(0, 1, 2))
    refs = None
    if case.error is None:
        refs = serial_results(
            w, [Schedule(3, case.stages, (6,) * len(case.stages), step) for step in (1, 2)], patch_layer
        )
    calls = spy_forward(type(w.runner), patch_layer=patch_layer)
    if case.before_apply is not None:
        case.before_apply(w, monkeypatch)
    cfg = OverlapConfig(enabled=True, backend="cpu", adaptive=False).with_overrides(**case.config)
    assert_stack(patch_layer.engine.apply(strict=case.strict, config=cfg))
    if case.after_apply is not None:
        case.after_apply(w, monkeypatch)
    if case.switch_off_after_apply:
        monkeypatch.setattr(patch_layer.engine, "config", patch_layer.engine.config.with_overrides(enabled=False))
    sessions = SessionSpy(monkeypatch, patch_layer=patch_layer)
    with trace.recording() as rec:
        for step in (1, 2):
            if case.error is not None:
                with pytest.raises(case.error):
                    bounded(lambda step=step: _run(w, case.stages, step, case.forward))
                dp = calls[-1]["dp_metadata_list"]
            else:
                got, dp = bounded(lambda step=step: _run(w, case.stages, step, case.forward))
                if case.compare:
                    assert_same(got, refs[step - 1])
                else:
                    assert len(got) == len(set(w.layer_list())) * len(case.stages)
            call = calls[-1]
            assert call["dp_metadata_list"] is dp
            assert call["aclgraph_runtime_mode"] is SENTINEL
            assert call["self"] is w.runner
            assert call["session"] is None
            for key in ("is_graph_capturing", "update_connector_state"):
                if key in case.forward:
                    assert call[key] is case.forward[key]
    assert len(calls) == 2
    assert sessions.count == 0
    logged = logs.texts(GATE)
    assert len(logged) == 1, logged  # once, although two steps were gated
    reason = logged[0].split(f"{GATE}: ", 1)[1]
    assert [n for n, c in CASES.items() if reason.startswith(c.reason)] == [name], logged[0]
    side = {o.stream for o in rec.ops()} - {"C"}
    assert not side


def test_each_distinct_reason_is_logged_once(
    monkeypatch: pytest.MonkeyPatch, logs: PackageLogs, patch_layer: PatchLayer
) -> None:
    w = world(layers=2, stage_ids=(0, 1, 2))
    patch_layer.engine.apply(
        strict=True, config=OverlapConfig(enabled=True, backend="cpu", adaptive=False, min_stages=3)
    )
    _run(w, (0, 1), 1, {})
    _run(w, (0,), 2, {})
    _run(w, (0, 1), 3, {})
    _run(w, (0,), 4, {})
    _run(w, (0, 2), 5, {})  # the same reason text as (0, 1)
    logged = logs.texts(GATE)
    assert len(logged) == 2
    assert "2 stage(s), fewer than the minimum 3" in logged[0]
    assert "1 stage(s), fewer than the minimum 3" in logged[1]


@pytest.mark.parametrize("layout", ["compute-side", "comm-side"])
def test_graph_capture_engages_with_the_graph_switch(
    monkeypatch: pytest.MonkeyPatch, patch_layer: PatchLayer, layout: str
) -> None:
    """With the graph switch on, a capture engages the overlap in the layout listed (comm-side's capture, with
    A2E/E2A on side streams, only with its own opt-in) and runs the layout's schedule."""
    w = world(layers=3, stage_ids=(0, 1))
    (ref,) = serial_results(w, [Schedule(3, (0, 1), (6, 6), 1)])
    calls = spy_forward(type(w.runner), patch_layer=patch_layer)
    cfg = OverlapConfig(
        enabled=True,
        backend="cpu",
        adaptive=False,
        graph=True,
        layouts=(layout,),
        graph_comm_side=layout == "comm-side",
    )
    patch_layer.engine.apply(strict=True, config=cfg)
    sessions = SessionSpy(monkeypatch, patch_layer=patch_layer, keep=True)
    with trace.recording() as rec:
        got, dp = _run(w, (0, 1), 1, {"is_graph_capturing": True})
    assert_same(got, ref)
    assert sessions.count == 1
    (session,) = sessions.kept
    assert session.layout.name == layout
    assert calls[0]["dp_metadata_list"] is dp and calls[0]["is_graph_capturing"] is True
    expected = session.expected_schedule()
    assert expected == trace.ExpectedSchedule(
        (0, 1, 2), (0, 1), layout == "comm-side", layout == "comm-side", layout == "compute-side"
    )
    res = edges.check_step(rec.ops(rec.steps()[0]), expected)
    assert res.ok, str(res)
    side = {o.stream for o in rec.ops() if o.kind in ("a2e", "ffn", "e2a")} - {"C"}
    assert side == ({"F"} if layout == "compute-side" else {"K0", "K1"})


def test_both_directions_off_keep_compute_side(
    monkeypatch: pytest.MonkeyPatch, logs: PackageLogs, patch_layer: PatchLayer
) -> None:
    """The direction switches refine comm-side only: with compute-side listed (the default), both off still
    engages it (FFN on F, A2E/E2A on C) and no gate reason is logged."""
    w = world(layers=3, stage_ids=(0, 1))
    (ref,) = serial_results(w, [Schedule(3, (0, 1), (6, 6), 1)], patch_layer)
    cfg = OverlapConfig(enabled=True, backend="cpu", adaptive=False, a2e_on_side_stream=False, e2a_on_side_stream=False)
    assert cfg.layouts == ("compute-side",)
    patch_layer.engine.apply(strict=True, config=cfg)
    sessions = SessionSpy(monkeypatch, patch_layer=patch_layer, keep=True)
    with trace.recording() as rec:
        got, _ = bounded(lambda: _run(w, (0, 1), 1, {}))
    assert_same(got, ref)
    (session,) = sessions.kept
    assert session.layout.name == "compute-side"
    res = edges.check_step(rec.ops(rec.steps()[0]), session.expected_schedule())
    assert res.ok, str(res)
    ops = {(o.kind, o.stream) for o in rec.ops() if o.kind in ("a2e", "ffn", "e2a")}
    assert ops == {("a2e", "C"), ("e2a", "C"), ("ffn", "F")}
    assert not logs.texts(GATE)


def test_reentrant_forward_runs_the_original(
    monkeypatch: pytest.MonkeyPatch, logs: PackageLogs, patch_layer: PatchLayer
) -> None:
    outer = world(layers=3, stage_ids=(0, 1))
    inner = world(layers=2, stage_ids=(0, 1), seed=5)
    (ref_outer,) = serial_results(outer, [Schedule(3, (0, 1), (6, 6), 1)])
    (ref_inner,) = serial_results(inner, [Schedule(2, (0, 1), (6, 6), 7)])
    calls = spy_forward(type(outer.runner), patch_layer=patch_layer)
    patch_layer.engine.apply(strict=True, config=OverlapConfig(enabled=True, backend="cpu", adaptive=False))
    sessions = SessionSpy(monkeypatch, patch_layer=patch_layer)
    model = outer.runner.model
    original = type(model).compute_ffn_output.__get__(model)
    inner_out: dict[str, Any] = {}

    def compute_ffn_output(*, hidden_states: torch.Tensor, layer_idx: int) -> Any:
        if not inner_out:
            inner_out["results"], inner_out["dp"] = _run(inner, (0, 1), 7, {})
        return original(hidden_states=hidden_states, layer_idx=layer_idx)

    model.compute_ffn_output = compute_ffn_output
    got, dp = bounded(lambda: _run(outer, (0, 1), 1, {}))
    assert_same(got, ref_outer)
    assert_same(inner_out["results"], ref_inner)
    assert sessions.count == 1  # the outer step only
    assert [c["self"] for c in calls] == [outer.runner, inner.runner]
    assert calls[0]["dp_metadata_list"] is dp and calls[1]["dp_metadata_list"] is inner_out["dp"]
    assert calls[0]["session"] is not None and calls[1]["session"] is calls[0]["session"]
    (msg,) = logs.texts(GATE)
    assert "re-entrant FFN forward inside an active step" in msg


def test_planning_error_runs_the_original(
    monkeypatch: pytest.MonkeyPatch, logs: PackageLogs, patch_layer: PatchLayer
) -> None:
    """A failure while planning (here the layer list holds a non-integer)
    never breaks the call: the original runs (and fails or not on its own)."""
    w = world(layers=2, stage_ids=(0, 1))
    patch_layer.engine.apply(strict=True, config=OverlapConfig(enabled=True, backend="cpu", adaptive=False))
    plan_calls = {"n": 0}
    real = w.modules[0]._ffn_layer_indices

    def layers(runner: Any) -> Any:
        plan_calls["n"] += 1
        return ["zero", "one"] if plan_calls["n"] == 2 else real(runner)

    monkeypatch.setattr(w.modules[0], "_ffn_layer_indices", layers)
    got, _ = _run(w, (0, 1), 1, {})
    assert len(got) == 4
    (msg,) = logs.texts(GATE)
    assert "could not plan the step (ValueError" in msg
