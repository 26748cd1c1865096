"""Child of tests/patching/test_patch_orders.py: imports the package, then
applies (configured by the environment), and prints the vLLM / afd-plugin /
torch_npu / torch modules loaded after each, the report's ``applied`` and
the vLLM version it read."""

import sys

import camp2p_overlap

UPSTREAM = ("vllm", "afd_plugin", "torch_npu", "torch")


def upstream_modules():
    return sorted(m for m in sys.modules if m.split(".")[0] in UPSTREAM)


after_import = upstream_modules()
report = camp2p_overlap.apply()
after_apply = upstream_modules()
print("RESULT", after_import, after_apply, report.applied, report.vllm_version)
