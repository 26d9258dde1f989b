"""The trainer pool on the Megatron backend: a Core of two Megatron DP ranks (the
DistributedOptimizer sharded over them) and a warm DP1 Megatron Hybrid lane, all built from an
HF directory through mbridge in real worker processes (Gloo, Megatron's CPU layer).

What is shown: the state load (DP-zero gather over the Core's two shards → point to point →
scatter into the DP1 lane) and the step after it, with the Hybrid live, leave the Hybrid's
whole state — parameters, FP32 masters, both Adam moments, per-parameter steps — equal to the
Core's bit for bit; Core rank 0 publishes a revision that `from_pretrained` loads. Then the
Hybrid is killed (SIGKILL) inside the next step's all-reduce (the workers' reduction hook,
`tests/reduce_hook.py`): the pool re-forms its world without it, the Core's Megatron lanes are
rebuilt in the new world with their captured state (`training.lanes.move_lane`), the Core's
state is bit for bit the one before the failed step, and the step retried on the Core trains.
The dead worker's replacement starts on standby and builds its Megatron lane when the pool
admits it into the world; a borrow into it is again bit for bit the Core's state.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from ehp_fsm.training import verify
from ehp_fsm.training.adam import AdamConfig
from ehp_fsm.training.objective import ObjectiveConfig
from ehp_fsm.training.pool import PoolConfig, PoolFailure, StepResult, TrainerPool
from ehp_fsm.training.worker import REDUCE_HOOK_ENV
from tests.reduce_hook import KillInsideReduction
from tests.training_pool.rig import batch_of

pytestmark = [pytest.mark.slow]


def ok(result: object) -> Any:
    assert not isinstance(result, PoolFailure), str(result)
    return result


def hooked_megatron_pool(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch, **kw: Any
) -> tuple[Path, PoolConfig]:
    """The reduction hook's folder (named in the environment the workers inherit) and a
    Megatron pool's config on `model_dir` with the run's Adam (`job_adam`); `kw`: its shape."""
    hook = tmp_path / "hook"
    hook.mkdir()
    monkeypatch.setenv(REDUCE_HOOK_ENV, str(hook))
    return hook, PoolConfig(
        model=str(model_dir),
        backend="megatron",
        objective=ObjectiveConfig(aggregation="token_mean"),
        adam=AdamConfig(lr=1e-3, eps=1e-6, fused=True),
        revisions=str(tmp_path / "revisions"),
        **kw,
    )


@pytest.mark.timeout(240)
def test_megatron_core_dp2_and_a_hybrid_lane_stay_bit_identical(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ehp_fsm.training.policy import PolicyConfig

    hook, config = hooked_megatron_pool(
        tmp_path, tiny_model_dir, monkeypatch, core_dp=2, max_hybrids=1
    )
    policy = PolicyConfig()  # the tiny model's ids are the built-in task's

    def batch(step: int) -> Any:
        return batch_of(step, config=policy, groups=6, size=4)

    with TrainerPool.spawn(config, work_dir=tmp_path / "pool", start_timeout_s=200) as pool:
        ids = batch(0).group_ids
        core_only = {"core:0": ids[:3], "core:1": ids[3:]}
        ok(pool.step(step=0, epoch=0, partition=core_only, batch=batch(0), publish=False))
        warm = pool.idle_warm_ranks()[0]
        assert ok(pool.load_state(warm, replica="hybrid:x")).version == 1
        pool.activate("hybrid:x")
        ids = batch(1).group_ids
        split = {"core:0": ids[:2], "core:1": ids[2:4], "hybrid:x": ids[4:]}
        res: StepResult = ok(pool.step(step=1, epoch=1, partition=split, batch=batch(1)))
        assert res.replicas == ("core:0", "core:1", "hybrid:x") and res.version == 2
        ok(pool.save_state(tmp_path / "core"))
        ok(pool.save_state(tmp_path / "hybrid", rank=warm))
        report = verify.compare_states(tmp_path / "core", tmp_path / "hybrid", exact=True)
        assert report.passed, report.lines()
        revision = res.revision_path
        # the Hybrid dies inside the all-reduce of step 2
        pid = next(w.identity.pid for w in pool.workers if w.rank == warm)
        (hook / f"hold-{warm}").write_text("")
        killer = KillInsideReduction(hook, victim=warm, hold=f"hold-{warm}", step=2, pid=pid)
        killer.start()
        ids = batch(2).group_ids
        split = {"core:0": ids[:2], "core:1": ids[2:4], "hybrid:x": ids[4:]}
        failed = pool.step(step=2, epoch=1, partition=split, batch=batch(2), publish=False)
        killer.join(10)
        assert isinstance(failed, PoolFailure) and failed.reason == "dead", failed
        assert pool.broken is None and pool.core_version == 2  # re-formed; nothing stepped
        ok(pool.save_state(tmp_path / "core-reformed"))
        same = verify.compare_states(tmp_path / "core", tmp_path / "core-reformed", exact=True)
        assert same.passed, same.lines()  # the rebuilt lanes hold exactly the state
        pool.deactivate("hybrid:x")
        core_only = {"core:0": ids[:3], "core:1": ids[3:]}
        retried = ok(pool.step(step=2, epoch=2, partition=core_only, batch=batch(2)))
        assert retried.version == 3 and retried.replicas == ("core:0", "core:1")
        # its replacement, started on standby, builds its Megatron lane when admitted into the
        # world (with the world, as every Megatron lane is built), then takes a borrow exactly
        assert pool.admit_replacements(wait_s=120) is None and pool.idle_warm_ranks() == (warm,)
        assert ok(pool.load_state(warm, replica="hybrid:y")).version == 3
        pool.activate("hybrid:y")
        ids = batch(3).group_ids
        split = {"core:0": ids[:2], "core:1": ids[2:4], "hybrid:y": ids[4:]}
        assert ok(pool.step(step=3, epoch=3, partition=split, batch=batch(3))).version == 4
        ok(pool.save_state(tmp_path / "core-4"))
        ok(pool.save_state(tmp_path / "hybrid-4", rank=warm))
        report = verify.compare_states(tmp_path / "core-4", tmp_path / "hybrid-4", exact=True)
        assert report.passed, report.lines()
        pool.deactivate("hybrid:y")
        _restore_is_held_to_the_save(pool, tmp_path / "core")
    assert revision is not None
    from transformers import AutoModelForCausalLM

    auto: Any = AutoModelForCausalLM
    _, info = auto.from_pretrained(revision, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def _restore_is_held_to_the_save(pool: TrainerPool, saved: Path) -> None:
    """A resume's restore into the two Core ranks: the state saved after step 2 comes back bit
    for bit (each rank's lane hashed against the save's digests: rank 0 all of it, rank 1 its
    parameters); a copy with one master element changed on disk is installed as read and then
    refused, naming the tensor, and the pool stays usable (the failure is local)."""
    got = ok(pool.restore_state(saved))
    assert got.version == 2 and list(got.checked) == ["tp0"], got
    assert got.checked["tp0"]["tensors"] == len(verify.read_index(saved)["tensors"])
    digest = verify.combine_digests({"tp0": got.checked["tp0"]["digest"]})
    assert digest == verify.state_digest(saved)
    damaged = saved.parent / "core-damaged"
    shutil.copytree(saved, damaged)
    entry = next(e for e in verify.read_index(damaged)["tensors"] if e["key"].startswith("master/"))
    t = torch.load(damaged / entry["file"], weights_only=True)
    t.view(-1)[0] += 1.0
    torch.save(t, damaged / entry["file"])
    failed = pool.restore_state(damaged)
    assert isinstance(failed, PoolFailure) and failed.reason == "worker_error", failed
    name = entry["key"].split("/", 1)[1]
    assert "is not the saved one" in failed.detail and name in failed.detail, failed.detail
    assert pool.broken is None
    assert ok(pool.restore_state(saved)).version == 2  # the intact state still restores
