"""The embedding API against a scheduler that gets it wrong in two more ways. Each raises the
API's own error (`EventError` / `OrchestratorError`) with nothing logged and nothing changed,
and the log replays: before, each raised a bare `ValueError` out of the log's write."""

from __future__ import annotations

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
