"""The embedding API against a scheduler that gets it wrong in two more ways. Each raises the
API's own error (`EventError` / `OrchestratorError`) with nothing logged and nothing changed,
and the log replays: before, each raised a bare `ValueError` out of the log's write."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from ehp_fsm import Accepted, Event, EventError, Orchestrator, load_plan
from ehp_fsm.embedded import OrchestratorError
from ehp_fsm.replay import replay

ROOT = Path(__file__).resolve().parents[2]
LAUNCH: dict[str, Any] = {"host": "h1", "gpus": ["h1:g0"], "tp": 1, "token": "t"}


@pytest.fixture
def orch(tmp_path: Path) -> Iterator[Orchestrator]:
    o = Orchestrator.from_plan(
        load_plan(ROOT / "examples" / "local.toml"), log_path=tmp_path / "t.jsonl", check=True
    )
    yield o
    o.close()
    assert replay(tmp_path / "t.jsonl").world.snapshot() == o.world.snapshot()


def _launch(payload: Mapping[str, Any]) -> Event:
    return Event("rollout_engine", "e0", "launch", 1.0, payload)


@pytest.mark.parametrize(
    ("payload", "named"),
    [
        ({**LAUNCH, "x": 10**5000}, "`payload['x']`"),
        ({**LAUNCH, "x": [1, {"y": -(10**5000)}]}, "`payload['x'][1]['y']`"),
    ],
)
def test_an_int_too_long_to_write_raises_naming_it_and_changes_nothing(
    orch: Orchestrator, payload: dict[str, Any], named: str
) -> None:
    before, head = orch.world.snapshot(), orch.chain_head
    with pytest.raises(EventError, match="int of more than") as info:
        orch.handle(_launch(payload))
    assert named in str(info.value)
    assert orch.world.snapshot() == before and orch.chain_head == head
    assert isinstance(orch.handle(_launch({**LAUNCH, "x": 10**4000})), Accepted)  # writable


def test_close_from_an_events_own_code_raises_and_the_event_is_not_logged(
    orch: Orchestrator,
) -> None:
    inner: list[BaseException] = []

    class Closing(Mapping[str, Any]):
        def __getitem__(self, key: str) -> Any:
            return LAUNCH[key]

        def __iter__(self) -> Iterator[str]:
            try:
                orch.close()
            except OrchestratorError as exc:
                inner.append(exc)
                raise
            return iter(LAUNCH)

        def __len__(self) -> int:
            return len(LAUNCH)

    before = orch.world.snapshot()
    with pytest.raises(OrchestratorError, match=r"close\(\) was called while"):
        orch.handle(_launch(Closing()))
    assert inner and orch.world.snapshot() == before
    assert isinstance(orch.handle(_launch(LAUNCH)), Accepted)  # still open


def test_close_from_another_thread_waits_for_the_event_being_handled(orch: Orchestrator) -> None:
    closer = threading.Thread(target=orch.close)

    class Slow(Mapping[str, Any]):
        def __getitem__(self, key: str) -> Any:
            return LAUNCH[key]

        def __iter__(self) -> Iterator[str]:
            if not closer.is_alive():
                closer.start()
                time.sleep(0.2)  # the other thread's close() comes while this event is handled
            return iter(LAUNCH)

        def __len__(self) -> int:
            return len(LAUNCH)

    assert isinstance(orch.handle(_launch(Slow())), Accepted)
    closer.join()
    with pytest.raises(OrchestratorError, match=r"after close\(\)"):
        orch.handle(_launch(LAUNCH))
    assert orch.world.get("rollout_engine", "e0") is not None  # logged: the fixture replays it


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"inventory": "h1:g0"}, "`inventory` is not a map"),
        ({"inventory": {"h1:g0": "h1"}, "replica_size": "1"}, '`replica_size` is "1"'),
        ({"inventory": {"h1:g0": "h1"}, "max_hybrids": 2.5}, "`max_hybrids` is 2.5"),
        ({"core_gpus": "h0:g0"}, "`core_gpus` is not a list"),
        (None, "not a mapping"),
    ],
)
def test_an_orchestrator_built_on_a_config_the_engine_cannot_read_is_refused_at_once(
    config: Any, named: str
) -> None:
    """`Orchestrator(config)` with a config the guards cannot read was built without a word:
    an `inventory` string raised a bare AttributeError from the world, a `replica_size` of
    "1" was taken, and the first event whose guard read it raised a TypeError out of `handle`
    (replay refuses the same config in a log's header, naming the key)."""
    from ehp_fsm.errors import EhpError

    with pytest.raises(EhpError, match=re.escape(named)) as info:
        Orchestrator(config)
    assert "world_config" in info.value.fix


def test_from_plan_refuses_a_core_version_that_is_no_int_before_it_writes_a_log(
    tmp_path: Path,
) -> None:
    """`from_plan(plan, core_version="3")` wrote "3" into the log's header and started the
    Core at 0 (the world reads only an int): a log replay refused ("the header's config
    cannot be the engine's"). Now it is refused before the log is made: nothing is left
    holding the path."""
    from ehp_fsm.errors import EhpError

    plan = load_plan(ROOT / "examples" / "local.toml")
    log = tmp_path / "t.jsonl"
    with pytest.raises(EhpError, match='`core_version` is "3", not an integer') as info:
        Orchestrator.from_plan(plan, log_path=log, core_version="3")  # type: ignore[arg-type]
    assert info.value is not None  # (the error, and what its traceback holds, still alive)
    again = Orchestrator.from_plan(plan, log_path=log, core_version=3)
    assert again.world.globals["core_version"] == 3
    again.close()
    assert replay(log).world.globals["core_version"] == 3


def test_a_scheduler_fires_the_deadlines_that_passed_and_the_log_replays(
    orch: Orchestrator, tmp_path: Path
) -> None:
    """Every waiting state has a deadline that fires while it waits (DESIGN); the shell's
    loop fires them on every tick, but the embedding API had no way to: an engine launched at
    t=0 that never came up stayed `starting` at t=500, past its 120 s deadline, its GPU held,
    unless the scheduler found `ehp_fsm.core.timers` on its own. `fire_deadlines(now)` handles
    a `deadline` event for each deadline at or before `now`; `next_deadline()` says when."""
    launch = Event("rollout_engine", "e0", "launch", 0.0, LAUNCH)
    assert isinstance(orch.handle(launch), Accepted)
    assert orch.next_deadline() == 120.0
    assert orch.fire_deadlines(119.5) == []
    assert orch.world.get("rollout_engine", "e0").state == "starting"
    (out,) = orch.fire_deadlines(500.0)
    assert isinstance(out, Accepted) and out.event.name == "deadline"
    assert orch.world.get("rollout_engine", "e0").state == "failed"
    assert orch.world.get("gpu", "h1:g0").state == "releasing"  # freed only once confirmed
    assert {c.kind for c in out.commands} == {"cancel_launch", "confirm_gpu_free"}
    assert orch.next_deadline() is None and orch.fire_deadlines(1000.0) == []
    for bad in (float("nan"), float("inf"), "500", True):
        with pytest.raises(EventError, match="`now`"):
            orch.fire_deadlines(bad)  # type: ignore[arg-type]
