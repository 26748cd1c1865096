"""The patch engine in-process, one thread: apply() imports nothing and
waits for the import, one wrapper per target, exact restore, foreign
wrappers, refusals of changed or missing targets, synthetic
static/class/inherited targets, status, the one log line and the report.

Orders in fresh interpreters, threads, reloads, forked and spawned
children and unpatch during a step: test_patch_orders.py."""

from __future__ import annotations

import functools
import importlib
import logging
import sys
import types
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import wrapt
from support.child import SUPPORT
from support.logs import PackageLogs
from support.overlap import assert_same, count_our_wrappers
from support.patching import (
    CFG,
    CONNECTOR,
    ENGAGED,
    ROUTED,
    RUNNER,
    WRAPPED,
    assert_wrapped_once,
    each_layout,
    import_targets,
    layout_cfg,
    raw_targets,
    run_engaged,
    run_traced,
    synthetic_manifest,
    variant_module,
)

from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.patch_layer import PatchLayer
from camp2p_overlap.core.patching.lifecycle import PatchRefused
from camp2p_overlap.core.patching.manifest import load_manifest
from camp2p_overlap.core.patching.status_report import PatchReport, TargetState
from camp2p_overlap.emulation import standins


def engine_states(patch_layer: PatchLayer) -> dict[str, TargetState]:
    return {t.target.rsplit(".", 1)[-1]: t.state for t in patch_layer.engine.status().targets}


@pytest.fixture
def world(make_world: Any) -> Any:
    return make_world(layers=2, tokens=8, stage_ids=(0, 1))


# ---------------------------------------------------------------------------
# apply() imports nothing and waits for the import
def test_apply_does_not_import_targets(patch_layer: PatchLayer) -> None:
    standins.install()
    before = set(sys.modules)
    report = patch_layer.engine.apply(config=CFG)
    assert report.applied and patch_layer.engine.is_applied()
    new = set(sys.modules) - before
    assert not [m for m in new if m.startswith(("afd_plugin", "vllm", "torch_npu"))], new
    assert RUNNER not in sys.modules and CONNECTOR not in sys.modules
    assert set(engine_states(patch_layer=patch_layer).values()) == {TargetState.NOT_IMPORTED}
    assert len(report.targets) == len(load_manifest().targets())
    # The post-import hooks do the wrapping.
    import_targets()
    assert_wrapped_once(patch_layer=patch_layer)
    states = engine_states(patch_layer=patch_layer)
    assert states["_ffn_layer_indices"] is TargetState.CHECKED
    assert {states[a] for _, _, a in WRAPPED} == {TargetState.WRAPPED}
    assert patch_layer.engine.status().engaged


def test_status_not_imported_then_partial_then_complete(patch_layer: PatchLayer) -> None:
    standins.install()
    patch_layer.engine.apply(config=CFG)
    importlib.import_module(RUNNER)
    states = engine_states(patch_layer=patch_layer)
    assert states["_ffn_forward"] is TargetState.WRAPPED
    assert states["recv_attn_output"] is TargetState.NOT_IMPORTED
    partial = patch_layer.engine.status()
    assert not partial.engaged and not partial.to_dict()["engaged"]
    assert "recv_attn_output" in (PatchReport.unready_of(partial.targets) or "")
    importlib.import_module(CONNECTOR)
    complete = patch_layer.engine.status()
    assert complete.engaged and PatchReport.unready_of(complete.targets) is None
    patch_layer.engine.unpatch()
    assert not patch_layer.engine.is_applied()
    assert set(engine_states(patch_layer=patch_layer).values()) == {TargetState.INACTIVE}


