"""Controller recovery from its write-ahead log, and the controller's epoch.

Knows: that the transition log is the controller's write-ahead log (every accepted or refused
event was written, and flushed, before its commands were sent), how a crash can damage its tail
— a torn last line (no newline, or not JSON) or an incomplete last event (its root record written
but not all of its cascaded records) — and how to cut exactly that tail off before replaying. It
also keeps the controller's epoch beside the log (`<log>.epoch`), so a restarted controller always
uses a larger epoch than the one agents saw (they drop frames from an older epoch).

Does not know: sockets or agents (the controller reconciles with them after it rebuilt its
world), nor how to repair anything but the tail: a divergence before the last event is a
tampered or foreign log and raises, as `replay` does; so is a whole last line that differs
from what the engine computes (an edited last event or checkpoint: a crash cuts lines short,
it does not change them).

Memory: only the tail is read (from the end, a line at a time: `loglines.lines_backward`), after
every line was checked against the line limit (`loglines`) as `replay` checks it; before, the
whole log was read into memory (twice: its bytes and its lines), and a crafted line of any
length with it.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ehp_fsm.errors import EhpError, LogFormatError, ReplayDivergence
from ehp_fsm.loglines import check_line_lengths, line_number, lines_backward
from ehp_fsm.loglines import line_limit as _line_limit
from ehp_fsm.replay import ReplayResult, replay
from ehp_fsm.runtime.reliability import epoch_path, next_epoch

__all__ = ["RecoveryError", "RecoveryReport", "epoch_path", "next_epoch", "recover_log"]


class RecoveryError(EhpError):
    """The log cannot be recovered: missing, empty, or damaged before its last event."""


@dataclass(frozen=True, kw_only=True)
class RecoveryReport:
    """What `recover_log` found and did."""

    path: Path
    last_seq: int
    events: int
    transitions: int
    truncated_bytes: int
    dropped_records: int
    notes: tuple[str, ...]
    #: the bytes cut off the tail, kept beside the log (`<log>.cut-<offset>`); None when
    #: nothing was cut or they could not be written (a note says why)
    kept: Path | None = None

    def describe(self) -> str:
        head = (
            f"recovered {self.path}: {self.events} events ({self.transitions} transitions) "
            f"replayed, last seq {self.last_seq}"
        )
        if not self.truncated_bytes:
            return head + ("; " + "; ".join(self.notes) if self.notes else "; the log was intact")
        kept = f"; the cut bytes are kept in {self.kept}" if self.kept is not None else ""
        return (
            f"{head}; cut {self.truncated_bytes} bytes off the tail: "
            + "; ".join(self.notes)
            + kept
        )


def _last_group_start(fh: BinaryIO, end: int) -> tuple[int, int] | None:
    """(byte offset, lines from there to byte `end`) of the line where the last event (its
    root record) starts; the header is not one."""
    for count, (offset, raw) in enumerate(lines_backward(fh, end), start=1):
        if offset == 0:
            return None
        try:
            rec = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON, not UTF-8 text (json.loads of bytes
            continue  # decodes them), or nested past what a JSON reader recurses into
        if isinstance(rec, dict) and rec.get("cause", 0) is None:
            return offset, count
    return None


def _whole_record(raw: bytes) -> bool:
    """Whether `raw` (a line without its newline) is a whole JSON object, as the writer ends
    every line: its last key, `chain`, closes it."""
    if not raw.endswith(b'"}'):
        return False
    try:
        return isinstance(json.loads(raw), dict)
    except (ValueError, RecursionError):
        return False


def recover_log(
    path: str | Path,
    *,
    key: str | bytes | None = None,
    line_limit: int | None = None,
    forget_finished: bool | Collection[str] = False,
    checkpoint: Callable[[], None] | None = None,
) -> tuple[ReplayResult, RecoveryReport]:
    """Replay `path`, first cutting off a torn last line or an incomplete last event. `key`:
    a keyed log's chain key (default: the `EHP_LOG_KEY` environment variable, as `replay`);
    `line_limit`: the longest line read (default: `EHP_LOG_LINE_LIMIT`, else 256 MiB: see
    `loglines`) — a log with a longer line, anywhere, is refused (`LogLineTooLong`) as it is,
    before anything is cut. `forget_finished`: as `replay`'s (the world forgets finished
    instances as it is rebuilt, so the memory of a long log's recovery follows its live world).
    `checkpoint`: as `replay`'s (what it raises ends the recovery, the log left as it was).

    The file is truncated in place (what was cut is described in the report's notes), so the
    recovered controller appends to a log that replays clean. A log that cannot be recovered
    is left exactly as it was: a cut tail is written back before the error is raised (it was
    the evidence of what went wrong, and a repair by hand may need it).
    """
    p = Path(path)
    if not p.is_file():
        raise RecoveryError(
            f"cannot recover from {p}",
            "the transition log does not exist",
            "start a fresh controller (Controller.start), or point at the crashed run's log",
        )
    limit = _line_limit(line_limit)
    with p.open("rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        check_line_lengths(fh, 0, size, limit)
        cut = _Cut(p, fh, size)
        try:
            return _recover(p, fh, cut, key, limit, forget_finished, checkpoint)
        except BaseException:
            cut.put_back()
            raise


class _Cut:
    """The log's tail cut off so far (bytes [start, end) of the file as it was): `to` cuts
    the log shorter and keeps what it cut, `put_back` writes it back (a log that cannot be
    recovered is left as it was)."""

    def __init__(self, path: Path, fh: BinaryIO, size: int) -> None:
        self.path, self.fh, self.start, self.end, self.data = path, fh, size, size, b""

    def to(self, size: int) -> None:
        """Cut the log to its first `size` bytes."""
        if size < self.start:
            self.data = os.pread(self.fh.fileno(), self.start - size, size) + self.data
            self.start = size
        _truncate(self.path, size)

    def put_back(self) -> None:
        """Write what was cut back after the log's end (its bytes as they were)."""
        size = self.path.stat().st_size
        if self.start <= size < self.end:
            with self.path.open("r+b") as fh:
                fh.seek(size)
                fh.write(self.data[size - self.start :])
                fh.flush()
                os.fsync(fh.fileno())


def _recover(
    p: Path,
    fh: BinaryIO,
    cut: _Cut,
    key: str | bytes | None,
    limit: int,
    forget: bool | Collection[str],
    checkpoint: Callable[[], None] | None,
) -> tuple[ReplayResult, RecoveryReport]:
    original = end = cut.end
    notes: list[str] = []
    dropped = 0
    lines = lines_backward(fh, end)  # the last line first (each within the limit: checked)
    last = next(lines, None)
    # A last line without its newline is torn (the writer writes each event's lines, newlines
    # and all, at once) — unless it is a whole record: cut just before its newline, or the
    # newline lost to an editor; `replay` verifies such a line, and its newline is put back
    # below (cutting it dropped an event that `replay` took as logged). A last line that ends
    # with its newline is whole as written: one that is not JSON is no crash's doing and is
    # refused below as an edited last event (it was cut as "not JSON", with the event it
    # replaced) — unless it holds NUL bytes, as a page a crash left unwritten does.
    unended = last is not None and not last[1].endswith(b"\n") and _whole_record(last[1])
    if last is not None and not last[1].endswith(b"\n") and not unended:
        end = last[0]
        notes.append(f"a torn last line ({original - end} bytes without a newline)")
        dropped += 1
    elif last is not None and last[0] > 0 and b"\x00" in last[1]:
        # NUL bytes: a page of the file the crash left unwritten (the log is flushed, not
        # fsynced, so after a power loss a page before the end can read as zeros while the
        # page after it, ending in a newline, reached the disk) — crash damage, cut as before
        end = last[0]
        notes.append(
            f"a last line holding NUL bytes ({original - end} bytes: a page a crash left unwritten)"
        )
        dropped += 1
    if end == 0:
        raise RecoveryError(f"cannot recover from {p}", "the log is empty (no header)", "")
    if end != original:
        cut.to(end)
    try:
        result = replay(p, key=key, line_limit=limit, forget_finished=forget, checkpoint=checkpoint)
    except (ReplayDivergence, LogFormatError) as exc:
        group = _last_group_start(fh, end)
        start = line_number(fh, group[0]) if group is not None else 0
        line = getattr(exc, "line", 0)
        found = f"{exc.what}: {exc.why}" if exc.why else exc.what
        if group is None or line < start:
            raise RecoveryError(  # the replay's own fix: a key to give, line ends to convert
                f"cannot recover from {p}",
                f"it diverges before its last event ({found})",
                exc.fix or "the log was edited or written by other specs; restore it",
            ) from exc
        if getattr(exc, "ends_inside", None) is None:
            # A crash leaves a torn last line or an event's records cut short (`ends_inside`),
            # never a whole line that differs: an edited last event or checkpoint was cut as
            # if it were incomplete, and the log recovered without a word.
            raise RecoveryError(
                f"cannot recover from {p}",
                f"its last event does not verify ({found}); a crash leaves a torn last line "
                "or an event's records cut short, not a whole line that differs: the log was "
                "edited after it was written",
                "restore the log from the original; do not trust this one (`ehp-fsm replay "
                "LOG` names the line)",
            ) from exc
        offset, cut_lines = group
        notes.append(
            f"an incomplete last event ({cut_lines} record(s) from line {start}: {exc.what})"
        )
        dropped += cut_lines
        cut.to(offset)
        result = replay(p, key=key, line_limit=limit, forget_finished=forget, checkpoint=checkpoint)
    if unended and p.stat().st_size == original:  # the whole last line kept: its newline
        with p.open("ab") as out:
            out.write(b"\n")
            out.flush()
            os.fsync(out.fileno())
        notes.append("a last line without its newline (the newline put back)")
    truncated = max(0, original - p.stat().st_size)
    kept = _keep_cut(p, cut, notes) if truncated else None
    return result, RecoveryReport(
        path=p,
        last_seq=result.last_seq,
        events=result.events,
        transitions=result.transitions,
        truncated_bytes=truncated,
        dropped_records=dropped,
        notes=tuple(notes),
        kept=kept,
    )


def _keep_cut(p: Path, cut: _Cut, notes: list[str]) -> Path | None:
    """Write the bytes `cut` took off the log's tail to `<log>.cut-<offset>` beside it (mode
    0600, as the log), and say so in `notes`: they were cut and kept nowhere, while `replay`'s
    advice said a resume "sets a torn tail aside" (an operator's find). A write that fails (the
    full disk that tore the line) is said in `notes`, and the recovery stands."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    for n in range(1, 1000):  # a second tear at the same offset (a crash loop) keeps its own
        kept = p.with_name(f"{p.name}.cut-{cut.start}" + (f".{n}" if n > 1 else ""))
        try:
            fd = os.open(kept, flags, 0o600)
        except FileExistsError:
            continue
        except OSError as exc:
            notes.append(f"the cut bytes could not be kept ({exc.strerror or exc}: {kept})")
            return None
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(cut.data)
                out.flush()
                os.fsync(out.fileno())
        except OSError as exc:
            with contextlib.suppress(OSError):
                kept.unlink()
            notes.append(f"the cut bytes could not be kept ({exc.strerror or exc}: {kept})")
            return None
        return kept
    notes.append(f"the cut bytes could not be kept (999 earlier cuts at byte {cut.start})")
    return None


def _truncate(path: Path, size: int) -> None:
    with path.open("r+b") as fh:
        fh.truncate(size)
        fh.flush()
        os.fsync(fh.fileno())
