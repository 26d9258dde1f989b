"""Worker scenario: `shards.gather_world` / `scatter_world` against Megatron-Core's own
`get_parameter_state_dp_zero` / `load_parameter_state_from_dp_zero`, bit for bit.

One Gloo world of two processes. For each lane layout (BF16 parameters in several buckets,
padded to the DP size or to 65,536 elements; FP32 parameters in one bucket) a DP2 lane over the
world takes two Core-only steps, then every rank also builds a DP1 lane over its own one-rank
group (both at once: Megatron's optimizer factory all-gathers over the world) and restores the
DP2 state into it. On each lane, with the default chunk and with chunks of 1,000 elements (they
cut through parameters):

- gather: both functions' world tensors on DP rank 0, compared by their bits;
- scatter: the lane's shards are scrambled, the Megatron-format state is loaded by Megatron's
  loader (bug (a) sidestepped as a user would: steps popped, under `no_grad`) and its shards
  recorded; scrambled again and loaded by `scatter_world`; both sets of shards compared by their
  bits, and with the shards before scrambling.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.megatron.harness import WorkerContext

LAYOUTS = (
    ("bf16-buckets", torch.bfloat16, dict(bucket_size=3000, overlap_grad_reduce=True)),
    # Padding for NCCL bus bandwidth makes each bucket 65,536 elements: DP rank 0's half holds
    # every parameter, DP rank 1 owns none (its shard is all padding).
    (
        "bf16-padded",
        torch.bfloat16,
        dict(bucket_size=3000, overlap_grad_reduce=True, pad_buckets_for_high_nccl_busbw=True),
    ),
    # A hidden size that is no multiple of 64: Megatron starts each parameter at a multiple of
    # 64, so the bucket has gaps between parameters (zeros in the DP-zero format).
    ("fp32-one", torch.float32, dict(hidden_size=36)),
)
CHUNKS = (None, 1000)
KEYS = ("param", "exp_avg", "exp_avg_sq")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.int32)


def _same_world(a: dict[Any, Any] | None, b: dict[Any, Any] | None) -> list[str]:
    """Where two DP-zero dicts (int keys only) differ; [] when bit-identical."""
    if a is None or b is None:
        return [] if a is b else ["one is None"]
    bad = []
    for index in sorted(k for k in b if isinstance(k, int)):
        for key, entry in b[index].items():
            mine = a[index][key]
            if mine["numel_unpadded"] != entry["numel_unpadded"]:
                bad.append(f"{index}.{key}.numel_unpadded")
            for k in KEYS:
                if mine[k].shape != entry[k].shape or not torch.equal(
                    _bits(mine[k]), _bits(entry[k])
                ):
                    bad.append(f"{index}.{key}.{k}")
    if set(a) - {"buckets_coalesced"} != set(b) - {"buckets_coalesced"}:
        bad.append("buffers")
    return bad


def _shards(dist_opt: Any) -> dict[int, dict[str, torch.Tensor]]:
    from ehp_fsm.backends.megatron import state as st

    out = {}
    for i, (param, _) in enumerate(st._owned(dist_opt)):
        tensors = dist_opt._get_main_param_and_optimizer_states(param)
        out[i] = {k: tensors[k].detach().clone() for k in KEYS}
    return out


def _differing(a: dict[int, dict[str, torch.Tensor]], b: dict[int, dict[str, torch.Tensor]]) -> int:
    return sum(int((_bits(a[i][k]) != _bits(b[i][k])).sum()) for i in a for k in KEYS) + abs(
        len(a) - len(b)
    )


def _scramble(dist_opt: Any, seed: int) -> None:
    from ehp_fsm.backends.megatron import state as st

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, main in st._owned(dist_opt):
            main.copy_(torch.randn(main.shape, generator=g))
            for k in ("exp_avg", "exp_avg_sq"):
                dist_opt.optimizer.state[main][k].copy_(torch.rand(main.shape, generator=g))


def _check(lane: Any, tag: str, report: dict[str, Any]) -> None:
    from ehp_fsm.backends.megatron import shards
    from ehp_fsm.backends.megatron import state as st

    dist_opt = st.distributed_optimizer(lane.optimizer)
    default = shards.CHUNK_NUMEL
    kept = _shards(dist_opt)
    report[f"{tag}.owned"] = len(kept)
    theirs = dist_opt.get_parameter_state_dp_zero(use_gloo_comm=True)
    for chunk in CHUNKS:
        shards.CHUNK_NUMEL = chunk or default
        name = f"{tag}.chunk{chunk or 'default'}"
        ours = shards.gather_world(dist_opt)
        report[f"{name}.gather"] = _same_world(ours, theirs)
        report[f"{name}.gather_on_rank"] = ours is not None

        _scramble(dist_opt, 1)
        for _, main in st._owned(dist_opt):
            dist_opt.optimizer.state[main].pop("step", None)
        with torch.no_grad():
            dist_opt.load_parameter_state_from_dp_zero(theirs)
        by_megatron = _shards(dist_opt)
        _scramble(dist_opt, 2)
        with torch.no_grad():
            shards.scatter_world(dist_opt, ours)
        by_shards = _shards(dist_opt)
        report[f"{name}.scatter_vs_megatron"] = _differing(by_shards, by_megatron)
        report[f"{name}.scatter_vs_before"] = _differing(by_shards, kept)
        report[f"{name}.scramble_moved"] = _differing(kept, _scrambled(dist_opt))
        with torch.no_grad():
            shards.scatter_world(dist_opt, ours)
    shards.CHUNK_NUMEL = default


def _scrambled(dist_opt: Any) -> dict[int, dict[str, torch.Tensor]]:
    """The shards after a scramble (then left scrambled: the caller restores them)."""
    _scramble(dist_opt, 3)
    return _shards(dist_opt)


def _poisoned(numel: int) -> torch.Tensor:
    return torch.full((numel,), float("nan"))


def shards_vs_megatron(ctx: WorkerContext) -> None:
    from ehp_fsm.backends.megatron import shards
    from ehp_fsm.backends.megatron.state import distributed_optimizer
    from tests.megatron.scenario_common import build, core_only_step, share_state

    rank, n = ctx.rank, ctx.world_size
    shards._host = _poisoned  # what `shards` allocates starts as NaN: each element is written
    singles = [torch.distributed.new_group([r]) for r in range(n)]
    report: dict[str, Any] = {}
    for tag, dtype, config in LAYOUTS:
        dp2 = build("core", f"core{rank}", rank, n, dtype, **config)
        for step in range(2):
            core_only_step(dp2, step, rank, n)
        state = dp2.gather_dp_zero()
        dp1 = build("hybrid", f"hybrid{rank}", 0, 1, dtype, dp_group=singles[rank], **config)
        dp1.scatter_dp_zero(share_state(dp2, dp1, state, rank, n))
        for name, lane in (("dp2", dp2), ("dp1", dp1)):
            dist_opt = distributed_optimizer(lane.optimizer)
            report[f"{tag}.{name}.buckets"] = [len(b.buckets) for b in dist_opt.buffers]
        _check(dp2, f"{tag}.dp2", report)
        _check(dp1, f"{tag}.dp1", report)
    ctx.save(f"report{rank}", report)
