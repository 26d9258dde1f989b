"""The pure step function: `step(world, event) -> Accepted | Rejected`.

What it knows: how to look up the transition for (state, event), run its guards (named pure
predicates returning a reason or None) and its effects (named functions that patch the instance's
data, patch globals, emit commands for the shell, or cascade events to other machines in the same
atomic step). What it does not know: what any guard or effect means (see `guards` and `effects`),
clocks, logs, sockets. `step` never writes the world; the caller applies an `Accepted` with
`World.apply(outcome.changes, outcome.globals)`. A `Rejected` carries the reason and changes
nothing — a cascaded event that is refused refuses the whole step.

Speed: `step` is the inner loop of the controller and of replay. Its results (`Instance`,
`Record`, `Command`, `Accepted`, `Rejected`) and the `View` and `Act` it builds per step are
`msgspec.Struct`s, whose constructors are written in C; guards and effects get one `Act` (a
`Ctx`) per transition. Instance data is a plain dict, built fresh per transition and never
written afterwards.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import msgspec

from ehp_fsm.core.spec import NEW, MachineSpec, TransitionSpec
from ehp_fsm.core.world import EMPTY, Event, Instance, World

MAX_CASCADE_DEPTH = 8


class Command(msgspec.Struct, frozen=True, gc=False):
    """An effect for the shell to perform, as data (launch, stop process X, install r, ...)."""

    kind: str
    machine: str
    instance: str
    args: Mapping[str, Any] = EMPTY

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "machine": self.machine,
            "instance": self.instance,
            "args": dict(self.args),
        }


class Record(msgspec.Struct, frozen=True, gc=False):
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
    payload: Mapping[str, Any] = EMPTY


class Accepted(msgspec.Struct, frozen=True):
    """An accepted event: its records, the commands to perform, the world's changes. Both
    outcomes answer `accepted`, `commands` and `reason` (here: none), so a caller may read
    them without first asking which it got."""

    event: Event
    records: tuple[Record, ...]
    commands: tuple[Command, ...]
    changes: Mapping[tuple[str, str], Instance]
    globals: Mapping[str, Any]
    accepted: ClassVar[bool] = True
    reason: ClassVar[str] = ""


class Rejected(msgspec.Struct, frozen=True):
    """A refused event: why, and its one record; it changes nothing and commands nothing."""

    event: Event
    reason: str
    records: tuple[Record, ...]
    accepted: ClassVar[bool] = False
    commands: ClassVar[tuple[Command, ...]] = ()


Outcome = Accepted | Rejected


class View(msgspec.Struct):
    """Read access to the world as it will be if the current step is accepted: the world and
    the step's pending instance changes and globals."""

    world: World
    changes: dict[tuple[str, str], Instance] = msgspec.field(default_factory=dict)
    globals: dict[str, Any] = msgspec.field(default_factory=dict)

    def get(self, machine: str, instance_id: str) -> Instance | None:
        inst = self.changes.get((machine, instance_id)) if self.changes else None
        if inst is None:
            inst = self.world.instances[machine].get(instance_id)
            if inst is None and self.world.forgotten is not None:
                return self.world.forgotten(machine, instance_id)
        return inst

    def all(self, machine: str) -> list[Instance]:
        """Every instance of `machine`, pending changes included, in id order."""
        merged = dict(self.world.instances[machine])
        for (m, iid), inst in self.changes.items():
            if m == machine:
                merged[iid] = inst
        return [merged[k] for k in sorted(merged)]

    def each(self, machine: str) -> Iterator[Instance]:
        """Every instance of `machine`, pending changes included, in no particular order: for
        a guard that only asks whether one exists (no copy, no sort of the whole machine)."""
        pending = {iid: inst for (m, iid), inst in self.changes.items() if m == machine}
        for iid, inst in self.world.instances[machine].items():
            yield pending.pop(iid, inst)
        yield from pending.values()

    def glob(self, key: str) -> Any:
        return self.globals[key] if key in self.globals else self.world.globals.get(key)

    @property
    def config(self) -> Mapping[str, Any]:
        return self.world.config


class Ctx(msgspec.Struct):
    """What a guard sees: the view, the instance (as before the transition), the event, its
    machine spec and transition, and `payload` (the event's payload)."""

    view: View
    inst: Instance
    event: Event
    spec: MachineSpec
    transition: TransitionSpec
    payload: Mapping[str, Any]

    @property
    def owner_key(self) -> str:
        """How GPUs name this instance as their owner, e.g. `engine:e0`."""
        return f"{_OWNER_PREFIX.get(self.inst.machine, self.inst.machine)}:{self.inst.id}"


