"""`kill -USR1 PID` writes every Python thread's stack: where a process that seems stuck waits.

Why not `faulthandler.register(SIGUSR1, all_threads=True)`: faulthandler walks the other
threads' frames from inside the signal, without the GIL, while those threads run. In a process
with several busy threads — `ehp-fsm run`: its loop, the trainer's step thread, the HTTP
workers — that can crash the process an operator only wanted to look at (a CI run died of
SIGSEGV during such a dump, a thread inside ZeroMQ's send). This handler is a Python signal
handler: it runs in the main thread between two bytecodes, holding the GIL, reads
`sys._current_frames()`, and writes the whole text with `os.write` on a file descriptor (not
through a buffered stream, which the main thread may have been writing to when the signal came).

What it cannot do: report a process whose main thread does not come back to Python (blocked in
a C call that ignores signals). A trainer worker, whose main thread waits inside Gloo
collectives, keeps faulthandler: its other threads are not Python threads.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from types import FrameType
from typing import Any

__all__ = ["format_stacks", "install"]


def format_stacks() -> str:
    """Every Python thread's stack, most recent call first (faulthandler's order), the thread
    that runs this first."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    frames = sorted(sys._current_frames().items(), key=lambda kv: kv[0] != me)
    out = []
    for ident, frame in frames:
        what = "Current thread" if ident == me else "Thread"
        out.append(f"{what} {ident:#x} ({names.get(ident, '?')}), most recent call first:\n")
        out.extend(reversed(traceback.format_stack(frame)))
        out.append("\n")
    return "".join(out)


def install(fd: int) -> Any:
    """On SIGUSR1, write `format_stacks()` to file descriptor `fd`; returns the handler it
    replaced (`signal.signal`'s answer). Main thread only (as every Python signal handler:
    `ValueError` elsewhere)."""

    def dump(signum: int, frame: FrameType | None) -> None:
        data = format_stacks().encode("utf-8", "replace")
        while data:
            try:
                data = data[os.write(fd, data) :]
            except InterruptedError:
                continue
            except OSError:
                return  # the stream is gone: the process goes on without its dump

    return signal.signal(signal.SIGUSR1, dump)
