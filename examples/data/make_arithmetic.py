"""Write examples/data/arithmetic.jsonl: questions of `ehp_fsm.training.task.ArithmeticTask`,
one JSON object per line ({"prompt": "7+5=", "label": "12", "index": 0, "a": 7, "op": "+", "b": 5}).

Deterministic: question i depends only on (seed, i) through the task's SplitMix64 hash, and the
lines are written with sorted keys, so the same arguments give the same bytes.

    python examples/data/make_arithmetic.py [--count 4000] [--max-operand 99] [--seed 0] [--out F]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ehp_fsm.training.task import ArithmeticTask

DEFAULT_OUT = Path(__file__).with_name("arithmetic.jsonl")


def lines(*, count: int, max_operand: int, seed: int, ops: str = "+") -> list[str]:
    task = ArithmeticTask(seed=seed, max_operand=max_operand, ops=ops, max_new_tokens=6)
    out = []
    for i in range(count):
        q = task.question(i)
        record = {
            "prompt": q.text,
            "label": str(q.answer),
            "index": i,
            "a": q.a,
            "op": q.op,
            "b": q.b,
        }
        out.append(json.dumps(record, sort_keys=True))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=4000)
    p.add_argument("--max-operand", type=int, default=99)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ops", default="+")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    a = p.parse_args(argv)
    text = "\n".join(lines(count=a.count, max_operand=a.max_operand, seed=a.seed, ops=a.ops))
    a.out.write_text(text + "\n", encoding="utf-8")
    print(f"{a.count} questions written to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
