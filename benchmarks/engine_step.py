"""Benchmark: guarded transitions per second through the engine, against `transitions`.

Workload (the same for every contender): the GPU finalizer cycle on N Core GPUs, every edge
guarded — `release` (released_by_owner) → `confirm_free` (finalizer_confirmed) → `assign`
(owner_claims_gpu) — round-robin over the GPUs, `--rounds` times. Printed, from one run:

- engine, logging off: `Orchestrator.handle` (pure `step` + `World.apply`);
- engine, JSONL log on: the same events with `TransitionLog` writing to a real file;
- `transitions`: a plain `transitions.Machine` (auto_transitions=False) over one model per GPU,
  the same edges, the same guard functions as its conditions and the same effect functions as
  `after` callbacks (so it computes the same data) — the baseline of every ratio;
- replay: `replay()` over the log the logged run wrote, in one process and with `--jobs`
  processes (default: the CPU count) verifying the stretches between its checkpoints at once
  (the log writes its default checkpoints: every 10,000 events);
- structlog alone: a structlog logger with structlog's own JSON rendering (its default
  `JSONRenderer`, `json.dumps`) writing the same record dicts to a file — what "no slower than
  structlog's own JSON rendering" is measured against. (The transition log itself renders
  through `JSONRenderer` with msgspec's encoder as the serializer, structlog's documented fast
  path, and writes through `BytesLogger`);
- memory per instance over 100,000 GPU instances (tracemalloc delta / count), free and owned.

Each contender runs `--repeat` times, interleaved; the table shows the best run of each. The
engine's ratio is also taken round by round (its run right after the baseline's) and checked
on the median of those rounds, which a slow stretch of the VM under one contender's best
cannot skew.

    .venv/bin/python benchmarks/engine_step.py [--gpus 2000] [--rounds 10]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType
from typing import Any, cast

import structlog
from transitions import EventData, Machine

from ehp_fsm.core.effects import EFFECTS
from ehp_fsm.core.guards import GUARDS
from ehp_fsm.core.spec import MachineSpec, TransitionSpec
from ehp_fsm.core.transition import Act, View
from ehp_fsm.core.world import EMPTY, Event, Instance, World
from ehp_fsm.embedded import Orchestrator
from ehp_fsm.replay import replay
from ehp_fsm.specfiles import load_specs
from ehp_fsm.translog import TransitionLog, outcome_records

CYCLE = ("release", "confirm_free", "assign")


def config(n: int) -> dict[str, Any]:
    gpus = [f"h{i // 8}:g{i % 8}" for i in range(n)]
    return {
        "inventory": {g: g.split(":")[0] for g in gpus},
        "core_gpus": gpus,
        "core_replicas": ["core:0"],
        "replica_size": 1,
    }


def events(n: int, rounds: int) -> list[Event]:
    gpus = list(config(n)["inventory"])
    payloads = {
        "release": MappingProxyType({"owner": "core"}),
        "confirm_free": MappingProxyType(
            {"owner": "core", "processes_exited": True, "memory_free": True}
        ),
        "assign": MappingProxyType({"owner": "core"}),
    }
    out = []
    t = 1.0
    for _ in range(rounds):
        for name in CYCLE:
            for g in gpus:
                out.append(Event("gpu", g, name, t, payloads[name]))
                t += 0.001
    return out


def fresh_engine(n: int, log: TransitionLog | None = None) -> Orchestrator:
    engine = Orchestrator(config(n), log=log)
    for g in engine.world.config["core_gpus"]:  # Core owns its GPUs before the clock starts
        assert engine.handle(Event("gpu", g, "assign", 0.0, {"owner": "core"})).accepted
    return engine


def run_engine(engine: Orchestrator, evs: list[Event]) -> float:
    handle = engine.handle
    gc.collect()
    t0 = time.perf_counter()
    for ev in evs:
        handle(ev)
    return time.perf_counter() - t0


class GpuModel:
    """One GPU for the `transitions` baseline: its state (set by transitions), its data and the
    `Act` of the transition in progress."""

    state: str
    act: Act
    trigger: Callable[..., bool]  # added by transitions

    def __init__(self, inst: Instance) -> None:
        self.inst = inst


def transitions_baseline(
    n: int, evs: list[Event], spec: MachineSpec
) -> tuple[float, int, dict[str, tuple[str, dict[str, Any]]]]:
    """The same edges as a plain `transitions.Machine`, doing the engine's work per transition:
    a `prepare` callback builds the one `Act` the engine builds (guards read it, effects write
    it), the guards are its conditions, the effects run as `after` callbacks and the new
    `Instance` is written back to the model; triggered with the same events."""
    world = fresh_engine(n).world  # guards read config through a View of it
    view = View(world)
    models = {iid: GpuModel(inst) for iid, inst in world.of("gpu").items()}

    def prepare(t: TransitionSpec) -> Callable[[EventData], None]:
        def build(ed: EventData) -> None:
            m = cast(GpuModel, ed.model)
            ev = ed.kwargs["event"]
            m.act = Act(view, m.inst, ev, spec, t, ev.payload, dict(m.inst.data))

        return build

    def condition(g: str) -> Callable[[EventData], bool]:
        guard = GUARDS[g]

        def check(ed: EventData) -> bool:
            m = cast(GpuModel, ed.model)
            return guard(m.act) is None

        return check

    def after(t: TransitionSpec) -> Callable[[EventData], None]:
        fns = [EFFECTS[e] for e in t.effects]

        def run(ed: EventData) -> None:
            m = cast(GpuModel, ed.model)
            act = m.act
            for fn in fns:
                fn(act)
            m.inst = Instance("gpu", m.inst.id, t.dest, act.data if act.data else EMPTY)

        return run

    trans = [
        {
            "trigger": t.event,
            "source": t.source,
            "dest": t.dest,
            "prepare": [prepare(t)],
            "conditions": [condition(g) for g in t.guards],
            "after": [after(t)],
        }
        for t in spec.transitions
    ]
    machine = Machine(
        model=list(models.values()),
        states=list(spec.states),
        transitions=trans,
        initial="owned",
        auto_transitions=False,
        send_event=True,
        ignore_invalid_triggers=False,
    )
    del machine  # the models keep their triggers
    gc.collect()
    accepted = 0
    t0 = time.perf_counter()
    for ev in evs:
        if models[ev.instance].trigger(ev.name, event=ev):
            accepted += 1
    elapsed = time.perf_counter() - t0
    return elapsed, accepted, {g: (m.state, dict(m.inst.data)) for g, m in models.items()}


def structlog_alone(records: list[dict[str, Any]], path: Path) -> float:
    """structlog's own JSON rendering (default `JSONRenderer`, `WriteLogger`) of the same
    record dicts, written to a file through the bound logger's `info`."""
    with path.open("w", encoding="utf-8") as fh:
        log = structlog.wrap_logger(
            structlog.WriteLogger(fh),
            processors=[structlog.processors.JSONRenderer()],
            wrapper_class=structlog.make_filtering_bound_logger(0),
        )
        info = log.info
        gc.collect()
        t0 = time.perf_counter()
        for rec in records:
            rec = dict(rec)
            name = rec.pop("event")
            info(name, **rec)
        return time.perf_counter() - t0


