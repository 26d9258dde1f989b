"""The engine throughput `fit_costs` fits: tokens over the time an engine had a group in flight
and was not installing — the simulation charges installs on their own, so time spent installing
with groups in flight must not be counted as decoding too (it made the simulated steps of the
calibration run ~25 % long)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from ehp_fsm.errors import EhpError
from ehp_fsm.plan import load_plan, simulate_costs
from ehp_fsm.sim.calibrate import _busy, _overlap, _union, fit_costs
from ehp_fsm.sim.story import Simulation

GPU_PLAN = Path(__file__).resolve().parents[2] / "examples" / "gpu-4x8.toml"


def test_union_merges_overlapping_and_touching_spans() -> None:
    assert _union([(5.0, 6.0), (0.0, 2.0), (1.0, 3.0), (3.0, 4.0)]) == [(0.0, 4.0), (5.0, 6.0)]


def test_overlap_of_two_interval_lists() -> None:
    assert _overlap([(0.0, 4.0), (5.0, 9.0)], [(3.0, 6.0), (8.5, 20.0)]) == pytest.approx(2.5)
    assert _overlap([(0.0, 1.0)], [(2.0, 3.0)]) == 0.0


def test_install_time_with_groups_in_flight_is_not_decoding() -> None:
    spans = {"e0": [(0.0, 6.0), (4.0, 10.0)], "e1": [(0.0, 2.0)]}
    installs = {"e0": [(4.0, 6.0), (20.0, 21.0)], "e1": [(5.0, 6.0)]}  # e1 idle while installing
    assert _busy(spans, installs) == pytest.approx((10.0 - 2.0) + 2.0)
    assert _busy(spans, {}) == pytest.approx(12.0)


def test_no_completed_group_is_refused() -> None:
    with pytest.raises(EhpError, match="no completed groups"):
        _busy({"e0": [(1.0, 1.0)]}, {})


def test_training_is_fitted_from_a_core_of_several_replicas(tmp_path: Path) -> None:
    """A Core of DP 4 trains a quarter of the batch on each replica at once: each of its steps
    is a Core-only step, fitted per sample of one replica's share (only partitions of one
    replica were counted: a DP>1 Core's log was refused as holding no training step)."""
    plan = load_plan(GPU_PLAN)
    assert plan.core.dp == 4
    spec = replace(
        simulate_costs(plan),
        train_s_per_sample=0.25,
        optimizer_s=0.0,
        reduce_gb_per_s=1e6,
        save_gb_per_s=1e6,
    )
    log = tmp_path / "t.jsonl"
    Simulation(replace(plan, simulate=spec), seed=0, ehp=False, steps=2, log_path=log).run()
    assert fit_costs(log, plan).train_s_per_sample == pytest.approx(0.25, rel=1e-3)
