"""The plan of one FFN step (:class:`StepPlan`); the layouts, where each op
kind runs; and the rollout rungs (each mode is a layout) and the ladder."""

from __future__ import annotations

import functools
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.keys import A2E, A_DONE, E2A, E_DONE, E_DONE_ON_C, F_DONE, EventKey, OpKey

StageLayer = tuple[int, int]


@dataclass(frozen=True)
class StepPlan:
    """The step as the loop will run it: ``for L in layers: for s in stages``. What a session reads per (layer,
    stage) (the order, each layer's next, the receive kwargs, event keys and op labels) is derived once per plan,
    and plans are cached per step shape (:func:`step_plan`)."""

    layers: tuple[int, ...]
    stages: tuple[int, ...]
    #: Extra receive kwargs of every call besides ``ubatch_idx``/``layer_idx``
    #: (upstream: ``max_num_tokens``).
    recv_extra: Mapping[str, Any] = field(default_factory=dict)

    def next_layer(self, layer: int) -> int | None:
        return self.next_of[layer]

    @cached_property
    def sequence(self) -> tuple[StageLayer, ...]:
        return tuple((L, s) for L in self.layers for s in self.stages)

    @cached_property
    def next_of(self) -> dict[int, int | None]:
        following = (*self.layers[1:], None)
        return dict(zip(self.layers, following, strict=True))

    @cached_property
    def recv_kw(self) -> dict[StageLayer, dict[str, Any]]:
        """The receive kwargs of each (layer, stage); read, never mutated."""
        return {(L, s): self.build_recv_kwargs(L, s) for L, s in self.sequence}

    def build_recv_kwargs(self, layer: int, stage: int) -> dict[str, Any]:
        """The receive kwargs of (layer, stage), built afresh (also off the plan)."""
        return {"ubatch_idx": stage, "layer_idx": layer, **self.recv_extra}

    @cached_property
    def keys(self) -> dict[StageLayer, OpKeys]:
        return {(L, s): OpKeys.of(L, s) for L, s in self.sequence}

    def event_keys(self) -> list[EventKey]:
        """Every event key a session of this plan may record, so a backend can
        make them before a graph capture."""
        out = [EventKey.fork(), EventKey.join(None), *(EventKey.join(s) for s in self.stages)]
        for k in self.keys.values():
            out += [k.a_done, k.f_done, k.e_done, k.e_done_c]
        return out


@dataclass(frozen=True)
class OpKeys:
    """The event keys and op labels of one (layer, stage)."""

    a_done: EventKey
    f_done: EventKey
    e_done: EventKey
    e_done_c: EventKey
    a2e_label: str
    e2a_label: str

    @classmethod
    def of(cls, layer: int, stage: int) -> OpKeys:
        return cls(
            EventKey(A_DONE, layer, stage),
            EventKey(F_DONE, layer, stage),
            EventKey(E_DONE, layer, stage),
            EventKey(E_DONE_ON_C, layer, stage),
            OpKey(A2E, layer, stage).label(),
            OpKey(E2A, layer, stage).label(),
        )


@functools.lru_cache(maxsize=256)
def _cached_plan(layers: tuple[int, ...], stages: tuple[int, ...], max_num_tokens: Hashable) -> StepPlan:
    return StepPlan(layers, stages, {"max_num_tokens": max_num_tokens})


def step_plan(layers: tuple[int, ...], stages: tuple[int, ...], max_num_tokens: Any) -> StepPlan:
    """The plan of a step shape, built once per shape (and ``max_num_tokens``)."""
    try:
        return _cached_plan(layers, stages, max_num_tokens)
    except TypeError:  # an unhashable max_num_tokens: not cached
        return StepPlan(layers, stages, {"max_num_tokens": max_num_tokens})


#: Where an op kind runs: the caller's stream (``C``; in a capture, the
#: capture's stream), or a side stream: the stage's (``K_s``, one per HCCL
#: group) for A2E and E2A, the runner's FFN stream (``F``) for the FFN.
CALLER = "caller"
SIDE = "side"


