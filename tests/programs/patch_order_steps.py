"""Child of tests/patching/test_patch_orders.py: runs the steps named in
argv (``import``, ``apply``, ``unpatch``) in order, with the stand-ins
installed, and prints one ``SNAP <json>`` snapshot of the patch layer and the
wrap targets after each step."""

import importlib
import json
import sys
import types

import wrapt

import camp2p_overlap
from camp2p_overlap.core.patch_layer import PATCH_LAYER
from camp2p_overlap.emulation import standins

RUNNER = "afd_plugin.v1.worker.npu.ffn_model_runner"
CONNECTOR = "afd_plugin.connectors.npu.camp2p"
TARGETS = [
    (RUNNER, "AFDNPUFFNModelRunner", "_ffn_forward"),
    (CONNECTOR, "CAMP2pAFDConnector", "recv_attn_output"),
    (CONNECTOR, "CAMP2pAFDConnector", "send_ffn_output"),
]
ORIGINAL = {}


def snapshot(step, result):
    snap = {
        "step": step,
        "result": result,
        "applied": camp2p_overlap.is_applied(),
        "states": {t.target.rsplit(".", 1)[-1]: t.state.value for t in camp2p_overlap.status().targets},
        "imported": [m in sys.modules for m in (RUNNER, CONNECTOR)],
        "foreign": sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "torch", "torch_npu")),
        "targets": {},
    }
    for mod, cname, attr in TARGETS:
        if mod not in sys.modules:
            continue
        entry = vars(getattr(sys.modules[mod], cname))[attr]
        # "ours": count_our_wrappers() of tests/support/overlap.py, inline (no test helpers here)
        snap["targets"][attr] = {
            "ours": sum(1 for e in wrapt.wrapper_chain(entry) if PATCH_LAYER.engine.is_ours(e)),
            "outer_is_ours": PATCH_LAYER.engine.is_ours(entry),
            "plain_function": isinstance(entry, types.FunctionType) and not hasattr(entry, "__wrapped__"),
            "is_original": attr in ORIGINAL and entry is ORIGINAL[attr],
        }
    print("SNAP " + json.dumps(snap), flush=True)


def main(steps):
    standins.install()
    for step in steps:
        result = None
        if step == "import":
            for mod, cname, attr in TARGETS:
                m = importlib.import_module(mod)
                if not camp2p_overlap.is_applied():
                    ORIGINAL[attr] = vars(getattr(m, cname))[attr]
        elif step == "apply":
            result = camp2p_overlap.apply().applied
        elif step == "unpatch":
            result = camp2p_overlap.unpatch()
        else:
            raise SystemExit("unknown step " + step)
        snapshot(step, result)


if __name__ == "__main__":
    main(sys.argv[1:])
