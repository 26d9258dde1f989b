"""The GRPO objective as a researcher bringing their own model, prompts and reward checks it:
every expected value here is computed by hand (Python floats and `math`, fp64), never by the
code under test.

- group advantages: population std, ε = 1e-6, equal-reward groups exactly 0, huge rewards;
- the clipped surrogate: sign, clip-higher's two sides, no clip of a favourable ratio, k3 KL;
- a ratio that overflows float32 on a side the clip holds (or an advantage of 0) gives the
  clipped/zero loss and a zero gradient, not NaN;
- the whole path a run takes (`layout_batch` of engine answers → `GroupBatch` →
  `replica_loss`): prompt, padding and the stop token masked as the docs say, truncated and
  empty responses, the behaviour log-probs aligned with their tokens, temperature, reference,
  every aggregation — and every partition into whole groups giving the full-batch gradient;
- every `[grpo]` objective key changes the gradient, and out-of-range values are refused.

The models are a bigram table and a per-position logit table (not a transformer): the
gradient of log-softmax w.r.t. a logit row is written out by hand, which a transformer's is not.
"""

from __future__ import annotations

import copy
import itertools
import math
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from torch import nn

from ehp_fsm.errors import PlanError
from ehp_fsm.plan import parse_plan
from ehp_fsm.run.startup import pool_config
from ehp_fsm.training.grpo import GroupBatch, group_advantages, replica_loss
from ehp_fsm.training.objective import ObjectiveConfig, ObjectiveError, local_loss
from ehp_fsm.training.reduction import weighted_sum
from ehp_fsm.training.task import GroupSamples, Scored, layout_batch

F32_MAX = 3.4028234663852886e38
EPS = 1e-6

# -- group-normalised advantages ----------------------------------------------------------------


def test_advantage_is_reward_minus_group_mean_over_population_std_plus_eps() -> None:
    # [1, 0, 0, 0]: mean 0.25, population variance (0.75² + 3·0.25²)/4 = 0.1875. The sample
    # std (÷ n − 1) would be 0.5 and give 1.5 for the first sample: README says population.
    std = math.sqrt(0.1875)
    got = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 5.0, 5.0, 2.0]), 4).tolist()
    # second group [2, 5, 5, 2]: mean 3.5, population std 1.5
    expect = [0.75 / (std + EPS)] + [-0.25 / (std + EPS)] * 3
    expect += [-1.5 / (1.5 + EPS), 1.5 / (1.5 + EPS), 1.5 / (1.5 + EPS), -1.5 / (1.5 + EPS)]
    assert got == pytest.approx(expect, rel=1e-6, abs=0)
    assert got[0] != pytest.approx(1.5, rel=1e-3)  # not the sample std


def test_eps_is_added_to_the_std_not_the_variance() -> None:
    # [0, 1e-6]: population std 5e-7; (r − mean)/(std + 1e-6) = ±5e-7/1.5e-6 = ±1/3
    got = group_advantages(torch.tensor([0.0, 1e-6], dtype=torch.float64), 2).tolist()
    assert got == pytest.approx([-1 / 3, 1 / 3], rel=1e-6)


def test_a_group_of_equal_rewards_has_advantage_exactly_zero_and_no_nan() -> None:
    rewards = torch.tensor([0.1, 0.1, 0.1, 3.0, 3.0, 3.0, 0.0, 1.0, 0.5], dtype=torch.float32)
    got = group_advantages(rewards, 3)
    assert torch.isfinite(got).all()
    assert got[:6].tolist() == [0.0] * 6  # exactly, not ~ulp/ε
    # the third group is untouched by the others: mean 0.5, population std √(1/6)
    s = math.sqrt(1 / 6)
    assert got[6:].tolist() == pytest.approx([-0.5 / (s + EPS), 0.5 / (s + EPS), 0.0], abs=1e-6)


