"""Every key of every example plan, walked: no value a TOML file can hold breaks the loader
or `ehp-fsm check`.

The starting points are the example plans (`examples/*.toml`), each completed with every key
they leave out that has a fixed place — a full `[simulate]` (every cost-model key, a
`response_lengths_file`) and every `[deadlines.*]` table with each of its states — so that the
walk reaches those keys too. For each document, each key path (tables' keys, arrays' entries)
is given, in turn, each edge value of `EDGE_VALUES` (NaN, ±inf, 0, -1, 2**63, 10**400, empty
strings, arrays and tables, a 5,000-character string, control characters, bidi overrides, TOML
dates and times, a table where a scalar goes and a scalar where a table goes, the names other
keys take), or is deleted, or gets an unknown key beside it, or has its array's first entry
duplicated (duplicate ids).

The properties:
- `test_every_key_takes_every_edge_value` (exhaustive, no randomness): `parse_plan` returns a
  `Plan` or raises `PlanError` whose key is set and whose message names it — never another
  exception.
- `test_check_runs_or_refuses_what_parses` (Hypothesis over the same walk and over generated
  values): for a mutated plan written as TOML, `ehp-fsm check`'s own function, in process
  (`cli._cmd_check`: the loader, its printout, `unsupported`, `prepare(create=False)`), returns
  0 or 2 or raises the project's `EhpError` naming the plan's key or its dataset file — never
  another exception (which `cli.main` would print as a bare OSError or a traceback).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import io
import math
import os
import threading
import tomllib
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ehp_fsm import cli
from ehp_fsm.errors import EhpError, PlanError, printable
from ehp_fsm.plan import _DEADLINE_STATES, _DEFAULT_DEADLINES, SIMULATE_DEFAULTS, parse_plan
from tests.property.test_plan_fuzz import example_doc as fuzz_example_doc
from tests.property.test_plan_fuzz import paths as key_paths
from tests.property.test_plan_fuzz import to_toml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = tuple(sorted(p.stem for p in (ROOT / "examples").glob("*.toml")))

#: The values every key is given in turn (as TOML allows: 10**400 is an integer tomllib reads;
#: a float that large is inf).
EDGE_VALUES: tuple[Any, ...] = (
    math.nan,
    math.inf,
    -math.inf,
    0,
    -1,
    1,
    2**63,
    -(2**63) - 1,
    10**400,
    0.0,
    -0.0,
    5e-324,
    0.5,
    1e308,
    True,
    False,
    "",
    " ",
    "x" * 5000,
    "\x00",
    "a\x1b[2Jb",
    "line\nbreak",
    "é日本\u202e",
    "../../x",
    "/",
    "nan",
    "h0:g0",
    "cuda",
    "sglang",
    "megatron",
    "bfloat16",
    "os:getcwd",
    "tcp://0.0.0.0:5",
    [],
    [1],
    [""],
    ["a", "a"],
    [[]],
    [{}],
    ["h0:g0", "h0:g0"],
    {},
    {"x": 1},
    {"id": "h0", "gpus": 1},
    datetime.date(2020, 1, 1),
    datetime.datetime(2020, 1, 1, 1, 2, 3),
    datetime.time(1, 2, 3),
)

DELETE = "<delete>"
UNKNOWN = "<unknown key beside it>"
DUPLICATE = "<first array entry duplicated>"
OPS: tuple[Any, ...] = (DELETE, UNKNOWN, DUPLICATE, *EDGE_VALUES)


def example_doc(name: str, model: Path, tmp: Path) -> dict[str, Any]:
    """The example `name`, its files pointed at the test's (model, data, log under `tmp`), and
    every fixed-place key it leaves out filled with its default."""
    doc = fuzz_example_doc(name, model, tmp)
    lengths = tmp / "lengths.txt"
    lengths.write_text("# tokens\n3\n1\n2\n", encoding="utf-8")
    simulate = doc.setdefault("simulate", {})
    for key, (default, _low, _high, _source) in SIMULATE_DEFAULTS.items():
        simulate.setdefault(key, 2 if default is None else default)
    simulate["response_max_tokens"] = 3
    simulate.setdefault("response_lengths_file", str(lengths))
    deadlines = doc.setdefault("deadlines", {})
    for machine, states in _DEADLINE_STATES.items():
        table = deadlines.setdefault(machine, {})
        for state in states:
            table.setdefault(state, _DEFAULT_DEADLINES[machine][state])
    deadlines.setdefault("run", {"agents_connect": 60.0, "rollout": 300.0, "generate": 60.0})
    return doc


def mutate(doc: dict[str, Any], path: tuple[Any, ...], op: Any) -> dict[str, Any] | None:
    """A copy of `doc` with `op` done at `path` (None: `op` does not apply there)."""
    out = dict(doc)  # the containers on the path are copied, the rest shared (parse_plan
    parent: Any = out  # only reads them)
    for part in path[:-1]:
        parent[part] = copy.copy(parent[part])
        parent = parent[part]
    key = path[-1]
    if op == DELETE:
        del parent[key]
    elif op == UNKNOWN:
        if isinstance(parent[key], dict):
            parent[key] = {**parent[key], "no_such_key": 1}
        elif isinstance(parent, dict):
            parent["no_such_key"] = 1
        else:
            return None
    elif op == DUPLICATE:
        if not (isinstance(parent[key], list) and parent[key]):
            return None
        parent[key] = [*parent[key], copy.deepcopy(parent[key][0])]
    else:
        parent[key] = copy.deepcopy(op)
    return out


def refusal(doc: dict[str, Any], file: str) -> PlanError | None:
    """What `parse_plan` refuses `doc` with (None: it parses); any other exception escapes."""
    try:
        parse_plan(doc, file=file)
    except PlanError as exc:
        return exc
    return None


def assert_parses_or_names_a_key(doc: dict[str, Any], file: str) -> None:
    exc = refusal(doc, file)
    if exc is not None:
        assert exc.key, exc
        assert f"plan key `{printable(exc.key)[:50]}" in str(exc), exc
        assert str(exc).startswith(f"{file}: "), exc


@pytest.fixture(scope="module")
def bases(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("keys")
    return {name: example_doc(name, tiny_model_dir, tmp) for name in EXAMPLES}


def test_the_walk_starts_from_valid_plans(bases: dict[str, Any]) -> None:
    """Each completed example loads: a mutation's refusal is the mutation's."""
    assert {"local", "short", "local-megatron", "gpu-4x8"} <= set(bases)
    for name, doc in bases.items():
        plan = parse_plan(doc, file=f"{name}.toml")
        assert plan.simulate is not None and plan.simulate.response_lengths == (3, 1, 2)


def test_every_key_takes_every_edge_value(bases: dict[str, Any]) -> None:
    """Exhaustive: every (example, key path, edge value or operation)."""
    failures: list[str] = []
    for name, doc in bases.items():
        for path in key_paths(doc):
            for op in OPS:
                mutated = mutate(doc, path, op)
                if mutated is None:
                    continue
                try:
                    assert_parses_or_names_a_key(mutated, "plan.toml")
                except Exception as exc:  # collect them all: one run shows every defect
                    failures.append(f"{name} {path} = {op!r:.40}: {type(exc).__name__}: {exc}")
    assert not failures, "\n".join(failures[:20]) + f"\n({len(failures)} in all)"


# -- `ehp-fsm check`, in process, on the file a user would write --


GENERATED = st.one_of(
    st.sampled_from(EDGE_VALUES),
    st.integers(),
    st.floats(),
    st.text(st.characters(exclude_categories=("Cs",)), max_size=20),
    st.lists(st.one_of(st.integers(-2, 9), st.text(max_size=6)), max_size=4),
    st.dictionaries(st.text(max_size=6), st.integers(-2, 9), max_size=3),
)


@st.composite
def mutated_docs(draw: st.DrawFn, bases: dict[str, Any]) -> dict[str, Any]:
    doc = bases[draw(st.sampled_from(sorted(bases)))]
    for _ in range(draw(st.integers(1, 2))):
        path = draw(st.sampled_from(list(key_paths(doc))))
        op = draw(st.one_of(st.sampled_from(OPS), GENERATED))
        doc = mutate(doc, path, op) or doc
    return doc


@settings(
    max_examples=min(settings().max_examples, 150),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_check_runs_or_refuses_what_parses(
    data: st.DataObject, bases: dict[str, Any], tmp_path: Path
) -> None:
    doc = data.draw(mutated_docs(bases))
    plan = tmp_path / "plan.toml"
    plan.write_text(to_toml(doc), encoding="utf-8")
    assert tomllib.loads(plan.read_text(encoding="utf-8")) == doc or _has_nan(doc)
    assert_parses_or_names_a_key(doc, str(plan))
    # `_cmd_check` itself: `main` would turn an OSError into exit 2, which hides a crash
    out = io.StringIO()
    try:
        with redirect_stdout(out):
            code = cli._cmd_check(argparse.Namespace(plan=str(plan)))
    except EhpError as exc:  # the project's errors: one line, naming the plan's key or file
        message = cli.shown(exc)
        assert "\n" not in message and message.isprintable(), message
        assert f"{plan}: plan key `" in message or "dataset " in message, message
        return
    assert code in (0, 2), code
    # exit 2 without an error: a valid plan naming what `ehp-fsm run` refuses
    assert code == 0 or "ehp-fsm run refuses" in out.getvalue(), out.getvalue()
    err = io.StringIO()
    with redirect_stdout(io.StringIO()), redirect_stderr(err):
        assert cli.main(["check", str(plan)]) == code
    assert err.getvalue() == ""


def _has_nan(node: Any) -> bool:
    if isinstance(node, float):
        return math.isnan(node)
    values = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
    return any(_has_nan(v) for v in values)


# -- what the walk found, each kept as an example --


@pytest.mark.parametrize("name", ["", "  ", "/", "a/b", "../x", ".", "..", "a\nb", "\x1b[2J"])
def test_a_plan_name_that_cannot_name_its_folders_is_refused(
    name: str, bases: dict[str, Any]
) -> None:
    """The plan's name names its default log folder `runs/<name>/` and simulate's output
    `runs/<name>-sim/`: "/" made that `/-sim` at the file system's root, "" `runs/-sim`."""
    doc = mutate(bases["local"], ("run", "name"), name)
    assert doc is not None
    exc = refusal(doc, "plan.toml")
    assert exc is not None and exc.key == "run.name", exc
    assert "cannot name the plan's folders" in str(exc) and 'no "/"' in str(exc), exc


def test_a_plan_path_that_never_ends_is_refused_not_read(tmp_path: Path) -> None:
    """`ehp-fsm check /dev/zero` read until the memory was gone (8 GB in 20 s); a plan is read
    up to a bound. A pipe (`check <(cat plan.toml)`) is still read."""
    from ehp_fsm.plan import load_plan

    exc = None
    try:
        load_plan("/dev/zero")
    except PlanError as e:
        exc = e
    assert exc is not None and exc.key == "<file>", exc
    assert f"/dev/zero holds more than {16 << 20} bytes" in str(exc), exc  # MAX_PLAN_BYTES
    fifo = tmp_path / "plan.fifo"
    os.mkfifo(fifo)
    text = (ROOT / "examples" / "short.toml").read_text(encoding="utf-8")
    writer = threading.Thread(target=fifo.write_text, args=(text.replace("\n", "\r\n"),))
    writer.start()
    try:
        assert load_plan(fifo).name == "short"  # CRLF read as the file's newlines, as before
    finally:
        writer.join(10)
