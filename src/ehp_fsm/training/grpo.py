"""GRPO on the tiny policy: group-normalised advantages, the per-sample loss, and a replica's mean
gradient over the samples of the groups assigned to it.

What it knows: a GRPO group is the n samples of one prompt; each sample's advantage is its reward
normalised by the mean and standard deviation of its own group, so a group is never split. The
loss of a sample is −Aₛ · (mean log-probability of its completion tokens); a replica delivers the
mean gradient ḡᵢ over its nᵢ samples, so Σ (nᵢ/B)·ḡᵢ is the full-batch mean gradient.
`synthetic_groups` builds deterministic arithmetic groups (prompt "a+b=", random completions,
reward = −|answer error|) whose content depends only on (seed, group id), never on the partition.
What it does not know: rollout engines, processes, reduction, optimizers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ehp_fsm.training.policy import BOS, EOS, PAD, PolicyConfig, encode

ADV_EPS = 1e-6


@dataclass(frozen=True, kw_only=True)
class GroupBatch:
    """Samples of whole groups. `tokens[N, T]` (BOS prompt completion EOS PAD…), `completion[N, T]`
    marks positions whose *next* token belongs to the completion, `rewards[N]`; samples are
    grouped contiguously, `group_size` per group, in the order of `group_ids`."""

    group_ids: tuple[int, ...]
    group_size: int
    tokens: torch.Tensor
    completion: torch.Tensor
    rewards: torch.Tensor

    def __post_init__(self) -> None:
        n = len(self.group_ids) * self.group_size
        if self.tokens.shape[0] != n or self.rewards.shape != (n,):
            raise ValueError(
                f"batch of {len(self.group_ids)} groups × {self.group_size} needs {n} samples, "
                f"got tokens {tuple(self.tokens.shape)} and rewards {tuple(self.rewards.shape)}"
            )

    @property
    def samples(self) -> int:
        return len(self.group_ids) * self.group_size

    def select(self, group_ids: Sequence[int]) -> GroupBatch:
        """The sub-batch of the given whole groups (in the given order)."""
        where = {g: i for i, g in enumerate(self.group_ids)}
        missing = [g for g in group_ids if g not in where]
        if missing:
            raise KeyError(f"groups {missing} are not in this batch")
        idx = (
            torch.cat(
                [
                    torch.arange(where[g] * self.group_size, (where[g] + 1) * self.group_size)
                    for g in group_ids
                ]
            )
            if group_ids
            else torch.zeros(0, dtype=torch.long)
        )
        return GroupBatch(
            group_ids=tuple(group_ids),
            group_size=self.group_size,
            tokens=self.tokens[idx],
            completion=self.completion[idx],
            rewards=self.rewards[idx],
        )


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(r − mean_group) / (std_group + ε) for rewards laid out group by group; exactly 0 for a
    group whose rewards are all equal (its rounded mean would otherwise leave noise of order
    ulp/ε that depends on how many groups are in the batch)."""
    r = rewards.reshape(-1, group_size).to(torch.float64)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, unbiased=False, keepdim=True)
    same = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)
    adv = torch.where(same, torch.zeros_like(r), (r - mean) / (std + ADV_EPS))
    return adv.to(torch.float32).reshape(-1)


def per_sample_loss(model: nn.Module, batch: GroupBatch) -> torch.Tensor:
    """−Aₛ · mean completion-token log-probability, one value per sample ([N])."""
    logits = model(batch.tokens[:, :-1]).float()
    logp = torch.log_softmax(logits, dim=-1)
    target = batch.tokens[:, 1:]
    tok_logp = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    mask = batch.completion[:, :-1].to(tok_logp.dtype)
    seq_logp = (tok_logp * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)
    adv = group_advantages(batch.rewards, batch.group_size)
    return -adv * seq_logp


def mean_gradient(model: nn.Module, batch: GroupBatch) -> list[torch.Tensor]:
    """ḡ over the batch's samples, one fp32 tensor per parameter (in `named_parameters` order).
    Leaves `.grad` of the model cleared."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    loss = per_sample_loss(model, batch).mean()
    grads = torch.autograd.grad(loss, params)
    return [g.detach().to(torch.float32).contiguous() for g in grads]


def synthetic_groups(
    group_ids: Sequence[int], *, group_size: int, config: PolicyConfig, seed: int
) -> GroupBatch:
    """Deterministic arithmetic groups; group g's samples depend only on (seed, g)."""
    t = min(config.max_len, 16)
    rows, masks, rewards = [], [], []
    for g in group_ids:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + g)
        a, b = (int(x) for x in torch.randint(0, 50, (2,), generator=gen))
        prompt = [BOS, *encode(f"{a}+{b}=")]
        for _ in range(group_size):
            length = int(torch.randint(1, 4, (1,), generator=gen))
            digits = torch.randint(0, 10, (length,), generator=gen).tolist()
            answer = int("".join(str(d) for d in digits))
            completion = [*encode("".join(str(d) for d in digits)), EOS]
            seq = (prompt + completion)[:t]
            row = seq + [PAD] * (t - len(seq))
            mask = [0] * t
            for pos in range(len(prompt) - 1, len(seq) - 1):
                mask[pos] = 1  # logits at pos predict the completion token at pos + 1
            rows.append(row)
            masks.append(mask)
            rewards.append(-abs(answer - (a + b)) / 10.0)
    return GroupBatch(
        group_ids=tuple(group_ids),
        group_size=group_size,
        tokens=torch.tensor(rows, dtype=torch.long).reshape(-1, t),
        completion=torch.tensor(masks, dtype=torch.bool).reshape(-1, t),
        rewards=torch.tensor(rewards, dtype=torch.float32),
    )