def test_a_group_of_one_has_advantage_zero_and_the_plan_refuses_it() -> None:
    assert group_advantages(torch.tensor([3.0, -2.0]), 1).tolist() == [0.0, 0.0]
    with pytest.raises(PlanError, match="group_size") as err:
        _plan(group_size=1)
    assert "group_size = 2 or more" in str(err.value)


def test_rewards_at_float32_range_give_finite_unit_advantages() -> None:
    # the reward checker lets ±float32 max through (data.rewards.MOST); mean 0, std F32_MAX
    got = group_advantages(torch.tensor([F32_MAX, -F32_MAX], dtype=torch.float32), 2)
    assert got.tolist() == [1.0, -1.0]


def test_rewards_that_float32_cannot_tell_apart_keep_their_advantages_to_the_trainer() -> None:
    """Rewards 1e8, 1e8 + 1, 1e8 + 2 were laid out in float32, where all three are 1e8: the
    group's advantages were 0, without a word (an ML user's find), though `group_advantages`
    computes in float64. The batch holds them in float64, and so does the trainer pool's wire
    (`pool_protocol.encode_batch`)."""
    from ehp_fsm.training.pool_protocol import decode_batch, encode_batch

    prompt, comps, _ = GROUPS[0]
    rewards = [1e8 + k for k in range(len(comps))]
    group = GroupSamples(
        group_index=0,
        question=_Prompt(0, prompt),
        completions=tuple(comps),
        scores=tuple(Scored(reward=r, exact=False, well_formed=True) for r in rewards),
        logprobs=None,
    )
    batch = decode_batch(encode_batch(layout_batch([group], seq_len=SEQ_LEN, pad=PAD)))
    assert batch.rewards.tolist() == rewards
    adv = group_advantages(batch.rewards, len(comps))
    exact = torch.tensor(rewards, dtype=torch.float64)
    assert adv.tolist() == group_advantages(exact, len(comps)).tolist()
    assert len(set(adv.tolist())) == len(comps) and adv.abs().max() > 1.0


# -- the clipped surrogate on single tokens -----------------------------------------------------


def _one_token(
    ratio: float, adv: float, config: ObjectiveConfig, dtype: torch.dtype = torch.float64
) -> tuple[float, float]:
    """(ℓ, dℓ/dlog π) of one response token with ρ = `ratio` and advantage `adv`."""
    old = torch.tensor([[-1.0]], dtype=dtype)
    logp = (old + math.log(ratio)).clone().requires_grad_(True)
    out = local_loss(logp, old, torch.tensor([adv], dtype=dtype), torch.tensor([[True]]), config)
    (grad,) = torch.autograd.grad(out.loss, [logp])
    return out.loss.item(), grad.item()


# (ρ, Â, clip_low, clip_high, ℓ = −min(ρÂ, clip(ρ)Â), dℓ/dlog π: −Âρ if that branch is taken)
SURROGATE_CASES = [
    (1.25, 1.0, 0.2, 0.28, -1.25, -1.25),  # inside [0.8, 1.28]: unclipped
    (1.25, 1.0, 0.2, 0.20, -1.20, 0.0),  # clip_high 0.2: 1.25 > 1.2, clipped, no gradient
    (1.50, 1.0, 0.2, 0.28, -1.28, 0.0),  # above 1 + clip_high with Â > 0: clipped
    (1.50, -1.0, 0.2, 0.28, 1.50, 1.50),  # above it with Â < 0: the unclipped loss is larger
    (0.75, -1.0, 0.2, 0.28, 0.80, 0.0),  # below 1 − clip_low with Â < 0: clipped
    (0.75, -1.0, 0.3, 0.28, 0.75, 0.75),  # clip_low 0.3: 0.75 inside [0.7, 1.28]
    (0.75, 1.0, 0.2, 0.28, -0.75, -0.75),  # below with Â > 0: unclipped (pessimistic bound)
    (1.10, 2.0, 0.0, 0.0, -2.0, 0.0),  # zero-width clip: always the clipped branch off ρ = 1
    (1.10, 0.0, 0.2, 0.28, 0.0, 0.0),  # Â = 0: nothing
]


