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
from typing import Any

import psutil
import pytest

from ehp_fsm.replay import replay
from ehp_fsm.rollout.launch import free_port
from ehp_fsm.runtime.identity import MACHINE_ENV
from tests.run.soundness import assert_run_sound
from tests.run.test_run import assert_no_orphans, leftovers, plan_text

NODES = ("node-01", "node-02", "node-03")
SLOTS = {"node-01": 1, "node-02": 2, "node-03": 1}


def slurm_plan(
    tmp: Path, port: int, steps: int, edit: Callable[[str], str] | None = None
) -> tuple[Path, Path, Path]:
    """The short plan on node names, a fixed controller port and a revisions path of its own;
    `edit`: a change of the plan's text on top."""
    log = tmp / "run" / "transitions.jsonl"
    shared = tmp / "shared" / "revisions"
    text = plan_text(log, steps, engines=3)  # three nodes, as `examples/slurm/`
    for old, new in zip(("h0", "h1", "h2"), NODES, strict=True):
        text = text.replace(f'"{old}"', f'"{new}"').replace(f'"{old}:', f'"{new}:')
    text = text.replace('log = "', f'revisions = "{shared}"\nlog = "', 1)
    # agents started by hand on this machine, on the plain loopback channel (local keys are
    # only for agents the run starts; the keyed flow: `test_..._agents_that_never_come`)
    text = text.replace(
        'controller = "tcp://127.0.0.1:*"',
        f'controller = "tcp://127.0.0.1:{port}"\ncurve = "off"',
    )
    assert f"127.0.0.1:{port}" in text and '"h1"' not in text
    if edit is not None:
        text = edit(text)
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
    slots: int | None = None,
    extra: tuple[str, ...] = (),
) -> subprocess.Popen[str]:
    """`ehp-fsm agent` as the sbatch script's srun starts it: Slurm's environment, the host id
    from $SLURMD_NODENAME, engines started as the plan says (`--plan`). `machine`: the machine
    it and its processes report (`EHP_MACHINE`; default: this machine's host name) — the far
    edge a test on one machine cannot have is a second node, so only the machine's name is
    faked: the run cannot check that agent's processes, as on another node. `extra`: more of
    the agent's options (e.g. `--keys DIR`)."""
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
            str(slots or SLOTS[node]),
            "--state-dir",
            str(tmp / "nodes" / node),
            "--plan",
            str(plan),
            *extra,
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
        ctl_log = run_dir / "controller.log"
        text = ctl_log.read_text() if ctl_log.exists() else ""
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
    steps: int = 8,
    edit: Callable[[str], str] | None = None,
    slots: dict[str, int] | None = None,
    verify: bool = False,
) -> tuple[
    subprocess.CompletedProcess[str], list[subprocess.CompletedProcess[str]], Path, Path, str
]:
    """`ehp-fsm run --agents external` on the Slurm plan of `steps` steps (`edit`: a change of
    its text, `slots`: a node's slots other than `SLOTS`) with one srun-style agent per node
    (`machines`: node -> the host name its agent reports); each agent is stopped with SIGTERM
    once the run has ended, as the batch script does; `during(run_dir, run_id)` runs on a
    thread of its own meanwhile. (run, agents, log, shared, id)."""
    run_id = uuid.uuid4().hex
    port = free_port()
    plan, log, shared = slurm_plan(tmp, port, steps=steps, edit=edit)
    env = {**os.environ, "EHP_TEST_RUN": run_id}
    argv = [sys.executable, "-m", "ehp_fsm.cli", "run", str(plan), "--agents", "external"]
    argv += ["--verify"] if verify else []
    run = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    agents = [
        srun_agent(
            n,
            port,
            tmp,
            run_id,
            i,
            plan,
            machine=(machines or {}).get(n),
            slots=(slots or {}).get(n),
        )
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
    # 12 steps: the planner borrows once its measured train/rollout times say a Hybrid pays,
    # which on a loaded machine came as late as step 8 of 8 — the replacement then had no
    # step left to be launched in
    run, agents, log, shared, run_id = run_with_srun_agents(
        tmp_path,
        steps=12,
        timeout_s=200,
        machines=REMOTE,
        during=lambda run_dir, rid: kill_the_first_hybrid_worker(run_dir, rid, killed),
    )
    out, agent_out = run.stdout, [a.stdout for a in agents]
    assert run.returncode == 0, out
    assert "waiting up to 60 s for the host agents node-01, node-02, node-03" in out
    assert [a.returncode for a in agents] == [0, 0, 0], agent_out
    receipt = json.loads((log.parent / "receipt.json").read_text())
    assert receipt["error"] is None and receipt["last_step"] == 12
    assert receipt["clean_controller"] is True
    assert not (log.parent / "agents").exists(), "the run started no agent of its own"
    assert (shared / "r00000013" / "model.safetensors").is_file()  # the newest of 12 steps
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


def core_lane_on_node_02(text: str) -> str:
    """The Slurm plan with a Core of DP 2: lane 0 on node-01, lane 1 on a third device of
    node-02 (its engines keep theirs), EHP off (only the Core trains: a short test)."""
    core = '[core]\ndp = 1\ngpus = ["node-01:g0"]'
    node = 'id = "node-02"\ngpus = 2'
    assert core in text and node in text and "[ehp]\n" in text
    text = text.replace(core, '[core]\ndp = 2\ngpus = ["node-01:g0", "node-02:g2"]')
    return text.replace(node, 'id = "node-02"\ngpus = 3').replace(
        "[ehp]\n", "[ehp]\nenabled = false\n"
    )


#: Core lane 1's node, node-02, is another machine; its agent has the third slot lane 1 needs.
CORE_ELSEWHERE: dict[str, Any] = {
    "machines": {"node-02": "box-b"},
    "edit": core_lane_on_node_02,
    "slots": {"node-02": 3},
}


def watch_core_rank_1(run_dir: Path, run_id: str, seen: dict[str, Any], *, kill: bool) -> None:
    """Find Core rank 1's worker as soon as the pool's log says its agent launched it (its pid),
    note in `seen` its pid, its command line and its parent's (command line, Slurm node); with
    `kill`, SIGKILL it at the run's first step (the log's first `partition`)."""
    deadline = time.monotonic() + 150
    proc, offset, tail = None, 0, b""
    while time.monotonic() < deadline:
        if proc is None:
            ops = run_dir / "controller.log"
            for line in ops.read_text().splitlines() if ops.exists() else ():
                if '"remote_worker_launched"' not in line or not line.endswith("}"):
                    continue  # (a line still being written ends later)
                if (event := json.loads(line))["rank"] == 1:
                    proc = psutil.Process(event["pid"])
                    parent = proc.parent()
                    assert parent is not None and proc.environ()["EHP_TEST_RUN"] == run_id
                    seen.update(
                        pid=proc.pid,
                        argv=proc.cmdline(),
                        parent_argv=parent.cmdline(),
                        parent_node=parent.environ().get("SLURMD_NODENAME"),
                    )
                    if not kill:
                        return
        if proc is not None and (log := run_dir / "transitions.jsonl").exists():
            with log.open("rb") as fh:
                fh.seek(offset)
                new = fh.read()
            offset += len(new)
            if b'"event":"partition"' in tail + new:  # the first step's
                proc.kill()
                return
            tail = new[-32:]
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_core_lane_on_another_machine_is_launched_by_its_agent_and_verifies(
    tmp_path: Path,
) -> None:
    """Core DP rank 1 is on node-02, whose agent runs on another machine: that agent launches
    the rank (its child, its log), the run launches rank 0 only, and the run trains to its
    end with `--verify` passing."""
    seen: dict[str, Any] = {}
    run, agents, log, shared, run_id = run_with_srun_agents(
        tmp_path,
        timeout_s=150,
        steps=2,
        verify=True,
        during=lambda run_dir, rid: watch_core_rank_1(run_dir, rid, seen, kill=False),
        **CORE_ELSEWHERE,
    )
    out = run.stdout
    assert run.returncode == 0, out
    assert "launched by their hosts' agents on other machines: core:1 on node-02 (box-b)" in out
    assert [a.returncode for a in agents] == [0, 0, 0], [a.stdout for a in agents]
    receipt = json.loads((log.parent / "receipt.json").read_text())
    assert receipt["error"] is None and receipt["last_step"] == 2
    assert receipt["verify"]["passed"] is True and receipt["clean_controller"] is True
    assert (shared / "r00000003" / "model.safetensors").is_file()
    # rank 0 is the run's; rank 1 was launched by node-02's agent, as its child
    assert [p.name for p in (log.parent / "trainers").glob("worker-*.log")] == ["worker-0.log"]
    events = [json.loads(x) for x in (log.parent / "controller.log").read_text().splitlines()]
    launch = [e for e in events if e["event"] == "remote_worker_launch"]
    assert [(e["host"], e["rank"], e["role"]) for e in launch] == [("node-02", 1, "core")]
    launched = [e for e in events if e["event"] == "remote_worker_launched"]
    assert [(e["host"], e["rank"]) for e in launched] == [("node-02", 1)]
    assert seen.get("pid") == launched[0]["pid"], seen
    assert seen["argv"][seen["argv"].index("--rank") + 1] == "1", seen
    assert "agent" in seen["parent_argv"] and seen["parent_node"] == "node-02", seen
    assert list((tmp_path / "nodes" / "node-02" / "logs").glob("pool-r1-*.log"))
    assert_run_sound(log, run_id=run_id)
    assert_no_orphans(run_id)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_dead_core_lane_on_another_machine_ends_the_run_cleanly(tmp_path: Path) -> None:
    """Core rank 1, launched by node-02's agent on another machine, is killed in the first
    step: its agent's word ends the run as a local Core rank's death does — exit 2 naming the
    rank and its host, every process stopped, every GPU handed back."""
    seen: dict[str, Any] = {}
    run, agents, log, _, run_id = run_with_srun_agents(
        tmp_path,
        timeout_s=150,
        steps=3,
        during=lambda run_dir, rid: watch_core_rank_1(run_dir, rid, seen, kill=True),
        **CORE_ELSEWHERE,
    )
    out = run.stdout
    assert "pid" in seen, out
    assert run.returncode == 2, out
    assert "rank 1 (core:1)" in out and "its agent on node-02" in out, out
    assert "exited (code -9)" in out and "ehp-fsm run PLAN --resume" in out, out
    assert [a.returncode for a in agents] == [0, 0, 0], [a.stdout for a in agents]
    receipt = assert_run_sound(log, run_id=run_id, error=True)
    assert "its agent on node-02" in receipt["error"] and receipt["last_step"] < 3
    assert receipt["clean_controller"] is True and receipt["left_running"] == []
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
