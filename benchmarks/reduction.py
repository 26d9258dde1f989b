"""Benchmark: bucketed sample-weighted gradient reduction vs a naive flatten-everything baseline
and vs a plain `copy_` of the same bytes, all in one run, each variant in a fresh process.

One process (default): gradient set of `--mib` MiB of fp32 (default 512) as 60 % large tensors
(8 MiB) and 40 % small ones (4–256 KiB). A real Gloo group of world size 1. Variants:
`copy` (per-tensor `copy_` into preallocated tensors: the baseline), `copy-flat` (one `copy_` of
a flat buffer of the same bytes: the stricter baseline), `flat` (the design: gradients are views
of one persistent flat buffer, reduced in place bucket by bucket), `scattered` (separately
allocated tensors: small ones go through the reusable staging bucket), `naive` (cat → reduce →
copy back). Peak extra memory: see peak_memory.py (fresh process, VmHWM reset, glibc mmap
threshold fixed). Targets (issue 3): peak extra ≤ 3 buckets and independent of model size;
throughput ≥ 0.5× copy.

Two processes (`--processes 2 --model tiny`): the trainer pool's per-step case — the default
tiny policy's gradients, delivered by the real `TorchBackend.compute` (snapshot included) and
reduced by `TorchBackend.reduce` over a 2-rank Gloo group, against a raw `dist.all_reduce` of one
flat tensor of the same bytes; also the reduction of separately allocated gradient tensors and
the snapshot alone. Median over `--iters` barrier-aligned iterations, interleaved.

    python benchmarks/reduction.py                 # 512 MiB, 16 MiB buckets, also 256 MiB
    python benchmarks/reduction.py --mib 1024 --bucket-mib 16
    python benchmarks/reduction.py --processes 2 --model tiny [--iters 400]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from peak_memory import calibrate, peak_extra, run_child
from two_ranks import run_two_ranks

MIB = 2**20


def make_grads(mib: int, *, flat: bool = False):
    """The gradient set: separate tensors, or (`flat`) views of one flat buffer in the same
    order and shapes (laid out here, so an older reduction module can be measured too)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    total = mib * MIB // 4
    large, small = int(total * 0.6), total - int(total * 0.6)
    sizes = []
    while large > 0:
        n = min(2 * MIB, large)  # 8 MiB fp32
        sizes.append(n)
        large -= n
    while small > 0:
        n = min(int(torch.randint(1024, 65536, (1,), generator=gen)), small)
        sizes.append(n)
        small -= n
    if flat:
        return list(torch.split(torch.ones(sum(sizes), dtype=torch.float32), sizes))
    return [torch.ones(n, dtype=torch.float32) for n in sizes]