@pytest.mark.parametrize(("ratio", "adv", "low", "high", "loss", "grad"), SURROGATE_CASES)
def test_clip_higher_surrogate_by_hand(ratio, adv, low, high, loss, grad) -> None:
    got_loss, got_grad = _one_token(ratio, adv, ObjectiveConfig(clip_low=low, clip_high=high))
    assert got_loss == pytest.approx(loss, abs=1e-12)
    assert got_grad == pytest.approx(grad, abs=1e-12)


def test_k3_kl_to_the_reference_by_hand() -> None:
    # ρ = 1, Â = 0: only the KL term. d = log π_ref − log π_θ = 0.5:
    # k3 = e^0.5 − 0.5 − 1, d/dlog π_θ = β(1 − e^0.5)
    logp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-0.5]], dtype=torch.float64)
    cfg = ObjectiveConfig(kl_coef=0.1)
    out = local_loss(
        logp,
        logp.detach(),
        torch.zeros(1, dtype=torch.float64),
        torch.tensor([[True]]),
        cfg,
        ref_logp=ref,
    )
    (grad,) = torch.autograd.grad(out.loss, [logp])
    assert out.loss.item() == pytest.approx(0.1 * (math.exp(0.5) - 1.5), abs=1e-15)
    assert grad.item() == pytest.approx(0.1 * (1 - math.exp(0.5)), abs=1e-15)
    assert out.metrics.ref_kl == pytest.approx(math.exp(0.5) - 1.5, abs=1e-15)


# exp overflows float32 past log ρ = 88.7, float64 past 709.8; the rollout client accepts
# behaviour log-probs down to −1e4 (`rollout.client.LOGPROB_FLOOR`)
OVERFLOW = [(torch.float32, 95.0), (torch.float64, 800.0)]


def _overflow_rows(dtype: torch.dtype, log_ratio: float, adv0: float):
    """Row 0: ρ = e^log_ratio, Â = adv0; row 1: an ordinary token, ρ = 1, Â = 0.5."""
    old = torch.tensor([[-log_ratio - 1.0], [-2.0]], dtype=dtype)
    logp = torch.tensor([[-1.0], [-2.0]], dtype=dtype, requires_grad=True)
    cfg = ObjectiveConfig(aggregation="seq_mean_token_sum")
    adv = torch.tensor([adv0, 0.5], dtype=dtype)
    out = local_loss(logp, old, adv, torch.ones(2, 1, dtype=torch.bool), cfg)
    (grad,) = torch.autograd.grad(out.loss, [logp])
    return out, grad.flatten().tolist()


@pytest.mark.parametrize(("dtype", "log_ratio"), OVERFLOW)
def test_an_overflowing_ratio_with_a_positive_advantage_is_clipped_with_zero_gradient(
    dtype, log_ratio
) -> None:
    # Â = +1, ρ far above 1 + 0.28: ℓ = −1.28 and no gradient (it was 0·∞ = NaN, which made
    # the whole step's gradient NaN); the ordinary token: ℓ = −0.5, dℓ/dlog π = −0.5
    out, grad = _overflow_rows(dtype, log_ratio, 1.0)
    assert out.loss.item() == pytest.approx((-1.28 - 0.5) / 2, rel=1e-6)
    assert grad == pytest.approx([0.0, -0.5 / 2], abs=1e-7)
    assert out.metrics.clipped == 1


