"""Megatron-Core lane state in the `TrainingBackend` Protocol's own types (`LaneState`).

What this module knows: how a `DistributedOptimizer` lays out one DP rank's state, expressed as
an `ehp_fsm.training.layout.FlatLayout` — one layout buffer per Megatron *bucket* (buckets are
what Megatron shards: every bucket is padded to a multiple of the DP size and each DP rank owns
one contiguous, equal range of it), each parameter at its offset inside its bucket (Megatron
aligns parameter starts, so the gaps between parameters are part of the bucket and stay zero
in a capture). From that layout it captures a rank's exact state as a `LaneState` (model
parameters, FP32 master shards, Adam moments and an independent step per owned parameter,
hyperparameters, version) and restores one.

What it does not know: transfers across layouts (`state.dp_zero_gather` / `dp_zero_scatter` do
that in Megatron's DP-zero format), processes, when to capture.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import MegatronOptimizer

from ehp_fsm.backends.megatron import state as st
from ehp_fsm.backends.megatron.errors import MegatronBackendError, OptimizerStateMismatch
from ehp_fsm.training.lane import HYPER_KEYS, LaneState
from ehp_fsm.training.layout import BufferLayout, FlatLayout, ParamSlot, Piece


def _buckets(dist_opt: DistributedOptimizer) -> Iterator[tuple[int, Any, Any]]:
    """(layout buffer index, Megatron buffer, bucket) for every bucket, in buffer order."""
    index = 0
    for buffer in dist_opt.buffers:
        for bucket in buffer.buckets:
            yield index, buffer, bucket
            index += 1


def megatron_layout(model: torch.nn.Module, optimizer: MegatronOptimizer) -> FlatLayout:
    """This rank's Megatron layout as a `FlatLayout` (validated against the optimizer's own
    per-rank parameter ranges; raises `MegatronBackendError` if they disagree)."""
    dist_opt = st.distributed_optimizer(optimizer)
    dp = dist_opt.data_parallel_group.size()
    names = st.parameter_names(model)
    bucket_of: dict[tuple[int, int], int] = {}
    buffers: list[BufferLayout] = []
    placed: dict[int, int] = {}  # grad buffer → unpadded elements of its buckets so far
    for index, buffer, bucket in _buckets(dist_opt):
        gbuf = dist_opt.buffers.index(buffer)
        bucket_of[(gbuf, bucket.bucket_id)] = index
        padded = bucket.grad_data.numel()
        buffers.append(
            BufferLayout(
                index=index,
                param_dtype=buffer.param_dtype,
                grad_dtype=buffer.grad_dtype,
                numel_unpadded=bucket.numel_unpadded,
                numel_padded=padded,
                shard_numel=padded // dp,
                # Megatron's DP-zero world tensor of a grad buffer: its buckets back to back,
                # unpadded (`get_parameter_state_dp_zero`)
                world_buffer=gbuf,
                world_offset=placed.get(gbuf, 0),
            )
        )
        placed[gbuf] = placed.get(gbuf, 0) + bucket.numel_unpadded
    where = {
        param: (gbuf, start, bucket_id)
        for gbuf, buffer in enumerate(dist_opt.buffers)
        for param, (start, _, bucket_id) in buffer.param_index_map.items()
    }
    slots = []
    for param, name in names.items():
        if param not in where:
            raise MegatronBackendError(
                f"parameter {name} is in none of the optimizer's grad buffers",
                "every trainable parameter of a dense Megatron model lives in one bucket",
                "build the optimizer over this model's DDP wrapper",
            )
        gbuf, start, bucket_id = where[param]
        start -= dist_opt.buffers[gbuf].buckets[bucket_id].offset
        slots.append(
            ParamSlot(
                name=name,
                shape=tuple(param.shape),
                buffer=bucket_of[(gbuf, bucket_id)],
                offset=start,
            )
        )
    # Megatron chooses the padding (lcm of DP and 128, or 2^16 with
    # pad_buckets_for_high_nccl_busbw); numel_padded records its result, so the unit is 1 here.
    layout = FlatLayout(params=tuple(slots), buffers=tuple(buffers), dp_size=dp, pad_multiple=1)
    _check_pieces(layout, dist_opt, names)
    return layout


def _owned_pieces(
    layout: FlatLayout, dist_opt: DistributedOptimizer, names: dict[torch.nn.Parameter, str]
) -> Iterator[tuple[Piece, torch.nn.Parameter, torch.Tensor]]:
    """(piece, model parameter, main-parameter shard) for every parameter this rank owns."""
    rank = dist_opt.data_parallel_group.rank()
    pieces = {p.name: p for p in layout.pieces(rank)}
    for model_param, main in st._owned(dist_opt):
        yield pieces[names[model_param]], model_param, main


def _check_pieces(
    layout: FlatLayout, dist_opt: DistributedOptimizer, names: dict[torch.nn.Parameter, str]
) -> None:
    rank = dist_opt.data_parallel_group.rank()
    expected = {p.name for p in layout.pieces(rank)}
    owned = {names[p] for p, _ in st._owned(dist_opt)}
    bad = sorted(expected ^ owned)
    for piece, model_param, main in _owned_pieces(layout, dist_opt, names):
        ranges = dist_opt._get_model_param_range_map(model_param)
        param, in_bucket = ranges["param"], ranges["gbuf_world_in_bucket"]
        shard_start = in_bucket.start - rank * layout.buffer(piece.buffer).shard_numel
        if (piece.param_start, piece.param_end, piece.shard_start) != (
            param.start,
            param.end,
            shard_start,
        ) or main.numel() != piece.numel:
            bad.append(piece.name)
    if bad:
        raise MegatronBackendError(
            f"the layout derived from Megatron's buckets disagrees with the optimizer's shards "
            f"for {bad[:3]}",
            "capture/restore address each owned piece through the layout",
            "report this with the megatron-core version; the bucket layout may have changed",
        )


def capture_lane_state(
    model: torch.nn.Module, optimizer: MegatronOptimizer, layout: FlatLayout, *, version: int
) -> LaneState:
    """An owned copy of this rank's exact state (local, not collective)."""
    dist_opt = st.distributed_optimizer(optimizer)
    names = st.parameter_names(model)
    flat = {
        key: {b.index: torch.zeros(b.shard_numel, dtype=torch.float32) for b in layout.buffers}
        for key in ("master", "exp_avg", "exp_avg_sq")
    }
    steps: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for piece, _, main in _owned_pieces(layout, dist_opt, names):
            state = dist_opt.optimizer.state[main]
            window = slice(piece.shard_start, piece.shard_start + piece.numel)
            flat["master"][piece.buffer][window].copy_(main.view(-1))
            if state:
                flat["exp_avg"][piece.buffer][window].copy_(state["exp_avg"].view(-1))
                flat["exp_avg_sq"][piece.buffer][window].copy_(state["exp_avg_sq"].view(-1))
                steps[piece.name] = state["step"].detach().clone()
            else:  # no step taken yet: zero moments, step 0 (what torch Adam initialises)
                steps[piece.name] = torch.tensor(0.0, dtype=torch.float32)
    return LaneState(
        version=version,
        layout=layout,
        dp_rank=dist_opt.data_parallel_group.rank(),
        params={n: p.detach().clone() for n, p in st.unwrap(model).named_parameters()},
        master=flat["master"],
        exp_avg=flat["exp_avg"],
        exp_avg_sq=flat["exp_avg_sq"],
        steps=steps,
        param_groups=st.hyperparameters(dist_opt),
    )


