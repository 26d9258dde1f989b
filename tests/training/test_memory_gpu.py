"""On a GPU machine (`-m gpu`; never in CPU CI, where `tests/training/test_memory.py` checks the
same measurement on CPU tensors): a lane's tensors on CUDA are seen by the park measurement
while referenced; once dropped, and what is kept beside it moved to host memory
(`offload_cuda`), torch's allocator holds nothing after `empty_cache` and — with the `gpu` extra
(nvidia-ml-py) — NVML sees no more device memory for this process than it held outside torch's
allocator before parking; the offloaded tensor then comes back exactly. A fresh process: the
measurement reads this process's whole CUDA state."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import torch
    from ehp_fsm.training import memory

    torch.cuda.set_device(0)
    model = torch.nn.Linear(4096, 4096, device="cuda")
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 4096, device="cuda")).sum().backward()
    opt.step()
    context = memory.cuda_context_bytes()
    recorded = memory.lane_storages({
        "params": list(model.parameters()),
        "grads": [p.grad for p in model.parameters()],
        "optimizer": [t for s in opt.state.values() for t in s.values()],
    })
    held = memory.measure(recorded, frozen=0, nvml_baseline=context)
    assert held.device == "cuda:0" and held.cuda_allocated and held.by_kind["optimizer"], held
    assert not held.free, held
    del model, opt
    kept = torch.arange(1 << 20, device="cuda")  # what a parked lane keeps beside its state
    context = memory.cuda_context_bytes()  # right before parking, as the worker takes it
    assert not memory.measure(recorded, frozen=0, nvml_baseline=context).free
    offloaded = memory.offload_cuda()
    assert sum(h.nbytes() for _, h in offloaded) == 8 << 20, offloaded
    gone = memory.measure(recorded, frozen=0, nvml_baseline=context)
    assert gone.lane_bytes == 0 and gone.cuda_allocated == 0 == gone.cuda_reserved, gone
    assert gone.nvml_used is not None and gone.free, gone.why_not_free()
    memory.restore_storages(offloaded)
    # (the expected values are made only now: a CPU copy kept earlier would count as held)
    assert kept.is_cuda and torch.equal(kept, torch.arange(1 << 20, device="cuda"))
    print("ok", context, held.nvml_used, gone.nvml_used)
    """
)


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_a_dropped_cuda_lane_is_free_by_torch_and_nvml() -> None:
    # keep the caller's PYTHONPATH (a GPU script may add carried wheels to it)
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    got = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert got.returncode == 0 and got.stdout.startswith("ok"), got.stdout + got.stderr
