"""Benchmark (issue 8): training-phase time per step with one borrowed Hybrid replica against
Core-only at the same global batch, in one run; and the state-load latency of a borrow.

Training phase (this file's part): one `TrainerPool` of real processes — Core DP=1 plus one warm
Hybrid worker, the embedded default policy (`PolicyConfig()`), the run's optimizer (`job_adam`:
fused AdamW; `--adam per-parameter` for torch's unset default), Gloo, ZeroMQ control, one torch
intra-op thread per worker (reported at hello and printed). For each global batch shape
(`--shapes`; default: the embedded default plan's `[grpo]` shape, read from
`examples/local.toml` (16x16), then 8x8 for comparison), blocks of Core-only steps
and of steps with the Hybrid active alternate (A B A B …) so drift on a shared machine hits both
alike; the figure is median(step wall with Hybrid) / median(step wall Core-only), as the
coordinator sees it (compute + ledger + reduce + apply, no revision save). Target ≤ 0.65×.
Per phase (slowest lane): compute wall, compute on-CPU time (thread time: what a free core
gives), reduce (includes waiting for the slower lane), apply, and the coordinator overhead (step
wall − compute − reduce − apply: control round trips, encoding, the ledger, scheduling). On a
2-core machine Core DP1 + 1 Hybrid are exactly 2 busy processes, so the ratio is meaningful only
when nothing else runs: the load average is printed before and after.

State load: `load_state` (DP-zero gather on the Core, point-to-point send, the warm worker
building its DP1 lane — a parked worker holds none — and the scatter into it) until the worker
reports its lane loaded, repeated `--loads` times per block, the worker parked between loads as
a run's return parks it.

Decision latency (`--decision-runs N`, default 3): whole `ehp-fsm run` jobs on a shortened
local plan whose planner borrows at the first step boundary; for each borrow, the time from the
planner's decision to the Hybrid's first training step (drain → stop the engine process →
finalizer → warm worker bound → state load → join at the boundary), from the run's receipt.
Target ≤ 1 s median (the anchor: a published "GPU switch within 1 second").

    python benchmarks/ehp_speedup.py [--shapes 16x16,8x8] [--steps 10] [--blocks 3]
                                     [--adam job|per-parameter] [--decision-runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from ehp_fsm.core.batch import partition_groups
from ehp_fsm.plan import load_plan
from ehp_fsm.run.startup import job_adam
from ehp_fsm.training.adam import AdamConfig
from ehp_fsm.training.grpo import synthetic_groups
from ehp_fsm.training.policy import PolicyConfig
from ehp_fsm.training.pool import PoolConfig, PoolFailure, StepResult, TrainerPool


def _park(pool: TrainerPool) -> None:
    """The warm worker drops its lane, as at a run's return (the next load builds it again)."""
    held = pool.park(1)
    if isinstance(held, PoolFailure) or not held.free:
        raise SystemExit(f"park failed: {held}")


def _run_steps(
    pool: TrainerPool, first: int, count: int, *, epoch: int, groups: int, group_size: int
) -> list[StepResult]:
    out = []
    for step in range(first, first + count):
        batch = synthetic_groups(
            range(step * groups, (step + 1) * groups),
            group_size=group_size,
            config=pool.config.policy,
            seed=1,
        )
        part = partition_groups(
            groups=batch.group_ids,
            live=dict.fromkeys(pool.live_replicas(), 1),
            group_size=group_size,
            step=step,
            epoch=epoch,
        )
        res = pool.step(step=step, epoch=epoch, partition=part, batch=batch, publish=False)
        if isinstance(res, PoolFailure):
            raise SystemExit(f"step {step} failed: {res}")
        out.append(res)
    return out


def _shape(text: str) -> tuple[int, int]:
    g, n = text.lower().split("x")
    return int(g), int(n)


