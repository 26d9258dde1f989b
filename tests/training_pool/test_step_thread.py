"""The pool stepped from a thread of its own, as the run does (`run/step.py`'s `Trainer`): the
commit asks first (`on_computed`), a step given up there leaves the Core exactly as it was and
the world usable, and while a step holds the pool the other thread's calls wait for it
(`busy()` says so without waiting).

Real processes, real Gloo, real ZeroMQ; nothing faked.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from ehp_fsm.training.pool import PoolFailure, TrainerPool
from tests.training_pool.rig import HeldStep, batch_of, ok, run_step, tiny_config


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_step_given_up_before_its_commit_steps_nothing(tmp_path: Path) -> None:
    with TrainerPool.spawn(tiny_config(max_hybrids=0), work_dir=tmp_path / "pool") as pool:
        asked: list[tuple[str, ...]] = []

        def refuse(replicas: tuple[str, ...]) -> bool:
            asked.append(replicas)
            return False

        given_up = run_step(pool, 0, 0, batch_of(0), on_computed=refuse)
        assert isinstance(given_up, PoolFailure) and given_up.reason == "cancelled", given_up
        assert not given_up.broken_world and pool.broken is None
        assert asked == [("core:0",)]
        assert pool.core_version == 0  # nothing reduced, nothing stepped
        # the same step again, allowed this time: the world is intact and it steps once
        done = ok(run_step(pool, 0, 0, batch_of(0), on_computed=lambda r: True))
        assert done.version == 1 and pool.core_version == 1


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_step_on_another_thread_holds_the_pool(tmp_path: Path) -> None:
    with TrainerPool.spawn(tiny_config(max_hybrids=1), work_dir=tmp_path / "pool") as pool:
        assert not pool.busy()
        held = HeldStep(pool).start()
        assert pool.busy()  # from this thread: the step holds it

        answered: list[float] = []
        asker = threading.Thread(
            target=lambda: (pool.held_memory(1), answered.append(time.monotonic()))
        )
        asker.start()
        time.sleep(0.5)
        assert not answered  # it waits for the step: one thread at a time on the socket
        released_at = time.monotonic()
        assert held.release().version == 1
        asker.join(60)
        assert answered and answered[0] >= released_at
        assert not pool.busy()
