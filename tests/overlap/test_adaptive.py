"""Adaptive engage: decisions from injected step times (deterministic),
hysteresis, re-probes and bucket isolation; the switch and its bad values;
``stats()``; bitwise-equal outputs across a run that switches paths; and no
synchronize on the device path."""

from __future__ import annotations

import itertools
import json
import logging
from types import SimpleNamespace
from typing import Any

import pytest
from support.logs import PackageLogs
from support.overlap import Schedule, SessionSpy, apply_cpu, assert_same, bounded, run_step, serial_results, world

import camp2p_overlap
from camp2p_overlap.core.config import ConfigError, load_config
from camp2p_overlap.core.env_vars import ENV_ADAPTIVE, ENV_REPROBE
from camp2p_overlap.core.overlap.adaptive import AdaptiveEngage, AdaptiveSettings, BucketKey, Choice, StepTimings
from camp2p_overlap.core.overlap.streams.backend import StreamBackend
from camp2p_overlap.core.patch_layer import PATCH_LAYER

KEY = BucketKey("runner#0", 2, 6, 128)
OTHER = BucketKey("runner#0", 2, 6, 256)


def drive(engine: AdaptiveEngage, key: BucketKey, times: dict[str, float], steps: int) -> list[tuple[str, bool]]:
    """Run ``steps`` steps of ``key`` where each path takes ``times[path]``;
    returns the (path, probe) sequence."""
    seq = []
    for _ in range(steps):
        mode, probe, _, _ = engine.choose(key)
        seq.append((mode, probe))
        engine.record(key, mode, times[mode])
    return seq


# ---------------------------------------------------------------------------
# the decision logic, with injected times
def test_learning_runs_each_path_back_to_back_and_decides_at_the_seventh_step() -> None:
    a = AdaptiveEngage()
    seq = drive(a, KEY, {"overlap": 0.010, "serial": 0.015}, 6)
    assert a.decision(KEY) is None  # not yet: 3 overlap times kept, 2 serial
    seq += drive(a, KEY, {"overlap": 0.010, "serial": 0.015}, 1)
    # overlap first (its first step's time dropped), then serial: each path
    # warm, as it runs once decided
    assert [m for m, _ in seq] == ["overlap"] * 4 + ["serial"] * 3
    assert all(probe for _, probe in seq)  # learning steps measure
    assert a.decision(KEY) == "overlap"
    (snap,) = a.snapshot()
    # the first overlap time is dropped (first-use costs)
    assert snap["overlap_samples"] == 3 and snap["serial_samples"] == 3
    assert snap["overlap_median_ms"] == pytest.approx(10.0) and snap["serial_median_ms"] == pytest.approx(15.0)


def test_first_decision_with_times_read_one_step_late_comes_by_the_eighth_step() -> None:
    """On a device the time of step k is read at step k+1."""
    a = AdaptiveEngage()
    times = {"overlap": 0.010, "serial": 0.015}
    last: tuple[BucketKey, str] | None = None
    decided_at = None
    for step in range(1, 9):
        if last is not None:
            a.record(last[0], last[1], times[last[1]])  # type: ignore[arg-type]
        if a.decision(KEY) is not None:
            decided_at = step
            break
        mode, _, _, _ = a.choose(KEY)
        last = (KEY, mode)
    assert a.decision(KEY) == "overlap" and decided_at == 8  # steps 1-7 learn, step 8 runs the decision


def test_the_first_decision_takes_the_faster_median_by_default() -> None:
    """Both paths are timed under the patch layer, so a serial step's time holds
    the patch layer's pass-through cost: no margin by default; a tie stays serial."""
    a = AdaptiveEngage()
    drive(a, KEY, {"overlap": 0.0097, "serial": 0.0100}, 7)  # 3% better
    assert a.decision(KEY) == "overlap"
    b = AdaptiveEngage()
    drive(b, KEY, {"overlap": 0.0100, "serial": 0.0100}, 7)
    assert b.decision(KEY) == "serial"
    c = AdaptiveEngage()
    drive(c, KEY, {"overlap": 0.0103, "serial": 0.0100}, 7)
    assert c.decision(KEY) == "serial"


def test_overlap_must_win_by_the_engage_margin() -> None:
    a = AdaptiveEngage(AdaptiveSettings(engage_margin=0.05))
    drive(a, KEY, {"overlap": 0.0097, "serial": 0.0100}, 7)  # 3% better: not worth it
    assert a.decision(KEY) == "serial"
    b = AdaptiveEngage(AdaptiveSettings(engage_margin=0.05))
    drive(b, KEY, {"overlap": 0.0094, "serial": 0.0100}, 7)  # 6% better
    assert b.decision(KEY) == "overlap"


