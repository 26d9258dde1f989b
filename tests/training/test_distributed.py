"""Real processes over Gloo: bucketed sample-weighted reduction and DP-zero transfer
Core DP=2 → DP1 Hybrid lane → Core DP=2 with different paddings."""

from __future__ import annotations

import pytest
import torch

from tests.training import workers
from tests.training.harness import run_ranks


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bucketed_weighted_allreduce_over_gloo_equals_full_batch_gradient(tmp_path):
    # 4 KiB buckets: many packed buckets plus in-place chunked all-reduces of big tensors.
    res = run_ranks(workers.reduction_rank, 3, tmp_path, 4096)
    assert sum(r["samples"] for r in res) == 21  # B = 7 groups × 3, fixed
    assert sorted(r["samples"] for r in res) == [6, 6, 9]  # 2, 2 and 3 groups (capacity 1:1:2)
    for r in res:
        assert r["bucket"] <= 4096
        assert r["collectives"] > 10
        for got, want in zip(r["grads"], r["expect"], strict=True):
            torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-4)
    for a, b in zip(res[0]["grads"], res[2]["grads"], strict=True):
        assert torch.equal(a, b)  # every member holds the identical reduced gradient


def _same_world(a, b, *, exact=True):
    assert a["version"] == b["version"]
    assert a["steps"] == b["steps"]
    assert a["hyper"] == b["hyper"]
    for k in a:
        if isinstance(a[k], torch.Tensor):
            if exact:
                assert torch.equal(a[k], b[k]), k
            else:
                torch.testing.assert_close(a[k], b[k], atol=2e-4, rtol=2e-3)


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_dp_zero_core_to_hybrid_and_back_is_exact(tmp_path, dtype):
    core0, core1, hybrid = run_ranks(workers.dp_zero_rank, 3, tmp_path, dtype)
    # Gathered Core state restored into the Hybrid lane (pad 5 vs Core pad 16): exact.
    assert hybrid["hybrid_version"] == 2
    _same_world(core0["core_world_v2"], hybrid["hybrid_world_v2"])
    assert core0["core_world_v2"]["steps"] == dict.fromkeys(core0["core_world_v2"]["steps"], 2.0)
    # The next update is the same on the sharded Core and on the DP1 Hybrid: elementwise
    # Adam on the same gradient in fp32, so bit-exact.
    _same_world(core0["core_world_v3"], hybrid["hybrid_world_v3"])
    for name, p in hybrid["hybrid_params_v3"].items():
        assert p.dtype == (torch.float32 if dtype == "fp32" else torch.bfloat16)
        assert torch.equal(p, core0["core_params_v3"][name]), name
        assert torch.equal(p, core1["core_params_v3"][name]), name
    # Return: Hybrid world → fresh Core DP=2 with pad 3 → gathered again: exact, and every
    # restored piece has its own step tensor.
    _same_world(core0["returned_world"], hybrid["hybrid_world_v3"])
    for r in (core0, core1):
        assert r["returned_step_ptrs"] == r["returned_pieces"]
        assert set(r["returned_steps"]) == {3.0}
        for name, p in r["returned_params"].items():
            assert torch.equal(p, hybrid["hybrid_params_v3"][name]), name


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_dp_zero_with_a_mostly_padding_shard_and_nonzero_source_is_exact(tmp_path):
    r0, r1, r2 = run_ranks(workers.dp_zero_padding_rank, 3, tmp_path)
    assert 0 < r2["real"] <= 3 < r1["real"] == r0["real"]  # rank 2: almost all padding
    for r in (r0, r1, r2):
        assert r["finite"] and r["padding_zero"]  # every NaN was overwritten or zeroed
        assert r["version"] == 2
        for name, p in r["params"].items():
            assert torch.equal(p, r["src_params"][name]), name
    _same_world(r2["world"], r1["world"])  # gathered at rank 2, scattered, gathered at rank 1


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_state_the_source_refuses_is_refused_on_every_rank_at_once(tmp_path):
    r0, r1 = run_ranks(workers.scatter_refusal_rank, 2, tmp_path, timeout=60)
    assert r0["error"].startswith("TrainingStateError buffer 0 holds"), r0["error"]
    assert r1["error"].startswith("TrainingStateError the source rank refused"), r1["error"]
    for r in (r0, r1):
        assert r["seconds"] < 10  # not the collective timeout
        assert r["unchanged"] and r["version"] == 1
