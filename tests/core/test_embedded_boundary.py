"""The embedding API's boundary: what `Orchestrator.handle` does with events a scheduler gets
wrong. Each either is handled — refused or accepted, logged, and replayed to the same world —
or raises `EventError` / `OrchestratorError` naming what was wrong, with nothing logged and
nothing changed. Before, each case below was either logged in a form replay could not read
back (`null` for a machine, an int instance, base64 for bytes, a list for a set, `null` for
NaN) — the log stopped replaying at that line — or raised a bare Python exception
(UnicodeEncodeError, OverflowError, the caller's own RuntimeError)."""

from __future__ import annotations

import collections
import enum
import re
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

import ehp_fsm.core.checks as checks_module
import ehp_fsm.core.index as index_module
import ehp_fsm.core.world as world_module
import ehp_fsm.embedded as embedded_module
import ehp_fsm.translog as translog_module
from ehp_fsm import Accepted, Event, EventError, Orchestrator, Rejected, load_plan
from ehp_fsm.cli import main as ehp_fsm_main
from ehp_fsm.core.invariants import check_invariants
from ehp_fsm.embedded import OrchestratorError
from ehp_fsm.errors import EhpError
from ehp_fsm.replay import replay

ROOT = Path(__file__).resolve().parents[2]
LAUNCH: dict[str, Any] = {"host": "h1", "gpus": ["h1:g0"], "tp": 1, "token": "t"}


class _Obj:
    def __repr__(self) -> str:
        return "<obj>"


class _BadRepr:
    def __repr__(self) -> str:
        raise RuntimeError("repr boom")


class _Raising(Mapping[str, Any]):
    def __getitem__(self, key: str) -> Any:
        raise RuntimeError("boom")

    def __iter__(self) -> Iterator[str]:
        return iter(["host"])

    def __len__(self) -> int:
        return 1


class _Kind(enum.StrEnum):
    ENGINE = "rollout_engine"


class _Tp(enum.IntEnum):
    ONE = 1


def _launch(**payload: Any) -> Event:
    return Event("rollout_engine", "e0", "launch", 1.0, {**LAUNCH, **payload})


@pytest.fixture
def orch(tmp_path: Path) -> Iterator[Orchestrator]:
    o = Orchestrator.from_plan(
        load_plan(ROOT / "examples" / "local.toml"), log_path=tmp_path / "t.jsonl", check=True
    )
    yield o
    o.close()
    assert o.log is not None
    result = replay(tmp_path / "t.jsonl")
    assert result.world.snapshot() == o.world.snapshot()


@pytest.mark.parametrize(
    ("event", "named"),
    [
        (Event(None, "e0", "launch", 1.0, LAUNCH), "`machine` is None (a NoneType)"),  # type: ignore[arg-type]
        (Event("rollout_engine", 7, "launch", 1.0, LAUNCH), "`instance` is 7 (an int)"),  # type: ignore[arg-type]
        (Event("rollout_engine", "e0", None, 1.0, LAUNCH), "`name` is None"),  # type: ignore[arg-type]
        (Event("rollout_engine", "e0", "launch", 1.0, LAUNCH, 5), "`correlation` is 5"),  # type: ignore[arg-type]
        (_launch(gpus={"h1:g0"}), "`payload['gpus']` is {'h1:g0'} (a builtins.set)"),
        (_launch(gpus=frozenset({"h1:g0"})), "`payload['gpus']` is frozenset"),
        (_launch(token=b"t"), "`payload['token']` is b't' (a builtins.bytes)"),
        (_launch(token=_Obj()), "`payload['token']` is <obj>"),
        (_launch(tp=float("nan")), "`payload['tp']` is nan: JSON has no NaN"),
        (_launch(tp=float("-inf")), "`payload['tp']` is -inf"),
        (_launch(x={"a": [1, {2}]}), "`payload['x']['a'][1]` is {2}"),
        (_launch(tp=_BadRepr()), "<a _BadRepr whose repr raised>"),
        (Event("rollout_engine", "e0", "launch", 1.0, {1: 2}), "has the key 1 (an int)"),
        (Event("rollout_engine", "e0", "launch", 1.0, _Raising()), "raised RuntimeError"),
        (_launch(token="\ud800"), "`payload['token']` is '\\ud800', a str that is not UTF-8"),
        (_launch(x={"k\ud800": 1}), "`payload['x'] key 'k\\ud800'` is 'k\\ud800', a str that"),
        (Event("rollout_engine", "e\udfff", "launch", 1.0, LAUNCH), "`instance` is 'e\\udfff'"),
        (Event("rollout_engine", "e0", "launch", 10**400, LAUNCH), "too large for a float"),
    ],
)
def test_an_event_the_log_cannot_give_back_raises_naming_the_field(
    orch: Orchestrator, event: Event, named: str
) -> None:
    before, head = orch.world.snapshot(), orch.chain_head
    with pytest.raises(EventError, match=re.escape(named)) as err:
        orch.handle(event)
    assert "Fix: build it as Event(" in str(err.value)
    assert orch.world.snapshot() == before and orch.chain_head == head


