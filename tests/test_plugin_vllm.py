"""The vllm.general_plugins entry point: register() never raises, applies
when switched on, and makes our VLLM_CAMP2P_* names known to vLLM. The
``vllm_runtime`` tests drive vLLM's own plugin loader in fresh processes."""

from __future__ import annotations

import importlib.metadata
import json
import sys
import types
from typing import Any

import pytest
from conftest import REPO, run_python

import camp2p_overlap
from camp2p_overlap.core import plugin
from camp2p_overlap.core.config import ENV_BACKEND, ENV_STRICT, ENV_SWITCH, ENV_VARS
from camp2p_overlap.core.process import ENGINE

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_entry_point_is_declared_and_installed() -> None:
    declared = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    assert declared["project"]["entry-points"]["vllm.general_plugins"] == {
        plugin.ENTRY_POINT_NAME: "camp2p_overlap:register"
    }
    found = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "camp2p_overlap"]
    assert len(found) == 1 and found[0].value == "camp2p_overlap:register"
    assert found[0].load() is plugin.register


def test_register_applies_when_switched_on(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(ENV_SWITCH, "1")
    assert plugin.register() is None
    assert camp2p_overlap.is_applied()
    plugin.register()  # vLLM may load plugins again: still one application
    assert camp2p_overlap.is_applied()


def test_register_does_nothing_when_switched_off(clean_env: pytest.MonkeyPatch) -> None:
    plugin.register()
    assert not camp2p_overlap.is_applied()
    assert "switched off" in camp2p_overlap.status().reason
    clean_env.setenv(ENV_SWITCH, "0")
    plugin.register()
    assert not camp2p_overlap.is_applied()


@pytest.mark.parametrize("bad", [{ENV_SWITCH: "perhaps"}, {ENV_SWITCH: "1", ENV_BACKEND: "tpu"}])
def test_register_never_raises_on_a_bad_environment(clean_env: pytest.MonkeyPatch, bad: dict[str, str]) -> None:
    for k, v in bad.items():
        clean_env.setenv(k, v)
    plugin.register()
    assert not camp2p_overlap.is_applied()
    assert "configuration error" in camp2p_overlap.status().reason


def test_register_never_raises_when_apply_breaks(clean_env: pytest.MonkeyPatch) -> None:
    def boom(**_: Any) -> None:
        raise RuntimeError("engine exploded")

    clean_env.setenv(ENV_SWITCH, "1")
    clean_env.setattr(ENGINE, "apply", boom)
    plugin.register()  # logged, swallowed
    clean_env.setenv(ENV_STRICT, "1")
    with pytest.raises(RuntimeError, match="engine exploded"):
        plugin.register()


def test_register_never_raises_when_the_env_registry_breaks(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(ENV_SWITCH, "1")

    def boom() -> list[str]:
        raise RuntimeError("registry exploded")

    clean_env.setattr(plugin, "register_env_vars", boom)
    plugin.register()
    assert camp2p_overlap.is_applied()  # apply() still ran


def test_register_env_vars_needs_vllm_envs_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "vllm.envs", raising=False)
    assert plugin.register_env_vars() == []
    assert "vllm.envs" not in sys.modules  # it never imports vLLM itself


def test_register_env_vars_adds_our_names_once(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("vllm.envs")
    existing = {"VLLM_PLUGINS": lambda: None, ENV_SWITCH: lambda: "theirs"}
    fake.environment_variables = existing  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.envs", fake)
    added = plugin.register_env_vars()
    assert set(added) == set(ENV_VARS) - {ENV_SWITCH}  # an existing entry is left alone
    assert existing[ENV_SWITCH]() == "theirs"
    monkeypatch.setenv(ENV_BACKEND, "cpu")
    assert existing[ENV_BACKEND]() == "cpu"
    monkeypatch.delenv(ENV_BACKEND)
    assert existing[ENV_BACKEND]() is None
    assert plugin.register_env_vars() == []


# ---------------------------------------------------------------------------
# With the real vLLM, in fresh processes.
SKIP_RC = 77
# Skip only where vLLM is not installed at all; an installed vLLM that fails
# to import (a broken install, a missing dependency) makes the child exit
# non-zero and the test fail.
PRELUDE = f"""
import importlib.util, json, os, sys
if importlib.util.find_spec("vllm") is None:
    print("SKIP vllm is not installed")
    sys.exit({SKIP_RC})
import vllm.plugins
import vllm.envs as envs
"""


def run_vllm(code: str, env: dict[str, str]) -> dict[str, Any]:
    proc = run_python(PRELUDE + code, env=env, timeout=120)
    if proc.returncode == SKIP_RC and proc.stdout.startswith("SKIP vllm is not installed"):
        pytest.skip("vLLM is not installed")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(next(line[4:] for line in proc.stdout.splitlines() if line.startswith("OUT ")))


@pytest.mark.vllm_runtime
def test_validate_environ_knows_our_names_only_after_register() -> None:
    out = run_vllm(
        """
from camp2p_overlap.core.plugin import register
def check():
    try:
        envs.validate_environ(hard_fail=True)
        return "passed"
    except ValueError as exc:
        return str(exc)
before = check()
register()
after = check()
print("OUT " + json.dumps({"before": before, "after": after, "value": envs.VLLM_CAMP2P_MULTISTREAM}))
""",
        env={"VLLM_CAMP2P_MULTISTREAM": "1", "VLLM_CAMP2P_MULTISTREAM_BACKEND": "cpu"},
    )
    assert "VLLM_CAMP2P_MULTISTREAM" in out["before"]
    assert out["after"] == "passed"
    assert out["value"] == "1"  # readable through vLLM's envs module too


LOADER = """
vllm.plugins.load_general_plugins()
vllm.plugins.load_general_plugins()  # once per process: the second call does nothing
loaded = "camp2p_overlap.core.plugin" in sys.modules
out = {"loaded": loaded, "known": "VLLM_CAMP2P_MULTISTREAM" in envs.environment_variables}
if loaded:
    import camp2p_overlap
    st = camp2p_overlap.status()
    out.update(applied=st.applied, reason=st.reason, states=sorted({t.state.value for t in st.targets}))
print("OUT " + json.dumps(out))
"""


@pytest.mark.vllm_runtime
@pytest.mark.parametrize(
    ("env", "loaded", "applied"),
    [
        ({"VLLM_CAMP2P_MULTISTREAM": "1", "VLLM_PLUGINS": "camp2p_overlap"}, True, True),
        ({"VLLM_CAMP2P_MULTISTREAM": "0", "VLLM_PLUGINS": "camp2p_overlap"}, True, False),
        ({"VLLM_CAMP2P_MULTISTREAM": "1"}, True, True),  # VLLM_PLUGINS unset: every plugin
        ({"VLLM_CAMP2P_MULTISTREAM": "1", "VLLM_PLUGINS": "lora_filesystem_resolver"}, False, False),
    ],
    ids=["named-on", "named-off", "all-plugins-on", "other-plugin-only"],
)
def test_vllm_loader_runs_our_entry_point(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], loaded: bool, applied: bool
) -> None:
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)  # the child inherits the rest of this environment
    out = run_vllm(LOADER, env=env)
    assert out["loaded"] is loaded
    assert out["known"] is loaded  # register() told vLLM about our names
    if loaded:
        assert out["applied"] is applied
        if applied:
            assert out["reason"] == "applied" and out["states"] == ["not-imported-yet"]
        else:
            assert "switched off" in out["reason"]
