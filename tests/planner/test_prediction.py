"""The planner sizes its moves by a predicted step time (the thrash of session 11's simulation).

One borrow of `max_hybrids` used to halve training on a balanced plan, rollout on the engines
left became the bottleneck, everything went back, and again. These tests pin the sizing: a borrow
that would make rollout the bottleneck is cut to the count that balances, a balanced plan holds,
and a return gives back only what the prediction says.
"""

from __future__ import annotations

from ehp_fsm.core.planner import ClusterView, PlannerState, StartHybrid, StopHybrid, decide
from ehp_fsm.core.planner_predict import (
    KEPT_UP,
    RolloutPace,
    StepModel,
    StepTimes,
    shape_of,
)
from tests.planner.cluster import ClusterBuilder, actions_of, metrics, policy, uniform_cluster

FRESH = PlannerState()


def _four_hybrids() -> ClusterView:
    """4 active replicas of 2 GPUs on host a beside two TP4 engines (8 GPUs) on host b."""
    b = ClusterBuilder(replica_size=2)
    b.host("a")
    for _ in range(4):
        b.hybrid("a", state="active")
    b.host("b")
    b.engine("b", 4)
    b.engine("b", 4)
    return b.build()


def test_training_scales_with_the_largest_share_of_the_batch() -> None:
    """16 groups over 5 replicas: the partition gives one replica 4 (ceil), as over 4."""
    m = StepModel(
        train_s=16.0, rollout_s=1.0, train_replicas=1, rollout_gpus=8, groups=16, overlapped=True
    )
    assert m.predict(4, 8).train_s == 4.0
    assert m.predict(5, 8).train_s == 4.0
    assert m.predict(8, 8).train_s == 2.0
    assert m.predict(1, 4).rollout_s == 2.0
    assert m.predict(8, 4).step_s == 2.0  # max(train, rollout) when they overlap
    serial = StepModel(
        train_s=16.0, rollout_s=1.0, train_replicas=1, rollout_gpus=8, groups=16, overlapped=False
    )
    assert serial.predict(8, 4).step_s == 4.0  # train + rollout when they do not


def test_a_borrow_that_would_make_rollout_the_bottleneck_is_sized_down() -> None:
    """24 TP1 engines, 1 Core replica; train 4 s, rollout 2 s. All 5 replicas that fit would
    leave 4 GPUs: rollout 12 s. One replica: train 2 s, rollout 2.4 s — the best count."""
    view = uniform_cluster(3, [1] * 8)
    pol = policy(max_hybrids=8, groups_per_step=64)
    d = decide(view=view, metrics=metrics(4.0, 2.0), policy=pol, state=FRESH, now=0.0)
    assert d.direction == "borrow"
    assert (d.wanted, d.granted, d.shortfall) == (1, 1, None)
    assert len(actions_of(d, StartHybrid)) == 1
    assert d.serving_gpus_after == 20
    assert "predicted step 4 s" in d.reason and "2.4 s" in d.reason, d.reason


def test_a_balanced_plan_holds_when_no_borrow_shortens_the_step() -> None:
    """Ratio 1.6 is past the borrow threshold, but a replica of 4 out of 8 serving GPUs
    doubles rollout (2 s) while training drops to 0.8 s: holding (1.6 s) is better."""
    b = ClusterBuilder()
    b.host("a")
    b.engine("a", 4)
    b.engine("a", 4)
    pol = policy(rollout_reserve=0, max_hybrids=2)
    d = decide(view=b.build(), metrics=metrics(1.6, 1.0), policy=pol, state=FRESH, now=0.0)
    assert (d.direction, d.actions, d.shortfall) == ("hold", (), None)
    assert d.wanted == d.granted == d.current == 0
    assert d.next_state == FRESH  # nothing moved: no cooldown starts
    assert "no count of Hybrids shortens it" in d.reason


def test_a_return_gives_back_only_what_the_prediction_says() -> None:
    """4 active replicas of 2 GPUs beside 8 serving GPUs, 1 Core replica, 10 groups; train 1 s
    on 5 replicas (2 groups each), rollout 2 s. Returning 1 (4 replicas: 3 groups, 1.5 s of
    training; 10 GPUs: 1.6 s of rollout) beats holding (2 s), returning 2 (4 groups: 2 s) and
    returning all (10 groups on Core: 5 s) — the old planner returned all."""
    pol = policy(replica_size=2, rollout_reserve=0, max_hybrids=4, groups_per_step=10)
    d = decide(view=_four_hybrids(), metrics=metrics(1.0, 2.0), policy=pol, state=FRESH, now=0.0)
    assert d.direction == "return"
    assert (d.current, d.wanted, d.granted) == (4, 3, 3)
    assert len(actions_of(d, StopHybrid)) == 1
    assert "returning 1 of 4" in d.reason, d.reason


