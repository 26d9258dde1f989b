"""Sample-weighted gradient reduction: reduced = Σᵢ (nᵢ / B) · ḡᵢ.

Each replica delivers ḡᵢ, its mean gradient over its nᵢ samples; B = Σ nᵢ is the fixed global
batch. The weighted sum equals the full-batch mean gradient for every partition of whole groups.

`weighted_allreduce_` does it over torch.distributed (Gloo on CPU) in fixed-size buckets, in
place, in about one pass over the bytes. Buckets are planned from the tensors' shapes alone (a
tensor of at least half a bucket is a bucket of its own, cut into bucket-sized collectives;
consecutive smaller tensors share a bucket), so members whose gradients are laid out differently
in memory still issue the same collectives. Then, per bucket:

- if its tensors lie back to back in one storage (consecutive views of a flat buffer: what
  `flat_gradients` and `ehp_fsm.training.snapshot` produce, and what Megatron's grad buffers
  are), or it is one tensor, it is reduced where it lies: one fused `mul_` and one collective
  per bucket-sized slice, no copy, no allocation;
- otherwise (small, separately allocated tensors) they are scaled while packed into a staging
  bucket (allocated once per thread, reused by every later call), reduced, and copied back
  with one `_foreach_copy_`.

With real peers, the next bucket is scaled while the previous bucket's collective is in flight.

Extra memory is therefore at most one staging bucket (none at all for flat gradients), plus what
the backend allocates for the bucket-sized messages in flight (at most two), independent of
model size. `weighted_sum` is the same sum in one process, for deliveries accepted by the ledger.

What it does not know: which deliveries are valid (the ledger decides), optimizers, processes.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from math import prod

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
    bucket_bytes_allocated: int  # staging memory this call allocated (0 when reused or in place)
    bytes_in_place: int = 0  # reduced inside the gradients' own storage (no staging copy)
    staging_bytes: int = 0  # size of the staging bucket this call used (allocated or reused)


def require_finite(reduced: Sequence[torch.Tensor], names: Sequence[str]) -> None:
    """Raise `ReductionError` naming the first parameter whose reduced gradient holds a NaN or
    an Inf. Called before an optimizer step: a non-finite gradient would otherwise be applied
    and corrupt the weights and Adam moments for good (no loss scaler checks it here)."""
    for name, g in zip(names, reduced, strict=True):
        if not bool(torch.isfinite(g).all()):
            raise ReductionError(
                f"the reduced gradient of {name} holds NaN or Inf; the optimizer did not step",
                "a replica delivered a non-finite gradient (a diverged loss, or a bad batch)",
                "find the replica and step in the training log; lower the learning rate or "
                "fix the batch, and resume from the last revision",
            )


def sample_weight(samples: int, total_samples: int) -> float:
    if not 0 <= samples <= total_samples or total_samples <= 0:
        raise ReductionError(
            f"sample count {samples} of global batch {total_samples} is invalid",
            "a replica's samples are part of the fixed global batch",
            "pass the replica's assigned sample count and the step's B = G·n",
        )
    return float(Fraction(samples, total_samples))


def flat_gradients(
    shapes: Sequence[Sequence[int]],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """One zeroed flat buffer and a view of it per shape, in order: gradients laid out like this
    are reduced in place by `weighted_allreduce_` (one op and one collective per bucket)."""
    sizes = [prod(s) for s in shapes]
    flat = torch.zeros(sum(sizes), dtype=dtype, device=device)
    parts = torch.split(flat, sizes) if sizes else ()
    return flat, tuple(p.view(tuple(s)) for p, s in zip(parts, shapes, strict=True))


# -- staging bucket: one per thread, device and dtype, reused across calls --------------------

_staging = threading.local()


def _staging_buffer(
    numel: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, int]:
    """A staging tensor of at least `numel` elements and the bytes allocated to get it."""
    cache: dict[tuple[torch.device, torch.dtype], torch.Tensor] = _staging.__dict__.setdefault(
        "buffers", {}
    )
    have = cache.get((device, dtype))
    if have is not None and have.numel() >= numel:
        return have, 0
    cache.pop((device, dtype), None)  # drop the smaller one first: never two at once
    buf = torch.empty(numel, dtype=dtype, device=device)
    cache[(device, dtype)] = buf
    return buf, buf.numel() * buf.element_size()


def staging_tensors() -> tuple[torch.Tensor, ...]:
    """The staging buckets this thread keeps for reuse."""
    cache: dict[object, torch.Tensor] = _staging.__dict__.get("buffers", {})
    return tuple(cache.values())


def staging_bytes_held() -> int:
    """Bytes of staging buckets this thread keeps for reuse."""
    cache: dict[object, torch.Tensor] = _staging.__dict__.get("buffers", {})
    return sum(t.numel() * t.element_size() for t in cache.values())


def release_staging() -> None:
    """Free this thread's staging buckets (the next packed reduction allocates one again)."""
    _staging.__dict__.pop("buffers", None)


# -- the reduction ------------------------------------------------------------------------------


