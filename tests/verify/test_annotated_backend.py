"""The annotating backend: every op, record and wait inside its named
profiler range (a wait named by the key its event was recorded under), the
rest of the backend its own, and the stream set's own backend back after."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from camp2p_overlap.core.keys import A_DONE, COMPUTE_STREAM, EventKey, OpKey
from camp2p_overlap.core.overlap.streams import make_backend
from camp2p_overlap.core.overlap.streams.streamset import StreamSet
from camp2p_overlap.verify import annotated_backend
from camp2p_overlap.verify.annotated_backend import AnnotatedBackend, annotating, parse_event_range


def test_ops_records_and_waits_are_issued_inside_their_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[str] = []

    @contextlib.contextmanager
    def fake_range(name: str) -> Iterator[None]:
        opened.append(name)
        yield

    monkeypatch.setattr(annotated_backend, "profiler_range", fake_range)
    inner = make_backend("cpu")
    sset = StreamSet(inner, [0])
    try:
        with annotating(sset) as wrapped:
            assert sset.backend is wrapped and isinstance(wrapped, AnnotatedBackend)
            k0, c = sset.streams[0], wrapped.compute_stream()  # the inner backend's own method
            key = EventKey(A_DONE, 1, 0)
            wrapped.submit(k0, lambda: None, OpKey("a2e", 1, 0).label()).result()
            event = wrapped.record(k0, key)
            wrapped.wait(c, event)
            inner.synchronize(c)
        assert sset.backend is inner
    finally:
        sset.close()
    assert opened[0] == "camp2p:a2e L1 s0"
    assert parse_event_range(opened[1]) == ("record", "K0", key)
    assert parse_event_range(opened[2]) == ("wait", COMPUTE_STREAM, key)
    assert len(opened) == 3
