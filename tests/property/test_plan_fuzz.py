"""No plan file makes `load_plan` or `ehp-fsm check` fail with anything but a clear error.

Hypothesis starts from each example plan (its model and data pointed at the session's tiny
model and the example prompts, its log under a temp dir, so the unmutated plan checks clean) and
mutates it structurally: a key deleted, a value replaced by one of another type (huge, negative,
NaN, infinite, empty, very long, unicode, a path like "../../x", a list, a table), an
array-of-tables entry duplicated, unknown keys and tables added, a table swapped for an array.
The mutated document is written back as TOML, so the file `check` reads is what a user could
write; a few cases mutate the text itself (cut, garbage, bytes that are not UTF-8).

The property: `load_plan` returns a plan or raises `PlanError` naming a key and the file, and
`ehp-fsm check FILE` (`cli.main`) exits 0 or 2, printing at most `ehp-fsm: error: ...` that names
the file or a key — never another exception type, never a traceback, never a hang (each call
runs under an alarm).
"""

from __future__ import annotations

import copy
import datetime
import io
import math
import os
import shutil
import signal
import tomllib
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ehp_fsm import cli
from ehp_fsm.errors import MAX_QUOTED, PlanError, printable
from ehp_fsm.plan import SIMULATE_DEFAULTS, load_plan

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ("local", "short", "local-megatron", "gpu-4x8")
#: A call that takes longer than this is a hang (generous: two cores shared by several runs).
CALL_LIMIT_S = 60
T = TypeVar("T")

# -- writing a document back as TOML (tomllib reads; the venv has no writer) --


def _string(s: str) -> str:
    out = []
    for ch in s:
        if ch in '"\\' or ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, datetime.date | datetime.time):  # TOML's dates and times, as tomllib reads
        return v.isoformat()
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    assert isinstance(v, dict), v
    return "{" + ", ".join(f"{_string(k)} = {_value(x)}" for k, x in v.items()) + "}"


def to_toml(doc: dict[str, Any]) -> str:
    """`doc` as TOML: top-level keys as inline values (tomllib reads them back as `doc`)."""
    return "".join(f"{_string(k)} = {_value(v)}\n" for k, v in doc.items())


# -- the example plans, made to resolve from a temp dir --


def example_doc(name: str, model: Path, tmp: Path) -> dict[str, Any]:
    doc = tomllib.loads((ROOT / "examples" / f"{name}.toml").read_text(encoding="utf-8"))
    doc["run"]["log"] = str(tmp / "runs" / name / "transitions.jsonl")
    if "model" in doc:
        doc["model"]["path"] = str(model)
    if "data" in doc:
        doc["data"]["train"] = str(ROOT / "examples" / doc["data"]["train"])
    return doc


# -- mutations --

TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
ODD_VALUES = st.one_of(
    st.integers(-3, 3),
    st.sampled_from([10**30, -(10**30), 2**63, 2**64, -1, 0, 1 << 31]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-300, 1e300, 0.5]),
    st.booleans(),
    TEXT,
    st.sampled_from(["", "../../x", "/", "x" * 5000, "é\u202e日本", "h0:g0", "nan", "cuda"]),
    st.sampled_from(["a\x00b", "/tmp\x00", "\x1b[31m", "line\nbreak", ".", "plan.toml"]),
    st.sampled_from(["sglang", "megatron", "local", "qwen3", "token_mean", "zero", "m:f"]),
    st.sampled_from(["x.py:f", "os:getcwd", "tcp://[::1]:5", "tcp://0.0.0.0:1", "ipc://x"]),
    st.lists(st.one_of(st.integers(-2, 4), TEXT), max_size=3),
    st.dictionaries(TEXT, st.integers(-2, 2), max_size=2),
    st.builds(lambda: [{}]),  # fresh objects: a later mutation may append to them
    st.builds(lambda: [[1]]),
)


