"""The stall report: where the host and each stream of the device are in an engaged step that has not finished,
from a snapshot of its session (never a sync: event queries, through the capture guard, and handle states only),
replaying the order the session issued the step's records, waits and ops in. The step watchdog (``watchdog.py``)
logs it once at its deadline. It sits in the overlap room: it reads the session's snapshot types, which the
observe room may not import (the rooms contract in ``pyproject.toml``).
"""

from __future__ import annotations

import functools
import threading
import time
from collections import defaultdict
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from camp2p_overlap.core.keys import A2E, A_DONE, COMPUTE_STREAM, E2A, E_DONE, E_DONE_ON_C, F_DONE, FORK, JOIN, EventKey
from camp2p_overlap.core.overlap.camp2p import group_of
from camp2p_overlap.core.overlap.plan import StageLayer
from camp2p_overlap.core.overlap.session import IssuedOp, RunningOp, SessionSnapshot
from camp2p_overlap.core.overlap.streams.backend import GUARD
from camp2p_overlap.core.overlap.streams.base import StreamPoisonedError

#: Events listed in full up to this many; past it only the pending ones.
_FULL_EVENT_LIST = 32
#: Seconds the report waits for the FFN peers' heartbeats (store reads) before it goes on without them.
PEERS_READ_S = 2.0


class PeerGroup(Protocol):
    """What the report reads of this rank's FFN rank group (``overlap.rank_group.RankGroup``)."""

    @property
    def size(self) -> int: ...
    @property
    def rank(self) -> int: ...
    @property
    def members(self) -> Sequence[int]: ...
    @property
    def source(self) -> str: ...
    @property
    def broken(self) -> str | None: ...

    def peers(self) -> list[dict[str, Any]]: ...


@dataclass(frozen=True, slots=True)
class _Item:
    """One thing a stream was given, in its FIFO order: ``record`` or ``wait`` of an event, an ``op`` (a connector
    op), or the ``ffn`` of a (layer, stage) (the model's kernels on the FFN's stream: C, or F in ``compute-side``)."""

    kind: str
    key: EventKey | None = None
    op: IssuedOp | None = None
    at: StageLayer | None = None


def _programs(snap: SessionSnapshot) -> dict[str, list[_Item]]:
    """Each stream's items, in the order the session issued them: its log of records, waits and ops, and each FFN
    the loop began, on the FFN's stream (the layout's, whatever it is)."""
    items: list[tuple[int, str, _Item]] = [(seq, stream, _Item(kind, key=key)) for kind, key, stream, seq in snap.marks]
    items += [(o.seq, o.stream, _Item("op", op=o)) for o in snap.ops]
    items += [
        (seq, snap.ffn_streams.get(s, COMPUTE_STREAM), _Item("ffn", at=(L, s)))
        for L, s, seq in snap.ffns
        if (L, s) in snap.sent or not snap.closed  # closed in an FFN: its stream only has the join left
    ]
    prog: dict[str, list[_Item]] = defaultdict(list)
    for _, stream, item in sorted(items, key=lambda entry: entry[0]):
        prog[stream].append(item)
    return prog


def _event_after(o: IssuedOp, events: Container[EventKey]) -> EventKey | None:
    """The event the session recorded right after op ``o`` on its stream (None: none, as after an A2E on the FFN's
    own stream, which no other stream waits)."""
    if o.layer is None or o.stage is None:
        return None
    kinds = (A_DONE,) if o.kind == A2E else (E_DONE, E_DONE_ON_C) if o.kind == E2A else ()
    for kind in kinds:
        key = EventKey(kind, o.layer, o.stage)
        if key in events:
            return key
    return None


