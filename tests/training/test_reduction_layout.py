"""The in-place reduction design: gradients as views of a flat buffer are reduced where they lie
(no allocation), scattered gradients share one reusable staging bucket (memory bounded by the
bucket, not the model), the collectives follow from shapes alone (members with different memory
layouts still agree), and live gradient buffers moved into a flat buffer stay valid across steps.

Allocations are counted by torch's own CPU allocator records (`torch.profiler` with
`profile_memory=True`); the first test shows the meter sees an allocation when there is one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from ehp_fsm.training.grpo import ON_POLICY, replica_loss, synthetic_groups
from ehp_fsm.training.policy import PolicyConfig, build_policy
from ehp_fsm.training.reduction import (
    flat_gradients,
    release_staging,
    staging_bytes_held,
    weighted_allreduce_,
)
from ehp_fsm.training.snapshot import LiveGradients
from tests.training import workers
from tests.training.harness import run_ranks

KIB = 1024


class Meter:
    allocated: int = 0  # total bytes handed out (frees not subtracted)
    largest: int = 0  # the largest single allocation

    def only_scalars(self, collectives: int) -> bool:
        """Nothing but the 0-dim tensors torch wraps a Python number in (`t.mul_(0.5)`, one per
        bucket)."""
        return self.largest <= 8 and self.allocated <= 16 * collectives


@contextmanager
def allocated_bytes() -> Iterator[Meter]:
    """What torch's CPU allocator handed out inside the block."""
    meter = Meter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield meter
    sizes = [e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0]
    meter.allocated = sum(sizes)
    meter.largest = max(sizes, default=0)


def _shapes(n_small: int) -> list[tuple[int, ...]]:
    gen = torch.Generator().manual_seed(n_small)
    return [
        tuple(int(x) for x in torch.randint(1, 40, (2,), generator=gen)) for _ in range(n_small)
    ]


def test_the_meter_sees_a_flatten_everything_allocation():
    grads = [torch.ones(s) for s in _shapes(50)]
    total = sum(g.numel() * 4 for g in grads)
    with allocated_bytes() as m:
        torch.cat([g.reshape(-1) * 0.5 for g in grads])
    assert m.allocated >= 2 * total  # the scaled copies and the concatenation


def test_flat_views_are_reduced_in_place_without_allocating():
    shapes = [*_shapes(200), (300, 100)]  # small ones plus one larger than half a bucket
    flat, views = flat_gradients(shapes)
    flat.copy_(torch.randn(flat.numel(), generator=torch.Generator().manual_seed(1)))
    want = [v.clone() * (3 / 8) for v in views]
    ptrs = [v.data_ptr() for v in views]
    weighted_allreduce_(views, samples=3, total_samples=8, bucket_bytes=64 * KIB)  # warm
    for w in want:
        w.mul_(3 / 8)
    with allocated_bytes() as m:
        stats = weighted_allreduce_(views, samples=3, total_samples=8, bucket_bytes=64 * KIB)
    assert m.only_scalars(stats.collectives), (m.allocated, m.largest)
    assert stats.bytes_in_place == stats.bytes_reduced == flat.numel() * 4
    assert stats.staging_bytes == 0 and stats.bucket_bytes_allocated == 0
    assert [v.data_ptr() for v in views] == ptrs  # the views stay valid: nothing was re-homed
    for w, v in zip(want, views, strict=True):
        torch.testing.assert_close(v, w, rtol=0, atol=0)