def training_phase(
    *,
    shapes: list[tuple[int, int]],
    steps: int,
    blocks: int,
    loads: int,
    warmup: int,
    adam: AdamConfig,
) -> tuple[float, dict[int, int], list[dict[str, float]]]:
    """One pool; for each (groups, group_size): A/B blocks and the state loads. Returns the
    pool start time, the workers' intra-op thread counts and one figure dict per shape."""
    cfg = PoolConfig(policy=PolicyConfig(), seed=0, core_dp=1, max_hybrids=1, adam=adam)
    figures = []
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        pool = TrainerPool.spawn(cfg, work_dir=Path(tmp))
        start_s = time.monotonic() - t0
        threads = {w.rank: w.intra_op_threads for w in pool.workers}
        try:
            step, epoch = 0, 0
            for groups, group_size in shapes:
                core: list[StepResult] = []
                ehp: list[StepResult] = []
                load_s: list[float] = []
                kw = {"groups": groups, "group_size": group_size}
                _run_steps(pool, step, warmup, epoch=epoch, **kw)
                step += warmup
                for _ in range(blocks):
                    core += _run_steps(pool, step, steps, epoch=epoch, **kw)
                    step += steps
                    for i in range(loads):
                        got = pool.load_state(1, replica="hybrid:bench")
                        if isinstance(got, PoolFailure):
                            raise SystemExit(f"load_state failed: {got}")
                        load_s.append(got.seconds)
                        if i < loads - 1:
                            pool.deactivate("hybrid:bench")
                            _park(pool)
                    pool.activate("hybrid:bench")
                    epoch += 1
                    _run_steps(pool, step, warmup, epoch=epoch, **kw)
                    step += warmup
                    ehp += _run_steps(pool, step, steps, epoch=epoch, **kw)
                    step += steps
                    pool.deactivate("hybrid:bench")
                    _park(pool)
                    epoch += 1
                figures.append(_figures(groups, group_size, core, ehp, load_s))
        finally:
            pool.shutdown()
    return start_s, threads, figures


def _figures(
    groups: int,
    group_size: int,
    core: list[StepResult],
    ehp: list[StepResult],
    load_s: list[float],
) -> dict[str, float]:
    def med(rs: list[StepResult], phase: str | None = None) -> float:
        if phase is None:
            return statistics.median(r.wall_s for r in rs)
        return statistics.median(r.phase_s(phase) for r in rs)  # type: ignore[arg-type]

    def overhead(rs: list[StepResult]) -> float:
        return statistics.median(
            r.wall_s - r.phase_s("compute_s") - r.phase_s("reduce_s") - r.phase_s("apply_s")
            for r in rs
        )

    return {
        "groups": float(groups),
        "group_size": float(group_size),
        "core_step_s": med(core),
        "ehp_step_s": med(ehp),
        "ratio": med(ehp) / med(core),
        "core_compute_s": med(core, "compute_s"),
        "ehp_compute_s": med(ehp, "compute_s"),
        "core_reduce_s": med(core, "reduce_s"),
        "ehp_reduce_s": med(ehp, "reduce_s"),
        "core_compute_cpu_s": med(core, "compute_cpu_s"),
        "ehp_compute_cpu_s": med(ehp, "compute_cpu_s"),
        "core_apply_s": med(core, "apply_s"),
        "ehp_apply_s": med(ehp, "apply_s"),
        "core_overhead_s": overhead(core),
        "ehp_overhead_s": overhead(ehp),
        "load_median_s": statistics.median(load_s),
        "load_max_s": max(load_s),
        "loads": float(len(load_s)),
        "steps_each": float(len(core)),
    }


_SHORT = Path(__file__).resolve().parents[1] / "examples" / "short.toml"
_LOCAL = Path(__file__).resolve().parents[1] / "examples" / "local.toml"


