"""Model parameters after a DP-zero restore are the source's, bit for bit (real megatron-core on
2 Gloo ranks; see `scenario_restore.py`): DP2 -> DP2 and DP2 -> DP1, BF16 and FP32 parameters.

The DP-zero state carries only master weights; each target rank rebuilds its model parameters
from its own master shards and Megatron's parameter all-gather fills in the rest. Without the
all-gather (`start_param_sync` in `dp_zero_scatter`) about half of every DP2 target's elements
keep their initial values; checked by removing the call: the DP2 test failed, the DP1 test (one
rank owns every shard) passed, as it should.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.megatron.harness import load, run_worlds
from tests.megatron.scenario_restore import DTYPES, restore

pytestmark = [pytest.mark.slow]
TAGS = [tag for tag, _ in DTYPES]
RANKS = 2


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root: Path = tmp_path_factory.mktemp("megatron-restore")
    run_worlds([("restore", RANKS, restore)], root, timeout=150)
    return root


def _check(out: Path, tag: str, target: str) -> None:
    for rank in range(RANKS):
        r = load(out, f"restore.{tag}.{target}.{rank}")
        assert r["version"] == 2
        # The target started elsewhere (the fresh initial weights), so the restore had to move
        # nearly every element: the comparison below is not between equal copies.
        assert sum(r["before"].values()) > 0.9 * _numel(out, tag)
        assert set(r["after"].values()) == {0}, (rank, {k: v for k, v in r["after"].items() if v})


def _numel(out: Path, tag: str) -> int:
    return sum(load(out, f"restore.{tag}.numel").values())


@pytest.mark.timeout(200)
@pytest.mark.parametrize("tag", TAGS)
def test_dp2_to_dp2_restore_rebuilds_every_model_parameter_exactly(out: Path, tag: str) -> None:
    _check(out, tag, "dp2")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("tag", TAGS)
def test_dp2_to_dp1_restore_rebuilds_every_model_parameter_exactly(out: Path, tag: str) -> None:
    _check(out, tag, "dp1")