class _States:
    """Event and op states of one snapshot, each read at most once per report (a device query is not free)."""

    def __init__(self, snap: SessionSnapshot, now: int) -> None:
        self.events = dict(snap.events)
        self.now = now
        self._op_states: dict[int, tuple[bool, str]] = {}
        #: Per event: True: completed; False: pending; None: not recorded this step; a string: unknown (why).
        self.event = functools.cache(self._query)

    def _query(self, key: EventKey) -> bool | str | None:
        ev = self.events.get(key)
        if ev is None:
            return None
        try:
            done = GUARD.read(ev.query)
        except Exception as exc:  # noqa: BLE001 - diagnostics only
            return f"query failed: {exc}"
        return "not read: a graph capture is in progress" if done is None else bool(done)

    def op(self, o: IssuedOp) -> tuple[bool, str]:
        """Whether ``o`` has finished, and its state in words."""
        state = self._op_states.get(id(o))
        if state is None:
            state = self._op_states[id(o)] = self._op_state(o)
        return state

    def _op_state(self, o: IssuedOp) -> tuple[bool, str]:
        h = o.handle
        if isinstance(h, RunningOp):
            return False, f"being issued by the host for {self._since(h.start_ns)}"
        if not h.done():
            if h.start_ns is None:
                return False, "queued"
            return False, f"RUNNING for {self._since(h.start_ns)}"
        exception = getattr(h, "exception", None)
        exc = exception() if callable(exception) else None
        if isinstance(exc, StreamPoisonedError):
            return True, "skipped (an earlier op of its stream failed)"
        if exc is not None:
            return True, f"FAILED ({type(exc).__name__}: {_short(exc)})"
        # Device backends return at once; the event after the op tells.
        after = _event_after(o, self.events)
        if after is not None and self.event(after) is False:
            return False, "enqueued, not complete on the device"
        return True, "done"

    def item_done(self, item: _Item) -> bool:
        if item.kind == "op":
            assert item.op is not None
            return self.op(item.op)[0]
        if item.kind == "ffn":
            assert item.at is not None
            return self.event(EventKey(F_DONE, *item.at)) is True
        assert item.key is not None
        return self.event(item.key) is True

    def _since(self, start_ns: int) -> str:
        return f"{(self.now - start_ns) / 1e9:.2f} s"


def _short(exc: BaseException, limit: int = 120) -> str:
    text = str(exc)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(key: EventKey, snap: SessionSnapshot) -> str:
    """What completes event ``key``: the op or FFN it is recorded after."""
    L, s = key.layer, key.stage
    k = snap.side_streams.get(s, "?")
    if key.kind == A_DONE:
        return f"a2e(L{L},s{s}) on {snap.a2e_streams.get(s, k)}"
    if key.kind == F_DONE:
        return f"the FFN of (L{L},s{s}) on {snap.ffn_streams.get(s, COMPUTE_STREAM)}"
    if key.kind == E_DONE:
        return f"e2a(L{L},s{s}) on {k}"
    if key.kind == E_DONE_ON_C:
        return f"e2a(L{L},s{s}) on {COMPUTE_STREAM}"
    if key.kind == JOIN:
        return f"the last work of the FFN stream {k}" if s is None else f"the last op of stage {s} on {k}"
    if key.kind == FORK:
        return f"the start of the step on {COMPUTE_STREAM}"
    return key.label()


def _op_name(o: IssuedOp) -> str:
    return f"{o.kind}(L{o.layer},s{o.stage})"


def _event_text(st: _States, key: EventKey) -> str:
    state = st.event(key)
    return f"event {key.label()} " + ("pending" if state is False else str(state))


def _head(items: list[_Item], st: _States) -> _Item | None:
    """The first item of a stream not complete (what the stream is at). A stream runs in order: an FFN (which no
    event follows in every layout) is complete once an op after it on its stream runs or has finished."""
    reached = max((i for i, item in enumerate(items) if item.op is not None and _started(item.op, st)), default=-1)
    for i, item in enumerate(items):
        if item.op is not None and isinstance(item.op.handle, RunningOp):
            return None  # the host has not enqueued it yet: the stream ran all before it
        if not st.item_done(item) and not (item.kind == "ffn" and i < reached):
            return item
    return None


def _started(o: IssuedOp, st: _States) -> bool:
    finished, state = st.op(o)
    return finished or state.startswith("RUNNING")


def _host_line(snap: SessionSnapshot, st: _States) -> str:
    if snap.closed:
        return "  host: has issued the whole step and closed it; the streams below are where the device is"
    issuing = [o for o in snap.ops if isinstance(o.handle, RunningOp)]
    order = snap.plan.sequence
    if issuing:
        o = issuing[-1]
        return f"  host: issuing {_op_name(o)} on {o.stream} ({st.op(o)[1]})"
    if snap.received == 0:
        return "  host: has not made the step's first receive yet"
    L, s = order[snap.received - 1]
    if (L, s) not in snap.sent:
        return f"  host: in the FFN of (L{L},s{s}) (the model's host part); its send is not issued yet"
    if snap.received == len(order):
        return f"  host: between the send of (L{L},s{s}) and the step's close"
    nL, ns = order[snap.received]
    return f"  host: between the send of (L{L},s{s}) and the receive of (L{nL},s{ns})"


