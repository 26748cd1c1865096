"""Child of tests/patching/test_versions.py: with whatever vLLM /
afd-plugin distribution metadata ``PYTHONPATH`` puts first, installs the
stand-ins (of ``STANDIN_STACK``, default the first stack), applies, then
applies in strict mode, and prints ``OUT <json>``: the version read, the
report, whether the runner class was left untouched and whether vLLM
was imported."""

import importlib
import importlib.metadata
import json
import os
import sys

import camp2p_overlap
from camp2p_overlap.core.patching.lifecycle import PatchRefused
from camp2p_overlap.emulation import standins

standins.install(stack=os.environ.get("STANDIN_STACK"))
importlib.import_module("afd_plugin.connectors.npu.camp2p")
runner = importlib.import_module("afd_plugin.v1.worker.npu.ffn_model_runner").AFDNPUFFNModelRunner
before = dict(vars(runner))
report = camp2p_overlap.apply()
out = {
    "metadata": importlib.metadata.version("vllm"),
    "applied": report.applied,
    "reason": camp2p_overlap.status().reason,
    "states": sorted({t.state.value for t in camp2p_overlap.status().targets}),
    "reported": report.vllm_version,
    "stack": report.stack,
    "untouched": vars(runner).keys() == before.keys() and all(vars(runner)[k] is v for k, v in before.items()),
    "vllm_imported": "vllm" in sys.modules,
}
camp2p_overlap.unpatch()
try:
    camp2p_overlap.apply(strict=True)
    out["strict"] = "applied"
except PatchRefused as exc:
    out["strict"] = "PatchRefused: " + str(exc)
print("OUT " + json.dumps(out))
