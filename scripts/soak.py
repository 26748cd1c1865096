#!/usr/bin/env python3
"""Soak the FFN-side overlap on the CPU emulation.

Runs many steps (default 10,000) of the emulated FFN forward with the
overlap on, on a pool of worlds with randomized shapes, layer lists and
stage sets (two and three stages, non-contiguous stage ids, a one-stage
world that the gate sends down the serial path), random token counts per
stage and step, and the layouts in turn (phases: compute-side, the users'
default; comm-side; and comm-side's direction switches, e2a-only and
a2e-only). On a
sample of steps it runs the same step on the serial path (the original,
unwrapped ``_ffn_forward``) and requires bitwise-equal outputs, and checks
every edge of the design in the overlap step's trace.

It samples Python heap (tracemalloc, current), RSS (/proc/self/statm, or
psutil) and the thread count through the run and compares a window early
in the run with one at its end: they must stay flat within a tolerance.

    python scripts/soak.py                       # 10,000 steps
    python scripts/soak.py --steps 300 --json out/soak.json

Exit status: 0 when every compared step was equal, every edge held and
memory and threads stayed flat; 1 otherwise; 2 when it could not run.
``--leak-bytes-per-step`` keeps that many bytes alive per step on purpose,
to show the flatness check fails when something leaks.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import random
import statistics
import sys
import threading
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from camp2p_overlap.core.config import OverlapConfig  # noqa: E402
from camp2p_overlap.core.observe.trace import ExpectedSchedule, recording  # noqa: E402
from camp2p_overlap.core.patch_layer import PATCH_LAYER  # noqa: E402
from camp2p_overlap.emulation.moe import MoEShape  # noqa: E402
from camp2p_overlap.emulation.standin_patch_layer import standin_site  # noqa: E402
from camp2p_overlap.emulation.world import LinkModel, World, WorldSpec, build_world  # noqa: E402
from camp2p_overlap.tools.bench.runner import use_tool_switch_interval  # noqa: E402
from camp2p_overlap.verify.edges import check_step  # noqa: E402

FFN_TARGET = "AFDNPUFFNModelRunner._ffn_forward"
#: Per phase, in turn: (layouts listed, A2E on a side stream, E2A on a side
#: stream; the switches refine comm-side only), and the schedule its
#: overlap steps must follow: (A2E on K_s, E2A on K_s, FFN on F).
PHASES = [
    (("compute-side",), True, True),
    (("comm-side",), True, True),
    (("comm-side",), False, True),
    (("comm-side",), True, False),
]


def phase_schedule(layouts: tuple[str, ...], a2e_side: bool, e2a_side: bool) -> tuple[bool, bool, bool]:
    """Where a phase's overlap step runs A2E, E2A and the FFN (side streams or not)."""
    if layouts[0] == "compute-side":
        return (False, False, True)
    return (a2e_side, e2a_side, False)


NO_DELAY = LinkModel(latency_s=0.0, bandwidth_Bps=float("inf"))


# ---------------------------------------------------------------------------
# memory and threads
def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        try:
            import psutil

            return int(psutil.Process().memory_info().rss)
        except Exception:  # noqa: BLE001 - not available: report 0
            return 0


@dataclass
class Sample:
    step: int
    traced_bytes: int
    rss_bytes: int
    threads: int


@dataclass
class Flatness:
    metric: str
    early: float
    late: float
    growth: float
    tolerance: float
    ok: bool


def window(samples: list[Sample], lo: float, hi: float, steps: int) -> list[Sample]:
    return [s for s in samples if lo * steps <= s.step < hi * steps or (hi >= 1.0 and s.step >= lo * steps)]


def flatness(samples: list[Sample], steps: int, tol_traced: int, tol_rss: int) -> list[Flatness]:
    early = window(samples, 0.2, 0.4, steps)
    late = window(samples, 0.8, 1.0, steps)
    if not early or not late:
        return [Flatness("samples", len(early), len(late), 0, 0, False)]
    out = []
    for metric, tol in (("traced_bytes", tol_traced), ("rss_bytes", tol_rss)):
        e = statistics.median(getattr(s, metric) for s in early)
        lt = statistics.median(getattr(s, metric) for s in late)
        out.append(Flatness(metric, e, lt, lt - e, tol, lt - e <= tol))
    e_thr = max(s.threads for s in early)
    l_thr = max(s.threads for s in late)
    spread = max(s.threads for s in early + late) - min(s.threads for s in early + late)
    out.append(Flatness("threads", e_thr, l_thr, l_thr - e_thr, 0, spread == 0))
    return out