@pytest.mark.parametrize(("dtype", "log_ratio"), OVERFLOW)
def test_an_overflowing_ratio_with_zero_advantage_adds_nothing(dtype, log_ratio) -> None:
    # Â = 0 (a group of equal rewards, the commonest kind): ℓ = 0·ρ = 0 (it was NaN)
    out, grad = _overflow_rows(dtype, log_ratio, 0.0)
    assert out.loss.item() == pytest.approx(-0.5 / 2, rel=1e-6)
    assert grad == pytest.approx([0.0, -0.5 / 2], abs=1e-7)
    assert out.metrics.clipped == 0


@pytest.mark.parametrize(("dtype", "log_ratio"), OVERFLOW)
def test_an_overflowing_ratio_with_a_negative_advantage_stays_unbounded(dtype, log_ratio) -> None:
    # Â < 0 is the side no clip bounds (README: no dual-clip, no clamp of the log-ratio): the
    # loss is ρ·|Â|, past the float's range: inf, as the formula says, never a finite stand-in
    out, _ = _overflow_rows(dtype, log_ratio, -1.0)
    assert out.loss.item() == math.inf


# -- the whole path: engine answers → layout → replica loss -------------------------------------

V, PAD, EOS = 10, 0, 2
MAX_PROMPT, MAX_NEW = 4, 4
SEQ_LEN = MAX_PROMPT + MAX_NEW


@dataclass(frozen=True)
class _Prompt:
    index: int
    prompt_ids: tuple[int, ...]
    text: str = ""


# three groups of 3: completions ending at EOS, one cut at max_new_tokens (no EOS), one that
# is only the EOS, one empty (no response token at all), a group of equal rewards
GROUPS: list[tuple[tuple[int, ...], list[tuple[int, ...]], list[float]]] = [
    ((1, 5, 6), [(7, 8, EOS), (9, EOS), (3, 4, 7, 8)], [1.0, 0.0, 0.5]),
    ((1, 4), [(EOS,), (5, 6, EOS), (6, EOS)], [0.0, 0.0, 0.0]),
    ((1, 3, 3, 3), [(6, EOS), (), (7, 7, 7, 7)], [2.0, -1.0, 0.5]),
]


def _engine_logprobs() -> list[list[list[float]]]:
    """Behaviour log-probs as an engine (an older revision) would return them: any value in
    [−3.5, −0.5], so ρ against the model spans both clip bounds."""
    gen = torch.Generator().manual_seed(11)
    return [
        [
            [-0.5 - 3.0 * float(torch.rand((), generator=gen, dtype=torch.float64)) for _ in c]
            for c in comps
        ]
        for _, comps, _ in GROUPS
    ]


def _samples(logprobs: Sequence[Sequence[Sequence[float]]] | None) -> list[GroupSamples]:
    return [
        GroupSamples(
            group_index=g,
            question=_Prompt(g, prompt),
            completions=tuple(comps),
            scores=tuple(
                Scored(reward=r, exact=False, well_formed=EOS in c)
                for r, c in zip(rewards, comps, strict=True)
            ),
            logprobs=None if logprobs is None else tuple(tuple(x) for x in logprobs[g]),
        )
        for g, (prompt, comps, rewards) in enumerate(GROUPS)
    ]


