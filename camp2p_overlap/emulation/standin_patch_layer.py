"""Patch layers for the emulation (benchmark, soak and tests): each is a
fresh engine with its own runtime whose version gate accepts the emulated
stack (the stand-ins follow a supported stack's contract, whatever vLLM
is installed), and where the stand-ins live for a run. Nothing here touches
the process-wide patch layer behind ``camp2p_overlap.apply()``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from camp2p_overlap.core.patch_layer import PATCH_LAYER, PatchLayer, build_patch_layer
from camp2p_overlap.core.patching.lifecycle import PatchEngine
from camp2p_overlap.core.patching.manifest import DEFAULT_STACK, StackManifest, load_manifest
from camp2p_overlap.core.patching.versions import VersionCheck
from camp2p_overlap.emulation import standins


def emulated_version_check(manifest: StackManifest) -> VersionCheck:
    """The version gate of the emulated stack: always accepted, without
    reading what vLLM or afd-plugin is installed."""
    return VersionCheck(True, "emulated", manifest.vllm, f"emulated stack (stand-ins for {manifest.describe()})")


def emulated_patch_layer() -> PatchLayer:
    """A fresh patch layer for the emulated stack. Refuses
    (``RuntimeError``) while the process-wide patch layer is applied: its wrappers
    would sit on the same stand-in classes."""
    if PATCH_LAYER.engine.is_applied():
        raise RuntimeError(
            "the process-wide camp2p-overlap patch layer is applied in this process; call "
            "camp2p_overlap.unpatch() first (the benchmark drives its own engines)"
        )
    return build_patch_layer(version_check=emulated_version_check)


@contextlib.contextmanager
def emulation_engine() -> Iterator[PatchEngine]:
    """A fresh emulated engine for the block, unpatched on every exit path."""
    engine = emulated_patch_layer().engine
    try:
        yield engine
    finally:
        if not engine.unpatch(timeout=30.0):
            raise RuntimeError("an emulated patch engine could not unpatch; see the log")


@dataclass(frozen=True)
class StandinSite:
    """Where the stand-ins live for this run and the manifest that names them."""

    root: str
    manifest: StackManifest
    installed_here: bool  # whether this run installed the finder (and so removes it)


def standin_site(stack: str = DEFAULT_STACK) -> StandinSite:
    """The stand-ins of ``stack`` (a shipped manifest's name) at the real
    dotted path ``afd_plugin`` unless a real afd-plugin is importable; then
    under :data:`standins.ALIAS_ROOT` with the manifest rebased onto it, so
    the real package is never shadowed."""
    if standins.real_afd_plugin_installed():
        root = standins.ALIAS_ROOT
        manifest = load_manifest(stack).rebased(standins.REAL_ROOT, root)
    else:
        root = standins.REAL_ROOT
        manifest = load_manifest(stack)
    present = any(isinstance(f, standins.StandinFinder) and f.root == root for f in sys.meta_path)
    standins.install(root, stack=stack)
    return StandinSite(root, manifest, installed_here=not present)


def release_site(site: StandinSite) -> None:
    """Undo :func:`standin_site` if it installed the finder."""
    if site.installed_here:
        standins.uninstall(site.root)