def test_reprobe_every_n_steps_and_the_decision_holds_when_the_probe_loses() -> None:
    a = AdaptiveEngage(AdaptiveSettings(reprobe_every=8))
    close = {"overlap": 0.0100, "serial": 0.0105}  # serial loses by 5%: a close call
    drive(a, KEY, close, 7)
    assert a.decision(KEY) == "overlap"
    seq = drive(a, KEY, close, 36)
    probes = [i for i, (m, p) in enumerate(seq) if p]
    # each probe round: a warm-up step of the other path (time dropped), then
    # a measured probe; then 8 steps of the decision
    assert probes == [7, 8, 16, 17, 25, 26, 34, 35]
    assert all(seq[i][0] == "serial" for i in probes)
    assert all(m == "overlap" for i, (m, _) in enumerate(seq) if i not in probes)
    assert a.decision(KEY) == "overlap"
    assert a.snapshot()[0]["reprobe_every"] == 8


def test_a_clearly_losing_probe_backs_the_interval_off_and_a_close_one_resets_it() -> None:
    a = AdaptiveEngage(AdaptiveSettings(reprobe_every=8))
    clear = {"overlap": 0.010, "serial": 0.015}  # serial loses by 50%
    drive(a, KEY, clear, 7)
    seq = drive(a, KEY, clear, 200)
    rounds = [i for i, (m, p) in enumerate(seq) if p][::2]  # each round's warm-up step
    # the interval doubles after each clear loss: 8, 16, 32, then 64 (8 x 8) at most
    assert [b - a_ for a_, b in itertools.pairwise(rounds)] == [17, 33, 65, 65]
    assert a.snapshot()[0]["reprobe_every"] == 64
    assert a.decision(KEY) == "overlap"
    # serial now loses by only 5%: the next probe round sets the interval back
    close = {"overlap": 0.010, "serial": 0.0105}
    seq = drive(a, KEY, close, 100)
    rounds = [i for i, (m, p) in enumerate(seq) if p][::2]
    assert a.snapshot()[0]["reprobe_every"] == 8
    assert [b - a_ for a_, b in itertools.pairwise(rounds)][-2:] == [9, 9]


def test_a_close_first_decision_is_checked_again_soon() -> None:
    """Within 10% on 3 times each: the first probe round comes 16 steps
    after the decision; a clear first decision waits the whole interval."""
    for times, first_round in (({"overlap": 0.0100, "serial": 0.0105}, 16), ({"overlap": 0.010, "serial": 0.015}, 64)):
        a = AdaptiveEngage()
        drive(a, KEY, times, 7)
        assert a.decision(KEY) == "overlap"
        seq = drive(a, KEY, times, 100)
        assert next(i for i, (_, probe) in enumerate(seq) if probe) == first_round - 1


def test_a_close_first_decision_a_few_per_cent_slower_is_undone_at_its_recheck() -> None:
    """Learning saw overlap 3 % ahead, but it runs 3 % behind: the close
    call's recheck round switches on probes 1 % faster (the full 5 %
    hysteresis would keep the slower path for good), and later rounds keep
    the full margin, so a path 3 % behind never wins back."""
    a = AdaptiveEngage()
    drive(a, KEY, {"overlap": 0.0100, "serial": 0.0103}, 7)
    assert a.decision(KEY) == "overlap"
    truth = {"overlap": 0.0100, "serial": 0.0097}
    seq = drive(a, KEY, truth, 40)
    assert a.decision(KEY) == "serial"
    switched = next(i for i, (m, p) in enumerate(seq) if m == "serial" and not p)
    assert switched <= 16 + 4  # the recheck round: a warm-up and 3 confirming probes
    drive(a, KEY, truth, 400)  # later rounds probe overlap: 3 % behind, never 5 % ahead
    (snap,) = a.snapshot()
    assert snap["decision"] == "serial" and snap["changes"] == 2
    # a clear first decision is checked with the full margin: 3 % does not switch it
    b = AdaptiveEngage()
    drive(b, KEY, {"overlap": 0.0100, "serial": 0.0150}, 7)
    drive(b, KEY, {"overlap": 0.0100, "serial": 0.0097}, 200)
    assert b.decision(KEY) == "overlap"


def test_a_change_of_decision_resets_the_back_off() -> None:
    a = AdaptiveEngage(AdaptiveSettings(reprobe_every=4))
    drive(a, KEY, {"overlap": 0.010, "serial": 0.015}, 7 + 40)
    assert a.snapshot()[0]["reprobe_every"] > 4
    slow = {"overlap": 0.030, "serial": 0.015}  # the load changes: serial now wins
    for _ in range(400):
        drive(a, KEY, slow, 1)
        if a.decision(KEY) == "serial":
            break
    (snap,) = a.snapshot()
    assert snap["decision"] == "serial" and snap["changes"] == 2
    assert snap["reprobe_every"] == 4  # the switch set the interval back
    drive(a, KEY, slow, 400)  # overlap (2x slower) loses every round since
    assert a.snapshot()[0]["reprobe_every"] == 4 * 8


