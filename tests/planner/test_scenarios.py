"""The issue's planner scenarios, one test each (issue 4, parts 1-3 and 5)."""

from __future__ import annotations

import pytest

from ehp_fsm.core.planner import (
    CancelJoin,
    PlannerState,
    RestartEngine,
    StartHybrid,
    StopEngine,
    StopHybrid,
    decide,
    return_all,
    serving_gpus,
    validate_decision,
)
from tests.planner.cluster import (
    ClusterBuilder,
    actions_of,
    apply_decision,
    current_hybrids,
    metrics,
    policy,
    uniform_cluster,
)

# Far past the thresholds, so that the step-time prediction wants every replica capacity allows
# (training dwarfs rollout on any GPUs left) or back (rollout dwarfs training on Core alone):
# these tests are about capacity and allocation, not about sizing the move.
BORROW = metrics(1000.0, 1.0)  # train/rollout 1000 >= 1.5
RETURN = metrics(1.0, 1000.0)  # 0.001 <= 0.67
FRESH = PlannerState()


def test_24_tp1_gpus_reserve_4_replica_4_gives_five_replicas() -> None:
    view = uniform_cluster(3, [1] * 8)
    d = decide(view=view, metrics=BORROW, policy=policy(max_hybrids=8), state=FRESH, now=0.0)
    assert d.granted == 5
    assert len(actions_of(d, StartHybrid)) == 5
    assert len(actions_of(d, StopEngine)) == 20  # 20 TP1 engines = 20 physical GPUs
    assert (d.serving_gpus, d.serving_gpus_after) == (24, 4)
    assert d.shortfall is not None  # wanted max_hybrids 8 > 5
    assert (d.shortfall.wanted, d.shortfall.granted) == (8, 5)
    after, _ = apply_decision(view, d)
    assert serving_gpus(after) == 4
    assert current_hybrids(after) == 5


def test_24_tp8_gpus_give_four_replicas_by_physical_accounting() -> None:
    """Same 24 GPUs as three TP8 engines: 4 replicas, not 5.

    GPU arithmetic says (24 - 4) / 4 = 5. Physically, each stop removes a whole TP8 engine: two
    stops leave 8 serving GPUs (4 replicas); a third would leave 0 < reserve 4, so it is refused.
    """
    view = uniform_cluster(3, [8])
    d = decide(view=view, metrics=BORROW, policy=policy(max_hybrids=5), state=FRESH, now=0.0)
    assert d.granted == 4
    assert len(actions_of(d, StopEngine)) == 2
    assert d.serving_gpus_after == 8
    assert d.shortfall is not None
    assert (d.shortfall.wanted, d.shortfall.granted) == (5, 4)


@pytest.mark.parametrize(
    ("reserve", "tp1_replicas", "tp8_replicas"), [(4, 5, 4), (12, 3, 2), (17, 1, 0)]
)
def test_engine_granularity_costs_replicas_against_the_reserve(
    reserve: int, tp1_replicas: int, tp8_replicas: int
) -> None:
    pol = policy(rollout_reserve=reserve, max_hybrids=8)
    for tps, expected in (([1] * 8, tp1_replicas), ([8], tp8_replicas)):
        d = decide(view=uniform_cluster(3, tps), metrics=BORROW, policy=pol, state=FRESH, now=0.0)
        assert d.granted == expected, (tps, reserve)
        assert d.serving_gpus_after >= reserve


def test_ratio_20_to_5_borrows_up_to_capacity() -> None:
    # Two hosts of 4 TP2 engines (16 GPUs) plus 4 free GPUs on a third host; reserve 8.
    b = ClusterBuilder()
    for host in ("a", "b"):
        b.host(host)
        for _ in range(4):
            b.engine(host, 2)
    b.host("c")
    b.free("c", 4)
    view = b.build()
    d = decide(view=view, metrics=BORROW, policy=policy(rollout_reserve=8), state=FRESH, now=0.0)
    # Capacity: 1 replica from free GPUs (no cost) + 8 GPUs of engines (budget 16 - 8) = 3.
    assert d.direction == "borrow"
    assert d.granted == 3
    assert d.serving_gpus_after == 8
    starts = actions_of(d, StartHybrid)
    assert any(s.after_stops == () and s.host == "c" for s in starts)  # free GPUs: no stop


