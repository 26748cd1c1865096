"""Child of tests/package/test_plugin_vllm.py: the stand-ins of
``STANDIN_STACK``, a serial step, then vLLM's plugin loader (which applies
our entry point) and the same step again, traced; prints whether it was
engaged, bitwise equal to the serial one and held every edge."""

import os

import child_vllm  # first: exits where vLLM is not installed
import torch
import vllm.plugins

import camp2p_overlap
from camp2p_overlap.core.observe import trace
from camp2p_overlap.emulation import standins
from camp2p_overlap.emulation.moe import MoEShape
from camp2p_overlap.emulation.world import WorldSpec, build_world
from camp2p_overlap.verify import edges

standins.install(stack=os.environ["STANDIN_STACK"])
shape = MoEShape(hidden=32, ffn=64, experts=4, top_k=2)
w = build_world(WorldSpec(layers=3, stage_ids=(0, 1), tokens=8, shape=shape, op_timeout_s=10.0))
serial = w.run_step(tokens={0: 8, 1: 5})
vllm.plugins.load_general_plugins()
st = camp2p_overlap.status()
w.steps_run = 0  # the same step again: attention sends the same data
with trace.recording() as rec:
    got = w.run_step(tokens={0: 8, 1: 5})
(step,) = rec.steps()
ops = rec.ops(step)
layers = tuple(w.layer_list())
comm_side = os.environ.get("VLLM_CAMP2P_MULTISTREAM_LAYOUT") == "comm-side"
check = edges.check_step(ops, trace.ExpectedSchedule(layers, (0, 1), comm_side, comm_side, not comm_side))
child_vllm.emit(
    {
        "stack": st.stack,
        "engaged": st.engaged,
        "runner_file": os.path.basename(w.modules[0].__file__),
        "keys_equal": sorted(got) == sorted(serial) and len(serial) == 6,
        "bitwise": all(torch.equal(got[k], serial[k]) for k in serial),
        "side": sorted({(o.kind, o.stream) for o in ops if o.kind in ("a2e", "e2a", "ffn")}),
        "check": str(check) if not check.ok else "ok",
    }
)
