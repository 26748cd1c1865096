"""The step gate counts steps in and out without a lock: a drain never
misses a step that entered, and a step never enters once a drain waits."""

from __future__ import annotations

import sys
import threading
import time

from camp2p_overlap.core.patching.gate import StepGate


def test_a_drain_waits_for_every_step_that_entered_and_none_enters_after() -> None:
    gate = StepGate()
    gate.open()
    stop = threading.Event()
    drained = threading.Event()  # set while a drain has returned and not ended
    inside = [False] * 3  # per step thread: between an enter() that returned True and its exit()
    entered = [0] * len(inside)
    bad: list[str] = []

    def steps(i: int) -> None:
        while not stop.is_set():
            if gate.enter():
                entered[i] += 1
                inside[i] = True
                if drained.is_set():
                    bad.append("a step entered after a drain returned")
                inside[i] = False
                gate.exit()

    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    threads = [threading.Thread(target=steps, args=(i,)) for i in range(len(inside))]
    try:
        for t in threads:
            t.start()
        for _ in range(300):
            seen = sum(entered)
            while sum(entered) < seen + len(inside):  # steps run between drains
                time.sleep(0)
            assert gate.drain(timeout=5.0)
            drained.set()
            time.sleep(2e-4)  # the drained window: a step that slipped past the drain would enter here
            if any(inside) or gate.running():
                bad.append("a drain returned while a step was inside")
            drained.clear()
            gate.end_drain()
    finally:
        stop.set()
        for t in threads:
            t.join()
        sys.setswitchinterval(previous)
    assert not bad
    assert gate.running() == 0 and not gate.running_here()


def test_a_closed_gate_counts_nothing_in() -> None:
    gate = StepGate()
    assert not gate.enter() and gate.running() == 0
    gate.open()
    assert gate.enter() and gate.running() == 1 and gate.running_here()
    gate.exit()
    assert gate.running() == 0 and not gate.running_here()