def test_a_change_of_load_switches_only_after_confirming_probes(logs: PackageLogs) -> None:
    a = AdaptiveEngage(AdaptiveSettings(reprobe_every=4))
    drive(a, KEY, {"overlap": 0.010, "serial": 0.015}, 7)
    assert a.decision(KEY) == "overlap"
    # The load changes: overlap now costs 20 ms, serial 15 ms. Overlap's own
    # window still says 10 ms for a while, then the probes confirm.
    seq = drive(a, KEY, {"overlap": 0.020, "serial": 0.015}, 40)
    assert a.decision(KEY) == "serial"
    first_serial_decided = next(i for i, (m, p) in enumerate(seq) if m == "serial" and not p)
    probes_before = [i for i, (m, p) in enumerate(seq[:first_serial_decided]) if p]
    assert len(probes_before) >= 3  # one probe round of 3 confirmed it
    changes = logs.texts("adaptive:")
    assert len(changes) == 2  # the first decision and the switch, each logged once
    assert "-> serial" in changes[1] and "overlap median" in changes[1] and "serial median" in changes[1]


def test_hysteresis_keeps_the_decision_inside_the_band() -> None:
    """Overlap 6% better than serial: engaged; a later load where serial is
    3% better does not switch (inside the 5% band), 12% better does."""
    a = AdaptiveEngage(AdaptiveSettings(reprobe_every=4))
    drive(a, KEY, {"overlap": 0.0094, "serial": 0.0100}, 7)
    assert a.decision(KEY) == "overlap"
    drive(a, KEY, {"overlap": 0.0100, "serial": 0.0097}, 64)
    assert a.decision(KEY) == "overlap"
    drive(a, KEY, {"overlap": 0.0100, "serial": 0.0088}, 64)  # 12% better
    assert a.decision(KEY) == "serial"


def test_a_single_lucky_probe_does_not_switch() -> None:
    a = AdaptiveEngage(AdaptiveSettings(reprobe_every=4))
    drive(a, KEY, {"overlap": 0.010, "serial": 0.015}, 7)
    probes = 0
    for _ in range(16):
        mode, probe, _, _ = a.choose(KEY)
        probes += probe
        lucky = probe and probes == 2  # the first measured probe is very fast, the next ones are not
        a.record(KEY, mode, 0.005 if lucky else (0.010 if mode == "overlap" else 0.015))
    assert probes >= 4 and a.decision(KEY) == "overlap"


def test_a_probe_rounds_warm_up_step_is_not_judged() -> None:
    """Decided serial; each probe round's first overlap step is slow (cold
    side streams), its measured probes fast: the warm-up times are dropped
    and the confirmed probes switch the bucket to overlap."""
    a = AdaptiveEngage(AdaptiveSettings(reprobe_every=4))
    drive(a, KEY, {"overlap": 0.020, "serial": 0.015}, 7)
    assert a.decision(KEY) == "serial"
    previous = "serial"
    for _ in range(24):
        mode, _, _, _ = a.choose(KEY)
        cold = mode == "overlap" and previous == "serial"
        a.record(KEY, mode, 0.030 if cold else (0.010 if mode == "overlap" else 0.015))
        previous = mode
    assert a.decision(KEY) == "overlap"
    (snap,) = a.snapshot()
    assert snap["overlap_median_ms"] == pytest.approx(10.0)


def test_a_decided_serial_step_is_timed_one_in_serial_time_every_and_probes_always() -> None:
    a = AdaptiveEngage(AdaptiveSettings(reprobe_every=1000, serial_time_every=4))
    drive(a, KEY, {"overlap": 0.020, "serial": 0.015}, 7)
    assert a.decision(KEY) == "serial"
    chosen = [a.choose(KEY) for _ in range(12)]
    assert [c[:3] for c in chosen] == [("serial", False, t) for t in (True, False, False, False) * 3]
    every = AdaptiveEngage(AdaptiveSettings(reprobe_every=1000, serial_time_every=1))
    drive(every, KEY, {"overlap": 0.020, "serial": 0.015}, 7)
    assert [every.choose(KEY)[2] for _ in range(5)] == [True] * 5
    probing = AdaptiveEngage(AdaptiveSettings(reprobe_every=4, serial_time_every=1000))
    drive(probing, KEY, {"overlap": 0.020, "serial": 0.015}, 7)
    paths = [probing.choose(KEY) for _ in range(4)]
    assert paths[-1][:3] == ("overlap", True, True)  # the probe round's warm-up: timed
    b = AdaptiveEngage()
    drive(b, KEY, {"overlap": 0.010, "serial": 0.015}, 7)
    assert b.decision(KEY) == "overlap" and b.choose(KEY)[:3] == ("overlap", False, True)