class Bigram(nn.Module):
    """logits at a position = the row of the table for the token there (fp64 table)."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = nn.Parameter(table.clone())

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.table[inputs]


def _table(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(V, V, generator=gen, dtype=torch.float64)


def _log_softmax(row: Sequence[float], temperature: float) -> list[float]:
    z = [x / temperature for x in row]
    top = max(z)
    lse = top + math.log(sum(math.exp(x - top) for x in z))
    return [x - lse for x in z]


def _hand_advantages(rewards: Sequence[float]) -> list[float]:
    if max(rewards) == min(rewards):
        return [0.0] * len(rewards)
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))  # population
    return [(r - mean) / (std + EPS) for r in rewards]


def _surrogate(ratio: float, adv: float, low: float, high: float) -> tuple[float, float]:
    """(ℓ, dℓ/dlog π) of −min(ρÂ, clip(ρ)Â), branch by branch."""
    clipped = min(max(ratio, 1 - low), 1 + high)
    unclipped_loss, clipped_loss = -ratio * adv, -clipped * adv
    if unclipped_loss >= clipped_loss:  # the unclipped branch is the loss (ties: same value)
        return unclipped_loss, -adv * ratio
    return clipped_loss, 0.0


def _hand_loss_and_grad(
    table: torch.Tensor,
    ref_table: torch.Tensor,
    groups: Sequence[int],
    cfg: ObjectiveConfig,
    old: Sequence[Sequence[Sequence[float]]] | None,
) -> tuple[float, list[list[float]], int]:
    """The global loss of `groups` (the definition in OBJECTIVE.md, by hand), its gradient
    w.r.t. the bigram table, and its units (response tokens for token_mean, else samples)."""
    w, wr = table.tolist(), ref_table.tolist()
    t = cfg.temperature
    rows = []  # (advantage, [(prev, target, old logp)])
    for g in groups:
        prompt, comps, rewards = GROUPS[g]
        for j, (comp, adv) in enumerate(zip(comps, _hand_advantages(rewards), strict=True)):
            seq = list(prompt) + list(comp)
            # position len(prompt) − 1 + k predicts completion token k; the stop token counts
            toks = [
                (seq[len(prompt) - 1 + k], comp[k], None if old is None else old[g][j][k])
                for k in range(len(comp))
            ]
            rows.append((adv, toks))
    n_tokens = sum(len(toks) for _, toks in rows)
    loss = 0.0
    grad = [[0.0] * V for _ in range(V)]
    for adv, toks in rows:
        if cfg.aggregation == "token_mean":
            scale = 1 / n_tokens
        elif cfg.aggregation == "seq_mean_token_sum":
            scale = 1 / len(rows)
        else:  # seq_mean_token_mean: an empty response adds nothing and counts in B
            scale = 1 / (len(rows) * max(len(toks), 1))
        for prev, target, lp_old in toks:
            lp_all = _log_softmax(w[prev], t)
            lp = lp_all[target]
            ratio = 1.0 if lp_old is None else math.exp(lp - lp_old)  # None: on-policy
            ell, dl = _surrogate(ratio, adv, cfg.clip_low, cfg.clip_high)
            if cfg.kl_coef > 0:
                d = _log_softmax(wr[prev], t)[target] - lp
                ell += cfg.kl_coef * (math.exp(d) - d - 1)
                dl += cfg.kl_coef * (1 - math.exp(d))
            loss += scale * ell
            # d log softmax(w/T)[target] / d w[v] = (1[v = target] − p_v) / T
            for v in range(V):
                grad[prev][v] += scale * dl * ((v == target) - math.exp(lp_all[v])) / t
    units = n_tokens if cfg.aggregation == "token_mean" else len(rows)
    return loss, grad, units


def _batch(with_logprobs: bool = True) -> GroupBatch:
    # the run's own layout: `data.task.DatasetTask.build_batch` is this with the tokenizer's pad
    return layout_batch(
        _samples(_engine_logprobs() if with_logprobs else None), seq_len=SEQ_LEN, pad=PAD
    )


def _code_loss_and_grad(
    batch: GroupBatch, cfg: ObjectiveConfig, table: torch.Tensor, ref_table: torch.Tensor
) -> tuple[float, torch.Tensor, int]:
    model, ref = Bigram(table), Bigram(ref_table)
    out = replica_loss(model, batch, cfg, reference=ref if cfg.needs_reference else None)
    (grad,) = torch.autograd.grad(out.loss, [model.table])
    return out.loss.item(), grad, out.weight


CONFIGS = [
    ObjectiveConfig(),
    ObjectiveConfig(
        aggregation="seq_mean_token_sum", clip_low=0.1, clip_high=0.1, kl_coef=0.05, temperature=0.7
    ),
    ObjectiveConfig(
        aggregation="seq_mean_token_mean", clip_low=0.3, clip_high=0.5, kl_coef=0.2, temperature=1.3
    ),
]


def _close(got: torch.Tensor, expect: Sequence[Sequence[float]]) -> None:
    # the run's logits are float32 (`grpo._logits`): compare at float32's precision
    torch.testing.assert_close(got, torch.tensor(expect, dtype=torch.float64), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.aggregation)
def test_the_run_path_computes_the_global_loss_by_hand(cfg: ObjectiveConfig) -> None:
    table, ref_table = _table(1), _table(2)
    old = _engine_logprobs()
    loss, grad, units = _hand_loss_and_grad(table, ref_table, range(len(GROUPS)), cfg, old)
    got_loss, got_grad, got_units = _code_loss_and_grad(_batch(), cfg, table, ref_table)
    assert got_units == units
    assert got_loss == pytest.approx(loss, rel=2e-5, abs=2e-6)
    _close(got_grad, grad)
    # the example exercises both clip sides and unclipped tokens (else it proves little)
    clip = 0
    for g, (_, comps, _) in enumerate(GROUPS):
        for j, comp in enumerate(comps):
            prompt = GROUPS[g][0]
            seq = list(prompt) + list(comp)
            for k in range(len(comp)):
                lp = _log_softmax(table[seq[len(prompt) - 1 + k]].tolist(), cfg.temperature)
                r = math.exp(lp[comp[k]] - old[g][j][k])
                clip += r > 1 + cfg.clip_high or r < 1 - cfg.clip_low
    assert 0 < clip < sum(len(c) for _, cs, _ in GROUPS for c in cs)


def _partitions(items: list[int]) -> list[list[list[int]]]:
    if not items:
        return [[]]
    first, rest = items[0], items[1:]
    out = []
    for p in _partitions(rest):
        out.append([[first], *p])
        for i in range(len(p)):
            out.append([*p[:i], [first, *p[i]], *p[i + 1 :]])
    return out


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.aggregation)
def test_every_partition_into_whole_groups_gives_the_full_batch_gradient(
    cfg: ObjectiveConfig,
) -> None:
    # Σₖ (wₖ / Σ w)·gₖ over replicas holding whole groups (any order, groups of different
    # lengths, an empty response, a replica with one group) = the hand global gradient
    table, ref_table = _table(3), _table(4)
    old = _engine_logprobs()
    _, grad, units = _hand_loss_and_grad(table, ref_table, range(len(GROUPS)), cfg, old)
    batch = _batch()
    parts = _partitions(list(range(len(GROUPS))))
    assert len(parts) == 5  # the Bell number of 3
    for partition in parts:
        pieces = []
        for groups in partition:
            _, g, w = _code_loss_and_grad(batch.select(groups), cfg, table, ref_table)
            # the order of groups inside a replica does not matter
            _, g_rev, w_rev = _code_loss_and_grad(batch.select(groups[::-1]), cfg, table, ref_table)
            assert w_rev == w
            torch.testing.assert_close(g_rev, g, rtol=1e-5, atol=1e-7)
            pieces.append((w, g))
        assert sum(w for w, _ in pieces) == units
        # the run's reducer (`weighted_allreduce_` equals it): Σₖ (wₖ / Σ w)·gₖ
        (reduced,) = weighted_sum([(w, [g]) for w, g in pieces], total_samples=units)
        _close(reduced, grad)


def test_a_replica_of_only_empty_and_equal_reward_rows_weighs_nothing_under_token_mean() -> None:
    # group 1 has equal rewards (Â = 0); alone, a replica holding it has tokens but a zero
    # policy gradient; an all-empty replica has weight 0 and a zero gradient
    table = _table(5)
    batch = _batch()
    _, g, w = _code_loss_and_grad(batch.select([1]), ObjectiveConfig(), table, table)
    assert w == 1 + 3 + 2 and torch.count_nonzero(g) == 0
    empty = replace(batch.select([2]), completion=torch.zeros_like(batch.select([2]).completion))
    _, g, w = _code_loss_and_grad(empty, ObjectiveConfig(), table, table)
    assert w == 0 and torch.count_nonzero(g) == 0


class PerPosition(nn.Module):
    """Free logits per (row, position): the gradient shows exactly which positions the loss
    reads."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = nn.Parameter(logits.clone())

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        assert inputs.shape == self.logits.shape[:2]
        return self.logits


