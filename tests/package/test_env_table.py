"""The table of environment variables (core.env_vars) is the one source of
load_config, the OverlapConfig defaults, vLLM's env registry, the CLI help
and the README's configuration table: each is checked against it here, and
the re-probe help against what adaptive engage really does."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from support.child import REPO

from camp2p_overlap.core import config, env_vars, plugin
from camp2p_overlap.core.config import ConfigError, OverlapConfig, load_config
from camp2p_overlap.core.env_vars import (
    BY_NAME,
    DEFAULTS,
    ENV_BACKEND,
    ENV_LAYOUT,
    ENV_MODE,
    ENV_REPROBE,
    TABLE,
    EnvVar,
    plain,
)
from camp2p_overlap.core.overlap.adaptive import AdaptiveEngage, AdaptiveSettings, BucketKey
from camp2p_overlap.tools import cli
from camp2p_overlap.tools.docgen import help_listing, markdown_table

BEGIN = re.compile(r"^<!-- BEGIN generated: configuration table( \([^()]*\))? -->$")
END = "<!-- END generated: configuration table -->"
REGENERATE = "regenerate it with `.venv/bin/camp2p-overlap docs`"


def test_the_readme_configuration_table_is_the_generated_one() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").split("\n")
    begins = [i for i, line in enumerate(lines) if BEGIN.match(line)]
    ends = [i for i, line in enumerate(lines) if line == END]
    assert len(begins) == 1 and len(ends) == 1 and begins[0] < ends[0], (
        "README.md lacks one pair of markers '<!-- BEGIN generated: configuration table (camp2p-overlap docs) -->'"
        f" ... '{END}' around its configuration table; add them and {REGENERATE}"
    )
    body = lines[begins[0] + 1 : ends[0]]
    assert body == markdown_table().rstrip("\n").split("\n"), (
        f"README.md's configuration table differs from tools.docgen.markdown_table(): {REGENERATE}"
    )


def test_the_markdown_table_has_one_row_per_variable() -> None:
    rows = [line for line in markdown_table().split("\n") if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == [v.name for v in TABLE]
    for row, v in zip(rows, TABLE, strict=True):
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert cells == [f"`{v.name}`", v.default_text(), v.meaning()]
        assert v.help in cells[2] and (v.kind == "switch" or v.accepted() in cells[2])


def test_the_table_imports_only_the_standard_library() -> None:
    tree = ast.parse(Path(env_vars.__file__).read_text(encoding="utf-8"))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level}
    assert imported and all(m.split(".")[0] in sys.stdlib_module_names for m in imported), imported
    assert not any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(tree))


def test_table_fills_every_config_field_once_and_the_defaults_agree() -> None:
    names = [v.name for v in TABLE]
    assert len(set(names)) == len(names) and all(n.startswith("VLLM_CAMP2P_MULTISTREAM") for n in names)
    fields = [f for f in dataclasses.fields(OverlapConfig) if f.name != "raw"]
    assert [f.name for f in fields] == [v.field for v in TABLE]
    assert {f.name: f.default for f in fields} == DEFAULTS
    cfg = OverlapConfig()
    for v in TABLE:
        assert getattr(cfg, v.field) == v.default, v.name
        v.check(v.default)  # every default lies in its own range
    assert load_config({}) == cfg


def test_config_names_and_help_come_from_the_table() -> None:
    assert list(config.ENV_VARS) == [v.name for v in TABLE]
    assert all(config.ENV_VARS[v.name] == plain(v.meaning()) and v.help for v in TABLE)
    names = {getattr(env_vars, c) for c in dir(env_vars) if re.fullmatch(r"ENV_[A-Z0-9_]+", c)}
    assert [n for n in config.__all__ if n in dir(env_vars)] == []  # config re-exports nothing of the table
    assert names == set(BY_NAME)
    assert typing.get_args(config.Backend) == BY_NAME[ENV_BACKEND].values
    assert typing.get_args(config.Mode) == BY_NAME[ENV_MODE].values == config.MODES
    assert typing.get_args(config.LayoutName) == BY_NAME[ENV_LAYOUT].values == config.LAYOUTS


def test_a_choice_list_is_described_with_its_choices_and_what_a_list_means() -> None:
    v = BY_NAME[ENV_LAYOUT]
    assert v.kind == "choice-list" and v.default == ("compute-side",) and v.values == ("compute-side", "comm-side")
    assert v.default_text() == "`compute-side`" and v.default_text(markdown=False) == "compute-side"
    assert v.accepted().endswith("; or a comma list of them, each once (`compute-side,comm-side`)")
    assert all(f"`{value}` ({meaning})" in v.accepted() for value, meaning in v.choices)
    assert v.meaning() == f"{v.help}: {v.accepted()}: {v.listed}"
    assert [f.name for f in dataclasses.fields(OverlapConfig)].index("layouts") == [t.name for t in TABLE].index(
        ENV_LAYOUT
    )


def _other_value(v: EnvVar) -> tuple[str, Any]:
    """A valid setting of ``v`` that is not its default, as text and as parsed."""
    if v.kind == "switch":
        return ("OFF", False) if v.default else (" Yes ", True)
    if v.kind == "integer":
        value = v.high if v.default != v.high else v.low
        return f" {value} ", value
    if v.kind == "choice":
        value = next(c for c in v.values if c != v.default)
        return value.upper(), value
    if v.kind == "choice-list":
        values = tuple(reversed(v.values))
        return " , ".join(c.title() for c in values), values
    if v.kind == "address":
        return " ::1 ", "::1"
    return "2.5", 2.5


@pytest.mark.parametrize("var", TABLE, ids=lambda v: v.name)
def test_load_config_parses_every_variable_into_its_field(var: EnvVar) -> None:
    text, value = _other_value(var)
    cfg = load_config({var.name: text})
    assert getattr(cfg, var.field) == value != var.default
    assert dict(cfg.raw) == {var.name: text}
    assert dataclasses.replace(cfg, **{var.field: var.default}) == OverlapConfig()  # nothing else changed
    assert getattr(load_config({var.name: "  "}), var.field) == var.default  # blank: the default


def _bad_values(v: EnvVar) -> list[str]:
    if v.kind == "switch":
        return ["maybe", "2", "on please"]
    if v.kind == "integer":
        return ["x", "1.5", str(v.low - 1), str(v.high + 1)]  # type: ignore[operator]
    if v.kind == "choice":
        return ["nope", v.values[0] + "x"]
    if v.kind == "choice-list":
        return ["nope", v.values[0] + "x", f"{v.values[0]},", ",", f"{v.values[0]},{v.values[0].upper()}"]
    if v.kind == "address":
        return ["http://host", "host:80", "[::1]", "1.2.3.999", "-host", "a b", "x" * 64]
    return ["abc", "-1", "inf", "nan"] + ([] if v.low == 0 else ["0"])


BAD = [(v, raw) for v in TABLE for raw in _bad_values(v)]


@pytest.mark.parametrize(("var", "raw"), BAD, ids=[f"{v.name}={raw}" for v, raw in BAD])
def test_a_bad_value_is_a_config_error_naming_the_variable_and_the_value(var: EnvVar, raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({var.name: raw})
    assert var.name in str(info.value) and raw in str(info.value)


@pytest.mark.parametrize("var", [v for v in TABLE if v.kind != "switch"], ids=lambda v: v.name)
def test_an_override_outside_the_range_is_a_config_error(var: EnvVar) -> None:
    bad: Any = {
        "integer": (var.high or 0) + 1,
        "choice": "nope",
        "choice-list": ("nope",),
        "seconds": -1.0,
        "address": "a b",
    }[var.kind]
    with pytest.raises(ConfigError, match=re.escape(var.name)):
        OverlapConfig().with_overrides(**{var.field: bad})


def test_plugin_registers_every_variable_with_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("vllm.envs")
    registry: dict[str, Any] = {}
    fake.environment_variables = registry  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.envs", fake)
    assert plugin.register_env_vars() == [v.name for v in TABLE]
    for v in TABLE:
        monkeypatch.setenv(v.name, "x")
        assert registry[v.name]() == os.environ[v.name] == "x"


def test_the_cli_help_lists_every_variable_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    listing = help_listing()
    for v in TABLE:
        assert f"{v.name} (default {v.default_text(markdown=False)})" in listing
    assert listing.isascii()
    with pytest.raises(SystemExit) as info:
        cli.main(["doctor", "--help"])
    assert info.value.code == 0
    assert listing in capsys.readouterr().out


# ---------------------------------------------------------------------------
# The re-probe help says what adaptive.py does.
def test_the_reprobe_help_quotes_the_adaptive_settings() -> None:
    s = AdaptiveSettings()
    text = BY_NAME[ENV_REPROBE].help
    assert BY_NAME[ENV_REPROBE].default == s.reprobe_every
    assert f"{s.confirm} probes faster by {s.switch_margin * 100:g} % switch it" in text
    assert f"a round slower by {s.backoff_above * 100:g} % doubles the interval, up to {s.max_backoff} times" in text
    assert f"(within {s.close_call * 100:g} %) is probed within {s.close_recheck} steps" in text


def _probe_round(serial_probes: list[float]) -> list[str | None]:
    """Decide a bucket for overlap (1.0 s a step against serial's 2.0 s),
    then run one probe round whose measured serial probes take
    ``serial_probes``; the decision after each measured probe."""
    engage = AdaptiveEngage(AdaptiveSettings(reprobe_every=4))
    key = BucketKey("runner", 2, 4, 64)
    while engage.decision(key) is None:
        path, _, _, _ = engage.choose(key)
        engage.record(key, path, 1.0 if path == "overlap" else 2.0)
    while (path := engage.choose(key)[0]) == "overlap":
        engage.record(key, path, 1.0)
    engage.record(key, path, 9.0)  # the round's warm-up step: its time is dropped
    decisions = []
    for seconds in serial_probes:
        path, probe, _, _ = engage.choose(key)
        if path == "overlap":
            break  # the round has ended
        assert probe
        engage.record(key, path, seconds)
        decisions.append(engage.decision(key))
    return decisions


def test_a_switch_needs_the_median_of_three_probes_not_three_wins_in_a_row() -> None:
    assert _probe_round([0.5, 0.5, 0.5]) == ["overlap", "overlap", "serial"]
    # The second probe alone loses (1.2 s against 1.0 s), yet the median of
    # the three wins: the decision switches.
    assert _probe_round([0.5, 1.2, 0.5]) == ["overlap", "overlap", "serial"]
    # The median of two falls short of 5 %: the round ends, no switch.
    assert _probe_round([0.5, 2.0, 0.5]) == ["overlap", "overlap"]
