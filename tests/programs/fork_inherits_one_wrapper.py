"""Child of tests/patching/test_patch_orders.py: applies the entry point,
forks, and in the forked child runs ``register()`` and ``apply()`` again
(vLLM loads plugins again in every process it starts); prints the child's
exit code (0: exactly one wrapper of ours on ``_ffn_forward``, none on the
routed connector targets, applied and engaged) and the parent's wrapper
counts."""

import importlib
import os

import wrapt

import camp2p_overlap
from camp2p_overlap.core.patch_layer import PATCH_LAYER
from camp2p_overlap.emulation import standins

standins.install()
camp2p_overlap.apply()
conn = importlib.import_module("afd_plugin.connectors.npu.camp2p").CAMP2pAFDConnector
runner = importlib.import_module("afd_plugin.v1.worker.npu.ffn_model_runner").AFDNPUFFNModelRunner


def count():
    """count_our_wrappers() of tests/support/overlap.py, inline (no test helpers here)."""
    return [
        sum(1 for e in wrapt.wrapper_chain(vars(c)[a]) if PATCH_LAYER.engine.is_ours(e))
        for c, a in ((runner, "_ffn_forward"), (conn, "recv_attn_output"), (conn, "send_ffn_output"))
    ]


pid = os.fork()
if pid == 0:
    camp2p_overlap.register()
    camp2p_overlap.apply()
    ok = count() == [1, 0, 0] and camp2p_overlap.is_applied() and camp2p_overlap.status().engaged
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
print("CHILD", os.waitstatus_to_exitcode(status), "PARENT", count())