def test_ratio_2_to_20_returns_all() -> None:
    b = ClusterBuilder()
    b.host("a")
    b.hybrid("a", state="active")
    b.hybrid("a", state="active")
    b.host("b")
    b.hybrid("b", state="loading")
    b.free("b", 2)
    b.engine("b", 2)
    view = b.build(version=7)
    d = decide(view=view, metrics=RETURN, policy=policy(rollout_reserve=0), state=FRESH, now=0.0)
    assert (d.direction, d.wanted, d.granted, d.shortfall) == ("return", 0, 0, None)
    assert len(actions_of(d, StopHybrid)) == 2
    assert len(actions_of(d, CancelJoin)) == 1
    restarted = sorted(g for a in actions_of(d, RestartEngine) for g in a.gpu_ids)
    assert len(restarted) == 8 + 4 + 2  # every freed GPU and every free GPU goes back to rollout
    after, _ = apply_decision(view, d)
    assert current_hybrids(after) == 0
    assert all(g.owner is None or g.owner.startswith("engine:") for g in after.gpus)


def test_the_end_of_run_return_leaves_every_gpu_free_when_no_engine_is_wanted() -> None:
    """`return_all(restart_engines=False)` (the end of a run that stops every engine): the same
    leaves and cancellations as the return that restarts engines, no engine started, and the
    GPUs the Hybrids held end free."""
    b = ClusterBuilder()
    b.host("a")
    b.hybrid("a", state="active")
    b.hybrid("a", state="launching")
    b.engine("a", 2)
    view = b.build(version=3)
    args = {"view": view, "policy": policy(rollout_reserve=0), "state": FRESH, "now": 0.0}
    full, bare = return_all(**args), return_all(**args, restart_engines=False)
    assert actions_of(full, RestartEngine) and not actions_of(bare, RestartEngine)
    kept = [a for a in full.actions if not isinstance(a, RestartEngine)]
    assert list(bare.actions) == kept and len(kept) == 2
    after, _ = apply_decision(view, bare)
    assert current_hybrids(after) == 0
    held = {g for a in kept for g in a.gpu_ids}
    assert all(g.owner is None for g in after.gpus if g.gpu_id in held)


def test_a_joining_replica_counts_as_current() -> None:
    b = ClusterBuilder()
    b.host("a")
    b.hybrid("a", state="active")
    b.hybrid("a", state="loading")  # joining
    b.host("b")
    for _ in range(8):
        b.engine("b", 1)
    view = b.build()
    d = decide(view=view, metrics=BORROW, policy=policy(max_hybrids=2), state=FRESH, now=0.0)
    assert (d.current, d.wanted, d.granted, d.actions) == (2, 2, 2, ())
    d3 = decide(view=view, metrics=BORROW, policy=policy(max_hybrids=3), state=FRESH, now=0.0)
    assert d3.granted == 3
    assert len(actions_of(d3, StartHybrid)) == 1


def test_a_return_cancels_the_pending_join_first_and_frees_its_gpus() -> None:
    b = ClusterBuilder()
    b.host("a")
    active = b.hybrid("a", state="active")
    joining = b.hybrid("a", state="launching")
    view = b.build()
    d = decide(view=view, metrics=RETURN, policy=policy(max_hybrids=2), state=FRESH, now=0.0)
    first = d.actions[0]
    assert isinstance(first, CancelJoin)
    assert first.hybrid_id == joining
    assert isinstance(d.actions[1], StopHybrid)
    assert d.actions[1].hybrid_id == active
    joining_gpus = set(first.gpu_ids)
    assert any(
        joining in a.after_hybrids and joining_gpus <= set(a.gpu_ids)
        for a in actions_of(d, RestartEngine)
    )
    after, _ = apply_decision(view, d)
    owners = {g.owner for g in after.gpus if g.gpu_id in joining_gpus}
    assert all(o is not None and o.startswith("engine:") for o in owners)
    assert next(h for h in after.hybrids if h.hybrid_id == joining).state == "cancelled"


def test_a_starting_or_updating_engine_is_never_picked() -> None:
    b = ClusterBuilder()
    b.host("a")
    b.engine("a", 4, state="starting", name="starting")
    b.engine("a", 4, state="updating", name="updating")
    b.host("b")
    b.engine("b", 4, name="b0")
    b.engine("b", 4, name="b1")
    b.host("c")
    b.engine("c", 8, name="c0")
    view = b.build()
    pol = policy(rollout_reserve=0, max_hybrids=8)
    d = decide(view=view, metrics=BORROW, policy=pol, state=FRESH, now=0.0)
    stopped = {a.engine_id for a in actions_of(d, StopEngine)}
    assert stopped == {"b0", "b1", "c0"}
    assert d.granted == 4
    # With only starting/updating engines there is nothing to take: shortfall, nothing stops.
    only = ClusterBuilder()
    only.host("a")
    only.engine("a", 4, state="starting")
    only.engine("a", 4, state="updating")
    d2 = decide(view=only.build(), metrics=BORROW, policy=pol, state=FRESH, now=0.0)
    assert d2.actions == ()
    assert d2.shortfall is not None


