"""The trainer pool with real processes: Core DP1 + warm Hybrid workers over one Gloo world,
driven over ZeroMQ. A Hybrid is borrowed at step 2 and returned at step 4; the final Core state is
then compared with a Core-only pool trained on the same recorded batches (`verify`).

Which comparison applies, and why (as in `tests/training/test_equivalence.py`):
- the state a warm worker loads equals the Core's bit-exactly (a copy, no arithmetic);
- while the Hybrid is live, Core and Hybrid apply the same reduced gradient: bit-exact;
- Core-only replay of steps 0–1 repeats the same arithmetic: bit-exact;
- the whole run against the Core-only replay: steps 2–3 summed Σ (nᵢ/B)·ḡᵢ over two replicas
  instead of one (another fp32 order, other batch shapes): atol 2e-4 / rtol 2e-3, with Adam
  ε = 1e-6 (the ε caveat of issue 3). Steps, version, hyperparameters: exact.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from ehp_fsm.core.batch import partition_groups
from ehp_fsm.rollout.revisions import RevisionStore
from ehp_fsm.training import verify
from ehp_fsm.training.adam import AdamConfig
from ehp_fsm.training.grpo import synthetic_groups
from ehp_fsm.training.policy import PolicyConfig
from ehp_fsm.training.pool import (
    PoolConfig,
    PoolFailure,
    StaleStateError,
    StepResult,
    TrainerPool,
)
from tests.procs import pids_of_a_killed_coordinator, running_after

CFG = PolicyConfig(d_model=32, n_heads=4, d_ff=64, n_layers=2, max_len=16)
ADAM = AdamConfig(lr=1e-3, eps=1e-6, weight_decay=0.01)
G, N, K = 8, 4, 6
BORROW, RETURN = 2, 4


def _config(**kw: object) -> PoolConfig:
    base = {"policy": CFG, "seed": 3, "core_dp": 1, "max_hybrids": 2, "adam": ADAM}
    base.update(kw)
    return PoolConfig(**base)  # type: ignore[arg-type]


def _batch(step: int):
    return synthetic_groups(range(step * G, (step + 1) * G), group_size=N, config=CFG, seed=7)


def _step(pool: TrainerPool, step: int, epoch: int, **kw: object) -> StepResult | PoolFailure:
    batch = _batch(step)
    part = partition_groups(
        groups=batch.group_ids,
        live=dict.fromkeys(pool.live_replicas(), 1),
        group_size=N,
        step=step,
        epoch=epoch,
    )
    return pool.step(step=step, epoch=epoch, partition=part, batch=batch, **kw)  # type: ignore[arg-type]


def _ok(x):
    assert not isinstance(x, PoolFailure), str(x)
    return x


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_borrow_and_return_matches_core_only(tmp_path: Path, tiny_model_dir: Path) -> None:
    # publishing needs a Hugging Face directory: the generated tiny model trains here
    cfg = _config(revisions=str(tmp_path / "revisions"), model=str(tiny_model_dir))
    records = tmp_path / "records"
    with TrainerPool.spawn(cfg, work_dir=tmp_path / "ehp") as pool:
        assert [w.role for w in pool.workers] == ["core", "hybrid", "hybrid"]
        assert len({w.identity.pid for w in pool.workers}) == 3
        assert all(w.identity.launch_token == pool.launch_token for w in pool.workers)
        _ok(pool.publish(0))
        epoch = 0
        for step in range(K):
            if step == BORROW:
                loaded = _ok(pool.load_state(1, replica="hybrid:a"))
                assert loaded.version == pool.core_version == BORROW
                _ok(pool.save_state(tmp_path / "core-at-borrow"))
                _ok(pool.save_state(tmp_path / "hybrid-at-borrow", rank=1))
                # A second warm worker loaded now but activated after a step is stale.
                _ok(pool.load_state(2, replica="hybrid:b"))
                pool.activate("hybrid:a")
                epoch += 1
            if step == RETURN:
                _ok(pool.save_state(tmp_path / "core-at-return"))
                _ok(pool.save_state(tmp_path / "hybrid-at-return", rank=1))
                pool.deactivate("hybrid:a")
                epoch += 1
            res = _ok(_step(pool, step, epoch))
            live = BORROW <= step < RETURN
            assert res.replicas == (("core:0", "hybrid:a") if live else ("core:0",))
            assert sum(r.delivery.samples for r in res.ranks) == G * N
            assert {r.delivery.epoch for r in res.ranks} == {epoch}
            assert res.version == step + 1 and res.revision == step + 1
            assert all(r.timings.compute_s > 0 and r.timings.apply_s > 0 for r in res.ranks)
            verify.record_step(
                records,
                step=step,
                epoch=epoch,
                partition={r.replica: _partition_of(res, r.replica, step) for r in res.ranks},
                batch=_batch(step),
            )
            if step == BORROW:
                with pytest.raises(StaleStateError, match="version 2"):
                    pool.activate("hybrid:b")
                pool.deactivate("hybrid:b")
        _ok(pool.save_state(tmp_path / "ehp-final"))
        final_rev = RevisionStore(cfg.revisions or "").load(K).state_dict()
    # Bit-exact: the load, and the updates Core and Hybrid applied together.
    for a, b in (("core-at-borrow", "hybrid-at-borrow"), ("core-at-return", "hybrid-at-return")):
        report = verify.compare_states(tmp_path / a, tmp_path / b, exact=True)
        assert report.passed, report.lines()
    # The published revision is the Core's final weights (every one of them: compared by name).
    compared = set()
    for key, t in verify.iter_state(tmp_path / "ehp-final"):
        if key.startswith("param/"):
            assert torch.equal(final_rev[key.removeprefix("param/")], t), key
            compared.add(key.removeprefix("param/"))
    # (the revision also holds lm_head: tied to the embedding, not a parameter of its own)
    assert set(final_rev) - compared == {"lm_head.weight"}, sorted(compared ^ set(final_rev))

    # Core-only replay of the first two steps: the same arithmetic, bit-exact.
    early = tmp_path / "records-early"
    early.mkdir()
    for f in sorted(records.glob("step-*.pt"))[:BORROW]:
        shutil.copy(f, early / f.name)
    replay, report = verify.verify_run(
        early, tmp_path / "core-at-borrow", config=cfg, work_dir=tmp_path / "v-early"
    )
    assert replay.hybrid_steps == 0 and report.mode == "bit-exact"
    assert report.passed, report.lines()

    # The whole run: bit for bit its own recorded partitions replayed (each step's split equal
    # to the whole batch's gradient within the fixed-batch tolerance); the Core-only replay on
    # the same batches is reported beside it.
    replay, report = verify.verify_run(
        records, tmp_path / "ehp-final", config=cfg, work_dir=tmp_path / "v-all"
    )
    assert replay.steps == K and replay.hybrid_steps == RETURN - BORROW
    assert report.mode.startswith("run == its partitions replayed, bit-exact"), report.mode
    assert report.passed, report.lines()
    assert report.version == (K, K) and report.steps_equal and report.hyper_equal
    assert report.first_departure is None
    exact = "the run vs its recorded partitions replayed (bit-exact required): bit-exact"
    assert any(n.strip().startswith(exact) for n in report.notes), report.lines()
    # the categories are the Core-only replay's, reported beside: another split, other rounding
    assert not report.categories["master"].bit_exact
    assert report.peak_extra_bytes < report.state_bytes  # streamed, not two states at once

    # A perturbed state fails and names the tensor.
    bad = tmp_path / "perturbed"
    shutil.copytree(tmp_path / "ehp-final", bad)
    entry = next(e for e in verify.read_index(bad)["tensors"] if e["key"].startswith("exp_avg/"))
    t = torch.load(bad / entry["file"], weights_only=True)
    t.view(-1)[0] += 1e-2
    torch.save(t, bad / entry["file"])
    report = verify.compare_states(bad, replay.state, exact=False)
    assert not report.passed
    assert any(entry["key"] in f for f in report.failures), report.failures


def _partition_of(res: StepResult, replica: str, step: int) -> list[int]:
    p = partition_groups(
        groups=range(step * G, (step + 1) * G),
        live=dict.fromkeys(res.replicas, 1),
        group_size=N,
        step=step,
        epoch=res.epoch,
    )
    return list(p.groups_of(replica))


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("fused", [False, True], ids=["per-parameter", "fused"])
def test_core_dp2_borrow_is_bit_exact(tmp_path: Path, fused: bool) -> None:
    """Core DP=2 (sharded, pad 64) → DP1 warm lane (pad 48) and two joint steps; with torch's
    per-parameter AdamW and with the fused kernel the run uses (`job_adam`)."""
    adam = AdamConfig(lr=1e-3, eps=1e-6, weight_decay=0.01, fused=True) if fused else ADAM
    cfg = _config(core_dp=2, max_hybrids=1, adam=adam)
    with TrainerPool.spawn(cfg, work_dir=tmp_path / "pool") as pool:
        _ok(_step(pool, 0, 0))
        _ok(pool.load_state(2, replica="hybrid:x"))
        pool.activate("hybrid:x")
        for step in (1, 2):
            res = _ok(_step(pool, step, 1))
            assert res.replicas == ("core:0", "core:1", "hybrid:x")
        _ok(pool.save_state(tmp_path / "core"))
        _ok(pool.save_state(tmp_path / "hybrid", rank=2))
    report = verify.compare_states(tmp_path / "core", tmp_path / "hybrid", exact=True)
    assert report.passed, report.lines()
    assert report.version == (3, 3)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_dead_workers_are_error_values(tmp_path: Path) -> None:
    """Workers launched by someone else (as a host agent would, with `worker_argv`): the pool
    knows them only by their hello identity. A killed idle warm worker does not stop Core
    steps; a killed active Hybrid fails the step with a value naming its rank, and the Core
    continues once it is deactivated."""
    cfg = _config()
    pool = TrainerPool.bind(cfg, work_dir=tmp_path / "pool")
    procs = [
        subprocess.Popen(pool.worker_argv(r), env=pool.worker_env(r), start_new_session=True)
        for r in range(cfg.world_size)
    ]
    try:
        assert pool.wait_ready(timeout_s=90) is None
        assert sorted(w.identity.pid for w in pool.workers) == sorted(p.pid for p in procs)
        _ok(_step(pool, 0, 0))
        os.kill(procs[2].pid, signal.SIGKILL)  # an idle warm worker
        procs[2].wait(10)
        _ok(_step(pool, 1, 0))
        failed = pool.load_state(2, replica="hybrid:b")
        assert isinstance(failed, PoolFailure) and failed.reason == "dead" and failed.rank == 2
        _ok(pool.load_state(1, replica="hybrid:a"))
        pool.activate("hybrid:a")
        os.kill(procs[1].pid, signal.SIGKILL)  # the active Hybrid
        procs[1].wait(10)
        t0 = time.monotonic()
        failed = _step(pool, 2, 1)
        assert time.monotonic() - t0 < 10
        assert isinstance(failed, PoolFailure), failed
        assert (failed.reason, failed.rank, failed.replica) == ("dead", 1, "hybrid:a")
        assert "rank 1 (hybrid:a)" in str(failed)
        pool.deactivate("hybrid:a")
        res = _ok(_step(pool, 2, 2))
        assert res.replicas == ("core:0",) and res.version == 3
    finally:
        pool.shutdown(timeout_s=10)
        with contextlib.suppress(subprocess.TimeoutExpired):
            procs[0].wait(15)  # the pool asked it to exit; it was not launched by the pool
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
    assert procs[0].returncode == 0


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_deadline_then_stale_delivery_is_rejected(tmp_path: Path) -> None:
    """A step whose replies miss the deadline fails as a value; the late delivery then reaches
    the next step's ledger, which rejects it as stale; the next step still trains."""
    cfg = _config(max_hybrids=0)
    with TrainerPool.spawn(cfg, work_dir=tmp_path / "pool") as pool:
        failed = _step(pool, 0, 0, timeout_s=0.001)
        assert isinstance(failed, PoolFailure) and failed.reason == "deadline"
        assert failed.rank == 0 and not failed.broken_world
        time.sleep(1.0)  # let the late reply arrive
        with capture_logs() as logs:
            res = _ok(_step(pool, 1, 0))
        assert res.version == 1
        rejected = [e for e in logs if e["event"] == "delivery_rejected"]
        assert rejected and rejected[0]["reason"] == "stale_step", logs