def test_buckets_are_isolated() -> None:
    a = AdaptiveEngage()
    drive(a, KEY, {"overlap": 0.010, "serial": 0.015}, 7)
    drive(a, OTHER, {"overlap": 0.020, "serial": 0.015}, 7)
    assert a.decision(KEY) == "overlap" and a.decision(OTHER) == "serial"
    by_label = {b["label"]: b for b in a.snapshot()}
    assert by_label[KEY.label()]["steps"] == 7 and by_label[OTHER.label()]["steps"] == 7


# ---------------------------------------------------------------------------
# a list of overlap paths (the layouts listed in VLLM_CAMP2P_MULTISTREAM_LAYOUT)
CS, COMM = "compute-side", "comm-side"
BOTH = (CS, COMM)


def drive_list(
    engine: AdaptiveEngage, key: BucketKey, overlaps: tuple[str, ...], times: dict[str, float], steps: int
) -> list[tuple[str, bool]]:
    """:func:`drive` with ``overlaps`` as the bucket's overlap paths."""
    seq = []
    for _ in range(steps):
        path, probe, _, _ = engine.choose(key, overlaps)
        seq.append((path, probe))
        engine.record(key, path, times[path])
    return seq


def rounds_of(seq: list[tuple[str, bool]]) -> list[str]:
    """The path of each probe round of a decided bucket's steps (a round: its warm-up step and its measured probes,
    back to back, one path)."""
    out: list[str] = []
    previous_probe = False
    for path, probe in seq:
        if probe and not previous_probe:
            out.append(path)
        elif probe:
            assert path == out[-1], seq  # one path per round
        previous_probe = probe
    return out


@pytest.mark.parametrize(
    ("overlaps", "times", "decided"),
    [
        (BOTH, {CS: 0.012, COMM: 0.009, "serial": 0.015}, COMM),
        (BOTH, {CS: 0.009, COMM: 0.012, "serial": 0.015}, CS),
        (BOTH, {CS: 0.016, COMM: 0.017, "serial": 0.015}, "serial"),
        ((COMM, CS), {CS: 0.009, COMM: 0.012, "serial": 0.015}, CS),
    ],
    ids=["comm-side-fastest", "compute-side-fastest", "serial-fastest", "listed-the-other-way"],
)
def test_with_a_list_learning_visits_each_listed_path_then_serial_and_decides_for_the_fastest_median(
    overlaps: tuple[str, ...], times: dict[str, float], decided: str
) -> None:
    a = AdaptiveEngage()
    first_use = dict.fromkeys(overlaps, True)

    def learn(steps: int) -> list[tuple[str, bool]]:
        seq = []
        for _ in range(steps):
            path, probe, timed, _ = a.choose(KEY, overlaps)
            assert timed
            seq.append((path, probe))
            # each overlap path's first step is slow (first-use costs): dropped, it cannot sway the medians
            slow = first_use.pop(path, False)
            a.record(KEY, path, 1.0 if slow else times[path])
        return seq

    seq = learn(10)
    assert a.decision(KEY) is None  # the last serial time is still to come
    seq += learn(1)
    # each listed path in the order listed (its dropped first step and 3 kept), then serial: each back to back
    assert [p for p, _ in seq] == [overlaps[0]] * 4 + [overlaps[1]] * 4 + ["serial"] * 3
    assert all(probe for _, probe in seq)
    assert a.decision(KEY) == decided
    (snap,) = a.snapshot()
    assert snap["samples"] == {overlaps[0]: 3, overlaps[1]: 3, "serial": 3}
    assert snap["medians_ms"] == {m: pytest.approx(t * 1e3) for m, t in times.items()}
    fastest = min(overlaps, key=lambda m: times[m])  # "overlap": the fastest overlap path
    assert snap["overlap_median_ms"] == pytest.approx(times[fastest] * 1e3) and snap["overlap_samples"] == 3
    assert snap["decision"] == decided
    # decided: the decision's steps, not probes
    assert a.choose(KEY, overlaps)[:2] == (decided, False)


def test_an_overlap_path_must_beat_serial_by_the_engage_margin_even_when_it_is_the_fastest_listed() -> None:
    a = AdaptiveEngage(AdaptiveSettings(engage_margin=0.05))
    drive_list(a, KEY, BOTH, {CS: 0.0097, COMM: 0.0099, "serial": 0.0100}, 11)  # 3 % better: not worth it
    assert a.decision(KEY) == "serial"
    b = AdaptiveEngage(AdaptiveSettings(engage_margin=0.05))
    drive_list(b, KEY, BOTH, {CS: 0.0099, COMM: 0.0094, "serial": 0.0100}, 11)  # 6 % better
    assert b.decision(KEY) == COMM


