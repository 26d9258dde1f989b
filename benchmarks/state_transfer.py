"""Benchmark: DP-zero gather + scatter between real processes vs raw Gloo gather/scatter of the
same bytes.

Two processes form a Core DP=2 group over Gloo. Model: `--mib` MiB of fp32 parameters (default
64) in 8 parameters, so the world state (master weights, exp_avg, exp_avg_sq) is 3 × that.
Ours: `gather_dp_zero` (shards → unpadded world tensors on rank 0) followed by `scatter_dp_zero`
into a DP=2 lane with another padding (world → padded shards → install, including the
all-gather that refreshes the model parameters; that refresh is also timed on its own).
Baseline: `dist.gather` of the same three shard tensors to rank 0 and `dist.scatter` of them
back. Target (issue 3): ≥ 0.5× the baseline.

    python benchmarks/state_transfer.py [--mib 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import time

from two_ranks import run_two_ranks


def rank_main(rank: int, tmp: str, mib: int, repeats: int, q) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from ehp_fsm.training.adam import AdamConfig
    from ehp_fsm.training.dpzero import gather_dp_zero, scatter_dp_zero
    from ehp_fsm.training.lane import LaneSpec, TrainingLane

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    numel = mib * 2**20 // 4
    shapes = [(numel // 8 - 13 * i,) for i in range(8)]

    def model() -> nn.Module:
        m = nn.Module()
        m.ps = nn.ParameterList([nn.Parameter(torch.ones(s)) for s in shapes])
        return m

    group = dist.new_group([0, 1])
    src = TrainingLane(
        model(),
        LaneSpec(
            role="core",
            replica=f"c{rank}",
            dp_rank=rank,
            dp_size=2,
            pad_multiple=128,
            adam=AdamConfig(),
        ),
        dp_group=group,
    )
    src.apply([torch.full(s, 0.5) for s in shapes])
    dst = TrainingLane(
        model(),
        LaneSpec(
            role="core",
            replica=f"c{rank}",
            dp_rank=rank,
            dp_size=2,
            pad_multiple=7,
            adam=AdamConfig(),
        ),
        dp_group=group,
    )
    world_bytes = 3 * sum(s[0] for s in shapes) * 4
    shards = src.shard_tensors()[0]

    def ours() -> None:
        state = gather_dp_zero(src, group=group, dst=0)
        scatter_dp_zero(state, dst, group=group, src=0)

    def raw() -> None:
        for key in ("param", "exp_avg", "exp_avg_sq"):
            t = shards[key]
            bufs = [torch.empty_like(t) for _ in range(2)] if rank == 0 else None
            dist.gather(t, bufs, dst=0, group=group)
            out = torch.empty_like(t)
            dist.scatter(out, bufs, src=0, group=group)

    def refresh() -> None:  # the model refresh `scatter_dp_zero` ends with (lane.sync_params)
        dst.sync_params()

    result = {}
    rounds = (("raw", raw), ("dp_zero", ours), ("refresh", refresh))
    for name, fn in rounds + rounds:
        fn()  # the first round is warm-up; the second is measured
        times = []
        for _ in range(repeats):
            dist.barrier(group)
            t0 = time.perf_counter()
            fn()
            dist.barrier(group)
            times.append(time.perf_counter() - t0)
        result[name] = min(times)
    if rank == 0:
        q.put({"world_bytes": world_bytes, **result})
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    res = run_two_ranks(rank_main, a.mib, a.repeats, prefix="ehp-xfer-")
    moved = 2 * res["world_bytes"]  # gathered once, scattered once
    gib = 2**30
    print(
        f"# state transfer: Core DP=2 over Gloo (2 processes), params {a.mib} MiB fp32, "
        f"world state {res['world_bytes'] / 2**20:.0f} MiB, best of {a.repeats}"
    )
    print(f"raw gather+scatter : {res['raw']:.3f} s  {moved / res['raw'] / gib:.2f} GiB/s")
    print(
        f"dp-zero gather+scatter: {res['dp_zero']:.3f} s  {moved / res['dp_zero'] / gib:.2f} GiB/s"
    )
    print(f"ratio dp-zero / raw: {res['raw'] / res['dp_zero']:.2f}x")
    print(
        f"of which the model refresh (TrainingLane.sync_params: all-gather of the master shards "
        f"into the model): {res['refresh']:.3f} s; without it: "
        f"{res['raw'] / max(res['dp_zero'] - res['refresh'], 1e-9):.2f}x raw"
    )


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