# ---------------------------------------------------------------------------
# one wrapper, exact restore
def test_apply_twice_then_import_leaves_one_wrapper_and_restores_identity(patch_layer: PatchLayer) -> None:
    standins.install()
    r1 = patch_layer.engine.apply(config=CFG)
    r2 = patch_layer.engine.apply(config=CFG)
    assert r1.applied and r2.applied
    cls = import_targets()
    patch_layer.engine.apply(config=CFG)  # and once more after the import
    assert_wrapped_once(patch_layer=patch_layer)
    inner = {(c, a): vars(cls[c])[a].__wrapped__ for _, c, a in WRAPPED}
    rest = {c: {k: v for k, v in vars(k_).items() if (c, k) not in inner} for c, k_ in cls.items()}
    assert patch_layer.engine.unpatch() is True
    for (c, a), original in inner.items():
        assert vars(cls[c])[a] is original
        assert not patch_layer.engine.is_ours(vars(cls[c])[a])
    for c, entries in rest.items():
        assert all(vars(cls[c])[k] is v for k, v in entries.items())
        assert set(vars(cls[c])) == set(entries) | {a for (cc, a) in inner if cc == c}


def ours_in_chain(engine: Any, entry: Any) -> int:
    """How many wrappers of ``engine`` the ``__wrapped__`` links from the
    class-dict ``entry`` down pass through (walked by hand, not by wrapt)."""
    n, seen = 0, set()
    while entry is not None and id(entry) not in seen:
        seen.add(id(entry))
        n += engine.is_ours(entry)
        entry = getattr(entry, "__wrapped__", None)
    return n


def test_repeated_apply_keeps_the_one_wrapper_it_installed(patch_layer: Any) -> None:
    """apply() on an applied layer, before and after the import, wraps
    nothing again and keeps its configuration: each wrap target's chain
    holds exactly one of ours, the very wrapper the first install put there."""
    standins.install()
    assert patch_layer.engine.apply(config=CFG).applied
    for _ in range(2):  # another configuration is ignored: the patch layer is applied already
        assert patch_layer.engine.apply(config=OverlapConfig(enabled=True, backend="cpu", min_stages=3)).applied
    assert patch_layer.engine.config is CFG
    cls = import_targets()
    first = {(c, a): vars(cls[c])[a] for _, c, a in WRAPPED}
    for _ in range(3):
        assert patch_layer.engine.apply(config=CFG).engaged and patch_layer.engine.config is CFG
        for (c, a), entry in first.items():
            assert vars(cls[c])[a] is entry, f"{c}.{a} was wrapped again"
            assert ours_in_chain(patch_layer.engine, entry) == 1
            assert not patch_layer.engine.is_ours(entry.__wrapped__)
    assert patch_layer.engine.unpatch() is True
    for (c, a), entry in first.items():
        assert vars(cls[c])[a] is entry.__wrapped__ and ours_in_chain(patch_layer.engine, vars(cls[c])[a]) == 0


def test_installing_a_module_twice_keeps_the_one_wrapper(patch_layer: Any) -> None:
    """The installer, handed the same (unreloaded) module twice, keeps its
    first wrap: one of ours in the chain, one record, the same wrapper."""
    cls = import_targets()
    raw = raw_targets()
    assert patch_layer.engine.apply(config=CFG).engaged
    installer, manifest = patch_layer.engine.installer, patch_layer.engine.manifest
    entries = {(c, a): vars(cls[c])[a] for _, c, a in WRAPPED}
    records = {m: list(r) for m, r in installer.records.items()}
    wrappers = patch_layer.engine.wrappers
    for mspec in manifest.modules:
        for _ in range(2):
            statuses = installer.install(mspec, sys.modules[mspec.name], wrappers)
            assert {s.state for s in statuses.values()} <= {TargetState.WRAPPED, TargetState.CHECKED}
    for (c, a), entry in entries.items():
        assert ours_in_chain(patch_layer.engine, vars(cls[c])[a]) == 1, f"{c}.{a}: not exactly one of ours"
        assert vars(cls[c])[a] is entry, f"{c}.{a} was wrapped again"
    assert {m: list(r) for m, r in installer.records.items()} == records
    assert patch_layer.engine.unpatch() is True
    for (c, a), original in raw.items():
        assert vars(cls[c])[a] is original


