"""The pure step function: `step(world, event) -> Accepted | Rejected`.

What it knows: how to look up the transition for (state, event), run its guards (named pure
predicates returning a reason or None) and its effects (named functions that patch the instance's
data, patch globals, emit commands for the shell, or cascade events to other machines in the same
atomic step). What it does not know: what any guard or effect means (see `guards` and `effects`),
clocks, logs, sockets. `step` never writes the world; the caller applies an `Accepted` with
`World.apply(outcome.changes, outcome.globals)`. A `Rejected` carries the reason and changes
nothing — a cascaded event that is refused refuses the whole step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ehp_fsm.core.spec import NEW, MachineSpec, TransitionSpec
from ehp_fsm.core.world import EMPTY, Event, Instance, World

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


class View:
    """Read access to the world as it will be if the current step is accepted."""

    __slots__ = ("_changes", "_globals", "world")

    def __init__(self, world: World) -> None:
        self.world = world
        self._changes: dict[tuple[str, str], Instance] = {}
        self._globals: dict[str, Any] = {}

    def get(self, machine: str, instance_id: str) -> Instance | None:
        inst = self._changes.get((machine, instance_id))
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
    """What a guard sees: the view, the instance (as before the transition) and the event."""

    __slots__ = ("event", "inst", "spec", "transition", "view")

    def __init__(
        self, view: View, inst: Instance, event: Event, spec: MachineSpec, t: TransitionSpec
    ) -> None:
        self.view, self.inst, self.event, self.spec, self.transition = view, inst, event, spec, t

    @property
    def payload(self) -> Mapping[str, Any]:
        return self.event.payload

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
        self.commands.append(Command(kind, self.inst.machine, self.inst.id, MappingProxyType(args)))

    def cascade(self, machine: str, instance_id: str, name: str, **payload: Any) -> None:
        self.cascades.append(
            Event(
                machine,
                instance_id,
                name,
                self.event.time,
                MappingProxyType(payload),
                self.event.correlation,
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
    view = View(world)
    records: list[Record] = []
    commands: list[Command] = []
    try:
        _fire(view, event, guards, effects, records, commands, cause=None, depth=0)
    except _Refused as refused:
        spec = world.specs.get(event.machine)
        inst = world.instances[event.machine].get(event.instance) if spec else None
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
    return Accepted(event, tuple(records), tuple(commands), view._changes, view._globals)


def _fire(
    view: View,
    event: Event,
    guards: Mapping[str, Guard],
    effects: Mapping[str, Effect],
    records: list[Record],
    commands: list[Command],
    cause: int | None,
    depth: int,
) -> None:
    spec = view.world.specs.get(event.machine)
    if spec is None:
        raise _Refused(f"unknown machine {event.machine!r}; known: {sorted(view.world.specs)}")
    inst = view.get(event.machine, event.instance)
    t: TransitionSpec | None
    if inst is None:
        if event.name != spec.create.event:
            raise _Refused(
                f"{event.machine} {event.instance!r} does not exist; "
                f"create it with event {spec.create.event!r}"
            )
        t = spec.create
        inst = Instance(event.machine, event.instance, NEW)
    else:
        if inst.state in spec.terminal:
            raise _Refused(
                f"{event.machine} {event.instance!r} is in terminal state {inst.state!r}, "
                "which absorbs every event"
            )
        t = spec.table.get((inst.state, event.name))
        if t is None:
            allowed = spec.allowed_events(inst.state)
            raise _Refused(
                f"event {event.name!r} is not allowed for {event.machine} {event.instance!r} "
                f"in state {inst.state!r}; allowed: {list(allowed)}"
            )
    if t.guards:
        ctx = Ctx(view, inst, event, spec, t)
        for name in t.guards:
            reason = guards[name](ctx)
            if reason is not None:
                raise _Refused(f"guard {name} refused: {reason}")
    act = Act(view, inst, event, spec, t)
    for name in t.effects:
        effects[name](act)
    key = (event.machine, event.instance)
    view._changes[key] = Instance(
        event.machine, event.instance, t.dest, MappingProxyType(act.data) if act.data else EMPTY
    )
    view._globals.update(act.globals)
    index = len(records)
    records.append(
        Record(
            event.machine,
            event.instance,
            inst.state,
            event.name,
            t.dest,
            True,
            "",
            tuple(act.commands),
            cause,
            event.payload,
        )
    )
    commands.extend(act.commands)
    if act.cascades and depth >= MAX_CASCADE_DEPTH:
        raise _Refused(f"cascade deeper than {MAX_CASCADE_DEPTH} events; the specs loop")
    for sub in act.cascades:
        try:
            _fire(view, sub, guards, effects, records, commands, index, depth + 1)
        except _Refused as refused:
            raise _Refused(
                f"cascaded {sub.name!r} to {sub.machine} {sub.instance!r} was refused "
                f"({refused.reason})"
            ) from None
