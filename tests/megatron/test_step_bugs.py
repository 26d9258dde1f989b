"""Megatron-Core's torch-Adam step bugs, reproduced with real Megatron code on 2 Gloo ranks.

Each test asserts both that unmodified megatron-core 0.16.1 shows the bug (so a Megatron upgrade
that fixes it is noticed) and that the backend's path restores independent per-parameter steps.
Without the backend's fix the second half of each test fails (checked by removing each fix in
turn: the per-parameter steps in `dp_zero_scatter`, the clone in `load_optimizer_state_dict`,
the step re-install and the `no_grad` in `load_dp_reshardable_checkpoint`; each removal failed
its own test and no other). `dp_zero_scatter` no longer calls Megatron's loader for (a):
`shards.scatter_world` writes the shards through detached views, so neither the step nor the
leaf view can trip it (removing its `no_grad` changed no test's result).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.megatron.harness import load, run_worlds
from tests.megatron.scenario_bugs import bugs

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out: Path = tmp_path_factory.mktemp("megatron-bugs")
    run_worlds([("core", 2, bugs)], out, timeout=150)
    return [load(out, f"core.bugs{rank}") for rank in range(2)]


@pytest.mark.timeout(200)
def test_dp_zero_load_keyerror_step_and_leaf_view_are_fixed(reports: list[dict[str, Any]]) -> None:
    for r in reports:
        assert r["a_raw"].startswith("RuntimeError a view of a leaf Variable that requires grad")
        assert r["a_raw_no_grad"] == "KeyError 'step'"
        assert r["a_fixed_error"] is None
        assert r["a_observe_error"] is None
        assert r["a_fixed_equal"] is True
        assert r["a_fixed_steps"] == [2.0] * r["params"]
        assert r["a_fixed_shared"] == 0


@pytest.mark.timeout(200)
def test_load_state_dict_shared_step_is_fixed(reports: list[dict[str, Any]]) -> None:
    for r in reports:
        n = r["params"]
        assert n > 1
        assert r["b_raw_shared"] == n
        # One update advances the one shared tensor once per parameter: wrong bias correction.
        assert r["b_raw_steps_after_one_update"] == [2.0 + n] * n
        assert r["b_fixed_error"] is None
        assert r["b_fixed_shared"] == 0
        assert r["b_fixed_steps_after_one_update"] == [3.0] * n


@pytest.mark.timeout(200)
def test_dp_reshardable_checkpoint_stale_step_is_fixed(reports: list[dict[str, Any]]) -> None:
    for r in reports:
        n = r["params"]
        saved = r["c_saved_steps"]
        assert saved == [saved[0]] * n
        assert r["c_in_memory_steps_before_load"] == [saved[0] + 2] * n
        assert r["c_raw_steps"] == r["c_in_memory_steps_before_load"]  # stale
        assert r["c_fixed_error"] is None
        assert r["c_fixed_steps"] == saved
        assert r["c_fixed_shared"] == 0


@pytest.mark.timeout(200)
def test_capture_restore_round_trip_in_the_protocols_lane_state(
    reports: list[dict[str, Any]],
) -> None:
    # The state was captured at step 2, the lane then reloaded it through the DP-zero path;
    # restore() must bring back every bit (masters, moments, params, hyperparameters) with one
    # independent step tensor per parameter.
    for r in reports:
        assert r["is_training_backend"] is True
        assert r["restore_is_lane_state"] is True
        assert r["restore_equal"] is True
        assert r["restore_shared"] == 0
