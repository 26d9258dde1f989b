"""Commands at the agent (real agent, real controller endpoint, real sockets, real processes):
a malformed one gets a refusal naming what was wrong and the agent goes on serving (an
exception that escaped a command used to end the agent's loop, and its shutdown stopped every
process on the host); a process adopted for a stop holds every GPU of the host until it is
gone; a stop for a process that does not carry the identity's launch token, or for another
host's process, signals nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ehp_fsm.runtime.agent_processes import launch_token_of
from ehp_fsm.runtime.deliveries import Replied
from ehp_fsm.runtime.identity import capture
from ehp_fsm.runtime.transport import TransportConfig

from .agent_rig import agent_rig


@pytest.mark.timeout(60)
def test_a_malformed_command_is_refused_and_the_agent_goes_on(tmp_path: Path) -> None:
    with agent_rig(tmp_path) as rig:
        # raised out of the agent's loop before the fix
        bad = rig.command("stop_process", {"identity": "not-a-map"}, seconds=1.0)
        assert bad is not None and bad.ok is False
        assert bad.result["reason"] == "bad_args"
        assert "AttributeError" in bad.result["detail"]
        good = rig.command("report", {}, seconds=1.0)
        assert good is not None and good.ok is True  # still serving


@pytest.mark.timeout(60)
def test_a_gpu_is_not_confirmed_free_while_an_adopted_process_may_still_run_on_it(
    tmp_path: Path,
) -> None:
    # A process the agent never launched (its state file lost, say) is stopped by identity;
    # which GPU it runs on is unknown to the agent, so no GPU of the host is free until it is
    # gone. It ignores SIGTERM: it is gone only when the grace runs out and it is killed.
    ignores_term = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('ready', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", ignores_term],
        stdout=subprocess.PIPE,
        env={**os.environ, "EHP_LAUNCH_TOKEN": "tok-e0"},  # as every launch of ours carries
    )
    try:
        with agent_rig(tmp_path, stop_grace_s=2.0) as rig:
            assert proc.stdout is not None
            assert proc.stdout.readline() == b"ready\n"  # its SIGTERM handler is in place
            mine = capture(proc.pid, launch_token="tok-e0")
            ident = {
                "host": "h1",
                "pid": mine.pid,
                "start_time": mine.start_time,
                "token": "tok-e0",
            }
            rig.pump(0.5)
            args = {"machine": "rollout_engine", "instance": "e0", "identity": ident}
            rig.command("stop_process", args, seconds=0.3)
            rig.command("confirm_gpu_free", {"gpu": "h1:g0", "owner": "engine:e0"}, seconds=1.0)
            assert rig.freed() == [] and proc.poll() is None  # it still runs: not free
            rig.pump(4.0)
            assert rig.freed() and proc.poll() is not None  # killed after the grace, then freed
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.timeout(60)
def test_a_stop_signals_nothing_without_the_launch_token_or_on_the_wrong_host(
    tmp_path: Path,
) -> None:
    # pid and start time match (the process is the one captured), but it was not launched with
    # the identity's token: some other process the controller never launched. Before the check
    # the agent adopted and SIGTERMed it on pid + start time alone.
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)"],
            env={**os.environ, **env},
        )
        for env in ({}, {"EHP_LAUNCH_TOKEN": "someone-else"}, {"EHP_LAUNCH_TOKEN": "tok-e0"})
    ]
    try:
        with agent_rig(tmp_path) as rig:

            def stop(proc: subprocess.Popen[bytes], host: str) -> Replied:
                me = capture(proc.pid, launch_token="tok-e0")
                ident = {
                    "host": host,
                    "pid": me.pid,
                    "start_time": me.start_time,
                    "token": "tok-e0",
                }
                reply = rig.command("stop_process", {"identity": ident})
                assert reply is not None
                return reply

            no_token, other_token, ours = procs
            for proc in (no_token, other_token):
                reply = stop(proc, "h1")
                assert reply.ok is False and reply.result["reason"] == "not_same_process"
                assert "launch token" in reply.result["detail"]
            wrong_host = stop(ours, "h2")
            assert wrong_host.ok is False and wrong_host.result["reason"] == "wrong_host"
            rig.pump(0.5)
            assert all(p.poll() is None for p in procs)  # nothing was signalled
            assert stop(ours, "h1").ok is True
            assert ours.wait(timeout=10) == -15
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def _adopted_sleeper(state_dir: Path) -> subprocess.Popen[bytes]:
    """A process the agent adopts at start from its state file (as a restarted agent does), so
    it has one process under the controller's lease."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={**os.environ, "EHP_LAUNCH_TOKEN": "tok-e0"},
    )
    # Popen returns once the exec closed its error pipe, a moment before the kernel sets the
    # new image's environment: /proc/PID/environ read then is empty, and the agent refused to
    # adopt it ("token_mismatch", once in CI). An agent adopts processes a previous agent
    # launched long before; here the child is a few microseconds old.
    end = time.monotonic() + 10
    while launch_token_of(proc.pid) != "tok-e0":
        assert time.monotonic() < end, "the child's environment never showed its token"
        time.sleep(0.01)
    mine = capture(proc.pid, launch_token="tok-e0")
    state_dir.mkdir(parents=True, exist_ok=True)
    entry = {
        "pid": mine.pid,
        "start_time": mine.start_time,
        "token": "tok-e0",
        "machine": "rollout_engine",
        "instance": "e0",
        "role": "rollout_engine",
        "gpus": ["h1:g0"],
        "url": None,
    }
    (state_dir / "processes.json").write_text(json.dumps([entry]))
    return proc


