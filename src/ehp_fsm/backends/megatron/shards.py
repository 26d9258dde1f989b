"""Copies between a `DistributedOptimizer`'s shards and Megatron's DP-zero world tensors.

The format is Megatron-Core's own (`get_parameter_state_dp_zero` /
`load_parameter_state_from_dp_zero`, "buckets_coalesced"): for every grad buffer, one flat FP32
world tensor per key (`param`, `exp_avg`, `exp_avg_sq`) holding each bucket's DP shards in rank
order, with the padding at the end of each bucket removed. Gaps between parameters inside a
bucket are zero. The tests check both directions bit for bit against Megatron's functions.

Why not call Megatron's: it copies each parameter shard to fresh pageable host memory one at a
time, then into a zeroed shard, then into a zeroed world tensor. On an H200 that moved a 4.92 GiB
state at 0.40-0.59 GB/s against 55 GB/s for one pinned device-to-host copy
(`benchmarks/REPORT-gpu-2026-12-04.md`). Here each bucket's shard is assembled on the device in
chunks of at most `CHUNK_NUMEL` elements (so the extra device memory is bounded) and crosses to
the host through one pinned chunk, then into its place; at DP 1 the world tensor *is* the shard
and no Gloo collective runs. On the CPU the chunk is the destination itself. Restoring runs the
same way backwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from ehp_fsm.backends.megatron.errors import MegatronBackendError, OptimizerStateMismatch
from ehp_fsm.training.lane import STATE_KEYS

CHUNK_NUMEL = 1 << 26  # 256 MiB of FP32 on the device per chunk

# (start, end) in the bucket's local shard, and the parameter whose tensors fill it
Span = tuple[int, int, torch.nn.Parameter]


class _Bucket:
    """One bucket of one grad buffer: its DP shard size, unpadded world size and parameters."""

    def __init__(self, dist_opt: DistributedOptimizer, index: int, bucket: int, ranges: Any):
        dp = dist_opt.data_parallel_group_gloo.size()
        world = int(dist_opt.buffers[index].buckets[bucket].grad_data.numel())
        if world % dp:
            raise MegatronBackendError(
                f"bucket {bucket} of buffer {index} has {world} elements, not a multiple of "
                f"DP {dp}",
                "Megatron pads every bucket to a multiple of the DP size",
                "build the lane through MegatronBackend (its DDP config pads buckets)",
            )
        self.local = world // dp
        self.unpadded = int(dist_opt.buffers[index].buckets[bucket].numel_unpadded)
        self.spans: list[Span] = sorted(
            (
                (r["gbuf_local"].start, r["gbuf_local"].end, p)
                for p, r in ranges["param_map"].items()
            ),
            key=lambda s: s[0],
        )


def _layout(dist_opt: DistributedOptimizer) -> Iterator[tuple[int, Any, list[_Bucket]]]:
    """(buffer index, dtype key, its buckets in order) for every grad buffer."""
    for index, per_dtype in enumerate(dist_opt.gbuf_ranges):
        for key, buckets in per_dtype.items():
            yield index, key, [_Bucket(dist_opt, index, b, r) for b, r in enumerate(buckets)]


def _tensors(dist_opt: DistributedOptimizer, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
    """The FP32 master shard and Adam moments of `param` on this rank (1-D, on its device)."""
    tensors: dict[str, torch.Tensor] = dist_opt._get_main_param_and_optimizer_states(param)
    missing = [k for k in STATE_KEYS if k not in tensors]
    if missing:
        raise OptimizerStateMismatch(
            f"a parameter shard has no {missing}",
            "the Adam state was not allocated before the transfer",
            "call ensure_adam_state first (dp_zero_gather / dp_zero_scatter do)",
        )
    return tensors


# a piece of a chunk: (offset in the chunk, offset in the parameter's shard, count, parameter)
Piece = tuple[int, int, int, torch.nn.Parameter]


def _chunks(spans: list[Span], length: int) -> Iterator[tuple[int, int, list[Piece]]]:
    """Cover [0, length) with consecutive chunks of at most CHUNK_NUMEL elements: (start, end,
    the parameter pieces inside)."""
    first = 0
    for pos in range(0, length, CHUNK_NUMEL):
        end = min(pos + CHUNK_NUMEL, length)
        while first < len(spans) and spans[first][1] <= pos:
            first += 1
        pieces: list[Piece] = []
        for s, e, param in spans[first:]:
            if s >= end:
                break
            lo, hi = max(s, pos), min(e, end)
            pieces.append((lo - pos, lo - s, hi - lo, param))
        yield pos, end, pieces


def _piece(dist_opt: DistributedOptimizer, param: torch.nn.Parameter, key: str) -> torch.Tensor:
    return _tensors(dist_opt, param)[key].detach().view(-1)


class _Staging:
    """The two chunk buffers of one transfer on a GPU lane, made at first use: one on the device
    where a chunk is assembled (or taken apart) and one in pinned host memory it crosses
    through. Crossing straight into fresh pageable memory ran at 1.4 GB/s on an H200 (the page
    faults are taken in one thread); through pinned memory the host side is a plain copy in
    torch's threads (15 GB/s into fresh memory, same machine)."""

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self._device: torch.Tensor | None = None
        self._pinned: torch.Tensor | None = None

    def get(self, device: torch.device, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._device is None or self._pinned is None or self._device.device != device:
            self._device = torch.empty(self.numel, dtype=torch.float32, device=device)
            self._pinned = torch.empty(self.numel, dtype=torch.float32, pin_memory=True)
        return self._device[:numel], self._pinned[:numel]


def _staging(buckets: list[_Bucket]) -> _Staging:
    return _Staging(min(CHUNK_NUMEL, max((b.local for b in buckets), default=0)))


def _read_shard(
    dist_opt: DistributedOptimizer,
    bucket: _Bucket,
    key: str,
    out: torch.Tensor,
    staging: _Staging,
) -> None:
    """Write the first `out.numel()` elements of this rank's shard of `bucket` for `key` into the
    host tensor `out` (zeros where no parameter lies)."""
    for pos, end, pieces in _chunks(bucket.spans, out.numel()):
        dest = out[pos:end]
        if not pieces:
            dest.zero_()
            continue
        device = _piece(dist_opt, pieces[0][3], key).device
        stage, pinned = (dest, dest) if device.type == "cpu" else staging.get(device, end - pos)
        stage.zero_()
        for at, src, count, param in pieces:
            stage[at : at + count].copy_(_piece(dist_opt, param, key)[src : src + count])
        if stage is not dest:
            pinned.copy_(stage)
            dest.copy_(pinned)


def _write_shard(
    dist_opt: DistributedOptimizer,
    bucket: _Bucket,
    key: str,
    shard: torch.Tensor,
    staging: _Staging,
) -> None:
    """Copy the host tensor `shard` (this rank's shard of `bucket`, possibly cut at the unpadded
    end) into the parameters' `key` tensors, one host-to-device copy per chunk."""
    for pos, end, pieces in _chunks(bucket.spans, shard.numel()):
        if not pieces:
            continue
        device = _piece(dist_opt, pieces[0][3], key).device
        stage = shard[pos:end]
        if device.type != "cpu":
            stage, pinned = staging.get(device, end - pos)
            pinned.copy_(shard[pos:end])
            stage.copy_(pinned)
        for at, dst, count, param in pieces:
            _piece(dist_opt, param, key)[dst : dst + count].copy_(stage[at : at + count])


def _host(numel: int) -> torch.Tensor:
    """Uninitialised FP32 host memory: every element is written before it is read."""
    return torch.empty(numel, dtype=torch.float32)


def _split(flat: torch.Tensor, size: int) -> list[torch.Tensor]:
    return [flat[i : i + size] for i in range(0, flat.numel(), size)]


def gather_world(dist_opt: DistributedOptimizer) -> dict[int, dict[Any, dict[str, Any]]] | None:
    """What `get_parameter_state_dp_zero(use_gloo_comm=True)` returns, without its
    "buckets_coalesced" flag: the world tensors on DP rank 0, None on other ranks. Collective
    over the DP group's Gloo twin (no collective at DP 1)."""
    group = dist_opt.data_parallel_group_gloo
    dp, rank = group.size(), group.rank()
    dst = torch.distributed.get_process_group_ranks(group)[0]
    out: dict[int, dict[Any, dict[str, Any]]] = {}
    for index, dtype_key, buckets in _layout(dist_opt):
        total = int(dist_opt.buffers[index].numel_unpadded)
        if sum(b.unpadded for b in buckets) != total:
            raise MegatronBackendError(
                f"buffer {index}'s buckets hold {sum(b.unpadded for b in buckets)} unpadded "
                f"elements, the buffer {total}",
                "the DP-zero format concatenates the buckets' unpadded elements",
                "report this layout: it is not one this backend was tested with",
            )
        entry: dict[str, Any] = {"numel_unpadded": total}
        staging = _staging(buckets)
        for key in STATE_KEYS:
            world = _host(total) if rank == 0 else None
            offset = 0
            for bucket in buckets:
                if dp == 1:
                    assert world is not None
                    _read_shard(
                        dist_opt, bucket, key, world[offset : offset + bucket.unpadded], staging
                    )
                else:
                    local = _host(bucket.local)
                    _read_shard(dist_opt, bucket, key, local, staging)
                    full = _host(bucket.local * dp if world is not None else 0)
                    recv = _split(full, bucket.local) if world is not None else None
                    torch.distributed.gather(local, recv, dst, group)
                    if world is not None:
                        world[offset : offset + bucket.unpadded].copy_(full[: bucket.unpadded])
                offset += bucket.unpadded
            entry[key] = world
        out.setdefault(index, {})[dtype_key] = entry
    return out if rank == 0 else None


def scatter_world(
    dist_opt: DistributedOptimizer, buffers: dict[int, dict[Any, dict[str, Any]]] | None
) -> None:
    """What `load_parameter_state_from_dp_zero` does with `buffers` (given on DP rank 0, checked
    there by the caller): every rank's master shards and Adam moments are overwritten with its
    part of the world tensors. Collective over the Gloo DP group (none at DP 1)."""
    group = dist_opt.data_parallel_group_gloo
    dp, rank = group.size(), group.rank()
    src = torch.distributed.get_process_group_ranks(group)[0]
    for index, dtype_key, buckets in _layout(dist_opt):
        entry = buffers[index][dtype_key] if buffers is not None else None
        staging = _staging(buckets)
        for key in STATE_KEYS:
            world = entry[key] if entry is not None else None
            offset = 0
            for bucket in buckets:
                if dp == 1:
                    assert world is not None
                    shard = world[offset : offset + bucket.unpadded]
                else:
                    shard = _host(bucket.local)
                    sends = None
                    if rank == 0:
                        assert world is not None
                        padded = torch.zeros(bucket.local * dp, dtype=torch.float32)
                        padded[: bucket.unpadded].copy_(world[offset : offset + bucket.unpadded])
                        sends = _split(padded, bucket.local)
                    torch.distributed.scatter(shard, sends, src, group)
                _write_shard(dist_opt, bucket, key, shard, staging)
                offset += bucket.unpadded
