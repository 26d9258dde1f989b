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


GPU_4X8 = Path(__file__).parents[2] / "examples" / "gpu-4x8.toml"


def _no_budget(tmp_path: Path) -> Path:
    """gpu-4x8 with a reserve that keeps every engine (24 of 24 GPUs): the planner wants
    Hybrids, training-bound, and can never grant one — a shortfall at every boundary."""
    text = GPU_4X8.read_text().replace("\nreserve = 12", "\nreserve = 24")
    text = text.replace('curve_keys = "keys/"', f'curve_keys = "{GPU_4X8.parent}/keys/"')
    text += "\n[simulate]\nsequence_tokens_per_s = 500.0\ninstall_gb_per_s = 1.0\n"
    assert "reserve = 24" in text
    plan = tmp_path / "no-budget.toml"
    plan.write_text(text)
    return plan


def test_a_shortfall_the_installs_cannot_mend_is_not_waited_for_at_every_boundary(
    tmp_path: Path,
) -> None:
    """The same shortfall, no move, at every boundary (a reserve that keeps every engine):
    each boundary waited for the installs (15 s of 15 GB at 1 GB/s) only to record it again —
    EHP on 0.721× of EHP off over 12 steps with no borrow. Once a wait proved fruitless the
    boundaries decide at once, waiting again only now and then (`BoundaryWait`)."""
    plan = load_plan(_no_budget(tmp_path))
    off = Simulation(plan, seed=0, ehp=False, steps=12, log_path=tmp_path / "off.jsonl").run()
    on = Simulation(plan, seed=0, ehp=True, steps=12, log_path=tmp_path / "on.jsonl").run()
    assert not on.borrows and not off.borrows
    assert off.steps_s / on.steps_s > 0.85, (off.steps_s, on.steps_s)
    waits = [b.end - a.end - (b.train_s + b.rollout_s) for a, b in itertools.pairwise(on.figures)]
    assert sum(w > 5.0 for w in waits) <= 4, waits  # the first, then after 2, 4, 8 boundaries


def test_boundary_wait_skips_only_a_fruitless_repeat_and_backs_off() -> None:
    from ehp_fsm.core.planner_model import Shortfall
    from ehp_fsm.run.decisions import BoundaryWait

    # (a Decision as the planner makes it holds more; `BoundaryWait` reads these two)
    class D:
        def __init__(self, short: tuple[int, int] | None, actions: int = 0) -> None:
            self.actions = tuple(range(actions))
            self.shortfall = (
                None if short is None else Shortfall(wanted=short[0], granted=short[1], reason="")
            )

    w = BoundaryWait()
    d = D((5, 0))
    assert w.needed(d)  # nothing known: wait
    w.settled(d)  # the wait ended in the same shortfall, no move: fruitless
    waited = [w.needed(d) for _ in range(20)]
    # after 2 skipped boundaries it waits again; each fruitless wait doubles the skips
    assert waited[:3] == [False, False, True], waited
    w.settled(d)
    assert [w.needed(d) for _ in range(5)] == [False] * 4 + [True]
    assert w.needed(D((5, 1)))  # another shortfall: waits
    assert w.needed(D((5, 0), actions=1))  # a move: waits
    w.settled(D(None))  # a settled decision without shortfall forgets it
    assert w.needed(d)
