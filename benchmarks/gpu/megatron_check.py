"""GPU check of the Megatron-Core backend: CUDA + NCCL, a 0.5B-1B GPTModel, random init.

Runs the CPU suite's checks on real GPUs, without the CPU compatibility layer:
1. Core world (DP = min(2, GPUs)) trains 2 Core-only steps through `MegatronBackend`
   (compute -> NCCL weighted all-reduce -> DistributedOptimizer step).
2. Bug (b) on GPU: raw `load_state_dict` shares one step tensor; the backend's loader does not.
3. DP-zero gather on the Core (timed), saved; a DP1 Hybrid world (its own process, last GPU)
   scatters it (timed) and must match the Core bitwise (FP32 master, Adam moments, steps).
4. Next update: both apply the same reduced gradient; states must match bitwise again.
Prints state-transfer bandwidth against a plain device-to-host copy of the same bytes measured in
the same run (pinned and pageable). Exit status 0 only when every check passes.

Not here (the CPU tests in `tests/megatron/` cover them with real Megatron code over Gloo): the
fixed-batch split run against a Core-only reference, and the one-world form (Core and Hybrid
lanes in one process group world, deliveries reduced together) — with one GPU, NCCL cannot put
two ranks of one communicator on the same device. With one GPU the Core is DP1 and the Hybrid
shares GPU 0, so source and target padding are equal here.

Usage: python benchmarks/gpu/megatron_check.py [--layers 24 --hidden 1536 ...] [--small]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--small", action="store_true", help="tiny model (smoke test)")
    p.add_argument(
        "--cpu",
        action="store_true",
        help="dry run of this script's logic on CPU (Gloo + the tests' CPU compatibility "
        "layer, tiny model); bandwidth figures are meaningless there",
    )
    default_dir = Path(tempfile.gettempdir()) / "megatron_check"  # ~2x state size on disk
    p.add_argument("--workdir", default=str(default_dir))
    p.add_argument("--timeout", type=float, default=500.0)
    a = p.parse_args(argv)
    if a.small or a.cpu:
        a.layers, a.hidden, a.heads, a.vocab = 2, 64, 4, 64
    return a


def _config(a: argparse.Namespace) -> Any:
    from ehp_fsm.backends.megatron.backend import MegatronModelConfig

    return MegatronModelConfig(
        num_layers=a.layers,
        hidden_size=a.hidden,
        num_attention_heads=a.heads,
        vocab_size=a.vocab,
        seq_length=16,
        bucket_size=40_000_000,
        overlap_grad_reduce=True,
    )


def _build(a: argparse.Namespace, role: str, rank: int, size: int) -> Any:
    from ehp_fsm.backends.megatron.backend import MegatronBackend
    from ehp_fsm.training.adam import AdamConfig
    from ehp_fsm.training.lane import LaneSpec

    backend = MegatronBackend(_config(a))
    name = "hybrid" if role == "hybrid" else f"core{rank}"
    backend.build(
        LaneSpec(
            role=role,  # type: ignore[arg-type]
            replica=name,
            dp_rank=rank,
            dp_size=size,
            param_dtype=torch.bfloat16,
            adam=AdamConfig(lr=1e-4, weight_decay=0.01),
        )
    )
    return backend


def _batch(step: int) -> Any:
    from ehp_fsm.training.grpo import synthetic_groups
    from ehp_fsm.training.policy import PolicyConfig

    return synthetic_groups(
        [step * 4 + g for g in range(4)], group_size=2, config=PolicyConfig(), seed=7
    )


def _synthetic_reduced(backend: Any, step: int) -> list[torch.Tensor]:
    """The same reduced gradient in every process (seeded on CPU, moved to the GPU)."""
    gen = torch.Generator().manual_seed(10_000 + step)
    return [
        (torch.randn(p.shape, generator=gen) * 1e-3).cuda() for _, p in backend.named_parameters()
    ]


def _timed(fn: Any) -> tuple[Any, float]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def _wait(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout}s")
        time.sleep(0.1)


def _equal(a: Any, b: Any) -> list[str]:
    """Names of everything that differs between two DpZeroStates (empty = bitwise equal)."""
    bad = [] if a.version == b.version else ["version"]
    bad += [] if dict(a.steps) == dict(b.steps) else ["steps"]
    for idx, per_dtype in a.buffers.items():
        for key, entry in per_dtype.items():
            for k in ("param", "exp_avg", "exp_avg_sq"):
                if not torch.equal(entry[k], b.buffers[idx][key][k]):
                    bad.append(f"{idx}.{k}")
    return bad


def core(rank: int, size: int, a: argparse.Namespace, work: Path) -> None:
    from ehp_fsm.backends.megatron import state as st

    lane = _build(a, "core", rank, size)
    n_params = sum(p.numel() for _, p in lane.named_parameters())
    if rank == 0:
        print(f"[core] model {n_params / 1e9:.3f}B params, DP={size}", flush=True)
    for step in range(2):
        batch = _batch(step)
        per = len(batch.group_ids) // size
        mine = batch.select(batch.group_ids[rank * per : (rank + 1) * per])
        delivery = lane.compute(mine, step=step, epoch=0)
        lane.apply(lane.reduce(delivery, total_samples=batch.samples, group=None))
    dist_opt = st.distributed_optimizer(lane.optimizer)
    sd = lane.optimizer.state_dict()
    lane.optimizer.load_state_dict(sd)
    raw_shared = st.shared_step_count(dist_opt)
    st.load_optimizer_state_dict(lane.optimizer, sd)
    fixed_shared = st.shared_step_count(dist_opt)
    ok_b = raw_shared > 0 and fixed_shared == 0
    state, seconds = _timed(lane.gather_dp_zero)
    if rank == 0:
        print(
            f"[core] bug (b) shared steps raw={raw_shared} fixed={fixed_shared} "
            f"{'PASS' if ok_b else 'FAIL'}",
            flush=True,
        )
        nbytes = st.state_nbytes(state)
        src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").normal_()
        pinned = torch.empty(src.shape, dtype=src.dtype, pin_memory=not a.cpu)
        pageable = torch.empty(src.shape, dtype=src.dtype)
        _timed(lambda: pinned.copy_(src))  # warm-up
        _, t_pinned = _timed(lambda: pinned.copy_(src))
        _, t_pageable = _timed(lambda: pageable.copy_(src))
        gb = nbytes / 1e9
        print(
            f"[core] state {gb:.2f} GB; dp_zero_gather {seconds:.2f}s = {gb / seconds:.2f} GB/s; "
            f"D2H pinned {gb / t_pinned:.2f} GB/s, pageable {gb / t_pageable:.2f} GB/s; "
            f"gather/pinned = {t_pinned / seconds:.3f}x, gather/pageable = "
            f"{t_pageable / seconds:.3f}x of copy speed",
            flush=True,
        )
        del src, pinned, pageable
        st.save_dp_zero(state, work / "state.tmp")
        (work / "state.tmp").rename(work / "state.pt")
        del state
        (work / "ok_b").write_text(str(ok_b))
    _wait(work / "hybrid_restored", a.timeout)
    lane.apply(_synthetic_reduced(lane, 2))
    after = lane.gather_dp_zero()
    if rank == 0:
        _wait(work / "hybrid_next.pt", a.timeout)
        other = st.load_dp_zero(work / "hybrid_next.pt")
        bad = _equal(after, other)
        print(f"[core] next update Core vs Hybrid bitwise: {bad or 'PASS'}", flush=True)
        (work / "ok_next").write_text(str(not bad))


def hybrid(rank: int, size: int, a: argparse.Namespace, work: Path) -> None:
    from ehp_fsm.backends.megatron import state as st

    lane = _build(a, "hybrid", 0, 1)
    _wait(work / "state.pt", a.timeout)
    state = st.load_dp_zero(work / "state.pt")
    _, seconds = _timed(lambda: lane.scatter_dp_zero(state))
    gb = st.state_nbytes(state) / 1e9
    mine = lane.gather_dp_zero()
    bad = _equal(state, mine)
    print(
        f"[hybrid] dp_zero_scatter {seconds:.2f}s = {gb / seconds:.2f} GB/s; restored state "
        f"bitwise equal to the Core's: {bad or 'PASS'}",
        flush=True,
    )
    (work / "ok_restore").write_text(str(not bad))
    (work / "hybrid_restored").write_text("1")
    lane.apply(_synthetic_reduced(lane, 2))
    st.save_dp_zero(lane.gather_dp_zero(), work / "hybrid_next.tmp")
    (work / "hybrid_next.tmp").rename(work / "hybrid_next.pt")


def _entry(fn: Any, rank: int, size: int, port: int, device: int, a: Any, work: str) -> None:
    import warnings

    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if a.cpu:
        from ehp_fsm.backends.megatron import cpu

        cpu.apply()
    torch.cuda.set_device(device)
    try:
        torch.distributed.init_process_group(
            "gloo" if a.cpu else "nccl", rank=rank, world_size=size
        )
        fn(rank, size, a, Path(work))
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        raise


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    if not torch.cuda.is_available() and not a.cpu:
        print("megatron_check: no CUDA device; this script is for GPU machines", file=sys.stderr)
        return 2
    gpus = 2 if a.cpu else torch.cuda.device_count()
    name = "CPU dry run" if a.cpu else torch.cuda.get_device_name(0)
    core_size = min(2, gpus)
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    for f in work.iterdir():
        f.unlink()
    print(
        f"megatron_check: {gpus} GPU(s) {name}; Core DP={core_size}, Hybrid on GPU {gpus - 1}",
        flush=True,
    )
    ctx = mp.get_context("spawn")
    procs = []
    cport, hport = _port(), _port()
    for r in range(core_size):
        procs.append(ctx.Process(target=_entry, args=(core, r, core_size, cport, r, a, str(work))))
    procs.append(ctx.Process(target=_entry, args=(hybrid, 0, 1, hport, gpus - 1, a, str(work))))
    t0 = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(1.0, a.timeout - (time.monotonic() - t0)))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    oks = [
        (work / n).read_text() == "True" if (work / n).exists() else False
        for n in ("ok_b", "ok_restore", "ok_next")
    ]
    passed = not alive and all(p.exitcode == 0 for p in procs) and all(oks)
    print(
        f"megatron_check: {'PASS' if passed else 'FAIL'} (bug b, restore, next update = {oks}; "
        f"{time.monotonic() - t0:.0f}s)",
        flush=True,
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
