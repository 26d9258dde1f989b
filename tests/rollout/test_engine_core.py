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


def test_a_retract_during_a_forward_pass_does_not_shift_the_sampling_stream(
    tmp_path: Path,
) -> None:
    """The retract lands between the forward pass and the sampling of that pass's token (the
    scheduler does not hold the engine's lock there). The discarded token must draw from the
    old generator: drawing from the fresh one shifted the whole regenerated sequence (seen in CI
    as `test_retracted_request_regenerates_identically` failing one run in many)."""
    store = make_store(tmp_path / "revisions", revisions=(1,))
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, sampling_seed=5)
    core = EngineCore()
    try:
        assert core.update_weights_from_disk(str(store.path(1)))[0]
        reference = core.submit(input_ids=[1, 5, 6], params=params).result(timeout=30)
        passes = 0

        def retract_on_the_fourth_pass(*_: object) -> None:
            nonlocal passes
            passes += 1
            if passes == 4:  # inside the scheduler thread, between forward and sample
                core.pause("retract")
                core.continue_generation()

        model = core._model
        assert model is not None
        hook = model.register_forward_hook(retract_on_the_fourth_pass)
        try:
            result = core.submit(input_ids=[1, 5, 6], params=params).result(timeout=30)
        finally:
            hook.remove()
        assert result["meta_info"]["num_retractions"] == 1
        assert result["output_ids"] == reference["output_ids"]
    finally:
        core.shutdown()
