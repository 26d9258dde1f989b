"""Owned asynchronous CPU gradient snapshots never alias the live buffer, and the live buffer is
not reused before the snapshot owns its copy."""

from __future__ import annotations

import time

import pytest
import torch

from ehp_fsm.training.snapshot import LiveGradients


def test_naive_cpu_snapshot_aliases_which_is_what_we_guard_against():
    live = torch.ones(8)
    naive = live.cpu()  # a no-op on a CPU tensor: the same storage
    live.zero_()
    assert naive.sum() == 0  # the "snapshot" changed: this is the bug


def test_snapshot_owns_its_copy_and_later_writes_do_not_change_it():
    big = [torch.arange(4_000_000, dtype=torch.float32), torch.full((1000, 33), 2.5)]
    expect = [t.clone() for t in big]
    live = LiveGradients(big)
    try:
        snap = live.snapshot()
        live.zero_()  # must wait for the copy before writing
        got = snap.wait(timeout=30)
        for g, e, t in zip(got, expect, big, strict=True):
            assert torch.equal(g, e)
            assert g.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
            assert float(t.abs().sum()) == 0.0
        with live.writable() as ts:
            for t in ts:
                t.fill_(7.0)
        for g, e in zip(got, expect, strict=True):
            assert torch.equal(g, e)
    finally:
        live.close()


def test_buffer_is_not_reused_before_the_copy_is_owned():
    t = torch.ones(2_000_000)
    live = LiveGradients([t])
    try:
        for i in range(5):
            snap = live.snapshot()
            with live.writable() as ts:
                assert snap.done()  # writable only after the copy completed
                ts[0].fill_(float(i + 2))
            assert torch.all(snap.wait()[0] == float(i + 1))
    finally:
        live.close()


def test_a_failed_copy_does_not_let_the_buffer_be_written_under_a_later_one():
    # The first copy fails (the far edge faked: a host allocation failure), the second is slow.
    # Writing the live buffer must still wait for the second, and the failure is the first
    # snapshot's own: raised by its wait(), not by every later write.
    t = torch.ones(1_000_000)
    live = LiveGradients([t], inline_bytes=0)
    real, calls = live._copy, []

    def copy() -> tuple[torch.Tensor, ...]:
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError("host allocation failed")
        time.sleep(0.3)  # still copying when the test writes the live buffer
        return real()

    live._copy = copy  # type: ignore[method-assign]
    try:
        first, second = live.snapshot(), live.snapshot()
        live.zero_()  # waits for both, raises neither's failure
        assert second.done() and float(second.wait()[0].sum()) == t.numel()
        assert float(t.sum()) == 0.0
        with pytest.raises(MemoryError, match="host allocation failed"):
            first.wait()
        live.zero_()  # the failure is not raised again
    finally:
        live.close()
