"""The backend's DP-zero copies (`backends/megatron/shards.py`) are Megatron-Core's format bit
for bit: gather and scatter against megatron-core 0.16.1's own functions on real Gloo ranks
(see `scenario_shards.py`), on a DP2 lane and on DP1 lanes, with several buckets (padded two
ways) and with one, with chunks that cut through parameters.

Checked against mutations of `shards.py`: reading every piece from its parameter's start
(wrong wherever a chunk cuts a parameter) failed all 12 checks with 1,000-element chunks; not
zeroing the gaps between parameters failed the 4 gather checks of the layout with gaps (its
memory starts as NaN in the scenario).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.megatron.harness import load, run_worlds
from tests.megatron.scenario_shards import CHUNKS, LAYOUTS, shards_vs_megatron

pytestmark = [pytest.mark.slow]
RANKS = 2
CASES = [
    f"{tag}.{lane}.chunk{chunk or 'default'}"
    for tag, _, _ in LAYOUTS
    for lane in ("dp2", "dp1")
    for chunk in CHUNKS
]


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out: Path = tmp_path_factory.mktemp("megatron-shards")
    run_worlds([("shards", RANKS, shards_vs_megatron)], out, timeout=150)
    return [load(out, f"shards.report{rank}") for rank in range(RANKS)]


@pytest.mark.timeout(200)
def test_the_layouts_have_the_buckets_they_claim(reports: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(reports):
        for lane in ("dp2", "dp1"):
            assert r[f"bf16-buckets.{lane}.buckets"][0] > 2, r
            assert r[f"bf16-padded.{lane}.buckets"][0] > 2, r
            assert r[f"fp32-one.{lane}.buckets"] == [1]
            for tag, _, _ in LAYOUTS:
                # every rank owns shards, but for the padded DP2 lane's rank 1 (all padding)
                empty = (tag, lane, rank) == ("bf16-padded", "dp2", 1)
                assert (r[f"{tag}.{lane}.owned"] == 0) is empty, (tag, lane, rank)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", CASES)
def test_gather_world_equals_megatrons_bit_for_bit(
    reports: list[dict[str, Any]], case: str
) -> None:
    for rank, r in enumerate(reports):
        assert r[f"{case}.gather"] == [], (rank, r[f"{case}.gather"])
        # DP rank 0 holds the world; a DP2 lane's rank 1 holds nothing, a DP1 lane is its own 0
        assert r[f"{case}.gather_on_rank"] is (rank == 0 or ".dp1." in case)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", CASES)
def test_scatter_world_writes_megatrons_shards_bit_for_bit(
    reports: list[dict[str, Any]], case: str
) -> None:
    for rank, r in enumerate(reports):
        # the comparison is not between equal copies (but where the rank owns nothing)
        assert (r[f"{case}.scramble_moved"] > 0) is (r[f"{case.rsplit('.', 1)[0]}.owned"] > 0)
        assert r[f"{case}.scatter_vs_megatron"] == 0, rank
        assert r[f"{case}.scatter_vs_before"] == 0, rank
