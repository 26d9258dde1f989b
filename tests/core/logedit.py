"""Editing transition logs in tests, as a forger would: lines re-rendered compact and the hash
chain rebuilt (`rechain`), or a log turned back into an earlier schema without a chain."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from ehp_fsm.translog import CHAIN_MARK, VERSION_KEY, chain_hasher, log_key


def render(obj: dict[str, Any]) -> str:
    """A JSON object as the writer renders it (compact), without a `chain` key."""
    return msgspec.json.encode({k: v for k, v in obj.items() if k != "chain"}).decode()


def rechain(lines: list[str], key: str | None = None) -> list[str]:
    """Each line parsed, re-rendered compact and linked into a fresh chain (with `key`, keyed):
    what a forger who can rebuild the chain writes after an edit."""
    link = chain_hasher(log_key(key) if key is not None else None)
    head = b""
    out = []
    for x in lines:
        body = render(json.loads(x))[:-1].encode()
        head = link(head + body)
        out.append(f"{body.decode()}{CHAIN_MARK.decode()}{head.decode()}" + '"}\n')
    return out


def unchained(line: str) -> str:
    """The line without its `chain` key."""
    return render(json.loads(line)) + "\n"


def as_schema_2(lines: list[str]) -> list[str]:
    """The log as schema 2 wrote it: no chain, no chain kind or config fingerprint (and no
    ehp-fsm version: the header records it since schema 3), checkpoints without `finished`
    (schema 4; the log's writer must have forgotten nothing)."""
    head = json.loads(lines[0])
    head["schema_version"] = 2
    head.pop(VERSION_KEY, None)
    for k in ("chain_kind", "config_fingerprint"):
        head.pop(k)
    return [render(head) + "\n", *(_unfinished(unchained(x)) for x in lines[1:])]


def _unfinished(line: str) -> str:
    """A checkpoint line without its `finished` key, which must list nothing."""
    obj = json.loads(line)
    if "finished" not in obj:
        return line
    assert not any(obj.pop("finished").values()), "its writer forgot instances"
    return render(obj) + "\n"


def rechain_raw(lines: list[str], key: str | None = None) -> list[str]:
    """`rechain` without parsing: each line's bytes before its `chain` key kept as they are
    (a line no JSON reader can parse, nested too deep, is linked too)."""
    link = chain_hasher(log_key(key) if key is not None else None)
    mark = CHAIN_MARK.decode()
    head = b""
    out = []
    for x in lines:
        body = x.rstrip("\n")
        body = body[: body.rindex(mark)] if mark in body else body[:-1]
        head = link(head + body.encode())
        out.append(f"{body}{mark}{head.decode()}" + '"}\n')
    return out


def without_version(lines: list[str]) -> list[str]:
    """The log as ehp-fsm wrote it before its header recorded the version that wrote it (no
    `ehp_fsm_version`), its chain rebuilt and every record's bytes kept."""
    head = json.loads(lines[0])
    head.pop(VERSION_KEY, None)
    return rechain_raw([render(head) + "\n", *lines[1:]])


def with_version(lines: list[str], value: str) -> list[str]:
    """The log with its header's `ehp_fsm_version` set to `value`, its chain rebuilt (the
    lines unchanged where it is that already)."""
    head = json.loads(lines[0])
    if head.get(VERSION_KEY) == value:
        return lines
    head[VERSION_KEY] = value
    return rechain_raw([render(head) + "\n", *lines[1:]])