def test_near_the_end_a_move_that_cannot_earn_its_cost_back_is_not_made() -> None:
    """The borrow above saves 1.6 s a step and costs `release_resume_s` = 3 s: not with 1 step
    left, yes with 2. The return above saves 0.4 s a step and its engines restart for
    `engine_restart_s` = 30 s: not with 75 steps left (30 s), yes with 76. A return decided
    before the last step of the default run restarted an engine the run then waited 8 s for,
    only to stop it."""
    view = uniform_cluster(3, [1] * 8)
    pol = policy(max_hybrids=8, groups_per_step=64)

    def borrow(left: int) -> str:
        m = metrics(4.0, 2.0, steps_left=left)
        return decide(view=view, metrics=m, policy=pol, state=FRESH, now=0.0).direction

    assert (borrow(1), borrow(2)) == ("hold", "borrow")
    d = decide(view=view, metrics=metrics(4.0, 2.0, steps_left=1), policy=pol, state=FRESH, now=0)
    assert d.actions == () and d.next_state == FRESH
    assert "over the 1 step(s) left, not more than its cost of 3 s" in d.reason, d.reason

    back = _four_hybrids()
    pol = policy(replica_size=2, rollout_reserve=0, max_hybrids=4, groups_per_step=10)

    def give_back(left: int) -> tuple[str, int]:
        m = metrics(1.0, 2.0, steps_left=left)
        d = decide(view=back, metrics=m, policy=pol, state=FRESH, now=0.0)
        return d.direction, len(d.actions)

    assert give_back(75)[1] == 0
    assert give_back(76) == ("return", 2)  # StopHybrid + the restart of its GPUs


def test_one_noisy_step_does_not_move_the_planner_and_a_new_shape_starts_afresh() -> None:
    """The planner decides from the median of the last 3 steps of the current shape: one step
    whose rollout wait doubled (an install, a busy machine) does not turn a hold into a return
    that restarts an engine; a move (another shape) is measured from its own steps only."""
    view = _four_hybrids()
    pol = policy(replica_size=2, rollout_reserve=0, max_hybrids=4, groups_per_step=10)
    times = StepTimes()
    shape = shape_of(view)
    assert shape == (("a-h00", "a-h01", "a-h02", "a-h03"), ("b-e00", "b-e04"))

    def direction(train: float, rollout: float) -> str:
        t, r = times.add(shape, train, rollout)
        d = decide(view=view, metrics=metrics(t, r), policy=pol, state=FRESH, now=0.0)
        return d.direction if d.actions else "hold"

    assert [direction(1.0, 1.0), direction(1.0, 1.0)] == ["hold", "hold"]
    assert direction(1.0, 2.0) == "hold"  # alone, (1.0, 2.0) returns one (see above)
    assert times.add(shape, 1.0, 2.0) == (1.0, 2.0)  # a second such step: the median moves
    assert times.add("another shape", 3.0, 5.0) == (3.0, 5.0)  # nothing of the old shape


def test_min_hybrids_borrows_up_to_the_floor_whatever_the_prediction() -> None:
    """The balanced plan above holds on its prediction; with `min_hybrids = 1` the planner
    borrows one replica anyway, and says why. A shortfall is recorded for a floor that does
    not fit (the reserve keeps one engine of two serving)."""
    b = ClusterBuilder()
    b.host("a")
    b.engine("a", 4)
    b.engine("a", 4)
    view = b.build()
    pol = policy(rollout_reserve=0, max_hybrids=2, min_hybrids=1)
    d = decide(view=view, metrics=metrics(1.6, 1.0), policy=pol, state=FRESH, now=0.0)
    assert (d.direction, d.wanted, d.granted, d.shortfall) == ("borrow", 1, 1, None)
    assert len(actions_of(d, StartHybrid)) == 1
    assert "below the plan's min_hybrids 1: borrowing up to it" in d.reason, d.reason
    # a return signal (ratio 0.1) below the floor borrows too: the floor comes first
    d = decide(view=view, metrics=metrics(0.1, 1.0), policy=pol, state=FRESH, now=0.0)
    assert (d.direction, d.granted) == ("borrow", 1)
    short = policy(rollout_reserve=4, max_hybrids=2, min_hybrids=2)
    d = decide(view=view, metrics=metrics(1.6, 1.0), policy=short, state=FRESH, now=0.0)
    assert (d.wanted, d.granted) == (2, 1) and d.shortfall is not None
    assert "min_hybrids 2" in d.shortfall.reason, d.shortfall


