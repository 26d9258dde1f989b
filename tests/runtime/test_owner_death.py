"""An agent started with `--parent-pid` stops, and stops its processes, when its owner dies —
even by SIGKILL (the run that spawned it cannot clean up then).

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
