"""The step metrics: the opt-in per-process endpoint scraped for real (an
HTTP GET over loopback, parsed with prometheus_client's own text parser),
the counters reaching vLLM's multi-process ``/metrics`` registry through
PROMETHEUS_MULTIPROC_DIR, vLLM-style names, bounded reason labels, and the
one-line summary."""

from __future__ import annotations

import json
import logging
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.child import run_program
from support.logs import PackageLogs
from support.overlap import Schedule, bounded, run_step, world

import camp2p_overlap
from camp2p_overlap.core import layer as process
from camp2p_overlap.core.config import ENV_METRICS_PORT, ENV_SUMMARY, ConfigError, OverlapConfig, load_config
from camp2p_overlap.core.layer import LAYER
from camp2p_overlap.core.observe import metrics


@pytest.fixture
def fresh_reporting() -> Iterator[None]:
    """No reporter running; the process layer starts one on its next step."""
    process.reset_reporting()
    yield
    process.reset_reporting()


def scrape(port: int) -> dict[str, Any]:
    """GET /metrics over loopback; the families parsed by prometheus_client."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(family: Any, label: str) -> dict[str, float]:
    return {s.labels[label]: s.value for s in family.samples if s.name.endswith("_total")}


def test_endpoint_is_scraped_over_loopback(fresh_reporting: None) -> None:
    w = world(layers=2, stage_ids=(0, 1))
    LAYER.engine.apply(
        strict=True, config=OverlapConfig(enabled=True, backend="cpu", adaptive=False, metrics_port=0, summary_s=0)
    )
    bounded(lambda: run_step(w))  # the first step starts the reporter
    reporter = metrics.current_reporter()
    assert reporter is not None and reporter.port, "no endpoint started"
    bounded(lambda: run_step(w, Schedule(2, (0,), (4,), 2)))  # one stage: serial
    fams = scrape(reporter.port)
    stats = camp2p_overlap.stats()
    assert samples(fams["vllm:camp2p_overlap_steps"], "path") == {k: float(v) for k, v in stats["steps"].items()}
    assert fams["vllm:camp2p_overlap_steps"].type == "counter"
    serial = samples(fams["vllm:camp2p_overlap_serial_steps"], "reason")
    assert serial == {k: float(v) for k, v in stats["serial_reasons"].items()}
    assert "1 stage(s), fewer than the minimum 2" in serial
    info = {(s.labels["mode"], s.labels["rung"]): s.value for s in fams["vllm:camp2p_overlap_mode_info"].samples}
    assert info == {("overlap", "overlap"): 1.0}
    # A scrape serves the counts of that moment.
    before = stats["steps"]["overlap"]
    bounded(lambda: run_step(w))
    assert samples(scrape(reporter.port)["vllm:camp2p_overlap_steps"], "path")["overlap"] == before + 1


def test_no_endpoint_unless_asked(fresh_reporting: None) -> None:
    w = world(layers=2, stage_ids=(0, 1))
    LAYER.engine.apply(strict=True, config=OverlapConfig(enabled=True, backend="cpu", adaptive=False, summary_s=0))
    bounded(lambda: run_step(w))
    reporter = metrics.current_reporter()
    assert reporter is not None and reporter.server is None and reporter.port is None


def test_names_follow_vllms_conventions() -> None:
    m = metrics.StepMetrics(lambda: {"steps": {"overlap": 2, "serial": 1}, "serial_reasons": {"why": 1}})
    from prometheus_client import generate_latest

    # prometheus_client adds a ``_created`` series per counter (vLLM keeps them too).
    fams = [
        f
        for f in text_string_to_metric_families(generate_latest(m.registry).decode())
        if not f.name.endswith("_created")
    ]
    assert {f.name for f in fams} == {metrics.STEPS, metrics.SERIAL_STEPS, metrics.MODE_INFO}
    for f in fams:
        assert f.name.startswith("vllm:") and f.name == f.name.lower() and " " not in f.name
        assert f.documentation
    steps = next(f for f in fams if f.name == metrics.STEPS)
    assert {s.name for s in steps.samples} >= {"vllm:camp2p_overlap_steps_total"}
    assert samples(steps, "path") == {"overlap": 2.0, "parity": 0.0, "reorder": 0.0, "serial": 1.0}


def test_reason_labels_are_bounded() -> None:
    reasons = {f"reason {i}": 1 for i in range(metrics.MAX_REASONS + 8)}
    m = metrics.StepMetrics(lambda: {"steps": {"serial": len(reasons)}, "serial_reasons": reasons})
    m.sync()
    m.sync()  # idempotent: nothing new counted
    from prometheus_client import generate_latest

    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(m.registry).decode())}
    got = samples(fams[metrics.SERIAL_STEPS], "reason")
    assert len(got) == metrics.MAX_REASONS + 1
    assert got[metrics.OTHER_REASON] == 8.0
    assert sum(got.values()) == len(reasons)
    # A reason counted under "other" stays there when it comes again later.
    reasons[f"reason {metrics.MAX_REASONS}"] += 1
    m.sync()
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(m.registry).decode())}
    got = samples(fams[metrics.SERIAL_STEPS], "reason")
    assert len(got) == metrics.MAX_REASONS + 1 and got[metrics.OTHER_REASON] == 9.0


def test_a_port_in_use_is_logged_not_raised(logs: PackageLogs) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = metrics.Reporter(lambda: {}, port=port, summary_s=0, addr="127.0.0.1")
        try:
            assert r.server is None and r.port is None
        finally:
            r.close()
    assert any("metrics endpoint not started" in m and str(port) in m for m in logs.messages)


def test_summary_line_is_logged_when_counts_change(logs: PackageLogs) -> None:
    counts = {"steps": {"overlap": 3, "parity": 0, "reorder": 0, "serial": 1}, "serial_reasons": {"switched off": 1}}
    r = metrics.Reporter(lambda: counts, port=None, summary_s=0)
    try:
        assert r.log_summary()
        assert not r.log_summary()  # unchanged: nothing logged
        counts["steps"] = {**counts["steps"], "overlap": 5}
        assert r.log_summary()
    finally:
        r.close()
    lines = logs.texts("camp2p-overlap steps:", logging.INFO)
    assert lines == [
        "camp2p-overlap steps: overlap=3 parity=0 reorder=0 serial=1; top serial reason (1): switched off",
        "camp2p-overlap steps: overlap=5 (+2) parity=0 reorder=0 serial=1; top serial reason (1): switched off",
    ]


def test_summary_thread_logs_periodically(logs: PackageLogs) -> None:
    import time

    counts = {"steps": {"overlap": 1}, "serial_reasons": {}}
    r = metrics.Reporter(lambda: counts, port=None, summary_s=0.05)
    try:
        deadline = time.monotonic() + 10
        while not logs.texts("camp2p-overlap steps:") and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        r.close()
    assert logs.texts("camp2p-overlap steps: overlap=1")


def test_port_and_summary_settings_are_validated() -> None:
    assert load_config({ENV_METRICS_PORT: "9400"}).metrics_port == 9400
    assert load_config({}).metrics_port is None
    assert load_config({ENV_SUMMARY: "0"}).summary_s == 0
    for bad in ("http", "-1", "70000"):
        with pytest.raises(ConfigError, match=ENV_METRICS_PORT):
            load_config({ENV_METRICS_PORT: bad})
    for bad in ("soon", "-5", "inf"):
        with pytest.raises(ConfigError, match=ENV_SUMMARY):
            load_config({ENV_SUMMARY: bad})


@pytest.mark.vllm_runtime
def test_worker_counters_reach_vllms_multiprocess_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker process with PROMETHEUS_MULTIPROC_DIR (as vLLM sets it for
    several API servers) writes our counters where vLLM's own ``/metrics``
    registry (vllm.v1.metrics.prometheus.get_prometheus_registry) reads."""
    prom = pytest.importorskip("vllm.v1.metrics.prometheus", reason="the real vLLM 0.19.1 wheel is not installed")
    env = {
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
        "VLLM_CAMP2P_MULTISTREAM": "1",
        "VLLM_CAMP2P_MULTISTREAM_BACKEND": "cpu",
        "VLLM_CAMP2P_MULTISTREAM_ADAPTIVE": "0",
        "VLLM_CAMP2P_MULTISTREAM_MODE": "reorder",
    }
    out = run_program("metrics_worker.py", env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = json.loads(out.stdout.split("STATS=")[1].splitlines()[0])
    assert steps["reorder"] == 3
    assert list(tmp_path.glob("counter_*.db")), "no multi-process counter file written"
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    from prometheus_client import generate_latest

    registry = prom.get_prometheus_registry()
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    assert samples(fams["vllm:camp2p_overlap_steps"], "path") == {k: float(v) for k, v in steps.items()}
    info = fams["vllm:camp2p_overlap_mode_info"]
    assert any(s.labels.get("mode") == "reorder" and s.value == 1.0 for s in info.samples)
