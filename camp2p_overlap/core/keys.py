"""The names a step's streams, events and ops carry, shared by the overlap
schedule, its traces, the stall report and the verifiers: one definition
each, so that nothing rebuilds a key or parses one back from its ``repr``.

A key becomes text with ``label()`` (trace details, stall reports, profiler
range names) and is read back with ``parse()``; nothing else writes or reads
that text."""

from __future__ import annotations

import re
from typing import Any, NamedTuple

#: The name of the compute stream (the runner's current stream) in the
#: schedule, its traces and stall reports.
COMPUTE_STREAM = "C"
#: The name of a runner's FFN side stream (``F``), where the ``compute-side``
#: layout runs the FFN compute.
FFN_STREAM = "F"

#: What each event kind orders (``docs/design.md``, "Edges of one step").
A_DONE = "a"  # A2E(L, s) done on its stream: the FFN's stream may compute (L, s)
F_DONE = "f"  # FFN(L, s) done on its stream: the E2A's stream may send E2A(L, s)
E_DONE = "e"  # E2A(L, s) done on K_s
E_DONE_ON_C = "ec"  # E2A(L, s) done on C (E2A kept on the compute stream)
FORK = "fork"  # recorded on C before the step's first side-stream work
JOIN = "join"  # the last work of a side stream (K_s; F: no stage), waited by C when the step closes

EVENT_KINDS = (A_DONE, F_DONE, E_DONE, E_DONE_ON_C, FORK, JOIN)

#: The connector ops a step issues: a receive (A2E) and a send (E2A).
A2E = "a2e"
E2A = "e2a"
CONNECTOR_OP_KINDS = (A2E, E2A)


def side_stream_name(stage: int) -> str:
    """The name of stage ``stage``'s side stream (``K_s``)."""
    return f"K{stage}"


class _Key(NamedTuple):
    """A key of a step: its kind and the (layer, stage) it belongs to."""

    kind: str
    layer: int | None = None
    stage: int | None = None

    def label(self) -> str:
        """A text form, read back by ``parse``: ``f L3 s1``, ``join s0``, ``fork``, ``a2e L3 s1``."""
        layer = "" if self.layer is None else f" L{self.layer}"
        return self.kind + layer + ("" if self.stage is None else f" s{self.stage}")

    @classmethod
    def parse(cls, text: str) -> Any:
        """The key whose :meth:`label` is ``text``, or None."""
        m = cls._LABEL.match(text)  # each subclass has its own
        if m is None:
            return None
        layer, stage = m.group(2), m.group(3)
        return cls(m.group(1), None if layer is None else int(layer), None if stage is None else int(stage))


def _label_pattern(kinds: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile(r"^(" + "|".join(kinds) + r")(?: L(-?\d+))?(?: s(-?\d+))?$")


class EventKey(_Key):
    """One event of a step: its kind (one of :data:`EVENT_KINDS`) and the
    (layer, stage) it belongs to; ``fork`` has neither, ``join`` a stage only."""

    __slots__ = ()
    _LABEL = _label_pattern(EVENT_KINDS)

    @classmethod
    def fork(cls) -> EventKey:
        return cls(FORK)

    @classmethod
    def join(cls, stage: int | None) -> EventKey:
        """The join of stage ``stage``'s side stream K_s, or (None) of the FFN stream F."""
        return cls(JOIN, None, stage)


class OpKey(_Key):
    """One connector op of a step: its kind (one of :data:`CONNECTOR_OP_KINDS`) and
    its (layer, stage), None where the loop's call named none."""

    __slots__ = ()
    _LABEL = _label_pattern(CONNECTOR_OP_KINDS)
