"""The embedding API under a careless scheduler and a hostile caller: `Orchestrator.handle` fed
through the public names (`from ehp_fsm import Event, Orchestrator, ...`) with events in any
order, for unknown machines, ids and events, with times that are NaN, infinite, negative,
going backwards or too large for a float, and payloads of the wrong types (strings for
numbers, huge ints, None, nested objects, sets, bytes, objects, enums, tuples, lone
surrogates), besides the role walks of `strategies.RoleMachine` (the targeted, main-path and
side-exit events of the GPU ledger, engines and Hybrids, with their classic mistakes). On top:
events that try to give one GPU two owners, take a GPU back behind its owner's back, drain
rollout below the reserve or allocate past `max_hybrids`, and an event handled from inside
the handling of another.

After every call: it returned an outcome or raised `EventError` / `OrchestratorError` (any
other exception fails the test) with a message that says why and what to do; an error or a
refusal left the world (a snapshot) and the log (its chain head) as they were, and a refusal
says why; `EventError` is raised exactly for the events the log could not give back as they
were handled (an oracle here restates which, from JSON's rules); the world's invariants hold
(`check_invariants`, no leaked or doubly held GPU), an accepted drain left the reserve serving
and an accepted allocation kept within `max_hybrids`. At the end the log is verified by
`ehp-fsm replay` (in-process, its exit status) and by `replay`, whose world must equal the
live one (`Harness.finish`, which also replays from a mid checkpoint)."""

from __future__ import annotations

import collections
import decimal
import enum
import math
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import rule

from ehp_fsm import (
    Accepted,
    Event,
    EventError,
    Orchestrator,
    OrchestratorError,
    Rejected,
    embedded,
)
from ehp_fsm.cli import main as ehp_fsm_main
from ehp_fsm.core.checks import InvariantChecks
from ehp_fsm.core.guards import GUARDS, HYBRID_HOLDING, rollout_gpus_scan
from ehp_fsm.core.invariants import check_invariants
from ehp_fsm.core.transition import View
from ehp_fsm.core.world import Instance
from ehp_fsm.embedded import InvariantViolation
from tests.property.strategies import (
    BOGUS_EVENTS,
    FORWARD,
    HOSTS,
    IDS,
    PAYLOAD_KEYS,
    Harness,
    RoleMachine,
    junk_payload,
    ownership_problems,
    pick_event,
    plain_copy,
    small_plan,
    valid_payload,
)

PLAN = small_plan(ehp={"enabled": True, "replica_size": 2, "cooldown_s": 1.0, "max_hybrids": 1})


class Kind(enum.StrEnum):
    ENGINE = "rollout_engine"


class Tp(enum.IntEnum):
    ONE = 1


class Thing:
    def __repr__(self) -> str:
        return "<thing>"


class Exploding(Mapping[str, Any]):
    """A payload whose reading raises (a caller's broken mapping)."""

    def __getitem__(self, key: str) -> Any:
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(["host"])

    def __len__(self) -> int:
        return 1


# Values a scheduler might put anywhere: right ones, wrong types, values JSON has no form for.
HOSTILE = st.sampled_from(
    [
        None,
        "",
        "7",
        "1.5",
        "é",
        "\ud800",
        -1,
        0,
        1,
        2**70,
        -(2**70),
        10**400,
        1e308,
        -0.0,
        2.5,
        float("nan"),
        float("inf"),
        float("-inf"),
        True,
        [],
        [None],
        ["h1:g0", "h1:g0"],
        ("h1:g0",),
        {"a": {"b": [1, "x"]}},
        {"a": {1, 2}},
        {1, 2},
        frozenset(),
        b"x",
        bytearray(b"x"),
        Thing(),
        Kind.ENGINE,
        Tp.ONE,
        collections.OrderedDict(host="h1"),
        MappingProxyType({"host": "h1"}),
        decimal.Decimal("1.5"),
    ]
)
MACHINES = st.sampled_from([*sorted(IDS), "toaster", "", None, 5, Kind.ENGINE, "gpu\ud800", b"gpu"])
INSTANCES = st.sampled_from([*IDS["gpu"], *IDS["rollout_engine"], "", None, 7, ("e0",), "e\ud800"])


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def loggable(value: Any) -> bool:
    """Whether `value` has a JSON form that gives the same value back (a tuple as its list,
    an enum as its value): JSON's own rules, restated apart from the code under test."""
    if value is None or isinstance(value, bool | int):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, str):
        return _utf8(value)
    if isinstance(value, list | tuple):
        return all(loggable(v) for v in value)
    if isinstance(value, Mapping):
        try:
            items = list(value.items())
        except Exception:  # a mapping that cannot be read has no form
            return False
        return all(isinstance(k, str) and _utf8(k) and loggable(v) for k, v in items)
    return False


