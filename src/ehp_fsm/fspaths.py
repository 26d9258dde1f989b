"""File system paths as a plan writes them: what a string must be before the OS is asked.

Knows: the limits every path string of a plan meets (no NUL byte, not blank, names and the
whole path within what Linux takes), so that `ehp-fsm check` refuses such a key by name instead
of the OS failing in `check` or, later, in `run`; how a small file is written whole or not at
all (`write_whole`). Does not know: whether the path exists (the plan loader and `run.inputs`
ask that).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Final

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
    then refused as unreadable JSON, and a `run.json.tmp` beside it."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
