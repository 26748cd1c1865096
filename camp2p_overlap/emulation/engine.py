"""The patch engine the benchmark drives the emulation with (benchmark and
test use only).

The wrappers installed on the stand-ins read the process-wide engine
``camp2p_overlap.core.engine.ENGINE`` at call time, exactly as they do for users.
The global engine's version gate requires an installed vLLM 0.19.1, which a
benchmark machine need not have. :func:`emulation_engine` therefore swaps
``patcher.ENGINE`` for an engine whose version gate accepts the emulated
stack, and restores the global engine on every exit path. The user-facing
behaviour of ``camp2p_overlap.apply()`` is unchanged: it keeps using the
global engine object (``camp2p_overlap.ENGINE``).

Swapping a module global is not safe while other threads of the process run
FFN steps through the patch layer; it is meant for the benchmark's own
process and for tests, never for a vLLM worker.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from camp2p_overlap.core import engine as patcher
from camp2p_overlap.core.manifest import StackManifest, load_manifest
from camp2p_overlap.core.versions import VersionCheck
from camp2p_overlap.emulation import standins

_swap_lock = threading.Lock()
_swapped = False


def emulated_version_check(supported: str) -> VersionCheck:
    """The version gate of the emulated stack: always accepted (the stand-ins
    follow the contract of the supported stack, whatever vLLM is installed)."""
    return VersionCheck(True, "emulated", supported, f"emulated stack (stand-ins for vLLM {supported})")


@contextlib.contextmanager
def emulation_engine() -> Iterator[patcher.PatchEngine]:
    """Make ``camp2p_overlap.core.engine.ENGINE`` a fresh engine that accepts the
    emulated stack for the duration of the block; unpatch it and restore the
    global engine on every exit path.

    Refuses (``RuntimeError``) when the global engine is applied (its
    wrappers would sit on the same stand-in classes) or when another
    emulation engine is already active in this process."""
    global _swapped
    with _swap_lock:
        if _swapped:
            raise RuntimeError("an emulation engine is already active in this process")
        previous = patcher.ENGINE
        if previous.is_applied():
            raise RuntimeError(
                "the global camp2p-overlap patch engine is applied in this process; call "
                "camp2p_overlap.unpatch() first (the benchmark drives its own engine)"
            )
        engine = patcher.PatchEngine(version_check=emulated_version_check)
        patcher.ENGINE = engine
        _swapped = True
    try:
        yield engine
    finally:
        try:
            engine.unpatch(timeout=30.0)
        finally:
            with _swap_lock:
                patcher.ENGINE = previous
                _swapped = False


@dataclass(frozen=True)
class StandinSite:
    """Where the stand-ins live for this run and the manifest that names them."""

    root: str
    manifest: StackManifest
    installed_here: bool  # whether this run installed the finder (and so removes it)


def standin_site() -> StandinSite:
    """The stand-ins at the real dotted path ``afd_plugin`` unless a real
    afd-plugin is importable; then under :data:`standins.ALIAS_ROOT` with the
    manifest rebased onto it, so the real package is never shadowed."""
    if standins.real_afd_plugin_installed():
        root = standins.ALIAS_ROOT
        manifest = load_manifest().rebased(standins.REAL_ROOT, root)
    else:
        root = standins.REAL_ROOT
        manifest = load_manifest()
    present = any(isinstance(f, standins.StandinFinder) and f.root == root for f in sys.meta_path)
    standins.install(root)
    return StandinSite(root, manifest, installed_here=not present)


def release_site(site: StandinSite) -> None:
    """Undo :func:`standin_site` if it installed the finder."""
    if site.installed_here:
        standins.uninstall(site.root)
