"""The patch engine against time and processes: every order of import /
apply / unpatch, each in a fresh interpreter (ddtrace-style); the entry
point in forked and spawned children; apply/unpatch from many threads and
while another thread imports a target; apply/unpatch storms while steps
run, unpatch during and inside a step; module reloads and re-imports.

Applied means one wrapper of ours per target, unpatched the exact
originals, and apply() imports no vLLM / torch / afd-plugin module.

The per-step criterion: every step runs either fully wrapped (the overlap
engaged in the layout configured: compute-side, the default, runs every
FFN on the runner's side-stream thread F and every A2E/E2A on the caller's
stream; comm-side runs every A2E/E2A of a stage on that stage's side-stream
thread K_s and every FFN on the caller's stream) or fully original (every
A2E/E2A and every FFN ran on the thread that called the step or on the
caller's stream), never a mix, and its outputs are bitwise those of the
serial path.

Single-thread apply/unpatch semantics, foreign wrappers and refusals:
test_patch_engine.py."""

from __future__ import annotations

import importlib
import json
import multiprocessing as mp
import os
import random
import shutil
import sys
import threading
import time
import traceback
import types
import uuid
from typing import Any

import pytest
import torch
from support.child import SUPPORT, run_program
from support.overlap import assert_same, count_our_wrappers
from support.patching import (
    CFG,
    ENGAGED,
    ROUTED,
    WRAPPED,
    assert_wrapped_once,
    classes,
    each_layout,
    layout_cfg,
    raw_targets,
    run_engaged,
    synthetic_manifest,
)

from camp2p_overlap.core.overlap.routes import ROUTER_MARK
from camp2p_overlap.core.patch_layer import PATCH_LAYER
from camp2p_overlap.core.patching.status_report import TargetState
from camp2p_overlap.emulation import device as emulated_device
from camp2p_overlap.emulation import standins
from camp2p_overlap.emulation.faults import run_step_bounded
from camp2p_overlap.emulation.world import World

pytestmark = pytest.mark.usefixtures("forget_stuck")
STEP_BOUND_S = 30.0


