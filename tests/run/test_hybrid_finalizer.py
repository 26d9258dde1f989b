"""The finalizer of a Hybrid's GPU is a check: a parked warm worker that keeps its memory keeps
the GPU `releasing`, and the GPU is free once the worker lets go.

Real pieces: the orchestrator built from `examples/local.toml` (the GPU and hybrid_replica
machines), the shell's loop, a real trainer pool (Core rank + one warm worker process, Gloo,
ZeroMQ with msgpack frames) and the run's `WarmHybrids` performer. The worker's test hook
(`EHP_TEST_REDUCE_HOOK=<dir>`, never set in production) makes it keep a reference to its lane's
tensors when it parks while `<dir>/keep-<rank>` exists, and let go once that file is gone.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ehp_fsm import Orchestrator, load_plan
from ehp_fsm.core.transition import Accepted
from ehp_fsm.run.hybrids import HYBRID, WarmHybrids
from ehp_fsm.shell.loop import Loop
from ehp_fsm.training.pool import TrainerPool
from ehp_fsm.training.worker import REDUCE_HOOK_ENV
from tests.training_pool.rig import tiny_config

PLAN = Path(__file__).resolve().parents[2] / "examples" / "local.toml"


def _must(loop: Loop, machine: str, instance: str, name: str, **payload: object) -> None:
    out = loop.event(machine, instance, name, **payload)
    assert isinstance(out, Accepted), f"{machine} {instance} {name}: {out}"


def _state(loop: Loop, machine: str, instance: str) -> str:
    inst = loop.world.get(machine, instance)
    assert inst is not None
    return inst.state


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_parked_worker_that_keeps_its_memory_keeps_the_gpu_releasing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hook = tmp_path / "hook"
    hook.mkdir()
    keep = hook / "keep-1"  # warm rank 1 keeps its lane's tensors when it parks
    keep.write_text("")
    monkeypatch.setenv(REDUCE_HOOK_ENV, str(hook))
    orch = Orchestrator.from_plan(load_plan(PLAN), log_path=tmp_path / "t.jsonl", check=True)
    loop = Loop(orch, clock=time.monotonic)
    try:
        with TrainerPool.spawn(tiny_config(), work_dir=tmp_path / "pool") as pool:
            _park_and_let_go(loop, pool, keep)
    finally:
        assert loop.close() == []


def _park_and_let_go(loop: Loop, pool: TrainerPool, keep: Path) -> None:
    hybrids = WarmHybrids(loop, pool, recheck_s=0.05)
    loop.add(hybrids)
    _must(loop, HYBRID, "x1", "request")
    _must(loop, HYBRID, "x1", "allocate", host="h1", gpus=["h1:g1"])
    _must(loop, HYBRID, "x1", "launch", token="t-x1")  # bound, loaded: its lane is built
    assert _state(loop, HYBRID, "x1") == "ready"
    assert _state(loop, "gpu", "h1:g1") == "owned"

    _must(loop, HYBRID, "x1", "cancel", reason="the test returns it")  # park, release
    rank, report = hybrids.parked["x1"]
    assert rank == 1 and report is not None and not report.free
    assert report.by_kind["params"] > 0 and report.by_kind["optimizer"] > 0, report
    assert report.by_kind["master"] > 0, report
    assert 1 not in pool.idle_warm_ranks()  # nothing is loaded into it meanwhile
    loop.run_until(lambda: False, timeout_s=0.5)  # asked again and again: still held
    assert _state(loop, "gpu", "h1:g1") == "releasing"
    assert hybrids.unconfirmed == {"h1:g1": "hybrid:x1"}

    keep.unlink()  # the worker lets go of its lane
    loop.run_until(lambda: _state(loop, "gpu", "h1:g1") == "free", timeout_s=10.0)
    assert _state(loop, "gpu", "h1:g1") == "free"
    _, report = hybrids.parked["x1"]
    assert report is not None and report.free and report.lane_bytes == 0, report
    assert hybrids.unconfirmed == {}
    assert 1 in pool.idle_warm_ranks()
