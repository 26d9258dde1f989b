"""Planner decisions carried out through the machines (issue: EHP resource lifecycle, part 4).

The engine is the one of `tests/core/plan.toml` (Core DP2 on h0; engines e0, e1 on h1 and e2 on
h2, TP1 each; reserve 1; replica_size 1; max 2 Hybrids). The agents' replies (drained, exited,
confirm_free, launched, ...) are fed as events by the test: this is the far edge a unit test
cannot have; the runtime tests drive the same events from real processes.
"""

from __future__ import annotations

import itertools

import pytest

from ehp_fsm.core.execution import Intent, cluster_view, decision_events, ready_events
from ehp_fsm.core.planner import decide
from ehp_fsm.core.planner_model import Decision, Metrics, PlannerState
from ehp_fsm.core.transition import Accepted, Rejected
from ehp_fsm.core.world import Event
from ehp_fsm.plan import load_plan
from tests.core.scenario import LOCAL_PLAN, Scenario, identity

POLICY = load_plan(LOCAL_PLAN).planner_policy()
BUSY_TRAINER = Metrics(train_seconds=20.0, rollout_seconds=5.0)
BUSY_ROLLOUT = Metrics(train_seconds=2.0, rollout_seconds=20.0)


class Driver(Scenario):
    def __init__(self) -> None:
        super().__init__()
        self.intents: list[Intent] = []
        self.memory = PlannerState()
        self.ids = itertools.count()
        for eid, gpu, host in (("e0", "h1:g0", "h1"), ("e1", "h1:g1", "h1"), ("e2", "h2:g0", "h2")):
            self.serving_engine(eid, gpu, host)

    def new_id(self, kind: str) -> str:
        return f"{kind[0]}{next(self.ids)}"

    def decide(self, metrics: Metrics) -> Decision:
        self.now += 100.0  # past any cooldown
        d = decide(
            view=cluster_view(self.world),
            metrics=metrics,
            policy=POLICY,
            state=self.memory,
            now=self.now,
        )
        self.memory = d.next_state
        return d

    def execute(self, d: Decision) -> list[Accepted | Rejected]:
        events, intents = decision_events(d, self.now, self.new_id)
        outs = [self.engine.handle(events[0])]
        if isinstance(outs[0], Accepted):
            outs += [self.engine.handle(e) for e in events[1:]]
            self.intents += intents
        return outs

    def tick(self) -> list[Accepted | Rejected]:
        events, self.intents = ready_events(self.intents, self.world, self.now)
        return [self.engine.handle(e) for e in events]

    def agent_stops_engine(self, eid: str, gpu: str, host: str) -> None:
        self.ok("rollout_engine", eid, "drained")
        self.ok("rollout_engine", eid, "exited", identity=identity(host, f"t-{eid}"))
        self.confirm_free(gpu, f"engine:{eid}")

    def agent_starts_hybrid(self, hid: str, host: str) -> None:
        token = self.world.get("hybrid_replica", hid).get("token")
        self.ok("hybrid_replica", hid, "launched", identity=identity(host, token, pid=900))
        self.ok("hybrid_replica", hid, "loaded", version=self.world.globals["core_version"])


def hybrids(d: Driver, state: str) -> list[str]:
    return sorted(h.id for h in d.world.of("hybrid_replica").values() if h.state == state)


def test_borrow_then_return_through_the_machines() -> None:
    d = Driver()
    dec = d.decide(BUSY_TRAINER)
    assert (dec.wanted, dec.granted, dec.shortfall) == (2, 2, None)
    outs = d.execute(dec)
    assert all(isinstance(o, Accepted) for o in outs)
    draining = sorted(e.id for e in d.world.of("rollout_engine").values() if e.state == "draining")
    assert len(draining) == 2
    assert d.tick() == []  # nothing allocates before the GPUs are confirmed free
    assert len(d.intents) == 2
    for eid in draining:
        e = d.world.get("rollout_engine", eid)
        d.agent_stops_engine(eid, e.get("gpus")[0], e.get("host"))
    outs = d.tick()
    assert [o.event.name for o in outs] == ["allocate", "launch"] * 2
    assert all(isinstance(o, Accepted) for o in outs)
    for hid in hybrids(d, "launching"):
        d.agent_starts_hybrid(hid, d.world.get("hybrid_replica", hid).get("host"))
        d.ok("hybrid_replica", hid, "activate")
    assert len(hybrids(d, "active")) == 2
    assert d.world.globals["epoch"] == 2
    serving = [e for e in d.world.of("rollout_engine").values() if e.state == "serving"]
    assert sum(len(e.get("gpus")) for e in serving) >= POLICY.rollout_reserve

    back = d.decide(BUSY_ROLLOUT)
    assert back.granted == 0 and back.direction == "return"
    assert all(isinstance(o, Accepted) for o in d.execute(back))
    assert [o.event.name for o in d.tick()] == ["leave", "leave"]
    assert d.world.globals["epoch"] == 4
    for hid in hybrids(d, "leaving"):
        h = d.world.get("hybrid_replica", hid)
        d.ok("hybrid_replica", hid, "exited", identity=h.get("identity"))
        d.confirm_free(h.get("gpus")[0], f"hybrid:{hid}")
    outs = d.tick()
    assert [o.event.name for o in outs] == ["launch", "launch"]
    for o in outs:
        assert isinstance(o, Accepted)
        eid, token = o.event.instance, o.event.payload["token"]
        host = o.event.payload["host"]
        d.ok("rollout_engine", eid, "healthy", identity=identity(host, token))
        d.ok("rollout_engine", eid, "installed", revision=d.world.globals["revision"])
    serving = [e for e in d.world.of("rollout_engine").values() if e.state == "serving"]
    assert len(serving) == 3
    assert d.world.get("capacity", "grp").state == "steady"


