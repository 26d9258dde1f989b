"""An agent started with `--parent-pid` stops, and stops its processes, when its owner dies —
even by SIGKILL (the run that spawned it cannot clean up then); so does a trainer worker whose
coordinator dies while it starts.

Real processes: an owner process spawns the agent (pointed at a controller endpoint nobody
answers: the agent does not need one to run), the test kills the owner with SIGKILL and polls
until the agent is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ehp_fsm.rollout.launch import free_port
from ehp_fsm.runtime.identity import capture
from ehp_fsm.training.pool import PoolConfig, TrainerPool
from ehp_fsm.training.pool_protocol import worker_argv

OWNER = """
import os, subprocess, sys
agent = subprocess.Popen(
    [sys.executable, "-m", "ehp_fsm.cli", "agent", "--controller", sys.argv[1],
     "--host-id", "h1", "--device", "cpu", "--state-dir", sys.argv[2],
     "--parent-pid", str(os.getpid())],
    stderr=open(sys.argv[3], "wb"),
)
print(agent.pid, flush=True)
agent.wait()
"""


def wait_for(pred: object, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not pred():  # type: ignore[operator]
        assert time.monotonic() < end, what
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_an_agent_stops_when_its_owner_is_killed(tmp_path: Path) -> None:
    log = tmp_path / "agent.log"
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, f"tcp://127.0.0.1:{free_port()}", str(tmp_path), str(log)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert owner.stdout is not None
    agent = psutil.Process(int(owner.stdout.readline()))
    try:
        wait_for(lambda: log.exists() and "agent_started" in log.read_text(), 60, "no start")
        assert agent.is_running() and agent.status() != psutil.STATUS_ZOMBIE
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)

        def gone() -> bool:
            return not agent.is_running() or agent.status() == psutil.STATUS_ZOMBIE

        wait_for(gone, 30, f"the agent outlived its owner: {log.read_text()[-800:]}")
    finally:
        if agent.is_running():
            agent.kill()
        owner.kill()
        owner.wait(10)
        owner.stdout.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_trainer_worker_stops_when_its_coordinator_dies_while_it_starts(tmp_path: Path) -> None:
    """kill -9 of the run while its trainer workers start: rank 0 waits in the world's
    rendezvous for rank 1 (never started here; in a run, a rank still importing torch). It
    exits within a poll of its coordinator's death; it waited out the join's deadline (60 s
    here; ~10 s after a kill -9 of `ehp-fsm run` at its start, not yet in its `run.json`)."""
    pool = TrainerPool.bind(
        PoolConfig(core_dp=1, max_hybrids=1, join_timeout_s=60.0), work_dir=tmp_path / "pool"
    )
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    log = tmp_path / "worker.log"
    try:
        argv = worker_argv(
            pool.config,
            rank=0,
            control=pool.control,
            rendezvous=pool.rendezvous,
            parent=capture(owner.pid, launch_token="owner"),
        )
        with log.open("wb") as out:
            worker = subprocess.Popen(
                argv, env=pool.worker_env(0), stdout=out, stderr=subprocess.STDOUT
            )
        try:
            store = Path(pool.rendezvous.removeprefix("file://"))
            wait_for(store.exists, 60, f"rank 0 never reached the rendezvous: {log.read_text()}")
            time.sleep(0.5)  # inside init_process_group, waiting for rank 1
            assert worker.poll() is None, log.read_text()
            owner.kill()
            owner.wait(10)
            killed = time.monotonic()
            code = worker.wait(40)
            took = time.monotonic() - killed
            assert took < 10.0 and code == 4, (took, code, log.read_text()[-800:])
            assert "coordinator is gone while starting" in log.read_text()
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait(10)
    finally:
        owner.kill()
        owner.wait(10)
        pool.shutdown(timeout_s=5.0)
