"""The rollout modes (``VLLM_CAMP2P_MULTISTREAM_MODE``): what each one
changes in an engaged step, and the rung of the rollout ladder a
configuration is on (docs/design.md, "Rollout modes and the ladder").

* ``overlap``: A2E/E2A on a side stream per stage (HCCL group), as the
  direction switches say;
* ``reorder``: the overlap's issue order (prologue A2E of every stage, then
  E2A(L, s) followed at once by A2E(L+1, s)), every op on the compute stream;
* ``parity``: the session engaged, every op on the compute stream in the
  order the FFN loop calls it (upstream's order).

The session needs no mode of its own: ``parity`` is the session with both
directions on the compute stream, ``reorder`` the session with both on
"side streams" that are all the compute stream.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.overlap.plan import Directions
from camp2p_overlap.core.overlap.streams.base import Stream, StreamBackend

#: The rungs in the order a new deployment climbs them.
LADDER = ("parity", "reorder", "e2a-only", "overlap")


def mode_directions(cfg: OverlapConfig) -> Directions:
    """The session's directions for ``cfg.mode``; the direction switches
    apply to ``overlap`` only. One shared object per combination."""
    if cfg.mode == "parity":
        return _directions(False, False)
    if cfg.mode == "reorder":
        return _directions(True, True)
    return _directions(cfg.a2e_on_side_stream, cfg.e2a_on_side_stream)


@functools.lru_cache(maxsize=4)
def _directions(a2e_side: bool, e2a_side: bool) -> Directions:
    return Directions(a2e_side, e2a_side)


def rung(cfg: OverlapConfig) -> str:
    """The ladder rung ``cfg`` sets: ``off``, one of :data:`LADDER`, or
    ``a2e-only`` (off the ladder: E2A=0), or ``none`` (overlap with both
    directions off: every step runs serially)."""
    if not cfg.enabled:
        return "off"
    if cfg.mode != "overlap":
        return cfg.mode
    if cfg.a2e_on_side_stream and cfg.e2a_on_side_stream:
        return "overlap"
    if cfg.e2a_on_side_stream:
        return "e2a-only"
    if cfg.a2e_on_side_stream:
        return "a2e-only"
    return "none"


@dataclass(frozen=True)
class ComputeOnlyStreams:
    """A stream set whose every stage "side stream" is the compute stream
    (the ``parity`` and ``reorder`` modes): the session records, waits and
    issues as in ``overlap``, but everything runs in order on the caller."""

    backend: StreamBackend
    streams: Mapping[int, Stream]
    lock: Any


def streams_for(mode: str, streamset: Any) -> Any:
    """What the session of a ``mode`` step runs on: the runner's stream set,
    or for ``parity``/``reorder`` a view of it with only the compute stream."""
    if mode == "overlap":
        return streamset
    compute = streamset.backend.compute_stream()
    return ComputeOnlyStreams(streamset.backend, dict.fromkeys(streamset.streams, compute), streamset.lock)