@pytest.mark.parametrize("pad", [PAD, EOS], ids=["pad", "pad-is-eos"])
def test_the_loss_reads_response_tokens_and_the_stop_token_never_prompt_or_padding(pad) -> None:
    # (a tokenizer without a pad token pads with its EOS: `data.task.DatasetTask.pad`)
    batch = layout_batch(_samples(_engine_logprobs()), seq_len=SEQ_LEN, pad=pad)
    gen = torch.Generator().manual_seed(6)
    shape = (batch.samples, SEQ_LEN - 1, V)
    model = PerPosition(torch.randn(shape, generator=gen, dtype=torch.float64))
    reference = PerPosition(torch.randn(shape, generator=gen, dtype=torch.float64))
    cfg = ObjectiveConfig(kl_coef=0.5)  # the KL term makes every read position's gradient ≠ 0
    out = replica_loss(model, batch, cfg, reference=reference)
    (grad,) = torch.autograd.grad(out.loss, [model.logits])
    read = sorted({(int(i), int(t)) for i, t, _ in torch.nonzero(grad).tolist()})
    # by hand: row = group·3 + sample, positions len(prompt) − 1 … len(prompt) − 2 + len(comp)
    expect = [
        *[(0, 2), (0, 3), (0, 4)],  # 7 8 EOS
        *[(1, 2), (1, 3)],  # 9 EOS
        *[(2, 2), (2, 3), (2, 4), (2, 5)],  # 3 4 7 8, cut at max_new_tokens: every token
        (3, 1),  # EOS alone
        *[(4, 1), (4, 2), (4, 3)],  # 5 6 EOS
        *[(5, 1), (5, 2)],  # 6 EOS
        *[(6, 3), (6, 4)],  # 6 EOS
        # row 7: empty response, nothing
        *[(8, 3), (8, 4), (8, 5), (8, 6)],  # 7 7 7 7, cut
    ]
    assert read == expect
    assert out.weight == len(expect) == batch.response_tokens


