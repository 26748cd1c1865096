"""Helpers shared by the patch-engine tests (test_patch_engine.py,
test_patch_orders.py, the optional-target tests): the shipped manifest's
wrap targets on the stand-ins, the one-wrapper check, a traced step,
synthetic one-module manifests, stand-in modules with an edit."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Sequence
from typing import Any

import pytest
import wrapt

from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.observe.trace import recording
from camp2p_overlap.core.patch_layer import PATCH_LAYER, PatchLayer
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


def assert_wrapped_once(patch_layer: PatchLayer = PATCH_LAYER) -> None:
    """Each wrap target carries exactly one wrapper of ``patch_layer`` (default the
    process-wide one), outermost; each route target none."""
    cls = classes()
    for _, cname, attr in WRAPPED:
        entry = vars(cls[cname])[attr]
        assert patch_layer.engine.is_ours(entry), f"{cname}.{attr} is not our wrapper: {entry!r}"
        assert not patch_layer.engine.is_ours(entry.__wrapped__), f"{cname}.{attr} is double wrapped"
        assert count_our_wrappers(entry, patch_layer.engine) == 1
        assert wrapt.find_wrapper(entry, predicate=patch_layer.engine.is_ours) is entry
    for _, cname, attr in ROUTED:  # route targets: nothing of ours on the class
        entry = vars(cls[cname])[attr]
        assert count_our_wrappers(entry, patch_layer.engine) == 0, (
            f"{cname}.{attr} carries a wrapper of ours: {entry!r}"
        )


def run_traced(world: Any) -> tuple[dict, set[str]]:
    """One step from a fixed seed; returns what attention received and the
    set of streams our wrappers recorded (empty: no wrapper of ours ran)."""
    world.steps_run = 0
    with recording() as rec:
        out = world.run_step()
    return out, {o.stream for o in rec.ops()}


#: Where an engaged step of each layout runs each op kind (stream names as the trace gives them): compute-side (the
#: default) its A2E/E2A on the caller's stream C and its FFN on the runner's stream F; comm-side its A2E/E2A on the
#: stages' K_s and its FFN on C.
ENGAGED = {
    "compute-side": {("a2e", "C"), ("ffn", "F"), ("e2a", "C")},
    "comm-side": {("a2e", "K0"), ("a2e", "K1"), ("e2a", "K0"), ("e2a", "K1"), ("ffn", "C")},
}
each_layout = pytest.mark.parametrize("layout", list(ENGAGED))


def layout_cfg(layout: str) -> OverlapConfig:
    return CFG.with_overrides(layouts=(layout,))


def run_engaged(world: Any) -> tuple[dict, set[tuple[str, str]]]:
    """One step from a fixed seed (as ``support.patching.run_traced``); returns what attention received and
    where each op of ours ran: ``(kind, stream)`` of every A2E, FFN and E2A the trace recorded (empty: no
    wrapper of ours ran)."""
    world.steps_run = 0
    with recording() as rec:
        out = world.run_step()
    return out, {(o.kind, o.stream) for o in rec.ops() if o.kind in ("a2e", "ffn", "e2a")}


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


#: The runner stand-in's ``_capture_graphs`` line (both stacks' files).
CAPTURE_GRAPHS_LINE = "    _capture_graphs = graph_path._capture_graphs\n"
#: Edits of the runner stand-in that leave ``_capture_graphs`` out of the
#: runner class (the manifest's optional target for ``graph_variants``),
#: each keeping upstream's graph path working:
RUNNER_VARIANTS: dict[str, tuple[tuple[str, str], ...]] = {
    # RFC #388 splits AFDNPUFFNModelRunner: the method moves to a base class
    # (the runner only inherits it).
    "capture-graphs-moved": (
        (CAPTURE_GRAPHS_LINE, ""),
        (
            "class AFDNPUFFNModelRunner(NPUModelRunner):",
            "class _GraphRunner(NPUModelRunner):\n"
            "    _capture_graphs = graph_path._capture_graphs\n\n\n"
            "class AFDNPUFFNModelRunner(_GraphRunner):",
        ),
    ),
    # A later line (PR #344, vLLM 0.28) gives it a new keyword parameter.
    "capture-graphs-new-param": (
        (
            CAPTURE_GRAPHS_LINE,
            "    def _capture_graphs(\n"
            "        self, *, aclgraph_runtime_mode, dp_metadata_list, is_attn_graph_capturing=True, num_tokens=None\n"
            "    ):\n"
            "        return graph_path._capture_graphs(\n"
            "            self,\n"
            "            aclgraph_runtime_mode=aclgraph_runtime_mode,\n"
            "            dp_metadata_list=dp_metadata_list,\n"
            "            is_attn_graph_capturing=is_attn_graph_capturing,\n"
            "        )\n",
        ),
    ),
}
#: What each variant's refusal says is wrong with the target.
RUNNER_VARIANT_PROBLEM = {
    "capture-graphs-moved": (
        "AFDNPUFFNModelRunner._capture_graphs is missing ('_capture_graphs' is not defined in class "
        "AFDNPUFFNModelRunner itself (only inherited))"
    ),
    "capture-graphs-new-param": (
        "AFDNPUFFNModelRunner._capture_graphs has a changed signature (unexpected parameter(s) num_tokens)"
    ),
}
#: The end of every graph_variants refusal.
GRAPH_VARIANTS_REFUSED = "decode graph variants are refused; the eager overlap is applied"


def standin_source(name: str) -> Any:
    """The stand-in file of module ``name`` for the stack whose stand-ins
    are installed (the release line's when none is)."""
    rel = name.split(".", 1)[1]
    stack = standins.installed_stack(standins.REAL_ROOT) or standins.STANDINS_DEFAULT_STACK
    parts = rel.split(".")
    stem = standins.STACKS[stack].get(rel)
    if stem is not None:
        parts[-1] = stem
    return standins._BASE.joinpath(*parts).with_suffix(".py")


def variant_module(
    name: str, edits: Sequence[tuple[str, str]], *, into: types.ModuleType | None = None
) -> types.ModuleType:
    """Execute the stand-in source of ``name`` with each (old, new) edit made
    once, registered under the real name (its parents come from the stand-in
    finder). With ``into``, execute it in that module object instead, as
    ``importlib.reload`` does (new classes in the same module)."""
    standins.install()
    importlib.import_module(name.rsplit(".", 1)[0])
    importlib.import_module("afd_plugin.connectors.metadata")
    src = standin_source(name)
    text = src.read_text(encoding="utf-8")
    for old, new in edits:
        assert old in text, f"stand-in {src.name} no longer contains {old!r}"
        text = text.replace(old, new, 1)
    module = into if into is not None else types.ModuleType(name)
    module.__file__ = str(src)
    module.__package__ = name.rsplit(".", 1)[0]
    sys.modules[name] = module
    exec(compile(text, str(src), "exec"), module.__dict__)
    return module
