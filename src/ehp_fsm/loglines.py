"""A transition log's lines, read within a bound on each line's length.

Knows: the line limit (`LINE_LIMIT`, the `EHP_LOG_LINE_LIMIT` environment variable, or a
caller's), how to check that every line of a stretch of a log is within it while holding at most
a chunk of the file (`check_line_lengths`: a line over the limit is refused after reading no
more than the limit of it), how to read a first line (the header) within it, and how to walk a
log's lines from its end (`lines_backward`: recovery cuts a crash's tail). Does not know what a
line holds (`translog` writes the lines, `replay` reads them).

Why a limit: replay reads a log someone else wrote, and a line is read, copied and decoded
whole — a crafted line of 300 MB took ~1.2 GB of memory before it was refused. The longest
line ehp-fsm writes is a checkpoint: the live world, growing with the cluster. Measured with
`ehp-fsm simulate examples/gpu-4x8.toml --steps 2` (2026-12-05): with checkpoint lines turned
on, the simulation's (it forgets consumed groups) are 4.65 MB at 1,024 hosts and 9.37 MB at
2,048 (linear: ~38 MB at 8,192); a world that kept every instance rendered to 7.73 MB after 2
steps at 1,024 hosts (7,548 bytes a host: ~62 MB at 8,192). The header (~200 bytes a host) and
a step's `partition` record (~460) are smaller. `LINE_LIMIT`, 256 MiB, is 4.3 times the
8,192-host checkpoint. Since schema 4 (`translog`) a checkpoint no longer grows with the run's
steps: the writer's world forgets a step's consumed groups, its done step and retired revisions
(`finished.WRITER_FORGETS`), and the checkpoint lists them as runs of ids (`[["g", 0, 16383]]`:
a few bytes however many). Measured with `tests/core/test_replay_forget.training` (8 groups a
step, 2026-12-05): the checkpoint after 10, 20, 40, 80 steps is 977, 980, 981, 981 bytes (it
was 13.8, 27.5, 54.9, 109.9 kB: +1.37 kB a step; +2.64 MB a step at 1,024 hosts, which passed
the limit after ~100 steps, after ~12 at 8,192). What still grows is small: the finished
engines and Hybrids a borrow and return leave (kept whole: the run's shell reads them), a few
per move. A log written before schema 4 still grows so, and is replayed (and resumed) with the
limit raised (`EHP_LOG_LINE_LIMIT`), as the refusal says.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from typing import BinaryIO

from ehp_fsm.errors import EhpError, LogLineTooLong, printable

LINE_LIMIT_ENV = "EHP_LOG_LINE_LIMIT"
#: The longest line (bytes, its newline included) replay and recovery read: see the docstring.
LINE_LIMIT = 256 << 20
#: What one read takes (`check_line_lengths`, `lines_backward`, `line_number`).
CHUNK = 1 << 20
#: (ASCII digits: `\d` took "５" and "१२३" for numbers)
_SIZE = re.compile(r"\s*([0-9]+)\s*(|k|kib|m|mib|g|gib)\s*", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20}
_UNITS |= {"g": 1 << 30, "gib": 1 << 30}


def line_limit(value: int | None = None) -> int:
    """The line limit: `value`, else the `EHP_LOG_LINE_LIMIT` environment variable (bytes, or
    with a unit: 512MiB, 2GiB), else `LINE_LIMIT`. A limit past the largest size a read
    takes (`sys.maxsize`) is that size: no line is longer (10**30 raised a bare
    OverflowError from the first read)."""
    if value is not None:
        if type(value) is not int or value < 1:
            raise ValueError(f"line_limit={value!r} must be a number of bytes >= 1")
        return min(value, sys.maxsize)
    text = os.environ.get(LINE_LIMIT_ENV)
    if not text:
        return LINE_LIMIT
    m = _SIZE.fullmatch(text)
    size = 0
    if m:  # (`int` of more than 4,300 digits raised a bare ValueError: past 19, no limit)
        digits = m[1].lstrip("0")
        size = sys.maxsize if len(digits) > 19 else int(digits or 0) * _UNITS[m[2].lower()]
    if size < 1:
        raise EhpError(
            f"{LINE_LIMIT_ENV}={printable(text)[:40]!r} is not a line limit",
            "it is the longest line of a transition log replay reads, in bytes",
            f"give {LINE_LIMIT_ENV} a number of bytes >= 1, with or without a unit "
            f"(e.g. {LINE_LIMIT_ENV}=512MiB), or unset it for the default ({LINE_LIMIT >> 20} MiB)",
        )
    return min(size, sys.maxsize)


def too_long(fh: BinaryIO, start: int, limit: int) -> LogLineTooLong:
    """The error of the line at byte `start` of `fh`, whose first `limit` bytes hold no
    newline (counting its line number costs a pass over the bytes before it)."""
    n = line_number(fh, start)
    return LogLineTooLong(
        n,
        limit,
        limit,
        f"{limit:,} bytes of it were read from its start without reaching its end (a newline), "
        "and reading stopped there. The longest lines ehp-fsm writes are checkpoints (the live "
        "world: ~62 MB at 8,192 hosts; a log written before schema 4, more with each step): "
        "this line was not written by ehp-fsm, or by a run far larger or longer than that"
        + (
            ""
            if limit >= LINE_LIMIT
            else f"; or the limit, lowered below its default ({LINE_LIMIT >> 20} MiB) by "
            f"{LINE_LIMIT_ENV} or line_limit=, is shorter than lines ehp-fsm writes (a "
            "header: ~200 bytes a host)"
        ),
        _raise_limit(fh, start, limit),
    )


def _raise_limit(fh: BinaryIO, start: int, limit: int) -> str:
    """The fix of a line at byte `start` of `fh` over `limit`. Under a lowered limit it said
    to double it (`EHP_LOG_LINE_LIMIT=100`: use 200; at 200: 400, ...) for a header of ~1 kB:
    the line's length is measured then (up to the default: a chunk held at a time), and the
    fix is to unset the variable, or to give it at least that length."""
    then = "ehp-fsm replay LOG (the same variable for ehp-fsm run --resume)"
    needed = _line_length(fh, start, LINE_LIMIT) if limit < LINE_LIMIT else None
    if needed is None:  # not lowered, or the line is longer than the default too
        return (
            "do not replay a log you cannot vouch for; if it is a run's own log, raise the "
            f"limit: {LINE_LIMIT_ENV}={_units(2 * max(limit, LINE_LIMIT))} {then}"
        )
    at_least = _units(-(-needed // 1024) * 1024)
    default = f"the default, {LINE_LIMIT >> 20} MiB, reads this line of {needed:,} bytes"
    if os.environ.get(LINE_LIMIT_ENV) and line_limit() == limit:  # the variable lowered it
        return (
            f"unset {LINE_LIMIT_ENV} ({default}), or set it to at least the line's length: "
            f"{LINE_LIMIT_ENV}={at_least} {then}"
        )
    return f"leave line_limit= out ({default}), or give it at least {needed}"


def _line_length(fh: BinaryIO, start: int, most: int) -> int | None:
    """The length of the line at byte `start` of `fh` (its newline included; the last line
    may lack it), when it is at most `most` bytes; None otherwise. Read 64 KiB at a time: a
    refusal holds little more than the limit (`tests/core/test_line_limit.py`)."""
    fd, at = fh.fileno(), start
    while at - start < most:
        chunk = os.pread(fd, min(CHUNK >> 4, start + most - at), at)
        if not chunk:
            return at - start if at > start else None
        if (k := chunk.find(b"\n")) != -1:
            return at + k + 1 - start
        at += len(chunk)
    return None


def _units(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


def check_line_lengths(fh: BinaryIO, start: int, end: int, limit: int) -> None:
    """Raise `LogLineTooLong` unless every line of `fh` in bytes [start, end) (`start`: a line
    start) is at most `limit` bytes long, its newline included (the last one may lack it).

    Each step reads back from `limit` bytes past the first unchecked line start for the last
    newline before there: every line from that start to that newline is within the limit, and
    the next step starts after it. With lines far shorter than the limit that is one chunk read
    per `limit` bytes of the log; a line over the limit is refused after its first `limit` bytes
    were read, a chunk at a time (what is held: one chunk)."""
    fd = fh.fileno()
    p = start
    while end - p > limit:  # what is left may hold a line over the limit
        hi = p + limit
        newline = -1
        while hi > p:
            lo = max(p, hi - CHUNK)
            k = os.pread(fd, hi - lo, lo).rfind(b"\n")
            if k != -1:
                newline = lo + k
                break
            hi = lo
        if newline == -1:
            raise too_long(fh, p, limit)
        p = newline + 1


def first_line(fh: BinaryIO, limit: int) -> bytes:
    """The line at `fh`'s position (its header, at the start), read within `limit`: one over
    it is refused before it is read (a 300 MB first line took 564 MB when read to the limit)."""
    at = fh.tell()
    check_line_lengths(fh, at, min(os.fstat(fh.fileno()).st_size, at + limit + 1), limit)
    raw = fh.readline(limit)
    if len(raw) == limit and not raw.endswith(b"\n") and fh.read(1):
        raise too_long(fh, at, limit)
    return raw


def line_number(fh: BinaryIO, offset: int) -> int:
    """The number of the line that starts at byte `offset` (a chunk held at a time)."""
    fd, count, at = fh.fileno(), 1, 0
    while at < offset:
        chunk = os.pread(fd, min(offset - at, CHUNK), at)
        if not chunk:
            break
        count += chunk.count(b"\n")
        at += len(chunk)
    return count


def lines_backward(fh: BinaryIO, end: int) -> Iterator[tuple[int, bytes]]:
    """(byte offset, bytes with its newline) of each line of `fh` before byte `end` (a line end,
    or the end of the file), the last line first. What is held: one line and one chunk (check
    the lines' lengths first where they may be long: `check_line_lengths`)."""
    fd = fh.fileno()
    line_end, pos = end, end
    pieces: list[bytes] = []  # the line being read, its last piece first
    while pos > 0:
        lo = max(0, pos - CHUNK)
        chunk = os.pread(fd, pos - lo, lo)
        hi = len(chunk)  # chunk[:hi] is not yet in a line
        while True:
            # the newline before the line that ends at `line_end` (not the line's own)
            stop = min(hi, line_end - 1 - lo)
            k = chunk.rfind(b"\n", 0, stop) if stop > 0 else -1
            if k == -1:
                break
            pieces.append(chunk[k + 1 : hi])
            yield lo + k + 1, b"".join(reversed(pieces))
            pieces.clear()
            line_end, hi = lo + k + 1, k + 1
        pieces.append(chunk[:hi])
        pos = lo
    if line_end > 0:  # the first line
        yield 0, b"".join(reversed(pieces))
