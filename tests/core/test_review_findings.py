"""Guards, effects and invariants a review found open: a Core GPU taken by an engine, a step
marked published with an older revision, malformed payloads that raised out of `step`, integer
group ids refused, a revision retired while an engine may still read it, commands sharing the
world's maps, and a leaked GPU the invariants did not see. Each test fails without its fix."""

from __future__ import annotations

from typing import Any

import pytest

from ehp_fsm.core.invariants import check_invariants
from ehp_fsm.core.world import Instance

from .scenario import Scenario, identity


def _partitioned(s: Scenario, ids: list[Any]) -> None:
    """Step s1 partitioned over the two Core replicas."""
    s.ok("training_step", "s1", "begin", step=1)
    half = len(ids) // 2
    partition = {"core:0": ids[:half], "core:1": ids[half:]}
    s.ok("training_step", "s1", "partition", groups=ids, partition=partition)


def _step_to_publishing(s: Scenario, ids: list[Any]) -> None:
    _partitioned(s, ids)
    s.ok("training_step", "s1", "delivered", replicas=["core:0", "core:1"])
    s.ok("training_step", "s1", "reduced")
    s.ok("training_step", "s1", "stepped", version=1)


def test_a_core_gpu_released_is_never_taken_by_an_engine() -> None:
    s = Scenario()
    s.ok("gpu", "h0:g0", "release", owner="core")
    s.confirm_free("h0:g0", "core")
    s.publish(1)
    reason = s.no("rollout_engine", "eX", "launch", host="h0", gpus=["h0:g0"], tp=1, token="t")
    assert "Core layout" in reason
    s.ok("gpu", "h0:g0", "assign", owner="core")  # the Core takes it back


def test_a_step_is_published_only_with_a_revision_newer_than_its_partition() -> None:
    s = Scenario()
    s.serving_engine("e0", "h1:g0", "h1")  # revision 1 is current
    _step_to_publishing(s, s.completed_groups(8))
    assert "already current" in s.no("training_step", "s1", "published", revision=1)
    s.publish(2)
    s.ok("training_step", "s1", "published", revision=2)


@pytest.mark.parametrize(
    ("machine", "setup", "payload"),
    [
        ("rollout_engine", None, {"host": "h1", "gpus": [["h1:g0"]], "tp": 1, "token": "t"}),
        ("hybrid_replica", "request", {"host": "h1", "gpus": [{}]}),
    ],
)
def test_gpu_lists_that_are_not_strings_are_refused(
    machine: str, setup: str | None, payload: dict[str, Any]
) -> None:
    s = Scenario()
    s.publish(1)
    if setup is not None:
        s.ok(machine, "z", setup)
    event = "launch" if machine == "rollout_engine" else "allocate"
    assert "list of GPU ids" in s.no(machine, "z", event, **payload)


def test_replicas_that_are_not_names_are_refused() -> None:
    s = Scenario()
    s.serving_engine("e0", "h1:g0", "h1")
    _partitioned(s, s.completed_groups(8))
    assert "replica names" in s.no("training_step", "s1", "delivered", replicas=["core:0", 1])


def test_integer_group_ids_go_through_a_whole_step() -> None:
    s = Scenario()
    s.serving_engine("e0", "h1:g0", "h1")
    ints = [int(i) for i in s.completed_groups(8, prefix="")]
    _step_to_publishing(s, ints)
    assert all(s.state("request", str(i)) == "consumed" for i in ints)


def test_a_revision_an_engine_may_still_be_installing_is_not_retired() -> None:
    s = Scenario()
    s.serving_engine("e0", "h1:g0", "h1")  # revision 1 installed
    s.publish(2)  # e0 updating to 2
    s.publish(3)  # e0 now wants 3; it may still be reading 2
    assert "installing" in s.no("revision", "r2", "retire")
    s.ok("rollout_engine", "e0", "installed", revision=3)
    s.ok("revision", "r2", "retire")


def test_a_command_carries_its_own_copy_of_the_recorded_identity() -> None:
    s = Scenario()
    s.publish(1)
    s.ok("rollout_engine", "e0", "launch", host="h1", gpus=["h1:g0"], tp=1, token="t-e0")
    out = s.ok("rollout_engine", "e0", "healthy", identity=identity("h1", "t-e0"))
    (install,) = [c for c in out.commands if c.kind == "install"]
    install.args["identity"]["pid"] = 999  # a shell that normalises arguments in place
    assert s.world.get("rollout_engine", "e0").get("identity")["pid"] == 100


def test_the_invariants_see_a_gpu_left_owned_by_a_holder_that_ended() -> None:
    s = Scenario()
    s.serving_engine("e0", "h1:g0", "h1")
    e0 = s.world.get("rollout_engine", "e0")
    # what a skipped release would leave: the engine stopped, its GPU still owned by it
    s.world.apply(
        {("rollout_engine", "e0"): Instance("rollout_engine", "e0", "stopped", e0.data)}, {}
    )
    assert any("does not hold it" in p for p in check_invariants(s.world))
    g = s.world.get("gpu", "h0:g0")
    s.world.apply(
        {("gpu", "h0:g0"): Instance("gpu", "h0:g0", g.state, {**g.data, "owner": "engine:e0"})}, {}
    )
    assert any("Core GPU h0:g0 is owned by engine:e0" in p for p in check_invariants(s.world))


def test_the_invariants_see_a_group_claimed_by_no_step() -> None:
    s = Scenario()
    s.serving_engine("e0", "h1:g0", "h1")
    (gid,) = s.completed_groups(1)
    r = s.world.get("request", gid)
    s.world.apply({("request", gid): Instance("request", gid, "claimed", r.data)}, {})
    assert any("claimed but no training step holds it" in p for p in check_invariants(s.world))


def test_a_decision_whose_actions_are_not_a_list_is_refused() -> None:
    s = Scenario()
    out = s.fire("capacity", "grp", "decided", based_on_version=s.world.version, actions=5)
    assert not out.accepted and "`actions`" in out.reason  # raised TypeError before
