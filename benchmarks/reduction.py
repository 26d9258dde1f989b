"""Benchmark: bucketed sample-weighted gradient reduction vs a naive flatten-everything baseline
and vs a plain `copy_` of the same bytes, all in one run, each variant in a fresh process.

Gradient set: `--mib` MiB of fp32 (default 512) as 60 % large tensors (8 MiB) and 40 % small
ones (4–256 KiB, packed into buckets). One process, a real Gloo group of world size 1.
Peak extra memory: see peak_memory.py (fresh process, VmHWM reset, glibc mmap threshold fixed).
Targets (issue 3): peak extra ≤ 3 buckets and independent of model size; throughput ≥ 0.5× copy.

    python benchmarks/reduction.py                 # 512 MiB, 16 MiB buckets, also 256 MiB
    python benchmarks/reduction.py --mib 1024 --bucket-mib 16
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

MIB = 2**20


def make_grads(mib: int):
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
    return [torch.ones(n, dtype=torch.float32) for n in sizes]


def child(variant: str, mib: int, bucket_mib: int, repeats: int) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from ehp_fsm.training.reduction import weighted_allreduce_

    tmp = tempfile.mkdtemp(prefix="ehp-bench-")
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
    grads = make_grads(mib)
    nbytes = sum(g.numel() * 4 for g in grads)
    bucket = bucket_mib * MIB
    dst = [torch.empty_like(g).fill_(0) for g in grads] if variant == "copy" else None
    w = 3 / 8

    def run() -> None:
        if variant == "bucketed":
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
        else:
            raise SystemExit(f"unknown variant {variant}")

    run()  # warm up (first-touch of Gloo buffers, kernels)
    times = []
    peak = 0
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--small-mib", type=int, default=256, help="second size, to show independence")
    ap.add_argument("--bucket-mib", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", nargs=4, metavar=("VARIANT", "MIB", "BUCKET", "REPEATS"))
    a = ap.parse_args()
    if a.child:
        v, mib, b, r = a.child
        print(json.dumps(child(v, int(mib), int(b), int(r))))
        return
    me = os.path.abspath(__file__)
    rows = {}
    for mib in (a.small_mib, a.mib):
        for v in ("copy", "bucketed", "naive"):
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
        f"{'peak extra MiB':>15} {'buckets':>8}"
    )
    for mib in (a.small_mib, a.mib):
        c = rows[("copy", mib)]
        for v in ("copy", "bucketed", "naive"):
            r = rows[(v, mib)]
            print(
                f"{mib:>6}Mi {v:>9} {r['tensors']:>7} {r['gib_per_s']:>7.2f} "
                f"{r['gib_per_s'] / c['gib_per_s']:>7.2f}x "
                f"{r['peak_extra_bytes'] / MIB:>15.1f} {r['peak_extra_bytes'] / bucket:>8.2f}"
            )


if __name__ == "__main__":
    main()
