"""Benchmark: what handing the reward to its own thread costs the run's loop, per completion
(`Reward.score_sync`, one hand-over per completion: what the run did before 2026-12-02)
against per group (`Reward.score_group_sync`, one hand-over per prompt's group of n).

One process. A step's scoring: `--groups` groups of `--n` completions (default 32 × 16 = 512
samples), a trivial reward (`exact_match`, ~0.1 µs a call). Baseline, measured in the same
run: the reward called directly in the loop, no thread (what the run did before rewards got a
thread, and what cannot time out). Modes, interleaved within each of `--repeats` rounds so a
busy machine slows them alike: direct, per completion, per group; with `--async`, the same
trivial reward as an `async def` per completion (an `asyncio.run` each) and per group (one
event loop per group). Printed: each mode's median round (ms a step, µs a completion) and its
ratio to the direct baseline's median; then per completion / per group (medians, same run).

    PYTHONPATH=src python benchmarks/reward_handover.py [--groups 32] [--n 16] [--repeats 15]

Run against a tree without `score_group_sync` (e.g. `git archive main src`), it measures the
direct and per-completion modes only: the old per-completion hand-over, as it was.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

from ehp_fsm.data.rewards import Reward, exact_match

Step = Callable[[], None]


async def async_exact_match(
    prompt: str, completion: str, label: str, metadata: Mapping[str, Any]
) -> float:
    return exact_match(prompt, completion, label, metadata)


def groups_of(g: int, n: int) -> list[tuple[str, list[str], str]]:
    """`g` prompts, each with `n` completions, about one in `n` right."""
    return [(f"{i}+1=", [str(i + 1 - (k % n)) for k in range(n)], str(i + 1)) for i in range(g)]


def modes(groups: list[tuple[str, list[str], str]], with_async: bool) -> dict[str, Step]:
    sync = Reward(fn=exact_match, name="exact_match")
    meta: dict[str, Any] = {}

    def direct() -> None:
        for prompt, comps, label in groups:
            for c in comps:
                exact_match(prompt, c, label, meta)

    def per_completion(r: Reward) -> Step:
        def step() -> None:
            for prompt, comps, label in groups:
                for c in comps:
                    r.score_sync(prompt, c, label, meta)

        return step

    def per_group(r: Reward) -> Step:
        def step() -> None:
            for prompt, comps, label in groups:
                r.score_group_sync(prompt, comps, label, meta)

        return step

    out: dict[str, Step] = {"direct": direct, "per completion": per_completion(sync)}
    grouped = hasattr(Reward, "score_group_sync")
    if grouped:
        out["per group"] = per_group(sync)
    if with_async:
        areward = Reward(fn=async_exact_match, name="async")
        out["async, per completion"] = per_completion(areward)
        if grouped:
            out["async, per group"] = per_group(areward)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--n", type=int, default=16, help="completions per group")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--async", dest="with_async", action="store_true")
    args = ap.parse_args()
    groups = groups_of(args.groups, args.n)
    samples = args.groups * args.n
    steps = modes(groups, args.with_async)
    for step in steps.values():  # warm: threads started, first loops made
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["direct"])
    print(f"{args.groups} groups × {args.n} completions = {samples} a step; {args.repeats} rounds")
    print(f"{'mode':24} {'ms/step':>9} {'µs/compl.':>10} {'× direct':>10}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:24} {med * 1e3:9.3f} {med / samples * 1e6:10.3f} {med / base:10.1f}")
    for kind in ("", "async, "):
        one, group = times.get(f"{kind}per completion"), times.get(f"{kind}per group")
        if one and group:
            gain = statistics.median(one) / statistics.median(group)
            print(f"{kind}per completion / per group: {gain:.1f}×")


if __name__ == "__main__":
    main()