def test_min_hybrids_is_never_returned_below_and_caps_at_the_batch() -> None:
    """The return above gives back 1 of 4 replicas; a floor of 4 keeps all, a floor of 3
    still lets that one go. A floor past the batch's groups beside the Core is cut to them."""
    pol = policy(replica_size=2, rollout_reserve=0, max_hybrids=4, groups_per_step=10)
    view = _four_hybrids()
    for floor, kept in ((4, 4), (3, 3)):
        d = decide(
            view=view,
            metrics=metrics(1.0, 2.0),
            policy=policy(
                replica_size=2,
                rollout_reserve=0,
                max_hybrids=4,
                groups_per_step=10,
                min_hybrids=floor,
            ),
            state=FRESH,
            now=0.0,
        )
        assert d.granted == kept, (floor, d.reason)
        assert len(actions_of(d, StopHybrid)) == 4 - kept
    assert pol.min_hybrids == 0
    b = ClusterBuilder()
    b.host("a")
    for _ in range(4):
        b.engine("a", 4)
    few = policy(rollout_reserve=0, max_hybrids=4, min_hybrids=4, groups_per_step=3)
    d = decide(view=b.build(), metrics=metrics(1.0, 1.0), policy=few, state=FRESH, now=0.0)
    assert (d.wanted, d.granted) == (2, 2), d.reason  # 3 groups: the Core and 2 Hybrids


def test_rollout_pace_stands_in_for_a_wait_that_reads_rollout_as_free() -> None:
    """The planner's rollout time is the step's wait for its groups, unless rollout kept up
    (a wait of at most 5 % of the step's training): then what the serving GPUs need for one
    step's G groups at the pace they generated since the last decision. 12 busy GPU-seconds
    for 8 groups on 3 GPUs is 4 s for 8 groups, though the step waited 0.001 s (the groups were
    made while the previous step trained). A material wait stands (a step waiting on its
    longest responses), and so does the wait without a group made in the window."""
    pace = RolloutPace()

    def add(busy: float, made: int, gpus: int, waited: float) -> float:
        return pace.add(
            busy_gpu_s=busy, completed=made, groups=8, serving_gpus=gpus, waited_s=waited, train_s=2
        )

    assert add(12.0, 8, 3, 0.001) == 4.0
    assert add(18.0, 12, 2, 0.0) == 6.0
    # a wait of 0.5 s against 2 s of training is material: it stands, though the pace says 6 s
    assert add(24.0, 16, 2, 0.5) == 0.5
    assert add(24.0, 16, 2, 0.05) == 0.05  # no group made since: nothing to pace by
    assert KEPT_UP == 0.05


def test_occupancy_counts_each_group_in_flight_as_a_share_of_its_engine() -> None:
    """A TP2 engine of 2 slots: one group from t=0 to 1 and one from 0.5 to 3 are 3.5
    slot-seconds, 1.75 s of the whole engine, 3.5 GPU-seconds; a group in flight now counts
    up to now; an end without a begin (a group requeued behind the dispatcher's back, then
    reported) counts nothing. One long response holds one slot, not the engine."""
    from ehp_fsm.rollout.dispatch import Occupancy

    o = Occupancy(slots=2)
    o.begin("e0", 2, 0.0)
    o.begin("e0", 2, 0.5)
    o.end("e0", 1.0)
    assert o.gpu_seconds(2.0) == 2.5  # (1 + 1.5) slot-s x 2 GPUs / 2 slots
    o.end("e0", 3.0)
    o.end("e0", 4.0)  # no group of it in flight: nothing
    o.end("e9", 4.0)
    assert o.gpu_seconds(10.0) == 3.5
    o.begin("e1", 1, 10.0)
    assert o.gpu_seconds(12.0) == 4.5


def test_occupancy_is_the_same_whatever_order_its_engines_end_in() -> None:
    """`ehp-fsm simulate` ends several engines' groups in the order of a set of ids (which a
    hash seed decides): the busy total is summed exactly, so the planner, and the log, are the
    same under any order."""
    import itertools

    from ehp_fsm.rollout.dispatch import Occupancy

    totals = set()
    for order in itertools.permutations(("a", "b", "c", "d")):
        o = Occupancy(slots=1)
        for eid, began in zip(("a", "b", "c", "d"), (0.9, 0.8, 0.7, 0.3), strict=True):
            o.begin(eid, 1, began)
        for eid in order:
            o.end(eid, 1.0)
        totals.add(o.gpu_seconds(1.0))
    assert len(totals) == 1, totals
