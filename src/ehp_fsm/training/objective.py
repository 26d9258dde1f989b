"""The GRPO objective of the field, split so that a Core + Hybrid reduction stays exact.

What it knows (see `/work/shared/OBJECTIVE.md` for the derivation): per response token t of
sample i, the ratio ρᵢₜ = exp(log π_θ − log π_old) against the *behaviour* log-probs the rollout
engine returned, the clip-higher surrogate

    ℓᵢₜ = −min(ρᵢₜ Âᵢ, clip(ρᵢₜ, 1 − clip_low, 1 + clip_high) Âᵢ) + kl_coef · KLᵢₜ,
    KLᵢₜ = exp(log π_ref − log π_θ) − (log π_ref − log π_θ) − 1            (k3; only if kl_coef > 0)

and the three loss aggregations. A replica holding a subset Sₖ of *complete* groups calls
`local_loss` on its rows; it back-propagates `LocalLoss.loss` (normalised by its own Tₖ or Bₖ)
and reports `LocalLoss.weight`:

    aggregation            local normaliser and weight      the global loss it reproduces
    token_mean             Tₖ = response tokens in Sₖ       Σᵢ Σₜ ℓᵢₜ / T
    seq_mean_token_sum     Bₖ = sequences in Sₖ             (1/B) Σᵢ Σₜ ℓᵢₜ
    seq_mean_token_mean    Bₖ                               (1/B) Σᵢ (1/Lᵢ) Σₜ ℓᵢₜ

so Σₖ (wₖ / Σⱼ wⱼ) · ∇(local lossₖ) is the full-batch gradient for every partition. A
sequence with no response token (Lᵢ = 0) adds 0 to every sum and still counts in B. The existing
`training.reduction.weighted_sum(((w, g), ...), total_samples=Σ w)` and `weighted_allreduce_`
compute exactly that sum when `w` is passed where they say "samples". A replica whose subset has
no response token (possible under `token_mean`) reports weight 0 and a zero gradient.

`ObjectiveMetrics` are sums and counts, so the metrics of several replicas `merge` into the
step's: clip fraction (tokens whose clipped branch was taken and carries no gradient), ρ
mean/max, approximate KL (mean k3 of π_θ against π_old) and, with a reference, the k3 KL to it.

What it does not know: models (it takes per-token log-probs; `token_log_probs` turns logits
into them), advantages (the caller normalises rewards per group, e.g. with
`training.grpo.group_advantages`, before partitioning), optimizers, processes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from ehp_fsm.errors import EhpError

Aggregation = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"]
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)


class ObjectiveError(EhpError):
    """The objective's configuration or inputs cannot be used as given."""


