"""What a parked worker holds, measured: the lane's storages by kind while anything references
them, nothing once it let go; and the rules that make a report "free" (CUDA allocator and NVML
figures as a worker on a GPU host reports them — given here as values, the CPU CI has no GPU)."""

from __future__ import annotations

import pytest

from ehp_fsm.training import memory
from ehp_fsm.training.backend import TorchBackend
from ehp_fsm.training.lane import LaneSpec
from ehp_fsm.training.memory import HeldMemory
from ehp_fsm.training.policy import PolicyConfig
from ehp_fsm.training.reduction import release_staging

TINY = PolicyConfig(d_model=16, n_heads=2, d_ff=32, n_layers=1, max_len=16)


def test_a_dropped_lane_is_seen_only_while_something_keeps_it() -> None:
    release_staging()  # the process's staging bucket: an earlier test's reduction may hold one
    be = TorchBackend(TINY, seed=0)
    be.build(LaneSpec(role="hybrid", replica="x", pad_multiple=48))
    recorded = memory.lane_storages(be.memory_tensors())
    built = memory.measure(recorded, frozen=0)
    assert set(built.by_kind) == set(memory.KINDS)
    for kind in ("params", "grads", "master", "optimizer"):
        assert built.by_kind[kind] > 0, built
    assert built.by_kind["master"] == sum(t.numel() * 4 for t in be.lane.master.values())

    kept = be.lane.exp_avg[0][:3]  # a view keeps its whole flat moment buffer alive
    be.close()
    del be
    release_staging()  # as a parking worker does
    held = memory.measure(recorded, frozen=0)
    assert held.by_kind["optimizer"] == kept.untyped_storage().nbytes()
    assert held.lane_bytes == held.by_kind["optimizer"] and not held.free
    assert "optimizer" in (held.why_not_free() or "")

    del kept
    gone = memory.measure(recorded, frozen=0)
    assert gone.lane_bytes == 0 and gone.device == "cpu" and gone.cuda_allocated is None


def _cuda(**kw: object) -> HeldMemory:
    base: dict[str, object] = {
        "device": "cuda:0",
        "cuda_allocated": 0,
        "cuda_reserved": 0,
        "nvml_used": 500 << 20,
        "nvml_baseline": 500 << 20,
    }
    return HeldMemory(**(base | kw))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("report", "why"),
    [
        (HeldMemory(device="cpu"), None),
        (HeldMemory(device="cpu", by_kind={"params": 8}), "lane tensors"),
        (HeldMemory(device="cpu", other=64, frozen=64), None),  # globals re-made, not grown
        (HeldMemory(device="cpu", other=65, frozen=64), "other tensors"),
        (_cuda(), None),
        (_cuda(cuda_reserved=2 << 20), "reserved"),
        (_cuda(nvml_used=None), "NVML could not confirm"),  # a doubt is not free
        (_cuda(nvml_baseline=None), "NVML could not confirm"),
        (_cuda(nvml_used=(500 << 20) + 1), "NVML: the process uses"),
    ],
)
def test_what_counts_as_free(report: HeldMemory, why: str | None) -> None:
    said = report.why_not_free()
    assert (said is None) if why is None else (said is not None and why in said), said
    assert HeldMemory.from_wire(report.to_wire()) == report


def test_nvml_figures_of_the_workers_processes() -> None:
    procs = [(10, 300), (11, 700), (12, None)]
    assert memory.used_by(procs, [10, 11]) == 1000
    assert memory.used_by(procs, [99]) == 0  # none of its processes on the GPU
    assert memory.used_by(procs, [10, 12]) is None  # the driver hid a figure: unknown


def test_offloaded_storages_give_their_bytes_back_and_return_them_exactly() -> None:
    # what a parked lane does with the CUDA tensors it keeps beside its state (module buffers,
    # cached rotary tables, Megatron's global memory buffer); the mechanics are the same for CPU
    # storages, which is what CI has
    import torch

    flat = torch.randn(64, generator=torch.Generator().manual_seed(3))
    views = [flat[:16], flat[16:].view(6, 8)]  # two views of one storage
    other = torch.arange(5, dtype=torch.int64)
    want = [flat.clone(), other.clone()]
    offloaded = memory.offload_storages([*views, other, flat])
    assert len(offloaded) == 2  # one entry per storage
    assert flat.untyped_storage().nbytes() == 0 == other.untyped_storage().nbytes()
    assert sum(h.nbytes() for _, h in offloaded) == 64 * 4 + 5 * 8
    memory.restore_storages(offloaded)
    assert torch.equal(flat, want[0]) and torch.equal(other, want[1])
    assert torch.equal(views[1], want[0][16:].view(6, 8))


def test_offload_cuda_touches_nothing_in_a_process_without_cuda() -> None:
    import torch

    t = torch.ones(4)
    assert memory.offload_cuda() == []
    assert t.untyped_storage().nbytes() == 16


def test_the_tensors_a_baseline_froze_are_still_found() -> None:
    # a Megatron warm worker builds its lane, then freezes the baseline: `gc.get_objects` then
    # no longer lists the lane's module buffers, which a park on a GPU must still move to host
    import gc

    import torch

    kept = torch.full((7,), 3.0)
    try:
        memory.baseline()
        assert not any(t is kept for t in memory.live_tensors())  # hidden by the freeze ...
        assert any(t is kept for t in memory.frozen_tensors())  # ... and remembered
    finally:
        gc.unfreeze()
