"""On a GPU machine (`-m gpu`; never in CPU CI, where `tests/training/test_memory.py` checks the
same measurement on CPU tensors): a lane's tensors on CUDA are seen by the park measurement
while referenced, and once dropped torch's allocator holds nothing after `empty_cache` and —
with the `gpu` extra (nvidia-ml-py) — NVML sees no more device memory for this process than its
CUDA context. A fresh process: the measurement reads this process's whole CUDA state."""

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
    gone = memory.measure(recorded, frozen=0, nvml_baseline=context)
    assert gone.lane_bytes == 0 and gone.cuda_allocated == 0 == gone.cuda_reserved, gone
    assert gone.nvml_used is not None and gone.free, gone.why_not_free()
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
