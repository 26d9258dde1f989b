"""DP-zero optimizer-state transfer between a Core DP layout and a DP1 Hybrid lane.

The format is Megatron-Core's DP-zero parameter state: per buffer index and per
(param dtype, grad dtype) key, flat fp32 "world" tensors `param` (master weights), `exp_avg`,
`exp_avg_sq` with padding removed, and `numel_unpadded`; plus `"buckets_coalesced": True`.
Because world tensors carry no padding, source and target may pad differently and have different
DP sizes. Adam's per-parameter step and the hyperparameters are carried beside the buffers
(Megatron keeps them in the optimizer's param_groups, not in the DP-zero dict). Each buffer here is
one bucket; Megatron concatenates the unpadded range of every bucket of a buffer, which for one
bucket is the same world tensor.

What it knows: converting shards ↔ world tensors (pure tensor functions), and moving them between
real processes with torch.distributed (gather to one DP rank, scatter from one, point-to-point
send/recv of world tensors). What it does not know: when a transfer should happen (the engine's
Hybrid machine decides) or how state is computed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ehp_fsm.training.lane import HYPER_KEYS, STATE_KEYS, TrainingLane, TrainingStateError
from ehp_fsm.training.layout import FlatLayout

DtypeKey = tuple[torch.dtype, torch.dtype]
WorldBuffers = dict[int, dict[DtypeKey, dict[str, Any]]]


@dataclass(frozen=True, kw_only=True)
class DpZeroState:
    """World (unpadded) optimizer state of one model: `buffers` in Megatron's DP-zero layout,
    `steps` = Adam's step per parameter name, `hyper` = (lr, betas, eps, weight_decay) per
    param group, `version` = optimizer steps taken."""

    buffers: WorldBuffers
    steps: Mapping[str, float]
    hyper: tuple[dict[str, Any], ...]
    version: int

    def megatron_dict(self) -> dict[Any, Any]:
        """The dict Megatron-Core's `load_parameter_state_from_dp_zero` reads."""
        out: dict[Any, Any] = {"buckets_coalesced": True}
        out.update(self.buffers)
        return out


# -- pure conversions ---------------------------------------------------------------------------


def shards_to_world(
    shards: Sequence[Mapping[int, Mapping[str, torch.Tensor]]], layout: FlatLayout
) -> WorldBuffers:
    """Concatenate the DP ranks' padded shards (rank order) and strip the padding."""
    if len(shards) != layout.dp_size:
        raise TrainingStateError(
            f"{len(shards)} shards for dp_size={layout.dp_size}",
            "a world tensor is the concatenation of every DP rank's shard",
            "gather from every rank of the DP group",
        )
    out: WorldBuffers = {}
    for b in layout.buffers:
        entry: dict[str, Any] = {
            key: torch.cat([s[b.index][key] for s in shards])[: b.numel_unpadded]
            for key in STATE_KEYS
        }
        entry["numel_unpadded"] = b.numel_unpadded
        out[b.index] = {b.dtype_key: entry}
    return out


def world_to_shard(
    world: WorldBuffers, layout: FlatLayout, dp_rank: int
) -> dict[int, dict[str, torch.Tensor]]:
    """The padded shard of `dp_rank` in `layout`, cut from world tensors (padding is zero)."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for b in layout.buffers:
        entry = _entry(world, b.index, b.dtype_key)
        if entry["numel_unpadded"] != b.numel_unpadded:
            raise TrainingStateError(
                f"buffer {b.index} holds {entry['numel_unpadded']} unpadded elements, "
                f"the target layout {b.numel_unpadded}",
                "source and target must describe the same parameters",
                "build both lanes from the same model config",
            )
        lo, hi = layout.shard_range(b.index, dp_rank)
        out[b.index] = {}
        for key in STATE_KEYS:
            shard = torch.zeros(hi - lo, dtype=torch.float32)
            t = entry[key]
            a, z = min(lo, b.numel_unpadded), min(hi, b.numel_unpadded)
            shard[: z - a].copy_(t[a:z])
            out[b.index][key] = shard
    return out


def world_to_shards(
    world: WorldBuffers, layout: FlatLayout
) -> list[dict[int, dict[str, torch.Tensor]]]:
    """Every DP rank's padded shard, as views into one zero-padded copy per world tensor."""
    out: list[dict[int, dict[str, torch.Tensor]]] = [{} for _ in range(layout.dp_size)]
    for b in layout.buffers:
        entry = _entry(world, b.index, b.dtype_key)
        _check_numel(entry, b.index, b.numel_unpadded)
        for key in STATE_KEYS:
            padded = torch.empty(b.numel_padded, dtype=torch.float32)
            padded[: b.numel_unpadded].copy_(entry[key])
            padded[b.numel_unpadded :].zero_()
            for r, part in enumerate(padded.chunk(layout.dp_size)):
                out[r].setdefault(b.index, {})[key] = part
    return out


