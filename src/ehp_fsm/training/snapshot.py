"""Owned asynchronous CPU snapshots of live gradient buffers.

A snapshot taken for sending must never alias the live buffer: `tensor.cpu()` on a CPU tensor and
`tensor.detach()` return the *same* storage, so a later `zero_()` or backward pass would change
what is being sent. `LiveGradients.snapshot()` copies every tensor into freshly allocated CPU
storage on a background thread (a CUDA tensor would use a non-blocking copy into pinned memory
and an event), and the live buffer refuses to be written (`writable()`, `zero_()`) until every
pending snapshot owns its copy.

What it knows: copying and the ordering between the copy and the next write. What it does not
know: where snapshots are sent, reduction, the ledger.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch

from ehp_fsm.errors import EhpError


class SnapshotError(EhpError):
    """A snapshot could not be completed."""


def _owned_copy(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    out = []
    for t in tensors:
        dst = torch.empty(
            t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda and torch.cuda.is_available()
        )
        dst.copy_(t.detach(), non_blocking=t.is_cuda)
        out.append(dst)
    if any(t.is_cuda for t in tensors):
        torch.cuda.current_stream().synchronize()
    return tuple(out)


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
    is still being copied."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = list(tensors)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grad-snapshot")
        self._pending: list[Snapshot] = []
        self._lock = threading.Lock()

    def snapshot(self) -> Snapshot:
        """Start an owned copy of the live tensors; returns at once."""
        snap = Snapshot(self._pool.submit(_owned_copy, list(self.tensors)))
        with self._lock:
            self._pending.append(snap)
        return snap

    def wait_owned(self) -> None:
        """Block until every pending snapshot owns its copy."""
        with self._lock:
            pending, self._pending = self._pending, []
        for s in pending:
            s.wait()

    @contextmanager
    def writable(self) -> Iterator[list[torch.Tensor]]:
        """The live tensors, once no snapshot still reads them."""
        self.wait_owned()
        yield self.tensors

    def zero_(self) -> None:
        with self.writable() as ts, torch.no_grad():
            for t in ts:
                t.zero_()

    def close(self) -> None:
        self.wait_owned()
        self._pool.shutdown(wait=True)
