"""The orchestrator for embedding: feed events, get back the effects to perform, guards enforced.

    from ehp_fsm import Orchestrator, Event, load_plan
    orch = Orchestrator.from_plan(load_plan("examples/local.toml"), log_path="t.jsonl")
    outcome = orch.handle(Event("rollout_engine", "e0", "drain", time=now))
    if outcome.accepted:
        for command in outcome.commands: ...   # perform: stop process X, install revision r, ...
    else:
        print(outcome.reason)                  # which guard refused and why; nothing changed

`Orchestrator` is the thin shell around the pure core: it calls `core.transition.step`, applies
an accepted outcome to its world, writes every attempted transition to the transition log, and (with
`check=True`) asserts the safety invariants after each accepted step (`core.checks`: the verdict
of `core.invariants.check_invariants` at the cost of what the step changed). It performs no
command: that is the caller's (or `ehp-fsm run`'s runtime) job. An event is handled whole or not
at all: an exception that interrupts it (a KeyboardInterrupt between the log's write and the
world's change) takes the log and the world back to where they were before it. After a crash,
`Orchestrator.resume(log_path)` rebuilds the world from the log and goes on writing it.

Its world forgets finished instances as it goes (`finished.WRITER_FORGETS`: a step's consumed
groups, a done step, a retired revision), as replay's does, so its memory and its checkpoint
lines follow the live world, not the run's length: `world.get` still answers such an instance
in its state (an event for it is refused as before), but its data is gone (reading it raises
`finished.Unsure`) and `world.of` lists the live instances only. `forget_finished=False` keeps
every instance (and its checkpoints list them all).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from time import sleep
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

from ehp_fsm.core.checks import InvariantChecks
from ehp_fsm.core.effects import EFFECTS
from ehp_fsm.core.guards import GUARDS
from ehp_fsm.core.spec import MachineSpec
from ehp_fsm.core.timers import due_deadlines, next_deadline
from ehp_fsm.core.transition import Accepted, Outcome, Rejected, step
from ehp_fsm.core.world import Event, Instance, World, config_problem
from ehp_fsm.errors import EhpError, LogFormatError, printable
from ehp_fsm.finished import FORGETTABLE_STATES, WRITER_FORGETS, Forgetter
from ehp_fsm.fspaths import kind_of
from ehp_fsm.loglines import line_limit
from ehp_fsm.plan import Plan
from ehp_fsm.specfiles import load_specs
from ehp_fsm.translog import (
    FINISHED_SINCE,
    TransitionLog,
    config_fingerprint,
    log_key,
    open_to_append,
    specs_differ,
    starts_a_log,
)

if TYPE_CHECKING:  # (imported by `resume` when it runs: recovery replays, which imports this)
    from ehp_fsm.runtime.recovery import RecoveryReport


class EngineLike(Protocol):
    """What shells that fire events need: the world to read and `handle`. `Orchestrator` is one; the
    run's controller-backed facade is another."""

    @property
    def world(self) -> World: ...

    def handle(self, event: Event) -> Outcome: ...


class EventError(EhpError):
    """An event whose fields cannot be interpreted (a caller bug): not a rejected event."""


class OrchestratorError(EhpError):
    """The orchestrator was misused: `handle` called while it handles an event (from the
    caller's own code it ran, or another thread), or after `close`."""


def _admitted(event: Event) -> Event:
    """`event` as it is stepped and logged: the event itself when it is already what its log
    line will give back to replay (exact `str` ids, a finite float time, a dict or read-only
    payload of JSON scalars), else a copy in that form (str, int and float subclasses — an
    enum, a numpy float — as their plain values; tuples as lists; mappings as dicts; every
    list and dict copied, so that what the world keeps of it is not the caller's). Raises
    `EventError` naming the field when there is no such form: replay steps the logged line,
    so an event the log cannot give back as it was handled (a set, bytes, an object, NaN, a
    non-string key or id) would be decided one way live and another way on replay. Text that
    is not UTF-8 (a lone surrogate) is refused when the log cannot write it. The payload is
    walked before any guard sees it, so no caller code (a mapping's `__getitem__`, a value's
    `__eq__`) runs inside a step.

    The event every shell builds (exact types, scalar payload values) passes by the first
    test alone: the general path costs more than a simulated event's step."""
    if type(event) is Event:
        t, payload = event.time, event.payload
        if (
            type(t) is float
            and t - t == 0.0  # (finite: `inf - inf` and `nan - nan` are nan)
            and type(payload) in _PAYLOADS
            and type(event.machine) is str
            and type(event.instance) is str
            and type(event.name) is str
            and type(event.correlation) is str
        ):
            for k, v in payload.items():
                tv = type(v)
                if type(k) is str and (tv is str or tv is int or tv is bool or v is None):
                    continue
                break
            else:
                return event
    if not isinstance(event, Event):
        raise _refused(f"it is a {type(event).__name__}, not an ehp_fsm.Event")
    ids = [_id(event, f) for f in ("machine", "instance", "name", "correlation")]
    t = event.time
    if isinstance(t, bool) or not isinstance(t, int | float):
        raise _refused(f"`time` is {_shown(t)}, not a finite number of seconds")
    try:
        time = float(t)
    except OverflowError:
        raise _refused(f"`time` is {_shown(t)}, too large for a float number of seconds") from None
    if not math.isfinite(time):
        raise _refused(f"`time` is {_shown(t)}, not a finite number of seconds")
    payload = event.payload
    if not isinstance(payload, Mapping):
        raise _refused(f"`payload` is {_shown(payload)}, not a mapping")
    try:
        plain_payload = _plain(payload)
    except _NotPlain as bad:
        raise _refused(str(bad)) from None
    except RecursionError:
        raise _refused("`payload` is nested too deep for the log") from None
    except EhpError:
        raise
    except Exception as exc:  # the caller's mapping or sequence raised: say so
        raise _refused(
            f"reading `payload` raised {type(exc).__name__}: {_shown(str(exc))}"
        ) from None
    return Event(ids[0], ids[1], ids[2], time, plain_payload, ids[3])