def test_stale_decision_is_refused_and_recomputed() -> None:
    d = Driver()
    dec = d.decide(BUSY_TRAINER)
    d.ok("request", "g0", "enqueue")  # the world moves on before the decision is applied
    (out,) = d.execute(dec)
    assert isinstance(out, Rejected)
    assert "recompute it from the current world" in out.reason
    assert all(e.state == "serving" for e in d.world.of("rollout_engine").values())
    fresh = d.decide(BUSY_TRAINER)
    assert all(isinstance(o, Accepted) for o in d.execute(fresh))


def test_shortfall_is_state_and_stops_nothing_then_clears() -> None:
    d = Driver()
    d.ok("rollout_engine", "e2", "fail", reason="crashed")
    d.confirm_free("h2:g0", "engine:e2")
    d.ok("rollout_engine", "e1", "drain")  # e1 not serving: only e0 serves = the reserve
    dec = d.decide(BUSY_TRAINER)
    assert dec.shortfall is not None and dec.granted < dec.wanted
    stops = [a for a in dec.actions if a.kind == "stop_engine"]
    assert stops == []
    d.execute(dec)
    cap = d.world.get("capacity", "grp")
    assert cap.state == "short"
    assert cap.get("shortfall")["wanted"] == dec.wanted
    assert d.state_of_engine("e0") == "serving"
    # capacity comes back: a decision met in full clears the shortfall
    d.agent_stops_engine("e1", "h1:g1", "h1")
    d.ok("rollout_engine", "e3", "launch", host="h1", gpus=["h1:g1"], tp=1, token="t-e3")
    d.ok("rollout_engine", "e3", "healthy", identity=identity("h1", "t-e3"))
    d.ok("rollout_engine", "e3", "installed", revision=1)
    d.ok("rollout_engine", "e4", "launch", host="h2", gpus=["h2:g0"], tp=1, token="t-e4")
    d.ok("rollout_engine", "e4", "healthy", identity=identity("h2", "t-e4"))
    d.ok("rollout_engine", "e4", "installed", revision=1)
    again = d.decide(Metrics(train_seconds=10.0, rollout_seconds=10.0))
    assert again.shortfall is None
    d.execute(again)
    assert d.world.get("capacity", "grp").state == "steady"
    assert d.world.get("capacity", "grp").get("shortfall") is None


def test_return_cancels_a_pending_join_and_frees_its_gpus() -> None:
    d = Driver()
    d.execute(d.decide(BUSY_TRAINER))
    for eid in [e.id for e in d.world.of("rollout_engine").values() if e.state == "draining"]:
        e = d.world.get("rollout_engine", eid)
        d.agent_stops_engine(eid, e.get("gpus")[0], e.get("host"))
    d.tick()
    joining = hybrids(d, "launching")
    assert len(joining) == 2
    back = d.decide(BUSY_ROLLOUT)
    assert {a.kind for a in back.actions} >= {"cancel_join"}
    d.execute(back)
    assert hybrids(d, "cancelled") == joining
    for hid in joining:
        gpu = d.world.get("hybrid_replica", hid).get("gpus")[0]
        assert d.world.get("gpu", gpu).state == "releasing"


def test_deadline_during_loading_releases_the_gpus() -> None:
    d = Driver()
    d.execute(d.decide(BUSY_TRAINER))
    for eid in [e.id for e in d.world.of("rollout_engine").values() if e.state == "draining"]:
        e = d.world.get("rollout_engine", eid)
        d.agent_stops_engine(eid, e.get("gpus")[0], e.get("host"))
    d.tick()
    hid = hybrids(d, "launching")[0]
    h = d.world.get("hybrid_replica", hid)
    d.ok("hybrid_replica", hid, "launched", identity=identity(h.get("host"), h.get("token")))
    deadline = d.world.get("hybrid_replica", hid).get("deadline")
    d.now = deadline - 0.5
    out = d.engine.handle(Event("hybrid_replica", hid, "deadline", d.now))
    assert isinstance(out, Rejected)
    d.now = deadline
    out = d.engine.handle(Event("hybrid_replica", hid, "deadline", d.now))
    assert isinstance(out, Accepted)
    assert d.world.get("gpu", h.get("gpus")[0]).state == "releasing"


def test_applying_a_decision_twice_acts_once() -> None:
    d = Driver()
    dec = d.decide(BUSY_TRAINER)
    first = d.execute(dec)
    assert all(isinstance(o, Accepted) for o in first)
    before = d.world.snapshot()
    (second,) = d.execute(dec)
    assert isinstance(second, Rejected)  # stale: the first application moved the world
    assert d.world.snapshot() == before


@pytest.mark.parametrize("state", ["starting", "updating"])
def test_starting_or_updating_engines_are_never_picked(state: str) -> None:
    d = Driver()
    if state == "updating":
        d.publish(2)
    else:
        d.ok("rollout_engine", "e0", "drain")
        d.agent_stops_engine("e0", "h1:g0", "h1")
        d.ok("rollout_engine", "e5", "launch", host="h1", gpus=["h1:g0"], tp=1, token="t")
    dec = d.decide(BUSY_TRAINER)
    picked = {a.engine_id for a in dec.actions if a.kind == "stop_engine"}
    not_serving = {e.id for e in d.world.of("rollout_engine").values() if e.state == state}
    assert not_serving and not (picked & not_serving)
