"""``camp2p-overlap bench --ffn-ranks N``: the multi-rank main job. Each repetition runs the multi-rank world
(:mod:`camp2p_overlap.emulation.ranks`: attention and FFN ranks as processes over gloo, a MoE all-to-all among the FFN
ranks inside each FFN) once with adaptive engage and once more with one straggler FFN rank; each world runs the same
steps patched (the ``overlap`` phase) and after ``unpatch()`` (``serial``), so every ratio is of two phases of one
run. The group's step time is its slowest FFN rank's; the figures are over the steps with two stages or more (a
one-stage step runs serially in both phases). The report says, per world, on how many steps the FFN ranks ran
different paths, and each bucket's decision changes."""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from camp2p_overlap.emulation.ranks import STEP, RanksSpec, WorldResult, run_world
from camp2p_overlap.tools.bench.runner import _eta, _fill_drain_terms

SCHEMA = "camp2p-overlap/bench-ranks/v1"


@dataclass(frozen=True)
class RankBenchParams:
    ffn_ranks: int = 4
    attn_ranks: int = 4
    mapping: str = "equal"
    layers: int = 6
    stages: int = 2
    tokens: int = 4
    steps: int = 200
    reps: int = 3
    #: Modelled FFN time per (layer, stage); A2E and E2A take ``comm_ratio`` of it together (the ffn-bound preset).
    #: Long enough for the host of a 2-CPU machine to keep up with 8 processes: at 6 ms the attention ranks' real
    #: turnaround (their TP all-reduce over loopback) outgrows the slack of a stage's chain (docs/benchmark.md).
    ffn_ms: float = 12.0
    comm_ratio: float = 0.5
    collective_ms: float = 0.2
    reprobe_every: int = 32
    #: Each FFN rank's own noise: up to this much more on each FFN kernel.
    noise_ms: float = 0.3
    #: The straggler world: FFN rank 1's FFN this many times slower.
    straggler: float = 1.3
    layout: str = "compute-side"
    #: Steps at the start of each phase left out of the figures (learning).
    warmup: int = 20
    #: Each FFN rank's emulated device gets this many vector cores (None: no core model). CAM takes ``cam_cores``,
    #: the MoE's collective and the experts (in waves) the rest: ``compute-side`` fits exactly, and the layer's core
    #: rule sees the count (docs/design.md, "Cores beside collectives"). The MoE block keeps its one collective (no
    #: dispatch), so the figures compare with those of the world without cores.
    vector_cores: int | None = None
    cam_cores: int = 8

    def spec(self, seed: int, straggler: bool) -> RanksSpec:
        link_s = self.ffn_ms * self.comm_ratio / 2 * 1e-3
        return RanksSpec(
            attn_ranks=self.attn_ranks,
            ffn_ranks=self.ffn_ranks,
            mapping=self.mapping,
            layers=self.layers,
            steps=self.steps,
            stages=self.stages,
            tokens=self.tokens,
            vary_tokens=True,
            seed=seed,
            adaptive=True,
            reprobe_every=self.reprobe_every,
            layout=self.layout,
            timing="model",
            ffn_model_s=self.ffn_ms * 1e-3,
            link_model_s=link_s,
            coll_model_s=self.collective_ms * 1e-3,
            straggler={1: self.straggler} if straggler and self.ffn_ranks > 1 else {},
            noise_s={r: self.noise_ms * 1e-3 for r in range(self.ffn_ranks)},
            timeout_s=60.0,
            **self._cores(),
        )

    def _cores(self) -> dict[str, Any]:
        if self.vector_cores is None:
            return {}
        if self.vector_cores <= self.cam_cores:
            raise ValueError(f"--rank-cores must be more than CAM's {self.cam_cores} cores")
        moe = self.vector_cores - self.cam_cores
        return {
            "vector_cores": self.vector_cores,
            "cam_cores": self.cam_cores,
            "moe_cores": moe,
            "ffn_cores": moe,
            "moe_dispatch": False,
        }

    def floor_s(self, slowdown: float) -> float:
        """The fill/drain floor of a step (``runner._fill_drain_terms``), from the modelled times: the FFN with its
        collective as f, each A2E and E2A its link time, no attention time."""
        f = (self.ffn_ms * slowdown + self.collective_ms) * 1e-3
        link = self.ffn_ms * self.comm_ratio / 2 * 1e-3
        stages = list(range(self.stages))
        a = dict.fromkeys(stages, link)
        return max(_fill_drain_terms(f, a, a, stages, 0.0, self.layers)) * self.layers


def group_times(res: WorldResult, phase: str, warmup: int) -> list[float]:
    """The group's time of each multi-stage step of ``phase`` after ``warmup`` entries: its slowest FFN rank's."""
    per_rank = res.step_s(phase)
    plan = res.spec.plan()
    out = []
    for i, (kind, step) in enumerate(plan):
        if i < warmup or kind != STEP or len(res.spec.stage_ids(step)) < 2:
            continue
        out.append(max(times[i] for times in per_rank.values()))
    return out


