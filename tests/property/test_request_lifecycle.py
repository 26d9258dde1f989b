"""The request lifecycle and publication under random interleavings, through the Orchestrator.

No processes here: the unit is the engine's machines (request, training_step, rollout_engine,
revision, gpu), fed the events the dispatcher, the publisher and the trainer would feed —
dispatches, completions (right and wrong revision), aborts, engine drains, crashes and restarts
on the freed GPU, publications, successful and failed installs, expiries, retirements, and
training steps (begin → partition → delivered → reduced → stepped → published, with wrong
partitions, missing deliveries, wrong versions, failures and deadlines on the way). Groups are
claimed, consumed and handed back only as cascades of a step's own transitions; a direct
claim/consume/unclaim is tried at random and must always be refused. The shells
(`rollout.dispatch`, `rollout.publish`) are exercised against real engine processes in
`tests/rollout_flow/`.

The plan is `examples/local.toml` with two changes so that a 30-step run reaches several
training steps and partitions across more than one replica: Core DP2 (`core:0`, `core:1` on
two slots of h0) and G = `prompts_per_step` = 2 groups per step.

Properties, checked after every step: no group is lost (every enqueued group exists and the
states add up), none is consumed twice and every consumed group was consumed by its step's
optimizer step, a claimed group belongs to exactly one running step, every claim respects the
staleness bound, the revision installed on each engine never goes down, and no retired revision
is referenced (installed on a live engine, or tagged on an in-flight group) — plus the engine's
own invariants (`check=True`).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ehp_fsm import Event, Orchestrator
from ehp_fsm.core.transition import Accepted, Outcome
from ehp_fsm.plan import Plan, parse_plan

PLAN = Path(__file__).resolve().parents[2] / "examples" / "local.toml"
ENGINE_GPUS = ("h1:g0", "h1:g1", "h2:g0")
LIVE = ("starting", "installing", "serving", "updating", "draining", "stopping")
BUSY = ("computing", "reducing", "stepping")  # a step that holds claimed groups
OPEN = ("collecting", *BUSY, "publishing")


def _plan() -> Plan:
    doc = tomllib.loads(PLAN.read_text(encoding="utf-8"))
    doc["hosts"][0]["gpus"] = 2
    doc["core"] |= {"dp": 2, "gpus": ["h0:g0", "h0:g1"]}
    doc["grpo"]["prompts_per_step"] = 2
    return parse_plan(doc, file=str(PLAN))


PLAN_DP2 = _plan()


def _identity(eid: str, host: str) -> dict[str, Any]:
    return {"host": host, "pid": 1000 + int(eid[1:]), "start_time": 1.0, "token": f"t-{eid}"}


class RequestLifecycle(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        # (every instance kept: the invariants count consumed groups, read finished ones)
        self.engine = Orchestrator.from_plan(PLAN_DP2, check=True, forget_finished=False)
        config = self.engine.world.config
        self.max_staleness = int(config["max_staleness"])
        self.G = int(config["groups_per_step"])
        self.replicas = [str(r) for r in config["core_replicas"]]
        self.step_deadline = float(config["deadlines"]["training_step"]["computing"])
        self.now = 1.0
        self.groups: list[str] = []
        self.consumes: dict[str, int] = {}
        self.stepped_groups: dict[str, str] = {}  # group -> the step whose optimizer consumed it
        self.installed_seen: dict[str, int] = {}
        self.next_engine = 0
        self.next_step = 0
        self.step: str | None = None  # the open training step, if any
        self.revision = 0
        self.gpu_engine: dict[str, str] = {}

    # -- plumbing --------------------------------------------------------------------------
    def fire(self, machine: str, instance: str, name: str, **payload: Any) -> Outcome:
        self.now += 1.0
        out = self.engine.handle(Event(machine, instance, name, self.now, payload))
        if isinstance(out, Accepted):
            for rec in out.records:
                if rec.machine != "request" or rec.event not in ("claim", "consume", "unclaim"):
                    continue
                # never fired on its own: always a cascade of a training step's transition
                assert rec.cause is not None, rec
                parent = out.records[rec.cause]
                assert parent.machine == "training_step", (rec, parent)
                assert parent.instance == rec.payload["step"], (rec, parent)
                if rec.event == "consume":
                    self.consumes[rec.instance] = self.consumes.get(rec.instance, 0) + 1
                if rec.event == "claim":
                    inst = self.engine.world.get("request", rec.instance)
                    assert inst is not None
                    floor = self.engine.world.globals["revision"] - self.max_staleness
                    assert inst.get("revision") >= floor, (
                        f"claimed {rec.instance} from revision {inst.get('revision')} below {floor}"
                    )
        return out

    def must(self, machine: str, instance: str, name: str, **payload: Any) -> Accepted:
        out = self.fire(machine, instance, name, **payload)
        assert isinstance(out, Accepted), (machine, instance, name, out.reason)
        return out

    def of(self, machine: str, *states: str) -> list[str]:
        return sorted(i.id for i in self.engine.world.of(machine).values() if i.state in states)

    def inst(self, machine: str, iid: str) -> Any:
        return self.engine.world.get(machine, iid)

    def install_current(self, eid: str) -> None:
        self.must("rollout_engine", eid, "installed", revision=self.revision)

    # -- rules -----------------------------------------------------------------------------
    @initialize()
    def start(self) -> None:
        self.publish()
        for gpu in ENGINE_GPUS[:2]:
            self.launch(gpu)
            eid = self.gpu_engine[gpu]
            self.install_current(eid)

    @precondition(lambda self: self.revision < 6)
    @rule(settle=st.booleans())
    def publish(self, settle: bool = False) -> None:
        self.revision += 1
        rid = f"r{self.revision}"
        self.must("revision", rid, "save", revision=self.revision, step=self.revision)
        self.must("revision", rid, "saved", checksum="c", path=f"/rev/{self.revision}")
        self.must("revision", rid, "publish")
        if settle:  # every engine's install succeeds at once
            for eid in self.of("rollout_engine", "installing", "updating"):
                self.install_current(eid)

    @rule(n=st.integers(1, 3))
    def enqueue(self, n: int) -> None:
        for _ in range(n):
            gid = f"g{len(self.groups)}"
            self.must("request", gid, "enqueue", prompt="1+1=")
            self.groups.append(gid)

    @precondition(lambda self: bool(self.of("request", "queued")))
    @rule(data=st.data())
    def dispatch(self, data: st.DataObject) -> None:
        queued = self.of("request", "queued")
        for gid in data.draw(
            st.lists(st.sampled_from(queued), min_size=1, max_size=3, unique=True)
        ):
            engines = self.of("rollout_engine", "serving")
            if not engines or data.draw(st.integers(0, 4)) == 0:  # sometimes a non-serving one
                engines = sorted(self.engine.world.of("rollout_engine"))
            eid = data.draw(st.sampled_from(engines))
            out = self.fire("request", gid, "dispatch", engine=eid)
            assert out.accepted == (self.inst("rollout_engine", eid).state == "serving")

    @precondition(lambda self: bool(self.of("rollout_engine", "serving")))
    @rule(data=st.data(), n=st.integers(1, 4))
    def serve_round(self, data: st.DataObject, n: int) -> None:
        """The common path in one rule (so that runs reach training steps): up to n groups are
        enqueued if needed, dispatched to serving engines and completed at their revision."""
        while len(self.of("request", "queued")) < n:
            self.enqueue(1)
        for gid in self.of("request", "queued")[:n]:
            eid = data.draw(st.sampled_from(self.of("rollout_engine", "serving")))
            self.must("request", gid, "dispatch", engine=eid)
            r = self.inst("request", gid)
            self.must("request", gid, "complete", engine=eid, revision=r.get("revision"))

    @precondition(lambda self: bool(self.of("request", "dispatched")))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        """Up to 3 in-flight groups end: completed (mostly), completed with the wrong revision
        tag (refused), or aborted after an HTTP failure (requeued)."""
        inflight = self.of("request", "dispatched")
        picked = data.draw(st.lists(st.sampled_from(inflight), min_size=1, max_size=3, unique=True))
        for gid in picked:
            how = data.draw(st.sampled_from(["ok", "ok", "ok", "wrong_revision", "abort"]))
            r = self.inst("request", gid)
            if how == "abort":
                self.must("request", gid, "abort", reason="http")
                continue
            rev = r.get("revision") + (1 if how == "wrong_revision" else 0)
            out = self.fire("request", gid, "complete", engine=r.get("engine"), revision=rev)
            assert out.accepted == (how == "ok")

    @precondition(lambda self: bool(self.of("rollout_engine", "installing", "updating")))
    @rule(data=st.data(), ok=st.booleans())
    def install(self, data: st.DataObject, ok: bool) -> None:
        busy = self.of("rollout_engine", "installing", "updating")
        if not busy:
            return
        eid = data.draw(st.sampled_from(busy))
        if ok:
            self.install_current(eid)
        else:
            self.must("rollout_engine", eid, "install_failed", reason="corrupt")
            assert self.inst("rollout_engine", eid).state == "installing"

    @precondition(lambda self: bool(self.of("rollout_engine", *LIVE)))
    @rule(data=st.data(), drain=st.booleans())
    def engine_down(self, data: st.DataObject, drain: bool) -> None:
        """Borrow (drain, stop, exit) a serving engine, or crash any live one; either way its
        in-flight groups are requeued and its GPU goes back through the finalizer."""
        serving = self.of("rollout_engine", "serving")
        eid = data.draw(
            st.sampled_from(serving if drain and serving else self.of("rollout_engine", *LIVE))
        )
        if drain and serving:
            # The rollout reserve: the other up engines' GPUs must still cover it.
            others = [
                e
                for e in self.of("rollout_engine", "installing", "serving", "updating")
                if e != eid
            ]
            out = self.fire("rollout_engine", eid, "drain")
            assert out.accepted == (len(others) >= PLAN_DP2.rollout.reserve), out
            if not out.accepted:
                assert "rollout reserve" in out.reason  # type: ignore[union-attr]
                return
            assert not [g for g in self.of("request", "dispatched") if self._on(g, eid)]
            self.must("rollout_engine", eid, "drained")
            e = self.inst("rollout_engine", eid)
            self.must("rollout_engine", eid, "exited", identity=_identity(eid, e.get("host")))
        else:
            self.must("rollout_engine", eid, "fail", reason="SIGKILL")
        assert not [g for g in self.of("request", "dispatched") if self._on(g, eid)]
        self.free(eid)

    @precondition(lambda self: any(self.inst("gpu", g).state == "free" for g in ENGINE_GPUS))
    @rule(data=st.data())
    def restart(self, data: st.DataObject) -> None:
        free = [g for g in ENGINE_GPUS if self.inst("gpu", g).state == "free"]
        if free:
            self.launch(data.draw(st.sampled_from(free)))

    @precondition(lambda self: bool(self.of("request", "completed")))
    @rule(data=st.data())
    def expire(self, data: st.DataObject) -> None:
        """The dispatcher offers completed groups to `expire`: only a stale one is regenerated."""
        floor = self.engine.world.globals["revision"] - self.max_staleness
        for gid in self.of("request", "completed"):
            rev = self.inst("request", gid).get("revision")
            if data.draw(st.booleans()):
                assert self.fire("request", gid, "expire").accepted == (rev < floor)

    @precondition(lambda self: self.step is None)
    @rule(wrong=st.booleans())
    def begin_step(self, wrong: bool) -> None:
        n = int(self.engine.world.globals["core_version"]) + 1
        self.next_step += 1
        sid = f"s{self.next_step}"
        if wrong:  # a step number that is not the next one
            assert not self.fire("training_step", sid, "begin", step=n + 1).accepted
        self.must("training_step", sid, "begin", step=n)
        self.step = sid

    @precondition(
        lambda self: (
            self._step_state() in (None, "collecting")
            and len(self.of("request", "completed")) >= self.G
        )
    )
    @rule(
        data=st.data(),
        flaw=st.sampled_from(["none", "none", "none", "short", "replica"]),
        then=st.integers(0, 4),
    )
    def partition(self, data: st.DataObject, flaw: str, then: int) -> None:
        """Partition G completed groups (maybe a stale one) across the live replicas (a step
        begins first if none is open): the step claims all of them — or none, when one is too
        stale or the partition is wrong. Then `then` of its next reports follow at once (0:
        other rules interleave first)."""
        if self.step is None:
            self.begin_step(wrong=False)
        sid = self.step
        assert sid is not None
        done = self.of("request", "completed")
        picked = data.draw(
            st.lists(st.sampled_from(done), min_size=self.G, max_size=self.G, unique=True)
        )
        where = [data.draw(st.sampled_from(self.replicas)) for _ in picked]
        partition = {
            r: [g for g, w in zip(picked, where, strict=True) if w == r] for r in self.replicas
        }
        if flaw == "short":  # one group fewer than G
            short = {r: [g for g in gs if g != picked[-1]] for r, gs in partition.items()}
            out = self.fire("training_step", sid, "partition", groups=picked[:-1], partition=short)
            assert not out.accepted
        elif flaw == "replica":  # a replica that is not live in this epoch
            wrong = {**partition, "hybrid:h9": []}
            out = self.fire("training_step", sid, "partition", groups=picked, partition=wrong)
            assert not out.accepted
        floor = self.engine.world.globals["revision"] - self.max_staleness
        fresh = all(self.inst("request", g).get("revision") >= floor for g in picked)
        out = self.fire("training_step", sid, "partition", groups=picked, partition=partition)
        assert out.accepted == fresh, (picked, floor, getattr(out, "reason", ""))
        want = ("claimed", sid) if fresh else ("completed", None)
        for g in picked:
            r = self.inst("request", g)
            assert (r.state, r.get("claimed_by")) == want, (g, r)
        if fresh and then:
            self.advance_step(data, then)

    @precondition(lambda self: self._step_state() in (*BUSY, "publishing"))
    @rule(data=st.data(), phases=st.integers(1, 4))
    def advance_step(self, data: st.DataObject, phases: int) -> None:
        """The step's next `phases` reports (other rules interleave between rule calls)."""
        for _ in range(phases):
            if self._step_state() not in (*BUSY, "publishing"):
                return
            self._advance_once(flaw=data.draw(st.booleans()), settle=data.draw(st.booleans()))

    def _advance_once(self, *, flaw: bool, settle: bool) -> None:
        """The step's next report: `delivered` (a missing replica is refused), `reduced`,
        `stepped` (a wrong version is refused; consumes the groups), then a publication and
        `published`."""
        sid = self.step
        assert sid is not None
        state = self._step_state()
        groups = list(self.inst("training_step", sid).get("groups"))
        if state == "computing":
            if flaw:
                out = self.fire("training_step", sid, "delivered", replicas=self.replicas[:1])
                assert not out.accepted
            self.must("training_step", sid, "delivered", replicas=list(self.replicas))
        elif state == "reducing":
            self.must("training_step", sid, "reduced")
        elif state == "stepping":
            v = int(self.engine.world.globals["core_version"]) + 1
            if flaw:
                assert not self.fire("training_step", sid, "stepped", version=v + 1).accepted
            out = self.must("training_step", sid, "stepped", version=v)
            consumed = sorted(r.instance for r in out.records if r.event == "consume")
            assert consumed == sorted(groups)
            for g in groups:
                self.stepped_groups[g] = sid
        else:
            if flaw:  # a revision that is not the current one
                rev = self.revision + 1
                assert not self.fire("training_step", sid, "published", revision=rev).accepted
            self.publish(settle)
            self.must("training_step", sid, "published", revision=self.revision)
            self.step = None

    @precondition(lambda self: self._step_state() in OPEN)
    @rule(data=st.data(), deadline=st.booleans())
    def break_step(self, data: st.DataObject, deadline: bool) -> None:
        """A dead replica or an epoch change fails the step, or (while computing) its deadline
        passes — it fires only once passed. Groups it held (claimed, not yet consumed) go back
        to `completed`; consumed ones stay consumed."""
        sid = self.step
        assert sid is not None
        state = self._step_state()
        if state == "collecting" and data.draw(st.integers(0, 3)):
            return  # mostly a step fails while it holds groups, not before
        groups = list(self.inst("training_step", sid).get("groups") or ())
        if deadline and state == "computing":
            assert not self.fire("training_step", sid, "deadline").accepted
            self.now += self.step_deadline
            self.must("training_step", sid, "deadline")
        else:
            self.must("training_step", sid, "fail", reason="replica died")
        self.step = None
        for g in groups:
            r = self.inst("request", g)
            want = "completed" if state in BUSY else "consumed"
            assert r.state == want and (want == "consumed" or r.get("claimed_by") is None), r

    @precondition(lambda self: bool(self.groups))
    @rule(
        data=st.data(),
        event=st.sampled_from(["claim", "consume", "unclaim"]),
        which=st.sampled_from(["open", "any", "unknown", "none"]),
    )
    def direct_hand_over(self, data: st.DataObject, event: str, which: str) -> None:
        """A caller (not a step's transition) claims, consumes or hands back a group, naming
        the open step, any step, a step that does not exist, or none: always refused."""
        gid = data.draw(st.sampled_from(self.groups))
        steps = sorted(self.engine.world.of("training_step"))
        if which == "open" and self.step is not None:
            payload: dict[str, Any] = {"step": self.step}
        elif which == "any" and steps:
            payload = {"step": data.draw(st.sampled_from(steps))}
        elif which == "unknown":
            payload = {"step": f"s{self.next_step + 1}"}
        else:
            payload = {}
        before = self.inst("request", gid)
        out = self.fire("request", gid, event, **payload)
        assert not out.accepted, (gid, event, payload, before)
        assert self.inst("request", gid) == before

    @precondition(lambda self: bool(self.of("revision", "saved", "published")))
    @rule(data=st.data())
    def retire(self, data: st.DataObject) -> None:
        revs = self.of("revision", "saved", "published")
        if revs:
            self.fire("revision", data.draw(st.sampled_from(revs)), "retire")

    # -- helpers ---------------------------------------------------------------------------
    def _step_state(self) -> str | None:
        if self.step is None:
            return None
        return str(self.inst("training_step", self.step).state)

    def _on(self, gid: str, eid: str) -> bool:
        return bool(self.inst("request", gid).get("engine") == eid)

    def launch(self, gpu: str) -> None:
        eid = f"e{self.next_engine}"
        self.next_engine += 1
        host = gpu.split(":")[0]
        self.must("rollout_engine", eid, "launch", host=host, gpus=[gpu], tp=1, token=f"t-{eid}")
        out = self.must("rollout_engine", eid, "healthy", identity=_identity(eid, host))
        installs = [c for c in out.commands if c.kind == "install"]
        assert [c.args["revision"] for c in installs] == [self.revision]  # install-before-serve
        self.gpu_engine[gpu] = eid

    def free(self, eid: str) -> None:
        for g in self.inst("rollout_engine", eid).get("gpus"):
            if self.inst("gpu", g).state == "releasing":
                owner = f"engine:{eid}"
                self.must(
                    "gpu", g, "confirm_free", owner=owner, processes_exited=True, memory_free=True
                )

    # -- invariants ------------------------------------------------------------------------
    @invariant()
    def no_group_lost(self) -> None:
        reqs = self.engine.world.of("request")
        assert sorted(reqs) == sorted(self.groups)
        by_state: dict[str, int] = {}
        for r in reqs.values():
            by_state[r.state] = by_state.get(r.state, 0) + 1
        assert sum(by_state.values()) == len(self.groups)
        for r in reqs.values():
            if r.state == "dispatched":  # in flight on a live engine that can finish it
                e = self.inst("rollout_engine", r.get("engine"))
                assert e is not None and e.state in ("serving", "updating", "installing"), (r, e)

    @invariant()
    def consumed_at_most_once(self) -> None:
        assert all(n == 1 for n in self.consumes.values()), self.consumes
        consumed = set(self.of("request", "consumed"))
        assert consumed == set(self.consumes) == set(self.stepped_groups)

    @invariant()
    def claimed_only_by_a_running_step(self) -> None:
        held: dict[str, str] = {}
        for s in self.engine.world.of("training_step").values():
            if s.state in BUSY:
                for g in s.get("groups"):
                    assert g not in held, (g, held[g], s.id)  # in two running steps
                    held[g] = s.id
        claimed = {
            r.id: r.get("claimed_by")
            for r in self.engine.world.of("request").values()
            if r.state == "claimed"
        }
        assert claimed == held

    @invariant()
    def revisions_monotone_per_engine(self) -> None:
        for e in self.engine.world.of("rollout_engine").values():
            rev = e.get("installed")
            if rev is None:
                continue
            assert rev >= self.installed_seen.get(e.id, 0), (e.id, rev, self.installed_seen)
            self.installed_seen[e.id] = rev

    @invariant()
    def retired_never_referenced(self) -> None:
        retired = {
            r.get("revision")
            for r in self.engine.world.of("revision").values()
            if r.state == "retired"
        }
        assert self.engine.world.globals["revision"] not in retired
        for e in self.engine.world.of("rollout_engine").values():
            if e.state in LIVE:
                assert e.get("installed") not in retired, (e.id, e.get("installed"), retired)
        for r in self.engine.world.of("request").values():
            if r.state == "dispatched":
                assert r.get("revision") not in retired, (r.id, r.get("revision"), retired)


RequestLifecycle.TestCase.settings = settings(
    RequestLifecycle.TestCase.settings, stateful_step_count=50
)
TestRequestLifecycle = RequestLifecycle.TestCase
