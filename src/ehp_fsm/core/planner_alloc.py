"""Where the planner takes GPUs from and how it gives them back: one-host allocation arithmetic.

What it knows: how to index a `ClusterView` by host (free GPUs, pickable serving engines, serving
GPU count), how to choose the engines to stop for k complete one-host replicas within a
physical-GPU budget, and how to cut GPUs coming back into engines of allowed TPs.

What it does not know: whether to borrow or return (that is `ehp_fsm.core.planner`), nor
anything about carrying actions out. Everything here is pure and deterministic: every choice is
made by a total order that ends in ids.

The allocation rule (documented for the lead and the tests):
* A replica is `replica_size` GPUs of one host, taken from that host's free GPUs first, then from
  the GPUs of serving engines stopped *whole* (an engine's every GPU leaves rollout).
* For each host and each replica count m the host could give, the engines to stop are the set
  with the fewest physical GPUs that covers the need, then the fewest engines, then the least
  loaded engines (in-flight plus queued requests), then engine id.
* Across hosts, steps are taken greedily by physical GPUs stopped per replica gained, then by
  GPUs stranded on the host (freed but not part of a replica), then engines stopped, then host
  name — and only while the stopped GPUs stay within the budget `serving - reserve`.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from ehp_fsm.core.planner_model import HYBRID_CURRENT, ClusterView, EngineView, HybridView

__all__ = ["HostAllocation", "ViewIndex", "allocate_replicas", "index_view", "partition_tps"]

_CURRENT = frozenset(HYBRID_CURRENT)


@dataclass(frozen=True, slots=True)
class ViewIndex:
    """A snapshot indexed by host. Free GPU ids are sorted; engines keep the snapshot's order.

    `owned` maps each GPU in state `owned` to its owner (quarantined, failed and releasing GPUs
    are absent: they come back only through reconciliation or their finalizer).
    """

    free: dict[str, list[str]]
    owned: dict[str, str]
    pickable: dict[str, list[EngineView]]
    serving_gpus: int
    current: list[HybridView]


def index_view(view: ClusterView) -> ViewIndex:
    """One pass over GPUs, engines and replicas.

    Serving GPUs are the GPUs in state `owned` by an engine in state `serving` (a quarantined or
    failed GPU of a serving engine does not count). An engine is pickable when it is serving and
    every one of its GPUs is `owned` by it — never a starting, installing, updating, draining or
    stopping engine, and never one whose agent went silent.
    """
    free: dict[str, list[str]] = {}
    owned: dict[str, str] = {}
    for g in view.gpus:
        state = g.state
        if state == "owned":
            owned[g.gpu_id] = g.owner  # type: ignore[assignment]  # owned implies an owner
        elif state == "free":
            lst = free.get(g.host)
            if lst is None:
                free[g.host] = [g.gpu_id]
            else:
                lst.append(g.gpu_id)
    for lst in free.values():
        lst.sort()
    # ClusterView guarantees that a GPU owned by `engine:X` is listed by X, so counting owners
    # counts, for each engine, its GPUs that are really `owned` by it.
    held = Counter(owned.values())
    pickable: dict[str, list[EngineView]] = {}
    serving = 0
    for e in view.engines:
        if e.state != "serving":
            continue
        n_ok = held.get(e.owner, 0)
        serving += n_ok
        if n_ok == e.tp:
            lst_e = pickable.get(e.host)
            if lst_e is None:
                pickable[e.host] = [e]
            else:
                lst_e.append(e)
    current = sorted((h for h in view.hybrids if h.state in _CURRENT), key=_hybrid_id)
    return ViewIndex(
        free=free, owned=owned, pickable=pickable, serving_gpus=serving, current=current
    )


def _engine_id(e: EngineView) -> str:
    return e.engine_id


def _hybrid_id(h: HybridView) -> str:
    return h.hybrid_id


# --------------------------------------------------------------------------- borrow


@dataclass(frozen=True, slots=True)
class HostAllocation:
    """New replicas on one host: engines to stop, then the replica GPU sets in order."""

    host: str
    stops: tuple[EngineView, ...]
    replicas: tuple[tuple[str, ...], ...]
    stranded: int


_Table = tuple[tuple[int, int, tuple[tuple[int, int], ...]], ...]


@lru_cache(maxsize=8192)
def _host_table(n_free: int, tps: tuple[int, ...], replica_size: int) -> _Table:
    """For m = 0..max replicas on a host: (GPUs stopped, engines stopped, {tp: count}).

    `tps` are the pickable engines' TPs, sorted. The cheapest cover of the need wins: fewest
    physical GPUs, then fewest engines, then the count vector (for determinism).
    """
    distinct = sorted(set(tps))
    counts = [tps.count(t) for t in distinct]
    combos: list[tuple[int, int, tuple[tuple[int, int], ...]]] = []
    for pick in itertools.product(*(range(c + 1) for c in counts)):
        gpus = sum(t * k for t, k in zip(distinct, pick, strict=True))
        engines = sum(pick)
        chosen = tuple((t, k) for t, k in zip(distinct, pick, strict=True) if k)
        combos.append((gpus, engines, chosen))
    combos.sort()
    max_m = (n_free + sum(tps)) // replica_size
    table = []
    for m in range(max_m + 1):
        need = m * replica_size - n_free
        table.append(next(c for c in combos if c[0] >= need))
    return tuple(table)


def _load(e: EngineView) -> tuple[int, str]:
    return (e.active_requests + e.queued_requests, e.engine_id)


def _concrete_stops(
    engines: Sequence[EngineView], chosen: tuple[tuple[int, int], ...]
) -> tuple[EngineView, ...]:
    """Turn a {tp: count} choice into engines: the least loaded of each TP, then by id."""
    out: list[EngineView] = []
    for tp, count in chosen:
        same = sorted((e for e in engines if e.tp == tp), key=_load)
        out.extend(same[:count])
    out.sort(key=_engine_id)
    return tuple(out)


_Key = tuple[float, int, int, int]


def _candidate(
    table: _Table, m0: int, remaining: int, budget: int, n_free: int, replica_size: int
) -> tuple[_Key, int] | None:
    """The host's best next step from m0 replicas: (key, new m), or None when nothing fits."""
    c0, e0, _ = table[m0]
    best: tuple[_Key, int] | None = None
    for m in range(m0 + 1, min(len(table) - 1, m0 + remaining) + 1):
        c, e, _ = table[m]
        dc = c - c0
        if dc > budget:
            break  # the cost table is non-decreasing in m
        dm = m - m0
        key: _Key = (dc / dm, n_free + c - m * replica_size, e - e0, -dm)
        if best is None or key < best[0]:
            best = (key, m)
    return best