@dataclass(frozen=True)
class Layout:
    """Where each op kind of a step runs, and in which order its receives are
    issued: one per rollout rung, all run by the same code (an edge is issued
    only between two different streams). ``prefetch``: the overlap's order (the
    first layer's receive of every stage at the step's first receive, then each
    stage's next receive right after its send); without it each receive is
    issued when the loop asks (upstream's order), on the caller's stream."""

    name: str
    a2e: str
    e2a: str
    ffn: str = CALLER
    prefetch: bool = True
    #: Whether any op kind runs on a side stream (the step forks and joins).
    side: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "side", SIDE in (self.a2e, self.e2a, self.ffn))
        for kind in (self.a2e, self.e2a, self.ffn):
            if kind not in (CALLER, SIDE):
                raise ValueError(f"layout {self.name}: {kind!r} is not {CALLER!r} or {SIDE!r}")
        if self.ffn == SIDE and (self.a2e, self.e2a, self.prefetch) != (CALLER, CALLER, True):
            raise ValueError(
                f"layout {self.name}: with the FFN on its side stream, A2E and E2A stay on the caller's stream, "
                "in the overlap's order (prefetch)"
            )
        if self.a2e == SIDE and not self.prefetch:
            raise ValueError(f"layout {self.name}: a receive on a side stream is issued ahead (prefetch)")

    @property
    def a2e_side(self) -> bool:
        return self.a2e == SIDE

    @property
    def e2a_side(self) -> bool:
        return self.e2a == SIDE

    @property
    def ffn_side(self) -> bool:
        return self.ffn == SIDE

    @property
    def comm_on_side(self) -> bool:
        """Whether A2E or E2A runs on a side stream (K_s): a decode graph captures that only with the opt-in."""
        return SIDE in (self.a2e, self.e2a)


#: The rollout rungs' layouts (``layout_of``).
PARITY = Layout("parity", CALLER, CALLER, prefetch=False)
REORDER = Layout("reorder", CALLER, CALLER)
COMPUTE_SIDE = Layout("compute-side", CALLER, CALLER, SIDE)
E2A_ONLY = Layout("e2a-only", CALLER, SIDE, prefetch=False)
A2E_ONLY = Layout("a2e-only", SIDE, CALLER)
COMM_SIDE = Layout("comm-side", SIDE, SIDE)

#: The rungs (docs/design.md, "Rollout modes and the ladder") in the order a new deployment climbs them; decode
#: graphs come after them (docs/validation.md).
LADDER = ("parity", "reorder", "compute-side", "comm-side")


def layouts_of(cfg: OverlapConfig) -> tuple[Layout, ...]:
    """The layouts an engaged step may run under ``cfg``, in the order listed: one for ``parity`` and ``reorder``;
    under ``overlap`` those of ``VLLM_CAMP2P_MULTISTREAM_LAYOUT``, where the direction switches refine
    ``comm-side`` (none left when both are off)."""
    if cfg.mode == "parity":
        return (PARITY,)
    if cfg.mode == "reorder":
        return (REORDER,)
    comm_side = _SWITCHED[(cfg.a2e_on_side_stream, cfg.e2a_on_side_stream)]
    listed = (COMPUTE_SIDE if name == COMPUTE_SIDE.name else comm_side for name in cfg.layouts)
    return tuple(layout for layout in listed if layout is not None)


_SWITCHED = {(True, True): COMM_SIDE, (False, True): E2A_ONLY, (True, False): A2E_ONLY, (False, False): None}


def graph_needs_opt_in(cfg: OverlapConfig) -> bool:
    """Whether a decode graph of ``cfg``'s first listed layout would put A2E/E2A on side streams without
    VLLM_CAMP2P_MULTISTREAM_GRAPH_COMM_SIDE: its capture then records upstream's serial graph."""
    layouts = layouts_of(cfg)
    return bool(layouts) and layouts[0].comm_on_side and not cfg.graph_comm_side


def rung(cfg: OverlapConfig) -> str:
    """The ladder rung ``cfg`` sets: ``off``, ``parity``, ``reorder``, or under ``overlap`` the layouts listed
    (``compute-side``, ``comm-side``, comma-joined when several; ``e2a-only``/``a2e-only`` for ``comm-side`` with a
    direction switched off, off the ladder; ``none``: nothing left to engage, every step runs serially)."""
    if not cfg.enabled:
        return "off"
    if cfg.mode != "overlap":
        return cfg.mode
    return ",".join(layout.name for layout in layouts_of(cfg)) or "none"