def test_import_then_apply_then_unpatch_restores_every_dict_entry_and_no_subclass_residue(
    patch_layer: PatchLayer,
) -> None:
    cls = import_targets()
    sub = {name: type(f"Sub{name}", (c,), {}) for name, c in cls.items()}
    snap = {name: dict(vars(c)) for name, c in cls.items()}
    sub_snap = {name: dict(vars(c)) for name, c in sub.items()}
    patch_layer.engine.apply(config=CFG)
    assert_wrapped_once(patch_layer=patch_layer)
    for name, c in sub.items():
        assert dict(vars(c)).keys() == sub_snap[name].keys()
        assert {a for _, cn, a in WRAPPED if cn == name}.isdisjoint(vars(c))
    assert patch_layer.engine.unpatch() is True
    for name, c in cls.items():
        now = dict(vars(c))
        assert now.keys() == snap[name].keys()
        assert all(now[k] is v for k, v in snap[name].items()), name
    for name, c in sub.items():
        assert dict(vars(c)).keys() == sub_snap[name].keys()
    assert patch_layer.engine.installer.stuck == []


def test_unpatch_twice_and_before_apply_are_noops(patch_layer: PatchLayer) -> None:
    assert patch_layer.engine.unpatch() is True
    cls = import_targets()
    snap = {n: dict(vars(c)) for n, c in cls.items()}
    assert patch_layer.engine.unpatch() is True
    patch_layer.engine.apply(config=CFG)
    assert patch_layer.engine.unpatch() is True
    assert patch_layer.engine.unpatch() is True
    for n, c in cls.items():
        assert all(vars(c)[k] is v for k, v in snap[n].items())


@each_layout
def test_instance_created_before_apply_follows_patch_unpatch_repatch(
    world: Any, patch_layer: PatchLayer, layout: str
) -> None:
    conn_cls, runner_cls = type(world.connector), type(world.runner)
    original = vars(conn_cls)["recv_attn_output"]
    reference, streams = run_traced(world)
    assert streams == set()  # nothing of ours ran
    for _ in range(2):  # patch, unpatch, re-patch, unpatch
        patch_layer.engine.apply(config=layout_cfg(layout))
        assert vars(conn_cls)["recv_attn_output"] is original  # routed per step, never wrapped
        assert patch_layer.engine.is_ours(vars(runner_cls)["_ffn_forward"])
        assert "recv_attn_output" not in vars(world.connector)
        out, where = run_engaged(world)
        assert_same(out, reference)
        assert where == ENGAGED[layout]  # the overlap engaged: each op on the layout's stream
        assert "recv_attn_output" not in vars(world.connector)  # the step's route is gone
        assert patch_layer.engine.unpatch() is True
        assert vars(conn_cls)["recv_attn_output"] is original
        assert not patch_layer.engine.is_ours(vars(runner_cls)["_ffn_forward"])
        out, streams = run_traced(world)
        assert_same(out, reference)
        assert streams == set()


