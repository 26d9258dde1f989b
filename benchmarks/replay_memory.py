"""`ehp-fsm replay` of a short and a long simulated log: peak RSS and transitions/s, this tree
against a baseline tree (default: `main`), measured in the same run.

Replay used to grow with the log: it kept every instance ever created (a step's G groups stay
`consumed` forever) and every page of the memory-mapped log it had read. This tree forgets
finished instances (`ehp_fsm.finished`) and hands read pages back (`replay._read_lines`), so
its peak should stay flat from the short log to the long one while the baseline's grows.

Each replay runs in its own process (its peak RSS, `VmHWM`, is its own) as the CLI runs it:
`ehp-fsm replay LOG --receipt RECEIPT --jobs 1`; the logs are `ehp-fsm simulate` runs of
examples/gpu-4x8.toml at `--hosts` hosts for each of `--steps` (no checkpoints: a simulation
writes none). Trees alternate within each of `--pairs` rounds (which goes first alternates
too); the rate is transitions per CPU second of the replay call (`time.process_time`: steadier
than wall time on a shared machine), from the median round's CPU time.

    .venv/bin/python benchmarks/replay_memory.py                  # 64 hosts, 20 and 80 steps
    .venv/bin/python benchmarks/replay_memory.py --hosts 128 --steps 10 40 --pairs 3
    .venv/bin/python benchmarks/replay_memory.py --base /tmp/old/src   # another tree's src/
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "examples" / "gpu-4x8.toml"

CHILD = r"""
import contextlib, io, json, re, sys, time
from ehp_fsm.cli import main
log, receipt = sys.argv[1:3]
out = io.StringIO()
t0 = time.process_time()
with contextlib.redirect_stdout(out):
    rc = main(["replay", log, "--receipt", receipt, "--jobs", "1"])
cpu = time.process_time() - t0
hwm = next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM:"))
done = re.match(r"(\d+) transitions verified", out.getvalue())
n = int(done.group(1)) if rc == 0 and done else None
print(json.dumps({"rc": rc, "cpu": cpu, "transitions": n, "peak_kib": hwm, "out": out.getvalue()}))
"""


def simulate(src: Path, hosts: int, steps: int, out: Path) -> tuple[Path, Path]:
    """A simulated run's log and receipt (written with this tree)."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "ehp_fsm.cli",
            "simulate",
            str(PLAN),
            "--hosts",
            str(hosts),
            "--steps",
            str(steps),
            "--seed",
            "1",
            "--out",
            str(out),
        ],
        check=True,
        env={**os.environ, "PYTHONPATH": str(src)},
        stdout=subprocess.DEVNULL,
    )
    return out / "transitions.jsonl", out / "receipt.json"


def measure(src: Path, log: Path, receipt: Path) -> dict[str, Any]:
    """One replay in a fresh process with the tree at `src`; `SystemExit` with the replay's own
    error when it fails (a baseline that cannot read this tree's log format, say)."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(log), str(receipt)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(src)},
    )
    lines = done.stdout.strip().splitlines()
    got: dict[str, Any] = json.loads(lines[-1]) if done.returncode == 0 and lines else {}
    if got.get("rc") != 0:  # (a failed replay was a bare CalledProcessError: the child then
        # crashed reading a count from the error's empty output, and its stderr went unshown)
        raise SystemExit(
            f"replay of {log} with {src} failed: {got.get('out', done.stdout)}"
            f"{done.stderr.strip()}\nFix: give --ref or --base a tree that reads this tree's "
            "logs (a baseline from before a log schema change cannot)"
        )
    return got


def base_tree(ref: str, into: Path) -> Path:
    """`src/` of git `ref` (and the `specs/` it reads), extracted under `into`."""
    tar = into / "base.tar"
    subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", "-o", str(tar), ref, "src", "specs"],
        check=True,
    )
    with tarfile.open(tar) as t:
        t.extractall(into, filter="data")
    return into / "src"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=64)
    ap.add_argument("--steps", type=int, nargs="+", default=[20, 80])
    ap.add_argument("--pairs", type=int, default=4, help="rounds of (baseline, this tree)")
    ap.add_argument("--ref", default="main", help="the baseline's git ref (default main)")
    ap.add_argument("--base", type=Path, help="the baseline's src/ (instead of --ref)")
    args = ap.parse_args()
    here = ROOT / "src"
    with tempfile.TemporaryDirectory(prefix="replay-memory-") as tmp:
        base = args.base or base_tree(args.ref, Path(tmp))
        label = str(args.base) if args.base else args.ref
        print(f"baseline: {label}; this tree: {ROOT}; {args.hosts} hosts, steps {args.steps}")
        rows = []
        for steps in args.steps:
            log, receipt = simulate(here, args.hosts, steps, Path(tmp) / f"s{steps}")
            size = log.stat().st_size / 2**20
            runs: dict[str, list[dict[str, Any]]] = {"base": [], "this": []}
            for i in range(args.pairs):  # alternating which goes first
                for k in ("base", "this") if i % 2 == 0 else ("this", "base"):
                    runs[k].append(measure(base if k == "base" else here, log, receipt))
            n = runs["this"][0]["transitions"]
            assert all(r["transitions"] == n for rs in runs.values() for r in rs)
            best = {k: statistics.median(r["cpu"] for r in rs) for k, rs in runs.items()}
            peak = {k: max(r["peak_kib"] for r in rs) / 1024 for k, rs in runs.items()}
            rows.append((steps, size, n, best, peak))
        print(
            f"{'steps':>5} {'log MiB':>8} {'transitions':>11} | {'peak MiB base':>13} "
            f"{'this':>6} {'this/base':>9} | {'per CPU-s base':>14} {'this':>8} {'this/base':>9}"
        )
        for steps, size, n, best, peak in rows:
            rate = {k: n / v for k, v in best.items()}
            print(
                f"{steps:>5} {size:>8.1f} {n:>11,} | {peak['base']:>13.1f} {peak['this']:>6.1f} "
                f"{peak['this'] / peak['base']:>8.2f}× | {rate['base']:>14,.0f} "
                f"{rate['this']:>8,.0f} {rate['this'] / rate['base']:>8.2f}×"
            )
        if len(rows) > 1:
            (s0, _, _, _, p0), (s1, _, _, _, p1) = rows[0], rows[-1]
            print(
                f"peak growth from {s0} to {s1} steps: base {p1['base'] / p0['base']:.2f}×, "
                f"this tree {p1['this'] / p0['this']:.2f}×"
            )


if __name__ == "__main__":
    main()
