"""Planner decisions carried out through the loop: the events now, the intents when ready.

`carry_out(decision)` posts the decision record first (refused when the world moved since the
planner's snapshot: a stale decision is recomputed, never applied), then one event per action;
an engine to stop is drained (its groups requeued, generation paused with retract, its requests
aborted) and reported `drained` at once. The actions that must wait — a Hybrid's allocation for
the GPUs its engine's stop frees, an engine restart for the GPUs a leaving replica frees, a leave
for the step boundary — are held as intents (`core.execution`), and each turn of the loop
(`poll`) posts those whose precondition holds. A planned borrow or return and the end-of-run
return take exactly this path.

Knows: the intents in flight, how to name new instances. Does not know: when to decide (the
job), the planner's reasons, or how any command is performed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Final

from ehp_fsm.core.execution import Intent, decision_events, ready_events
from ehp_fsm.core.planner import decide, rollout_gpus
from ehp_fsm.core.planner_model import ClusterView, Decision, Metrics, PlannerPolicy, PlannerState
from ehp_fsm.core.planner_predict import RolloutPace, StepTimes, shape_of
from ehp_fsm.core.transition import Accepted, Command, Outcome
from ehp_fsm.core.world import World
from ehp_fsm.runtime.identity import new_launch_token
from ehp_fsm.shell.loop import Door, Route

#: A borrowed Hybrid on its way (not yet `ready`). The trainer holds its pool for a whole step,
#: and a Hybrid's launch and state load need the pool: so a step boundary waits for these
#: (bounded by their deadlines), and the Hybrid joins at this boundary instead of waiting out
#: the next step with its launch or load deadline running.
BORROW_ON_THE_WAY: Final = ("requested", "allocated", "launching", "loading")
HYBRID: Final = "hybrid_replica"


def borrows_on_the_way(world: World, among: Iterable[str] | None = None) -> list[str]:
    """The Hybrids (of `among`, else all) that are on their way, in order."""
    hybrids = world.of(HYBRID)
    ids = sorted(hybrids) if among is None else among
    return [h for h in ids if (i := hybrids.get(h)) is not None and i.state in BORROW_ON_THE_WAY]


def idle(decision: Decision, world: World) -> bool:
    """Nothing to carry out: no move, and either no shortfall with the capacity machine
    `steady` (no shortfall recorded earlier to clear), or the very shortfall it holds (the
    same wanted and granted: a floor or a count that does not fit stays recorded, and was
    recorded again at every step boundary). Such a decision is not recorded; its planner state
    is kept. Known from a world whose engines are still installing the last revision, a
    decision without a shortfall is idle only where the settled world's would be too (the
    installing engines add engines to drain and reserve GPUs, which only a move or a shortfall
    needs); one with a shortfall may be met once they serve (`idle_once_settled`)."""
    cap = world.get("capacity", "grp")
    if decision.actions or cap is None:
        return False
    if decision.shortfall is None:
        return cap.state == "steady"
    held = cap.get("shortfall")
    return (
        cap.state == "short"
        and isinstance(held, dict)
        and held.get("wanted") == decision.shortfall.wanted
        and held.get("granted") == decision.shortfall.granted
    )


def planner_turn(
    view: ClusterView,
    *,
    pace: RolloutPace,
    step_times: StepTimes,
    dispatched: tuple[float, int],
    groups: int,
    train_s: float,
    rollout_s: float,
    steps_left: int,
    policy: PlannerPolicy,
    state: PlannerState,
    now: Callable[[], float],
) -> Callable[[ClusterView], Decision]:
    """A step boundary's planner: the step's times (`dispatched`: the dispatcher's busy
    GPU-seconds and completions, `Dispatcher.pace()`) added to the rollout pace and the
    step-time model, then the decision on a view of the world from those times and `state`,
    at `now()` read at each call (a move is decided again once the installs settle). The
    run's `Job.plan_next` and the simulator's `Story.plan_next` decide through it."""
    busy_gpu_s, completed = dispatched
    rollout_s = pace.add(
        busy_gpu_s=busy_gpu_s,
        completed=completed,
        groups=groups,
        serving_gpus=rollout_gpus(view),
        waited_s=rollout_s,
        train_s=train_s,
    )
    train, rollout = step_times.add(shape_of(view), train_s, rollout_s)
    metrics = Metrics(
        train_seconds=max(train, 1e-6),
        rollout_seconds=max(rollout, 1e-6),
        steps_left=steps_left,
    )

    def decide_on(view: ClusterView) -> Decision:
        return decide(view=view, metrics=metrics, policy=policy, state=state, now=now())

    return decide_on


def settled(view: ClusterView) -> ClusterView:
    """`view` at its most: every engine installing a revision (`updating` the new one, or
    `installing` its first after a start) serving. A shortfall this view cannot meet, no wait
    for the installs meets."""
    engines = tuple(
        replace(e, state="serving") if e.state in ("updating", "installing") else e
        for e in view.engines
    )
    return replace(view, engines=engines)


def idle_once_settled(
    decision: Decision,
    world: World,
    view: ClusterView,
    decide_on: Callable[[ClusterView], Decision],
) -> bool:
    """Whether `decision`, taken from `view` of a world whose engines are still installing, is
    idle and stays idle once they serve: a shortfall that is the one held is decided again on
    the settled view (`decide_on`: the same planner, state and times). A floor that does not fit
    waited for every engine's install at every step boundary; a shortfall that the installing
    engines would meet is still waited for."""
    if not idle(decision, world):
        return False
    return decision.shortfall is None or idle(decide_on(settled(view)), world)


@dataclass(frozen=True)
class CarriedOut:
    """What a decision started: the Hybrids it requests, the engines it drains (with their
    GPUs) and restarts, the Hybrids it makes leave."""

    borrows: tuple[Intent, ...]
    drained: dict[str, tuple[str, ...]]
    leaves: tuple[str, ...]
    restarts: tuple[str, ...]


class Decisions:
    """See the module docstring. A performer with no command of its own (`poll` only)."""

    routes: frozenset[Route] = frozenset()

    def __init__(self, door: Door, *, drain: Callable[[str], list[Outcome]]) -> None:
        self.door = door
        self.drain = drain  # the dispatcher's: drain, then drained
        self.intents: list[Intent] = []
        self._ids = itertools.count(1)

    def new_id(self, kind: str) -> str:
        n = next(self._ids)
        return {"hybrid": f"x{n}", "engine": f"r{n}"}.get(kind) or new_launch_token()

    def carry_out(self, decision: Decision) -> CarriedOut | None:
        """Post `decision` (None when it is refused as stale: nothing of it happened)."""
        events, intents = decision_events(decision, self.door.now(), self.new_id)
        if not isinstance(self.door.post(events[0]), Accepted):
            return None
        drained: dict[str, tuple[str, ...]] = {}
        for ev in events[1:]:
            if ev.machine == "rollout_engine" and ev.name == "drain":
                inst = self.door.world.get("rollout_engine", ev.instance)
                drained[ev.instance] = tuple(inst.get("gpus") or ()) if inst is not None else ()
                self.drain(ev.instance)
            else:
                self.door.post(ev)
        self.intents += intents
        self.poll(0.0)  # what may go at once goes now
        return CarriedOut(
            borrows=tuple(i for i in intents if i.kind == "allocate"),
            drained=drained,
            leaves=tuple(i.instance for i in intents if i.kind == "leave"),
            restarts=tuple(i.instance for i in intents if i.kind == "launch_engine"),
        )

    def pending(self) -> bool:
        return bool(self.intents)

    def perform(self, command: Command) -> None:
        return None  # no routes: never called

    def poll(self, timeout_s: float) -> None:
        events, self.intents = ready_events(self.intents, self.door.world, self.door.now())
        for ev in events:
            self.door.post(ev)

    def close(self) -> None:
        self.intents.clear()
