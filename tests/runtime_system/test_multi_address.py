"""Multi-host on one machine, each agent on its own address.

Linux routes all of 127.0.0.0/8 to the loopback interface, so without root each agent can have
an address of its own: h1 is 127.0.0.2, h2 is 127.0.0.3 (`ehp-fsm agent --address`). The agent
connects to the controller from that address and its engines listen on it; the controller sees
each agent's frames come from its address (ZeroMQ's Peer-Address) and records it per host.
(`unshare -rn` — a user + network namespace — also works on this machine, but a namespace has
its own loopback that the controller's cannot reach without a veth pair, which needs more
privileges than CI has: these tests use loopback addresses and do not depend on namespaces.)

Engines here are real embedded engines (their URL must carry their agent's address).
"""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from ehp_fsm.plan import load_plan
from ehp_fsm.runtime.controller import Controller
from tests.runtime_system.driver import TEST_TRANSPORT, Driver, wait_agents
from tests.runtime_system.harness import AgentProc, cleanup, final_checks, new_run_id, write_plan

pytestmark = [pytest.mark.slow]
ADDRESS = {"h1": "127.0.0.2", "h2": "127.0.0.3"}


def _agent(host: str, address: str, endpoint: str, tmp: Path, run_id: str) -> AgentProc:
    extra = ["--address", address]
    return AgentProc(host=host, endpoint=endpoint, tmp=tmp, run_id=run_id, extra=extra)


def _connection_sources(pid: int, port: int) -> set[str]:
    """Local addresses of `pid`'s TCP connections to the controller's port."""
    return {
        c.laddr.ip
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.raddr and c.raddr.port == port
    }


@pytest.mark.timeout(180)
def test_two_agents_on_their_own_addresses_borrow_and_return(tmp_path: Path) -> None:
    plan_path, endpoint = write_plan(tmp_path)  # the controller binds 127.0.0.1
    port = int(endpoint.rsplit(":", 1)[1])
    log_path = tmp_path / "transitions.jsonl"
    run_id = new_run_id()
    ctl = Controller.start(
        load_plan(plan_path), log_path=log_path, bind=endpoint, transport=TEST_TRANSPORT
    )
    agents = {h: _agent(h, a, endpoint, tmp_path, run_id) for h, a in ADDRESS.items()}
    with cleanup(run_id, list(agents.values()), [ctl]):
        wait_agents(ctl, list(ADDRESS))
        for host, address in ADDRESS.items():
            info = ctl.agents[host]
            assert info.address == address, f"{host} seen at {info.address}"
            assert info.inventory["address"] == address
            assert _connection_sources(agents[host].pid, port) == {address}
        d = Driver(ctl)
        d.setup()
        d.drive("serving", 120.0)
        assert ctl.run_until(
            lambda c: all(e.state == "serving" for e in c.world.of("rollout_engine").values()),
            120.0,
        )
        for e in ctl.world.of("rollout_engine").values():  # each engine on its agent's address
            assert e.get("identity")["url"].startswith(f"http://{ADDRESS[e.get('host')]}:")
        d.drive("borrowed", 90.0)
        d.drive("serving", 120.0)
        # h1 comes back from another address: the controller records the new one, reconciles
        agents["h1"].kill9()
        agents["h1"].extra = ["--address", "127.0.0.4"]
        agents["h1"].start()
        assert ctl.run_until(
            lambda c: c.agents["h1"].address == "127.0.0.4" and c.agents["h1"].reconciled, 60.0
        ), f"h1 did not reconcile from its new address: {ctl.agents['h1']}"
        assert ctl.agents["h2"].address == "127.0.0.3"
        d.drive("serving", 60.0)
        final_checks(ctl, run_id, log_path)
