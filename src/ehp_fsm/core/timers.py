"""Deadlines that have passed: the `deadline` events a shell fires on every tick.

What it knows: that an instance's armed deadline lives in its data under `deadline` (written by
the `arm_deadline` effect, removed by `disarm_deadline`), and that a deadline can only fire where
the instance's spec has a `deadline` transition from its current state. What it does not know:
clocks (the caller passes `now`), and whether the event will be accepted — the `deadline_passed`
guard re-checks every event when it is handled.

Pure: no clock, no I/O. The shell calls `due_deadlines(world, now)` and handles each event, so a
waiting state's deadline fires while waiting, not only between phases.
"""

from __future__ import annotations

from ehp_fsm.core.world import Event, World

DEADLINE_EVENT = "deadline"


def _timed(world: World) -> list[str]:
    """The machines whose spec has a `deadline` transition, sorted: only their instances can
    fire one. The others (groups, revisions, the ledger) are most of a long run's instances and
    were scanned, and sorted, on every tick of the shell."""
    return sorted(
        m
        for m, spec in world.specs.items()
        if m in world.instances and any(ev == DEADLINE_EVENT for _, ev in spec.table)
    )


def due_deadlines(world: World, now: float) -> list[Event]:
    """One `deadline` event per instance whose armed deadline is `<= now`, in a stable order
    (machine name, then instance id). Instances in a terminal state or in a state without a
    `deadline` transition are skipped."""
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
            if deadline > now:
                continue
            if (inst.state, DEADLINE_EVENT) not in spec.table:
                continue
            out.append(
                Event(machine, iid, DEADLINE_EVENT, now, {"deadline": float(deadline)}, "timer")
            )
    return out


def next_deadline(world: World) -> float | None:
    """The earliest armed deadline of any live instance that can fire one (None if none is
    armed)."""
    best: float | None = None
    for machine in _timed(world):
        spec = world.specs[machine]
        for inst in world.instances[machine].values():
            deadline = inst.data.get("deadline")
            if inst.state in spec.terminal or not isinstance(deadline, int | float):
                continue
            if best is None or deadline < best:
                best = float(deadline)
    return best
