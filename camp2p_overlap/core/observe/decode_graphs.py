"""What the step summary and ``doctor`` say about which graph decode
replays: upstream's serial graph until the README's Roll-out rung
:data:`GRAPH_RUNG` captures the patch layer's variant too."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: The README "Roll out" rung that captures both variants per key.
GRAPH_RUNG = 6
GRAPH_RUNG_SETTING = "VLLM_CAMP2P_MULTISTREAM_GRAPH=adaptive"
#: Words of the serial reason a capture is counted under at ``GRAPH=0``
#: where captures count as serial steps (``core/overlap/step.py``'s
#: ``GRAPH_OFF``, which this room may not import; a test holds the two
#: together).
GRAPH_OFF_WORDS = "VLLM_CAMP2P_MULTISTREAM_GRAPH is off"
UPSTREAM_GRAPH = "decode replays upstream's graph"


def rung_hint() -> str:
    """Which rung switches decode to the patch layer's graphs."""
    return f"Roll out rung {GRAPH_RUNG} ({GRAPH_RUNG_SETTING}) switches it"


def _count(snap: Mapping[str, Any], key: str, variant: str) -> int:
    return int((snap.get(key) or {}).get(variant, 0))


def _graph_off_counted(snap: Mapping[str, Any]) -> bool:
    return any(GRAPH_OFF_WORDS in r for r in snap.get("serial_reasons") or {})


def upstream_graph_only(snap: Mapping[str, Any]) -> bool:
    """Whether every decode graph counted in ``snap`` (a ``stats()``-shaped
    snapshot) is upstream's: captures counted, none of the patch layer's variant
    (captured or replayed)."""
    if _count(snap, "graph_captures", "overlap") or _count(snap, "graph_replays", "overlap"):
        return False
    return bool(_count(snap, "graph_captures", "serial")) or _graph_off_counted(snap)


def summary_note(snap: Mapping[str, Any], graph: str | None = None) -> str | None:
    """The summary's decode-graph words once captures were counted and all
    are upstream's (None otherwise). ``graph`` is the
    VLLM_CAMP2P_MULTISTREAM_GRAPH setting (None: unknown; a capture counted
    under ``GRAPH_OFF`` tells it is ``0``): at ``0`` the words name the rung
    that switches it, else they say the variants were not captured."""
    if not upstream_graph_only(snap):
        return None
    if graph == "0" or (graph is None and _graph_off_counted(snap)):
        return f"{UPSTREAM_GRAPH} (Roll out rung {GRAPH_RUNG}: {GRAPH_RUNG_SETTING})"
    return f"{UPSTREAM_GRAPH} (graph variants not captured: the log says why)"
