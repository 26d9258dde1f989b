"""From the world to the planner and back: snapshots, decisions as events, pending intents.

What it knows: how to take a `ClusterView` of a `World` (at its version), how to turn a
planner `Decision` into the events that carry it out through the machines — first the decision
record itself (refused if the world moved since the snapshot: a stale decision is recomputed,
never applied), then one event per action — and how to hold the actions that must wait (a
Hybrid allocation waits for the GPUs its engine stop frees, an engine restart for the GPUs a
leaving replica frees, a leave for the step boundary) as `Intent`s that `ready_events` releases
when their precondition holds. Every event is still re-checked by the guards when it is handled.

What it does not know: clocks and id generation (the caller passes `now` and `new_id`), sockets,
or how commands are performed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ehp_fsm.core.guards import BUSY_STEP_STATES
from ehp_fsm.core.planner_model import (
    CancelJoin,
    ClusterView,
    CoreLayout,
    Decision,
    EngineView,
    GpuView,
    HybridView,
    RestartEngine,
    StartHybrid,
    StopEngine,
    StopHybrid,
)
from ehp_fsm.core.world import Event, World

CAPACITY = ("capacity", "grp")


@dataclass(frozen=True, slots=True)
class Intent:
    """An action waiting for its precondition: `allocate` (GPUs free), `launch_engine` (GPUs
    free), or `leave` (a step boundary)."""

    kind: str
    machine: str
    instance: str
    host: str = ""
    gpus: tuple[str, ...] = ()
    tp: int = 0
    token: str = ""


def cluster_view(world: World, *, inflight: Mapping[str, int] | None = None) -> ClusterView:
    """The planner's snapshot of `world`, stamped with its version. `inflight` (groups
    dispatched per engine) is counted from the world's requests unless the caller keeps it
    indexed (`ehp-fsm simulate` does: the requests grow with every step)."""
    if inflight is None:
        inflight = _inflight(world)
    gpus = tuple(
        GpuView(gpu_id=g.id, host=str(g.get("host")), state=g.state, owner=g.get("owner"))
        for g in sorted(world.of("gpu").values(), key=lambda g: g.id)
    )
    engines = tuple(
        EngineView(
            engine_id=e.id,
            host=str(e.get("host")),
            tp=int(e.get("tp")),
            gpu_ids=tuple(e.get("gpus")),
            state=e.state,
            active_requests=inflight.get(e.id, 0),
        )
        for e in sorted(world.of("rollout_engine").values(), key=lambda e: e.id)
    )
    hybrids = tuple(
        HybridView(
            hybrid_id=h.id,
            host=str(h.get("host", "")),
            gpu_ids=tuple(h.get("gpus") or ()),
            state=h.state,
        )
        for h in sorted(world.of("hybrid_replica").values(), key=lambda h: h.id)
    )
    hosts = tuple(sorted({g.host for g in gpus} | {h.host for h in hybrids if h.host}))
    core = CoreLayout(
        replicas=len(world.config.get("core_replicas", ())),
        replica_size=int(world.config.get("replica_size", 1)),
    )
    return ClusterView(
        version=world.version, hosts=hosts, gpus=gpus, engines=engines, hybrids=hybrids, core=core
    )


def _inflight(world: World) -> dict[str, int]:
    inflight: dict[str, int] = {}
    for r in world.of("request").values():
        if r.state == "dispatched":
            eid = str(r.get("engine"))
            inflight[eid] = inflight.get(eid, 0) + 1
    return inflight


def decision_events(
    decision: Decision, now: float, new_id: Callable[[str], str]
) -> tuple[list[Event], list[Intent]]:
    """The events to handle now (the decision record first) and the intents to hold.

    `new_id(kind)` names new instances and launch tokens (`"hybrid"`, `"engine"`, `"token"`).
    Handle the events in order; if the first (the decision record) is refused as stale, drop the
    rest and recompute.
    """
    corr = f"decision-v{decision.based_on_version}"
    record = {
        "based_on_version": decision.based_on_version,
        "wanted": decision.wanted,
        "granted": decision.granted,
        "reason": decision.reason if decision.shortfall is None else decision.shortfall.reason,
        "actions": [a.key for a in decision.actions],
    }
    name = "decided" if decision.shortfall is None else "fell_short"
    events = [Event(*CAPACITY, name, now, record, corr)]
    intents: list[Intent] = []
    for a in decision.actions:
        if isinstance(a, StopEngine):
            events.append(
                Event("rollout_engine", a.engine_id, "drain", now, {"reason": a.reason}, corr)
            )
        elif isinstance(a, CancelJoin):
            events.append(
                Event("hybrid_replica", a.hybrid_id, "cancel", now, {"reason": a.reason}, corr)
            )
        elif isinstance(a, StopHybrid):
            intents.append(Intent("leave", "hybrid_replica", a.hybrid_id, a.host, a.gpu_ids))
        elif isinstance(a, StartHybrid):
            hid = new_id("hybrid")
            events.append(Event("hybrid_replica", hid, "request", now, {"reason": a.reason}, corr))
            intents.append(
                Intent("allocate", "hybrid_replica", hid, a.host, a.gpu_ids, token=new_id("token"))
            )
        elif isinstance(a, RestartEngine):
            intents.append(
                Intent(
                    "launch_engine",
                    "rollout_engine",
                    new_id("engine"),
                    a.host,
                    a.gpu_ids,
                    tp=a.tp,
                    token=new_id("token"),
                )
            )
    return events, intents


def _gpus_free(world: World, gpus: Sequence[str]) -> bool:
    ledger = world.of("gpu")
    return all(g in ledger and ledger[g].state == "free" for g in gpus)


def ready_events(
    intents: Sequence[Intent], world: World, now: float
) -> tuple[list[Event], list[Intent]]:
    """Events for intents whose precondition holds now, and the intents still waiting.

    An intent whose instance has ended (a request cancelled or failed at its deadline) is
    dropped: its GPUs, if any, were handed to the finalizer by that transition.
    """
    events: list[Event] = []
    waiting: list[Intent] = []
    busy = any(s.state in BUSY_STEP_STATES for s in world.of("training_step").values())
    for it in intents:
        inst = world.get(it.machine, it.instance)
        if it.kind == "allocate":
            if inst is None or inst.state != "requested":
                continue
            if _gpus_free(world, it.gpus):
                events.append(
                    Event(
                        "hybrid_replica",
                        it.instance,
                        "allocate",
                        now,
                        {"host": it.host, "gpus": list(it.gpus)},
                    )
                )
                events.append(
                    Event("hybrid_replica", it.instance, "launch", now, {"token": it.token})
                )
                continue
        elif it.kind == "launch_engine":
            if inst is not None:
                continue
            if _gpus_free(world, it.gpus):
                events.append(
                    Event(
                        "rollout_engine",
                        it.instance,
                        "launch",
                        now,
                        {"host": it.host, "gpus": list(it.gpus), "tp": it.tp, "token": it.token},
                    )
                )
                continue
        elif it.kind == "leave":
            if inst is None or inst.state != "active":
                continue
            if not busy:
                events.append(Event("hybrid_replica", it.instance, "leave", now))
                continue
        waiting.append(it)
    return events, waiting