def event_loggable(event: object) -> bool:
    if not isinstance(event, Event):
        return False
    ids = (event.machine, event.instance, event.name, event.correlation)
    if not all(isinstance(i, str) and _utf8(i) for i in ids):
        return False
    t = event.time
    if isinstance(t, bool) or not isinstance(t, int | float):
        return False
    try:
        if not math.isfinite(float(t)):
            return False
    except OverflowError:
        return False
    return isinstance(event.payload, Mapping) and loggable(event.payload)


class EmbeddedCaller(RoleMachine):
    FOCUS = ("gpu", "rollout_engine", "hybrid_replica")
    SUPPORT = ("revision", "request", "training_step", "capacity")

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()

    def setup(self) -> None:
        self.h.discard()  # the default plan's harness: this test's plan has max_hybrids = 1
        self.h = Harness(PLAN, forget_finished=True)
        self.h.hooks.append(self._capacity_rules)
        self.publish("r1", 1)

    @property
    def orch(self) -> Orchestrator:
        return self.h.engine

    # -- the one way this test calls the API ---------------------------------------------------
    def send(self, event: object) -> Accepted | Rejected | None:
        """`handle(event)` through the public API, checked (see the module docstring)."""
        orch, world = self.orch, self.orch.world
        before, version, head = plain_copy(world.snapshot()), world.version, orch.chain_head
        try:
            out = orch.handle(event)  # type: ignore[arg-type]
        except (EventError, OrchestratorError) as exc:
            self.calls[type(exc).__name__] += 1
            text = str(exc)
            assert "because" in text and "Fix:" in text, text
            if isinstance(exc, EventError):
                assert not event_loggable(event), f"a loggable event was refused: {text}"
            assert world.snapshot() == before and world.version == version
            assert orch.chain_head == head, "an event that raised was logged"
            return None
        assert event_loggable(event), f"an event the log cannot hold was handled: {event!r}"
        self.calls["accepted" if out.accepted else "rejected"] += 1
        # the README's reading of an outcome: `accepted`, `commands`, `reason` on either kind
        assert (out.commands == ()) if not out.accepted else (out.reason == "")
        if isinstance(out, Rejected):
            assert out.reason and len(out.records) == 1
            assert world.snapshot() == before and world.version == version
        else:
            assert world.version == version + 1
            self._capacity_rules(out.event, None, world, out)
        assert orch.chain_head != head, "a handled event was not logged"
        assert check_invariants(world) == []
        assert ownership_problems(world) == []
        return out

    def _capacity_rules(self, event: Event, _inst: object, world: Any, out: Any) -> None:
        """An accepted drain leaves the reserve serving; an allocation keeps within
        `max_hybrids` (neither is a world invariant: an engine that fails may leave rollout
        below the reserve; but no accepted event may take it there)."""
        if not out.accepted:
            return
        if (event.machine, event.name) == ("rollout_engine", "drain"):
            left = rollout_gpus_scan(View(world))
            assert left >= world.config["rollout_reserve"], f"a drain left {left} serving"
        if (event.machine, event.name) == ("hybrid_replica", "allocate"):
            held = [h for h in world.of("hybrid_replica").values() if h.state in HYBRID_HOLDING]
            assert len(held) <= world.config["max_hybrids"], f"{len(held)} Hybrids hold GPUs"

    # -- a careless scheduler ------------------------------------------------------------------
    @rule(data=st.data())
    def careless(self, data: st.DataObject) -> None:
        """A plausible event (an allowed one, a world-built payload), as it is or with one
        thing a scheduler gets wrong: a value's type, an extra key, the time, the payload's
        kind."""
        machine = data.draw(st.sampled_from(sorted(IDS)))
        iid = data.draw(st.sampled_from(IDS[machine]))
        name = pick_event(data.draw, self.h.world, machine, iid)
        payload: Any = valid_payload(data.draw, self.h, machine, iid, name)
        mistake = data.draw(
            st.sampled_from(
                ["none", "none", "value", "extra", "time", "tuple", "ordered", "proxy", "numeric"]
            )
        )
        t: Any = self.h.now
        if mistake == "value" and payload:
            payload[data.draw(st.sampled_from(sorted(payload)))] = data.draw(HOSTILE)
        elif mistake == "extra":
            payload[data.draw(st.sampled_from(PAYLOAD_KEYS))] = data.draw(HOSTILE)
        elif mistake == "time":
            t = data.draw(
                st.sampled_from(
                    [
                        int(self.h.now),
                        self.h.now - 50.0,  # backwards: the caller's clock, not refused
                        -1.0,
                        1e300,
                        10**400,
                        float("nan"),
                        float("inf"),
                        "12",
                        None,
                        True,
                        decimal.Decimal(1),
                    ]
                )
            )
        elif mistake == "tuple":
            payload = {k: tuple(v) if isinstance(v, list) else v for k, v in payload.items()}
        elif mistake == "ordered":
            payload = collections.OrderedDict(payload)
        elif mistake == "proxy":
            payload = MappingProxyType(payload)
        elif mistake == "numeric" and payload:
            payload = {k: str(v) if isinstance(v, int) else v for k, v in payload.items()}
        self.send(Event(machine, iid, name, t, payload, "embedded"))
        if data.draw(st.booleans()):  # the scheduler reuses its lists: the world is not them
            for value in list(payload.values()):
                if isinstance(value, list):
                    value.append("reused")
                elif isinstance(value, dict):
                    value["reused"] = 1
            assert check_invariants(self.h.world) == []

    # -- a hostile caller ----------------------------------------------------------------------
    @rule(
        machine=MACHINES,
        iid=INSTANCES,
        name=st.sampled_from(["launch", "assign", "drain", "allocate", *BOGUS_EVENTS, None, 3]),
        payload=st.dictionaries(st.sampled_from(PAYLOAD_KEYS), HOSTILE, max_size=3),
        correlation=st.sampled_from(["", "x", None, 5]),
    )
    def stranger(
        self, machine: Any, iid: Any, name: Any, payload: dict[str, Any], correlation: Any
    ) -> None:
        self.send(Event(machine, iid, name, self.h.now, payload, correlation))

    @rule(thing=st.sampled_from(["event", None, 7, ("gpu", "h1:g0", "assign"), {"machine": "gpu"}]))
    def not_an_event(self, thing: object) -> None:
        self.send(thing)

    @rule(payload=st.sampled_from([None, [1], "x", Exploding(), {1: "a"}, {("a",): 1}]))
    def broken_payload(self, payload: Any) -> None:
        self.send(Event("gpu", "h1:g0", "assign", self.h.now, payload))

    @rule(data=st.data())
    def double_owner(self, data: st.DataObject) -> None:
        """Give a GPU that has an owner to someone else: by the ledger, by an engine launch,
        by a Hybrid allocation. Every way is refused."""
        owned = sorted(g.id for g in self.h.world.of("gpu").values() if g.state == "owned")
        if not owned:
            return
        gid = data.draw(st.sampled_from(owned))
        host = str(self.h.world.get("gpu", gid).get("host"))  # type: ignore[union-attr]
        attempt = data.draw(st.sampled_from(["assign", "launch", "allocate"]))
        if attempt == "assign":
            ev = Event("gpu", gid, "assign", self.h.now, {"owner": "engine:e2"})
        elif attempt == "launch":
            self._fresh += 1
            eid = f"e-grab{self._fresh}"
            payload = {"host": host, "gpus": [gid], "tp": 1, "token": f"t-{eid}"}
            ev = Event("rollout_engine", eid, "launch", self.h.now, payload)
        else:
            hid = data.draw(st.sampled_from(IDS["hybrid_replica"][:-1]))
            others = sorted(g.id for g in self.h.world.of("gpu").values() if g.get("host") == host)
            gpus = [gid, *[g for g in others if g != gid]][:2]
            ev = Event("hybrid_replica", hid, "allocate", self.h.now, {"host": host, "gpus": gpus})
        out = self.send(ev)
        assert out is None or isinstance(out, Rejected), f"{gid} was given a second owner"

    @rule(data=st.data())
    def behind_the_owners_back(self, data: st.DataObject) -> None:
        """Release a GPU in its live holder's name and confirm it free at once (a leak if the
        holder still lists it): the invariants after each call must still hold."""
        owned = sorted(
            g.id
            for g in self.h.world.of("gpu").values()
            if g.state == "owned" and g.get("owner") != "core"
        )
        if not owned:
            return
        gid = data.draw(st.sampled_from(owned))
        owner = self.h.world.get("gpu", gid).get("owner")  # type: ignore[union-attr]
        self.send(Event("gpu", gid, "release", self.h.now, {"owner": owner}))
        confirm = {"owner": owner, "processes_exited": True, "memory_free": True}
        self.send(Event("gpu", gid, "confirm_free", self.h.now, confirm))

    @rule()
    def drain_everything(self) -> None:
        """Drain every engine that serves: the reserve's guard stops the last ones."""
        for e in sorted(self.h.world.of("rollout_engine").values(), key=lambda e: e.id):
            if e.state == "serving":
                self.send(Event("rollout_engine", e.id, "drain", self.h.now))

    @rule(data=st.data())
    def hybrids_everywhere(self, data: st.DataObject) -> None:
        """Request and allocate a Hybrid on every host with two free GPUs: `max_hybrids`
        (1 here) stops the second."""
        for host in HOSTS:
            free = sorted(
                g.id
                for g in self.h.world.of("gpu").values()
                if g.state == "free" and g.get("host") == host
            )
            if len(free) < 2:
                continue
            self._fresh += 1
            hid = f"x-many{self._fresh}"
            self.send(Event("hybrid_replica", hid, "request", self.h.now))
            self.send(
                Event("hybrid_replica", hid, "allocate", self.h.now, {"host": host, "gpus": free})
            )

    @rule(depth=st.sampled_from(["getitem", "items"]))
    def reentrant(self, depth: str) -> None:
        """A payload whose reading handles another event (a scheduler calling back into the
        orchestrator from code the first event runs): the inner call is refused, nothing of
        it is logged, and the outer event is handled as if it were alone."""
        orch, inner = self.orch, []

        class CallsBack(Mapping[str, Any]):
            def _call(self) -> None:
                if inner:  # once: the first reading is handle()'s (this test's oracle reads later)
                    return
                try:
                    orch.handle(Event("gpu", "h1:g0", "quarantine", 0.0))
                except OrchestratorError as exc:
                    inner.append(exc)

            def __getitem__(self, key: str) -> Any:
                if depth == "getitem":
                    self._call()
                return {"owner": "engine:e9"}[key]

            def __iter__(self) -> Iterator[str]:
                if depth == "items":
                    self._call()
                return iter(["owner"])

            def __len__(self) -> int:
                return 1

        self.send(Event("gpu", "h1:g1", "assign", self.h.now, CallsBack()))
        assert inner, "the inner handle() was not refused"

    def teardown(self) -> None:
        # `ehp-fsm replay LOG`, in this process: the verifier a user runs (every line is flushed
        # when it is handled, so the file is whole while the log is open).
        try:
            status = ehp_fsm_main(["replay", str(self.h.log_path)])
        finally:
            super().teardown()  # `Harness.finish`: replay == live world, from a mid checkpoint
        assert status == 0, "ehp-fsm replay refused the log"


