"""Replay a transition log: re-run every root event through the engine and compare.

`replay(path)` rebuilds the world from the header's config, feeds each root record's event to the
pure step function, and checks that the computed records (the root and everything it cascaded)
equal the logged ones field by field. Lines are decoded with msgspec straight into a typed
`LoggedRecord` (keys and types checked in C), so reading costs little beside the re-step. It
returns the verified count and the final world, or raises `ReplayDivergence` at the first line
that differs (a tampered, truncated or foreign log) and `LogFormatError` for a line that is not
a record. `until_seq` stops after the event that contains that seq, to inspect the world there.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

from ehp_fsm.core.effects import EFFECTS
from ehp_fsm.core.engine import Outcome, Record, step
from ehp_fsm.core.guards import GUARDS
from ehp_fsm.core.world import Event, World, new_event
from ehp_fsm.errors import LogFormatError, ReplayDivergence
from ehp_fsm.specfiles import load_specs
from ehp_fsm.translog import (
    HEADER_EVENT,
    RECORD_KEYS,
    SCHEMA_VERSION,
    outcome_records,
    plain,
    plain_effects,
)

_COMPARED = (
    "seq",
    "machine",
    "instance",
    "source",
    "event",
    "dest",
    "accepted",
    "reason",
    "effects",
    "cause",
    "time",
    "correlation",
    "payload",
)


@dataclass(frozen=True)
class ReplayResult:
    transitions: int
    events: int
    world: World
    last_seq: int
    header: dict[str, Any]


class LoggedRecord(msgspec.Struct, frozen=True, gc=False):
    """One record line as the log stores it (the keys of `translog.RECORD_KEYS`, plus the
    event's `payload`). Decoding into this type checks every key and type in one C call per line."""

    seq: int
    time: float
    machine: str
    instance: str
    source: str
    dest: str
    accepted: bool
    reason: str
    effects: list[dict[str, Any]]
    correlation: str
    cause: int | None
    event: str
    payload: dict[str, Any] = {}


_decode_record = msgspec.json.Decoder(LoggedRecord).decode
_decode_any = msgspec.json.Decoder().decode


def _format_error(n: int, raw: bytes, exc: msgspec.DecodeError) -> LogFormatError:
    """Why line `n` is not a record, in the log's own terms (JSON, object, keys, types)."""
    try:
        obj = _decode_any(raw)
    except msgspec.DecodeError as bad:
        return LogFormatError(
            n, f"it is not JSON ({bad})", "restore the line from the original log"
        )
    if not isinstance(obj, dict):
        return LogFormatError(n, "it is not a JSON object")
    missing = [k for k in RECORD_KEYS if k not in obj]
    if missing:
        return LogFormatError(n, f"keys {missing} are missing")
    return LogFormatError(n, f"a value has the wrong type ({exc})")


def _header(fh: BinaryIO) -> dict[str, Any]:
    raw = fh.readline()
    try:
        header = _decode_any(raw) if raw.strip() else None
    except msgspec.DecodeError:
        header = None
    if not isinstance(header, dict) or header.get("event") != HEADER_EVENT:
        raise LogFormatError(
            1,
            f"the first line is not a {HEADER_EVENT!r} header",
            "replay a file written by ehp-fsm",
        )
    if header.get("schema_version") != SCHEMA_VERSION:
        raise LogFormatError(
            1,
            f"schema version {header.get('schema_version')!r} is not {SCHEMA_VERSION}",
            "replay it with the ehp-fsm that wrote it",
        )
    return header


def _records(fh: BinaryIO) -> Iterator[tuple[int, LoggedRecord]]:
    """(line number, record) for every line after the header; blank lines are skipped."""
    decode = _decode_record
    for n, raw in enumerate(fh, start=2):
        try:
            yield n, decode(raw)
        except msgspec.DecodeError as exc:  # not JSON, or not a record (a ValidationError)
            if raw.strip():
                raise _format_error(n, raw, exc) from None


def replay(path: str | Path, *, until_seq: int | None = None) -> ReplayResult:
    """Re-run the log at `path` through the engine; see the module docstring.

    Each root record's event is stepped as soon as it is read; the outcome says how many records
    the event made, and exactly that many lines (the root and its cascades) must follow, each
    equal to its computed record. A missing, extra or reordered line is a divergence at its line.
    """
    with Path(path).open("rb") as fh:
        header = _header(fh)
        world = World(load_specs(), header.get("config") or {})
        specs = world.specs
        lines = _records(fh)
        seq = transitions = events = 0
        for n, root in lines:
            if root.seq != seq + 1:
                raise ReplayDivergence(n, "seq", root.seq, seq + 1)
            if root.cause is not None:
                raise ReplayDivergence(n, "cause", root.cause, "null (a root record)")
            if root.machine not in specs:
                raise ReplayDivergence(n, "machine", root.machine, sorted(specs))
            event = new_event(
                root.machine, root.instance, root.event, root.time, root.payload, root.correlation
            )
            outcome = step(world, event, GUARDS, EFFECTS)
            computed = outcome.records
            first = root.seq
            if _expected(computed[0], first, first, event, root.payload) != root:
                _diverged(n, root, outcome, 0)
            for i in range(1, len(computed)):
                line = next(lines, None)
                if line is None:
                    raise ReplayDivergence(n, "records in this event", i, len(computed))
                n, logged = line
                r = computed[i]
                if _expected(r, first + i, first, event, plain(r.payload)) != logged:
                    _diverged(n, logged, outcome, i)
            if outcome.accepted:
                world.apply(outcome.changes, outcome.globals)  # type: ignore[union-attr]
            seq = first + len(computed) - 1
            transitions += len(computed)
            events += 1
            if until_seq is not None and seq >= until_seq:
                break
    return ReplayResult(transitions, events, world, seq, header)


def _expected(
    r: Record, seq: int, first: int, event: Event, payload: dict[str, Any]
) -> LoggedRecord:
    """The line the log must hold at `seq` for computed record `r` of the event whose root is
    seq `first` (`payload`: the root's own, as read; a cascade's, as JSON gives it back)."""
    return LoggedRecord(
        seq,
        event.time,
        r.machine,
        r.instance,
        r.source,
        r.dest,
        r.accepted,
        r.reason,
        plain_effects(r.commands) if r.commands else [],
        event.correlation,
        None if r.cause is None else first + r.cause,
        r.event,
        payload,
    )


def _diverged(n: int, logged: LoggedRecord, outcome: Outcome, i: int) -> None:
    """Raise `ReplayDivergence` at line `n` naming the first field where the logged record
    differs from computed record `i` of `outcome`."""
    first = logged.seq - i
    mine = outcome_records(outcome, first)[i]
    for key in _COMPARED:
        value = getattr(logged, key)
        if plain(value) != mine[key]:
            raise ReplayDivergence(n, key, value, mine[key])
    raise ReplayDivergence(n, "record", msgspec.to_builtins(logged), mine)
