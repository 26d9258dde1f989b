"""`ehp-fsm run PLAN --agents external`: the run starts no agents and waits for the ones the
cluster starts, as `examples/slurm/ehp-fsm.sbatch` does with srun.

The agents are separate processes started the way srun starts them: no `--host-id` on their
command line (each takes its node's name from `$SLURMD_NODENAME`), Slurm's job and task
variables in their environment, and their own lifetime (the batch script stops them with
SIGTERM after the controller ends). The far edge this test cannot have is Slurm itself: the
"nodes" are host ids on this machine. The plan's host ids are node names, and the revisions live
on the plan's `run.revisions` path (on a cluster, a shared file system).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from ehp_fsm.replay import replay
from ehp_fsm.rollout.launch import free_port
from ehp_fsm.runtime.identity import MACHINE_ENV
from tests.run.soundness import assert_run_sound
from tests.run.test_run import assert_no_orphans, leftovers, plan_text

NODES = ("node-01", "node-02", "node-03")
SLOTS = {"node-01": 1, "node-02": 2, "node-03": 1}


def slurm_plan(tmp: Path, port: int, steps: int) -> tuple[Path, Path, Path]:
    """The short plan on node names, a fixed controller port and a revisions path of its own."""
    log = tmp / "run" / "transitions.jsonl"
    shared = tmp / "shared" / "revisions"
    text = plan_text(log, steps)
    for old, new in zip(("h0", "h1", "h2"), NODES, strict=True):
        text = text.replace(f'"{old}"', f'"{new}"').replace(f'"{old}:', f'"{new}:')
    text = text.replace('log = "', f'revisions = "{shared}"\nlog = "', 1)
    text = text.replace(
        'controller = "tcp://127.0.0.1:*"', f'controller = "tcp://127.0.0.1:{port}"'
    )
    assert f"127.0.0.1:{port}" in text and '"h1"' not in text
    plan = tmp / "plan.toml"
    plan.write_text(text)
    return plan, log, shared


def srun_agent(
    node: str,
    port: int,
    tmp: Path,
    run_id: str,
    procid: int,
    plan: Path,
    *,
    machine: str | None = None,
) -> subprocess.Popen[str]:
    """`ehp-fsm agent` as the sbatch script's srun starts it: Slurm's environment, the host id
    from $SLURMD_NODENAME, engines started as the plan says (`--plan`). `machine`: the machine
    it and its processes report (`EHP_MACHINE`; default: this machine's host name) — the far
    edge a test on one machine cannot have is a second node, so only the machine's name is
    faked: the run cannot check that agent's processes, as on another node."""
    env = {
        **os.environ,
        "EHP_TEST_RUN": run_id,
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "1",
        "SLURM_PROCID": str(procid),
        "SLURM_NTASKS": str(len(NODES)),
        "SLURM_NODEID": str(procid),
        "SLURMD_NODENAME": node,
        "SLURM_JOB_NODELIST": "node-[01-03]",
        **({MACHINE_ENV: machine} if machine is not None else {}),
    }
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ehp_fsm.cli",
            "agent",
            "--controller",
            f"tcp://127.0.0.1:{port}",
            "--device",
            "cpu",
            "--slots",
            str(SLOTS[node]),
            "--state-dir",
            str(tmp / "nodes" / node),
            "--plan",
            str(plan),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def kill_the_first_hybrid_worker(run_dir: Path, run_id: str, killed: list[int]) -> None:
    """Once the run's first Hybrid is loaded, SIGKILL its warm worker — a process of its node's
    agent, on "another machine" — and note its rank in `killed`."""
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        text = (run_dir / "controller.log").read_text() if run_dir.exists() else ""
        loads = [x for x in text.splitlines() if '"hybrid_loaded"' in x]
        if loads:
            rank = json.loads(loads[0])["rank"]
            for p in leftovers(run_id):
                with contextlib.suppress(psutil.Error, ValueError, IndexError):
                    argv = p.cmdline()
                    if "ehp_fsm.training.worker" in argv and argv[argv.index("--rank") + 1] == str(
                        rank
                    ):
                        p.kill()
                        killed.append(rank)
                        return
        time.sleep(0.05)


def run_with_srun_agents(
    tmp: Path,
    *,
    timeout_s: float,
    machines: dict[str, str] | None = None,
    during: Callable[[Path, str], None] | None = None,
) -> tuple[
    subprocess.CompletedProcess[str], list[subprocess.CompletedProcess[str]], Path, Path, str
]:
    """`ehp-fsm run --agents external` on the 8-step Slurm plan with one srun-style agent per
    node (`machines`: node -> the host name its agent reports); each agent is stopped with
    SIGTERM once the run has ended, as the batch script does; `during(run_dir, run_id)` runs on
    a thread of its own meanwhile. (run, agents, log, shared, id)."""
    run_id = uuid.uuid4().hex
    port = free_port()
    plan, log, shared = slurm_plan(tmp, port, steps=8)
    env = {**os.environ, "EHP_TEST_RUN": run_id}
    argv = [sys.executable, "-m", "ehp_fsm.cli", "run", str(plan), "--agents", "external"]
    run = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    agents = [
        srun_agent(n, port, tmp, run_id, i, plan, machine=(machines or {}).get(n))
        for i, n in enumerate(NODES)
    ]
    meanwhile = None
    if during is not None:
        meanwhile = threading.Thread(target=during, args=(log.parent, run_id), daemon=True)
        meanwhile.start()
    try:
        out, _ = run.communicate(timeout=timeout_s)
        if meanwhile is not None:
            meanwhile.join(10)
    finally:
        for a in agents:  # what the batch script does once the controller has ended
            a.send_signal(signal.SIGTERM)
        agent_outs = [a.communicate(timeout=30)[0] for a in agents]
    done = subprocess.CompletedProcess(argv, run.returncode, out)
    agent_done = [
        subprocess.CompletedProcess(a.args, a.returncode, o)
        for a, o in zip(agents, agent_outs, strict=True)
    ]
    return done, agent_done, log, shared, run_id


#: The lending nodes' agents run on machines of their own: every Hybrid trains there.
REMOTE = {"node-02": "box-b", "node-03": "box-c"}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_run_with_external_agents_trains_borrows_and_returns(tmp_path: Path) -> None:
    """The lending nodes are other machines: their warm Hybrid workers are launched there by
    their agents (none by the run), a Hybrid borrowed on one trains there with the Core. Its
    worker is killed once loaded: its agent's word reaches the pool, the run goes on, and the
    agent launches the replacement. The run ends with nothing of them left."""
    killed: list[int] = []
    run, agents, log, shared, run_id = run_with_srun_agents(
        tmp_path,
        timeout_s=200,
        machines=REMOTE,
        during=lambda run_dir, rid: kill_the_first_hybrid_worker(run_dir, rid, killed),
    )
    out, agent_out = run.stdout, [a.stdout for a in agents]
    assert run.returncode == 0, out
    assert "waiting up to 60 s for the host agents node-01, node-02, node-03" in out
    assert [a.returncode for a in agents] == [0, 0, 0], agent_out
    receipt = json.loads((log.parent / "receipt.json").read_text())
    assert receipt["error"] is None and receipt["last_step"] == 8
    assert receipt["clean_controller"] is True
    assert not (log.parent / "agents").exists(), "the run started no agent of its own"
    assert (shared / "r00000009" / "model.safetensors").is_file()  # the newest of 8 steps
    assert not (log.parent / "revisions").exists(), "revisions go to run.revisions only"
    engine_logs = [p.read_text() for p in (tmp_path / "nodes").glob("*/logs/*.log")]
    started = [line for text in engine_logs for line in text.splitlines() if "engine pid=" in line]
    # The engines were launched while the trainers started, before revision 1 existed: each
    # started from the plan's model directory (the agents read it from the plan), an engine
    # started later from the agent's links to the newest revision, removed once it answered.
    model = re.search(r'path = "([^"]+)"', (tmp_path / "plan.toml").read_text())
    assert model is not None
    assert len(started) >= 3, started
    assert all(
        line.endswith(f"from {model[1]}") or f"from {shared}/.launch-" in line for line in started
    ), started
    assert sum(line.endswith(f"from {model[1]}") for line in started) >= 3, started
    assert not list(shared.glob(".launch-*"))
    records = [json.loads(x) for x in log.read_text().splitlines()[1:]]
    hosts = {r["payload"].get("host") for r in records if r["machine"] == "rollout_engine"}
    assert {"node-02", "node-03"} <= hosts
    assert any(r["machine"] == "hybrid_replica" and r["dest"] == "active" for r in records)
    assert replay(log).transitions == len(records)  # it raises on any break
    assert_run_sound(log, run_id=run_id)  # the fault matrix's checks
    # The Core's rank is the run's; every warm worker was its lending node's agent's.
    assert [p.name for p in (log.parent / "trainers").glob("worker-*.log")] == ["worker-0.log"]
    events = [json.loads(x) for x in (log.parent / "controller.log").read_text().splitlines()]
    launched = {e["host"]: e["rank"] for e in events if e["event"] == "remote_worker_launched"}
    assert launched == {"node-02": 1, "node-03": 2}, launched
    for node, rank in launched.items():  # its log is its agent's
        assert list((tmp_path / "nodes" / node / "logs").glob(f"pool-r{rank}-*.log")), node
    loaded = [e["rank"] for e in events if e["event"] == "hybrid_loaded"]
    assert loaded and set(loaded) <= {1, 2}, loaded  # every Hybrid trained on its node
    # The killed worker: its agent said so, and the same agent started its replacement.
    assert len(killed) == 1, "the first Hybrid's worker was never killed"
    host = next(h for h, r in launched.items() if r == killed[0])
    exits = [e for e in events if e["event"] == "remote_worker_exited" and e["rank"] == killed[0]]
    assert exits and exits[0]["returncode"] == -9, exits
    again = [e for e in events if e["event"] == "remote_worker_launch" and e["rank"] == killed[0]]
    assert [e["standby"] for e in again] == [False, True] and again[1]["host"] == host, again
    assert_no_orphans(run_id)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_core_host_on_another_machine_is_refused_before_training(tmp_path: Path) -> None:
    """node-01 holds the Core's device, and the run starts the Core's ranks on its own machine;
    node-01's agent runs on another one. The run refuses before training, names host and
    machines and where to start the run, and leaves nothing running."""
    run, agents, log, _, run_id = run_with_srun_agents(
        tmp_path, timeout_s=150, machines={"node-01": "other-box"}
    )
    out, agent_out = run.stdout, [a.stdout for a in agents]
    assert run.returncode == 2, out  # an EhpError: what was wrong and what to do
    assert "the run cannot train where the plan says" in out, out
    assert "host 'node-01' (it holds Core devices) has its agent on machine 'other-box'" in out
    assert "start `ehp-fsm run` on 'other-box'" in out, out
    assert "node-02" not in out.split("cannot train where")[1].split("Fix:")[0], out
    assert [a.returncode for a in agents] == [0, 0, 0], agent_out
    receipt = json.loads((log.parent / "receipt.json").read_text())
    assert receipt["last_step"] == 0 and "cannot train where" in receipt["error"]
    records = [json.loads(x) for x in log.read_text().splitlines()[1:]]
    assert not any(r["machine"] == "rollout_engine" and r["dest"] == "serving" for r in records)
    assert_no_orphans(run_id)


def test_external_agents_need_a_fixed_controller_port(tmp_path: Path) -> None:
    from ehp_fsm.plan import load_plan
    from ehp_fsm.run.job import RunError, run

    (tmp_path / "plan.toml").write_text(plan_text(tmp_path / "run" / "t.jsonl", 2))
    with pytest.raises(RunError, match="no fixed port"):
        run(load_plan(tmp_path / "plan.toml"), agents="external")


def test_an_agent_outside_slurm_without_a_host_id_is_refused() -> None:
    env = {k: v for k, v in os.environ.items() if k != "SLURMD_NODENAME"}
    proc = subprocess.run(
        [sys.executable, "-m", "ehp_fsm.cli", "agent", "--controller", "tcp://127.0.0.1:1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--host-id is required (outside Slurm" in proc.stderr
