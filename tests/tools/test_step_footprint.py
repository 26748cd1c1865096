"""scripts/step_footprint.py: the host code of one engaged step, counted
by core file and function, and refused when the measured step did not
engage."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "step_footprint.py"


def _run(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    out = tmp_path / "fp.json"
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--layers", "2", "--stages", "2", "--json", str(out), *argv],
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_one_engaged_step_is_counted_by_core_file_and_function(tmp_path: Path) -> None:
    run = _run(tmp_path, "--adaptive", "off", "--settle", "1")
    assert run.returncode == 0, run.stdout + run.stderr
    data = json.loads((tmp_path / "fp.json").read_text())
    assert 0 < data["core_files"] <= data["core_functions"] <= data["core_calls"]
    files = {f["file"] for f in data["functions"]}
    assert len(files) == data["core_files"]
    assert any(f.endswith("core/overlap/session.py") for f in files)  # the step engaged: the session ran
    assert "distinct core functions" in run.stdout


def test_a_step_that_cannot_engage_is_refused(tmp_path: Path) -> None:
    """Adaptive engage on with one warm-up step: no decision yet, so the
    script refuses to measure (it never reports a step that did not engage)."""
    run = _run(tmp_path, "--max-warmup", "1")
    assert run.returncode != 0
    assert "did not decide for the overlap" in run.stdout + run.stderr
    assert not (tmp_path / "fp.json").exists()
