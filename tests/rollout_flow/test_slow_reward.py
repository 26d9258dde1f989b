"""A slow reward does not hold the run's loop.

An ML user's reward of 0.5 s a completion (an LLM judge, a sandbox) held the loop — scoring ran
on the dispatcher's caller, the loop's thread — 2 s for each group of 4: no heartbeat read, no
deadline fired, no other engine's answer taken meanwhile, and the run said it as its own stall
("the run's own process did not turn for 8.0 s ... a paused VM"). The dispatcher now scores on a
thread of its own; the group stays `dispatched` until scored, then completes as before.

Real embedded engine processes over HTTP (`fleet.Fleet`); the task's scoring is the far edge
made slow: the arithmetic task's own scores, after a sleep."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from ehp_fsm.data.rewards import RewardError
from ehp_fsm.training.task import ArithmeticTask, GroupSamples

from .fleet import Fleet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SCORE_S = 1.0  # a group's scoring


class SlowTask(ArithmeticTask):
    def __init__(self) -> None:
        super().__init__()
        self.fail = False

    def score_group(
        self,
        group_index: int,
        completions: Sequence[Sequence[int]],
        logprobs: Sequence[Sequence[float]] | None = None,
        *,
        revision: int = 0,
    ) -> GroupSamples:
        time.sleep(SCORE_S)
        if self.fail:
            raise RewardError("the reward raised ValueError", "scoring group", "fix the reward")
        return super().score_group(group_index, completions, logprobs, revision=revision)


@pytest.fixture
def fleet(tmp_path: Path, tiny_model: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path, base=tiny_model, group_size=4)
    f.task = f.disp.task = SlowTask()
    try:
        yield f
    finally:
        f.shutdown()


def test_a_slow_reward_leaves_the_loop_turning_and_its_groups_complete(fleet: Fleet) -> None:
    fleet.start_processes(["e0"])
    fleet.publish()
    fleet.launch("e0", "h1:g0")
    assert fleet.settle(30)
    fleet.disp.fill(3)
    turns: list[float] = []
    start = time.monotonic()
    while len(fleet.disp.completed_groups()) < 3 and time.monotonic() - start < 60:
        t0 = time.monotonic()
        fleet.disp.pump(0.02)
        turns.append(time.monotonic() - t0)
    done = fleet.disp.completed_groups()
    assert len(done) == 3, fleet.disp.stats
    # three groups scored one after another (≥ 3 s) while the loop turned all along: no turn
    # waited for a score (scored on the loop's thread, each answer's turn took SCORE_S)
    assert time.monotonic() - start >= 3 * SCORE_S
    assert max(turns) < SCORE_S / 2, max(turns)
    assert len(turns) > 3 * SCORE_S / 0.05
    assert all(len(g.samples.completions) == 4 for g in fleet.disp.results(done))
    # a daemon: a reward still scoring at the run's end does not hold its exit (a pool's
    # thread did: "not waiting for 1 thread still running (ehp-score_0)")
    scorers = [t for t in threading.enumerate() if t.name == "ehp-score"]
    assert scorers and all(t.daemon for t in scorers), scorers

    # a reward that fails (on_error = "raise") still stops the run: its error is raised by
    # the loop's turn that takes the scored answer, as it was by the turn that scored it
    fleet.task.fail = True
    fleet.disp.enqueue(1)
    with pytest.raises(RewardError, match="the reward raised ValueError"):
        _pump_for(fleet, 60.0)


def _pump_for(fleet: Fleet, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        fleet.disp.pump(0.02)
