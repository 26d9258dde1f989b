"""A replay asked to stop: `replay(..., checkpoint=)` calls the checkpoint as it reads the log,
and what the checkpoint raises ends the replay as it is — in one stretch and in the last
stretch of a replay cut at the log's checkpoints (`jobs` > 1), where any other exception of the
line loop is taken for the engine failing on a restored world. `recover_log` leaves the log as
it was (its torn tail written back). This is what `ehp-fsm run --resume` stops by: before, a
stop was answered once the whole log had replayed (~45,000 records a second)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from ehp_fsm.replay import replay
from ehp_fsm.runtime.recovery import recover_log
from tests.core.test_replay_forget import training

BATCH = 4096  # lines between two calls (`replay._BATCH`)


class Stop(Exception):
    """The caller's own exception (the run's `Interrupted`)."""


def stopping_at(call: int, calls: list[int]) -> Callable[[], None]:
    """A checkpoint that counts its calls and raises `Stop` at call number `call`."""

    def checkpoint() -> None:
        calls.append(1)
        if len(calls) == call:
            raise Stop(f"stopped at call {call}")

    return checkpoint


@pytest.fixture(scope="module")
def long_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    log = tmp_path_factory.mktemp("stop") / "t.jsonl"
    training(log, 320, checkpoint_every=40).engine.close()
    return log


def test_the_checkpoint_is_called_through_the_whole_log(long_log: Path) -> None:
    lines = len(long_log.read_bytes().splitlines())
    assert lines > 4 * BATCH, lines
    calls: list[int] = []
    got = replay(long_log, checkpoint=lambda: calls.append(1))
    assert got.transitions == replay(long_log).transitions
    assert len(calls) >= lines // BATCH, (len(calls), lines)


@pytest.mark.parametrize("jobs", [1, 3])
def test_what_the_checkpoint_raises_ends_the_replay_as_it_is(long_log: Path, jobs: int) -> None:
    calls: list[int] = []
    with pytest.raises(Stop, match="stopped at call 2"):
        replay(long_log, jobs=jobs, checkpoint=stopping_at(2, calls), forget_finished=True)
    assert len(calls) == 2  # nothing read past it
    # the last stretch of 3 starts at a checkpoint line: a raise there was named the engine
    # failing on a restored world ("the engine cannot step it from the checkpoint on line")


def test_a_recovery_stopped_leaves_the_log_as_it_was(long_log: Path, tmp_path: Path) -> None:
    log = tmp_path / "t.jsonl"
    torn = long_log.read_bytes() + b'{"seq": 99999999, "mach'  # a torn last line: cut first
    log.write_bytes(torn)
    calls: list[int] = []
    with pytest.raises(Stop):
        recover_log(log, forget_finished=True, checkpoint=stopping_at(3, calls))
    assert log.read_bytes() == torn  # the cut tail written back
    result, report = recover_log(log, forget_finished=True)  # and it recovers as before
    assert report.dropped_records == 1
    assert result.transitions == replay(long_log).transitions
