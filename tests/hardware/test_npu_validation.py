"""Ascend validation (marker ``npu``): runs only where torch_npu, an NPU and
a real afd-plugin import; skipped with the reason everywhere else. The
checklist around it is in docs/validation.md.

1. The patch applies to the REAL ``AFDNPUFFNModelRunner`` and
   ``CAMP2pAFDConnector`` (every target found, signatures as in the
   manifest) and unpatch restores the exact originals.
2. The REAL ``AFDNPUFFNModelRunner._ffn_forward`` loop (with the real
   ``_send_ffn_output``, ``_ffn_layer_indices`` and metadata classes) on a
   real ``CAMP2pAFDConnector`` instance gives, with the overlap on NPU
   streams, bitwise the outputs of the serial path. The connector's two
   transfer methods are replaced, for this test only and before the patch
   is applied, by emulated bodies with the contract's signatures (a real
   A2E/E2A needs the attention ranks of a deployment); the Ascend forward
   context and the MoE layer index setter are replaced by no-op stand-ins.
3. The NPU stream backend runs the emulated world (stand-ins under their
   alias root) bitwise equal to serial, with A2E/E2A on the side streams.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from support.overlap import assert_same

from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.patch_layer import PATCH_LAYER
from camp2p_overlap.core.patching.status_report import TargetState

RUNNER_MOD = "afd_plugin.v1.worker.npu.ffn_model_runner"
CONNECTOR_MOD = "afd_plugin.connectors.npu.camp2p"
METADATA_MOD = "afd_plugin.connectors.metadata"


def _why_not() -> str | None:
    if importlib.util.find_spec("torch_npu") is None:
        return "torch_npu is not installed"
    try:
        importlib.import_module("torch_npu")
    except Exception as exc:  # noqa: BLE001 - the skip reason
        return f"importing torch_npu failed: {type(exc).__name__}: {exc}"
    npu = getattr(torch, "npu", None)
    if npu is None or not npu.is_available():
        return "no Ascend NPU: torch.npu.is_available() is False"
    try:
        spec = importlib.util.find_spec("afd_plugin")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return "afd_plugin (vllm-afd-plugin) is not installed"
    return None


_REASON = _why_not()
pytestmark = [pytest.mark.npu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

NPU_CFG = OverlapConfig(enabled=True, backend="npu")


def _import_real() -> tuple[Any, Any, Any]:
    """The real modules. An import error here is a failure: afd_plugin is
    installed but its NPU runner does not import (vLLM-Ascend mismatch?)."""
    return tuple(importlib.import_module(m) for m in (RUNNER_MOD, CONNECTOR_MOD, METADATA_MOD))  # type: ignore[return-value]


def _apply_or_skip() -> None:
    report = PATCH_LAYER.engine.apply(config=NPU_CFG)
    if not report.applied and report.reason.startswith("refused"):
        pytest.skip(f"the installed stack is not the supported one: {report.reason}")
    assert report.applied, str(report)


def test_patch_applies_to_the_real_classes_and_restores_them_exactly() -> None:
    runner_mod, conn_mod, _ = _import_real()
    runner_cls, conn_cls = runner_mod.AFDNPUFFNModelRunner, conn_mod.CAMP2pAFDConnector
    before = {
        "_ffn_forward": vars(runner_cls)["_ffn_forward"],
        "recv_attn_output": vars(conn_cls)["recv_attn_output"],
        "send_ffn_output": vars(conn_cls)["send_ffn_output"],
    }
    _apply_or_skip()
    report = PATCH_LAYER.engine.status()
    states = {t.target: (t.state, t.reason) for t in report.targets}
    assert report.engaged, "the manifest no longer matches the installed afd-plugin:\n" + str(report)
    assert all(s in (TargetState.WRAPPED, TargetState.CHECKED) for s, _ in states.values()), states
    assert vars(runner_cls)["_ffn_forward"].__wrapped__ is before["_ffn_forward"]
    assert vars(conn_cls)["recv_attn_output"].__wrapped__ is before["recv_attn_output"]
    assert PATCH_LAYER.engine.unpatch(timeout=30)
    assert vars(runner_cls)["_ffn_forward"] is before["_ffn_forward"]
    assert vars(conn_cls)["recv_attn_output"] is before["recv_attn_output"]
    assert vars(conn_cls)["send_ffn_output"] is before["send_ffn_output"]


class _ForwardContext(dict):
    """A permissive stand-in for the Ascend forward context: item and
    attribute access both work, ``additional_kwargs`` is a dict."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(dp_metadata=None, additional_kwargs={}, **kw)

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value


@contextlib.contextmanager
def _fake_forward_context(*args: Any, **kwargs: Any) -> Iterator[_ForwardContext]:
    yield _ForwardContext(**{k: v for k, v in kwargs.items() if isinstance(k, str)})


def _device_parts(device: torch.device, hidden: int, tokens: int) -> tuple[Any, Any, Any]:
    from camp2p_overlap.emulation.kernel_world import DeviceDelay, DeviceFFN, DeviceTiming, DeviceTransport
    from camp2p_overlap.emulation.moe import MoEShape
    from camp2p_overlap.emulation.world import LinkModel

    timing = DeviceTiming(torch.npu, torch.npu.current_stream())
    transport = DeviceTransport(
        hidden=hidden,
        link=LinkModel(latency_s=100e-6, bandwidth_Bps=20e9),
        device=device,
        delay=DeviceDelay(torch.npu, device),
        timing=timing,
        max_tokens=tokens,
    )
    moe = DeviceFFN(MoEShape(hidden=hidden, ffn=2 * hidden, experts=4, top_k=2), seed=0, device=device)
    return transport, moe, timing