@dataclass(frozen=True, kw_only=True)
class ObjectiveConfig:
    """`clip_low`/`clip_high` are ε_low/ε_high of clip-higher (DAPO's defaults 0.2/0.28);
    `kl_coef` = 0 builds no reference model and needs no reference log-probs. `temperature` is
    the rollout's sampling temperature: the engines return the log-probs of the tokens they
    sampled under softmax(logits / T), so π_θ (and the reference) are taken at the same T —
    at T ≠ 1 an untempered π_θ made the ratio ≠ 1 at the very weights that sampled."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0
    aggregation: Aggregation = "token_mean"
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if not (0.0 <= self.clip_low < 1.0):
            raise ObjectiveError(
                f"clip_low = {self.clip_low} is out of range",
                "the lower clip bound 1 − clip_low must stay positive",
                "use 0 ≤ clip_low < 1 (0.2 is usual)",
            )
        if not (math.isfinite(self.clip_high) and self.clip_high >= 0.0):
            raise ObjectiveError(
                f"clip_high = {self.clip_high} is out of range",
                "the upper clip bound is 1 + clip_high",
                "use a finite clip_high ≥ 0 (0.28 is DAPO's)",
            )
        if not (math.isfinite(self.kl_coef) and self.kl_coef >= 0.0):
            raise ObjectiveError(
                f"kl_coef = {self.kl_coef} is out of range",
                "the KL penalty's weight must be a finite number ≥ 0",
                "use kl_coef = 0 for no reference model, or a small positive value",
            )
        if not (math.isfinite(self.temperature) and self.temperature > 0.0):
            raise ObjectiveError(
                f"temperature = {self.temperature} is out of range",
                "π_θ is taken at the rollout's sampling temperature, softmax(logits / T)",
                "use the plan's [grpo] temperature, a finite number > 0 (1.0 is usual)",
            )
        if self.aggregation not in AGGREGATIONS:
            raise ObjectiveError(
                f"aggregation {self.aggregation!r} is unknown",
                "the reduction weight depends on it",
                f"use one of {list(AGGREGATIONS)}",
            )

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0.0


@dataclass(frozen=True, kw_only=True)
class ObjectiveMetrics:
    """Token-level sums over some rows; `merge` adds replicas up, the properties read them."""

    tokens: int = 0
    clipped: int = 0
    ratio_sum: float = 0.0
    ratio_max: float = 0.0
    kl_old_sum: float = 0.0
    kl_ref_sum: float = 0.0

    @staticmethod
    def merge(parts: Iterable[ObjectiveMetrics]) -> ObjectiveMetrics:
        out = ObjectiveMetrics()
        for m in parts:
            out = ObjectiveMetrics(
                tokens=out.tokens + m.tokens,
                clipped=out.clipped + m.clipped,
                ratio_sum=out.ratio_sum + m.ratio_sum,
                ratio_max=max(out.ratio_max, m.ratio_max),
                kl_old_sum=out.kl_old_sum + m.kl_old_sum,
                kl_ref_sum=out.kl_ref_sum + m.kl_ref_sum,
            )
        return out

    def _mean(self, total: float) -> float:
        return total / self.tokens if self.tokens else 0.0

    @property
    def clip_fraction(self) -> float:
        return self._mean(self.clipped)

    @property
    def ratio_mean(self) -> float:
        return self._mean(self.ratio_sum)

    @property
    def approx_kl(self) -> float:
        """Mean k3 estimate of KL between π_θ and the behaviour policy π_old."""
        return self._mean(self.kl_old_sum)

    @property
    def ref_kl(self) -> float:
        """Mean k3 KL to the reference (0.0 when no reference was used)."""
        return self._mean(self.kl_ref_sum)

    def to_dict(self) -> dict[str, float]:
        return {
            "tokens": float(self.tokens),
            "clip_fraction": self.clip_fraction,
            "ratio_mean": self.ratio_mean,
            "ratio_max": self.ratio_max,
            "approx_kl": self.approx_kl,
            "ref_kl": self.ref_kl,
        }


@dataclass(frozen=True, kw_only=True)
class LocalLoss:
    """A replica's loss over its rows (backward this), the numerator of its reduction weight
    (Tₖ for `token_mean`, Bₖ for `seq_mean_*`; the denominator is the sum over replicas), and
    its metrics."""

    loss: torch.Tensor
    weight: int
    metrics: ObjectiveMetrics


def token_log_probs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log π(targets) from `logits[N, T, V]` (position t predicts `targets[:, t]`), as [N, T]
    in at least float32, under softmax(logits / temperature) — the distribution the engines
    sampled from and whose log-probs they return."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    scaled = logits.to(dtype)
    if temperature != 1.0:  # at 1 nothing is divided: the same bits as before
        scaled = scaled / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def k3(log_other: torch.Tensor, log_policy: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator exp(d) − d − 1 with d = log_other − log_policy (≥ 0, 0 at d = 0)."""
    d = log_other - log_policy
    return torch.expm1(d) - d


