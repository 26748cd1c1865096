"""Helpers shared by the overlap tests (session, wrappers, streams, trace):
run one emulated FFN step with a chosen schedule, compute the serial
reference with the engine unpatched, bound anything that could hang."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import wrapt

from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.overlap.session import StepSession
from camp2p_overlap.core.patch_layer import PATCH_LAYER, PatchLayer
from camp2p_overlap.core.patching.status_report import PatchReport
from camp2p_overlap.emulation import standins
from camp2p_overlap.emulation.moe import MoEShape
from camp2p_overlap.emulation.world import StageMeta, World, WorldSpec, build_world

SHAPE = MoEShape(hidden=64, ffn=128, experts=4, top_k=2)
Results = dict[tuple[int, int], torch.Tensor]


def world(**kw: Any) -> World:
    kw.setdefault("shape", SHAPE)
    kw.setdefault("tokens", 16)
    kw.setdefault("op_timeout_s", 10.0)
    return build_world(WorldSpec(**kw))


def graph_world(**kw: Any) -> World:
    """A 3-layer, 2-stage world whose runner uses decode graphs (upstream's
    graph path on the emulated device)."""
    w = world(layers=3, stage_ids=(0, 1), tokens=8, graph=True, **kw)
    assert w.runner.use_aclgraph
    return w


def eager_refs(w: World, steps: range) -> dict[int, dict]:
    """Eager outputs (graphs off; call it unpatched: upstream's) of each
    step number."""
    graphs, w.runner.use_aclgraph = w.runner.use_aclgraph, False
    try:
        out = {}
        for n in steps:
            w.steps_run = n - 1
            out[n] = w.run_step()
        return out
    finally:
        w.runner.use_aclgraph = graphs


def apply_cpu(*, patch_layer: PatchLayer = PATCH_LAYER, **overrides: Any) -> PatchReport:
    """Apply ``patch_layer`` (strict; default the process-wide one) switched on
    with the CPU backend plus ``overrides``; the engine must have picked the
    stack whose stand-ins are installed."""
    patch_layer.engine.unpatch(timeout=10)
    overrides.setdefault("adaptive", False)  # the schedule tests want every allowed step engaged
    report = patch_layer.engine.apply(strict=True, config=OverlapConfig(enabled=True, backend="cpu", **overrides))
    assert report.engaged, str(report)
    assert_stack(report)
    return report


def assert_stack(report: PatchReport) -> None:
    """The engine picked the manifest of the stand-ins' stack (from the
    installed versions: see ``support.stacks.use_stack``)."""
    stack = standins.installed_stack(standins.REAL_ROOT)
    assert stack is None or report.stack == stack, f"stand-ins of {stack}, manifest of {report.stack}"


@dataclass(frozen=True)
class Schedule:
    """One step: the layer count, the stage ids and tokens per stage."""

    layers: int
    stages: tuple[int, ...]
    tokens: tuple[int, ...]
    step: int

    def dp(self) -> dict[int, StageMeta]:
        return {s: StageMeta(n) for s, n in zip(self.stages, self.tokens, strict=True)}


def run_step(w: World, sched: Schedule | None = None, **forward_kwargs: Any) -> Results:
    """One step of ``w`` as :meth:`World.run_step` does it, with the stage
    ids, layer count, tokens and step number of ``sched``."""
    if sched is None:
        return w.run_step(**forward_kwargs)
    w.runner.num_layers = sched.layers
    w.steps_run = sched.step
    dp = sched.dp()
    w.transport.begin_step(sched.step, w.layer_list(), sorted(dp))
    try:
        if forward_kwargs:
            w.runner._ffn_forward(dp_metadata_list=dp, **forward_kwargs)
        else:
            w.runner.execute_ffn_step(dp_metadata_list=dp)
    except BaseException:
        w.settle()  # as World.run_step: the next step starts on an idle device
        raise
    w.synchronize()  # the host ran ahead of the (emulated) device
    return dict(w.transport.results)


def serial_results(w: World, scheds: Sequence[Schedule], patch_layer: PatchLayer = PATCH_LAYER) -> list[Results]:
    """What the unpatched (upstream) code delivers for each schedule."""
    assert not patch_layer.engine.is_applied()
    assert "_ffn_forward" in vars(type(w.runner)) and not hasattr(vars(type(w.runner))["_ffn_forward"], "__wrapped__")
    return [run_step(w, s) for s in scheds]


def assert_same(got: Mapping[Any, torch.Tensor], want: Mapping[Any, torch.Tensor], context: str = "") -> None:
    """The one tensor-dict equality check of the suite: the same keys and,
    for every key, ``torch.equal`` (same shape, bitwise equal values).
    ``context`` (a run, a step) prefixes the failure text."""
    pre = f"{context}: " if context else ""
    assert sorted(got) == sorted(want), f"{pre}keys differ: got {sorted(got)}, want {sorted(want)}"
    for k in want:
        assert torch.equal(got[k], want[k]), f"{pre}output of (layer, stage) {k} differs from the serial path"


def count_our_wrappers(obj: Any, engine: Any = None) -> int:
    """How many wrappers of ours (``engine``, default ``PATCH_LAYER.engine``) are in the
    wrapper chain of ``obj`` (``wrapt.wrapper_chain``: every ``__wrapped__``
    link, wrapt proxies and ``functools.wraps`` functions alike). Code run
    in a fresh interpreter inlines the same expression."""
    engine = PATCH_LAYER.engine if engine is None else engine
    return sum(1 for e in wrapt.wrapper_chain(obj) if engine.is_ours(e))


def bounded(fn: Callable[[], Any], timeout: float = 30.0) -> Any:
    """Run ``fn`` in a thread; re-raise what it raised; fail if it has not
    returned after ``timeout`` seconds (a hang becomes a failure)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box["error"] = exc

    t = threading.Thread(target=target, name="bounded-step", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise AssertionError(f"step did not finish within {timeout} s (hang)")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def stream_sets(patch_layer: PatchLayer = PATCH_LAYER) -> list[Any]:
    return patch_layer.runtime.runners.stream_sets()


def assert_streams_idle(timeout: float = 5.0, patch_layer: PatchLayer = PATCH_LAYER) -> None:
    sets = stream_sets(patch_layer)
    assert sets, "no stream set was created"
    for sset in sets:
        for s, stream in sset.streams.items():
            assert stream.drain(timeout), f"side stream of stage {s} still busy after the step"
            assert stream.alive
        assert sset.ffn.drain(timeout), "the FFN stream still busy after the step"
        assert sset.ffn.alive


def delay_hook(rng: random.Random, max_ms: float) -> Callable[[str, int, int], None]:
    """A fault hook that sleeps a random 0..max_ms before each a2e/e2a."""
    lock = threading.Lock()

    def hook(kind: str, layer: int, stage: int) -> None:
        with lock:
            d = rng.uniform(0.0, max_ms) / 1000.0
        time.sleep(d)

    return hook


def wrap_model(
    w: World,
    before: Callable[[int], None] | None = None,
    after: Callable[[Any], None] | None = None,
    *,
    before_with_stage: Callable[[int, int], None] | None = None,
):
    """Wrap the world's ``compute_ffn_output`` (an instance attribute, so the
    loop's ``self.model.compute_ffn_output`` finds it). ``before_with_stage``
    gets (layer, stage): the stage is found from the received hidden states
    (the transport's ``a2e`` is wrapped to remember which stage made them)."""
    model = w.runner.model
    original = type(model).compute_ffn_output.__get__(model)
    stage_of: dict[int, int] = {}
    if before_with_stage is not None:
        transport = w.transport
        a2e = type(transport).a2e.__get__(transport)

        def a2e_tracking(**kw: Any) -> Any:
            hidden, bs = a2e(**kw)
            stage_of[id(hidden)] = kw["stage"]
            return hidden, bs

        transport.a2e = a2e_tracking  # type: ignore[method-assign]

    def compute_ffn_output(*, hidden_states: torch.Tensor, layer_idx: int) -> Any:
        if before_with_stage is not None:
            before_with_stage(layer_idx, stage_of.pop(id(hidden_states), -1))
        if before is not None:
            before(layer_idx)
        out = original(hidden_states=hidden_states, layer_idx=layer_idx)
        if after is not None:
            after(out)
        return out

    model.compute_ffn_output = compute_ffn_output
    return original


class SessionSpy:
    """Make ``patch_layer``'s runtime (default the process-wide one) build sessions
    of a subclass that remembers every session it builds (weakly unless
    ``keep``) and, for kept ones, the ops it issued (``issued_ops``, taken
    when the session closes)."""

    def __init__(
        self,
        monkeypatch: Any,
        base: type[StepSession] = StepSession,
        *,
        keep: bool = False,
        patch_layer: PatchLayer = PATCH_LAYER,
    ) -> None:
        import weakref

        self.refs: list[weakref.ref[StepSession]] = []
        self.kept: list[StepSession] = []
        spy = self

        class Recorded(base):  # type: ignore[misc, valid-type]
            def __init__(self, **kw: Any) -> None:
                super().__init__(**kw)
                self.issued_ops: list[tuple[str, int | None, int | None]] = []
                spy.refs.append(weakref.ref(self))
                if keep:
                    spy.kept.append(self)

            def close(self, *, raising: bool = False) -> None:
                if keep and not self.closed:
                    self.issued_ops = self.issued()
                super().close(raising=raising)

        monkeypatch.setattr(patch_layer.runtime, "session_class", Recorded)

    @property
    def count(self) -> int:
        return len(self.refs)


def spy_forward(runner_cls: type, patch_layer: PatchLayer = PATCH_LAYER) -> list[dict[str, Any]]:
    """Replace ``_ffn_forward`` in the class dict (before apply) by a function
    of the same signature that records its arguments (and ``patch_layer``'s active
    session) and calls the original."""
    original = vars(runner_cls)["_ffn_forward"]
    calls: list[dict[str, Any]] = []

    def _ffn_forward(
        self,
        *,
        dp_metadata_list,
        aclgraph_runtime_mode=None,
        is_graph_capturing=False,
        update_connector_state=True,
    ):
        calls.append(
            {
                "self": self,
                "dp_metadata_list": dp_metadata_list,
                "aclgraph_runtime_mode": aclgraph_runtime_mode,
                "is_graph_capturing": is_graph_capturing,
                "update_connector_state": update_connector_state,
                "session": patch_layer.runtime.active_session(),
            }
        )
        return original(
            self,
            dp_metadata_list=dp_metadata_list,
            aclgraph_runtime_mode=aclgraph_runtime_mode,
            is_graph_capturing=is_graph_capturing,
            update_connector_state=update_connector_state,
        )

    runner_cls._ffn_forward = _ffn_forward
    return calls


#: An A2E or E2A call as the issue-order oracles name it: (kind, layer, stage).
Call = tuple[str, int, int]


def upstream_order(layers: Sequence[int], stages: Sequence[int]) -> list[Call]:
    """Upstream's loop order (and ``parity``'s): per (L, s), A2E then E2A."""
    return [(k, L, s) for L in layers for s in stages for k in ("a2e", "e2a")]


def overlap_issue_order(layers: Sequence[int], stages: Sequence[int]) -> list[Call]:
    """The overlap's issue order (and ``reorder``'s), written out from
    docs/design.md: the prologue A2E of every stage, then per (L, s)
    E2A(L, s) and A2E(L+1, s)."""
    order: list[Call] = [("a2e", layers[0], s) for s in stages]
    for i, L in enumerate(layers):
        for s in stages:
            order.append(("e2a", L, s))
            if i + 1 < len(layers):
                order.append(("a2e", layers[i + 1], s))
    return order


def by_key(ops: Sequence[Any]) -> Mapping[tuple[str, int | None, int | None], Any]:
    return {(o.kind, o.layer, o.stage): o for o in ops if o.kind in ("a2e", "ffn", "e2a")}
