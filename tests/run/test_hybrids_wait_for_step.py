"""A Hybrid's commands wait while a training step holds the trainer pool, and the loop does not
wait with them: the launch posted during the step returns at once (the Hybrid stays
`launching`), and once the step is over the loop's next turns bind the warm worker and load the
state that step made.

Real pieces, as in `test_hybrid_finalizer.py`: the orchestrator built from `examples/local.toml`,
the shell's loop, a real trainer pool (Core rank + one warm worker process, Gloo, ZeroMQ), the
run's `WarmHybrids`; the step runs on a thread of its own as the run's `Trainer` runs it, held at
its commit (`on_computed`) until the test lets it go.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ehp_fsm import Orchestrator, load_plan
from ehp_fsm.run.hybrids import HYBRID, WarmHybrids
from ehp_fsm.shell.loop import Loop
from ehp_fsm.training.pool import TrainerPool
from tests.run.test_hybrid_finalizer import PLAN, _must, _state
from tests.training_pool.rig import HeldStep, tiny_config


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_launch_during_a_step_waits_for_it_without_the_loop(tmp_path: Path) -> None:
    orch = Orchestrator.from_plan(load_plan(PLAN), log_path=tmp_path / "t.jsonl", check=True)
    loop = Loop(orch, clock=time.monotonic)
    try:
        with TrainerPool.spawn(tiny_config(), work_dir=tmp_path / "pool") as pool:
            hybrids = WarmHybrids(loop, pool)
            loop.add(hybrids)
            held = HeldStep(pool).start()
            assert pool.busy()

            _must(loop, HYBRID, "x1", "request")
            _must(loop, HYBRID, "x1", "allocate", host="h1", gpus=["h1:g1"])
            t0 = time.monotonic()
            _must(loop, HYBRID, "x1", "launch", token="t-x1")
            assert time.monotonic() - t0 < 0.5  # not carried out: the step holds the pool
            loop.run_until(lambda: False, timeout_s=0.5)  # the loop turns; still waiting
            assert _state(loop, HYBRID, "x1") == "launching"

            assert held.release().version == 1
            loop.run_until(lambda: _state(loop, HYBRID, "x1") == "ready", timeout_s=30)
            assert _state(loop, HYBRID, "x1") == "ready"
            inst = loop.world.get(HYBRID, "x1")
            assert inst is not None and inst.get("loaded_version") == 1  # the step's state
            _must(loop, HYBRID, "x1", "cancel", reason="the test returns it")  # parked
    finally:
        assert loop.close() == []
