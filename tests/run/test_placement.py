"""Where the run trains (`run.placement`): the hosts of the Core's devices, and with EHP on every
host a Hybrid may be borrowed on, must be the machine of the run's trainer pool. The run's refusal
end to end (an agent reporting another machine) is in `test_external_agents.py`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ehp_fsm.plan import load_plan
from ehp_fsm.run.placement import misplaced, placement_fix, training_hosts

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_core_hosts_and_with_ehp_every_lending_host_train() -> None:
    plan = load_plan(EXAMPLES / "local.toml")  # Core on h0; engines on h1 and h2
    assert list(training_hosts(plan)) == ["h0", "h1", "h2"]
    off = dataclasses.replace(plan, ehp=dataclasses.replace(plan.ehp, enabled=False))
    assert list(training_hosts(off)) == ["h0"]  # without EHP only the Core's host trains


def test_agents_on_the_run_machine_pass_and_others_are_named() -> None:
    plan = load_plan(EXAMPLES / "local.toml")
    here = {"h0": "box", "h1": "box", "h2": "box"}
    assert misplaced(plan, here, "box") == []
    assert misplaced(plan, {"h0": "box"}, "box") == []  # an agent that said nothing is not judged
    found = misplaced(plan, {**here, "h2": "other"}, "box")
    assert [(m.host, m.machine) for m in found] == [("h2", "other")]
    assert "host 'h2' (EHP is on" in found[0].describe("box")
    fix = placement_fix(found)
    assert "set [ehp] enabled = false" in fix and "start `ehp-fsm run`" not in fix


def test_a_core_host_elsewhere_says_where_to_start_the_run() -> None:
    plan = load_plan(EXAMPLES / "local.toml")
    off = dataclasses.replace(plan, ehp=dataclasses.replace(plan.ehp, enabled=False))
    found = misplaced(off, {"h0": "node-07", "h1": "box", "h2": "elsewhere"}, "box")
    assert [m.host for m in found] == ["h0"]  # h2 only serves rollout with EHP off
    assert placement_fix(found) == "start `ehp-fsm run` on 'node-07', where the Core's devices are"
