"""A CPU pool's workers are forked from one starter that has imported torch and transformers
(`training.prefork`): real processes, a real pool, real signals.

What the pool relies on of a `Popen` it must keep: a worker's exit code as soon as it has
exited, signals that reach only that worker, no worker outliving its starter, and the pool's
launch token where `ehp-fsm stop` looks for it. And the plain start (each worker its own
`python -m ehp_fsm.training.worker`, as on CUDA) still works when asked for."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import psutil
import pytest

from ehp_fsm.training.pool import PoolConfig, PoolError, PoolFailure, TrainerPool
from ehp_fsm.training.prefork import StartedWorker
from tests.procs import running_after, wait_exited
from tests.training_pool.rig import batch_of, ok, run_step, tiny_config


def _processes(pool: TrainerPool) -> dict[int, StartedWorker]:
    out = {}
    for w in pool._workers.values():
        assert isinstance(w.process, StartedWorker), w.process
        out[w.rank] = w.process
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_workers_are_forked_from_one_starter_and_their_deaths_are_known_at_once(
    tmp_path: Path,
) -> None:
    with TrainerPool.spawn(tiny_config(max_hybrids=2), work_dir=tmp_path / "pool") as pool:
        assert pool._starter is not None
        starter = pool._starter.process.pid
        procs = _processes(pool)
        assert sorted(procs) == [0, 1, 2]
        for rank, proc in procs.items():
            p = psutil.Process(proc.pid)
            assert p.ppid() == starter  # the starter's children, not this process's
            assert p.name() == f"trainer-{rank}"  # (`ps -o comm`): which rank it is
            # where `ehp-fsm stop` looks for the pool's token: the process's own environment
            assert p.environ()["EHP_LAUNCH_TOKEN"] == pool.launch_token
            assert proc.poll() is None
        ok(run_step(pool, 0, 0, batch_of(0), publish=False))

        # kill -9 of a warm worker: its code is known once it has exited, as Popen's poll
        # knows it (no wait for a liveness round)
        os.kill(procs[2].pid, signal.SIGKILL)
        wait_exited(procs[2].pid)
        assert procs[2].poll() == -signal.SIGKILL
        assert procs[2].wait(0) == -signal.SIGKILL
        procs[2].kill()  # a signal to a reaped worker reaches nobody (its pid may be reused)
        # SIGTERM: the worker's own code ends it (exit 143 through Python's default action)
        procs[1].terminate()
        assert procs[1].wait(10) == -signal.SIGTERM
        # a live one's wait times out as Popen's does
        with pytest.raises(subprocess.TimeoutExpired):
            procs[0].wait(0.05)
        ok(run_step(pool, 1, 0, batch_of(1), publish=False))  # the Core trains on
    assert running_after([p.pid for p in procs.values()] + [starter], 5.0) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_killed_starter_takes_its_workers_with_it_and_the_pool_names_their_deaths(
    tmp_path: Path,
) -> None:
    """No worker outlives its starter (`PR_SET_PDEATHSIG`): a worker whose exit nobody could
    reap or report would be a process the pool cannot account for. The pool names their ends
    and shuts down clean; a new launch gets a new starter."""
    with TrainerPool.spawn(tiny_config(), work_dir=tmp_path / "pool") as pool:
        assert pool._starter is not None
        starter = pool._starter.process
        procs = _processes(pool)
        starter.kill()
        for proc in procs.values():
            wait_exited(proc.pid)
            assert proc.wait(10) == -signal.SIGKILL
        failed = run_step(pool, 0, 0, batch_of(0), publish=False)
        assert isinstance(failed, PoolFailure) and failed.reason == "dead", failed
        assert "was killed by SIGKILL" in failed.detail, failed.detail
        said = f"its worker starter, process {starter.pid}, was killed by SIGKILL"
        assert said in failed.detail, failed.detail
        assert not pool._starter.alive()
    assert pool._starter is None  # closed with the pool
    assert running_after([p.pid for p in procs.values()], 5.0) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_prefork_off_starts_each_worker_as_its_own_process(tmp_path: Path) -> None:
    """The start a CUDA pool uses (a process that touched CUDA cannot fork one that uses it):
    each worker is this process's child, `python -m ehp_fsm.training.worker`."""
    with TrainerPool.spawn(tiny_config(), work_dir=tmp_path / "pool", prefork=False) as pool:
        assert pool._starter is None
        for w in pool._workers.values():
            assert isinstance(w.process, subprocess.Popen), w.process
            argv = psutil.Process(w.process.pid).cmdline()
            assert argv[1:3] == ["-m", "ehp_fsm.training.worker"], argv
            assert psutil.Process(w.process.pid).ppid() == os.getpid()
        ok(run_step(pool, 0, 0, batch_of(0), publish=False))


def test_prefork_is_refused_for_a_cuda_pool(tmp_path: Path) -> None:
    with pytest.raises(PoolError, match="cannot fork a child that uses it"):
        TrainerPool(PoolConfig(device="cuda"), work_dir=tmp_path / "pool", prefork=True)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_pool_whose_starter_is_stuck_before_it_answers_shuts_down_promptly(
    tmp_path: Path,
) -> None:
    """A starter stopped (SIGSTOP) before it answers, its workers' pids never known: the shutdown
    does not wait a worker's whole start deadline (`trainers_start`, 120 s by default) for each,
    nor raise (it did both): past `REPORT_WAIT_S` the starts are given up, said in the workers'
    logs, and the starter, which does not read its closed input, is killed."""
    import time

    from ehp_fsm.training.prefork import REPORT_WAIT_S

    pool = TrainerPool(tiny_config(), work_dir=tmp_path / "pool")
    pool.launch_all()  # returns at once: the starter answers only once its imports are done
    assert pool._starter is not None
    starter = pool._starter.process
    os.kill(starter.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    pool.shutdown(timeout_s=1.0)
    took = time.monotonic() - t0
    assert took < 2 * REPORT_WAIT_S + 5, took
    assert starter.poll() == -signal.SIGKILL
    for w in pool._workers.values():
        assert w.process is not None and w.process.poll() == 1
        said = (tmp_path / "pool" / f"worker-{w.rank}.log").read_text()
        assert "the pool's worker starter did not start it" in said, said


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_stopped_starter_leaves_its_running_workers_alone_and_their_deaths_known(
    tmp_path: Path,
) -> None:
    """SIGSTOP of a running pool's starter: its workers run on (the Core trains), and one that
    dies meanwhile, not reaped while its parent is stopped, is known dead with its code (read
    from its zombie's `/proc/PID/stat`) at once."""
    import time

    with TrainerPool.spawn(tiny_config(), work_dir=tmp_path / "pool") as pool:
        assert pool._starter is not None
        starter = pool._starter.process
        procs = _processes(pool)
        os.kill(starter.pid, signal.SIGSTOP)
        try:
            os.kill(procs[1].pid, signal.SIGKILL)
            wait_exited(procs[1].pid)
            t0 = time.monotonic()
            assert procs[1].poll() == -signal.SIGKILL
            assert time.monotonic() - t0 < 1.0  # not the report's wait
            assert psutil.Process(procs[1].pid).status() == psutil.STATUS_ZOMBIE
            ok(run_step(pool, 0, 0, batch_of(0), publish=False))  # the Core trains on
        finally:
            os.kill(starter.pid, signal.SIGCONT)
    assert running_after([p.pid for p in procs.values()] + [starter.pid], 5.0) == []
