"""A Hybrid killed (SIGKILL) inside the gradient all-reduce is survived: the pool re-forms its
Gloo world without it and the step is retried from exactly the state before it.

Real processes, real Gloo, real ZeroMQ. The kill is made to land inside the collective with the
worker's test hook (`EHP_TEST_REDUCE_HOOK`): every rank announces entering the reduction of a
step as a file and waits while a `hold-<rank>` file exists. Two variants, both in one run:
- step 3: the Hybrid is held at the door; the Core has entered the all-reduce and waits for it
  when the Hybrid is killed (Gloo must raise on the peer's death at once, not at its timeout);
- step 5: the Core is held; the Hybrid has entered the all-reduce and waits inside it when it is
  killed; the Core then enters the collective with a dead peer.
After each kill the world is re-formed (Core rank 0 and the idle warm worker), the retried step
trains Core-only on the same batch, and a second warm worker is borrowed in the re-formed world.
Each killed worker is replaced by a fresh process on standby; at step 7 both replacements are
admitted (another re-form) and one of them is borrowed and trains.

Reference: the same steps and batches on a fresh pool where each Hybrid simply left at the same
step boundary. The comparison is bit-exact (the same fp32 arithmetic in the same order: the
failed step left no trace), for parameters, FP32 master weights, Adam moments and steps.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from ehp_fsm.core.batch import partition_groups
from ehp_fsm.training import verify
from ehp_fsm.training.adam import AdamConfig
from ehp_fsm.training.grpo import synthetic_groups
from ehp_fsm.training.policy import PolicyConfig
from ehp_fsm.training.pool import PoolConfig, PoolFailure, StepResult, TrainerPool
from ehp_fsm.training.worker import REDUCE_HOOK_ENV
from tests.procs import still_running
from tests.reduce_hook import KillInsideReduction

CFG = PolicyConfig(d_model=32, n_heads=4, d_ff=64, n_layers=2, max_len=16)
ADAM = AdamConfig(lr=1e-3, eps=1e-6, weight_decay=0.01)
G, N, STEPS = 8, 4, 8
# step -> (warm rank borrowed at this boundary, its replica id); leave/kill at the next step
# (step 7: the replacement of the rank killed at step 3, admitted into the re-formed world)
BORROWS = {2: (1, "hybrid:a"), 4: (2, "hybrid:b"), 7: (1, "hybrid:c")}
KILLS = {3: (1, "hold-1"), 5: (2, "hold-0")}  # step -> (rank killed, which rank is held)


def _config() -> PoolConfig:
    return PoolConfig(policy=CFG, seed=3, core_dp=1, max_hybrids=2, adam=ADAM)


def _batch(step: int):
    return synthetic_groups(range(step * G, (step + 1) * G), group_size=N, config=CFG, seed=7)


def _step(pool: TrainerPool, step: int, epoch: int) -> StepResult | PoolFailure:
    batch = _batch(step)
    part = partition_groups(
        groups=batch.group_ids,
        live=dict.fromkeys(pool.live_replicas(), 1),
        group_size=N,
        step=step,
        epoch=epoch,
    )
    return pool.step(step=step, epoch=epoch, partition=part, batch=batch)


def _ok(x):
    assert not isinstance(x, PoolFailure), str(x)
    return x


def _hooked(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The hook folder, named in the environment the pool's workers inherit (pytest restores
    the environment after the test)."""
    hook = tmp / "hook"
    hook.mkdir(parents=True)
    monkeypatch.setenv(REDUCE_HOOK_ENV, str(hook))
    return hook


