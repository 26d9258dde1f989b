"""`ehp-fsm simulate` at cluster scale: wall time, simulated transitions per second, peak memory,
the factor per doubling of hosts, and the EHP speed-up of examples/gpu-4x8.toml.

Each size runs in its own process (so its peak RSS is its own): `examples/gpu-4x8.toml` repeated
to N hosts × 8 GPUs (`sim.cluster.scale`: Core DP, reserve, max_hybrids and the global batch
grow with the cluster — G = 16 groups per host), `--steps` steps, faults `on` (the documented
rates), invariants checked at every event, the transition log written.

Baseline, measured in the same run: `ehp-fsm replay` of the smallest size's log in one process
— the same core re-stepping the same transitions with no simulation around it; "sim/replay" is
the simulation's rate over the bare engine's.

Targets (issue 17): 1,024 hosts × 500 steps in ≤ 60 s, ≥ 100,000 transitions/s, ≤ 2 GiB, and
cost at most linear in hosts. `--target` runs that configuration as well (hours on this VM at
the rates measured so far; it is not run by default).

    .venv/bin/python benchmarks/simulate.py                       # 128..4096 hosts, 2 steps
    .venv/bin/python benchmarks/simulate.py --sizes 128 256 --steps 3 --ehp-steps 100
    .venv/bin/python benchmarks/simulate.py --sizes 1024 --steps 2 --kinds --ehp-steps 0
    .venv/bin/python benchmarks/simulate.py --sizes 256 --steps 12 --ehp-steps 0 \\
        --compare /tmp/base/src --pairs 3     # A/B against another tree, CPU-time medians

`--kinds` counts each size's log records by (machine, event), per step: where the
transitions come from (at 1,024 hosts, five per group — enqueue, dispatch, complete, claim,
consume — are ~9 in 10 of them: the request machine's lifecycle the run logs too).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "examples" / "gpu-4x8.toml"


def one(hosts: int, steps: int, log: str, faults: str) -> None:
    """Child: one simulated run; prints its figures as JSON."""
    from ehp_fsm.plan import load_plan
    from ehp_fsm.sim.cluster import scale
    from ehp_fsm.sim.command import quiet_loop_logs
    from ehp_fsm.sim.story import Simulation

    quiet_loop_logs()
    plan = scale(load_plan(PLAN), hosts)
    t0, c0 = time.perf_counter(), time.process_time()
    r = Simulation(plan, seed=0, faults=faults, steps=steps, log_path=log).run()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        json.dumps(
            {
                "hosts": hosts,
                "gpus": r.gpus,
                "groups_per_step": plan.grpo.prompts_per_step,
                "wall_s": wall,
                "transitions": r.transitions,
                "rate": r.transitions / wall,
                "cpu_s": cpu,
                "cpu_rate": r.transitions / cpu,
                "rss_mib": rss,
                "virtual_s": r.virtual_s,
                "faults": r.faults_seen,
                "log_mib": Path(log).stat().st_size / 2**20,
            }
        )
    )


def child(args: list[str], src: Path = ROOT / "src") -> dict[str, Any]:
    """One size in its own process, with the simulator from `src` (this tree's, or the
    `--compare` tree's: the same script and plan against another version of the code)."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run(
        [sys.executable, __file__, "--one", *args], capture_output=True, text=True, env=env
    )
    if out.returncode != 0:
        raise SystemExit(f"child {args} failed:\n{out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def kinds(log: str, steps: int) -> str:
    """Where the transitions come from: the log's records by (machine, event), per step."""
    counts: Counter[tuple[str, str]] = Counter()
    with open(log, "rb") as f:
        next(f)
        for line in f:
            r = json.loads(line)
            if "machine" in r:
                counts[(r["machine"], r["event"])] += 1
    total = sum(counts.values())
    rows = [
        f"        {n / steps:>10,.0f}/step {n / total:6.1%}  {m} {e}"
        for (m, e), n in counts.most_common(12)
    ]
    return "\n".join([f"      records by machine and event ({total:,} in all):", *rows])


def replay_rate(log: str) -> float:
    from ehp_fsm.replay import replay

    t0 = time.perf_counter()
    r = replay(log, jobs=1)
    return r.transitions / (time.perf_counter() - t0)


def ehp_speedup(steps: int) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            [
                *(sys.executable, "-m", "ehp_fsm.cli", "simulate", str(PLAN)),
                *("--steps", str(steps), "--ehp", "both", "--out", tmp),
            ],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
    return out.stdout[out.stdout.index("EHP off vs on") :].rstrip()


def _digest(path: str) -> bytes:
    """A log's SHA-256, read in pieces: reading two whole logs into this process made it as big
    as both (600 MiB at 1,024 × 10), and a child forked from it reports at least that peak RSS
    (Linux keeps `ru_maxrss` across the child's `exec`)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.digest()


def pairs(hosts: int, a: argparse.Namespace, log: str, first: dict[str, Any]) -> str:
    """`a.pairs` paired runs of one size, this tree against `a.compare` (the first run of this
    tree is `first`, already made), each pair back to back, alternating which tree goes
    first. On a shared machine CPU time moves between runs with the other jobs' load; a pair's
    two runs see about the same load, so the ratio within a pair, and its median over pairs,
    is the figure to read. Every run's log must be byte-identical to the first's."""
    args = [str(hosts), str(a.steps)]
    ours, theirs, same = [float(first["cpu_s"])], list[float](), True
    rss: dict[str, list[float]] = {"ours": [float(first["rss_mib"])], "cmp": []}
    for k in range(a.pairs):
        mine, other = ("ours", ROOT / "src"), ("cmp", a.compare)
        runs = [other] if k == 0 else [other, mine] if k % 2 else [mine, other]
        for kind, src in runs:
            path = f"{log}.{kind}{k}"
            r = child([*args, path, a.faults], src)
            same = same and _digest(path) == _digest(log)
            Path(path).unlink()
            (ours if kind == "ours" else theirs).append(float(r["cpu_s"]))
            rss[kind].append(float(r["rss_mib"]))
    ratios = [t / o for o, t in zip(ours, theirs, strict=True)]
    lines = [
        f"      pair {k + 1}: this tree {o:.2f} s, --compare tree {t:.2f} s of CPU: × {t / o:.2f}"
        for k, (o, t) in enumerate(zip(ours, theirs, strict=True))
    ]
    n = int(first["transitions"])
    lines.append(
        f"      median of {len(ratios)} pairs: this tree {statistics.median(ours):.2f} s "
        f"({n / statistics.median(ours):,.0f}/s), --compare tree {statistics.median(theirs):.2f}"
        f" s ({n / statistics.median(theirs):,.0f}/s); faster in CPU time × "
        f"{statistics.median(ratios):.2f} (median ratio); same log in every run: {same}; "
        f"peak RSS (median) this tree {statistics.median(rss['ours']):.0f} MiB, --compare "
        f"tree {statistics.median(rss['cmp']):.0f} MiB"
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", nargs=4, metavar=("HOSTS", "STEPS", "LOG", "FAULTS"))
    ap.add_argument("--sizes", nargs="+", type=int, default=[128, 256, 512, 1024, 2048, 4096])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--faults", default="on")
    ap.add_argument("--ehp-steps", type=int, default=500, help="gpu-4x8 --ehp both steps")
    ap.add_argument("--target", action="store_true", help="also 1,024 hosts × 500 steps")
    ap.add_argument(
        "--kinds", action="store_true", help="count each size's records by machine and event"
    )
    ap.add_argument(
        "--compare", type=Path, help="another tree's src/ (e.g. main's): each size run with it too"
    )
    ap.add_argument(
        "--pairs",
        type=int,
        default=1,
        help="with --compare: run each size this many times in each tree, the two runs of a "
        "pair back to back (which goes first alternates); prints every pair's CPU times and "
        "the median ratio",
    )
    a = ap.parse_args()
    if a.one:
        one(int(a.one[0]), int(a.one[1]), a.one[2], a.one[3])
        return
    print(f"# simulate benchmark — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"python {platform.python_version()}, {os.cpu_count()} CPUs, load {os.getloadavg()}")
    print(f"plan {PLAN.name} repeated; {a.steps} steps; faults {a.faults}; checks every event\n")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for hosts in a.sizes:
            log = f"{tmp}/h{hosts}.jsonl"
            r = child([str(hosts), str(a.steps), log, a.faults])
            rows.append(r)
            print(
                f"{hosts:>5} hosts {r['gpus']:>6} GPUs G={r['groups_per_step']:>6}: "
                f"{r['wall_s']:8.1f} s wall, {r['transitions']:>10,} transitions, "
                f"{r['rate']:>9,.0f}/s, peak RSS {r['rss_mib']:7.0f} MiB, log "
                f"{r['log_mib']:.0f} MiB, faults {r['faults']}; CPU {r['cpu_s']:.1f} s "
                f"({r['cpu_rate']:,.0f}/s)",
                flush=True,
            )
            if a.compare and a.pairs > 1:
                print(pairs(hosts, a, log, r), flush=True)
            elif a.compare:
                c = child([str(hosts), str(a.steps), f"{log}.cmp", a.faults], a.compare)
                same = _digest(log) == _digest(f"{log}.cmp")
                print(
                    f"      --compare tree: {c['wall_s']:8.1f} s wall, CPU {c['cpu_s']:.1f} s "
                    f"({c['cpu_rate']:,.0f}/s), peak RSS {c['rss_mib']:7.0f} MiB; this tree "
                    f"× {float(c['cpu_s']) / float(r['cpu_s']):.2f} faster in CPU time, "
                    f"× {float(c['wall_s']) / float(r['wall_s']):.2f} in wall; same log: {same}",
                    flush=True,
                )
            if a.kinds:
                print(kinds(log, a.steps), flush=True)
            if hosts == a.sizes[0]:
                base = replay_rate(log)
                print(f"      baseline: replay of this log, 1 process: {base:,.0f} transitions/s")
        print()
        for prev, cur in itertools.pairwise(rows):
            f = float(cur["wall_s"]) / float(prev["wall_s"])
            fc = float(cur["cpu_s"]) / float(prev["cpu_s"])
            d = math.log2(int(cur["hosts"]) / int(prev["hosts"]))
            print(
                f"  {prev['hosts']:>5} → {cur['hosts']:>5} hosts: wall × {f:.2f}, CPU × {fc:.2f}"
                f" (per doubling: wall × {f ** (1 / d):.2f}, CPU × {fc ** (1 / d):.2f})"
            )
        for r in rows:
            print(f"  sim/replay at {r['hosts']} hosts: {float(r['rate']) / base:.2f}×")
        if a.target:
            log = f"{tmp}/target.jsonl"
            r = child(["1024", "500", log, a.faults])
            print(f"\ntarget 1,024 hosts × 500 steps: {json.dumps(r)}")
    if a.ehp_steps > 0:
        print()
        print(f"examples/gpu-4x8.toml, documented default costs, {a.ehp_steps} steps:")
        print(ehp_speedup(a.ehp_steps))


if __name__ == "__main__":
    main()
