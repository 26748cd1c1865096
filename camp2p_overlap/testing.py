"""Helpers for users' own test suites: apply with a given configuration and
always unpatch afterwards, even when the test fails.

    from camp2p_overlap.testing import overlap_patched

    def test_my_ffn_runner():
        with overlap_patched(backend="cpu") as report:
            ...

or, as a pytest fixture (``pytest_plugins = ["camp2p_overlap.testing"]``)::

    def test_it(camp2p_overlap_patched):
        ...
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from camp2p_overlap.core.config import OverlapConfig, load_config
from camp2p_overlap.core.patch_layer import PATCH_LAYER
from camp2p_overlap.core.patching.status_report import PatchReport


@contextlib.contextmanager
def overlap_patched(
    config: OverlapConfig | None = None, *, strict: bool = True, **overrides: Any
) -> Iterator[PatchReport]:
    """Apply with ``config`` (default: the environment, switched on) plus
    ``overrides`` (``OverlapConfig`` field names), yield the report, and
    always unpatch. Strict by default: a refusal fails the test."""
    base = config if config is not None else load_config().with_overrides(enabled=True)
    cfg = base.with_overrides(**overrides) if overrides else base
    if cfg.backend == "cpu":
        # the cpu backend runs on the emulated device, which registers itself
        # when imported (the patch layer itself never imports the emulation)
        import camp2p_overlap.emulation.device  # noqa: F401
    PATCH_LAYER.engine.unpatch()
    try:
        yield PATCH_LAYER.engine.apply(strict=strict, config=cfg)
    finally:
        PATCH_LAYER.engine.unpatch()


try:  # the fixture exists only where pytest does
    import pytest

    @pytest.fixture
    def camp2p_overlap_patched() -> Iterator[PatchReport]:
        with overlap_patched() as report:
            yield report

except ImportError:  # pragma: no cover
    pass
