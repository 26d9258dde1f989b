"""A Megatron pool at TP 2 survives its Hybrid lanes dying, as a TP 1 pool does.

Real worker processes (Gloo, Megatron's CPU layer): a Core lane of TP 2 (DP 1) and two warm
TP 2 Hybrid lanes, each lane two processes (TP rank 0 the pool's worker, TP rank 1 its child).

1. Hybrid A's TP rank 0 is killed (SIGKILL) inside the all-reduce of a step (the workers'
   reduction hook, `tests/reduce_hook.py`): the step fails naming it dead, the pool re-forms its
   world without the lane — every surviving TP rank joins the new world at Gloo rank
   member × TP + TP rank, and the Megatron lanes are rebuilt there with their captured state —
   and A's orphaned TP rank 1 exits by itself. The Core's state is bit for bit the state before
   the failed step, and the step retried with Hybrid B trains.
2. Hybrid B's TP rank 1 (the follower, not the process the pool knows) is killed inside the next
   step's all-reduce: its TP rank 0 can no longer run a collective, so it exits too, the pool
   sees the lane dead and re-forms without it; the Core retries alone.

3. Both dead lanes' replacements start on standby (TP rank 0 and its follower), build their
   Megatron lanes when the pool admits them into the world, and a borrow into one holds the
   Core's state bit for bit after a step.

Before, a TP > 1 world was never re-formed: either death broke the pool, and the run with it
(and a Megatron warm worker was never replaced).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from ehp_fsm.training import verify
from ehp_fsm.training.policy import PolicyConfig
from ehp_fsm.training.pool import PoolFailure, TrainerPool
from tests.reduce_hook import KillInsideReduction
from tests.training_pool.rig import batch_of
from tests.training_pool.test_megatron_pool import hooked_megatron_pool, ok

pytestmark = [pytest.mark.slow]


def _follower(pid: int) -> int:
    """The pid of TP rank 1 of the lane whose TP rank 0 is `pid` (its only child)."""
    (child,) = psutil.Process(pid).children()
    return child.pid


def _gone(pid: int, *, within_s: float) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.timeout(300)
def test_a_tp2_pool_re_forms_without_a_dead_hybrid_lane_either_tp_rank(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hook, config = hooked_megatron_pool(
        tmp_path, tiny_model_dir, monkeypatch, core_dp=1, max_hybrids=2, tp=2
    )
    policy = PolicyConfig()

    def batch(step: int) -> Any:
        return batch_of(step, config=policy, groups=6, size=4)

    def kill_inside(victim: int, pid: int, step: int, split: dict[str, Any]) -> PoolFailure:
        (hook / f"hold-{victim}").write_text("")
        killer = KillInsideReduction(hook, victim=victim, hold=f"hold-{victim}", step=step, pid=pid)
        killer.start()
        failed = pool.step(step=step, epoch=step, partition=split, batch=batch(step), publish=False)
        killer.join(10)
        assert killer.killed_at is not None, "the victim never entered the reduction"
        assert isinstance(failed, PoolFailure), failed
        return failed

    with TrainerPool.spawn(config, work_dir=tmp_path / "pool", start_timeout_s=240) as pool:
        ids = batch(0).group_ids
        ok(pool.step(step=0, epoch=0, partition={"core:0": ids}, batch=batch(0), publish=False))
        a, b = pool.idle_warm_ranks()
        rank0 = {w.rank: w.identity.pid for w in pool.workers}
        follower_a, follower_b = _follower(rank0[a]), _follower(rank0[b])
        for rank, replica in ((a, "hybrid:a"), (b, "hybrid:b")):
            assert ok(pool.load_state(rank, replica=replica)).version == 1
            pool.activate(replica)
        ids = batch(1).group_ids
        three = {"core:0": ids[:2], "hybrid:a": ids[2:4], "hybrid:b": ids[4:]}
        ok(pool.step(step=1, epoch=1, partition=three, batch=batch(1), publish=False))
        ok(pool.save_state(tmp_path / "core-1"))

        # 1. Hybrid A's TP rank 0 dies inside the all-reduce of step 2
        ids = batch(2).group_ids
        split = {"core:0": ids[:2], "hybrid:a": ids[2:4], "hybrid:b": ids[4:]}
        failed = kill_inside(a, rank0[a], 2, split)
        assert failed.reason == "dead" and failed.rank == a, failed
        assert pool.broken is None and pool.core_version == 2, pool.broken  # nothing stepped
        assert _gone(follower_a, within_s=30), "the dead lane's TP rank 1 outlived it"
        ok(pool.save_state(tmp_path / "core-1-reformed"))
        same = verify.compare_states(tmp_path / "core-1", tmp_path / "core-1-reformed", exact=True)
        assert same.passed, same.lines()  # the rebuilt TP shards hold exactly the state
        pool.deactivate("hybrid:a")
        two = {"core:0": ids[:3], "hybrid:b": ids[3:]}
        assert ok(pool.step(step=2, epoch=3, partition=two, batch=batch(2))).version == 3

        # 2. Hybrid B's TP rank 1 dies inside the all-reduce of step 3
        ok(pool.save_state(tmp_path / "core-3"))
        ids = batch(3).group_ids
        failed = kill_inside(b, follower_b, 3, {"core:0": ids[:3], "hybrid:b": ids[3:]})
        assert failed.reason == "dead" and failed.rank == b, failed
        # (it named lane rank 0's own exit, code 5, not that its follower had died first)
        assert "exited with code 5: another rank of its lane exited first" in failed.detail
        assert pool.broken is None and pool.core_version == 3, pool.broken
        assert _gone(rank0[b], within_s=30), "TP rank 0 of a lane that lost a shard lived on"
        ok(pool.save_state(tmp_path / "core-3-reformed"))
        same = verify.compare_states(tmp_path / "core-3", tmp_path / "core-3-reformed", exact=True)
        assert same.passed, same.lines()
        pool.deactivate("hybrid:b")
        alone = ok(pool.step(step=3, epoch=4, partition={"core:0": ids}, batch=batch(3)))
        assert alone.version == 4 and alone.replicas == ("core:0",)

        # 3. both replacements, started on standby with their followers, build their TP 2
        # Megatron lanes when admitted into the world; a borrow into one is the Core's state
        assert pool.admit_replacements(wait_s=180) is None
        assert sorted(pool.idle_warm_ranks()) == [a, b]
        assert ok(pool.load_state(a, replica="hybrid:c")).version == 4
        pool.activate("hybrid:c")
        ids = batch(4).group_ids
        split = {"core:0": ids[:3], "hybrid:c": ids[3:]}
        assert ok(pool.step(step=4, epoch=5, partition=split, batch=batch(4))).version == 5
        ok(pool.save_state(tmp_path / "core-5"))
        ok(pool.save_state(tmp_path / "hybrid-5", rank=a))
        same = verify.compare_states(tmp_path / "core-5", tmp_path / "hybrid-5", exact=True)
        assert same.passed, same.lines()
