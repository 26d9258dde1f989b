"""Planner decision time for 128 ... 8,192 hosts x 8 GPUs with mixed-TP engines.

Baseline (measured in the same run, same snapshot): `scan` — one pass over every GPU, engine and
replica record of the `ClusterView`, reading one field of each. Any decision has to look at
every record at least once, so decide/scan says how many "snapshot reads" a decision costs.

Scenarios per size (same world, different metrics):
  borrow  train/rollout 4.0, reserve = half the GPUs, max_hybrids = hosts/4 (the heavy path:
          per-host allocation tables, the greedy across hosts, one-host GPU sets)
  return  train/rollout 0.1 (cancel/stop every replica, repartition freed + free GPUs)
  hold    train/rollout 1.0 (inside the hysteresis band: index the world, decide nothing)

Timings are medians of `--repeats` rounds after one warm-up round, timed round-robin so that
machine load hits baseline and decisions alike (the per-host allocation tables are memoised by
host shape, so the warm-up fills that cache; the warm-up borrow call is reported apart). Each
call is timed twice over: wall clock, and process CPU time (`time.process_time`), which leaves
out the time the process waits for a core on a shared machine. The garbage collector stays on.
The decision times do not include building the `ClusterView`; its consistency check is timed
apart ("ClusterView check alone": the view rebuilt from the same records, median of 5).

    .venv/bin/python benchmarks/planner.py                # 128 ... 8192 hosts, under ~2 minutes
    .venv/bin/python benchmarks/planner.py --sizes 128 1024 --repeats 21 --out report.md
"""

from __future__ import annotations

import argparse
import functools
import gc
import platform
import statistics
import time
from collections.abc import Callable

from ehp_fsm.core.planner import (
    ClusterView,
    CoreLayout,
    Decision,
    EngineView,
    GpuView,
    HybridView,
    Metrics,
    PlannerPolicy,
    PlannerState,
    decide,
)

GPUS_PER_HOST = 8
REPLICA_SIZE = 4
# Host layouts, cycled: engine TPs, "H" = an active Hybrid replica of 4 GPUs, "F" = one free GPU.
LAYOUTS: tuple[tuple[int | str, ...], ...] = (
    (8,),
    (4, 4),
    (4, 2, 2),
    (2, 2, 2, 2),
    (1, 1, 1, 1, 1, 1, 1, 1),
    (2, 2, 1, 1, 1, 1),
    ("H", 4),
    (4, 2, 1, "F"),
)