def local_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: ObjectiveConfig,
    *,
    ref_logp: torch.Tensor | None = None,
) -> LocalLoss:
    """The GRPO loss of one replica's rows of complete groups (see the module docstring).

    `logp[N, T]` are π_θ's log-probs of the sampled tokens (with grad), `old_logp[N, T]` the
    behaviour log-probs the engine returned, `advantages[N]` per sample, `mask[N, T]` true on
    response tokens; `ref_logp[N, T]` only when `config.kl_coef > 0`. Values outside the mask
    are never read (padding may hold anything, −inf included)."""
    n = _check_inputs(logp, old_logp, advantages, mask, ref_logp, config)
    dtype = torch.promote_types(logp.dtype, torch.float32)
    m = mask.to(torch.bool)
    mf = m.to(dtype)
    zero = torch.zeros((), dtype=dtype)
    cur = torch.where(m, logp.to(dtype), zero)
    old = torch.where(m, old_logp.to(dtype).detach(), zero)
    adv = advantages.to(dtype).detach().unsqueeze(-1)

    log_ratio = cur - old
    ratio = torch.exp(log_ratio)  # the metrics' ρ (inf where it overflows)
    # Where Â ≥ 0 a ρ above 1 + clip_high is clipped (or multiplied by 0): its loss is
    # −(1 + clip_high)·Â and its gradient 0 for any such ρ, so ρ is taken at most e·(1 +
    # clip_high) there. An overflowing exp (float32 past log ρ = 88.7, behaviour log-probs
    # down to the client's −1e4) made that token's gradient 0·∞ = NaN, and at Â = 0 its
    # loss NaN; every other token's ρ is the same bits as before.
    cap = math.log1p(config.clip_high) + 1.0
    capped = torch.where((adv >= 0) & (log_ratio > cap), torch.full_like(log_ratio, cap), log_ratio)
    rho = torch.exp(capped)
    unclipped = -rho * adv
    clipped = -torch.clamp(rho, 1.0 - config.clip_low, 1.0 + config.clip_high) * adv
    per_token = torch.maximum(unclipped, clipped)
    kl_ref: torch.Tensor | None = None
    if config.needs_reference:
        assert ref_logp is not None  # _check_inputs refused None
        ref = torch.where(m, ref_logp.to(dtype).detach(), zero)
        kl_ref = k3(ref, cur)
        per_token = per_token + config.kl_coef * kl_ref
    per_token = per_token * mf

    lengths = mf.sum(dim=-1)
    tokens = int(m.sum())
    if config.aggregation == "token_mean":
        weight = tokens
        loss = per_token.sum() / max(tokens, 1)
    elif config.aggregation == "seq_mean_token_sum":
        weight = n
        loss = per_token.sum() / max(n, 1)
    else:  # seq_mean_token_mean
        weight = n
        loss = (per_token.sum(dim=-1) / lengths.clamp_min(1.0)).sum() / max(n, 1)

    with torch.no_grad():
        r = ratio.detach()
        metrics = ObjectiveMetrics(
            tokens=tokens,
            clipped=int(((clipped > unclipped) & m).sum()),
            ratio_sum=float((r * mf).sum()),
            ratio_max=float(r[m].max()) if tokens else 0.0,
            kl_old_sum=float((k3(old, cur.detach()) * mf).sum()),
            kl_ref_sum=float((kl_ref.detach() * mf).sum()) if kl_ref is not None else 0.0,
        )
    return LocalLoss(loss=loss, weight=weight, metrics=metrics)


def _check_inputs(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logp: torch.Tensor | None,
    config: ObjectiveConfig,
) -> int:
    if logp.dim() != 2:
        raise ObjectiveError(
            f"logp has shape {tuple(logp.shape)}",
            "the objective takes per-token log-probs as [sequences, tokens]",
            "gather the sampled tokens' log-probs first (token_log_probs)",
        )
    shape = tuple(logp.shape)
    named = {"old_logp": old_logp, "mask": mask}
    if config.needs_reference:
        if ref_logp is None:
            raise ObjectiveError(
                f"kl_coef = {config.kl_coef} but no reference log-probs were given",
                "the k3 KL term compares π_θ with the reference policy",
                "pass ref_logp, or set kl_coef = 0 to train without a reference model",
            )
        named["ref_logp"] = ref_logp
    for name, t in named.items():
        if tuple(t.shape) != shape:
            raise ObjectiveError(
                f"{name} has shape {tuple(t.shape)}, logp has {shape}",
                "every per-token input covers the same rows and positions",
                "build them from the same padded batch",
            )
    if tuple(advantages.shape) != (shape[0],):
        raise ObjectiveError(
            f"advantages has shape {tuple(advantages.shape)}, expected ({shape[0]},)",
            "there is one advantage per sequence",
            "normalise rewards per group and pass one value per row",
        )
    return shape[0]
