"""Which GPUs the planner takes and how it gives them back (issue 4, parts 3 and 5)."""

from __future__ import annotations

import pytest

from ehp_fsm.core.planner import (
    PlannerState,
    RestartEngine,
    StartHybrid,
    StopEngine,
    decide,
)
from ehp_fsm.core.planner_alloc import partition_tps
from tests.planner.cluster import ClusterBuilder, actions_of, metrics, policy

BORROW = metrics(1000.0, 1.0)  # training-bound on any GPUs left: the prediction wants them all
FRESH = PlannerState()


def test_free_reserve_gpus_are_used_before_any_engine_stops() -> None:
    b = ClusterBuilder()
    b.host("a")
    b.engine("a", 4)
    b.free("a", 4)
    d = decide(
        view=b.build(),
        metrics=BORROW,
        policy=policy(rollout_reserve=0, max_hybrids=1),
        state=FRESH,
        now=0.0,
    )
    assert actions_of(d, StopEngine) == []
    (start,) = actions_of(d, StartHybrid)
    assert start.after_stops == ()


def test_the_choice_that_loses_the_least_rollout_capacity_wins() -> None:
    b = ClusterBuilder()
    b.host("a")
    b.engine("a", 8, name="big")
    b.host("b")
    b.engine("b", 4, name="small0")
    b.engine("b", 4, name="small1")
    d = decide(
        view=b.build(),
        metrics=BORROW,
        policy=policy(rollout_reserve=0, max_hybrids=1),
        state=FRESH,
        now=0.0,
    )
    assert [a.engine_id for a in actions_of(d, StopEngine)] == ["small0"]
    assert d.serving_gpus_after == 12


def test_the_choice_that_strands_the_fewest_gpus_wins() -> None:
    b = ClusterBuilder()
    b.host("a")
    b.free("a", 2)
    b.engine("a", 4, name="a4")  # 2 free + 4 stopped = 6, 2 stranded
    b.engine("a", 2, name="a2")
    b.host("b")
    b.engine("b", 4, name="b4")  # 4 stopped, none stranded
    b.engine("b", 4, name="b4x")
    pol = policy(rollout_reserve=0, max_hybrids=1)
    d = decide(view=b.build(), metrics=BORROW, policy=pol, state=FRESH, now=0.0)
    # Host a could also do it with a2 alone (2 free + 2 = 4, nothing stranded, 2 GPUs lost).
    assert [a.engine_id for a in actions_of(d, StopEngine)] == ["a2"]
    # Without a2, host a would strand 2 GPUs for the same 4 lost: host b wins.
    b2 = ClusterBuilder()
    b2.host("a")
    b2.free("a", 2)
    b2.engine("a", 4, name="a4")
    b2.host("b")
    b2.engine("b", 4, name="b4")
    d2 = decide(view=b2.build(), metrics=BORROW, policy=pol, state=FRESH, now=0.0)
    assert [a.engine_id for a in actions_of(d2, StopEngine)] == ["b4"]


def test_among_equal_engines_the_least_loaded_is_stopped() -> None:
    b = ClusterBuilder()
    b.host("a")
    b.engine("a", 4, name="busy", load=9)
    b.engine("a", 4, name="idle", load=0)
    d = decide(
        view=b.build(),
        metrics=BORROW,
        policy=policy(rollout_reserve=0, max_hybrids=1),
        state=FRESH,
        now=0.0,
    )
    assert [a.engine_id for a in actions_of(d, StopEngine)] == ["idle"]


def test_a_stop_whose_engine_gpus_are_quarantined_is_never_planned() -> None:
    b = ClusterBuilder()
    b.host("a")
    b.engine("a", 4)
    b.silence_agent("a")
    b.host("b")
    b.engine("b", 4, name="ok")
    b.host("c")
    b.engine("c", 4, name="spare")  # keeps rollout alive: a move may not stop every engine
    view = b.build()
    d = decide(
        view=view,
        metrics=BORROW,
        policy=policy(rollout_reserve=0, max_hybrids=1),
        state=FRESH,
        now=0.0,
    )
    assert d.serving_gpus == 8  # the silent host's engine does not count as serving
    assert [a.engine_id for a in actions_of(d, StopEngine)] == ["ok"]


def _returning(tp_hint: str, *, queue_pressure: float, allowed: tuple[int, ...]) -> list[int]:
    b = ClusterBuilder(replica_size=2)
    b.host("a")
    b.hybrid("a", state="active")  # its 2 GPUs were a TP2 engine before the borrow
    pol = policy(replica_size=2, rollout_reserve=0, allowed_engine_tps=allowed)
    d = decide(
        view=b.build(),
        metrics=metrics(1.0, 1000.0, queue_pressure=queue_pressure),
        policy=pol,
        state=FRESH,
        now=0.0,
    )
    restarts = actions_of(d, RestartEngine)
    assert all(len(r.gpu_ids) == r.tp and r.host == "a" for r in restarts), tp_hint
    return [r.tp for r in restarts]


def test_returned_gpus_restart_as_two_tp1_engines_under_a_backlog() -> None:
    assert _returning("backlog", queue_pressure=2.0, allowed=(1, 2)) == [1, 1]


def test_returned_gpus_restart_as_one_tp2_engine_without_a_backlog() -> None:
    assert _returning("idle", queue_pressure=0.0, allowed=(1, 2)) == [2]


@pytest.mark.parametrize(
    ("n", "allowed", "prefer_small", "expected"),
    [
        (8, (1, 2, 4, 8), False, (8,)),
        (8, (1, 2, 4, 8), True, (1,) * 8),
        (6, (2, 4), False, (4, 2)),
        (6, (4,), False, (4,)),  # 2 GPUs stranded: no allowed TP fits them
        (3, (2, 4), True, (2,)),
        (1, (2,), False, ()),
    ],
)
def test_partition_rule(
    n: int, allowed: tuple[int, ...], prefer_small: bool, expected: tuple[int, ...]
) -> None:
    assert partition_tps(n, allowed, prefer_small) == expected


def test_actions_have_stable_unique_idempotency_keys() -> None:
    b = ClusterBuilder()
    b.host("a")
    for _ in range(9):  # the ninth keeps rollout alive after two replicas of 4
        b.engine("a", 1)
    view = b.build()
    pol = policy(rollout_reserve=0, max_hybrids=2)
    d = decide(view=view, metrics=BORROW, policy=pol, state=FRESH, now=0.0)
    keys = [a.key for a in d.actions]
    assert len(keys) == len(set(keys)) == 10
    assert keys == [
        a.key for a in decide(view=view, metrics=BORROW, policy=pol, state=FRESH, now=0.0).actions
    ]
