"""Owned asynchronous CPU snapshots of live gradient buffers.

A snapshot taken for sending must never alias the live buffer: `tensor.cpu()` on a CPU tensor and
`tensor.detach()` return the *same* storage, so a later `zero_()` or backward pass would change
what is being sent. `LiveGradients.snapshot()` copies the live tensors into freshly allocated CPU
storage (a CUDA tensor would use a non-blocking copy into pinned memory and an event), and the
live buffer refuses to be written (`writable()`, `zero_()`) until every pending snapshot owns its
copy.

Flat layout: `LiveGradients` moves the live CPU tensors it is given into one flat buffer per
dtype (each tensor object is re-pointed, in place, at its slice: `p.grad` stays the same object
and autograd keeps accumulating into it). A snapshot is then one allocation and one `copy_` per
flat buffer, and its tensors are consecutive views of one owned flat buffer, which
`ehp_fsm.training.reduction.weighted_allreduce_` reduces in place with one op and one collective
per bucket. A small CPU snapshot (≤ `inline_bytes`) is copied on the calling thread — handing a
sub-millisecond copy to a thread costs more than the copy; larger ones and CUDA tensors are copied
on the background thread.

What it knows: copying and the ordering between the copy and the next write. What it does not
know: where snapshots are sent, reduction, the ledger.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ehp_fsm.errors import EhpError

DEFAULT_INLINE_BYTES = 4 * 2**20


class SnapshotError(EhpError):
    """A snapshot could not be completed."""


@dataclass(frozen=True, kw_only=True)
class _FlatGroup:
    """Live tensors of one dtype that are consecutive views of `flat`: `index[i]` is the
    position in the caller's order of the i-th view."""

    flat: torch.Tensor
    index: tuple[int, ...]
    sizes: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]


