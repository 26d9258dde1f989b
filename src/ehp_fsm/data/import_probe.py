"""Import a user's module in a child process first, to see whether importing it ends the
process or never returns — two things no `try` in the importing process survives.

A reward module whose top level calls `os._exit(0)` ended `ehp-fsm check` with exit 0 and no
output (a plan "checked" that never was); one that loops at import hung `check` and `run`
without a word. The child imports the module under the parent's `sys.path` and `sys.argv` and
ends with an exit code of its own: imported, or raised (then the parent's own import raises the
same and says why, as before). Any other end — another exit code, a signal, no end within the
time allowed — is what the parent is told, before it imports the module itself.

What it does not do: sandbox the module. Its side effects at import happen twice (in the child,
then in the parent); a module that behaves differently the second time is not caught.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from typing import Final

import structlog

_log = structlog.get_logger("ehp_fsm.import_probe")

#: The child's exit codes for "imported" and "raised" (the parent's own import says what).
IMPORTED: Final = 79
RAISED: Final = 80
#: An import that has not ended after this long is a hang (a heavy module — torch,
#: transformers, sympy — imports in seconds).
TIMEOUT_S: Final = 120.0
#: How long before a slow import is said, so that `check` does not look frozen.
SLOW_S: Final = 10.0

_CHILD: Final = f"""
import importlib, json, os, sys
given = json.loads(sys.stdin.readline())
sys.path[:] = given["path"]
sys.argv[:] = given["argv"]
try:
    importlib.import_module(given["module"])
except BaseException:
    os._exit({RAISED})
os._exit({IMPORTED})
"""


def probe(
    module: str, *, timeout_s: float = TIMEOUT_S, slow_s: float = SLOW_S
) -> tuple[str, str] | None:
    """Import `module` in a child process: None when it imported or raised (the caller's own
    import tells which), else (why, fix) — it ended the process, or did not end in
    `timeout_s`. Skipped (None) where no interpreter can be started (an embedded one)."""
    if not sys.executable:
        return None
    given = json.dumps({"module": module, "path": sys.path, "argv": sys.argv}) + "\n"
    # stderr to a file, not a pipe: a process the module starts (a server it keeps) holds a
    # pipe open after the child ended, and a pipe not drained fills; a file does neither
    with tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as stdin:
        stdin.write(given.encode())
        stdin.seek(0)
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD],
            stdin=stdin,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,  # ended with whatever it started, below
        )
        try:
            code = _wait(child, module, timeout_s=timeout_s, slow_s=slow_s)
        finally:
            _kill_group(child)  # the child, at a hang; what its import started, always
        err.seek(max(0, os.fstat(err.fileno()).st_size - 4096))
        tail = err.read().decode(errors="replace").strip()
    if code is None:
        return (
            f"importing it did not end in {timeout_s:.0f} s (it was ended): its top level "
            "waits or loops",
            "make importing the module only define the reward: put script code under "
            '`if __name__ == "__main__":` and start any work on the first call',
        )
    if code in (IMPORTED, RAISED):
        return None
    if code < 0:
        how = f"it was killed by {_signal_name(-code)}"
    else:
        how = (
            f"the process exited with code {code} (os._exit or the like, which no caller survives)"
        )
    said_tail = f"; it wrote: {tail.splitlines()[-1][:300]!r}" if tail else ""
    return (
        f"importing it ended the process: {how}{said_tail}",
        'put the module\'s script code under `if __name__ == "__main__":`, so that importing '
        "it only defines the reward",
    )


def _wait(
    child: subprocess.Popen[bytes], module: str, *, timeout_s: float, slow_s: float
) -> int | None:
    """The child's exit code; None when it did not end in `timeout_s` (said at `slow_s`)."""
    try:
        return child.wait(timeout=min(slow_s, timeout_s))
    except subprocess.TimeoutExpired:
        pass
    _log.warning(
        "reward_import_slow",
        module=module,
        after_s=slow_s,
        note=f"still importing the reward module; given up after {timeout_s:.0f} s",
    )
    try:
        return child.wait(timeout=max(0.0, timeout_s - slow_s))
    except subprocess.TimeoutExpired:
        return None


def _kill_group(child: subprocess.Popen[bytes]) -> None:
    """End the child's session (its own, `start_new_session`): the child where it still runs,
    and every process its import started."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