@pytest.mark.parametrize(
    ("event", "accepted"),
    [
        (_launch(tp=(1,)), False),  # the reason quoted `(1,)`; replay, which has a list, `[1]`
        (_launch(gpus=("h1:g0",)), True),
        (_launch(tp=_Tp.ONE), True),
        (Event(_Kind.ENGINE, "e0", "launch", 1.0, LAUNCH), True),
        (Event("rollout_engine", "e0", "launch", 3, LAUNCH), True),  # an int time
        (Event("rollout_engine", "e0", "launch", 1.0, collections.OrderedDict(LAUNCH)), True),
        (Event("nope", "e0", "launch", 1.0, LAUNCH), False),  # replay refused the line
    ],
)
def test_an_event_with_a_plain_form_is_handled_as_replay_will_see_it(
    orch: Orchestrator, event: Event, accepted: bool
) -> None:
    out = orch.handle(event)
    assert out.accepted is accepted
    assert type(out.event.payload) in (dict, type(LAUNCH)) and type(out.event.time) is float


def test_an_event_handled_inside_another_is_refused_and_the_log_replays(
    orch: Orchestrator,
) -> None:
    """A payload whose `__getitem__` handled another event ran that event in the middle of the
    first one's step: the first was decided on a world that changed under it and the log no
    longer replayed."""
    inner: list[BaseException] = []

    class Reentering(Mapping[str, Any]):
        def __getitem__(self, key: str) -> Any:
            try:
                orch.handle(Event("rollout_engine", "e1", "launch", 1.0, LAUNCH))
            except OrchestratorError as exc:
                inner.append(exc)
            return LAUNCH[key]

        def __iter__(self) -> Iterator[str]:
            return iter(LAUNCH)

        def __len__(self) -> int:
            return len(LAUNCH)

    out = orch.handle(Event("rollout_engine", "e0", "launch", 1.0, Reentering()))
    assert isinstance(out, Accepted)
    assert inner and "was called while rollout_engine 'e0' 'launch' was being handled" in str(
        inner[0]
    )
    assert orch.world.get("rollout_engine", "e1") is None


def test_handle_after_close_says_so(tmp_path: Path) -> None:
    o = Orchestrator.from_plan(load_plan(ROOT / "examples" / "local.toml"), log_path=tmp_path / "t")
    o.close()
    with pytest.raises(OrchestratorError, match=r"after close\(\)"):
        o.handle(_launch())
    o.close()  # twice: nothing
    assert isinstance(
        Orchestrator.from_plan(load_plan(ROOT / "examples" / "local.toml")).handle(
            Event("nope", "x", "y", 1.0)
        ),
        Rejected,
    )


