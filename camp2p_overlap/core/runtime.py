"""What the wrappers of one patch engine share at run time: the side
streams of each runner, the session active on each thread, and the session
class (tests substitute a recording subclass). The engine closes it on
unpatch through its on-unpatch hook."""

from __future__ import annotations

import threading

from camp2p_overlap.core.config import MAX_STAGES
from camp2p_overlap.core.session import OverlapSession
from camp2p_overlap.core.streams.streamset import StreamSetRegistry


class OverlapRuntime:
    def __init__(self) -> None:
        self.streamsets = StreamSetRegistry(range(MAX_STAGES))
        self.session_class: type[OverlapSession] = OverlapSession
        self._local = threading.local()

    def active_session(self) -> OverlapSession | None:
        """The session of the step running on this thread, if any."""
        return getattr(self._local, "session", None)

    def set_session(self, session: OverlapSession | None) -> None:
        self._local.session = session

    def close(self) -> None:
        """Release every runner's side streams (CPU worker threads)."""
        self.streamsets.close_all()