# ---------------------------------------------------------------------------
# every order of import / apply / unpatch, each in a fresh interpreter:
# tests/programs/patch_order_steps.py runs the steps it is given and prints
# one JSON snapshot per step.
def run_steps(steps: list[str], env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    proc = run_program("patch_order_steps.py", *steps, env={"VLLM_CAMP2P_MULTISTREAM": "1", **(env or {})}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    snaps = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("SNAP ")]
    assert [s["step"] for s in snaps] == steps, proc.stdout + proc.stderr
    for s in snaps:
        assert s["foreign"] == [], f"step {s['step']} imported {s['foreign']}"
    return snaps


def assert_snapshot_wrapped_once(snap: dict[str, Any]) -> None:
    assert snap["applied"] is True
    assert len(snap["targets"]) == 3
    for attr, t in snap["targets"].items():
        if attr == "_ffn_forward":
            assert t["ours"] == 1 and t["outer_is_ours"], (attr, t)
        else:  # the connector's targets are routed per step: nothing of ours on the class
            assert t["ours"] == 0 and t["plain_function"], (attr, t)
    assert set(snap["states"].values()) == {"wrapped", "checked"}
    assert snap["states"]["recv_attn_output"] == snap["states"]["send_ffn_output"] == "checked"
    assert snap["states"]["_ffn_layer_indices"] == "checked"


def assert_snapshot_original(snap: dict[str, Any], *, identity: bool) -> None:
    assert snap["applied"] is False
    assert len(snap["targets"]) == 3
    for attr, t in snap["targets"].items():
        assert t["ours"] == 0 and t["plain_function"], (attr, t)
        if identity:
            assert t["is_original"], attr


def test_apply_then_import() -> None:
    apply, imp = run_steps(["apply", "import"])
    assert apply["result"] is True and apply["imported"] == [False, False]
    assert set(apply["states"].values()) == {"not-imported-yet"}
    assert_snapshot_wrapped_once(imp)


def test_import_then_apply() -> None:
    imp, apply = run_steps(["import", "apply"])
    assert_snapshot_original(imp, identity=True)
    assert_snapshot_wrapped_once(apply)


def test_apply_twice_before_and_after_import() -> None:
    snaps = run_steps(["apply", "apply", "import", "apply", "apply"])
    for s in snaps[2:]:
        assert_snapshot_wrapped_once(s)


def test_import_apply_unpatch_apply() -> None:
    _, applied, unpatched, reapplied = run_steps(["import", "apply", "unpatch", "apply"])
    assert_snapshot_wrapped_once(applied)
    assert unpatched["result"] is True
    assert_snapshot_original(unpatched, identity=True)
    assert set(unpatched["states"].values()) == {"inactive"}
    assert_snapshot_wrapped_once(reapplied)


def test_apply_unpatch_import_hook_does_not_wrap() -> None:
    _, unpatched, imp, reapplied, unpatched2 = run_steps(["apply", "unpatch", "import", "apply", "unpatch"])
    assert unpatched["result"] is True
    assert_snapshot_original(imp, identity=True)
    assert "wrapped" not in imp["states"].values()
    assert_snapshot_wrapped_once(reapplied)
    assert_snapshot_original(unpatched2, identity=True)


def test_apply_unpatch_apply_then_import_wraps_once() -> None:
    snaps = run_steps(["apply", "unpatch", "apply", "import"])
    assert_snapshot_wrapped_once(snaps[-1])


def test_unpatch_twice() -> None:
    snaps = run_steps(["import", "apply", "unpatch", "unpatch"])
    assert snaps[2]["result"] is True and snaps[3]["result"] is True
    assert_snapshot_original(snaps[2], identity=True)
    assert_snapshot_original(snaps[3], identity=True)


def test_unpatch_before_apply() -> None:
    snaps = run_steps(["unpatch", "import", "unpatch", "apply"])
    assert snaps[0]["result"] is True and snaps[2]["result"] is True
    assert_snapshot_original(snaps[2], identity=True)
    assert_snapshot_wrapped_once(snaps[3])


def test_switched_off_apply_wraps_nothing() -> None:
    snaps = run_steps(["apply", "import", "apply"], env={"VLLM_CAMP2P_MULTISTREAM": "0"})
    assert [s["result"] for s in snaps] == [False, None, False]
    assert_snapshot_original(snaps[1], identity=True)
    assert_snapshot_original(snaps[2], identity=True)


@pytest.mark.parametrize("strict", ["0", "1"])
def test_import_of_package_and_apply_import_no_upstream_module(strict: str) -> None:
    proc = run_program(
        "upstream_modules_after_apply.py",
        env={"VLLM_CAMP2P_MULTISTREAM": "1", "VLLM_CAMP2P_MULTISTREAM_STRICT": strict},
    )
    assert proc.returncode == 0, proc.stderr
    assert "RESULT [] [] True 0.19.1" in proc.stdout, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------
# the entry point in forked and spawned children
def test_fork_child_inherits_exactly_one_wrapper() -> None:
    proc = run_program("fork_inherits_one_wrapper.py", env={"VLLM_CAMP2P_MULTISTREAM": "1"}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "CHILD 0 PARENT [1, 0, 0]" in proc.stdout, proc.stdout + proc.stderr


def _child(q: Any, env: dict[str, str], ref: dict, step: int) -> None:
    """Run in a child process: the entry point as vLLM calls it (twice: a
    second call must change nothing), then count our wrappers per target and
    run one step on a fresh runner, noting the threads its A2E/E2A and FFN
    kernels ran on."""
    try:
        os.environ.update(env)
        torch.set_num_threads(1)
        from camp2p_overlap.core import plugin
        from camp2p_overlap.core.patch_layer import PATCH_LAYER

        engine = PATCH_LAYER.engine
        from camp2p_overlap.emulation.moe import MoEShape
        from camp2p_overlap.emulation.world import WorldSpec, build_world

        inherited = engine.is_applied()
        plugin.register()
        plugin.register()
        w = build_world(
            WorldSpec(
                layers=3,
                stage_ids=(0, 1),
                tokens=8,
                shape=MoEShape(hidden=64, ffn=128, experts=4, top_k=2),
                op_timeout_s=10.0,
            )
        )
        counts = {}
        for mod, cls, attr in WRAPPED:
            owner = getattr(importlib.import_module(mod), cls)
            counts[f"{cls}.{attr}"] = count_our_wrappers(vars(owner)[attr], engine)
        threads: set[str] = set()
        ffn_threads: set[str] = set()
        w.transport.fault_hook = lambda kind, layer, stage: threads.add(threading.current_thread().name)
        kernel = w.moe.kernel_body

        def ffn_kernel(*args: Any, **kwargs: Any) -> Any:
            ffn_threads.add(threading.current_thread().name)
            return kernel(*args, **kwargs)

        w.moe.kernel_body = ffn_kernel
        w.steps_run = step - 1
        got = w.run_step()
        try:
            assert_same(got, ref)
            equal: bool | str = True
        except AssertionError as exc:
            equal = str(exc)
        q.put(
            {
                "pid": os.getpid(),
                "inherited_applied": inherited,
                "engaged": engine.status().engaged,
                "counts": counts,
                "equal": equal,
                "layouts": list(engine.config.layouts),
                "threads": sorted(threads),
                "ffn_threads": sorted(ffn_threads),
                "compute_thread": emulated_device.default_stream().thread.name,
                "unpatched": engine.unpatch(timeout=10),
            }
        )
    except BaseException:  # noqa: BLE001 - reported to the parent
        q.put({"error": traceback.format_exc()})


@each_layout
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_entry_point_in_forked_and_spawned_children_patches_exactly_once(make_world, method: str, layout: str) -> None:
    if method not in mp.get_all_start_methods():
        pytest.skip(f"start method {method!r} is not available on this platform")
    w = make_world(layers=3, stage_ids=(0, 1), tokens=8)
    ref = _serial_refs(w, range(7, 8))[7]
    # The parent is patched and has imported the targets (fork children inherit it).
    assert PATCH_LAYER.engine.apply(config=layout_cfg(layout), strict=True).engaged
    env = {
        "VLLM_CAMP2P_MULTISTREAM": "1",
        "VLLM_CAMP2P_MULTISTREAM_BACKEND": "cpu",
        "VLLM_CAMP2P_MULTISTREAM_LAYOUT": layout,
    }
    ctx = mp.get_context(method)
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q, env, ref, 7), name=f"camp2p-{method}-child")
    p.start()
    try:
        res = q.get(timeout=120)
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
            p.join(10)
    assert "error" not in res, res.get("error")
    assert res["pid"] != os.getpid()
    assert res["inherited_applied"] is (method == "fork")
    assert res["engaged"] is True
    assert res["counts"] == {f"{c}.{a}": 1 for _, c, a in WRAPPED}, res["counts"]
    assert res["equal"] is True, res["equal"]
    assert res["layouts"] == [layout]
    # Engaged in the layout: comm-side's A2E/E2A on the stages' K_s and FFN on the caller's stream;
    # compute-side's A2E/E2A on the caller's stream and FFN on the runner's F.
    if layout == "comm-side":
        assert res["threads"] == ["camp2p-overlap-stream-K0", "camp2p-overlap-stream-K1"]
        assert res["ffn_threads"] == [res["compute_thread"]]
    else:
        assert res["threads"] == [res["compute_thread"]]
        assert res["ffn_threads"] == ["camp2p-overlap-stream-F"]
    assert res["unpatched"] is True
    assert p.exitcode == 0
    # The parent is unaffected by what the child did.
    assert PATCH_LAYER.engine.status().engaged
    assert all(count_our_wrappers(v) == 1 for v in raw_targets().values())


