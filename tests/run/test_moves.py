"""The run's move tracker matches each borrow to the Hybrid it started (not the oldest one
pending): a Hybrid that fails before it trains leaves no latency to another."""

from __future__ import annotations

import io

from ehp_fsm.report.progress import Progress, RunFigures
from ehp_fsm.run.decisions import CarriedOut
from ehp_fsm.run.watch import MoveTracker, Pending


def test_a_borrow_is_done_when_its_own_hybrid_trains() -> None:
    figures = RunFigures()
    tracker = MoveTracker(figures, Progress(io.StringIO(), live=False))
    tracker.add(Pending(10.0, "borrow", "e0 drained", 3, hybrid="x1"))  # x1 fails later
    tracker.add(Pending(20.0, "borrow", "free GPUs", 5, hybrid="x3"))
    tracker.moved("borrow", "x3", 6)
    (move,) = figures.moves
    assert (move.kind, move.step, move.detail) == ("borrow", 6, "free GPUs -> hybrid x3")
    assert [p.hybrid for p in tracker.pending] == ["x1"]
    tracker.moved("borrow", "x9", 7)  # no move of its own: nothing recorded
    assert len(figures.moves) == 1


def test_a_return_that_restarts_only_free_gpus_is_a_move() -> None:
    """A return decision that makes no Hybrid leave but restarts engines on free GPUs (the
    planner's return path with nothing to take back but free GPUs) is tracked like any return:
    done once those engines serve. It was not tracked at all: the run neither showed it nor
    waited for its engines at the end."""
    figures = RunFigures()
    tracker = MoveTracker(figures, Progress(io.StringIO(), live=False))
    tracker.track(CarriedOut(borrows=(), drained={}, leaves=(), restarts=("e7", "e8")), 4)
    (p,) = tracker.returns()
    assert (p.kind, p.detail, p.step, p.engines, p.hybrid) == (
        "return",
        "free GPUs",
        4,
        ["e7", "e8"],
        "",
    )
    tracker.track(CarriedOut(borrows=(), drained={}, leaves=("x2",), restarts=("e9",)), 5)
    assert [(p.detail, p.engines) for p in tracker.returns()[1:]] == [("hybrid x2", ["e9"])]
