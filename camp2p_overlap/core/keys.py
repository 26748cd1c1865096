"""The names a step's streams and events carry, shared by the overlap
schedule, its traces, the stall report and the verifiers: one definition
each, so that nothing rebuilds a key or parses one back from its ``repr``."""

from __future__ import annotations

import re
from typing import NamedTuple

#: The name of the compute stream (the runner's current stream) in the
#: schedule, its traces and stall reports.
COMPUTE_STREAM = "C"

#: What each event kind orders (``docs/design.md``, "Edges").
A_DONE = "a"  # A2E(L, s) done on K_s: C may compute (L, s)
F_DONE = "f"  # FFN(L, s) done on C: K_s may send E2A(L, s)
E_DONE = "e"  # E2A(L, s) done on K_s
E_DONE_ON_C = "ec"  # E2A(L, s) done on C (E2A kept on the compute stream)
FORK = "fork"  # recorded on C before the step's first side-stream work
JOIN = "join"  # the last work of K_s, waited by C when the step closes

EVENT_KINDS = (A_DONE, F_DONE, E_DONE, E_DONE_ON_C, FORK, JOIN)


def side_stream_name(stage: int) -> str:
    """The name of stage ``stage``'s side stream (``K_s``)."""
    return f"K{stage}"


class EventKey(NamedTuple):
    """One event of a step: its kind (one of :data:`EVENT_KINDS`) and the
    (layer, stage) it belongs to; ``fork`` has neither, ``join`` a stage only."""

    kind: str
    layer: int | None = None
    stage: int | None = None

    @classmethod
    def fork(cls) -> EventKey:
        return cls(FORK)

    @classmethod
    def join(cls, stage: int) -> EventKey:
        return cls(JOIN, None, stage)

    def label(self) -> str:
        """A text form, read back by :meth:`parse`: ``f L3 s1``, ``join s0``, ``fork``."""
        parts = [self.kind]
        if self.layer is not None:
            parts.append(f"L{self.layer}")
        if self.stage is not None:
            parts.append(f"s{self.stage}")
        return " ".join(parts)

    @classmethod
    def parse(cls, text: str) -> EventKey | None:
        """The key whose :meth:`label` is ``text``, or None."""
        m = _LABEL.match(text)
        if m is None:
            return None
        layer, stage = m.group(2), m.group(3)
        return cls(m.group(1), None if layer is None else int(layer), None if stage is None else int(stage))


_LABEL = re.compile(r"^(" + "|".join(EVENT_KINDS) + r")(?: L(-?\d+))?(?: s(-?\d+))?$")
