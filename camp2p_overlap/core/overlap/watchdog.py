"""The step watchdog: when an engaged step runs longer than
``VLLM_CAMP2P_MULTISTREAM_WATCHDOG_S``, log a stall report built from a
snapshot of the session (never a sync: event queries and handle states
only), naming the peer op that most likely never came."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from camp2p_overlap.core.keys import A2E, A_DONE, COMPUTE_STREAM, E2A, E_DONE, E_DONE_ON_C, EventKey
from camp2p_overlap.core.log import logger
from camp2p_overlap.core.overlap.camp2p import group_of
from camp2p_overlap.core.overlap.session import IssuedOp, SessionSnapshot

#: Events listed in full up to this many; past it only the pending ones.
_FULL_EVENT_LIST = 32


def start_watchdog(
    seconds: float | None, snapshot: Callable[[], SessionSnapshot], step_id: int
) -> threading.Timer | None:
    """A daemon timer that logs :func:`stall_report` of ``snapshot()`` after
    ``seconds``; None when no watchdog is configured. Cancel it at step end."""
    if not seconds:
        return None

    def report() -> None:
        try:
            text = stall_report(snapshot())
        except Exception as exc:  # noqa: BLE001 - diagnostics must not raise
            text = f"stall report failed: {exc!r}"
        logger.warning(
            "camp2p-overlap: FFN step %d has not finished after %.1f s; a peer op may be missing.\n%s",
            step_id,
            seconds,
            text,
        )

    timer = threading.Timer(seconds, report)
    timer.daemon = True
    timer.name = "camp2p-overlap-watchdog"
    timer.start()
    return timer


def _event_after(o: IssuedOp) -> EventKey | None:
    """The event the session records right after op ``o`` on its stream
    (None: none, as after an A2E on the compute stream)."""
    if o.kind == A2E and o.stream != COMPUTE_STREAM:
        return EventKey(A_DONE, o.layer, o.stage)
    if o.kind == E2A:
        return EventKey(E_DONE if o.stream != COMPUTE_STREAM else E_DONE_ON_C, o.layer, o.stage)
    return None


class _States:
    """Event and op states of one snapshot, each read once: an event is
    queried at most once per report (a device query is not free)."""

    def __init__(self, snap: SessionSnapshot, now: int) -> None:
        self.events = dict(snap.events)
        self.now = now
        self._event_states: dict[EventKey, bool | str | None] = {}
        self._op_states: dict[int, tuple[bool, str]] = {}

    def event(self, key: EventKey) -> bool | str | None:
        if key not in self._event_states:
            self._event_states[key] = self._query(key)
        return self._event_states[key]

    def _query(self, key: EventKey) -> bool | str | None:
        ev = self.events.get(key)
        if ev is None:
            return None
        try:
            return bool(ev.query())
        except Exception as exc:  # noqa: BLE001 - diagnostics only
            return f"query failed: {exc}"

    def op(self, o: IssuedOp) -> tuple[bool, str]:
        """Whether ``o`` has finished, and its state in words."""
        state = self._op_states.get(id(o))
        if state is None:
            state = self._op_states[id(o)] = self._op_state(o)
        return state

    def _op_state(self, o: IssuedOp) -> tuple[bool, str]:
        h = o.handle
        if not h.done():
            if h.start_ns is None:
                return False, "queued"
            return False, f"RUNNING for {(self.now - h.start_ns) / 1e9:.2f} s"
        # Device backends return at once; the event after the op tells.
        after = _event_after(o)
        if after is not None and self.event(after) is False:
            return False, "enqueued, not complete on the device"
        return True, "done"


def stall_report(snap: SessionSnapshot) -> str:
    """Which ops were issued and which recorded events have completed.

    Layout: the header; what the compute stream C is blocked on; per stage
    (stream, HCCL group) every op issued in order with its state (done /
    running for N s / queued / enqueued on the device, not complete); the
    first unfinished op of each stage named as the likely missing peer op;
    then the events (all of them when few, else only the pending ones) and
    the unfinished ops."""
    now = time.perf_counter_ns()
    st = _States(snap, now)
    order = snap.plan.order()
    lines = [
        f"step {snap.step_id}: {snap.received}/{len(order)} receives handed to the loop",
        f"  open for {(now - snap.opened_ns) / 1e9:.2f} s; plan: layers {list(snap.plan.layers)}, "
        f"stages {list(snap.plan.stages)}",
    ]
    # Ops the host runs on C (one direction switched off, parity, reorder)
    # are listed before they run: the stage lines name them, and a stalled
    # one is the likely missing peer op of its stage.
    running_c = [o for o in snap.ops if o.stream == COMPUTE_STREAM and not st.op(o)[0]]
    if snap.received > 0 and order[snap.received - 1] not in snap.consumed:
        L, s = order[snap.received - 1]
        if snap.directions.a2e_side:
            why = f"waiting for a2e(L{L},s{s})"
        elif any(o.kind == A2E and (o.layer, o.stage) == (L, s) for o in running_c):
            why = f"running a2e(L{L},s{s}) on the compute stream"
        elif snap.directions.e2a_side:  # C waits the stage's last E2A before it issues the A2E
            why = f"waiting for the last e2a of stage {s} on {snap.side_streams.get(s, '?')}"
        else:
            why = f"about to issue a2e(L{L},s{s}) on the compute stream"
        lines.append(f"  compute stream {COMPUTE_STREAM} is blocked in receive (L{L},s{s}), {why}")
    elif snap.received < len(order):
        L, s = order[snap.received]
        lines.append(
            f"  compute stream {COMPUTE_STREAM} is not waiting on a receive (FFN or E2A issue); "
            f"next receive (L{L},s{s})"
        )
    for o in running_c:
        lines.append(
            f"  compute stream {COMPUTE_STREAM} is blocked in {o.kind}(L{o.layer},s{o.stage}), "
            "issued on the compute stream"
        )
    culprits: list[str] = []
    for s in snap.plan.stages:
        lines += _stage_lines(snap, st, s, culprits)
    lines.extend(culprits or ["  every issued op has finished"])
    events = list(snap.events)
    shown = events if len(events) <= _FULL_EVENT_LIST else [(k, e) for k, e in events if st.event(k) is not True]
    if len(shown) < len(events):
        lines.append(f"  events: {len(events) - len(shown)} done, listing the other {len(shown)}")
    for key, _ev in shown:
        done = st.event(key)
        lines.append(f"  event {key.label()}: {'done' if done is True else done or 'pending'}")
    pending = [f"{o.kind}(L{o.layer},s{o.stage}) on {o.stream}" for o in snap.ops if not st.op(o)[0]]
    lines.append("  ops not finished: " + (", ".join(pending) or "none"))
    return "\n".join(lines)


def _stage_lines(snap: SessionSnapshot, st: _States, s: int, culprits: list[str]) -> list[str]:
    group = group_of(s)
    mine = [o for o in snap.ops if o.stage == s]
    stream: Any = snap.side_streams.get(s, "?")
    lines = [f"  stage {s} (stream {stream}, group {group}): {len(mine)} op(s) issued"]
    states = [st.op(o) for o in mine]
    open_idx = [i for i, (finished, _) in enumerate(states) if not finished]
    # Keep long steps readable: the done ops before the last two preceding
    # the first unfinished one are counted, not listed.
    cut = max((open_idx[0] if open_idx else len(mine)) - 2, 0)
    if cut:
        lines.append(f"    ... {cut} earlier op(s) done")
    for o, (_, text) in list(zip(mine, states, strict=True))[cut:]:
        lines.append(f"    {o.kind}(L{o.layer},s{o.stage}) on {o.stream}: {text}")
    if open_idx:
        o, text = mine[open_idx[0]], states[open_idx[0]][1]
        role = "answered (no data)" if o.kind == "a2e" else "acknowledged"
        culprits.append(
            f"  likely missing peer op: {o.kind}(L{o.layer},s{o.stage}) on {o.stream} ({text}): "
            f"the attention peer of stage {s} (group {group}) has not {role}"
        )
    return lines