def child(variant: str, mib: int, bucket_mib: int, repeats: int) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from ehp_fsm.training.reduction import weighted_allreduce_

    tmp = tempfile.mkdtemp(prefix="ehp-bench-")
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
    grads = make_grads(mib, flat=variant in ("flat", "copy-flat"))
    nbytes = sum(g.numel() * 4 for g in grads)
    bucket = bucket_mib * MIB
    dst = [torch.empty_like(g).fill_(0) for g in grads] if variant == "copy" else None
    src_flat = grads[0].as_strided((nbytes // 4,), (1,), 0) if variant == "copy-flat" else None
    dst_flat = torch.zeros(nbytes // 4) if variant == "copy-flat" else None
    w = 3 / 8

    def run() -> None:
        if variant in ("flat", "scattered"):
            weighted_allreduce_(grads, samples=3, total_samples=8, bucket_bytes=bucket)
        elif variant == "naive":
            flat = torch.cat([g.reshape(-1) * w for g in grads])
            dist.all_reduce(flat)
            off = 0
            for g in grads:
                g.copy_(flat[off : off + g.numel()].view_as(g))
                off += g.numel()
        elif variant == "copy":
            assert dst is not None
            for d, g in zip(dst, grads, strict=True):
                d.copy_(g)
        elif variant == "copy-flat":
            assert dst_flat is not None and src_flat is not None
            dst_flat.copy_(src_flat)
        else:
            raise SystemExit(f"unknown variant {variant}")

    with peak_extra() as p:  # the first call: it allocates whatever the variant keeps
        run()
    peak = p.extra_bytes
    times = []
    for _ in range(repeats):
        with peak_extra() as p:
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        peak = max(peak, p.extra_bytes)
    calib = calibrate(lambda n: torch.ones(n // 4), 64 * MIB) if variant == "copy" else None
    dist.destroy_process_group()
    shutil.rmtree(tmp, ignore_errors=True)
    best = min(times)
    return {
        "variant": variant,
        "mib": mib,
        "bytes": nbytes,
        "best_s": best,
        "gib_per_s": nbytes / best / 2**30,
        "peak_extra_bytes": peak,
        "calibration_64mib": calib,
        "tensors": len(grads),
    }


def tiny_rank(rank: int, tmp: str, iters: int, bucket_bytes: int, q) -> None:
    """One of two ranks: the pool's per-step reduction of the default tiny policy."""
    import statistics

    import torch
    import torch.distributed as dist

    from ehp_fsm.training.backend import GradientDelivery, TorchBackend
    from ehp_fsm.training.grpo import synthetic_groups
    from ehp_fsm.training.lane import LaneSpec
    from ehp_fsm.training.policy import PolicyConfig
    from ehp_fsm.training.reduction import weighted_allreduce_
    from ehp_fsm.training.snapshot import LiveGradients

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    group = dist.new_group([0, 1])  # the pool reduces over a subgroup, too
    cfg = PolicyConfig()
    be = TorchBackend(cfg, seed=1)
    be.build(LaneSpec(role="hybrid", replica=f"r{rank}"))
    batch = synthetic_groups(range(rank * 4, rank * 4 + 4), group_size=8, config=cfg, seed=3)
    d = be.compute(batch, step=0, epoch=0)
    numel = sum(g.numel() for g in d.grads)
    flat = torch.zeros(numel)
    scattered = [g.clone() for g in d.grads]
    live = LiveGradients([p.grad for _, p in be.lane.named if p.grad is not None])
    times: dict[str, list[float]] = {"raw": [], "pool": [], "scattered": [], "snapshot": []}

    def timed(name: str, fn) -> None:
        dist.barrier(group)
        t0 = time.perf_counter()
        fn()
        times[name].append(time.perf_counter() - t0)

    for _ in range(iters):
        timed("raw", lambda: dist.all_reduce(flat, group=group))
        timed(
            "pool",
            lambda: be.reduce(d, total_samples=64, group=group, bucket_bytes=bucket_bytes),
        )
        timed(
            "scattered",
            lambda: weighted_allreduce_(
                scattered, samples=32, total_samples=64, group=group, bucket_bytes=bucket_bytes
            ),
        )
        timed("snapshot", lambda: live.snapshot().wait())
    warm = iters // 10
    med = {k: statistics.median(v[warm:]) for k, v in times.items()}
    flat_views = all(
        a.data_ptr() + a.numel() * 4 == b.data_ptr()
        for a, b in zip(d.grads, d.grads[1:], strict=False)
    )
    assert isinstance(d, GradientDelivery)
    if rank == 0:
        q.put({"bytes": numel * 4, "tensors": len(d.grads), "flat_views": flat_views, **med})
    live.close()
    be.close()
    dist.destroy_process_group()


def main_processes(a: argparse.Namespace) -> None:
    if a.model != "tiny" or a.processes != 2:
        raise SystemExit("only --processes 2 --model tiny is implemented")
    res = run_two_ranks(tiny_rank, a.iters, a.bucket_mib * MIB, prefix="ehp-red2-")
    us = 1e6
    print(
        f"# pool reduction: default tiny policy, {res['tensors']} gradient tensors, "
        f"{res['bytes'] / 1024:.0f} KiB fp32, 2 processes over Gloo, bucket {a.bucket_mib} MiB, "
        f"median of {a.iters - a.iters // 10} iterations"
    )
    print(f"delivered gradients are views of one flat buffer: {res['flat_views']}")
    raw = res["raw"]
    for k, what in (
        ("raw", "raw dist.all_reduce of one flat tensor"),
        ("pool", "TorchBackend.reduce (the pool's step)"),
        ("scattered", "weighted_allreduce_ on separate tensors"),
        ("snapshot", "LiveGradients.snapshot().wait()"),
    ):
        print(f"{what:42s} {res[k] * us:8.0f} us  {res[k] / raw:5.2f}x raw")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--small-mib", type=int, default=256, help="second size, to show independence")
    ap.add_argument("--bucket-mib", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--model", default="set", help="'tiny' (the default policy) with --processes 2")
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--child", nargs=4, metavar=("VARIANT", "MIB", "BUCKET", "REPEATS"))
    a = ap.parse_args()
    if a.child:
        v, mib, b, r = a.child
        print(json.dumps(child(v, int(mib), int(b), int(r))))
        return
    if a.processes != 1:
        main_processes(a)
        return
    me = os.path.abspath(__file__)
    variants = ("copy", "copy-flat", "flat", "scattered", "naive")
    rows = {}
    for mib in (a.small_mib, a.mib):
        for v in variants:
            rows[(v, mib)] = run_child(me, v, str(mib), str(a.bucket_mib), str(a.repeats))
    bucket = a.bucket_mib * MIB
    print(
        f"# reduction benchmark: fp32 gradients, bucket {a.bucket_mib} MiB, Gloo world 1, "
        f"best of {a.repeats}"
    )
    cal = rows[("copy", a.mib)]["calibration_64mib"]
    print(f"calibration: 64 MiB allocation measured as {cal / MIB:.1f} MiB")
    print(
        f"{'size':>8} {'variant':>9} {'tensors':>7} {'GiB/s':>7} {'vs copy':>8} "
        f"{'vs flat copy':>12} {'peak extra MiB':>15} {'buckets':>8}"
    )
    for mib in (a.small_mib, a.mib):
        c, cf = rows[("copy", mib)], rows[("copy-flat", mib)]
        for v in variants:
            r = rows[(v, mib)]
            print(
                f"{mib:>6}Mi {v:>9} {r['tensors']:>7} {r['gib_per_s']:>7.2f} "
                f"{r['gib_per_s'] / c['gib_per_s']:>7.2f}x "
                f"{r['gib_per_s'] / cf['gib_per_s']:>11.2f}x "
                f"{r['peak_extra_bytes'] / MIB:>15.1f} {r['peak_extra_bytes'] / bucket:>8.2f}"
            )


if __name__ == "__main__":
    main()
