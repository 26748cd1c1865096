"""Side streams per runner: a :class:`StreamSet` (one side stream per stage
id on one backend) is created once, outside any graph capture, and reused
for every step of its runner; a :class:`StreamSetRegistry` owns the sets of
one patch engine and closes them on unpatch, when their runner dies, or (in
a forked child) forgets them."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from camp2p_overlap.core.keys import side_stream_name
from camp2p_overlap.core.overlap.streams import make_backend
from camp2p_overlap.core.overlap.streams.base import Stream, StreamBackend


class StreamSet:
    """A backend and one side stream per stage id."""

    def __init__(self, backend: StreamBackend, stage_ids: Sequence[int]) -> None:
        self.backend = backend
        self.streams: dict[int, Stream] = {s: backend.new_stream(side_stream_name(s)) for s in stage_ids}
        #: One step at a time per runner.
        self.lock = threading.Lock()

    def close(self) -> None:
        self.backend.close()


class StreamSetRegistry:
    """The stream sets of one engine's runners, keyed by runner identity."""

    def __init__(self, stage_ids: Sequence[int], make: Callable[[str, Any], StreamBackend] | None = None) -> None:
        self._stage_ids = tuple(stage_ids)
        #: Builds a backend from its name and the runner's device (None: this
        #: module's ``make_backend``, looked up when a set is made).
        self._make = make
        self._lock = threading.Lock()
        self._sets: dict[int, tuple[str, StreamSet]] = {}
        #: The runner finalizer of each entry: detached when the set is closed
        #: otherwise, so a closed set is not kept alive until its runner dies.
        self._finalizers: dict[int, weakref.finalize] = {}
        if hasattr(os, "register_at_fork"):
            ref = weakref.WeakMethod(self._forget_in_child)
            os.register_at_fork(after_in_child=lambda: (m := ref()) is not None and m())

    def get(self, runner: Any, backend_name: str) -> StreamSet | None:
        """The runner's set on ``backend_name``, created on first use. None
        when it would have to be created inside a graph capture (Ascend
        graphs have a small stream budget). Raises ``BackendUnavailable``."""
        key = id(runner)
        with self._lock:
            entry = self._sets.get(key)
            if entry is not None and entry[0] == backend_name:
                return entry[1]
            make = self._make if self._make is not None else make_backend
            backend = make(backend_name, getattr(runner, "device", None))
            if backend.is_capturing():
                return None
            if entry is not None:
                entry[1].close()
                old = self._finalizers.pop(key, None)
                if old is not None:
                    old.detach()
            sset = StreamSet(backend, self._stage_ids)
            self._sets[key] = (backend_name, sset)
            self._finalizers[key] = weakref.finalize(runner, self._drop, key, sset)
        return sset

    def peek(self, runner: Any) -> StreamSet | None:
        """The runner's set if one exists (never creates one)."""
        with self._lock:
            entry = self._sets.get(id(runner))
        return entry[1] if entry is not None else None

    def sets(self) -> list[StreamSet]:
        with self._lock:
            return [s for _, s in self._sets.values()]

    def __len__(self) -> int:
        with self._lock:
            return len(self._sets)

    def close_all(self) -> None:
        """Release every set (CPU worker threads): on unpatch."""
        with self._lock:
            sets = [s for _, s in self._sets.values()]
            self._sets.clear()
            finalizers = list(self._finalizers.values())
            self._finalizers.clear()
        for f in finalizers:
            f.detach()
        for s in sets:
            s.close()

    def _drop(self, key: int, sset: StreamSet) -> None:
        with self._lock:
            entry = self._sets.get(key)
            if entry is not None and entry[1] is sset:
                del self._sets[key]
                self._finalizers.pop(key, None)
        sset.close()

    def _forget_in_child(self) -> None:
        """After fork the parent's CPU stream threads do not exist in the
        child: forget the sets without joining threads that are not there."""
        self._lock = threading.Lock()
        self._sets.clear()
        for f in self._finalizers.values():
            f.detach()
        self._finalizers.clear()
