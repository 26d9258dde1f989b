"""A resume rebuilds its world forgetting finished instances as it replays the log, as the log's
writer forgot them: the memory of recovering a long log follows its live world, not its length.

Before, `Orchestrator.resume` and `ehp-fsm run --resume` (`runtime.recovery.recover_log`)
replayed keeping every instance — at 1,024 hosts × 500 steps, 8.2 M consumed groups held at
once, only for the resumed orchestrator to forget them as soon as it took the world.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import ehp_fsm.loglines as loglines
from ehp_fsm import Orchestrator
from ehp_fsm.finished import WRITER_FORGETS, IdSet
from ehp_fsm.replay import replay
from ehp_fsm.run.resume import next_group_index
from ehp_fsm.runtime.recovery import recover_log
from tests.core.scenario import Scenario
from tests.core.test_replay_forget import GROUPS, more_steps, training


def _peak(fn: Callable[[], Any]) -> tuple[Any, int]:
    """`fn()` and the peak of the Python memory it allocated."""
    tracemalloc.start()
    try:
        return fn(), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_resume_holds_the_live_world_not_every_finished_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "t.jsonl"
    training(log, 100, checkpoint_every=7).engine.close()  # 800 consumed groups
    Orchestrator.resume(log).close()  # (its imports and caches, outside what is measured)
    # the log is read a chunk at a time: a small chunk, so the peak is the world's
    monkeypatch.setattr(loglines, "CHUNK", 4096)
    _, keeping = _peak(lambda: replay(log))
    orch, resuming = _peak(lambda: Orchestrator.resume(log, check=True))
    # measured: keeping every instance 782 kB, the resume 135 kB (before: as much as keeping)
    assert resuming < 0.3 * keeping, (resuming, keeping)
    assert orch.world.of("request") == {}  # every group consumed: forgotten
    s = Scenario.__new__(Scenario)
    s.engine, s.now = orch, 1e6
    more_steps(s, 101, 102)  # it goes on forgetting, and writes a log that verifies
    orch.close()
    assert orch.world.of("request") == {}
    assert replay(log, jobs=2, forget_finished=True).transitions == replay(log).transitions


def test_recovery_forgets_as_asked_and_finds_the_next_group_among_the_forgotten(
    tmp_path: Path,
) -> None:
    """What `ehp-fsm run --resume` does: the next group's index counts the consumed groups the
    recovered world forgot (numbering again from a live group's would create `g0` again, which
    a consumed `g0` refuses)."""
    log = tmp_path / "t.jsonl"
    s = training(log, 5)
    s.ok("request", f"g{5 * GROUPS}", "enqueue", prompt="1+1=")  # one live group after them
    s.engine.close()
    result, _ = recover_log(log, forget_finished=True)
    live = result.world.of("request")
    assert list(live) == [f"g{5 * GROUPS}"]
    assert result.forgetter is not None
    consumed = list(result.forgetter.finished["request"].by_state.values())
    assert next_group_index(live, consumed) == 5 * GROUPS + 1
    kept, _ = recover_log(log)  # keeping every instance: the same answer
    assert next_group_index(kept.world.of("request")) == 5 * GROUPS + 1
    assert kept.forgetter is None
    only = replay(log, forget_finished=WRITER_FORGETS)
    assert only.forgetter is not None and set(only.forgetter.finished) == set(WRITER_FORGETS)


def test_the_next_group_index_reads_forgotten_ids() -> None:
    ids = IdSet()
    for n in range(40):
        ids.add(f"g{n}")
    ids.add("g007")  # (not <prefix><number>: kept as it is, and still a group's number)
    assert next_group_index({}, [ids]) == 40
    assert next_group_index({"g3": {"index": 3}}, [IdSet()]) == 4
    other = IdSet()
    other.add("g0099")
    assert next_group_index({}, [other]) == 100


def test_replay_refuses_to_forget_what_is_never_forgotten(tmp_path: Path) -> None:
    log = tmp_path / "t.jsonl"
    training(log, 1).engine.close()
    with pytest.raises(ValueError, match="forget_finished names gpu, whose finished"):
        replay(log, forget_finished=["gpu"])
    with pytest.raises(TypeError, match="a bool or a collection of machine names, not str"):
        replay(log, forget_finished="request")
