"""Imported first by the real-vLLM children of tests/package/test_plugin_vllm.py:
exits with ``SKIP_RC`` (the test skips) only where vLLM is not installed at
all; an installed vLLM that fails to import makes the child fail. ``emit``
prints the child's result as ``OUT <json>`` with the vLLM version."""

import importlib.util
import json
import sys

#: The exit code that says "vLLM is not installed" (test_plugin_vllm.SKIP_RC).
SKIP_RC = 77

if importlib.util.find_spec("vllm") is None:
    print("SKIP vllm is not installed")
    sys.exit(SKIP_RC)


def emit(out: dict) -> None:
    import vllm

    out["vllm"] = vllm.__version__
    print("OUT " + json.dumps(out))
