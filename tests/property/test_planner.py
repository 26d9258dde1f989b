"""Planner properties over random clusters, metrics and failures (issue 4).

Clusters: 1-5 hosts of 2, 4 or 8 GPUs, carved into engines of mixed TP in every engine state,
Hybrid replicas in every state, Core and free GPUs; failures are engine crashes (failed engines
keep their GPUs) and agent silence (a host's GPUs are quarantined). After each decision is applied
with the tiny simulator in `tests.planner.cluster`, the invariants below must hold.
"""

from __future__ import annotations

import dataclasses
import itertools

from hypothesis import event, given
from hypothesis import strategies as st

from ehp_fsm.core.planner import (
    ClusterView,
    Decision,
    Metrics,
    PlannerPolicy,
    PlannerState,
    StartHybrid,
    StopEngine,
    decide,
    serving_gpus,
    validate_decision,
)
from tests.planner.cluster import CURRENT, ClusterBuilder, apply_decision, current_hybrids

ENGINE_STATES = ("serving",) * 6 + ("starting", "installing", "updating", "draining", "stopping")
HYBRID_STATES = (*CURRENT, "leaving")


@st.composite
def clusters(draw: st.DrawFn) -> tuple[ClusterView, int]:
    rs = draw(st.sampled_from((1, 2, 4, 8)))
    per_host = draw(st.sampled_from((2, 4, 8)))
    b = ClusterBuilder(replica_size=rs)
    for i in range(draw(st.integers(1, 5))):
        host = f"h{i}"
        b.host(host)
        left = per_host
        while left > 0:
            kind = draw(st.sampled_from(("engine", "engine", "engine", "free", "hybrid", "core")))
            if kind == "engine":
                tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if t <= left]))
                state = draw(st.sampled_from(ENGINE_STATES))
                eid = b.engine(host, tp, state=state, load=draw(st.integers(0, 3)))
                if draw(st.integers(0, 9)) == 0:
                    b.crash_engine(eid)
                left -= tp
            elif kind == "hybrid" and rs <= left:
                state = draw(st.sampled_from(HYBRID_STATES))
                b.hybrid(host, state=state)
                left -= 0 if state == "requested" else rs
            elif kind == "core":
                n = draw(st.integers(1, left))
                b.core(host, n)
                left -= n
            else:
                n = draw(st.integers(1, left))
                b.free(host, n)
                left -= n
        if draw(st.integers(0, 7)) == 0:
            b.silence_agent(host)
    return b.build(version=draw(st.integers(0, 50))), rs


