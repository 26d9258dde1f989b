"""Benchmark: what `Orchestrator(check=True)` costs per event, against `check=False`, by size.

The world: N GPUs, 8 a host; the Core on a quarter of them, one serving engine (TP8) on each
other host but one, revision 1 published. The timed events, the same for every contender:
the GPU finalizer cycle on Core GPUs (`release` → `confirm_free` → `assign`, every edge
guarded) interleaved with groups enqueued, dispatched to the engines in turn and completed —
every event accepted. Contenders, each on a fresh orchestrator, interleaved `--repeat` times
(the best run of each is shown):

- `check=False`: no invariant checks (the baseline of every ratio);
- `check=True`: the per-event checks (`core.checks`: what the step changed);
- whole world: `check=False` plus `check_invariants(world, indexed=True)` after each accepted
  event — what `check=True` ran before the per-event checks.

    .venv/bin/python benchmarks/embedded_checks.py [--gpus 1024 20000] [--events 3000]
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from typing import Any

from ehp_fsm import Event, Orchestrator
from ehp_fsm.core.invariants import check_invariants


def config(n: int) -> dict[str, Any]:
    gpus = [f"h{i // 8}:g{i % 8}" for i in range(n)]
    return {
        "inventory": {g: g.split(":")[0] for g in gpus},
        "core_gpus": gpus[: max(8, n // 4 // 8 * 8)],
        "core_replicas": ["core:0"],
        "replica_size": 8,
        "rollout_reserve": 0,
    }


def world(n: int, check: bool) -> tuple[Orchestrator, list[str]]:
    """An orchestrator at the starting world; the serving engines."""
    cfg = config(n)
    orch = Orchestrator(cfg, check=check)
    ok = orch.handle
    core = set(cfg["core_gpus"])
    for g in cfg["core_gpus"]:
        assert ok(Event("gpu", g, "assign", 0.0, {"owner": "core"})).accepted
    assert ok(Event("revision", "r1", "save", 0.0, {"revision": 1, "step": 0})).accepted
    assert ok(Event("revision", "r1", "saved", 0.0, {"checksum": "c", "path": "/r1"})).accepted
    assert ok(Event("revision", "r1", "publish", 0.0)).accepted
    hosts = sorted({h for g, h in cfg["inventory"].items() if g not in core})[:-1]
    engines = []
    for host in hosts:
        eid, gpus = f"e-{host}", [f"{host}:g{i}" for i in range(8)]
        token = f"t-{eid}"
        launch = {"host": host, "gpus": gpus, "tp": 8, "token": token}
        assert ok(Event("rollout_engine", eid, "launch", 0.0, launch)).accepted
        ident = {"host": host, "pid": 100, "start_time": 1.0, "token": token}
        assert ok(Event("rollout_engine", eid, "healthy", 0.0, {"identity": ident})).accepted
        assert ok(Event("rollout_engine", eid, "installed", 0.0, {"revision": 1})).accepted
        engines.append(eid)
    return orch, engines


def events(n: int, engines: list[str], count: int) -> list[Event]:
    core = config(n)["core_gpus"]
    cycle = [
        ("release", {"owner": "core"}),
        ("confirm_free", {"owner": "core", "processes_exited": True, "memory_free": True}),
        ("assign", {"owner": "core"}),
    ]
    out: list[Event] = []
    t, i = 1.0, 0
    while len(out) < count:
        g = core[i % len(core)]
        out += [Event("gpu", g, name, t, payload) for name, payload in cycle]
        gid, eid = f"g{i}", engines[i % len(engines)]
        out.append(Event("request", gid, "enqueue", t, {"prompt": "p"}))
        out.append(Event("request", gid, "dispatch", t, {"engine": eid}))
        out.append(Event("request", gid, "complete", t, {"engine": eid, "revision": 1}))
        t += 0.01
        i += 1
    return out[:count]


def timed(orch: Orchestrator, evs: list[Event], after: Callable[[], object] | None) -> float:
    handle = orch.handle
    gc.collect()
    t0 = time.perf_counter()
    for ev in evs:
        out = handle(ev)
        assert out.accepted, out.reason
        if after is not None:
            after()
    return (time.perf_counter() - t0) / len(evs)


def whole_check(orch: Orchestrator) -> Callable[[], object]:
    world = orch.world
    return lambda: check_invariants(world, indexed=True)


def bench(n: int, count: int, repeat: int) -> dict[str, float]:
    best = {"off": float("inf"), "on": float("inf"), "whole": float("inf")}
    for _ in range(repeat):
        for name in best:
            orch, engines = world(n, check=name == "on")
            evs = events(n, engines, count)
            after = whole_check(orch) if name == "whole" else None
            best[name] = min(best[name], timed(orch, evs, after))
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, nargs="+", default=[1024, 20_000])
    p.add_argument("--events", type=int, default=3000)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    head = ("GPUs", "check=False", "check=True", "ratio", "whole world", "ratio")
    print("{:>7} {:>12} {:>12} {:>6} {:>12} {:>7}".format(*head))
    for n in args.gpus:
        count = args.events if n <= 4096 else max(300, args.events // 10)
        r = bench(n, count, args.repeat)
        print(
            f"{n:>7} {r['off'] * 1e6:>10.1f}µs {r['on'] * 1e6:>10.1f}µs "
            f"{r['on'] / r['off']:>6.2f} {r['whole'] * 1e6:>10.1f}µs {r['whole'] / r['off']:>7.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
