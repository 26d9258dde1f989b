"""Warm lanes on another machine (`PoolConfig.remote_warm`): launched through the pool's
`Launcher` (the run's asks that host's agent), known dead only from the launcher's word
(`report_exit`) — the coordinator cannot see another machine's pids — and replaced through it.
A Core lane on another machine (`PoolConfig.remote_core`) is launched the same way (end to end:
`tests/run/test_external_agents.py`).

Real processes, real Gloo, real ZeroMQ. The far edge is faked, and said so: the launcher here
starts the worker itself with `EHP_MACHINE` set to another machine name (so its identity is not
checkable from the coordinator, as on a real second node) and reports its exit from a watcher
thread, standing in for the agent that does both in a run (`tests/run/test_remote_hybrid.py`).
"""

from __future__ import annotations

import os
import subprocess
import threading
import uuid
from pathlib import Path

import psutil
import pytest

from ehp_fsm.runtime.identity import MACHINE_ENV
from ehp_fsm.runtime.pool_launch import POOL_TOKEN_ENV, ROUTE_ENV
from ehp_fsm.training import verify
from ehp_fsm.training.pool import PoolError, PoolFailure, TrainerPool
from tests.procs import kill_and_wait
from tests.training_pool.rig import batch_of, ok, run_step, tiny_config