@pytest.mark.parametrize("n_small", [300, 3000])
def test_scattered_gradients_use_one_reusable_bucket_whatever_the_model_size(n_small):
    bucket = 16 * KIB
    release_staging()
    grads = [torch.randn(s) for s in _shapes(n_small)]
    total = sum(g.numel() * 4 for g in grads)
    assert total > 20 * bucket  # many buckets' worth of small tensors
    want = [g * 0.25 for g in grads]
    with allocated_bytes() as first:
        s1 = weighted_allreduce_(grads, samples=1, total_samples=4, bucket_bytes=bucket)
    with allocated_bytes() as second:
        s2 = weighted_allreduce_(grads, samples=4, total_samples=4, bucket_bytes=bucket)
    # One staging bucket, whatever the number of tensors; besides it only the scalar wrappers
    # (at most 16 bytes per collective).
    assert first.largest <= bucket
    assert first.allocated <= bucket + 16 * s1.collectives
    assert s1.bucket_bytes_allocated <= bucket
    assert second.only_scalars(s2.collectives) and s2.bucket_bytes_allocated == 0
    assert staging_bytes_held() <= bucket
    assert s1.bytes_in_place == 0 and s1.collectives > 20
    for w, g in zip(want, grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    release_staging()
    assert staging_bytes_held() == 0


def test_collectives_follow_from_shapes_not_memory_layout():
    shapes = [*_shapes(400), (200, 100), (7,)]
    _, views = flat_gradients(shapes)
    scattered = [torch.zeros(s) for s in shapes]
    a = weighted_allreduce_(views, samples=1, total_samples=2, bucket_bytes=16 * KIB)
    b = weighted_allreduce_(scattered, samples=1, total_samples=2, bucket_bytes=16 * KIB)
    assert a.collectives == b.collectives > 10
    # Scattered: only the large tensor and the lone (7,) after it are buckets of one tensor.
    assert a.bytes_in_place == a.bytes_reduced and b.bytes_in_place == (200 * 100 + 7) * 4


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_members_with_flat_and_scattered_gradients_reduce_together_over_gloo(tmp_path):
    # Rank 0 holds flat views, rank 1 separate tensors (e.g. a zero-sample delivery), rank 2
    # flat views of a buffer with a gap in it: the collectives must still match.
    res = run_ranks(workers.mixed_layout_rank, 3, tmp_path, 4 * KIB)
    assert res[0]["in_place"] == res[0]["bytes"] and res[1]["in_place"] < res[1]["bytes"]
    assert len({r["collectives"] for r in res}) == 1
    for r in res:
        for got, want in zip(r["grads"], r["expect"], strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    for a, b, c in zip(res[0]["grads"], res[1]["grads"], res[2]["grads"], strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


CFG = PolicyConfig(d_model=16, n_heads=2, d_ff=32, n_layers=1, max_len=16)


def test_live_gradients_move_into_one_flat_buffer_and_stay_valid_across_steps():
    model = build_policy(CFG, seed=2)
    params = [p for p in model.parameters()]
    for p in params:
        p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    live = LiveGradients(grads)
    try:
        (flat,) = live.flat_buffers
        lo = flat.data_ptr()
        hi = lo + flat.numel() * 4
        snaps = []
        for step in range(3):
            live.zero_()
            batch = synthetic_groups(range(step, step + 2), group_size=2, config=CFG, seed=step)
            torch.autograd.backward(replica_loss(model, batch, ON_POLICY).loss)
            ref = torch.autograd.grad(replica_loss(model, batch, ON_POLICY).loss, params)
            for p, g, r in zip(params, grads, ref, strict=True):
                assert p.grad is g  # the same tensor objects: autograd accumulated into them
                assert lo <= g.data_ptr() < hi  # ... inside the flat buffer
                torch.testing.assert_close(g, r, rtol=0, atol=0)
            snap = live.snapshot()
            assert snap.done()  # a small CPU snapshot is complete on return
            got = snap.wait()
            base = got[0].untyped_storage().data_ptr()
            assert all(t.untyped_storage().data_ptr() == base for t in got)  # one owned buffer
            assert base != flat.untyped_storage().data_ptr()
            snaps.append((got, [r.clone() for r in ref]))
        live.zero_()
        assert float(flat.abs().sum()) == 0.0
        for got, ref in snaps:  # no snapshot changed when the live buffer was rewritten
            for t, r in zip(got, ref, strict=True):
                torch.testing.assert_close(t, r, rtol=0, atol=0)
        # The snapshot is laid out for the in-place reduction: one run, reduced where it lies.
        stats = weighted_allreduce_(snaps[-1][0], samples=1, total_samples=1)
        assert stats.bytes_in_place == stats.bytes_reduced
    finally:
        live.close()


def test_live_gradients_adopt_tensors_that_already_are_flat_views():
    flat, views = flat_gradients([(3, 4), (5,), (2, 2)])
    live = LiveGradients(views)
    try:
        assert live.flat_buffers[0].data_ptr() == flat.data_ptr()
        flat.fill_(2.0)
        got = live.snapshot().wait()
        live.zero_()
        assert float(flat.abs().sum()) == 0.0
        assert all(float(t.min()) == 2.0 for t in got)
    finally:
        live.close()


def test_views_sharing_storage_otherwise_are_left_alone_and_still_owned():
    base = torch.arange(10.0)
    a, b = base[:4], base[6:]  # one storage with a gap: re-pointing would split them
    live = LiveGradients([a, b], inline_bytes=0)  # the background-thread path
    try:
        assert live.flat_buffers == ()
        snap = live.snapshot()
        live.zero_()
        got = snap.wait()
        assert got[0].tolist() == [0.0, 1.0, 2.0, 3.0] and got[1].tolist() == [6.0, 7.0, 8.0, 9.0]
        assert base[4:6].tolist() == [4.0, 5.0]  # the gap was never written
    finally:
        live.close()
