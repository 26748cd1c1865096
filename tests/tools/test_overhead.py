"""``camp2p-overlap overhead`` times our code alone: a known cost outside
it cancels out, a known cost inside it shows, and every step takes the
path the harness says it measures. Behaviour only: no timing goal here
(the figures belong to the command's own output)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from camp2p_overlap.core.overlap.session import OverlapSession
from camp2p_overlap.emulation.noop import busy_wait
from camp2p_overlap.tools import overhead
from camp2p_overlap.tools.cli import main
from camp2p_overlap.tools.overhead import OverheadParams, measure_overhead

DELAY_US = 400.0


def _small(**changes: Any) -> OverheadParams:
    return OverheadParams(layers=(4,), stages=(2,), steps=20, warmup=2, rounds=3, **changes)


def test_a_delay_outside_our_code_is_subtracted() -> None:
    result = measure_overhead(_small(delay_us=DELAY_US))
    (shape,) = result["shapes"]
    # The unpatched loop pays the delay in every receive ...
    assert shape["unpatched_us_per_layer_stage"] >= DELAY_US
    # ... and so does every patched step: it is not counted as ours (were it
    # counted, the figures would exceed DELAY_US per (layer, stage), and
    # DELAY_US * 8 / 17 per wrapped call; the margins absorb a busy machine).
    assert result["engaged_us_per_layer_stage"]["median"] < DELAY_US * 0.75
    assert result["passthrough_us_per_call"]["median"] < DELAY_US / 4


def test_a_delay_inside_our_code_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    original = OverlapSession.recv

    def slow_recv(self: OverlapSession, *args: Any, **kwargs: Any) -> Any:
        busy_wait(DELAY_US / 1e6)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(OverlapSession, "recv", slow_recv)
    result = measure_overhead(_small())
    assert result["engaged_us_per_layer_stage"]["median"] >= DELAY_US * 0.9
    # The pass-through path opens no session: the delay is not there.
    assert result["passthrough_us_per_call"]["median"] < DELAY_US / 4


def test_the_paths_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A harness whose pass-through engine engages would time the wrong path: it refuses."""
    monkeypatch.setattr(overhead, "_passthrough_config", overhead._engaged_config)
    monkeypatch.setattr(overhead, "_decide_serial", lambda layer, world: None)
    with pytest.raises(RuntimeError, match="not taken as planned"):
        measure_overhead(_small())


def test_cli_writes_the_documented_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "overhead.json"
    argv = ["overhead", "--layers", "2,3", "--stages", "1,2", "--steps", "6", "--rounds", "1", "--json", str(path)]
    assert main(argv) == 0
    data = json.loads(path.read_text())
    assert data["schema"] == "camp2p-overlap/overhead/v1"
    for key in ("engaged_us_per_layer_stage", "passthrough_us_per_call"):
        assert set(data[key]) == {"median", "p90", "samples"}
        assert data[key]["p90"] >= data[key]["median"]
    assert [(s["layers"], s["stages"]) for s in data["shapes"]] == [(2, 1), (2, 2), (3, 1), (3, 2)]
    assert data["shapes"][3]["wrapped_calls_per_step"] == 1 + 2 * 3 * 2
    assert data["engaged_us_per_layer_stage"]["samples"] == 4 * 6
    out = capsys.readouterr().out
    assert "us per (layer, stage)" in out and "JSON:" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--stages", "4"], "stage counts must lie in 1..3"),
        (["--layers", "0"], "layer counts must be >= 1"),
        (["--steps", "2"], "need steps >= 5"),
        (["--delay-us", "-1"], "delay_us must be >= 0"),
    ],
)
def test_cli_refuses_bad_values(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["overhead", *argv]) == 2
    assert message in capsys.readouterr().err
