"""An operator's `--agents external` mistakes, with agents started as srun starts them."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from ehp_fsm.rollout.launch import free_port
from ehp_fsm.runtime.keys import generate_keys
from tests.run.test_external_agents import slurm_plan, srun_agent
from tests.run.test_run import assert_no_orphans


def _run_with_agents(
    plan: Path, run_id: str, agents: Callable[[], list[subprocess.Popen[str]]]
) -> tuple[int, str]:
    """`ehp-fsm run PLAN --agents external` with the agents `agents` starts: its exit code and
    output; the agents are stopped after it ends."""
    env = {**os.environ, "EHP_TEST_RUN": run_id}
    argv = [sys.executable, "-m", "ehp_fsm.cli", "run", str(plan), "--agents", "external"]
    run = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    started = agents()
    try:
        out, _ = run.communicate(timeout=90)
    finally:
        for a in started:
            a.send_signal(signal.SIGTERM)
        for a in started:
            a.communicate(timeout=30)
    return run.returncode, out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_agent_whose_host_id_is_not_in_the_plan_is_named_by_the_run(tmp_path: Path) -> None:
    """The third node's agent takes a node name the plan does not have (its [[hosts]] id is
    `node-03`, its $SLURMD_NODENAME `node-09`): its hello is refused. The run said only that
    node-03 "did not connect" and to see the agents' output, which showed a handshake that
    succeeded; it names the agent it refused now, and the id to start it with."""
    run_id = uuid.uuid4().hex
    port = free_port()

    def short_wait(text: str) -> str:
        return text + "\n[deadlines.run]\nagents_connect = 10\n"

    plan, log, _ = slurm_plan(tmp_path, port, steps=2, edit=short_wait)
    code, out = _run_with_agents(
        plan,
        run_id,
        lambda: [
            srun_agent(node, port, tmp_path, run_id, i, plan, slots=1)
            for i, node in enumerate(("node-01", "node-02", "node-09"))
        ],
    )
    assert code == 2, out
    assert "the host agents ['node-03'] did not connect within 10 s" in out, out
    assert "agents of hosts the plan does not have connected and were refused: ['node-09']" in out
    assert "start each agent with a [[hosts]] id of the plan" in out, out
    assert "$SLURMD_NODENAME" in out, out
    assert not (log.parent / "agents").exists(), "the run started no agent of its own"
    assert_no_orphans(run_id)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_agent_speaking_with_another_hosts_key_is_named_with_the_key(tmp_path: Path) -> None:
    """node-03's agent started with node-02's key (`--key-name node-02`): the controller drops
    its frames (the key is not bound to node-03), and the run said "no hello came from them:
    an agent not started ..., or whose CURVE handshake failed" though it knew why (a user's
    find). It names the host, the key's problem and what to start it with."""
    run_id = uuid.uuid4().hex
    port = free_port()
    keys = tmp_path / "keys"
    generate_keys(keys, agents=["node-01", "node-02", "node-03"])

    def keyed_short_wait(text: str) -> str:
        text = text.replace(
            f'controller = "tcp://127.0.0.1:{port}"\ncurve = "off"',
            f'controller = "tcp://127.0.0.1:{port}"\ncurve_keys = "{keys}"',
        )
        return text + "\n[deadlines.run]\nagents_connect = 10\n"

    plan, _, _ = slurm_plan(tmp_path, port, steps=2, edit=keyed_short_wait)
    code, out = _run_with_agents(
        plan,
        run_id,
        lambda: [
            srun_agent(
                node,
                port,
                tmp_path,
                run_id,
                i,
                plan,
                extra=("--keys", str(keys), *(("--key-name", "node-02") if i == 2 else ())),
            )
            for i, node in enumerate(("node-01", "node-02", "node-03"))
        ],
    )
    assert code == 2, out
    assert "the host agents ['node-03'] did not connect within 10 s" in out, out
    assert "the controller dropped what came from node-03: " in out, out
    assert "no hello came from them" not in out, out
    assert "start each agent with its own host's key" in out, out
    assert_no_orphans(run_id)


@pytest.mark.slow  # a run's start: ~6 s
@pytest.mark.timeout(120)
def test_an_agent_that_never_comes_is_named_with_what_to_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No agent of node-03 ever comes (srun never started it, or it cannot reach the head
    node): the run waits out [deadlines.run] agents_connect and said only "because see each
    node's agent output (the srun step's log)", with no fix. It says why an agent is not heard
    and the command to start on the missing node, with the plan's keys. (No agent at all: the
    wait is the same whichever hosts are missing.)"""
    from ehp_fsm.plan import load_plan
    from ehp_fsm.run import job as job_module

    monkeypatch.setenv("EHP_TEST_RUN", uuid.uuid4().hex)
    port = free_port()
    keys = tmp_path / "keys"

    def keyed_short_wait(text: str) -> str:
        text = text.replace(
            f'controller = "tcp://127.0.0.1:{port}"',
            f'controller = "tcp://127.0.0.1:{port}"\ncurve_keys = "{keys}"',
        )
        return text + "\n[deadlines.run]\nagents_connect = 1\n"

    generate_keys(keys, agents=["node-01", "node-02", "node-03"])
    plan, log, _ = slurm_plan(tmp_path, port, steps=1, edit=keyed_short_wait)
    with pytest.raises(job_module.RunError) as raised:
        job_module.run(load_plan(plan), out=io.StringIO(), agents="external")
    text = str(raised.value)
    assert "the host agents ['node-01', 'node-02', 'node-03'] did not connect within 1 s" in text
    assert "because see" not in text, text
    assert "no hello came from them" in text, text
    assert (
        f"Fix: start `ehp-fsm agent --controller tcp://127.0.0.1:{port} --plan PLAN "
        f"--keys {keys}` on each of those nodes" in text
    ), text
    assert "$SLURMD_NODENAME" in text and "agents_connect" in text, text
    assert (
        "no hello came from them" in json.loads((log.parent / "receipt.json").read_text())["error"]
    )


def test_a_dead_external_agents_leftovers_are_not_said_to_be_gone(tmp_path: Path) -> None:
    """node-03's agent (started by srun) is killed mid-run: the run ends its steps and exits
    1, its agent having confirmed nothing. It said "nothing the run recorded is left running;
    check the GPUs of node-03 by hand" while that agent's engine ran on (ppid 1): the run
    records no process an external agent launched. It says what may be left and how to stop
    it. (The receipt as such a run writes it; `job.run` passes `external`.)"""
    from ehp_fsm.run.ending import unclean_end

    receipt = {"unconfirmed_hosts": ["node-03"], "stopped_at_end": [], "left_running": []}
    said = unclean_end("short", tmp_path / "run", receipt, external=True)
    assert "nothing the run recorded is left running" not in said, said
    assert "what the agent of node-03 launched may still run there" in said, said
    assert "restart that agent with the same --state-dir" in said, said
    assert "`ehp-fsm run PLAN --resume`" in said and "check the GPUs of node-03" in said, said
    local = unclean_end("short", tmp_path / "run", receipt)  # its own agents: it stopped theirs
    assert "nothing the run recorded is left running; check the GPUs of node-03" in local