def build_view(hosts: int) -> ClusterView:
    gpus: list[GpuView] = []
    engines: list[EngineView] = []
    hybrids: list[HybridView] = []
    names = tuple(f"node{i:05d}" for i in range(hosts))
    for i, host in enumerate(names):
        slot = 0
        for item in LAYOUTS[i % len(LAYOUTS)]:
            if item == "F":
                gpus.append(GpuView(gpu_id=f"{host}:g{slot}", host=host, state="free"))
                slot += 1
                continue
            n = REPLICA_SIZE if item == "H" else int(item)
            ids = tuple(f"{host}:g{slot + k}" for k in range(n))
            slot += n
            if item == "H":
                owner = f"hybrid:{host}-h"
                hybrids.append(
                    HybridView(hybrid_id=f"{host}-h", host=host, gpu_ids=ids, state="active")
                )
            else:
                eid = f"{host}-e{slot}"
                owner = f"engine:{eid}"
                state = "updating" if (i // len(LAYOUTS)) % 16 == 1 else "serving"
                engines.append(
                    EngineView(
                        engine_id=eid,
                        host=host,
                        tp=n,
                        gpu_ids=ids,
                        state=state,
                        active_requests=(i * 7 + slot) % 5,
                    )
                )
            gpus.extend(GpuView(gpu_id=g, host=host, state="owned", owner=owner) for g in ids)
        assert slot == GPUS_PER_HOST
    return ClusterView(
        version=1,
        hosts=names,
        gpus=tuple(gpus),
        engines=tuple(engines),
        hybrids=tuple(hybrids),
        core=CoreLayout(replicas=2, replica_size=REPLICA_SIZE),
    )


def scan(view: ClusterView) -> int:
    n = 0
    for g in view.gpus:
        n += g.state == "free"
    for e in view.engines:
        n += e.state == "serving"
    for h in view.hybrids:
        n += h.state == "active"
    return n


def interleaved(
    fns: dict[str, Callable[[], object]], repeats: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Median wall-clock and process-CPU seconds per function, timed round-robin.

    Round-robin so that machine load hits all of them alike. One warm-up round first; its wall
    times are returned under "<name>:first". CPU time (`time.process_time`) leaves out the time
    the process spends waiting for a core, which dominates wall time on a shared machine.
    """
    gc.collect()
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    first: dict[str, float] = {}
    for round_ in range(repeats + 1):
        for name, fn in fns.items():
            c0 = time.process_time()
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            dc = time.process_time() - c0
            if round_ == 0:
                first[f"{name}:first"] = dt
            else:
                wall[name].append(dt)
                cpu[name].append(dc)
    med_wall = {name: statistics.median(ts) for name, ts in wall.items()}
    med_wall.update(first)
    return med_wall, {name: statistics.median(ts) for name, ts in cpu.items()}


def check_time(view: ClusterView, repeats: int) -> float:
    """Median wall seconds of `ClusterView`'s consistency check (rebuilt from the same records)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ClusterView(
            version=view.version,
            hosts=view.hosts,
            gpus=view.gpus,
            engines=view.engines,
            hybrids=view.hybrids,
            core=view.core,
        )
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _row(hosts: int, view: ClusterView, t: dict[str, float], growth: str) -> str:
    scan = t["scan"]
    cells = [f"{hosts}", f"{len(view.gpus)}", f"{len(view.engines)}", f"{scan * 1e3:.2f}"]
    for name in ("hold", "return", "borrow"):
        cells.append(f"{t[name] * 1e3:.2f} ({t[name] / scan:.1f}x)")
    cells += [f"{t['borrow'] / hosts * 1e6:.2f}", growth]
    return "| " + " | ".join(cells) + " |"


def _growth(now: tuple[int, dict[str, float]], prev: tuple[int, dict[str, float]] | None) -> str:
    if prev is None:
        return ""
    (h1, t1), (h0, t0) = now, prev
    return (
        f"{t1['borrow'] / t0['borrow']:.2f}x (scan {t1['scan'] / t0['scan']:.2f}x) "
        f"for {h1 / h0:.0f}x hosts"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096, 8192])
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--out", help="also write the Markdown tables to this file")
    args = ap.parse_args()
    header = (
        "| hosts | GPUs | engines | scan ms | hold ms (x scan) | return ms (x scan) "
        "| borrow ms (x scan) | borrow µs/host | borrow growth vs prev |"
    )
    rule = "|" + "---|" * 9
    wall_rows: list[str] = []
    cpu_rows: list[str] = []
    notes: list[str] = []
    prev_wall: tuple[int, dict[str, float]] | None = None
    prev_cpu: tuple[int, dict[str, float]] | None = None
    print("wall-clock medians; then process CPU-time medians of the same calls")
    print(header)
    print(rule)
    for hosts in args.sizes:
        t0 = time.perf_counter()
        view = build_view(hosts)
        build = time.perf_counter() - t0
        gpus = len(view.gpus)
        policy = PlannerPolicy(
            rollout_reserve=gpus // 2,
            replica_size=REPLICA_SIZE,
            allowed_engine_tps=(1, 2, 4, 8),
            borrow_threshold=1.5,
            release_threshold=0.67,
            cooldown_s=60.0,
            engine_restart_s=30.0,
            release_resume_s=3.0,
            max_hybrids=hosts // 4 + sum(1 for h in view.hybrids),
        )

        def run(train: float, policy: PlannerPolicy = policy, view: ClusterView = view) -> Decision:
            m = Metrics(train_seconds=train, rollout_seconds=1.0)
            return decide(view=view, metrics=m, policy=policy, state=PlannerState(), now=0.0)

        wall, cpu = interleaved(
            {
                "scan": functools.partial(scan, view),
                "hold": functools.partial(run, 1.0),
                "return": functools.partial(run, 0.1),
                "borrow": functools.partial(run, 4.0),
            },
            args.repeats,
        )
        check = check_time(view, 5)
        d = run(4.0)
        wall_rows.append(_row(hosts, view, wall, _growth((hosts, wall), prev_wall)))
        cpu_rows.append(_row(hosts, view, cpu, _growth((hosts, cpu), prev_cpu)))
        prev_wall, prev_cpu = (hosts, wall), (hosts, cpu)
        note = (
            f"{hosts} hosts: build {build:.2f} s (records + ClusterView check), ClusterView "
            f"check alone {check * 1e3:.2f} ms ({check / wall['scan']:.1f}x scan), borrow "
            f"first call {wall['borrow:first'] * 1e3:.2f} ms, borrow granted "
            f"{d.granted}/{d.wanted} with {len(d.actions)} actions"
        )
        notes.append(note)
        print(wall_rows[-1], flush=True)
        print(cpu_rows[-1], f"[{note}]", flush=True)
    env = f"Python {platform.python_version()} on {platform.machine()}, repeats={args.repeats}"
    print(env)
    if args.out:
        text = [
            "Wall-clock medians:",
            "",
            header,
            rule,
            *wall_rows,
            "",
            "Process CPU-time medians (same calls):",
            "",
            header,
            rule,
            *cpu_rows,
            "",
            *(f"- {n}" for n in notes),
            "",
            env,
            "",
        ]
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write("\n".join(text))


if __name__ == "__main__":
    main()
