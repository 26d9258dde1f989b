"""The request lifecycle and publication under random interleavings, driven through the Engine.

No processes here: the unit is the engine's machines (request, rollout_engine, revision, gpu),
fed the events the dispatcher and the publisher would feed — dispatches, completions (right and
wrong revision), aborts, engine drains, crashes and restarts on the freed GPU, publications,
successful and failed installs, expiries, claims/consumes/unclaims of training steps, and
retirements. The shells (`rollout.dispatch`, `rollout.publish`) are exercised against real
engine processes in `tests/rollout_flow/`.

Properties, checked after every step: no group is lost (every enqueued group exists and the
states add up), none is consumed twice, every claim respects the staleness bound, the revision
installed on each engine never goes down, and no retired revision is referenced (installed on a
live engine, or tagged on an in-flight group) — plus the engine's own invariants (`check=True`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ehp_fsm import Engine, Event, load_plan
from ehp_fsm.core.engine import Accepted, Outcome

PLAN = Path(__file__).resolve().parents[2] / "examples" / "local.toml"
ENGINE_GPUS = ("h1:g0", "h1:g1", "h2:g0")
LIVE = ("starting", "installing", "serving", "updating", "draining", "stopping")


def _identity(eid: str, host: str) -> dict[str, Any]:
    return {"host": host, "pid": 1000 + int(eid[1:]), "start_time": 1.0, "token": f"t-{eid}"}


class RequestLifecycle(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.engine = Engine.from_plan(load_plan(PLAN), check=True)
        self.max_staleness = int(self.engine.world.config["max_staleness"])
        self.now = 1.0
        self.groups: list[str] = []
        self.consumes: dict[str, int] = {}
        self.installed_seen: dict[str, int] = {}
        self.next_engine = 0
        self.next_step = 0
        self.revision = 0
        self.gpu_engine: dict[str, str] = {}

    # -- plumbing --------------------------------------------------------------------------
    def fire(self, machine: str, instance: str, name: str, **payload: Any) -> Outcome:
        self.now += 1.0
        out = self.engine.handle(Event(machine, instance, name, self.now, payload))
        if isinstance(out, Accepted):
            for rec in out.records:
                if rec.machine == "request" and rec.event == "consume":
                    self.consumes[rec.instance] = self.consumes.get(rec.instance, 0) + 1
                if rec.machine == "request" and rec.event == "claim":
                    inst = self.engine.world.get("request", rec.instance)
                    assert inst is not None
                    floor = self.engine.world.globals["revision"] - self.max_staleness
                    assert inst.get("revision") >= floor, (
                        f"claimed {rec.instance} from revision {inst.get('revision')} below {floor}"
                    )
        return out

    def must(self, machine: str, instance: str, name: str, **payload: Any) -> Accepted:
        out = self.fire(machine, instance, name, **payload)
        assert isinstance(out, Accepted), out.reason  # type: ignore[union-attr]
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
            self.must("rollout_engine", eid, "drain")
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
    @rule(data=st.data(), k=st.integers(1, 3), fail=st.integers(0, 3))
    def train_step(self, data: st.DataObject, k: int, fail: int) -> None:
        """Expire what is too stale (regenerated), claim up to k completed groups (a stale one is
        refused), then consume them or hand them back (a failed step)."""
        floor = self.engine.world.globals["revision"] - self.max_staleness
        for gid in self.of("request", "completed"):
            rev = self.inst("request", gid).get("revision")
            if data.draw(st.booleans()):
                assert self.fire("request", gid, "expire").accepted == (rev < floor)
        done = self.of("request", "completed")
        if not done:
            return
        picked = data.draw(st.lists(st.sampled_from(done), min_size=1, max_size=k, unique=True))
        self.next_step += 1
        step = f"s{self.next_step}"
        claimed = []
        for gid in picked:
            rev = self.inst("request", gid).get("revision")
            out = self.fire("request", gid, "claim", step=step)
            assert out.accepted == (rev >= floor), (gid, rev, floor)
            if out.accepted:
                claimed.append(gid)
        for gid in claimed:
            self.must("request", gid, "unclaim" if fail == 0 else "consume", step=step)
        for gid in claimed:  # consumed: absorbs every later event; handed back: not claimed
            assert not self.fire("request", gid, "consume", step=step).accepted

    @precondition(lambda self: bool(self.of("revision", "saved", "published")))
    @rule(data=st.data())
    def retire(self, data: st.DataObject) -> None:
        revs = self.of("revision", "saved", "published")
        if revs:
            self.fire("revision", data.draw(st.sampled_from(revs)), "retire")

    # -- helpers ---------------------------------------------------------------------------
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
        assert consumed == set(self.consumes)

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
    RequestLifecycle.TestCase.settings, stateful_step_count=30
)
TestRequestLifecycle = RequestLifecycle.TestCase
