"""Flat per-buffer layout of a model's parameters, as Megatron-Core's DP-zero sharding sees it.

What it knows: which parameters live in which flat buffer and at which offset, how each buffer is
padded for a data-parallel size and a padding unit, which contiguous shard each DP rank owns, and
which piece of which parameter falls inside that shard. What it does not know: tensors' values,
optimizers, processes. Source and target of a transfer may use different `dp_size` and
`pad_multiple`; the unpadded ("world") coordinates are the same for both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import prod

import torch

from ehp_fsm.errors import EhpError


class LayoutError(EhpError):
    """Two layouts (or a layout and a state) do not describe the same parameters."""


@dataclass(frozen=True, kw_only=True)
class ParamSlot:
    name: str
    shape: tuple[int, ...]
    buffer: int
    offset: int  # start in the buffer's unpadded flat coordinates

    @property
    def numel(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True, kw_only=True)
class BufferLayout:
    index: int
    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    numel_unpadded: int
    numel_padded: int
    shard_numel: int
    #: Where this buffer's unpadded elements lie in a DP-zero world state (`DpZeroState.buffers`):
    #: under `world_buffer` (default: this buffer's own index) from `world_offset`. Megatron
    #: shards per bucket but gathers a grad buffer's buckets into one world tensor, the padding
    #: between them dropped: a Megatron layout has one `BufferLayout` per bucket, each placed in
    #: its grad buffer's world tensor (e.g. the shared embedding's own bucket under PP).
    world_buffer: int | None = None
    world_offset: int = 0

    @property
    def world_key(self) -> int:
        """The key of this buffer's world tensors in a `DpZeroState`."""
        return self.index if self.world_buffer is None else self.world_buffer

    @property
    def dtype_key(self) -> tuple[torch.dtype, torch.dtype]:
        """Megatron-Core keys a buffer's DP-zero state by (param dtype, grad dtype)."""
        return (self.param_dtype, self.grad_dtype)


@dataclass(frozen=True, kw_only=True)
class Piece:
    """The part [param_start, param_end) of a parameter's flat view that lies in one DP shard,
    starting at `shard_start` inside that shard."""

    name: str
    buffer: int
    param_start: int
    param_end: int
    shard_start: int

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


@dataclass(frozen=True, kw_only=True)
class FlatLayout:
    params: tuple[ParamSlot, ...]
    buffers: tuple[BufferLayout, ...]
    dp_size: int
    pad_multiple: int

    def __post_init__(self) -> None:
        if self.dp_size < 1:
            raise ValueError(f"dp_size={self.dp_size} must be >= 1")
        if self.pad_multiple < 1:
            raise ValueError(f"pad_multiple={self.pad_multiple} must be >= 1")
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise ValueError("parameter names must be unique in a layout")

    @classmethod
    def build(
        cls,
        named_shapes: Sequence[tuple[str, tuple[int, ...]]],
        *,
        dp_size: int,
        pad_multiple: int,
        param_dtype: torch.dtype,
        grad_dtype: torch.dtype = torch.float32,
        buffer_of: Callable[[str], int] | None = None,
    ) -> FlatLayout:
        """Lay out parameters (in the given order) into flat buffers; each buffer is padded to a
        multiple of `dp_size * pad_multiple` so that it splits into equal DP shards."""
        if not named_shapes:
            raise ValueError("a layout needs at least one parameter")
        which = buffer_of or (lambda _name: 0)
        fill: dict[int, int] = {}
        slots = []
        for name, shape in named_shapes:
            b = which(name)
            off = fill.get(b, 0)
            slot = ParamSlot(name=name, shape=tuple(shape), buffer=b, offset=off)
            slots.append(slot)
            fill[b] = off + slot.numel
        unit = dp_size * pad_multiple
        buffers = []
        for b in sorted(fill):
            unpadded = fill[b]
            padded = max(unit, -(-unpadded // unit) * unit)
            buffers.append(
                BufferLayout(
                    index=b,
                    param_dtype=param_dtype,
                    grad_dtype=grad_dtype,
                    numel_unpadded=unpadded,
                    numel_padded=padded,
                    shard_numel=padded // dp_size,
                )
            )
        return cls(
            params=tuple(slots),
            buffers=tuple(buffers),
            dp_size=dp_size,
            pad_multiple=pad_multiple,
        )

    def with_dp(self, *, dp_size: int, pad_multiple: int) -> FlatLayout:
        """The same parameters laid out for another DP size / padding (the transfer target)."""
        out = FlatLayout.build(
            [(p.name, p.shape) for p in self.params],
            dp_size=dp_size,
            pad_multiple=pad_multiple,
            param_dtype=self.buffers[0].param_dtype,
            grad_dtype=self.buffers[0].grad_dtype,
            buffer_of={p.name: p.buffer for p in self.params}.__getitem__,
        )
        return out

    def buffer(self, index: int) -> BufferLayout:
        for b in self.buffers:
            if b.index == index:
                return b
        raise KeyError(f"no buffer {index} in layout (have {[b.index for b in self.buffers]})")

    def slot(self, name: str) -> ParamSlot:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(f"no parameter {name!r} in layout")

    def shard_range(self, buffer: int, dp_rank: int) -> tuple[int, int]:
        if not 0 <= dp_rank < self.dp_size:
            raise ValueError(f"dp_rank={dp_rank} outside dp_size={self.dp_size}")
        n = self.buffer(buffer).shard_numel
        return dp_rank * n, (dp_rank + 1) * n

    def pieces(self, dp_rank: int) -> tuple[Piece, ...]:
        """Pieces of parameters owned by `dp_rank`, in parameter order."""
        out = []
        for p in self.params:
            lo, hi = self.shard_range(p.buffer, dp_rank)
            a, b = max(lo, p.offset), min(hi, p.offset + p.numel)
            if a < b:
                out.append(
                    Piece(
                        name=p.name,
                        buffer=p.buffer,
                        param_start=a - p.offset,
                        param_end=b - p.offset,
                        shard_start=a - lo,
                    )
                )
        return tuple(out)

    def check_same_params(self, other: FlatLayout) -> None:
        """Raise `LayoutError` unless both layouts hold the same parameters at the same unpadded
        offsets (padding and DP size may differ)."""
        mine = [(p.name, p.shape, p.buffer, p.offset) for p in self.params]
        theirs = [(p.name, p.shape, p.buffer, p.offset) for p in other.params]
        if mine != theirs:
            raise LayoutError(
                "source and target layouts hold different parameters",
                "DP-zero state is exchanged in unpadded world coordinates that must agree",
                "build both lanes from the same model config and parameter order",
            )
