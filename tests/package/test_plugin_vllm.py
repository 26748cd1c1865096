"""The vllm.general_plugins entry point: register() never raises, applies
when switched on, and makes our VLLM_CAMP2P_* names known to vLLM. The
``vllm_runtime`` tests drive vLLM's own plugin loader in fresh processes."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from support.child import REPO, VLLM_PYTHONS, run_program

import camp2p_overlap
from camp2p_overlap.core import plugin
from camp2p_overlap.core.config import ENV_VARS
from camp2p_overlap.core.env_vars import ENV_BACKEND, ENV_STRICT, ENV_SWITCH
from camp2p_overlap.core.patch_layer import PATCH_LAYER

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
    clean_env.setattr(PATCH_LAYER.engine, "apply", boom)
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
# With the real vLLM of each supported stack, in fresh processes (the venvs
# of support.child.VLLM_PYTHONS), each wheel installed with --no-deps plus
# what vllm.plugins, vllm.envs and vllm.forward_context need to import.
SKIP_RC = 77  # tests/programs/child_vllm.py exits with it where vLLM is not installed
STACK_OF = {"0.19.1": "vllm-0.19.1", "0.26.0": "vllm-0.26.0"}


@pytest.fixture(params=list(VLLM_PYTHONS), ids=lambda v: f"vllm-{v}")
def real_vllm(request: pytest.FixtureRequest) -> str:
    """The vLLM release whose real wheel the test's child process imports."""
    version = request.param
    if not Path(VLLM_PYTHONS[version]).exists():
        if importlib.util.find_spec("vllm") is not None:
            # The test set-up ran (it installed vLLM here) and makes both venvs.
            pytest.fail(f"{VLLM_PYTHONS[version]} is missing: run bash scripts/setup.sh --test")
        pytest.skip(f"the vLLM {version} venv is not set up (bash scripts/setup.sh --test)")
    return version


def run_vllm(program: str, env: dict[str, str], version: str = "0.19.1") -> dict[str, Any]:
    """Run ``tests/programs/<program>`` (a real-vLLM child) in the venv of
    ``version``; skip only where vLLM is not installed at all (an installed
    vLLM that fails to import fails the test)."""
    proc = run_program(program, env=env, timeout=180, python=VLLM_PYTHONS[version])
    if proc.returncode == SKIP_RC and proc.stdout.startswith("SKIP vllm is not installed"):
        if version != "0.19.1":  # its venv exists only to hold this wheel
            pytest.fail(f"vLLM is missing from {VLLM_PYTHONS[version]}: run bash scripts/setup.sh --test")
        pytest.skip("vLLM is not installed")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = json.loads(next(line[4:] for line in proc.stdout.splitlines() if line.startswith("OUT ")))
    assert out["vllm"].split("+")[0] == version, f"the child imported vLLM {out['vllm']}, not {version}"
    return out


@pytest.mark.vllm_runtime
def test_validate_environ_knows_our_names_only_after_register(real_vllm: str) -> None:
    out = run_vllm(
        "vllm_env_names.py",
        env={"VLLM_CAMP2P_MULTISTREAM": "1", "VLLM_CAMP2P_MULTISTREAM_BACKEND": "cpu"},
        version=real_vllm,
    )
    assert "VLLM_CAMP2P_MULTISTREAM" in out["before"]
    assert out["after"] == "passed"
    assert out["value"] == "1"  # readable through vLLM's envs module too


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
    monkeypatch: pytest.MonkeyPatch, real_vllm: str, env: dict[str, str], loaded: bool, applied: bool
) -> None:
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)  # the child inherits the rest of this environment
    out = run_vllm("vllm_plugin_loader.py", env=env, version=real_vllm)
    assert out["loaded"] is loaded
    assert out["known"] is loaded  # register() told vLLM about our names
    if loaded:
        assert out["applied"] is applied
        if applied:
            assert out["reason"] == "applied" and out["states"] == ["not-imported-yet"]
            assert out["stack"] == STACK_OF[real_vllm]  # picked from the installed vLLM
        else:
            assert "switched off" in out["reason"]


@pytest.mark.vllm_runtime
@pytest.mark.parametrize("layout", ["compute-side", "comm-side"])
def test_real_vllm_picks_its_stack_and_an_engaged_two_stage_step_equals_serial(real_vllm: str, layout: str) -> None:
    """With the real wheel installed, the entry point applies the stack of
    that vLLM; with that stack's stand-ins (afd-plugin main's runner for
    0.26.0), an engaged 2-stage step is bitwise equal to the serial one and
    runs its layout: the FFN on F and A2E/E2A on C (compute-side, the
    default), or A2E and E2A on the stage streams (comm-side)."""
    stack = STACK_OF[real_vllm]
    out = run_vllm(
        "vllm_engaged_step.py",
        env={
            "VLLM_CAMP2P_MULTISTREAM": "1",
            "VLLM_CAMP2P_MULTISTREAM_BACKEND": "cpu",
            "VLLM_CAMP2P_MULTISTREAM_ADAPTIVE": "0",
            "VLLM_PLUGINS": "camp2p_overlap",
            "STANDIN_STACK": stack,
            "VLLM_CAMP2P_MULTISTREAM_LAYOUT": layout,
        },
        version=real_vllm,
    )
    assert out["stack"] == stack and out["engaged"] is True
    assert out["runner_file"] == ("ffn_model_runner_main.py" if stack == "vllm-0.26.0" else "ffn_model_runner.py")
    assert out["keys_equal"] and out["bitwise"]
    assert out["check"] == "ok"
    streams = {(kind, stream) for kind, stream in out["side"]}
    assert {kind for kind, _ in streams} == {"a2e", "e2a", "ffn"}
    if layout == "compute-side":
        assert streams == {("a2e", "C"), ("e2a", "C"), ("ffn", "F")}, streams
    else:
        assert ("ffn", "C") in streams and all(s != "C" for k, s in streams if k != "ffn"), streams
