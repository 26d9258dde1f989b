"""The GRPO objective on hand-sized examples: the importance-weighted, clipped gradient computed
by hand; the k3 KL term's gradient; kl_coef = 0 needs no reference; refusals name the fix."""

from __future__ import annotations

import math

import pytest
import torch

from ehp_fsm.training.objective import (
    ObjectiveConfig,
    ObjectiveError,
    ObjectiveMetrics,
    local_loss,
    token_log_probs,
)

# Two sequences, three positions; the second has two response tokens. ρ per token:
#   row 0 (A = +1): 1.5 (above 1 + 0.28 with A > 0: clipped, no gradient), 0.5, 1.1
#   row 1 (A = −1): 1.5 (A < 0: the unclipped branch is the larger loss), 0.5 (clipped)
RATIOS = torch.tensor([[1.5, 0.5, 1.1], [1.5, 0.5, 1.0]], dtype=torch.float64)
MASK = torch.tensor([[True, True, True], [True, True, False]])
ADV = torch.tensor([1.0, -1.0], dtype=torch.float64)
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.2, -9.0]], dtype=torch.float64)


def _leaf_logp() -> torch.Tensor:
    return (OLD + torch.log(RATIOS)).clone().requires_grad_(True)


def test_gradient_is_the_importance_weighted_clipped_reference_by_hand() -> None:
    logp = _leaf_logp()
    out = local_loss(logp, OLD, ADV, MASK, ObjectiveConfig(clip_low=0.2, clip_high=0.28))
    (grad,) = torch.autograd.grad(out.loss, [logp])
    # dℓ/dlog π = −A·ρ where the unclipped branch is taken, 0 where the clip holds; ÷ T = 5
    by_hand = torch.tensor([[0.0, -0.5, -1.1], [1.5, 0.0, 0.0]], dtype=torch.float64) / 5
    torch.testing.assert_close(grad, by_hand, rtol=0, atol=1e-15)
    assert out.weight == 5
    # ℓ per token: −min(ρA, clip(ρ)A) = [−1.28, −0.5, −1.1], [1.5, 0.8]
    assert out.loss.item() == pytest.approx((-1.28 - 0.5 - 1.1 + 1.5 + 0.8) / 5, abs=1e-15)
    m = out.metrics
    assert (m.tokens, m.clipped) == (5, 2)
    assert m.clip_fraction == pytest.approx(0.4)
    assert m.ratio_mean == pytest.approx((1.5 + 0.5 + 1.1 + 1.5 + 0.5) / 5)
    assert m.ratio_max == pytest.approx(1.5)
    k3 = [r - math.log(r) - 1 for r in (1 / 1.5, 1 / 0.5, 1 / 1.1, 1 / 1.5, 1 / 0.5)]
    assert m.approx_kl == pytest.approx(sum(k3) / 5)
    assert m.ref_kl == 0.0


@pytest.mark.parametrize(
    ("aggregation", "weight", "scale"),
    [
        # row sums of the by-hand token gradient, then each aggregation's normaliser
        ("token_mean", 5, [[1 / 5] * 3, [1 / 5] * 3]),
        ("seq_mean_token_sum", 2, [[1 / 2] * 3, [1 / 2] * 3]),
        ("seq_mean_token_mean", 2, [[1 / 6] * 3, [1 / 4] * 3]),
    ],
)
def test_each_aggregation_normalises_by_its_own_count(aggregation, weight, scale) -> None:
    logp = _leaf_logp()
    out = local_loss(logp, OLD, ADV, MASK, ObjectiveConfig(aggregation=aggregation))
    (grad,) = torch.autograd.grad(out.loss, [logp])
    raw = torch.tensor([[0.0, -0.5, -1.1], [1.5, 0.0, 0.0]], dtype=torch.float64)
    expect = raw * torch.tensor(scale, dtype=torch.float64)
    torch.testing.assert_close(grad, expect, rtol=0, atol=1e-15)
    assert out.weight == weight


def test_k3_kl_term_adds_its_gradient_by_hand() -> None:
    logp = _leaf_logp()
    ref = logp.detach() + torch.tensor([[0.3, -0.2, 0.0], [0.1, 0.4, 5.0]], dtype=torch.float64)
    cfg = ObjectiveConfig(kl_coef=0.5)
    out = local_loss(logp, OLD, ADV, MASK, cfg, ref_logp=ref)
    (grad,) = torch.autograd.grad(out.loss, [logp])
    d = (ref - logp.detach()) * MASK
    kl_grad = 0.5 * (1 - torch.exp(d)) * MASK  # d/dlog π of exp(d) − d − 1
    pg = torch.tensor([[0.0, -0.5, -1.1], [1.5, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(grad, (pg + kl_grad) / 5, rtol=0, atol=1e-15)
    assert out.metrics.ref_kl == pytest.approx(float((torch.expm1(d) - d)[MASK].mean()))


def test_kl_coef_zero_needs_no_reference_and_a_positive_one_refuses_without() -> None:
    out = local_loss(_leaf_logp(), OLD, ADV, MASK, ObjectiveConfig(kl_coef=0.0))
    assert torch.isfinite(out.loss)
    assert not ObjectiveConfig(kl_coef=0.0).needs_reference
    with pytest.raises(ObjectiveError, match="no reference log-probs") as err:
        local_loss(_leaf_logp(), OLD, ADV, MASK, ObjectiveConfig(kl_coef=0.1))
    assert "kl_coef = 0" in str(err.value)


def test_on_policy_ratio_is_one_and_nothing_clips() -> None:
    logits = torch.randn(3, 4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 6, (3, 4), generator=torch.Generator().manual_seed(2))
    logp = token_log_probs(logits, targets)
    mask = torch.ones(3, 4, dtype=torch.bool)
    out = local_loss(logp, logp.detach(), torch.tensor([1.0, 0.0, -1.0]), mask, ObjectiveConfig())
    assert out.metrics.clip_fraction == 0.0
    assert out.metrics.ratio_mean == pytest.approx(1.0)
    assert out.metrics.approx_kl == pytest.approx(0.0, abs=1e-15)


def test_a_replica_without_response_tokens_has_weight_zero_and_zero_gradient() -> None:
    logp = _leaf_logp()
    none = torch.zeros_like(MASK)
    out = local_loss(logp, OLD, ADV, none, ObjectiveConfig(aggregation="token_mean"))
    (grad,) = torch.autograd.grad(out.loss, [logp])
    assert out.weight == 0
    assert torch.count_nonzero(grad) == 0
    assert out.metrics == ObjectiveMetrics()


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"clip_low": 1.0}, "clip_low"),
        ({"clip_high": -0.1}, "clip_high"),
        ({"kl_coef": float("nan")}, "kl_coef"),
        ({"aggregation": "sum"}, "seq_mean_token_mean"),
    ],
)
def test_bad_config_is_refused_with_the_key_and_a_fix(kwargs, needle) -> None:
    with pytest.raises(ObjectiveError, match=needle) as err:
        ObjectiveConfig(**kwargs)
    assert "Fix:" in str(err.value)


def test_mismatched_shapes_are_refused() -> None:
    with pytest.raises(ObjectiveError, match="old_logp has shape"):
        local_loss(_leaf_logp(), OLD[:, :2], ADV, MASK, ObjectiveConfig())
    with pytest.raises(ObjectiveError, match="advantages has shape"):
        local_loss(_leaf_logp(), OLD, ADV[:1], MASK, ObjectiveConfig())
