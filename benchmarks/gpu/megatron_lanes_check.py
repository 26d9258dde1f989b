"""GPU check (issue 15, one H200, < 10 min): the Megatron Core lane and a Hybrid lane of
`ehp-fsm run` on one GPU, built from a generated ~0.5B Qwen3-architecture HF model in bf16
through mbridge (`MegatronBackend(hf_model=...)`, what `training.lanes` builds).

Two processes share GPU 0. NCCL cannot hold two ranks of one communicator on one device, so each
lane is its own world (Core DP1, Hybrid DP1) and the DP-zero state passes through a file
(`torch.save`, read back with `weights_only=True`). Checks, each printed with PASS/FAIL:
1. Adam temporaries on CUDA (Core, steps 2 and 3 of the same state): peak extra CUDA memory of
   an optimizer step with the backend's per-parameter rule against torch's automatic choice on
   CUDA (`foreach=True`), measured in the same process.
2. State transfer: DP-zero gather on the Core, timed, in GB/s against a plain device-to-host
   copy of the same bytes (pinned and pageable) measured in the same process.
3. DP-zero restore: the Hybrid (started from perturbed weights) scatters the Core's state; its
   own gather and its HF export must equal the Core's bit for bit.
4. Next update: the Core computes one GRPO delivery (token_mean, clip-higher) and applies it; the
   Hybrid applies the same reduced gradient; states must be equal bit for bit again (the
   Hybrid's own delivery of the same batch is compared and reported).
5. Parking, as the run's warm worker parks a Megatron lane (`training.worker._empty_lane`: every
   storage of its parameters, DDP buffers, FP32 masters and Adam state resized to 0 bytes, the
   lane and its world kept; every other CUDA tensor it still references moved to host memory),
   then measured as the worker measures it (`training.memory.measure`: torch's allocated and
   reserved bytes after `empty_cache`, NVML's figure for the process against what it held
   outside torch's allocator right before parking). What torch still has allocated is listed
   (live CUDA tensors by size). This process then reads NVML: after the Hybrid exits, no
   process of that pid holds GPU memory.

`--cpu`: a dry run of the same logic on CPU (Gloo, Megatron's CPU layer, the tiny model; no
NVML, figures meaningless) — what CPU CI can check of this script. Needs torch with CUDA,
megatron-core 0.16.1, mbridge 0.15.1 (+ einops), nvidia-ml-py, structlog (see `wheels.txt`).

Usage: python benchmarks/gpu/megatron_lanes_check.py [--cpu] [--workdir DIR] [--timeout 540]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

# ~0.44 B parameters, Qwen3-0.6B's layer shapes (the character vocabulary keeps the embedding
# small, so nearly all of it is transformer layers).
SHAPE = dict(
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    max_position_embeddings=64,
)


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="dry run on CPU (tiny model)")
    p.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "megatron_lanes"))
    p.add_argument("--timeout", type=float, default=540.0)
    return p.parse_args(argv)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn: Any) -> tuple[Any, float]:
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - t0


def _wait(path: Path, timeout: float = 400.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout}s")
        time.sleep(0.05)


def _put(work: Path, name: str, obj: Any) -> None:
    tmp = work / f".{name}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, work / f"{name}.pt")


def _get(work: Path, name: str) -> Any:
    _wait(work / f"{name}.pt")
    return torch.load(work / f"{name}.pt", weights_only=True)


def _put_state(work: Path, name: str, state: Any) -> None:
    from ehp_fsm.backends.megatron.state import save_dp_zero

    save_dp_zero(state, work / f".{name}.dpz")
    os.replace(work / f".{name}.dpz", work / f"{name}.dpz")


def _get_state(work: Path, name: str) -> Any:
    from ehp_fsm.backends.megatron.state import load_dp_zero

    _wait(work / f"{name}.dpz")
    return load_dp_zero(work / f"{name}.dpz")


def _report(work: Path, name: str, value: Any) -> None:
    (work / f"{name}.json").write_text(json.dumps(value))


def _batch() -> Any:
    from ehp_fsm.training.grpo import synthetic_groups
    from ehp_fsm.training.policy import PolicyConfig

    return synthetic_groups(range(8), group_size=8, config=PolicyConfig(), seed=7)


def _lane(model: Path, *, hybrid: bool) -> Any:
    from megatron.core import parallel_state

    from ehp_fsm.backends.megatron.backend import MegatronBackend, MegatronModelConfig
    from ehp_fsm.training.adam import AdamConfig
    from ehp_fsm.training.lane import LaneSpec
    from ehp_fsm.training.objective import ObjectiveConfig

    parallel_state.initialize_model_parallel(1, 1)
    be = MegatronBackend(
        MegatronModelConfig(micro_batch_groups=1 << 16),
        hf_model=str(model),
        objective=ObjectiveConfig(aggregation="token_mean"),
        perturb_seed=7919 if hybrid else None,
    )
    spec = LaneSpec(
        role="hybrid" if hybrid else "core",
        replica="hybrid:x" if hybrid else "core:0",
        param_dtype=torch.bfloat16,
        adam=AdamConfig(lr=1e-5, eps=1e-6),  # automatic: the backend's per-parameter rule
    )
    be.build(spec)
    return be


def _state_bytes(state: Any) -> int:
    from ehp_fsm.backends.megatron import state as st

    return int(st.state_nbytes(state))


def _step_peak(be: Any, grads: list[torch.Tensor]) -> int:
    """Peak extra CUDA memory (bytes) of one `apply` (0 on CPU)."""
    if not torch.cuda.is_available():
        be.apply(grads)
        return 0
    _sync()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    be.apply(grads)
    _sync()
    return int(torch.cuda.max_memory_allocated() - base)


def _set_foreach(be: Any, value: bool) -> None:
    from ehp_fsm.backends.megatron import state as st

    for group in st.distributed_optimizer(be.optimizer).optimizer.param_groups:
        group["foreach"] = value


def _d2h_gbps(nbytes: int, *, pinned: bool) -> float:
    """A plain device-to-host copy of `nbytes` (the baseline for the transfer)."""
    if not torch.cuda.is_available():
        return float("nan")
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty(src.shape, dtype=torch.float32, pin_memory=pinned)
    dst.copy_(src)  # warm-up
    _, s = _timed(lambda: dst.copy_(src))
    return nbytes / s / 1e9


def core(work: Path, model: Path) -> None:
    from ehp_fsm.backends.megatron.state import distributed_optimizer

    be = _lane(model, hybrid=False)
    batch = _batch()
    d = be.compute(batch, step=0, epoch=0)
    be.apply(list(d.grads))  # step 1
    d = be.compute(batch, step=1, epoch=0)
    per_param = _step_peak(be, list(d.grads))  # step 2: the backend's rule
    _set_foreach(be, True)
    d = be.compute(batch, step=2, epoch=0)
    foreach = _step_peak(be, list(d.grads))  # step 3: torch's automatic choice on CUDA
    _set_foreach(be, False)
    _report(work, "adam", {"per_parameter": per_param, "foreach": foreach})
    state, gather_s = _timed(be.gather_dp_zero)
    nbytes = _state_bytes(state)
    dist_opt = distributed_optimizer(be.optimizer)
    theirs, megatron_s = _timed(lambda: dist_opt.get_parameter_state_dp_zero(use_gloo_comm=True))
    _report(
        work,
        "transfer",
        {
            "bytes": nbytes,
            "gather_s": gather_s,
            "gather_gbps": nbytes / gather_s / 1e9,
            "megatron_gather_s": megatron_s,
            "megatron_gather_gbps": nbytes / megatron_s / 1e9,
            "gather_vs_megatron": _world_differs(state.buffers, theirs),
            "d2h_pinned_gbps": _d2h_gbps(nbytes, pinned=True),
            "d2h_pageable_gbps": _d2h_gbps(nbytes, pinned=False),
        },
    )
    _put_state(work, "state", state)
    _put(work, "core_hf", be.hf_state_dict())
    d = be.compute(batch, step=3, epoch=0)  # the next update
    _put(work, "grads", [g.cpu() for g in d.grads])
    be.apply(list(d.grads))
    _put_state(work, "core_next", be.gather_dp_zero())
    _put(work, "core_next_hf", be.hf_state_dict())


def _world_differs(ours: dict[Any, Any], theirs: dict[Any, Any]) -> list[str]:
    """Where the backend's world tensors differ from Megatron's own gather, by their bits."""
    bad = [] if set(ours) == {k for k in theirs if isinstance(k, int)} else ["buffers"]
    for idx, per_dtype in ours.items():
        for key, entry in per_dtype.items():
            for k in ("param", "exp_avg", "exp_avg_sq"):
                other = theirs[idx][key][k]
                if entry[k].shape != other.shape or not torch.equal(
                    entry[k].view(torch.int32), other.view(torch.int32)
                ):
                    bad.append(f"{idx}.{k}")
    return bad


def _equal(a: Any, b: Any) -> list[str]:
    bad = [] if a.version == b.version else ["version"]
    bad += [] if dict(a.steps) == dict(b.steps) else ["steps"]
    for idx, per_dtype in a.buffers.items():
        for key, entry in per_dtype.items():
            for k in ("param", "exp_avg", "exp_avg_sq"):
                if not torch.equal(entry[k].cpu(), b.buffers[idx][key][k].cpu()):
                    bad.append(f"{idx}.{k}")
    return bad


def _hf_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return sorted(set(a) ^ set(b)) + [k for k in a if k in b and not torch.equal(a[k], b[k])]


def _hybrid_lane(work: Path, model: Path) -> tuple[Any, dict[str, Any]]:
    """Build, restore, compare, take the next update, compare; returns the lane."""
    from ehp_fsm.backends.megatron import shards
    from ehp_fsm.backends.megatron.state import distributed_optimizer
    from ehp_fsm.training import memory

    be = _lane(model, hybrid=True)
    context = memory.cuda_context_bytes()  # the process's non-torch GPU memory after the build
    memory.baseline()  # as the warm worker does after building its lane: gc.freeze()
    state = _get_state(work, "state")
    _, scatter_s = _timed(lambda: be.scatter_dp_zero(state))
    restored = _equal(be.gather_dp_zero(), state) + _hf_equal(
        be.hf_state_dict(), _get(work, "core_hf")
    )
    # The copies of the restore timed alone, the backend's and then Megatron's own loader
    # (steps popped and under no_grad: its bug (a)) as the baseline, both reloading the same
    # state: the backend's full path ran first, from perturbed weights, so this changes
    # nothing the later checks see (checked: the gather after it equals the state).
    dist_opt = distributed_optimizer(be.optimizer)
    mains = [m for g in dist_opt.optimizer.param_groups for m in g["params"]]
    steps = {m: dist_opt.optimizer.state[m].pop("step") for m in mains}

    def megatron_load() -> None:
        with torch.no_grad():
            dist_opt.load_parameter_state_from_dp_zero(state.megatron_dict())

    def shards_load() -> None:
        with torch.no_grad():
            shards.scatter_world(dist_opt, state.buffers)

    _, shards_scatter_s = _timed(shards_load)  # the copies alone, as Megatron's loader does
    _, megatron_scatter_s = _timed(megatron_load)
    for main, step in steps.items():
        dist_opt.optimizer.state[main]["step"] = step
    reloaded = _equal(be.gather_dp_zero(), state)
    mine = be.compute(_batch(), step=3, epoch=0)
    grads = _get(work, "grads")
    diff = max(
        float((g.cpu() - m.cpu()).abs().max()) for g, m in zip(grads, mine.grads, strict=True)
    )
    device = next(be.model.parameters()).device
    be.apply([g.to(device) for g in grads])
    nxt = _equal(be.gather_dp_zero(), _get_state(work, "core_next")) + _hf_equal(
        be.hf_state_dict(), _get(work, "core_next_hf")
    )
    return be, {
        "scatter_s": scatter_s,
        "shards_scatter_s": shards_scatter_s,
        "megatron_scatter_s": megatron_scatter_s,
        "megatron_reload": reloaded,
        "restore": restored,
        "next": nxt,
        "own_delivery_max": diff,
        "context": context,
    }


def _live_cuda() -> list[str]:
    """The largest CUDA tensors Python still references (what keeps torch's counters up)."""
    from ehp_fsm.training import memory

    seen: dict[int, tuple[int, str]] = {}
    for t in memory.live_tensors():
        if t.is_cuda and t.untyped_storage().nbytes():
            st = t.untyped_storage()
            seen[st.data_ptr()] = (st.nbytes(), f"{tuple(t.shape)} {t.dtype}")
    return [f"{n} B {what}" for n, what in sorted(seen.values(), reverse=True)[:8]]


def hybrid(work: Path, model: Path) -> None:
    from ehp_fsm.training import memory

    be, report = _hybrid_lane(work, model)
    _report(work, "hybrid", report)
    # park as the run's warm worker parks a Megatron lane (the lane and its world stay)
    before_park = memory.cuda_context_bytes()
    emptied = memory.empty_storages(be.memory_tensors(), keep=("reference", "staging"))
    offloaded = memory.offload_cuda()
    held = memory.measure({}, frozen=0, nvml_baseline=before_park)
    cuda_only = replace(held, by_kind={}, other=0)  # the CPU tensors' part is not this check's
    _report(
        work,
        "parked",
        {
            "pid": os.getpid(),
            "emptied_bytes": sum(n for _, n in emptied),
            "offloaded_bytes": sum(h.nbytes() for _, h in offloaded),
            "context_after_build": report["context"],
            "allocated": held.cuda_allocated or 0,
            "reserved": held.cuda_reserved or 0,
            "nvml_used": held.nvml_used,
            "nvml_baseline": held.nvml_baseline,
            "why_not_free": cuda_only.why_not_free(),
            "live_cuda": _live_cuda() if torch.cuda.is_available() else [],
        },
    )
    _wait(work / "exit.json")


def _entry(fn: Any, port: int, cpu: bool, work: str, model: str) -> None:
    import warnings

    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if cpu:
        from ehp_fsm.backends.megatron import cpu as cpu_layer

        cpu_layer.apply()
    else:
        torch.cuda.set_device(0)
    try:
        torch.distributed.init_process_group("gloo" if cpu else "nccl", rank=0, world_size=1)
        fn(Path(work), Path(model))
        torch.distributed.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        raise


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _nvml_used(pid: int) -> tuple[int | None, int]:
    """(GPU memory NVML attributes to `pid` on GPU 0 — None when NVML lists no such process,
    e.g. it exited or sits in another pid namespace —, the device's used memory)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        mine = [p.usedGpuMemory for p in procs if p.pid == pid]
        used = int(pynvml.nvmlDeviceGetMemoryInfo(h).used)
        return (int(mine[0] or 0) if mine else None), used
    finally:
        pynvml.nvmlShutdown()


def _model(work: Path, cpu: bool) -> Path:
    from ehp_fsm.models.tiny import TinyShape, init_model

    dest = work / "model"
    shape = TinyShape() if cpu else TinyShape(**SHAPE)  # type: ignore[arg-type]
    init_model(dest, arch="qwen3", seed=0, shape=shape, dtype=torch.bfloat16)
    return dest


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    if not a.cpu and not torch.cuda.is_available():
        print("megatron_lanes_check: no CUDA device; run with --cpu for a dry run", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    work = Path(a.workdir)
    if work.exists():
        import shutil

        shutil.rmtree(work)
    work.mkdir(parents=True)
    model = _model(work, a.cpu)
    from safetensors import safe_open

    with safe_open(str(model / "model.safetensors"), "pt") as f:
        n = sum(int(torch.tensor(f.get_slice(k).get_shape()).prod()) for k in f.keys())  # noqa: SIM118
    where = "CPU dry run" if a.cpu else torch.cuda.get_device_name(0)
    print(f"megatron_lanes_check: {where}; Qwen3-architecture model {n / 1e6:.0f} M params, bf16")
    ctx = mp.get_context("spawn")
    procs = {
        name: ctx.Process(target=_entry, args=(fn, _port(), a.cpu, str(work), str(model)))
        for name, fn in (("core", core), ("hybrid", hybrid))
    }
    for p in procs.values():
        p.start()
    ok = True
    try:
        while not (work / "parked.json").exists():
            dead = [n for n, p in procs.items() if p.exitcode not in (None, 0)]
            if dead or time.monotonic() - t0 > a.timeout:
                raise RuntimeError(f"no parked Hybrid: {dead or 'time-out'} (see the output above)")
            time.sleep(0.1)
        parked = json.loads((work / "parked.json").read_text())
        nvml = None if a.cpu else _nvml_used(int(parked["pid"]))
    finally:
        (work / "exit.json").write_text("{}")
        for p in procs.values():
            p.join(max(1.0, a.timeout - (time.monotonic() - t0)))
            if p.is_alive():
                p.kill()
                ok = False
    ok = ok and all(p.exitcode == 0 for p in procs.values())
    after = None if a.cpu else _nvml_used(int(parked["pid"]))
    adam = json.loads((work / "adam.json").read_text())
    tr = json.loads((work / "transfer.json").read_text())
    hy = json.loads((work / "hybrid.json").read_text())
    checks = {
        "gather equals Megatron's own, bit for bit": tr["gather_vs_megatron"] == [],
        "restore bit-exact": hy["restore"] == [],
        "Megatron's own loader gives the same state": hy["megatron_reload"] == [],
        "next update bit-exact": hy["next"] == [],
        "parked lane emptied": parked["emptied_bytes"] > 0,
    }
    if not a.cpu:
        assert nvml is not None and after is not None
        checks["Adam temporaries below foreach"] = adam["per_parameter"] < adam["foreach"]
        checks["exited worker holds no GPU memory (NVML)"] = after[0] is None
        checks["parked lane: torch holds nothing on the GPU"] = (
            parked["allocated"] == 0 and parked["reserved"] == 0
        )
        checks["parked lane: NVML sees no more than the CUDA context"] = (
            parked["nvml_used"] is not None
            and parked["nvml_baseline"] is not None
            and parked["nvml_used"] <= parked["nvml_baseline"]
        )
        print(
            f"  parked lane: emptied {parked['emptied_bytes'] / 2**30:.2f} GiB, offloaded "
            f"{parked['offloaded_bytes']} B to host; torch allocated {parked['allocated']} B, "
            f"reserved {parked['reserved']} B; NVML {parked['nvml_used']} B vs "
            f"{parked['nvml_baseline']} B outside torch's allocator before parking "
            f"({parked['context_after_build']} B after the build); the worker's CUDA verdict: "
            f"{parked['why_not_free'] or 'free'}"
        )
        for line in parked["live_cuda"]:
            print(f"    live CUDA tensor: {line}")
        print(
            f"  NVML: parked Hybrid pid {parked['pid']}: {nvml[0]} B (its CUDA context), device "
            f"used {nvml[1] / 2**30:.2f} GiB; after it exited: {after[0]} B, device used "
            f"{after[1] / 2**30:.2f} GiB"
        )
    print(
        f"  Adam step peak extra CUDA memory: per-parameter {adam['per_parameter'] / 2**20:.1f} "
        f"MiB vs foreach {adam['foreach'] / 2**20:.1f} MiB"
    )
    print(
        f"  state {tr['bytes'] / 2**30:.2f} GiB: DP-zero gather {tr['gather_s']:.3f} s = "
        f"{tr['gather_gbps']:.2f} GB/s vs Megatron's own {tr['megatron_gather_s']:.3f} s = "
        f"{tr['megatron_gather_gbps']:.2f} GB/s ({tr['megatron_gather_s'] / tr['gather_s']:.1f}x"
        f" faster) vs plain D2H copy pinned {tr['d2h_pinned_gbps']:.2f} GB/s, pageable "
        f"{tr['d2h_pageable_gbps']:.2f} GB/s"
    )
    print(
        f"  Hybrid restore (scatter_dp_zero) {hy['scatter_s']:.3f} s; its copies alone "
        f"{hy['shards_scatter_s']:.3f} s = {tr['bytes'] / hy['shards_scatter_s'] / 1e9:.2f} GB/s "
        f"vs Megatron's own loader {hy['megatron_scatter_s']:.3f} s "
        f"({hy['megatron_scatter_s'] / hy['shards_scatter_s']:.1f}x faster)"
    )
    print(f"  the Hybrid's own delivery of the same batch: max |Δ| {hy['own_delivery_max']:.3e}")
    for name, good in checks.items():
        print(f"  {'PASS' if good else 'FAIL'} {name}")
        ok = ok and good
    print(f"megatron_lanes_check: {'PASS' if ok else 'FAIL'} in {time.monotonic() - t0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
