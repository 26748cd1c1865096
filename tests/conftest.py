"""Shared fixtures. Every test leaves the process as it found it: the patch
engine unpatched, the stand-in finder removed, log-once memory cleared."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

try:
    from hypothesis import HealthCheck, settings
except ImportError:
    settings = None  # type: ignore[assignment]

from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.layer import LAYER
from camp2p_overlap.core.log import reset_log_once
from camp2p_overlap.emulation import standins

REPO = Path(__file__).resolve().parent.parent

# Hypothesis profiles (HYPOTHESIS_PROFILE, default "ci"). Every example runs
# real emulated steps, so "ci" keeps the budget small and the draw fixed
# (derandomized: the same examples on every run, no example database), to
# bound the suite's time; "dev" explores fresh examples; "thorough" is for a
# long run before a release (with ``-m slow``).
# (The GPU box runs only the gpu-marked files, without hypothesis.)
if settings is not None:
    _COMMON = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow], "print_blob": True}
    settings.register_profile("ci", max_examples=50, derandomize=True, database=None, **_COMMON)
    settings.register_profile("dev", max_examples=100, **_COMMON)
    settings.register_profile("thorough", max_examples=500, **_COMMON)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _clean_state() -> Iterator[None]:
    import torch

    torch.set_num_threads(1)
    yield
    LAYER.engine.unpatch(timeout=10)
    standins.uninstall(standins.REAL_ROOT)
    standins.uninstall(standins.ALIAS_ROOT)
    reset_log_once()


#: The stacks the overlap suite runs against (a ``patches/`` manifest each),
#: with the distributions a process of that stack has installed. For
#: vllm-0.19.1 that is this venv's own real vLLM 0.19.1 wheel (nothing is
#: faked: the suite runs as it always has); for vllm-0.26.0 a vLLM 0.26.0
#: and an afd-plugin built from main's pinned commit, as distribution
#: metadata only, first on sys.path, so the engine picks that stack from
#: the installed versions as it would on a real box.
STACK_DISTS: dict[str, dict[str, str]] = {
    "vllm-0.19.1": {},
    "vllm-0.26.0": {"vllm": "0.26.0", "vllm_afd_plugin": "0.1.dev447+g2e4378f2d"},
}


def fake_dists(root: Path, dists: dict[str, str]) -> Path:
    """Write ``<name>-<version>.dist-info/METADATA`` under ``root`` for each
    distribution (the metadata ``importlib.metadata`` reads, nothing else)."""
    for name, version in dists.items():
        info = root / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n", encoding="utf-8"
        )
    return root


@contextlib.contextmanager
def use_stack(stack: str) -> Iterator[None]:
    """The stand-ins of ``stack`` at ``afd_plugin`` and, in this process,
    the installed versions of that stack (see :data:`STACK_DISTS`)."""
    standins.uninstall(standins.REAL_ROOT)
    standins.install(standins.REAL_ROOT, stack=stack)
    with tempfile.TemporaryDirectory(prefix="camp2p-stack-") as tmp:
        site = str(fake_dists(Path(tmp), STACK_DISTS[stack]))
        sys.path.insert(0, site)
        try:
            yield
        finally:
            sys.path.remove(site)
            LAYER.engine.unpatch(timeout=10)
            standins.uninstall(standins.REAL_ROOT)


@pytest.fixture(params=list(STACK_DISTS), ids=lambda s: s.removeprefix("vllm-"))
def standin_stack(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test once per supported stack: that stack's stand-ins, and
    its versions installed (the engine must pick its manifest)."""
    with use_stack(request.param):
        yield request.param


class PackageLogs(logging.Handler):
    """Every record of the package logger, wherever vLLM's logging config
    (which importing vLLM turns on) would otherwise send them."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @property
    def messages(self) -> list[str]:
        return [r.getMessage() for r in self.records]

    def matching(self, contains: str = "", level: int = logging.NOTSET) -> list[logging.LogRecord]:
        """The records at ``level`` or above whose message contains ``contains``."""
        return [r for r in self.records if r.levelno >= level and contains in r.getMessage()]

    def texts(self, contains: str = "", level: int = logging.NOTSET) -> list[str]:
        """The messages of :meth:`matching`."""
        return [r.getMessage() for r in self.matching(contains, level)]


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
    LAYER.engine.unpatch(timeout=10)
    LAYER.engine.installer.stuck.clear()


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


def run_python(
    code: str, *, env: dict[str, str] | None = None, timeout: float = 120, python: str | None = None
) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter of this venv (or ``python``, e.g.
    the vLLM 0.26.0 venv's); returns the result (stdout/stderr as text). The
    caller asserts on returncode/output."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CAMP2P")}
    full_env.update(env or {})
    full_env.setdefault("PYTHONPATH", str(REPO))
    return subprocess.run(
        [python or sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=str(REPO),
    )
