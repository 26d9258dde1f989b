"""Tests that kill the mutants a hand mutation review of the core left alive (each test names
the one-line change to `src/ehp_fsm` it fails on; all pass on the code as it is)."""

from __future__ import annotations

import dataclasses

import pytest

from ehp_fsm.core.batch import (
    Delivery,
    DeliveryAccepted,
    DeliveryLedger,
    DeliveryRejected,
    LedgerStatus,
    RejectReason,
    partition_groups,
)
from ehp_fsm.core.checks import InvariantChecks
from ehp_fsm.core.effects import EFFECTS
from ehp_fsm.core.guards import GUARDS
from ehp_fsm.core.invariants import check_invariants
from ehp_fsm.core.planner import (
    ClusterView,
    Decision,
    PlannerState,
    _unpaid,
    decide,
    validate_decision,
)
from ehp_fsm.core.transition import Accepted, Rejected, step
from ehp_fsm.core.world import Event, Instance, World
from ehp_fsm.finished import IdSet
from ehp_fsm.specfiles import load_specs
from tests.core.scenario import Scenario, identity
from tests.planner.cluster import metrics, policy, uniform_cluster


@pytest.fixture
def s() -> Scenario:
    return Scenario()


def test_a_partition_naming_a_group_twice_is_refused_as_not_distinct(s: Scenario) -> None:
    """Mutant: `partition_is_complete` without `len(set(groups)) != len(groups)`. A partition
    that lists a group twice (and the partition maps it twice) is refused by that guard, with
    its reason, not later by a claim that happens to fail."""
    s.serving_engine("e0", "h1:g0")
    groups = s.completed_groups(7)
    doubled = [*groups, groups[0]]
    s.ok("training_step", "s1", "begin", step=1)
    part = {"core:0": doubled[:4], "core:1": doubled[4:]}
    reason = s.no("training_step", "s1", "partition", groups=doubled, partition=part)
    assert "partition_is_complete" in reason and "8 distinct groups" in reason
    assert all(s.state("request", g) == "completed" for g in groups)


def test_a_revision_is_not_retired_while_an_engine_installs_with_nothing_installed(
    s: Scenario,
) -> None:
    """Mutant: `revision_unreferenced` reading `(installed is None or installed < rev)` as
    `(installed is not None and installed < rev)`. An engine that became healthy while r1
    was current was told to install r1 and has nothing installed yet: r1 must not be retired
    (its files deleted) under it, even after r2 is published."""
    s.publish(1)
    s.ok("rollout_engine", "e0", "launch", host="h1", gpus=["h1:g0"], tp=1, token="t-e0")
    s.ok("rollout_engine", "e0", "healthy", identity=identity("h1", "t-e0"))
    assert s.state("rollout_engine", "e0") == "installing"
    assert s.world.get("rollout_engine", "e0").get("installed") is None
    s.publish(2)
    reason = s.no("revision", "r1", "retire")
    assert "engine e0 is installing and may be reading revision 1" in reason
    s.ok("rollout_engine", "e0", "installed", revision=2)
    s.ok("revision", "r1", "retire")


def test_a_gpu_is_not_assigned_to_a_holder_on_another_host() -> None:
    """Mutant: `owner_claims_gpu` without its host check. The engine and Hybrid creates
    (`gpus_on_one_host`) keep every holder's GPUs on its host, so no guarded run reaches this;
    the guard is the ledger's own line of defence, tested on a world written through
    `World.apply` with an engine on h2 that lists h1's GPU."""
    world = World(load_specs(), {"inventory": {"h1:g0": "h1"}, "core_gpus": []})
    world.apply(
        {
            ("gpu", "h1:g0"): Instance("gpu", "h1:g0", "free", {"host": "h1"}),
            ("rollout_engine", "e0"): Instance(
                "rollout_engine", "e0", "starting", {"host": "h2", "gpus": ["h1:g0"], "tp": 1}
            ),
        },
        {},
    )
    out = step(world, Event("gpu", "h1:g0", "assign", 1.0, {"owner": "engine:e0"}), GUARDS, EFFECTS)
    assert isinstance(out, Rejected)
    assert "GPU h1:g0 is on host h1, owner engine:e0 on h2" in out.reason


