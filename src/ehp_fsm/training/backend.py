"""The training backend contract the engine drives, and its torch implementation.

`TrainingBackend` is one method per backend operation of one training lane (a Core DP replica
rank or a DP1 Hybrid lane): build, compute a sample-weighted delivery for assigned groups, reduce,
apply, capture/restore, DP-zero gather/scatter. Ordering and policy (who computes which groups,
which deliveries count, when to borrow or return) live in the engine and `ehp_fsm.core.batch`,
not here. `TorchBackend` implements it with plain torch on CPU (Gloo between processes); a
Megatron-Core backend implements the same Protocol on GPUs.

What it does not know: the ledger's verdicts, membership epochs beyond stamping them on a
delivery, process launch.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from ehp_fsm.core.batch import Delivery
from ehp_fsm.training.dpzero import (
    DpZeroState,
    gather_dp_zero,
    local_dp_zero,
    recv_dp_zero,
    scatter_dp_zero,
    send_dp_zero,
)
from ehp_fsm.training.grpo import ON_POLICY, GroupBatch, replica_loss
from ehp_fsm.training.lane import LaneSpec, LaneState, TrainingLane
from ehp_fsm.training.layout import FlatLayout
from ehp_fsm.training.objective import ObjectiveConfig, ObjectiveMetrics
from ehp_fsm.training.policy import PolicyConfig, build_policy
from ehp_fsm.training.reduction import (
    DEFAULT_BUCKET_BYTES,
    staging_tensors,
    weighted_allreduce_,
)
from ehp_fsm.training.snapshot import LiveGradients


@dataclass(frozen=True, kw_only=True)
class GradientDelivery:
    """ḡᵢ of one replica for one (step, epoch): `record` goes to the ledger, `grads` are owned
    fp32 copies in parameter order (never aliases of live buffers)."""

    record: Delivery
    grads: tuple[torch.Tensor, ...]
    loss: float = 0.0  # the delivery's local loss (normalised by its own units; 0 for none)
    metrics: ObjectiveMetrics = field(default_factory=ObjectiveMetrics)


@runtime_checkable
class TrainingBackend(Protocol):
    """One training lane. Collective methods (`reduce` with a group, `apply` on a sharded Core
    lane, `gather_dp_zero`, `scatter_dp_zero`) must be called by every rank of the group."""

    def build(self, spec: LaneSpec, *, dp_group: dist.ProcessGroup | None = None) -> None:
        """Build model + optimizer for a Core replica rank (`spec.dp_size` > 1 possible) or a
        DP1 Hybrid lane (`spec.role == "hybrid"`)."""
        ...

    @property
    def version(self) -> int:
        """Optimizer steps taken (the Core version this lane's state is at)."""
        ...

    def grad_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Shapes of the gradient tensors a delivery carries, in parameter order."""
        ...

    def compute(self, batch: GroupBatch, *, step: int, epoch: int) -> GradientDelivery:
        """Forward/backward on the assigned whole groups; the mean gradient over their samples
        with a ledger record (replica, step, epoch, samples, shapes)."""
        ...

    def reduce(
        self,
        delivery: GradientDelivery,
        *,
        total_samples: int,
        group: dist.ProcessGroup | None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> tuple[torch.Tensor, ...]:
        """Σ (nᵢ/B)·ḡᵢ over the live replicas of `group` (in place on the delivery's copies)."""
        ...

    def apply(self, reduced: Sequence[torch.Tensor]) -> int:
        """One optimizer step with the reduced gradient; returns the new version. A gradient
        holding NaN or Inf is refused with `ReductionError` before any state changes."""
        ...

    def capture(self) -> LaneState:
        """Owned copy of the lane's exact state."""
        ...

    def restore(self, state: LaneState) -> None:
        """Install a state captured from a lane with the same layout."""
        ...

    def gather_dp_zero(
        self, *, group: dist.ProcessGroup | None, dst: int = 0
    ) -> DpZeroState | None:
        """World state on group rank `dst` (Megatron DP-zero format), None elsewhere."""
        ...

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The lane's tensors by kind (`ehp_fsm.training.memory.KINDS`): what a parked worker
        must no longer reference once it dropped the lane."""
        ...

    def scatter_dp_zero(
        self, state: DpZeroState | None, *, group: dist.ProcessGroup | None, src: int = 0
    ) -> None:
        """Install world state (given on `src`) into this lane's layout and padding."""
        ...


def build_model(source: PolicyConfig | str, *, seed: int) -> torch.nn.Module:
    """The model a lane trains: a Hugging Face causal LM from its directory (fp32 weights as
    saved), or the built-in toy policy from `seed`."""
    if isinstance(source, PolicyConfig):
        return build_policy(source, seed=seed)
    from ehp_fsm.models.load import load_model

    model: torch.nn.Module = load_model(source, torch.float32).model
    return model


def perturb_(model: torch.nn.Module, *, seed: int) -> None:
    """Move every weight off its value by seeded noise: a warm Hybrid must be given the Core's
    state, never start from the same weights by accident (a load that did nothing shows)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.02)


class TorchBackend:
    """`TrainingBackend` on plain torch. The model is a Hugging Face causal LM loaded from its
    directory (`model` a path) or, for the fast unit tests of the math, the built-in toy policy
    (`model` a `PolicyConfig`, initialised from `seed`). fp32 master weights and Adam pieces are
    laid out DP-zero style (`TrainingLane`). The loss is the GRPO objective (`objective`); with
    `kl_coef > 0` a frozen copy of the initial model is the reference."""

    def __init__(
        self,
        model: PolicyConfig | str,
        *,
        seed: int,
        objective: ObjectiveConfig = ON_POLICY,
        perturb: bool = False,
    ) -> None:
        self.model_source = model
        self.seed = seed
        self.objective = objective
        self.perturb = perturb  # a warm Hybrid: start from other weights than the Core's
        self.reference: torch.nn.Module | None = None
        self._lane: TrainingLane | None = None
        self._live: LiveGradients | None = None

    @property
    def config(self) -> PolicyConfig | str:
        return self.model_source

    @property
    def lane(self) -> TrainingLane:
        if self._lane is None:
            raise RuntimeError("TorchBackend.build(spec) must be called before use")
        return self._lane

    def build(self, spec: LaneSpec, *, dp_group: dist.ProcessGroup | None = None) -> None:
        model = build_model(self.model_source, seed=self.seed)
        if self.objective.needs_reference:  # the initial weights, the same on every lane
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        if self.perturb and not isinstance(self.model_source, PolicyConfig):
            perturb_(model, seed=self.seed)  # (the toy is built from this lane's own seed)
        self._lane = TrainingLane(model, spec, dp_group=dp_group)
        params = [p for _, p in self._lane.named]
        for p in params:  # persistent live gradient buffers, reused every step
            p.grad = torch.zeros_like(p)
        self._live = LiveGradients([p.grad for p in params if p.grad is not None])

    def drop_reference(self) -> None:
        """Let go of the KL reference (a parked torch lane is dropped whole; this is the
        pool's lane protocol, which a parked Megatron lane that stays built needs)."""
        self.reference = None

    def restore_reference(self) -> None:
        """Build the KL reference again after `drop_reference`: the initial weights, from the
        same source and seed."""
        if self.objective.needs_reference and self.reference is None:
            model = build_model(self.model_source, seed=self.seed)
            self.reference = model.eval().requires_grad_(False)

    def close(self) -> None:
        """Wait for pending gradient snapshots and stop the snapshot thread."""
        if self._live is not None:
            self._live.close()

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        lane = self.lane
        params = [p for _, p in lane.named]
        optimizer = [*lane.exp_avg.values(), *lane.exp_avg_sq.values()]
        for state in lane.optimizer.state.values():
            optimizer += [t for t in state.values() if isinstance(t, torch.Tensor)]
        return {
            "params": params + list(lane.model.buffers()),
            "grads": [p.grad for p in params if p.grad is not None]
            + list(self._live.flat_buffers if self._live is not None else ()),
            "master": list(lane.master.values()),
            "optimizer": optimizer,
            "reference": [] if self.reference is None else list(self.reference.parameters()),
            "staging": list(staging_tensors()),
        }

    @property
    def version(self) -> int:
        return 0 if self._lane is None else self._lane.version

    def grad_shapes(self) -> tuple[tuple[int, ...], ...]:
        return self.lane.grad_shapes()

    def compute(self, batch: GroupBatch, *, step: int, epoch: int) -> GradientDelivery:
        lane, live = self.lane, self._live
        assert live is not None
        live.zero_()  # waits until the previous snapshot owns its copy
        out = replica_loss(lane.model, batch, self.objective, reference=self.reference)
        torch.autograd.backward(out.loss)
        grads = tuple(
            g.to(torch.float32) if g.dtype != torch.float32 else g for g in live.snapshot().wait()
        )
        record = Delivery(
            step=step,
            epoch=epoch,
            replica=lane.spec.replica,
            samples=out.weight,
            shapes=lane.grad_shapes(),
        )
        return GradientDelivery(
            record=record, grads=grads, loss=float(out.loss.detach()), metrics=out.metrics
        )

    def reduce(
        self,
        delivery: GradientDelivery,
        *,
        total_samples: int,
        group: dist.ProcessGroup | None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> tuple[torch.Tensor, ...]:
        """Σ (uᵢ/U)·ḡᵢ in place (`total_samples` = U: all units of the step)."""
        weighted_allreduce_(
            delivery.grads,
            samples=delivery.record.samples,
            total_samples=total_samples,
            group=group,
            bucket_bytes=bucket_bytes,
        )
        return delivery.grads

    def apply(self, reduced: Sequence[torch.Tensor]) -> int:
        return self.lane.apply(reduced)

    def capture(self) -> LaneState:
        return self.lane.capture()

    def restore(self, state: LaneState) -> None:
        self.lane.restore(state)

    def gather_dp_zero(
        self, *, group: dist.ProcessGroup | None, dst: int = 0
    ) -> DpZeroState | None:
        return gather_dp_zero(self.lane, group=group, dst=dst)

    def scatter_dp_zero(
        self, state: DpZeroState | None, *, group: dist.ProcessGroup | None, src: int = 0
    ) -> None:
        scatter_dp_zero(state, self.lane, group=group, src=src)

    # -- what a trainer worker needs beyond the Protocol (`training.lanes.PoolLane`) ----------

    @property
    def layout(self) -> FlatLayout:
        return self.lane.layout

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return list(self.lane.named)

    def revision_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.lane.model.state_dict().items()}

    def local_state(self) -> DpZeroState:
        return local_dp_zero(self.lane)

    def send_dp_zero(self, state: DpZeroState, *, dst: int) -> None:
        send_dp_zero(state, dst=dst, names=list(self.lane.param_names))

    def recv_dp_zero(self, *, src: int) -> DpZeroState:
        return recv_dp_zero(self.lane.layout, src=src, groups=len(self.lane.optimizer.param_groups))

    def rebind_dp_group(self, group: dist.ProcessGroup) -> None:
        self.lane.dp_group = group
