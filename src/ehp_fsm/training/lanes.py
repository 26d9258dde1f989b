"""Which backend a trainer worker's lane is built on: the seam between the pool and a backend.

`build_lane` builds the one lane of a trainer process — a Core DP rank or a warm DP1 Hybrid
lane — on the backend the pool's config names: `torch` (`TorchBackend`, the HF model trained by
plain torch) or `megatron` (`MegatronBackend` over the GPTModel mbridge builds from the same HF
directory: Megatron DDP and the DistributedOptimizer, sharded over the Core's DP group; a warm
lane over a group of its own). Both serve the worker through `PoolLane`: the `TrainingBackend`
operations plus what the worker's commands need beyond them (DP-zero point to point, the
revision's HF tensors, the state dir's parameters and layout).

A Megatron lane on a CPU plan runs through Megatron's CPU compatibility layer
(`ehp_fsm.backends.megatron.cpu`), applied here before Megatron builds anything and only when
the pool's device is `cpu`. Megatron's parallel state spans the pool's world with the plan's
TP and PP (CP = 1; `ehp-fsm check` refuses more): the world holds `tp × pp` processes per pool
rank (`PoolConfig.lane_size`), Gloo rank `member index × lane_size + lane rank` with lane rank
`PP stage × tp + TP rank` (Megatron's rank order `tp-pp-dp`), so Megatron's TP and PP groups
are exactly each lane's own processes, and a lane's DP group is one per lane rank
(`lane_ranks`: the Gloo ranks of one lane rank of a set of lanes). Its optimizer factory
all-gathers over the whole world, so every rank builds its lane at start-up, together — and
again, restoring its state, when the pool re-forms its world without a dead member
(`move_lane`). What it does not know: commands,
sockets, the pool's groups beyond the Core's (handed in), when a lane trains.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from ehp_fsm.training.backend import TorchBackend, TrainingBackend
from ehp_fsm.training.dpzero import DpZeroState
from ehp_fsm.training.lane import LaneSpec
from ehp_fsm.training.layout import FlatLayout

if TYPE_CHECKING:
    from ehp_fsm.training.pool_protocol import PoolConfig

#: A warm lane starts from other weights than the Core's (a load that did nothing shows).
WARM_SEED_OFFSET = 7919
#: Whole groups per Megatron micro-batch: a lane's whole share in one (FP32 parameters make the
#: split exact to rounding for any micro-batching; see `MegatronModelConfig.micro_batch_groups`).
MEGATRON_MICRO_BATCH_GROUPS = 1 << 16


class PoolLane(TrainingBackend, Protocol):
    """A built lane as the trainer worker drives it."""

    @property
    def layout(self) -> FlatLayout:
        """This rank's flat layout (what a state dir's master/moment slices address)."""
        ...

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]: ...

    def drop_reference(self) -> None:
        """Let go of the KL reference (a parked lane that stays built)."""
        ...

    def restore_reference(self) -> None:
        """Build the KL reference again after `drop_reference` (nothing to do if it is there)."""
        ...

    def revision_state_dict(self) -> dict[str, torch.Tensor]:
        """The current weights as a Hugging Face state dict (owned copies): a revision."""
        ...

    def local_state(self) -> DpZeroState:
        """A DP1 lane's whole state in the DP-zero format (no peer involved)."""
        ...

    def send_dp_zero(self, state: DpZeroState, *, dst: int) -> None: ...

    def recv_dp_zero(self, *, src: int) -> DpZeroState: ...

    def rebind_dp_group(self, group: dist.ProcessGroup) -> None:
        """After the pool's world was re-formed: the Core lane's DP group in the new world."""
        ...

    def close(self) -> None: ...


def lane_ranks(
    pool_ranks: Sequence[int], members: Sequence[int], *, lane_size: int, lane_rank: int
) -> list[int]:
    """The Gloo ranks of lane rank `lane_rank` of the lanes of `pool_ranks` in the world of
    `members` (pool ranks in Gloo order; each member is `lane_size` consecutive Gloo ranks)."""
    return [members.index(r) * lane_size + lane_rank for r in pool_ranks]


