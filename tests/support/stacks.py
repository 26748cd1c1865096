"""The stacks the overlap suite runs against (a ``patches/`` manifest each)
and how a test puts one in place: that stack's stand-ins at ``afd_plugin``
and, in this process, its installed versions as distribution metadata."""

from __future__ import annotations

import contextlib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from camp2p_overlap.core.patch_layer import PATCH_LAYER
from camp2p_overlap.emulation import standins

#: The stacks, with the distributions a process of that stack has installed.
#: For vllm-0.19.1 that is this venv's own real vLLM 0.19.1 wheel (nothing is
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
            PATCH_LAYER.engine.unpatch(timeout=10)
            standins.uninstall(standins.REAL_ROOT)
