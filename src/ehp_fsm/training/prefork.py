"""Local trainer workers forked from one process that has already imported torch and
transformers (a "starter"), instead of each started from scratch.

Why: a worker's start is mostly imports. `import torch` with `transformers.modeling_utils` (the
model classes a lane builds) is ~4 s of CPU per process here (measured 4.2 s user on the CI
machine); the worker's own work until it says hello is a fraction of a second on the tiny model.
A pool of Core ranks and warm Hybrid workers paid it once per rank, and again for every
replacement of a dead warm worker. Forked from the starter, a worker begins with those modules
already loaded; the fork is what PyTorch's own `DataLoader` workers do.

Only for a pool on CPU (`PoolConfig.device == "cpu"`): a process that has initialised CUDA
cannot fork a child that uses it, and nothing here proves transformers' import never does. On
CUDA the pool starts each worker as its own process (`python -m ehp_fsm.training.worker`), as
the Megatron followers of a TP or PP lane always are.

The starter is single-threaded and touches no device, socket or thread pool before it forks: its
children begin clean. It speaks only on the two pipes its pool holds (its stdin and stdout;
msgpack maps, never pickle):

    request  {"argv": [...worker options...], "env": {...}, "log": PATH, "name": "trainer-R"}
    reply    {"pid": N}  or  {"error": "..."}          (one per request, in order)
    event    {"exit": N, "code": C}                    (C as `Popen.returncode`: -S for signal S)

A child: its own session (Ctrl-C goes to the coordinator, which stops it), stdin from
/dev/null, stdout and stderr appended to `log`, exactly `env` as its environment, then the
worker's `main`. It dies with the starter (`PR_SET_PDEATHSIG`): a worker whose exit nobody can
reap or report must not outlive the record of it. The starter exits when its stdin closes (its
pool shut down, or the coordinator died).

Seen from outside, a forked worker is one process among the run's as before, with two
differences: its environment in `/proc/PID/environ` is the starter's (the pool's launch token is
in it, which is what `ehp-fsm stop` checks; its own route only in its `os.environ`), and its
command line is the starter's, `python -m ehp_fsm.training.prefork --pool DIR`. Its name, in
`ps -o comm`, `top` and psutil's `name()`, says which rank it is: `trainer-<rank>`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgpack

from ehp_fsm.errors import EhpError

MODULE = "ehp_fsm.training.prefork"
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_MAX_FRAME = 1 << 20  # a request is a command line and an environment: far below this
#: how long a pool waits for the starter's report of a child it has seen end (the starter reaps
#: on SIGCHLD: milliseconds, unless the machine is starved)
REPORT_WAIT_S = 5.0


class StarterError(EhpError):
    """The starter could not start a worker, or is gone."""


def _pack(obj: Mapping[str, Any]) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


# -- the starter process ------------------------------------------------------------------------


def _preload() -> None:
    """What every worker imports before it does anything (the cost forking saves)."""
    import torch  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    import ehp_fsm.training.worker  # noqa: F401


def _child(req: Mapping[str, Any], closing: Sequence[int]) -> None:
    """In the forked child: become the worker `req` describes. Never returns."""
    code = 1
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        # its name in `ps -o comm`, `top` and psutil's `name()` (its command line is the
        # starter's): "trainer-<rank>"
        libc.prctl(_PR_SET_NAME, str(req.get("name", "trainer")).encode()[:15])
        if os.getppid() == 1:  # the starter died between the fork and the prctl
            os._exit(1)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for fd in closing:
            with contextlib.suppress(OSError):
                os.close(fd)
        os.setsid()
        log = os.open(str(req["log"]), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in req["env"].items()})
        argv = [str(a) for a in req["argv"]]
        sys.argv = [MODULE, *argv]
        from ehp_fsm.training import worker

        code = worker.main(argv)  # it ends the process itself (`os._exit`)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 2
    except BaseException:
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _reap(out: int) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        os.write(out, _pack({"exit": pid, "code": os.waitstatus_to_exitcode(status)}))


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the coordinator's to handle
    _preload()
    inp, out = sys.stdin.fileno(), sys.stdout.fileno()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (the wake-up fd says it)
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=_MAX_FRAME, strict_map_key=True)
    while True:
        try:
            ready, _, _ = select.select([inp, wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in ready:
            os.read(wake_r, 4096)
            _reap(out)
        if inp not in ready:
            continue
        data = os.read(inp, 65536)
        if not data:
            break  # the pool closed us (or its process died): our children watch their own
        unpacker.feed(data)
        for req in unpacker:
            if not isinstance(req, dict) or not {"argv", "env", "log"} <= req.keys():
                os.write(out, _pack({"error": f"not a start request: {req!r:.200}"}))
                continue
            try:
                pid = os.fork()
            except OSError as exc:
                os.write(out, _pack({"error": f"fork failed: {exc}"}))
                continue
            if pid == 0:
                _child(req, closing=(wake_r, wake_w))
            os.write(out, _pack({"pid": pid}))
    _reap(out)
    os._exit(0)


# -- the pool's end -----------------------------------------------------------------------------


class Starter:
    """A pool's starter process and what it reports (see the module docstring). Thread-safe."""

    def __init__(self, env: Mapping[str, str], log: Path, *, answer_s: float) -> None:
        """`env`: the starter's environment, and so every child's in `/proc/PID/environ`;
        `log`: where the starter's own output goes (a failed import, say); `answer_s`: how long
        a start waits for the starter's answer (its first includes its imports)."""
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
        self._lock = threading.Lock()  # one request at a time: replies come in order
        self._changed = threading.Condition()
        self._replies: list[dict[str, Any]] = []
        self._exits: dict[int, int] = {}
        self._ended = False
        self._reader = threading.Thread(target=self._read, name="prefork-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=_MAX_FRAME, strict_map_key=True)
        fd = self.process.stdout.fileno()
        try:
            while data := os.read(fd, 65536):
                unpacker.feed(data)
                with self._changed:
                    for msg in unpacker:
                        if isinstance(msg, dict) and "exit" in msg:
                            self._exits[int(msg["exit"])] = int(msg["code"])
                        elif isinstance(msg, dict):
                            self._replies.append(msg)
                    self._changed.notify_all()
        except (OSError, ValueError, msgpack.UnpackException):
            pass
        finally:
            with self._changed:
                self._ended = True
                self._changed.notify_all()

    def alive(self) -> bool:
        return not self._ended and self.process.poll() is None

    def start(
        self, argv: Sequence[str], env: Mapping[str, str], log: Path, *, name: str
    ) -> StartedWorker:
        """Fork a worker with options `argv` (`worker_argv` past `-m ehp_fsm.training.worker`)
        and environment `env`, its output appended to `log`, named `name` (`ps -o comm`)."""
        with self._lock:
            if not self.alive():
                raise StarterError(
                    "the pool's worker starter is gone",
                    f"its process {self.process.pid} ended (its log: {self.log})",
                    "start a new pool",
                )
            assert self.process.stdin is not None
            try:
                self.process.stdin.write(
                    _pack({"argv": list(argv), "env": dict(env), "log": str(log), "name": name})
                )
                self.process.stdin.flush()
            except (BrokenPipeError, ValueError) as exc:
                raise StarterError(
                    "the pool's worker starter is gone",
                    f"writing to it failed: {exc}",
                    "start a new pool",
                ) from None
            with self._changed:
                self._changed.wait_for(lambda: self._replies or self._ended, self.answer_s)
                if not self._replies:
                    raise StarterError(
                        "the pool's worker starter did not answer",
                        f"it ended or gave no pid within {self.answer_s:g} s (its log: {self.log})",
                        "start a new pool; on a loaded machine raise the time the run waits "
                        "for its trainers ([deadlines.run] trainers_start)",
                    )
                reply = self._replies.pop(0)
        if "pid" not in reply:
            raise StarterError(
                "the pool's worker starter could not start a worker",
                str(reply.get("error")),
                "see the starter's log: " + str(self.log),
            )
        return StartedWorker(self, int(reply["pid"]))

    def exit_code(self, pid: int, timeout: float | None = 0.0) -> int | None:
        """Child `pid`'s exit code once the starter reaped it, waiting up to `timeout` (None:
        for ever); None if it is not known by then, or the starter is gone (then ask the
        process itself: `StartedWorker`)."""
        with self._changed:
            if timeout != 0.0:
                self._changed.wait_for(lambda: pid in self._exits or self._ended, timeout)
            return self._exits.get(pid)

    @property
    def ended(self) -> bool:
        """The starter's output ended: it exited (or was killed); it reports no more exits."""
        return self._ended

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
    """A worker the starter forked, with what the pool uses of a `subprocess.Popen`: `pid`,
    `returncode`, `poll`, `wait`, `send_signal`, `terminate`, `kill`.

    Signals go through a pidfd opened as the starter answered: once the child is reaped, a
    signal fails instead of reaching whatever process took its pid next. A child outlives no
    starter (`PR_SET_PDEATHSIG`): when the starter is gone, the pidfd says when the child is,
    and its code is -SIGKILL, the death its starter's end gave it, unless the starter reported
    an exit before."""

    def __init__(self, starter: Starter, pid: int) -> None:
        self._starter = starter
        self.pid = pid
        self.returncode: int | None = None
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # already reaped: its exit is (or will be) reported
            self._pidfd = None

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
        code = self._starter.exit_code(self.pid)
        if code is None:
            if not self._exited(timeout):
                return None
            code = self._starter.exit_code(self.pid, REPORT_WAIT_S)
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
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None and self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


if __name__ == "__main__":
    main()