def _check_numel(entry: Mapping[str, Any], index: int, numel: int) -> None:
    if entry["numel_unpadded"] != numel:
        raise TrainingStateError(
            f"buffer {index} holds {entry['numel_unpadded']} unpadded elements, "
            f"the target layout {numel}",
            "source and target must describe the same parameters",
            "build both lanes from the same model config",
        )


def _entry(world: WorldBuffers, index: int, key: DtypeKey) -> dict[str, Any]:
    try:
        return world[index][key]
    except KeyError:
        raise TrainingStateError(
            f"world state has no buffer {index} with dtypes {key}",
            f"it has {[(i, list(d)) for i, d in world.items()]}",
            "transfer between lanes whose models use the same parameter dtype",
        ) from None


def _source_refusal(state: DpZeroState | None, lane: TrainingLane) -> TrainingStateError | None:
    """Why the source cannot scatter `state` into `lane`'s layout; None when it can."""
    if state is None:
        return TrainingStateError(
            "no state to scatter on the source rank",
            "src holds the world",
            "pass the DpZeroState on group rank `src`",
        )
    try:
        for b in lane.layout.buffers:
            _check_numel(_entry(state.buffers, b.index, b.dtype_key), b.index, b.numel_unpadded)
    except TrainingStateError as exc:
        return exc
    missing = sorted(set(lane.param_names) - set(state.steps))
    if missing or len(state.hyper) != len(lane.optimizer.param_groups):
        return TrainingStateError(
            "the state does not name this lane's parameters and parameter groups",
            f"missing steps for {missing[:3]}, {len(state.hyper)} hyperparameter groups for "
            f"{len(lane.optimizer.param_groups)}",
            "build both lanes from the same model config",
        )
    return None


def _hyper_of(lane: TrainingLane) -> tuple[dict[str, Any], ...]:
    return tuple({k: g[k] for k in HYPER_KEYS} for g in lane.optimizer.param_groups)


def _hyper_tensor(hyper: Sequence[Mapping[str, Any]]) -> torch.Tensor:
    rows = [[h["lr"], h["betas"][0], h["betas"][1], h["eps"], h["weight_decay"]] for h in hyper]
    return torch.tensor(rows, dtype=torch.float64)


def _hyper_from(t: torch.Tensor) -> tuple[dict[str, Any], ...]:
    return tuple(
        {"lr": r[0], "betas": (r[1], r[2]), "eps": r[3], "weight_decay": r[4]} for r in t.tolist()
    )


def _steps_tensor(lane: TrainingLane) -> torch.Tensor:
    have = lane.piece_steps()
    return torch.tensor([have.get(n, math.nan) for n in lane.param_names], dtype=torch.float64)


def _steps_from(rows: Sequence[torch.Tensor], names: Sequence[str]) -> dict[str, float]:
    steps: dict[str, float] = {}
    for row in rows:
        for n, v in zip(names, row.tolist(), strict=True):
            if math.isnan(v):
                continue
            if n in steps and steps[n] != v:
                raise TrainingStateError(
                    f"DP ranks disagree on Adam's step for {n!r}: {steps[n]} vs {v}",
                    "every piece of a parameter is stepped together",
                    "do not gather while an optimizer step is in progress",
                )
            steps[n] = v
    return steps


