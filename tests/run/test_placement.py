"""Where the run trains (`run.placement`): the hosts of the Core's devices must be the machine of
the run; a host a Hybrid may be borrowed on may be another machine, whose agent then launches its
warm lanes (as many as Hybrids fit on it, at most `max_hybrids`). End to end (agents reporting
other machines) in `test_external_agents.py`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ehp_fsm.errors import EhpError
from ehp_fsm.plan import Plan, load_plan
from ehp_fsm.run import startup
from ehp_fsm.run.placement import (
    local_lenders,
    misplaced,
    placement_fix,
    remote_lenders,
    remote_warm_lanes,
    training_hosts,
)
from ehp_fsm.run.startup import pool_channel
from ehp_fsm.runtime.keys import generate_keys, load_server_keys
from ehp_fsm.training.pool_protocol import PoolConfig

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_core_hosts_and_with_ehp_every_lending_host_train() -> None:
    plan = load_plan(EXAMPLES / "local.toml")  # Core on h0; engines on h1 and h2
    assert list(training_hosts(plan)) == ["h0", "h1", "h2"]
    off = dataclasses.replace(plan, ehp=dataclasses.replace(plan.ehp, enabled=False))
    assert list(training_hosts(off)) == ["h0"]  # without EHP only the Core's host trains


def test_agents_on_the_run_machine_pass_and_lenders_elsewhere_get_lanes_there() -> None:
    plan = load_plan(EXAMPLES / "local.toml")  # h1: 2 devices outside the Core, h2: 1
    here = {"h0": "box", "h1": "box", "h2": "box"}
    assert misplaced(plan, here, "box") == [] and remote_lenders(plan, here, "box") == []
    assert misplaced(plan, {"h0": "box"}, "box") == []  # an agent that said nothing is not judged
    elsewhere = {**here, "h1": "other", "h2": "third"}
    assert misplaced(plan, elsewhere, "box") == []  # a lending host may be another machine
    lenders = remote_lenders(plan, elsewhere, "box")
    assert lenders == ["h1", "h2"] and not local_lenders(plan, lenders)
    assert local_lenders(plan, ["h1"])  # h2 lends from the run's machine
    # one lane per Hybrid that fits there (replica_size 1), at most max_hybrids of each host
    x = plan.ehp
    assert remote_warm_lanes(plan, lenders) == ("h1",) * min(2, x.max_hybrids) + ("h2",)
    one = dataclasses.replace(plan, ehp=dataclasses.replace(x, max_hybrids=1))
    assert remote_warm_lanes(one, lenders) == ("h1", "h2")
    two = dataclasses.replace(plan, ehp=dataclasses.replace(x, replica_size=2, max_hybrids=4))
    assert remote_warm_lanes(two, lenders) == ("h1",)  # a TP 2 Hybrid does not fit on h2


def test_a_core_host_elsewhere_says_where_to_start_the_run() -> None:
    plan = load_plan(EXAMPLES / "local.toml")
    off = dataclasses.replace(plan, ehp=dataclasses.replace(plan.ehp, enabled=False))
    found = misplaced(off, {"h0": "node-07", "h1": "box", "h2": "elsewhere"}, "box")
    assert [m.host for m in found] == ["h0"]  # h2 only serves rollout with EHP off
    assert placement_fix(found) == "start `ehp-fsm run` on 'node-07', where the Core's devices are"


def _with_controller(plan: Plan, controller: str, keys: Path | None) -> Plan:
    transport = dataclasses.replace(
        plan.transport,
        controller=controller,
        allow_non_loopback=True,
        curve_keys=None if keys is None else str(keys),
    )
    return dataclasses.replace(plan, transport=transport)


def test_the_pool_listens_where_workers_on_other_machines_can_reach_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With warm lanes on other machines the pool's channel listens on the controller's address
    (loopback: only "other machines" on this one), with the plan's CURVE keys and each rank
    bound to the key of the host that launches it; a wildcard address is refused, naming it."""
    plan = load_plan(EXAMPLES / "local.toml")
    config = PoolConfig(core_dp=1, max_hybrids=0, remote_warm=("h1", "h2"))
    assert pool_channel(plan, config) == {"listen": "tcp://127.0.0.1"}  # no keys: plain
    keys = tmp_path / "keys"
    generate_keys(keys, agents=["h0", "h1", "h2"])
    got = pool_channel(_with_controller(plan, "tcp://10.0.0.1:5555", keys), config)
    assert got["listen"] == "tcp://10.0.0.1"
    assert got["rank_hosts"] == {0: "h0", 1: "h1", 2: "h2"}  # the Core's rank: the run's host
    assert got["local_client_key"] == keys / "agents" / "h0.key_secret"
    assert got["curve"].public == load_server_keys(keys).public
    # a host name: the address it names here (name resolution is the far edge faked here)
    monkeypatch.setattr(startup.socket, "gethostbyname", {"head-node": "10.0.0.9"}.__getitem__)
    named = pool_channel(_with_controller(plan, "tcp://head-node:5555", keys), config)
    assert named["listen"] == "tcp://10.0.0.9"
    for wildcard in ("tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://[::]:5555"):
        with pytest.raises(EhpError, match="is a wildcard") as err:
            pool_channel(_with_controller(plan, wildcard, keys), config)
        assert "h1" in str(err.value) and "tcp://10.0.0.1:5555" in str(err.value)
