"""An attention side that couples the stages: it sends a stage's A2E of
layer L+1 only once it has received the E2A of layer L from *every* stage
(an attention loop that finishes a layer for all micro-batches before the
next, unlike vLLM's DBO micro-batching, where each stage's next layer
depends on that stage's E2A alone).

With such a peer, every layout that issues A2E and E2A on one stream in the
overlap's order deadlocks: the ``reorder`` rollout mode, and the
``compute-side`` layout of the ``overlap`` mode (the default: A2E/E2A on the
caller's stream C, the FFN on F). There A2E(L+1, s) is issued right after
E2A(L, s) and blocks everything behind it, including E2A(L, s') of the
other stages it waits for. The ``comm-side`` layout completes (the
lookahead A2E waits on its own stage's side stream K_s). In the emulation
the wait is bounded by the transport's op timeout.

Attach with :func:`couple_stages`; it takes the transport's fault hook slot.
"""

from __future__ import annotations

import threading
import time

from camp2p_overlap.emulation.world import EmulatedTransport, PeerTimeoutError, World


class CoupledAttention:
    """A transport fault hook: A2E(L, s) waits until every stage of the step
    has started its E2A of the layer before L (bounded by the op timeout)."""

    def __init__(self, transport: EmulatedTransport) -> None:
        self.transport = transport
        self._cond = threading.Condition()
        self._peers: object = None
        self._sent: dict[int, set[int]] = {}

    def _reset_if_new_step(self) -> None:
        # begin_step builds new peers: a new step (even one of the same number).
        if self._peers is not self.transport.peers:
            self._peers = self.transport.peers
            self._sent = {}

    def __call__(self, kind: str, layer: int, stage: int) -> None:
        with self._cond:
            self._reset_if_new_step()
            if kind == "e2a":
                self._sent.setdefault(layer, set()).add(stage)
                self._cond.notify_all()
                return
            if kind != "a2e":
                return
            peers = self.transport.peers
            layers = peers[stage].layers
            i = layers.index(layer) if layer in layers else 0
            if i == 0:
                return
            previous, stages = layers[i - 1], set(peers)
            timeout = self.transport.op_timeout_s
            deadline = time.perf_counter() + timeout
            while not stages <= self._sent.get(previous, set()):
                left = deadline - time.perf_counter()
                if left <= 0:
                    missing = sorted(stages - self._sent.get(previous, set()))
                    raise PeerTimeoutError(
                        f"a2e(L{layer}) of stage {stage}: attention waits for e2a(L{previous}) of stage(s) "
                        f"{missing} before sending layer {layer}; none came after {timeout:.1f} s"
                    )
                self._cond.wait(left)


def couple_stages(world: World) -> CoupledAttention:
    """Make ``world``'s attention side couple its stages (see the module doc)."""
    hook = CoupledAttention(world.transport)
    world.transport.fault_hook = hook
    return hook
