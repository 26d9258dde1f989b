"""Machine specs: states, events and guarded transitions, as data, checked when loaded.

A spec is one TOML document per machine (the files live in `specs/`). This module parses an
already-read document into a frozen `MachineSpec` and checks it; it knows nothing about files on
disk (see `ehp_fsm.specs`), the world, or what guards and effects do — only their names, which it
checks against the names the caller says are implemented.

Spec format::

    machine = "gpu"
    description = "one physical device"
    initial = "free"
    terminal = ["failed"]
    [states]                      # name = one-line meaning
    free = "no owner"
    [create]                      # the event that brings an instance into being
    event = "register"
    guards = []
    effects = ["record_host"]
    [[transitions]]
    event = "assign"
    source = "free"               # a state, a list of states, or "*" (every non-terminal state)
    dest = "owned"
    guards = ["owner_is_valid"]
    effects = ["set_owner"]
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, field
from typing import Any

from ehp_fsm.errors import SpecError

ANY_STATE = "*"
NEW = "<new>"  # the pseudo-source of a create transition

_TOP_KEYS = {"machine", "description", "initial", "terminal", "states", "create", "transitions"}
_TRANSITION_KEYS = {"event", "source", "dest", "guards", "effects", "doc"}
_CREATE_KEYS = {"event", "guards", "effects", "doc"}


@dataclass(frozen=True, slots=True)
class TransitionSpec:
    """One edge: in `source`, `event` moves to `dest` if every guard passes, then runs effects."""

    event: str
    source: str
    dest: str
    guards: tuple[str, ...] = ()
    effects: tuple[str, ...] = ()
    doc: str = ""


@dataclass(frozen=True, slots=True)
class MachineSpec:
    name: str
    file: str
    description: str
    states: Mapping[str, str]
    initial: str
    terminal: frozenset[str]
    create: TransitionSpec
    transitions: tuple[TransitionSpec, ...]
    table: Mapping[tuple[str, str], TransitionSpec] = field(repr=False)

    @property
    def events(self) -> tuple[str, ...]:
        seen = dict.fromkeys([self.create.event] + [t.event for t in self.transitions])
        return tuple(seen)

    def allowed_events(self, state: str) -> tuple[str, ...]:
        """Events with a transition out of `state`, in spec order."""
        return tuple(t.event for t in self.transitions if t.source == state)


def _str_list(doc: Mapping[str, Any], key: str, file: str, where: str) -> tuple[str, ...]:
    value = doc.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SpecError(
            file,
            f"{where}.{key}",
            f"it must be a list of names, got {value!r}",
            f'write `{key} = ["name", ...]`',
        )
    return tuple(value)


def _require_str(doc: Mapping[str, Any], key: str, file: str, where: str) -> str:
    value = doc.get(key)
    if not isinstance(value, str) or not value:
        raise SpecError(
            file,
            f"{where}{key}",
            f"it must be a non-empty string, got {value!r}",
            f'add `{key} = "..."`',
        )
    return value


def _unknown_keys(doc: Mapping[str, Any], allowed: Set[str], file: str, where: str) -> None:
    extra = sorted(set(doc) - allowed)
    if extra:
        raise SpecError(
            file, f"{where}{extra[0]}", "it is not a spec key", f"use only {sorted(allowed)}"
        )


def parse_spec(
    doc: Mapping[str, Any],
    *,
    file: str,
    guards: Set[str],
    effects: Set[str],
) -> MachineSpec:
    """Parse and check one spec document; `guards`/`effects` are the implemented names.

    Raises `SpecError` naming the file, the key and a fix for: unknown keys, unknown states,
    unreachable states, non-terminal dead ends, terminal states with exits, two transitions that
    can fire for the same (state, event), and guard or effect names with no implementation.
    """
    _unknown_keys(doc, _TOP_KEYS, file, "")
    name = _require_str(doc, "machine", file, "")
    states_doc = doc.get("states")
    if not isinstance(states_doc, dict) or not states_doc:
        raise SpecError(
            file,
            "states",
            "a spec needs a [states] table with at least one state",
            'add `[states]` with lines like `idle = "what idle means"`',
        )
    states = {str(k): str(v) for k, v in states_doc.items()}
    initial = _require_str(doc, "initial", file, "")
    terminal = frozenset(_str_list(doc, "terminal", file, "spec"))

    def known(state: str, key: str) -> str:
        if state not in states:
            raise SpecError(
                file,
                key,
                f"state {state!r} is not declared in [states]",
                f"declare it or use one of {sorted(states)}",
            )
        return state

    known(initial, "initial")
    for i, s in enumerate(sorted(terminal)):
        known(s, f"terminal[{i}]")

    def names(entry: Mapping[str, Any], where: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        g = _str_list(entry, "guards", file, where)
        e = _str_list(entry, "effects", file, where)
        for n in g:
            if n not in guards:
                raise SpecError(
                    file,
                    f"{where}.guards",
                    f"guard {n!r} has no implementation",
                    "implement it in ehp_fsm.core.guards or fix the name",
                )
        for n in e:
            if n not in effects:
                raise SpecError(
                    file,
                    f"{where}.effects",
                    f"effect {n!r} has no implementation",
                    "implement it in ehp_fsm.core.effects or fix the name",
                )
        return g, e

    create_doc = doc.get("create")
    if not isinstance(create_doc, dict):
        raise SpecError(
            file,
            "create",
            "a spec needs a [create] table",
            'add `[create]` with `event = "..."` naming the event that creates an instance',
        )
    _unknown_keys(create_doc, _CREATE_KEYS, file, "create.")
    cg, ce = names(create_doc, "create")
    create = TransitionSpec(
        _require_str(create_doc, "event", file, "create."),
        NEW,
        initial,
        cg,
        ce,
        str(create_doc.get("doc", "")),
    )

    raw = doc.get("transitions", [])
    if not isinstance(raw, list):
        raise SpecError(
            file,
            "transitions",
            "it must be an array of tables",
            "write each transition as a `[[transitions]]` table",
        )
    table: dict[tuple[str, str], TransitionSpec] = {}
    expanded: list[TransitionSpec] = []
    for i, entry in enumerate(raw):
        where = f"transitions[{i}]"
        if not isinstance(entry, dict):
            raise SpecError(file, where, "it must be a table", "write it as `[[transitions]]`")
        _unknown_keys(entry, _TRANSITION_KEYS, file, f"{where}.")
        event = _require_str(entry, "event", file, f"{where}.")
        if event == create.event:
            raise SpecError(
                file,
                f"{where}.event",
                f"{event!r} is the create event",
                "give transitions of existing instances another event name",
            )
        dest = known(_require_str(entry, "dest", file, f"{where}."), f"{where}.dest")
        src = entry.get("source")
        if src == ANY_STATE:
            sources: Iterable[str] = [s for s in states if s not in terminal]
        elif isinstance(src, str):
            sources = [known(src, f"{where}.source")]
        elif isinstance(src, list) and src and all(isinstance(s, str) for s in src):
            sources = [known(s, f"{where}.source") for s in src]
        else:
            raise SpecError(
                file,
                f"{where}.source",
                f"it must be a state, a list or '*', got {src!r}",
                'write `source = "state"`, `source = ["a", "b"]` or `source = "*"`',
            )
        g, e = names(entry, where)
        for s in sources:
            if s in terminal:
                raise SpecError(
                    file,
                    f"{where}.source",
                    f"{s!r} is terminal and terminal states absorb every event",
                    "remove the transition or make the state non-terminal",
                )
            if (s, event) in table:
                raise SpecError(
                    file,
                    f"{where}",
                    f"a second transition fires for ({s!r}, {event!r})",
                    "merge the two or give one a different event name",
                )
            t = TransitionSpec(event, s, dest, g, e, str(entry.get("doc", "")))
            table[(s, event)] = t
            expanded.append(t)

    reachable = {initial}
    frontier = [initial]
    while frontier:
        s = frontier.pop()
        for t in expanded:
            if t.source == s and t.dest not in reachable:
                reachable.add(t.dest)
                frontier.append(t.dest)
    for s in states:
        if s not in reachable:
            raise SpecError(
                file,
                f"states.{s}",
                f"state {s!r} is unreachable from {initial!r}",
                "add a transition into it or remove it",
            )
        if s not in terminal and not any(t.source == s for t in expanded):
            raise SpecError(
                file,
                f"states.{s}",
                f"state {s!r} is a dead end but is not declared terminal",
                "add a transition out of it or list it in `terminal`",
            )
    return MachineSpec(
        name=name,
        file=file,
        description=str(doc.get("description", "")),
        states=states,
        initial=initial,
        terminal=terminal,
        create=create,
        transitions=tuple(expanded),
        table=table,
    )
