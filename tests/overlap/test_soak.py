"""A short run of ``scripts/soak.py`` (the full soak is 10,000 steps; see
docs/validation.md): outputs bitwise equal to the serial path on the
compared steps, every edge held, memory and threads flat - and the
flatness check does fail when something leaks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.child import REPO

from camp2p_overlap.core.env_vars import MAX_STAGES

SOAK = REPO / "scripts" / "soak.py"


def _soak(tmp_path: Path, *extra: str) -> tuple[int, dict, str]:
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(SOAK), "--steps", "300", "--sample-every", "10", "--json", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(REPO),
    )
    assert out.exists(), proc.stdout + proc.stderr
    return proc.returncode, json.loads(out.read_text()), proc.stdout + proc.stderr


def test_short_soak_is_equal_and_flat(tmp_path: Path) -> None:
    rc, s, text = _soak(tmp_path)
    assert rc == 0, text
    assert s["ok"] is True
    assert s["steps"] == 300
    assert s["compared"] >= 40
    assert s["mismatches"] == [] and s["edge_violations"] == []
    assert s["overlap_steps"] > 200 and s["serial_gate_steps"] > 0
    flat = {f["metric"]: f for f in s["flatness"]}
    assert set(flat) == {"traced_bytes", "rss_bytes", "threads"}
    assert all(f["ok"] for f in flat.values()), flat
    # Per runner of a multi-stage world, one stream thread per stage id it may see (K0..K2) and the FFN
    # stream F (compute-side's), whichever layout its steps ran; none after unpatch.
    multi = sum(1 for w in s["worlds"] if len(w["stages"]) > 1)
    assert s["stream_threads_end"] == (MAX_STAGES + 1) * multi
    assert s["stream_threads_after_unpatch"] == 0
    assert len(s["samples"]) >= 15


def test_the_flatness_check_catches_a_leak(tmp_path: Path) -> None:
    rc, s, text = _soak(tmp_path, "--leak-bytes-per-step", "4096")
    assert rc == 1, text
    flat = {f["metric"]: f for f in s["flatness"]}
    assert flat["traced_bytes"]["ok"] is False
    assert flat["traced_bytes"]["growth"] > 256 * 1024
    assert "NOT FLAT" in text
    assert s["mismatches"] == []  # the leak is the only thing wrong
