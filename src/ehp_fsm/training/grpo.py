"""GRPO batches: whole groups laid out for a causal LM, group-normalised advantages, and a
replica's loss and gradient under the objective (`training.objective`).

What it knows: a GRPO group is the n samples of one prompt; each sample's advantage is its reward
normalised by the mean and standard deviation of its own group, so a group is never split. A
batch carries the behaviour log-probs the engine returned for the sampled tokens (`old_logp`;
none: on-policy, π_old = π_θ detached). `replica_loss` runs the model over a replica's rows and
returns the objective's local loss and weight units (response tokens for `token_mean`, samples
otherwise), so Σ (uᵢ/U)·ḡᵢ is the full-batch gradient whatever the partition.
`synthetic_groups` builds deterministic arithmetic groups (prompt "a+b=", random completions,
reward = −|answer error|) whose content depends only on (seed, group id), never on the partition.
What it does not know: rollout engines, processes, reduction, optimizers.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ehp_fsm.training.objective import LocalLoss, ObjectiveConfig, local_loss, token_log_probs
from ehp_fsm.training.policy import BOS, EOS, PAD, PolicyConfig, encode

ADV_EPS = 1e-6
#: The loss the built-in policy's tests and the Megatron lanes use: per-sample mean over tokens.
ON_POLICY = ObjectiveConfig(aggregation="seq_mean_token_mean")


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
    # behaviour log-prob of the token at t + 1 where `completion[t]` (float32, 0 elsewhere);
    # None: on-policy (π_old is π_θ, detached)
    old_logp: torch.Tensor | None = None

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

    @property
    def response_tokens(self) -> int:
        return int(self.completion.sum())

    def units(self, aggregation: str) -> int:
        """The batch's weight units: response tokens under `token_mean`, else samples."""
        return self.response_tokens if aggregation == "token_mean" else self.samples

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
            old_logp=None if self.old_logp is None else self.old_logp[idx],
        )


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(r − mean_group) / (std_group + ε), ε = `ADV_EPS`, for rewards laid out group by group,
    with the population std (÷ n: verl, slime and TRL divide by n − 1, so theirs are
    √((n − 1)/n) of these); exactly 0 for a group whose rewards are all equal, a group of one
    included (its rounded mean would otherwise leave noise of order ulp/ε that depends on how
    many groups are in the batch). Computed in float64, returned as float32."""
    r = rewards.reshape(-1, group_size).to(torch.float64)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, unbiased=False, keepdim=True)
    same = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)
    adv = torch.where(same, torch.zeros_like(r), (r - mean) / (std + ADV_EPS))
    return adv.to(torch.float32).reshape(-1)


def replica_loss(
    model: nn.Module,
    batch: GroupBatch,
    objective: ObjectiveConfig,
    *,
    reference: nn.Module | None = None,
) -> LocalLoss:
    """The objective's local loss of `batch` (whole groups) under `model`: backward `.loss`,
    report `.weight` units and `.metrics`. `reference` (frozen) only when `kl_coef > 0`."""
    inputs = batch.tokens[:, :-1]
    logits = _logits(model, inputs)
    ref = None
    if objective.needs_reference:
        if reference is None:
            raise ValueError("kl_coef > 0 needs the frozen reference model")
        with torch.no_grad():
            ref = reference_log_probs(_logits(reference, inputs), batch, objective.temperature)
    return logits_loss(logits, batch, objective, ref_logp=ref)


def reference_log_probs(
    logits: torch.Tensor, batch: GroupBatch, temperature: float = 1.0
) -> torch.Tensor:
    """The reference's log-probs of the batch's next tokens from its logits over
    `batch.tokens[:, :-1]` (what `logits_loss` takes as `ref_logp`), at the objective's
    sampling temperature."""
    return token_log_probs(logits.float(), batch.tokens[:, 1:], temperature)


def logits_loss(
    logits: torch.Tensor,
    batch: GroupBatch,
    objective: ObjectiveConfig,
    *,
    ref_logp: torch.Tensor | None = None,
) -> LocalLoss:
    """`replica_loss` from the policy's logits over `batch.tokens[:, :-1]` (for a caller whose
    model already ran, e.g. the last stage of a pipeline). `ref_logp`: `reference_log_probs`,
    only when `kl_coef > 0`."""
    logp = token_log_probs(logits.float(), batch.tokens[:, 1:], objective.temperature)
    mask = batch.completion[:, :-1]
    old = logp.detach() if batch.old_logp is None else batch.old_logp[:, :-1]
    if objective.needs_reference and ref_logp is None:
        raise ValueError("kl_coef > 0 needs the frozen reference's log-probs")
    adv = group_advantages(batch.rewards, batch.group_size)
    return local_loss(logp, old, adv, mask, objective, ref_logp=ref_logp)


def _logits(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """The model's fp32 logits over `inputs` (rows right-padded: prompt, completion, PAD…).
    A model that takes an attention mask (a transformers one) is given it: all ones. Attention
    is causal, so a position the loss reads attends to real tokens only and never to the
    padding after it; transformers runs the same causal attention as with no mask (the same
    logits, bit for bit), and does not warn "We strongly recommend passing in an
    `attention_mask`", as it did for every run of a model whose config names a pad token."""
    if _takes_attention_mask(type(model)):
        out = model(inputs, attention_mask=torch.ones_like(inputs))
    else:  # the built-in policy, Megatron's logits adapter
        out = model(inputs)
    logits = out.logits if hasattr(out, "logits") else out  # a transformers model's output
    return logits.float()  # type: ignore[no-any-return]


_TAKES_ATTENTION_MASK: dict[type[nn.Module], bool] = {}  # by model class


def _takes_attention_mask(model_type: type[nn.Module]) -> bool:
    """Whether `model_type.forward` has an `attention_mask` parameter (asked once a class)."""
    if model_type not in _TAKES_ATTENTION_MASK:
        try:
            takes = "attention_mask" in inspect.signature(model_type.forward).parameters
        except (TypeError, ValueError):  # a forward without a signature: called as it was
            takes = False
        _TAKES_ATTENTION_MASK[model_type] = takes
    return _TAKES_ATTENTION_MASK[model_type]


def mean_gradient(
    model: nn.Module, batch: GroupBatch, objective: ObjectiveConfig = ON_POLICY
) -> list[torch.Tensor]:
    """ḡ over the batch (normalised by its own units), one fp32 tensor per parameter (in
    `named_parameters` order). Leaves `.grad` of the model cleared."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    loss = replica_loss(model, batch, objective).loss
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