def build_lane(
    config: PoolConfig,
    *,
    rank: int,
    core_group: dist.ProcessGroup | None,
    members: Sequence[int],
    lane_rank: int = 0,
) -> PoolLane:
    """Build lane rank `lane_rank` of pool rank `rank`'s lane (collective over the world on the
    Megatron backend: every process calls it at start-up). `core_group`: this TP rank's group of
    the Core lanes; `members`: the world's pool ranks in Gloo order."""
    core = rank < config.core_dp
    if core and core_group is None:
        raise ValueError(f"Core rank {rank} needs the Core's process group")
    spec = _spec(config, rank)
    if config.backend == "megatron":
        return _megatron_lane(
            config, spec, rank=rank, core_group=core_group, members=members, lane_rank=lane_rank
        )
    be = TorchBackend(
        config.model_source,
        seed=config.seed if core else config.seed + WARM_SEED_OFFSET,
        objective=config.objective,
        perturb=not core,  # a warm worker must load the Core's state, not start from it
    )
    be.build(spec, dp_group=core_group if core else None)
    return be


def move_lane(
    lane: PoolLane,
    config: PoolConfig,
    *,
    rank: int,
    core_group: dist.ProcessGroup | None,
    members: Sequence[int],
    lane_rank: int = 0,
) -> PoolLane:
    """The lane in the pool's re-formed world (the old world destroyed, the new one joined).

    A torch lane keeps its state and takes the Core's new DP group. A Megatron lane cannot be
    re-pointed (its DDP buckets, DistributedOptimizer and Megatron's parallel state hold the
    old world's groups), so it is rebuilt in the new world and its captured state — parameters,
    FP32 masters, Adam moments, per-parameter steps, version — restored exactly. Rebuilding is
    collective over the new world: every member moves its lane at once, as they re-form at once
    — at TP > 1 every TP rank of it, each capturing and restoring its own shard.
    """
    if config.backend != "megatron":
        if rank < config.core_dp:
            assert core_group is not None
            lane.rebind_dp_group(core_group)
        return lane
    from megatron.core import parallel_state

    state = lane.capture()  # local: no peer involved
    lane.close()
    parallel_state.destroy_model_parallel()  # the old world's groups
    new = _megatron_lane(
        config,
        _spec(config, rank),
        rank=rank,
        core_group=core_group,
        members=members,
        lane_rank=lane_rank,
    )
    new.restore(state)
    return new


def _spec(config: PoolConfig, rank: int) -> LaneSpec:
    core = rank < config.core_dp
    return LaneSpec(
        role="core" if core else "hybrid",
        replica=config.core_replica(rank) if core else f"warm:{rank}",
        dp_rank=rank if core else 0,
        dp_size=config.core_dp if core else 1,
        pad_multiple=config.core_pad_multiple if core else config.hybrid_pad_multiple,
        adam=config.adam,
    )


def _megatron_lane(
    config: PoolConfig,
    spec: LaneSpec,
    *,
    rank: int,
    core_group: dist.ProcessGroup | None,
    members: Sequence[int],
    lane_rank: int,
) -> PoolLane:
    with warnings.catch_warnings():
        # Megatron and mbridge announce at import that Apex / Transformer Engine are missing
        # (they fall back to torch); the worker's log is for what happens to this lane.
        warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed")
        if config.device == "cpu":
            from ehp_fsm.backends.megatron import cpu

            cpu.apply()
        from megatron.core import parallel_state

        from ehp_fsm.backends.megatron.backend import MegatronBackend, MegatronModelConfig

        # Collective over the world, in the same order on every rank: Megatron's own groups
        # (the plan's TP and PP, CP = 1; rank order tp-pp-dp, so a lane's processes are
        # consecutive), then one DP group per lane rank of each warm lane.
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(config.tp, config.pp, order="tp-cp-ep-pp-dp")
        warm: dict[tuple[int, int], dist.ProcessGroup] = {}
        n = config.lane_size
        for w in config.warm_ranks:
            if w in members:
                for k in range(n):
                    warm[w, k] = dist.new_group(lane_ranks([w], members, lane_size=n, lane_rank=k))
        be = MegatronBackend(
            MegatronModelConfig(seed=config.seed, micro_batch_groups=MEGATRON_MICRO_BATCH_GROUPS),
            hf_model=config.model,
            objective=config.objective,
            perturb_seed=None if spec.role == "core" else config.seed + WARM_SEED_OFFSET,
        )
        be.build(spec, dp_group=core_group if spec.role == "core" else warm[rank, lane_rank])
    return be
