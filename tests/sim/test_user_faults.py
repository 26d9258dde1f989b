"""A process that dies while it starts is a fault like any other: `gpu_fault_per_hour` is per
GPU-hour of a process's life, start-up included. Before, a death drawn before the process was
up was dropped, so a higher rate injected *fewer* faults: at 100 per GPU-hour every draw fell
inside an engine's start and the run reported "faults injected: none"."""

from __future__ import annotations

from pathlib import Path

import pytest

from ehp_fsm.cli import main
from ehp_fsm.plan import load_plan
from ehp_fsm.sim.story import SimError, Simulation
from tests.sim.test_cost_model_edges import _plan


def test_a_process_that_dies_while_it_starts_is_a_fault(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = load_plan(_plan(tmp_path, "gpu_fault_per_hour = 1.0\nengine_start_s = 60.0"))
    sim = Simulation(plan, seed=0, faults="on", steps=1, log_path=tmp_path / "t.jsonl")
    # every process dies 1 s after its launch, 59 s before it would be up
    monkeypatch.setattr(sim.costs, "time_to_gpu_fault", lambda gpus: 1.0)
    with pytest.raises(SimError, match="no engine came up"):  # ran on, with no fault seen
        sim.run()
    assert sim.acct.faults.get("engine_death") == 3  # each of the plan's 3 engines


def test_a_fault_rate_that_kills_every_start_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = _plan(tmp_path, "gpu_fault_per_hour = 1e6\nengine_start_s = 60.0")
    out_dir = str(tmp_path / "o")
    code = main(["simulate", str(plan), "--steps", "1", "--faults", "on", "--out", out_dir])
    out, err = capsys.readouterr()
    assert code == 2, out  # was 0, with "faults injected: none"
    assert "no engine came up" in err and "gpu_fault_per_hour" in err, err
    assert "Traceback" not in err


def test_a_hunt_with_faults_off_says_to_turn_them_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--seeds` without `--faults` (off) injected none and advised "give more --hosts or
    --steps", which inject none either while faults are off."""
    plan = _plan(tmp_path, "")
    assert main(["simulate", str(plan), "--steps", "1", "--seeds", "1"]) == 0
    out = capsys.readouterr().out
    assert "--faults off injects no fault" in out and "--faults heavy" in out, out
    assert "more --hosts or --steps" not in out, out
