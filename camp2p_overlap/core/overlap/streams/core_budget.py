"""The core budget rule: an overlap layout engages only where the kernels it can run at once fit the device's vector
cores (docs/design.md, "Cores beside collectives").

What can run at once on a layout's streams, per stream the largest kernel that must be resident there:

* a stream that carries CAM's A2E or E2A (``C`` in ``compute-side``; each ``K_s`` in ``comm-side``): one CAM kernel
  of ``aiv_num`` blocks, which synchronise with one another and spin until the peer answers;
* the stream that carries the FFN (``F``, or ``C``): the MoE's collective kernel (MC2's dispatch or combine), whose
  blocks every peer rank's blocks wait on.

The experts' own kernels run in waves and wait for no one: they do not count. Upstream's serial loop runs one kernel
at a time per rank, so it has nothing to fit.

The numbers: the device's vector cores from its properties (``get_device_properties(i).vector_core_num``), else
``VLLM_CAMP2P_MULTISTREAM_VECTOR_CORES``; CAM's from the connector's ``aiv_num``; the MoE collective's from
``VLLM_CAMP2P_MULTISTREAM_MOE_CORES``, else every core of the device, the strictest reading upstream's sources allow.
On an NPU whose core count cannot be read, no overlap layout engages. Devices without CAM kernels (CUDA, the emulated
device without a core model) have nothing to fit: the rule says so and lets every layout through.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from camp2p_overlap.core.env_vars import ENV_MOE_CORES, ENV_VECTOR_CORES
from camp2p_overlap.core.overlap.plan import Layout

#: afd-plugin's CAMP2P default block count of its A2E/E2A (``connector_extra_config`` ``core_num``).
DEFAULT_CAM_CORES = 8


@dataclass(frozen=True, slots=True)
class Budget:
    """The numbers the rule reads. ``vector``: the device's vector cores (None: unknown); ``cam``: one CAM
    kernel's blocks; ``moe``: one MoE collective kernel's (None: unknown, read as every core of the device); each
    ``*_from`` says where the number came from. ``applies``: whether the device runs CAM kernels at all."""

    vector: int | None
    vector_from: str
    cam: int
    cam_from: str
    moe: int | None
    moe_from: str
    applies: bool = True

    @property
    def moe_cores(self) -> int | None:
        """The MoE collective's cores as the rule counts them (the whole device when unknown)."""
        return self.moe if self.moe is not None else self.vector


@dataclass(frozen=True, slots=True)
class Fit:
    """One layout's verdict: the cores its kernels take at once (``needed``), and whether that fits."""

    layout: str
    needed: int | None
    fits: bool
    text: str


def held_at_once(layout: Layout, stages: int, cam: int, moe: int) -> list[tuple[str, str, int]]:
    """What ``layout``'s resident kernels can hold at once with ``stages`` stages: per stream, ``(stream, kernel,
    cores)`` of the largest kernel queued there (a stream runs one kernel at a time)."""
    caller = []
    if not (layout.a2e_side and layout.e2a_side):  # A2E or E2A stays on C
        caller.append(("CAM", cam))
    if not layout.ffn_side:
        caller.append(("MoE collective", moe))
    parts = [("C", *max(caller, key=lambda kc: kc[1]))]
    if layout.comm_on_side:
        parts += [(f"K{s}", "CAM", cam) for s in range(stages)]
    if layout.ffn_side:
        parts.append(("F", "MoE collective", moe))
    return parts


def cores_at_once(layout: Layout, stages: int, cam: int, moe: int) -> int:
    """The vector cores ``layout``'s resident kernels can hold at once (:func:`held_at_once`)."""
    return sum(cores for _, _, cores in held_at_once(layout, stages, cam, moe))


def _verdict(layout: Layout, stages: int, budget: Budget) -> Fit:
    if not budget.applies:
        return Fit(layout.name, None, True, f"{layout.name}: no core rule ({budget.vector_from})")
    if budget.vector is None:
        return Fit(
            layout.name,
            None,
            False,
            f"{layout.name}: the device's vector core count is unknown ({budget.vector_from}); set {ENV_VECTOR_CORES}",
        )
    moe = budget.moe_cores
    assert moe is not None
    parts = held_at_once(layout, stages, budget.cam, moe)
    needed = sum(cores for _, _, cores in parts)
    terms = " + ".join(f"{kernel} {cores} on {stream}" for stream, kernel, cores in parts)
    text = (
        f"{layout.name} with {stages} stage(s): {terms} = {needed} vector cores at once; the device has "
        f"{budget.vector} ({budget.vector_from}; CAM: {budget.cam_from}; MoE collective: {budget.moe_from})"
    )
    return Fit(layout.name, needed, needed <= budget.vector, text)


def fit(layouts: Sequence[Layout], stages: int, budget: Budget) -> tuple[tuple[Layout, ...], tuple[Fit, ...]]:
    """The layouts of ``layouts`` that fit ``budget`` with ``stages`` stages (in order), and every verdict."""
    verdicts = tuple(_verdict(layout, stages, budget) for layout in layouts)
    return tuple(layout for layout, v in zip(layouts, verdicts, strict=True) if v.fits), verdicts


def refusal(verdicts: Sequence[Fit]) -> str:
    """The serial reason when no listed layout fits."""
    return "core budget: " + "; ".join(v.text for v in verdicts if not v.fits)


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def device_vector_cores(mod: Any, device: Any = None) -> tuple[int | None, str]:
    """The vector core count the device module reports for ``device`` (its index), and where it was read."""
    if mod is None:
        return None, "no NPU here to read it from"
    props_of = getattr(mod, "get_device_properties", None)
    name = getattr(mod, "__name__", "device module")
    if props_of is None:
        return None, f"{name} has no get_device_properties"
    index = getattr(device, "index", None)
    index = 0 if index is None else index
    where = f"{name}.get_device_properties({index}).vector_core_num"
    try:
        props = props_of(index)
    except Exception as exc:  # noqa: BLE001 - a device that cannot say is read as unknown
        return None, f"{where} failed: {type(exc).__name__}: {exc}"
    count = _positive_int(getattr(props, "vector_core_num", None))
    return count, where if count is not None else f"{where} is not given"


def cam_cores(connector: Any) -> tuple[int, str]:
    """One CAM kernel's blocks: the connector's ``aiv_num``, else CAMP2P's default."""
    count = _positive_int(getattr(connector, "aiv_num", None))
    if count is not None:
        return count, "the connector's aiv_num"
    return DEFAULT_CAM_CORES, f"CAMP2P's default core_num {DEFAULT_CAM_CORES}; the connector gives no aiv_num"


def read_budget(backend: str, mod: Any, device: Any, connector: Any, config: Any) -> Budget:
    """The rule's numbers for a runner on ``backend`` (``npu``, ``cuda`` or ``cpu``) whose device module is
    ``mod``; ``config``: an ``OverlapConfig`` (its ``vector_cores`` and ``moe_cores``)."""
    cam, cam_from = cam_cores(connector)
    moe = config.moe_cores
    moe_from = ENV_MOE_CORES if moe is not None else f"every vector core: {ENV_MOE_CORES} is unset"
    vector, vector_from = device_vector_cores(mod, device)
    if vector is None and config.vector_cores is not None:
        vector, vector_from = config.vector_cores, f"{ENV_VECTOR_CORES} ({vector_from})"
    applies = backend == "npu" or vector is not None
    if not applies:
        vector_from = f"a {backend} device runs no CAM kernels and models no vector cores"
    return Budget(vector, vector_from, cam, cam_from, moe, moe_from, applies)
