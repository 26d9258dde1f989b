"""Log records a stranger can cause, at a bounded rate.

A frame dropped, a delivery refused, a stranger gone silent: each is worth a log line, and each
is caused by whoever can reach a socket. Unbounded, that is a way to fill the disk: 50,000 one-byte
frames sent to the trainer pool's port in well under a second wrote 50,002 `frame_dropped` lines
(8 MB) to the run's log. `LogThrottle` lets through the first `burst` records of each kind in a
window of `window_s` seconds and counts the rest; the next record let through carries that count
(`suppressed`). The counters callers keep (`AgentLink.drops`, `WorkerChannel.dropped`) stay
exact.

Pure bookkeeping over an injected clock: nothing here logs, sleeps or does I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

#: Kinds tracked at most; more (a caller that keys by something a stranger picks) share one.
MAX_KINDS: Final = 256
_OTHER: Final = "(other)"


@dataclass(slots=True)
class _Window:
    started: float
    let: int = 0
    suppressed: int = 0


class LogThrottle:
    """See the module docstring."""

    def __init__(
        self,
        *,
        burst: int = 20,
        window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if burst < 1 or window_s <= 0:
            raise ValueError(f"burst {burst} and window_s {window_s} must be positive")
        self.burst = burst
        self.window_s = window_s
        self._clock = clock
        self._windows: dict[str, _Window] = {}

    def let(self, kind: str) -> dict[str, int] | None:
        """None: leave this record of `kind` out (it is counted). Else the fields to add to it:
        `{"suppressed": n}` when n records of its kind were left out since the last one let
        through, `{}` otherwise."""
        now = self._clock()
        w = self._windows.get(kind)
        if w is None:
            if len(self._windows) >= MAX_KINDS:
                kind = _OTHER
                w = self._windows.get(kind)
            if w is None:
                w = self._windows[kind] = _Window(started=now)
        if now - w.started >= self.window_s:
            w.started, w.let = now, 0
        if w.let >= self.burst:
            w.suppressed += 1
            return None
        w.let += 1
        n, w.suppressed = w.suppressed, 0
        return {"suppressed": n} if n else {}
