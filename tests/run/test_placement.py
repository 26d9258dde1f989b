"""Where the run trains (`run.placement`): the hosts of the Core's devices must be the machine of
the run; a host a Hybrid may be borrowed on may be another machine, whose agent then launches its
warm lanes (as many as Hybrids fit on it, at most `max_hybrids`). End to end (agents reporting
other machines) in `test_external_agents.py`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ehp_fsm.plan import load_plan
from ehp_fsm.run.placement import (
    local_lenders,
    misplaced,
    placement_fix,
    remote_lenders,
    remote_warm_lanes,
    training_hosts,
)

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
