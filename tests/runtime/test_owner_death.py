"""An agent started with `--parent-pid` stops, and stops its processes, when its owner dies —
even by SIGKILL (the run that spawned it cannot clean up then); so does a trainer worker whose
coordinator dies while it starts.

Real processes: an owner process spawns the agent (pointed at a controller endpoint nobody
answers: the agent does not need one to run), the test kills the owner with SIGKILL and polls
until the agent is gone."""

from __future__ import annotations

import json
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


BUSY = """
import json, subprocess, sys, threading, time
from ehp_fsm.training.pool_protocol import parse_parent
from ehp_fsm.training.worker import _exit_with_parent
follower = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(follower.pid, flush=True)
started, ended = threading.Event(), threading.Event()
_exit_with_parent(
    parse_parent(sys.argv[1]), "w0", started=started, ended=ended, followers=lambda: [follower]
)
started.set()
time.sleep(120)  # the command it is in the middle of: a step, a state load, a collective
"""


@pytest.mark.timeout(60)
def test_a_trainer_worker_in_the_middle_of_a_command_stops_when_its_coordinator_dies(
    tmp_path: Path,
) -> None:
    """A worker looked for its coordinator only between commands (after a second with none):
    a rank in the middle of a long one — a step, a state load, a collective whose peers died
    with the run — outlived a killed run for as long as that command took, and so did its
    lane's followers. The worker's watch thread (here with the main thread in a two-minute
    call standing in for the command) ends it and its followers within a poll."""
    from ehp_fsm.training.pool_protocol import parent_argument

    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    log = tmp_path / "worker.log"
    try:
        parent = json.dumps(parent_argument(capture(owner.pid, launch_token="owner")))
        with log.open("wb") as err:
            worker = subprocess.Popen(
                [sys.executable, "-c", BUSY, parent], stdout=subprocess.PIPE, stderr=err
            )
        assert worker.stdout is not None
        follower = psutil.Process(int(worker.stdout.readline()))
        try:
            time.sleep(1.5)  # three polls: its coordinator is alive, it stays
            assert worker.poll() is None, log.read_text()
            owner.kill()
            owner.wait(10)
            killed = time.monotonic()
            code = worker.wait(20)
            took = time.monotonic() - killed
            assert code == 4 and took < 3.0, (code, took, log.read_text())
            assert "w0: coordinator is gone in the middle of a command" in log.read_text()
            follower.wait(10)  # terminated by it, not left to its own two minutes
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait(10)
            worker.stdout.close()
            if follower.is_running():
                follower.kill()
    finally:
        owner.kill()
        owner.wait(10)
