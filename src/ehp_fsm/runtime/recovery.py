"""Controller recovery from its write-ahead log, and the controller's epoch.

Knows: that the transition log is the controller's write-ahead log (every accepted or refused
event was written, and flushed, before its commands were sent), how a crash can damage its tail
— a torn last line (no newline, or not JSON) or an incomplete last event (its root record written
but not all of its cascaded records) — and how to cut exactly that tail off before replaying. It
also keeps the controller's epoch beside the log (`<log>.epoch`), so a restarted controller always
uses a larger epoch than the one agents saw (they drop frames from an older epoch).

Does not know: sockets or agents (the controller reconciles with them after it rebuilt its
world), nor how to repair anything but the tail: a divergence before the last event is a
tampered or foreign log and raises, as `replay` does.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ehp_fsm.errors import EhpError, LogFormatError, ReplayDivergence
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

    def describe(self) -> str:
        head = (
            f"recovered {self.path}: {self.events} events ({self.transitions} transitions) "
            f"replayed, last seq {self.last_seq}"
        )
        if not self.truncated_bytes:
            return head + "; the log was intact"
        return f"{head}; cut {self.truncated_bytes} bytes off the tail: " + "; ".join(self.notes)


def _last_group_start(lines: list[bytes]) -> int | None:
    """Index (0-based) of the line where the last event (its root record) starts."""
    for i in range(len(lines) - 1, 0, -1):
        try:
            rec = json.loads(lines[i])
        except (ValueError, RecursionError):  # not JSON, not UTF-8 text (json.loads of bytes
            continue  # decodes them), or nested past what a JSON reader recurses into
        if isinstance(rec, dict) and rec.get("cause", 0) is None:
            return i
    return None


def recover_log(path: str | Path) -> tuple[ReplayResult, RecoveryReport]:
    """Replay `path`, first cutting off a torn last line or an incomplete last event.

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
    data = p.read_bytes()
    try:
        return _recover(p, data)
    except BaseException:
        _put_back(p, data)
        raise


def _put_back(path: Path, data: bytes) -> None:
    """Restore the tail `_recover` cut from `path`, whose whole content was `data`."""
    size = path.stat().st_size
    if size < len(data):
        with path.open("r+b") as fh:
            fh.seek(size)
            fh.write(data[size:])
            fh.flush()
            os.fsync(fh.fileno())


def _recover(p: Path, data: bytes) -> tuple[ReplayResult, RecoveryReport]:
    original = len(data)
    notes: list[str] = []
    dropped = 0
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        notes.append(f"a torn last line ({len(data) - cut} bytes without a newline)")
        data = data[:cut]
        dropped += 1
    lines = data.splitlines(keepends=True)
    if len(lines) > 1:
        try:
            json.loads(lines[-1])
        except (ValueError, RecursionError):  # a UnicodeDecodeError too: bytes torn inside a
            # character; RecursionError: nested past what a JSON reader recurses into
            notes.append("a last line that is not JSON")
            data = data[: len(data) - len(lines[-1])]
            lines = lines[:-1]
            dropped += 1
    if not lines:
        raise RecoveryError(f"cannot recover from {p}", "the log is empty (no header)", "")
    if len(data) != original:
        _truncate(p, len(data))
    try:
        result = replay(p)
    except (ReplayDivergence, LogFormatError) as exc:
        start = _last_group_start(lines)
        line = getattr(exc, "line", 0)
        if start is None or line < start + 1:
            raise RecoveryError(
                f"cannot recover from {p}",
                f"it diverges before its last event ({exc})",
                "the log was edited or written by other specs; restore it or start fresh",
            ) from exc
        cut_lines = len(lines) - start
        notes.append(
            f"an incomplete last event ({cut_lines} record(s) from line {start + 1}: {exc.what})"
        )
        dropped += cut_lines
        _truncate(p, sum(len(x) for x in lines[:start]))
        result = replay(p)
    truncated = original - p.stat().st_size
    return result, RecoveryReport(
        path=p,
        last_seq=result.last_seq,
        events=result.events,
        transitions=result.transitions,
        truncated_bytes=truncated,
        dropped_records=dropped,
        notes=tuple(notes),
    )


def _truncate(path: Path, size: int) -> None:
    with path.open("r+b") as fh:
        fh.truncate(size)
        fh.flush()
        os.fsync(fh.fileno())
