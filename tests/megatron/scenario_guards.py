"""Worker scenario: the Megatron backend refuses bad input without corrupting state or hanging.

Two 2-rank Core worlds (DP=2, FP32) run at once. `plain` takes one Core-only step. `guards`
first gathers its DP-zero state before any optimizer step (version 0: what a Hybrid joining at
step 0 needs) and scatters it back, takes the same step (its state must equal `plain`'s, bit for
bit), then applies a reduced gradient holding a NaN (refused before the optimizer steps), and
scatters a state whose hyperparameters differ (refused on DP rank 0, and the refusal must reach
DP rank 1 at once instead of leaving it in the broadcast until the collective timeout); a last
Core-only step shows the world is still in step. Every observation is saved for
`test_backend_guards.py`; an exception of a path under test is recorded, not raised.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from tests.megatron.harness import WorkerContext


def _tensors(state: Any) -> dict[str, dict[str, torch.Tensor]]:
    """A `LaneState`'s tensors by field and key (what `torch.load(weights_only=True)` reads)."""
    fields = ("params", "master", "exp_avg", "exp_avg_sq", "steps")
    return {f: {str(k): v for k, v in getattr(state, f).items()} for f in fields}


def _error(fn: Any, *args: Any) -> str | None:
    try:
        fn(*args)
    except Exception as exc:  # recorded and asserted on by the test
        return f"{type(exc).__name__} {exc}"
    return None


def plain(ctx: WorkerContext) -> None:
    from tests.megatron.scenario_common import build, core_only_step

    replica = build("core", f"core{ctx.rank}", ctx.rank, ctx.world_size, torch.float32)
    core_only_step(replica, 0, ctx.rank, ctx.world_size)
    ctx.save(f"state{ctx.rank}", _tensors(replica.capture()))


def guards(ctx: WorkerContext) -> None:
    from tests.megatron.scenario_common import build, core_only_step, equal_states, step_batch

    n, rank = ctx.world_size, ctx.rank
    replica = build("core", f"core{rank}", rank, n, torch.float32)
    report: dict[str, object] = {}

    # Version 0: gather before the first optimizer step, scatter back, then step.
    state = None

    def gather() -> None:
        nonlocal state
        state = replica.gather_dp_zero()

    report["v0_gather_error"] = _error(gather)
    if state is not None:
        report["v0_version"] = state.version
        report["v0_steps"] = sorted(set(state.steps.values()))
    report["v0_scatter_error"] = _error(replica.scatter_dp_zero, state)
    core_only_step(replica, 0, rank, n)
    ctx.save(f"state{rank}", _tensors(replica.capture()))

    # A reduced gradient with a NaN: refused before the optimizer steps.
    before = replica.capture()
    batch = step_batch(1)
    per = len(batch.group_ids) // n
    mine = batch.select(batch.group_ids[rank * per : (rank + 1) * per])
    reduced = replica.reduce(
        replica.compute(mine, step=1, epoch=0), total_samples=batch.samples, group=None
    )
    reduced[0].view(-1)[0] = float("nan")
    report["nan_error"] = _error(replica.apply, reduced)
    report["nan_state_unchanged"] = equal_states(before, replica.capture())

    # A state whose hyperparameters differ, given on DP rank 0.
    state = replica.gather_dp_zero()
    if state is not None:
        state = dataclasses.replace(
            state, hyper=tuple({**h, "lr": h["lr"] * 2} for h in state.hyper)
        )
    t0 = time.monotonic()
    report["scatter_error"] = _error(replica.scatter_dp_zero, state)
    report["scatter_s"] = time.monotonic() - t0
    report["scatter_state_unchanged"] = equal_states(before, replica.capture())

    # A state cut short (a truncated file, another model's buffers), given on DP rank 0.
    state = replica.gather_dp_zero()
    if state is not None:
        entry = state.buffers[0][next(iter(state.buffers[0]))]
        entry["exp_avg"] = entry["exp_avg"][:-1]
    report["short_error"] = _error(replica.scatter_dp_zero, state)
    report["short_state_unchanged"] = equal_states(before, replica.capture())

    # The world is still in step: one more Core-only step on both ranks.
    report["after_error"] = _error(core_only_step, replica, 1, rank, n)
    report["after_version"] = replica.version
    ctx.save(f"report{rank}", report)
