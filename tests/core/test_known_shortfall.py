"""A shortfall the capacity machine already holds is nothing new to decide — unless the engines
still installing the new revision would meet it once they serve.

Real orchestrator world (`tests/core/scenario.py`: engines e0 on h1:g0 and e2 on h2:g0 serving,
and e1 on h1:g1 or that GPU free), the real planner on the world's own view, and the run's and
the simulator's step-boundary test (`run.decisions.idle_once_settled`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ehp_fsm.core.execution import cluster_view
from ehp_fsm.core.planner import decide
from ehp_fsm.core.planner_model import ClusterView, Decision, Metrics, PlannerState
from ehp_fsm.plan import load_plan
from ehp_fsm.run.decisions import idle, idle_once_settled, settled
from tests.core.scenario import LOCAL_PLAN, Scenario


def _world_short_of_one(
    reserve: int, *, e1: bool = False
) -> tuple[Scenario, ClusterView, Decision, Callable[[ClusterView], Decision]]:
    s = Scenario()
    s.serving_engine("e0", "h1:g0", "h1")
    if e1:
        s.serving_engine("e1", "h1:g1", "h1")
    s.reserve_engine()  # e2 on h2:g0
    policy = dataclasses.replace(
        load_plan(LOCAL_PLAN).planner_policy(), min_hybrids=1, rollout_reserve=reserve
    )
    times = Metrics(train_seconds=1.0, rollout_seconds=1.0, steps_left=10)

    def decide_on(view: ClusterView) -> Decision:
        return decide(view=view, metrics=times, policy=policy, state=PlannerState(), now=s.now)

    # the shortfall held: the floor of 1 recorded as not met (wanted 1, granted 0)
    s.ok(
        "capacity",
        "grp",
        "fell_short",
        based_on_version=s.world.version,
        wanted=1,
        granted=0,
        reason="floor",
        actions=[],
    )
    s.publish(2)
    s.ok("rollout_engine", "e0", "update", revision=2)  # e0 installs r2: not one to drain
    view = cluster_view(s.world)
    return s, view, decide_on(view), decide_on


def test_the_held_shortfall_again_is_idle_where_the_settled_world_cannot_meet_it() -> None:
    # every GPU an engine's, all three the reserve
    s, view, d, decide_on = _world_short_of_one(reserve=3, e1=True)
    assert not d.actions and d.shortfall is not None
    assert (d.shortfall.wanted, d.shortfall.granted) == (1, 0)
    assert idle(d, s.world)
    assert idle_once_settled(d, s.world, view, decide_on)  # (e0 serving changes nothing)


def test_a_held_shortfall_the_installing_engine_would_meet_is_waited_for() -> None:
    # h1:g1 free: not to be borrowed while only e2 serves (the reserve is 2), and borrowed
    # once e0 serves again
    s, view, d, decide_on = _world_short_of_one(reserve=2)
    assert not d.actions and d.shortfall is not None
    assert idle(d, s.world)  # the same shortfall as held ...
    assert not idle_once_settled(d, s.world, view, decide_on)  # ... but e0 serving meets it
    assert decide_on(settled(view)).actions  # (a borrow of the free GPU)


def test_another_shortfall_than_the_one_held_is_recorded() -> None:
    s, _view, d, _decide_on = _world_short_of_one(reserve=3, e1=True)
    assert d.shortfall is not None
    other = dataclasses.replace(d, shortfall=dataclasses.replace(d.shortfall, wanted=2), wanted=2)
    assert not idle(other, s.world)