def decision_latency(runs: int) -> list[float]:
    """Borrow latencies (decision → Hybrid training) from `runs` whole jobs."""
    import io
    import json

    from ehp_fsm.plan import load_plan
    from ehp_fsm.run.job import run

    out: list[float] = []
    for i in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            log = Path(tmp) / "run" / "transitions.jsonl"
            plan_path = Path(tmp) / "plan.toml"
            plan_path.write_text(
                _SHORT.read_text()
                .replace('log = "runs/short/transitions.jsonl"', f'log = "{log}"')
                .replace("prompts_per_step = 4", "prompts_per_step = 8")
                # the plan is written elsewhere: the example's model and data by absolute path
                .replace('path = "../runs/', f'path = "{_SHORT.parent.parent}/runs/')
                .replace('train = "data/', f'train = "{_SHORT.parent}/data/')
            )
            run(load_plan(plan_path), out=io.StringIO())
            receipt = json.loads((log.parent / "receipt.json").read_text())
            got = [m["latency_s"] for m in receipt["moves"] if m["kind"] == "borrow"]
            print(f"  run {i + 1}: borrow latencies {[round(x, 3) for x in got]} s")
            out += got
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    grpo = load_plan(_LOCAL).grpo
    default = f"{grpo.prompts_per_step}x{grpo.group_size}"
    p.add_argument(
        "--shapes",
        default=",".join(dict.fromkeys([default, "8x8"])),
        help="global batch shapes GROUPSxGROUP_SIZE, comma-separated (default: the embedded "
        f"default plan's {default} first, then 8x8)",
    )
    p.add_argument("--steps", type=int, default=10, help="timed steps per block")
    p.add_argument("--blocks", type=int, default=3, help="A/B block pairs")
    p.add_argument("--loads", type=int, default=3, help="state loads per block")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--adam",
        choices=("job", "per-parameter"),
        default="job",
        help="job: the run's optimizer (fused AdamW); per-parameter: torch's unset default",
    )
    p.add_argument("--decision-runs", type=int, default=3, help="whole runs for the latency")
    a = p.parse_args()
    adam = job_adam(1e-3) if a.adam == "job" else AdamConfig(lr=1e-3, eps=1e-6)
    print(f"load average before: {_load()}")
    start_s, threads, figures = training_phase(
        shapes=[_shape(x) for x in a.shapes.split(",")],
        steps=a.steps,
        blocks=a.blocks,
        loads=a.loads,
        warmup=a.warmup,
        adam=adam,
    )
    print(
        f"training phase: Core DP1 + 1 warm Hybrid, PolicyConfig(), Adam {a.adam} "
        f"({'fused' if adam.fused else 'per-parameter'}), intra-op threads per worker "
        f"(rank: threads, as reported at hello) {threads}"
    )
    print(f"pool start (2 processes, Gloo, groups, models): {start_s:.2f} s")
    for r in figures:
        g, n = int(r["groups"]), int(r["group_size"])
        print(
            f"B = {g}x{n} = {g * n}: step wall (median of {int(r['steps_each'])}): Core-only "
            f"{r['core_step_s'] * 1e3:.1f} ms, with Hybrid {r['ehp_step_s'] * 1e3:.1f} ms -> "
            f"ratio {r['ratio']:.3f}x (target <= 0.65x)"
        )
        for phase in ("compute", "compute_cpu", "reduce", "apply", "overhead"):
            c, e = r[f"core_{phase}_s"], r[f"ehp_{phase}_s"]
            print(
                f"  {phase:<11} Core-only {c * 1e3:7.2f} ms   "
                f"with Hybrid {e * 1e3:7.2f} ms (slowest lane)"
            )
        print(
            f"  state load (load_state -> ready), {int(r['loads'])} loads: "
            f"median {r['load_median_s'] * 1e3:.1f} ms, max {r['load_max_s'] * 1e3:.1f} ms"
        )
    print(f"load average after the training phase: {_load()}")
    if a.decision_runs:
        print(f"decision -> Hybrid training, {a.decision_runs} whole runs (shortened local plan):")
        lat = decision_latency(a.decision_runs)
        if lat:
            med = statistics.median(lat)
            print(
                f"borrow latency median {med:.3f} s, max {max(lat):.3f} s over {len(lat)} "
                f"borrows -> {med:.2f}x the 1 s anchor (target <= 1.0x)"
            )


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
