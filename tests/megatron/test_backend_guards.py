"""The Megatron backend refuses bad input without corrupting state or hanging a peer (real
megatron-core on 2 Gloo ranks; see `scenario_guards.py`): a Hybrid can take the Core's state at
version 0, a non-finite reduced gradient never reaches the optimizer, and a state DP rank 0
refuses is refused on every rank at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.megatron.harness import load, run_worlds
from tests.megatron.scenario_guards import guards, plain

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root: Path = tmp_path_factory.mktemp("megatron-guards")
    run_worlds([("plain", 2, plain), ("guards", 2, guards)], root, timeout=150)
    return root


def _reports(out: Path) -> list[dict[str, Any]]:
    return [load(out, f"guards.report{rank}") for rank in range(2)]


@pytest.mark.timeout(200)
def test_state_gathered_at_version_zero_changes_nothing(out: Path) -> None:
    r0, r1 = _reports(out)
    assert r0["v0_gather_error"] is None and r1["v0_gather_error"] is None
    assert r0["v0_version"] == 0 and r0["v0_steps"] == [0.0]
    assert "v0_version" not in r1  # the state lands on DP rank 0 only
    assert r0["v0_scatter_error"] is None and r1["v0_scatter_error"] is None
    for rank in range(2):
        mine, theirs = load(out, f"guards.state{rank}"), load(out, f"plain.state{rank}")
        assert mine.keys() == theirs.keys()
        for field in mine:
            assert mine[field].keys() == theirs[field].keys()
            for k in mine[field]:
                assert torch.equal(mine[field][k], theirs[field][k]), (rank, field, k)


@pytest.mark.timeout(200)
def test_a_non_finite_gradient_is_refused_before_the_optimizer_steps(out: Path) -> None:
    for r in _reports(out):
        assert str(r["nan_error"]).startswith("ReductionError the reduced gradient of ")
        assert "holds NaN or Inf; the optimizer did not step" in str(r["nan_error"])
        assert r["nan_state_unchanged"] is True


@pytest.mark.timeout(200)
def test_a_state_refused_on_dp_rank_zero_is_refused_on_every_rank_at_once(out: Path) -> None:
    r0, r1 = _reports(out)
    assert str(r0["scatter_error"]).startswith("OptimizerStateMismatch the transferred optimizer")
    assert str(r1["scatter_error"]).startswith("OptimizerStateMismatch DP rank 0 refused")
    assert r0["scatter_s"] < 10 and r1["scatter_s"] < 10  # the collective timeout is far longer
    for r in (r0, r1):
        assert r["scatter_state_unchanged"] is True
        assert r["after_error"] is None and r["after_version"] == 2


@pytest.mark.timeout(200)
def test_a_state_whose_world_tensors_are_cut_short_is_refused_by_every_rank(out: Path) -> None:
    """Checked on DP rank 0 before any copy: the refusal names the buffer, reaches every rank
    at once, and nothing is installed (without the check both ranks were still stuck at the
    harness's 150 s deadline: DP rank 0 failed inside the copies, its peer waited in the
    scatter)."""
    r0, r1 = _reports(out)
    assert str(r0["short_error"]).startswith(
        "OptimizerStateMismatch the state has no world tensors of"
    ), r0["short_error"]
    assert str(r1["short_error"]).startswith("OptimizerStateMismatch DP rank 0 refused")
    for r in (r0, r1):
        assert r["short_state_unchanged"] is True
        assert r["after_error"] is None and r["after_version"] == 2
