"""The attention peer's dependency cycle, checked on a step's trace.

Per stage group, layer after layer: the FFN side's E2A of layer L reaches
the attention rank, attention runs (``attn`` at least), and only then can
the A2E of the stage's next layer complete. No schedule on the FFN side can
shorten that cycle; an emulation whose A2E completed earlier would model a
peer that answers before it was asked, and its figures (speedup, eta) would
be too good. :func:`check_peer_cycle` finds such A2Es in a trace (CPU or
device timings); the edge checker (:func:`camp2p_overlap.verify.edges.check_step`)
checks the FFN side's own edges.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from camp2p_overlap.core.observe.trace import TraceOp
from camp2p_overlap.verify.edges import CheckResult


def check_peer_cycle(
    ops: Sequence[TraceOp],
    layers: Sequence[int],
    stages: Sequence[int],
    attn_ns: int,
    *,
    tolerance_ns: int = 2_000,
) -> CheckResult:
    """Check, for every stage and consecutive layers ``L -> L'`` of the
    step, that ``a2e(L')`` did not start before ``e2a(L)`` did (the E2A must
    have been issued to the peer first) and ended no earlier than ``e2a(L)``
    started plus the attention time (less ``tolerance_ns`` for clock and
    event granularity). The E2A's data reached the peer somewhere inside the
    E2A's span; its start is the bound a trace proves on any backend (a host
    thread may be descheduled between delivering and recording its end), so
    a peer that answers before it was asked plus attention is always caught
    once the attention time exceeds the E2A's own span. Ops outside the
    step's layers and stages are ignored; a missing op is reported."""
    res = CheckResult()
    bad = res.violations.append
    by: dict[tuple[str, int | None, int | None], list[TraceOp]] = {}
    for o in ops:
        if o.kind in ("a2e", "e2a"):
            by.setdefault((o.kind, o.layer, o.stage), []).append(o)
    for s in stages:
        for prev, nxt in itertools.pairwise(layers):
            e = by.get(("e2a", prev, s))
            a = by.get(("a2e", nxt, s))
            if not e or not a:
                bad(f"stage {s}: missing {'e2a' if not e else 'a2e'} for the cycle L{prev} -> L{nxt}")
                continue
            e_op, a_op = e[0], a[0]
            if a_op.start_ns < e_op.start_ns:
                bad(f"stage {s}: a2e(L{nxt}) started before e2a(L{prev}) did")
            early = e_op.start_ns + attn_ns - tolerance_ns - a_op.end_ns
            if early > 0:
                bad(
                    f"stage {s}: a2e(L{nxt}) completed {early + tolerance_ns} ns before e2a(L{prev}) started "
                    f"plus the attention time ({attn_ns} ns): the peer answered before it was asked"
                )
    return res
