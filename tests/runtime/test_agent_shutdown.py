"""An agent asked to stop (SIGTERM) is gone, with every process it started, well within the
grace whoever stops it gives it (`ehp-fsm stop`: 10 s) — its controller gone, one of its engines
deaf to SIGTERM, another launch still starting.

Real processes and sockets: the agent is `ehp-fsm agent` in a subprocess; its controller is a
real endpoint in the test, which launches two real embedded engines through it and then closes
(the controller is gone, as when the run was killed with SIGKILL). The one far edge made here:
engines that do not end on SIGTERM (hung in a driver call, a wedged GPU teardown) are made by
SIGSTOP — the kernel keeps a stopped process from running any code, its SIGTERM handler
included, until SIGKILL ends it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import psutil
import pytest

from ehp_fsm.rollout.launch import free_port
from ehp_fsm.runtime.agent_processes import KILL_WAIT_S, SHUTDOWN_BOUND_S, launch_token_of
from ehp_fsm.runtime.deliveries import Received
from ehp_fsm.runtime.identity import new_launch_token
from ehp_fsm.runtime.protocol import Kind
from ehp_fsm.runtime.transport import ControllerEndpoint

from .agent_rig import agent_rig, engine_launch_args

#: What the agent may take from SIGTERM to gone, its engines with it: its own bound plus room
#: for its interpreter to exit on a loaded 2-core machine; well under `ehp-fsm stop`'s 10 s
#: (the agent took 10.1 s before its shutdown was bounded).
BOUND_S = SHUTDOWN_BOUND_S + 2.0


def _events(ctl: ControllerEndpoint, seconds: float) -> list[tuple[str, dict[str, Any]]]:
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for item in ctl.poll(0.02):
            if isinstance(item, Received) and item.frame.kind is Kind.EVENT:
                out.append((item.frame.payload["name"], item.frame.payload["data"]))
    return out


def _launch(ctl: ControllerEndpoint, instance: str, gpu: str) -> str:
    token = new_launch_token()
    args = {
        "machine": "rollout_engine",
        "instance": instance,
        "role": "rollout_engine",
        "gpus": [gpu],
        "token": token,
    }
    ctl.send_command("h1", "launch", args)
    return token


def _carrying(agent: psutil.Process, token: str) -> psutil.Process | None:
    for p in agent.children(recursive=True):
        if launch_token_of(p.pid) == token:
            return p
    return None


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_stopped_agent_ends_its_hung_engines_and_exits_well_within_stops_grace(
    tmp_path: Path,
) -> None:
    ctl = ControllerEndpoint(bind="tcp://127.0.0.1:*")
    log = tmp_path / "agent.log"
    argv = [sys.executable, "-m", "ehp_fsm.cli", "agent", "--controller", ctl.endpoint]
    argv += ["--host-id", "h1", "--device", "cpu", "--slots", "2"]
    argv += ["--state-dir", str(tmp_path / "agent")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with log.open("wb") as fh:
        agent = subprocess.Popen(argv, stderr=fh, stdout=fh, env=env)
    engines: list[psutil.Process] = []
    try:
        end = time.monotonic() + 60
        while "h1" not in ctl.peers():
            assert time.monotonic() < end and agent.poll() is None, log.read_text()[-2000:]
            ctl.poll(0.05)
        # where does it wait? every thread's stack, in its log: its loop (`run`), and it goes
        # on. Heard by the controller, the agent may still be on its way into the loop (under
        # load, one dump showed it there): asked again until a dump shows the loop.
        end = time.monotonic() + 20
        while " in run\n" not in log.read_text(errors="replace"):
            assert time.monotonic() < end and agent.poll() is None, log.read_text()[-2000:]
            agent.send_signal(signal.SIGUSR1)
            for _ in range(10):
                ctl.poll(0.05)
        # e0 serves; e1 is still starting (its process runs, it has not answered yet)
        _launch(ctl, "e0", "h1:g0")
        end = time.monotonic() + 90
        healthy = None
        while healthy is None:
            assert time.monotonic() < end, log.read_text()[-2000:]
            healthy = next((d for n, d in _events(ctl, 0.1) if n == "healthy"), None)
        engines.append(psutil.Process(healthy["identity"]["pid"]))
        token = _launch(ctl, "e1", "h1:g1")
        me = psutil.Process(agent.pid)
        end = time.monotonic() + 30
        while (starting := _carrying(me, token)) is None:
            assert time.monotonic() < end, log.read_text()[-2000:]
            _events(ctl, 0.01)
        engines.append(starting)
        for p in engines:
            p.send_signal(signal.SIGSTOP)  # neither ends on SIGTERM now
        ctl.close()  # the controller is gone

        asked = time.monotonic()
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=60)
        agent_took = time.monotonic() - asked
        while not all(_gone(p) for p in engines) and time.monotonic() < asked + 60:
            time.sleep(0.02)
        all_took = time.monotonic() - asked

        assert agent.returncode == 0, log.read_text()[-2000:]
        assert agent_took <= BOUND_S, (agent_took, log.read_text()[-2000:])
        assert all_took <= BOUND_S, (all_took, [p.pid for p in engines if not _gone(p)])
        assert '"processes_stopped"' in log.read_text(), log.read_text()[-2000:]
    finally:
        for p in engines:
            if not _gone(p):
                p.kill()
        if agent.poll() is None:
            agent.kill()
            agent.wait(10)
        ctl.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_launch_still_starting_is_not_waited_for_past_the_grace(tmp_path: Path) -> None:
    """The agent's stop does not wait on a launch's thread (it waits for its engine's answer,
    and stops a cancelled engine with a grace of its own): the engine of a launch still
    starting is found by its launch token and killed with the rest at the grace."""
    with agent_rig(tmp_path) as rig:
        token = new_launch_token()
        args = engine_launch_args(token)
        rig.command("launch", args, seconds=0.0)
        me = psutil.Process()
        end = time.monotonic() + 30
        while (starting := _carrying(me, token)) is None:
            assert time.monotonic() < end, "the engine never started"
            rig.pump(0.01)
        try:
            starting.send_signal(signal.SIGSTOP)  # it never answers, nor ends on SIGTERM
            began = time.monotonic()
            rig.agent.processes.stop_all(grace_s=0.5)
            took = time.monotonic() - began
            assert _gone(starting), starting
            # the launch thread's own stop of a cancelled engine gives it 2 s: not waited for
            # (waited for, it took 2 s more; 1.5 s of slack for a loaded machine)
            assert took < 0.5 + KILL_WAIT_S + 1.5, took
        finally:
            if not _gone(starting):
                starting.kill()


def _burst(pid: int, seconds: float) -> None:
    """SIGTERMs to `pid` as fast as they go for `seconds` (a child not waited for yet: its pid
    names it until then, exited or not)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(100):
            os.kill(pid, signal.SIGTERM)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_agent_given_a_burst_of_sigterms_stops(tmp_path: Path) -> None:
    """When a run dies, its agents get the parent-death SIGTERM once per thread of the run
    that held them (several, microseconds apart), and `stop`'s after: the handler runs again
    inside itself. It took a lock then, and 8 agents in 10 hung until SIGKILL. Three real agents
    (their controller nobody: they need none to stop), each sent SIGTERMs for 0.2 s."""
    agents = []
    for i in range(3):
        log = tmp_path / f"agent{i}.log"
        argv = [sys.executable, "-m", "ehp_fsm.cli", "agent", "--host-id", f"h{i}"]
        argv += ["--controller", f"tcp://127.0.0.1:{free_port()}", "--device", "cpu"]
        argv += ["--state-dir", str(tmp_path / f"agent{i}")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        with log.open("wb") as fh:
            agents.append((subprocess.Popen(argv, stderr=fh, stdout=fh, env=env), log))
    try:
        for agent, log in agents:
            end = time.monotonic() + 60
            while not (log.exists() and "agent_started" in log.read_text()):
                assert time.monotonic() < end and agent.poll() is None, log.read_text()
                time.sleep(0.05)
        for agent, log in agents:
            _burst(agent.pid, 0.2)
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.wait(BOUND_S)
            assert agent.returncode is not None, f"hung: {log.read_text()[-1500:]}"
            # it stopped its processes (a SIGTERM that comes once the interpreter is exiting,
            # its handlers reset, ends it with -15: nothing is left to stop by then)
            assert '"processes_stopped"' in log.read_text(), log.read_text()[-1500:]
    finally:
        for agent, _ in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait(10)


def test_request_stop_can_be_reentered_at_any_instant(tmp_path: Path) -> None:
    """The handler's re-entry, at the worst instants and every time: a profile hook calls
    `request_stop` again at each call it makes, as a SIGTERM handled at that instant would.
    With a lock taken there (a `threading.Event`), the inner call blocked for good."""
    with agent_rig(tmp_path) as rig:
        agent = rig.agent
        code = type(agent).request_stop.__code__
        reentered = []

        def inside(frame: FrameType | None) -> bool:
            while frame is not None:
                if frame.f_code is code:
                    return True
                frame = frame.f_back
            return False

        def hook(frame: FrameType, event: str, _arg: object) -> None:
            if event in ("call", "c_call") and len(reentered) < 8 and inside(frame):
                reentered.append(event)
                agent.request_stop()  # runs unprofiled: the hook is off inside itself

        def handler() -> None:
            sys.setprofile(hook)
            try:
                agent.request_stop()
            finally:
                sys.setprofile(None)

        t = threading.Thread(target=handler, daemon=True)  # a hung call must not hang pytest
        t.start()
        t.join(5.0)
        assert not t.is_alive(), "request_stop blocked inside itself"
        assert reentered and agent.stop_requested


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_agent_whose_terminal_hangs_up_stops_its_processes_and_exits_0(
    tmp_path: Path,
) -> None:
    """`ehp-fsm agent` started by hand, its terminal closed: SIGHUP. Its default ended the
    agent at once (killed by signal 1), its processes unstopped by it; now it stops as on
    SIGTERM. A real agent (its controller nobody: it needs none to stop)."""
    log = tmp_path / "agent.log"
    argv = [sys.executable, "-m", "ehp_fsm.cli", "agent", "--host-id", "h1", "--device", "cpu"]
    argv += ["--controller", f"tcp://127.0.0.1:{free_port()}"]
    argv += ["--state-dir", str(tmp_path / "agent")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with log.open("wb") as fh:
        agent = subprocess.Popen(argv, stderr=fh, stdout=fh, env=env)
    try:
        end = time.monotonic() + 60
        while not (log.exists() and "agent_started" in log.read_text()):
            assert time.monotonic() < end and agent.poll() is None, log.read_text()
            time.sleep(0.05)
        agent.send_signal(signal.SIGHUP)
        assert agent.wait(BOUND_S) == 0, log.read_text()[-1500:]
        assert '"processes_stopped"' in log.read_text(), log.read_text()[-1500:]
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(10)


def _agent_on_a_full_disk(tmp_path: Path, state: Path, *, fill_state: bool) -> None:
    """A real agent whose log is on a full disk (`/dev/full`: every write fails with ENOSPC;
    under `ehp-fsm run` its log is `agents/<host>.log` in the run directory) launches an
    engine; with `fill_state` (its log a plain file) its state dir (`processes.json`) is made
    full instead, once the engine serves (a full tmpfs mounted over it: the agent died saving
    it as the engine's exit was collected, and again in its shutdown). The engine is killed:
    the agent reports its exit and serves on; SIGTERM then stops it, exit 0. On a 150 KB
    tmpfs under a real run's `agents/`, two agents died mid-run: their GPUs were quarantined,
    their engines and the Hybrid failed, and the run ended "did not end cleanly" (exit 1)
    naming the hosts but not the full disk."""
    ctl = ControllerEndpoint(bind="tcp://127.0.0.1:*")
    argv = [sys.executable, "-m", "ehp_fsm.cli", "agent", "--controller", ctl.endpoint]
    argv += ["--host-id", "h1", "--device", "cpu", "--slots", "2", "--state-dir", str(state)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    log = tmp_path / "agent.log" if fill_state else Path("/dev/full")
    with open(log, "wb") as fh:
        agent = subprocess.Popen(argv, stderr=fh, stdout=fh, env=env)
    mounted = False
    try:
        end = time.monotonic() + 60
        while "h1" not in ctl.peers():
            assert time.monotonic() < end and agent.poll() is None, agent.returncode
            ctl.poll(0.05)
        _launch(ctl, "e0", "h1:g0")
        end = time.monotonic() + 90
        healthy = None
        while healthy is None:
            assert time.monotonic() < end and agent.poll() is None, agent.returncode
            healthy = next((d for n, d in _events(ctl, 0.1) if n == "healthy"), None)
        if fill_state:
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(state)], check=True
            )
            mounted = True
            with contextlib.suppress(OSError), open(state / "filler", "wb") as fh:
                while True:
                    fh.write(b"\0" * 1024)
                    fh.flush()
        os.kill(healthy["identity"]["pid"], signal.SIGKILL)
        end = time.monotonic() + 30
        while not any(n == "exited" for n, _ in _events(ctl, 0.1)):
            assert time.monotonic() < end and agent.poll() is None, agent.returncode
        _events(ctl, 1.0)  # (it died here, once it had reported the exit)
        assert agent.poll() is None, f"the agent died: exit {agent.returncode}"
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=BOUND_S) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(10)
        ctl.close()
        if mounted:
            subprocess.run(["umount", str(state)], check=True)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (a full device)")
def test_an_agent_whose_log_is_on_a_full_disk_serves_on(tmp_path: Path) -> None:
    _agent_on_a_full_disk(tmp_path, tmp_path / "agent", fill_state=False)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (a full device)")
def test_an_agent_whose_state_dir_fills_serves_on(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounts a tmpfs over the agent's state dir: needs root")
    _agent_on_a_full_disk(tmp_path, tmp_path / "agent", fill_state=True)