# ---------------------------------------------------------------------------
# threads: apply/unpatch from many threads, apply while a thread imports
@each_layout
def test_concurrent_apply_and_unpatch_leave_a_consistent_state(make_world: Any, layout: str) -> None:
    world = make_world(layers=2, tokens=8, stage_ids=(0, 1))
    cls = classes()
    originals = {(c, a): vars(cls[c])[a] for _, c, a in WRAPPED}
    snap = {n: dict(vars(c)) for n, c in cls.items()}
    errors: list[BaseException] = []
    barrier = threading.Barrier(6)
    cfg = layout_cfg(layout)

    def worker(i: int) -> None:
        try:
            barrier.wait(timeout=10)
            for j in range(30):
                if (i + j) % 3:
                    PATCH_LAYER.engine.apply(config=cfg)
                else:
                    PATCH_LAYER.engine.unpatch(timeout=10)
                PATCH_LAYER.engine.status()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    for final in ("applied", "unpatched"):
        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "apply/unpatch threads hung"
        assert errors == []
        if final == "applied":
            PATCH_LAYER.engine.apply(config=cfg)
        else:
            PATCH_LAYER.engine.unpatch()
        if PATCH_LAYER.engine.is_applied():
            assert_wrapped_once()
            assert PATCH_LAYER.engine.status().engaged
            _, where = run_engaged(world)
            assert where == ENGAGED[layout]  # the overlap engaged in the layout applied
        else:
            for (c, a), original in originals.items():
                assert vars(cls[c])[a] is original
            for n, c in cls.items():
                assert all(vars(c)[k] is v for k, v in snap[n].items())
        assert PATCH_LAYER.engine.installer.stuck == []
        # Either way the patch layer is in one of the two whole states.
        wrapped = [PATCH_LAYER.engine.is_ours(vars(cls[c])[a]) for _, c, a in WRAPPED]
        assert all(wrapped) == PATCH_LAYER.engine.is_applied() and any(wrapped) == PATCH_LAYER.engine.is_applied()


