"""Hypothesis strategies for the schedule and fault properties: layers,
stage sets, tokens, directions, rollout modes and injected faults. A
failing example shrinks to fewer layers, fewer stages, fewer tokens, the
first op kind and the simplest mode. The example budget comes from the
profile registered in ``conftest.py`` (``HYPOTHESIS_PROFILE``)."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from camp2p_overlap.emulation.faults import Action, Fault, InjectedFault, InjectedIOError
from support.overlap import Schedule

#: Every non-empty set of CAMP2P stage ids, smallest first (shrinks towards (0,)).
STAGE_SETS = [(0,), (0, 1), (0, 2), (1, 2), (0, 1, 2), (1,), (2,)]
MULTI_STAGE_SETS = [s for s in STAGE_SETS if len(s) > 1]
#: (A2E on a side stream, E2A on a side stream): both first (shrinks there).
DIRECTIONS = [(True, True), (True, False), (False, True)]
MODES = ["overlap", "reorder", "parity"]
FAULT_SITES = ["a2e", "ffn", "e2a"]


def stage_sets(*, multi: bool = False) -> st.SearchStrategy[tuple[int, ...]]:
    return st.sampled_from(MULTI_STAGE_SETS if multi else STAGE_SETS)


@st.composite
def tokens_for(draw: st.DrawFn, stages: tuple[int, ...], max_tokens: int = 16) -> tuple[int, ...]:
    return tuple(draw(st.integers(1, max_tokens)) for _ in stages)


@st.composite
def schedules(
    draw: st.DrawFn,
    *,
    layers: tuple[int, int] = (1, 4),
    multi: bool = False,
    step: int = 1,
) -> Schedule:
    """One step: a layer count, a stage set and tokens per stage."""
    stages = draw(stage_sets(multi=multi))
    return Schedule(draw(st.integers(*layers)), stages, draw(tokens_for(stages)), step)


@dataclass(frozen=True)
class FaultRun:
    """One fault-injection run: a step with one fault, then a clean step."""

    fault: Fault
    layers: int
    stages: tuple[int, ...]
    directions: tuple[bool, bool]
    mode: str
    tokens: dict[int, int]

    def __str__(self) -> str:
        return (
            f"{self.fault.describe()}, layers {self.layers}, stages {self.stages}, mode {self.mode}, "
            f"a2e/e2a side {self.directions}, tokens {self.tokens}"
        )


@st.composite
def faults(
    draw: st.DrawFn, action: Action, layers: int, stages: tuple[int, ...], ops: list[str] | None = None
) -> Fault:
    """One fault of ``action`` at a (layer, stage) and op kind of the step."""
    op = draw(st.sampled_from(ops or (["a2e", "e2a"] if action == "stop" else FAULT_SITES)))
    layer = draw(st.integers(0, layers - 1))
    stage = draw(st.sampled_from(stages))
    if action == "delay":
        return Fault("delay", op, layer, stage, delay_s=draw(st.floats(0.001, 0.02)))  # type: ignore[arg-type]
    if action == "raise":
        exc = draw(st.sampled_from([InjectedFault, InjectedIOError]))
        return Fault("raise", op, layer, stage, exc_type=exc)  # type: ignore[arg-type]
    return Fault("stop", op, layer, stage)  # type: ignore[arg-type]


@st.composite
def fault_runs(draw: st.DrawFn, action: Action) -> FaultRun:
    layers = draw(st.integers(1, 4))
    stages = draw(stage_sets())
    tokens = dict(zip(stages, draw(tokens_for(stages)), strict=True))
    return FaultRun(
        fault=draw(faults(action, layers, stages)),
        layers=layers,
        stages=stages,
        directions=draw(st.sampled_from(DIRECTIONS)),
        mode=draw(st.sampled_from(MODES)),
        tokens=tokens,
    )