EmbeddedCaller.TestCase.settings = settings(
    EmbeddedCaller.TestCase.settings,
    max_examples=min(EmbeddedCaller.TestCase.settings.max_examples, 100),
    stateful_step_count=40,
)
TestEmbeddedCaller = EmbeddedCaller.TestCase


# -- the checks of `Orchestrator(check=True)` against the whole-world check --------------------

_CHECKED = ("gpu", "rollout_engine", "hybrid_replica", "request", "training_step")

NO_GUARDS = dict.fromkeys(GUARDS, lambda act: None)  # every guard passes: a bug's world
# the machines whose instances the invariants read, more often
MACHINE_MIX = (*(m for m in sorted(IDS) for _ in range(1 + (m in _CHECKED))),)


def _checked_harness() -> Harness:
    """A harness whose world has engines serving revision 1 (e0 on h1, e1 on h2) and groups
    dispatched to e0: the invariants have something to break from the first event."""
    h = Harness(PLAN, forget_finished=True)

    def must(machine: str, iid: str, name: str, **payload: Any) -> None:
        out = h.fire(machine, iid, name, payload)
        assert out.accepted, f"set-up {machine} {iid} {name}: {out.reason}"

    must("revision", "r1", "save", revision=1, step=0)
    must("revision", "r1", "saved", checksum="c", path="/tmp/r1")
    must("revision", "r1", "publish")
    for eid, host, gpus in (("e0", "h1", ["h1:g0", "h1:g1"]), ("e1", "h2", ["h2:g0"])):
        token = h.token(eid)
        must("rollout_engine", eid, "launch", host=host, gpus=gpus, tp=len(gpus), token=token)
        ident = {"host": host, "pid": 100, "start_time": 1000.0, "token": token}
        must("rollout_engine", eid, "healthy", identity=ident)
        must("rollout_engine", eid, "installed", revision=1)
    for gid in ("g0", "g1"):
        must("request", gid, "enqueue", prompt=gid)
        must("request", gid, "dispatch", engine="e0")
    return h


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_the_per_event_checks_give_the_whole_world_checks_verdict(data: st.DataObject) -> None:
    """`Orchestrator(check=True)` checks what each event changed (`core.checks`), not the
    whole world (`check_invariants`, O(world): ~55 ms an event at 20,000 GPUs). Its verdict
    must be the whole check's after every event: events legal and illegal, allowed ones with
    world-built payloads and their classic mistakes, main-path ones, junk, and — to break the
    invariants the guards keep — events stepped with every guard bypassed (what a guard's bug
    lets through: GPUs given two owners, taken back behind their holder, groups left on a
    failed engine, a revision published under serving engines...). Whatever `handle`
    accepted, it raised `InvariantViolation` exactly when `check_invariants(world)` finds
    problems afterwards, with those problems (a refused event changes nothing and is not
    checked, as before); an unsound world is checked whole until it is sound again, and the
    per-event checks go on from there (or a fresh sound world is started)."""
    h = _checked_harness()
    try:
        for _ in range(data.draw(st.integers(5, 40), label="events")):
            machine = data.draw(st.sampled_from(MACHINE_MIX))
            known = sorted(h.world.of(machine))
            if known and data.draw(st.integers(0, 3)) > 0:
                iid = data.draw(st.sampled_from(known))
            else:
                iid = data.draw(st.sampled_from(IDS[machine]))
            inst = h.world.get(machine, iid)
            forward = FORWARD.get(machine, {}).get(inst.state) if inst is not None else None
            if forward is not None and data.draw(st.booleans(), label="main path"):
                name = forward
            else:
                name = pick_event(data.draw, h.world, machine, iid)
            payload = (
                junk_payload(data.draw)
                if data.draw(st.integers(0, 9)) == 0
                else valid_payload(data.draw, h, machine, iid, name, clean=data.draw(st.booleans()))
            )
            guards = NO_GUARDS if data.draw(st.booleans(), label="guards off") else GUARDS
            h.now += data.draw(st.sampled_from([0.0, 1.0, 200.0]))
            before = plain_copy(h.world.snapshot())
            embedded.GUARDS, raised = guards, None  # (what `_handle` steps with)
            try:
                if not h.engine.handle(Event(machine, iid, name, h.now, payload, "p")).accepted:
                    continue  # refused: nothing changed, nothing checked (as before)
            except InvariantViolation as exc:
                raised = exc
            except Exception:
                assert h.world.snapshot() == before, "an event that raised changed the world"
                continue
            finally:
                embedded.GUARDS = GUARDS
            want = check_invariants(h.world)
            assert (raised.problems if raised is not None else []) == want, (
                f"per event: {raised and raised.problems}; whole world: {want}"
            )
            if want and data.draw(st.booleans(), label="start again"):
                h.discard()
                h = _checked_harness()
    finally:
        embedded.GUARDS = GUARDS
        h.discard()


