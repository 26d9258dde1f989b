"""The agent's state file: a launch is written ahead, so a kill -9 between fork and recording the
process leaves no orphan (the next incarnation finds the process by its launch token)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ehp_fsm.runtime.agent import Agent, AgentConfig, AgentError
from ehp_fsm.runtime.identity import new_launch_token
from ehp_fsm.runtime.workers import LaunchSpec
from tests.procs import still_running


def _agent(state_dir: Path) -> Agent:
    # Nothing listens there: a DEALER connects lazily; only the state file matters here.
    config = AgentConfig(controller="tcp://127.0.0.1:9", host_id="h1", state_dir=state_dir)
    return Agent(config)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_an_interrupted_launch_is_killed_by_the_next_incarnation(tmp_path: Path) -> None:
    token = new_launch_token()
    spec = LaunchSpec(
        role="rollout_engine",
        machine="rollout_engine",
        instance="e9",
        host_id="h1",
        gpus=("h1:g0",),
        token=token,
        device="cpu",
    )
    first = _agent(tmp_path)
    first.processes._intend(spec)  # the write-ahead record, as `launch` writes it before Popen
    entries = json.loads(first.processes.state_path.read_text())
    assert entries == [
        {
            "launching": True,
            "token": token,
            "machine": "rollout_engine",
            "instance": "e9",
            "role": "rollout_engine",
            "gpus": ["h1:g0"],
        }
    ]
    # The process that fork+exec produced before the agent died (never recorded as managed).
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], env={**os.environ, **spec.env()}
    )
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        first.close()  # kill -9: nothing else runs
        second = _agent(tmp_path)
        try:
            assert proc.wait(10) == -9
            assert stranger.poll() is None, "a process without the token was touched"
            assert token not in second.managed
            assert json.loads(second.processes.state_path.read_text()) == []
        finally:
            second.close()
    finally:
        for p in (proc, stranger):
            if p.poll() is None:
                p.kill()
            p.wait(5)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_recorded_process_is_adopted_and_its_write_ahead_entry_cleared(tmp_path: Path) -> None:
    """The normal path: Popen, record (`_adopt_launched`), the write-ahead entry is gone."""
    from ehp_fsm.runtime.workers import WorkerRegistry

    config = AgentConfig(controller="tcp://127.0.0.1:9", host_id="h1", state_dir=tmp_path)
    agent = Agent(config, workers=WorkerRegistry.from_names(["rollout_engine"]))
    try:
        ok, _ = agent.processes.launch(
            {"machine": "rollout_engine", "instance": "e1", "gpus": ["h1:g0"], "token": "t-1"}
        )
        assert ok
        entries = json.loads(agent.processes.state_path.read_text())
        assert [e.get("token") for e in entries] == ["t-1"]
        assert "launching" not in entries[0]
        pid = entries[0]["pid"]
        assert psutil.pid_exists(pid)
    finally:
        agent.processes.stop_all(grace_s=2.0)
        agent.close()
    deadline = time.monotonic() + 10
    while still_running([pid]):
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_second_agent_on_a_held_state_dir_is_refused(tmp_path: Path) -> None:
    """An srun step started twice on a node gives two agents of one host the same --state-dir
    (`$TMPDIR/ehp-agent-$SLURM_JOB_ID`). The second read the first's processes.json, adopted
    its engines, was never answered (one agent per host id) and after --orphan-after-s stopped
    them mid-run; at exit the two tore processes.json.tmp (a FileExistsError traceback). It is
    refused at start now, naming the holder; once the first has closed, an agent may start
    there again (a restart adopts what the first left)."""
    first = _agent(tmp_path)
    second: Agent | None = None
    try:
        with pytest.raises(AgentError) as refused:
            second = _agent(tmp_path)
        said = str(refused.value)
        assert (
            f"--state-dir {tmp_path} is in use by another agent (host h1, pid {os.getpid()}" in said
        )
        assert "give each agent its own --state-dir" in said, said
    finally:
        first.close()
        if second is not None:
            second.close()
    again = _agent(tmp_path)
    again.close()


def test_an_agents_state_dir_and_logs_are_its_users_alone(tmp_path: Path) -> None:
    """The agent's `logs/` holds the output of every engine it launches (SGLang logs its
    `--api-key` at start, and the engines' key outlives the run) and of its trainer workers.
    It was 0755 with 0644 files (the umask): any user of the node read them. A state directory
    the agent makes is 0700, its `logs/` too — one an older agent left 0755 included; a state
    directory another user owns (the default, /tmp/ehp-agent-<host>, is one path for every
    user) is refused, naming it and what to do."""
    old = os.umask(0o022)
    try:
        fresh = tmp_path / "fresh" / "state"
        _agent(fresh).close()
        older = tmp_path / "older"
        (older / "logs").mkdir(parents=True)
        os.chmod(older, 0o700)
        _agent(older).close()
    finally:
        os.umask(old)
    for folder in (fresh, fresh / "logs", older / "logs"):
        assert folder.stat().st_mode & 0o777 == 0o700, (folder, oct(folder.stat().st_mode))
    if os.geteuid() != 0:  # (only root can give a folder to another user)
        return
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    with pytest.raises(AgentError) as refused:
        _agent(theirs)
    said = str(refused.value)
    assert f"--state-dir {theirs} belongs to another user (uid 65534)" in said, said
    assert "give the agent a --state-dir of your own" in said, said
    assert not (theirs / "logs").exists()


def test_a_state_dir_already_there_is_narrowed_and_a_sticky_one_refused(tmp_path: Path) -> None:
    """README: an agent's `--state-dir` is made 0700. One already there — an older agent's,
    made 0755 under the umask — stayed 0755: any user of the node could open its 0644
    `agent.lock` read-only, hold its `flock`, and the agent refused to start ("in use by
    another agent"). Now it is narrowed; a sticky folder every user writes in (as /tmp) is
    refused, not narrowed."""
    older = tmp_path / "older"
    older.mkdir()
    os.chmod(older, 0o755)  # noqa: S103 - what an older agent left, on purpose
    (older / "agent.lock").write_text("host h1, pid 1, on elsewhere\n")
    _agent(older).close()
    assert older.stat().st_mode & 0o777 == 0o700, oct(older.stat().st_mode)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # noqa: S103 - a shared folder, as /tmp
    with pytest.raises(AgentError) as refused:
        _agent(shared)
    said = str(refused.value)
    assert f"--state-dir {shared} is a folder every user writes in" in said, said
    assert shared.stat().st_mode & 0o7777 == 0o1777
    assert not (shared / "logs").exists()
