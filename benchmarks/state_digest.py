"""Benchmark: what the SHA-256 digests a state save records (and a resume's restore checks,
`verify.check_restored`) cost against the save itself.

One process, one thread (a trainer worker's). Model: `--mib` MiB of fp32 parameters (default
32) in 8 parameters, three Adam steps taken, so a state dir holds 4 × that (parameters, FP32
masters, both moments). Ours: the digests of every tensor of the state (`state_tensors`, hashed
with `tensor_digest`: what `write_state` adds to a save and what the restore check computes).
Baseline: `write_state` of the same state (the save, digests included; the files to a temporary
folder, page cache). Printed: each one's best time of `--repeats` and the ratio digests / save.

    python benchmarks/state_digest.py [--mib 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ehp_fsm.training.dpzero import local_dp_zero
from ehp_fsm.training.lane import LaneSpec, TrainingLane
from ehp_fsm.training.verify import state_tensors, tensor_digest, write_state


def lane(mib: int) -> TrainingLane:
    numel = mib * 2**20 // 4
    m = nn.Module()
    m.ps = nn.ParameterList([nn.Parameter(torch.randn(numel // 8 - 13 * i)) for i in range(8)])
    out = TrainingLane(m, LaneSpec(role="core", replica="c", pad_multiple=4))
    for _ in range(3):
        out.apply([torch.randn(s) for s in out.grad_shapes()])
    return out


def best(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    a = lane(args.mib)
    params, world = dict(a.named), local_dp_zero(a)
    root = Path(tempfile.mkdtemp(prefix="ehp-bench-digest-"))
    n = [0]

    def save() -> None:
        n[0] += 1
        write_state(root / f"s{n[0]}", params=params, world=world, layout=a.layout)
        shutil.rmtree(root / f"s{n[0]}")

    def digests() -> None:
        for _, t in state_tensors(params, world, a.layout):
            tensor_digest(t)

    try:
        saved, hashed = best(save, args.repeats), best(digests, args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    state_mib = 4 * args.mib
    print(f"state: {state_mib} MiB ({len(a.layout.params)} parameters x 4 tensors)")
    print(f"save (write_state, digests included): {saved:.3f} s ({state_mib / saved:.0f} MiB/s)")
    print(f"digests of every tensor:              {hashed:.3f} s ({state_mib / hashed:.0f} MiB/s)")
    print(f"digests / save: {hashed / saved:.2f}")


if __name__ == "__main__":
    main()
