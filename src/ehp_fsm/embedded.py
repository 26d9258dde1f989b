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
`check=True`) asserts the safety invariants after each accepted step. It performs no command:
that is the caller's (or `ehp-fsm run`'s runtime) job.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

from ehp_fsm.core.effects import EFFECTS
from ehp_fsm.core.guards import GUARDS
from ehp_fsm.core.invariants import check_invariants
from ehp_fsm.core.spec import MachineSpec
from ehp_fsm.core.timers import due_deadlines, next_deadline
from ehp_fsm.core.transition import Accepted, Outcome, Rejected, step
from ehp_fsm.core.world import Event, World, config_problem
from ehp_fsm.errors import EhpError
from ehp_fsm.plan import Plan
from ehp_fsm.specfiles import load_specs
from ehp_fsm.translog import TransitionLog


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


class Orchestrator:
    def __init__(
        self,
        config: Mapping[str, Any],
        *,
        specs: Mapping[str, MachineSpec] | None = None,
        log: TransitionLog | None = None,
        check: bool = False,
    ) -> None:
        """`config`: the engine config, as `Plan.world_config()` builds it (`from_plan` does);
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
        self.world = World(self.specs, config)
        self.log = log
        self.check = check
        # One call at a time (re-entry and other threads are refused, not waited for: a
        # caller that waits on itself would hang); `_handling`: the event of that call.
        self._turn = threading.Lock()
        self._handling: object = None
        self._thread: int | None = None  # the thread of that call
        self._closed = False

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
    ) -> Orchestrator:
        """An orchestrator whose world holds the plan's GPU inventory, the Core GPUs assigned
        (`log_meta`: more entries for the log header's `meta`, e.g. a resumed run's
        `resumes`; `core_version`: the Core's optimizer version at the start, a resumed run's
        restored step, kept in the world config so replay starts there too)."""
        specs = load_specs()
        config = plan.world_config()
        if core_version:
            config["core_version"] = core_version
        # the config checked before the log is made (a `core_version` of "3" was written into
        # the header, which replay refuses, and the log's path stayed locked by the error)
        orch = cls(config, specs=specs, check=check)
        if log_path is not None:
            orch.log = TransitionLog.create(
                log_path,
                config=config,
                specs=specs,
                meta={"plan": plan.name, "source": Path(plan.source).name, **(log_meta or {})},
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

    def handle(self, event: Event) -> Outcome:
        """Step, log the attempted transitions, apply if accepted, check invariants if asked.
        The log is written first: a change the log could not record (a full disk) is not made.
        An event whose fields cannot be logged as they are raises `EventError` (nothing
        logged, nothing changed); a call made while another is being handled (re-entry from
        the caller's code, another thread) or after `close` raises `OrchestratorError`. A log
        write that fails (a full disk) raises its `OSError`: nothing of the event is logged or
        applied, and the same event may be handled again."""
        if not self._turn.acquire(blocking=False):  # taken: a call is being handled
            raise self._misused(event, self._handling or None)
        try:
            if self._closed:
                raise self._misused(event, None)
            self._handling, self._thread = event, threading.get_ident()
            return self._handle(_admitted(event))
        finally:
            self._handling = self._thread = None
            self._turn.release()

    def _handle(self, event: Event) -> Outcome:
        outcome = step(self.world, event, GUARDS, EFFECTS)
        log = self.log
        if log is not None:
            try:
                log.write(outcome)
            except UnicodeEncodeError as exc:  # a lone surrogate: nothing was written
                raise _refused(
                    f"the text {_shown(exc.object)} holds {exc.object[exc.start : exc.end]!r} "
                    f"at {exc.start}, which is not UTF-8 (a lone surrogate): the log cannot "
                    "hold it"
                ) from None
            except ValueError:  # an int of more digits than `str` writes: nothing was written
                where = _long_int(event.payload, "payload")
                if where is None:
                    raise
                raise _refused(
                    f"`{where}` is an int of more than {sys.get_int_max_str_digits():,} digits, "
                    "which Python does not write as text: the log cannot hold it (pass it as "
                    "a str)"
                ) from None
        if isinstance(outcome, Accepted):
            self.world.apply(outcome.changes, outcome.globals)
            if self.check:
                problems = check_invariants(self.world, indexed=True)
                if problems:
                    raise InvariantViolation(event, problems)
        if log is not None and log.checkpoint_due(self.world):
            try:
                log.checkpoint(self.world)
            except OSError:
                # (a full disk) The event is logged and applied: raising would tell the
                # caller it was not (`handle`'s contract) and it would be handled twice. A
                # checkpoint is optional (replay needs none); the write is cut back to the
                # last whole line (`TransitionLog._put`) and the checkpoint is due again
                # after the next event, whose own write raises if the disk is still full.
                # (A buffered log, `flush_each=False`, may keep part of the line: it raises.)
                if not log.flush_each:
                    raise
        return outcome

    def _misused(self, event: object, busy: object) -> OrchestratorError:
        """The error of a `handle(event)` refused: after `close` (`busy` None), or while
        `busy` (the event of the call in progress; None: not yet known) is handled."""
        if self._closed and busy is None:
            return OrchestratorError(
                f"handle({_named(event)}) after close()",
                "the orchestrator's log is closed: nothing more can be recorded",
                "handle every event before close(), or start a new Orchestrator",
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
            raise _refused(f"`now` is {_shown(now)}, not a finite number of seconds")
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

    def close(self) -> None:
        """Close the log (again: nothing); `handle` refuses events after it. Called while an
        event is handled, from another thread it waits for that event's end; from code the
        event runs (its payload's methods) it raises `OrchestratorError`: the log would close
        under the step (the write after it raised a bare "I/O operation on closed file")."""
        if self._closed:
            return
        if not self._turn.acquire(blocking=False):
            if self._thread == threading.get_ident():
                raise OrchestratorError(
                    f"close() was called while {_named(self._handling)} was being handled",
                    "the log would close under the event being logged",
                    "close the orchestrator after handle returns",
                )
            self._turn.acquire()  # another thread's event: closed once it is logged
        try:
            if self._closed:
                return
            self._closed = True
            if self.log is not None:
                self.log.close()
        finally:
            self._turn.release()


def inventory_events(plan: Plan, time: float) -> list[Event]:
    """Assign the Core's GPUs to `core` (the ledger starts with every GPU free) and create the
    planner's capacity record."""
    events = [Event("gpu", g, "assign", time, {"owner": "core"}) for g in plan.core.gpus]
    return [*events, Event("capacity", "grp", "start", time)]
