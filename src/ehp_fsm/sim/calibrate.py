"""Fit the `[simulate]` cost model from a real run's transition log.

What a run's log already measures, transition by transition: each group's dispatch → complete
(an engine's throughput: the tokens it completed over the time it had any group in flight),
each step's partition → stepped (compute, reduction, optimizer and save), each engine's
launch → healthy (start), its last group done after an update → installed (install: an engine
finishes the groups it has in flight before it installs, decoding them meanwhile), drained →
exited (stop), each GPU's release → confirm_free (finalizer), each Hybrid's launch → launched
and launched → loaded.
`fit_costs` takes medians of those and returns a `SimulateSpec` that reproduces them (responses
of `max_response_len` tokens, no tail, no faults); `steps_wall` is the run's training-steps wall
time (first group enqueued → last step published), the number a simulation is compared with.

Knows: the log's record format. Does not know how the run produced it.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

from ehp_fsm.errors import EhpError
from ehp_fsm.plan import Plan, SimulateSpec, simulate_spec

__all__ = ["fit_costs", "steps_wall"]


def _records(log: str | Path) -> list[dict[str, Any]]:
    out = []
    for line in Path(log).read_text(encoding="utf-8").splitlines()[1:]:
        rec = json.loads(line)
        if rec.get("accepted") and "machine" in rec:
            out.append(rec)
    return out


def _median(xs: list[float], what: str) -> float:
    if not xs:
        raise EhpError(f"the log holds no {what} to fit", fix="give the log of a run that trained")
    return max(1e-6, statistics.median(xs))


def steps_wall(log: str | Path) -> float:
    """First group enqueued → last training step published (seconds of the run's clock)."""
    recs = _records(log)
    first = min(r["time"] for r in recs if r["machine"] == "request" and r["event"] == "enqueue")
    last = max(
        r["time"] for r in recs if r["machine"] == "training_step" and r["event"] == "published"
    )
    return float(last - first)


def fit_costs(log: str | Path, plan: Plan) -> SimulateSpec:
    """The cost model that reproduces the run's measured times (see the module docstring)."""
    recs = _records(log)
    first: dict[tuple[str, str, str], float] = {}
    durations: dict[str, list[float]] = defaultdict(list)
    pairs = {
        ("rollout_engine", "healthy"): ("rollout_engine", "launch", "start"),
        ("rollout_engine", "installed"): ("rollout_engine", "update", "install"),
        ("rollout_engine", "exited"): ("rollout_engine", "drained", "stop"),
        ("gpu", "confirm_free"): ("gpu", "release", "finalizer"),
        ("hybrid_replica", "launched"): ("hybrid_replica", "launch", "hybrid_launch"),
        ("hybrid_replica", "loaded"): ("hybrid_replica", "launched", "state_load"),
        ("training_step", "stepped"): ("training_step", "partition", "train"),
    }
    dispatched: dict[str, tuple[str, float]] = {}
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)  # engine -> (dispatch, done)
    last_done: dict[str, float] = {}  # engine -> its latest group completed
    n = plan.grpo.group_size
    for r in recs:
        m, ev, iid, t = r["machine"], r["event"], r["instance"], float(r["time"])
        first[(m, iid, ev)] = t
        if m == "request" and ev == "dispatch":
            dispatched[iid] = (str(r["payload"].get("engine")), t)
        if m == "request" and ev == "complete" and iid in dispatched:
            eid, t0 = dispatched.pop(iid)
            spans[eid].append((t0, t))
            last_done[eid] = t
        start = pairs.get((m, ev))
        if start is not None and (start[0], iid, start[1]) in first:
            took = t - first[(start[0], iid, start[1])]
            if start[2] == "install":
                # from the update, or from the last group it finished after the update: the
                # groups in flight were decoded meanwhile (their time is the throughput's)
                took = t - max(t - took, last_done.get(iid, t - took))
            if start[2] == "train":
                # per sample of the largest share one Core replica trained (the replicas train
                # at once: a Core of DP d takes ~1/d of the batch each); only steps on the Core
                # alone (a Hybrid, with a start-up of its own, may be the slowest replica)
                largest = _core_share(recs, iid)
                if largest:
                    durations["train"].append(took / (largest * n))
            else:
                durations[start[2]].append(took)
    tokens = n * (plan.model.max_response_len if plan.model else 1)
    base = simulate_spec(None, Path("."), plan.model, plan.ehp)
    model_gb = 1.0
    return replace(
        base,
        engine_tokens_per_s=tokens * sum(map(len, spans.values())) / _busy(spans),
        tp_exponent=0.0,
        sequence_tokens_per_s=1e9,
        response_median_tokens=float(tokens // n),
        response_sigma=0.0,
        response_max_tokens=tokens // n,
        response_lengths=(),
        train_s_per_sample=_median(durations["train"], "Core-only training steps"),
        optimizer_s=0.0,
        model_gb=model_gb,
        reduce_gb_per_s=1e9,
        save_gb_per_s=1e9,
        install_gb_per_s=model_gb / _median(durations["install"], "installs"),
        state_gb_per_s=model_gb
        * base.state_bytes_factor
        / _median(durations["state_load"] or [1e-3], "state loads"),
        engine_start_s=_median(durations["start"], "engine starts"),
        engine_stop_s=_median(durations["stop"] or [base.engine_stop_s], "engine stops"),
        hybrid_launch_s=_median(durations["hybrid_launch"] or [1e-3], "Hybrid launches"),
        finalizer_s=_median(durations["finalizer"] or [base.finalizer_s], "finalizers"),
        gpu_fault_per_hour=0.0,
        agent_silence_per_hour=0.0,
        slow_node_fraction=0.0,
    )


def _busy(spans: dict[str, list[tuple[float, float]]]) -> float:
    """Seconds in which each engine had at least one group in flight, summed over engines.
    An update does not stop the decoding: the engine finishes the groups it has in flight, then
    installs (the fitted install is only what follows its last group), as the simulation does
    (its install waits for the groups ahead of it). Leaving the update's time out of the
    decoding counted the drain as neither, and fitted ~40 % more throughput than the engines
    had: the simulated steps ran 24-26 % short under load."""
    total = 0.0
    for intervals in spans.values():
        total += sum(b - a for a, b in _union(intervals))
    if total <= 0:
        raise EhpError("the log holds no completed groups to fit", fix="give a run's log")
    return total


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint, sorted intervals covering the same time."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


_SHARES: dict[int, dict[str, int]] = {}


def _core_share(recs: list[dict[str, Any]], sid: str) -> int:
    """Groups of the largest share one replica trained in step `sid`, if only Core replicas
    trained it (0 if a Hybrid did, or its partition is not in the log). Indexed once per record
    list. (It counted only partitions of one replica: no step of a Core of DP > 1 was fitted.)"""
    index = _SHARES.get(id(recs))
    if index is None:
        index = {}
        for r in recs:
            if r["machine"] == "training_step" and r["event"] == "partition":
                part = r["payload"].get("partition") or {}
                core = part and all(str(k).startswith("core:") for k in part)
                index[r["instance"]] = max(map(len, part.values())) if core else 0
        _SHARES.clear()
        _SHARES[id(recs)] = index
    return index.get(sid, 0)