# ---------------------------------------------------------------------------
# worlds and steps
def world_specs(seed: int) -> list[WorldSpec]:
    rng = random.Random(seed)
    stage_sets = [(0, 1), (0, 2), (1, 2), (0, 1, 2), (0, 1, 2), (2,)]
    specs = []
    for i, stages in enumerate(stage_sets):
        hidden = rng.choice([16, 32, 48, 64])
        specs.append(
            WorldSpec(
                layers=rng.randint(1, 5),
                stage_ids=stages,
                tokens=rng.choice([4, 8, 16]),
                shape=MoEShape(
                    hidden=hidden,
                    ffn=2 * hidden,
                    experts=rng.choice([2, 4]),
                    top_k=rng.choice([1, 2]),
                    shared_expert=rng.random() < 0.7,
                ),
                link=NO_DELAY,
                attn_s=0.0,
                op_timeout_s=30.0,
                seed=seed + i,
                compute_gate_on_attention=rng.random() < 0.3,
                first_k_dense_replace=rng.randint(0, 1),
                moe_layer_freq=rng.choice([1, 2]),
                return_payload=rng.random() < 0.8,
            )
        )
    return specs


def serial_step(world: World, original: Any, step: int, tokens: dict[int, int]) -> dict:
    """Step ``step`` through the original, unwrapped ``_ffn_forward`` (the
    connector's wrappers pass straight through: no session is active)."""
    dp = world.dp_metadata(tokens)
    world.transport.begin_step(step, world.layer_list(), sorted(dp))
    original(world.runner, dp_metadata_list=dp)
    world.synchronize()  # the host ran ahead of the (emulated) device
    return dict(world.transport.results)


def overlap_step(world: World, step: int, tokens: dict[int, int]) -> dict:
    world.steps_run = step - 1
    return world.run_step(tokens)


@contextlib.contextmanager
def patched(cfg: OverlapConfig, manifest: Any) -> Iterator[tuple[Any, str]]:
    """Apply the patch layer with ``cfg``: through the process engine (the
    real version gate) when it accepts this install, else through the
    benchmark's emulation engine (which accepts the emulated stack)."""
    report = PATCH_LAYER.engine.apply(config=cfg, manifest=manifest)
    if report.applied:
        try:
            yield PATCH_LAYER.engine, "process engine"
        finally:
            PATCH_LAYER.engine.unpatch()
        return
    try:
        from camp2p_overlap.emulation.standin_patch_layer import emulation_engine
    except ImportError as exc:
        raise SystemExit(f"soak: the patch layer refused ({report.reason}) and no emulation engine: {exc}") from exc
    with emulation_engine() as engine:
        emulated = engine.apply(config=cfg, manifest=manifest)
        if not emulated.applied:
            raise SystemExit(f"soak: the emulation engine refused too: {emulated.reason}")
        yield engine, f"emulation engine (the process engine refused: {report.reason})"


def original_forward(engine: Any) -> Any:
    for recs in engine.installer.records.values():
        for r in recs:
            if r.spec.qualname == FFN_TARGET:
                return r.original
    raise RuntimeError(f"{FFN_TARGET} is not wrapped")


def stream_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("camp2p-overlap-stream-"))


# ---------------------------------------------------------------------------
@dataclass
class Summary:
    steps: int
    seconds: float
    steps_per_s: float
    engine: str
    worlds: list[dict[str, Any]]
    overlap_steps: int
    serial_gate_steps: int
    compared: int
    mismatches: list[str]
    edge_violations: list[str]
    flatness: list[dict[str, Any]]
    samples: list[dict[str, int]]
    stream_threads_end: int
    stream_threads_after_unpatch: int
    ok: bool
    python: str = field(default_factory=platform.python_version)
    torch: str = field(default_factory=lambda: torch.__version__)
    #: The run's sys.getswitchinterval() (the emulation tools' setting; docs/benchmark.md).
    env: dict[str, Any] = field(default_factory=lambda: {"switch_interval_s": round(sys.getswitchinterval(), 9)})


