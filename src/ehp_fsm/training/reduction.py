"""Sample-weighted gradient reduction: reduced = Σᵢ (nᵢ / B) · ḡᵢ.

Each replica delivers ḡᵢ, its mean gradient over its nᵢ samples; B = Σ nᵢ is the fixed global
batch. The weighted sum equals the full-batch mean gradient for every partition of whole groups.

`weighted_allreduce_` does it over torch.distributed (Gloo on CPU) in fixed-size buckets: a
tensor at least half a bucket large is scaled in place and all-reduced in bucket-sized slices of
its own storage (no copy); smaller tensors are packed into one reusable bucket, scaled while
packed, all-reduced, and copied back. Extra memory is therefore one bucket (plus what the
backend allocates for one bucket-sized message), independent of model size.
`weighted_sum` is the same sum in one process, for deliveries accepted by the ledger.

What it does not know: which deliveries are valid (the ledger decides), optimizers, processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.distributed as dist

from ehp_fsm.errors import EhpError

DEFAULT_BUCKET_BYTES = 16 * 2**20


class ReductionError(EhpError):
    """Gradients cannot be reduced as given."""


@dataclass(frozen=True, kw_only=True)
class ReductionStats:
    bytes_reduced: int
    collectives: int
    bucket_bytes_allocated: int  # the only extra buffer this call allocated


def sample_weight(samples: int, total_samples: int) -> float:
    if not 0 <= samples <= total_samples or total_samples <= 0:
        raise ReductionError(
            f"sample count {samples} of global batch {total_samples} is invalid",
            "a replica's samples are part of the fixed global batch",
            "pass the replica's assigned sample count and the step's B = G·n",
        )
    return float(Fraction(samples, total_samples))


def weighted_allreduce_(
    grads: Sequence[torch.Tensor],
    *,
    samples: int,
    total_samples: int,
    group: dist.ProcessGroup | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> ReductionStats:
    """In place on every member of `group`: grads ← Σᵢ (nᵢ/B) · ḡᵢ. Every member calls it with
    its own `samples` (nᵢ); all members must pass tensors of the same shapes and order."""
    w = sample_weight(samples, total_samples)
    if bucket_bytes < 1024:
        raise ReductionError(
            f"bucket_bytes={bucket_bytes} is too small",
            "each bucket is one collective",
            "use at least 1 KiB (default 16 MiB)",
        )
    dtype = grads[0].dtype if grads else torch.float32
    for g in grads:
        if g.dtype != dtype or not g.is_contiguous():
            raise ReductionError(
                "gradients must be contiguous and of one dtype",
                f"got {g.dtype} contiguous={g.is_contiguous()} beside {dtype}",
                "deliver contiguous fp32 gradients (ehp_fsm.training.grpo.mean_gradient does)",
            )
    numel = max(1, bucket_bytes // grads[0].element_size()) if grads else 1
    bucket: torch.Tensor | None = None
    packed: list[tuple[torch.Tensor, int, int]] = []
    fill = 0
    collectives = 0
    total = 0

    def allreduce(t: torch.Tensor) -> None:
        nonlocal collectives
        if group is not None or dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        collectives += 1

    def flush() -> None:
        nonlocal fill
        if fill == 0 or bucket is None:
            return
        allreduce(bucket[:fill])
        for flat, start, n in packed:
            flat.copy_(bucket[start : start + n])
        packed.clear()
        fill = 0

    with torch.no_grad():
        for g in grads:
            flat = g.view(-1)
            n = flat.numel()
            total += n * flat.element_size()
            if n >= numel // 2:
                for chunk in torch.split(flat, numel):
                    chunk.mul_(w)
                    allreduce(chunk)
                continue
            if fill + n > numel:
                flush()
            if bucket is None:
                bucket = torch.empty(numel, dtype=dtype, device=g.device)
            torch.mul(flat, w, out=bucket[fill : fill + n])
            packed.append((flat, fill, n))
            fill += n
        flush()
    return ReductionStats(
        bytes_reduced=total,
        collectives=collectives,
        bucket_bytes_allocated=0 if bucket is None else bucket.numel() * bucket.element_size(),
    )


def weighted_sum(
    deliveries: Sequence[tuple[int, Sequence[torch.Tensor]]], *, total_samples: int
) -> list[torch.Tensor]:
    """Σᵢ (nᵢ/B) · ḡᵢ in one process over `(nᵢ, ḡᵢ)` pairs (e.g. the ledger's accepted
    deliveries, in acceptance order). Raises `ReductionError` unless Σ nᵢ == B."""
    if sum(n for n, _ in deliveries) != total_samples:
        raise ReductionError(
            f"deliveries cover {sum(n for n, _ in deliveries)} samples, not B={total_samples}",
            "the optimizer consumes exactly the fixed global batch",
            "reduce only a closed ledger's accepted deliveries",
        )
    out: list[torch.Tensor] | None = None
    with torch.no_grad():
        for n, grads in deliveries:
            w = sample_weight(n, total_samples)
            if out is None:
                out = [g.mul(w) for g in grads]
            else:
                for o, g in zip(out, grads, strict=True):
                    o.add_(g, alpha=w)
    return out or []
