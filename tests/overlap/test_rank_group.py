"""FFN ranks that decide together (docs/design.md, "Many FFN ranks"): the exchange over a c10d store, its timeout and
broken state, the configuration agreement, the merge of the group's times, and adaptive engage's group mode, whose
ranks take the same path at every step whatever each measures. Ranks here are threads over one in-process store
(``torch.distributed.HashStore``); tests/emulation/test_multirank_world.py runs them as processes."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist

from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.overlap.adaptive import SERIAL, AdaptiveEngage, AdaptiveSettings, BucketKey
from camp2p_overlap.core.overlap.rank_group import (
    ExchangeFailed,
    Membership,
    RankGroup,
    configuration,
    disagreement,
    discover,
    merge_times,
)

KEY = BucketKey("R#0", 2, 8, 128)
LAYOUTS = ("compute-side", "comm-side")


def groups(size: int, timeout_s: float = 20.0) -> list[RankGroup]:
    store = dist.HashStore()
    members = tuple(range(size))
    return [RankGroup(Membership(size, r, members, "test", store), timeout_s=timeout_s) for r in range(size)]


def on_threads(size: int, body: Callable[[int], Any], timeout_s: float = 60.0) -> list[Any]:
    """``body(rank)`` on one thread per rank; their results, in rank order (every join bounded)."""
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
        assert not t.is_alive(), "a rank did not finish in time"
    if errors:
        raise errors[0]
    return results


def test_an_exchange_gives_every_rank_every_post_in_rank_order() -> None:
    gs = groups(3)
    posts = on_threads(3, lambda r: [gs[r].exchange("t", {"rank": r}) for _ in range(4)])
    for per_rank in posts:
        assert per_rank == [[{"rank": 0}, {"rank": 1}, {"rank": 2}]] * 4
    assert all(g.exchanges == 4 for g in gs)


def test_an_exchange_without_an_answer_times_out_breaks_the_group_and_names_the_silent_rank() -> None:
    (g0, _g1) = groups(2, timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(ExchangeFailed, match=r"no answer from rank\(s\) \[1\].*within 0.3 s"):
        g0.exchange("configuration", {"x": 1})
    assert time.monotonic() - t0 < 5
    assert g0.broken is not None
    with pytest.raises(ExchangeFailed):  # broken for good: no further wait
        g0.exchange("next", {})


def test_a_rank_that_breaks_the_group_ends_the_others_wait_at_once() -> None:
    g0, g1 = groups(2, timeout_s=30.0)
    g1.fail("the FFN ranks' configurations differ (mode: ...)")
    t0 = time.monotonic()
    with pytest.raises(ExchangeFailed, match="rank 1 reported: the FFN ranks' configurations differ"):
        g0.exchange("configuration", {})
    assert time.monotonic() - t0 < 5  # not the 30 s timeout


def test_posts_of_old_exchanges_are_removed_once_every_rank_has_read_them() -> None:
    gs = groups(2)
    on_threads(2, lambda r: [gs[r].exchange(f"t{i}", i) for i in range(5)])
    store = gs[0].store
    assert not store.check(["x/0/t0/0"]) and not store.check(["x/2/t2/1"])
    assert store.check(["x/4/t4/0"]) and store.check(["x/3/t3/1"])


def test_the_heartbeat_tells_a_live_peer_from_one_that_stopped() -> None:
    g0, g1 = groups(2)
    g1.steps = 7
    g1.start_heartbeat(interval_s=0.05)
    try:
        deadline = time.monotonic() + 5
        while not g0.store.check(["hb/1"]) and time.monotonic() < deadline:
            time.sleep(0.01)
        (peer,) = g0.peers()
        assert peer["rank"] == 1 and peer["steps"] == 7 and not peer["stopped"]
        (later,) = g0.peers(now=lambda: time.time() + 60)
        assert later["stopped"]
    finally:
        g1.stop()
    assert g1.peers()[0]["stopped"]  # rank 0 never beat


def test_configurations_that_differ_are_named_with_their_ranks() -> None:
    base = configuration(OverlapConfig(enabled=True), "vllm-0.19.1")
    other = configuration(OverlapConfig(enabled=True, mode="parity"), "vllm-0.19.1")
    assert disagreement([base, base]) is None
    text = disagreement([base, other, base])
    assert text is not None and "mode" in text and "[0, 2]" in text and "[1]" in text and '"parity"' in text
    assert "layouts" not in text


def test_merged_times_are_the_slowest_ranks_of_the_steps_every_rank_timed() -> None:
    posts = [{"a": [[1, 1.0], [2, 2.0], [3, 3.0]]}, {"a": [[1, 1.5], [3, 2.0], [4, 9.0]]}]
    assert merge_times(posts) == {"a": [(1, 1.5), (3, 3.0)]}


def test_without_a_process_group_a_rank_is_alone() -> None:
    found = discover()
    assert found.size == 1 and found.problem is None


# -- adaptive engage in a group ------------------------------------------------------------------
def drive_group(
    size: int,
    steps: int,
    seconds: Callable[[int, int, str], float],
    *,
    exchange: bool = True,
    settings: AdaptiveSettings | None = None,
) -> list[list[str]]:
    """Each rank's path at each of ``steps`` steps of one bucket, each step's time ``seconds(rank, step, path)``."""
    gs = groups(size)
    settings = settings or AdaptiveSettings(reprobe_every=8)

    def rank(r: int) -> list[str]:
        a = AdaptiveEngage(settings, group=gs[r] if exchange else None)
        paths = []
        for i in range(steps):
            c = a.choose(KEY, LAYOUTS)
            paths.append(c.path)
            a.record(KEY, c.path, seconds(r, i, c.path), c.step)
        return paths

    return on_threads(size, rank, timeout_s=120)


def noisy(base: dict[str, float], noise: float, *, straggler: int | None = None, swap_at: int | None = None):
    """Step times: ``base`` per path, each rank's own noise (a different seed per rank), the straggler's FFN paths
    30 % slower, and the overlap and serial times swapped from step ``swap_at`` (a change of load)."""
    rngs: dict[int, random.Random] = {}

    def seconds(rank: int, step: int, path: str) -> float:
        rng = rngs.setdefault(rank, random.Random(1000 + rank))
        t = base[path]
        if swap_at is not None and step >= swap_at:
            t = {"compute-side": base[SERIAL], SERIAL: base["compute-side"], "comm-side": base["comm-side"]}[path]
        if rank == straggler:
            t *= 1.3
        return t * (1 + rng.uniform(-noise, noise))

    return seconds


CLOSE = {"compute-side": 0.0100, "comm-side": 0.0103, SERIAL: 0.0102}


@pytest.mark.parametrize(
    "seconds",
    [
        pytest.param(noisy(CLOSE, 0.06), id="close-call-noisy"),
        pytest.param(noisy(CLOSE, 0.06, straggler=2), id="straggler"),
        pytest.param(noisy({"compute-side": 0.006, "comm-side": 0.008, SERIAL: 0.010}, 0.02, swap_at=120), id="load"),
    ],
)
def test_every_rank_takes_the_same_path_at_every_step(seconds: Callable[[int, int, str], float]) -> None:
    paths = drive_group(4, 240, seconds)
    assert all(p == paths[0] for p in paths), "ranks took different paths"
    assert len(set(paths[0])) >= 2  # learning and probes ran more than one path


def test_alone_the_same_noisy_ranks_part() -> None:
    """The control: each rank deciding alone on its own noisy times takes another path at some step."""
    paths = drive_group(4, 240, noisy(CLOSE, 0.06), exchange=False)
    assert any(p != paths[0] for p in paths)


def test_a_change_of_load_is_followed_by_the_group() -> None:
    base = {"compute-side": 0.006, "comm-side": 0.008, SERIAL: 0.010}
    paths = drive_group(2, 400, noisy(base, 0.02, swap_at=150))[0]
    assert paths[100:140].count("compute-side") > 30
    assert paths[-40:].count(SERIAL) > 30  # serial is the faster once the load changed


def test_the_group_decides_on_its_slowest_ranks_times() -> None:
    """Overlap is faster on three ranks and slower on the straggler: the group's step is its slowest rank's, so
    the group decides serial, where the fast ranks alone would engage."""

    def seconds(rank: int, step: int, path: str) -> float:
        if path == SERIAL:
            return 0.0100
        return 0.0130 if rank == 3 else 0.0080

    paths = drive_group(4, 20, seconds, settings=AdaptiveSettings(reprobe_every=1000))
    assert paths[0][-8:] == [SERIAL] * 8


def test_a_rank_that_never_reaches_a_decision_point_sends_the_others_down_upstreams_path() -> None:
    (g0, _g1) = groups(2, timeout_s=0.3)
    a = AdaptiveEngage(AdaptiveSettings(reprobe_every=8), group=g0)
    paths = []
    for _ in range(12):
        c = a.choose(KEY, LAYOUTS)
        paths.append(c.path)
        a.record(KEY, c.path, 0.01, c.step)
    assert g0.broken is not None and "rank(s) [1]" in g0.broken
    assert paths[-3:] == [SERIAL] * 3


# -- the runtime's join ---------------------------------------------------------------------------
def test_a_rank_that_cannot_find_its_group_turns_adaptive_off_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from camp2p_overlap.core.log import reset_log_once
    from camp2p_overlap.core.overlap import runtime as runtime_module
    from camp2p_overlap.core.overlap.runtime import OverlapRuntime

    reset_log_once()
    monkeypatch.setattr(runtime_module, "discover", lambda: Membership(problem="this rank (5) is not in the group"))
    rt = OverlapRuntime()
    with caplog.at_level("WARNING"):
        rt.join_group(OverlapConfig(enabled=True), "vllm-0.19.1")
    assert rt.group is None and rt.adaptive.group is None
    assert rt.adaptive_off is not None and "this rank (5) is not in the group" in rt.adaptive_off
    assert "adaptive engage is off" in caplog.text
    assert rt.stats()["group"]["state"] == rt.adaptive_off
    # the same keys as a joined group's (stats() keeps one shape)
    assert set(rt.stats()["group"]) == set(groups(2)[0].describe())


def test_two_runtimes_that_agree_decide_together_and_one_that_differs_breaks_both() -> None:
    from camp2p_overlap.core.overlap.runtime import OverlapRuntime

    def join(configs: list[OverlapConfig]) -> list[OverlapRuntime]:
        store = dist.HashStore()
        runtimes = [OverlapRuntime() for _ in configs]
        found = [Membership(2, r, (0, 1), "test", store) for r in range(2)]
        on_threads(2, lambda r: runtimes[r].join_group(configs[r], "vllm-0.19.1", found[r]))
        for rt in runtimes:
            if rt.group is not None:
                rt.group.stop()
        return runtimes

    agreed = join([OverlapConfig(enabled=True)] * 2)
    assert all(rt.group is not None and rt.group.broken is None for rt in agreed)
    assert all(rt.adaptive.group is rt.group for rt in agreed)
    differ = join([OverlapConfig(enabled=True), OverlapConfig(enabled=True, layouts=("comm-side",))])
    for rt in differ:
        assert rt.group is not None and rt.group.broken is not None
        assert "layouts" in rt.group.broken and rt.stats()["group"]["state"] == "broken"
