"""A Megatron PP 2 Hybrid lane killed while the group of its step forms costs seconds.

Real worker processes (Gloo, Megatron's CPU layer): a Core lane of PP 2 (DP 1) and one warm PP 2
Hybrid lane, each two processes (stage 0 the pool's worker, stage 1 its child). The first step
with the Hybrid forms the group of pool ranks [0, 1]; the Hybrid's stage 0 is held at the door
of that formation (the workers' test hook) and killed there, while the Core's stage 0 already
waits in `dist.new_group` for it. The group was formed with `collective_timeout_s` as its
time-out, which bounds the formation too (gloo waits that long for a peer's address, 5 x that
for a peer to connect): the Core stayed in `new_group` for the collective time-out (at the
door, 60 s here) or five times it (inside the formation: in one CI run of
`tests/run/test_megatron_hybrid_dies.py[pp2]`, 300 s, and the test timed out). Formed within
`worker.form_timeout_s`, the step fails within seconds, the world is re-formed without the lane,
the Core's state is what it was, and the step retried on the Core trains.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ehp_fsm.training import verify
from ehp_fsm.training.policy import PolicyConfig
from ehp_fsm.training.pool import PoolFailure, TrainerPool
from ehp_fsm.training.worker import form_timeout_s
from tests.procs import kill_and_wait
from tests.training_pool.rig import batch_of
from tests.training_pool.test_megatron_pool import hooked_megatron_pool, ok

COLLECTIVE_S = 60.0  # the run's `collective_timeout_s` (`PoolConfig`'s default)


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_a_pp2_hybrid_lane_killed_in_its_group_formation_fails_the_step_within_seconds(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hook, config = hooked_megatron_pool(
        tmp_path,
        tiny_model_dir,
        monkeypatch,
        core_dp=1,
        max_hybrids=1,
        pp=2,
        collective_timeout_s=COLLECTIVE_S,
    )
    policy = PolicyConfig()

    def batch(step: int) -> Any:
        return batch_of(step, config=policy, groups=6, size=4)

    with TrainerPool.spawn(config, work_dir=tmp_path / "pool", start_timeout_s=240) as pool:
        ids = batch(0).group_ids
        ok(pool.step(step=0, epoch=0, partition={"core:0": ids}, batch=batch(0), publish=False))
        ok(pool.save_state(tmp_path / "core-1"))
        (warm,) = pool.idle_warm_ranks()
        pid = next(w.identity.pid for w in pool.workers if w.rank == warm)
        assert ok(pool.load_state(warm, replica="hybrid:a")).version == 1
        pool.activate("hybrid:a")

        # its 2nd formation (the Core group was the 1st): the group of the step's members
        hold, entered = hook / f"hold-form-{warm}", hook / f"form-{warm}-1"
        hold.write_text("")

        def kill() -> None:  # killed at the door, then the hold lifted (for its replacement)
            end = time.monotonic() + 120
            while not entered.exists() and time.monotonic() < end:
                time.sleep(0.01)
            kill_and_wait(pid)
            hold.unlink()

        killer = threading.Thread(target=kill, daemon=True)
        killer.start()
        ids = batch(1).group_ids
        split = {"core:0": ids[:3], "hybrid:a": ids[3:]}
        t0 = time.monotonic()
        failed = pool.step(step=1, epoch=1, partition=split, batch=batch(1), publish=False)
        took = time.monotonic() - t0
        killer.join(10)
        assert entered.exists(), "the Hybrid never entered the formation"
        assert isinstance(failed, PoolFailure) and not failed.broken_world, failed
        assert (failed.reason, failed.rank) == ("dead", warm), failed
        # the Core waits `form_timeout_s` (10 s) for the dead lane, not the collective time-out
        assert form_timeout_s(COLLECTIVE_S) < 0.5 * COLLECTIVE_S
        assert took < 0.75 * COLLECTIVE_S, f"{took:.1f} s: the Core waited out the formation"
        assert pool.broken is None and pool.core_version == 1, pool.broken  # nothing stepped
        assert pool.world_members == (0,) and pool.reforms[-1].dead == (warm,), pool.reforms
        ok(pool.save_state(tmp_path / "core-1-reformed"))
        same = verify.compare_states(tmp_path / "core-1", tmp_path / "core-1-reformed", exact=True)
        assert same.passed, same.lines()  # the rebuilt stages hold exactly the state

        pool.deactivate("hybrid:a")
        alone = ok(pool.step(step=1, epoch=2, partition={"core:0": ids}, batch=batch(1)))
        assert alone.version == 2 and alone.replicas == ("core:0",)