def test_behaviour_log_probs_line_up_with_their_tokens() -> None:
    # Engine log-probs equal to the model's own (by hand, at the temperature) give ρ = 1 on
    # every token: no clip, and the on-policy gradient. One position off and ρ ≠ 1.
    table = _table(7)
    t = 0.8
    own = [
        [
            [
                _log_softmax(table[(list(p) + list(c))[len(p) - 1 + k]].tolist(), t)[c[k]]
                for k in range(len(c))
            ]
            for c in comps
        ]
        for p, comps, _ in GROUPS
    ]
    cfg = ObjectiveConfig(temperature=t, clip_low=0.01, clip_high=0.01)
    model = Bigram(table)
    out = replica_loss(model, layout_batch(_samples(own), seq_len=SEQ_LEN, pad=PAD), cfg)
    (grad,) = torch.autograd.grad(out.loss, [model.table])
    assert out.metrics.clipped == 0
    assert out.metrics.ratio_max == pytest.approx(1.0, abs=1e-6)
    assert out.metrics.approx_kl == pytest.approx(0.0, abs=1e-6)
    _, on_policy, _ = _hand_loss_and_grad(table, table, range(len(GROUPS)), cfg, None)
    _close(grad, on_policy)
    # and the batch without log-probs is on-policy: the same gradient
    _, grad_none, _ = _code_loss_and_grad(_batch(with_logprobs=False), cfg, table, table)
    _close(grad_none, on_policy)