def local_dp_zero(lane: TrainingLane) -> DpZeroState:
    """World state of a DP1 lane (no communication)."""
    if lane.layout.dp_size != 1:
        raise TrainingStateError(
            f"local_dp_zero on a lane with dp_size={lane.layout.dp_size}",
            "a sharded lane holds only part of the world state",
            "use gather_dp_zero",
        )
    world = shards_to_world([lane.shard_tensors()], lane.layout)
    steps = _steps_from([_steps_tensor(lane)], lane.param_names)
    return DpZeroState(buffers=world, steps=steps, hyper=_hyper_of(lane), version=lane.version)


# -- over torch.distributed -----------------------------------------------------------------------


def _global(group: dist.ProcessGroup | None, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _tag(buffer: int, key: int) -> int:
    return buffer * len(STATE_KEYS) + key


def _isend(t: torch.Tensor, *, dst: int, group: dist.ProcessGroup | None, tag: int) -> dist.Work:
    work = dist.isend(t, dst=dst, group=group, tag=tag)
    assert work is not None
    return work


def _irecv(t: torch.Tensor, *, src: int, group: dist.ProcessGroup | None, tag: int) -> dist.Work:
    work = dist.irecv(t, src=src, group=group, tag=tag)
    assert work is not None
    return work


def gather_dp_zero(
    lane: TrainingLane, *, group: dist.ProcessGroup | None, dst: int = 0
) -> DpZeroState | None:
    """Gather every DP rank's shards onto group rank `dst` and strip padding (Megatron's
    `get_parameter_state_dp_zero`). Every rank of `group` calls it; returns the state on `dst`,
    None elsewhere."""
    if lane.layout.dp_size == 1:
        return local_dp_zero(lane)
    me = dist.get_rank(group)
    gdst = _global(group, dst)
    n = lane.layout.dp_size
    mine = lane.shard_tensors(copy=False)  # sent as they are; nothing writes them meanwhile
    world: WorldBuffers = {}
    # Point to point straight into the world tensors: Gloo's `gather` would stage every message
    # in a flat temporary and copy it out again.
    works: list[dist.Work] = []
    for b in lane.layout.buffers:
        entry: dict[str, Any] = {"numel_unpadded": b.numel_unpadded}
        for k, key in enumerate(STATE_KEYS):
            tag = _tag(b.index, k)
            if me != dst:
                works.append(_isend(mine[b.index][key], dst=gdst, group=group, tag=tag))
                continue
            padded = torch.empty(b.numel_padded, dtype=torch.float32)
            for r, part in enumerate(padded.chunk(n)):
                if r == me:
                    part.copy_(mine[b.index][key])
                else:
                    works.append(_irecv(part, src=_global(group, r), group=group, tag=tag))
            entry[key] = padded[: b.numel_unpadded]
        world[b.index] = {b.dtype_key: entry}
    for w in works:
        w.wait()
    st = _steps_tensor(lane)
    rows = [torch.empty_like(st) for _ in range(n)] if me == dst else None
    dist.gather(st, rows, dst=gdst, group=group)
    if me != dst or rows is None:
        return None
    return DpZeroState(
        buffers=world,
        steps=_steps_from(rows, lane.param_names),
        hyper=_hyper_of(lane),
        version=lane.version,
    )


def scatter_dp_zero(
    state: DpZeroState | None,
    lane: TrainingLane,
    *,
    group: dist.ProcessGroup | None,
    src: int = 0,
) -> None:
    """Cut world state into this lane layout's padded shards on group rank `src` and scatter
    them (Megatron's `load_parameter_state_from_dp_zero`); every rank installs its shard, its
    pieces' steps and the hyperparameters. `state` is needed on `src` only."""
    if lane.layout.dp_size == 1:
        if state is None:
            raise TrainingStateError(
                "no state to scatter", "a DP1 lane scatters locally", "pass the DpZeroState"
            )
        lane.load_shards(
            world_to_shard(state.buffers, lane.layout, 0),
            steps=state.steps,
            hyper=state.hyper,
            version=state.version,
        )
        return
    me = dist.get_rank(group)
    gsrc = _global(group, src)
    # The source checks the state and broadcasts its verdict before any transfer: a source
    # that raised alone would leave its peers waiting in `irecv` until the collective timeout.
    refusal = _source_refusal(state, lane) if me == src else None
    verdict = torch.tensor([0.0 if refusal is None else 1.0], dtype=torch.float64)
    dist.broadcast(verdict, src=gsrc, group=group)
    if refusal is not None:
        raise refusal
    if verdict.item() != 0.0:
        raise TrainingStateError(
            "the source rank refused the state; nothing was installed",
            "it does not fit this lane's layout (the source rank's error says how)",
            "fix what the source rank's error names, then scatter again",
        )
    # Each rank's range of every world tensor goes point to point straight into that rank's live
    # flat shard (no padded copy of the world, no staging in Gloo's `scatter`); the shard's
    # padding is zeroed locally. A failed transfer leaves the lane unusable (the Hybrid machine
    # then fails it), never silently half-loaded and training.
    live = lane.live_shards()
    works: list[dist.Work] = []
    for b in lane.layout.buffers:
        entry = _entry(state.buffers, b.index, b.dtype_key) if state is not None else None
        for k, key in enumerate(STATE_KEYS):
            tag = _tag(b.index, k)
            for r in range(lane.layout.dp_size):
                if me not in (r, src):
                    continue
                lo, hi = lane.layout.shard_range(b.index, r)
                a, z = min(lo, b.numel_unpadded), min(hi, b.numel_unpadded)
                if me == r:
                    live[b.index][key][z - a :].zero_()
                if z == a:
                    continue
                if me == src and entry is not None:
                    part = entry[key][a:z].contiguous()
                    if r == me:
                        live[b.index][key][: z - a].copy_(part)
                    else:
                        works.append(_isend(part, dst=_global(group, r), group=group, tag=tag))
                elif me == r:
                    dest = live[b.index][key][: z - a]
                    works.append(_irecv(dest, src=gsrc, group=group, tag=tag))
    for w in works:
        w.wait()
    names = lane.param_names
    meta = torch.empty(len(names) + 1, dtype=torch.float64)
    hyper = torch.empty(len(lane.optimizer.param_groups), 5, dtype=torch.float64)
    if me == src and state is not None:
        meta = torch.tensor([state.steps[x] for x in names] + [state.version], dtype=torch.float64)
        hyper = _hyper_tensor(state.hyper)
    dist.broadcast(meta, src=gsrc, group=group)
    dist.broadcast(hyper, src=gsrc, group=group)
    values = meta.tolist()
    lane.install_loaded(
        steps=dict(zip(names, values[:-1], strict=True)),
        hyper=_hyper_from(hyper),
        version=int(values[-1]),
    )


def send_dp_zero(state: DpZeroState, *, dst: int, names: Sequence[str]) -> None:
    """Send world state to global rank `dst` (point to point, tensors only: no pickle)."""
    for index in sorted(state.buffers):
        for key in sorted(state.buffers[index], key=str):
            for k in STATE_KEYS:
                dist.send(state.buffers[index][key][k].contiguous(), dst=dst)
    meta = torch.tensor([state.steps[x] for x in names] + [state.version], dtype=torch.float64)
    dist.send(meta, dst=dst)
    dist.send(_hyper_tensor(state.hyper), dst=dst)


def recv_dp_zero(layout: FlatLayout, *, src: int, groups: int = 1) -> DpZeroState:
    """Receive world state sent by `send_dp_zero` from global rank `src` for `layout`'s model."""
    world: WorldBuffers = {}
    for b in layout.buffers:
        entry: dict[str, Any] = {}
        for k in STATE_KEYS:
            t = torch.empty(b.numel_unpadded, dtype=torch.float32)
            dist.recv(t, src=src)
            entry[k] = t
        entry["numel_unpadded"] = b.numel_unpadded
        world[b.index] = {b.dtype_key: entry}
    names = [p.name for p in layout.params]
    meta = torch.empty(len(names) + 1, dtype=torch.float64)
    dist.recv(meta, src=src)
    hyper = torch.empty(groups, 5, dtype=torch.float64)
    dist.recv(hyper, src=src)
    values = meta.tolist()
    return DpZeroState(
        buffers=world,
        steps=dict(zip(names, values[:-1], strict=True)),
        hyper=_hyper_from(hyper),
        version=int(values[-1]),
    )