# ---------------------------------------------------------------------------
# foreign wrappers
@each_layout
def test_third_party_wrapt_wrapper_on_the_connector_while_applied_is_called_and_survives_unpatch(
    world: Any, patch_layer: PatchLayer, layout: str
) -> None:
    conn_cls = type(world.connector)
    reference, _ = run_traced(world)
    patch_layer.engine.apply(config=layout_cfg(layout))
    original = vars(conn_cls)["send_ffn_output"]
    calls: list[Any] = []

    def theirs(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        calls.append(instance)
        return wrapped(*args, **kwargs)

    handle = wrapt.wrap_function_wrapper(conn_cls, "send_ffn_output", theirs)
    assert vars(conn_cls)["send_ffn_output"] is handle and handle.__wrapped__ is original
    out, where = run_engaged(world)  # engaged: the route calls the class attribute, theirs included
    assert_same(out, reference)
    assert where == ENGAGED[layout]
    assert len(calls) == 2 * 2 and all(c is world.connector for c in calls)  # layers x stages
    assert patch_layer.engine.unpatch() is True
    assert patch_layer.engine.installer.stuck == []
    assert vars(conn_cls)["send_ffn_output"] is handle and handle.__wrapped__ is original
    assert count_our_wrappers(handle, patch_layer.engine) == 0
    out, streams = run_traced(world)
    assert_same(out, reference)
    assert streams == set()
    assert len(calls) == 2 * 2 * 2
    wrapt.unwrap_object(conn_cls, "send_ffn_output", handle)
    assert vars(conn_cls)["send_ffn_output"] is original


@each_layout
def test_third_party_wrapt_wrapper_on_the_connector_before_apply_stays_in_the_chain(
    world: Any, patch_layer: PatchLayer, layout: str
) -> None:
    cls = type(world.connector)
    reference, _ = run_traced(world)
    original = vars(cls)["recv_attn_output"]
    calls: list[Any] = []

    def theirs(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        calls.append(kwargs.get("layer_idx"))
        return wrapped(*args, **kwargs)

    handle = wrapt.wrap_function_wrapper(cls, "recv_attn_output", theirs)
    try:
        patch_layer.engine.apply(config=layout_cfg(layout))
        assert vars(cls)["recv_attn_output"] is handle and handle.__wrapped__ is original
        out, where = run_engaged(world)
        assert_same(out, reference)
        assert where == ENGAGED[layout]
        assert sorted(calls) == [0, 0, 1, 1]  # the prefetches went through theirs
        assert patch_layer.engine.unpatch() is True
        assert vars(cls)["recv_attn_output"] is handle and handle.__wrapped__ is original
    finally:
        wrapt.unwrap_object(cls, "recv_attn_output", handle, missing_ok=True)


@each_layout
@pytest.mark.parametrize("capture", ["handle", "class-attribute"])
def test_non_wrapt_wrapper_on_top_is_a_clear_refusal_that_breaks_nothing(
    world: Any,
    logs: PackageLogs,
    capture: str,
    patch_layer: PatchLayer,
    layout: str,
) -> None:
    runner_cls = type(world.runner)
    original = vars(runner_cls)["_ffn_forward"]
    reference, _ = run_traced(world)
    patch_layer.engine.apply(config=layout_cfg(layout))
    ours = vars(runner_cls)["_ffn_forward"]
    # Two ways a third party captures what it wraps: the raw __dict__ entry,
    # or ``Cls.method`` (a bound wrapt wrapper, not our handle itself).
    inner = ours if capture == "handle" else runner_cls._ffn_forward
    calls: list[int] = []

    @functools.wraps(inner)
    def foreign(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return inner(self, *args, **kwargs) if capture == "class-attribute" else inner.__get__(self)(*args, **kwargs)

    runner_cls._ffn_forward = foreign
    assert patch_layer.engine.unpatch() is False
    refusals = logs.matching(level=logging.ERROR)
    assert len(refusals) == 1
    assert "cannot remove our wrapper" in refusals[0].getMessage()
    assert "AFDNPUFFNModelRunner._ffn_forward" in refusals[0].getMessage()
    assert [r.spec.qualname for r in patch_layer.engine.installer.stuck] == ["AFDNPUFFNModelRunner._ffn_forward"]
    assert not patch_layer.engine.is_applied()
    assert vars(runner_cls)["_ffn_forward"] is foreign
    # Still works: ours passes straight through (serial path, compute stream only).
    out, streams = run_traced(world)
    assert_same(out, reference)
    assert streams <= {"C"} and calls
    # The other targets were removed.
    assert not patch_layer.engine.is_ours(vars(type(world.connector))["recv_attn_output"])

    # Re-apply takes the stuck wrapper back instead of wrapping twice.
    patch_layer.engine.apply(config=layout_cfg(layout))
    assert count_our_wrappers(vars(runner_cls)["_ffn_forward"], patch_layer.engine) == 1
    assert patch_layer.engine.installer.stuck == []
    assert engine_states(patch_layer=patch_layer)["_ffn_forward"] is TargetState.WRAPPED
    out, where = run_engaged(world)
    assert_same(out, reference)
    assert where == ENGAGED[layout]

    # Once the foreign wrapper is gone, unpatch restores the original exactly.
    runner_cls._ffn_forward = ours
    assert patch_layer.engine.unpatch() is True
    assert vars(runner_cls)["_ffn_forward"] is original
    assert patch_layer.engine.installer.stuck == []


def test_stuck_wrapper_is_removed_by_a_later_unpatch_once_unblocked(world: Any, patch_layer: PatchLayer) -> None:
    runner_cls = type(world.runner)
    original = vars(runner_cls)["_ffn_forward"]
    patch_layer.engine.apply(config=CFG)
    ours = vars(runner_cls)["_ffn_forward"]
    runner_cls._ffn_forward = functools.wraps(ours)(lambda self, *a, **k: ours.__get__(self)(*a, **k))
    assert patch_layer.engine.unpatch() is False and len(patch_layer.engine.installer.stuck) == 1
    runner_cls._ffn_forward = ours  # the third party went away
    assert patch_layer.engine.unpatch() is True
    assert patch_layer.engine.installer.stuck == [] and vars(runner_cls)["_ffn_forward"] is original


def test_attribute_replaced_wholesale_is_left_alone(patch_layer: PatchLayer) -> None:
    cls = import_targets()["CAMP2pAFDConnector"]
    patch_layer.engine.apply(config=CFG)

    def replacement(self: Any, ffn_output: Any, context: Any, **kwargs: Any) -> None:
        return None

    cls.send_ffn_output = replacement
    assert patch_layer.engine.unpatch() is True
    assert vars(cls)["send_ffn_output"] is replacement
    assert patch_layer.engine.installer.stuck == []


# ---------------------------------------------------------------------------
# refusals: changed or missing targets leave the module untouched
def _variant_module(name: str, old: str, new: str) -> types.ModuleType:
    """Execute the stand-in source of ``name`` with one edit, registered
    under the real name (parents come from the stand-in finder)."""
    return variant_module(name, [(old, new)])


VARIANTS = {
    "recv-lost-kwargs": (
        CONNECTOR,
        "def recv_attn_output(self, ubatch_idx: int = 0, **kwargs: Any)",
        "def recv_attn_output(self, ubatch_idx: int = 0, layer_idx: int = 0, max_num_tokens: Any = None)",
        "CAMP2pAFDConnector.recv_attn_output",
        "missing parameter(s) kwargs",
    ),
    "ffn-forward-new-param": (
        RUNNER,
        "update_connector_state=True,\n    ):",
        "update_connector_state=True,\n        stream_hint=None,\n    ):",
        "AFDNPUFFNModelRunner._ffn_forward",
        "unexpected parameter(s) stream_hint",
    ),
    "send-missing": (
        CONNECTOR,
        "def send_ffn_output(self, ffn_output: Any, context: Any, **kwargs: Any)",
        "def _renamed_send(self, ffn_output: Any, context: Any, **kwargs: Any)",
        "CAMP2pAFDConnector.send_ffn_output",
        "missing",
    ),
    "layer-indices-default-changed": (
        RUNNER,
        "def _ffn_layer_indices(runner):",
        "def _ffn_layer_indices(runner=None):",
        "_ffn_layer_indices",
        "parameter runner (POSITIONAL_OR_KEYWORD) is now runner (POSITIONAL_OR_KEYWORD) = None",
    ),
}


@pytest.mark.parametrize("when", ["imported-before-apply", "imported-after-apply"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_changed_or_missing_target_refuses_that_module_only(variant: str, when: str, patch_layer: PatchLayer) -> None:
    modname, old, new, culprit, why = VARIANTS[variant]
    other = CONNECTOR if modname == RUNNER else RUNNER
    if when == "imported-after-apply":
        standins.install()
        patch_layer.engine.apply(config=CFG)
    module = _variant_module(modname, old, new)
    snap = {n: dict(vars(c)) for n, c in vars(module).items() if isinstance(c, type) and c.__module__ == modname}
    funcs = {n: f for n, f in vars(module).items() if callable(f)}
    if when == "imported-before-apply":
        report = patch_layer.engine.apply(config=CFG)
    else:
        wrapt.notify_module_loaded(module)  # what the import system does for a real import
        report = patch_layer.engine.status()
    try:
        assert report.applied
        refused = {t.target: t.reason for t in report.refused}
        mod_targets = {t.id for t in load_manifest().module(modname).targets}
        assert set(refused) == mod_targets  # the whole module, nothing else
        assert why in refused[f"{modname}.{culprit}"]
        assert "signature changed" in refused[f"{modname}.{culprit}"] or "missing" in refused[f"{modname}.{culprit}"]
        assert all(culprit in r for t, r in refused.items() if t != f"{modname}.{culprit}")
        for n, entries in snap.items():
            now = vars(vars(module)[n])
            assert now.keys() == entries.keys()
            assert all(now[k] is v for k, v in entries.items()), n
        assert all(vars(module)[n] is f for n, f in funcs.items())
        assert not patch_layer.engine.status().engaged
        # The other module is still wrapped when it is imported.
        importlib.import_module(other)
        other_states = {t.target: t.state for t in patch_layer.engine.status().targets if t.target.startswith(other)}
        assert set(other_states.values()) <= {TargetState.WRAPPED, TargetState.CHECKED}
        assert culprit in str(patch_layer.engine.status())
    finally:
        patch_layer.engine.unpatch()
        sys.modules.pop(modname, None)


def test_strict_refusal_raises_and_leaves_nothing_wrapped(patch_layer: PatchLayer) -> None:
    module = _variant_module(CONNECTOR, *VARIANTS["recv-lost-kwargs"][1:3])
    try:
        runner_cls = import_targets()["AFDNPUFFNModelRunner"]
        before = dict(vars(runner_cls))
        with pytest.raises(PatchRefused, match="recv_attn_output"):
            patch_layer.engine.apply(config=CFG, strict=True)
        assert not patch_layer.engine.is_applied()
        assert all(vars(runner_cls)[k] is v for k, v in before.items())
        assert not patch_layer.engine.is_ours(vars(module.CAMP2pAFDConnector)["send_ffn_output"])
    finally:
        sys.modules.pop(CONNECTOR, None)


def test_missing_class_refuses_module(patch_layer: PatchLayer) -> None:
    standins.install()
    patch_layer.engine.apply(config=CFG)
    module = types.ModuleType(CONNECTOR)
    module.SomethingElse = type("SomethingElse", (), {})
    sys.modules[CONNECTOR] = module
    try:
        wrapt.notify_module_loaded(module)
        reasons = {t.target.rsplit(".", 1)[-1]: t.reason for t in patch_layer.engine.status().refused}
        assert set(reasons) == {"recv_attn_output", "send_ffn_output"}
        assert "'CAMP2pAFDConnector' not found" in reasons["recv_attn_output"]
    finally:
        sys.modules.pop(CONNECTOR, None)


# ---------------------------------------------------------------------------
# synthetic targets: staticmethod, classmethod, inherited
SYNTHETIC_SOURCE = (SUPPORT / "synthetic_targets.py").read_text(encoding="utf-8")


@pytest.fixture
def synthetic(patch_layer: PatchLayer) -> Iterator[tuple[str, types.ModuleType]]:
    name = f"camp2p_synthetic_{uuid.uuid4().hex[:8]}"
    module = types.ModuleType(name)
    exec(compile(SYNTHETIC_SOURCE, f"<{name}>", "exec"), module.__dict__)
    yield name, module
    patch_layer.engine.unpatch()
    sys.modules.pop(name, None)


@pytest.mark.parametrize("when", ["imported-before-apply", "imported-after-apply"])
def test_synthetic_static_and_class_methods_wrapped_and_restored_exactly(
    synthetic: tuple[str, types.ModuleType],
    when: str,
    patch_layer: PatchLayer,
) -> None:
    name, module = synthetic
    man = synthetic_manifest(name, [("Target.static", None), ("Target.klass", "cls"), ("Target.plain", "self")])
    target, sub = module.Target, module.Sub
    snap, sub_snap = dict(vars(target)), dict(vars(sub))
    assert isinstance(snap["static"], staticmethod) and isinstance(snap["klass"], classmethod)
    if when == "imported-before-apply":
        sys.modules[name] = module
        patch_layer.engine.apply(config=CFG, manifest=man, strict=True)
    else:
        patch_layer.engine.apply(config=CFG, manifest=man, strict=True)
        assert {t.state for t in patch_layer.engine.status().targets} == {TargetState.NOT_IMPORTED}
        sys.modules[name] = module
        wrapt.notify_module_loaded(module)
    assert {t.state for t in patch_layer.engine.status().targets} == {TargetState.WRAPPED}
    for attr in ("static", "klass", "plain"):
        entry = vars(target)[attr]
        assert patch_layer.engine.is_ours(entry) and count_our_wrappers(entry, patch_layer.engine) == 1
        assert entry.__wrapped__ is snap[attr]  # the raw descriptor is what we wrapped
    assert vars(sub).keys() == sub_snap.keys()  # nothing on the subclass
    # Behaviour unchanged through every access path.
    assert target.static(3) == ("static", 3) and target().static(ubatch_idx=4) == ("static", 4)
    assert target.klass(5) == ("klass", "Target", 5) and sub.klass(6) == ("klass", "Sub", 6)
    assert sub().klass(7) == ("klass", "Sub", 7) and sub().plain(8) == ("plain", 8)
    assert patch_layer.engine.unpatch() is True
    assert dict(vars(target)).keys() == snap.keys()
    assert all(vars(target)[k] is v for k, v in snap.items())
    assert dict(vars(sub)) == sub_snap
    assert target.static(1) == ("static", 1) and sub.klass(2) == ("klass", "Sub", 2)


def test_synthetic_module_function_is_wrapped_without_an_instance_and_restored(
    synthetic: tuple[str, types.ModuleType],
    patch_layer: PatchLayer,
) -> None:
    name, module = synthetic
    raw = vars(module)["free"]
    sys.modules[name] = module
    patch_layer.engine.apply(config=CFG, manifest=synthetic_manifest(name, [("free", None)]), strict=True)
    assert {t.state for t in patch_layer.engine.status().targets} == {TargetState.WRAPPED}
    entry = vars(module)["free"]
    assert patch_layer.engine.is_ours(entry) and entry.__wrapped__ is raw
    assert module.free(ubatch_idx=3) == ("free", 3) and module.free(4) == ("free", 4)
    assert patch_layer.engine.unpatch() is True
    assert vars(module)["free"] is raw


def test_synthetic_inherited_method_is_refused_and_module_untouched(
    synthetic: tuple[str, types.ModuleType], patch_layer: PatchLayer
) -> None:
    name, module = synthetic
    man = synthetic_manifest(name, [("Target.static", None), ("Target.inherited", "self")])
    snap, base_snap = dict(vars(module.Target)), dict(vars(module.Base))
    sys.modules[name] = module
    report = patch_layer.engine.apply(config=CFG, manifest=man)
    reasons = {t.target.rsplit(".", 1)[-1]: t.reason for t in report.refused}
    assert set(reasons) == {"static", "inherited"}
    assert "only inherited" in reasons["inherited"]
    assert "Target.inherited" in reasons["static"]
    assert dict(vars(module.Target)) == snap and all(vars(module.Target)[k] is v for k, v in snap.items())
    assert dict(vars(module.Base)) == base_snap
    assert patch_layer.engine.installer.records == {}


def test_wrapping_failure_half_way_rolls_the_module_back(
    synthetic: tuple[str, types.ModuleType], patch_layer: PatchLayer
) -> None:
    name, module = synthetic

    class ReadOnlySecond(type):
        def __setattr__(cls, attr: str, value: Any) -> None:
            if attr == "second":
                raise TypeError("second is read-only")
            super().__setattr__(attr, value)

    def first(self, ubatch_idx=0, **kwargs):  # type: ignore[no-untyped-def]
        return ("first", ubatch_idx)

    def second(self, ubatch_idx=0, **kwargs):  # type: ignore[no-untyped-def]
        return ("second", ubatch_idx)

    module.Guarded = ReadOnlySecond("Guarded", (), {"first": first, "second": second})
    snap = dict(vars(module.Guarded))
    man = synthetic_manifest(name, [("Guarded.first", "self"), ("Guarded.second", "self")])
    sys.modules[name] = module
    report = patch_layer.engine.apply(config=CFG, manifest=man)
    reasons = {t.target.rsplit(".", 1)[-1]: t.reason for t in report.refused}
    assert set(reasons) == {"first", "second"}
    assert "wrapping failed: TypeError: second is read-only" in reasons["second"]
    assert dict(vars(module.Guarded)).keys() == snap.keys()
    assert all(vars(module.Guarded)[k] is v for k, v in snap.items())  # 'first' was unwrapped again
    assert patch_layer.engine.installer.records == {} and patch_layer.engine.installer.stuck == []
    with pytest.raises(PatchRefused, match="second is read-only"):
        patch_layer.engine.unpatch()
        patch_layer.engine.apply(config=CFG, manifest=man, strict=True)
    assert vars(module.Guarded)["first"] is snap["first"]


# ---------------------------------------------------------------------------
# the one log line and the report
def test_one_log_line_when_every_target_is_settled(logs: PackageLogs, patch_layer: PatchLayer) -> None:
    import os

    standins.install()
    patch_layer.engine.apply(config=CFG)
    patch_layer.engine.apply(config=CFG)
    assert logs.matching("pid=") == []  # nothing settled yet
    importlib.import_module(RUNNER)
    assert logs.matching("pid=") == []  # one module still to come
    importlib.import_module(CONNECTOR)
    patch_layer.engine.apply(config=CFG)
    patch_layer.engine.status()
    lines = logs.matching("pid=")
    assert len(lines) == 1
    msg = lines[0].getMessage()
    assert lines[0].levelno == logging.INFO
    assert f"pid={os.getpid()}" in msg
    assert "vllm=0.19.1" in msg and f"wrapt={wrapt.__version__}" in msg
    for _, cname, attr in WRAPPED:
        assert f"{cname}.{attr}=wrapped" in msg
    for _, cname, attr in ROUTED:
        assert f"{cname}.{attr}=checked" in msg
    assert "_ffn_layer_indices=checked" in msg


def test_one_log_line_on_refusal(logs: PackageLogs, patch_layer: PatchLayer) -> None:
    _variant_module(CONNECTOR, *VARIANTS["recv-lost-kwargs"][1:3])
    try:
        patch_layer.engine.apply(config=CFG)
        importlib.import_module(RUNNER)
        patch_layer.engine.status()
        lines = logs.matching("pid=")
        assert len(lines) == 1 and lines[0].levelno == logging.WARNING
        msg = lines[0].getMessage()
        assert "CAMP2pAFDConnector.recv_attn_output=refused" in msg and "missing parameter(s) kwargs" in msg
    finally:
        sys.modules.pop(CONNECTOR, None)


def test_report_serialises_every_target(patch_layer: PatchLayer) -> None:
    import_targets()
    report = patch_layer.engine.apply(config=CFG)
    d = report.to_dict()
    assert d["applied"] is True and d["engaged"] is True and d["stack"] == "vllm-0.19.1"
    assert d["vllm_version"] == "0.19.1" and d["wrapt_version"] == wrapt.__version__
    assert {t["state"] for t in d["targets"]} == {"wrapped", "checked"}
    assert len(d["targets"]) == len(load_manifest().targets())
    text = str(report)
    assert all(t.target in text for t in report.targets)
    assert f"pid={d['pid']}" in text
