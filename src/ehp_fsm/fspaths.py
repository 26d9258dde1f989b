"""File system paths as a plan writes them: what a string must be before the OS is asked.

Knows: the limits every path string of a plan meets (no NUL byte, not blank, names and the
whole path within what Linux takes), so that `ehp-fsm check` refuses such a key by name instead
of the OS failing in `check` or, later, in `run`; how a small file is written whole or not at
all (`write_whole`); how a file the run writes in place is opened without following a
symbolic link planted there (`open_own`); how a file that holds a secret (a launch token) is
made readable by its owner alone (`PRIVATE`); what a path that is not a regular file is
(`kind_of`), and how a small file the run wrote is read back without waiting on a FIFO or
reading gigabytes planted in its place (`read_own_json`; `open_regular` and `read_regular` for
any file that must be a regular one: a reward's source files); how a process's log on a full
disk is written without the write killing the process (`LogStream`). Does not know: whether the path
exists (the plan loader and `run.inputs` ask that).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final

from ehp_fsm.errors import EhpError

#: Linux's NAME_MAX (one file or folder name) and PATH_MAX less room for the plan's folder,
#: in bytes.
MAX_NAME_BYTES: Final = 255
MAX_PATH_BYTES: Final = 3072
#: The mode of a file that holds a secret — a process's launch token (`run.json`, an agent's
#: `processes.json`, the transition log, the logs that name launches): made with it, never
#: widened then narrowed. `ehp-fsm stop` signals a process only when it carries its recorded
#: token; a token others could read, they could copy into a forged run folder of their own.
PRIVATE: Final = 0o600


#: Files that are not text, by their first bytes: what each is, and how to get the JSON lines
#: out of it (`FILE` stands for the file's name). A transition log or a prompts file kept as
#: `.gz`, a data set's `.parquet`, ... was refused as a bad header or as text that is not UTF-8.
_CONTAINERS: Final = (
    (b"\x1f\x8b", "gzip-compressed", "decompress it (gunzip -k FILE)"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed", "decompress it (zstd -d FILE)"),
    (b"\xfd7zXZ\x00", "xz-compressed", "decompress it (unxz -k FILE)"),
    (b"BZh", "bzip2-compressed", "decompress it (bunzip2 -k FILE)"),
    (b"PAR1", "Parquet", "write its rows as JSON lines (pandas: to_json(lines=True))"),
    (b"PK\x03\x04", "a zip archive", "extract the .jsonl from it"),
)


def container_of(head: bytes) -> tuple[str, str] | None:
    """(what the file is, how to get its JSON lines out) for a file starting with `head` that
    is compressed or a container (`_CONTAINERS`); None for anything else."""
    return next(((kind, how) for m, kind, how in _CONTAINERS if head.startswith(m)), None)


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


def write_whole(path: Path, text: str, *, private: bool = False) -> None:
    """Write `text` to `path` whole or not at all: into `path.tmp`, then renamed over `path`.
    On an `OSError` (a full disk, a file-size limit) the partial `.tmp` is removed and the
    error raised, `path` left as it was: a full disk left an empty `receipt.json` that replay
    then refused as unreadable JSON, and a `run.json.tmp` beside it.

    A `path.tmp` already there is removed and the new one made exclusively (mode "x":
    `O_EXCL`, which never follows a link): a symbolic link planted there (a run directory
    others can write) was written through, overwriting its target, and then renamed over
    `path`.

    `private`: the file is made mode `PRIVATE` (0600) — created so, which the rename keeps: it
    is never readable by others, not even while it is written."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()  # a link itself, not its target; a leftover of a killed writer
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        with os.fdopen(
            os.open(tmp, flags, PRIVATE if private else 0o666), "w", encoding="utf-8"
        ) as fh:
            fh.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if exc.filename is None:  # a write's error names no file ("File too large"): this one
            exc.filename = str(path)
        raise


def open_own(
    path: str | os.PathLike[str], flags: int, mode: int = 0o666, *, private: bool = False
) -> int:
    """`os.open(path, flags)` for a file the run writes in place (its lock, `controller.log`,
    the transition log), refusing a symbolic link there (`O_NOFOLLOW`, an `EhpError` naming the
    link and its target): one planted in a run directory others can write, or left by a
    careless `ln -s`, was followed, and the run emptied or appended to the link's target — any
    file of the user's. Other `OSError`s are raised as they are.

    `private`: the file will hold launch tokens. One it creates is made mode `PRIVATE` (0600)
    at once; one already there must be this user's (another user's file, planted in a folder
    others can write, would let its owner read every token the run writes: refused) and is
    narrowed to 0600 before anything is written (a file an older run left readable).
    `O_TRUNC` empties it only after that check."""
    trunc = private and bool(flags & os.O_TRUNC)
    try:
        fd = os.open(
            path,
            (flags & ~os.O_TRUNC if trunc else flags) | os.O_NOFOLLOW | os.O_CLOEXEC,
            PRIVATE if private else mode,
        )
    except OSError as exc:
        if exc.errno != errno.ELOOP or not os.path.islink(path):
            raise
        raise EhpError(
            f"{path} is a symbolic link (to {os.readlink(path)})",
            "the run writes this file itself, and through the link it would empty or append to "
            "the link's target",
            f"remove the link ({path}); the run makes the file",
        ) from None
    if private:
        try:
            _keep_private(fd, path)
            if trunc:
                os.ftruncate(fd, 0)
        except BaseException:
            os.close(fd)
            raise
    return fd