@lru_cache(maxsize=65536)
def _host_step(
    n_free: int, tps: tuple[int, ...], replica_size: int, m0: int
) -> tuple[_Table, tuple[_Key, int] | None]:
    """The host's table and its best step from m0 when neither count nor budget binds."""
    table = _host_table(n_free, tps, replica_size)
    return table, _candidate(table, m0, len(table), table[-1][0], n_free, replica_size)


def allocate_replicas(
    index: ViewIndex, k: int, budget: int, replica_size: int
) -> tuple[HostAllocation, ...]:
    """Up to `k` new complete one-host replicas stopping at most `budget` physical GPUs.

    Returns allocations sorted by host. Fewer than k when hosts cannot yield more; empty (so no
    engine is stopped) when not even one complete set exists within the budget.
    """
    shapes: dict[str, tuple[int, tuple[int, ...]]] = {}
    heap: list[tuple[float, int, int, int, str, int, int]] = []
    free_of, pickable_of = index.free, index.pickable
    for host in free_of.keys() | pickable_of.keys():  # order does not matter: keys end in host
        nf = len(free_of.get(host, ()))
        tps = tuple(sorted([e.tp for e in pickable_of.get(host, ())]))
        if nf + sum(tps) < replica_size:
            continue
        shapes[host] = (nf, tps)
        table, cand = _host_step(nf, tps, replica_size, 0)
        if k < len(table) - 1 or budget < table[-1][0]:
            cand = _candidate(table, 0, k, budget, nf, replica_size)
        if cand is not None:
            heap.append((*cand[0], host, 0, cand[1]))
    heapq.heapify(heap)
    level: dict[str, int] = {}
    remaining = k
    while remaining > 0 and heap:
        *_, host, m0, m = heapq.heappop(heap)
        nf, tps = shapes[host]
        table = _host_table(nf, tps, replica_size)
        dc = table[m][0] - table[m0][0]
        if m - m0 <= remaining and dc <= budget:
            level[host] = m
            remaining -= m - m0
            budget -= dc
            m0 = m
        _, cand = _host_step(nf, tps, replica_size, m0)
        if remaining < len(table) - 1 - m0 or budget < table[-1][0] - table[m0][0]:
            cand = _candidate(table, m0, remaining, budget, nf, replica_size)
        if cand is not None:
            heapq.heappush(heap, (*cand[0], host, m0, cand[1]))
    out: list[HostAllocation] = []
    for host in sorted(level):
        m = level[host]
        _, _, chosen = _host_table(*shapes[host], replica_size)[m]
        stops = _concrete_stops(index.pickable.get(host, ()), chosen)
        pool = list(index.free.get(host, ()))
        for e in stops:
            pool.extend(sorted(e.gpu_ids))
        sets = tuple(tuple(pool[i * replica_size : (i + 1) * replica_size]) for i in range(m))
        out.append(HostAllocation(host, stops, sets, len(pool) - m * replica_size))
    return tuple(out)


# --------------------------------------------------------------------------- return


@lru_cache(maxsize=1024)
def partition_tps(n: int, allowed: tuple[int, ...], prefer_small: bool) -> tuple[int, ...]:
    """Cut n GPUs of one host into engines of allowed TPs (largest TP first in the result).

    Rule: use as many GPUs as possible (fewest stranded); then, when rollout is saturated
    (`prefer_small`), as many engines as possible — independent engines add throughput under a
    backlog; otherwise as few engines as possible — fewer restarts to pay and lower per-request
    latency when there is no backlog. Ties go to the lexicographically larger TP list.
    """
    best: list[tuple[int, ...] | None] = [None] * (n + 1)
    best[0] = ()

    def rank(parts: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
        count = -len(parts) if prefer_small else len(parts)
        return (count, tuple(-p for p in parts))

    for s in range(1, n + 1):
        for tp in allowed:
            prev = best[s - tp] if tp <= s else None
            if prev is None:
                continue
            parts = tuple(sorted((*prev, tp), reverse=True))
            cur = best[s]
            if cur is None or rank(parts) < rank(cur):
                best[s] = parts
    for s in range(n, -1, -1):
        found = best[s]
        if found is not None:
            return found
    return ()  # pragma: no cover - best[0] is always set