def run(args: argparse.Namespace) -> Summary:
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    site = standin_site()
    root, manifest = site.root, site.manifest
    specs = world_specs(args.seed)
    worlds = [build_world(spec, root=root) for spec in specs]
    phase_len = max(args.steps // len(PHASES), 1)
    leak: list[bytes] = []
    samples: list[Sample] = []
    mismatches: list[str] = []
    violations: list[str] = []
    compared = overlap_steps = serial_steps = 0
    gc.collect()
    tracemalloc.start()
    t0 = time.perf_counter()
    step = 0
    stream_end = 0
    for p, (layouts, a2e_side, e2a_side) in enumerate(PHASES):
        n_phase = phase_len if p < len(PHASES) - 1 else args.steps - phase_len * (len(PHASES) - 1)
        cfg = OverlapConfig(
            enabled=True,
            backend="cpu",
            adaptive=False,
            layouts=layouts,  # type: ignore[arg-type]
            a2e_on_side_stream=a2e_side,
            e2a_on_side_stream=e2a_side,
        )
        on_a2e, on_e2a, on_ffn = phase_schedule(layouts, a2e_side, e2a_side)
        with patched(cfg, manifest) as (engine, engine_name):
            original = original_forward(engine)
            order = list(range(len(worlds)))
            for i in range(n_phase):
                # Each phase starts with one step per world, so every stream
                # set exists before the first sample of the phase.
                w = worlds[order[i]] if i < len(order) else rng.choice(worlds)
                step += 1
                tokens = {s: rng.randint(1, w.spec.tokens) for s in w.spec.stage_ids}
                multi = len(w.spec.stage_ids) >= 2
                overlap_steps += multi
                serial_steps += not multi
                compare = step <= 20 or step % args.compare_every == 0
                if compare:
                    with recording() as rec:
                        got = overlap_step(w, step, tokens)
                    ref = serial_step(w, original, step, tokens)
                    compared += 1
                    if got.keys() != ref.keys() or not all(torch.equal(got[k], ref[k]) for k in ref):
                        mismatches.append(f"step {step} (world {worlds.index(w)}, tokens {tokens}) differs")
                    if multi:
                        (sid,) = rec.steps()
                        exp = ExpectedSchedule(tuple(w.layer_list()), tuple(w.spec.stage_ids), on_a2e, on_e2a, on_ffn)
                        res = check_step(rec.ops(sid), exp)
                        if not res.ok:
                            violations.append(f"step {step}: {res}")
                else:
                    overlap_step(w, step, tokens)
                if args.leak_bytes_per_step:
                    leak.append(os.urandom(args.leak_bytes_per_step))
                if step % args.sample_every == 0 and i >= len(order):
                    # A full collection also empties the interpreter's free
                    # lists (tuples, dicts...), which otherwise fill up over
                    # thousands of steps and look like a slow leak.
                    gc.collect()
                    current, _peak = tracemalloc.get_traced_memory()
                    samples.append(Sample(step, current, rss_bytes(), threading.active_count()))
                if args.progress and step % 1000 == 0:
                    print(f"  {step} steps, {time.perf_counter() - t0:.1f} s", file=sys.stderr)
            stream_end = stream_threads()
    seconds = time.perf_counter() - t0
    tracemalloc.stop()
    flat = flatness(samples, args.steps, args.tol_traced_kib * 1024, args.tol_rss_mib * 1024 * 1024)
    after = stream_threads()
    ok = not mismatches and not violations and all(f.ok for f in flat) and after == 0 and compared > 0
    return Summary(
        steps=step,
        seconds=round(seconds, 3),
        steps_per_s=round(step / seconds, 1) if seconds else 0.0,
        engine=engine_name,
        worlds=[
            {
                "layers": w.layer_list(),
                "stages": list(w.spec.stage_ids),
                "hidden": w.spec.shape.hidden,
                "experts": w.spec.shape.experts,
                "max_tokens": w.spec.tokens,
            }
            for w in worlds
        ],
        overlap_steps=overlap_steps,
        serial_gate_steps=serial_steps,
        compared=compared,
        mismatches=mismatches[:20],
        edge_violations=violations[:20],
        flatness=[asdict(f) for f in flat],
        samples=[asdict(s) for s in samples],
        stream_threads_end=stream_end,
        stream_threads_after_unpatch=after,
        ok=ok,
    )


def print_summary(s: Summary) -> None:
    print(
        f"soak: {s.steps} steps in {s.seconds:.1f} s ({s.steps_per_s:.0f} steps/s), "
        f"{s.overlap_steps} overlapped, {s.serial_gate_steps} through the serial gate; {s.engine}"
    )
    print(
        f"  compared with the serial path: {s.compared} steps, {len(s.mismatches)} mismatching; "
        f"edge violations: {len(s.edge_violations)}"
    )
    for f in s.flatness:
        unit, scale = ("KiB", 1024) if f["metric"] != "threads" else ("", 1)
        print(
            f"  {f['metric']:>12}: early {f['early'] / scale:,.1f}{unit}  late {f['late'] / scale:,.1f}{unit}  "
            f"growth {f['growth'] / scale:+,.1f}{unit} (tolerance {f['tolerance'] / scale:,.0f}{unit}) "
            f"{'flat' if f['ok'] else 'NOT FLAT'}"
        )
    print(f"  stream threads: {s.stream_threads_end} while applied, {s.stream_threads_after_unpatch} after unpatch")
    for m in s.mismatches + s.edge_violations:
        print(f"  ! {m}")
    print(f"  verdict: {'OK' if s.ok else 'FAILED'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare-every", type=int, default=10, help="compare with the serial path every N steps")
    ap.add_argument("--sample-every", type=int, default=0, help="memory/thread sample period (default: steps/100)")
    ap.add_argument("--tol-traced-kib", type=int, default=256, help="allowed tracemalloc growth, early to late")
    ap.add_argument("--tol-rss-mib", type=int, default=16, help="allowed RSS growth, early to late")
    ap.add_argument("--leak-bytes-per-step", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, help="write the summary (with samples) here")
    ap.add_argument("--progress", action="store_true")
    args = ap.parse_args(argv)
    use_tool_switch_interval()  # the emulated streams are threads: this process only
    if args.steps < len(PHASES) * 10:
        ap.error(f"--steps must be at least {len(PHASES) * 10}")
    if not args.sample_every:
        args.sample_every = max(args.steps // 100, 1)
    summary = run(args)
    print_summary(summary)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(asdict(summary), indent=1))
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main())
