"""The plan of one FFN step: the (layer, stage) order the upstream loop
runs (``for L in layers: for s in stages``), each layer's next, the receive
kwargs of each (layer, stage), its event keys and op labels, and which
directions run on the side streams. Derived once per step shape and cached;
the session reads it, never builds it."""

from __future__ import annotations

import functools
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from camp2p_overlap.core.keys import A2E, A_DONE, E2A, E_DONE, E_DONE_ON_C, F_DONE, EventKey, OpKey

StageLayer = tuple[int, int]


@dataclass(frozen=True)
class StepPlan:
    """The step as the loop will run it: ``for L in layers: for s in stages``.

    What a session reads per (layer, stage) (the order, each layer's next,
    the receive kwargs, event keys and op labels) is derived once per plan,
    and plans are cached per step shape (:func:`step_plan`), so an engaged
    step builds none of it."""

    layers: tuple[int, ...]
    stages: tuple[int, ...]
    #: Extra receive kwargs of every call besides ``ubatch_idx``/``layer_idx``
    #: (upstream: ``max_num_tokens``).
    recv_extra: Mapping[str, Any] = field(default_factory=dict)

    def order(self) -> list[StageLayer]:
        return list(self.sequence)

    def next_layer(self, layer: int) -> int | None:
        return self.next_of[layer]

    def recv_kwargs(self, layer: int, stage: int) -> dict[str, Any]:
        return dict(self.recv_kw[(layer, stage)])

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
        """Every event key a session of this plan may record (fork, joins,
        and each (layer, stage)'s), so a backend can make them before a
        graph capture."""
        out = [EventKey.fork(), *(EventKey.join(s) for s in self.stages)]
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


@dataclass(frozen=True)
class Directions:
    a2e_side: bool = True
    e2a_side: bool = True


#: Both directions on the side streams: the overlap's default.
BOTH_SIDES = Directions()
