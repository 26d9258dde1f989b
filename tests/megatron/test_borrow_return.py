"""Headline: a DP1 Hybrid lane borrowed from a DP2 Megatron-Core Core, then given back.

Real Megatron-Core (GPTModel, DDP, DistributedOptimizer with torch AdamW, FP32 master weights) in
one Gloo world of three real processes (Core DP2 on ranks 0-1, the DP1 Hybrid on rank 2; while
the Hybrid is live all three reduce their deliveries with the torch path's sample-weighted
`weighted_allreduce_`), once with BF16 and once with FP32 model parameters; see
`scenario_borrow.py` for the schedule. Which comparison applies, and why:

- Exact (bitwise), both dtypes: the restored Hybrid state, the next update on both sides, the
  Hybrid's state when it returns, a Core state restored from its capture, and Core-only steps
  against Megatron's own DDP path (the same arithmetic in the same order on both sides).
- The fixed-batch split run (Core + Hybrid 4/2/2, Hybrid returned, Core-only continuation)
  against the Core-only reference, which runs Megatron's own micro-batch schedule (one GRPO
  group per micro-batch, loss / micro-batches, FP32 grad accumulation, reduce-scatter): within
  `CONTINUATION_TOLERANCE` (atol 2e-4 / rtol 2e-3, the seed's own validation tolerance) on every
  tensor (masters, exp_avg, exp_avg_sq, model parameters), both dtypes, steps exact. The two
  runs add the same group gradients in a different order (a weighted all-reduce over three
  replicas against micro-batch accumulation and a reduce-scatter over two), and FP32 addition
  is not associative, so no bit-exactness holds by construction:
  * FP32 parameters: the group gradients are FP32 and their weighted sums round differently for
    a different partition; a tighter atol 1e-6 on the masters (measured 6e-8) shows the
    difference is rounding, not a wrong weight (which the tolerance would hide for a few steps
    at lr 1e-3). `test_fp32_split_run_is_not_bitwise_the_reference` proves the runs differ.
  * BF16 parameters: a group's weight gradient leaves the BF16 backward rounded to BF16, the
    same bits on whichever replica computes it (one group per micro-batch in the backend and in
    the reference), and the weights nᵢ/B, 1/micro-batches are powers of two; the FP32 sum of a
    few BF16 values is exact in any order only while their exponents lie close together. That
    held on CPUs without AVX512-BF16 (the runs matched bit for bit), but on an AVX512-BF16 CPU
    (other BF16 GEMM kernels, other gradient values) one exp_avg_sq element differed by one
    FP32 ulp (7e-15 on 1.1e-7) from step 4 on. So BF16 gets the same tolerance (and the same
    1e-6 bound on the masters), not a bitwise claim that depends on the CPU.
  `test_continuation_tolerance_catches_a_real_error` shows the tolerance still catches a 1e-2
  error in any compared tensor.
  Root cause of the looser tolerances of session 1 (exp_avg 2.3e-4, BF16 params one ulp):
  each replica ran its whole share as one micro-batch, so the BF16 weight-gradient GEMM
  contracted a different set of samples before rounding to BF16 (relative differences up to
  2⁻⁸, not FP32 summation noise); the differing masters then flipped BF16 parameter roundings,
  which changed later forwards.
- In both dtypes every published model parameter is exactly its FP32 master rounded to the
  model dtype on every rank (checked in the workers), so comparing the masters compares the
  parameters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.megatron.harness import load, run_worlds
from tests.megatron.scenario_borrow import DTYPES, WORLD_SIZE, reference, scenario

pytestmark = [pytest.mark.slow]
KEYS = ("param", "exp_avg", "exp_avg_sq")
TAGS = [tag for tag, _ in DTYPES]
# The split continuation against the Core-only reference (different summation order, so
# different FP32 roundings): the tolerance the seed's own validation used for its continuation
# comparisons (issue 13 item 6). Restores of state are compared bit for bit, never with this.
CONTINUATION_TOLERANCE = {"atol": 2e-4, "rtol": 2e-3}
# The masters only move by rounding noise (measured 6e-8 in FP32): a wrong weight shows here
# long before it exceeds CONTINUATION_TOLERANCE.
MASTER_ATOL = 1e-6


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = tmp_path_factory.mktemp("megatron-borrow")
    run_worlds([("ehp", WORLD_SIZE, scenario), ("ref", 2, reference)], path, timeout=220)
    return path


def _world(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    flat = {}
    for idx, per_dtype in state["buffers"].items():
        for dtype_key, entry in per_dtype.items():
            for key in KEYS:
                flat[f"{idx}.{dtype_key}.{key}"] = entry[key]
    return flat


def _assert_consistent(state: dict[str, Any], tag: str) -> None:
    assert state["rounded_masters"] is True  # params == masters rounded, on every rank
    want = dict(DTYPES)[tag]
    assert {p.dtype for p in state["params"].values()} == {want}


def _assert_exact(a: dict[str, Any], b: dict[str, Any], tag: str, *, versions: bool = True) -> None:
    _assert_consistent(a, tag)
    _assert_consistent(b, tag)
    assert a["version"] == b["version"] or not versions
    assert a["steps"] == b["steps"]
    wa, wb = _world(a), _world(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert wa[k].dtype == torch.float32
        assert torch.equal(wa[k], wb[k]), k
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k


def _assert_close(a: dict[str, Any], b: dict[str, Any], tag: str) -> None:
    """CONTINUATION_TOLERANCE on every compared tensor, MASTER_ATOL on the masters; steps
    exact."""
    _assert_consistent(a, tag)
    _assert_consistent(b, tag)
    assert a["steps"] == b["steps"]
    wa, wb = _world(a), _world(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], **CONTINUATION_TOLERANCE)
        if k.endswith(".param"):
            torch.testing.assert_close(wa[k], wb[k], atol=MASTER_ATOL, rtol=0.0)
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        torch.testing.assert_close(a["params"][k], b["params"][k], **CONTINUATION_TOLERANCE)


@pytest.mark.timeout(280)
@pytest.mark.parametrize("tag", TAGS)
def test_hybrid_restored_from_core_is_exact_despite_different_padding(out: Path, tag: str) -> None:
    core_buckets, hybrid_buckets = (
        load(out, f"core.{tag}.buckets"),
        load(out, f"hybrid.{tag}.buckets"),
    )
    assert [u for _, u in core_buckets] == [u for _, u in hybrid_buckets]  # same content
    assert [n for n, _ in core_buckets] != [n for n, _ in hybrid_buckets]  # different padding
    assert len(core_buckets) > 1  # bucket padding sits inside the buffer, not only at its end
    restored, source = load(out, f"hybrid.{tag}.restored"), load(out, f"core.{tag}.v2")
    assert restored["version"] == 2
    assert set(restored["steps"].values()) == {2.0}
    _assert_exact(restored, source, tag)


@pytest.mark.timeout(280)
@pytest.mark.parametrize("tag", TAGS)
def test_next_update_and_return_are_exact(out: Path, tag: str) -> None:
    _assert_exact(load(out, f"hybrid.{tag}.v3"), load(out, f"core.{tag}.v3"), tag)
    # Core state is authoritative at return: the Hybrid holds the same bits.
    _assert_exact(load(out, f"hybrid.{tag}.v5"), load(out, f"core.{tag}.v5"), tag)
    assert set(load(out, f"core.{tag}.v5")["steps"].values()) == {5.0}
    assert load(out, f"hybrid.{tag}.shared_steps") == 0
    assert load(out, f"core.{tag}.shared_steps0") == load(out, f"core.{tag}.shared_steps1") == 0


@pytest.mark.timeout(280)
@pytest.mark.parametrize("tag", TAGS)
def test_borrow_and_return_match_core_only_reference(out: Path, tag: str) -> None:
    # Core-only steps through the backend (Σ (nᵢ/B)·ḡᵢ) are the same arithmetic as Megatron's
    # own DDP path ((1/DP)·ḡᵢ summed by reduce-scatter) with equal shares: bitwise equal.
    # (The reference steps outside the backend, so its lane version stays 0.)
    _assert_exact(load(out, f"core.{tag}.v2"), load(out, f"core.{tag}.ref.v2"), tag, versions=False)
    for version in (3, 5, 7):  # during the borrow, at the return, after the continuation
        split, reference = (
            load(out, f"core.{tag}.v{version}"),
            load(out, f"core.{tag}.ref.v{version}"),
        )
        assert split["version"] == version
        _assert_close(split, reference, tag)
    final = load(out, f"core.{tag}.v7")
    moved = max(
        float(
            (load(out, f"core.{tag}.v2")["params"][k].float() - final["params"][k].float())
            .abs()
            .max()
        )
        for k in final["params"]
    )
    assert moved > 1e-3  # the comparison is not between untrained copies


@pytest.mark.timeout(280)
@pytest.mark.parametrize("tag", TAGS)
def test_continuation_tolerance_catches_a_real_error(out: Path, tag: str) -> None:
    # The comparison above is a tolerance; it must still fail for a real error: 1e-2 added to
    # one element of any compared tensor (a master, a moment, a model parameter) is caught.
    split, reference = load(out, f"core.{tag}.v7"), load(out, f"core.{tag}.ref.v7")
    _assert_close(split, reference, tag)  # the unperturbed pair passes
    targets: list[tuple[Any, ...]] = [
        ("buffers", idx, dtype_key, key)
        for idx, per_dtype in reference["buffers"].items()
        for dtype_key in per_dtype
        for key in KEYS
    ] + [("params", k) for k in reference["params"]]
    for path in targets:
        wrong = load(out, f"core.{tag}.ref.v7")
        tensor = wrong
        for part in path:
            tensor = tensor[part]
        flat = tensor.view(-1)
        flat[flat.numel() // 3] += 1e-2
        with pytest.raises(AssertionError):
            _assert_close(split, wrong, tag)


@pytest.mark.timeout(280)
def test_fp32_split_run_is_not_bitwise_the_reference(out: Path) -> None:
    # The FP32 comparison above is a tolerance because the arithmetic differs; prove it does
    # (if it ever became bitwise equal, the test would say less than it claims).
    split, reference = _world(load(out, "core.fp32.v7")), _world(load(out, "core.fp32.ref.v7"))
    assert any(not torch.equal(split[k], reference[k]) for k in split)


@pytest.mark.timeout(280)
@pytest.mark.parametrize("tag", TAGS)
def test_core_capture_restore_brings_back_every_bit(out: Path, tag: str) -> None:
    # LaneState captured at version 2, restored after five more steps (BF16 params too).
    assert load(out, f"core.{tag}.restore_equal0") is True
    assert load(out, f"core.{tag}.restore_equal1") is True
    _assert_exact(load(out, f"core.{tag}.restored_v2"), load(out, f"core.{tag}.v2"), tag)