_OWNERS = (None, "core", "engine:e0", "engine:e1", "engine:e2", "hybrid:x0", "hybrid:x1")
_H2 = ["h2:g0", "h2:g1"]
_GPU_IDS = ("h0:g0", "h0:g1", "h1:g0", "h1:g1", "h2:g0", "h2:g1", "h9:g0")
_GPU_LISTS = st.lists(st.sampled_from(_GPU_IDS), max_size=3) | st.sampled_from(
    [None, "h1:g0", _H2, ["h9:g0"], ["h3:g0"], ["h3:g0", "h3:g0"]]
)
_GROUP_LISTS = st.lists(
    st.sampled_from(["g0", "g1", "g2", "g3", "g9"]), max_size=3
) | st.sampled_from([[1], ["g3"], ["g3", "g3"]])


@st.composite
def _change(draw: Any, world: Any) -> Any:
    """One instance of a machine the invariants read, in any state of its spec, with data the
    invariants read set to right and wrong values."""
    machine = draw(st.sampled_from(_CHECKED))
    iid = draw(st.sampled_from(sorted({*IDS[machine], *world.of(machine)})))
    old = world.get(machine, iid)
    states = sorted(world.specs[machine].states)
    if old is not None and draw(st.booleans()):
        states = [old.state]  # its data changes alone
    if machine == "gpu" and len(states) > 1:
        states = [*states, "owned", "owned", "melted"]  # (most GPUs are owned)
    state = draw(st.sampled_from(states))
    data = dict(old.data) if old is not None else {}

    def maybe(key: str, values: Any) -> None:
        if old is None or draw(st.booleans()):
            data[key] = draw(values)

    if machine == "gpu":
        maybe("owner", st.sampled_from(_OWNERS))
        maybe("host", st.sampled_from(["h1", "h2"]))
    elif machine in ("rollout_engine", "hybrid_replica"):
        maybe("gpus", _GPU_LISTS)
        maybe("installed", st.sampled_from([None, 0, 1, 2]))
    elif machine == "request":
        maybe("engine", st.sampled_from(["e0", "e1", "e2", "e9", None, 5]))
    else:
        maybe("groups", _GROUP_LISTS)
    return (machine, iid), Instance(machine, iid, state, data)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_the_per_event_checks_see_every_break_the_whole_check_sees(data: st.DataObject) -> None:
    """The per-event checks (`core.checks.InvariantChecks`, what `Orchestrator(check=True)`
    runs) against `check_invariants` on worlds changed any way at all — what a bug in any
    effect could write: 1-3 instances of the machines the invariants read set to any state
    with their GPUs, owners, hosts, groups, engines and revisions right or wrong, and the
    revision moved under them. After each change both must give the same problems (the
    whole check's, in its words and order); a change that broke the world is then undone (a
    change too), after
    which both must find it sound again, and the next change starts from there."""
    h = _checked_harness()
    world = h.world
    more = {  # a Hybrid, an engine holding no GPU with a group on it, a step holding a group
        ("rollout_engine", "e1"): Instance("rollout_engine", "e1", "stopped", {"gpus": []}),
        ("hybrid_replica", "x0"): Instance("hybrid_replica", "x0", "active", {"gpus": _H2}),
        ("gpu", "h2:g0"): Instance("gpu", "h2:g0", "owned", {"host": "h2", "owner": "hybrid:x0"}),
        ("gpu", "h2:g1"): Instance("gpu", "h2:g1", "owned", {"host": "h2", "owner": "hybrid:x0"}),
        ("rollout_engine", "e2"): Instance("rollout_engine", "e2", "serving", {"installed": 1}),
        ("request", "g2"): Instance("request", "g2", "dispatched", {"engine": "e2"}),
        ("request", "g3"): Instance("request", "g3", "claimed", {}),
        ("training_step", "s1"): Instance("training_step", "s1", "computing", {"groups": ["g3"]}),
    }
    world.apply(more, {})
    assert check_invariants(world) == []
    checks = InvariantChecks(world)
    try:
        for _ in range(data.draw(st.integers(1, 30), label="changes")):
            changes = dict(data.draw(st.lists(_change(world), min_size=1, max_size=3)))
            moved = data.draw(st.sampled_from([{}, {}, {}, {"revision": 2}, {"revision": 1}]))
            undo = {k: world.get(*k) for k in changes}
            revision = world.globals["revision"]
            outcome = _fabricated(changes, moved)
            world.apply(outcome.changes, outcome.globals)
            want = check_invariants(world, indexed=True)  # (`check=True` gave these)
            assert sorted(want) == sorted(check_invariants(world))
            assert checks.check(outcome) == want
            if not want:
                continue
            for machine, iid in [k for k, v in undo.items() if v is None]:
                del world.instances[machine][iid]  # (never done by `apply`: checks made anew)
                world.reindex()
                checks = InvariantChecks(world)
            back = {k: v for k, v in undo.items() if v is not None}
            outcome = _fabricated(back, {"revision": revision})
            world.apply(outcome.changes, outcome.globals)
            assert checks.check(outcome) == check_invariants(world, indexed=True) == []
    finally:
        h.discard()


def _fabricated(changes: Mapping[Any, Any], moved: Mapping[str, Any]) -> Accepted:
    return Accepted(Event("gpu", "-", "-", 0.0), (), (), changes, moved)
