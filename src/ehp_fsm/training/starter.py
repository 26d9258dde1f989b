"""The process a CPU trainer pool forks its workers from (`python -m
ehp_fsm.training.starter`; see `training.prefork`, the pool's end, for why and how).

Single-threaded, it imports what every worker imports, then serves its pool's requests on its
stdin and reports on its stdout (msgpack maps, never pickle): a pid for each request, in order,
and the exit code of each child it reaps.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack

from ehp_fsm.training.prefork import MAX_FRAME, pack

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def _preload() -> None:
    """What every worker imports before it does anything (the cost forking saves)."""
    import torch  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    import ehp_fsm.training.worker  # noqa: F401


def _child(req: Mapping[str, Any], *, starter: int, closing: Sequence[int]) -> None:
    """In the forked child of process `starter`: become the worker `req` describes. Never
    returns."""
    code = 1
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        # its name in `ps -o comm`, `top` and psutil's `name()` (its command line is the
        # starter's): "trainer-<rank>"
        libc.prctl(_PR_SET_NAME, str(req.get("name", "trainer")).encode()[:15])
        if os.getppid() != starter:  # the starter died between the fork and the prctl
            os._exit(1)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for fd in closing:
            with contextlib.suppress(OSError):
                os.close(fd)
        os.setsid()
        log = os.open(str(req["log"]), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in req["env"].items()})
        argv = [str(a) for a in req["argv"]]
        sys.argv = ["ehp_fsm.training.worker", *argv]
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
        os.write(out, pack({"exit": pid, "code": os.waitstatus_to_exitcode(status)}))


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the coordinator's to handle
    _preload()
    inp, out = sys.stdin.fileno(), sys.stdout.fileno()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (the wake-up fd says it)
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=MAX_FRAME, strict_map_key=True)
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
            break  # the pool closed us, or its process died: our children die with us
        unpacker.feed(data)
        for req in unpacker:
            if not isinstance(req, dict) or not {"argv", "env", "log"} <= req.keys():
                os.write(out, pack({"error": f"not a start request: {req!r:.200}"}))
                continue
            me = os.getpid()
            try:
                pid = os.fork()
            except OSError as exc:
                os.write(out, pack({"error": f"fork failed: {exc}"}))
                continue
            if pid == 0:
                _child(req, starter=me, closing=(wake_r, wake_w))
            os.write(out, pack({"pid": pid}))
    _reap(out)
    os._exit(0)


if __name__ == "__main__":
    main()