def _run(
    tmp: Path, monkeypatch: pytest.MonkeyPatch, *, kill: bool
) -> tuple[Path, dict[int, float], set[int]]:
    hook = _hooked(tmp, monkeypatch)
    losses: dict[int, float] = {}
    with TrainerPool.spawn(_config(), work_dir=tmp / "pool") as pool:
        pids = {w.rank: w.identity.pid for w in pool.workers}
        every_pid = set(pids.values())
        epoch = 0
        for step in range(STEPS):
            if step in KILLS and not kill:  # the reference: the Hybrid leaves at this boundary
                pool.deactivate(BORROWS[step - 1][1])
                epoch += 1
            if step in BORROWS:
                rank, replica = BORROWS[step]
                if kill and step == 7:  # the replacements of both killed workers are admitted
                    assert pool.admit_replacements(wait_s=90) is None
                    assert pool.idle_warm_ranks() == (1, 2)
                    assert pool.reforms[-1].members == (0, 1, 2)
                    every_pid |= {w.identity.pid for w in pool.workers}
                    assert len(every_pid) == 5
                _ok(pool.load_state(rank, replica=replica))
                pool.activate(replica)
                epoch += 1
            if step in KILLS and kill:
                victim, hold = KILLS[step]
                (hook / hold).write_text("")
                killer = KillInsideReduction(
                    hook, victim=victim, hold=hold, step=step, pid=pids[victim]
                )
                killer.start()
                with capture_logs() as logs:
                    failed = _step(pool, step, epoch)
                    seen = time.monotonic()
                killer.join(10)
                replica = BORROWS[step - 1][1]
                assert isinstance(failed, PoolFailure), failed
                assert (failed.reason, failed.rank, failed.replica) == ("dead", victim, replica)
                assert not failed.broken_world and pool.broken is None
                assert "no survivor stepped" in failed.detail, failed.detail
                # Gloo raised on the peer's death at once, not at its 60 s timeout.
                assert killer.killed_at is not None and seen - killer.killed_at < 10.0
                ledger = [e for e in logs if e["event"] == "step_failed"]
                assert ledger and ledger[0]["missing"] == [replica], logs
                assert ledger[0]["reason"] == "died_in_reduction"
                reform = pool.reforms[-1]
                assert reform.dead == (victim,) and victim not in reform.members
                assert reform.op == "step"
                assert pool.core_version == step  # the optimizer did not step
                pool.deactivate(replica)  # the engine fails the Hybrid: epoch + 1
                epoch += 1
                res = _ok(_step(pool, step, epoch))  # the retry: every group, Core only
                assert res.replicas == ("core:0",)
                assert res.ranks[0].delivery.samples == G * N
            else:
                res = _ok(_step(pool, step, epoch))
                assert len(res.replicas) == (2 if step in BORROWS else 1)
            assert res.version == step + 1
            losses[step] = res.loss
        if kill:
            assert [r.dead for r in pool.reforms if r.dead] == [(1,), (2,)]
        else:
            assert pool.reforms == []
        _ok(pool.save_state(tmp / "final"))
    return tmp / "final", losses, every_pid


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_hybrid_killed_inside_the_all_reduce_is_survived(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ehp, ehp_losses, pids = _run(tmp_path / "ehp", monkeypatch, kill=True)
    ref, ref_losses, _ = _run(tmp_path / "ref", monkeypatch, kill=False)
    assert ehp_losses == ref_losses  # the retried steps trained on exactly the same groups
    report = verify.compare_states(ehp, ref, exact=True)
    assert report.passed, report.lines()
    assert report.version == (STEPS, STEPS) and report.steps_equal
    # No orphans: every worker process of the killed run (replacements included) is gone.
    assert not still_running(pids)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_core_rank_killed_inside_the_all_reduce_breaks_the_pool_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Core holds the only authoritative optimizer state: a Core rank that dies is not
    survivable, so the pool reports a broken world naming the Core rank, at once (not at the
    collective timeout), refuses further work, and shuts down without orphans."""
    hook = _hooked(tmp_path, monkeypatch)
    pool = TrainerPool.spawn(_config(), work_dir=tmp_path / "pool")
    try:
        pids = {w.rank: w.identity.pid for w in pool.workers}
        _ok(pool.load_state(1, replica="hybrid:a"))
        pool.activate("hybrid:a")
        (hook / "hold-1").write_text("")  # the Hybrid waits at the door, the Core is inside
        killer = KillInsideReduction(hook, victim=0, hold="hold-1", step=0, pid=pids[0])
        killer.start()
        failed = _step(pool, 0, 1)
        seen = time.monotonic()
        killer.join(10)
        assert isinstance(failed, PoolFailure), failed
        assert failed.broken_world and failed.rank == 0 and failed.replica == "core:0"
        assert killer.killed_at is not None and seen - killer.killed_at < 10.0
        again = _step(pool, 0, 1)
        assert isinstance(again, PoolFailure) and again.reason == "broken"
        assert pool.reforms == []
    finally:
        pool.shutdown(timeout_s=10)
    left = still_running(pids.values())
    assert not left, left


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_hybrid_killed_between_collectives_is_replaced_and_borrowed_again(
    tmp_path: Path,
) -> None:
    """A Hybrid that dies outside any collective fails its step as a value (no re-form needed);
    the pool replaces the dead warm worker with a fresh process, admits it into a re-formed
    world, and it can be borrowed and train again."""
    with TrainerPool.spawn(_config(), work_dir=tmp_path / "pool") as pool:
        first = {w.rank: w.identity.pid for w in pool.workers}
        _ok(pool.load_state(1, replica="hybrid:a"))
        pool.activate("hybrid:a")
        os.kill(first[1], signal.SIGKILL)
        failed = _step(pool, 0, 1)
        assert isinstance(failed, PoolFailure) and failed.reason == "dead"
        assert failed.replica == "hybrid:a" and not failed.broken_world
        pool.deactivate("hybrid:a")
        res = _ok(_step(pool, 0, 2))  # the retry, Core only
        assert res.replicas == ("core:0",)
        assert pool.admit_replacements(wait_s=90) is None
        assert pool.idle_warm_ranks() == (1, 2)
        new_pid = next(w.identity.pid for w in pool.workers if w.rank == 1)
        assert new_pid != first[1]
        _ok(pool.load_state(1, replica="hybrid:b"))
        pool.activate("hybrid:b")
        res = _ok(_step(pool, 1, 3))
        assert res.replicas == ("core:0", "hybrid:b") and res.version == 2
        pids = set(first.values()) | {new_pid}
    assert not still_running(pids)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_hybrid_killed_after_the_reduction_leaves_the_step_standing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Hybrid dies after the all-reduce completed but before its optimizer step: its
    gradient was reduced, the Core stepped, so the step stands (`lost` names the Hybrid for the
    caller to fail); the world is re-formed and the Core trains on."""
    hook = _hooked(tmp_path, monkeypatch)
    pool = TrainerPool.spawn(_config(), work_dir=tmp_path / "pool")
    try:
        pid = next(w.identity.pid for w in pool.workers if w.rank == 1)
        _ok(pool.load_state(1, replica="hybrid:a"))
        pool.activate("hybrid:a")
        (hook / "hold-after-1").write_text("")

        def kill_after() -> None:
            end = time.monotonic() + 60
            while not (hook / "after-1-0").exists() and time.monotonic() < end:
                time.sleep(0.005)
            os.kill(pid, signal.SIGKILL)
            (hook / "hold-after-1").unlink()

        killer = threading.Thread(target=kill_after, daemon=True)
        killer.start()
        res = _ok(_step(pool, 0, 1))
        killer.join(10)
        assert res.version == 1 and pool.core_version == 1
        assert res.replicas == ("core:0", "hybrid:a") and res.lost == ("hybrid:a",)
        assert f"{pid}" in res.lost_why["hybrid:a"], res.lost_why  # how it died, for the run
        assert sum(r.delivery.samples for r in res.ranks) == G * N
        assert pool.reforms[-1].dead == (1,)
        pool.deactivate("hybrid:a")
        again = _ok(_step(pool, 1, 2))
        assert again.replicas == ("core:0",) and again.version == 2 and again.lost == ()
    finally:
        pool.shutdown(timeout_s=10)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_hybrid_killed_during_a_state_load_is_survived(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warm worker dies while the Core sends it the state (it is held on entering the
    receive, then SIGKILLed): the load fails as a value naming it, the world is re-formed
    without it, the Core trains on unchanged, and its replacement is loaded and trains."""
    hook = _hooked(tmp_path, monkeypatch)
    (hook / "hold-recv-1").write_text("")
    with TrainerPool.spawn(_config(), work_dir=tmp_path / "pool") as pool:
        first = {w.rank: w.identity.pid for w in pool.workers}
        before = _ok(_step(pool, 0, 0))
        got: list[object] = []
        loader = threading.Thread(
            target=lambda: got.append(pool.load_state(1, replica="hybrid:a")), daemon=True
        )
        loader.start()
        deadline = time.monotonic() + 60
        while not list(hook.glob("recv-1-*")) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert list(hook.glob("recv-1-*")), "the warm worker never started receiving"
        os.kill(first[1], signal.SIGKILL)
        loader.join(60)
        assert not loader.is_alive(), "load_state hung on a dead receiver"
        (failed,) = got
        assert isinstance(failed, PoolFailure) and failed.reason == "dead", failed
        assert failed.rank == 1 and not failed.broken_world
        assert list(pool.live_replicas()) == ["core:0"]
        res = _ok(_step(pool, 1, 0))  # the Core trains on: its state was only read
        assert res.replicas == ("core:0",) and res.version == before.version + 1
        assert pool.admit_replacements(wait_s=90) is None
        new_pid = next(w.identity.pid for w in pool.workers if w.rank == 1)
        assert new_pid != first[1]
        (hook / "hold-recv-1").unlink()
        _ok(pool.load_state(1, replica="hybrid:b"))
        pool.activate("hybrid:b")
        res = _ok(_step(pool, 2, 1))
        assert res.replicas == ("core:0", "hybrid:b") and res.version == before.version + 2
        pids = set(first.values()) | {new_pid}
    assert not still_running(pids)
