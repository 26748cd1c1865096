"""Fault injection on the CPU backend and the emulated world.

Hundreds of seeded runs, each with one fault (an exception, a delay, or an
attention peer that stops answering) at a random (layer, stage) and op kind
(A2E, FFN, E2A), random stage sets and directions. Every run must:

* end within a bound (a hang fails the run instead of blocking the suite);
* give outputs bitwise equal to the serial path (delays) or surface the
  injected error to the caller with its exact type (raise, stop);
* leave the side streams joined: no emulated op of the step still in
  flight when the step returns, every CPU worker stream idle;
* leave the next step correct;
* leave no thread behind: after ``unpatch()`` the threads are exactly those
  from before ``apply()``, and no ``camp2p-overlap-stream-*`` thread lives.

The serial path (patch not applied) gets the same fault and must fail with
the same exception type (or give the same outputs) - the overlap changes
where the error happens, never what the caller sees.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from camp2p_overlap.core import wrappers
from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.engine import ENGINE
from camp2p_overlap.core.streams.cpu import WorkerStream
from camp2p_overlap.emulation.faults import Action, Fault, FaultPlan, random_fault, run_step_bounded
from camp2p_overlap.emulation.world import World

STEP_BOUND_S = 20.0
STAGE_SETS = [(0, 1), (0, 2), (1, 2), (0, 1, 2), (0, 1, 2), (1,)]
DIRECTIONS = [(True, True), (True, True), (True, False), (False, True)]


@dataclass
class Run:
    seed: int
    fault: Fault
    layers: int
    stages: tuple[int, ...]
    directions: tuple[bool, bool]
    tokens: dict[int, int]

    def __str__(self) -> str:
        return (
            f"seed {self.seed}: {self.fault.describe()}, layers {self.layers}, stages {self.stages}, "
            f"a2e/e2a side {self.directions}, tokens {self.tokens}"
        )


def _draw(seed: int, action: Action) -> Run:
    rng = random.Random(seed)
    layers = rng.randint(1, 4)
    stages = rng.choice(STAGE_SETS)
    fault = random_fault(rng, range(layers), stages, actions=[action])
    tokens = {s: rng.randint(1, 16) for s in stages}
    return Run(seed, fault, layers, stages, rng.choice(DIRECTIONS), tokens)


def _camp2p_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("camp2p-overlap-")]


def _stream_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("camp2p-overlap-stream-")]


def _side_streams() -> list[WorkerStream]:
    with wrappers._sets_lock:
        sets = [s for _, s in wrappers._sets.values()]
    return [k for s in sets for k in s.streams.values() if isinstance(k, WorkerStream)]


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class Runner:
    def __init__(self, make_world: Callable[..., World], op_timeout_s: float) -> None:
        self.make_world = make_world
        self.op_timeout_s = op_timeout_s
        self.worlds: dict[tuple[int, tuple[int, ...]], World] = {}

    def world(self, run: Run) -> World:
        key = (run.layers, run.stages)
        if key not in self.worlds:
            self.worlds[key] = self.make_world(
                layers=run.layers, stage_ids=run.stages, tokens=16, op_timeout_s=self.op_timeout_s, seed=run.seed
            )
        return self.worlds[key]

    def step(self, w: World, n: int, tokens: dict[int, int]):
        out = run_step_bounded(w, n, STEP_BOUND_S, tokens=tokens)
        assert not out.hung, f"step {n} did not finish within {STEP_BOUND_S} s"
        return out

    def check(self, run: Run, *, serial_too: bool) -> None:
        w = self.world(run)
        fault = run.fault
        a, b = 2 * run.seed + 11, 2 * run.seed + 12  # step numbers: peers send per-step data
        assert not ENGINE.is_applied()
        ref_a = self.step(w, a, run.tokens)
        ref_b = self.step(w, b, run.tokens)
        assert ref_a.error is None and ref_b.error is None

        if serial_too:
            # The serial path with the same fault: what the caller must see.
            with FaultPlan(w, [fault]) as plan:
                plan.arm()
                ser = self.step(w, a, run.tokens)
            assert len(plan.fired) == 1
            want = fault.expected_error()
            assert (type(ser.error) if ser.error else None) is want, f"{run}: serial path gave {ser.error!r}"

        before = set(threading.enumerate())
        assert not _stream_threads(), f"{run}: stream threads alive before apply: {_stream_threads()}"
        a2e_side, e2a_side = run.directions
        cfg = OverlapConfig(enabled=True, backend="cpu", a2e_on_side_stream=a2e_side, e2a_on_side_stream=e2a_side)
        assert ENGINE.apply(config=cfg, strict=True).applied
        try:
            with FaultPlan(w, [fault]) as plan:
                plan.arm()
                out = self.step(w, a, run.tokens)
                # Joined: nothing of the step still in flight on any group.
                busy = {s: p.busy for s, p in w.transport.peers.items() if p.busy is not None}
            assert not busy, f"{run}: ops still running after the step returned: {busy}"
            assert len(plan.fired) == 1, f"{run}: fault fired {len(plan.fired)} times"
            for k in _side_streams():
                assert k.drain(timeout=5.0), f"{run}: side stream {k.name} not idle"
            want = fault.expected_error()
            if want is None:
                assert out.error is None, f"{run}: unexpected {out.error!r}"
                assert _equal(out.results, ref_a.results), f"{run}: outputs differ from the serial path"
            else:
                assert type(out.error) is want, f"{run}: expected {want.__name__}, got {out.error!r}"
                if fault.action == "raise":
                    assert "injected" in str(out.error), f"{run}: a different error surfaced: {out.error!r}"
            nxt = self.step(w, b, run.tokens)
            assert nxt.error is None, f"{run}: the next step failed: {nxt.error!r}"
            assert _equal(nxt.results, ref_b.results), f"{run}: the next step's outputs differ"
        finally:
            assert ENGINE.unpatch(timeout=10)
        assert not _stream_threads(), f"{run}: stream threads left after unpatch: {_stream_threads()}"
        for t in _camp2p_threads():  # cancelled watchdog timers end on their own
            t.join(5.0)
        after = set(threading.enumerate())
        assert after == before, f"{run}: threads differ: new {after - before}, gone {before - after}"


def _suite(make_world, action: Action, seeds: range, op_timeout_s: float, serial_every: int = 1) -> dict[str, int]:
    runner = Runner(make_world, op_timeout_s)
    seen: dict[str, int] = {}
    for i, seed in enumerate(seeds):
        run = _draw(seed, action)
        runner.check(run, serial_too=i % serial_every == 0)
        key = f"{run.fault.op}/{'overlap' if len(run.stages) > 1 else 'serial-gate'}"
        seen[key] = seen.get(key, 0) + 1
    return seen


def test_injected_exceptions_surface_with_their_type(make_world) -> None:
    seen = _suite(make_world, "raise", range(0, 160), op_timeout_s=10.0)
    # The draw covered every op kind on the overlap path.
    assert {"a2e/overlap", "ffn/overlap", "e2a/overlap"} <= seen.keys(), seen


def test_injected_delays_keep_outputs_bitwise_equal(make_world) -> None:
    seen = _suite(make_world, "delay", range(1000, 1100), op_timeout_s=10.0)
    assert {"a2e/overlap", "ffn/overlap", "e2a/overlap"} <= seen.keys(), seen


def test_stopped_peers_time_out_and_leave_nothing_behind(make_world) -> None:
    seen = _suite(make_world, "stop", range(2000, 2024), op_timeout_s=0.3, serial_every=4)
    assert {"a2e/overlap", "e2a/overlap"} <= seen.keys(), seen


@pytest.mark.slow
@pytest.mark.parametrize("action", ["raise", "delay", "stop"])
def test_fault_injection_many_seeds(make_world, action: Action) -> None:
    n = {"raise": 400, "delay": 200, "stop": 40}[action]
    base = {"raise": 10_000, "delay": 20_000, "stop": 30_000}[action]
    _suite(make_world, action, range(base, base + n), op_timeout_s=0.3 if action == "stop" else 10.0, serial_every=3)


def test_the_harness_catches_a_hang(make_world) -> None:
    """The bound is real: a delay longer than the bound is reported as hung
    (so a deadlocked overlap would fail a run rather than block the suite)."""
    w = make_world(layers=1, stage_ids=(0, 1), tokens=4)
    assert ENGINE.apply(config=OverlapConfig(enabled=True, backend="cpu"), strict=True).applied
    with FaultPlan(w, [Fault("delay", "e2a", 0, 1, delay_s=1.5)]) as plan:
        plan.arm()
        out = run_step_bounded(w, 1, 0.2)
        assert out.hung
        # Let it finish before the plan is removed and the layer unpatched.
        for t in threading.enumerate():
            if t.name == "camp2p-test-step-1":
                t.join(10)
    assert ENGINE.unpatch(timeout=10)
