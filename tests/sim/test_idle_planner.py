"""EHP on pays nothing at a step boundary where the planner has nothing to do.

The planner decided from a settled world: every step boundary waited for every engine to install
the new revision, EHP on only (EHP off has no planner turn), while training waited. On
`examples/short.toml` (training-bound; its one Hybrid is borrowed at the first boundary and then
trains to the end, so every later decision is "nothing to do") that wait, 3 s a boundary at the
default cost model's 15 GB installs, made EHP on slower than EHP off: 30 steps in 389 s against
330 s (0.848×), with a Hybrid training. Now a decision with nothing to do is taken at once
(`Job.plan_next`, `Simulation.plan_next`); a move still waits for the installs and is decided
again. Only the far edge is simulated (agents, engines, trainer ranks); the planner and the
decision's execution are the run's own.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

from ehp_fsm.plan import load_plan
from ehp_fsm.sim.story import Simulation

SHORT = Path(__file__).parents[2] / "examples" / "short.toml"


def test_an_idle_planner_turn_does_not_wait_for_the_installs(tmp_path: Path) -> None:
    plan = load_plan(SHORT)
    off = Simulation(plan, seed=0, ehp=False, steps=30, log_path=tmp_path / "off.jsonl").run()
    on = Simulation(plan, seed=0, ehp=True, steps=30, log_path=tmp_path / "on.jsonl").run()
    assert len(on.borrows) == 1 and not off.borrows
    assert on.steps_s < off.steps_s, (on.steps_s, off.steps_s)
    # with the Hybrid training, a step takes its training time and no install on top: the
    # boundaries after the borrow are as long as the steps' own times (no 3 s wait each)
    late = on.figures[5:]
    gaps = [b.end - a.end - (b.train_s + b.rollout_s) for a, b in itertools.pairwise(late)]
    assert max(gaps) < 1.0, gaps


def test_a_floor_that_does_not_fit_is_recorded_once_not_at_every_boundary(tmp_path: Path) -> None:
    # gpu-4x8 with a floor of 5 Hybrids (2 GPUs each) and a reserve of 20 serving GPUs: 2 fit.
    # Before, the same shortfall (wanted 5, granted 2) was a decision to record at every step
    # boundary — one `fell_short` a step, and each waited for every engine's install first.
    # Now the shortfall the capacity machine holds is nothing new: recorded once, and the
    # boundary waits for the installs only where they could meet it (decided again on the
    # settled view: `decisions.idle_once_settled`).
    plan = load_plan(Path(__file__).parents[2] / "examples" / "gpu-4x8.toml")
    plan = replace(
        plan,
        rollout=replace(plan.rollout, reserve=20),
        ehp=replace(plan.ehp, max_hybrids=5, min_hybrids=5),
    )
    log = tmp_path / "floor.jsonl"
    result = Simulation(plan, seed=0, ehp=True, steps=12, log_path=log).run()
    records = [json.loads(line) for line in log.read_text().splitlines()[1:]]
    short = [r for r in records if r.get("machine") == "capacity" and r["event"] == "fell_short"]
    assert len(short) == 1, short
    assert short[0]["payload"]["wanted"] == 5 and short[0]["payload"]["granted"] == 2
    assert len(result.borrows) == 2  # the two that fit, borrowed at the first boundary
