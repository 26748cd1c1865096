"""Helpers shared by the patch-engine tests (test_patch_engine.py,
test_patch_orders.py): the shipped manifest's wrap targets on the stand-ins,
the one-wrapper check, a traced step, synthetic one-module manifests."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import wrapt

from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.layer import LAYER, Layer
from camp2p_overlap.core.observe.trace import recording
from camp2p_overlap.core.patching.manifest import parse_manifest
from camp2p_overlap.emulation import standins
from support.overlap import count_our_wrappers

RUNNER = "afd_plugin.v1.worker.npu.ffn_model_runner"
CONNECTOR = "afd_plugin.connectors.npu.camp2p"
#: (module, class, attribute) of every 'wrap' target of the shipped manifest.
WRAPPED = (
    (RUNNER, "AFDNPUFFNModelRunner", "_ffn_forward"),
    (RUNNER, "AFDNPUFFNModelRunner", "_capture_graphs"),
)
#: (module, class, attribute) of every 'route' target: checked, never wrapped.
ROUTED = (
    (CONNECTOR, "CAMP2pAFDConnector", "recv_attn_output"),
    (CONNECTOR, "CAMP2pAFDConnector", "send_ffn_output"),
)
CFG = OverlapConfig(enabled=True, backend="cpu", adaptive=False)


def classes() -> dict[str, type]:
    """The target classes of the (already imported) stand-in modules."""
    runner = sys.modules[RUNNER].AFDNPUFFNModelRunner
    conn = sys.modules[CONNECTOR].CAMP2pAFDConnector
    return {"AFDNPUFFNModelRunner": runner, "CAMP2pAFDConnector": conn}


def import_targets() -> dict[str, type]:
    standins.install()
    importlib.import_module(RUNNER)
    importlib.import_module(CONNECTOR)
    return classes()


def raw_targets() -> dict[tuple[str, str], Any]:
    """The raw class-dict entry of every wrap target, keyed (class, attribute)
    (importing the modules where needed)."""
    out = {}
    for mod, cls, attr in WRAPPED:
        owner = getattr(importlib.import_module(mod), cls)
        out[(cls, attr)] = vars(owner)[attr]
    return out


def assert_wrapped_once(layer: Layer = LAYER) -> None:
    """Each wrap target carries exactly one wrapper of ``layer`` (default the
    process-wide one), outermost; each route target none."""
    cls = classes()
    for _, cname, attr in WRAPPED:
        entry = vars(cls[cname])[attr]
        assert layer.engine.is_ours(entry), f"{cname}.{attr} is not our wrapper: {entry!r}"
        assert not layer.engine.is_ours(entry.__wrapped__), f"{cname}.{attr} is double wrapped"
        assert count_our_wrappers(entry, layer.engine) == 1
        assert wrapt.find_wrapper(entry, predicate=layer.engine.is_ours) is entry
    for _, cname, attr in ROUTED:  # route targets: nothing of ours on the class
        entry = vars(cls[cname])[attr]
        assert count_our_wrappers(entry, layer.engine) == 0, f"{cname}.{attr} carries a wrapper of ours: {entry!r}"


def run_traced(world: Any) -> tuple[dict, set[str]]:
    """One step from a fixed seed; returns what attention received and the
    set of streams our wrappers recorded (empty: no wrapper of ours ran)."""
    world.steps_run = 0
    with recording() as rec:
        out = world.run_step()
    return out, {o.stream for o in rec.ops()}


_SIG = """signature = [
  { name = "%s", kind = "POSITIONAL_OR_KEYWORD" },
  { name = "ubatch_idx", kind = "POSITIONAL_OR_KEYWORD", default = "0" },
  { name = "kwargs", kind = "VAR_KEYWORD" },
]"""


def synthetic_manifest(modname: str, members: list[tuple[str, str | None]]) -> Any:
    """A stack with one module; ``members`` are (qualname, first param)."""
    parts = [f'[stack]\nname = "synthetic"\nvllm = "0.19.1"\n\n[[module]]\nname = "{modname}"\n']
    for qualname, first in members:
        sig = (_SIG % first) if first else _SIG.replace('  { name = "%s", kind = "POSITIONAL_OR_KEYWORD" },\n', "")
        parts.append(f'[[module.target]]\nqualname = "{qualname}"\naction = "wrap"\nwrapper = "ffn_forward"\n{sig}\n')
    return parse_manifest("\n".join(parts), source="<synthetic>")
