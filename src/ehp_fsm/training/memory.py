"""What a parked trainer worker still holds: measured, never assumed.

A warm Hybrid worker leaves a borrow by dropping its lane (model, gradients, master weights,
optimizer state, the KL reference, the reduction's staging bucket). Its GPU is free again only
after that was *checked* (DESIGN.md: a GPU leaves `releasing` only on a real check, never a
self-confirmation). Before the lane is dropped, `lane_storages` records which storage holds which
kind of lane tensor; `measure` then collects garbage and walks every tensor the process still
references (`gc.get_objects`), summing storage bytes once per storage: those of the recorded
storages by kind (`params`, `grads`, `master`, `optimizer`, `reference`, `staging`), the rest
as `other`. A storage that only C++ still holds (no Python tensor refers to it) is not seen on
CPU; on CUDA the caching allocator's own counters after `empty_cache` see everything torch
allocated, and NVML (`nvidia-ml-py`) sees what the driver gives the process, whatever allocated
it.

Free means: no lane tensor is referenced, the other tensors made since the worker started add up
to no more than what it held before its first lane (`baseline`, measured once and then left out
of the watch by `gc.freeze`: a library's global state re-made by each build, such as Megatron's
RNG tracker states, replaces what was there), and on CUDA nothing is allocated or reserved by
torch and NVML sees no more device memory for the process than it held outside torch's allocator
right before it parked (its NVML baseline: the CUDA context with its loaded kernels, library
handles and communicators).

What it knows: torch's tensors, allocator counters and NVML. What it does not know: lanes beyond
their tensors, the GPU ledger, who asked.
"""

from __future__ import annotations

import gc
import os
import warnings
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ehp_fsm import nvml

KINDS = ("params", "grads", "master", "optimizer", "reference", "staging")

#: storage key (device, data pointer) → (kind, bytes)
Storages = dict[tuple[str, int], tuple[str, int]]


def _cuda_started() -> bool:
    """Whether this process created its CUDA context (torch's call is untyped)."""
    return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]


def _key(t: torch.Tensor) -> tuple[tuple[str, int], int] | None:
    """A tensor's storage as (device, data pointer) and its bytes; None for a storage without
    memory (meta tensors, empty storages)."""
    if t.device.type == "meta":
        return None
    s = t.untyped_storage()
    ptr, n = s.data_ptr(), s.nbytes()
    if ptr == 0 or n == 0:
        return None
    return (str(t.device), ptr), n


def lane_storages(tensors: Mapping[str, Iterable[torch.Tensor]]) -> Storages:
    """The storages of a lane's tensors by kind (a storage is counted once, first kind wins)."""
    out: Storages = {}
    for kind, ts in tensors.items():
        for t in ts:
            got = _key(t)
            if got is not None and got[0] not in out:
                out[got[0]] = (kind, got[1])
    return out


def live_tensors() -> list[torch.Tensor]:
    """Every tensor a Python object of this process still references (after a full collection)."""
    gc.collect()
    with warnings.catch_warnings():  # torch's deprecated module proxies warn on isinstance
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]


