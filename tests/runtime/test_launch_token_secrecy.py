"""Launch tokens are secrets: `ehp-fsm stop` signals an agent, engine or trainer worker only when
it carries its recorded token (`EHP_LAUNCH_TOKEN`, `run.owned`). Security review: the tokens were
in files others could read (`run.json`, `processes.json`, the transition log, the logs, all made
with the default mode: 0644 under the usual umask) and on command lines (a trainer worker's
`--launch-token` and `--parent`; `/proc/PID/cmdline` is readable by every user), so anyone who
could read one run's files and write another run folder could forge that folder with the first
run's pids, start times and tokens, and `stop` would signal the first run's processes.

Now every file that holds a token is created mode 0600 (`fspaths.PRIVATE`), one of the user's
own left readable by an older run is narrowed before anything is written, another user's is
refused, and a token reaches a child in its environment alone. Real files, real processes (an
agent and the stand-in it launches); the whole run is checked in `tests/run/test_run.py`."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import structlog

from ehp_fsm.errors import EhpError
from ehp_fsm.run.owned import write_run_state
from ehp_fsm.run.startup import log_beside
from ehp_fsm.runtime.agent_processes import STATE_FILE, launch_token_of
from ehp_fsm.runtime.identity import capture, hide_launch_tokens, new_launch_token
from ehp_fsm.translog import TransitionLog

from .agent_rig import agent_rig


@pytest.fixture
def usual_umask() -> Iterator[None]:
    """The umask most users have (0022: files others can read unless made otherwise)."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def holding(root: Path, token: str) -> dict[str, int]:
    """Every file under `root` whose bytes hold `token`, with its mode."""
    return {
        str(f.relative_to(root)): mode(f)
        for f in sorted(root.rglob("*"))
        if f.is_file() and token.encode() in f.read_bytes()
    }


@pytest.mark.usefixtures("usual_umask")
def test_the_run_state_the_transition_log_and_the_controller_log_are_made_private(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    me = capture(os.getpid(), launch_token=new_launch_token())
    write_run_state(run_dir, plan="short", run=me, agents={"h0": me}, trainers={0: me})
    assert me.launch_token in (run_dir / "run.json").read_text()
    log = TransitionLog.create(run_dir / "transitions.jsonl", config={}, specs={}, key=None)
    log.close()
    # an older run's controller log, left readable by others: narrowed before a line is added
    (run_dir / "controller.log").write_text("an older run's line\n")
    os.chmod(run_dir / "controller.log", 0o644)
    fh = log_beside(run_dir)
    try:
        structlog.get_logger().info("pool_worker_launch", token=me.launch_token)
    finally:
        fh.close()
        structlog.reset_defaults()
    assert (run_dir / "controller.log").read_text().startswith("an older run's line\n")
    modes = {p.name: mode(p) for p in run_dir.iterdir()}
    assert modes == {"run.json": 0o600, "transitions.jsonl": 0o600, "controller.log": 0o600}


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can plant a file of another user")
def test_a_file_of_another_user_where_the_run_writes_tokens_is_refused(tmp_path: Path) -> None:
    """A run folder others can write: another user plants `controller.log` or the transition
    log, writable by all, and would read every token the run appends. Refused, untouched."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name in ("controller.log", "transitions.jsonl"):
        planted = run_dir / name
        planted.write_text("planted\n")
        os.chown(planted, 65534, 65534)
        os.chmod(planted, 0o666)  # noqa: S103 - what the other user does, on purpose
    with pytest.raises(EhpError, match="belongs to another user"):
        log_beside(run_dir)
    with pytest.raises(EhpError, match="belongs to another user"):
        TransitionLog.create(run_dir / "transitions.jsonl", config={}, specs={}, key=None)
    for name in ("controller.log", "transitions.jsonl"):
        assert (run_dir / name).read_text() == "planted\n"
        assert mode(run_dir / name) == 0o666


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.usefixtures("usual_umask")
def test_an_agents_launch_carries_its_token_in_its_environment_and_in_private_files_alone(
    tmp_path: Path,
) -> None:
    """A real agent launches a real process (the Hybrid stand-in). Before: its `processes.json`
    (every launch's pid, start time and token) was 0644, and the stand-in printed its token to
    its log (0644)."""
    state = tmp_path / "agent"
    token = new_launch_token()
    with agent_rig(state) as rig:
        try:
            args = {"machine": "hybrid_replica", "instance": "x0", "gpus": [], "token": token}
            reply = rig.command("launch", {**args, "role": "hybrid_replica"})
            assert reply is not None and reply.ok, reply
            end = time.monotonic() + 30
            while time.monotonic() < end and not (
                token in rig.agent.managed
                and b"ready" in b"".join(p.read_bytes() for p in (state / "logs").glob("*.log"))
            ):
                rig.pump(0.05)
            pid = rig.agent.managed[token].identity.pid
            assert launch_token_of(pid) == token  # what `stop` checks: in its environment
            assert token not in " ".join(psutil.Process(pid).cmdline())
            assert holding(state, token) == {STATE_FILE: 0o600}
        finally:
            if (m := rig.agent.managed.get(token)) is not None and m.popen is not None:
                m.popen.kill()
                m.popen.wait(10)


def test_an_agents_log_lines_name_a_launch_by_its_tokens_first_characters_alone() -> None:
    """The agent logs every event it sends — an engine's identity, launch token and all — on
    stderr, which `srun` writes to an output file others may read; the run's `controller.log`
    is shared in bug reports. A token there is cut to the 8 characters its launch's log file
    is named with."""
    engine, pool = new_launch_token(), new_launch_token()
    record = {
        "event": "event_sent",
        "name": "healthy",
        "identity": {"host": "h1", "pid": 7, "start_time": 1.0, "token": engine},
        "trainer": {"rank": 1, "pool_token": pool},
        "entries": [{"launch_token": engine}],
        "token": engine,
    }
    shown = hide_launch_tokens(None, "info", dict(record))
    assert engine not in str(shown) and pool not in str(shown), shown
    hint = engine[:8] + "…"
    assert shown["identity"] == {"host": "h1", "pid": 7, "start_time": 1.0, "token": hint}
    assert shown["trainer"] == {"rank": 1, "pool_token": pool[:8] + "…"}
    assert shown["token"] == hint and shown["name"] == "healthy"
