"""Σ (nᵢ/B)·ḡᵢ equals the full-batch mean gradient for random partitions of whole groups on the
real tiny policy; and the ledger-collected reduction uses exactly the valid first deliveries."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from ehp_fsm.core.batch import Delivery, DeliveryAccepted, DeliveryRejected, partition_groups
from ehp_fsm.training.backend import GradientDelivery
from ehp_fsm.training.collect import DeliveryCollector
from ehp_fsm.training.grpo import mean_gradient, synthetic_groups
from ehp_fsm.training.policy import PolicyConfig, build_policy
from ehp_fsm.training.reduction import flat_gradients, weighted_allreduce_, weighted_sum

CFG = PolicyConfig(d_model=16, n_heads=2, d_ff=32, n_layers=1, max_len=16)
MODEL = build_policy(CFG, seed=3)

live_maps = st.dictionaries(
    st.sampled_from(["core-0", "core-1", "hybrid:a", "hybrid:b"]),
    st.integers(1, 3),
    min_size=1,
    max_size=4,
)


# Each example runs one real forward/backward per replica plus the full batch (~0.4 s on the
# shared two-core machine): 20 examples keep
# this property under ~10 s.
@settings(max_examples=20)
@given(
    groups=st.integers(1, 8),
    n=st.integers(1, 4),
    live=live_maps,
    seed=st.integers(0, 99),
    bucket=st.sampled_from([1024, 4096, 1 << 20]),
)
def test_weighted_reduction_equals_full_batch_gradient(groups, n, live, seed, bucket):
    p = partition_groups(
        groups=range(groups), live=live, group_size=n, step=0, epoch=0, require_work=False
    )
    full = synthetic_groups(range(groups), group_size=n, config=CFG, seed=seed)
    expect = mean_gradient(MODEL, full)
    parts = []
    for r in p.working_replicas:
        g = mean_gradient(MODEL, full.select(p.groups_of(r)))
        parts.append((p.samples_of(r), g))
    got = weighted_sum(parts, total_samples=p.total_samples)
    # The bucketed path in one process scales by nᵢ/B; summing the scaled copies is the same.
    scaled = []
    for samples, g in parts:
        copy = [t.clone() for t in g]
        stats = weighted_allreduce_(
            copy, samples=samples, total_samples=p.total_samples, bucket_bytes=bucket
        )
        assert stats.bucket_bytes_allocated <= bucket
        scaled.append(copy)
    summed = [torch.stack(ts).sum(0) for ts in zip(*scaled, strict=True)]
    for e, a, s in zip(expect, got, summed, strict=True):
        torch.testing.assert_close(a, e, atol=2e-6, rtol=1e-4)
        torch.testing.assert_close(s, e, atol=2e-6, rtol=1e-4)


SHAPES = ((3, 2), (5,))


def _grads(tag: float) -> tuple[torch.Tensor, ...]:
    return tuple(torch.full(s, tag) for s in SHAPES)


@given(
    n_replicas=st.integers(1, 3),
    script=st.lists(
        st.tuples(
            st.sampled_from(["valid", "valid", "stale", "epoch", "samples"]),
            st.integers(0, 2),
            st.booleans(),
        ),
        max_size=20,
    ),
)
def test_collector_reduces_exactly_the_first_valid_deliveries(n_replicas, script):
    live = {f"r{i}": 1 for i in range(n_replicas)}
    p = partition_groups(groups=range(2 * n_replicas), live=live, group_size=2, step=4, epoch=1)
    col = DeliveryCollector(p, shapes=SHAPES, deadline=10.0)
    first: dict[str, float] = {}
    rejected = 0
    with capture_logs() as logs:
        for i, (kind, who, late) in enumerate(script):
            r = f"r{who % n_replicas}"
            rec = Delivery(
                step=3 if kind == "stale" else 4,
                epoch=0 if kind == "epoch" else 1,
                replica=r,
                samples=p.samples_of(r) + (1 if kind == "samples" else 0),
                shapes=SHAPES,
            )
            out = col.offer(
                GradientDelivery(record=rec, grads=_grads(float(i + 1))), now=11.0 if late else 1.0
            )
            if isinstance(out, DeliveryAccepted):
                first[r] = float(i + 1)
            else:
                assert isinstance(out, DeliveryRejected)
                rejected += 1
        col.expire(now=20.0)
    rej_logs = [e for e in logs if e["event"] == "delivery_rejected"]
    assert len(rej_logs) == rejected
    for e in rej_logs:
        assert {"step", "epoch", "replica", "reason"} <= e.keys()
    if len(first) == n_replicas:
        got = col.reduced()
        want = weighted_sum(
            [(p.samples_of(r), _grads(first[r])) for r in sorted(first)],
            total_samples=p.total_samples,
        )
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b)
    else:
        assert set(col.ledger.missing) == set(live) - set(first)
        assert any(e["event"] == "step_failed" for e in logs)


def _laid_out(values: list[torch.Tensor], layout: str) -> list[torch.Tensor]:
    if layout == "flat":
        _, views = flat_gradients([tuple(v.shape) for v in values])
    elif layout == "scattered":
        views = tuple(torch.empty_like(v) for v in values)
    else:  # "gapped": views of one buffer with a gap of one element after each
        big = torch.empty(sum(v.numel() + 1 for v in values))
        out, off = [], 0
        for v in values:
            out.append(big[off : off + v.numel()].view(v.shape))
            off += v.numel() + 1
        views = tuple(out)
    for d, v in zip(views, values, strict=True):
        d.copy_(v)
    return list(views)


@given(
    sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=30),
    bucket=st.sampled_from([1024, 4096, 16384]),
    samples=st.integers(0, 5),
    seed=st.integers(0, 99),
)
def test_every_memory_layout_gives_the_same_result_and_the_same_collectives(
    sizes, bucket, samples, seed
):
    gen = torch.Generator().manual_seed(seed)
    values = [torch.randn(n, generator=gen) for n in sizes]
    want = [v * (samples / 5) for v in values]
    stats = {}
    for layout in ("flat", "scattered", "gapped"):
        grads = _laid_out(values, layout)
        stats[layout] = weighted_allreduce_(
            grads, samples=samples, total_samples=5, bucket_bytes=bucket
        )
        for g, w in zip(grads, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert len({s.collectives for s in stats.values()}) == 1
    assert stats["flat"].bytes_in_place == stats["flat"].bytes_reduced == 4 * sum(sizes)
    assert stats["flat"].staging_bytes == 0
    assert all(s.staging_bytes <= bucket for s in stats.values())