def restore_lane_state(
    model: torch.nn.Module, optimizer: MegatronOptimizer, layout: FlatLayout, state: LaneState
) -> None:
    """Install a state captured on this rank's layout exactly: model parameters, FP32 master
    shards, Adam moments, an independent step tensor per owned parameter, hyperparameters."""
    dist_opt = st.distributed_optimizer(optimizer)
    rank = dist_opt.data_parallel_group.rank()
    if state.layout != layout or state.dp_rank != rank:
        raise OptimizerStateMismatch(
            f"the state was captured on DP rank {state.dp_rank} of another layout "
            f"(this lane: DP rank {rank})",
            "capture/restore copies shards as they are; buckets, padding and DP size must match",
            "transfer across layouts with gather_dp_zero / scatter_dp_zero",
        )
    names = st.parameter_names(model)
    st.ensure_adam_state(dist_opt)
    with torch.no_grad():
        for piece, _, main in _owned_pieces(layout, dist_opt, names):
            opt_state = dist_opt.optimizer.state[main]
            window = slice(piece.shard_start, piece.shard_start + piece.numel)
            main.view(-1).copy_(state.master[piece.buffer][window])
            opt_state["exp_avg"].view(-1).copy_(state.exp_avg[piece.buffer][window])
            opt_state["exp_avg_sq"].view(-1).copy_(state.exp_avg_sq[piece.buffer][window])
            # Where ensure_adam_state put it (on the device for a fused group), same bits.
            step = state.steps[piece.name].detach().clone()
            opt_state["step"] = step.to(opt_state["step"].device)
        for n, p in st.unwrap(model).named_parameters():
            p.copy_(state.params[n])
        for group, hyper in zip(dist_opt.optimizer.param_groups, state.param_groups, strict=True):
            for key in HYPER_KEYS:
                group[key] = hyper[key]