def _apply(world: World, checks: InvariantChecks, *changed: Instance) -> list[str]:
    """Write `changed` through `World.apply` (guards bypassed) and return the per-event
    verdict, after checking it is the whole check's."""
    changes = {(i.machine, i.id): i for i in changed}
    world.apply(changes, {})
    got = checks.check(Accepted(Event("request", "-", "-", 0.0), (), (), changes, {}))
    assert got == check_invariants(world, indexed=True)
    return got


def test_a_one_group_step_is_checked_whole_while_a_step_holds_unindexed_groups() -> None:
    """Mutant: `InvariantChecks.check`'s one-group path asking only `not self.sound` (not
    `self.odd`). A busy step whose groups the indices cannot read (integer ids: a world
    written around the guards, as `record_partition` stores strings) is not in `held_by`: a
    group it holds that leaves `claimed` breaks "a step holds only claimed groups", which only
    the whole check sees."""
    world = World(load_specs(), {"inventory": {}, "core_gpus": [], "core_replicas": []})
    world.apply(
        {
            ("training_step", "s1"): Instance("training_step", "s1", "computing", {"groups": [1]}),
            ("request", "1"): Instance("request", "1", "claimed", {"claimed_by": "s1"}),
        },
        {},
    )
    checks = InvariantChecks(world)
    assert checks.sound and checks.odd  # sound, and the step is read only by the whole check
    problems = _apply(world, checks, Instance("request", "1", "completed", {}))
    assert problems == ["step s1 holds group 1, which is completed"]


def test_a_holder_listing_one_gpu_twice_breaks_one_owner_per_gpu() -> None:
    """Mutant: `check_invariants` without its "held by both" report. Two holders listing one
    GPU are also caught by the owner check (the GPU names one of them), but one holder listing
    its own GPU twice is caught by nothing else: the GPU's owner is that holder both times."""
    world = World(load_specs(), {"inventory": {"h1:g0": "h1"}, "core_gpus": []})
    world.apply(
        {
            ("gpu", "h1:g0"): Instance(
                "gpu", "h1:g0", "owned", {"host": "h1", "owner": "engine:e0"}
            ),
            ("rollout_engine", "e0"): Instance(
                "rollout_engine", "e0", "starting", {"host": "h1", "gpus": ["h1:g0", "h1:g0"]}
            ),
        },
        {},
    )
    want = ["GPU h1:g0 is held by both engine:e0 and engine:e0"]
    assert check_invariants(world) == want
    assert check_invariants(world, indexed=True) == want
    assert not InvariantChecks(world).sound


def test_the_writer_keeps_a_failed_step_and_its_groups(s: Scenario) -> None:
    """Mutant: `Forgetter.forget` without `inst.state not in gone` (any state some machine
    forgets in: a `failed` step too). A failed step stays in the world with its data (an
    `unclaim` naming it reads its groups; the shell reads its reason); its groups are back."""
    s.serving_engine("e0", "h1:g0")
    groups = s.completed_groups(8)
    s.ok("training_step", "s1", "begin", step=1)
    part = {"core:0": groups[:4], "core:1": groups[4:]}
    s.ok("training_step", "s1", "partition", groups=groups, partition=part)
    s.ok("training_step", "s1", "fail", reason="replica core:1 died")
    kept = s.world.instances["training_step"].get("s1")
    assert kept is not None and kept.state == "failed"
    assert kept.get("reason") == "replica core:1 died" and kept.get("groups") == groups
    assert all(s.state("request", g) == "completed" for g in groups)