# -- every [grpo] objective key is honoured and checked ------------------------------------------

BASE = ObjectiveConfig(aggregation="token_mean", clip_low=0.2, clip_high=0.28, kl_coef=0.05)


@pytest.mark.parametrize(
    "change",
    [
        {"clip_low": 0.75},  # the Â < 0 token at ρ = 0.28 leaves the clip
        {"clip_high": 0.6},
        {"kl_coef": 0.3},
        {"aggregation": "seq_mean_token_sum"},
        {"aggregation": "seq_mean_token_mean"},
        {"temperature": 0.6},
    ],
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()),
)
def test_each_objective_key_changes_the_gradient_as_the_formula_says(change) -> None:
    table, ref_table = _table(8), _table(9)
    old = _engine_logprobs()
    cfg = replace(BASE, **change)
    _, before, _ = _hand_loss_and_grad(table, ref_table, range(len(GROUPS)), BASE, old)
    _, after, _ = _hand_loss_and_grad(table, ref_table, range(len(GROUPS)), cfg, old)
    diff = max(
        abs(a - b)
        for ra, rb in zip(before, after, strict=True)
        for a, b in zip(ra, rb, strict=True)
    )
    assert diff > 1e-3  # the example is sensitive to the key
    _close(_code_loss_and_grad(_batch(), cfg, table, ref_table)[1], after)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"clip_low": -0.1}, "clip_low"),
        ({"clip_low": 1.0}, "clip_low"),
        ({"clip_high": -0.01}, "clip_high"),
        ({"clip_high": math.inf}, "clip_high"),
        ({"kl_coef": -0.1}, "kl_coef"),
        ({"kl_coef": math.inf}, "kl_coef"),
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"aggregation": "sum"}, "aggregation"),
    ],
)
def test_out_of_range_objective_values_are_refused(kwargs, key) -> None:
    with pytest.raises(ObjectiveError, match=key) as err:
        ObjectiveConfig(**kwargs)
    assert "Fix:" in str(err.value)


PLAN = Path(__file__).resolve().parents[2] / "examples" / "short.toml"


def _plan(**grpo: object):
    doc = tomllib.loads(PLAN.read_text(encoding="utf-8"))
    doc = copy.deepcopy(doc)
    doc["grpo"].update(grpo)
    return parse_plan(doc, file=str(PLAN))


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("clip_low", -0.1),
        ("clip_low", 1.0),
        ("clip_high", -0.1),
        ("kl_coef", -0.5),
        ("temperature", 0.0),
        ("temperature", math.nan),
        ("loss_aggregation", "sum"),
    ],
)
def test_the_plan_refuses_out_of_range_objective_keys_naming_them(key, value) -> None:
    with pytest.raises(PlanError, match=f"grpo.{key}"):
        _plan(**{key: value})


def test_the_plan_objective_keys_reach_the_trainers() -> None:
    keys = dict(
        temperature=0.7,
        clip_low=0.1,
        clip_high=0.35,
        kl_coef=0.02,
        loss_aggregation="seq_mean_token_sum",
    )
    plan = _plan(**keys)
    cfg = pool_config(plan, Path("/nonexistent/model"), Path("/nonexistent/store")).objective
    assert cfg == ObjectiveConfig(
        temperature=0.7,
        clip_low=0.1,
        clip_high=0.35,
        kl_coef=0.02,
        aggregation="seq_mean_token_sum",
    )


def test_the_partition_helper_lists_each_partition_once() -> None:
    # (guards the partition test: each of the 5 set partitions of {0, 1, 2} once)
    seen = {tuple(sorted(tuple(sorted(b)) for b in p)) for p in _partitions([0, 1, 2])}
    assert len(seen) == 5
    assert all(sorted(itertools.chain(*p)) == [0, 1, 2] for p in seen)
