"""Fixtures and hooks only (what tests import lives in ``tests/support/``).
Every test leaves the process as it found it: the patch engine unpatched,
the stand-in finder removed, log-once memory cleared, the emulated device
idle."""

from __future__ import annotations

import fcntl
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

try:
    from hypothesis import HealthCheck, settings
except ImportError:
    settings = None  # type: ignore[assignment]

from support.logs import PackageLogs
from support.stacks import STACK_DISTS, use_stack

from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.log import reset_log_once
from camp2p_overlap.core.patch_layer import PATCH_LAYER, PatchLayer, build_patch_layer
from camp2p_overlap.emulation import device as emulated_device
from camp2p_overlap.emulation import standins
from camp2p_overlap.tools.bench.runner import TOOL_SWITCH_INTERVAL_S

# The emulated device's streams (the compute stream too) are Python threads,
# and many tests time or order work on them (timeouts, watchdogs, adaptive
# engage's step times, the benchmark's own runs). At CPython's default switch
# interval (5 ms) a stream that could run may wait that long for the GIL;
# the test process runs with the emulation tools' interval, as they do
# (docs/benchmark.md, "Thread switching"). The patch layer itself never sets it.
sys.setswitchinterval(TOOL_SWITCH_INTERVAL_S)

# One intra-op thread from the start, before any stream's worker thread
# exists: a thread keeps the count it started with, and a serial reference
# computed on two threads can differ in the last bit from the same FFN on a
# one-thread side stream (every test also sets it, in _clean_state).
torch.set_num_threads(1)

# Hypothesis profiles (HYPOTHESIS_PROFILE, default "ci"). Every example runs
# real emulated steps, so "ci" keeps the budget small and the draw fixed
# (derandomized: the same examples on every run, no example database), to
# bound the suite's time; "dev" explores fresh examples; "thorough" is for a
# long run before a release (with ``-m slow``: the default run leaves the
# ``slow`` tier out, see ``addopts`` in pyproject.toml).
# (The GPU box runs only the gpu-marked files, without hypothesis.)
if settings is not None:
    _COMMON = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow], "print_blob": True}
    settings.register_profile("ci", max_examples=50, derandomize=True, database=None, **_COMMON)
    settings.register_profile("dev", max_examples=100, **_COMMON)
    settings.register_profile("thorough", max_examples=500, **_COMMON)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The ``alone`` tests run first, one after the other: a parallel run
    (``-n auto --dist worksteal`` gives the first worker the first half)
    starts with them on one worker, and they wait only for the test the
    other worker started with."""
    items.sort(key=lambda item: item.get_closest_marker("alone") is None)


_NEXT_ITEM = pytest.StashKey["pytest.Item | None"]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    item.stash[_NEXT_ITEM] = nextitem


def _is_alone(item: pytest.Item | None) -> bool:
    return item is not None and item.get_closest_marker("alone") is not None


class _AloneLock:
    """The run's two lock files (every pytest-xdist worker's temporary
    folder has one parent; in one process they are never contended) and
    whether this process holds the lock exclusively."""

    def __init__(self, root: Path) -> None:
        self.gate = open(root / "camp2p-alone-gate.lock", "a")  # held for the session
        self.lock = open(root / "camp2p-alone.lock", "a")
        self.exclusive = False

    def take(self, alone: bool) -> None:
        if alone and self.exclusive:
            return  # the previous test was alone too: kept
        fcntl.flock(self.gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(self.gate, fcntl.LOCK_UN)
        self.exclusive = alone

    def give(self, keep: bool) -> None:
        if not keep:
            fcntl.flock(self.lock, fcntl.LOCK_UN)
            self.exclusive = False


@pytest.fixture(scope="session")
def _alone_lock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_AloneLock]:
    root = tmp_path_factory.getbasetemp()
    made = _AloneLock(root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root)
    yield made
    made.gate.close()
    made.lock.close()


@pytest.fixture(autouse=True)
def _alone(request: pytest.FixtureRequest, _alone_lock: _AloneLock) -> Iterator[None]:
    """A test marked ``alone`` (one whose check reads a time or a CPU share,
    which a second busy process could change) runs while no other test of
    the run does: it holds the run's lock exclusively (kept for the next
    test when that one is alone too), every other test holds it shared. It
    takes the gate first and holds it until it has the lock, and every
    other test passes the gate before it takes its share, so it waits only
    for the tests already running."""
    alone = _is_alone(request.node)
    _alone_lock.take(alone)
    try:
        yield
    finally:
        _alone_lock.give(keep=alone and _is_alone(request.node.stash.get(_NEXT_ITEM, None)))


@pytest.fixture(autouse=True)
def _clean_state(_alone: None) -> Iterator[None]:
    import torch

    torch.set_num_threads(1)
    yield
    PATCH_LAYER.engine.unpatch(timeout=10)
    standins.uninstall(standins.REAL_ROOT)
    standins.uninstall(standins.ALIAS_ROOT)
    reset_log_once()
    # The emulated device is process-wide: the next test starts with it idle
    # and holding no asynchronous error a test left (one that checked a
    # failure, say, without synchronizing after it).
    emulated_device.drain_all(timeout=60.0)
    emulated_device.take_errors()


@pytest.fixture(params=list(STACK_DISTS), ids=lambda s: s.removeprefix("vllm-"))
def standin_stack(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test once per supported stack: that stack's stand-ins, and
    its versions installed (the engine must pick its manifest)."""
    with use_stack(request.param):
        yield request.param


