"""The emulated device's vector cores (``emulation/device/cores.py``): a kernel that must be resident waits for all its
cores, holding what it got; a spinning kernel keeps its cores until it ends; a kernel that runs in waves starts on
what is free and lasts longer; a resident kernel larger than the device fails; free cores go oldest (or newest)
first; without a budget nothing waits."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from camp2p_overlap.emulation import device as dev
from camp2p_overlap.emulation.device import cores

WAIT_S = 5.0


@pytest.fixture(autouse=True)
def budget() -> Iterator[None]:
    yield
    dev.synchronize()
    dev.take_errors()
    cores.set_core_budget(None)


def _holder(gate: threading.Event, started: threading.Event | None = None):
    """A kernel that spins (holds its cores) until ``gate`` is set, like an A2E whose peer has not sent."""

    def kernel() -> None:
        if started is not None:
            started.set()
        assert gate.wait(WAIT_S), "the test never let the spinning kernel go"

    return kernel


def _launch(stream: dev.Stream, fn, **kw) -> None:
    with dev.stream(stream):
        dev.launch(fn, **kw)


def _wait_for(cond, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def _spinning(n: int, kind: str = "a2e") -> threading.Event:
    """A spinning kernel on a stream of its own, holding ``n`` resident cores until the returned gate is set."""
    gate, spinning = threading.Event(), threading.Event()
    _launch(dev.Stream(), _holder(gate, spinning), cores=n, resident=True, kind=kind)
    assert spinning.wait(WAIT_S)
    return gate


def test_a_resident_kernel_waits_for_all_its_cores_and_holds_what_it_got() -> None:
    cores.set_core_budget(8)
    spin, mc2 = dev.Stream(), dev.Stream()
    gate, spinning, ran = threading.Event(), threading.Event(), threading.Event()
    _launch(spin, _holder(gate, spinning), cores=6, resident=True, kind="a2e")
    assert spinning.wait(WAIT_S)
    _launch(mc2, ran.set, cores=4, resident=True, kind="moe-a2a")
    _wait_for(lambda: cores.core_pool().state().waiting, "the MoE kernel never asked for its cores")  # type: ignore[union-attr]
    time.sleep(0.05)
    assert not ran.is_set(), "a resident kernel ran with fewer cores than its blocks"
    state = cores.core_pool().state()  # type: ignore[union-attr]
    assert state.free == 0
    assert state.waiting == ("moe-a2a on " + mc2.name + ": holds 2 of 4 (resident)",)  # its dispatched blocks hold 2
    assert state.running == ("a2e on " + spin.name + ": holds 6 of 6 (resident)",)
    gate.set()  # the spinning kernel ends: its cores come free
    assert ran.wait(WAIT_S)
    dev.synchronize()
    assert cores.core_pool().free == 8  # type: ignore[union-attr]


def test_a_kernel_in_waves_starts_on_what_is_free_and_lasts_longer() -> None:
    cores.set_core_budget(8)
    ffn = dev.Stream()
    gate = _spinning(6)
    dev.take_timing()
    t0 = time.perf_counter()
    _launch(ffn, lambda: None, cores=8, model_s=0.02, kind="ffn")  # 8 blocks on 2 cores: 4 waves
    ffn.synchronize()
    took = time.perf_counter() - t0
    gate.set()
    dev.synchronize()
    assert took >= 4 * 0.02 * 0.95, f"an FFN of 8 blocks on 2 free cores took {took:.3f} s, not 4 waves of 20 ms"
    assert cores.core_pool().short == 1  # type: ignore[union-attr]


def test_a_spinning_kernel_keeps_its_cores_until_it_ends() -> None:
    cores.set_core_budget(8)
    other, ran = dev.Stream(), threading.Event()
    gate = _spinning(8)
    _launch(other, ran.set, cores=1, kind="ffn")
    time.sleep(0.15)
    assert not ran.is_set(), "a kernel took a core a spinning kernel holds"
    gate.set()
    assert ran.wait(WAIT_S)


def test_a_resident_kernel_larger_than_the_device_fails_on_its_stream() -> None:
    cores.set_core_budget(8)
    s = dev.Stream()
    ran = threading.Event()
    _launch(s, ran.set, cores=9, resident=True, kind="moe-a2a")
    assert s.drain(WAIT_S), "the kernel larger than the device waits instead of failing"
    errors = dev.take_errors([s])
    assert len(errors) == 1 and isinstance(errors[0], cores.CoreBudgetError)
    assert "needs 9 resident vector cores; the device has 8" in str(errors[0])
    assert not ran.is_set()


@pytest.mark.parametrize(("order", "first"), [("oldest", "a"), ("newest", "b")])
def test_free_cores_go_to_the_waiting_kernels_in_order(order: str, first: str) -> None:
    cores.set_core_budget(4, order=order)
    sa, sb = dev.Stream(), dev.Stream()
    seen: list[str] = []
    gate = _spinning(4)
    _launch(sa, lambda: seen.append("a"), cores=4, resident=True)
    _wait_for(lambda: len(cores.core_pool().state().waiting) == 1, "a never waited")  # type: ignore[union-attr]
    _launch(sb, lambda: seen.append("b"), cores=4, resident=True)
    _wait_for(lambda: len(cores.core_pool().state().waiting) == 2, "b never waited")  # type: ignore[union-attr]
    gate.set()
    dev.synchronize()
    assert seen[0] == first


def test_without_a_budget_nothing_waits_and_the_device_reports_no_cores() -> None:
    cores.set_core_budget(None)
    s1, s2 = dev.Stream(), dev.Stream()
    gate, spinning, ran = threading.Event(), threading.Event(), threading.Event()
    _launch(s1, _holder(gate, spinning), cores=64, resident=True)
    assert spinning.wait(WAIT_S)
    _launch(s2, ran.set, cores=64, resident=True)
    assert ran.wait(WAIT_S)
    gate.set()
    assert not hasattr(dev.get_device_properties(0), "vector_core_num")
    assert dev.core_state() == []


def test_the_device_reports_its_budget_only_where_asked() -> None:
    cores.set_core_budget(48)
    assert dev.get_device_properties(0).vector_core_num == 48
    cores.set_core_budget(48, reported=False)
    assert not hasattr(dev.get_device_properties(0), "vector_core_num")
    assert dev.core_state()[0] == "vector cores: 0 of 48 held, 48 free"


def test_a_captured_kernel_takes_its_cores_at_every_replay() -> None:
    cores.set_core_budget(8)
    cap_stream = dev.Stream()
    ran: list[int] = []
    g = dev.Graph()
    with dev.graph(g, stream=cap_stream):
        dev.launch(lambda: ran.append(1), cores=8, resident=True, kind="moe-a2a")
    gate = _spinning(1)
    with dev.stream(cap_stream):
        g.replay()
    time.sleep(0.15)
    assert ran == [], "the replayed kernel ran without its cores"
    gate.set()
    dev.synchronize()
    assert ran == [1]


def test_bad_demands_and_budgets_are_refused() -> None:
    with pytest.raises(ValueError, match="positive whole number of cores"):
        cores.CoreDemand(0)
    with pytest.raises(ValueError, match="positive whole number of vector cores"):
        cores.CorePool(0)
    with pytest.raises(ValueError, match="not 'random'"):
        cores.CorePool(4, "random")
