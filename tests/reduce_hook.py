"""Drives the trainer workers' reduction test hook (`EHP_TEST_REDUCE_HOOK`) from a test thread.

Each worker writes `enter-<rank>-<step>` (content: its pid) on entering a step's reduction and
waits at the door while `hold-<rank>` exists (see `TrainerWorker._reduce_hook`). Knows only
that file protocol; what is killed and what must follow is the test's business.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path


class KillInsideReduction(threading.Thread):
    """Waits until rank 0 and rank `victim` have entered the reduction of the same step
    (`step`, or the first such step when None), gives the rank that is not held 0.3 s to get
    inside the Gloo all-reduce, SIGKILLs the victim (`pid`, else the pid its hook file names),
    then lifts the `hold` file so the held rank goes on. Under heavy load the kill can land
    just before the free rank's collective; the pool must survive that case the same way."""

    def __init__(
        self,
        hook: Path,
        *,
        victim: int,
        hold: str,
        step: int | None = None,
        pid: int | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        super().__init__(daemon=True)
        self.hook, self.victim, self.hold, self.pid = hook, victim, hold, pid
        self.step, self.timeout_s = step, timeout_s
        self.killed_at: float | None = None

    def _entered(self) -> int | None:
        """The step both ranks have entered, if any yet."""
        for f in self.hook.glob(f"enter-{self.victim}-*"):
            step = int(f.name.rsplit("-", 1)[1])
            if (self.step is None or step == self.step) and (
                self.hook / f"enter-0-{step}"
            ).exists():
                return step
        return None

    def run(self) -> None:
        end = time.monotonic() + self.timeout_s
        while (step := self._entered()) is None:
            if time.monotonic() >= end:
                return  # never entered: the test's own assertions say so (killed_at is None)
            time.sleep(0.005)
        time.sleep(0.3)
        pid = self.pid or int((self.hook / f"enter-{self.victim}-{step}").read_text())
        os.kill(pid, signal.SIGKILL)
        self.step, self.killed_at = step, time.monotonic()
        time.sleep(0.2)  # the held rank stays at the door until the death can be seen
        (self.hook / self.hold).unlink()
