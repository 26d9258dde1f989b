"""Two agents, real sockets, real embedded engines: a borrow and a return end to end.

Agent h1 runs engine e0 and agent h2 runs engine e1 (both real `ehp_fsm.rollout.server`
processes started through `rollout.launch`). The borrow drains e0, stops it through its identity
on agent h1, waits for h1's finalizer, launches the Hybrid stand-in on the freed slot; the return
makes the Hybrid leave, waits for the finalizer again and relaunches an engine there. The GPU
ledger is checked after each step. The only faked edge is the embedding run loop's handlers
(see `driver`).
"""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from ehp_fsm.plan import load_plan
from ehp_fsm.runtime.controller import Controller
from ehp_fsm.runtime.identity import start_time_of
from tests.procs import still_running
from tests.runtime_system.driver import TEST_TRANSPORT, Driver, wait_agents
from tests.runtime_system.harness import (
    AgentProc,
    cleanup,
    final_checks,
    ledger_of,
    new_run_id,
    write_plan,
)

pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(150)
def test_two_agent_borrow_and_return_over_real_sockets(tmp_path: Path) -> None:
    plan_path, endpoint = write_plan(tmp_path)
    plan = load_plan(plan_path)
    log_path = tmp_path / "transitions.jsonl"
    run_id = new_run_id()
    ctl = Controller.start(plan, log_path=log_path, bind=endpoint, transport=TEST_TRANSPORT)
    agents = [
        AgentProc(host=h, endpoint=endpoint, tmp=tmp_path, run_id=run_id) for h in ("h1", "h2")
    ]
    with cleanup(run_id, agents, [ctl]):
        wait_agents(ctl, ["h1", "h2"])
        d = Driver(ctl)
        d.setup()
        assert ledger_of(ctl) == {
            "h0:g0": ("owned", "core"),
            "h1:g0": ("owned", "engine:e0"),
            "h2:g0": ("owned", "engine:e1"),
        }
        ok = ctl.run_until(
            lambda c: all(
                c.world.get("rollout_engine", e).state == "serving" for e in ("e0", "e1")
            ),
            90.0,
        )
        assert ok, [a.tail() for a in agents]
        e0 = ctl.world.get("rollout_engine", "e0")
        pid0 = e0.get("identity")["pid"]
        assert start_time_of(pid0) == pytest.approx(e0.get("identity")["start_time"], abs=0.01)
        assert "ehp_fsm.rollout.server" in " ".join(psutil.Process(pid0).cmdline())
        d.dispatch_groups()

        # borrow: drain e0 → stop by identity on h1 → finalizer → Hybrid on h1:g0
        d.drive("borrowed", 60.0)
        assert ctl.world.get("rollout_engine", "e0").state == "stopped"
        assert not still_running([pid0])
        (hid,) = [h.id for h in ctl.world.of("hybrid_replica").values() if h.state == "active"]
        assert ledger_of(ctl)["h1:g0"] == ("owned", f"hybrid:{hid}")
        assert ledger_of(ctl)["h2:g0"] == ("owned", "engine:e1")
        hpid = ctl.world.get("hybrid_replica", hid).get("identity")["pid"]
        assert "ehp_fsm.runtime.workers" in " ".join(psutil.Process(hpid).cmdline())
        assert ctl.world.globals["epoch"] == 1
        # the groups e0 held were requeued and went to e1
        assert {ctl.world.get("request", g).get("engine") for g in ("g0", "g1")} == {"e1"}

        # return: the Hybrid leaves → stop by identity → finalizer → engine relaunched there
        d.drive("serving", 90.0)
        assert ctl.world.get("hybrid_replica", hid).state == "stopped"
        assert not still_running([hpid])
        (eid,) = [
            e.id
            for e in ctl.world.of("rollout_engine").values()
            if e.state == "serving" and e.get("host") == "h1"
        ]
        assert ledger_of(ctl)["h1:g0"] == ("owned", f"engine:{eid}")
        assert ctl.world.globals["epoch"] == 2
        final_checks(ctl, run_id, log_path)
        # controller shutdown: every process it owns is stopped, the agents' children are gone
        assert ctl.shutdown(timeout_s=40.0)
        for a in agents:
            assert psutil.Process(a.pid).children(recursive=True) == []
            assert a.terminate() == 0
