"""File system paths as a plan writes them: what a string must be before the OS is asked.

Knows: the limits every path string of a plan meets (no NUL byte, not blank, names and the
whole path within what Linux takes), so that `ehp-fsm check` refuses such a key by name instead
of the OS failing in `check` or, later, in `run`; how a small file is written whole or not at
all (`write_whole`); how a file the run writes in place is opened without following a
symbolic link planted there (`open_own`). Does not know: whether the path exists (the plan
loader and `run.inputs` ask that).
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Final

from ehp_fsm.errors import EhpError

#: Linux's NAME_MAX (one file or folder name) and PATH_MAX less room for the plan's folder,
#: in bytes.
MAX_NAME_BYTES: Final = 255
MAX_PATH_BYTES: Final = 3072


def path_problem(path: str) -> str | None:
    """Why `path` cannot name a file (None: it can): the OS refuses a NUL byte and names or
    paths longer than its limits, and a blank path would silently mean the plan's folder."""
    if "\x00" in path:
        return f"{path[:80]!r} holds a NUL byte, which no file system path may hold"
    if not path.strip():
        return "it is empty"
    if path.startswith("~"):  # a shell's home; taken as is, a folder named `~` (then made)
        return (
            f"{path[:80]!r} starts with '~', which is not expanded here: it would name a folder "
            f"called {path.split('/')[0]!r} (and a run would make it); write the whole path, "
            f"e.g. {os.path.expanduser(path)[:120]!r}"
        )
    size = len(path.encode("utf-8", "surrogatepass"))
    longest = max(len(part.encode("utf-8", "surrogatepass")) for part in path.split("/"))
    if size > MAX_PATH_BYTES or longest > MAX_NAME_BYTES:
        return (
            f"{path[:80]!r}… ({size} bytes) is too long for a file system path: a name is at "
            f"most {MAX_NAME_BYTES} bytes, a path at most {MAX_PATH_BYTES}"
        )
    return None


def write_whole(path: Path, text: str) -> None:
    """Write `text` to `path` whole or not at all: into `path.tmp`, then renamed over `path`.
    On an `OSError` (a full disk, a file-size limit) the partial `.tmp` is removed and the
    error raised, `path` left as it was: a full disk left an empty `receipt.json` that replay
    then refused as unreadable JSON, and a `run.json.tmp` beside it.

    A `path.tmp` already there is removed and the new one made exclusively (mode "x":
    `O_EXCL`, which never follows a link): a symbolic link planted there (a run directory
    others can write) was written through, overwriting its target, and then renamed over
    `path`."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()  # a link itself, not its target; a leftover of a killed writer
        with tmp.open("x", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def open_own(path: str | os.PathLike[str], flags: int, mode: int = 0o666) -> int:
    """`os.open(path, flags)` for a file the run writes in place (its lock, `controller.log`,
    the transition log), refusing a symbolic link there (`O_NOFOLLOW`, an `EhpError` naming the
    link and its target): one planted in a run directory others can write, or left by a
    careless `ln -s`, was followed, and the run emptied or appended to the link's target — any
    file of the user's. Other `OSError`s are raised as they are."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno != errno.ELOOP or not os.path.islink(path):
            raise
        raise EhpError(
            f"{path} is a symbolic link (to {os.readlink(path)})",
            "the run writes this file itself, and through the link it would empty or append to "
            "the link's target",
            f"remove the link ({path}); the run makes the file",
        ) from None
