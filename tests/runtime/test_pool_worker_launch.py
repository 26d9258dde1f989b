"""A host's agent launches a rank of the run's trainer pool on its host: the worker says hello
to the real pool, the run hears `launched` (and, once the worker is killed, `exited`) through
the controller, and a worker never outlives its agent.

Everything real: a controller, an agent process (`python -m ehp_fsm.runtime.agent`), a pool
bound on loopback (`TrainerPool.bind`, the toy policy of `PoolConfig()`), its Core rank 0
started by the test, rank 1 by the agent, one Gloo world."""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path

import psutil
import pytest

from ehp_fsm.plan import load_plan
from ehp_fsm.runtime.controller import Controller
from ehp_fsm.runtime.identity import new_launch_token
from ehp_fsm.runtime.pool_launch import TrainerLaunch
from ehp_fsm.runtime.pool_workers import PoolWorkerEvent
from ehp_fsm.training.pool import PoolConfig, PoolFailure, TrainerPool
from tests.procs import kill_and_wait, running_after
from tests.runtime_system.harness import AgentProc, cleanup, new_run_id, write_plan


def heard(events: list[PoolWorkerEvent], kind: str, token: str) -> PoolWorkerEvent | None:
    return next((e for e in events if e.kind == kind and e.token == token), None)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_an_agent_launches_a_pool_worker_that_lives_and_dies_with_it(tmp_path: Path) -> None:
    plan_path, endpoint = write_plan(tmp_path)
    run_id = new_run_id()
    ctl = Controller.start(load_plan(plan_path), log_path=tmp_path / "t.jsonl")
    agent = AgentProc(host="h1", endpoint=endpoint, tmp=tmp_path, run_id=run_id)
    pool = TrainerPool.bind(PoolConfig(core_dp=1, max_hybrids=1), work_dir=tmp_path / "pool")
    events: list[PoolWorkerEvent] = []
    ctl.on_pool_worker(events.append)
    with (
        cleanup(run_id, [agent], [ctl]),
        (tmp_path / "core.log").open("wb") as core_log,
        subprocess.Popen(
            pool.worker_argv(0), env=pool.worker_env(0), stdout=core_log, stderr=subprocess.STDOUT
        ) as core,
    ):
        try:
            first = new_launch_token()
            ctl.launch_pool_worker("h1", TrainerLaunch.for_pool(pool, 1), first)
            ready: list[PoolFailure | None] = []
            waiting = threading.Thread(target=lambda: ready.append(pool.wait_ready(timeout_s=120)))
            waiting.start()
            assert ctl.run_until(
                lambda c: bool(ready) and heard(events, "launched", first) is not None, 130
            ), (ready, events, agent.tail())
            waiting.join()
            assert ready == [None], ready  # rank 1's hello reached the pool

            launched = heard(events, "launched", first)
            assert launched is not None and launched.identity is not None
            worker = launched.identity["pid"]
            hello = {w.rank: w.identity for w in pool.workers}[1]
            assert hello.pid == worker and hello.launch_token == pool.launch_token
            proc = psutil.Process(worker)
            assert proc.ppid() == agent.pid  # the agent's child, not the run's
            argv = proc.cmdline()
            assert argv[1:3] == ["-m", "ehp_fsm.training.worker"]
            assert json.loads(argv[argv.index("--parent") + 1])["pid"] == agent.pid
            assert proc.environ()["EHP_LAUNCH_TOKEN"] == first  # the agent's launch token
            log = agent.state_dir / "logs" / f"pool-r1-{first[:8]}.log"
            assert log.is_file()  # its output, beside the agent's other launches'

            kill_and_wait(worker)
            assert ctl.run_until(lambda c: heard(events, "exited", first) is not None, 30)
            exited = heard(events, "exited", first)
            assert exited is not None and exited.returncode == -9 and not exited.stopped
            assert exited.identity == launched.identity and exited.rank == 1

            # a replacement on standby (says hello, joins the world when admitted): its agent
            # is killed, so nobody would stop it — it exits by itself
            standby = TrainerLaunch.for_pool(pool, 1, standby=True)
            second = new_launch_token()
            ctl.launch_pool_worker("h1", standby, second)
            assert ctl.run_until(lambda c: heard(events, "launched", second) is not None, 60)
            again = heard(events, "launched", second)
            assert again is not None and again.identity is not None
            agent.kill9()
            assert running_after([again.identity["pid"]], 15) == [], "it outlived its agent"
            assert ctl.world.of("hybrid_replica") == {}  # no machine heard of any of it
        finally:
            pool.shutdown(timeout_s=5.0)
            core.kill()
