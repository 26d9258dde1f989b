"""The run's move tracker matches each borrow to the Hybrid it started (not the oldest one
pending): a Hybrid that fails before it trains leaves no latency to another."""

from __future__ import annotations

import io
from pathlib import Path

from ehp_fsm import Event, Orchestrator, load_plan
from ehp_fsm.replay import replay
from ehp_fsm.report.progress import Progress, RunFigures
from ehp_fsm.run.decisions import CarriedOut
from ehp_fsm.run.watch import FailureWatch, MoveTracker, Pending
from ehp_fsm.runtime.reconcile import AgentInfo
from tests.run.test_run import SHORT

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "borrow_and_return.jsonl"


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


def test_an_end_of_run_return_whose_gpus_are_quarantined_is_not_waited_for() -> None:
    """The end-of-run return of a Hybrid whose host's agent went silent (kill -9 of the agent
    of the host the Hybrid was borrowed on): the Hybrid has left, its GPU is quarantined and
    only that agent could free it. The return is done, saying so; the run waited for it until
    its 210 s were up ("its GPUs did not serve rollout again (not within 210 s)")."""
    world = replay(GOLDEN, until_seq=142).world  # hybrid x0 stopped, its GPU h1:g1 releasing
    orch = Orchestrator.from_plan(load_plan(SHORT))
    orch.world = world
    figures = RunFigures()
    out = io.StringIO()
    tracker = MoveTracker(figures, Progress(out, live=False))
    tracker.track(CarriedOut(borrows=(), drained={}, leaves=("x0",), restarts=()), 9)
    tracker.watch_returns(orch.world)
    assert len(tracker.returns()) == 1  # releasing: its finalizer may still confirm it
    assert orch.handle(Event("gpu", "h1:g1", "quarantine", time=97.0)).accepted
    tracker.watch_returns(orch.world)
    assert tracker.returns() == []
    (move,) = figures.moves
    assert move.detail == (
        "hybrid x0 -> left; GPUs h1:g1 quarantined (their host's agent is silent: not "
        "confirmed free)"
    ), move.detail
    assert "return: hybrid x0 left; GPUs h1:g1 quarantined" in out.getvalue()


def test_a_host_whose_agent_falls_silent_is_named_once_and_when_it_answers() -> None:
    """kill -9 of a host's agent mid-run: its GPUs were quarantined and nothing said so until
    the run's end (exit 1), for the whole rest of the run."""
    out = io.StringIO()
    watch = FailureWatch(Progress(out, live=False))
    agents = {"h1": AgentInfo("h1", 1), "h2": AgentInfo("h2", 1)}
    watch.watch_agents(agents)
    assert out.getvalue() == ""
    agents["h1"].silent = True
    watch.watch_agents(agents)
    watch.watch_agents(agents)  # once a silence
    assert out.getvalue().count("host h1: its agent went silent; its GPUs are quarantined") == 1
    agents["h1"].silent = False
    watch.watch_agents(agents)
    assert out.getvalue().endswith("host h1: its agent answers again\n"), out.getvalue()
