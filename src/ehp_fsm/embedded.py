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
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

from ehp_fsm.core.effects import EFFECTS
from ehp_fsm.core.guards import GUARDS
from ehp_fsm.core.invariants import check_invariants
from ehp_fsm.core.spec import MachineSpec
from ehp_fsm.core.transition import Accepted, Outcome, Rejected, step
from ehp_fsm.core.world import Event, World
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


def _event_problem(event: Event) -> str | None:
    """Why `event` cannot be stepped, or None. A non-finite time would be logged as `null`
    (the log could not be replayed); a payload that is not a mapping failed deep in a guard.
    (An id that is not a string is the engine's to refuse: a logged `Rejected`.) The event
    every shell builds — an `Event`, a float time, a dict or read-only payload — is passed by
    exact types first: the general checks below cost more than a simulated event's step."""
    if type(event) is Event:
        t = event.time
        if type(t) is float and t - t == 0.0 and type(event.payload) in _PAYLOADS:
            return None  # (finite: `inf - inf` and `nan - nan` are nan)
    if not isinstance(event, Event):
        return f"it is a {type(event).__name__}, not an ehp_fsm.Event"
    t = event.time
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t):
        return f"`time` is {t!r}, not a finite number of seconds"
    if not isinstance(event.payload, Mapping):
        return f"`payload` is {event.payload!r}, not a mapping"
    return None


_PAYLOADS = frozenset({dict, MappingProxyType})


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
        self.specs = specs if specs is not None else load_specs()
        self.world = World(self.specs, config)
        self.log = log
        self.check = check

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
        log = None
        if log_path is not None:
            log = TransitionLog.create(
                log_path,
                config=config,
                specs=specs,
                meta={"plan": plan.name, "source": Path(plan.source).name, **(log_meta or {})},
            )
        orch = cls(config, specs=specs, log=log, check=check)
        for ev in inventory_events(plan, time):
            out = orch.handle(ev)
            if isinstance(out, Rejected):
                raise EhpError(f"the plan's inventory does not load: {out.reason}")
        return orch

    def handle(self, event: Event) -> Outcome:
        """Step, log the attempted transitions, apply if accepted, check invariants if asked.
        The log is written first: a change the log could not record (a full disk) is not made.
        An event whose fields are of the wrong type raises `EventError` (nothing logged)."""
        if (problem := _event_problem(event)) is not None:
            raise EventError(
                "an event cannot be handled",
                problem,
                "build it as Event(machine, instance, name, time, payload) with str ids, a "
                "finite float time and a dict payload",
            )
        outcome = step(self.world, event, GUARDS, EFFECTS)
        log = self.log
        if log is not None:
            log.write(outcome)
        if isinstance(outcome, Accepted):
            self.world.apply(outcome.changes, outcome.globals)
            if self.check:
                problems = check_invariants(self.world, indexed=True)
                if problems:
                    raise InvariantViolation(event, problems)
        if log is not None and log.checkpoint_due(self.world):
            log.checkpoint(self.world)
        return outcome

    def handle_all(self, events: Iterable[Event]) -> list[Outcome]:
        return [self.handle(e) for e in events]

    @property
    def chain_head(self) -> tuple[int, str] | None:
        """The log's (lines written, last line's `chain`) — what a run's receipt records as
        `log_chain: {"count": ..., "hash": ...}` for `ehp-fsm replay --receipt` (read it after
        the last event, before or after `close`); None without a log."""
        return self.log.chain_head if self.log is not None else None

    def close(self) -> None:
        if self.log is not None:
            self.log.close()


def inventory_events(plan: Plan, time: float) -> list[Event]:
    """Assign the Core's GPUs to `core` (the ledger starts with every GPU free) and create the
    planner's capacity record."""
    events = [Event("gpu", g, "assign", time, {"owner": "core"}) for g in plan.core.gpus]
    return [*events, Event("capacity", "grp", "start", time)]