def _keep_private(fd: int, path: str | os.PathLike[str]) -> None:
    """Make open file `fd` (at `path`) readable by this user alone, or refuse another user's."""
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        raise EhpError(
            f"{path} belongs to another user (uid {st.st_uid})",
            "the run writes launch tokens into this file, and its owner could read them (and "
            "forge a run folder that `ehp-fsm stop` would believe)",
            f"remove {path} (the run makes its own), or run in a folder only you can write",
        )
    if st.st_mode & 0o077:
        os.fchmod(fd, PRIVATE)


def kind_of(mode: int) -> str:
    """What a path whose `st_mode` is `mode` is, as an error names it ("a FIFO", "a folder",
    ...): a FIFO where a file was expected waits for a writer (or a reader) for ever, and a
    device swallows what is written to it, so each reader and writer of the run's files refuses
    anything but "a file", naming what it found."""
    for test, name in (
        (stat.S_ISREG, "a file"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "a device"


def path_kind(path: str | os.PathLike[str]) -> str | None:
    """`kind_of` what is at `path`, followed through a link; None when nothing is there or the
    OS cannot say: `Path.is_file` raises OSError ("File name too long") for a name past the
    file system's limits (a failed `import <300 letters>` asked about), a traceback from
    `check` in place of a refusal."""
    try:
        return kind_of(os.stat(path).st_mode)
    except (OSError, ValueError):
        return None


def read_own_json(path: Path, limit: int) -> Any:
    """`json.loads` of the file at `path`, one the run wrote itself (its `run.json`, an agent's
    state, `resume/latest.json`), read only as the run writes it: a FIFO there (planted in a
    run directory others can write) hung `ehp-fsm stop` and `--resume` for ever, `[[[...`
    nested 200,000 deep raised a RecursionError traceback, and a file of gigabytes was read
    whole. Raises `OSError` (`FileNotFoundError` when missing; not a regular file) or
    `ValueError` (over `limit` bytes, not UTF-8, not JSON, or nested too deep)."""
    try:
        return json.loads(read_own_text(path, limit))
    except RecursionError:
        raise ValueError("it nests deeper than any JSON the run writes") from None


def read_own_text(path: Path, limit: int) -> str:
    """The text of the run's own file `path`, refused (`OSError`) when it is not a regular
    file (a FIFO's read waited for a writer for ever; the open does not: `O_NONBLOCK`) and
    (`ValueError`) past `limit` bytes or not UTF-8."""
    try:
        raw = read_regular(path, limit)
    except ValueError:
        raise ValueError(f"it is larger than {limit:,} bytes, more than the run writes") from None
    return raw.decode("utf-8")


def open_regular(path: str | os.PathLike[str]) -> io.BufferedReader:
    """`open(path, "rb")` for a regular file alone (followed through a link): anything else
    is refused with an `OSError` naming what it is, without waiting on a FIFO (the open is
    `O_NONBLOCK`; a FIFO's blocking open, or its read, waits for a writer for ever)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    fh = os.fdopen(fd, "rb")
    try:
        if (kind := kind_of(os.fstat(fd).st_mode)) != "a file":
            raise OSError(f"{path} is {kind}, not a file")
    except BaseException:
        fh.close()
        raise
    return fh


def read_regular(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of the regular file at `path` (`open_regular`: `OSError` for anything else),
    or `ValueError` when it holds more than `limit` bytes — told by its size before anything is
    read, so a file of gigabytes costs no more than a small one."""
    with open_regular(path) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > limit:
            raise ValueError(f"{path} is larger than {limit:,} bytes")
        # the file's size and one byte more, not `limit + 1` at once: `read(n)` takes n bytes
        # of memory before it reads, and a 900-byte `run.json` read within 64 MiB raised
        # MemoryError under a memory limit (`ulimit -v`), as a traceback at the run's end
        raw = fh.read(size + 1)
        if len(raw) > size:  # (one that grew since)
            raw += fh.read(limit + 1 - len(raw))
    if len(raw) > limit:
        raise ValueError(f"{path} is larger than {limit:,} bytes")
    return raw


class LogStream:
    """A process's stdout or stderr that is its log in the run directory (a trainer worker's
    `worker-<rank>.log`, an agent's `agents/<host>.log`), whose writes never raise. On a full
    disk the traceback of a Core rank's failed state save (itself a full disk) raised
    `OSError` from the handler that was reporting it, and the rank died (exit 1, an empty log)
    where the save was to fail alone and the run go on; an agent died at its next log line.
    A line that cannot be written is dropped (`dropped` counts them); once there is room,
    lines are written again. A process started without the stream (`sys.stdout` is None)
    drops every line, counted; `writelines` writes each line as `write` does."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.dropped = 0

    def write(self, text: str) -> int:
        if self._stream is None:  # (no stdout: `None.write` raised AttributeError)
            self.dropped += 1
            return len(text)
        try:
            written = self._stream.write(text)
        except (OSError, ValueError):  # ValueError: the stream was closed (interpreter exit)
            self.dropped += 1
            return len(text)
        return written if isinstance(written, int) else len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        # (the stream's own, through `__getattr__`, raised on a full disk: a line at a time)
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self._stream is None:
            return
        try:
            self._stream.flush()
        except (OSError, ValueError):
            self.dropped += 1

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding...: the stream's own
        # `_stream` from the instance's own dict: where it is not set (a copy, as `copy.copy`
        # makes it, asked for `__setstate__`), `self._stream` came back here without end
        stream = self.__dict__.get("_stream")
        if stream is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(stream, name)