_ORPHAN_SCRIPT = """
import sys, time
from pathlib import Path
from ehp_fsm.training.pool import PoolConfig, TrainerPool
pool = TrainerPool.spawn(PoolConfig(max_hybrids=1), work_dir=Path(sys.argv[1]))
print("PIDS", *(w.identity.pid for w in pool.workers), flush=True)
time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_workers_exit_when_their_coordinator_dies(tmp_path: Path) -> None:
    """No orphans: a coordinator killed with SIGKILL (no chance to shut down) leaves workers
    that notice its identity is gone and exit on their own."""
    pids = pids_of_a_killed_coordinator(_ORPHAN_SCRIPT, str(tmp_path))
    assert len(pids) == 2
    left = running_after(pids, 15.0)
    assert not left, f"workers {left} outlived their coordinator"


class _Stop(Exception):
    pass


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_checkpoint_that_raises_ends_a_restore_and_the_pool(tmp_path: Path) -> None:
    """A stop while the pool restores a saved state (minutes for a 7B model's ~100 GB): the
    checkpoint's raise ends the wait at once, not when the worker answers; the pool refuses
    any further use (its worker is at a restore nobody awaits) and its shutdown ends the
    worker without waiting for it. The worker is frozen (SIGSTOP) to stand for a long
    restore."""
    state = tmp_path / "state"
    with TrainerPool.spawn(_config(max_hybrids=0), work_dir=tmp_path / "pool") as pool:
        _ok(_step(pool, 0, 0))
        assert _ok(pool.save_state(state)) == state
        (worker,) = pool.workers
        assert worker.identity is not None
        os.kill(worker.identity.pid, signal.SIGSTOP)
        stop_at = time.monotonic() + 0.3

        def checkpoint() -> None:
            if time.monotonic() >= stop_at:
                raise _Stop

        t0 = time.monotonic()
        with capture_logs() as logs, pytest.raises(_Stop):
            pool.restore_state(state, checkpoint=checkpoint)
        assert time.monotonic() - t0 < 2.0  # 0.3 s, then at most a 50 ms wait for replies
        assert [e["op"] for e in logs if e["event"] == "pool_abandoned"] == ["restore_state"]
        refused = _step(pool, 1, 0)
        assert isinstance(refused, PoolFailure) and refused.reason == "broken"
        assert "the wait for restore_state was abandoned" in refused.detail, refused
        os.kill(worker.identity.pid, signal.SIGCONT)
        assert pool.shutdown(timeout_s=30) == []
        # ended by the shutdown (SIGTERM), not asked to exit once its restore was done
        process = pool._workers[0].process  # (the pool's own handle: how it ended)
        assert process is not None and process.returncode == -signal.SIGTERM
    assert not running_after([worker.identity.pid], 5.0)
