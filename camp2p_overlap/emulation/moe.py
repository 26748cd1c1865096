"""A MoE-shaped FFN block doing real tensor work: a router, top-k routed
experts (SiLU-gated MLPs) and a shared expert. Deterministic for a seed.
On the CPU it runs as a kernel of the emulated device; with a timing model
(:attr:`MoEFFN.timing`, ``ffn_timing.py``) that kernel takes its modelled
duration and its outputs appear at its modelled end, as a device kernel's
writes are complete when it ends."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from camp2p_overlap.emulation.device import hold, launch


@dataclass(frozen=True)
class MoEShape:
    hidden: int = 512
    ffn: int = 1024
    experts: int = 8
    top_k: int = 2
    shared_expert: bool = True


def moe_weights(
    shape: MoEShape,
    *,
    seed: int,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    groups: int = 4,
) -> list[dict[str, torch.Tensor]]:
    """Deterministic weights (drawn on the CPU for a seed, then moved) for
    ``groups`` layer groups: router, per-expert gate/up and down, shared
    expert."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    h, f, e = shape.hidden, shape.ffn, shape.experts

    def w(*dims: int, scale: float) -> torch.Tensor:
        return (torch.randn(*dims, generator=g) * scale).to(device=device, dtype=dtype)

    return [
        {
            "router": w(h, e, scale=h**-0.5),
            "gate_up": w(e, h, 2 * f, scale=h**-0.5),
            "down": w(e, f, h, scale=f**-0.5),
            "shared_gate_up": w(h, 2 * f, scale=h**-0.5),
            "shared_down": w(f, h, scale=f**-0.5),
        }
        for _ in range(groups)
    ]


class MoEFFN:
    """One set of weights per layer group; ``layer_idx`` selects a group so
    that layers differ without holding a full model in memory."""

    def __init__(
        self,
        shape: MoEShape,
        *,
        seed: int = 0,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        weight_groups: int = 4,
    ) -> None:
        self.shape = shape
        self.groups = moe_weights(shape, seed=seed, device=device, dtype=dtype, groups=weight_groups)
        #: The kernel's timing model (an ``ffn_timing.FFNTiming``), or None:
        #: the kernel takes whatever wall time its work takes.
        self.timing: Any = None

    def _model_s(self, x: torch.Tensor) -> float | None:
        return None if self.timing is None else self.timing.model_s(x.shape[0])

    def kernel_body(self, x: torch.Tensor, layer_idx: int, routed: torch.Tensor, shared: torch.Tensor | None) -> None:
        """The kernel: the block's arithmetic, then (held until the modelled
        end, when launched with a model) its outputs written. ``shared`` None:
        ``routed`` gets routed + shared (the combined output)."""
        r, sh = self.compute(x, layer_idx)
        hold()  # a modelled kernel publishes at its modelled end (nothing without a model)
        if shared is not None and sh is not None:
            routed.copy_(r)
            shared.copy_(sh)
        elif sh is None:
            routed.copy_(r)
        else:
            torch.add(r, sh, out=routed)

    def __call__(self, x: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(routed, shared)`` for ``x``. On the CPU the work is a kernel of
        the emulated device's current stream: the outputs are allocated now
        and filled when the stream runs it (after whatever fills ``x``); on
        a device, torch's own kernels are already asynchronous."""
        if x.device.type != "cpu":
            return self.compute(x, layer_idx)
        # NaN until the kernel fills them (a debug allocator's pattern): a
        # reader not ordered after the kernel cannot match the serial run.
        routed = torch.full_like(x, float("nan"))
        shared = torch.full_like(x, float("nan")) if self.shape.shared_expert else None
        launch(
            lambda: self.kernel_body(x, layer_idx, routed, shared),
            writes=(routed,) if shared is None else (routed, shared),
            model_s=self._model_s(x),
            kind="ffn",
        )
        return routed, shared

    def combined(self, x: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """``routed + shared`` (routed alone without a shared expert), as one kernel."""
        if x.device.type != "cpu":
            routed, shared = self.compute(x, layer_idx)
            return routed if shared is None else routed + shared
        out = torch.full_like(x, float("nan"))
        launch(lambda: self.kernel_body(x, layer_idx, out, None), writes=(out,), model_s=self._model_s(x), kind="ffn")
        return out

    def compute(self, x: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block's arithmetic, run where it is called."""
        wts = self.groups[layer_idx % len(self.groups)]
        logits = x @ wts["router"]
        weights, experts = torch.topk(torch.softmax(logits, dim=-1), self.shape.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        routed = torch.zeros_like(x)
        for e in range(self.shape.experts):
            token_idx, slot = torch.nonzero(experts == e, as_tuple=True)
            if token_idx.numel() == 0:
                continue
            xe = x.index_select(0, token_idx)
            gate, up = (xe @ wts["gate_up"][e]).chunk(2, dim=-1)
            ye = (torch.nn.functional.silu(gate) * up) @ wts["down"][e]
            routed.index_add_(0, token_idx, ye * weights[token_idx, slot].unsqueeze(-1))
        shared = None
        if self.shape.shared_expert:
            gate, up = (x @ wts["shared_gate_up"]).chunk(2, dim=-1)
            shared = (torch.nn.functional.silu(gate) * up) @ wts["shared_down"]
        return routed, shared
