"""The pure step function: `step(world, event) -> Accepted | Rejected`.

What it knows: how to look up the transition for (state, event), run its guards (named pure
predicates returning a reason or None) and its effects (named functions that patch the instance's
data, patch globals, emit commands for the shell, or cascade events to other machines in the same
atomic step). What it does not know: what any guard or effect means (see `guards` and `effects`),
clocks, logs, sockets. `step` never writes the world; the caller applies an `Accepted` with
`World.apply(outcome.changes, outcome.globals)`. A `Rejected` carries the reason and changes
nothing — a cascaded event that is refused refuses the whole step.

Speed: `step` is the inner loop of the controller and of replay, so it builds its frozen results
(`Instance`, `Record`, `Command`, `Accepted`, `Rejected`) with fast constructors (a mutable
twin with the same slots, re-classed: see `world.builder`) and hands guards and effects one
`Act` (a `Ctx`) per transition. Instance data is a plain dict, built fresh per transition and
never written afterwards. What a step returns is the same, field for field, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, cast

from ehp_fsm.core.spec import NEW, MachineSpec, TransitionSpec
from ehp_fsm.core.world import EMPTY, Event, Instance, World, builder, new_event, new_instance

MAX_CASCADE_DEPTH = 8


@dataclass(frozen=True, slots=True)
class Command:
    """An effect for the shell to perform, as data (launch, stop process X, install r, ...)."""

    kind: str
    machine: str
    instance: str
    args: Mapping[str, Any] = field(default_factory=lambda: EMPTY)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "machine": self.machine,
            "instance": self.instance,
            "args": dict(self.args),
        }


@dataclass(frozen=True, slots=True)
class Record:
    """One attempted transition, as the transition log stores it. `cause` is the index of the
    record (within the same outcome) whose effect cascaded this one; None for the root."""

    machine: str
    instance: str
    source: str
    event: str
    dest: str
    accepted: bool
    reason: str
    commands: tuple[Command, ...]
    cause: int | None
    payload: Mapping[str, Any] = field(default_factory=lambda: EMPTY)


@dataclass(frozen=True, slots=True)
class Accepted:
    event: Event
    records: tuple[Record, ...]
    commands: tuple[Command, ...]
    changes: Mapping[tuple[str, str], Instance]
    globals: Mapping[str, Any]
    accepted: bool = field(default=True, init=False)


@dataclass(frozen=True, slots=True)
class Rejected:
    event: Event
    reason: str
    records: tuple[Record, ...]
    accepted: bool = field(default=False, init=False)


Outcome = Accepted | Rejected

_new = object.__new__
_InstanceBuilder = builder(Instance)
_CommandBuilder = builder(Command)
_RecordBuilder = builder(Record)
_AcceptedBuilder = builder(Accepted)
_RejectedBuilder = builder(Rejected)


def _record(
    machine: str,
    instance: str,
    source: str,
    event: str,
    dest: str,
    accepted: bool,
    reason: str,
    commands: tuple[Command, ...],
    cause: int | None,
    payload: Mapping[str, Any],
) -> Record:
    """`Record(...)` with the same arguments, built faster (see `world.builder`)."""
    r = _new(_RecordBuilder)
    r.machine = machine
    r.instance = instance
    r.source = source
    r.event = event
    r.dest = dest
    r.accepted = accepted
    r.reason = reason
    r.commands = commands
    r.cause = cause
    r.payload = payload
    r.__class__ = Record
    return cast(Record, r)


def _rejected(event: Event, reason: str, records: tuple[Record, ...]) -> Rejected:
    """`Rejected(event, reason, records)`, built faster."""
    j = _new(_RejectedBuilder)
    j.event = event
    j.reason = reason
    j.records = records
    j.accepted = False
    j.__class__ = Rejected
    return cast(Rejected, j)


def _check_builders() -> None:
    """Import-time proof that the builders build what the dataclasses build. (`_fire`, `step`
    and `Act.emit` write the same stores out; every test of an outcome covers those.)"""
    ev = Event("m", "i", "e", 1.0)
    c = Command("k", "m", "i", EMPTY)
    r = Record("m", "i", "s", "e", "d", True, "", (c,), None, EMPTY)
    if _record("m", "i", "s", "e", "d", True, "", (c,), None, EMPTY) != r or _rejected(
        ev, "x", (r,)
    ) != Rejected(ev, "x", (r,)):
        raise TypeError("the fast constructors of engine.py no longer build what the classes do")


_check_builders()


class View:
    """Read access to the world as it will be if the current step is accepted."""

    __slots__ = ("_changes", "_globals", "world")

    def __init__(self, world: World) -> None:
        self.world = world
        self._changes: dict[tuple[str, str], Instance] = {}
        self._globals: dict[str, Any] = {}

    def get(self, machine: str, instance_id: str) -> Instance | None:
        inst = self._changes.get((machine, instance_id)) if self._changes else None
        return inst if inst is not None else self.world.instances[machine].get(instance_id)

    def all(self, machine: str) -> list[Instance]:
        """Every instance of `machine`, pending changes included, in id order."""
        merged = dict(self.world.instances[machine])
        for (m, iid), inst in self._changes.items():
            if m == machine:
                merged[iid] = inst
        return [merged[k] for k in sorted(merged)]

    def glob(self, key: str) -> Any:
        return self._globals[key] if key in self._globals else self.world.globals.get(key)

    @property
    def config(self) -> Mapping[str, Any]:
        return self.world.config


class Ctx:
    """What a guard sees: the view, the instance (as before the transition) and the event
    (`payload` is the event's payload)."""

    __slots__ = ("event", "inst", "payload", "spec", "transition", "view")

    def __init__(
        self, view: View, inst: Instance, event: Event, spec: MachineSpec, t: TransitionSpec
    ) -> None:
        self.view, self.inst, self.event, self.spec, self.transition = view, inst, event, spec, t
        self.payload: Mapping[str, Any] = event.payload

    @property
    def owner_key(self) -> str:
        """How GPUs name this instance as their owner, e.g. `engine:e0`."""
        return f"{_OWNER_PREFIX.get(self.inst.machine, self.inst.machine)}:{self.inst.id}"


_OWNER_PREFIX = {"rollout_engine": "engine", "hybrid_replica": "hybrid"}


class Act(Ctx):
    """What an effect gets: a `Ctx` that can also write the pending step."""

    __slots__ = ("cascades", "commands", "data", "globals")

    def __init__(
        self, view: View, inst: Instance, event: Event, spec: MachineSpec, t: TransitionSpec
    ) -> None:
        super().__init__(view, inst, event, spec, t)
        self.data: dict[str, Any] = dict(inst.data)
        self.globals: dict[str, Any] = {}
        self.commands: list[Command] = []
        self.cascades: list[Event] = []

    def set(self, **values: Any) -> None:
        self.data.update(values)

    def set_global(self, key: str, value: Any) -> None:
        self.globals[key] = value

    def emit(self, kind: str, **args: Any) -> None:
        c = _new(_CommandBuilder)  # Command(kind, machine, instance, args), see world.builder
        c.kind = kind
        c.machine = self.inst.machine
        c.instance = self.inst.id
        c.args = MappingProxyType(args)
        c.__class__ = Command
        self.commands.append(c)

    def cascade(self, machine: str, instance_id: str, name: str, **payload: Any) -> None:
        ev = self.event
        self.cascades.append(
            new_event(
                machine, instance_id, name, ev.time, MappingProxyType(payload), ev.correlation
            )
        )


Guard = Callable[[Ctx], str | None]
Effect = Callable[[Act], None]


class _Refused(Exception):
    """Internal: unwinds a cascade when one of its events is refused."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def step(
    world: World,
    event: Event,
    guards: Mapping[str, Guard],
    effects: Mapping[str, Effect],
) -> Outcome:
    """Compute the outcome of `event` against `world` without changing it."""
    view: View = _new(View)
    view.world = world
    view._changes = {}
    view._globals = {}
    records: list[Record] = []
    try:
        _fire(view, event, guards, effects, records, None, 0)
    except _Refused as refused:
        spec = world.specs.get(event.machine)
        inst = world.instances[event.machine].get(event.instance) if spec else None
        source = inst.state if inst is not None else NEW
        root = _record(
            event.machine,
            event.instance,
            source,
            event.name,
            source,
            False,
            refused.reason,
            (),
            None,
            event.payload,
        )
        return _rejected(event, refused.reason, (root,))
    # Every command of the step, in the order the transitions fired (each record's own first).
    if len(records) == 1:
        commands = records[0].commands
    else:
        commands = tuple(c for r in records for c in r.commands)
    a = _new(_AcceptedBuilder)  # Accepted(event, records, commands, changes, globals)
    a.event = event
    a.records = tuple(records)
    a.commands = commands
    a.changes = view._changes
    a.globals = view._globals
    a.accepted = True
    a.__class__ = Accepted
    return cast(Accepted, a)


def _fire(
    view: View,
    event: Event,
    guards: Mapping[str, Guard],
    effects: Mapping[str, Effect],
    records: list[Record],
    cause: int | None,
    depth: int,
) -> None:
    # The constructors of `Act`, `Instance` and `Record` are written out here (see the module
    # docstring): this function runs once per transition.
    machine = event.machine
    iid = event.instance
    name = event.name
    payload = event.payload
    world = view.world
    spec = world.specs.get(machine)
    if spec is None:
        raise _Refused(f"unknown machine {machine!r}; known: {sorted(world.specs)}")
    key = (machine, iid)
    changes = view._changes
    inst = changes.get(key) if changes else None
    if inst is None:
        inst = world.instances[machine].get(iid)
    t: TransitionSpec | None
    if inst is None:
        if name != spec.create.event:
            raise _Refused(
                f"{machine} {iid!r} does not exist; create it with event {spec.create.event!r}"
            )
        t = spec.create
        inst = new_instance(machine, iid, NEW, EMPTY)
    else:
        if inst.state in spec.terminal:
            raise _Refused(
                f"{machine} {iid!r} is in terminal state {inst.state!r}, which absorbs every event"
            )
        t = spec.table.get((inst.state, name))
        if t is None:
            allowed = spec.allowed_events(inst.state)
            raise _Refused(
                f"event {name!r} is not allowed for {machine} {iid!r} "
                f"in state {inst.state!r}; allowed: {list(allowed)}"
            )
    # One Act per transition: the guards read it as their Ctx, then the effects write it.
    act: Act = _new(Act)
    act.view = view
    act.inst = inst
    act.event = event
    act.spec = spec
    act.transition = t
    act.payload = payload
    act.data = dict(inst.data)
    act.globals = {}
    act.commands = []
    act.cascades = []
    for guard_name in t.guards:
        reason = guards[guard_name](act)
        if reason is not None:
            raise _Refused(f"guard {guard_name} refused: {reason}")
    for effect_name in t.effects:
        effects[effect_name](act)
    emitted, cascades = act.commands, act.cascades
    dest = t.dest
    new = _new(_InstanceBuilder)
    new.machine = machine
    new.id = iid
    new.state = dest
    new.data = act.data if act.data else EMPTY
    new.__class__ = Instance
    changes[key] = new
    if act.globals:
        view._globals.update(act.globals)
    r = _new(_RecordBuilder)
    r.machine = machine
    r.instance = iid
    r.source = inst.state
    r.event = name
    r.dest = dest
    r.accepted = True
    r.reason = ""
    r.commands = tuple(emitted) if emitted else ()
    r.cause = cause
    r.payload = payload
    r.__class__ = Record
    records.append(r)
    if not cascades:
        return
    index = len(records) - 1  # this record: the cause of what it cascades
    if depth >= MAX_CASCADE_DEPTH:
        raise _Refused(f"cascade deeper than {MAX_CASCADE_DEPTH} events; the specs loop")
    for sub in cascades:
        try:
            _fire(view, sub, guards, effects, records, index, depth + 1)
        except _Refused as refused:
            raise _Refused(
                f"cascaded {sub.name!r} to {sub.machine} {sub.instance!r} was refused "
                f"({refused.reason})"
            ) from None
