"""A process's own stalls: the time it did not turn, not counted against its peers.

A run stopped (SIGSTOP, a paused VM, swapping) or a call that blocked its loop finds, at the
resume, every deadline it set passed and every peer silent — though the peers answered in time
and their answers wait unread in its sockets. Each waiter here measures its own absence and
puts its judgement off by it: `time_away` for loops that know how long they meant to wait (the
endpoint's poll, the controller's loop), `OwnDeadline` for a waiter that only reads a clock
between short waits (the trainer pool).

Pure bookkeeping over an injected clock: nothing here sleeps, logs or does I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def time_away(turned_at: float, start: float, end: float, wait: float) -> float:
    """Seconds a loop did not listen before and during the turn that began at `start` and
    ended at `end`: since its last turn ended (`turned_at`), plus however much longer than the
    `wait` it asked for the turn took. A caller credits what exceeds its ordinary turn."""
    return start - turned_at + max(0.0, end - start - wait)


class OwnDeadline:
    """A deadline on a monotonic clock that does not count the waiter's own stalls: when two
    readings (`left`) are more than `allowance_s` apart — its process stopped or paused, its
    thread not scheduled — the deadline moves later by what exceeds the allowance. A waiter
    reads it once per turn of a loop that waits at most a fraction of the allowance for the
    answer (the trainer pool: 20–50 ms); a reply that came while it could not read is read
    before the deadline is judged. A run stopped (SIGSTOP) past a step's deadline had its Core
    rank's answer, sent in time, given up at the resume: the run stopped ("no reply from ranks
    [0] in 3 s")."""

    __slots__ = ("_clock", "_last", "allowance_s", "at", "stalled_s")

    def __init__(
        self,
        seconds: float,
        *,
        allowance_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._last = clock()
        self.at = self._last + seconds
        self.allowance_s = allowance_s
        self.stalled_s = 0.0

    def _read(self) -> float:
        now = self._clock()
        gap = now - self._last
        self._last = now
        if gap > self.allowance_s:
            self.at += gap - self.allowance_s
            self.stalled_s += gap - self.allowance_s
        return now

    def left(self) -> float:
        """Seconds left (<= 0: passed), after crediting a stall since the last reading."""
        now = self._read()  # (first: it may move `at`)
        return self.at - now

    def now(self) -> float:
        """The clock less every stall credited (this reading's too): the time to judge
        against the deadline as it was first set (`at` less `stalled_s`)."""
        return self._read() - self.stalled_s