@pytest.mark.timeout(60)
def test_a_busy_controller_keeps_its_lease_a_gone_one_loses_it(tmp_path: Path) -> None:
    """The orphan lease (`--orphan-after-s`) stopped an agent's engines whenever the controller
    was silent that long — also while it was only busy: a training step blocks the run's loop,
    and a step longer than the lease (300 s by default) would have stopped every engine
    mid-run. Now the lease runs only once the connection dropped (the controller's process
    closed it here; a frozen or unreachable one times out the ZMTP heartbeat)."""
    proc = _adopted_sleeper(tmp_path / "state")
    transport = TransportConfig(heartbeat_interval_s=0.2, missed_heartbeats=2)
    try:
        with agent_rig(tmp_path / "state", orphan_after_s=1.0, transport=transport) as rig:
            assert list(rig.agent.processes.managed) == ["tok-e0"]
            end = time.monotonic() + 3.0  # the controller busy: it does not poll, for 3 leases
            while time.monotonic() < end:
                rig.agent.step(0.05)
            assert rig.agent.endpoint.peers()["controller"].status.value == "silent"
            assert proc.poll() is None and "tok-e0" in rig.agent.processes.managed  # kept
            rig.ctl.close()  # the controller is gone: its connection drops
            end = time.monotonic() + 15.0
            while proc.poll() is None and time.monotonic() < end:
                rig.agent.step(0.05)
            assert proc.poll() is not None  # the lease ran out: stopped
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.timeout(60)
def test_an_agent_s_own_stall_does_not_count_toward_its_lease(tmp_path: Path) -> None:
    """An agent stopped (SIGSTOP, a paused VM) for longer than its lease stopped its engines at
    its resume although its controller was only unheard because it was not listening: now its
    own stall (`Stalled`) is not counted, and the lease runs from when it listens again. The
    controller is gone here (closed: the connection drops), so the lease does run out then."""
    proc = _adopted_sleeper(tmp_path / "state")
    transport = TransportConfig(heartbeat_interval_s=0.2, missed_heartbeats=2)
    lease = 2.0
    try:
        with agent_rig(tmp_path / "state", orphan_after_s=lease, transport=transport) as rig:
            assert list(rig.agent.processes.managed) == ["tok-e0"]
            rig.agent.step(0.05)
            assert "controller" in rig.agent.endpoint.peers()
            rig.ctl.close()  # its connection drops
            time.sleep(2 * lease)  # the agent stalls: it polls nothing, for two leases
            resumed = time.monotonic()
            while time.monotonic() < resumed + lease / 2:
                rig.agent.step(0.05)
            assert rig.agent.endpoint.connection_dropped
            assert proc.poll() is None and "tok-e0" in rig.agent.processes.managed  # kept
            end = time.monotonic() + 15.0
            while proc.poll() is None and time.monotonic() < end:
                rig.agent.step(0.05)
            assert proc.poll() is not None  # a lease of listening later: stopped
            assert time.monotonic() - resumed >= lease
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
