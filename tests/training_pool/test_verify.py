"""verify's state dirs, recording and streaming comparison, in one process on real lanes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ehp_fsm.training import verify
from ehp_fsm.training.adam import AdamConfig
from ehp_fsm.training.dpzero import local_dp_zero
from ehp_fsm.training.grpo import mean_gradient, synthetic_groups
from ehp_fsm.training.lane import LaneSpec, TrainingLane
from ehp_fsm.training.policy import PolicyConfig, build_policy

CFG = PolicyConfig(d_model=32, n_heads=4, d_ff=64, n_layers=2, max_len=16)


def _trained_lane(steps: int, *, pad: int = 64) -> TrainingLane:
    lane = TrainingLane(
        build_policy(CFG, seed=2),
        LaneSpec(role="hybrid", replica="h", pad_multiple=pad, adam=AdamConfig(eps=1e-6)),
    )
    for s in range(steps):
        batch = synthetic_groups(range(s * 4, s * 4 + 4), group_size=3, config=CFG, seed=1)
        lane.apply(mean_gradient(lane.model, batch))
    return lane


def _write(lane: TrainingLane, path: Path) -> Path:
    verify.write_state(path, params=dict(lane.named), world=local_dp_zero(lane), layout=lane.layout)
    return path


def test_same_state_is_bit_exact_whatever_the_padding(tmp_path: Path) -> None:
    a = _write(_trained_lane(2, pad=64), tmp_path / "a")
    b = _write(_trained_lane(2, pad=5), tmp_path / "b")
    report = verify.compare_states(a, b, exact=True)
    assert report.passed, report.lines()
    assert all(c.bit_exact and c.tensors > 0 for c in report.categories.values())
    assert report.peak_extra_bytes < report.state_bytes / 4
    assert report.seconds > 0


def test_perturbation_fails_and_names_the_tensor(tmp_path: Path) -> None:
    a = _write(_trained_lane(2), tmp_path / "a")
    lane = _trained_lane(2)
    name = lane.named[3][0]
    with torch.no_grad():
        lane.exp_avg[0][lane.layout.slot(name).offset] += 1e-3
    b = _write(lane, tmp_path / "b")
    tolerant = verify.compare_states(b, a, exact=False)
    assert not tolerant.passed
    assert [f for f in tolerant.failures if f.startswith(f"exp_avg/{name}:")]
    assert tolerant.categories["exp_avg"].worst == f"exp_avg/{name}"
    assert tolerant.categories["param"].bit_exact
    # A difference inside the tolerance passes with atol/rtol and fails bit-exact.
    lane2 = _trained_lane(2)
    with torch.no_grad():
        lane2.master[0][0] += 1e-6
    c = _write(lane2, tmp_path / "c")
    assert verify.compare_states(c, a, exact=False).passed
    assert not verify.compare_states(c, a, exact=True).passed


def test_steps_and_version_are_compared_exactly(tmp_path: Path) -> None:
    report = verify.compare_states(
        _write(_trained_lane(2), tmp_path / "a"),
        _write(_trained_lane(3), tmp_path / "b"),
        exact=False,
    )
    assert not report.passed and not report.steps_equal and report.version == (2, 3)


def test_record_and_load_steps(tmp_path: Path) -> None:
    batch = synthetic_groups(range(4), group_size=3, config=CFG, seed=1)
    verify.record_step(
        tmp_path, step=0, epoch=1, partition={"core:0": [0, 1], "hybrid:a": [2, 3]}, batch=batch
    )
    (rec,) = verify.load_records(tmp_path)
    assert rec.hybrids == ("hybrid:a",) and rec.epoch == 1
    assert torch.equal(rec.batch.tokens, batch.tokens)
    with pytest.raises(verify.VerifyError, match="covers groups"):
        verify.record_step(tmp_path, step=1, epoch=1, partition={"core:0": [0]}, batch=batch)
    with pytest.raises(verify.VerifyError, match="not a complete state dir"):
        verify.compare_states(tmp_path, tmp_path, exact=True)


def test_a_group_recorded_twice_is_named(tmp_path: Path) -> None:
    """Both replays repeat a recorded batch as it is: a group handed to training twice (in two
    steps, or twice in one) is seen by `repeats`, which verify reports as a failure."""
    first = synthetic_groups([0, 1], group_size=3, config=CFG, seed=1)
    again = synthetic_groups([2, 1], group_size=3, config=CFG, seed=1)
    twice = synthetic_groups([4, 4], group_size=3, config=CFG, seed=1)
    for step, batch in ((1, first), (2, again), (3, twice)):
        verify.record_step(
            tmp_path, step=step, epoch=0, partition={"core:0": batch.group_ids}, batch=batch
        )
    assert verify.repeats(verify.load_records(tmp_path)) == (
        "group 1 was trained in step 1 and step 2",
        "group 4 was trained twice in step 3",
    )
    clean = tmp_path / "clean"
    verify.record_step(clean, step=1, epoch=0, partition={"core:0": [0, 1]}, batch=first)
    assert verify.repeats(verify.load_records(clean)) == ()


def test_a_state_dir_round_trips_buckets_placed_in_one_world_tensor(tmp_path: Path) -> None:
    """Megatron shards per bucket but gathers a grad buffer's buckets into one world tensor,
    back to back without their padding (under PP a stage's shared embedding has a bucket of
    its own): each parameter is written from, and read back into, its bucket's place there.
    Before, the state dir looked for a world tensor per bucket (`KeyError: 1`)."""
    from ehp_fsm.training.dpzero import DpZeroState
    from ehp_fsm.training.layout import BufferLayout, FlatLayout, ParamSlot

    f32 = torch.float32
    buckets = (
        BufferLayout(
            index=0, param_dtype=f32, grad_dtype=f32, numel_unpadded=6, numel_padded=8,
            shard_numel=8, world_buffer=0, world_offset=0,
        ),
        BufferLayout(
            index=1, param_dtype=f32, grad_dtype=f32, numel_unpadded=4, numel_padded=8,
            shard_numel=8, world_buffer=0, world_offset=6,
        ),
    )  # fmt: skip
    layout = FlatLayout(
        params=(
            ParamSlot(name="a", shape=(2, 3), buffer=0, offset=0),
            ParamSlot(name="embedding", shape=(4,), buffer=1, offset=0),
        ),
        buffers=buckets,
        dp_size=1,
        pad_multiple=1,
    )
    world = {
        key: torch.arange(10, dtype=f32) + 100 * i
        for i, key in enumerate(("param", "exp_avg", "exp_avg_sq"))
    }
    state = DpZeroState(
        buffers={0: {(f32, f32): {**world, "numel_unpadded": 10}}},
        steps={"a": 3.0, "embedding": 3.0},
        hyper=({"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},),
        version=3,
    )
    params = {"a": torch.zeros(2, 3), "embedding": torch.ones(4)}
    verify.write_state(tmp_path / "s", params=params, world=state, layout=layout)
    back = verify.read_state(tmp_path / "s", layout)
    assert list(back.buffers) == [0]
    got = back.buffers[0][(f32, f32)]
    assert got["numel_unpadded"] == 10
    for key, t in world.items():
        assert torch.equal(got[key], t), key
    saved = torch.load(
        tmp_path / "s" / _file(tmp_path / "s", "master/embedding"), weights_only=True
    )
    assert torch.equal(saved, world["param"][6:10])


def _file(path: Path, key: str) -> str:
    return next(e["file"] for e in verify.read_index(path)["tensors"] if e["key"] == key)
