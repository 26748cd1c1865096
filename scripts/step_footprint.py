"""How much of ``camp2p_overlap/core`` one engaged eager FFN step runs on the host.

The world is the one the test suite and the benchmark step: the stand-in of
afd-plugin's release-line ``AFDNPUFFNModelRunner`` (stack ``vllm-0.19.1``,
``camp2p_overlap/emulation/standins/``) over an emulated transport and MoE,
the emulated device, the CPU stream backend, ``VLLM_CAMP2P_MULTISTREAM=1``
and every other ``VLLM_CAMP2P_*`` variable at its default (adaptive engage
on). The process-wide patch layer is applied through the public API
(``camp2p_overlap.apply`` / ``stats`` / ``unpatch``).

Steps run until adaptive engage has decided for the overlap in the step's
bucket, then a few more engaged steps; then, around exactly one call of the
runner's ``execute_model`` (the step's top-level entry under
``execute_ffn_step``), ``sys.setprofile`` records every Python ``call``
event on this (the loop's) thread whose code lies under
``camp2p_overlap/core/``. The side streams' worker threads are not
profiled. The step must count as one ``overlap`` step in ``stats()`` and
nothing else, or the script fails.

    .venv/bin/python scripts/step_footprint.py --layers 4 --stages 2
    .venv/bin/python scripts/step_footprint.py --layers 61 --stages 3 --json /tmp/fp.json

Only public API is used (``camp2p_overlap.apply``/``stats``/``unpatch`` and
the ``camp2p_overlap.emulation`` helpers), no core internals, so the script
keeps working while the core is refactored.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

#: The stack whose stand-ins are the release line's runner.
STACK = "vllm-0.19.1"
#: The overlap suite's MoE shape and tokens (tests/support/overlap.py: ``world``).
HIDDEN, FFN, EXPERTS, TOP_K = 64, 128, 4, 2
STEP_PATHS = ("overlap", "parity", "reorder", "serial")


def configure_env(adaptive: bool = True) -> None:
    """Switch the layer on with the CPU backend; every other variable of
    ours at its default (adaptive engage on unless ``adaptive`` is false)."""
    for name in [n for n in os.environ if n.startswith("VLLM_CAMP2P_")]:
        del os.environ[name]
    os.environ["VLLM_CAMP2P_MULTISTREAM"] = "1"
    os.environ["VLLM_CAMP2P_MULTISTREAM_BACKEND"] = "cpu"
    if not adaptive:
        os.environ["VLLM_CAMP2P_MULTISTREAM_ADAPTIVE"] = "0"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4, help="FFN layers of the step (default 4)")
    p.add_argument("--stages", type=int, default=2, choices=(2, 3), help="micro-batch stages (default 2)")
    p.add_argument("--tokens", type=int, default=16, help="tokens per stage (default 16, as the tests)")
    p.add_argument("--attn-us", type=float, default=0.0, help="modelled attention time per layer (default 0)")
    p.add_argument(
        "--adaptive",
        choices=("on", "off"),
        default="on",
        help="adaptive engage (default on, as a user runs; off: every step engages, no decision to wait for)",
    )
    p.add_argument("--max-warmup", type=int, default=200, help="most steps to wait for the overlap decision")
    p.add_argument("--settle", type=int, default=3, help="engaged steps after the decision before the measured one")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the result as JSON here")
    args = p.parse_args(argv)
    if args.layers < 1 or args.tokens < 1 or args.max_warmup < 1 or args.settle < 0 or args.attn_us < 0:
        p.error("need layers >= 1, tokens >= 1, max-warmup >= 1, settle >= 0, attn-us >= 0")
    return args


class CoreCallRecorder:
    """A ``sys.setprofile`` function that keeps every ``call`` event whose
    code lies under ``core_dir`` (generator resumptions included: each is
    a ``call`` of the same code)."""

    def __init__(self, core_dir: Path) -> None:
        self.core_dir = core_dir
        self.calls: dict[CodeType, int] = defaultdict(int)
        self._is_core: dict[str, bool] = {}

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        core = self._is_core.get(code.co_filename)
        if core is None:
            core = self._is_core[code.co_filename] = self._under_core(code.co_filename)
        if core:
            self.calls[code] += 1

    def _under_core(self, filename: str) -> bool:
        try:
            Path(os.path.realpath(filename)).relative_to(self.core_dir)
        except ValueError:
            return False
        return True

    def functions(self) -> list[dict[str, Any]]:
        rows = []
        for code, n in self.calls.items():
            rel = Path(os.path.realpath(code.co_filename)).relative_to(self.core_dir.parent.parent).as_posix()
            name = getattr(code, "co_qualname", code.co_name)  # co_qualname: Python 3.11+
            rows.append({"file": rel, "function": name, "line": code.co_firstlineno, "calls": n})
        return sorted(rows, key=lambda r: (r["file"], r["line"], r["function"]))


def step_counts(stats: dict[str, Any]) -> dict[str, int]:
    steps = stats.get("steps", {})
    return {k: int(steps.get(k, 0)) for k in sorted(set(STEP_PATHS) | set(steps))}


def bucket_of(stats: dict[str, Any], layers: int, stages: int) -> dict[str, Any] | None:
    """The adaptive bucket of this shape (one runner in the process)."""
    found = [
        b
        for b in stats.get("buckets", [])
        if b.get("key", {}).get("layers") == layers and b.get("key", {}).get("stages") == stages
    ]
    return found[-1] if found else None


def git(repo: Path, *argv: str) -> str | None:
    """``git argv`` in ``repo``: its output, or None outside a checkout."""
    try:
        out = subprocess.run(["git", *argv], cwd=repo, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    adaptive = args.adaptive == "on"
    configure_env(adaptive)

    import camp2p_overlap
    import camp2p_overlap.emulation.device  # registers the cpu backend's emulated device
    from camp2p_overlap.emulation import standins
    from camp2p_overlap.emulation.moe import MoEShape
    from camp2p_overlap.emulation.world import WorldSpec, build_world

    package_dir = Path(os.path.realpath(camp2p_overlap.__file__)).parent
    core_dir = package_dir / "core"
    if not core_dir.is_dir():
        raise SystemExit(f"no core package at {core_dir}")

    if standins.installed_stack(standins.REAL_ROOT) not in (None, STACK):
        raise SystemExit(f"stand-ins of another stack are installed at {standins.REAL_ROOT}")
    standins.install(standins.REAL_ROOT, stack=STACK)
    world = build_world(
        WorldSpec(
            layers=args.layers,
            stage_ids=tuple(range(args.stages)),
            tokens=args.tokens,
            shape=MoEShape(hidden=HIDDEN, ffn=FFN, experts=EXPERTS, top_k=TOP_K),
            attn_s=args.attn_us * 1e-6,
            op_timeout_s=10.0,
        )
    )
    # As the suite does (support.overlap.apply_cpu): the world's modules are
    # imported, then the layer applied; every target must be in place.
    camp2p_overlap.unpatch(timeout=10)
    report = camp2p_overlap.apply(strict=True)
    if not report.engaged:
        world.close()
        raise SystemExit(f"apply() did not engage:\n{report}")
    if report.stack != STACK:
        world.close()
        camp2p_overlap.unpatch(timeout=10)
        raise SystemExit(f"apply() picked stack {report.stack!r}; the release runner's stand-ins are {STACK!r}")
    runner = world.runner
    entry_name = next(n for n in ("execute_model", "execute_ffn_step", "_ffn_forward") if hasattr(runner, n))
    entry = getattr(runner, entry_name)
    ffn_layers = len(world.layer_list())
    try:
        # -- warm up until adaptive engage has decided for the overlap ----------
        decided_at = None
        warm = 0
        while warm < args.max_warmup:
            world.run_step()
            warm += 1
            bucket = bucket_of(camp2p_overlap.stats(), ffn_layers, args.stages)
            if not adaptive or (bucket is not None and bucket.get("decision") not in (None, "learning", "serial")):
                decided_at = warm
                break
        if decided_at is None:
            raise SystemExit(
                f"adaptive engage did not decide for the overlap within {args.max_warmup} steps "
                f"(bucket: {bucket_of(camp2p_overlap.stats(), ffn_layers, args.stages)}); "
                "try more --layers, --tokens or --attn-us"
            )
        # then --settle engaged steps in a row (a probe step restarts the count)
        settled, budget = 0, warm + 4 * args.settle + 16
        while settled < args.settle:
            if warm >= budget:
                raise SystemExit(f"the decided bucket's steps do not run engaged: {camp2p_overlap.stats()}")
            before = step_counts(camp2p_overlap.stats())
            world.run_step()
            warm += 1
            after = step_counts(camp2p_overlap.stats())
            settled = settled + 1 if after["overlap"] - before["overlap"] == 1 else 0

        # -- the measured step: one call of the runner's step entry ------------
        before_stats = camp2p_overlap.stats()
        world.steps_run += 1
        dp = world.dp_metadata()
        world.transport.begin_step(world.steps_run, world.layer_list(), sorted(dp))
        recorder = CoreCallRecorder(core_dir)
        sys.setprofile(recorder)
        try:
            entry(dp_metadata_list=dp)
        finally:
            sys.setprofile(None)
        world.synchronize()
        after_stats = camp2p_overlap.stats()
    except BaseException:
        world.settle()
        raise
    finally:
        camp2p_overlap.unpatch(timeout=30)
        world.close()

    before, after = step_counts(before_stats), step_counts(after_stats)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    bucket = bucket_of(after_stats, ffn_layers, args.stages)
    engaged = delta.get("overlap") == 1 and all(v == 0 for k, v in delta.items() if k != "overlap")
    if not engaged or (adaptive and (bucket is None or bucket.get("decision") in ("learning", "serial"))):
        raise SystemExit(f"the measured step did not run engaged: step counts changed by {delta}, bucket {bucket}")

    functions = recorder.functions()
    per_file: dict[str, list[str]] = defaultdict(list)
    for f in functions:
        per_file[f["file"]].append(f["function"])
    repo = package_dir.parent
    dirty = git(repo, "status", "--porcelain", "--", str(core_dir))
    result = {
        "commit": git(repo, "rev-parse", "HEAD"),
        # whether the measured core differs from that commit (None: not a checkout)
        "core_dirty": None if dirty is None else bool(dirty),
        "python": sys.version.split()[0],
        "stack": report.stack,
        "entry": f"{type(runner).__name__}.{entry_name}",
        "shape": {"layers": ffn_layers, "stages": args.stages, "tokens": args.tokens, "attn_us": args.attn_us},
        "warmup_steps": warm,
        "decided_overlap_after": decided_at,
        "engaged": {"step_count_delta": delta, "bucket": bucket},
        "core_files": len(per_file),
        "core_functions": len(functions),
        "core_calls": sum(f["calls"] for f in functions),
        "per_file": {k: per_file[k] for k in sorted(per_file)},
        "functions": functions,
    }
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")

    print(
        f"commit {result['commit']} (core {'modified' if dirty else 'as committed' if dirty == '' else 'unknown'})"
        f"  stack {result['stack']}  entry {result['entry']}\n"
        f"shape {ffn_layers} layers x {args.stages} stages, {args.tokens} tokens/stage; "
        f"overlap decided after {decided_at} steps, measured step #{warm + 1}\n"
        f"engaged: stats() step counts changed by {delta}, adaptive engage {args.adaptive}, bucket {bucket}\n"
        f"core files: {result['core_files']}  distinct core functions: {result['core_functions']}  "
        f"core call events: {result['core_calls']}"
    )
    for f in sorted(per_file):
        names = [r for r in functions if r["file"] == f]
        print(f"  {f} ({len(names)})")
        for r in names:
            print(f"      {r['function']}:{r['line']}  x{r['calls']}")
    if args.json is not None:
        print(f"written: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
