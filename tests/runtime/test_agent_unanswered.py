"""An agent the controller never answers says so once, naming the two usual causes.

A second agent started for a host id another agent already holds (`srun` run twice, a copied
command line) is never answered: the controller's ROUTER hears one connection per routing id,
and the second one's frames never pass. It only logged reconnections ("unheard"), and the run's
error named no such agent. Real controller endpoint, two real agents, real sockets; the wait
before it speaks (`UNANSWERED_S`, 30 s) is shortened.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from ehp_fsm.plan import load_plan
from ehp_fsm.runtime import agent as agent_module
from ehp_fsm.runtime.agent import Agent, AgentConfig
from ehp_fsm.runtime.controller import Controller
from ehp_fsm.runtime.keys import generate_keys, load_server_keys
from ehp_fsm.runtime.transport import ControllerEndpoint
from tests.runtime_system.harness import write_plan

from .agent_rig import agent_rig


def test_a_second_agent_for_a_held_host_id_says_it_is_unanswered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agent_module, "UNANSWERED_S", 1.0)
    with agent_rig(tmp_path / "first") as rig:
        second = Agent(
            AgentConfig(controller=rig.ctl.endpoint, host_id="h1", state_dir=tmp_path / "second")
        )
        try:
            # the controller's reconcile of a hello it took: a command to the first agent
            assert rig.command("report", {}, seconds=0.2) is not None
            with capture_logs() as logs:
                end = time.monotonic() + 3.0
                while time.monotonic() < end:
                    rig.pump(0.02)
                    second.step(0.02)
            told = [e for e in logs if e["event"] == "controller_unanswered"]
            assert len(told) == 1, told  # once, and only by the second agent
            assert told[0]["epoch"] == second.endpoint.epoch != rig.agent.endpoint.epoch
            assert "no other agent runs as host 'h1'" in told[0]["fix"]
            assert rig.ctl.peers()["h1"].epoch == rig.agent.endpoint.epoch  # the first's
            assert rig.command("report", {}, seconds=1.0) is not None  # the first still served
        finally:
            second.close()


@pytest.mark.parametrize("own_keys", [False, True], ids=["no-keys", "keys-of-another-run"])
def test_an_agent_whose_curve_handshake_fails_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, own_keys: bool
) -> None:
    """The run uses CURVE keys; the agent has none (no --keys, as an operator who passed only
    --plan) or keys from another `ehp-fsm keys` run. Every handshake failed, and the agent only
    logged `handshake_failed` at info, then told to check that no other agent runs as its host:
    it names the keys now, and the flag to fix it. Real CURVE controller endpoint and agent."""
    monkeypatch.setattr(agent_module, "UNANSWERED_S", 1.0)
    generate_keys(tmp_path / "run-keys", agents=["h1"])
    generate_keys(tmp_path / "other-keys", agents=["h1"])
    ctl = ControllerEndpoint(
        bind="tcp://127.0.0.1:*", curve=load_server_keys(tmp_path / "run-keys")
    )
    agent = Agent(
        AgentConfig(
            controller=ctl.endpoint,
            host_id="h1",
            state_dir=tmp_path / "agent",
            keys_dir=tmp_path / "other-keys" if own_keys else None,
        )
    )
    try:
        with capture_logs() as logs:
            end = time.monotonic() + 2.5
            while time.monotonic() < end:
                ctl.poll(0.02)
                agent.step(0.02)
        assert "h1" not in ctl.peers()
        told = [e for e in logs if e["event"] == "controller_unanswered"]
        assert len(told) == 1, told
        assert told[0]["handshakes_failed"] >= 1, told
        why = "its key in" if own_keys else "this agent has no CURVE keys (no --keys)"
        assert why in told[0]["why"], told
        assert "start the agent with --keys DIR" in told[0]["fix"], told
    finally:
        agent.close()
        ctl.close()


def test_an_agent_given_the_plan_takes_its_curve_keys(tmp_path: Path) -> None:
    """`ehp-fsm agent --plan PLAN` for a plan with `[transport] curve_keys = DIR` (relative:
    to the plan's folder) and no --keys: the agent reads the plan, and it uses the plan's keys.
    It had none (it read only how engines start): every CURVE handshake failed, and the
    operator had to repeat the plan's folder as --keys by hand. A real `ehp-fsm agent` process
    (started elsewhere than the plan's folder) and a real CURVE controller endpoint."""
    plan_path, endpoint = write_plan(tmp_path)
    plan_path.write_text(plan_path.read_text() + 'curve_keys = "keys"\n')  # ([transport]'s)
    generate_keys(tmp_path / "keys", agents=["h1"])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ctl = ControllerEndpoint(bind=endpoint, curve=load_server_keys(tmp_path / "keys"))
    argv = ["--controller", endpoint, "--host-id", "h1", "--plan", str(plan_path)]
    argv += ["--device", "cpu", "--state-dir", str(tmp_path / "agent")]
    agent = subprocess.Popen(
        [sys.executable, "-m", "ehp_fsm.cli", "agent", *argv, "--orphan-after-s", "none"],
        cwd=elsewhere,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        end = time.monotonic() + 30.0
        while "h1" not in ctl.peers() and agent.poll() is None and time.monotonic() < end:
            ctl.poll(0.05)
        joined = "h1" in ctl.peers()
    finally:
        agent.terminate()
        _, err = agent.communicate(timeout=30)
        ctl.close()
    assert joined, err
    assert agent.returncode == 0, err
    assert f'"keys": "{tmp_path / "keys"}"' in err, err  # its start names the keys it took


def test_an_agent_whose_host_id_the_plan_lacks_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under Slurm an agent's host id is its node's name: `node-09` where the plan has `h1`.
    The controller refuses its hello, but acknowledges its frames, so the agent — whose
    "unanswered" warning only looked for an acknowledgement — logged a handshake that
    succeeded and nothing else, for ever (only the run's error, if the run gave up, named it).
    It says now that the plan lacks its host id. Real controller (its plan's hosts: h1, h2)
    and a real agent, pumped in turn."""
    monkeypatch.setattr(agent_module, "UNANSWERED_S", 1.0)
    plan_path, endpoint = write_plan(tmp_path)
    ctl = Controller.start(load_plan(plan_path), log_path=tmp_path / "t.jsonl")
    agent = Agent(AgentConfig(controller=endpoint, host_id="node-09", state_dir=tmp_path / "a"))
    try:
        with capture_logs() as logs:
            end = time.monotonic() + 2.5
            while time.monotonic() < end:
                ctl.run_until(lambda _c: False, 0.02)
                agent.step(0.02)
        assert any(p == "node-09" and what == "hello" for p, what, _ in ctl.link.refused)
        told = [e for e in logs if e["event"] == "controller_unanswered"]
        assert len(told) == 1, told
        assert "host id 'node-09' is not a [[hosts]] id of the run's plan" in told[0]["why"]
        assert "$SLURMD_NODENAME" in told[0]["fix"], told
    finally:
        agent.close()
        ctl.close()


_SIGNALLED_WHILE_MADE = """
import os, signal, sys
from ehp_fsm.runtime import agent as agent_module
original = agent_module.Agent.__init__
def signalled(self, *args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)  # while the agent is made (it connects here)
    original(self, *args, **kwargs)
agent_module.Agent.__init__ = signalled
sys.exit(agent_module.agent_main(sys.argv[1:]))
"""


def test_a_sigterm_while_the_agent_is_made_stops_it_cleanly(tmp_path: Path) -> None:
    """Making the agent connects it to the controller (on ZeroMQ's own thread), and its stop
    signals were taken only after: a run that saw the agent and stopped it at once killed it
    by the signal's default (exit -15, not a clean 0: a CI run met it in the test above). A
    SIGTERM sent from inside the agent's making now stops it once it is made, cleanly. (No
    controller listens: the far edge here is the run; the agent's connect is asynchronous.)"""
    argv = ["--controller", "tcp://127.0.0.1:9", "--host-id", "h1", "--device", "cpu"]
    argv += ["--state-dir", str(tmp_path / "agent"), "--orphan-after-s", "none"]
    done = subprocess.run(
        [sys.executable, "-c", _SIGNALLED_WHILE_MADE, *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert '"event": "processes_stopped"' in done.stderr, done.stderr[-2000:]