def _plan(grads: Sequence[torch.Tensor], numel: int) -> list[tuple[int, int, int, bool]]:
    """The buckets, from shapes only (so every member issues the same collectives whatever its
    memory layout): (first, last + 1, elements, in_place). A tensor of at least half a bucket
    is a bucket of its own (cut into bucket-sized collectives); consecutive smaller tensors share
    a bucket up to `numel` elements; an empty tensor never starts a bucket. `in_place`: the
    bucket's tensors lie back to back in memory inside the first one's storage (flat views), so
    the bucket is one region of that storage and is reduced where it lies. Validates dtype and
    contiguity (one pass, a few calls per tensor)."""
    dtype = grads[0].dtype
    esize = grads[0].element_size()
    if any(g.dtype != dtype or not g.is_contiguous() for g in grads):
        bad = next(g for g in grads if g.dtype != dtype or not g.is_contiguous())
        raise ReductionError(
            "gradients must be contiguous and of one dtype",
            f"got {bad.dtype} contiguous={bad.is_contiguous()} beside {dtype}",
            "deliver contiguous fp32 gradients (ehp_fsm.training.grpo.mean_gradient does)",
        )
    sizes = [int(g.numel()) for g in grads]
    ptrs = [g.data_ptr() for g in grads]
    plan: list[tuple[int, int, int, bool]] = []
    first, fill, adjacent = 0, 0, True
    end = -1
    half = numel // 2
    for i, n in enumerate(sizes):
        if n == 0:  # nothing to reduce: it neither starts a bucket nor breaks one's adjacency
            continue
        if n >= half:
            if fill:
                plan.append((first, i, fill, adjacent))
            plan.append((i, i + 1, n, True))
            fill = 0
            continue
        if fill and fill + n > numel:
            plan.append((first, i, fill, adjacent))
            fill = 0
        if fill == 0:  # a bucket starts at a tensor that has elements: its storage is the region
            first, adjacent = i, True
        elif ptrs[i] != end:
            adjacent = False
        fill += n
        end = ptrs[i] + n * esize
    if fill:
        plan.append((first, len(grads), fill, adjacent))
    return [(f, z, n, ok and (z - f == 1 or _inside(grads[f], n))) for f, z, n, ok in plan]


def _inside(g0: torch.Tensor, numel: int) -> bool:
    """`numel` elements from `g0`'s start lie inside `g0`'s storage (adjacent addresses alone
    could span two allocations that happen to touch)."""
    return (int(g0.storage_offset()) + numel) * g0.element_size() <= g0.untyped_storage().nbytes()


def weighted_allreduce_(
    grads: Sequence[torch.Tensor],
    *,
    samples: int,
    total_samples: int,
    group: dist.ProcessGroup | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> ReductionStats:
    """In place on every member of `group`: grads ← Σᵢ (nᵢ/B) · ḡᵢ. Every member calls it with
    its own `samples` (nᵢ); all members must pass tensors of the same shapes and order (their
    memory layout may differ: the collectives follow from the shapes alone)."""
    w = sample_weight(samples, total_samples)
    if bucket_bytes < 1024:
        raise ReductionError(
            f"bucket_bytes={bucket_bytes} is too small",
            "each bucket is one collective",
            "use at least 1 KiB (default 16 MiB)",
        )
    if not grads:
        return ReductionStats(bytes_reduced=0, collectives=0, bucket_bytes_allocated=0)
    dtype, device, esize = grads[0].dtype, grads[0].device, grads[0].element_size()
    numel = max(1, bucket_bytes // esize)
    plan = _plan(grads, numel)
    distributed = group is not None or dist.is_initialized()
    # Overlap only pays with real peers and more than one collective.
    pipelined = (
        distributed
        and sum(-(-n // numel) if ok else 1 for _, _, n, ok in plan) > 1
        and dist.get_world_size(group) > 1
    )
    collectives = 0
    pending: list[dist.Work] = []

    def reduce_(t: torch.Tensor) -> None:
        """Collective on `t`; with real peers the previous bucket's collective is waited for
        only after this one is issued (at most two in flight)."""
        nonlocal collectives
        collectives += 1
        if not distributed:
            return
        if not pipelined:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
            return
        work = dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True)
        drain()
        pending.append(work)

    def drain() -> None:
        while pending:
            pending.pop().wait()

    # fp32/fp64: one 0-dim tensor for the weight (a Python number is wrapped in a new one per
    # op), read by the kernels as the same scalar. Lower precisions keep the Python number: a
    # 0-dim tensor of their dtype would round the weight itself.
    scale: torch.Tensor | float = (
        torch.tensor(w, dtype=dtype, device=device)
        if dtype in (torch.float32, torch.float64)
        else w
    )
    in_place = 0
    staged = [(f, z, n) for f, z, n, together in plan if not together]
    staging_numel = max((n for _, _, n in staged), default=0)
    allocated = 0
    stage: torch.Tensor | None = None
    if staged:
        stage, allocated = _staging_buffer(staging_numel, dtype, device)
    with torch.no_grad():
        for first, last, n, together in plan:
            if together:  # one region of one storage: scale and reduce where it lies
                g0 = grads[first]
                region = g0.as_strided((n,), (1,), g0.storage_offset())
                for chunk in torch.split(region, numel) if n > numel else (region,):
                    chunk.mul_(scale)
                    reduce_(chunk)
                in_place += n
                continue
            assert stage is not None
            views = [g.view(-1) for g in grads[first:last]]
            packed = stage[:n]
            parts = torch.split(packed, [v.numel() for v in views])
            for v, part in zip(views, parts, strict=True):  # scaled while packed: one pass
                torch.mul(v, scale, out=part)
            reduce_(packed)
            drain()  # before the copy back, and before the staging bucket is reused
            torch._foreach_copy_(views, parts)
        drain()
    return ReductionStats(
        bytes_reduced=sum(n for _, _, n, _ in plan) * esize,
        collectives=collectives,
        bucket_bytes_allocated=allocated,
        bytes_in_place=in_place * esize,
        staging_bytes=staging_numel * esize,
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
