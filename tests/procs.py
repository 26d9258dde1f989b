"""Process checks shared by the multi-process tests."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable

import psutil


def still_running(pids: Iterable[int]) -> list[int]:
    """The pids among `pids` whose process still runs code: not gone and not a zombie (exited,
    not yet reaped). A process that exits while it is being looked at counts as gone."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return out


def running_after(pids: Iterable[int], timeout_s: float) -> list[int]:
    """`still_running(pids)` once they have all gone or `timeout_s` passed (polled): a process
    that was told to exit gets the time to do it, one that leaked is still reported."""
    pids = list(pids)
    end = time.monotonic() + timeout_s
    while (left := still_running(pids)) and time.monotonic() < end:
        time.sleep(0.02)
    return left


def kill_and_wait(pid: int, timeout_s: float = 10.0) -> None:
    """SIGKILL `pid` and wait (up to `timeout_s`) until it no longer runs. A pid already
    gone (ended and reaped, e.g. by a thread in `Popen.wait`, since the caller looked) is fine."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    assert not running_after([pid], timeout_s), f"pid {pid} survived SIGKILL"


def as_from_a_terminal() -> None:
    """`preexec_fn` for a child that stands for a command typed at a terminal, where Ctrl-C
    is not ignored. A shell without job control starts background jobs (`cmd &` in a script,
    as CI runners do) with SIGINT ignored; children inherit that, and Python then never raises
    `KeyboardInterrupt`: a test of what Ctrl-C does would wait forever."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
