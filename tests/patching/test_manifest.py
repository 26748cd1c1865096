"""The shipped manifest, its parser and the signature comparison."""

from __future__ import annotations

import importlib

import pytest

from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.overlap.step import make_wrappers
from camp2p_overlap.core.patch_layer import build_patch_layer
from camp2p_overlap.core.patching.lifecycle import PatchRefused
from camp2p_overlap.core.patching.manifest import (
    DEFAULT_STACK,
    ManifestError,
    ParamSpec,
    available_stacks,
    load_manifest,
    parse_manifest,
    signature_difference,
    signature_of,
)
from camp2p_overlap.core.patching.versions import judge_vllm_version
from camp2p_overlap.emulation import standins


def test_shipped_manifest_loads() -> None:
    assert DEFAULT_STACK in available_stacks()
    man = load_manifest()
    assert man.name == DEFAULT_STACK and man.vllm == "0.19.1" and man.remove_when
    assert [m.name for m in man.modules] == [
        "afd_plugin.v1.worker.npu.ffn_model_runner",
        "afd_plugin.connectors.npu.camp2p",
    ]
    ids = {t.id: t for t in man.targets()}
    assert {i.rsplit(".", 1)[-1] for i in ids} == {
        "_ffn_forward",
        "_capture_graphs",
        "_ffn_layer_indices",
        "recv_attn_output",
        "send_ffn_output",
    }
    own = build_patch_layer()
    wrappers = make_wrappers(own.engine, runtime=own.runtime)
    for t in man.targets():
        assert t.changes and t.why
        if t.action == "wrap":
            assert t.wrapper in wrappers and t.router is None
        elif t.action == "route":
            assert t.router in wrappers and t.wrapper is None
        else:
            assert t.wrapper is None and t.router is None
    read = ids["afd_plugin.v1.worker.npu.ffn_model_runner._ffn_layer_indices"]
    assert read.action == "read" and read.owner_path == () and read.attribute == "_ffn_layer_indices"


def test_the_vllm_0_26_0_manifest_pins_main_by_commit_with_the_same_targets() -> None:
    assert available_stacks() == ["vllm-0.19.1", "vllm-0.26.0"]
    old, new = load_manifest("vllm-0.19.1"), load_manifest("vllm-0.26.0")
    assert new.vllm == "0.26.0" and new.afd_plugin is None
    assert new.afd_plugin_commit == "2e4378f2d478313992e9a1b850c61b1e888a1145"
    assert "main" in new.afd_plugin_source and "0.1.dev447+g2e4378f2d" in new.afd_plugin_source
    assert new.vllm_ascend_commit == "80d8c194f7584b17fe08065ea99a130916f6b0e7" and "no release" in new.vllm_ascend
    assert new.describe() == "vLLM 0.26.0 with afd-plugin commit 2e4378f2d (stack vllm-0.26.0)"
    assert new.remove_when and "#161" in new.remove_when
    # Same modules, targets, actions, wrappers and signatures (checked upstream:
    # the connector file is unchanged, the runner's signatures too) ...
    strip = [(t.id, t.action, t.wrapper, t.signature, t.optional) for t in old.targets()]
    assert [(t.id, t.action, t.wrapper, t.signature, t.optional) for t in new.targets()] == strip
    # ... and each target says what differs on main, or that nothing does.
    why = {t.qualname: t.why for t in new.targets()}
    assert "ascend_forward_context" in why["AFDNPUFFNModelRunner._ffn_forward"]
    assert "afd_config directly" in why["_ffn_layer_indices"]
    assert all("unchanged from release/v0.19.1rc1" in why[q] for q in why if q.startswith("CAMP2pAFDConnector."))
    for t in new.targets():
        assert t.changes and t.why


def test_manifest_signatures_match_the_stand_ins() -> None:
    """The stand-ins keep the contract's shapes: the engine must accept them."""
    standins.install()
    for t in load_manifest().targets():
        obj: object = importlib.import_module(t.module)
        for part in t.qualname.split("."):
            obj = vars(obj)[part]
        assert signature_difference(t.signature, signature_of(obj)) is None, t.id  # type: ignore[arg-type]


