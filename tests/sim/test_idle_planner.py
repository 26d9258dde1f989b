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
