"""Child of tests/package/test_plugin_vllm.py: vLLM's plugin loader, run twice
(once per process: the second call does nothing); whether it loaded our
entry point, whether vLLM knows our names, and what ``status()`` says."""

import sys

import child_vllm  # first: exits where vLLM is not installed
import vllm.envs as envs
import vllm.plugins

vllm.plugins.load_general_plugins()
vllm.plugins.load_general_plugins()
loaded = "camp2p_overlap.core.plugin" in sys.modules
out = {"loaded": loaded, "known": "VLLM_CAMP2P_MULTISTREAM" in envs.environment_variables}
if loaded:
    import camp2p_overlap

    st = camp2p_overlap.status()
    out.update(applied=st.applied, reason=st.reason, stack=st.stack, states=sorted({t.state.value for t in st.targets}))
child_vllm.emit(out)
