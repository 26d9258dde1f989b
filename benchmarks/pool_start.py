"""Benchmark: what a CPU trainer pool's start costs, its workers forked from one preloaded
starter (`training.prefork`) against each started as its own `python -m
ehp_fsm.training.worker` (what a CUDA pool does), in one run.

The pool: the run's model (a generated tiny Qwen3, `models.tiny.init_model`), Core DP 1 and
`--warm` warm Hybrid workers (default 3), the torch backend. For each way, `--repeats` pools
(default 3, the two ways alternating so drift on a shared machine hits both alike) are spawned
and waited for until every rank's hello; the figures are medians:

- wall: from the spawn to the last hello;
- CPU: user + system seconds of every process of the pool (workers, and the starter), read
  from /proc at the last hello — what the start took from the machine's cores.

    python benchmarks/pool_start.py [--warm 3] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import psutil

from ehp_fsm.models.tiny import init_model
from ehp_fsm.training.pool import PoolConfig, TrainerPool


def _cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


def _one(config: PoolConfig, work: Path, *, prefork: bool) -> tuple[float, float]:
    t0 = time.monotonic()
    with TrainerPool.spawn(config, work_dir=work, prefork=prefork) as pool:
        wall = time.monotonic() - t0
        pids = [w.process.pid for w in pool._workers.values() if w.process is not None]
        if pool._starter is not None:
            pids.append(pool._starter.process.pid)
        cpu = _cpu_s(pids)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--warm", type=int, default=3, help="warm Hybrid workers (default 3)")
    ap.add_argument("--repeats", type=int, default=3, help="pools per way (default 3)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = init_model(Path(tmp) / "model")
        config = PoolConfig(
            model=str(model),
            core_dp=1,
            max_hybrids=args.warm,
            revisions=str(Path(tmp) / "revisions"),
        )
        got: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for i in range(args.repeats):
            for prefork in (False, True):
                work = Path(tmp) / f"pool-{i}-{int(prefork)}"
                got[prefork].append(_one(config, work, prefork=prefork))
    ranks = 1 + args.warm
    print(f"pool of {ranks} ranks (Core DP 1 + {args.warm} warm), tiny Qwen3, {args.repeats} each")
    print(f"load average after: {psutil.getloadavg()[0]:.2f}")
    med = {
        k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
        for k, v in got.items()
    }
    for prefork, label in ((False, "own process each"), (True, "forked (prefork)")):
        wall, cpu = med[prefork]
        print(f"  {label:18s} wall {wall:6.2f} s   CPU {cpu:6.2f} s ({cpu / ranks:.2f} s/rank)")
    print(
        f"ratio forked / own: wall {med[True][0] / med[False][0]:.2f}x, "
        f"CPU {med[True][1] / med[False][1]:.2f}x"
    )


if __name__ == "__main__":
    main()
