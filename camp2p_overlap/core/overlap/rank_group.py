"""The FFN ranks that share the MoE's collectives, as one group (docs/design.md, "Many FFN ranks"): who they are
(:func:`discover`), the channel their exchanges take (the c10d store of the default process group, under a prefix
of ours: point-to-point with the store's server, never a collective on a group that upstream also uses), what is
exchanged (the layer's configuration at the first engaged step, each adaptive bucket's times at its decision points),
the bounded wait of each exchange, and the heartbeat the stall report reads.

An exchange is keyed by its sequence number and topic. Every rank runs the same exchanges in the same order (the
decision points are step indices that every rank derives alike), so the keys meet; a rank that does not (switched
off, refused, another version) never posts, and every other rank's wait ends at the timeout, marks the group broken
and runs upstream's path. A rank whose wait fails posts the reason, so the others stop waiting at once.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.log import logger

#: The prefix of every key of ours in the store (the store is shared with upstream's own keys).
KEY_PREFIX = "camp2p_overlap"
BROKEN_KEY = "broken"
#: Seconds between two heartbeats of a rank; a peer whose last one is older than STALE_BEATS of them stopped.
HEARTBEAT_S = 1.0
STALE_BEATS = 3
#: A wait polls the store from this many seconds apart, doubling up to POLL_MAX_S.
POLL_MIN_S, POLL_MAX_S = 0.0005, 0.02


class ExchangeFailed(RuntimeError):
    """An exchange that could not complete: a rank did not post in time, or a rank reported the group broken."""


@dataclass(frozen=True)
class Membership:
    """Who this rank's group is: ``members`` (global ranks, in group order), this rank's place, and where that was
    read (``source``), or why it could not be (``problem``: the ranks cannot be told apart or reached)."""

    size: int = 1
    rank: int = 0
    members: tuple[int, ...] = (0,)
    source: str = "no process group: one FFN rank"
    store: Any = None
    problem: str | None = None


def discover() -> Membership:
    """The FFN ranks that share this rank's MoE collectives, from what the process already holds (nothing is
    imported): vLLM's expert-parallel group where vLLM's parallel state is set up, else the default process group of
    ``torch.distributed`` (an FFN server's world). No process group: one rank."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return Membership()
    world_rank, world_size = dist.get_rank(), dist.get_world_size()
    members: tuple[int, ...] = tuple(range(world_size))
    source = "torch.distributed world"
    parallel_state = sys.modules.get("vllm.distributed.parallel_state")
    ep = getattr(parallel_state, "_EP", None) if parallel_state is not None else None
    if ep is not None and getattr(ep, "ranks", None):
        members, source = tuple(int(r) for r in ep.ranks), "vLLM expert-parallel group"
    if len(members) == 1:
        return Membership(source=f"{source} of one rank")
    if world_rank not in members:
        return Membership(problem=f"this rank ({world_rank}) is not in the {source} {list(members)}")
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception as exc:  # noqa: BLE001 - a torch without it, or no store behind the group
        return Membership(problem=f"the default process group's store cannot be reached ({type(exc).__name__}: {exc})")
    return Membership(len(members), members.index(world_rank), members, source, store)


class RankGroup:
    """This rank's view of its group: the exchanges (:meth:`exchange`), the heartbeat (:meth:`start_heartbeat`), and
    whether the group is broken (``broken``: the reason; from then on every rank runs upstream's path)."""

    def __init__(self, membership: Membership, *, timeout_s: float) -> None:
        import torch.distributed as dist  # the process has it: discover() found its group

        self.size, self.rank, self.members = membership.size, membership.rank, membership.members
        self.source = membership.source
        prefix = f"{KEY_PREFIX}/ffn-group/{'-'.join(map(str, self.members))}"
        self.store = dist.PrefixStore(prefix, membership.store)
        self.channel = f"c10d store of the default process group, keys under {prefix}/"
        self.timeout_s = timeout_s
        self.broken: str | None = None
        #: Exchanges completed (its sequence number is the next one's).
        self.exchanges = 0
        #: This rank's posts of the last two exchanges (removed once every rank has read them).
        self._posted: list[str] = []
        self._lock = threading.Lock()
        #: Steps this rank has run (read by the heartbeat).
        self.steps = 0
        self._heartbeat: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def refusal(self) -> str | None:
        """Why every step runs upstream's path (the serial reason a step counts), or None while the group holds."""
        return None if self.broken is None else f"FFN rank group: {self.broken}"

    def describe(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "rank": self.rank,
            "members": list(self.members),
            "source": self.source,
            "channel": self.channel,
            "timeout_s": self.timeout_s,
            "exchanges": self.exchanges,
            "state": "broken" if self.broken else "ok",
            "broken": self.broken,
        }

    # -- exchanges -------------------------------------------------------------
    def exchange(self, topic: str, payload: Any) -> list[Any]:
        """Post ``payload`` (JSON-able) under the next sequence number and ``topic``, and every rank's post of it, in
        group order; :class:`ExchangeFailed` (the group is broken from then on) when a rank's post does not come
        within the timeout or a rank reported the group broken."""
        with self._lock:
            if self.broken is not None:
                raise ExchangeFailed(self.broken)
            name = f"x/{self.exchanges}/{topic}"
            keys = [f"{name}/{r}" for r in range(self.size)]
            try:
                self.store.set(keys[self.rank], json.dumps(payload))
                self._wait(keys, name)
                posts = [json.loads(self.store.get(k)) for k in keys]
            except ExchangeFailed as exc:
                self.fail(str(exc))
                raise
            except Exception as exc:
                self.fail(f"exchange {name}: the store failed ({type(exc).__name__}: {exc})")
                raise ExchangeFailed(self.broken) from exc
            self.exchanges += 1
            self._posted.append(keys[self.rank])
            if len(self._posted) > 2:  # every rank has read it: each has posted since
                self._delete(self._posted.pop(0))
            return posts

    def _wait(self, keys: Sequence[str], name: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        poll = POLL_MIN_S
        while not self.store.check(list(keys)):
            if self.store.check([BROKEN_KEY]):
                raise ExchangeFailed(f"exchange {name}: {self.store.get(BROKEN_KEY).decode(errors='replace')}")
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
                raise ExchangeFailed(
                    f"exchange {name}: no answer from rank(s) {missing} of the FFN group within {self.timeout_s:g} s"
                    " (a rank without the layer, switched off, refused or gone)"
                )
            time.sleep(min(poll, left))
            poll = min(poll * 2, POLL_MAX_S)

    def fail(self, reason: str) -> None:
        """The group is broken, for ``reason``: told to every rank through the store, logged once."""
        self.broken = reason
        try:
            self.store.set(BROKEN_KEY, f"rank {self.rank} reported: {reason}")
        except Exception:  # noqa: BLE001 - the store may be what failed
            pass
        logger.warning("camp2p-overlap: FFN rank group broken, every step runs upstream's path: %s", reason)

    def _delete(self, key: str) -> None:
        try:
            self.store.delete_key(key)
        except Exception:  # noqa: BLE001 - a store without deletion keeps its few small keys
            pass

    # -- the heartbeat ---------------------------------------------------------
    def start_heartbeat(self, interval_s: float = HEARTBEAT_S) -> None:
        """Post this rank's step count every ``interval_s`` from a daemon thread (it never holds up an exit)."""
        if self._heartbeat is not None:
            return
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(
            target=self._beat, args=(interval_s, self._stop), name="camp2p-overlap-heartbeat", daemon=True
        )
        self._heartbeat.start()

    def _beat(self, interval_s: float, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.store.set(f"hb/{self.rank}", json.dumps({"t": time.time(), "steps": self.steps}))
            except Exception:  # noqa: BLE001 - a store gone: the peers see this rank stop answering
                return
            stop.wait(interval_s)

    def stop(self) -> None:
        """Stop the heartbeat (on unpatch; the next joined step starts it again)."""
        self._stop.set()
        self._heartbeat = None

    def peers(self, now: Callable[[], float] = time.time) -> list[dict[str, Any]]:
        """Each other rank's last heartbeat: its step count, its age, and whether it stopped answering."""
        out = []
        for r in range(self.size):
            if r == self.rank:
                continue
            try:
                beat = json.loads(self.store.get(f"hb/{r}")) if self.store.check([f"hb/{r}"]) else None
            except Exception:  # noqa: BLE001 - a stall report reads what it can
                beat = None
            if beat is None:
                out.append({"rank": r, "member": self.members[r], "steps": None, "age_s": None, "stopped": True})
                continue
            age = max(now() - float(beat["t"]), 0.0)
            out.append(
                {
                    "rank": r,
                    "member": self.members[r],
                    "steps": beat["steps"],
                    "age_s": round(age, 3),
                    "stopped": age > STALE_BEATS * HEARTBEAT_S,
                }
            )
        return out


def merge_times(posts: Sequence[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """The group's step times from every rank's ``{path: [[step, seconds], ...]}``: for each path, the steps that
    every rank timed, in step order, each with the slowest rank's time (the group's step ends with its slowest
    rank). Every rank merges the same posts, so every rank gets the same times."""
    merged: dict[str, list[tuple[int, float]]] = {}
    for path in posts[0]:
        per_rank = [{int(s): float(t) for s, t in post.get(path, ())} for post in posts]
        common = sorted(set.intersection(*(set(p) for p in per_rank)))
        merged[path] = [(s, max(p[s] for p in per_rank)) for s in common]
    return merged


#: The configuration the FFN ranks compare at their first engaged step: what decides which path a step takes.
AGREED_FIELDS = (
    "enabled",
    "mode",
    "layouts",
    "graph",
    "graph_comm_side",
    "adaptive",
    "reprobe_every",
    "min_stages",
    "a2e_on_side_stream",
    "e2a_on_side_stream",
    "vector_cores",
    "moe_cores",
)


def configuration(config: OverlapConfig, stack: str | None) -> dict[str, Any]:
    """What a rank posts at the configuration exchange: the switch, mode, layouts, graph setting, adaptive settings,
    and the stack its version check fitted (a rank whose check refused never gets to post)."""
    values = {name: getattr(config, name) for name in AGREED_FIELDS}
    values["layouts"] = list(values["layouts"])
    return {**values, "stack": stack}


def disagreement(posts: Sequence[dict[str, Any]]) -> str | None:
    """None when every rank posted the same configuration; else the values that differ, with the ranks of each."""
    problems = []
    for name in posts[0]:
        by_value: dict[str, list[int]] = {}
        for rank, post in enumerate(posts):
            by_value.setdefault(json.dumps(post.get(name)), []).append(rank)
        if len(by_value) > 1:
            problems.append(f"{name}: " + ", ".join(f"{v} on rank(s) {r}" for v, r in by_value.items()))
    return "; ".join(problems) or None
