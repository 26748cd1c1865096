"""The features a manifest target may be optional for (``optional =
"<feature>"`` in ``patches/*.toml``): a target that only one feature needs
refuses that feature alone when it is missing or its signature changed;
its module and the other targets are still installed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from camp2p_overlap.core.config import OverlapConfig

GRAPH_VARIANTS = "graph_variants"


@dataclass(frozen=True)
class OptionalFeature:
    name: str
    #: What is refused without the target, in words (plural).
    refused: str
    #: What still applies without it, in words.
    kept: str
    #: Whether a configuration asks for the feature (strict mode then
    #: refuses the target's module instead of the feature alone).
    requested: Callable[[OverlapConfig], bool]
    #: The setting that asks for it, for messages.
    setting: str

    def reason(self, target: str, problem: str) -> str:
        """``<target> <problem>: <refused> are refused; <kept> is applied``."""
        return f"{target} {problem}: {self.refused} are refused; {self.kept} is applied"


#: Every feature a target may be optional for, by its manifest name.
FEATURES: dict[str, OptionalFeature] = {
    GRAPH_VARIANTS: OptionalFeature(
        GRAPH_VARIANTS,
        refused="decode graph variants",
        kept="the eager overlap",
        requested=lambda cfg: cfg.graph_overlap,
        setting="VLLM_CAMP2P_MULTISTREAM_GRAPH=1/adaptive",
    ),
}


def requested_features(cfg: OverlapConfig) -> frozenset[str]:
    """The optional features ``cfg`` asks for."""
    return frozenset(name for name, f in FEATURES.items() if f.requested(cfg))
