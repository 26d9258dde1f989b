"""`verify_run` on a real pool run: a Core and one Hybrid (real processes, Gloo, ZeroMQ) train
five steps while each step's partition, batch and weight fingerprint are recorded as `--verify`
records them.

The run trains step 3 on other data than it recorded (one group's rewards changed): to verify
that is what a group trained twice or left out, a wrong reduction weight or a Hybrid holding
stale state look like — the weights after the step are not what the recorded step gives. verify
must fail and name step 3, its groups and the tensors, not only report a final difference. With
the record made true (the batch the step did train), the same run passes: its final state equals
its partitions replayed bit for bit, every step compared by fingerprint, every split within the
fixed-batch tolerance of the whole batch. The replay on a pool of the run's own lanes (the
Megatron path) names the same step.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from ehp_fsm.core.batch import partition_groups
from ehp_fsm.training import verify
from ehp_fsm.training.adam import AdamConfig
from ehp_fsm.training.grpo import GroupBatch
from ehp_fsm.training.pool import TrainerPool
from ehp_fsm.training.pool_protocol import PoolConfig
from tests.training_pool.rig import batch_of, ok, tiny_config

STEPS, BAD = 5, 3
CONFIG = tiny_config(adam=AdamConfig(lr=1e-3, eps=1e-6))


def _tampered(batch: GroupBatch) -> GroupBatch:
    """The batch with its last group's rewards changed (what the run trains at step `BAD`)."""
    rewards = batch.rewards.clone()
    rewards[-batch.group_size :] = rewards[-batch.group_size :].flip(0) + 0.5
    return replace(batch, rewards=rewards)


def _run(tmp: Path, config: PoolConfig = CONFIG, groups: int = 4) -> tuple[Path, Path]:
    """Five steps, the Hybrids borrowed before the first — `hybrid:a` on the last warm rank,
    `hybrid:b` (with two warm ranks) on the first: not the order a replay would pick by
    itself; (records, final state)."""
    records = tmp / "records"
    hybrids = ("hybrid:a", "hybrid:b")[: config.max_hybrids]
    with TrainerPool.spawn(config, work_dir=tmp / "pool") as pool:
        for replica, rank in zip(hybrids, reversed(config.warm_ranks), strict=False):
            ok(pool.load_state(rank, replica=replica))
            pool.activate(replica)
        ranks = {h: pool.rank_of(h) for h in hybrids}
        for step in range(1, STEPS + 1):
            batch = batch_of(step, groups=groups)
            part = partition_groups(
                groups=batch.group_ids,
                live=dict.fromkeys(pool.live_replicas(), 1),
                group_size=batch.group_size,
                step=step,
                epoch=0,
            )
            shares = {r: part.groups_of(r) for r in part.replicas}
            verify.record_step(
                records, step=step, epoch=0, partition=shares, batch=batch, ranks=ranks
            )
            trained = _tampered(batch) if step == BAD else batch
            res = ok(pool.step(step=step, epoch=0, partition=part, batch=trained, fingerprint=True))
            core = {config.core_replica(r) for r in config.core_ranks}
            assert res.fingerprint is not None and set(res.replicas) == core | set(hybrids)
            verify.record_result(records, step=step, weights=res.fingerprint)
        state = ok(pool.save_state(tmp / "ehp-state"))
    return records, state


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_verify_names_the_step_whose_weights_depart_from_the_record(tmp_path: Path) -> None:
    records, state = _run(tmp_path)
    _, report = verify.verify_run(records, state, config=CONFIG, work_dir=tmp_path / "v1")
    assert not report.passed and report.first_departure == BAD, report.lines()
    first = report.failures[0]
    assert first.startswith(
        f"the run's weights depart from its recorded partitions replayed at step {BAD} ("
    ), report.lines()
    (rec,) = [r for r in verify.load_records(records) if r.step == BAD]
    for replica, groups in rec.partition.items():  # that step's groups, by replica
        assert f"{replica} {list(groups)}" in first, first
    assert rec.fingerprint is not None and any(name in first for name in rec.fingerprint)
    # The replay on a pool of the run's own lanes (what Megatron lanes use) names it too.
    on_pool = verify.replay_partitions_on_pool(records, config=CONFIG, work_dir=tmp_path / "p")
    assert on_pool.departure is not None and on_pool.departure.step == BAD
    assert on_pool.fingerprinted == STEPS
    # The record made true: the run passes, bit-exact against its partitions, all fingerprinted.
    verify.record_step(
        records, step=BAD, epoch=0, partition=rec.partition, batch=_tampered(rec.batch)
    )
    replayed, report = verify.verify_run(records, state, config=CONFIG, work_dir=tmp_path / "v2")
    assert report.passed, report.lines()
    assert replayed.hybrid_steps == STEPS and len(replayed.drift) == STEPS
    lines = "\n".join(report.lines())
    assert f"bit-exact; {STEPS} of {STEPS} steps compared by fingerprint: none departs" in lines
    # The max|Δ| table under the verdict is the Core-only replay's: it says so above its lines
    # (right under "PASS (... bit-exact)" with nothing above it, it read as the verdict's own).
    shown = report.lines()
    table = next(i for i, line in enumerate(shown) if line.startswith("  param "))
    assert "Core-only replay" in shown[table - 1] and "not judged" in shown[table - 1], shown


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_more_than_two_lanes_are_judged_bit_exact_on_the_runs_ranks(tmp_path: Path) -> None:
    """Core DP2 and two Hybrids (four lanes a step): a sum of more than two lanes depends on
    its order, so the in-process replay cannot repeat it — `--verify` replays on a pool of the
    run's lanes with each Hybrid on its recorded rank: bit-exact, every step fingerprinted,
    and the step trained on other data than recorded is named."""
    config = tiny_config(core_dp=2, max_hybrids=2, adam=AdamConfig(lr=1e-3, eps=1e-6))
    records, state = _run(tmp_path, config, groups=8)
    _, report = verify.verify_run(records, state, config=config, work_dir=tmp_path / "v1")
    assert not report.passed and report.first_departure == BAD, report.lines()
    (rec,) = [r for r in verify.load_records(records) if r.step == BAD]
    assert rec.lanes == 4 and rec.ranks == {"hybrid:a": 3, "hybrid:b": 2}
    verify.record_step(
        records,
        step=BAD,
        epoch=0,
        partition=rec.partition,
        batch=_tampered(rec.batch),
        ranks=rec.ranks,
    )
    _, report = verify.verify_run(records, state, config=config, work_dir=tmp_path / "v2")
    assert report.passed, report.lines()
    lines = "\n".join(report.lines())
    assert (
        f"bit-exact; {STEPS} of {STEPS} steps compared by fingerprint: none departs (replayed "
        "on a pool of the run's lanes and ranks)"
    ) in lines, lines
    assert "each step's split vs the whole batch at the same weights: worst" in lines
    for replay in (tmp_path / "v1", tmp_path / "v2"):  # the pool replay started with the
        # Core-only replay's pool, not once that one had saved its state
        # its starter's log, created at spawn (empty: its mtime stays the creation's)
        started = (replay / "pool-replay" / "pool" / "prefork.log").stat().st_mtime
        assert started < (replay / "core-only-state" / "index.json").stat().st_mtime
