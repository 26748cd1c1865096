"""The step metrics: the opt-in per-process endpoint scraped for real (an
HTTP GET over loopback, parsed with prometheus_client's own text parser)
on the address configured (loopback by default), the counters reaching
vLLM's multi-process ``/metrics`` registry through PROMETHEUS_MULTIPROC_DIR,
vLLM-style names, bounded reason labels, engaged steps counted per layout
(``stats()["layout_steps"]``), decode-graph replays counted per variant,
the one-line summary, a forked child starting from zero, and the
scrape and summary never touching a device event."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.child import run_forked, run_program
from support.logs import PackageLogs
from support.overlap import Schedule, bounded, run_step, world

import camp2p_overlap
from camp2p_overlap.core import patch_layer as process
from camp2p_overlap.core.config import ConfigError, OverlapConfig, load_config
from camp2p_overlap.core.env_vars import ENV_METRICS_ADDR, ENV_METRICS_PORT, ENV_SUMMARY
from camp2p_overlap.core.observe import metrics
from camp2p_overlap.core.observe.counters import StepCounters
from camp2p_overlap.core.patch_layer import PATCH_LAYER


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


def families(m: metrics.StepMetrics) -> dict[str, Any]:
    """``m``'s registry as a scrape would read it."""
    from prometheus_client import generate_latest

    return {f.name: f for f in text_string_to_metric_families(generate_latest(m.registry).decode())}


