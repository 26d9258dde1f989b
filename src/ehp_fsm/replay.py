"""Replay a transition log: re-run every root event through the engine and compare.

`replay(path)` rebuilds the world from the header's config, feeds each root record's event to the
pure step function, and checks that the computed records (the root and everything it cascaded)
equal the logged ones field by field. It returns the verified count and the final world, or
raises `ReplayDivergence` at the first line that differs (a tampered, truncated or foreign log)
and `LogFormatError` for a line that is not a record. `until_seq` stops after the event that
contains that seq, to inspect the world at that point.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ehp_fsm.core.effects import EFFECTS
from ehp_fsm.core.engine import Accepted, Outcome, step
from ehp_fsm.core.guards import GUARDS
from ehp_fsm.core.world import World, new_event
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
)


@dataclass(frozen=True)
class ReplayResult:
    transitions: int
    events: int
    world: World
    last_seq: int
    header: dict[str, Any]


_decode = json.JSONDecoder().raw_decode


def _lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with path.open(encoding="utf-8") as fh:
        for n, raw in enumerate(fh, start=1):
            # A line as the log writes it, `{...}\n`, decodes in one call; anything else (blank,
            # spaced, not JSON, not an object) takes the general path and its errors.
            if raw[:1] == "{":
                try:
                    obj, end = _decode(raw)
                except json.JSONDecodeError:
                    pass
                else:
                    if end == len(raw) - 1 and raw[end] == "\n":
                        yield n, obj
                        continue
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise LogFormatError(
                    n, f"it is not JSON ({exc.msg})", "restore the line from the original log"
                ) from None
            if not isinstance(rec, dict):
                raise LogFormatError(n, "it is not a JSON object")
            yield n, rec


_RECORD_KEY_SET = frozenset(RECORD_KEYS)


def _groups(
    lines: Iterator[tuple[int, dict[str, Any]]],
) -> Iterator[list[tuple[int, dict[str, Any]]]]:
    group: list[tuple[int, dict[str, Any]]] = []
    for n, rec in lines:
        if not rec.keys() >= _RECORD_KEY_SET:
            missing = [k for k in RECORD_KEYS if k not in rec]
            raise LogFormatError(n, f"keys {missing} are missing")
        if rec["cause"] is None and group:
            yield group
            group = []
        if rec["cause"] is not None and rec["cause"] not in {r["seq"] for _, r in group}:
            raise ReplayDivergence(n, "cause", rec["cause"], "the seq of a record of this event")
        group.append((n, rec))
    if group:
        yield group


def replay(path: str | Path, *, until_seq: int | None = None) -> ReplayResult:
    p = Path(path)
    lines = _lines(p)
    first = next(lines, None)
    if first is None or first[1].get("event") != HEADER_EVENT:
        raise LogFormatError(
            1,
            f"the first line is not a {HEADER_EVENT!r} header",
            "replay a file written by ehp-fsm",
        )
    header = first[1]
    if header.get("schema_version") != SCHEMA_VERSION:
        raise LogFormatError(
            1,
            f"schema version {header.get('schema_version')!r} is not {SCHEMA_VERSION}",
            "replay it with the ehp-fsm that wrote it",
        )
    world = World(load_specs(), header.get("config") or {})
    transitions = events = 0
    seq = 0
    for group in _groups(lines):
        n0, root = group[0]
        if root["seq"] != seq + 1:
            raise ReplayDivergence(n0, "seq", root["seq"], seq + 1)
        if root["machine"] not in world.specs:
            raise ReplayDivergence(n0, "machine", root["machine"], sorted(world.specs))
        event = new_event(
            root["machine"],
            root["instance"],
            root["event"],
            root["time"],
            root.get("payload") or {},
            root["correlation"],
        )
        outcome = step(world, event, GUARDS, EFFECTS)
        if not _agrees(group, outcome):
            _compare(group, outcome)  # raises at the first field that differs
        if isinstance(outcome, Accepted):
            world.apply(outcome.changes, outcome.globals)
        transitions += len(group)
        events += 1
        seq = group[-1][1]["seq"]
        if until_seq is not None and seq >= until_seq:
            break
    return ReplayResult(transitions, events, world, seq, header)


def _agrees(group: list[tuple[int, dict[str, Any]]], outcome: Outcome) -> bool:
    """Whether the logged records equal the computed ones: the comparisons of `_compare`, on
    the records' fields directly (no record dicts, no `plain` of JSON values, which are plain
    already). False sends the event through `_compare`, which names the first difference."""
    records = outcome.records
    if len(group) != len(records):
        return False
    first = group[0][1]["seq"]
    ev = outcome.event
    time, correlation = ev.time, ev.correlation
    for i, (_, logged) in enumerate(group):
        r = records[i]
        cause = None if r.cause is None else first + r.cause
        if (
            logged["seq"] != first + i
            or logged["machine"] != r.machine
            or logged["instance"] != r.instance
            or logged["source"] != r.source
            or logged["event"] != r.event
            or logged["dest"] != r.dest
            or logged["accepted"] != r.accepted
            or logged["reason"] != r.reason
            or logged["effects"] != (plain_effects(r.commands) if r.commands else [])
            or logged["cause"] != cause
            or logged["time"] != time
            or logged["correlation"] != correlation
        ):
            return False
        if logged["cause"] is not None and logged.get("payload") != plain(r.payload):
            return False
    return True


def _compare(group: list[tuple[int, dict[str, Any]]], outcome: Outcome) -> None:
    """Compare the logged records with the computed ones field by field; raise
    `ReplayDivergence` at the first line and key that differ."""
    computed = outcome_records(outcome, group[0][1]["seq"])
    for (n, logged), mine in zip(group, computed, strict=False):
        if logged["seq"] != mine["seq"]:
            raise ReplayDivergence(n, "seq", logged["seq"], mine["seq"])
        keys = _COMPARED if logged["cause"] is None else (*_COMPARED, "payload")
        for key in keys:
            if plain(logged.get(key)) != mine[key]:
                raise ReplayDivergence(n, key, logged[key], mine[key])
    if len(group) != len(computed):
        n = group[min(len(group), len(computed)) - 1][0]
        raise ReplayDivergence(n, "records in this event", len(group), len(computed))
