"""Watching a user's module while this process imports it (`watched_import`): the two things
a `try` around the import does not catch.

* `os._exit` at the module's top level (script code outside `if __name__ == "__main__":`)
  ended `ehp-fsm check` with exit 0 and no output — a plan "checked" that never was; called by
  the reward, it ended `ehp-fsm run` with exit 0 and no summary. In a thread that refuses it
  (`exit_refused`: the importing one, the reward's) it raises `ExitCalled` instead, which the
  caller refuses or counts as the reward's failure. Elsewhere it exits as ever: in another
  thread, and in a process forked meanwhile (multiprocessing's children end by it).
* An import that does not end (a loop, a blocked read at the top level) hung `check` and `run`
  without a word. It is said, `SAY_AFTER_S` into the import and every `SAY_EVERY_S` after;
  never ended: a module that loads a large reward model as it is imported takes minutes, and
  Ctrl-C (or `ehp-fsm stop`) ends the wait.

The module is imported once, here: its side effects at import (a server started, a file
read) happen as they would anywhere. A signal it sends itself (`os.kill(os.getpid(), ...)`)
is not caught.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from typing import Final, NoReturn

import structlog

_log = structlog.get_logger("ehp_fsm.import_watch")

#: When a slow import is first said, and how often after.
SAY_AFTER_S: Final = 10.0
SAY_EVERY_S: Final = 30.0


class ExitCalled(BaseException):  # (not Exception: a module's `except Exception` lets it by)
    """`os._exit(code)` was called by user code in a thread that refuses it (`exit_refused`)."""

    def __init__(self, code: object) -> None:
        self.code = code
        super().__init__(code)


_refusing = threading.local()  # .pid: this thread refuses os._exit in that process
_real_exit = os._exit
_patch_lock = threading.Lock()


def _guarded_exit(status: int) -> NoReturn:
    if getattr(_refusing, "pid", None) == os.getpid():
        raise ExitCalled(status)
    _real_exit(status)  # another thread, or a process forked meanwhile (its child's end)


@contextlib.contextmanager
def exit_refused() -> Iterator[None]:
    """During the block, `os._exit` called in this thread raises `ExitCalled` (see the module
    docstring); elsewhere it exits as ever. `os._exit` stays our function once set (its check
    is a thread-local lookup): a reward thread refuses it for as long as it runs."""
    with _patch_lock:
        if os._exit is not _guarded_exit:
            os._exit = _guarded_exit
    before = getattr(_refusing, "pid", None)
    _refusing.pid = os.getpid()
    try:
        yield
    finally:
        _refusing.pid = before


@contextlib.contextmanager
def watched_import(
    module: str, *, say_after_s: float = SAY_AFTER_S, say_every_s: float = SAY_EVERY_S
) -> Iterator[None]:
    """Import `module` in the block (see the module docstring)."""
    done = threading.Event()
    started = time.monotonic()

    def say_while_importing() -> None:
        wait = say_after_s
        while not done.wait(wait):
            _log.warning(
                "reward_import_slow",
                module=module,
                after_s=round(time.monotonic() - started),
                note="still importing the reward module: its top level is running (a loop "
                "or a wait there never ends; Ctrl-C stops)",
            )
            wait = say_every_s

    watcher = threading.Thread(target=say_while_importing, name="ehp-import-watch", daemon=True)
    watcher.start()
    try:
        with exit_refused():
            yield
    finally:
        done.set()
