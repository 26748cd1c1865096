"""The two supported stacks side by side: each shipped manifest has its
stand-ins, whose targets match that manifest; the runner stand-ins differ
where afd-plugin main differs from release/v0.19.1rc1 (docs/design.md,
"Supported stacks"), and the overlap keeps what each loop's forward context
gives the FFN compute."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from support.overlap import Schedule, apply_cpu, assert_same, run_step, serial_results, world, wrap_model
from support.stacks import STACK_DISTS, use_stack

from camp2p_overlap.core.observe import trace
from camp2p_overlap.core.patch_layer import PatchLayer
from camp2p_overlap.core.patching.manifest import (
    DEFAULT_STACK,
    available_stacks,
    load_manifest,
    signature_difference,
    signature_of,
)
from camp2p_overlap.emulation import standins
from camp2p_overlap.emulation.standin_patch_layer import release_site, standin_site
from camp2p_overlap.verify import edges

RUNNER = "afd_plugin.v1.worker.npu.ffn_model_runner"


def test_every_shipped_stack_has_stand_ins_and_the_suite_runs_it() -> None:
    assert set(available_stacks()) == set(standins.STACKS) == set(STACK_DISTS)


@pytest.mark.parametrize("stack", sorted(standins.STACKS))
def test_stand_in_targets_match_their_stack_manifest(stack: str) -> None:
    manifest = load_manifest(stack)
    with use_stack(stack):
        for t in manifest.targets():
            owner: Any = importlib.import_module(t.module)
            for part in t.owner_path:
                owner = vars(owner)[part]
            assert t.attribute in vars(owner), t.id
            assert signature_difference(t.signature, signature_of(vars(owner)[t.attribute])) is None, t.id


def test_the_stand_ins_default_stack_is_the_manifests_default() -> None:
    """The stand-ins keep their own name for it (they import nothing of ours)."""
    assert standins.STANDINS_DEFAULT_STACK == DEFAULT_STACK
    standins.install()  # no stack named, none installed: the default
    assert standins.installed_stack() == DEFAULT_STACK


def test_install_keeps_one_stack_per_root() -> None:
    standins.install(stack="vllm-0.26.0")
    assert standins.installed_stack() == "vllm-0.26.0"
    assert standins.install() == standins.REAL_ROOT  # no stack named: the installed one
    assert standins.installed_stack() == "vllm-0.26.0"
    with pytest.raises(RuntimeError, match="uninstall them first"):
        standins.install(stack="vllm-0.19.1")
    standins.uninstall()
    assert standins.installed_stack() is None
    with pytest.raises(ValueError, match=r"no stand-ins for stack 'vllm-0\.30\.0'"):
        standins.install(stack="vllm-0.30.0")
    assert standins.installed_stack() is None


@pytest.mark.parametrize("stack", sorted(standins.STACKS))
def test_standin_site_names_the_stack_and_its_manifest(stack: str) -> None:
    site = standin_site(stack)
    try:
        assert site.manifest.name == stack and standins.installed_stack(site.root) == stack
        runner = importlib.import_module(f"{site.root}.v1.worker.npu.ffn_model_runner")
        main = stack == "vllm-0.26.0"
        assert runner.__file__.endswith("ffn_model_runner_main.py" if main else "ffn_model_runner.py")
    finally:
        release_site(site)


# ---------------------------------------------------------------------------
# Where the loops differ.


def _contexts_seen(w: Any) -> list[tuple[int, int, int, Any]]:
    """Wrap the world's FFN compute to record, per call, (layer, stage, the
    context's num_tokens, the forward context in force: kept, so no two
    contexts share an id); returns the live list."""
    get = w.modules[0].get_forward_context
    seen: list[tuple[int, int, int, Any]] = []

    def before(layer: int, stage: int) -> None:
        ctx = get()
        assert ctx is not None, "FFN computed outside a forward context"
        seen.append((layer, stage, ctx["num_tokens"], ctx))

    wrap_model(w, before_with_stage=before)
    return seen


@pytest.mark.parametrize("layout", ["compute-side", "comm-side"])
@pytest.mark.parametrize("stack", sorted(standins.STACKS))
def test_forward_context_per_step_or_per_layer_and_stage_and_the_overlap_keeps_it(
    stack: str, layout: str, patch_layer: PatchLayer
) -> None:
    """release/v0.19.1rc1 opens one context for the step (sized by the first
    stage's tokens); main opens one per (layer, stage), sized by that stage.
    With the overlap engaged in either layout (compute-side: every FFN on the
    runner's stream F, A2E/E2A on the caller's; comm-side: A2E/E2A on the
    stages' K_s) each compute still runs in the context the loop opened for
    it, and the outputs are bitwise the serial ones."""
    tokens = (7, 3)
    scheds = [Schedule(3, (0, 1), tokens, step) for step in (1, 2)]
    with use_stack(stack):
        w = world(layers=3, stage_ids=(0, 1))
        seen = _contexts_seen(w)
        (ref, _) = serial_results(w, scheds, patch_layer=patch_layer)
        serial_seen = list(seen)
        seen.clear()
        apply_cpu(patch_layer=patch_layer, layouts=(layout,))
        with trace.recording() as rec:
            got = run_step(w, scheds[0])
        assert_same(got, ref)
        (step,) = rec.steps()
        # Engaged in the layout: its streams, in its schedule.
        comm_side = layout == "comm-side"
        expected = trace.ExpectedSchedule((0, 1, 2), (0, 1), comm_side, comm_side, not comm_side)
        res = edges.check_step(rec.ops(step), expected)
        assert res.ok, str(res)
        where = {(o.kind, o.stream) for o in rec.ops(step) if o.kind in ("a2e", "ffn", "e2a")}
        if comm_side:
            assert where == {(k, f"K{s}") for k in ("a2e", "e2a") for s in (0, 1)} | {("ffn", "C")}, where
        else:
            assert where == {("a2e", "C"), ("e2a", "C"), ("ffn", "F")}, where
        patch_layer.engine.unpatch(timeout=10)
    pairs = [(layer, stage) for layer in range(3) for stage in (0, 1)]
    # Each FFN of the overlap saw a context sized as the serial loop's for the same (layer, stage).
    assert [c[:3] for c in seen] == [c[:3] for c in serial_seen[: len(pairs)]]
    for calls in (serial_seen[: len(pairs)], seen):
        assert [(layer, stage) for layer, stage, _, _ in calls] == pairs
        if stack == "vllm-0.26.0":
            assert [n for _, stage, n, _ in calls] == [tokens[stage] for _, stage in pairs]
            assert len({id(c) for *_, c in calls}) == len(pairs)  # a fresh context each time
        else:
            assert {n for *_, n, _ in calls} == {tokens[0]}
            assert len({id(c) for *_, c in calls}) == 1  # one context for the whole step


@pytest.mark.parametrize("stack", sorted(standins.STACKS))
def test_a_runner_without_afd_config(stack: str, patch_layer: PatchLayer) -> None:
    """release/v0.19.1rc1 runs every layer for a runner without afd_config;
    main reads it directly and raises. Applied, the gate refuses the runner
    (no AFD role) and the original runs: the caller sees the same either way."""
    with use_stack(stack):
        w = world(layers=2, stage_ids=(0, 1))
        del w.runner.afd_config
        sched = Schedule(2, (0, 1), (4, 4), 1)
        outcomes = []
        for applied in (False, True):
            if applied:
                apply_cpu(patch_layer=patch_layer)
            # The transport is told the layers itself: the harness must not
            # call _ffn_layer_indices for the runner (main's would raise here).
            w.transport.begin_step(sched.step, [0, 1], sched.stages)
            try:
                w.runner.execute_ffn_step(dp_metadata_list=sched.dp())
                w.synchronize()
                outcomes.append(("ok", sorted(w.transport.results)))
            except AttributeError as exc:
                outcomes.append(("AttributeError", str(exc)))
        patch_layer.engine.unpatch(timeout=10)
    assert outcomes[0] == outcomes[1]
    if stack == "vllm-0.26.0":
        assert outcomes[0][0] == "AttributeError" and "afd_config" in outcomes[0][1]
    else:
        assert outcomes[0] == ("ok", [(layer, stage) for layer in range(2) for stage in (0, 1)])