class SpawningLauncher:
    """Starts remote warm ranks as local processes on "another machine" (see the module
    docstring) and reports each one's exit to the pool, as an agent's `exited` would."""

    def __init__(self, work_dir: Path) -> None:
        self.work_dir = work_dir
        self.pool: TrainerPool | None = None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.launched: list[tuple[int, bool]] = []
        self.stopped: list[str] = []
        self.reporters: dict[str, threading.Thread] = {}  # ref -> the thread that reports its exit

    def launch(self, rank: int, *, standby: bool, route: str) -> str:
        ref = uuid.uuid4().hex
        self._spawn(rank, standby=standby, ref=ref, route=route)
        return ref

    def _spawn(self, rank: int, *, standby: bool, ref: str, route: str) -> None:
        assert self.pool is not None
        # the launch's secrets, in the environment as an agent gives them
        env = {
            **os.environ,
            MACHINE_ENV: "node-b",
            ROUTE_ENV: route,
            POOL_TOKEN_ENV: self.pool.launch_token,
        }
        with open(self.work_dir / f"remote-{rank}.log", "ab") as out:
            proc = subprocess.Popen(
                self.pool.worker_argv(rank, standby=standby),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        self.procs[ref] = proc
        self.launched.append((rank, standby))
        pool = self.pool
        self.reporters[ref] = threading.Thread(
            target=lambda: pool.report_exit(ref, f"exited with code {proc.wait()}"),
            daemon=True,
        )
        self.reporters[ref].start()

    def stop(self, ref: str) -> None:
        self.stopped.append(ref)
        self.procs[ref].kill()

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                kill_and_wait(p.pid)


def _same_state(pool: TrainerPool, where: Path) -> None:
    """Warm rank 2's whole state equals the Core's, bit for bit."""
    ok(pool.save_state(where / "core"))
    ok(pool.save_state(where / "remote", rank=2))
    report = verify.compare_states(where / "core", where / "remote", exact=True)
    assert report.passed, report.lines()


def test_a_pool_refuses_remote_lanes_without_a_launcher(tmp_path: Path) -> None:
    with pytest.raises(PoolError, match="no launcher"):
        TrainerPool(tiny_config(max_hybrids=0, remote_warm=("h1",)), work_dir=tmp_path)


@pytest.mark.slow
def test_a_remote_warm_lane_trains_dies_and_is_replaced_through_its_launcher(
    tmp_path: Path,
) -> None:
    cfg = tiny_config(max_hybrids=1, remote_warm=("h1",))
    assert cfg.world_size == 3 and cfg.home(1) is None and cfg.home(2) == "h1"
    launcher = SpawningLauncher(tmp_path)
    pool = TrainerPool(cfg, work_dir=tmp_path / "pool", launcher=launcher)
    launcher.pool = pool
    try:
        pool.launch_all()
        assert pool.wait_ready(timeout_s=120) is None
        assert launcher.launched == [(2, False)]  # only the remote rank went through it
        remote = next(w for w in pool.workers if w.rank == 2)
        assert remote.identity.host == "node-b"

        ok(run_step(pool, 0, 0, batch_of(0), publish=False))
        ok(pool.load_state(2, replica="hybrid:x"))
        pool.activate("hybrid:x")
        ok(run_step(pool, 1, 1, batch_of(1), publish=False))
        _same_state(pool, tmp_path / "stepped")  # the remote lane steps with the Core

        # Its agent says it died: the pool cannot check node-b's pid, it takes the word.
        ref = next(iter(launcher.procs))
        kill_and_wait(launcher.procs[ref].pid)
        launcher.reporters[ref].join(10)  # the agent's word came before the step (not a race)
        got = run_step(pool, 2, 1, batch_of(2), publish=False)
        assert isinstance(got, PoolFailure) and got.rank == 2, got
        assert "its agent on h1" in got.detail
        ok(run_step(pool, 2, 2, batch_of(2), publish=False))  # the Core retries alone
        assert launcher.launched[-1] == (2, True)  # replaced on standby, through the launcher
        assert pool.admit_replacements(wait_s=120) is None
        assert 2 in pool.idle_warm_ranks()
        ok(pool.load_state(2, replica="hybrid:y"))
        _same_state(pool, tmp_path / "replaced")  # the replacement holds the Core's state
    finally:
        pool.shutdown(timeout_s=10)
        launcher.kill_all()


class LateLauncher(SpawningLauncher):
    """Starts each remote rank `delay_s` late, as an agent busy starting engines would."""

    def __init__(self, work_dir: Path, delay_s: float) -> None:
        super().__init__(work_dir)
        self.delay_s = delay_s

    def launch(self, rank: int, *, standby: bool, route: str) -> str:
        ref = uuid.uuid4().hex
        threading.Timer(
            self.delay_s, self._spawn, (rank,), {"standby": standby, "ref": ref, "route": route}
        ).start()
        return ref


@pytest.mark.slow
def test_a_remote_rank_that_starts_after_the_collective_timeout_still_joins(
    tmp_path: Path,
) -> None:
    """The world's rendezvous waits for its last member as long as the run waits for the
    workers' hellos (`join_timeout_s`: `[deadlines.run] trainers_start`), not the collective
    time-out: a remote worker starts through its agent, beside the engines' start. Before, the
    Core's rendezvous gave up after `collective_timeout_s` (here 2 s) and the pool failed."""
    cfg = tiny_config(max_hybrids=0, remote_warm=("h1",), collective_timeout_s=2.0)
    launcher = LateLauncher(tmp_path, delay_s=6.0)
    pool = TrainerPool(cfg, work_dir=tmp_path / "pool", launcher=launcher)
    launcher.pool = pool
    try:
        pool.launch_all()
        assert pool.wait_ready(timeout_s=120) is None
        ok(run_step(pool, 0, 0, batch_of(0), publish=False))  # the world works, 2 s time-outs
    finally:
        pool.shutdown(timeout_s=10)
        launcher.kill_all()


class RefusedLauncher:
    """An agent that answers every launch with `launch_failed` at once (the far edge, faked)."""

    def __init__(self) -> None:
        self.pool: TrainerPool | None = None
        self.launched: list[int] = []

    def launch(self, rank: int, *, standby: bool, route: str) -> str:
        ref = uuid.uuid4().hex
        self.launched.append(rank)
        assert self.pool is not None
        self.pool.report_exit(ref, "its launch failed: no slot for it")
        return ref

    def stop(self, ref: str) -> None:
        raise AssertionError("nothing was started")


def test_a_core_rank_of_another_machine_whose_launch_fails_fails_the_start(
    tmp_path: Path,
) -> None:
    """Core rank 1 of another machine (`PoolConfig.remote_core`) is launched through the
    launcher, not by the pool; its failed launch fails the pool's start at once, naming the
    rank and its host, and the pool's own rank 0 is stopped with it."""
    cfg = tiny_config(core_dp=2, max_hybrids=0, remote_core=(None, "h1"))
    with pytest.raises(PoolError, match="no launcher"):
        TrainerPool(cfg, work_dir=tmp_path / "none")
    launcher = RefusedLauncher()
    pool = TrainerPool(cfg, work_dir=tmp_path, launcher=launcher)
    launcher.pool = pool
    try:
        pool.launch_all()
        failed = pool.wait_ready(timeout_s=30)
        assert launcher.launched == [1]  # rank 0 is the pool's child
        assert [p.name for p in tmp_path.glob("worker-*.log")] == ["worker-0.log"]
        assert isinstance(failed, PoolFailure) and failed.rank == 1 and failed.reason == "dead"
        assert "its agent on h1: its launch failed: no slot for it" in str(failed)
    finally:
        pool.shutdown(timeout_s=5)
    ours = [p for p in psutil.Process().children(recursive=True) if str(tmp_path) in _argv(p)]
    assert psutil.wait_procs(ours, timeout=5)[1] == []  # rank 0 stopped with the pool


def _argv(p: psutil.Process) -> str:
    """`p`'s command line, or "" for a process already gone or a zombie (one another test left
    unreaped made this test fail with psutil.ZombieProcess, naming nothing of its own)."""
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""
