"""Building torch Adam/AdamW with bounded temporaries.

What it knows: when the user left both `foreach` and `fused` unset, torch picks the foreach
(multi-tensor) implementation, which allocates temporaries for *all* parameters at once (e.g. the
`sqrt(exp_avg_sq)` denominators of the whole model). We then step with torch's single-tensor
implementation instead (`foreach=False`): the same update, with temporaries for one parameter at a
time. An explicit `foreach=True` or `fused=True` is passed to torch exactly as given.
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
