"""Benchmark (issue 15): borrow latency of `examples/local-megatron.toml` — the time from the
planner's decision to the Hybrid's first training step (drain → stop the engine process → GPU
finalizer → warm worker bound → DP-zero state load → join at a step boundary), with Megatron-Core
Core and Hybrid lanes — against the same plan on the torch backend, measured in the same
session (runs alternate: megatron, torch, megatron, …, so drift on a shared machine hits both).

Each run is a whole `ehp-fsm run` (in this process, like `ehp_speedup.py`'s decision latency) of
the example with `--steps` steps; with `--eager` (the default) its planner borrows at the first
step boundary (the example's floor, `[ehp] min_hybrids = 1`, since 2026-12-07; before, tiny
thresholds and zero costs, and the planner borrowed only where its predicted step gained: on
2026-12-04 in 3 of 6 runs). With `--no-eager` the floor is 0 and the measured times decide. The
latencies come from each run's receipt (`moves`, kind `borrow`). Target: median ≤ 1 s.

With `--tp 2` the runs alternate `examples/local-megatron-tp2.toml` (the example at Megatron
TP 2: the Core on two slots of h0, a fourth engine on h2, `replica_size = 2`: a Hybrid is a TP 2
lane borrowed from two engine slots) against the example itself at TP 1 (the baseline), instead
of against torch; with `--pp 2`, `examples/local-megatron-pp2.toml` (the same at PP 2: a lane
of two pipeline stages) against TP 1.

    python benchmarks/megatron_borrow.py [--runs 3] [--steps 12] [--eager | --no-eager]
        [--tp 2 | --pp 2]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

from ehp_fsm.plan import load_plan
from ehp_fsm.run.job import run

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PLAN = EXAMPLES / "local-megatron.toml"


def plan_text(backend: str, log: Path, *, steps: int, eager: bool, shape: str = "") -> str:
    """The example (with `shape` "tp2" or "pp2": `examples/local-megatron-<shape>.toml`) with
    this run's backend, log and steps, paths made absolute."""
    text = (EXAMPLES / f"local-megatron-{shape}.toml" if shape else PLAN).read_text()
    text = text.replace('backend = "megatron"', f'backend = "{backend}"')
    text = re.sub(r'log = "[^"]*"', f'log = "{log}"', text, count=1)
    text = re.sub(r"\nsteps = \d+", f"\nsteps = {steps}", text)
    text = text.replace('path = "../', f'path = "{EXAMPLES.parent}/')
    text = text.replace('train = "data/', f'train = "{EXAMPLES}/data/')
    floor = re.search(r"\nmin_hybrids = 1\n", text)
    assert floor is not None, "the example lost its floor (`[ehp] min_hybrids = 1`)"
    if not eager:  # the measured times decide
        text = text.replace("\nmin_hybrids = 1\n", "\nmin_hybrids = 0\n")
    return text


def one_run(backend: str, *, steps: int, eager: bool, shape: str = "") -> tuple[list[float], float]:
    """Borrow latencies (s) of one whole run, and its wall time."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "run" / "transitions.jsonl"
        path = Path(tmp) / "plan.toml"
        path.write_text(plan_text(backend, log, steps=steps, eager=eager, shape=shape))
        t0 = time.perf_counter()
        status = run(load_plan(path), out=io.StringIO())
        wall = time.perf_counter() - t0
        receipt = json.loads((log.parent / "receipt.json").read_text())
        if status != 0:
            raise SystemExit(f"{backend} run failed ({status}): {receipt.get('error')}")
        return [m["latency_s"] for m in receipt["moves"] if m["kind"] == "borrow"], wall


def _ms(xs: list[float]) -> str:
    return "[" + ", ".join(f"{x * 1e3:.0f}" for x in xs) + "]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="runs per backend (alternating)")
    p.add_argument("--steps", type=int, default=12, help="steps per run")
    p.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--tp", type=int, default=1, choices=(1, 2), help="2: TP 2 against TP 1")
    p.add_argument("--pp", type=int, default=1, choices=(1, 2), help="2: PP 2 against TP 1")
    a = p.parse_args()
    if a.tp > 1 and a.pp > 1:
        p.error("--tp 2 and --pp 2 are two comparisons: run them one at a time")
    shape = f"tp{a.tp}" if a.tp > 1 else f"pp{a.pp}" if a.pp > 1 else ""
    plans = f"local-megatron-{shape}.toml against {PLAN.name}" if shape else PLAN.name
    print(f"plan: {plans}, {a.steps} steps per run, eager borrow: {a.eager}")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    # (label, backend, shape): the measured variant first, its baseline second
    variants = (
        [(f"megatron-{shape}", "megatron", shape), ("megatron", "megatron", "")]
        if shape
        else [("megatron", "megatron", ""), ("torch", "torch", "")]
    )
    got: dict[str, list[float]] = {label: [] for label, _, _ in variants}
    for i in range(a.runs):
        for label, backend, variant in variants:
            lat, wall = one_run(backend, steps=a.steps, eager=a.eager, shape=variant)
            got[label] += lat
            print(f"  run {i + 1} {label:<12} wall {wall:6.1f} s, borrow latencies ms {_ms(lat)}")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    med = {b: statistics.median(x) if x else float("nan") for b, x in got.items()}
    for label, xs in got.items():
        print(
            f"{label:<12} borrow latency median {med[label] * 1e3:.0f} ms over {len(xs)} "
            f"borrows (max {max(xs, default=float('nan')) * 1e3:.0f} ms)"
        )
    (measured, _, _), (baseline, _, _) = variants
    print(
        f"{measured} / {baseline}: {med[measured] / med[baseline]:.2f}x; {measured} median vs "
        f"the 1 s target: {med[measured]:.2f}x (target <= 1.0x)"
    )


if __name__ == "__main__":
    main()