def test_real_ffn_forward_loop_overlapped_equals_serial(monkeypatch: pytest.MonkeyPatch) -> None:
    from camp2p_overlap.emulation.world import EmulatedModel, StageMeta

    runner_mod, conn_mod, meta = _import_real()
    runner_cls, conn_cls = runner_mod.AFDNPUFFNModelRunner, conn_mod.CAMP2pAFDConnector
    device = torch.device("npu", torch.npu.current_device())
    transport, moe, timing = _device_parts(device, hidden=512, tokens=128)

    # Emulated transfer bodies with the contract's signatures, installed on
    # the real class before the patch, so our wrappers sit on top of them.
    def recv_attn_output(self: Any, ubatch_idx: int = 0, **kwargs: Any) -> Any:
        layer = int(kwargs["layer_idx"])
        n = int(self.dp_metadata_list[ubatch_idx].num_tokens)
        hidden, bs = transport.a2e(group=f"afd{ubatch_idx or ''}", stage=ubatch_idx, layer=layer, num_tokens=n)
        ctx = meta.AFDTransferContext(
            metadata=meta.AFDTransferMetadata(layer_idx=layer, stage_idx=ubatch_idx),
            states=SimpleNamespace(atten_batch_size=bs, x_active_mask=None),
        )
        return meta.AFDA2FTransferPayload(hidden_states=hidden, context=ctx)

    def send_ffn_output(self: Any, ffn_output: Any, context: Any, **kwargs: Any) -> None:
        stage = int(kwargs.get("ubatch_idx", context.metadata.stage_idx))
        transport.e2a(
            group=f"afd{stage or ''}",
            stage=stage,
            layer=int(context.metadata.layer_idx),
            routed=ffn_output,
            shared=kwargs.get("expand_x_shared"),
            atten_batch_size=context.states.atten_batch_size,
        )

    monkeypatch.setattr(conn_cls, "recv_attn_output", recv_attn_output)
    monkeypatch.setattr(conn_cls, "send_ffn_output", send_ffn_output)
    monkeypatch.setattr(runner_mod, "ascend_forward_context", _fake_forward_context)
    monkeypatch.setattr(runner_mod, "_set_moe_layer_index", lambda *a, **k: None)

    connector = object.__new__(conn_cls)
    runner = object.__new__(runner_cls)
    for name, value in {
        "connector": connector,
        "model": EmulatedModel(moe, return_payload=True, payload_cls=meta.AFDF2ATransferPayload),
        "num_layers": 4,
        "max_num_tokens": 128,
        "afd_config": SimpleNamespace(connector="camp2p", role="ffn", compute_gate_on_attention=False),
        "device": device,
        "use_aclgraph": False,
        "model_config": SimpleNamespace(hf_config=SimpleNamespace(first_k_dense_replace=0, moe_layer_freq=1)),
    }.items():
        object.__setattr__(runner, name, value)

    def step(n: int, tokens: dict[int, int]) -> dict:
        dp = {s: StageMeta(t) for s, t in tokens.items()}
        connector.dp_metadata_list = dp
        transport.begin_step(n, list(range(4)), sorted(dp))
        runner._ffn_forward(dp_metadata_list=dp, update_connector_state=False)
        torch.npu.synchronize()
        return dict(transport.results)

    cases = [(1, {0: 128, 1: 96}), (2, {0: 64, 1: 128, 2: 32}), (3, {0: 16, 2: 128})]
    serial = {n: step(n, t) for n, t in cases}
    _apply_or_skip()
    try:
        assert PATCH_LAYER.engine.status().engaged, str(PATCH_LAYER.engine.status())
        step(0, {0: 8, 1: 8})  # warm-up: side streams created outside any capture
        timing.active = True
        got = {n: step(n, t) for n, t in cases}
        ops = timing.resolve()
        timing.active = False
    finally:
        # Before monkeypatch puts the real transfer methods back.
        assert PATCH_LAYER.engine.unpatch(timeout=30)
    for n, _ in cases:
        assert serial[n].keys() == got[n].keys()
        assert_same(got[n], serial[n], f"step {n} differs from serial")
    comm_streams = {o.stream for o in ops if o.kind in ("a2e", "e2a")}
    assert comm_streams == {"K0", "K1", "K2"}, comm_streams


def test_npu_backend_runs_the_emulated_world_bitwise_serial() -> None:
    from camp2p_overlap.emulation.kernel_world import build_device_world
    from camp2p_overlap.emulation.moe import MoEShape
    from camp2p_overlap.emulation.standin_patch_layer import emulation_engine, release_site, standin_site
    from camp2p_overlap.emulation.world import WorldSpec

    site = standin_site()  # under the alias root: the real afd_plugin is never shadowed
    try:
        spec = WorldSpec(layers=6, stage_ids=(0, 1, 2), tokens=128, shape=MoEShape(hidden=512, ffn=1024, experts=4))
        dw = build_device_world(spec, "npu", root=site.root)
        tokens = {0: 128, 1: 64, 2: 100}

        def step(n: int) -> dict:
            dw.world.steps_run = n - 1
            out = dw.world.run_step(tokens)
            dw.synchronize()
            return out

        serial = {n: step(n) for n in (1, 2, 3)}
        with emulation_engine() as engine:
            assert engine.apply(config=NPU_CFG, manifest=site.manifest, strict=True).engaged
            step(1)
            dw.timing.active = True
            got = {n: step(n) for n in (1, 2, 3)}
            ops = dw.timing.resolve()
            dw.timing.active = False
        for n in serial:
            assert serial[n].keys() == got[n].keys()
            assert_same(got[n], serial[n], f"step {n} differs")
        assert {o.stream for o in ops if o.kind in ("a2e", "e2a")} == {"K0", "K1", "K2"}
    finally:
        release_site(site)
