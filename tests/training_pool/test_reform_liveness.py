"""A re-form of the Gloo world survives warm workers that died where nobody was watching: one
that died idle before the re-form (the pool checks every member's process before naming the
members), and one that dies during the re-form (the survivors' rendezvous fails for want of it,
and the re-form is tried once more without it). Before the fix either left the pool broken
although the Core was alive.

Real processes, real Gloo, real ZeroMQ; the worker's test hook (`EHP_TEST_REDUCE_HOOK`) holds a
warm worker on entering its re-form (`hold-reform-<rank>`) so the test kills it exactly there.
`collective_timeout_s` is small: the survivors' failed rendezvous waits that long.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from ehp_fsm.training.pool import PoolConfig, PoolFailure, StepResult, TrainerPool
from ehp_fsm.training.worker import REDUCE_HOOK_ENV
from tests.procs import kill_and_wait, still_running
from tests.training_pool.rig import batch_of, ok, run_step, tiny_config


def _config() -> PoolConfig:
    return tiny_config(max_hybrids=2, collective_timeout_s=3.0)


def _step(pool: TrainerPool, step: int, epoch: int) -> StepResult | PoolFailure:
    return run_step(pool, step, epoch, batch_of(step), publish=False)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_reform_leaves_out_warm_workers_that_died_unnoticed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hook = tmp_path / "hook"
    hook.mkdir()
    monkeypatch.setenv(REDUCE_HOOK_ENV, str(hook))
    with TrainerPool.spawn(_config(), work_dir=tmp_path / "pool") as pool:
        pids = {w.rank: w.identity.pid for w in pool.workers}
        seen = set(pids.values())
        ok(_step(pool, 0, 0))

        # 1. Rank 2 dies during the re-form that admits rank 1's replacement.
        kill_and_wait(pids[1])
        assert isinstance(pool.load_state(1, replica="hybrid:a"), PoolFailure)  # seen dead
        before = set(hook.glob("reform-2-*"))  # re-forms rank 2 has already been through
        (hook / "hold-reform-2").write_text("")
        entered: list[Path] = []

        def kill_in_reform() -> None:
            end = time.monotonic() + 90
            while not entered and time.monotonic() < end:
                entered.extend(set(hook.glob("reform-2-*")) - before)
                time.sleep(0.01)
            os.kill(pids[2], signal.SIGKILL)
            (hook / "hold-reform-2").unlink()  # rank 2's replacement must not be held

        killer = threading.Thread(target=kill_in_reform, daemon=True)
        killer.start()
        got = pool.admit_replacements(wait_s=90)
        killer.join(10)
        assert entered, "rank 2 never entered the re-form"
        assert got is None and pool.broken is None, got
        reform = pool.reforms[-1]
        assert reform.members == (0, 1) and reform.dead == (2,), reform
        assert reform.seconds >= _config().collective_timeout_s  # the first try timed out
        assert pool.idle_warm_ranks() == (1,)
        ok(pool.load_state(1, replica="hybrid:b"))
        pool.activate("hybrid:b")
        res = ok(_step(pool, 1, 1))
        assert res.replicas == ("core:0", "hybrid:b") and res.version == 2
        pool.deactivate("hybrid:b")
        rank1 = next(w.identity.pid for w in pool.workers if w.rank == 1)
        seen.add(rank1)

        # 2. Rank 1 dies idle, unnoticed; then rank 2's replacement is admitted.
        kill_and_wait(rank1)
        with capture_logs() as logs:
            assert pool.admit_replacements(wait_s=90) is None and pool.broken is None
        reform = pool.reforms[-1]
        assert reform.members == (0, 2) and reform.dead == (1,), reform
        # left out before the re-form, not found missing by survivors waiting for it
        assert not [e for e in logs if e["event"] == "world_reform_retried"], logs
        assert pool.idle_warm_ranks() == (2,)
        ok(pool.load_state(2, replica="hybrid:c"))
        pool.activate("hybrid:c")
        res = ok(_step(pool, 2, 2))
        assert res.replicas == ("core:0", "hybrid:c") and res.version == 3
        seen |= {w.identity.pid for w in pool.workers}
        # rank 1 was replaced again, and its replacement is admitted in its turn
        assert pool.admit_replacements(wait_s=90) is None
        assert pool.reforms[-1].members == (0, 1, 2)
        seen |= {w.identity.pid for w in pool.workers}
        assert len(seen) == 6
    left = still_running(seen)
    assert not left, f"worker processes {left} outlived the pool"
