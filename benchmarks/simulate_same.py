"""The simulation's output, byte for byte, against another tree's: the oracle for a change that
must only make `ehp-fsm simulate` faster.

Runs `ehp-fsm simulate` for each case below with this tree's `src/` and with `--base` (another
tree's `src/`, e.g. main's exported with `git archive HEAD src specs`), and compares the
transition log, the receipt, the summary (its wall-time and log-path lines left out: they name
the machine's speed and the output folder) and the `--ehp both` comparison table. The base's
outputs are kept in `--cache` (its code does not change), so a second run runs only this tree.
Every log this tree writes is then verified by `ehp-fsm replay`.

The header's `ehp_fsm_version` (the version that wrote the log, recorded since 0.1.1) is left
out of the comparison: each log is compared as if its header did not have it, its hash chain
rebuilt without it (the chain covers the header, so every line's `chain` and the receipt's
`log_chain` hash follow from it); the records' bytes are compared as they are. (A base from
before the field and this tree then compare the same; without this, they differed in the
header line and in every `chain`.)

    .venv/bin/python benchmarks/simulate_same.py --base /tmp/base/src
    .venv/bin/python benchmarks/simulate_same.py --base /tmp/base/src --only 0 1   # some cases
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec

from ehp_fsm.translog import CHAIN_MARK, CHAIN_SUFFIX, VERSION_KEY, chain_hasher, log_key

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
#: What names the machine's speed or the output folder: the summary's wall time, each step's
#: progress line's wall time and time left, the paths written.
VOLATILE = re.compile(
    r"[\d.]+ s wall \([\d,]+ transitions/s\)|wall [\d.]+ s(, ~[\d.]+ s left)?"
    r"|  log: .*|  written: .*"
)


def run(src: Path, args: list[str], out: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, "-m", "ehp_fsm.cli", "simulate", str(PLAN), *args, "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    return VOLATILE.sub("…", p.stdout)


def unversioned(log: bytes) -> tuple[bytes, dict[bytes, bytes]]:
    """`log` without its header's `ehp_fsm_version`, its chain rebuilt (every record's bytes
    before its `chain` kept), and {old chain head: new} for the receipt's `log_chain`; a log
    without the field as it is."""
    lines = log.splitlines(keepends=True)
    head = json.loads(lines[0]) if lines else {}
    if not isinstance(head, dict) or VERSION_KEY not in head:
        return log, {}
    del head[VERSION_KEY]
    head.pop("chain", None)
    link, chain, out = chain_hasher(log_key()), b"", []
    for k, raw in enumerate(lines):
        body = msgspec.json.encode(head)[:-1] if k == 0 else raw[: -CHAIN_SUFFIX - 1]
        chain = link(chain + body)
        out.append(body + CHAIN_MARK + chain + b'"}\n')
    old = lines[-1][-CHAIN_SUFFIX + len(CHAIN_MARK) - 1 : -3]
    return b"".join(out), {old: chain}


def files(out: Path) -> dict[str, bytes]:
    found = {}
    heads: dict[bytes, bytes] = {}
    for p in sorted(out.rglob("transitions.jsonl")):
        found[str(p.relative_to(out))], moved = unversioned(p.read_bytes())
        heads.update(moved)
    for p in sorted(out.rglob("*")):
        if p.name == "receipt.json":
            data = p.read_bytes()
            for old, new in heads.items():
                data = data.replace(old, new)
            found[str(p.relative_to(out))] = data
        elif p.name == "comparison.txt":
            found[str(p.relative_to(out))] = p.read_bytes()
        elif p.name == "summary.txt":
            found[str(p.relative_to(out))] = VOLATILE.sub("…", p.read_text()).encode()
    return dict(sorted(found.items()))


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
