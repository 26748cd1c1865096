"""Child of tests/package/test_plugin_vllm.py: vLLM's own environment check
before and after ``register()``, and our switch read through vLLM's envs."""

import child_vllm  # first: exits where vLLM is not installed
import vllm.envs as envs

from camp2p_overlap.core.plugin import register


def check() -> str:
    try:
        envs.validate_environ(hard_fail=True)
        return "passed"
    except ValueError as exc:
        return str(exc)


before = check()
register()
after = check()
child_vllm.emit({"before": before, "after": after, "value": envs.VLLM_CAMP2P_MULTISTREAM})