def parted_steps(res: WorldResult) -> list[int]:
    """The entries of the overlap phase on which the FFN ranks ran different paths."""
    paths = list(res.paths("overlap").values())
    return [i for i, chosen in enumerate(zip(*paths, strict=True)) if len(set(chosen)) > 1]


def world_figures(res: WorldResult, params: RankBenchParams, slowdown: float) -> dict[str, Any]:
    overlap, serial = group_times(res, "overlap", params.warmup), group_times(res, "serial", params.warmup)
    to, ts = statistics.median(overlap), statistics.median(serial)
    floor = params.floor_s(slowdown)
    buckets = res.ffn[0]["stats"]["buckets"] if res.ffn.get(0) else []
    return {
        "ok": res.ok,
        "outputs_equal": all(res.equal.values()),
        "steps": len(res.paths("overlap")[0]),
        "measured_steps": len(overlap),
        "overlap_median_ms": round(to * 1e3, 3),
        "serial_median_ms": round(ts * 1e3, 3),
        "overlap_mean_ms": round(statistics.fmean(overlap) * 1e3, 3),
        "speedup": round(ts / to, 4),
        "floor_fill_drain_ms": round(floor * 1e3, 3),
        "eta_fill_drain": None if (eta := _eta(ts, to, floor)) is None else round(eta, 4),
        "parted_steps": parted_steps(res),
        "engaged_steps": sum(p != "serial" for p in res.paths("overlap")[0]),
        "bucket_changes": {b["label"]: b["changes"] for b in buckets},
        "groups": [res.ffn[r]["stats"]["group"] for r in sorted(res.ffn) if res.ffn[r]],
        "wall_s": round(res.seconds, 1),
    }


def _spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def run_rank_bench(
    params: RankBenchParams, *, out_dir: Path | None = None, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """The report: per repetition the adaptive world and the straggler world, and their figures' spread."""
    worlds: dict[str, list[dict[str, Any]]] = {"adaptive": [], "straggler": []}
    with tempfile.TemporaryDirectory(prefix="camp2p-ranks-") as tmp:
        root = Path(out_dir or tmp)
        for rep in range(params.reps):
            for name, slowdown in (("adaptive", 1.0), ("straggler", params.straggler)):
                spec = params.spec(seed=rep, straggler=name == "straggler")
                res = run_world(spec, root / f"{name}-{rep}", timeout_s=60.0 + spec.steps * 4.0)
                if not res.ok:
                    raise RuntimeError(f"the {name} world of repetition {rep} failed:{res.diagnostics()}")
                figures = world_figures(res, params, slowdown)
                worlds[name].append(figures)
                if progress is not None:
                    progress(
                        f"{name} world {rep + 1}/{params.reps}: {figures['speedup']:.3f}x of serial, eta "
                        f"{figures['eta_fill_drain']}, parted at {len(figures['parted_steps'])} of "
                        f"{figures['steps']} steps ({figures['wall_s']} s)"
                    )
    summary = {}
    for name, runs in worlds.items():
        etas = [r["eta_fill_drain"] for r in runs if r["eta_fill_drain"] is not None]
        summary[name] = {
            "speedup": _spread([r["speedup"] for r in runs]),
            "eta_fill_drain": _spread(etas) if etas else None,
            "parted_steps": sum(len(r["parted_steps"]) for r in runs),
            "steps": sum(r["steps"] for r in runs),
            "outputs_equal": all(r["outputs_equal"] for r in runs),
            "most_changes_per_bucket": max((c for r in runs for c in r["bucket_changes"].values()), default=0),
        }
    wall = round(sum(r["wall_s"] for runs in worlds.values() for r in runs), 1)
    return {"schema": SCHEMA, "params": asdict(params), "summary": summary, "worlds": worlds, "wall_s": wall}


def rank_bench_table(report: dict[str, Any]) -> str:
    """The printed summary of :func:`run_rank_bench`'s report."""
    p = report["params"]
    lines = [
        f"multi-rank main job: {p['ffn_ranks']} FFN ranks, {p['attn_ranks']} attention ranks ({p['mapping']}), "
        f"{p['layers']} layers, {p['stages']} stages, FFN {p['ffn_ms']} ms, A2E+E2A {p['comm_ratio']} of it, "
        f"{p['reps']} repetitions of {p['steps']} steps (group step: its slowest FFN rank's)",
    ]
    for name, s in report["summary"].items():
        eta = s["eta_fill_drain"]
        lines.append(
            f"  {name:9s} adaptive overlap {s['speedup']['median']:.3f}x of serial "
            f"[{s['speedup']['min']:.3f}, {s['speedup']['max']:.3f}], eta f/d "
            + (f"{eta['median']:.2f} [{eta['min']:.2f}, {eta['max']:.2f}]" if eta else "-")
            + f", FFN ranks parted at {s['parted_steps']} of {s['steps']} steps, most decision changes per "
            f"bucket {s['most_changes_per_bucket']}, outputs {'bitwise equal' if s['outputs_equal'] else 'DIFFER'}"
        )
    return "\n".join(lines)