@dataclass(frozen=True, kw_only=True)
class HeldMemory:
    """One measurement of what a worker holds (bytes). `by_kind`: recorded lane storages still
    referenced; `other`: every other referenced tensor storage made since the baseline;
    `frozen`: tensor bytes referenced at the baseline (before any lane; not watched). CUDA
    fields are None where the process never touched CUDA; `nvml_used` / `nvml_baseline` are
    None where NVML could not be asked (then a CUDA worker is not free: a doubt is never
    "free")."""

    device: str
    by_kind: Mapping[str, int] = field(default_factory=dict)
    other: int = 0
    frozen: int = 0
    cuda_allocated: int | None = None
    cuda_reserved: int | None = None
    nvml_used: int | None = None
    nvml_baseline: int | None = None

    @property
    def lane_bytes(self) -> int:
        return sum(self.by_kind.values())

    def why_not_free(self) -> str | None:
        """None when free; else what is still held, in words."""
        held = {k: v for k, v in self.by_kind.items() if v}
        if held:
            return f"lane tensors still referenced: {held} bytes"
        if self.other > self.frozen:
            return (
                f"{self.other} bytes of other tensors made since the worker started (more than "
                f"the {self.frozen} it held before its first lane)"
            )
        if self.cuda_allocated is None:
            return None
        if self.cuda_allocated or self.cuda_reserved:
            return (
                f"torch still has {self.cuda_allocated} bytes allocated, "
                f"{self.cuda_reserved} reserved on {self.device}"
            )
        if self.nvml_used is None or self.nvml_baseline is None:
            return (
                "NVML could not confirm the process's memory on the device (nvidia-ml-py "
                "missing — the `gpu` extra — or NVML does not see this process)"
            )
        if self.nvml_used > self.nvml_baseline:
            return (
                f"NVML: the process uses {self.nvml_used} bytes on {self.device}, its CUDA "
                f"context took {self.nvml_baseline}"
            )
        return None

    @property
    def free(self) -> bool:
        return self.why_not_free() is None

    def to_wire(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "by_kind": dict(self.by_kind),
            "other": self.other,
            "frozen": self.frozen,
            "cuda_allocated": self.cuda_allocated,
            "cuda_reserved": self.cuda_reserved,
            "nvml_used": self.nvml_used,
            "nvml_baseline": self.nvml_baseline,
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> HeldMemory:
        def opt(k: str) -> int | None:
            v = d.get(k)
            return None if v is None else int(v)

        return cls(
            device=str(d["device"]),
            by_kind={str(k): int(v) for k, v in dict(d["by_kind"]).items()},
            other=int(d["other"]),
            frozen=int(d["frozen"]),
            cuda_allocated=opt("cuda_allocated"),
            cuda_reserved=opt("cuda_reserved"),
            nvml_used=opt("nvml_used"),
            nvml_baseline=opt("nvml_baseline"),
        )


#: the tensors alive when `baseline` froze them (weakly): `gc.get_objects` no longer lists them
_FROZEN_TENSORS: list[weakref.ref[torch.Tensor]] = []


def baseline() -> int:
    """Tensor bytes this process references now (before its first lane), then `gc.freeze()`:
    every object alive now — the imports, hundreds of thousands — is left out of later
    collections and scans, so a measurement walks only what was made since (a lane, and what
    outlived it) in milliseconds instead of a second. The tensors among them are remembered
    weakly (`frozen_tensors`): a Megatron lane built before the freeze keeps module buffers
    on the GPU that a park must still find."""
    live = live_tensors()
    _, other = tensor_bytes({}, live)
    _FROZEN_TENSORS[:] = [r for r in _FROZEN_TENSORS if r() is not None]
    _FROZEN_TENSORS.extend(weakref.ref(t) for t in live)
    gc.freeze()
    return other


def frozen_tensors() -> list[torch.Tensor]:
    """The tensors `baseline` froze that are still alive."""
    return [t for r in _FROZEN_TENSORS if (t := r()) is not None]


def tensor_bytes(
    recorded: Storages, live: Iterable[torch.Tensor] | None = None
) -> tuple[dict[str, int], int]:
    """Bytes of the referenced storages (`live`, or every tensor `live_tensors` finds):
    recorded ones by kind, and all others together."""
    by_kind = dict.fromkeys(KINDS, 0)
    other = 0
    seen: set[tuple[str, int]] = set()
    for t in live_tensors() if live is None else live:
        got = _key(t)
        if got is None or got[0] in seen:
            continue
        seen.add(got[0])
        kind = recorded.get(got[0])
        if kind is not None:
            by_kind[kind[0]] = by_kind.get(kind[0], 0) + got[1]
        else:
            other += got[1]
    return by_kind, other


def _storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The non-empty storages of `tensors`, each once (views share their base's storage)."""
    out: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() and st.nbytes():
            out.setdefault(st.data_ptr(), st)
    return list(out.values())


def empty_storages(
    tensors: Mapping[str, Iterable[torch.Tensor]], *, keep: Iterable[str] = ()
) -> list[tuple[torch.UntypedStorage, int]]:
    """Give back the bytes of every storage of `tensors` (kinds in `keep` left alone) without
    dropping the tensors: each storage is resized to 0 bytes, views of it included (a Megatron
    lane's parameters view its DDP buffer). Returns (storage, former size) for each, once: what
    resizing them back to that size restores (the contents are then undefined until written)."""
    kept = set(keep)
    out = [
        (st, st.nbytes())
        for st in _storages(t for k, ts in tensors.items() if k not in kept for t in ts)
    ]
    for st, _ in out:
        st.resize_(0)
    return out


def offload_storages(
    tensors: Iterable[torch.Tensor],
) -> list[tuple[torch.UntypedStorage, torch.UntypedStorage]]:
    """Move the bytes of every storage of `tensors` to host memory and resize the storage to 0
    bytes, the tensors kept. Returns (storage, host copy) for each storage, once;
    `restore_storages` puts the bytes back exactly."""
    out = []
    for st in _storages(tensors):
        host = torch.empty(st.nbytes(), dtype=torch.uint8).untyped_storage()
        host.copy_(st)
        out.append((st, host))
    for st, _ in out:
        st.resize_(0)
    return out


def restore_storages(
    offloaded: Iterable[tuple[torch.UntypedStorage, torch.UntypedStorage]],
) -> None:
    """Undo `offload_storages`: each storage gets its size and its bytes back."""
    for st, host in offloaded:
        st.resize_(host.nbytes())
        st.copy_(host)


def offload_cuda() -> list[tuple[torch.UntypedStorage, torch.UntypedStorage]]:
    """Offload (`offload_storages`) every CUDA tensor this process still references, those
    `baseline` froze included: what a parked lane keeps beside its emptied state — module
    buffers (rotary tables), cached rotary embeddings, Megatron's global memory buffer, the
    optimizer's scalars — so that torch's allocator can give the GPU back whole. Nothing on a
    process that never touched CUDA."""
    if not _cuda_started():
        return []
    return offload_storages(t for t in [*frozen_tensors(), *live_tensors()] if t.is_cuda)


def release_cuda() -> None:
    """Give the caching allocator's free blocks (and cuBLAS workspaces) back to the driver."""
    if not _cuda_started():
        return
    torch.cuda.synchronize()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()


def measure(
    recorded: Storages,
    *,
    frozen: int,
    nvml_baseline: int | None = None,
) -> HeldMemory:
    """What this process holds now (see the module docstring); frees the CUDA cache first."""
    by_kind, other = tensor_bytes(recorded)
    if not _cuda_started():
        return HeldMemory(device="cpu", by_kind=by_kind, other=other, frozen=frozen)
    release_cuda()
    index = torch.cuda.current_device()
    return HeldMemory(
        device=f"cuda:{index}",
        by_kind=by_kind,
        other=other,
        frozen=frozen,
        cuda_allocated=torch.cuda.memory_allocated(index),
        cuda_reserved=torch.cuda.memory_reserved(index),
        nvml_used=nvml_process_memory(_physical_index(index), [os.getpid()]),
        nvml_baseline=nvml_baseline,
    )


def cuda_context_bytes() -> int | None:
    """Device memory this process holds outside torch's caching allocator (its CUDA context,
    the kernels loaded into it, library handles and communicators), per NVML: what a parked
    worker may keep. NVML's figure for this process minus what torch reserved, taken right
    before the worker parks (the context grows while a lane trains: CUDA loads kernel modules
    lazily and NCCL sets up its communicators on first use: on an H200 a 0.44B Megatron lane's
    process held 1.63 GB there after its build and 3.0 GB after its steps). None without CUDA
    or NVML, and when NVML lists no memory for this process although it has a context: NVML
    does not see it (a PID namespace of its own), and a check that cannot see the process
    confirms nothing."""
    if not _cuda_started():
        return None
    index = torch.cuda.current_device()
    used = nvml_process_memory(_physical_index(index), [os.getpid()])
    if not used:
        return None
    return max(0, used - torch.cuda.memory_reserved(index))


def _physical_index(index: int) -> int:
    """The NVML index of torch's device `index` (CUDA_VISIBLE_DEVICES renumbers devices)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not visible:
        return index
    names = [v.strip() for v in visible.split(",") if v.strip()]
    return int(names[index]) if index < len(names) and names[index].isdigit() else index


def used_by(processes: Iterable[tuple[int, int | None]], pids: Iterable[int]) -> int | None:
    """Bytes NVML reports for `pids` among `processes` ((pid, used bytes) pairs); None when NVML
    gave no figure for one of them (the driver may hide it: a doubt is not "free")."""
    want = set(pids)
    total = 0
    for pid, used in processes:
        if pid in want:
            if used is None:
                return None
            total += used
    return total


def nvml_process_memory(index: int, pids: Iterable[int]) -> int | None:
    """Device memory NVML says `pids` use on GPU `index` (compute and graphics contexts); None
    when NVML is not installed (the `gpu` extra: nvidia-ml-py) or cannot be asked."""
    processes = nvml.device_processes(index)
    return None if processes is None else used_by(processes, pids)