def test_probe_rounds_rotate_among_the_paths_not_decided() -> None:
    a = AdaptiveEngage(AdaptiveSettings(reprobe_every=4))
    times = {CS: 0.010, COMM: 0.015, "serial": 0.020}  # a clear decision: compute-side
    drive_list(a, KEY, BOTH, times, 11)
    assert a.decision(KEY) == CS
    seq = drive_list(a, KEY, BOTH, times, 300)
    assert a.decision(KEY) == CS
    rounds = rounds_of(seq)
    assert len(rounds) >= 6
    assert rounds == [COMM, "serial"] * (len(rounds) // 2) + [COMM] * (len(rounds) % 2)
    assert all(path == CS for path, probe in seq if not probe)  # the decided path between rounds
    # decided serial: the rounds rotate among the two layouts
    b = AdaptiveEngage(AdaptiveSettings(reprobe_every=4))
    slow = {CS: 0.020, COMM: 0.025, "serial": 0.010}
    drive_list(b, KEY, BOTH, slow, 11)
    assert b.decision(KEY) == "serial"
    rounds = rounds_of(drive_list(b, KEY, BOTH, slow, 300))
    assert len(rounds) >= 6 and rounds[:6] == [CS, COMM] * 3


def test_a_path_not_listed_is_never_chosen_or_probed_and_a_changed_list_starts_the_bucket_again() -> None:
    a = AdaptiveEngage(AdaptiveSettings(reprobe_every=4))
    times = {CS: 0.020, COMM: 0.001, "serial": 0.010}  # comm-side would win, were it listed
    seq = drive_list(a, KEY, (CS,), times, 200)
    assert {p for p, _ in seq} == {CS, "serial"} and a.decision(KEY) == "serial"
    a.record(KEY, COMM, 0.0001)  # a time of a path not listed is not taken
    (snap,) = a.snapshot()
    assert set(snap["samples"]) == {CS, "serial"} and snap["steps"] == 200
    # the list grows: the bucket starts again, learning each listed path
    seq = drive_list(a, KEY, BOTH, times, 11)
    assert [p for p, _ in seq] == [CS] * 4 + [COMM] * 4 + ["serial"] * 3
    (snap,) = a.snapshot()
    assert snap["steps"] == 11 and snap["changes"] == 1 and snap["decision"] == COMM
    # the list shrinks: the decided path is not listed any more, the bucket starts again without it
    seq = drive_list(a, KEY, (CS,), times, 200)
    assert COMM not in {p for p, _ in seq}
    assert seq[:7] == [(CS, True)] * 4 + [("serial", True)] * 3
    assert a.decision(KEY) == "serial"
    (snap,) = a.snapshot()
    assert set(snap["samples"]) == {CS, "serial"} and snap["steps"] == 200


def test_a_layout_path_switches_in_on_confirmed_faster_probes(logs: PackageLogs) -> None:
    a = AdaptiveEngage(AdaptiveSettings(reprobe_every=4))
    drive_list(a, KEY, BOTH, {CS: 0.020, COMM: 0.025, "serial": 0.015}, 11)
    assert a.decision(KEY) == "serial"
    # the load changes: compute-side now takes 10 ms; its probes confirm it, then it is decided
    truth = {CS: 0.010, COMM: 0.025, "serial": 0.015}
    seq = drive_list(a, KEY, BOTH, truth, 60)
    assert a.decision(KEY) == CS
    switched = next(i for i, (p, probe) in enumerate(seq) if p == CS and not probe)
    measured = [i for i, (p, probe) in enumerate(seq[:switched]) if p == CS and probe]
    assert len(measured) >= 1 + 3  # a warm-up step, then 3 confirming probes
    # then comm-side turns faster still: a probe round of comm-side switches to it
    faster = {CS: 0.010, COMM: 0.005, "serial": 0.015}
    seq = drive_list(a, KEY, BOTH, faster, 60)
    assert a.decision(KEY) == COMM
    (snap,) = a.snapshot()
    assert snap["changes"] == 3 and snap["medians_ms"][COMM] == pytest.approx(5.0)
    changes = logs.texts("adaptive:")
    assert len(changes) == 3 and "-> serial" in changes[0]
    assert f"-> {CS}" in changes[1] and f"-> {COMM}" in changes[2]
    assert all(f"{m} median" in changes[2] for m in (CS, COMM, "serial"))


def test_a_bucket_rounds_the_largest_stage_tokens_up_to_a_power_of_two() -> None:
    from camp2p_overlap.core.overlap.step import bucket_of

    def tokens(*counts: int) -> int:
        meta = {s: SimpleNamespace(num_tokens=n) for s, n in enumerate(counts)}
        return bucket_of("r", len(counts), 2, meta).tokens

    assert [tokens(n) for n in (0, 1, 2, 3, 5, 8, 9, 128, 129)] == [0, 1, 2, 4, 8, 8, 16, 128, 256]
    assert tokens(3, 9, 2) == 16 and tokens() == 0  # the largest stage; 0: unknown


# ---------------------------------------------------------------------------
# the switch
def test_adaptive_is_on_by_default_and_parsed() -> None:
    assert load_config({}).adaptive is True and load_config({}).reprobe_every == 64
    assert load_config({ENV_ADAPTIVE: "0"}).adaptive is False
    assert load_config({ENV_ADAPTIVE: "on", ENV_REPROBE: "16"}).reprobe_every == 16


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({ENV_ADAPTIVE: "sometimes"}, "VLLM_CAMP2P_MULTISTREAM_ADAPTIVE='sometimes' is not a boolean"),
        ({ENV_REPROBE: "often"}, "VLLM_CAMP2P_MULTISTREAM_REPROBE_EVERY='often' is not an integer"),
        ({ENV_REPROBE: "1"}, "VLLM_CAMP2P_MULTISTREAM_REPROBE_EVERY=1 is out of range 2..1000000"),
    ],
)
def test_bad_adaptive_values_are_errors(env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(env)


def test_the_names_are_registered_with_vllm() -> None:
    from camp2p_overlap.core.config import ENV_VARS

    assert ENV_ADAPTIVE in ENV_VARS and ENV_REPROBE in ENV_VARS


# ---------------------------------------------------------------------------
# end to end on the emulation
def test_outputs_stay_bitwise_equal_across_switches_and_stats_count_them(logs: PackageLogs) -> None:
    """Adaptive on, re-probing every 2 steps: a 2-stage bucket alternates and
    switches paths; every step's outputs equal the serial path's; stats()
    counts each path and reason and shows the bucket."""
    w = world(layers=3, stage_ids=(0, 1), tokens=8)
    scheds = [Schedule(3, (0, 1), (8, 8), step=i + 1) for i in range(14)]
    one_stage = Schedule(3, (0,), (8,), step=99)
    refs = serial_results(w, [*scheds, one_stage])
    before = camp2p_overlap.stats()
    apply_cpu(adaptive=True, reprobe_every=2)
    paths = []
    for sched, ref in zip(scheds, refs, strict=False):
        n = camp2p_overlap.stats()["steps"]["overlap"]
        assert_same(bounded(lambda s=sched: run_step(w, s)), ref)
        paths.append("overlap" if camp2p_overlap.stats()["steps"]["overlap"] > n else "serial")
    assert_same(bounded(lambda: run_step(w, one_stage)), refs[-1])
    assert "overlap" in paths and "serial" in paths
    assert any(a != b for a, b in itertools.pairwise(paths))  # it switched back and forth
    after = camp2p_overlap.stats()
    json.dumps(after)  # JSON-able
    steps = {k: after["steps"][k] - before["steps"].get(k, 0) for k in after["steps"]}
    assert steps["overlap"] == paths.count("overlap")
    assert steps["serial"] == paths.count("serial") + 1
    assert steps["parity"] == 0 and steps["reorder"] == 0
    reasons = after["serial_reasons"]
    assert reasons.get("adaptive: serial probe step", 0) >= 2
    assert any("fewer than the minimum 2" in r for r in reasons)
    (bucket,) = [b for b in after["buckets"] if b["key"]["stages"] == 2 and b["key"]["layers"] == 3]
    assert bucket["key"]["tokens"] == 8 and bucket["decision"] in ("compute-side", "serial")  # the default layout
    assert bucket["overlap_samples"] >= 2 and bucket["serial_samples"] >= 2
    assert bucket["overlap_median_ms"] > 0 and bucket["serial_median_ms"] > 0
    assert logs.texts("adaptive: ")  # the decision was logged


def test_with_both_layouts_listed_adaptive_runs_and_counts_each_and_every_output_is_bitwise_serial(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """VLLM_CAMP2P_MULTISTREAM_LAYOUT=compute-side,comm-side with adaptive engage, re-probing every 2 steps: the
    bucket learns each layout, then serial, and goes on probing; stats()["layout_steps"] counts each layout as the
    sessions ran it, and every step's outputs equal the serial path's."""
    w = world(layers=3, stage_ids=(0, 1), tokens=8)
    scheds = [Schedule(3, (0, 1), (8, 8), step=i + 1) for i in range(30)]
    refs = serial_results(w, scheds)
    before = camp2p_overlap.stats()
    apply_cpu(adaptive=True, reprobe_every=2, layouts=BOTH)
    sessions = SessionSpy(monkeypatch, keep=True)
    ran: list[str] = []
    for sched, ref in zip(scheds, refs, strict=True):
        counted = dict(camp2p_overlap.stats()["layout_steps"])
        assert_same(bounded(lambda s=sched: run_step(w, s)), ref, f"step {sched.step}")
        now = camp2p_overlap.stats()["layout_steps"]
        grew = [m for m in now if now[m] != counted.get(m, 0)]
        assert len(grew) <= 1 and all(now[m] == counted.get(m, 0) + 1 for m in grew), (counted, now)
        ran.append(grew[0] if grew else "serial")
    assert ran[:11] == [CS] * 4 + [COMM] * 4 + ["serial"] * 3  # learning: each listed layout, then serial
    assert ran[11:].count(CS) + ran[11:].count(COMM) >= 1 and len(set(ran[11:])) >= 2  # decided, and probing
    assert [s.layout.name for s in sessions.kept] == [m for m in ran if m != "serial"]  # what each session ran
    after = camp2p_overlap.stats()
    layouts = {m: n - before["layout_steps"].get(m, 0) for m, n in after["layout_steps"].items()}
    layouts = {m: n for m, n in layouts.items() if n}  # every layout is listed, at 0 until it runs
    assert layouts == {CS: ran.count(CS), COMM: ran.count(COMM)}
    assert after["steps"]["overlap"] - before["steps"]["overlap"] == ran.count(CS) + ran.count(COMM)
    (bucket,) = [b for b in after["buckets"] if b["key"]["stages"] == 2 and b["key"]["layers"] == 3]
    assert set(bucket["samples"]) == {CS, COMM, "serial"} and min(bucket["samples"].values()) >= 3
    assert bucket["decision"] in (CS, COMM, "serial")


def test_adaptive_off_engages_every_allowed_step() -> None:
    w = world(layers=2, stage_ids=(0, 1), tokens=8)
    before = camp2p_overlap.stats()["steps"]["overlap"]
    apply_cpu(adaptive=False)
    for i in range(6):
        run_step(w, Schedule(2, (0, 1), (8, 8), step=i + 1))
    assert camp2p_overlap.stats()["steps"]["overlap"] - before == 6


def test_graph_capture_uses_the_static_setting() -> None:
    """Inside capture the adaptive decision does not apply: an allowed step
    engages even when the bucket decided serial."""
    w = world(layers=2, stage_ids=(0, 1), tokens=8)
    apply_cpu(adaptive=True, graph=True)
    key_calls: list[Any] = []
    real_choose = PATCH_LAYER.runtime.adaptive.choose
    PATCH_LAYER.runtime.adaptive.choose = lambda key, overlaps=(), settle=None: (
        key_calls.append(key) or Choice("serial", False, True, 0)
    )  # type: ignore[method-assign]
    try:
        before = camp2p_overlap.stats()
        run_step(w, Schedule(2, (0, 1), (8, 8), step=1), is_graph_capturing=True)
        after = camp2p_overlap.stats()
        assert after["graph_captures"]["overlap"] == before["graph_captures"]["overlap"] + 1 and key_calls == []
        assert after["steps"] == before["steps"]  # a capture is not an eager step
        run_step(w, Schedule(2, (0, 1), (8, 8), step=2))  # eager: the bucket's path
        assert camp2p_overlap.stats()["steps"]["overlap"] == before["steps"]["overlap"] and len(key_calls) == 1
    finally:
        PATCH_LAYER.runtime.adaptive.choose = real_choose  # type: ignore[method-assign]
    assert PATCH_LAYER.engine.is_applied()


# ---------------------------------------------------------------------------
# the device timing path never synchronizes
class _Ev:
    def __init__(self, log: list[str], clock: list[float]) -> None:
        self.log, self.clock, self.t, self.done = log, clock, None, False

    def record(self, stream: Any = None) -> None:
        self.log.append("record")
        self.t = self.clock[0]

    def query(self) -> bool:
        self.log.append("query")
        return self.done

    def elapsed_time(self, end: _Ev) -> float:
        return (end.t - self.t) * 1e3  # type: ignore[operator]

    def synchronize(self) -> None:
        raise AssertionError("a step must never synchronize")


class _FakeDevice:
    """A device module whose every synchronize fails the test."""

    __name__ = "fakedev"

    def __init__(self) -> None:
        self.log: list[str] = []
        self.clock = [0.0]
        self.events: list[_Ev] = []

    def Event(self, enable_timing: bool = False) -> _Ev:
        ev = _Ev(self.log, self.clock)
        self.events.append(ev)
        return ev

    class Stream:
        def __init__(self, device: Any = None) -> None:
            self.name = "s"

    def stream(self, s: Any) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def current_stream(self) -> Any:
        return self.Stream()

    def set_stream(self, s: Any) -> None:
        return None

    def synchronize(self) -> None:
        raise AssertionError("a step must never synchronize")


def test_device_step_timing_reads_events_later_and_never_synchronizes() -> None:
    dev = _FakeDevice()
    backend = StreamBackend("fake", dev)  # type: ignore[arg-type]
    seen: list[tuple[str, float]] = []
    adaptive = SimpleNamespace(record=lambda k, m, s, n=0: seen.append((m, round(s, 3))))
    timings = StepTimings(SimpleNamespace(adaptive=adaptive))

    def step() -> str:
        dev.clock[0] += 0.025
        return "out"

    assert timings.timed(KEY, "overlap", backend, step) == "out"  # type: ignore[arg-type]
    assert seen == []  # not complete yet: read later
    for ev in dev.events:
        ev.done = True
    timings.read_ready()
    assert seen == [("overlap", 0.025)]
    assert "query" in dev.log and len(dev.events) == 2
    timings.timed(KEY, "overlap", backend, step)  # type: ignore[arg-type]
    assert len(dev.events) == 2  # the pair went back to the pool


def test_runtime_collect_reads_only_completed_timings_in_order() -> None:
    dev = _FakeDevice()
    backend = StreamBackend("fake", dev)  # type: ignore[arg-type]
    a = PATCH_LAYER.runtime.adaptive
    key = BucketKey("collect-test", 2, 2, 8)
    recorded: list[tuple[str, float]] = []
    real = a.record
    a.record = lambda k, m, s, n=0: recorded.append((m, round(s, 3))) if k == key else real(k, m, s, n)  # type: ignore[method-assign]
    timings = StepTimings(PATCH_LAYER.runtime)  # one runner's
    try:
        for i, mode in enumerate(("overlap", "serial")):
            timings.timed(key, mode, backend, lambda i=i: dev.clock.__setitem__(0, dev.clock[0] + 0.010 * (i + 1)))  # type: ignore[arg-type]
        tokens = [dev.events[0:2], dev.events[2:4]]
        assert recorded == []  # nothing completed: nothing read, nothing waited for
        tokens[1][1].done = tokens[1][0].done = True
        timings.read_ready()
        assert recorded == []  # the older one is not done: order is kept
        tokens[0][1].done = tokens[0][0].done = True
        timings.read_ready()
        assert recorded == [("overlap", 0.01), ("serial", 0.02)]
    finally:
        a.record = real  # type: ignore[method-assign]
    assert all(entry != "synchronize" for entry in dev.log)


@pytest.fixture(autouse=True)
def _fresh_adaptive_state() -> Any:
    """Each test learns from scratch (the process runtime keeps what it learned)."""
    PATCH_LAYER.runtime.adaptive = AdaptiveEngage()
    yield
    PATCH_LAYER.runtime.adaptive = AdaptiveEngage()


def test_logs_at_info_name_the_bucket(logs: PackageLogs) -> None:
    a = AdaptiveEngage()
    drive(a, KEY, {"overlap": 0.010, "serial": 0.015}, 7)
    (line,) = logs.texts("adaptive:", logging.INFO)
    assert KEY.label() in line and "-> overlap" in line and "was learning" in line


class _SerialWins(AdaptiveEngage):
    """Adaptive engage fed fixed times: serial always the faster path."""

    def record(self, key: BucketKey, mode: Any, seconds: float, step: int = 0) -> None:
        super().record(key, mode, 0.010 if mode == "overlap" else 0.005)


def test_a_runners_state_is_forgotten_when_the_runner_is_collected() -> None:
    import gc

    from camp2p_overlap.core.overlap.runner_state import NotWeaklyReferenceable
    from camp2p_overlap.core.overlap.runtime import OverlapRuntime

    class Runner:
        device = "cpu"

    runtime = OverlapRuntime()
    runner, other = Runner(), Runner()
    sset = runtime.runners.streams(runner, "cpu")
    assert sset is not None and runtime.runners.streams(runner, "cpu") is sset  # made once, reused
    facts = object()
    runtime.runners.get(runner).facts = facts
    assert runtime.runners.of(runner).facts is facts and runtime.runners.of(other) is None
    assert runtime.runner_name(runner) == runtime.runner_name(runner) != runtime.runner_name(other)
    assert len(runtime.runners.states()) == 2
    streams = list(sset.streams.values())
    del runner
    gc.collect()
    assert len(runtime.runners.states()) == 1  # other's
    assert all(s.closed for s in streams)  # the collected runner's side streams closed with it
    with pytest.raises(NotWeaklyReferenceable, match="cannot be weakly referenced"):
        runtime.runners.get(7)
    assert runtime.runners.of(7) is None
    # On unpatch a state keeps its name only: what adaptive engage learned
    # under it applies after a new apply.
    name, kept = runtime.runner_name(other), runtime.runners.streams(other, "cpu")
    assert kept is not None
    runtime.runners.get(other).facts = object()
    runtime.close()
    state = runtime.runners.of(other)
    assert state is not None and state.name == name == runtime.runner_name(other)
    assert state.streamset is None and state.facts is None
    assert all(s.closed for s in kept.streams.values())