def memory_per_instance(count: int) -> tuple[float, float]:
    """tracemalloc bytes per GPU instance: free (from the inventory) and after `assign`."""
    specs = load_specs()
    cfg = config(count)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    world = World(specs, cfg)
    free = (tracemalloc.get_traced_memory()[0] - base) / count
    tracemalloc.stop()
    engine = Orchestrator(cfg, specs=specs)
    engine.world = world
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for g in cfg["core_gpus"]:
        engine.handle(Event("gpu", g, "assign", 0.0, {"owner": "core"}))
    gc.collect()
    owned_delta = (tracemalloc.get_traced_memory()[0] - base) / count
    tracemalloc.stop()
    return free, free + owned_delta


def profile(n: int, evs: list[Event], log: bool, out: Path) -> None:
    engine = fresh_engine(
        n,
        TransitionLog.create(out / "prof.jsonl", config=config(n), specs=load_specs())
        if log
        else None,
    )
    prof = cProfile.Profile()
    prof.enable()
    for ev in evs:
        engine.handle(ev)
    prof.disable()
    engine.close()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--instances", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=5, help="runs per contender; the best counts")
    ap.add_argument("--profile", action="store_true", help="cProfile the engine runs")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="replay processes")
    args = ap.parse_args()
    spec = load_specs()["gpu"]
    evs = events(args.gpus, args.rounds)
    n = len(evs)
    print(
        f"workload: {n} guarded GPU transitions ({args.gpus} GPUs x {args.rounds} x {CYCLE}), "
        f"best of {args.repeat} runs each"
    )

    # Every contender runs `--repeat` times, interleaved, from a fresh state; the best (least)
    # time of each counts: the machine is shared, and a slow run measures the neighbours.
    # The engine's ratio is also taken per round (engine right after its baseline) and the
    # median of those rounds is what the target is checked on: on a VM whose speed drifts for
    # seconds at a time, two bests can come from different phases; a round's pair cannot.
    t_ref = t_off = t_on = t_struct = t_replay = t_par = float("inf")
    round_ratios: list[float] = []
    replayed = 0
    with tempfile.TemporaryDirectory(prefix="ehp-bench-") as d:
        tmp = Path(d)
        for _ in range(args.repeat):
            t, acc_ref, final = transitions_baseline(args.gpus, evs, spec)
            assert acc_ref == n, f"transitions accepted {acc_ref} of {n}"
            t_ref = min(t_ref, t)

            engine = fresh_engine(args.gpus)
            t_engine = run_engine(engine, evs)
            t_off = min(t_off, t_engine)
            round_ratios.append(t / t_engine)
            gpus = engine.world.of("gpu")
            assert final == {g: (i.state, dict(i.data)) for g, i in gpus.items()}, "not the same"

            log_path = tmp / "transitions.jsonl"
            log = TransitionLog.create(log_path, config=config(args.gpus), specs=load_specs())
            logged = fresh_engine(args.gpus, log)
            first = log.next_seq
            t_on = min(t_on, run_engine(logged, evs))
            logged.close()
            assert logged.world.snapshot() == engine.world.snapshot()

            records: list[dict[str, Any]] = []
            probe = fresh_engine(args.gpus)
            seq = first
            for ev in evs:
                out = probe.handle(ev)
                records.extend(outcome_records(out, seq))
                seq += len(out.records)
            t_struct = min(t_struct, structlog_alone(records, tmp / "structlog.jsonl"))

            gc.collect()
            t0 = time.perf_counter()
            result = replay(log_path)
            t_replay = min(t_replay, time.perf_counter() - t0)
            assert result.world.snapshot() == logged.world.snapshot()
            replayed = result.transitions

            gc.collect()
            t0 = time.perf_counter()
            result = replay(log_path, jobs=args.jobs)
            t_par = min(t_par, time.perf_counter() - t0)
            assert result.world.snapshot() == logged.world.snapshot()
            assert result.transitions == replayed

        if args.profile:
            print("\n--- cProfile: engine, log off ---")
            profile(args.gpus, evs, False, tmp)
            print("--- cProfile: engine, log on ---")
            profile(args.gpus, evs, True, tmp)

    free_b, owned_b = memory_per_instance(args.instances)

    def rate(t: float, count: int = n) -> float:
        return count / t

    ref = rate(t_ref)
    print(f"\n{'contender':<34}{'transitions/s':>15}{'vs transitions':>16}")
    for label, r in (
        ("transitions.Machine (baseline)", ref),
        ("engine, logging off", rate(t_off)),
        ("engine, JSONL log on", rate(t_on)),
        ("replay() of the log, 1 process", rate(t_replay, replayed)),
        (f"replay() of the log, {args.jobs} processes", rate(t_par, replayed)),
        ("structlog rendering alone", rate(t_struct, len(records))),
    ):
        print(f"{label:<34}{r:>15,.0f}{r / ref:>15.2f}x")
    overhead_us = (t_on - t_off) / n * 1e6
    struct_us = t_struct / len(records) * 1e6
    paired = statistics.median(round_ratios)
    rounds = ", ".join(f"{r:.2f}" for r in round_ratios)
    print(f"\nengine vs transitions, round by round: {rounds} (median {paired:.2f}x)")
    print(f"logging overhead per transition: {overhead_us:.2f} us")
    print(f"structlog rendering per record:  {struct_us:.2f} us")
    print(
        f"memory per GPU instance ({args.instances:,}): free {free_b:.0f} B, owned {owned_b:.0f} B"
    )

    checks = (
        (
            "engine >= 5x transitions (log off)",
            paired >= 5.0,
            f"{paired:.2f}x median of rounds (best vs best: {rate(t_off) / ref:.2f}x)",
        ),
        (
            "log overhead <= structlog rendering",
            overhead_us <= struct_us,
            f"{overhead_us:.2f} us vs {struct_us:.2f} us",
        ),
        (
            f"replay >= 200,000 transitions/s ({args.jobs} processes)",
            rate(t_par, replayed) >= 200_000,
            f"{rate(t_par, replayed):,.0f}/s (1 process: {rate(t_replay, replayed):,.0f}/s)",
        ),
        ("<= 1 KiB per instance", owned_b <= 1024, f"{owned_b:.0f} B"),
    )
    print()
    for label, ok, value in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {label:<40} {value}")


if __name__ == "__main__":
    main()
