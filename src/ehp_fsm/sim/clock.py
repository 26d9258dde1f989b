"""Virtual time: a clock that jumps to the next scheduled happening.

Knows: the current virtual time and a heap of (time, sequence, callback); ties run in the
order they were scheduled, so a run is deterministic. Does not know what a callback does.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

__all__ = ["VirtualClock"]


class VirtualClock:
    """`now()` is the loop's clock; `at`/`after` schedule; `advance_to` runs what is due."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = start
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0

    def now(self) -> float:
        return self.t

    def at(self, when: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (max(when, self.t), self._seq, fn))

    def after(self, delay: float, fn: Callable[[], None]) -> None:
        self.at(self.t + delay, fn)

    def next_time(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def run_next(self) -> bool:
        """Run the earliest happening (time moves to it); False when nothing is scheduled."""
        if not self._heap:
            return False
        when, _, fn = heapq.heappop(self._heap)
        self.t = when
        fn()
        return True

    def run_until(self, pred: Callable[[], bool], end: float) -> bool | None:
        """Run the happenings in order until `pred()` holds (True); False when the next one is
        due after `end` (the clock then stands at `end`: `advance_to(end)`); None when nothing
        is left to run (`next_time()` and `run_next()` in a loop, without two calls a turn)."""
        heap, pop = self._heap, heapq.heappop
        while not pred():
            if not heap:
                return None
            if heap[0][0] > end:
                self.advance_to(end)
                return False
            when, _, fn = pop(heap)
            self.t = when
            fn()
        return True

    def advance_to(self, when: float) -> None:
        """Run everything due up to `when`, then stand at `when`."""
        while self._heap and self._heap[0][0] <= when:
            self.run_next()
        self.t = max(self.t, when)

    def __len__(self) -> int:
        return len(self._heap)
