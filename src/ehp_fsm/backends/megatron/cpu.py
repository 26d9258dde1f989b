"""Megatron-Core 0.16.1 on CPU: the compatibility layer a CPU plan's trainer processes apply.

Megatron-Core assumes CUDA everywhere. `apply()` lets the *unmodified* Megatron code (local-spec
GPTModel, DDP, DistributedOptimizer, dist_checkpointing) run on CPU with Gloo, so a CPU plan with
`core.backend = "megatron"` trains real Megatron-Core lanes and the CPU tests exercise real
Megatron code. It patches process-global state (torch's CUDA entry points and tensor factories),
so it is applied once, at start-up, in a process that will never touch a GPU: the trainer worker
applies it when the plan places the Core on CPU hosts (`training.lanes`), `ehp-fsm check`
says so, and the CPU tests apply it in their worker processes. The backend modules never
import it (a test enforces that), and nothing applies it on a CUDA host.

Each patch below carries a one-line reason. What it does not do: emulate CUDA semantics (streams
are synchronous no-ops, there is one "device"), or make fused/TE/Apex kernels available. What it
breaks: transformers' `from_pretrained` in the same process (observed with transformers 5.24:
the loaded Qwen3's rotary `inv_freq` buffer comes out uninitialised) — a Megatron lane reads HF
weights through mbridge's safetensors reader and never loads a transformers model.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

_APPLIED = False

# Factories Megatron calls with device="cuda" or device=torch.cuda.current_device().
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint")


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


def _cpu_device(device: object) -> object:
    return torch.device("cpu") if _is_cuda_device(device) else device


def _wrap_factory(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    return wrapper


class _FakeStream:
    """A CUDA stream stand-in: CPU work is synchronous, so every wait is already satisfied."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        del args, kwargs

    def wait_stream(self, other: object) -> None:
        del other

    def synchronize(self) -> None:
        return None

    def record_event(self, event: object = None) -> object:
        return event


@contextlib.contextmanager
def _stream_context(stream: object = None) -> Iterator[None]:
    del stream
    yield


_CPU_TYPE_TO_CUDA = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def applied() -> bool:
    """Whether this process runs Megatron-Core through the CPU layer."""
    return _APPLIED


def apply() -> None:
    """Patch torch so Megatron-Core 0.16.1 runs on CPU. Idempotent; process-global. Refused
    where CUDA is available: the layer would hide the GPU from Megatron."""
    global _APPLIED
    if _APPLIED:
        return
    if torch.cuda.is_available():
        raise RuntimeError(
            "the Megatron CPU compatibility layer was asked for in a process that sees a GPU; "
            "it is for CPU plans only (place the Core on CPU hosts, or run on the GPU)"
        )
    _APPLIED = True
    cuda: Any = torch.cuda  # Any: we replace module attributes with CPU stand-ins
    tensor_cls: Any = torch.Tensor
    # Megatron allocates buffers with device=torch.cuda.current_device(): one CPU "device".
    cuda.current_device = lambda: torch.device("cpu")
    # Megatron calls set_device(local_rank) at start-up; there is nothing to select on CPU.
    cuda.set_device = lambda device: None
    # DDP overlaps communication on side streams; on CPU everything is synchronous.
    cuda.Stream = _FakeStream
    cuda.stream = _stream_context
    cuda.current_stream = lambda device=None: _FakeStream()
    cuda.default_stream = lambda device=None: _FakeStream()
    # synchronize()/empty_cache() are barriers/frees of device memory; CPU has neither.
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    # Buffers and scalars are created with device="cuda": rewrite the device argument to CPU.
    for name in _FACTORIES:
        setattr(torch, name, _wrap_factory(getattr(torch, name)))
    # Tensor.cuda() moves state to the GPU before collectives: keep it where it is.
    tensor_cls.cuda = lambda self, *a, **k: self
    # The CUDA RNG tracker (weight init, dropout) forks the CUDA generator: use the CPU one.
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    from megatron.core.tensor_parallel import random as megatron_random

    mrandom: Any = megatron_random

    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state()
    )
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: (
        torch.set_rng_state(new_state)
    )
    # DistributedOptimizer accepts only 'torch.cuda.*Tensor' type strings: report CPU params so.
    original_type = torch.Tensor.type

    def _type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        result = original_type(self, *args, **kwargs)
        if not args and not kwargs and isinstance(result, str):
            return _CPU_TYPE_TO_CUDA.get(result, result)
        return result

    tensor_cls.type = _type