_PAYLOADS = frozenset({dict, MappingProxyType})


class _NotPlain(Exception):
    """Internal: a payload value the log cannot hold; `path` leads to it from the payload."""

    def __init__(self, why: str) -> None:
        self.why = why
        self.path: list[int | str] = []

    def __str__(self) -> str:
        return f"`payload{''.join(f'[{k!r}]' for k in self.path)}` {self.why}"


def _refused(why: str) -> EventError:
    return EventError(
        "an event cannot be handled",
        why,
        "build it as Event(machine, instance, name, time, payload) with str ids, a finite "
        "float time and a dict payload of JSON values (str, int, float, bool, None, lists, "
        "dicts with str keys): what the transition log holds and replay steps again",
    )


def _id(event: Event, field: str) -> str:
    value = getattr(event, field)
    if not isinstance(value, str):
        raise _refused(f"`{field}` is {_shown(value)} ({_a(value)}), not a string")
    return str.__str__(value)  # a str subclass (a StrEnum) as its plain string


def _plain(value: Any) -> Any:
    """`value` as JSON gives it back (see `_admitted`); `_NotPlain` when there is no such
    form (its `path` is filled in as it unwinds). Containers are copied."""
    t = type(value)
    if t is str or t is int or t is bool or value is None:
        return value
    if t is float:
        if value - value == 0.0:
            return value
        raise _NotPlain(f"is {value!r}: JSON has no NaN or infinity (the log would say null)")
    if t is list or t is tuple:
        return _plain_list(value)
    if t is dict or t is MappingProxyType:
        return _plain_dict(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return _plain(float.__float__(value))
    if isinstance(value, list | tuple):
        return _plain_list(value)
    if isinstance(value, Mapping):
        return _plain_dict(value)
    hint = (
        "a list"
        if isinstance(value, set | frozenset)
        else "a str, int, float, bool, None, list or dict"
    )
    raise _NotPlain(
        f"is {_shown(value)} (a {type(value).__module__}.{type(value).__qualname__}), which "
        f"the log cannot hold as it is: pass {hint}"
    )


def _plain_list(value: list[Any] | tuple[Any, ...]) -> list[Any]:
    """`value` as a new plain list (a copy even when it is one already: the world may keep
    it, and the caller's list is the caller's to change after `handle` returns)."""
    if type(value) is list:
        for v in value:
            tv = type(v)
            if tv is str or tv is int or tv is bool or v is None:
                continue
            break
        else:
            return value[:]
    out = []
    for i, v in enumerate(value):
        try:
            out.append(_plain(v))
        except _NotPlain as bad:
            bad.path.insert(0, i)
            raise
    return out


def _plain_dict(value: Mapping[Any, Any]) -> dict[str, Any]:
    """`value` as a plain dict (its keys strings)."""
    out = {}
    for k, v in value.items():
        if type(k) is not str:
            if not isinstance(k, str):
                raise _NotPlain(
                    f"has the key {_shown(k)} ({_a(k)}): JSON keys are strings "
                    "(the log would give it back as a string)"
                )
            k = str.__str__(k)
        try:
            out[k] = _plain(v)
        except _NotPlain as bad:
            bad.path.insert(0, k)
            raise
    return out


def _long_int(value: Any, path: str) -> str | None:
    """The path (`payload['k'][0]`) to an int in the plain `value` that `str` refuses to
    write (more digits than `sys.get_int_max_str_digits()`), else None."""
    if type(value) is int:
        try:
            str(value)
        except ValueError:
            return path
        return None
    if isinstance(value, Mapping):
        items: Iterable[tuple[Any, Any]] = value.items()
    elif type(value) is list:
        items = enumerate(value)
    else:
        return None
    for k, v in items:
        if (found := _long_int(v, f"{path}[{k!r}]")) is not None:
            return found
    return None


def _a(value: object) -> str:
    """`value`'s type with its article: "an int", "a NoneType"."""
    name = type(value).__name__
    return f"an {name}" if name[:1].lower() in "aeiou" else f"a {name}"


def _named(event: object) -> str:
    """An event as errors name it: `machine 'instance' 'name'` (anything else: its repr)."""
    if isinstance(event, Event):
        return f"{event.machine} {event.instance!r} {event.name!r}"
    return _shown(event)


def _shown(value: object) -> str:
    """`repr(value)`, at most 200 characters; a repr that raises is named by its type."""
    try:
        text = repr(value)
    except Exception:  # the caller's object: its repr is not ours to trust
        return f"<a {type(value).__name__} whose repr raised>"
    return text if len(text) <= 200 else f"{text[:200]}… ({len(text)} characters)"


class InvariantViolation(EhpError):
    """An accepted step left the world unsound (a bug in a spec, guard or effect)."""

    def __init__(self, event: Event, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(
            f"invariants violated after {event.machine} {event.instance!r} "
            f"{event.name!r}: {problems}",
            "a spec, guard or effect lets an unsafe transition through",
            "report it with the transition log; run with check=True to stop early",
        )


#: What `Orchestrator._repair` needs to take an interrupted event back out: where the log stood
#: (`TransitionLog.mark`; None: no log), the world's version, the instances the step changes as
#: they were (None: new), the globals before a step that changes them (None: it changes none),
#: the instances the world forgot after the step (filled in as it forgets them), and its
#: forgetter's counts before (`Forgetter.mark`; None: the step leaves nothing to forget).
#: (A plain tuple: one is made per event.)
_Undo = tuple[
    tuple[Any, ...] | None,
    int,
    list[tuple[str, str, Instance | None]],
    dict[str, Any] | None,
    list[tuple[tuple[str, str], Instance]],
    Any,
]


class Orchestrator:
    def __init__(
        self,
        config: Mapping[str, Any],
        *,
        specs: Mapping[str, MachineSpec] | None = None,
        log: TransitionLog | None = None,
        check: bool = False,
        forget_finished: bool = True,
    ) -> None:
        """`forget_finished`: the world forgets finished instances (see the module docstring).
        `config`: the engine config, as `Plan.world_config()` builds it (`from_plan` does);
        one the guards cannot read (a count that is not an int, an `inventory` that is not a
        map of GPU id to host) raises `EhpError` naming the key, as replay refuses it in a
        log's header (before, it raised a bare TypeError out of the first `handle` whose
        guard read it)."""
        problem = (
            config_problem(config)
            if isinstance(config, Mapping)
            else f"it is {_shown(config)} ({_a(config)}), not a mapping"
        )
        if problem is not None:
            raise EhpError(
                "the orchestrator's config cannot be the engine's",
                problem,
                "build it with Plan.world_config() (Orchestrator.from_plan(plan) does)",
            )
        self.specs = specs if specs is not None else load_specs()
        self._world = World(self.specs, config)
        self.forget_finished = forget_finished
        self._forget = Forgetter(self._world, WRITER_FORGETS) if forget_finished else None
        self.log = log
        self.check = check
        # The incremental invariant checks of `_world` (`core.checks`), made at the first
        # checked event and dropped when the world is replaced or the checks turned off (they
        # follow the world event by event).
        self._checks: InvariantChecks | None = None
        # One call at a time (re-entry and other threads are refused, not waited for: a
        # caller that waits on itself would hang). `_turn[""]`: the (thread, token) of the
        # call that has the turn, taken and given back by one C call each (`setdefault`,
        # `pop`), so that an interrupt (a signal handler's exception) cannot fall between
        # taking the turn and knowing which thread has it — before, one between
        # `Lock.acquire` returning and its result being stored left the lock held by no call:
        # every later `handle` was refused ("while another event was being handled") and
        # `close()` waited for ever. `_handling`: the event of that call.
        self._turn: dict[str, tuple[int, object]] = {}
        self._handling: object = None
        self._closed = False  # `handle` refuses events
        self._shut = False  # and the log is closed (`close` finished)
        # An event whose handling was interrupted and not yet taken back out (`_repair`); a
        # repair that could not be made (the log cannot be cut back): why, for every later call.
        self._undo: _Undo | None = None
        self._failed: str | None = None
        #: What `resume` repaired in the log before it replayed it (a torn last line, an
        #: incomplete last event: `runtime.recovery.RecoveryReport`); None when not resumed.
        self.recovery: RecoveryReport | None = None

    @property
    def world(self) -> World:
        """The world the events made (read it; only `handle` writes it). Setting it (a world
        replay rebuilt, or one written other than by `handle`) starts `check=True`'s per-event
        checks again from a check of the whole world: they follow the world event by event and
        do not see a change made behind `handle`'s back until then."""
        return self._world

    @world.setter
    def world(self, world: World) -> None:
        # (a controller recovering sets the world replay rebuilt): the checks start again;
        # a world that forgets forgets its finished instances now (replay kept them)
        own = self._forget is not None and self._forget.world is world
        if world.forgotten is not None and not own:
            raise OrchestratorError(
                "the world given already forgets finished instances (a replay's with "
                "forget_finished=True)",
                "the orchestrator lists what its world forgot in each checkpoint, and cannot "
                "know what another forgetter dropped"
                if self.forget_finished
                # (before, taken: its data read raised `finished.Unsure`, and its checkpoints
                # listed the finished engines that forgetter dropped)
                else "this orchestrator keeps every instance (forget_finished=False), and that "
                "world dropped some",
                "give it a world that holds every instance (replay without forget_finished)",
            )
        self._world = world
        self._checks = None
        if self.forget_finished and not own:
            self._forget = Forgetter(world, WRITER_FORGETS)

    @classmethod
    def from_plan(
        cls,
        plan: Plan,
        *,
        log_path: str | Path | None = None,
        check: bool = False,
        time: float = 0.0,
        log_meta: Mapping[str, Any] | None = None,
        core_version: int = 0,
        forget_finished: bool = True,
    ) -> Orchestrator:
        """An orchestrator whose world holds the plan's GPU inventory, the Core GPUs assigned
        (`log_meta`: more entries for the log header's `meta`, e.g. a resumed run's
        `resumes` — JSON values only: str, int, finite float, bool, None, lists and dicts with
        str keys, else `EhpError` naming the key and the type; `core_version`: the Core's
        optimizer version at the start, a resumed run's restored step, kept in the world
        config so replay starts there too; `forget_finished`: see the module docstring)."""
        specs = load_specs()
        config = plan_config(plan, core_version)
        meta = _header_meta(log_meta)
        _check_reserved_meta(meta, log_path)
        if type(time) not in (int, float) or not math.isfinite(time):  # (said as an Event's)
            raise EhpError(
                f"from_plan's time is {_shown(time)} ({_a(time)})",
                "it is the time of the plan's inventory events, which the log records",
                "pass the start's time in seconds, a finite number (the default is 0.0)",
            )
        if log_path is not None and not isinstance(log_path, str | os.PathLike):
            raise EhpError(
                f"from_plan's log_path is {_shown(log_path)} ({_a(log_path)})",
                "a log path is a str or a pathlib.Path",
                "pass log_path as a str or a Path (decode bytes with os.fsdecode)",
            )
        # the config checked before the log is made (a `core_version` of "3" was written into
        # the header, which replay refuses, and the log's path stayed locked by the error)
        orch = cls(config, specs=specs, check=check, forget_finished=forget_finished)
        if log_path is not None:
            orch.log = TransitionLog.create(
                log_path,
                config=config,
                specs=specs,
                meta={"plan": plan.name, "source": Path(plan.source).name, **meta},
            )
        try:
            for ev in inventory_events(plan, time):
                out = orch.handle(ev)
                if isinstance(out, Rejected):
                    raise EhpError(f"the plan's inventory does not load: {out.reason}")
        except BaseException:  # (a bad `time`): the log is closed, its path free again
            orch.close()
            raise
        return orch

    @classmethod
    def resume(
        cls,
        log_path: str | Path,
        *,
        plan: Plan | None = None,
        core_version: int = 0,
        config: Mapping[str, Any] | None = None,
        specs: Mapping[str, MachineSpec] | None = None,
        check: bool = False,
        key: str | bytes | None = None,
        forget_finished: bool | None = None,
    ) -> Orchestrator:
        """The orchestrator whose log is at `log_path` (its process died, or it was closed),
        rebuilt from the log, writing on at its end: the log is verified and replayed
        (`runtime.recovery.recover_log`, what `ehp-fsm run --resume` does: a torn last line or
        an incomplete last event is cut off first), the world is the replayed one, and the
        next event's lines follow the last one's seq and hash chain (keyed with `key`, default
        the `EHP_LOG_KEY` environment variable, when the log was written with a key), so
        `ehp-fsm replay` verifies the whole file as one log. What the repair cut is the
        orchestrator's `recovery` (`RecoveryReport`).

        `plan` (with the `core_version` given to `from_plan`), or `config`: what the log must
        have been written with; `specs`: the machine specs (default: the package's). A log
        whose header names another config or other specs is refused (`OrchestratorError`,
        naming the keys or machines) before anything is read further or cut; so is a log
        another orchestrator is writing (`EhpError`), a missing or empty one, and one that
        does not verify before its last event (`RecoveryError`). Without `plan` or `config`
        the log's own config is taken.

        `forget_finished`: whether its world forgets finished instances (see the module
        docstring); None: as a log of its schema is written (schema 4: it forgets; before:
        every instance kept). A log written with `forget_finished=False` goes on keeping them
        with False (before, a resumed world forgot them, and their data read as before the
        crash raised `finished.Unsure`); True for a log before schema 4 is refused, as its
        header says its checkpoints list every instance."""
        from ehp_fsm.replay import _header
        from ehp_fsm.runtime.recovery import RecoveryError, recover_log

        path = Path(log_path)
        problem = _not_resumable(path)
        if problem is not None:
            why, fix = problem
            raise RecoveryError(f"cannot resume from {printable(str(path))}", why, fix)
        specs = specs if specs is not None else load_specs()
        want = plan_config(plan, core_version) if plan is not None else config
        with path.open("rb") as fh:
            first = fh.readline(line_limit() + 1)  # (`_header` reads within it too)
            fh.seek(0)
            try:
                header, _ = _header(fh)  # LogFormatError: not a transition log
            except LogFormatError as exc:
                if first.endswith(b"\n"):
                    raise
                # empty, or its header cut short: a process killed as `from_plan` began the
                # log, before any event (the error said to replay "a run that began")
                raise RecoveryError(
                    f"cannot resume from {printable(str(path))}",
                    "the log has no whole header line ("
                    + ("the file is empty" if not first else "its first line is cut short")
                    + "): the process that began it was stopped before any event was logged",
                    "start afresh: Orchestrator.from_plan(plan, log_path=...) on this path "
                    "replaces it (nothing was logged to go on from)",
                ) from exc
        _same_as_logged(path, header, want, specs)
        schema = header.get("schema_version", 0)
        if forget_finished and schema < FINISHED_SINCE:
            raise OrchestratorError(
                f"cannot resume {printable(str(path))} with forget_finished=True",
                f"the log is schema {schema}: its checkpoints list every instance, and lines "
                f"that list finished ones by id came with schema {FINISHED_SINCE}",
                "resume it without forget_finished (its world keeps every instance)",
            )
        # a log from before schema 4 goes on as it was written: every instance kept, its
        # checkpoints listing them all (its header says which schema its lines are)
        forget = schema >= FINISHED_SINCE if forget_finished is None else forget_finished
        stream = open_to_append(path)  # locked: no other orchestrator writes it meanwhile
        try:
            # rebuilt forgetting as the writer forgets (a long log's recovery held every
            # finished group in memory, only for the world to forget them once set)
            result, report = recover_log(
                path, key=key, forget_finished=WRITER_FORGETS if forget else False
            )
            stream.seek(0, 2)  # (the repair may have cut the tail)
            log = TransitionLog(stream, first_seq=result.last_seq + 1, key=log_key(key))
        except BaseException:
            stream.close()
            raise
        orch = cls(header["config"], specs=specs, log=log, check=check, forget_finished=forget)
        if result.forgetter is not None:  # (None: replay could only decide keeping them all)
            orch._forget = result.forgetter
        orch.world = result.world
        orch.recovery = report
        try:
            orch._complete_inventory(header)
        except BaseException:
            orch.close()
            raise
        return orch

    def _complete_inventory(self, header: Mapping[str, Any]) -> None:
        """The plan's inventory events a log of `from_plan` does not hold, handled now: its
        process ended between the header and the last of them, and the log resumed into a
        world with the Core's GPUs free (a Hybrid could be granted one) and no capacity record
        for the planner. Said in `recovery.notes`."""
        meta = header.get("meta")
        if not isinstance(meta, Mapping) or "plan" not in meta:
            return  # not from_plan's: its inventory is the embedder's own
        if self.world.get("capacity", "grp") is not None:
            return  # the last inventory event is logged: so are the others
        done = []
        for ev in _inventory(header["config"].get("core_gpus", ()), 0.0):
            now = self.world.get(ev.machine, ev.instance)
            if ev.machine == "gpu" and now is not None and now.get("owner") == "core":
                continue  # logged before the process ended
            out = self.handle(ev)
            if isinstance(out, Rejected):
                raise OrchestratorError(
                    "the log ends inside the plan's inventory, which cannot be completed",
                    out.reason,
                    "start afresh (Orchestrator.from_plan on a new log_path)",
                )
            done.append(f"{ev.name} {ev.machine} {ev.instance}")
        if self.recovery is not None:
            note = "the log ended inside from_plan's inventory: handled now: " + ", ".join(done)
            self.recovery = dataclasses.replace(self.recovery, notes=(*self.recovery.notes, note))

    def handle(self, event: Event) -> Outcome:
        """Step, log the attempted transitions, apply if accepted, check invariants if asked.
        The log is written first: a change the log could not record (a full disk) is not made.
        An event whose fields cannot be logged as they are raises `EventError` (nothing
        logged, nothing changed); a call made while another is being handled (re-entry from
        the caller's code, another thread) or after `close` raises `OrchestratorError`. A log
        write that fails (a full disk) raises its `OSError`: nothing of the event is logged or
        applied, and the same event may be handled again. So does anything else that
        interrupts the call (a KeyboardInterrupt, a signal handler's exception) once the log is
        being written: the log is cut back and the world put back as they were before the
        event (`InvariantViolation` excepted: that event stands, logged and applied)."""
        turn = False  # (taken inside the `try`: an interrupt before it finds it not taken)
        try:
            mine = (threading.get_ident(), object())
            held = self._turn.setdefault("", mine)
            turn = held is mine or self._left_held(held)
            if not turn:
                raise self._misused(event, self._handling or None)
            if self._closed:
                raise self._misused(event, None)
            self._handling = event
            if self._undo is not None or self._failed is not None:
                self._repair()  # an earlier call was interrupted inside its repair
            return self._handle(_admitted(event))
        finally:
            if turn:
                self._handling = None
                self._turn.pop("", None)

    def _left_held(self, held: tuple[int, object]) -> bool:
        """Whether the turn, found taken (`held`), was left so by a call of this thread that
        was interrupted as it took it or gave it back (not taken by a call in progress): then
        this call has it."""
        if held[0] != threading.get_ident():
            return False
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code in _TURN_CODES and frame.f_locals.get("self") is self:
                return False  # a call of this thread is in progress: re-entry
            frame = frame.f_back  # type: ignore[assignment]
        return True

    def _handle(self, event: Event) -> Outcome:
        world = self._world
        outcome = step(world, event, GUARDS, EFFECTS)
        log = self.log
        mark = log.mark() if log is not None else None
        forgotten: list[tuple[tuple[str, str], Instance]] = []
        if isinstance(outcome, Accepted):
            instances = world.instances
            was = [(m, i, instances[m].get(i)) for m, i in outcome.changes]
            forget = self._forget
            self._undo = (
                mark,
                world.version,
                was,
                dict(world.globals) if outcome.globals else None,
                forgotten,
                forget.mark()
                if forget is not None
                and any(x.state in FORGETTABLE_STATES for x in outcome.changes.values())
                else None,
            )
        else:
            self._undo = (mark, world.version, [], None, forgotten, None)
        try:
            if log is not None:
                self._write(log, event, outcome)
            if isinstance(outcome, Accepted):
                world.apply(outcome.changes, outcome.globals)
                forget = self._forget
                if forget is not None:
                    for key, inst in outcome.changes.items():
                        if inst.state in FORGETTABLE_STATES:
                            forgotten.append((key, inst))
                            forget.forget(key, inst)
                if self.check:
                    # (of the world as it stands, its finished instances forgotten: before,
                    # a step that broke an invariant raised before its world forgot them, and
                    # its consumed groups stayed live, in the world and in the next
                    # checkpoint's `instances`, which replay refused)
                    checks = self._checks
                    if checks is None or checks.world is not world:
                        checks = self._checks = InvariantChecks(world)
                    problems = checks.check(outcome)
                    if problems:
                        self._undo = None  # the event stands: logged and applied
                        raise InvariantViolation(event, problems)
                elif self._checks is not None:
                    self._checks = None  # (turned off: they no longer follow the world)
            if log is not None and log.checkpoint_due(world):
                _checkpoint(log, world, self._forget)
            self._undo = None
        except InvariantViolation:
            raise
        except BaseException:
            self._repair()
            raise
        return outcome

    def _write(self, log: TransitionLog, event: Event, outcome: Outcome) -> None:
        try:
            log.write(outcome)
        except UnicodeEncodeError as exc:  # a lone surrogate: nothing was written
            where = next(
                (
                    bad
                    for field in ("machine", "instance", "name", "correlation", "payload")
                    if (bad := _unwritable(getattr(event, field), field)) is not None
                ),
                f"the text {_shown(exc.object)} holds {exc.object[exc.start : exc.end]!r} "
                f"at {exc.start}, which is not UTF-8 (a lone surrogate)",
            )
            raise _refused(f"{where}: the log cannot hold it") from None
        except ValueError:  # an int of more digits than `str` writes: nothing was written
            long = _long_int(event.payload, "payload")
            if long is None:
                raise
            raise _refused(
                f"`{long}` is an int of more than {sys.get_int_max_str_digits():,} digits, "
                "which Python does not write as text: the log cannot hold it (pass it as "
                "a str)"
            ) from None

    def _repair(self) -> None:
        """Take the interrupted event (`_undo`) back out of the log and the world; again on
        the next call if this one is interrupted too. When the log cannot be cut back, every
        later call raises `OrchestratorError` saying so."""
        if self._failed is not None:
            raise OrchestratorError(
                "the orchestrator was interrupted while it handled an event, and the event "
                "could not be taken back out of its log",
                self._failed,
                "close() it and rebuild it from its log with Orchestrator.resume(log_path), "
                "which cuts off what is incomplete",
            )
        undo = self._undo
        if undo is None:
            return
        mark, version, was, globals_, forgotten, counts = undo
        world = self._world
        if mark is not None and self.log is not None:
            try:
                self.log.rollback(mark)
            except (OSError, ValueError) as exc:
                self._failed = f"the log could not be cut back: {exc}"
                self._undo = None
                raise OrchestratorError(
                    "the orchestrator was interrupted while it handled an event, and the "
                    "event could not be taken back out of its log",
                    self._failed,
                    "close() it and rebuild it from its log with Orchestrator.resume(log_path)",
                ) from exc
        if self._forget is not None and counts is not None:
            self._forget.rollback(counts, forgotten)
        instances = world.instances
        for machine, iid, inst in was:
            if inst is None:
                instances[machine].pop(iid, None)
            else:
                instances[machine][iid] = inst
        if globals_ is not None:
            world.globals.clear()
            world.globals.update(globals_)
        world.version = version
        if was:
            world.reindex()
            self._checks = None  # built again from the world at the next checked event
        self._undo = None

    def _misused(self, event: object, busy: object) -> OrchestratorError:
        """The error of a `handle(event)` refused: after `close` (`busy` None), or while
        `busy` (the event of the call in progress; None: not yet known) is handled."""
        if self._closed and busy is None:
            # (before, the fix said "start a new Orchestrator": one made with from_plan on
            # the same log_path empties the log this one wrote)
            return OrchestratorError(
                f"handle({_named(event)}) after close()",
                "the orchestrator's log is closed: nothing more can be recorded",
                "handle every event before close(); to go on after it, rebuild the "
                "orchestrator from its log with Orchestrator.resume(log_path, plan=...), "
                "which writes on at its end (Orchestrator.from_plan on the same log_path "
                "starts that log afresh: it empties it)"
                if self.log is not None
                else "handle every event before close(), or start a new Orchestrator",
            )
        doing = _named(busy) if busy is not None else "another event"
        return OrchestratorError(
            f"handle({_named(event)}) was called while {doing} was being handled",
            "one event is handled at a time, to its end: an event handled inside another "
            "(from code the first one ran, e.g. its payload's methods, or from another "
            "thread) would change the world under a step and log out of order",
            "hand the new event back to your scheduler's loop and handle it after this "
            "call returns; call handle from one thread (or one at a time)",
        )

    def handle_all(self, events: Iterable[Event]) -> list[Outcome]:
        """`handle` each event in turn; an error raised by one leaves the events before it
        handled (and logged), and the rest not."""
        return [self.handle(e) for e in events]

    def fire_deadlines(self, now: float) -> list[Outcome]:
        """Handle a `deadline` event (stamped `now`) for every instance whose armed deadline
        is at or before `now`, in a stable order, and return their outcomes: an engine that
        never came up fails at its `starting` deadline and its GPU goes to `releasing`, a
        Hybrid that never loaded fails and releases its GPUs, and so on (`specs/*.toml`,
        `deadline`).
        Each is re-checked when handled (`deadline_passed`): one fired by an earlier one's
        cascade is refused, not applied twice. Call it from your scheduler's clock — every
        second, or at `next_deadline()` — as `ehp-fsm run`'s loop does on every tick: a
        waiting state's deadline fires only when something fires it. `now` that is not a
        finite number of seconds raises `EventError`."""
        if isinstance(now, bool) or not isinstance(now, int | float) or not math.isfinite(now):
            # (before, the fix said how to build an Event: this call takes no event)
            raise EventError(
                "the deadlines cannot be fired",
                f"`now` is {_shown(now)}, not a finite number of seconds",
                "pass now as a float of seconds on the clock your events' `time` is on "
                "(e.g. time.time())",
            )
        return [self.handle(ev) for ev in due_deadlines(self.world, float(now))]

    def next_deadline(self) -> float | None:
        """The earliest armed deadline (seconds, on the clock your events carry) of any
        instance that can fire one; None when none is armed."""
        return next_deadline(self.world)

    @property
    def chain_head(self) -> tuple[int, str] | None:
        """The log's (lines written, last line's `chain`) — what a run's receipt records as
        `log_chain: {"count": ..., "hash": ...}` for `ehp-fsm replay --receipt` (read it after
        the last event, before or after `close`); None without a log."""
        return self.log.chain_head if self.log is not None else None

    @property
    def log_chain(self) -> dict[str, Any] | None:
        """`chain_head` as a run's receipt records it (`log_chain`), with a keyed log's `seal`
        (`translog.receipt_log_chain`); None without a log."""
        return self.log.log_chain() if self.log is not None else None

    def close(self) -> None:
        """Close the log (again: nothing, or what an interrupted `close` left undone: the log
        closed and its path free); `handle` refuses events after it. Called while an
        event is handled, from another thread it waits for that event's end; from code the
        event runs (its payload's methods) it raises `OrchestratorError`: the log would close
        under the step (the write after it raised a bare "I/O operation on closed file")."""
        if self._shut:
            return
        mine = (threading.get_ident(), object())
        while (held := self._turn.setdefault("", mine)) is not mine and not self._left_held(held):
            if held[0] == mine[0]:
                raise OrchestratorError(
                    f"close() was called while {_named(self._handling)} was being handled",
                    "the log would close under the event being logged",
                    "close the orchestrator after handle returns",
                )
            # another thread's event: closed once it is logged (events handled after this
            # one are refused, so that the close is not put off by them)
            self._closed = True
            sleep(0.001)
        try:
            # (closed first: `handle` refuses events from here on; an interrupt before the
            # log is closed leaves it to the next `close`, which finishes it — before, that
            # one returned at once, and the log's path stayed locked for the process's life)
            self._closed = True
            if self._undo is not None:  # an interrupted event not yet taken back out
                with contextlib.suppress(OrchestratorError):
                    self._repair()
            if self.log is not None:
                self.log.close()
            self._shut = True
        finally:
            self._turn.pop("", None)


_TURN_CODES = frozenset({Orchestrator.handle.__code__, Orchestrator.close.__code__})


def _checkpoint(log: TransitionLog, world: World, forget: Forgetter | None) -> None:
    """Write a checkpoint of `world` after the event just logged and applied (`forget`: what
    it forgot, listed by id)."""
    try:
        log.checkpoint(world, forget.listing() if forget is not None else None)
    except OSError:
        # (a full disk) The event is logged and applied: raising would tell the caller it was
        # not (`handle`'s contract) and it would be handled twice. A checkpoint is optional
        # (replay needs none); the write is cut back to the last whole line
        # (`TransitionLog._put`) and the checkpoint is due again after the next event, whose
        # own write raises if the disk is still full. (A buffered log, `flush_each=False`,
        # may keep part of the line: it raises, and the event is taken back out.)
        if not log.flush_each:
            raise


def _not_resumable(path: Path) -> tuple[str, str] | None:
    """(why, what to do) when `resume` cannot append to the file at `path` — missing, not a
    regular file, a symbolic link, another user's — else None. Before, a FIFO or a folder
    was "the transition log does not exist", and another user's log or a link were refused
    by the writer's own checks, whose advice (remove the file; the run makes it) lost the log."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return (
            "the transition log does not exist",
            "pass the log_path the orchestrator was made with (from_plan's log_path)",
        )
    except (OSError, ValueError) as exc:
        return f"it cannot be read ({printable(str(exc))})", "pass the log's own path"
    kind = kind_of(st.st_mode)
    if kind == "a symbolic link":
        target = printable(os.readlink(path))
        return (
            f"it is a symbolic link (to {target}): resume appends to the log in place, and "
            "does not write through a link",
            f"pass the log's own path ({target}), not a link to it",
        )
    if kind != "a file":
        return (
            f"it is {kind}: a transition log is a file",
            "pass the log_path the orchestrator was made with (from_plan's log_path)",
        )
    if st.st_uid != os.geteuid():
        return (
            f"it belongs to another user (uid {st.st_uid}): resume appends to it, and the "
            "records it appends carry launch tokens that user could read",
            "resume it as its owner, or copy it to a file of yours (cp LOG MINE: the copy "
            "verifies as the log did) and resume the copy",
        )
    return None


def plan_config(plan: Plan, core_version: int = 0) -> dict[str, Any]:
    """The world config of `plan` as `Orchestrator.from_plan` makes it (with `core_version`,
    a resumed run's restored step, when not 0)."""
    config = plan.world_config()
    if core_version:
        config["core_version"] = core_version
    return config


def _header_meta(meta: object) -> dict[str, Any]:
    """`from_plan`'s `log_meta` as the header writes it; `EhpError` naming the key and the
    type of a value the header would have changed as it wrote it (a set written as a list,
    bytes as base64, NaN as null, a non-string key as a string, an object as its repr)."""
    if meta is None:
        return {}
    allowed = (
        "log_meta holds JSON values only: str, int, a finite float, bool, None, lists (or "
        "tuples) and dicts with str keys; convert the value (a set to a sorted list, bytes "
        "to a str, an object to the fields it stands for) or leave it out"
    )
    if not isinstance(meta, Mapping):
        raise EhpError(
            "the log header's meta cannot be written",
            f"log_meta is {_shown(meta)} ({_a(meta)}), not a mapping",
            allowed,
        )
    try:
        plain = _plain_dict(meta)
        where = _unwritable(plain, "log_meta")
    except _NotPlain as bad:
        path = "".join(f"[{k!r}]" for k in bad.path)
        raise EhpError(
            "the log header's meta cannot be written",
            f"`log_meta{path}` {bad.why}",
            allowed,
        ) from None
    except RecursionError:
        raise EhpError(
            "the log header's meta cannot be written", "log_meta is nested too deep", allowed
        ) from None
    if where is not None:
        raise EhpError("the log header's meta cannot be written", where, allowed)
    return plain


def _check_reserved_meta(meta: Mapping[str, Any], log_path: str | Path | None) -> None:
    """Refuse `log_meta` keys that replay reads: `plan` is the plan's name (given there, it
    replaced the header's, and `replay --receipt` compared the wrong name), and `resumes` must
    name an earlier log segment beside `log_path` (one that did not made a log that `replay`
    refused, "the log resumes the segment x.jsonl, which is not beside it")."""
    if "plan" in meta:
        raise EhpError(
            "log_meta['plan'] cannot be set",
            "the header's meta.plan is the plan's name, which `replay --receipt` compares",
            "leave 'plan' out of log_meta (give it another name for your own use)",
        )
    if "resumes" not in meta:
        return
    resumes = meta["resumes"]
    name = resumes.get("log") if isinstance(resumes, Mapping) else None
    fix = (
        "set log_meta['resumes'] only to go on from a segment of the same run (its 'log' the "
        "file name of that segment, in log_path's folder, with its 'count' and 'hash'), or "
        "leave it out"
    )
    if log_path is None:
        raise EhpError("log_meta['resumes'] is set without a log_path", "there is no log", fix)
    if not isinstance(name, str) or not name or Path(name).name != name:
        raise EhpError(
            "log_meta['resumes'] does not name a log segment",
            f"its 'log' is {_shown(name)}, not a file name (replay looks for the segment "
            "beside the log)",
            fix,
        )
    segment = Path(log_path).parent / name
    try:
        with segment.open("rb") as fh:
            ok = starts_a_log(fh)
    except OSError as exc:
        raise EhpError(
            f"log_meta['resumes'] names the segment {printable(name)!r}, which cannot be read "
            "beside the log",
            exc.strerror or str(exc),
            fix,
        ) from None
    if not ok:
        raise EhpError(
            f"log_meta['resumes'] names {printable(name)!r}, which is not a transition log",
            "replay verifies the segment a log resumes",
            fix,
        )


def _unwritable(value: Any, path: str) -> str | None:
    """Why a plain `value` (at `path`) cannot be written as text — a str that is not UTF-8 (a
    lone surrogate), an int of more digits than `str` writes — else None."""
    t = type(value)
    if t is str:
        try:
            value.encode()
        except UnicodeEncodeError:
            return f"`{path}` is {_shown(value)}, a str that is not UTF-8 (a lone surrogate)"
        return None
    if t is int:
        return _long_int(value, path) and (
            f"`{path}` is an int of more than {sys.get_int_max_str_digits():,} digits, which "
            "Python does not write as text"
        )
    items: Iterable[tuple[Any, Any]]
    if t is dict:
        for k in value:
            if (bad := _unwritable(k, f"{path} key {k!r}")) is not None:
                return bad
        items = value.items()
    elif t is list:
        items = enumerate(value)
    else:
        return None
    for k, v in items:
        if (bad := _unwritable(v, f"{path}[{k!r}]")) is not None:
            return bad
    return None


def _same_as_logged(
    path: Path,
    header: Mapping[str, Any],
    config: Mapping[str, Any] | None,
    specs: Mapping[str, MachineSpec],
) -> None:
    """Refuse to resume the log at `path` (its `header`) with another config or other specs
    than it was written with (`OrchestratorError` naming the keys or machines)."""
    name = printable(str(path))
    differ = specs_differ(header, specs)
    if differ:
        raise OrchestratorError(
            f"cannot resume from {name}",
            f"the log was written with other machine specs than these: {differ}",
            "resume with the specs (the ehp-fsm version) that wrote it",
        )
    if config is None:
        return
    theirs = header.get("config") or {}
    if config_fingerprint(config) != config_fingerprint(theirs):
        keys = sorted(
            k
            for k in set(theirs) | set(config)
            if _plain_json(theirs.get(k)) != _plain_json(config.get(k))
        )
        raise OrchestratorError(
            f"cannot resume from {name}",
            f"the log was written with another config: {keys or 'its values'} differ from "
            "the plan given",
            "resume with the plan (and core_version) the log was started with, or start a "
            "new log with Orchestrator.from_plan",
        )


def _plain_json(value: Any) -> Any:
    """`value` as JSON gives it back (for comparing a config with a logged one)."""
    return json.loads(json.dumps(value, default=str))


def inventory_events(plan: Plan, time: float) -> list[Event]:
    """Assign the Core's GPUs to `core` (the ledger starts with every GPU free) and create the
    planner's capacity record."""
    return _inventory(plan.core.gpus, time)


def _inventory(core_gpus: Iterable[str], time: float) -> list[Event]:
    events = [Event("gpu", g, "assign", time, {"owner": "core"}) for g in core_gpus]
    return [*events, Event("capacity", "grp", "start", time)]
