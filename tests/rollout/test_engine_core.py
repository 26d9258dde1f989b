"""The engine core in-process: a request whose waiter went away (its future cancelled, as
asyncio does when a client disconnects or the health probe times out) must not take the
scheduler thread down with it."""

from __future__ import annotations

from pathlib import Path

from ehp_fsm.rollout.engine import EngineCore, SamplingParams
from tests.rollout.conftest import make_store


def test_a_request_whose_waiter_went_away_does_not_stop_the_scheduler(tmp_path: Path) -> None:
    store = make_store(tmp_path / "revisions", revisions=(1,))
    core = EngineCore()
    try:
        assert core.update_weights_from_disk(str(store.path(1)))[0]
        core.pause("retract")  # held: the request waits, its waiter gives up
        gone = core.submit(input_ids=[1, 5], params=SamplingParams(max_new_tokens=2))
        assert gone.cancel()
        core.continue_generation()  # it runs, finishes, and nobody is there for its result
        later = core.submit(input_ids=[1, 5, 6], params=SamplingParams(max_new_tokens=2))
        assert later.result(timeout=10)["meta_info"]["finish_reason"]["type"] in ("length", "stop")
    finally:
        core.shutdown()