def test_apply_while_another_thread_is_importing_the_target(tmp_path: Any, monkeypatch: Any) -> None:
    """A module that is in sys.modules but still executing is not refused:
    it is wrapped once its import finishes."""
    name = f"camp2p_slow_{uuid.uuid4().hex[:8]}"
    gate = "camp2p_slow_import_gate"  # what tests/support/slow_import_target.py imports
    ev_started, ev_go = threading.Event(), threading.Event()
    gate_mod = types.ModuleType(gate)
    gate_mod.started, gate_mod.go = ev_started, ev_go
    sys.modules[gate] = gate_mod
    shutil.copy(SUPPORT / "slow_import_target.py", tmp_path / f"{name}.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    man = synthetic_manifest(name, [("Target.plain", "self")])
    result: list[Any] = []
    try:
        for hook_first in (False, True):
            result.clear()
            ev_started.clear()
            ev_go.clear()
            sys.modules.pop(name, None)
            if hook_first:  # a hook from an earlier apply() is pending
                PATCH_LAYER.engine.apply(config=CFG, manifest=man)
                PATCH_LAYER.engine.unpatch()
            importer = threading.Thread(target=lambda: result.append(importlib.import_module(name)), daemon=True)
            importer.start()
            assert ev_started.wait(10)
            report = PATCH_LAYER.engine.apply(config=CFG, manifest=man)
            assert report.refused == ()
            assert {t.state for t in report.targets} == {TargetState.NOT_IMPORTED}
            ev_go.set()
            importer.join(10)
            assert not importer.is_alive() and result
            if not hook_first:
                # No hook saw the import. status() only reads (and says so);
                # refresh() is the explicit step that wraps the module.
                seen = PATCH_LAYER.engine.status().targets
                assert {t.state for t in seen} == {TargetState.NOT_IMPORTED}
                assert all("imported while apply() ran" in t.reason for t in seen)
                assert count_our_wrappers(vars(result[0].Target)["plain"]) == 0
                PATCH_LAYER.engine.refresh()
            assert {t.state for t in PATCH_LAYER.engine.status().targets} == {TargetState.WRAPPED}
            assert count_our_wrappers(vars(result[0].Target)["plain"]) == 1
            assert PATCH_LAYER.engine.unpatch() is True
    finally:
        ev_go.set()
        PATCH_LAYER.engine.unpatch()
        sys.modules.pop(name, None)
        sys.modules.pop(gate, None)


# ---------------------------------------------------------------------------
# steps running while apply/unpatch: storms, unpatch during and inside a step
class CommThreads:
    """Records, per step number, on which thread (stream) each A2E/E2A ran (through
    the transport's fault hook, which every emulated op calls first) and each
    FFN kernel ran (through the FFN block's kernel body), to tell a wrapped step
    of ``layout`` from an original one."""

    def __init__(self, world: World, layout: str = "compute-side") -> None:
        self.world = world
        self.layout = layout
        self.by_step: dict[int, list[tuple[str, int | None, str]]] = {}
        self._lock = threading.Lock()
        world.transport.fault_hook = self._hook
        kernel = world.moe.kernel_body

        def ffn_kernel(*args: Any, **kwargs: Any) -> Any:
            self._note("ffn", None)
            return kernel(*args, **kwargs)

        world.moe.kernel_body = ffn_kernel

    def _hook(self, kind: str, layer: int, stage: int) -> None:
        self._note(kind, stage)

    def _note(self, kind: str, stage: int | None) -> None:
        with self._lock:
            self.by_step.setdefault(self.world.transport.step, []).append(
                (kind, stage, threading.current_thread().name)
            )

    def mode(self, step: int, caller: str) -> str:
        ops = self.by_step.get(step, [])
        if not ops:
            return "none"
        comm = [(s, t) for k, s, t in ops if k != "ffn"]
        ffn = [t for k, _, t in ops if k == "ffn"]
        if not comm or not ffn:
            return f"INCOMPLETE: {ops}"
        # The original loop's ops run on the compute stream (the emulated
        # device's default stream: its own worker thread), or on the caller
        # for a transport that works on the host.
        compute = emulated_device.default_stream().thread.name
        host = (caller, compute)
        if all(t in host for _, t in comm) and all(t in host for t in ffn):
            return "original"
        if self.layout == "comm-side":  # A2E/E2A on the stage's K_s, the FFN on the caller's stream
            engaged = all(t == f"camp2p-overlap-stream-K{s}" for s, t in comm) and all(t in host for t in ffn)
        else:  # compute-side: A2E/E2A on the caller's stream, every FFN on the runner's F
            engaged = all(t in host for _, t in comm) and all(t == "camp2p-overlap-stream-F" for t in ffn)
        return "wrapped" if engaged else f"MIX: {ops}"


def _serial_refs(world: World, steps: range) -> dict[int, dict]:
    assert not PATCH_LAYER.engine.is_applied()
    refs = {}
    for n in steps:
        out = run_step_bounded(world, n, STEP_BOUND_S)
        assert out.error is None and not out.hung
        refs[n] = out.results
    return refs


class Gate:
    """Blocks the E2A (or the A2E: ``kind``) of one (layer, stage) on the
    host, inside the connector's send (receive): in the custom op's host
    part, which the loop's thread runs inside the step (its kernel runs on a
    stream, after the host has moved on), until opened."""

    def __init__(self, world: World, layer: int = 0, stage: int = 0, kind: str = "e2a") -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.layer, self.stage, self.kind = layer, stage, kind
        transport = world.transport
        op = getattr(type(transport), kind).__get__(transport)

        def held(**kw: Any) -> Any:
            if (kw["layer"], kw["stage"]) == (self.layer, self.stage):
                self.entered.set()
                if not self.release.wait(STEP_BOUND_S):
                    raise TimeoutError("gate never opened")
            return op(**kw)

        setattr(transport, kind, held)


@each_layout
def test_apply_unpatch_storm_while_steps_run(make_world, layout: str) -> None:
    """Four threads apply and unpatch at random while a fifth runs steps:
    each step is fully wrapped (in the layout applied) or fully original, and
    bitwise correct."""
    w = make_world(layers=3, stage_ids=(0, 2), tokens=8)
    originals = raw_targets()
    n_refs = 40
    refs = _serial_refs(w, range(1, n_refs + 1))
    comm = CommThreads(w, layout)
    cfg = layout_cfg(layout)
    stop = threading.Event()
    unpatch_results: list[bool] = []
    errors: list[str] = []
    modes: dict[str, int] = {}

    def storm(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                if rng.random() < 0.5:
                    PATCH_LAYER.engine.apply(config=cfg)
                else:
                    unpatch_results.append(PATCH_LAYER.engine.unpatch(timeout=10))
                time.sleep(rng.uniform(0, 0.004))
        except BaseException:  # noqa: BLE001 - reported below
            errors.append(traceback.format_exc())

    def stepper() -> None:
        try:
            i = 0
            while not stop.is_set():
                n = 1 + i % n_refs
                w.steps_run = n - 1
                got = w.run_step()
                mode = comm.mode(n, threading.current_thread().name)
                comm.by_step.pop(n, None)
                modes[mode] = modes.get(mode, 0) + 1
                if mode not in ("wrapped", "original"):
                    errors.append(f"step {n}: {mode}")
                try:
                    assert_same(got, refs[n])
                except AssertionError as exc:
                    errors.append(f"step {n} ({mode}): outputs differ from the serial path: {exc}")
                i += 1
                both = modes.get("wrapped", 0) >= 10 and modes.get("original", 0) >= 10
                if (i >= 150 and both) or i >= 3000 or errors:
                    stop.set()
        except BaseException:  # noqa: BLE001 - reported below
            errors.append(traceback.format_exc())
            stop.set()

    threads = [threading.Thread(target=storm, args=(k,), name=f"storm-{k}", daemon=True) for k in range(4)]
    threads.append(threading.Thread(target=stepper, name="stepper", daemon=True))
    for t in threads:
        t.start()
    threads[-1].join(90)  # the stepper decides when the storm ends
    stop.set()
    for t in threads:
        t.join(10.0)
    alive = [t.name for t in threads if t.is_alive()]
    assert not alive, f"threads still running (a step hung?): {alive}; modes so far {modes}; {errors[:3]}"
    assert not errors, "\n".join(errors[:5])
    assert set(modes) == {"wrapped", "original"}, modes
    assert modes["wrapped"] >= 10 and modes["original"] >= 10, modes
    assert all(unpatch_results), "an unpatch() refused although every step is short"

    # Whatever state the storm left: consistent. Applied means each target
    # carries exactly one of our wrappers; after unpatch, the exact originals.
    if PATCH_LAYER.engine.is_applied():
        assert PATCH_LAYER.engine.status().engaged
        for key, obj in raw_targets().items():
            assert count_our_wrappers(obj) == 1, key
    assert PATCH_LAYER.engine.unpatch(timeout=10)
    assert raw_targets() == originals and all(raw_targets()[k] is originals[k] for k in originals)
    assert not [t for t in threading.enumerate() if t.name.startswith("camp2p-overlap-stream-")]


def test_unpatch_waits_for_the_active_step_and_new_steps_run_original(make_world) -> None:
    w = make_world(layers=3, stage_ids=(0, 1), tokens=8)
    other = make_world(layers=2, stage_ids=(0, 1), tokens=8, seed=5)
    ref = _serial_refs(w, range(4, 5))[4]
    ref_other = _serial_refs(other, range(6, 7))[6]
    assert PATCH_LAYER.engine.apply(config=CFG, strict=True).engaged
    gate = Gate(w, layer=1, stage=0)
    events: list[str] = []
    box: dict[str, Any] = {}

    def step() -> None:
        box["step"] = run_step_bounded(w, 4, STEP_BOUND_S)
        events.append("step done")

    def unpatch() -> None:
        box["unpatch"] = PATCH_LAYER.engine.unpatch(timeout=20)
        box["running_when_unpatch_returned"] = PATCH_LAYER.engine.gate.running()
        events.append("unpatch returned")

    st = threading.Thread(target=step, name="stepper")
    st.start()
    assert gate.entered.wait(STEP_BOUND_S), "the step never reached the gate"
    ut = threading.Thread(target=unpatch, name="unpatcher")
    ut.start()
    # While unpatch() waits for the step, a new step (another runner, another
    # thread) runs the original code, with no side stream.
    deadline = time.monotonic() + 10
    while not PATCH_LAYER.engine.gate.draining and time.monotonic() < deadline:
        time.sleep(0.005)
    assert PATCH_LAYER.engine.gate.draining and ut.is_alive() and PATCH_LAYER.engine.is_applied()
    comm = CommThreads(other)
    out_other = run_step_bounded(other, 6, STEP_BOUND_S)
    assert out_other.error is None
    assert_same(out_other.results, ref_other)
    assert comm.mode(6, "camp2p-test-step-6") == "original"
    assert ut.is_alive() and events == [], "unpatch() returned while a wrapped step was still running"
    gate.release.set()
    st.join(STEP_BOUND_S)
    ut.join(STEP_BOUND_S)
    # unpatch() was shown above to wait while the step was held; once the step
    # is released, which thread appends first is a race of this test's own
    # threads (unpatch may return between the wrapper's exit and the step
    # thread's append), not of the patch layer.
    assert sorted(events) == ["step done", "unpatch returned"]
    assert box["running_when_unpatch_returned"] == 0, "unpatch() returned while a wrapped step was running"
    assert box["unpatch"] is True and not PATCH_LAYER.engine.is_applied()
    assert box["step"].error is None
    assert_same(box["step"].results, ref)


@each_layout
def test_unpatch_timeout_refuses_cleanly_and_leaves_the_layer_working(make_world, logs, layout: str) -> None:
    w = make_world(layers=3, stage_ids=(0, 1), tokens=8)
    refs = _serial_refs(w, range(2, 4))
    assert PATCH_LAYER.engine.apply(config=layout_cfg(layout), strict=True).engaged
    wrapped_before = raw_targets()
    gate = Gate(w, layer=0, stage=1)
    box: dict[str, Any] = {}
    st = threading.Thread(target=lambda: box.setdefault("out", run_step_bounded(w, 2, STEP_BOUND_S)))
    st.start()
    assert gate.entered.wait(STEP_BOUND_S)
    assert PATCH_LAYER.engine.unpatch(timeout=0.2) is False
    assert any("unpatch() refused: 1 step(s) still running after 0.2 s" in m for m in logs.messages), logs.messages
    assert PATCH_LAYER.engine.is_applied() and not PATCH_LAYER.engine.gate.draining
    assert PATCH_LAYER.engine.status().engaged
    assert all(raw_targets()[k] is wrapped_before[k] for k in wrapped_before)
    gate.release.set()
    st.join(STEP_BOUND_S)
    assert box["out"].error is None
    assert_same(box["out"].results, refs[2])
    # The patch layer still engages on the next step.
    comm = CommThreads(w, layout)
    nxt = run_step_bounded(w, 3, STEP_BOUND_S)
    assert nxt.error is None
    assert_same(nxt.results, refs[3])
    assert comm.mode(3, "camp2p-test-step-3") == "wrapped"
    assert PATCH_LAYER.engine.unpatch(timeout=10) is True


def test_unpatch_refuses_while_a_step_waits_in_the_connectors_receive(make_world, patch_layer) -> None:
    """A step of a patch layer of the test's own, held inside the connector's
    receive (an A2E waiting on an Event) on another thread: unpatch(timeout=0.2)
    returns False and leaves the wrappers and the step's connector routes in
    place; once the receive is released the step ends bitwise and unpatch()
    returns True with nothing of ours left on the class or the instance."""
    w = make_world(layers=3, stage_ids=(0, 1), tokens=8)
    ref = _serial_refs(w, range(2, 3))[2]
    routed = [a for _, _, a in ROUTED]
    plain = raw_targets()
    assert patch_layer.engine.apply(config=CFG, strict=True).engaged
    wrapped = raw_targets()
    assert all(patch_layer.engine.is_ours(v) for v in wrapped.values())
    gate = Gate(w, layer=1, stage=1, kind="a2e")
    box: dict[str, Any] = {}
    st = threading.Thread(target=lambda: box.setdefault("out", run_step_bounded(w, 2, STEP_BOUND_S)))
    st.start()
    try:
        assert gate.entered.wait(STEP_BOUND_S), "the step never reached the receive"
        assert patch_layer.engine.gate.running() == 1
        assert patch_layer.engine.unpatch(timeout=0.2) is False
        assert patch_layer.engine.is_applied() and not patch_layer.engine.gate.draining
        assert all(raw_targets()[k] is wrapped[k] for k in wrapped), "a wrapper went while the step ran"
        assert all(getattr(vars(w.connector).get(a), ROUTER_MARK, False) is True for a in routed), (
            "the step's routes went while it ran"
        )
    finally:
        gate.release.set()
        st.join(STEP_BOUND_S)
    assert box["out"].error is None and not box["out"].hung
    assert_same(box["out"].results, ref)
    assert patch_layer.engine.unpatch(timeout=10) is True
    assert all(raw_targets()[k] is plain[k] for k in plain)
    assert not set(routed) & set(vars(w.connector)), "a route of ours is left on the connector instance"


@each_layout
@pytest.mark.parametrize("stages", [(0, 1), (1,)], ids=["overlap-step", "serial-gate-step"])
def test_unpatch_from_inside_a_step_on_the_same_thread_refuses(make_world, logs, stages, layout: str) -> None:
    w = make_world(layers=3, stage_ids=stages, tokens=8)
    ref = _serial_refs(w, range(5, 6))[5]
    assert PATCH_LAYER.engine.apply(config=layout_cfg(layout), strict=True).engaged
    comm = CommThreads(w, layout)  # before the model is replaced: it hooks the FFN block's kernel
    inner = w.runner.model
    calls: list[bool] = []

    class Model:
        def compute_ffn_output(self, *, hidden_states: Any, layer_idx: int) -> Any:
            if layer_idx == 1 and not calls:
                calls.append(PATCH_LAYER.engine.unpatch(timeout=1))
            return inner.compute_ffn_output(hidden_states=hidden_states, layer_idx=layer_idx)

    w.runner.model = Model()
    out = run_step_bounded(w, 5, STEP_BOUND_S)
    assert calls == [False]
    assert any("called from inside a running FFN step on this thread; refused" in m for m in logs.messages)
    assert out.error is None
    assert_same(out.results, ref)
    assert comm.mode(5, "camp2p-test-step-5") == ("wrapped" if len(stages) > 1 else "original")
    assert PATCH_LAYER.engine.is_applied()
    assert PATCH_LAYER.engine.unpatch(timeout=10) is True


# ---------------------------------------------------------------------------
# module reloads and re-imports
@each_layout
def test_reload_of_the_runner_module(make_world, layout: str) -> None:
    """``importlib.reload`` makes a new runner class, and wrapt's post-import
    hooks do not fire on a reload; the re-execution watch does, as the
    module's body ends: the new class is wrapped at once and the old class
    gets its original back, with no refresh and no check in any step (a
    step reads only the engine's ready flag). Steps of the new class are
    wrapped and equal serial; an instance of the old class runs the
    original, correctly. Unpatch restores the new class exactly."""
    w_old = make_world(layers=2, stage_ids=(0, 1), tokens=8)
    refs = _serial_refs(w_old, range(1, 5))
    runner_mod = w_old.modules[0]
    old_cls = runner_mod.AFDNPUFFNModelRunner
    old_raw = vars(old_cls)["_ffn_forward"]
    assert PATCH_LAYER.engine.apply(config=layout_cfg(layout), strict=True).engaged
    assert count_our_wrappers(vars(old_cls)["_ffn_forward"]) == 1
    assert PATCH_LAYER.engine.unready is None

    importlib.reload(runner_mod)
    new_cls = runner_mod.AFDNPUFFNModelRunner
    assert new_cls is not old_cls
    assert count_our_wrappers(vars(new_cls)["_ffn_forward"]) == 1  # wrapped as the reload ended
    new_raw = vars(new_cls)["_ffn_forward"].__wrapped__
    assert vars(old_cls)["_ffn_forward"] is old_raw  # the old class got its original back
    assert PATCH_LAYER.engine.unready is None and PATCH_LAYER.engine.status().engaged

    w_new = make_world(layers=2, stage_ids=(0, 1), tokens=8)
    assert type(w_new.runner) is new_cls
    comm = CommThreads(w_new, layout)
    for step in (1, 2):
        out = run_step_bounded(w_new, step, STEP_BOUND_S)
        assert out.error is None
        assert_same(out.results, refs[step])
        assert comm.mode(step, f"camp2p-test-step-{step}") == "wrapped"
    # An instance of the old class now runs the original code, correctly.
    comm_old = CommThreads(w_old, layout)
    out = run_step_bounded(w_old, 3, STEP_BOUND_S)
    assert out.error is None
    assert_same(out.results, refs[3])
    assert comm_old.mode(3, "camp2p-test-step-3") == "original"

    assert PATCH_LAYER.engine.unpatch(timeout=10)
    assert vars(new_cls)["_ffn_forward"] is new_raw
    assert vars(old_cls)["_ffn_forward"] is old_raw


def test_a_reload_no_hook_saw_is_reported_and_refresh_wraps_it(make_world, monkeypatch) -> None:
    """A reload the re-execution watch did not see (here: the watch is
    bypassed) leaves the new class unwrapped: ``status()`` reports it and
    only reads; the explicit ``refresh()`` (which ``apply()`` takes too)
    wraps it and clears the ready flag it set."""
    from camp2p_overlap.core.patching import reexec_watch

    w_old = make_world(layers=2, stage_ids=(0, 1), tokens=8)
    runner_mod = w_old.modules[0]
    assert PATCH_LAYER.engine.apply(config=CFG, strict=True).engaged
    monkeypatch.setattr(reexec_watch.REEXEC_WATCH, "_notify", lambda module: None)
    importlib.reload(runner_mod)
    new_cls = runner_mod.AFDNPUFFNModelRunner
    assert count_our_wrappers(vars(new_cls)["_ffn_forward"]) == 0  # no hook saw it
    stale = PATCH_LAYER.engine.status()
    assert not stale.engaged and "module reloaded since it was wrapped" in str(stale)
    assert count_our_wrappers(vars(new_cls)["_ffn_forward"]) == 0
    PATCH_LAYER.engine.refresh()
    assert PATCH_LAYER.engine.status().engaged and PATCH_LAYER.engine.unready is None
    assert count_our_wrappers(vars(new_cls)["_ffn_forward"]) == 1


@each_layout
def test_reimport_of_the_target_modules(make_world, layout: str) -> None:
    """The stand-ins dropped from ``sys.modules`` and imported again: fresh
    module and class objects. wrapt's post-import hooks have fired already
    (wrapt pops them); the re-execution watch sees the new import, so the
    new classes are wrapped as each module's body ends; a wrapped step of a
    new runner engages, and unpatch restores every class."""
    w1 = make_world(layers=2, stage_ids=(0, 2), tokens=8)
    refs = _serial_refs(w1, range(1, 3))
    first_raw = raw_targets()
    first_owners = {(cls, attr): getattr(importlib.import_module(mod), cls) for mod, cls, attr in WRAPPED}
    cfg = layout_cfg(layout)
    assert PATCH_LAYER.engine.apply(config=cfg, strict=True).engaged
    assert all(count_our_wrappers(v) == 1 for v in raw_targets().values())
    standins.uninstall(standins.REAL_ROOT)
    w2 = make_world(layers=2, stage_ids=(0, 2), tokens=8)  # imports the stand-ins again
    assert type(w2.runner) is not type(w1.runner)
    assert all(count_our_wrappers(v) == 1 for v in raw_targets().values())  # wrapped at the re-import
    fresh = {k: v.__wrapped__ for k, v in raw_targets().items()}
    assert PATCH_LAYER.engine.status().engaged and PATCH_LAYER.engine.unready is None
    assert PATCH_LAYER.engine.apply(config=cfg, strict=True).engaged  # apply() again changes nothing
    assert all(count_our_wrappers(v) == 1 for v in raw_targets().values())
    # The first import's classes got their exact originals back.
    assert all(vars(first_owners[k])[k[1]] is first_raw[k] for k in first_raw)
    comm = CommThreads(w2, layout)
    out = run_step_bounded(w2, 1, STEP_BOUND_S)
    assert out.error is None
    assert_same(out.results, refs[1])
    assert comm.mode(1, "camp2p-test-step-1") == "wrapped"
    assert PATCH_LAYER.engine.unpatch(timeout=10)
    after = raw_targets()
    assert all(after[k] is fresh[k] for k in fresh)


@each_layout
def test_a_ready_step_reads_the_ready_flag_and_walks_no_target(make_world, monkeypatch, layout: str) -> None:
    """The lifecycle is off the hot path: while every target is ready, a
    wrapped step looks at no manifest module (the engine's ``unready`` flag
    is all it reads); once the flag says why it is not ready, the step
    refreshes (and so wraps what a hook missed)."""
    w = make_world(layers=2, stage_ids=(0, 1), tokens=8)
    refs = _serial_refs(w, range(1, 4))
    assert PATCH_LAYER.engine.apply(config=layout_cfg(layout), strict=True).engaged
    walks: list[int] = []
    real = PATCH_LAYER.engine.installer.needing_install
    monkeypatch.setattr(
        PATCH_LAYER.engine.installer, "needing_install", lambda *a, **k: walks.append(1) or real(*a, **k)
    )
    comm = CommThreads(w, layout)
    out = run_step_bounded(w, 1, STEP_BOUND_S)
    assert out.error is None and comm.mode(1, "camp2p-test-step-1") == "wrapped"
    assert_same(out.results, refs[1])
    assert walks == []
    PATCH_LAYER.engine.unready = "a target module was imported while apply() ran"
    out = run_step_bounded(w, 2, STEP_BOUND_S)
    assert out.error is None and comm.mode(2, "camp2p-test-step-2") == "wrapped"
    assert walks and PATCH_LAYER.engine.unready is None  # the step refreshed, and found every target ready
    walks.clear()
    out = run_step_bounded(w, 3, STEP_BOUND_S)
    assert out.error is None and walks == []
    assert PATCH_LAYER.engine.unpatch(timeout=10)
    assert PATCH_LAYER.engine.unready is not None  # unpatched: not ready until the next apply()