_OWNER_PREFIX = {"rollout_engine": "engine", "hybrid_replica": "hybrid"}


class Act(Ctx):
    """What an effect gets: a `Ctx` that can also write the pending step — the instance's new
    `data` (a copy of the old), globals, commands for the shell and cascaded events."""

    data: dict[str, Any]
    globals: dict[str, Any] = msgspec.field(default_factory=dict)
    commands: list[Command] = msgspec.field(default_factory=list)
    cascades: list[Event] = msgspec.field(default_factory=list)

    def set(self, **values: Any) -> None:
        self.data.update(values)

    def set_global(self, key: str, value: Any) -> None:
        self.globals[key] = value

    def emit(self, kind: str, **args: Any) -> None:
        self.commands.append(Command(kind, self.inst.machine, self.inst.id, MappingProxyType(args)))

    def cascade(self, machine: str, instance_id: str, name: str, **payload: Any) -> None:
        ev = self.event
        self.cascades.append(
            Event(machine, instance_id, name, ev.time, MappingProxyType(payload), ev.correlation)
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
    view = View(world)
    records: list[Record] = []
    try:
        _fire(view, event, guards, effects, records, None, 0)
    except _Refused as refused:
        spec = world.specs.get(event.machine)
        known = spec is not None and type(event.instance) is str
        inst = world.get(event.machine, event.instance) if known else None
        source = inst.state if inst is not None else NEW
        root = Record(
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
        return Rejected(event, refused.reason, (root,))
    # Every command of the step, in the order the transitions fired (each record's own first).
    if len(records) == 1:
        commands = records[0].commands
    else:
        commands = tuple(c for r in records for c in r.commands)
    return Accepted(event, tuple(records), commands, view.changes, view.globals)


def _fire(
    view: View,
    event: Event,
    guards: Mapping[str, Guard],
    effects: Mapping[str, Effect],
    records: list[Record],
    cause: int | None,
    depth: int,
) -> None:
    machine = event.machine
    iid = event.instance
    name = event.name
    payload = event.payload
    world = view.world
    spec = world.specs.get(machine)
    if spec is None:
        raise _Refused(f"unknown machine {machine!r}; known: {sorted(world.specs)}")
    if type(iid) is not str:  # the boundary: ids are strings (a guard types a payload's ids)
        raise _Refused(f"the event's instance must be an id (a string), got {iid!r}")
    key = (machine, iid)
    changes = view.changes
    inst = changes.get(key) if changes else None
    if inst is None:
        inst = world.instances[machine].get(iid)
        if inst is None and world.forgotten is not None:
            inst = world.forgotten(machine, iid)
    t: TransitionSpec | None
    if inst is None:
        if name != spec.create.event:
            raise _Refused(
                f"{machine} {iid!r} does not exist; create it with event {spec.create.event!r}"
            )
        t = spec.create
        inst = Instance(machine, iid, NEW, EMPTY)
    else:
        if inst.state in spec.terminal:
            raise _Refused(
                f"{machine} {iid!r} is in terminal state {inst.state!r}, which absorbs every event"
            )
        t = spec.table.get((inst.state, name))
        if t is None:
            if name not in (known := spec.events):  # a typo read as "not allowed in this state"
                close = difflib.get_close_matches(name, known, n=1) if type(name) is str else []
                raise _Refused(
                    f"{machine} has no event {name!r}"
                    + (f" (did you mean {close[0]!r}?)" if close else "")
                    + f"; its events: {list(known)}"
                )
            allowed = spec.allowed_events(inst.state)
            raise _Refused(
                f"event {name!r} is not allowed for {machine} {iid!r} "
                f"in state {inst.state!r}; allowed: {list(allowed)}"
            )
    # One Act per transition: the guards read it as their Ctx, then the effects write it.
    act = Act(view, inst, event, spec, t, payload, dict(inst.data))
    for guard_name in t.guards:
        reason = guards[guard_name](act)
        if reason is not None:
            raise _Refused(f"guard {guard_name} refused: {reason}")
    for effect_name in t.effects:
        effects[effect_name](act)
    emitted, cascades = act.commands, act.cascades
    dest = t.dest
    changes[key] = Instance(machine, iid, dest, act.data if act.data else EMPTY)
    if act.globals:
        view.globals.update(act.globals)
    commands = tuple(emitted) if emitted else ()
    records.append(Record(machine, iid, inst.state, name, dest, True, "", commands, cause, payload))
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
