"""Process checks shared by the multi-process tests."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable

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


def wait_exited(pid: int, timeout_s: float = 10.0) -> None:
    """Wait until process `pid` has exited — a zombie or already reaped, whoever its parent is
    (a pool's workers are its starter's children, `training.prefork`): its pidfd turns
    readable then."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # reaped already
    try:
        ready, _, _ = select.select([fd], [], [], timeout_s)
        assert ready, f"process {pid} did not exit within {timeout_s} s"
    finally:
        os.close(fd)


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


def pids_of_a_killed_coordinator(script: str, *args: str) -> list[int]:
    """Run `script` (`python -c`) as a coordinator that prints its workers' pids on a line
    "PIDS ..." once they are started, then SIGKILL it (no chance to shut down) and return those
    pids: the orphan tests' setup."""
    coord = subprocess.Popen(
        [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True
    )
    try:
        assert coord.stdout is not None
        line = ""
        while not line.startswith("PIDS"):  # skip the pool's log lines
            line = coord.stdout.readline()
            assert line, "the coordinator exited before its pool started"
        return [int(x) for x in line.split()[1:]]
    finally:
        coord.kill()
        coord.wait(10)
        if coord.stdout is not None:
            coord.stdout.close()


def as_from_a_terminal() -> None:
    """`preexec_fn` for a child that stands for a command typed at a terminal, where Ctrl-C
    is not ignored. A shell without job control starts background jobs (`cmd &` in a script,
    as CI runners do) with SIGINT ignored; children inherit that, and Python then never raises
    `KeyboardInterrupt`: a test of what Ctrl-C does would wait forever."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Watched:
    """A child whose output (stdout, with stderr merged) is collected line by line on a thread
    into `lines`, for a test that acts on what the child prints: freeze one of its processes
    when a line shows (`stop_when`), then wait for its end and resume what it froze (`finish`).
    Used as a context manager, an exception before `finish` kills the child and resumes."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None, "start the child with stdout=subprocess.PIPE, text=True"
        self.proc = proc
        self.lines: list[str] = []
        self.stopped: list[int] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(proc.stdout or ()))
        self._reader.daemon = True
        self._reader.start()

    def __enter__(self) -> Watched:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is not None:  # the test failed before `finish`: end the child now
            self.finish(0)

    def stop_when(
        self,
        ready: Callable[[list[str]], bool],
        pid_of: Callable[[], int],
        within_s: float = 150.0,
        poll_s: float = 0.01,
    ) -> tuple[int | None, float]:
        """SIGSTOP process `pid_of()` as soon as `ready(lines)` holds; its pid and the time
        (`time.time()`) it was frozen, or (None, 0.0) when the child ended or `within_s`
        passed first. `finish` sends it SIGCONT."""
        end = time.monotonic() + within_s
        while time.monotonic() < end and self.proc.poll() is None:
            if ready(self.lines):
                pid = pid_of()
                os.kill(pid, signal.SIGSTOP)
                self.stopped.append(pid)
                return pid, time.time()
            time.sleep(poll_s)
        return None, 0.0

    def finish(self, timeout_s: float, resume: Iterable[int | None] = ()) -> str:
        """Wait up to `timeout_s` for the child's end (killed after that: its return code then
        says so), send SIGCONT to what `stop_when` froze and to `resume`, and return the whole
        output."""
        try:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
            for pid in (*self.stopped, *resume):
                if pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
            self._reader.join(10)
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        return "".join(self.lines)


def sigterm_when(
    args: list[str], ready: Callable[[int], bool], what: str, timeout_s: float = 120.0
) -> tuple[int, str, float]:
    """Run `args` (output captured), send it SIGTERM once `ready(pid)` holds (polled every
    5 ms; `what` names the moment in the failure when it never comes), and wait for it: its
    exit status, its output, and the seconds from the signal to its exit."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + timeout_s
        while not ready(proc.pid):
            assert time.monotonic() < deadline and proc.poll() is None, f"no {what}"
            time.sleep(0.005)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, out, time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
