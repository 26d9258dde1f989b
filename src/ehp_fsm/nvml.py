"""NVML (`nvidia-ml-py`, the `gpu` extra): the processes the driver lists on a GPU.

One question, asked by two checks that a GPU is free: a parked Hybrid worker's own report of
what its process still holds (`training/memory.py`), and an agent's look at a GPU whose owner
stopped (`runtime/agent_processes.py`). No torch here: an agent does not load it.
"""

from __future__ import annotations

import importlib.util
from typing import Any


def installed() -> bool:
    """Whether the NVML bindings (`pynvml`, from `nvidia-ml-py`) can be imported."""
    return importlib.util.find_spec("pynvml") is not None


def device_processes(index: int, *, graphics: bool = True) -> list[tuple[int, int | None]] | None:
    """(pid, device memory in bytes, or None where the driver gives no figure) of every compute
    process NVML lists on GPU `index` (NVML's numbering, not CUDA_VISIBLE_DEVICES'), and every
    graphics one with `graphics` (a display server holds one for good: not a sign that a
    stopped owner's process is still there); None when NVML is not installed or cannot be asked
    (no driver, an error): a doubt, never an empty device."""
    try:
        import pynvml  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        procs = list(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
        if graphics:
            procs += list(pynvml.nvmlDeviceGetGraphicsRunningProcesses(handle))
        return [(int(p.pid), _used(p)) for p in procs]
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


def _used(p: Any) -> int | None:
    used = getattr(p, "usedGpuMemory", None)
    # NVML_VALUE_NOT_AVAILABLE is an all-ones unsigned value (or None in newer bindings)
    return None if used is None or used >= 2**63 else int(used)