def test_unknown_stack_names_what_is_shipped() -> None:
    with pytest.raises(ManifestError, match=DEFAULT_STACK):
        load_manifest("vllm-9.9.9")


GOOD = """
[stack]
name = "s"
vllm = "1.0"

[[module]]
name = "m"

[[module.target]]
qualname = "C.f"
action = "wrap"
wrapper = "w"
signature = [{ name = "self", kind = "POSITIONAL_OR_KEYWORD" }]
"""


def test_parse_a_minimal_manifest() -> None:
    man = parse_manifest(GOOD)
    (t,) = man.targets()
    assert (t.module, t.qualname, t.owner_path, t.attribute) == ("m", "C.f", ("C",), "f")
    assert t.signature == (ParamSpec("self", "POSITIONAL_OR_KEYWORD"),)
    assert man.module("m").targets == (t,)
    with pytest.raises(KeyError):
        man.module("nope")


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (("[stack]", "[stak]"), "missing key 'stack'"),
        (('vllm = "1.0"', ""), "missing key 'vllm'"),
        (('action = "wrap"', 'action = "replace"'), "action must be"),
        (('wrapper = "w"', ""), "needs a 'wrapper'"),
        (('kind = "POSITIONAL_OR_KEYWORD"', 'kind = "POSITIONAL"'), "unknown parameter kind"),
        (("signature = [", "sig = ["), "missing key 'signature'"),
        (('name = "m"', 'name = "m'), "s.toml"),
        (('vllm = "1.0"', 'vllm = "1.0"\nafd_plugin_commit = "2e4378f"'), "full 40-digit"),
        (('vllm = "1.0"', 'vllm = "1.0"\nvllm_ascend_commit = 7'), "vllm_ascend_commit must be"),
        (('vllm = "1.0"', f'vllm = "1.0"\nafd_plugin = "1.0"\nafd_plugin_commit = "{"a" * 40}"'), "not both"),
    ],
)
def test_malformed_manifests_are_manifest_errors(edit: tuple[str, str], match: str) -> None:
    with pytest.raises(ManifestError, match=match):
        parse_manifest(GOOD.replace(*edit), source="s.toml")


# ---------------------------------------------------------------------------
# optional targets: ``optional = "<feature>"`` with ``optional_why``
OPTIONAL = 'wrapper = "w"\noptional = "graph_variants"\noptional_why = "only graphs need it"'


def test_an_optional_target_names_its_feature_and_why() -> None:
    (t,) = parse_manifest(GOOD.replace('wrapper = "w"', OPTIONAL)).targets()
    assert (t.optional, t.optional_why) == ("graph_variants", "only graphs need it")
    (required,) = parse_manifest(GOOD).targets()
    assert (required.optional, required.optional_why) == (None, "")
    read = GOOD.replace('action = "wrap"\nwrapper = "w"', 'action = "read"\noptional = "graph_variants"')
    (t,) = parse_manifest(read.replace("signature = [", 'optional_why = "x"\nsignature = [')).targets()
    assert t.action == "read" and t.optional == "graph_variants"


@pytest.mark.parametrize(
    ("replacement", "match"),
    [
        (
            'wrapper = "w"\noptional = "graphs"\noptional_why = "x"',
            r"s\.toml: m\.C\.f: optional = 'graphs' is not a known feature \(known: 'graph_variants'\)",
        ),
        ('wrapper = "w"\noptional = true\noptional_why = "x"', "optional = True is not a known feature"),
        ('wrapper = "w"\noptional = "graph_variants"', "needs an 'optional_why'"),
        ('wrapper = "w"\noptional = "graph_variants"\noptional_why = "  "', "needs an 'optional_why'"),
        ('wrapper = "w"\noptional_why = "x"', "'optional_why' without 'optional'"),
        (
            'action = "route"\nrouter = "r"\noptional = "graph_variants"\noptional_why = "x"',
            "a 'route' target cannot be optional",
        ),
    ],
)
def test_malformed_optional_keys_are_manifest_errors(replacement: str, match: str) -> None:
    text = GOOD.replace('wrapper = "w"', replacement)
    if "route" in replacement:
        text = text.replace('action = "wrap"\n', "")
    with pytest.raises(ManifestError, match=match):
        parse_manifest(text, source="s.toml")


