"""The environment: every VLLM_CAMP2P_* variable parsed, every bad value a
ConfigError naming the variable and the value (every malformed variable at
once); apply() and doctor report them instead of raising unless strict."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

import camp2p_overlap
from camp2p_overlap.core import config
from camp2p_overlap.core.config import ENV_VARS, ConfigError, OverlapConfig, load_config
from camp2p_overlap.core.env_vars import (
    DEFAULT_WATCHDOG_S,
    ENV_A2E,
    ENV_ADAPTIVE,
    ENV_BACKEND,
    ENV_E2A,
    ENV_GRAPH,
    ENV_GRAPH_COMM_SIDE,
    ENV_GROUP_TIMEOUT,
    ENV_LAYOUT,
    ENV_METRICS_ADDR,
    ENV_METRICS_PORT,
    ENV_MIN_STAGES,
    ENV_MODE,
    ENV_MOE_CORES,
    ENV_REPROBE,
    ENV_STRICT,
    ENV_SUMMARY,
    ENV_SWITCH,
    ENV_VECTOR_CORES,
    ENV_WATCHDOG,
)
from camp2p_overlap.core.log import logger
from camp2p_overlap.core.patch_layer import PATCH_LAYER
from camp2p_overlap.tools.doctor import diagnose, doctor_text

PACKAGE = Path(camp2p_overlap.__file__).resolve().parent


def test_defaults_from_an_empty_environment() -> None:
    cfg = load_config({})
    assert cfg == OverlapConfig()
    assert cfg.enabled is False and cfg.a2e_on_side_stream and cfg.e2a_on_side_stream
    assert cfg.min_stages == 2 and cfg.graph == "0" and cfg.backend == "auto"
    assert cfg.strict is False and cfg.watchdog_s == DEFAULT_WATCHDOG_S == 60.0 and dict(cfg.raw) == {}
    assert cfg.layouts == ("compute-side",) and cfg.graph_comm_side is False


@pytest.mark.parametrize("raw", ["0", "0.0", "off", " OFF ", "Off"])
def test_the_watchdog_is_on_by_default_and_0_or_off_turns_it_off(raw: str) -> None:
    assert load_config({}).watchdog_s == DEFAULT_WATCHDOG_S
    assert load_config({ENV_WATCHDOG: raw}).watchdog_s == 0.0
    assert load_config({ENV_WATCHDOG: "2.5"}).watchdog_s == 2.5


def test_unrelated_variables_are_ignored() -> None:
    assert load_config({"VLLM_OTHER": "x", "VLLM_CAMP2P_UNKNOWN_BUT_NOT_OURS": "x"}) == OverlapConfig()


@pytest.mark.parametrize(("raw", "value"), [("1", True), ("TRUE", True), (" on ", True), ("Yes", True), ("0", False)])
def test_booleans(raw: str, value: bool) -> None:
    for name, field in ((ENV_SWITCH, "enabled"), (ENV_A2E, "a2e_on_side_stream")):
        assert getattr(load_config({name: raw}), field) is value
    # GRAPH is a choice (0, 1, adaptive) that also reads the switch spellings.
    assert load_config({ENV_GRAPH: raw}).graph == ("1" if value else "0")
    assert load_config({ENV_E2A: raw}).e2a_on_side_stream is value
    assert load_config({ENV_STRICT: raw}).strict is value
    assert load_config({ENV_GRAPH_COMM_SIDE: raw}).graph_comm_side is value
    assert load_config({ENV_SWITCH: ""}).enabled is False  # empty: the default


def test_every_field_from_the_environment() -> None:
    env = {
        ENV_SWITCH: "on",
        ENV_A2E: "off",
        ENV_E2A: "no",
        ENV_MIN_STAGES: " 3 ",
        ENV_GRAPH: "yes",
        ENV_GRAPH_COMM_SIDE: "on",
        ENV_BACKEND: "CPU",
        ENV_STRICT: "true",
        ENV_WATCHDOG: "2.5",
        ENV_GROUP_TIMEOUT: " 7.5",
        ENV_ADAPTIVE: "Off",
        ENV_REPROBE: " 128",
        ENV_MODE: "Reorder",
        ENV_LAYOUT: " Comm-Side , compute-side ",
        ENV_METRICS_PORT: "9400",
        ENV_METRICS_ADDR: " 0.0.0.0 ",
        ENV_SUMMARY: "15",
    }
    cfg = load_config(env)
    assert cfg == OverlapConfig(
        enabled=True,
        a2e_on_side_stream=False,
        e2a_on_side_stream=False,
        min_stages=3,
        graph=True,
        graph_comm_side=True,
        backend="cpu",
        strict=True,
        watchdog_s=2.5,
        group_timeout_s=7.5,
        adaptive=False,
        reprobe_every=128,
        mode="reorder",
        layouts=("comm-side", "compute-side"),
        metrics_port=9400,
        metrics_addr="0.0.0.0",
        summary_s=15.0,
    )
    assert dict(cfg.raw) == env


BAD = [
    (ENV_SWITCH, "maybe"),
    (ENV_SWITCH, "2"),
    (ENV_A2E, "yes please"),
    (ENV_E2A, "enable"),
    (ENV_MIN_STAGES, "two"),
    (ENV_MIN_STAGES, "2.0"),
    (ENV_MIN_STAGES, "0"),
    (ENV_MIN_STAGES, "4"),
    (ENV_MIN_STAGES, "-1"),
    (ENV_GRAPH, "nah"),
    (ENV_GRAPH_COMM_SIDE, "capture"),
    (ENV_BACKEND, "tpu"),
    (ENV_BACKEND, "npu0"),
    (ENV_STRICT, "sure"),
    (ENV_WATCHDOG, "abc"),
    (ENV_WATCHDOG, "no"),
    (ENV_WATCHDOG, "-1"),
    (ENV_WATCHDOG, "nan"),
    (ENV_WATCHDOG, "inf"),
    (ENV_GROUP_TIMEOUT, "soon"),
    (ENV_GROUP_TIMEOUT, "0"),
    (ENV_GROUP_TIMEOUT, "-5"),
    (ENV_VECTOR_CORES, "forty-eight"),
    (ENV_VECTOR_CORES, "0"),
    (ENV_MOE_CORES, "4097"),
    (ENV_MOE_CORES, "-8"),
    (ENV_ADAPTIVE, "auto"),
    (ENV_REPROBE, "sixty-four"),
    (ENV_REPROBE, "1"),
    (ENV_REPROBE, "0"),
    (ENV_REPROBE, "2000000"),
    (ENV_MODE, "fast"),
    (ENV_MODE, "serial"),
    (ENV_LAYOUT, "ffn-side"),
    (ENV_LAYOUT, "compute-side,"),
    (ENV_LAYOUT, "comm-side,comm-side"),
    (ENV_METRICS_PORT, "http"),
    (ENV_METRICS_PORT, "65536"),
    (ENV_METRICS_PORT, "-1"),
    (ENV_METRICS_ADDR, "http://0.0.0.0"),
    (ENV_METRICS_ADDR, "0.0.0.0:9400"),
    (ENV_METRICS_ADDR, "256.1.1.1"),
    (ENV_METRICS_ADDR, "my_host"),
    (ENV_SUMMARY, "often"),
    (ENV_SUMMARY, "-1"),
    (ENV_SUMMARY, "nan"),
]


def test_bad_values_cover_every_variable() -> None:
    assert {name for name, _ in BAD} == set(ENV_VARS)


@pytest.mark.parametrize(("name", "raw"), BAD)
def test_bad_value_is_a_config_error_naming_variable_and_value(name: str, raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({ENV_SWITCH: "1", name: raw} if name != ENV_SWITCH else {name: raw})
    msg = str(info.value)
    assert name in msg
    assert raw in msg


def test_overrides_are_range_checked() -> None:
    cfg = OverlapConfig(enabled=True)
    assert cfg.with_overrides(min_stages=3).min_stages == 3
    with pytest.raises(ConfigError, match=ENV_MIN_STAGES):
        cfg.with_overrides(min_stages=0)
    with pytest.raises(ConfigError, match=ENV_BACKEND):
        cfg.with_overrides(backend="tpu")


# ---------------------------------------------------------------------------
# VLLM_CAMP2P_MULTISTREAM_LAYOUT: one layout or a comma list of distinct layouts
ACCEPTED = "(accepted: one of compute-side, comm-side, or a comma list of them, each at most once)"


@pytest.mark.parametrize(
    ("raw", "layouts"),
    [
        ("compute-side", ("compute-side",)),
        ("comm-side", ("comm-side",)),
        (" COMM-SIDE ", ("comm-side",)),
        ("compute-side,comm-side", ("compute-side", "comm-side")),
        ("comm-side,compute-side", ("comm-side", "compute-side")),  # the order is kept: the first is the graphs'
        (" Comm-Side ,\tcompute-SIDE ", ("comm-side", "compute-side")),
        ("", ("compute-side",)),  # empty: the default
        ("  ", ("compute-side",)),
    ],
)
def test_layouts(raw: str, layouts: tuple[str, ...]) -> None:
    assert load_config({ENV_LAYOUT: raw}).layouts == layouts
    assert OverlapConfig().with_overrides(layouts=layouts).layouts == layouts


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        ("ffn-side", "unknown value 'ffn-side'"),
        ("compute", "unknown value 'compute'"),
        ("compute-side;comm-side", "unknown value 'compute-side;comm-side'"),
        ("compute-side, Bogus ", "unknown value 'Bogus'"),
        ("compute-side,", "has an empty item"),
        (",comm-side", "has an empty item"),
        (",", "has an empty item"),
        ("compute-side,,comm-side", "has an empty item"),
        ("compute-side, ,comm-side", "has an empty item"),
        ("comm-side,comm-side", "lists 'comm-side' twice"),
        ("comm-side, COMM-SIDE ", "lists 'comm-side' twice"),
        ("compute-side,comm-side,Compute-Side", "lists 'compute-side' twice"),
    ],
)
def test_a_bad_layout_names_the_variable_the_value_and_what_is_accepted(raw: str, why: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({ENV_LAYOUT: raw})
    assert str(info.value) == f"{ENV_LAYOUT}={raw!r}{':' if 'unknown' in why else ''} {why} {ACCEPTED}"
    assert info.value.problems == [str(info.value)]


@pytest.mark.parametrize(
    ("layouts", "why"),
    [
        ("comm-side", "is not a tuple of values"),
        (["comm-side"], "is not a tuple of values"),
        ((), "is empty"),
        (("Comm-Side",), "unknown value 'Comm-Side'"),
        (("comm-side", "bogus"), "unknown value 'bogus'"),
        (("comm-side", "comm-side"), "lists 'comm-side' twice"),
    ],
)
def test_layout_overrides_are_checked(layouts: object, why: str) -> None:
    with pytest.raises(ConfigError) as info:
        OverlapConfig().with_overrides(layouts=layouts)
    assert str(info.value).startswith(f"{ENV_LAYOUT}={layouts!r}") and why in str(info.value)
    assert ACCEPTED in str(info.value)


# ---------------------------------------------------------------------------
# Every malformed variable named at once
TWO_BAD = {ENV_MODE: "bogus", ENV_REPROBE: "-3"}
TWO_PROBLEMS = [
    f"{ENV_REPROBE}=-3 is out of range 2..1000000",
    f"{ENV_MODE}='bogus' is not one of overlap, reorder, parity",
]


def test_load_config_names_every_malformed_variable_in_table_order() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({ENV_SWITCH: "1", **TWO_BAD})
    assert info.value.problems == TWO_PROBLEMS  # the table's order, not the environment's
    assert str(info.value) == "; ".join(TWO_PROBLEMS)
    # A parse error and a range error of other variables, and one per variable.
    with pytest.raises(ConfigError) as info:
        load_config({ENV_SWITCH: "maybe", ENV_MIN_STAGES: "9", ENV_LAYOUT: "x,x", ENV_SUMMARY: "often"})
    names = [p.split("=", 1)[0] for p in info.value.problems]
    assert names == [ENV_SWITCH, ENV_MIN_STAGES, ENV_LAYOUT, ENV_SUMMARY]


def test_overrides_name_every_field_out_of_range() -> None:
    with pytest.raises(ConfigError) as info:
        OverlapConfig().with_overrides(reprobe_every=-3, mode="bogus")
    assert info.value.problems == TWO_PROBLEMS


def test_a_config_error_of_one_message() -> None:
    assert ConfigError("x is bad").problems == ["x is bad"] and str(ConfigError("x is bad")) == "x is bad"


def test_doctor_names_every_malformed_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    for name, raw in TWO_BAD.items():
        monkeypatch.setenv(name, raw)
    d = diagnose()
    assert d["config"]["ok"] is False and d["config"]["error"] == "; ".join(TWO_PROBLEMS)
    assert [p for p in d["problems"] if p.startswith("configuration:")] == [f"configuration: {p}" for p in TWO_PROBLEMS]
    lines = doctor_text(d).split("\n")
    for problem in TWO_PROBLEMS:
        assert f"  - configuration: {problem}" in lines  # one line each


def test_every_variable_the_package_reads_is_declared() -> None:
    used: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        used |= set(re.findall(r"VLLM_CAMP2P_[A-Z0-9_]*[A-Z0-9]", path.read_text(encoding="utf-8")))
    assert used, "no VLLM_CAMP2P_ variable found in the package"
    assert used <= set(ENV_VARS), used - set(ENV_VARS)
    assert all(name.startswith("VLLM_CAMP2P_") and ENV_VARS[name] for name in ENV_VARS)


# ---------------------------------------------------------------------------
# apply() with a bad environment
@pytest.fixture
def errors() -> Iterator[list[logging.LogRecord]]:
    records: list[logging.LogRecord] = []

    class _H(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    h = _H(logging.ERROR)
    logger.addHandler(h)
    try:
        yield records
    finally:
        logger.removeHandler(h)


@pytest.mark.parametrize(("name", "raw"), BAD)
def test_apply_reports_a_bad_value_instead_of_raising(
    monkeypatch: pytest.MonkeyPatch, errors: list[logging.LogRecord], name: str, raw: str
) -> None:
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(ENV_SWITCH, "1")
    monkeypatch.setenv(name, raw)
    report = camp2p_overlap.apply()
    assert not report.applied and not PATCH_LAYER.engine.is_applied()
    assert report.reason.startswith("configuration error") and name in report.reason and raw in report.reason
    assert len(errors) == 1 and name in errors[0].getMessage()
    # Strict by argument, or by the environment (unless the strict switch itself is the bad one).
    with pytest.raises(ConfigError, match=re.escape(name)):
        camp2p_overlap.apply(strict=True)
    if name != ENV_STRICT:
        monkeypatch.setenv(ENV_STRICT, "1")
        with pytest.raises(ConfigError, match=re.escape(name)):
            camp2p_overlap.apply()
    assert not PATCH_LAYER.engine.is_applied()


def test_apply_names_every_malformed_variable(monkeypatch: pytest.MonkeyPatch, errors: list[logging.LogRecord]) -> None:
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(ENV_SWITCH, "1")
    for name, raw in TWO_BAD.items():
        monkeypatch.setenv(name, raw)
    report = camp2p_overlap.apply()
    assert not report.applied and not PATCH_LAYER.engine.is_applied()
    assert report.reason == f"configuration error: {'; '.join(TWO_PROBLEMS)}"
    assert len(errors) == 1 and all(p in errors[0].getMessage() for p in TWO_PROBLEMS)
    monkeypatch.setenv(ENV_STRICT, "1")  # strict is still read beside the malformed variables
    with pytest.raises(ConfigError) as info:
        camp2p_overlap.apply()
    assert info.value.problems == TWO_PROBLEMS and not PATCH_LAYER.engine.is_applied()


def test_bad_value_after_apply_keeps_the_layer_applied(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(ENV_SWITCH, "1")
    assert camp2p_overlap.apply().applied
    monkeypatch.setenv(ENV_MIN_STAGES, "nine")
    report = camp2p_overlap.apply()
    assert report.applied and report.reason == "applied" and PATCH_LAYER.engine.is_applied()


def test_strict_requested_tolerates_other_bad_values() -> None:
    assert config.strict_requested({ENV_STRICT: "1", ENV_BACKEND: "tpu"}) is True
    assert config.strict_requested({ENV_STRICT: "on", **TWO_BAD, ENV_LAYOUT: ","}) is True
    assert config.strict_requested({ENV_STRICT: "bogus"}) is False
    assert config.strict_requested({}) is False
