"""The names of streams, events and ops (core/keys.py): each key's text form
is read back as the same key, and nothing else is taken for one."""

from __future__ import annotations

import pytest

from camp2p_overlap.core.keys import (
    A_DONE,
    COMPUTE_STREAM,
    CONNECTOR_OP_KINDS,
    EVENT_KINDS,
    FFN_STREAM,
    FORK,
    JOIN,
    EventKey,
    OpKey,
    side_stream_name,
)
from camp2p_overlap.verify.annotated_backend import event_range_name, op_range_name, parse_event_range

PER_LAYER_STAGE = [k for k in EVENT_KINDS if k not in (FORK, JOIN)]


@pytest.mark.parametrize("kind", PER_LAYER_STAGE)
def test_event_labels_read_back_as_their_key(kind: str) -> None:
    key = EventKey(kind, 12, 2)
    assert key.label() == f"{kind} L12 s2"
    assert EventKey.parse(key.label()) == key


def test_fork_and_join_carry_what_they_name() -> None:
    assert EventKey.fork() == EventKey(FORK, None, None) and EventKey.fork().label() == "fork"
    assert EventKey.join(1) == EventKey(JOIN, None, 1) and EventKey.join(1).label() == "join s1"
    assert EventKey.parse("fork") == EventKey.fork()
    assert EventKey.parse("join s1") == EventKey.join(1)
    # the FFN stream F's join: no stage
    assert EventKey.join(None) == EventKey(JOIN, None, None) and EventKey.join(None).label() == "join"
    assert EventKey.parse("join") == EventKey.join(None) != EventKey.join(0)


@pytest.mark.parametrize("kind", CONNECTOR_OP_KINDS)
def test_op_labels_read_back_as_their_key(kind: str) -> None:
    key = OpKey(kind, 3, 0)
    assert key.label() == f"{kind} L3 s0"
    assert OpKey.parse(key.label()) == key
    assert OpKey(kind).label() == kind and OpKey.parse(kind) == OpKey(kind)  # a call that named none


@pytest.mark.parametrize(
    "text",
    [
        "('f', 0, 1)",  # a tuple's repr is no label
        "EventKey(kind='f', layer=0, stage=1)",
        "a2e L0 s1",  # an op, not an event
        "x L0 s1",
        "f L0 s1 ",
        "f s1 L0",
        "",
    ],
)
def test_text_that_is_no_event_label_is_refused(text: str) -> None:
    assert EventKey.parse(text) is None


@pytest.mark.parametrize("text", ["f L0 s1", "ffn L0 s1", "a2e L0 s1 extra", "A2E L0 s1"])
def test_text_that_is_no_op_label_is_refused(text: str) -> None:
    assert OpKey.parse(text) is None


def test_stream_names() -> None:
    assert COMPUTE_STREAM == "C"
    assert FFN_STREAM == "F"
    assert [side_stream_name(s) for s in (0, 1, 2)] == ["K0", "K1", "K2"]
    assert not {COMPUTE_STREAM, FFN_STREAM} & {side_stream_name(s) for s in range(8)}


def test_profiler_range_names_read_back_as_their_keys() -> None:
    key = EventKey("f", 4, 1)
    name = event_range_name("record", COMPUTE_STREAM, key)
    assert name == "camp2p:record C f L4 s1"
    assert parse_event_range(name) == ("record", "C", key)
    assert parse_event_range(name.removeprefix("camp2p:")) == ("record", "C", key)  # as a timeline holds it
    assert parse_event_range(event_range_name("wait", "K1", EventKey.join(1))) == ("wait", "K1", EventKey.join(1))
    assert event_range_name("record", FFN_STREAM, EventKey.join(None)) == "camp2p:record F join"
    assert parse_event_range("camp2p:wait C join") == ("wait", "C", EventKey.join(None))
    assert parse_event_range(event_range_name("wait", FFN_STREAM, EventKey(A_DONE, 0, 1))) == (
        "wait",
        "F",
        EventKey(A_DONE, 0, 1),
    )
    assert event_range_name("wait", "K0", None) == "camp2p:wait K0 ?"  # an event recorded elsewhere
    assert parse_event_range("camp2p:wait K0 ?") is None
    assert parse_event_range("camp2p:record C ('f', 4, 1)") is None
    assert parse_event_range("camp2p:launch C f L4 s1") is None
    assert op_range_name(OpKey("e2a", 4, 1).label()) == "camp2p:e2a L4 s1"
