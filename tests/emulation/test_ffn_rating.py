"""The FFN's rated model (``emulation/ffn_timing.py``): a kernel's modelled
duration is the emulated device's cost of its shape, the same on every run,
as long as this machine holds it (its isolated runs' median, and each
schedule's in the run, times HOLD within the rating); otherwise the model is
calibrated, and the reason is given. Kernel bodies here sleep a set time,
so what is held and what is not does not depend on this machine."""

from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from camp2p_overlap.emulation import ffn_timing
from camp2p_overlap.emulation.moe import MoEFFN, MoEShape

SHAPE = MoEShape(hidden=16, ffn=32, experts=2, top_k=1)


def _sleeping_moe(seconds: float) -> Any:
    """A MoE of SHAPE whose kernel body takes ``seconds`` (a sleep)."""
    router = torch.zeros(SHAPE.hidden, SHAPE.experts)
    return SimpleNamespace(shape=SHAPE, groups=[{"router": router}], kernel_body=lambda *args: time.sleep(seconds))


@pytest.fixture(autouse=True)
def _short_calibration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ffn_timing, "MIN_RUNS", 5)
    monkeypatch.setattr(ffn_timing, "CALIBRATION_S", 0.0)
    monkeypatch.setattr(ffn_timing, "WARMUP", 1)
    monkeypatch.setattr(ffn_timing, "MIN_GAP_S", 0.0)
    monkeypatch.setattr(ffn_timing, "MAX_GAP_S", 0.0)


def test_the_rating_follows_the_shape_alone() -> None:
    a = MoEFFN(MoEShape(hidden=64, ffn=128, experts=4, top_k=2), seed=0)
    b = MoEFFN(MoEShape(hidden=64, ffn=128, experts=4, top_k=2), seed=9)
    assert ffn_timing.rated_s(a, 8) == ffn_timing.rated_s(b, 8) > 0
    more = [ffn_timing.rated_s(a, t) for t in (1, 2, 8, 64)]
    assert more == sorted(more) and len(set(more)) == len(more)
    wider = MoEFFN(MoEShape(hidden=128, ffn=256, experts=4, top_k=2))
    assert ffn_timing.rated_s(wider, 8) > ffn_timing.rated_s(a, 8)  # type: ignore[operator]
    # each term counts: a rate with one term zeroed is cheaper
    full = ffn_timing.rated_s(a, 8)
    for term in ("kernel_us", "picked_expert_us", "weights_us_per_mb", "activations_us_per_mb", "us_per_mflop"):
        cheaper = replace(ffn_timing.RATE, **{term: 0.0})
        assert ffn_timing.rated_s(a, 8, cheaper) < full, term  # type: ignore[operator]


def test_weights_off_the_cpu_are_not_rated() -> None:
    moe = _sleeping_moe(0.0)
    moe.groups = [{"router": torch.zeros(SHAPE.hidden, SHAPE.experts, device="meta")}]
    assert ffn_timing.rated_s(moe, 4) is None


@pytest.mark.alone  # a timing check: the kernels' times must fit the rating
def test_a_machine_that_holds_the_rating_gets_it() -> None:
    rated = ffn_timing.rated_s(_sleeping_moe(0.0), 4)
    assert rated is not None
    # a kernel body that takes no time: a machine as fast as any (a sleep of a
    # fraction of the rating overshot it 4x under a parallel test run)
    timing = ffn_timing.calibrate_ffn(_sleeping_moe(0.0), [4])
    point = timing.points[4]
    assert point.model_s == point.rated_s == rated and not point.calibrated_why
    assert timing.rated and timing.model_s(4) == rated
    assert timing.describe().startswith(f"FFN rated {rated * 1e6:,.0f} us at 4 tokens")


def test_a_machine_too_slow_for_the_rating_is_calibrated_and_says_why() -> None:
    rated = ffn_timing.rated_s(_sleeping_moe(0.0), 4)
    assert rated is not None
    slow = rated / ffn_timing.HOLD * 1.5
    timing = ffn_timing.calibrate_ffn(_sleeping_moe(slow), [4])
    point = timing.points[4]
    assert point.model_s == pytest.approx(point.quantile_s * ffn_timing.MARGIN)
    assert point.model_s > rated and not timing.rated
    assert "not held on this machine" in point.calibrated_why and "isolated runs'" in point.calibrated_why
    assert point.calibrated_why in timing.describe()


@pytest.mark.alone  # a timing check, as above
def test_a_schedule_slower_in_the_run_than_the_rating_holds_calibrates_it() -> None:
    rated = ffn_timing.rated_s(_sleeping_moe(0.0), 4)
    assert rated is not None
    base = ffn_timing.calibrate_ffn(_sleeping_moe(0.0), [4])
    fits = round(rated / ffn_timing.HOLD * 0.9 * 1e9)
    held = ffn_timing.refine_in_run(base, 4, {"serial": [fits] * 5, "overlap": [fits] * 5, "empty": []})
    assert held.model_s(4) == rated and held.rated
    assert set(held.points[4].in_run_s) == {"serial", "overlap"}
    assert "held in the run's overlap/serial steps" in held.describe()
    over = round(rated / ffn_timing.HOLD * 1.2 * 1e9)
    lost = ffn_timing.refine_in_run(base, 4, {"serial": [fits] * 5, "overlap": [over] * 5})
    point = lost.points[4]
    assert not lost.rated and "the run's overlap kernels'" in point.calibrated_why
    assert point.model_s == pytest.approx(over / 1e9 * ffn_timing.MARGIN)


def test_a_fixed_model_is_neither_rated_nor_calibrated() -> None:
    timing = ffn_timing.fixed(8, 0.002)
    assert timing.model_s(8) == 0.002 and not timing.rated
    assert timing.describe() == "FFN fixed: 2,000 us at 8 tokens (--ffn-us)"
