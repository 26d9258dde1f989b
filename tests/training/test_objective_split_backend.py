"""A Core + Hybrid split of one step stays the full-batch step, for every loss aggregation, with
a real Hugging Face model (generated tiny Qwen3), off-policy behaviour log-probs, the delivery
ledger and the weighted reduction the pool uses — in one process (no Gloo: the reduction is
`weighted_sum`, which `weighted_allreduce_` equals; the pool tests cover the processes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ehp_fsm.core.batch import Delivery, DeliveryAccepted, DeliveryLedger, partition_groups
from ehp_fsm.training.backend import TorchBackend
from ehp_fsm.training.grpo import GroupBatch, synthetic_groups
from ehp_fsm.training.lane import LaneSpec
from ehp_fsm.training.objective import AGGREGATIONS, ObjectiveConfig
from ehp_fsm.training.policy import PolicyConfig
from ehp_fsm.training.reduction import weighted_sum

G, N = 5, 3


def _batch() -> GroupBatch:
    """Synthetic groups with behaviour log-probs that are not the model's (off-policy), and
    completions of different lengths (token_mean then weighs replicas by their tokens)."""
    b = synthetic_groups(range(G), group_size=N, config=PolicyConfig(max_len=16), seed=4)
    gen = torch.Generator().manual_seed(9)
    old = -1.5 - torch.rand(b.tokens.shape, generator=gen, dtype=torch.float32)
    return GroupBatch(
        group_ids=b.group_ids,
        group_size=b.group_size,
        tokens=b.tokens,
        completion=b.completion,
        rewards=b.rewards,
        old_logp=torch.where(b.completion, old, torch.zeros_like(old)),
    )


def _grads(be: TorchBackend, batch: GroupBatch, step: int) -> tuple[int, list[torch.Tensor]]:
    d = be.compute(batch, step=step, epoch=0)
    return d.record.samples, [g.clone() for g in d.grads]


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_a_split_step_is_the_full_batch_step(aggregation: str, tiny_model_dir: Path) -> None:
    objective = ObjectiveConfig(
        aggregation=aggregation,  # type: ignore[arg-type]
        clip_low=0.1,
        clip_high=0.1,
    )
    be = TorchBackend(str(tiny_model_dir), seed=0, objective=objective)
    be.build(LaneSpec(role="hybrid", replica="core:0", pad_multiple=1))
    batch = _batch()
    units, full = _grads(be, batch, 0)
    expected_units = batch.response_tokens if aggregation == "token_mean" else batch.samples
    assert units == expected_units

    part = partition_groups(
        groups=batch.group_ids, live={"core:0": 1, "hybrid:x": 1}, group_size=N, step=0, epoch=0
    )
    if aggregation == "token_mean":
        part = part.with_units(
            {r: batch.select(part.groups_of(r)).response_tokens for r in part.replicas}
        )
    ledger = DeliveryLedger.open(part, shapes=be.grad_shapes(), deadline=1e9)
    pieces = []
    for r in part.replicas:
        u, g = _grads(be, batch.select(part.groups_of(r)), 0)
        ledger, out = ledger.offer(
            Delivery(step=0, epoch=0, replica=r, samples=u, shapes=be.grad_shapes()), now=0.0
        )
        assert isinstance(out, DeliveryAccepted), out
        pieces.append((u, g))
    assert ledger.total_samples == part.total_units == units
    reduced = weighted_sum(pieces, total_samples=ledger.total_samples)
    worst = max(float((a - b).abs().max()) for a, b in zip(reduced, full, strict=True))
    scale = max(float(b.abs().max()) for b in full)
    assert scale > 0 and worst <= 1e-5 * scale, (aggregation, worst, scale)


def test_token_mean_weighs_replicas_by_tokens_not_samples(tiny_model_dir: Path) -> None:
    # The same split weighed by samples instead of tokens is not the full-batch gradient
    # (the test above would pass a wrong rule only if token counts happened to be equal).
    objective = ObjectiveConfig(aggregation="token_mean")
    be = TorchBackend(str(tiny_model_dir), seed=0, objective=objective)
    be.build(LaneSpec(role="hybrid", replica="core:0", pad_multiple=1))
    batch = _batch()
    _, full = _grads(be, batch, 0)
    part = partition_groups(
        groups=batch.group_ids, live={"a": 1, "b": 1}, group_size=N, step=0, epoch=0
    )
    subs = [batch.select(part.groups_of(r)) for r in part.replicas]
    assert subs[0].response_tokens * subs[1].samples != subs[1].response_tokens * subs[0].samples
    wrong = weighted_sum(
        [(s.samples, _grads(be, s, 0)[1]) for s in subs], total_samples=batch.samples
    )
    worst = max(float((a - b).abs().max()) for a, b in zip(wrong, full, strict=True))
    assert worst > 1e-4 * max(float(b.abs().max()) for b in full)


def test_kl_reference_is_the_initial_model_on_every_lane(tiny_model_dir: Path) -> None:
    # kl_coef > 0: a frozen copy of the initial weights is the reference — the same on a warm
    # Hybrid, whose own start is perturbed (it must load the Core's state) — and the KL term
    # changes the gradient; kl_coef = 0 builds no reference at all.
    objective = ObjectiveConfig(kl_coef=0.5)
    core = TorchBackend(str(tiny_model_dir), seed=0, objective=objective)
    warm = TorchBackend(str(tiny_model_dir), seed=7919, objective=objective, perturb=True)
    plain = TorchBackend(str(tiny_model_dir), seed=0)
    for be in (core, warm, plain):
        be.build(LaneSpec(role="hybrid", replica="core:0", pad_multiple=1))
    assert plain.reference is None
    assert core.reference is not None and warm.reference is not None
    for a, b in zip(
        core.reference.state_dict().values(), warm.reference.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b)
    moved = [
        not torch.equal(a, b)
        for a, b in zip(
            core.lane.model.state_dict().values(),
            warm.lane.model.state_dict().values(),
            strict=True,
        )
    ]
    assert all(moved)  # the warm lane's own weights start elsewhere
    batch = _batch()
    # the Core's model is its reference at first: KL 0 and a zero KL gradient; move it, and
    # the KL term shows in the metrics
    d = core.compute(batch, step=0, epoch=0)
    assert d.metrics.ref_kl == 0.0
    with torch.no_grad():
        for p in core.lane.model.parameters():
            p.add_(0.05)
    assert core.compute(batch, step=0, epoch=0).metrics.ref_kl > 0.0