@st.composite
def situations(
    draw: st.DrawFn, *, borrowing: bool = False
) -> tuple[ClusterView, Metrics, PlannerPolicy, PlannerState, float]:
    """A random situation; `borrowing=True` fixes the metrics and memory so the planner borrows."""
    view, rs = draw(clusters())
    total = len(view.gpus)
    tps = draw(st.sets(st.sampled_from((1, 2, 4, 8)), min_size=1))
    release = draw(st.floats(0.2, 1.0))
    policy = PlannerPolicy(
        rollout_reserve=draw(st.one_of(st.integers(0, total // 3), st.integers(0, total))),
        replica_size=rs,
        allowed_engine_tps=tuple(sorted(tps)),
        borrow_threshold=release + draw(st.floats(0.05, 2.0)),
        release_threshold=release,
        cooldown_s=draw(st.sampled_from((0.0, 10.0, 60.0))),
        engine_restart_s=30.0,
        release_resume_s=3.0,
        max_hybrids=(most := draw(st.one_of(st.integers(1, 8), st.integers(0, 8)))),
        min_hybrids=draw(st.one_of(st.just(0), st.integers(0, most))),
    )
    rollout = draw(st.floats(0.5, 40.0))
    ratio = draw(st.one_of(st.sampled_from((0.1, 4.0, 4.0, 1.0)), st.floats(0.05, 5.0)))
    metrics = Metrics(
        train_seconds=rollout * ratio,
        rollout_seconds=rollout,
        queue_pressure=draw(st.sampled_from((0.0, 0.0, 0.5, 2.0))),
        active_pressure=draw(st.sampled_from((0.0, 0.0, 0.3, 1.5))),
        accepted=draw(st.integers(0, 10)),
        rejected=draw(st.sampled_from((0, 0, 0, 0, 2))),
    )
    if borrowing:
        metrics = Metrics(train_seconds=20.0, rollout_seconds=5.0)
        return view, metrics, policy, PlannerState(), 100.0
    state = draw(
        st.one_of(
            st.just(PlannerState()),
            st.builds(
                PlannerState,
                last_change_at=st.floats(0.0, 100.0),
                last_direction=st.sampled_from(("borrow", "return")),
                settle_s=st.sampled_from((0.0, 33.0, 90.0)),
            ),
        )
    )
    return view, metrics, policy, state, 100.0


def _one_more_replica_fits(view: ClusterView, policy: PlannerPolicy) -> str | None:
    """Brute-force oracle: a host that could still yield one complete replica within the reserve."""
    budget = serving_gpus(view) - policy.rollout_reserve
    if budget < 0:
        return None
    gpus = {g.gpu_id: g for g in view.gpus}
    for host in view.hosts:
        free = sum(1 for g in view.gpus if g.host == host and g.state == "free")
        pickable = [
            e.tp
            for e in view.engines
            if e.host == host
            and e.state == "serving"
            and all(gpus[x].state == "owned" and gpus[x].owner == e.owner for x in e.gpu_ids)
        ]
        for r in range(len(pickable) + 1):
            for subset in itertools.combinations(pickable, r):
                if sum(subset) <= budget and free + sum(subset) >= policy.replica_size:
                    return host
    return None


def _check(view: ClusterView, policy: PlannerPolicy, d: Decision) -> None:
    rs = policy.replica_size
    before = serving_gpus(view)
    event(f"direction={d.direction}, actions={'yes' if d.actions else 'no'}")
    event(f"shortfall={d.shortfall is not None}, below_reserve={before < policy.rollout_reserve}")
    stops = [a for a in d.actions if isinstance(a, StopEngine)]
    starts = [a for a in d.actions if isinstance(a, StartHybrid)]
    # A fresh decision is valid for the world it was computed from.
    assert validate_decision(d, view) is None, validate_decision(d, view)
    # Shortfall exactly when wanted > granted.
    assert (d.shortfall is not None) == (d.wanted > d.granted)
    # No serving engine is stopped on account of a shortfall: every stop feeds a new replica.
    fed = {eid for s in starts for eid in s.after_stops}
    assert {s.engine_id for s in stops} <= fed
    # Every new replica is complete and on one host.
    for s in starts:
        assert len(s.gpu_ids) == rs
        assert {g.split(":")[0] for g in s.gpu_ids} == {s.host}
    after, _ = apply_decision(view, d)  # ClusterView re-validates: no GPU has two owners
    owners: dict[str, str] = {}
    for holder in (*after.engines, *after.hybrids):
        if holder.live:
            for gid in holder.gpu_ids:
                assert gid not in owners, (gid, owners.get(gid), holder)
                owners[gid] = holder.owner
    for h in after.hybrids:
        if h.live and h.gpu_ids:
            assert len(h.gpu_ids) == rs
            assert {g.split(":")[0] for g in h.gpu_ids} == {h.host}
    # The reserve holds unless failures alone broke it; then nothing is borrowed.
    served = serving_gpus(after)
    assert served == d.serving_gpus_after
    if before >= policy.rollout_reserve:
        assert served >= policy.rollout_reserve
    else:
        assert (stops, starts, served) == ([], [], before)
        if d.wanted > d.current:
            assert d.shortfall is not None
    # Granted is what the world holds once the actions are carried out.
    assert current_hybrids(after) == d.granted
    # No decision takes the Hybrids below the plan's floor (`min_hybrids`, cut to the groups
    # the batch has beside the Core).
    floor = policy.min_hybrids
    if policy.groups_per_step > 0:
        floor = max(0, min(floor, policy.groups_per_step - view.core.replicas))
    assert d.granted >= min(d.current, floor), (d.current, d.granted, floor, d.reason)
    # A shortfall is honest: no host could yield one more replica within the reserve.
    if d.shortfall is not None and before >= policy.rollout_reserve:
        assert _one_more_replica_fits(after, policy) is None
    # Applying the same decision twice acts once: stale by version, and a no-op by guards.
    assert validate_decision(d, after) is not None or not d.actions
    again, acted = apply_decision(after, d)
    assert acted == 0
    assert again == after


@given(situations())
def test_planner_invariants_hold_after_applying_a_decision(
    s: tuple[ClusterView, Metrics, PlannerPolicy, PlannerState, float],
) -> None:
    view, metrics, policy, state, now = s
    d = decide(view=view, metrics=metrics, policy=policy, state=state, now=now)
    _check(view, policy, d)


@given(situations())
def test_same_world_same_decision_in_any_order(
    s: tuple[ClusterView, Metrics, PlannerPolicy, PlannerState, float],
) -> None:
    view, metrics, policy, state, now = s
    d = decide(view=view, metrics=metrics, policy=policy, state=state, now=now)
    assert decide(view=view, metrics=metrics, policy=policy, state=state, now=now) == d
    shuffled = ClusterView(
        version=view.version,
        hosts=view.hosts[::-1],
        gpus=view.gpus[::-1],
        engines=view.engines[::-1],
        hybrids=view.hybrids[::-1],
        core=view.core,
    )
    assert decide(view=shuffled, metrics=metrics, policy=policy, state=state, now=now) == d


@given(situations(), st.integers(2, 4))
def test_repeated_decisions_keep_the_invariants(
    s: tuple[ClusterView, Metrics, PlannerPolicy, PlannerState, float], rounds: int
) -> None:
    """Decide, apply, decide again on the new world (time moving on): invariants every step."""
    view, metrics, policy, state, now = s
    for i in range(rounds):
        d = decide(view=view, metrics=metrics, policy=policy, state=state, now=now + 200.0 * i)
        _check(view, policy, d)
        view, _ = apply_decision(view, d)
        state = d.next_state


@given(situations(borrowing=True))
def test_borrow_decisions_keep_the_reserve_and_complete_one_host_sets(
    s: tuple[ClusterView, Metrics, PlannerPolicy, PlannerState, float],
) -> None:
    view, metrics, policy, state, now = s
    d = decide(view=view, metrics=metrics, policy=policy, state=state, now=now)
    _check(view, policy, d)


@given(situations(borrowing=True), st.integers(1, 12))
def test_a_borrow_never_asks_for_more_replicas_than_the_batch_has_groups(
    s: tuple[ClusterView, Metrics, PlannerPolicy, PlannerState, float], groups: int
) -> None:
    """Each replica trains whole groups, and the step's partition refuses a replica with none:
    the planner wants no more Hybrids than G − Core replicas (equal predicted times picked the
    most replicas, and G = 2 on a Core of 1 borrowed 2 Hybrids; the next step failed)."""
    view, metrics, policy, state, now = s
    policy = dataclasses.replace(policy, groups_per_step=groups)
    d = decide(view=view, metrics=metrics, policy=policy, state=state, now=now)
    _check(view, policy, d)
    if d.wanted > d.current:
        assert view.core.replicas + d.wanted <= groups, (view.core.replicas, d.wanted, groups)


@given(situations(), st.integers(0, 12))
def test_below_its_floor_the_planner_borrows_whatever_the_times_say(
    s: tuple[ClusterView, Metrics, PlannerPolicy, PlannerState, float], groups: int
) -> None:
    """`min_hybrids`: with fewer Hybrids current than the floor, a decision not held back by a
    return's cooldown borrows while one more replica fits within the reserve — for any
    measured times — and records a shortfall for what does not fit."""
    view, metrics, policy, state, now = s
    policy = dataclasses.replace(policy, groups_per_step=groups)
    d = decide(view=view, metrics=metrics, policy=policy, state=state, now=now)
    _check(view, policy, d)
    floor = policy.min_hybrids
    if groups > 0:
        floor = max(0, min(floor, groups - view.core.replicas))
    if d.current >= floor or state.blocks("borrow", now):
        return
    event("below the floor")
    assert d.wanted >= floor, d.reason
    if serving_gpus(view) >= policy.rollout_reserve and _one_more_replica_fits(view, policy):
        assert d.granted > d.current, d.reason
    if d.granted < floor:
        assert d.shortfall is not None, d.reason
