"""The shapes the controller reads inside an agent's frames, checked before it acts on them.

The transport (`protocol`) checks every frame's envelope, that its payload is plain msgpack
data, and the payload's top-level keys per kind; it does not know what a hello's inventory, an
event's data or a `report` reply holds. This module does: `problem(...)` names the first field
that is missing, of the wrong type or unknown, so a faulty or hostile agent's message is dropped
with that reason and the controller's own handling never meets a wrong shape.

Knows: the agent's inventory, its events (`healthy`, `launched`, `launch_failed`, `exited`,
`gpu_free`) and the `report` result. Does not know: what the controller does with them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from ehp_fsm.runtime.protocol import PROCESS_ENTRY_SCHEMA, check_fields

_Schema = Mapping[str, tuple[frozenset[type] | None, bool]]
_STR: Final = frozenset({str})
_OPT_STR: Final[frozenset[type]] = frozenset({str, type(None)})
_INT: Final = frozenset({int})
_OPT_INT: Final[frozenset[type]] = frozenset({int, type(None)})
_NUMBER: Final = frozenset({int, float})
_BOOL: Final = frozenset({bool})
_DICT: Final = frozenset({dict})
_LIST: Final = frozenset({list})

INVENTORY: Final[_Schema] = {
    "gpus": (_LIST, True),
    "device": (_STR, False),
    "hostname": (_STR, False),
    "agent_pid": (_INT, False),
    "address": (_OPT_STR, False),
}

#: A process identity as the engine world records it (`agent_processes.world_identity`).
IDENTITY: Final[_Schema] = {
    "host": (_STR, True),
    "pid": (_INT, True),
    "start_time": (_NUMBER, True),
    "token": (_STR, True),
    "url": (_STR, False),
}

_PROCESS: Final[_Schema] = {
    "machine": (_STR, True),
    "instance": (_STR, True),
    "identity": (_DICT, True),
}

EVENTS: Final[Mapping[str, _Schema]] = {
    "healthy": _PROCESS,
    "launched": _PROCESS,
    "launch_failed": {
        "machine": (_STR, True),
        "instance": (_STR, True),
        "token": (_STR, True),
        "reason": (_STR, True),
    },
    "exited": {**_PROCESS, "returncode": (_OPT_INT, True), "stopped": (_BOOL, True)},
    "gpu_free": {
        "gpu": (_STR, True),
        "owner": (_STR, True),
        "processes_exited": (_BOOL, True),
        "memory_free": (_BOOL, True),
    },
}

REPORT: Final[_Schema] = {"processes": (_LIST, True)}


def inventory_problem(inventory: Mapping[str, Any]) -> str | None:
    """What is wrong with a hello's inventory, or None."""
    problem = check_fields(inventory, INVENTORY, "inventory.")
    if problem is not None:
        return problem
    for i, gpu in enumerate(inventory["gpus"]):
        if type(gpu) is not str:
            return f"wrong_type: inventory.gpus[{i}] is {type(gpu).__name__}"
    return None


def event_problem(name: str, data: Mapping[str, Any]) -> str | None:
    """What is wrong with an agent event, or None."""
    schema = EVENTS.get(name)
    if schema is None:
        return f"unknown_event: {name[:64]!r} (known: {sorted(EVENTS)})"
    problem = check_fields(data, schema, f"{name}.")
    if problem is None and "identity" in schema:
        problem = check_fields(data["identity"], IDENTITY, f"{name}.identity.")
    return problem


def report_problem(result: Any) -> str | None:
    """What is wrong with the result of a `report` command, or None."""
    if type(result) is not dict:
        return f"wrong_type: report result is {type(result).__name__}"
    problem = check_fields(result, REPORT, "report.")
    if problem is not None:
        return problem
    for i, entry in enumerate(result["processes"]):
        if type(entry) is not dict:
            return f"wrong_type: report.processes[{i}] is {type(entry).__name__}"
        problem = check_fields(entry, PROCESS_ENTRY_SCHEMA, f"report.processes[{i}].")
        if problem is not None:
            return problem
    return processes_problem(result["processes"], "report")


def processes_problem(entries: list[dict[str, Any]], where: str) -> str | None:
    """What is wrong with the labels of a process list (a RECONCILE's or a report's; its
    entries' own fields are checked already), or None: a `labels.url` becomes the identity's
    `url` (`IDENTITY`), so it is text."""
    for i, entry in enumerate(entries):
        labels = entry.get("labels") or {}
        url = labels.get("url") if type(labels) is dict else None
        if url is not None and type(url) is not str:
            return f"wrong_type: {where}.processes[{i}].labels.url is {type(url).__name__}"
    return None