def test_endpoint_is_scraped_over_loopback(fresh_reporting: None) -> None:
    w = world(layers=2, stage_ids=(0, 1))
    PATCH_LAYER.engine.apply(
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
    info = {
        (s.labels["mode"], s.labels["rung"], s.labels["layouts"]): s.value
        for s in fams["vllm:camp2p_overlap_mode_info"].samples
    }
    assert info == {("overlap", "compute-side", "compute-side"): 1.0}  # the default layout
    # A scrape serves the counts of that moment.
    before = stats["steps"]["overlap"]
    bounded(lambda: run_step(w))
    assert samples(scrape(reporter.port)["vllm:camp2p_overlap_steps"], "path")["overlap"] == before + 1
    # Graph replays, per variant, next to (not inside) the eager steps.
    steps_before, replays_before = camp2p_overlap.stats()["steps"], camp2p_overlap.stats()["graph_replays"]
    for variant in ("serial", "overlap", "overlap"):
        PATCH_LAYER.runtime.counters.graph_replay(variant)
    fams = scrape(reporter.port)
    replays = samples(fams["vllm:camp2p_overlap_graph_replays"], "variant")
    assert fams["vllm:camp2p_overlap_graph_replays"].type == "counter"
    assert replays == {k: float(v) for k, v in camp2p_overlap.stats()["graph_replays"].items()}
    assert replays == {"serial": replays_before["serial"] + 1.0, "overlap": replays_before["overlap"] + 2.0}
    assert camp2p_overlap.stats()["steps"] == steps_before


def test_stats_count_engaged_steps_per_layout(fresh_reporting: None) -> None:
    """``stats()["layout_steps"]``: each engaged step under the layout it ran (compute-side by default, comm-side
    and its switched variants where listed, parity and reorder as their own), a serial step under none."""
    w = world(layers=2, stage_ids=(0, 1))
    runs = [
        ({}, "overlap", "compute-side", 2),
        ({"layouts": ("comm-side",)}, "overlap", "comm-side", 1),
        ({"layouts": ("comm-side",), "a2e_on_side_stream": False}, "overlap", "e2a-only", 1),
        ({"layouts": ("comm-side",), "e2a_on_side_stream": False}, "overlap", "a2e-only", 2),
        ({"mode": "reorder"}, "reorder", "reorder", 1),
        ({"mode": "parity"}, "parity", "parity", 1),
    ]
    for overrides, mode, layout, n in runs:
        cfg = OverlapConfig(enabled=True, backend="cpu", adaptive=False, summary_s=0, **overrides)
        assert PATCH_LAYER.engine.unpatch(timeout=10)  # an applied engine keeps its config
        PATCH_LAYER.engine.apply(strict=True, config=cfg)
        before = camp2p_overlap.stats()
        for _ in range(n):
            bounded(lambda: run_step(w))
        bounded(lambda: run_step(w, Schedule(2, (0,), (4,), 2)))  # one stage: serial, under no layout
        after = camp2p_overlap.stats()
        grown = {
            name: count - before["layout_steps"].get(name, 0)
            for name, count in after["layout_steps"].items()
            if count != before["layout_steps"].get(name, 0)
        }
        assert grown == {layout: n}, (overrides, before["layout_steps"], after["layout_steps"])
        assert after["steps"][mode] - before["steps"][mode] == n
        assert after["steps"]["serial"] - before["steps"]["serial"] == 1


def test_no_endpoint_unless_asked(fresh_reporting: None) -> None:
    w = world(layers=2, stage_ids=(0, 1))
    PATCH_LAYER.engine.apply(
        strict=True, config=OverlapConfig(enabled=True, backend="cpu", adaptive=False, summary_s=0)
    )
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
    assert {f.name for f in fams} == {
        metrics.STEPS,
        metrics.SERIAL_STEPS,
        metrics.GRAPH_REPLAYS,
        metrics.LAYOUT_STEPS,
        metrics.LAYOUT_GRAPH_REPLAYS,
        metrics.MODE_INFO,
        metrics.GROUP_INFO,
    }
    for f in fams:
        assert f.name.startswith("vllm:") and f.name == f.name.lower() and " " not in f.name
        assert f.documentation
    steps = next(f for f in fams if f.name == metrics.STEPS)
    assert {s.name for s in steps.samples} >= {"vllm:camp2p_overlap_steps_total"}
    assert samples(steps, "path") == {"overlap": 2.0, "parity": 0.0, "reorder": 0.0, "serial": 1.0}
    replays = next(f for f in fams if f.name == metrics.GRAPH_REPLAYS)
    assert {s.name for s in replays.samples} >= {"vllm:camp2p_overlap_graph_replays_total"}
    assert samples(replays, "variant") == {"serial": 0.0, "overlap": 0.0}  # both exported, 0 until used


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


def test_summary_line_includes_graph_replays(logs: PackageLogs) -> None:
    counts: dict[str, Any] = {
        "steps": {"overlap": 0, "parity": 0, "reorder": 0, "serial": 2},
        "serial_reasons": {"switched off": 2},
        "graph_replays": {"serial": 0, "overlap": 0},
    }
    r = metrics.Reporter(lambda: counts, port=None, summary_s=0)
    try:
        assert r.log_summary()
        # A decoding server on graphs: only its replays change, and that is news.
        counts["graph_replays"] = {"serial": 3, "overlap": 7}
        assert r.log_summary()
        assert not r.log_summary()
        counts["graph_replays"] = {"serial": 3, "overlap": 10}
        assert r.log_summary()
    finally:
        r.close()
    assert logs.texts("camp2p-overlap steps:", logging.INFO) == [
        "camp2p-overlap steps: overlap=0 parity=0 reorder=0 serial=2; top serial reason (2): switched off",
        "camp2p-overlap steps: overlap=0 parity=0 reorder=0 serial=2; graph replays: serial 3 (+3), overlap 7 (+7);"
        " top serial reason (2): switched off",
        "camp2p-overlap steps: overlap=0 parity=0 reorder=0 serial=2; graph replays: serial 3, overlap 10 (+3);"
        " top serial reason (2): switched off",
    ]


def test_summary_thread_logs_periodically(logs: PackageLogs) -> None:
    counts = {"steps": {"overlap": 1}, "serial_reasons": {}}
    r = metrics.Reporter(lambda: counts, port=None, summary_s=0.05)
    try:
        deadline = time.monotonic() + 10
        while not logs.texts("camp2p-overlap steps:") and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        r.close()
    assert logs.texts("camp2p-overlap steps: overlap=1")


def test_port_address_and_summary_settings_are_validated() -> None:
    assert load_config({ENV_METRICS_PORT: "9400"}).metrics_port == 9400
    assert load_config({}).metrics_port is None
    assert load_config({ENV_SUMMARY: "0"}).summary_s == 0
    for bad in ("http", "-1", "70000"):
        with pytest.raises(ConfigError, match=ENV_METRICS_PORT):
            load_config({ENV_METRICS_PORT: bad})
    for bad in ("soon", "-5", "inf"):
        with pytest.raises(ConfigError, match=ENV_SUMMARY):
            load_config({ENV_SUMMARY: bad})
    assert load_config({}).metrics_addr == "127.0.0.1"  # loopback unless asked
    assert load_config({ENV_METRICS_ADDR: ""}).metrics_addr == "127.0.0.1"
    good = ("0.0.0.0", "::", "::1", "10.1.2.3", "fe80::1%eth0", "localhost", "metrics-1.pod.cluster.local", "host.")
    for addr in good:
        assert load_config({ENV_METRICS_ADDR: f" {addr} "}).metrics_addr == addr
    bad_addrs = ("http://0.0.0.0", "0.0.0.0:9400", "[::1]", "256.0.0.1", "1.2.3", "my_host", "-x", "a..b", "a b", "*")
    for bad in bad_addrs:
        with pytest.raises(ConfigError, match=ENV_METRICS_ADDR) as info:
            load_config({ENV_METRICS_ADDR: bad})
        assert repr(bad) in str(info.value) and "IPv4 or IPv6 address or a host name" in str(info.value)
    with pytest.raises(ConfigError, match=ENV_METRICS_ADDR):
        OverlapConfig().with_overrides(metrics_addr="every interface")


def test_the_endpoint_listens_on_loopback_by_default(fresh_reporting: None) -> None:
    w = world(layers=2, stage_ids=(0, 1))
    PATCH_LAYER.engine.apply(
        strict=True, config=OverlapConfig(enabled=True, backend="cpu", adaptive=False, metrics_port=0, summary_s=0)
    )
    bounded(lambda: run_step(w))
    reporter = metrics.current_reporter()
    assert reporter is not None and reporter.port, "no endpoint started"
    assert reporter.server.server_address[0] == "127.0.0.1"
    assert scrape(reporter.port)["vllm:camp2p_overlap_steps"]


def _loopback_alias() -> str:
    """A loopback address other than the default (Linux routes all of 127/8 to lo)."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.2", 0))
        except OSError:
            pytest.skip("this host cannot bind 127.0.0.2, the second loopback address the test listens on")
    return "127.0.0.2"


def test_the_endpoint_listens_on_the_configured_address(fresh_reporting: None) -> None:
    addr = _loopback_alias()
    w = world(layers=2, stage_ids=(0, 1))
    cfg = OverlapConfig(enabled=True, backend="cpu", adaptive=False, metrics_port=0, metrics_addr=addr, summary_s=0)
    PATCH_LAYER.engine.apply(strict=True, config=cfg)
    bounded(lambda: run_step(w))
    reporter = metrics.current_reporter()
    assert reporter is not None and reporter.port, "no endpoint started"
    assert reporter.server.server_address[0] == addr
    with urllib.request.urlopen(f"http://{addr}:{reporter.port}/metrics", timeout=10) as resp:
        assert resp.status == 200 and b"vllm:camp2p_overlap_steps_total" in resp.read()
    with socket.socket() as s:  # not on the default address: 127.0.0.1 refuses the port
        s.settimeout(5)
        assert s.connect_ex(("127.0.0.1", reporter.port)) != 0


def test_start_reporting_serves_on_the_address_it_is_given(fresh_reporting: None) -> None:
    addr = _loopback_alias()
    metrics.stop_reporting()
    r = metrics.start_reporting(lambda: {}, port=0, summary_s=0, mode="overlap", rung="overlap", addr=addr)
    assert r is not None and r.port and r.server.server_address[0] == addr
    # A Reporter made without an address listens on loopback only.
    plain = metrics.Reporter(lambda: {}, port=0, summary_s=0)
    try:
        assert plain.server.server_address[0] == metrics.DEFAULT_METRICS_ADDR == "127.0.0.1"
    finally:
        plain.close()


# ---------------------------------------------------------------------------
# Graph replays are counted.
def test_graph_replays_are_counted_per_variant_apart_from_the_steps() -> None:
    c = StepCounters()
    started: list[int] = []
    c.on_first_step = lambda: started.append(1)
    c.graph_replay("overlap")
    assert started == [1] and c.on_first_step is None  # a replay starts the reporting like a step
    c.graph_replay("serial")
    c.graph_replay("overlap")
    c.serial("why")
    snap = c.to_dict()
    assert list(snap) == [
        "steps",
        "serial_reasons",
        "layout_steps",
        "graph_replays",
        "graph_replay_layouts",
        "graph_captures",
    ]
    assert snap["layout_steps"] == {} and snap["graph_replay_layouts"] == {}  # no engaged step, no layer's variant
    assert snap["graph_replays"] == {"serial": 1, "overlap": 2}
    assert snap["steps"] == {"overlap": 0, "parity": 0, "reorder": 0, "serial": 1}
    for bad in ("parity", "reorder", "Overlap", ""):
        with pytest.raises(ValueError, match="graph variant"):
            c.graph_replay(bad)
    assert c.to_dict()["graph_replays"] == {"serial": 1, "overlap": 2}
    c.graph_capture("serial")
    c.graph_capture("overlap")
    c.graph_capture("overlap")
    assert c.to_dict()["graph_captures"] == {"serial": 1, "overlap": 2}
    assert c.to_dict()["steps"] == snap["steps"]  # captures are not steps
    with pytest.raises(ValueError, match="graph variant"):
        c.graph_capture("reorder")


def test_graph_replays_are_counted_exactly_from_many_threads() -> None:
    c = StepCounters()
    n, threads = 2000, 8
    barrier = threading.Barrier(threads)

    def replay(variant: str) -> None:
        barrier.wait()
        for _ in range(n):
            c.graph_replay(variant)
            c.engaged("overlap", "compute-side")

    workers = [threading.Thread(target=replay, args=("serial" if i % 2 else "overlap",)) for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(60)
    snap = c.to_dict()
    assert snap["graph_replays"] == {"serial": n * threads // 2, "overlap": n * threads // 2}
    assert snap["steps"]["overlap"] == n * threads
    assert snap["layout_steps"] == {"compute-side": n * threads}


def test_the_graph_replays_metric_follows_the_counters() -> None:
    c = StepCounters()
    m = metrics.StepMetrics(c.to_dict)
    for _ in range(3):
        c.graph_replay("serial")
    c.graph_replay("overlap")
    got = samples(families(m)[metrics.GRAPH_REPLAYS], "variant")
    assert got == {"serial": 3.0, "overlap": 1.0}
    m.sync()  # idempotent
    c.graph_replay("overlap")
    assert samples(families(m)[metrics.GRAPH_REPLAYS], "variant") == {"serial": 3.0, "overlap": 2.0}


def _group_info(m: metrics.StepMetrics) -> dict[tuple[str, str, str, str], float]:
    fam = families(m)[metrics.GROUP_INFO]
    return {(s.labels["size"], s.labels["rank"], s.labels["channel"], s.labels["state"]): s.value for s in fam.samples}


def test_the_group_gauge_follows_the_runtimes_group() -> None:
    """``group_info{size,rank,channel,state}`` is 1 for ``stats()["group"]`` as it is now: one FFN rank before the
    group is joined, this rank's place and the store channel once it joined a group, ``broken`` once it broke; the
    label set before is removed (as ``mode_info``'s)."""
    import torch.distributed as dist

    from camp2p_overlap.core.overlap.rank_group import Membership, RankGroup
    from camp2p_overlap.core.overlap.runtime import OverlapRuntime

    runtime = OverlapRuntime()
    m = metrics.StepMetrics(runtime.stats)
    assert _group_info(m) == {("1", "0", "none", "not joined yet"): 1.0}
    group = RankGroup(Membership(2, 1, (6, 7), "test", dist.HashStore()), timeout_s=1.0)
    runtime.group, runtime.group_joined = group, True
    joined = ("2", "1", group.channel, "ok")
    assert group.channel.startswith("c10d store of the default process group, keys under camp2p_overlap/")
    assert _group_info(m) == {joined: 1.0}
    group.broken = "exchange x/0/configuration: no answer from rank(s) [0]"
    assert _group_info(m) == {("2", "1", group.channel, "broken"): 1.0}
    m.sync()  # idempotent
    assert _group_info(m) == {("2", "1", group.channel, "broken"): 1.0}


def test_the_group_gauge_is_left_as_it_is_by_stats_without_a_group() -> None:
    snap: dict[str, Any] = {"group": {"size": 1, "rank": 0, "members": [0], "channel": None, "state": "one FFN rank"}}
    m = metrics.StepMetrics(lambda: snap)
    assert _group_info(m) == {("1", "0", "none", "one FFN rank"): 1.0}
    del snap["group"]
    assert _group_info(m) == {("1", "0", "none", "one FFN rank"): 1.0}


# ---------------------------------------------------------------------------
# A forked child starts from zero.
def _in_forked_child(c: StepCounters, m: metrics.StepMetrics) -> int:
    """The checks a forked child runs: 0 when all hold, else which failed."""
    zero = {"steps": dict.fromkeys(("overlap", "parity", "reorder", "serial"), 0), "serial_reasons": {}}
    none = {"serial": 0, "overlap": 0}
    if c.to_dict() != {
        **zero,
        "layout_steps": {},
        "graph_replays": none,
        "graph_replay_layouts": {},
        "graph_captures": none,
    }:
        return 10
    fams = families(m)
    exported = [
        *samples(fams[metrics.STEPS], "path").values(),
        *samples(fams[metrics.GRAPH_REPLAYS], "variant").values(),
    ]
    if set(exported) != {0.0} or samples(fams[metrics.SERIAL_STEPS], "reason"):
        return 11
    c.engaged("overlap", "compute-side")
    c.graph_replay("serial")
    fams = families(m)
    info = {(s.labels["mode"], s.labels["rung"]): s.value for s in fams[metrics.MODE_INFO].samples}
    if samples(fams[metrics.STEPS], "path")["overlap"] != 1.0:
        return 12
    if samples(fams[metrics.GRAPH_REPLAYS], "variant") != {"serial": 1.0, "overlap": 0.0}:
        return 13
    if samples(fams[metrics.LAYOUT_STEPS], "layout") != {"compute-side": 1.0}:
        return 15
    return 0 if info == {("reorder", "reorder"): 1.0} else 14


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_starts_its_counters_and_metrics_from_zero() -> None:
    c = StepCounters()
    m = metrics.StepMetrics(c.to_dict, mode="reorder", rung="reorder")
    for _ in range(3):
        c.engaged("overlap", "compute-side")
        c.graph_replay("overlap")
    c.serial("why")
    m.sync()
    parent = c.to_dict()
    run_forked(
        lambda: _in_forked_child(c, m),
        {
            10: "the child's counters kept the parent's counts",
            11: "the child's metrics kept the parent's counts",
            12: "the child's own step was not exported alone",
            13: "the child's own replay was not exported alone",
            14: "the child lost the mode gauge",
            15: "the child's own step was not exported alone under its layout",
        },
    )
    # The parent's counts and metrics are untouched by the fork.
    assert c.to_dict() == parent
    assert samples(families(m)[metrics.STEPS], "path")["overlap"] == 3.0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_worker_does_not_count_its_parents_steps_into_the_multiprocess_dir(tmp_path: Path) -> None:
    """The parent counts 3 steps and 1 replay, forks; the child counts 1
    step. vLLM's ``/metrics`` sums every process's file: 4 steps, 1 replay
    (the child starting from its parent's counts would make it 7 and 2)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    env = {
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
        "VLLM_CAMP2P_MULTISTREAM": "1",
        "VLLM_CAMP2P_MULTISTREAM_BACKEND": "cpu",
        "VLLM_CAMP2P_MULTISTREAM_ADAPTIVE": "0",
        "VLLM_CAMP2P_MULTISTREAM_MODE": "reorder",
        "VLLM_CAMP2P_MULTISTREAM_SUMMARY_S": "0",
    }
    out = run_program("metrics_worker.py", "fork", env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    child = json.loads(out.stdout.split("CHILD=")[1].splitlines()[0])
    assert child["inherited"] == {
        "steps": {"overlap": 0, "parity": 0, "reorder": 0, "serial": 0},
        "graph_replays": {"serial": 0, "overlap": 0},
    }
    assert child["steps"]["reorder"] == 1
    assert "CHILD_EXIT=0" in out.stdout
    parent = json.loads(out.stdout.split("STATS=")[1].splitlines()[0])
    assert parent["reorder"] == 3
    assert len(list(tmp_path.glob("counter_*.db"))) == 2, "one counter file per process"
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    assert samples(fams[metrics.STEPS], "path")["reorder"] == 4.0
    assert samples(fams[metrics.GRAPH_REPLAYS], "variant") == {"serial": 0.0, "overlap": 1.0}


# ---------------------------------------------------------------------------
# The scrape and the summary read counters only: never a device event.
def test_the_scrape_and_the_summary_touch_no_device_event(
    fresh_reporting: None, monkeypatch: pytest.MonkeyPatch, logs: PackageLogs, tmp_path: Path
) -> None:
    from camp2p_overlap.core.overlap.adaptive import StepTimings
    from camp2p_overlap.core.overlap.streams import backend
    from camp2p_overlap.emulation.device import worker

    w = world(layers=2, stage_ids=(0, 1))
    PATCH_LAYER.engine.apply(  # adaptive: the steps leave timings whose events a careless reader would query
        strict=True, config=OverlapConfig(enabled=True, backend="cpu", adaptive=True, metrics_port=0, summary_s=0)
    )
    for _ in range(4):
        bounded(lambda: run_step(w))
    PATCH_LAYER.runtime.counters.graph_replay("overlap")
    reporter = metrics.current_reporter()
    assert reporter is not None and reporter.port
    # The step watchdog (on by default) reads the last step's events until it has seen them complete: let it.
    from camp2p_overlap.core.overlap.watch.watchdog import WATCHER

    deadline = time.monotonic() + 5.0
    while WATCHER.following() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert not WATCHER.following()
    touched: list[str] = []

    def forbidden(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            touched.append(f"{name} on {threading.current_thread().name}")
            raise AssertionError(f"the metrics touched {name}")

        return call

    for owner, names in (
        (PATCH_LAYER.runtime, ("stats",)),
        (StepTimings, ("read_ready", "timed")),
        (backend.StreamBackend, ("timing_pair", "synchronize", "event")),
        (worker.Event, ("query", "synchronize", "elapsed_time", "record", "wait")),
        (worker.Stream, ("query", "synchronize", "record_event", "wait_event")),
    ):
        for name in names:
            if hasattr(owner, name):
                monkeypatch.setattr(owner, name, forbidden(f"{getattr(owner, '__name__', 'runtime')}.{name}"))
    counts = PATCH_LAYER.runtime.counters.to_dict()
    fams = scrape(reporter.port)  # the endpoint's HTTP thread syncs
    assert samples(fams[metrics.STEPS], "path") == {k: float(v) for k, v in counts["steps"].items()}
    assert samples(fams[metrics.GRAPH_REPLAYS], "variant") == {k: float(v) for k, v in counts["graph_replays"].items()}
    assert reporter.log_summary()  # the first summary: logged
    # The reporter thread on its own tick: the multi-process sync (a directory
    # is set; prometheus_client chose its storage at import, so nothing is
    # written there) and the summary.
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    PATCH_LAYER.runtime.counters.graph_replay("serial")
    synced = []
    monkeypatch.setattr(reporter.metrics, "sync", lambda real=reporter.metrics.sync: synced.append(1) or real())
    ticking = metrics.Reporter(
        PATCH_LAYER.runtime.counters.to_dict, port=None, summary_s=0.02, metrics=reporter.metrics
    )
    logged = len(logs.texts("camp2p-overlap steps:"))
    try:
        deadline = time.monotonic() + 10
        while len(logs.texts("camp2p-overlap steps:")) == logged and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        ticking.close()
    assert len(logs.texts("camp2p-overlap steps:")) > logged, "the summary thread logged nothing"
    assert "graph replays: serial" in logs.texts("camp2p-overlap steps:")[-1]
    assert synced, "the reporter thread did not sync the metrics"
    assert (
        samples(scrape(reporter.port)[metrics.GRAPH_REPLAYS], "variant")["serial"]
        == counts["graph_replays"]["serial"] + 1
    )
    assert touched == []
    assert not logs.texts("could not sync") and not logs.texts("step reporting failed")


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


def test_steps_counted_on_many_threads_without_a_lock_are_all_counted() -> None:
    c = StepCounters()
    per_thread, threads = 2000, 4

    def count() -> None:
        for i in range(per_thread):
            c.serial("a" if i % 2 else "b")
            c.engaged("overlap", "comm-side" if i % 2 else "compute-side")

    workers = [threading.Thread(target=count) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    c.serial("a")  # this thread too
    d = c.to_dict()
    assert d["steps"]["serial"] == threads * per_thread + 1
    assert d["steps"]["overlap"] == threads * per_thread
    assert d["layout_steps"] == {"compute-side": threads * per_thread // 2, "comm-side": threads * per_thread // 2}
    assert d["serial_reasons"] == {"b": threads * per_thread // 2, "a": threads * per_thread // 2 + 1}
