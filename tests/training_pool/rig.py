"""What the trainer-pool tests share: a tiny policy, a pool config for it, a batch of synthetic
groups per step, and one step over every live replica."""

from __future__ import annotations

import threading
from typing import Any, TypeVar

from ehp_fsm.core.batch import partition_groups
from ehp_fsm.training.grpo import GroupBatch, synthetic_groups
from ehp_fsm.training.policy import PolicyConfig
from ehp_fsm.training.pool import PoolConfig, PoolFailure, StepResult, TrainerPool

TINY = PolicyConfig(d_model=16, n_heads=2, d_ff=32, n_layers=1, max_len=16)
G, N = 4, 2  # groups per step, samples per group

T = TypeVar("T")


def tiny_config(**kw: Any) -> PoolConfig:
    """Core DP1 and one warm worker on `TINY`, short collective timeouts (override any)."""
    base: dict[str, Any] = {
        "policy": TINY,
        "seed": 3,
        "core_dp": 1,
        "max_hybrids": 1,
        "collective_timeout_s": 5.0,
        "command_timeout_s": 60.0,
    }
    return PoolConfig(**(base | kw))


def batch_of(
    step: int, *, config: PolicyConfig = TINY, groups: int = G, size: int = N, seed: int = 1
) -> GroupBatch:
    """Step `step`'s synthetic groups (ids step*groups ...)."""
    ids = range(step * groups, (step + 1) * groups)
    return synthetic_groups(ids, group_size=size, config=config, seed=seed)


def run_step(
    pool: TrainerPool, step: int, epoch: int, batch: GroupBatch, **kw: Any
) -> StepResult | PoolFailure:
    """One step of `batch` over every live replica of `pool`."""
    part = partition_groups(
        groups=batch.group_ids,
        live=dict.fromkeys(pool.live_replicas(), 1),
        group_size=batch.group_size,
        step=step,
        epoch=epoch,
    )
    return pool.step(step=step, epoch=epoch, partition=part, batch=batch, **kw)


def ok(x: T | PoolFailure) -> T:
    assert not isinstance(x, PoolFailure), str(x)
    return x


class HeldStep:
    """One step of `pool` on a thread of its own (as the run's trainer steps it), held at its
    commit (`on_computed`) until `release()`: `computed` is set once every delivery is in."""

    def __init__(self, pool: TrainerPool, step: int = 0, epoch: int = 0) -> None:
        self.computed, self._release = threading.Event(), threading.Event()
        self.out: list[StepResult | PoolFailure] = []

        def hold(replicas: tuple[str, ...]) -> bool:
            self.computed.set()
            return self._release.wait(60)

        self.thread = threading.Thread(
            target=lambda: self.out.append(
                run_step(pool, step, epoch, batch_of(step), on_computed=hold)
            )
        )

    def start(self) -> HeldStep:
        self.thread.start()
        assert self.computed.wait(60), "the held step never computed"
        return self

    def release(self) -> StepResult:
        self._release.set()
        self.thread.join(60)
        return ok(self.out[0])
