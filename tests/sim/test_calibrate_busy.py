"""What `fit_costs` fits from a log: an engine's throughput (tokens over the time it had a group
in flight) and its install (what follows the last group it finished after an update). An engine
finishes its groups in flight before it installs, decoding them meanwhile — in the run (the
embedded engine and SGLang's `/update_weights_from_disk`) and in the simulation (its install
waits for the groups ahead of it). Fitting from a simulation's own log must give back the
costs that made it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from ehp_fsm.errors import EhpError
from ehp_fsm.plan import load_plan, simulate_costs
from ehp_fsm.sim.calibrate import _busy, _union, fit_costs
from ehp_fsm.sim.story import Simulation

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
GPU_PLAN = EXAMPLES / "gpu-4x8.toml"


def test_union_merges_overlapping_and_touching_spans() -> None:
    assert _union([(5.0, 6.0), (0.0, 2.0), (1.0, 3.0), (3.0, 4.0)]) == [(0.0, 4.0), (5.0, 6.0)]


def test_busy_is_the_union_of_each_engines_groups_in_flight() -> None:
    spans = {"e0": [(0.0, 6.0), (4.0, 10.0), (12.0, 13.0)], "e1": [(0.0, 2.0)]}
    assert _busy(spans) == pytest.approx(11.0 + 2.0)


def test_a_simulated_log_fits_back_the_engine_costs_that_made_it(tmp_path: Path) -> None:
    """The default local plan's shape (three TP1 engines, groups in flight when a revision is
    published) with known costs: the fitted throughput is within 10 % and the install within
    a factor of 2 (a group's completion is seen at the loop's next turn, up to `tick_s` late).
    The fit that left the update's time out of the decoding gave +34 % and 4x the install (the
    drain counted as install), and the calibration run's simulated steps 24-26 % short."""
    plan = load_plan(EXAMPLES / "local.toml")
    assert plan.model is not None
    length = plan.model.max_response_len
    base = simulate_costs(plan)
    spec = replace(
        base,
        engine_tokens_per_s=600.0,
        tp_exponent=0.0,
        sequence_tokens_per_s=1e9,
        response_median_tokens=float(length),
        response_sigma=0.0,
        response_max_tokens=length,
        response_lengths=(),
        train_s_per_sample=0.001,
        optimizer_s=0.0,
        reduce_gb_per_s=1e9,
        save_gb_per_s=1e9,
        install_gb_per_s=base.model_gb / 0.05,
        gpu_fault_per_hour=0.0,
        agent_silence_per_hour=0.0,
        slow_node_fraction=0.0,
    )
    log = tmp_path / "t.jsonl"
    Simulation(replace(plan, simulate=spec), seed=0, steps=6, log_path=log).run()
    fitted = fit_costs(log, plan)
    assert fitted.engine_tokens_per_s == pytest.approx(600.0, rel=0.10)
    assert 0.025 <= fitted.model_gb / fitted.install_gb_per_s <= 0.1


def test_no_completed_group_is_refused() -> None:
    with pytest.raises(EhpError, match="no completed groups"):
        _busy({"e0": [(1.0, 1.0)]})


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
