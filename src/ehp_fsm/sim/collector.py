"""When the simulation runs Python's cycle collector: at step boundaries, not every 700 objects.

Knows: the step number. Does not know the world or the clock.

A simulated step at 1,024 hosts builds millions of small objects (events, instance data, group
results); CPython's automatic collector scans the young ones every 700 allocations and the whole
heap each time it grew by a quarter — and the heap is the simulated cluster, so the full scans
grow with it (2 steps at 1,024 hosts: 15 full collections, ~40 % of the wall time). Almost all
of those objects die by reference counting; the few cycles (closures that reschedule
themselves) wait for the next collection. So, inside `Simulation.run` only: automatic collection
off, the young generations collected at every `YOUNG_EVERY`-th step boundary, and the heap built
during the run at steps 8, 16, 32, 64, 96, ... — a bounded share of the run, and cyclic garbage
never waits more than 32 steps. A young collection scans every object made since the last one
that is still alive; at a boundary those are mostly the groups of the next step or two (their
results, samples, bookkeeping), which die by reference counting within two steps, and they
found no garbage in the runs measured (256 hosts, faults on: 0 objects freed at each of 6
boundaries, 50-100 ms each). Collecting them every 4th boundary scans those short-lived
objects a quarter as often (`benchmarks/simulate-2026-12-01.md`). What existed before the
run (the imported modules, the plan, the cluster's initial world) is frozen (`gc.freeze`): alive
throughout, it is not scanned again (a full collection of it cost ~0.7 s at 1,024 hosts). The
previous setting is restored on exit (unfrozen, collection as before); the run's own processes
never see this.
"""

from __future__ import annotations

import gc
from types import TracebackType
from typing import Final

__all__ = ["StepCollector"]

FIRST_FULL: Final = 8  # the first step boundary that collects the whole (unfrozen) heap
FULL_EVERY_MAX: Final = 32  # steps between two whole-heap collections, at most
YOUNG_EVERY: Final = 4  # steps between two young collections (between the whole-heap ones)


class StepCollector:
    """`with StepCollector() as c: ... c.boundary(step)`."""

    def __init__(self) -> None:
        self._was_enabled = False
        self._next_full = FIRST_FULL

    def __enter__(self) -> StepCollector:
        self._was_enabled = gc.isenabled()
        gc.disable()
        gc.freeze()
        return self

    def boundary(self, step: int) -> None:
        """After step `step`: the whole heap on the doubling plan, else the young generations
        every `YOUNG_EVERY` steps."""
        if step >= self._next_full:
            gc.collect()
            self._next_full = step + min(step, FULL_EVERY_MAX)
        elif step % YOUNG_EVERY == 0:
            gc.collect(1)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        gc.unfreeze()
        if self._was_enabled:
            gc.enable()
