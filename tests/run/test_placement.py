"""Where the run trains and who launches each lane (`run.placement`): a Core lane on its host's
machine, launched there by its agent when that is another machine than the run's; a host a
Hybrid may be borrowed on likewise (as many warm lanes as Hybrids fit on it, at most
`max_hybrids`). Lanes elsewhere need `[run] revisions`. End to end (agents reporting other
machines) in `test_external_agents.py`."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from ehp_fsm.errors import EhpError
from ehp_fsm.plan import Plan, PlanError, load_plan, parse_plan
from ehp_fsm.run import startup
from ehp_fsm.run.placement import (
    core_lane_hosts,
    lending_hosts,
    local_lenders,
    remote_core,
    remote_lenders,
    remote_warm_lanes,
    unseen_write,
    unshared,
)
from ehp_fsm.run.startup import pool_channel
from ehp_fsm.runtime.keys import generate_keys, load_server_keys
from ehp_fsm.training.pool_protocol import PoolConfig

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_core_lanes_and_with_ehp_every_lending_host_train() -> None:
    plan = load_plan(EXAMPLES / "local.toml")  # Core on h0; engines on h1 and h2
    assert core_lane_hosts(plan) == ("h0",) and lending_hosts(plan) == ["h1", "h2"]
    off = dataclasses.replace(plan, ehp=dataclasses.replace(plan.ehp, enabled=False))
    assert lending_hosts(off) == []  # without EHP only the Core's lanes train


def test_agents_on_the_run_machine_pass_and_lenders_elsewhere_get_lanes_there() -> None:
    plan = load_plan(EXAMPLES / "local.toml")  # h1: 2 devices outside the Core, h2: 1
    here = {"h0": "box", "h1": "box", "h2": "box"}
    assert remote_core(plan, here, "box") == () and remote_lenders(plan, here, "box") == []
    assert remote_core(plan, {"h1": "other"}, "box") == ()  # an agent that said nothing: here
    elsewhere = {**here, "h1": "other", "h2": "third"}
    assert remote_core(plan, elsewhere, "box") == ()  # a lending host may be another machine
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


PLAN = """
[run]
name = "lanes"
{revisions}
[[hosts]]
id = "a"
gpus = 2
[[hosts]]
id = "b"
gpus = 3
[core]
tp = 2
dp = 2
gpus = {core}
[[engines]]
id = "e0"
host = "b"
tp = 1
[rollout]
reserve = 1
[grpo]
prompts_per_step = 2
group_size = 2
steps = 1
[ehp]
max_hybrids = 1
"""


def _plan(core: str, revisions: str = "") -> Plan:
    return parse_plan(tomllib.loads(PLAN.format(core=core, revisions=revisions)))


def test_a_core_lane_on_another_machine_is_launched_by_its_agent() -> None:
    plan = _plan('["a:g0", "a:g1", "b:g0", "b:g1"]', 'revisions = "/shared/revisions"')
    assert core_lane_hosts(plan) == ("a", "b")
    assert remote_core(plan, {"a": "box", "b": "box-b"}, "box") == (None, "b")
    assert remote_core(plan, {"a": "box-a", "b": "box-b"}, "box") == ("a", "b")
    # b holds Core lane 1 and an engine's device: a Hybrid may be borrowed there too, and its
    # warm lane is b's agent's
    assert lending_hosts(plan) == ["b"]
    assert remote_lenders(plan, {"a": "box", "b": "box-b"}, "box") == ["b"]
    config = PoolConfig(core_dp=2, max_hybrids=0, remote_core=(None, "b"), remote_warm=("b",))
    assert [config.home(r) for r in range(3)] == [None, "b", "b"]
    assert config.remote_ranks == (1, 2) and config.remote_hosts == ["b"]
    assert PoolConfig.from_json(config.to_json()) == config
    with pytest.raises(ValueError, match="one entry per Core rank"):
        PoolConfig(core_dp=2, remote_core=("b",))


def test_a_core_lane_across_hosts_is_refused_naming_lane_and_hosts() -> None:
    with pytest.raises(PlanError, match=r"core.gpus.*Core lane 0 .*spans hosts \['a', 'b'\]"):
        _plan('["a:g0", "b:g2", "a:g1", "b:g0"]')


def test_lanes_elsewhere_need_the_revisions_on_a_shared_path(tmp_path: Path) -> None:
    plan = _plan('["a:g0", "a:g1", "b:g0", "b:g1"]')
    assert unshared(plan, (), []) is None  # every lane here: the run directory will do
    why = unshared(plan, ("a", None), [])
    assert why is not None and "hosts a" in why and "[run] revisions is not set" in why
    assert "Core rank 0 saves every revision there" in why
    assert "Core rank 0" not in (unshared(plan, (None, "b"), []) or "")
    assert unshared(plan, (), ["b"]) is not None  # a remote warm lane meets the others there
    shared = _plan('["a:g0", "a:g1", "b:g0", "b:g1"]', 'revisions = "/shared/revisions"')
    assert unshared(shared, ("a", "b"), ["b"]) is None
    # what Core rank 0 wrote on another machine must be there on the run's
    assert unseen_write(tmp_path, "revision 1", "[run] revisions", "a") is None
    err = unseen_write(tmp_path / "r00000001", "revision 1", "[run] revisions", "a")
    assert err is not None and "on host a, another machine" in str(err)
    assert "set [run] revisions to a path every node sees" in str(err)


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
    # the Core lane launched by h0's agent elsewhere, h1's warm lane by h1's: the run's own
    # warm lane carries the key of the host on its machine (h2's)
    elsewhere = _with_controller(plan, "tcp://10.0.0.1:5555", keys)
    mixed = PoolConfig(core_dp=1, max_hybrids=1, remote_warm=("h1",), remote_core=("h0",))
    core = pool_channel(elsewhere, mixed)
    assert core["rank_hosts"] == {0: "h0", 1: "h2", 2: "h1"}
    assert core["local_client_key"] == keys / "agents" / "h2.key_secret"
    # a host name: the address it names here (name resolution is the far edge faked here)
    monkeypatch.setattr(startup.socket, "gethostbyname", {"head-node": "10.0.0.9"}.__getitem__)
    named = pool_channel(_with_controller(plan, "tcp://head-node:5555", keys), config)
    assert named["listen"] == "tcp://10.0.0.9"
    for wildcard in ("tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://[::]:5555"):
        with pytest.raises(EhpError, match="is a wildcard") as err:
            pool_channel(_with_controller(plan, wildcard, keys), config)
        assert "h1" in str(err.value) and "tcp://10.0.0.1:5555" in str(err.value)


def test_a_pool_on_this_machine_alone_uses_the_run_s_keys_on_loopback(tmp_path: Path) -> None:
    """Every rank on this machine: the channel listens on loopback whatever the controller's
    address, and with the plan's keys (`curve = "local"` gives every run some) it is a CURVE
    channel too. It was plain: on a shared machine any local user could send it frames."""
    plan = load_plan(EXAMPLES / "local.toml")
    config = PoolConfig(core_dp=1, max_hybrids=1)
    assert pool_channel(plan, config) == {"listen": "tcp://127.0.0.1"}
    keys = tmp_path / "keys"
    generate_keys(keys, agents=["h0", "h1", "h2"])
    for controller in ("tcp://127.0.0.1:5555", "tcp://10.0.0.1:5555", "tcp://*:5555"):
        got = pool_channel(_with_controller(plan, controller, keys), config)
        assert got["listen"] == "tcp://127.0.0.1"
        assert got["curve"].public == load_server_keys(keys).public
        assert got["rank_hosts"] == {0: "h0", 1: "h0"}
        assert got["local_client_key"] == keys / "agents" / "h0.key_secret"