@pytest.fixture
def logs() -> Iterator[PackageLogs]:
    from camp2p_overlap.core.log import logger

    cap = PackageLogs()
    old = logger.level
    logger.addHandler(cap)
    logger.setLevel(logging.DEBUG)
    try:
        yield cap
    finally:
        logger.removeHandler(cap)
        logger.setLevel(old)


@pytest.fixture
def forget_stuck() -> Iterator[None]:
    """A failed patch-engine test may leave a wrapper of ours stuck under a
    foreign one on a stand-in class that is about to be thrown away: unpatch
    and forget it (``pytestmark = pytest.mark.usefixtures("forget_stuck")``)."""
    yield
    PATCH_LAYER.engine.unpatch(timeout=10)
    PATCH_LAYER.engine.installer.stuck.clear()


@pytest.fixture
def patch_layer() -> Iterator[PatchLayer]:
    """A patch layer of the test's own (``build_patch_layer()``: its engine, runtime,
    stream sets and sessions), unpatched after the test; the process-wide
    ``PATCH_LAYER`` stays for the tests about it and about the public API."""
    own = build_patch_layer()
    yield own
    own.engine.unpatch(timeout=10)
    own.engine.installer.stuck.clear()


@pytest.fixture
def cpu_config() -> OverlapConfig:
    """Switched on, CPU backend, defaults otherwise."""
    return OverlapConfig(enabled=True, backend="cpu", adaptive=False)


@pytest.fixture
def make_world() -> Callable[..., object]:
    """Build an emulated world with stand-ins at the real dotted paths."""
    from camp2p_overlap.emulation.moe import MoEShape
    from camp2p_overlap.emulation.world import WorldSpec, build_world

    def _make(**kw: object) -> object:
        kw.setdefault("shape", MoEShape(hidden=64, ffn=128, experts=4, top_k=2))
        kw.setdefault("tokens", 16)
        kw.setdefault("op_timeout_s", 10.0)
        return build_world(WorldSpec(**kw))  # type: ignore[arg-type]

    return _make


@pytest.fixture
def emulated_torch_npu() -> Iterator[None]:
    """The emulated device as ``torch.npu`` for the test (upstream's graph
    path calls ``torch.npu.graph``), removed after unless it was there;
    no capture may be left in progress."""
    was = emulated_device.is_torch_npu()
    emulated_device.as_torch_npu()
    yield
    assert not emulated_device.capture_in_progress(), "a capture was left in progress"
    if not was:
        emulated_device.remove_torch_npu()
