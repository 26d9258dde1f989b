"""Worker scenario: model parameters after a DP-zero restore, DP2 -> DP2 and DP2 -> DP1.

One Gloo world of two processes, once with BF16 and once with FP32 model parameters. A DP2
source lane over the world takes two Core-only steps and gathers its DP-zero state on DP rank 0.
A fresh DP2 target (same seed, so still the initial weights) scatters that state; then every
rank builds a DP1 lane over its own one-rank group (both at once: Megatron's optimizer factory
all-gathers over the world), rank 0 hands the state to rank 1 point to point, and each DP1 lane
scatters it. After each restore every rank compares every model parameter of the target with
the source's, element by element, and records how many elements differ before and after.

The DP-zero state carries master weights, not model parameters: the target rebuilds its
parameters from its master shards, and on DP2 each rank owns only half of them, so the other
half must come from Megatron's parameter all-gather (`start_param_sync` in `dp_zero_scatter`).
"""

from __future__ import annotations

from typing import Any

import torch

from tests.megatron.harness import WorkerContext

DTYPES = (("bf16", torch.bfloat16), ("fp32", torch.float32))
STEPS = 2


def _params(lane: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in lane.named_parameters()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, int]:
    """How many elements of each parameter differ in their bits (-1: missing, other dtype or
    shape)."""
    out = {}
    for name, x in a.items():
        y = b.get(name)
        same_kind = y is not None and (y.dtype, y.shape) == (x.dtype, x.shape)
        out[name] = int((_bits(x) != _bits(y)).sum()) if y is not None and same_kind else -1
    return out


def restore(ctx: WorkerContext) -> None:
    from tests.megatron.scenario_common import build, core_only_step, share_state

    rank, n = ctx.rank, ctx.world_size
    singles = [torch.distributed.new_group([r]) for r in range(n)]  # every rank creates each
    for tag, dtype in DTYPES:
        source = build("core", f"core{rank}", rank, n, dtype)
        for step in range(STEPS):
            core_only_step(source, step, rank, n)
        want = _params(source)
        if rank == 0:
            ctx.save(f"{tag}.numel", {k: v.numel() for k, v in want.items()})
        state = source.gather_dp_zero()  # on DP rank 0, None elsewhere

        dp2 = build("core", f"core{rank}", rank, n, dtype)
        before = _differing(want, _params(dp2))
        dp2.scatter_dp_zero(state)
        ctx.save(
            f"{tag}.dp2.{rank}",
            {"before": before, "after": _differing(want, _params(dp2)), "version": dp2.version},
        )

        dp1 = build("hybrid", f"hybrid{rank}", 0, 1, dtype, dp_group=singles[rank])
        state = share_state(source, dp1, state, rank, n)
        before = _differing(want, _params(dp1))
        dp1.scatter_dp_zero(state)
        ctx.save(
            f"{tag}.dp1.{rank}",
            {"before": before, "after": _differing(want, _params(dp1)), "version": dp1.version},
        )