def test_two_threads_handling_at_once_are_refused_one_at_a_time_and_the_log_replays(
    orch: Orchestrator,
) -> None:
    """Two threads of a scheduler calling `handle` at once: before, both steps ran together
    on one world and wrote the log in turns (a record's seq given twice, the log broken);
    now a call made while another runs is refused with `OrchestratorError`, and the caller
    that retries it gets it handled after."""
    refused: list[OrchestratorError] = []
    start = threading.Barrier(2)

    def feed(prefix: str) -> None:
        start.wait()
        for i in range(1000):
            event = Event("request", f"{prefix}{i}", "enqueue", 1.0, {"prompt": "p"})
            while True:
                try:
                    orch.handle(event)
                    break
                except OrchestratorError as exc:
                    refused.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        threads = [threading.Thread(target=feed, args=(p,)) for p in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert len(orch.world.of("request")) == 2000
    assert refused and "call handle from one thread" in str(refused[0])


def test_either_outcome_answers_accepted_commands_and_reason(orch: Orchestrator) -> None:
    """The README reads an outcome's `accepted`, `commands` and `reason`: a `Rejected` had no
    `commands` and an `Accepted` no `reason` (AttributeError for a scheduler that logged the
    reason or looped over the commands before asking which it got)."""
    refused = orch.handle(Event("rollout_engine", "e0", "drain", 1.0))
    assert (refused.accepted, refused.commands) == (False, ())
    assert "does not exist" in refused.reason
    done = orch.handle(_launch())
    assert (done.accepted, done.reason) == (True, "")
    assert [c.kind for c in done.commands] == ["launch"]


def test_a_list_the_caller_changes_after_handle_does_not_change_the_world(
    orch: Orchestrator,
) -> None:
    """Before: a payload's list of scalars was kept by the world as the caller's own object
    (a revision's manifest `checksum` here): changed by the caller after `handle` returned, it
    changed the world behind the log's back, and replay no longer gave the live world."""
    checksum = [0]
    assert orch.handle(Event("revision", "r1", "save", 1.0, {"revision": 1, "step": 0})).accepted
    assert orch.handle(Event("revision", "r1", "saved", 1.0, {"checksum": checksum})).accepted
    checksum.append(99)
    rev = orch.world.get("revision", "r1")
    assert rev is not None and rev.get("checksum") == [0]


# -- an interrupt inside `handle` ----------------------------------------------------------------

_PLAN = ROOT / "examples" / "local.toml"
# The modules whose lines run inside `handle` after the pure step: the shell, the log, the
# world, its index and the invariant checks.
_TRACED = {
    str(Path(m.__file__).resolve())  # type: ignore[arg-type]
    for m in (embedded_module, translog_module, world_module, index_module, checks_module)
}


class _Interrupt:
    """A trace function (`sys.settrace`) that raises KeyboardInterrupt at the `at`-th line run
    in `_TRACED` (what Ctrl-C does between two lines there: the faked edge — a signal cannot be
    aimed at a line), or only counts the lines (`at` None)."""

    def __init__(self, at: int | None) -> None:
        self.at, self.lines, self.where = at, 0, ""

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "call":
            return self._line if frame.f_code.co_filename in _TRACED else None
        return None

    def _line(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            self.lines += 1
            if self.lines == self.at:
                self.where = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
                raise KeyboardInterrupt
        return self._line


def _interrupted(tmp_path: Path, at: int | None) -> tuple[Orchestrator, Path, _Interrupt, bool]:
    log = tmp_path / f"t{at}.jsonl"
    orch = Orchestrator.from_plan(load_plan(_PLAN), log_path=log, check=True)
    assert orch.log is not None
    orch.log.checkpoint_every, orch.log.checkpoint_events_per_instance = 1, 0.0  # one follows
    trace, hit = _Interrupt(at), False
    sys.settrace(trace)
    try:
        orch.handle(_launch())
    except KeyboardInterrupt:
        hit = True
    finally:
        sys.settrace(None)
    return orch, log, trace, hit


def test_an_interrupt_anywhere_in_handle_leaves_the_event_in_both_log_and_world_or_neither(
    tmp_path: Path,
) -> None:
    """A KeyboardInterrupt at each line that runs inside `handle` once the event is stepped —
    in the log's write, between the write and the world's change, inside `World.apply` and
    the index, in the invariant checks, in the checkpoint after it, as the call gives back its
    turn. Before, one between the write and the apply left the log holding an event the world
    never applied (`ehp-fsm replay`'s world had engine e0, the orchestrator's had not), and
    the next event was logged after it; one inside the write left part of a line. Now the
    event is in both or in neither (the log is cut back and the world put back), as
    `ehp-fsm replay` of the log shows, and the orchestrator goes on: the same event handled
    again, then another, and the whole log replays to its world."""
    whole, _, counted, _ = _interrupted(tmp_path, None)
    whole.close()
    assert counted.lines > 100, counted.lines
    for at in range(1, counted.lines + 1):
        orch, log, trace, hit = _interrupted(tmp_path, at)
        assert hit, f"no interrupt at line {at} ({trace.lines} lines ran)"
        assert replay(log).world.snapshot() == orch.world.snapshot(), (
            f"interrupted at {trace.where}: the log and the world differ"
        )
        handled = orch.world.get("rollout_engine", "e0") is not None
        again = orch.handle(_launch())
        assert again.accepted != handled, f"interrupted at {trace.where}: {again.reason}"
        assert orch.handle(Event("rollout_engine", "e0", "fail", 2.0)).accepted
        orch.close()
        assert ehp_fsm_main(["replay", str(log)]) == 0, f"interrupted at {trace.where}"
        assert replay(log).world.snapshot() == orch.world.snapshot(), trace.where
        log.unlink()


def test_a_buffered_log_is_cut_back_to_where_it_stood_after_an_interrupt_anywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same with a buffered log (`flush_each=False`, as `ehp-fsm simulate` writes it),
    whose `mark` gives the position the last record written left it at instead of asking the
    file (a seek an event): after an interrupt at each line, after the event handled again
    and after the next, that position is the file's, and the log replays to the world."""
    create = translog_module.TransitionLog.create.__func__  # type: ignore[attr-defined]

    def buffered(cls: Any, *args: Any, **kwargs: Any) -> Any:
        return create(cls, *args, **{**kwargs, "flush_each": False})

    monkeypatch.setattr(translog_module.TransitionLog, "create", classmethod(buffered))
    whole, _, counted, _ = _interrupted(tmp_path, None)
    assert whole.log is not None and not whole.log.flush_each
    whole.close()
    for at in range(1, counted.lines + 1):
        orch, log, trace, hit = _interrupted(tmp_path, at)
        assert hit and orch.log is not None, f"no interrupt at line {at}"
        stream = orch.log._stream
        assert orch.log.mark()[0] == stream.tell(), trace.where
        handled = orch.world.get("rollout_engine", "e0") is not None
        assert orch.handle(_launch()).accepted != handled, trace.where
        assert orch.log.mark()[0] == stream.tell(), trace.where
        assert orch.handle(Event("rollout_engine", "e0", "fail", 2.0)).accepted
        assert orch.log.mark()[0] == stream.tell(), trace.where
        orch.close()
        assert replay(log).world.snapshot() == orch.world.snapshot(), trace.where
        log.unlink()


def test_check_true_does_not_check_the_whole_world_after_each_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`check=True` ran `check_invariants` — every GPU, engine, Hybrid and busy step: ~55 ms
    an event at 20,000 GPUs against ~0.3 ms unchecked — after each accepted event. Now it
    checks what the event changed (`core.checks`), and the whole world only where that finds
    a problem (to name them all, as before): none here, in 30 accepted events."""
    import ehp_fsm.core.checks

    calls: list[int] = []

    def counted(world: Any, *, indexed: bool = False) -> list[str]:
        calls.append(1)
        return check_invariants(world, indexed=indexed)

    orch = Orchestrator.from_plan(load_plan(_PLAN), log_path=tmp_path / "t.jsonl", check=True)
    monkeypatch.setattr(embedded_module, "check_invariants", counted, raising=False)
    monkeypatch.setattr(ehp_fsm.core.checks, "check_invariants", counted)
    for i in range(10):  # a group queued; an engine launched, failed, its GPU freed
        assert orch.handle(Event("request", f"g{i}", "enqueue", 1.0, {"prompt": "p"})).accepted
        assert orch.handle(Event("rollout_engine", f"e{i}", "launch", 1.0, LAUNCH)).accepted
        assert orch.handle(Event("rollout_engine", f"e{i}", "fail", 1.0)).accepted
        confirm = {"owner": f"engine:e{i}", "processes_exited": True, "memory_free": True}
        assert orch.handle(Event("gpu", "h1:g0", "confirm_free", 1.0, confirm)).accepted
    orch.close()
    assert len(calls) <= 1, f"the whole world was checked {len(calls)} times in 40 events"


# -- `from_plan(log_meta=...)` -------------------------------------------------------------------


class _Meta:
    def __repr__(self) -> str:
        return "<meta>"


@pytest.mark.parametrize(
    ("meta", "named"),
    [
        ({"tags": {"a", "b"}}, "`log_meta['tags']` is {"),
        ({"blob": b"x"}, "`log_meta['blob']` is b'x' (a builtins.bytes)"),
        ({"loss": float("nan")}, "`log_meta['loss']` is nan: JSON has no NaN"),
        ({"x": {"y": [1, float("inf")]}}, "`log_meta['x']['y'][1]` is inf"),
        ({1: "one"}, "has the key 1 (an int)"),
        (
            {"who": _Meta()},
            "`log_meta['who']` is <meta> (a tests.core.test_embedded_boundary._Meta)",
        ),
        ({"text": "\ud800"}, "`log_meta['text']` is '\\ud800', a str that is not UTF-8"),
        ({"n": 10**5000}, "`log_meta['n']` is an int of more than"),
        (["not", "a", "map"], "log_meta is ['not', 'a', 'map'] (a list), not a mapping"),
    ],
)
def test_log_meta_the_header_would_change_is_refused_naming_the_key_and_type(
    tmp_path: Path, meta: Any, named: str
) -> None:
    """Before, the header's writer changed it without a word: a set written as a list, bytes
    as base64, NaN as null, an int key as a string, an object as its repr (a lone surrogate
    and a too-long int raised bare errors with the log's path left locked)."""
    log = tmp_path / "t.jsonl"
    with pytest.raises(EhpError, match="the log header's meta cannot be written") as err:
        Orchestrator.from_plan(load_plan(_PLAN), log_path=log, log_meta=meta)
    text = str(err.value)
    assert named in text, text
    assert "JSON values only" in text, text
    ok = Orchestrator.from_plan(
        load_plan(_PLAN), log_path=log, log_meta={"note": {"steps": (3, 4)}, "k": None}
    )
    ok.close()
    assert replay(log).header["meta"]["note"] == {"steps": [3, 4]}
