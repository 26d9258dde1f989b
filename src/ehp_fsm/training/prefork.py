"""Local trainer workers forked from one process that has already imported torch and
transformers (a "starter"), instead of each started from scratch.

Why: a worker's start is mostly imports. `import torch` with `transformers.modeling_utils` (the
model classes a lane builds) is ~4 s of CPU per process (4.2 s user, two runs, on the 2-core
machine the project is built on); the worker's own work until it says hello is a fraction of
a second on the tiny model.
A pool of Core ranks and warm Hybrid workers paid it once per rank, and again for every
replacement of a dead warm worker. Forked from the starter, a worker begins with those modules
already loaded; the fork is what PyTorch's own `DataLoader` workers do.

Only for a pool on CPU (`PoolConfig.device == "cpu"`): a process that has initialised CUDA
cannot fork a child that uses it, and nothing here proves transformers' import never does. On
CUDA the pool starts each worker as its own process (`python -m ehp_fsm.training.worker`), as
the Megatron followers of a TP or PP lane always are.

The starter is single-threaded and touches no device, socket or thread pool before it forks: its
children begin clean. It speaks only on the two pipes its pool holds (its stdin and stdout;
msgpack maps, never pickle; the process is `training.starter`):

    request  {"argv": [...worker options...], "env": {...}, "log": PATH, "name": "trainer-R"}
    reply    {"pid": N}  or  {"error": "..."}          (one per request, in order)
    event    {"exit": N, "code": C}                    (C as `Popen.returncode`: -S for signal S)

A child: its own session (Ctrl-C goes to the coordinator, which stops it), stdin from
/dev/null, stdout and stderr appended to `log`, exactly `env` as its environment, then the
worker's `main`. It dies with the starter (`PR_SET_PDEATHSIG`): a worker whose exit nobody can
reap or report must not outlive the record of it. The starter exits when its stdin closes (its
pool shut down, or the coordinator died).

A start does not wait for the starter: its first answer comes only once the starter's imports
are done (seconds), and the pool launches its ranks from the run's controller thread, whose
loop must keep listening to the agents. The worker's pid is known once the answer is in.

Seen from outside, a forked worker is one process among the run's as before, with two
differences: its environment in `/proc/PID/environ` is the starter's (the pool's launch token is
in it, which is what `ehp-fsm stop` checks; its own route only in its `os.environ`), and its
command line is the starter's, `python -m ehp_fsm.training.starter --pool DIR`. Its name, in
`ps -o comm`, `top` and psutil's `name()`, says which rank it is: `trainer-<rank>`.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgpack

from ehp_fsm.errors import exit_words
from ehp_fsm.training.pool_protocol import PoolError

MODULE = "ehp_fsm.training.starter"
MAX_FRAME = 1 << 20  # a request is a command line and an environment: far below this
#: how long a pool waits for the starter's report of a child it has seen end (the starter reaps
#: on SIGCHLD: milliseconds, unless the machine is starved)
REPORT_WAIT_S = 5.0


def pack(obj: Mapping[str, Any]) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


class Starter:
    """A pool's starter process and what it reports (see the module docstring). Thread-safe."""

    def __init__(self, env: Mapping[str, str], log: Path, *, answer_s: float) -> None:
        """`env`: the starter's environment, and so every child's in `/proc/PID/environ`;
        `log`: where the starter's own output goes (a failed import, say); `answer_s`: how long
        a worker's pid is waited for once asked for (the first answer includes the imports)."""
        with open(log, "ab") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", MODULE, "--pool", str(log.parent)],
                env=dict(env),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                start_new_session=True,
            )
        self.log = log
        self.answer_s = answer_s
        self._lock = threading.Lock()  # requests are written whole, and numbered in order
        self._changed = threading.Condition()
        self._asked = 0
        self._answers: list[dict[str, Any]] = []  # the n-th answer is the n-th request's
        self._exits: dict[int, int] = {}
        self._cancelled: set[int] = set()  # requests given up unanswered (`cancel`)
        self.stuck = False  # a request was given up; cleared by the next answer
        self._ended = False
        self._reader = threading.Thread(target=self._read, name="prefork-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=MAX_FRAME, strict_map_key=True)
        fd = self.process.stdout.fileno()
        try:
            while data := os.read(fd, 65536):
                unpacker.feed(data)
                with self._changed:
                    for msg in unpacker:
                        if isinstance(msg, dict) and "exit" in msg:
                            self._exits[int(msg["exit"])] = int(msg["code"])
                        elif isinstance(msg, dict):
                            if len(self._answers) in self._cancelled and "pid" in msg:
                                # a worker the pool gave up on before it was started: not
                                # one it knows of (it is the starter's child, not reaped
                                # yet: the pid is still its own)
                                with contextlib.suppress(ProcessLookupError):
                                    os.kill(int(msg["pid"]), signal.SIGKILL)
                            self._answers.append(msg)
                            self.stuck = False
                    self._changed.notify_all()
        except (OSError, ValueError, msgpack.UnpackException):
            pass
        finally:
            with self._changed:
                self._ended = True
                self._changed.notify_all()

    def alive(self) -> bool:
        return not self._ended and self.process.poll() is None

    @property
    def ended(self) -> bool:
        """The starter's output ended: it exited (or was killed); it reports no more exits."""
        return self._ended

    def start(
        self, argv: Sequence[str], env: Mapping[str, str], log: Path, *, name: str
    ) -> StartedWorker:
        """Ask for a worker with options `argv` (`worker_argv` past `-m
        ehp_fsm.training.worker`) and environment `env`, its output appended to `log`, named
        `name` (`ps -o comm`). Returns at once (its pid comes with the starter's answer)."""
        with self._lock:
            if not self.alive():
                raise PoolError(
                    "the pool's worker starter is gone",
                    f"its process {self.process.pid} ended (its log: {self.log})",
                    "start a new pool",
                )
            assert self.process.stdin is not None
            try:
                self.process.stdin.write(
                    pack({"argv": list(argv), "env": dict(env), "log": str(log), "name": name})
                )
                self.process.stdin.flush()
            except (BrokenPipeError, ValueError) as exc:
                raise PoolError(
                    "the pool's worker starter is gone",
                    f"writing to it failed: {exc}",
                    "start a new pool",
                ) from None
            ticket = self._asked
            self._asked += 1
        return StartedWorker(self, ticket, log)

    def answer(self, ticket: int, timeout: float | None) -> dict[str, Any] | None:
        """The starter's answer to request `ticket`, waiting up to `timeout` (None: none yet;
        `{"error": ...}` when the starter ended without giving it)."""
        with self._changed:
            if timeout != 0.0:
                self._changed.wait_for(lambda: len(self._answers) > ticket or self._ended, timeout)
            if len(self._answers) > ticket:
                return self._answers[ticket]
            if self._ended:
                return {"error": f"the starter ended first (its log: {self.log})"}
            return None

    def cancel(self, ticket: int) -> bool:
        """Give request `ticket` up unless its answer is in (True: given up). A pid that
        comes for it later is killed at once; the starter counts as stuck meanwhile."""
        with self._changed:
            if len(self._answers) > ticket:
                return False
            self._cancelled.add(ticket)
            self.stuck = True
            return True

    def exit_code(self, pid: int, timeout: float | None = 0.0) -> int | None:
        """Child `pid`'s exit code once the starter reaped it, waiting up to `timeout` (None:
        for ever); None if it is not known by then, or the starter is gone (then ask the
        process itself: `StartedWorker`)."""
        with self._changed:
            if timeout != 0.0:
                self._changed.wait_for(lambda: pid in self._exits or self._ended, timeout)
            return self._exits.get(pid)

    def close(self, timeout_s: float = 5.0) -> None:
        """Close the starter's stdin (it exits; its live children die with it) and reap it."""
        with contextlib.suppress(OSError, ValueError):
            if self.process.stdin is not None:
                self.process.stdin.close()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
        self._reader.join(timeout=5)
        if self.process.stdout is not None:
            self.process.stdout.close()


class StartedWorker:
    """A worker asked of the starter, with what the pool uses of a `subprocess.Popen`: `pid`,
    `returncode`, `poll`, `wait`, `send_signal`, `terminate`, `kill`.

    Its pid is the starter's answer: `pid` waits for it (`Starter.answer_s` at most); until it
    is in, the worker counts as starting (`poll` is None). A start the starter could not make
    (a fork that failed, a starter that ended first) is a process that exited with code 1, the
    reason appended to its log, as a worker that failed at once would have said it there.

    Signals go through a pidfd opened once the pid is known: once the child is reaped, a signal
    fails instead of reaching whatever process took its pid next. A child outlives no starter
    (`PR_SET_PDEATHSIG`): when the starter is gone, the pidfd says when the child is, and its
    code is -SIGKILL, the death its starter's end gave it, unless the starter reported an exit
    before."""

    def __init__(self, starter: Starter, ticket: int, log: Path) -> None:
        self._starter = starter
        self._ticket = ticket
        self._log = log
        self._pid: int | None = None
        self._pidfd: int | None = None
        self.returncode: int | None = None

    def _resolve(self, timeout: float | None) -> bool:
        """The starter's answer, waited for up to `timeout`: True once it is in."""
        if self._pid is not None or self.returncode is not None:
            return True
        got = self._starter.answer(self._ticket, timeout)
        if got is None:
            return False
        if "pid" in got:
            self._pid = int(got["pid"])
            try:
                self._pidfd = os.pidfd_open(self._pid)
            except ProcessLookupError:  # already reaped: its exit is (or will be) reported
                self._pidfd = None
            return True
        self._fail(str(got.get("error")))
        return True

    def _fail(self, why: str) -> None:
        """A start the starter did not make: exited with code 1, `why` in the worker's log."""
        with contextlib.suppress(OSError), open(self._log, "a") as fh:
            fh.write(f"RuntimeError: the pool's worker starter did not start it: {why}\n")
        self._pid = 0
        self.returncode = 1

    @property
    def pid(self) -> int:
        """The worker's pid (0: the starter could not start it); waits for the starter's
        answer."""
        if not self._resolve(self._starter.answer_s):
            raise PoolError(
                "trainer pool did not start: its worker starter gave no pid within "
                f"{self._starter.answer_s:g} s",
                f"the starter imports torch and transformers first (its log: {self._starter.log})",
                "on a loaded machine raise the time the run waits for its trainers "
                "([deadlines.run] trainers_start)",
            )
        assert self._pid is not None
        return self._pid

    def _exited(self, timeout: float | None) -> bool:
        """The process has ended (exited, or a zombie not reaped yet), within `timeout`."""
        if self._pidfd is None:
            return True
        ready, _, _ = select.select([self._pidfd], [], [], timeout)
        return bool(ready)

    def _settle(self, timeout: float | None) -> int | None:
        """The exit code once the process has ended (waiting up to `timeout` for it to), as
        `Popen` knows it the moment it has: the starter reaps its child at once, and the code
        follows within a moment (up to `REPORT_WAIT_S`, else None: still unknown)."""
        if not self._resolve(timeout):
            return None
        if self.returncode is not None:
            return self.returncode
        assert self._pid is not None
        code = self._starter.exit_code(self._pid)
        if code is None:
            if not self._exited(timeout):
                return None
            # not reaped yet (a stopped starter): its status is in /proc; else the report of
            # the starter that reaped it is on its way
            code = _zombie_code(self._pid)
            if code is None:
                code = self._starter.exit_code(self._pid, REPORT_WAIT_S)
            if code is None and self._starter.ended:
                code = -signal.SIGKILL  # it died with its starter (PR_SET_PDEATHSIG)
            if code is None:
                return None
        self.returncode = code
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        return code

    def poll(self) -> int | None:
        if self.returncode is None:
            self._settle(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and self._settle(timeout) is None:
            raise subprocess.TimeoutExpired(f"worker {self._pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Signal the worker. One whose pid is not in yet is waited for, `REPORT_WAIT_S` at
        most (the starter answers once its imports are done; not at all while it is known
        stuck). Past that the starter is stuck (stopped, or starved): a SIGKILL or SIGTERM
        gives the start up (`Starter.cancel`; the worker counts as exited with code 1, said in
        its log), and the starter's other workers, the Core among them, run on."""
        wait = 0.0 if self._starter.stuck else min(REPORT_WAIT_S, self._starter.answer_s)
        if not self._resolve(wait):
            if sig not in (signal.SIGKILL, signal.SIGTERM):
                return  # not started yet: nothing to signal
            if self._starter.cancel(self._ticket):
                self._fail(
                    f"no pid came in {REPORT_WAIT_S:g} s (the starter is stopped or starved); "
                    "given up"
                )
                return
            self._resolve(0.0)  # (the answer came in meanwhile)
        if self.poll() is None and self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def starter_end(self) -> str | None:
        """How its starter ended ("process N, was killed by SIGKILL"), when the worker died
        with it: its starter has ended and never reported the worker's own exit. None
        otherwise."""
        if self.returncode is None or not self._pid or not self._starter.ended:
            return None
        if self._starter.exit_code(self._pid) is not None:
            return None  # it ended first: its own end
        proc = self._starter.process
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(1.0)  # (its output ends a moment before it is reaped)
        code = proc.poll()
        words = "has ended" if code is None else exit_words(code)
        return f"process {proc.pid}, {words}"

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _zombie_code(pid: int) -> int | None:
    """The exit code of `pid` while it is a zombie (exited, not reaped): the last field of
    `/proc/PID/stat` is its wait status (Linux ≥ 3.5). None when it is not one."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] != b"Z" or len(fields) < 50:
        return None
    return os.waitstatus_to_exitcode(int(fields[49]))
