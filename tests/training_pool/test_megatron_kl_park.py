"""A Megatron Hybrid lane with a KL reference (`kl_coef > 0`) parks free and borrows again.

A parked Megatron lane stays built (its world's groups live in it) and empties its state's
storages; the state load writes them again. The KL reference is no state: before, it stayed in
memory, so the parked worker was never free (its GPU would have stayed `releasing`) and `check`
refused Megatron Hybrids with `kl_coef > 0`. Now the lane drops it at the park and builds it
again at the next load. And a warm Megatron worker, whose lane is built with its world, empties
it at once: before its first borrow it holds nothing either (before, the whole lane).

Two pools of real worker processes (Megatron Core DP1 + one warm Hybrid lane, Gloo, Megatron's
CPU layer, the tiny HF model) take the same three steps with the same partitions: pool A parks
the Hybrid between steps 1 and 2 and loads the Core's state into it again; pool B keeps it
bound. The park must report free, and step 2 — where the Hybrid's loss has a KL term against
its rebuilt reference — must come out bit for bit as in pool B (loss, KL sums, the Core's
state): a reference rebuilt from other weights, or not at all, would change them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ehp_fsm.training import verify
from ehp_fsm.training.adam import AdamConfig
from ehp_fsm.training.objective import ObjectiveConfig
from ehp_fsm.training.policy import PolicyConfig
from ehp_fsm.training.pool import PoolConfig, StepResult, TrainerPool
from tests.training_pool.rig import batch_of, ok

pytestmark = [pytest.mark.slow]

POLICY = PolicyConfig()  # the tiny model's ids are the built-in task's


def _batch(step: int) -> Any:
    return batch_of(step, config=POLICY, groups=4, size=4)


def _split(step: int, hybrid: str) -> dict[str, Any]:
    ids = _batch(step).group_ids
    return {"core:0": ids[:2], hybrid: ids[2:]}


def _three_steps(tmp_path: Path, model: Path, *, park: bool) -> tuple[StepResult, Path]:
    config = PoolConfig(
        model=str(model),
        backend="megatron",
        objective=ObjectiveConfig(aggregation="token_mean", kl_coef=0.05),
        adam=AdamConfig(lr=1e-3, eps=1e-6, fused=True),
        revisions=str(tmp_path / "revisions"),
        core_dp=1,
        max_hybrids=1,
    )
    with TrainerPool.spawn(config, work_dir=tmp_path / "pool", start_timeout_s=200) as pool:
        warm = pool.idle_warm_ranks()[0]
        # a warm Megatron lane is built with its world, then emptied: it holds nothing until
        # the first borrow loads state into it
        fresh = ok(pool.held_memory(warm))
        assert fresh.free and fresh.lane_bytes == 0, fresh.why_not_free()
        ids = _batch(0).group_ids
        ok(pool.step(step=0, epoch=0, partition={"core:0": ids}, batch=_batch(0), publish=False))
        ok(pool.load_state(warm, replica="hybrid:x"))
        pool.activate("hybrid:x")
        ok(pool.step(step=1, epoch=1, partition=_split(1, "hybrid:x"), batch=_batch(1)))
        hybrid = "hybrid:x"
        if park:
            pool.deactivate("hybrid:x")
            held = ok(pool.park(warm))
            assert held.free, held.why_not_free()
            assert held.by_kind.get("reference", 0) == 0, held
            assert ok(pool.load_state(warm, replica="hybrid:y")).version == 2
            pool.activate("hybrid:y")
            hybrid = "hybrid:y"
        res = ok(pool.step(step=2, epoch=2, partition=_split(2, hybrid), batch=_batch(2)))
        ok(pool.save_state(tmp_path / "core"))
        ok(pool.save_state(tmp_path / "hybrid", rank=warm))
    same = verify.compare_states(tmp_path / "core", tmp_path / "hybrid", exact=True)
    assert same.passed, same.lines()
    return res, tmp_path / "core"


@pytest.mark.timeout(300)
def test_a_megatron_hybrid_with_a_kl_reference_parks_free_and_borrows_again_exactly(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    parked, parked_state = _three_steps(tmp_path / "a", tiny_model_dir, park=True)
    kept, kept_state = _three_steps(tmp_path / "b", tiny_model_dir, park=False)
    assert parked.metrics.kl_ref_sum > 0, parked.metrics  # the KL term is really there
    assert parked.loss == kept.loss and parked.metrics == kept.metrics
    report = verify.compare_states(parked_state, kept_state, exact=True)
    assert report.passed, report.lines()