def test_idset_runs_merge_adjacent_ids_kept_in_different_places() -> None:
    """Mutant: `IdSet.runs` merging only overlapping runs (`lo <= last`, not `lo <= last + 1`).
    g8 starts the bit array at 8, so g7 (below it) goes to the plain set: its run (7, 7)
    and the array's (8, 8) are one run, as the same ids added in order give it."""
    ids = IdSet()
    ids.add("g8")
    ids.add("g7")
    in_order = IdSet()
    in_order.add("g7")
    in_order.add("g8")
    assert ids.runs() == in_order.runs() == ([("g", 7, 8)], [])


def test_idset_discard_of_an_id_outside_the_bit_arrays_counts_it_out() -> None:
    """Mutant: `IdSet.discard` not counting down an id it takes out of the plain set (ids
    with a leading zero, or below a prefix's first number, live there)."""
    ids = IdSet()
    ids.add("g1")
    ids.add("g01")
    assert len(ids) == ids.size() == 2 and "g01" in ids
    ids.discard("g01")
    assert "g01" not in ids and "g1" in ids
    assert len(ids) == ids.size() == 1


def test_a_delivery_at_its_deadline_is_late_and_fails_the_step() -> None:
    """Mutant: `DeliveryLedger.offer` expiring only after the deadline (`now > deadline`).
    At the deadline itself the step fails and the delivery is LATE, as `expire` decides."""
    p = partition_groups(groups=range(4), live={"a": 1, "b": 1}, group_size=2, step=1, epoch=0)
    ledger = DeliveryLedger.open(p, shapes=[(3,)], deadline=10.0)
    d = Delivery(step=1, epoch=0, replica="a", samples=p.units_of("a"), shapes=((3,),))
    early, ok = ledger.offer(d, now=9.5)
    assert isinstance(ok, DeliveryAccepted)
    late, out = ledger.offer(d, now=10.0)
    assert isinstance(out, DeliveryRejected) and out.reason is RejectReason.LATE
    assert late.status is LedgerStatus.FAILED and late.missing == ("a", "b")
    assert early.expire(now=10.0)[0].status is LedgerStatus.FAILED


def test_without_require_work_the_largest_remainder_wins_over_a_zero_floor() -> None:
    """Mutant: the largest-remainder order putting replicas whose floor is 0 first even without
    `require_work`. Shares of 3 groups at capacities 1:10 are 0.27 and 2.73: the one left
    over goes to the larger remainder (b: 3 groups), and a idles, which is allowed here."""
    p = partition_groups(
        groups=range(3), live={"a": 1, "b": 10}, group_size=1, step=0, epoch=0, require_work=False
    )
    assert p.groups_of("a") == () and p.groups_of("b") == (0, 1, 2)


def test_a_ratio_at_the_borrow_threshold_borrows() -> None:
    """Mutant: `_signal` borrowing only above the threshold (`ratio > borrow_threshold`). The
    rule is ratio >= borrow_threshold: borrow (the band is open at both ends)."""
    view = uniform_cluster(2, [1] * 8, version=5)
    d = decide(view=view, metrics=metrics(1.5, 1.0), policy=policy(), state=PlannerState(), now=0)
    assert d.direction == "borrow" and d.granted == 1
    assert "ratio 1.5 >= borrow threshold 1.5" in d.reason


def test_a_move_that_only_earns_back_its_cost_is_not_made() -> None:
    """Mutant: `_unpaid` taking gain × steps left == cost as paying (`>=`). A move is made
    only when the time it saves over the steps left exceeds its cost."""
    assert _unpaid(1.0, metrics(1.0, 1.0, steps_left=3), 3.0) is not None
    assert _unpaid(1.0, metrics(1.0, 1.0, steps_left=3), 2.999) is None
    assert _unpaid(1.0, metrics(1.0, 1.0), 3.0) is None


def _borrow_decision() -> tuple[ClusterView, Decision]:
    view = uniform_cluster(2, [1] * 8, version=5)
    d = decide(view=view, metrics=metrics(1.6, 1.0), policy=policy(), state=PlannerState(), now=0)
    assert validate_decision(d, view) is None
    assert [a.kind for a in d.actions] == ["stop_engine"] * 4 + ["start_hybrid"]
    return view, d


