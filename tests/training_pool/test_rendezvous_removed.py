"""The pool's rendezvous folder removed while it runs (a run directory deleted mid-run): the
next group formation, or the next re-formed world, fails within seconds, not after the store's
time-out.

Gloo's file store reopens its file at every operation and, when its folder is gone, retries for
the store's time-out: the run's `collective_timeout_s` (60 s). A borrow's group formation then
held the Core and the Hybrid for that minute (and the re-formed world after it, in a new file
in the same missing folder, 70 s more: 131 s in all before the step failed). Real processes and
real Gloo; the time-outs are the run's (`collective_timeout_s = 60`).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from ehp_fsm.training.pool import PoolFailure, TrainerPool
from ehp_fsm.training.worker import FORM_TIMEOUT_S
from tests.procs import kill_and_wait
from tests.training_pool.rig import batch_of, ok, run_step, tiny_config

#: The run's collective time-out (`[deadlines.run]`'s default): the store's wait before this fix.
RUN_COLLECTIVE_S = 60.0


def _spawn(tmp: Path) -> TrainerPool:
    return TrainerPool.spawn(tiny_config(collective_timeout_s=RUN_COLLECTIVE_S), work_dir=tmp)


def _borrow(pool: TrainerPool, replica: str = "hybrid:a", rank: int = 1) -> None:
    ok(pool.load_state(rank, replica=replica))
    pool.activate(replica)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_group_formed_after_the_folder_was_removed_fails_within_the_formation_bound(
    tmp_path: Path,
) -> None:
    with _spawn(tmp_path / "pool") as pool:
        ok(run_step(pool, 0, 0, batch_of(0)))
        shutil.rmtree(tmp_path / "pool")
        _borrow(pool)  # the Hybrid's first step forms the group of ranks 0 and 1
        t0 = time.monotonic()
        failed = run_step(pool, 1, 1, batch_of(1))
        took = time.monotonic() - t0
    assert isinstance(failed, PoolFailure) and failed.broken_world, failed
    assert "No such file or directory" in failed.detail, failed
    # the formation's bound (10 s) and slack for a loaded machine; 131 s before
    assert took < FORM_TIMEOUT_S + 15.0, (took, failed)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_world_re_formed_after_the_folder_was_removed_is_refused_at_once_naming_it(
    tmp_path: Path,
) -> None:
    """The run keeps the rendezvous files beside the revisions, apart from the pool's own
    folder (its workers' logs): that folder alone removed, a dead Hybrid's replacement starts,
    and the world it is admitted into would meet in a file there."""
    meet = tmp_path / "rendezvous"
    cfg = tiny_config(collective_timeout_s=RUN_COLLECTIVE_S)
    with TrainerPool(cfg, work_dir=tmp_path / "pool", rendezvous_dir=meet).launch_all() as pool:
        assert pool.wait_ready(timeout_s=120.0) is None
        ok(run_step(pool, 0, 0, batch_of(0)))
        _borrow(pool)
        ok(run_step(pool, 1, 1, batch_of(1)))  # the group of ranks 0 and 1 is formed
        shutil.rmtree(meet)
        kill_and_wait(next(w.identity.pid for w in pool.workers if w.rank == 1))
        dead = run_step(pool, 2, 1, batch_of(2))
        assert isinstance(dead, PoolFailure) and dead.reason == "dead", dead
        t0 = time.monotonic()
        failed = pool.admit_replacements(wait_s=60.0)  # its replacement joins a re-formed world
        took = time.monotonic() - t0
    assert isinstance(failed, PoolFailure) and failed.broken_world, failed
    assert f"rendezvous folder {meet} is gone" in failed.detail, failed
    assert took < 30.0, (took, failed)  # its start-up; no file store's retries (70 s before)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_replacement_whose_log_folder_was_removed_is_a_dead_worker_not_an_exception(
    tmp_path: Path,
) -> None:
    """The pool's folder removed: a dead Hybrid's replacement cannot open its log. That raised
    FileNotFoundError out of the pool (into the run's command handler); now the replacement
    is a worker that did not start, the Core steps on, and a borrow finds no idle worker."""
    with _spawn(tmp_path / "pool") as pool:
        ok(run_step(pool, 0, 0, batch_of(0)))
        _borrow(pool)
        ok(run_step(pool, 1, 1, batch_of(1)))
        shutil.rmtree(tmp_path / "pool")
        kill_and_wait(next(w.identity.pid for w in pool.workers if w.rank == 1))
        dead = run_step(pool, 2, 1, batch_of(2))
        assert isinstance(dead, PoolFailure) and dead.reason == "dead", dead
        assert pool.admit_replacements(wait_s=5.0) is None
        assert not pool.replacements_starting() and pool.idle_warm_ranks() == ()
        replacement = pool.worker_status(1)
        assert isinstance(replacement, PoolFailure) and replacement.reason == "dead", replacement
        assert "its replacement did not start" in replacement.detail, replacement
        assert "No such file or directory" in replacement.detail, replacement
        assert pool.admit_replacements() is None  # not tried again
        ok(run_step(pool, 3, 2, batch_of(3)))  # the Core alone