def _stream_text(stream: str, head: _Item | None, snap: SessionSnapshot, st: _States, compute: bool = False) -> str:
    """Where ``stream`` is: at ``head``, its first item not complete (None: it ran all). The ``compute`` stream's
    words say what holds the step up."""
    if head is None:
        ran = ("the whole step" if snap.closed else "everything issued so far") if compute else "everything issued"
        return f"{stream} has run {ran}"
    if head.kind == "wait":
        assert head.key is not None
        waits = "is waiting on the device for" if compute else "waits for"
        return f"{stream} {waits} {_describe(head.key, snap)} ({_event_text(st, head.key)})"
    if head.kind == "op":
        assert head.op is not None
        at = ("is blocked in {}, issued on the compute stream" if compute else "is at {}").format(_op_name(head.op))
        return f"{stream} {at} ({st.op(head.op)[1]})"
    if head.kind == "ffn":
        assert head.at is not None
        L, s = head.at
        if head.at not in snap.sent:
            return f"{stream} is at the FFN of (L{L},s{s}), whose send the host has not issued yet"
        return f"{stream} {'is running' if compute else 'is at'} the FFN of (L{L},s{s})"
    assert head.key is not None
    return f"{stream} has not reached its record of event {head.key.label()} yet"


def stall_report(snap: SessionSnapshot, group: PeerGroup | None = None) -> str:
    """Where the host and the compute stream are, and the FFN stream where the layout has one (``compute-side``'s
    F, on its ``FFN stream:`` line); per stage, where its stream is and every op issued with its state; the likely
    missing peer ops; with ``group`` (this rank's FFN rank group, of more than one rank) this rank's place in it,
    each peer's last heartbeat and the peers that stopped answering (:func:`peer_lines`); then the events (only the
    pending ones when many) and the unfinished ops."""
    now = time.perf_counter_ns()
    st = _States(snap, now)
    order = snap.plan.sequence
    programs = _programs(snap)
    heads = {stream: _head(items, st) for stream, items in programs.items()}
    lines = [
        f"step {snap.step_id}: {snap.received}/{len(order)} receives handed to the loop",
        f"  open for {(now - snap.opened_ns) / 1e9:.2f} s; plan: layers {list(snap.plan.layers)}, "
        f"stages {list(snap.plan.stages)}",
        _host_line(snap, st),
        f"  compute stream {_stream_text(COMPUTE_STREAM, heads.get(COMPUTE_STREAM), snap, st, compute=True)}",
    ]
    ffn_stream = snap.side_streams.get(None)
    if ffn_stream is not None:
        lines.append(f"  FFN stream: {_stream_text(ffn_stream, heads.get(ffn_stream), snap, st)}")
    culprits: list[str] = []
    for s in snap.plan.stages:
        lines += _stage_lines(snap, st, s, heads, culprits)
    if culprits:
        lines.extend(culprits)
    elif all(st.op(o)[0] for o in snap.ops):
        lines.append("  every issued op has finished")
    else:
        lines.append("  no connector op is running: the unfinished ones are queued behind other work of the device")
    if group is not None and group.size > 1:
        lines += peer_lines(group, _blocked_in(snap, st, heads))
    lines += _core_lines(snap)
    events = list(snap.events)
    shown = events if len(events) <= _FULL_EVENT_LIST else [(k, e) for k, e in events if st.event(k) is not True]
    if len(shown) < len(events):
        lines.append(f"  events: {len(events) - len(shown)} done, listing the other {len(shown)}")
    for key, _ev in shown:
        done = st.event(key)
        lines.append(f"  event {key.label()}: {'done' if done is True else done or 'pending'}")
    pending = [f"{_op_name(o)} on {o.stream}" for o in snap.ops if not st.op(o)[0]]
    lines.append("  ops not finished: " + (", ".join(pending) or "none"))
    return "\n".join(lines)


def _core_lines(snap: SessionSnapshot) -> list[str]:
    """The device's vector cores: which kernels hold them and which wait (only where the device can say)."""
    if snap.core_state is None:
        return []
    try:
        return [f"  {line}" for line in snap.core_state()]
    except Exception as exc:  # noqa: BLE001 - diagnostics must not raise
        return [f"  vector cores: could not be read ({type(exc).__name__}: {exc})"]


def _blocked_in(snap: SessionSnapshot, st: _States, heads: dict[str, _Item | None]) -> str:
    """The op this rank is blocked in: the first unfinished op its stream is at, else the first unfinished one."""
    pending = [o for o in snap.ops if not st.op(o)[0]]
    at_head = [o for o in pending if (h := heads.get(o.stream)) is not None and h.op is o]
    o = (at_head or pending or [None])[0]
    if o is None:
        return "no connector op (every issued op has finished)"
    return f"{_op_name(o)} on {o.stream} ({st.op(o)[1]})"


