"""Sessions that break one of graph capture's rules on purpose (test-only):
each is what a layer bug would look like inside a capture, for the tests
that check the emulated device catches it."""

from __future__ import annotations

from typing import Any

from camp2p_overlap.core.keys import JOIN, EventKey
from camp2p_overlap.core.overlap.session import StepSession


class SyncsInCapture(StepSession):
    def join(self) -> None:
        super().join()
        self.backend.synchronize(self.compute)  # illegal while capturing


class QueriesInCapture(StepSession):
    def join(self) -> None:
        super().join()
        for ev in list(self._events.values()):
            ev.query()  # illegal while capturing


class ForgetsToJoin(StepSession):
    """Records each side stream's join event but never makes the caller's stream wait it (the caller's stream is
    current again, as after a join): in every layout a side stream ends with work the capture's stream does not
    depend on."""

    def wait_event(self, stream: Any, key: EventKey) -> None:
        if key.kind != JOIN:  # the join's record stays, its wait goes
            super().wait_event(stream, key)


class ReadsOnTheHost(StepSession):
    def recv(self, fn: Any, kw: Any, call: Any = None) -> Any:
        payload = super().recv(fn, kw, call)
        payload.hidden_states[0, 0].item()  # reads a captured kernel's output
        return payload
