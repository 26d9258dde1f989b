"""Deadlines that have passed: the `deadline` events a shell fires on every tick.

What it knows: that an instance's armed deadline lives in its data under `deadline` (written by
the `arm_deadline` effect, removed by `disarm_deadline`), and that a deadline can only fire where
the instance's spec has a `deadline` transition from its current state. What it does not know:
clocks (the caller passes `now`), and whether the event will be accepted — the `deadline_passed`
guard re-checks every event when it is handled.

Pure: no clock, no I/O. The shell calls `due_deadlines(world, now)` and handles each event, so a
waiting state's deadline fires while waiting, not only between phases. A shell that did not turn
for a while (its process stopped, a paused VM) puts armed deadlines off by as much (`Postponed`:
what a deadline waits for may have happened meanwhile, its report still unread); the event still
carries the deadline that was armed, which the `deadline_passed` guard checks.
"""

from __future__ import annotations

from collections.abc import Mapping

from ehp_fsm.core.world import Event, World

DEADLINE_EVENT = "deadline"

#: (machine, instance) -> (the deadline armed there, seconds it is put off): an entry counts
#: only while that very deadline is armed (a deadline armed afresh is not put off).
Postponed = Mapping[tuple[str, str], tuple[float, float]]


def _due_at(machine: str, iid: str, deadline: float, postponed: Postponed | None) -> float:
    if postponed:
        p = postponed.get((machine, iid))
        if p is not None and p[0] == deadline:
            return deadline + p[1]
    return deadline


def _timed(world: World) -> list[str]:
    """The machines whose spec has a `deadline` transition, sorted: only their instances can
    fire one. The others (groups, revisions, the ledger) are most of a long run's instances and
    were scanned, and sorted, on every tick of the shell."""
    return sorted(
        m
        for m, spec in world.specs.items()
        if m in world.instances and any(ev == DEADLINE_EVENT for _, ev in spec.table)
    )


def due_deadlines(world: World, now: float, postponed: Postponed | None = None) -> list[Event]:
    """One `deadline` event per instance whose armed deadline (put off by `postponed`) is
    `<= now`, in a stable order (machine name, then instance id). Instances in a terminal state
    or in a state without a `deadline` transition are skipped."""
    out: list[Event] = []
    for machine in _timed(world):
        spec = world.specs[machine]
        for iid in sorted(world.instances[machine]):
            inst = world.instances[machine][iid]
            if inst.state in spec.terminal:
                continue
            deadline = inst.data.get("deadline")
            if not isinstance(deadline, int | float) or isinstance(deadline, bool):
                continue
            if _due_at(machine, iid, deadline, postponed) > now:
                continue
            if (inst.state, DEADLINE_EVENT) not in spec.table:
                continue
            out.append(
                Event(machine, iid, DEADLINE_EVENT, now, {"deadline": float(deadline)}, "timer")
            )
    return out


def next_deadline(world: World, postponed: Postponed | None = None) -> float | None:
    """The earliest armed deadline (put off by `postponed`) of any live instance that can fire
    one (None if none is armed)."""
    best: float | None = None
    for machine, iid, deadline in armed_deadlines(world):
        due = _due_at(machine, iid, deadline, postponed)
        if best is None or due < best:
            best = due
    return best


def armed_deadlines(world: World) -> list[tuple[str, str, float]]:
    """(machine, instance, deadline) of every live instance with an armed deadline, of the
    machines that can fire one."""
    out: list[tuple[str, str, float]] = []
    for machine in _timed(world):
        spec = world.specs[machine]
        for iid, inst in world.instances[machine].items():
            deadline = inst.data.get("deadline")
            if inst.state in spec.terminal or not isinstance(deadline, int | float):
                continue
            if isinstance(deadline, bool):
                continue
            out.append((machine, iid, float(deadline)))
    return out
