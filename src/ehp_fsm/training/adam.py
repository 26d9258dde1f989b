"""Building torch Adam/AdamW with bounded temporaries.

What it knows: when the user left both `foreach` and `fused` unset, torch picks the foreach
(multi-tensor) implementation, which allocates temporaries for *all* parameters at once (e.g. the
`sqrt(exp_avg_sq)` denominators of the whole model). We then step with torch's single-tensor
implementation instead (`foreach=False`): the same update, with temporaries for one parameter at a
time. An explicit `foreach=True` or `fused=True` is passed to torch exactly as given. The same
rule applies to a torch Adam that someone else built with the automatic choice (Megatron-Core's
optimizer factory does): `apply_choice` sets each parameter group's `foreach`/`fused`, which
torch reads at every step.
What it does not know: sharding, processes, gradient reduction.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, kw_only=True)
class AdamConfig:
    """Hyperparameters and the user's implementation choice (`None` = left unset)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = True  # AdamW
    foreach: bool | None = None
    fused: bool | None = None

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr={self.lr} must be > 0")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas={self.betas} must lie in [0, 1)")
        if self.eps <= 0:
            raise ValueError(f"eps={self.eps} must be > 0")
        if self.foreach and self.fused:
            raise ValueError(
                "foreach=True and fused=True were both set; torch accepts only one — "
                "set one of them and leave the other unset"
            )

    @property
    def automatic(self) -> bool:
        """True when torch would pick the implementation itself."""
        return self.foreach is None and self.fused is None

    def torch_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for torch.optim.Adam/AdamW, with the per-parameter choice applied."""
        kw: dict[str, Any] = {
            "lr": self.lr,
            "betas": self.betas,
            "eps": self.eps,
            "weight_decay": self.weight_decay,
        }
        if self.automatic:
            kw["foreach"] = False  # per-parameter temporaries instead of automatic foreach
        else:
            if self.foreach is not None:
                kw["foreach"] = self.foreach
            if self.fused is not None:
                kw["fused"] = self.fused
        return kw


def build_adam(params: Iterable[torch.Tensor], config: AdamConfig) -> torch.optim.Optimizer:
    cls = torch.optim.AdamW if config.decoupled else torch.optim.Adam
    return cls(list(params), **config.torch_kwargs())


def apply_choice(optimizer: torch.optim.Optimizer, config: AdamConfig) -> None:
    """Give a torch Adam/AdamW built elsewhere the implementation `build_adam` would pass:
    per-parameter temporaries (`foreach=False`) when `config` leaves the choice to torch, the
    user's explicit `foreach`/`fused` otherwise. torch reads both from each parameter group at
    every step (group values win over the constructor's defaults), so this is the same as
    building the optimizer with `config.torch_kwargs()`."""
    if not isinstance(optimizer, torch.optim.Adam):
        raise TypeError(
            f"apply_choice needs a torch.optim.Adam or AdamW, got {type(optimizer).__name__}; "
            "foreach/fused are torch Adam options (Transformer Engine and Apex FusedAdam have "
            "their own kernels) — leave foreach and fused unset for other optimizers"
        )
    kw = config.torch_kwargs()
    for group in optimizer.param_groups:
        if kw.get("fused") and group.get("differentiable"):
            raise ValueError(
                "fused=True was set for a differentiable Adam; torch's fused kernel does not "
                "support it — leave fused unset or build the optimizer without differentiable"
            )
        group["foreach"] = kw.get("foreach")
        group["fused"] = kw.get("fused")