def test_a_decision_starting_two_hybrids_on_one_gpu_set_is_invalid() -> None:
    """Mutant: `validate_decision` without its "claimed twice" check. The same StartHybrid
    twice claims each freed GPU twice; each copy alone is valid, so only that check sees it."""
    view, d = _borrow_decision()
    start = d.actions[-1]
    twice = dataclasses.replace(d, actions=(*d.actions, start))
    reason = validate_decision(twice, view)
    assert reason is not None and "is claimed twice" in reason


def test_a_hybrid_waiting_for_an_engine_the_decision_does_not_stop_is_invalid() -> None:
    """Mutant: `validate_decision` without `freeing <= stopping`. A StartHybrid whose GPUs are
    still owned by an engine the decision does not stop would wait for it forever."""
    view, d = _borrow_decision()
    kept = dataclasses.replace(d, actions=d.actions[1:])  # the first engine is not stopped
    reason = validate_decision(kept, view)
    assert reason is not None and "waits for engines this decision does not stop" in reason


def _partitioned(s: Scenario, sid: str, groups: list[str]) -> None:
    s.ok("training_step", sid, "begin", step=1)
    part = {"core:0": groups[:4], "core:1": groups[4:]}
    s.ok("training_step", sid, "partition", groups=groups, partition=part)


def test_a_step_cannot_claim_a_group_outside_its_partition(s: Scenario) -> None:
    """Mutant: `step_holds_group` without its "not in step's partition" check. A claim naming
    the computing step for a completed group it did not partition would leave that group
    claimed with no step holding it (never trained, never handed back)."""
    s.serving_engine("e0", "h1:g0")
    groups = s.completed_groups(8)
    (extra,) = s.completed_groups(1, prefix="x")
    _partitioned(s, "s1", groups)
    reason = s.no("request", extra, "claim", step="s1")
    assert f"group {extra} is not in step s1's partition" in reason
    assert s.state("request", extra) == "completed"


def test_a_failed_step_cannot_hand_back_a_group_the_next_step_claimed(s: Scenario) -> None:
    """Mutant: `claimed_by_step` always passing. s1 fails (its groups handed back), s2
    partitions the same groups; a late `unclaim` naming s1 — failed, and listing the group —
    must not take the group from s2 (it would be completed again while s2 trains on it, and
    trained twice)."""
    s.serving_engine("e0", "h1:g0")
    groups = s.completed_groups(8)
    _partitioned(s, "s1", groups)
    s.ok("training_step", "s1", "fail", reason="replica lost")
    _partitioned(s, "s2", groups)
    reason = s.no("request", groups[0], "unclaim", step="s1")
    assert "group is claimed by s2, not s1" in reason
    assert s.state("request", groups[0]) == "claimed"


def test_a_group_dispatched_to_an_engine_that_ended_is_seen_by_the_per_event_check() -> None:
    """Mutant: `InvariantChecks._groups_broken` asking only whether the group's engine exists
    (not whether it ended). A group written dispatched to a stopped engine (its engine did
    not change in this step, so `_engines_broken` does not look) breaks "every dispatched
    group is in flight on a live engine"."""
    world = World(load_specs(), {"inventory": {}, "core_gpus": [], "core_replicas": []})
    world.apply(
        {
            ("rollout_engine", "e0"): Instance("rollout_engine", "e0", "stopped", {}),
            ("request", "g0"): Instance("request", "g0", "queued", {}),
        },
        {},
    )
    checks = InvariantChecks(world)
    assert checks.sound
    dispatched = Instance("request", "g0", "dispatched", {"engine": "e0", "revision": 1})
    problems = _apply(world, checks, dispatched)
    assert problems == ["group g0 is dispatched to engine 'e0', which is stopped"]