def read_peers(group: PeerGroup, timeout_s: float = PEERS_READ_S) -> list[dict[str, Any]] | str:
    """``group.peers()``, read on a daemon thread waited for at most ``timeout_s`` (a store that does not answer
    never holds the report up); the peers, or why they could not be read. Never raises."""
    box: dict[str, Any] = {}

    def read() -> None:
        try:
            box["peers"] = group.peers()
        except Exception as exc:  # noqa: BLE001 - diagnostics only
            box["error"] = f"not read ({type(exc).__name__}: {_short(exc)})"

    try:
        reader = threading.Thread(target=read, name="camp2p-overlap-peers", daemon=True)
        reader.start()
        reader.join(timeout_s)
    except Exception as exc:  # noqa: BLE001 - no thread: no peers
        return f"not read ({type(exc).__name__}: {_short(exc)})"
    if "peers" in box:
        return box["peers"]
    return box.get("error", f"not read: the store did not answer within {timeout_s:g} s")


def peer_lines(group: PeerGroup, blocked: str, timeout_s: float = PEERS_READ_S) -> list[str]:
    """This rank's place in its FFN rank group and the op it is blocked in; each peer rank's last heartbeat (its
    step count and age) and whether it stopped answering; then the peers that stopped answering."""
    try:
        me = f"FFN rank {group.rank} of {group.size} (global rank {group.members[group.rank]}; {group.source})"
        broken = f"; the group is broken: {group.broken}" if group.broken else ""
    except Exception as exc:  # noqa: BLE001 - diagnostics only
        me, broken = f"an FFN rank of a group that cannot be described ({type(exc).__name__})", ""
    lines = [f"  FFN rank group: this is {me}{broken}; this rank is blocked in {blocked}"]
    peers = read_peers(group, timeout_s)
    if isinstance(peers, str):
        return [*lines, f"    peers' heartbeats: {peers}"]
    stopped = []
    for p in peers:
        try:
            who = f"peer FFN rank {p['rank']} (global rank {p['member']})"
            if p["steps"] is None:
                beat = "no heartbeat"
            else:
                beat = f"last heartbeat {float(p['age_s']):.2f} s ago, at {p['steps']} step(s)"
            if p["stopped"]:
                stopped.append(str(p["rank"]))
                beat += ": stopped answering"
        except Exception as exc:  # noqa: BLE001 - a heartbeat of another shape: shown as it is
            who, beat = "peer", f"unreadable heartbeat {p!r} ({type(exc).__name__})"
        lines.append(f"    {who}: {beat}")
    lines.append(
        "  FFN peers that stopped answering: "
        + (f"rank(s) {', '.join(stopped)}" if stopped else "none (every peer's heartbeat is recent)")
    )
    return lines


def _stage_lines(
    snap: SessionSnapshot, st: _States, s: int, heads: dict[str, _Item | None], culprits: list[str]
) -> list[str]:
    group = group_of(s)
    mine = [o for o in snap.ops if o.stage == s]
    stream = snap.side_streams.get(s, COMPUTE_STREAM)
    head = f"; {_stream_text(stream, heads.get(stream), snap, st)}" if stream != COMPUTE_STREAM else ""
    lines = [f"  stage {s} (stream {stream}, group {group}): {len(mine)} op(s) issued{head}"]
    states = [st.op(o) for o in mine]
    open_idx = [i for i, (finished, _) in enumerate(states) if not finished]
    # Keep long steps readable: done ops before the two preceding the first unfinished one are counted, not listed.
    cut = max((open_idx[0] if open_idx else len(mine)) - 2, 0)
    if cut:
        lines.append(f"    ... {cut} earlier op(s) done")
    for o, (_, text) in list(zip(mine, states, strict=True))[cut:]:
        lines.append(f"    {_op_name(o)} on {o.stream}: {text}")
    if open_idx:
        o, text = mine[open_idx[0]], states[open_idx[0]][1]
        at = heads.get(o.stream)
        # Blamed only when its stream is at it and it is running there: an op queued behind a wait, or behind its
        # stream's earlier work, waits for the device, not for the attention peer.
        if at is not None and at.op is o and not text.startswith(("queued", "being issued")):
            role = "answered (no data)" if o.kind == A2E else "acknowledged"
            culprits.append(
                f"  likely missing peer op: {_op_name(o)} on {o.stream} ({text}): "
                f"the attention peer of stage {s} (group {group}) has not {role}"
            )
    return lines
