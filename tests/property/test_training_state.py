"""Capture/restore round trips for random shapes, dtypes and paddings, and DP-zero world-tensor
round trips between layouts with different DP sizes and paddings."""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ehp_fsm.training.adam import AdamConfig
from ehp_fsm.training.dpzero import local_dp_zero, scatter_dp_zero, shards_to_world, world_to_shard
from ehp_fsm.training.lane import STATE_KEYS, LaneSpec, TrainingLane
from ehp_fsm.training.layout import FlatLayout

shapes_st = st.lists(
    st.lists(st.integers(1, 7), min_size=1, max_size=3).map(tuple), min_size=1, max_size=5
)


class Bag(nn.Module):
    def __init__(self, shapes, seed):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(s, generator=gen)) for s in shapes])


def _lane(shapes, dtype, pad, seed=0):
    return TrainingLane(
        Bag(shapes, seed),
        LaneSpec(
            role="hybrid",
            replica="h",
            pad_multiple=pad,
            param_dtype=dtype,
            adam=AdamConfig(lr=1e-2, weight_decay=0.1),
        ),
    )


def _grads(shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in shapes]


def _assert_same(a: TrainingLane, b: TrainingLane):
    for (n, p), (_, q) in zip(a.named, b.named, strict=True):
        assert p.dtype == q.dtype
        assert torch.equal(p, q), n
    # Compare world (unpadded) tensors: the two lanes may pad differently.
    wa, wb = local_dp_zero(a).buffers, local_dp_zero(b).buffers
    assert wa.keys() == wb.keys()
    for buf in wa:
        (ka, ea), (kb, eb) = next(iter(wa[buf].items())), next(iter(wb[buf].items()))
        assert ka == kb
        assert ea["numel_unpadded"] == eb["numel_unpadded"]
        for k in STATE_KEYS:
            assert torch.equal(ea[k], eb[k]), (buf, k)
    if a.layout == b.layout:
        sa, sb = a.shard_tensors(), b.shard_tensors()
        for buf in sa:
            for k in STATE_KEYS:
                assert torch.equal(sa[buf][k], sb[buf][k]), (buf, k)
    assert a.piece_steps() == b.piece_steps()
    assert a.hyperparameters() == b.hyperparameters()
    assert a.version == b.version


# Each example builds two lanes and runs up to four real Adam steps: 100 examples suffice.
@settings(max_examples=100)
@given(
    shapes=shapes_st,
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    pad=st.integers(1, 40),
    steps=st.integers(0, 2),
    seed=st.integers(0, 1000),
)
def test_capture_restore_round_trip_is_exact(shapes, dtype, pad, steps, seed):
    src = _lane(shapes, dtype, pad, seed=seed)
    for i in range(steps):
        src.apply(_grads(shapes, seed + i))
    src.optimizer.param_groups[0]["lr"] = 3e-3  # a scheduler moved it: must travel
    state = src.capture()
    dst = _lane(shapes, dtype, pad, seed=seed + 1)  # different weights before restore
    dst.restore(state)
    _assert_same(src, dst)
    # Captured state is owned: stepping the source does not change it.
    src.apply(_grads(shapes, 99))
    assert state.version == steps
    # The restored lane's step tensors are independent: one step advances each by exactly 1.
    steps_t = dst.step_tensors()
    assert len({t.data_ptr() for t in steps_t}) == len(steps_t)
    dst.restore(state)
    src.restore(state)
    src.apply(_grads(shapes, 7))
    dst.apply(_grads(shapes, 7))
    _assert_same(src, dst)
    assert all(v == steps + 1 for v in dst.piece_steps().values())


@settings(max_examples=100)
@given(
    shapes=shapes_st,
    pad_a=st.integers(1, 40),
    pad_b=st.integers(1, 40),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 1000),
)
def test_dp_zero_transfer_between_paddings_is_exact(shapes, pad_a, pad_b, dtype, seed):
    a = _lane(shapes, dtype, pad_a, seed=seed)
    a.apply(_grads(shapes, seed))
    a.apply(_grads(shapes, seed + 1))
    world = local_dp_zero(a)
    entry = next(iter(world.buffers[0].values()))
    assert entry["numel_unpadded"] == sum(p.numel() for _, p in a.named)
    assert set(world.megatron_dict()) == {"buckets_coalesced", 0}
    b = _lane(shapes, dtype, pad_b, seed=seed + 5)
    scatter_dp_zero(world, b, group=None)
    _assert_same(a, b)
    a.apply(_grads(shapes, 3))
    b.apply(_grads(shapes, 3))
    _assert_same(a, b)


@given(
    numels=st.lists(st.integers(1, 50), min_size=1, max_size=6),
    dp_a=st.integers(1, 4),
    dp_b=st.integers(1, 4),
    pad_a=st.integers(1, 16),
    pad_b=st.integers(1, 16),
    seed=st.integers(0, 100),
)
def test_world_tensors_round_trip_across_dp_sizes(numels, dp_a, dp_b, pad_a, pad_b, seed):
    named = [(f"p{i}", (n,)) for i, n in enumerate(numels)]
    la = FlatLayout.build(named, dp_size=dp_a, pad_multiple=pad_a, param_dtype=torch.float32)
    lb = la.with_dp(dp_size=dp_b, pad_multiple=pad_b)
    la.check_same_params(lb)
    total = sum(numels)
    gen = torch.Generator().manual_seed(seed)
    truth = {k: torch.randn(total, generator=gen) for k in STATE_KEYS}
    world = {0: {la.buffers[0].dtype_key: {**truth, "numel_unpadded": total}}}
    shards_a = [world_to_shard(world, la, r) for r in range(dp_a)]
    for r, s in enumerate(shards_a):
        lo, hi = la.shard_range(0, r)
        assert s[0]["param"].numel() == hi - lo == la.buffers[0].shard_numel
        # Padding is zero.
        pad_from = max(0, total - lo)
        assert torch.all(s[0]["param"][pad_from:] == 0)
    world_a = shards_to_world(shards_a, la)
    shards_b = [world_to_shard(world_a, lb, r) for r in range(dp_b)]
    back = shards_to_world(shards_b, lb)[0][lb.buffers[0].dtype_key]
    for k in STATE_KEYS:
        assert torch.equal(back[k], truth[k])
    # Every element of every parameter lies in exactly one piece across the DP ranks.
    covered = sorted(
        (p.name, p.param_start, p.param_end) for r in range(dp_b) for p in lb.pieces(r)
    )
    for name, n in named:
        spans = [(s, e) for nm, s, e in covered if nm == name]
        assert spans[0][0] == 0
        assert spans[-1][1] == n[0]
        assert all(x[1] == y[0] for x, y in itertools.pairwise(spans))