@pytest.mark.parametrize("stack", ["vllm-0.19.1", "vllm-0.26.0"])
def test_only_capture_graphs_is_optional_and_only_for_the_graph_variants(stack: str) -> None:
    optional = {t.qualname: t for t in load_manifest(stack).targets() if t.optional is not None}
    assert list(optional) == ["AFDNPUFFNModelRunner._capture_graphs"]
    t = optional["AFDNPUFFNModelRunner._capture_graphs"]
    assert t.optional == "graph_variants"
    assert "VLLM_CAMP2P_MULTISTREAM_GRAPH" in t.optional_why and "eager overlap" in t.optional_why
    assert "#388" in t.optional_why and "#344" in t.optional_why


def test_rebased_moves_only_the_root() -> None:
    man = load_manifest().rebased("afd_plugin", "alias_root")
    assert all(m.name.startswith("alias_root.") for m in man.modules)
    assert all(t.module.startswith("alias_root.") for t in man.targets())
    assert parse_manifest(GOOD).rebased("afd_plugin", "x").modules[0].name == "m"
    lookalike = parse_manifest(GOOD.replace('name = "m"', 'name = "afd_pluginx.m"'))
    assert lookalike.rebased("afd_plugin", "x").modules[0].name == "afd_pluginx.m"


def _sig(fn: object) -> tuple[ParamSpec, ...]:
    return signature_of(fn)  # type: ignore[arg-type]


def test_signature_difference_explains() -> None:
    def base(self, ubatch_idx=0, **kwargs): ...
    def lost_kwargs(self, ubatch_idx=0): ...
    def extra(self, ubatch_idx=0, stream=None, **kwargs): ...
    def new_default(self, ubatch_idx=1, **kwargs): ...
    def kw_only(self, *, ubatch_idx=0, **kwargs): ...
    def reordered(ubatch_idx, self, **kwargs): ...

    exp = _sig(base)
    assert signature_difference(exp, _sig(base)) is None
    assert signature_difference(exp, _sig(lost_kwargs)) == "missing parameter(s) kwargs"
    assert signature_difference(exp, _sig(extra)) == "unexpected parameter(s) stream"
    assert "ubatch_idx (POSITIONAL_OR_KEYWORD) = 0 is now ubatch_idx (POSITIONAL_OR_KEYWORD) = 1" in (
        signature_difference(exp, _sig(new_default)) or ""
    )
    assert "is now ubatch_idx (KEYWORD_ONLY) = 0" in (signature_difference(exp, _sig(kw_only)) or "")
    assert signature_difference(exp, _sig(reordered))


def test_signature_of_ignores_annotations() -> None:
    def annotated(self, x: int = 0, **kwargs: object) -> None: ...
    def bare(self, x=0, **kwargs): ...

    assert _sig(annotated) == _sig(bare)
    assert [p.kind for p in _sig(annotated)] == ["POSITIONAL_OR_KEYWORD", "POSITIONAL_OR_KEYWORD", "VAR_KEYWORD"]


# ---------------------------------------------------------------------------
# the engine with a manifest it cannot load
def test_unloadable_manifest_is_reported_not_raised() -> None:
    def broken() -> object:
        raise ManifestError("patches/x.toml: missing key 'stack'")

    engine = build_patch_layer(
        manifest_loader=broken,
        version_check=lambda manifest: judge_vllm_version("0.19.1", manifest.vllm),
    ).engine
    cfg = OverlapConfig(enabled=True, backend="cpu", adaptive=False)
    report = engine.apply(config=cfg)
    assert not report.applied and "manifest error" in report.reason and "missing key" in report.reason
    with pytest.raises(PatchRefused, match="manifest error"):
        engine.apply(config=cfg, strict=True)
    assert not engine.is_applied() and engine.unpatch() is True