#: Keys a plan may have that the examples leave out: a mutation may add them.
OPTIONAL_KEYS: tuple[tuple[str, ...], ...] = (
    ("run", "revisions"),
    ("hosts", "device"),
    ("engines", "gpus"),
    ("engines", "backend"),
    ("sglang", "args"),
    ("rollout", "allowed_tp"),
    ("model", "dtype"),
    ("model", "generate"),
    ("data", "prompt_key"),
    ("data", "label_key"),
    ("data", "chat_template"),
    ("data", "seed"),
    ("reward", "function"),
    ("reward", "on_error"),
    ("reward", "timeout_s"),
    *(("grpo", k) for k in ("temperature", "clip_low", "clip_high", "kl_coef", "global_batch")),
    ("grpo", "loss_aggregation"),
    ("ehp", "enabled"),
    ("deadlines", "rollout_engine", "starting"),
    ("deadlines", "training_step", "computing"),
    ("deadlines", "run", "generate"),
    ("transport", "allow_non_loopback"),
    ("transport", "curve_keys"),
    ("transport", "curve"),
    ("transport", "max_message_bytes"),
    *(("simulate", k) for k in SIMULATE_DEFAULTS),
    ("simulate", "response_lengths_file"),
)


def add(doc: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    """Set `path` (a first array-of-tables entry when it meets an array), making its tables."""
    node: Any = doc
    for part in path[:-1]:
        if isinstance(node, list):
            if not node:
                return
            node = node[0]
        if not isinstance(node, dict):
            return
        node = node.setdefault(part, {})
    if isinstance(node, list) and node:
        node = node[0]
    if isinstance(node, dict):
        node[path[-1]] = value


def paths(node: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every key path of a document (tables' keys and arrays' items), depth first."""
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for k, v in items:
        yield (*prefix, k)
        if isinstance(v, dict | list):
            yield from paths(v, (*prefix, k))


def at(doc: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        doc = doc[part]
    return doc


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        every = list(paths(doc))
        if not every:
            break
        path = draw(st.sampled_from(every))
        parent, key = at(doc, path[:-1]), path[-1]
        value = parent[key]
        ops = ["delete", "replace", "add_key", "add_known"]
        if isinstance(value, list) and value:
            ops.append("duplicate")
        if isinstance(value, dict):
            ops.append("to_array")
        op = draw(st.sampled_from(ops))
        if op == "delete":
            del parent[key]
        elif op == "replace":
            parent[key] = draw(ODD_VALUES)
        elif op == "duplicate":
            value.append(copy.deepcopy(value[draw(st.integers(0, len(value) - 1))]))
        elif op == "to_array":
            parent[key] = [value]
        elif op == "add_known":
            add(doc, draw(st.sampled_from(OPTIONAL_KEYS)), draw(ODD_VALUES))
        else:  # an unknown key beside it, or a known key name in the wrong table
            target = value if isinstance(value, dict) else parent
            if isinstance(target, dict):
                name = draw(st.one_of(TEXT, st.sampled_from(["gpus", "tp", "path", "run"])))
                target[name] = draw(ODD_VALUES)
    return doc


# -- the property --


@contextmanager
def bounded(seconds: int) -> Iterator[None]:
    """Fail a call that runs longer than `seconds` (a hang) instead of waiting for it."""

    def hang(signum: int, frame: object) -> None:
        raise AssertionError(f"the call did not return within {seconds} s")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def call(fn: Callable[[], T]) -> T:
    with bounded(CALL_LIMIT_S):
        return fn()


def refusal(path: Path) -> PlanError | None:
    """What `load_plan` refuses `path` with (None: it loads); any other exception escapes."""
    try:
        call(lambda: load_plan(path))
    except PlanError as exc:
        return exc
    return None


def assert_loads_or_refuses(path: Path) -> None:
    exc = refusal(path)
    if exc is not None:
        message = str(exc)
        assert exc.key and exc.path == str(path), message
        if exc.key.startswith("<"):  # the file as a whole (not text, not TOML): no key of it
            assert message.startswith(f"the plan {path} cannot be used: because "), message
        else:
            assert message.startswith(f"{path}: plan key `{printable(exc.key)}` is invalid"), (
                message
            )
        assert message.isprintable(), message  # one line, nothing a terminal would act on
        assert len(message) < 2 * MAX_QUOTED + 1000, message  # a long value is cut


def assert_checks_or_refuses(path: Path) -> int:
    """`ehp-fsm check path` exits 0, or 2 with one clear line; returns the exit code."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = call(lambda: cli.main(["check", str(path)]))
    text = err.getvalue()
    assert code in (0, 2), (code, text)
    assert "Traceback" not in text + out.getvalue()
    if code == 0:
        assert text == "", text
    if text:
        assert text.startswith("ehp-fsm: error: ") and text.endswith("\n"), text
        assert text[:-1].isprintable(), text  # one line, nothing a terminal would act on
        assert len(text) < 2 * MAX_QUOTED + 1000, text  # a long value is cut
        assert (
            f"{path}: plan key `" in text
            or f"the plan {path} cannot be used: " in text
            or "dataset " in text
        ), text  # the plan's key, the plan file as a whole (not TOML), or the data file (and
        # line) `[data] train` names
    else:  # exit 2 without an error: the plan is valid and names what the run refuses
        assert code == 0 or "ehp-fsm run refuses" in out.getvalue(), out.getvalue()
    return code


@pytest.fixture(scope="module")
def bases(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("plans")
    return {name: example_doc(name, tiny_model_dir, tmp) for name in EXAMPLES}


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "plan.toml"


@pytest.mark.parametrize("name", EXAMPLES)
def test_each_example_checks_as_it_ships(name: str, bases: dict[str, Any], plan_file: Path) -> None:
    """The starting points are what the examples say: the property starts from valid plans."""
    plan_file.write_text(to_toml(bases[name]), encoding="utf-8")
    assert tomllib.loads(plan_file.read_text(encoding="utf-8")) == bases[name]
    load_plan(plan_file)
    # gpu-4x8 is valid but names CUDA training, which `ehp-fsm run` refuses (exit 2, no error)
    assert assert_checks_or_refuses(plan_file) == (2 if name == "gpu-4x8" else 0)


#: The two plan fuzz tests' settings (the fixtures are per test, not per example: the plan
#: file is rewritten by each example).
FUZZ_300 = settings(
    max_examples=min(settings().max_examples, 300),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ_300
@given(name=st.sampled_from(EXAMPLES), data=st.data())
def test_load_plan_loads_or_names_the_key(
    name: str, data: st.DataObject, bases: dict[str, Any], plan_file: Path
) -> None:
    plan_file.write_text(to_toml(data.draw(mutated(bases[name]))), encoding="utf-8")
    assert_loads_or_refuses(plan_file)


@FUZZ_300
@given(name=st.sampled_from(EXAMPLES), data=st.data())
def test_check_exits_with_a_clear_error(
    name: str, data: st.DataObject, bases: dict[str, Any], plan_file: Path
) -> None:
    plan_file.write_text(to_toml(data.draw(mutated(bases[name]))), encoding="utf-8")
    assert_checks_or_refuses(plan_file)


@settings(
    max_examples=min(settings().max_examples, 60),
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    name=st.sampled_from(EXAMPLES),
    cut=st.integers(0, 10**6),
    junk=st.sampled_from([b"", b"\xff\xfe", b"[[", b"]", b"=", b"\x00", b'"', b"\n[core]\n"]),
)
def test_damaged_text_is_refused_as_the_file(
    name: str, cut: int, junk: bytes, bases: dict[str, Any], plan_file: Path
) -> None:
    text = to_toml(bases[name]).encode()
    cut %= len(text) + 1
    plan_file.write_bytes(text[:cut] + junk + text[cut:])
    assert_loads_or_refuses(plan_file)


# -- the crashes the property found, each kept as an example --

#: (label, key path, value, the key the refusal names, the example changed). Before the fix
#: each of these left `ehp-fsm check` with a traceback (ValueError: embedded null byte), an
#: error naming neither the key nor the plan, a message broken over lines or carrying escape
#: sequences, or (the data seed, the engine argument) was accepted and would not run as said.
FOUND: tuple[tuple[str, tuple[str, ...], Any, str, str], ...] = (
    ("model dir without a config", ("model", "path"), "/", "model.path", "local"),
    ("blank model path", ("model", "path"), "", "model.path", "local"),
    ("NUL in model path", ("model", "path"), "\x00", "model.path", "local"),
    ("NUL in the log", ("run", "log"), "runs/\x00/t.jsonl", "run.log", "local"),
    ("NUL in the plan name", ("run", "name"), "a\x00b", "run.name", "local"),
    ("NUL in revisions", ("run", "revisions"), "r\x00", "run.revisions", "local"),
    ("NUL in curve keys", ("transport", "curve_keys"), "\x00", "transport.curve_keys", "local"),
    ("NUL in the data file", ("data", "train"), "d\x00.jsonl", "data.train", "local"),
    (
        "NUL in lengths",
        ("simulate", "response_lengths_file"),
        "\x00",
        "simulate.response_lengths_file",
        "local",
    ),
    ("empty prompt key", ("data", "prompt_key"), "", "data.prompt_key", "local"),
    ("a data seed the shuffle would cut", ("data", "seed"), 2**32, "data.seed", "local"),
    ("escape sequence in the data path", ("data", "train"), "\x1b", "<dataset>", "local"),
    ("NUL in an engine argument", ("sglang", "args"), ["--x=\x00"], "sglang.args", "gpu-4x8"),
    ("a megabyte name where a number goes", ("grpo", "steps"), "x" * 10**6, "grpo.steps", "local"),
    ("a log name too long for the OS", ("run", "log"), "x" * 5000, "run.log", "local"),
    ("a model folder name too long", ("model", "path"), "/" + "m" * 300, "model.path", "local"),
    ("newline in a key", ("run", "\n"), 1, 'run."\\n"', "local"),
    ("escape sequence in a key", ("core", "\x1b[2J"), 1, 'core."\\x1b[2J"', "local"),
    ("bidi override in a key", ("\u202e",), {}, '"\\u202e"', "local"),
    ("empty key", ("grpo", ""), 1, 'grpo.""', "local"),
)


@pytest.mark.parametrize(
    ("label", "path", "value", "key", "example"), FOUND, ids=[f[0] for f in FOUND]
)
def test_found_crashes_are_plan_errors(
    label: str,
    path: tuple[str, ...],
    value: Any,
    key: str,
    example: str,
    bases: dict[str, Any],
    plan_file: Path,
) -> None:
    doc = copy.deepcopy(bases[example])
    add(doc, path, value)
    plan_file.write_text(to_toml(doc), encoding="utf-8")
    exc = refusal(plan_file)
    if exc is None:  # found by `check`'s input checks, past the loader
        assert_checks_or_refuses(plan_file)
        with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()) as err:
            cli.main(["check", str(plan_file)])
        want = "dataset " if key == "<dataset>" else f"plan key `{key}`"
        assert want in err.getvalue(), err.getvalue()
        return
    assert exc.key == key or printable(exc.key) == key, exc
    assert_loads_or_refuses(plan_file)
    assert_checks_or_refuses(plan_file)


def test_a_symlink_loop_is_refused_with_its_key(bases: dict[str, Any], tmp_path: Path) -> None:
    """`Path.resolve` raises RuntimeError on a symlink loop: it was a traceback."""
    (tmp_path / "loop").symlink_to("loop")
    for path, value, key in (
        (("model", "path"), "loop/x", "model.path"),  # from the plan's folder
        (("run", "log"), str(tmp_path / "loop" / "x" / "t.jsonl"), "run.log"),
    ):
        doc = copy.deepcopy(bases["local"])
        add(doc, path, value)
        plan = tmp_path / "plan.toml"
        plan.write_text(to_toml(doc), encoding="utf-8")
        assert_checks_or_refuses(plan)
        with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()) as err:
            cli.main(["check", str(plan)])
        assert f"plan key `{key}`" in err.getvalue() and "loop" in err.getvalue(), err.getvalue()


def test_a_fifo_of_lengths_is_refused_not_read(bases: dict[str, Any], tmp_path: Path) -> None:
    """A FIFO (or a device) named as `response_lengths_file` blocked `check` forever."""
    fifo = tmp_path / "lengths"
    os.mkfifo(fifo)
    doc = copy.deepcopy(bases["local"])
    add(doc, ("simulate", "response_lengths_file"), str(fifo))
    plan = tmp_path / "plan.toml"
    plan.write_text(to_toml(doc), encoding="utf-8")
    exc = refusal(plan)
    assert exc is not None and exc.key == "simulate.response_lengths_file", exc


@pytest.mark.parametrize(
    ("config", "backend"),
    [("not json", "torch"), ("[1, 2]", "torch"), ('{"model_type": ["qwen3"]}', "megatron")],
)
def test_a_broken_model_config_is_refused_as_the_model_path(
    config: str, backend: str, tiny_model_dir: Path, bases: dict[str, Any], tmp_path: Path
) -> None:
    """A model directory whose config.json is not JSON, not an object, or has an odd
    `model_type` was a JSONDecodeError / AttributeError / TypeError out of `check`."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "config.json").write_text(config, encoding="utf-8")
    doc = copy.deepcopy(bases["local-megatron" if backend == "megatron" else "local"])
    doc["model"]["path"] = str(model)
    plan = tmp_path / "plan.toml"
    plan.write_text(to_toml(doc), encoding="utf-8")
    assert_checks_or_refuses(plan)
    with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()) as err:
        cli.main(["check", str(plan)])
    assert "plan key `model.path`" in err.getvalue() or "core.backend" in err.getvalue()
