"""The trainer pool's waits do not count the run process's own stalls (`OwnDeadline`).

A run stopped (SIGSTOP, a paused VM) for longer than a step's deadline had its Core rank's
answer, sent in time and waiting in the pool's socket, given up at the resume: the step failed
inside its collective and the run stopped ("no reply from ranks [0] in 3 s", a 3 s
`[deadlines.training_step] computing`, a whole-run SIGSTOP of 8 s). Here the stall is the pool's
own thread not reading for 4 s (its first read sleeps: a stopped process cannot stop itself in a
test; it then reads nothing, as a resumed process whose socket libzmq has not handed the reply
yet), with real worker processes answering in a fraction of a second, and a step deadline of
2 s. Only that one read is made slow; the sockets, workers and Gloo world are real.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ehp_fsm.stalls import OwnDeadline
from ehp_fsm.training.pool import PoolFailure, StepResult, TrainerPool
from ehp_fsm.training.pool_channel import WorkerChannel
from tests.training_pool.rig import batch_of, run_step, tiny_config

STALL_S = 4.0
DEADLINE_S = 2.0


def test_own_deadline_moves_by_a_stall_beyond_its_allowance() -> None:
    t = [100.0]
    d = OwnDeadline(5.0, allowance_s=1.0, clock=lambda: t[0])
    t[0] += 0.5
    assert d.left() == pytest.approx(4.5)
    t[0] += 10.0  # stopped: 10 s between two readings, 9 of them beyond the allowance
    assert d.left() == pytest.approx(4.5 - 10.0 + 9.0)
    assert d.stalled_s == pytest.approx(9.0)
    for _ in range(40):  # read every 0.2 s: the time runs out as usual
        t[0] += 0.2
        d.left()
    assert d.left() <= 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_step_whose_answer_came_while_the_pool_stalled_is_not_given_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = WorkerChannel._recv
    armed = [False]  # set once the pool is up: its start-up reads are not stalled
    stalled: list[float] = []

    def recv(self: WorkerChannel, *, timeout_ms: int) -> object:
        if armed[0] and not stalled:
            stalled.append(STALL_S)
            time.sleep(STALL_S)  # the pool's thread does not read: its process is stopped
            return None  # and at the resume the socket has not been handed the reply yet
        return real(self, timeout_ms=timeout_ms)

    monkeypatch.setattr(WorkerChannel, "_recv", recv)
    with TrainerPool.spawn(tiny_config(max_hybrids=0), work_dir=tmp_path / "pool") as pool:
        armed[0] = True
        res = run_step(pool, 0, 0, batch_of(0), timeout_s=DEADLINE_S)
        assert stalled, "the stall was not reached"
        assert not isinstance(res, PoolFailure), str(res)
        assert isinstance(res, StepResult) and res.version == 1


def test_a_commit_after_a_stall_judges_its_margin_without_the_stall() -> None:
    """The run's trainer lets the pool commit only before the step's deadline margin
    (`_InFlight.commit_ok`, monotonic): the same 8 s stop gave the step up there ("training step
    N was given up: its computation did not end within ... computing (3 s)"). The stall the
    pool credited to the step (`TrainerPool.step_stalled_s`) is not counted now, as the loop
    does not count it against the step's deadline."""
    from ehp_fsm.run.step import _InFlight

    late = _InFlight(sid="s", step=1, give_up_at=time.monotonic() - 2.0)
    assert late.commit_ok(("core:0",)) is False  # past the margin, no stall: given up
    stalled = _InFlight(sid="s", step=1, give_up_at=time.monotonic() - 2.0, stalled=lambda: 7.0)
    assert stalled.commit_ok(("core:0",)) is True
    assert stalled.computed == ("core:0",)