def _owned_copy(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    out = []
    for t in tensors:
        dst = torch.empty(
            t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda and torch.cuda.is_available()
        )
        dst.copy_(t.detach(), non_blocking=t.is_cuda)
        out.append(dst)
    # a non-blocking copy runs on the current stream of its source's device, which need not be
    # the current device: wait for each device the tensors live on
    for device in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.current_stream(device).synchronize()
    return tuple(out)


def _owned_flat_copy(groups: Sequence[_FlatGroup], count: int) -> tuple[torch.Tensor, ...]:
    out: list[torch.Tensor | None] = [None] * count
    for grp in groups:
        owned = torch.empty_like(grp.flat)
        owned.copy_(grp.flat)
        for i, part, shape in zip(
            grp.index, torch.split(owned, list(grp.sizes)), grp.shapes, strict=True
        ):
            out[i] = part.view(shape)
    return tuple(t for t in out if t is not None)


def _adjacent(ts: Sequence[torch.Tensor]) -> bool:
    """Consecutive views of one storage, back to back, in order."""
    base = ts[0]
    end = base.data_ptr() + base.numel() * base.element_size()
    storage = base.untyped_storage().data_ptr()
    for t in ts[1:]:
        if t.untyped_storage().data_ptr() != storage or t.data_ptr() != end:
            return False
        end += t.numel() * t.element_size()
    return True


def _flatten(tensors: Sequence[torch.Tensor]) -> list[_FlatGroup] | None:
    """One flat buffer per dtype holding the tensors as consecutive views: adopted as it is when
    the tensors already are such views, else made by re-pointing every tensor at a slice of a new
    buffer (values kept, same tensor objects). None (nothing changed) unless the tensors are
    contiguous CPU tensors that do not require grad and, per dtype, either already flat or each in
    a storage of its own."""
    if not tensors or any(t.is_cuda or t.requires_grad or not t.is_contiguous() for t in tensors):
        return None
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    plans = []
    for dtype, index in by_dtype.items():
        ts = [tensors[i] for i in index]
        if _adjacent(ts):
            plans.append((dtype, index, True))
        elif len({t.untyped_storage().data_ptr() for t in ts}) == len(ts):
            plans.append((dtype, index, False))
        else:
            return None  # views sharing storage in another way: re-pointing would split them
    groups = []
    with torch.no_grad():
        for dtype, index, flat_already in plans:
            sizes = tuple(int(tensors[i].numel()) for i in index)
            shapes = tuple(tuple(tensors[i].shape) for i in index)
            first = tensors[index[0]]
            if flat_already:
                flat = first.as_strided((sum(sizes),), (1,), first.storage_offset())
            else:
                flat = torch.empty(sum(sizes), dtype=dtype)
                offset = 0
                for i, n in zip(index, sizes, strict=True):
                    t = tensors[i]
                    flat[offset : offset + n].copy_(t.reshape(-1))
                    t.set_(flat.untyped_storage(), offset, t.shape, t.stride())
                    offset += n
            groups.append(_FlatGroup(flat=flat, index=tuple(index), sizes=sizes, shapes=shapes))
    return groups


def _done(value: tuple[torch.Tensor, ...]) -> Future[tuple[torch.Tensor, ...]]:
    f: Future[tuple[torch.Tensor, ...]] = Future()
    f.set_result(value)
    return f


class Snapshot:
    """A pending or completed owned copy. `wait()` returns the copies (never the live tensors)."""

    def __init__(self, future: Future[tuple[torch.Tensor, ...]]) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> tuple[torch.Tensor, ...]:
        try:
            return self._future.result(timeout=timeout)
        except TimeoutError:
            raise SnapshotError(
                f"gradient snapshot not complete after {timeout} s",
                "the copy thread is blocked or the buffer is huge",
                "raise the timeout or check the copy thread",
            ) from None


class LiveGradients:
    """The live gradient buffers of one replica, guarded against reuse while a snapshot of them
    is still being copied. With `flatten=True` (default) distinct contiguous CPU tensors are
    moved into one flat buffer per dtype (see the module docstring); `flat_buffers` lists them
    (empty when the tensors were left as they are)."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        flatten: bool = True,
        inline_bytes: int = DEFAULT_INLINE_BYTES,
    ) -> None:
        if inline_bytes < 0:
            raise ValueError(f"inline_bytes={inline_bytes} must be >= 0 (0: always on the thread)")
        self.tensors = list(tensors)
        self._groups = _flatten(self.tensors) if flatten else None
        self._bytes = sum(t.numel() * t.element_size() for t in self.tensors)
        self._inline = self._bytes <= inline_bytes and not any(t.is_cuda for t in self.tensors)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grad-snapshot")
        self._pending: list[Snapshot] = []
        self._lock = threading.Lock()

    @property
    def flat_buffers(self) -> tuple[torch.Tensor, ...]:
        return tuple(g.flat for g in self._groups or ())

    def _copy(self) -> tuple[torch.Tensor, ...]:
        if self._groups is not None:
            return _owned_flat_copy(self._groups, len(self.tensors))
        return _owned_copy(self.tensors)

    def snapshot(self) -> Snapshot:
        """Start an owned copy of the live tensors; a small CPU copy is complete on return."""
        if self._inline:
            return Snapshot(_done(self._copy()))
        snap = Snapshot(self._pool.submit(self._copy))
        with self._lock:
            self._pending.append(snap)
        return snap

    def wait_owned(self) -> None:
        """Block until no pending snapshot still reads the live tensors: each has its copy, or
        has failed (its failure is its own, raised by its `wait()`, not here)."""
        with self._lock:
            pending, self._pending = self._pending, []
        futures.wait([s._future for s in pending])

    @contextmanager
    def writable(self) -> Iterator[list[torch.Tensor]]:
        """The live tensors, once no snapshot still reads them."""
        self.wait_owned()
        yield self.tensors

    def zero_(self) -> None:
        with self.writable() as ts, torch.no_grad():
            if self._groups is not None:
                for g in self._groups:
                    g.flat.zero_()
                return
            for t in ts:
                t.zero_()

    def close(self) -> None:
        self.wait_owned()
        self._pool.shutdown(wait=True)
