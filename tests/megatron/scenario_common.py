"""Shared pieces of the Megatron worker scenarios (run inside spawned workers only)."""

from __future__ import annotations

from typing import Any

import torch

from ehp_fsm.training.adam import AdamConfig
from ehp_fsm.training.grpo import GroupBatch, synthetic_groups
from ehp_fsm.training.policy import PolicyConfig

GROUP_SIZE = 2
GROUPS_PER_STEP = 4  # B = 8 samples per optimizer step
ADAM = AdamConfig(lr=1e-3, weight_decay=0.01)


def step_batch(step: int) -> GroupBatch:
    """The fixed global batch of one step (identical in every process)."""
    ids = [step * GROUPS_PER_STEP + g for g in range(GROUPS_PER_STEP)]
    return synthetic_groups(ids, group_size=GROUP_SIZE, config=PolicyConfig(), seed=7)


def build(
    role: str,
    replica: str,
    rank: int,
    size: int,
    dtype: torch.dtype,
    *,
    dp_group: Any = None,
    **config: Any,
) -> Any:
    from ehp_fsm.backends.megatron.backend import MegatronBackend, MegatronModelConfig
    from ehp_fsm.training.lane import LaneSpec

    backend = MegatronBackend(MegatronModelConfig(**config))
    spec = LaneSpec(
        role=role,  # type: ignore[arg-type]
        replica=replica,
        dp_rank=rank,
        dp_size=size,
        param_dtype=dtype,
        adam=ADAM,
    )
    backend.build(spec, dp_group=dp_group)
    return backend


def core_only_step(
    backend: Any, step: int, rank: int, world: int, *, group: Any = None, epoch: int = 0
) -> None:
    """One Core-only step through the backend: equal whole-group shares, weighted all-reduce
    over `group` (the Core's DP group; None = the default world)."""
    batch = step_batch(step)
    per = len(batch.group_ids) // world
    mine = batch.select(batch.group_ids[rank * per : (rank + 1) * per])
    delivery = backend.compute(mine, step=step, epoch=epoch)
    reduced = backend.reduce(delivery, total_samples=batch.samples, group=group)
    backend.apply(reduced)


def equal_states(a: Any, b: Any) -> bool:
    """Bitwise equality of two `LaneState` captures (every field; steps independent tensors)."""
    if (a.version, a.layout, a.dp_rank, a.param_groups) != (
        b.version,
        b.layout,
        b.dp_rank,
        b.param_groups,
    ):
        return False
    for f in ("params", "master", "exp_avg", "exp_avg_sq", "steps"):
        x, y = getattr(a, f), getattr(b, f)
        if x.keys() != y.keys() or not all(torch.equal(x[k], y[k]) for k in x):
            return False
    return True


def share_state(source: Any, target: Any, state: Any, rank: int, world: int) -> Any:
    """The DP-zero `state` DP rank 0 gathered from `source`, handed point to point to every
    other rank's `target` lane; returns it on every rank."""
    if rank == 0:
        assert state is not None
        for dst in range(1, world):
            source.send_dp_zero(state, dst=dst)
        return state
    return target.recv_dp_zero(src=0)
