"""`replay` against a forger who rebuilds the (unkeyed) hash chain after any edit: one value
anywhere in a record or checkpoint line replaced by a JSON value of any type, or its key
deleted. Whatever the edit, replay either verifies the log or names the line with the
library's own errors (`LogFormatError`, `ReplayDivergence`) — never another exception out of a
guard, an effect or the index over a world it restored — and the parallel replay (`jobs=3`,
stretches restored from checkpoints in worker processes, as `ehp-fsm replay` runs a log of
8 MiB or more) gives the same verdict at the same line as the sequential one. Before, a
checkpoint holding a value of the wrong type crashed `--jobs` with a worker's TypeError."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ehp_fsm.errors import LogFormatError, ReplayDivergence
from ehp_fsm.replay import replay
from tests.core.logedit import rechain
from tests.golden.scenarios import borrow_and_return

STATES = ["free", "owned", "releasing", "serving", "starting", "active", "bogus", "<new>"]
#: Keys of the globals and of instance data that guards and effects read as numbers or lists
_READ = frozenset({"deadline", "gpus", "groups", "installed", "loaded_version", "revision", "tp"})
IDS = ["h0:g0", "h1:g0", "h9:g9", "e0", "x0", "r1", "core", "engine:e0", "hybrid:x0"]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 10**20)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=4)
    | st.sampled_from(STATES + IDS),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=6,
)


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    log = tmp_path_factory.mktemp("forgeries") / "log.jsonl"
    borrow_and_return(log, checkpoint_every=2)
    return log.read_text().splitlines(keepends=True)


def _paths(value: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside `value` (keys and list indexes), `chain` left out."""
    out = [at] if at else []
    if isinstance(value, dict):
        for k, v in value.items():
            if not at and k == "chain":
                continue
            out += _paths(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*at, i))
    return out


def _verdict(path: Path, jobs: int) -> tuple[str, int]:
    try:
        result = replay(path, jobs=jobs, forget_finished=True)
    except (LogFormatError, ReplayDivergence) as exc:
        return type(exc).__name__, exc.line
    return "verified", result.transitions


def _edit(obj: dict[str, Any], path: tuple[Any, ...], delete: bool, value: Any) -> bool:
    """Apply the edit at `path` in `obj`; False where `obj` has no such parent."""
    parent: Any = obj
    try:
        for step in path[:-1]:
            parent = parent[step]
        if isinstance(parent, dict) and delete:
            del parent[path[-1]]
        else:
            parent[path[-1]] = value
    except (KeyError, IndexError, TypeError):
        return False
    return True


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_forged_log_verifies_or_is_named_the_same_way_in_one_process_or_three(
    checkpointed: list[str], tmp_path: Path, data: st.DataObject
) -> None:
    """One line edited, or every checkpoint edited alike (a forger who keeps the checkpoints
    agreeing with each other, so that only stepping the world they hold can tell)."""
    lines = list(checkpointed)
    checkpoints = [k for k, x in enumerate(lines) if x.startswith('{"checkpoint":')]
    everywhere = data.draw(st.booleans(), label="every checkpoint")
    k = (
        data.draw(st.sampled_from(checkpoints[len(checkpoints) // 2 :]), label="checkpoint")
        if everywhere
        else data.draw(st.integers(1, len(lines) - 1), label="line index")
    )
    paths = _paths(json.loads(lines[k]))
    read = [x for x in paths if x[0] == "globals" or x[-1] in _READ]  # what guards read
    path = data.draw(st.sampled_from(read or paths) | st.sampled_from(paths), label="path")
    delete = data.draw(st.booleans(), label="delete")
    value = data.draw(json_values, label="value")
    for n in checkpoints if everywhere else [k]:
        obj = json.loads(lines[n])
        if _edit(obj, path, delete, value):
            lines[n] = json.dumps(obj) + "\n"
    log = tmp_path / f"forged-{k}.jsonl"
    log.write_text("".join(rechain(lines)))
    one = _verdict(log, 1)
    assert _verdict(log, 3) == one
