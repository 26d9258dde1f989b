"""The simulation's output, byte for byte, against another tree's: the oracle for a change that
must only make `ehp-fsm simulate` faster.

Runs `ehp-fsm simulate` for each case below with this tree's `src/` and with `--base` (another
tree's `src/`, e.g. main's exported with `git archive HEAD src specs`), and compares the
transition log, the receipt, the summary (its wall-time and log-path lines left out: they name
the machine's speed and the output folder) and the `--ehp both` comparison table. The base's
outputs are kept in `--cache` (its code does not change), so a second run runs only this tree.
Every log this tree writes is then verified by `ehp-fsm replay`.

    .venv/bin/python benchmarks/simulate_same.py --base /tmp/base/src
    .venv/bin/python benchmarks/simulate_same.py --base /tmp/base/src --only 0 1   # some cases
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "examples" / "gpu-4x8.toml"

CASES: list[list[str]] = [
    ["--hosts", "128", "--steps", "3", "--seed", "0", "--faults", "on"],
    ["--hosts", "128", "--steps", "3", "--seed", "1", "--faults", "on"],
    ["--hosts", "128", "--steps", "3", "--seed", "0", "--faults", "heavy"],
    ["--hosts", "128", "--steps", "3", "--seed", "1", "--faults", "heavy"],
    ["--hosts", "32", "--steps", "10", "--seed", "2", "--faults", "heavy"],
    ["--hosts", "128", "--steps", "3", "--seed", "0", "--faults", "on", "--ehp", "both"],
    ["--hosts", "1024", "--steps", "2", "--seed", "0", "--faults", "on"],
]
VOLATILE = re.compile(r"[\d.]+ s wall \([\d,]+ transitions/s\)|  log: .*|  written: .*")


def run(src: Path, args: list[str], out: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, "-m", "ehp_fsm.cli", "simulate", str(PLAN), *args, "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    return VOLATILE.sub("…", p.stdout)


def files(out: Path) -> dict[str, bytes]:
    found = {}
    for p in sorted(out.rglob("*")):
        if p.name in ("transitions.jsonl", "receipt.json", "comparison.txt"):
            found[str(p.relative_to(out))] = p.read_bytes()
        elif p.name == "summary.txt":
            found[str(p.relative_to(out))] = VOLATILE.sub("…", p.read_text()).encode()
    return found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", type=Path, required=True, help="the other tree's src/")
    ap.add_argument(
        "--cache",
        type=Path,
        default=Path(tempfile.gettempdir()) / "simulate_same",
        help="where the base's outputs are kept between runs (and this tree's written)",
    )
    ap.add_argument("--only", type=int, nargs="*", help="case numbers (default: all)")
    a = ap.parse_args()
    bad = 0
    for k, args in enumerate(CASES):
        if a.only and k not in a.only:
            continue
        base_out = a.cache / f"case{k}"
        if not (base_out / "stdout.txt").exists():
            text = run(a.base, args, base_out)
            (base_out / "stdout.txt").write_text(text)
        mine = a.cache / f"mine{k}"
        c0 = os.times()
        text = run(ROOT / "src", args, mine)
        cpu = os.times().children_user - c0.children_user + os.times().children_system
        cpu -= c0.children_system
        theirs, ours = files(base_out), files(mine)
        same = theirs == ours and text == (base_out / "stdout.txt").read_text()
        diff = [n for n in sorted(set(theirs) | set(ours)) if theirs.get(n) != ours.get(n)]
        for log in sorted(mine.rglob("transitions.jsonl")):
            env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
            r = subprocess.run(
                [sys.executable, "-m", "ehp_fsm.cli", "replay", str(log)],
                capture_output=True,
                text=True,
                env=env,
            )
            if r.returncode != 0:
                same = False
                diff.append(f"replay {log}: {r.stdout[-500:]}{r.stderr[-500:]}")
        bad += not same
        print(
            f"case {k} {' '.join(args)}: {'same' if same else 'DIFFERENT'} "
            f"({len(ours)} files; this tree {cpu:.1f} s CPU){'' if same else ' ' + str(diff)}",
            flush=True,
        )
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