def test_gpus_split_across_hosts_never_form_a_replica() -> None:
    b = ClusterBuilder()
    for host in ("a", "b"):
        b.host(host)
        b.free(host, 2)
        b.engine(host, 2)
    view = b.build()
    # 4 free GPUs in all, but 2 per host; the reserve (8) forbids stopping either TP2 engine.
    pol = policy(rollout_reserve=4, max_hybrids=1)
    d = decide(view=view, metrics=BORROW, policy=pol, state=FRESH, now=0.0)
    assert d.actions == ()
    assert d.shortfall is not None
    assert d.shortfall.granted == 0
    assert "one-host" in d.shortfall.reason
    # Allowed to stop one TP2 engine, the replica forms on that one host only.
    d2 = decide(
        view=view,
        metrics=BORROW,
        policy=policy(rollout_reserve=2, max_hybrids=1),
        state=FRESH,
        now=0.0,
    )
    (start,) = actions_of(d2, StartHybrid)
    assert {g.split(":")[0] for g in start.gpu_ids} == {start.host}


def test_a_stale_decision_is_rejected_by_validate_decision() -> None:
    view = uniform_cluster(2, [1] * 8, version=5)
    d = decide(view=view, metrics=BORROW, policy=policy(), state=FRESH, now=0.0)
    assert validate_decision(d, view) is None
    after, acted = apply_decision(view, d)
    assert acted > 0
    reason = validate_decision(d, after)
    assert reason is not None
    assert "stale" in reason
    assert "version 5" in reason
    # Same version but the world disagrees (an engine failed): an action's precondition fails.
    b = ClusterBuilder()
    b.host("a")
    e0 = b.engine("a", 4)
    b.engine("a", 4)
    before = b.build(version=9)
    d2 = decide(
        view=before,
        metrics=BORROW,
        policy=policy(rollout_reserve=4, max_hybrids=1),
        state=FRESH,
        now=0.0,
    )
    b.crash_engine(e0)
    b.crash_engine(next(a.engine_id for a in actions_of(d2, StopEngine)))
    reason2 = validate_decision(d2, b.build(version=9))
    assert reason2 is not None
    assert "not serving" in reason2


def test_hysteresis_band_prevents_flapping() -> None:
    view = uniform_cluster(2, [1] * 8)
    pol = policy(cooldown_s=0.0, engine_restart_s=0.0, release_resume_s=0.0, max_hybrids=2)
    d = decide(view=view, metrics=BORROW, policy=pol, state=FRESH, now=0.0)
    assert d.direction == "borrow"
    assert d.granted == 2
    view, _ = apply_decision(view, d)
    state = d.next_state
    # The ratio wanders inside (0.67, 1.5): no costs, no cooldown, and still nothing moves.
    for t, ratio in enumerate((1.0, 0.7, 1.49, 0.68, 1.2), start=1):
        held = decide(view=view, metrics=metrics(ratio, 1.0), policy=pol, state=state, now=t)
        assert (held.direction, held.actions) == ("hold", ()), ratio
        assert "hysteresis" in held.reason
        state = held.next_state
    back = decide(view=view, metrics=metrics(0.5, 1.0), policy=pol, state=state, now=10.0)
    assert back.direction == "return"
    assert back.granted == 0


def test_cooldown_blocks_a_reversal_until_the_change_settles() -> None:
    view = uniform_cluster(2, [1] * 8)
    pol = policy(cooldown_s=60.0, engine_restart_s=30.0, release_resume_s=3.0, max_hybrids=2)
    d = decide(view=view, metrics=BORROW, policy=pol, state=FRESH, now=100.0)
    assert d.direction == "borrow"
    assert d.next_state == PlannerState(
        last_change_at=100.0, last_direction="borrow", settle_s=90.0
    )
    view, _ = apply_decision(view, d)
    early = decide(view=view, metrics=RETURN, policy=pol, state=d.next_state, now=150.0)
    assert (early.direction, early.actions) == ("hold", ())
    assert "cooldown" in early.reason
    assert early.next_state == d.next_state
    late = decide(view=view, metrics=RETURN, policy=pol, state=d.next_state, now=190.0)
    assert late.direction == "return"
    assert late.granted == 0
    assert late.next_state.settle_s == 90.0  # the return restarts engines: restart cost
    # A change that touches no engine settles after cooldown + release/resume cost only.
    b = ClusterBuilder()
    b.host("a")
    b.free("a", 4)
    b.engine("a", 4)
    cheap = decide(view=b.build(), metrics=BORROW, policy=pol, state=FRESH, now=0.0)
    assert actions_of(cheap, StopEngine) == []
    assert cheap.next_state.settle_s == 63.0
