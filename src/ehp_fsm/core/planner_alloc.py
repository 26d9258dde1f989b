"""Where the planner takes GPUs from and how it gives them back: one-host allocation arithmetic.

What it knows: how to read a `ClusterView` once (GPUs that are not `owned`, pickable serving
engines, serving GPU count, current replicas) and group what a decision needs by host, how to
choose the engines to stop for k complete one-host replicas within a physical-GPU budget, and how
to cut GPUs coming back into engines of allowed TPs.

Cost (issue 4's benchmark): the read is one comprehension over GPUs and one over engines; a
borrow adds one pass over pickable engines and one over hosts, work per host *shape* (free GPU
count and pickable TP multiset, which most hosts share), and work per host that yields replicas.
Nothing is quadratic; the heap holds the shapes and the hosts already touched.

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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from ehp_fsm.core.planner_model import (
    HYBRID_CURRENT,
    ClusterView,
    EngineView,
    GpuView,
    HybridView,
)

__all__ = [
    "HostAllocation",
    "ViewIndex",
    "allocate_replicas",
    "free_by_host",
    "index_view",
    "partition_tps",
]

_CURRENT = frozenset(HYBRID_CURRENT)


@dataclass(frozen=True, slots=True)
class ViewIndex:
    """A snapshot read once: what a decision needs, in flat lists (grouped by host on demand).

    `odd` are the GPUs in any state but `owned` (free, releasing, quarantined, failed), in
    snapshot order, and `not_owned` their ids: such GPUs come back only through reconciliation
    or their finalizer, never by a return. Every other GPU is `owned` by whoever lists it
    (`ClusterView` guarantees that a GPU in state `owned` is owned by the live engine or replica
    that lists it). `pickable` keeps the snapshot's order.
    """

    odd: list[GpuView]
    not_owned: set[str]
    pickable: list[EngineView]
    serving_gpus: int
    current: list[HybridView]


def index_view(view: ClusterView) -> ViewIndex:
    """One pass over GPUs, engines and replicas.

    Serving GPUs are the GPUs in state `owned` by an engine in state `serving` (a quarantined or
    failed GPU of a serving engine does not count). An engine is pickable when it is serving and
    every one of its GPUs is `owned` by it — never a starting, installing, updating, draining or
    stopping engine, and never one whose agent went silent.

    Cost: one comprehension over GPUs and one over engines; only the serving engines on a host
    with a GPU that is not `owned` are looked at again (one set test each).
    """
    odd = [g for g in view.gpus if g.state != "owned"]
    not_owned = {g.gpu_id for g in odd}
    odd_hosts = {g.host for g in odd}
    serving_engines = [e for e in view.engines if e.state == "serving"]
    serving = sum([e.tp for e in serving_engines])
    # A serving engine is live, so each GPU it lists is either `owned` by it or in `not_owned`
    # (ClusterView's cross-checks): its GPUs that really serve are tp minus those.
    hurt = [
        e for e in serving_engines if e.host in odd_hosts and not not_owned.isdisjoint(e.gpu_ids)
    ]
    pickable = serving_engines
    if hurt:
        serving -= sum([len(not_owned.intersection(e.gpu_ids)) for e in hurt])
        out = {e.engine_id for e in hurt}
        pickable = [e for e in serving_engines if e.engine_id not in out]
    current = sorted([h for h in view.hybrids if h.state in _CURRENT], key=_hybrid_id)
    return ViewIndex(
        odd=odd, not_owned=not_owned, pickable=pickable, serving_gpus=serving, current=current
    )


def free_by_host(index: ViewIndex) -> dict[str, list[str]]:
    """Free GPU ids per host, each list sorted (hosts without a free GPU are absent)."""
    free: dict[str, list[str]] = {}
    for g in index.odd:
        if g.state == "free":
            lst = free.get(g.host)
            if lst is None:
                free[g.host] = [g.gpu_id]
            else:
                lst.append(g.gpu_id)
    for lst in free.values():
        lst.sort()
    return free


def _engine_id(e: EngineView) -> str:
    return e.engine_id


def _hybrid_id(h: HybridView) -> str:
    return h.hybrid_id


# --------------------------------------------------------------------------- borrow


class HostAllocation(NamedTuple):
    """New replicas on one host: engines to stop, then the replica GPU sets in order.

    `stop_gpus[i]` are the GPU ids of `stops[i]`, sorted. `waits[j]` are the ids of the stopped
    engines whose GPUs replica j uses, in the order of `stops`. (A named tuple, not a frozen
    dataclass: one is built per host that yields replicas, and a tuple is built several times
    faster; it is as immutable.)
    """

    host: str
    stops: tuple[EngineView, ...]
    stop_gpus: tuple[tuple[str, ...], ...]
    replicas: tuple[tuple[str, ...], ...]
    waits: tuple[tuple[str, ...], ...]
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
) -> list[EngineView]:
    """Turn a {tp: count} choice into engines: the least loaded of each TP, then by id."""
    if sum([count for _, count in chosen]) == len(engines):  # every engine: no choice to make
        return sorted(engines, key=_engine_id)
    out: list[EngineView] = []
    for tp, count in chosen:
        same = [e for e in engines if e.tp == tp]
        if count < len(same):  # all of them when count == len: no load order needed
            same.sort(key=_load)
            del same[count:]
        out.extend(same)
    out.sort(key=_engine_id)
    return out


def _host_allocation(
    host: str,
    free: Sequence[str],
    engines: Sequence[EngineView],
    chosen: tuple[tuple[int, int], ...],
    m: int,
    replica_size: int,
) -> HostAllocation:
    """m replica sets from the host's free GPUs, then the chosen engines' GPUs, in that order."""
    stops = _concrete_stops(engines, chosen)
    pool = list(free)
    stop_gpus: list[tuple[str, ...]] = []
    spans: list[tuple[int, int, str]] = []
    for e in stops:
        ids = tuple(sorted(e.gpu_ids))
        stop_gpus.append(ids)
        spans.append((len(pool), len(pool) + len(ids), e.engine_id))
        pool.extend(ids)
    replicas: list[tuple[str, ...]] = []
    waits: list[tuple[str, ...]] = []
    for i in range(m):
        lo, hi = i * replica_size, (i + 1) * replica_size
        replicas.append(tuple(pool[lo:hi]))
        waits.append(tuple([eid for a, b, eid in spans if a < hi and b > lo]))
    # host, stops, stop_gpus, replicas, waits, stranded
    return HostAllocation(
        host,
        tuple(stops),
        tuple(stop_gpus),
        tuple(replicas),
        tuple(waits),
        len(pool) - m * replica_size,
    )


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


class _Shape:
    """One host shape (free GPU count, pickable engine TPs) and its memoised greedy steps.

    Hosts of one shape have the same allocation table and the same best step from each replica
    count when neither the count nor the budget binds, so both are computed once per shape per
    decision (and the table once per process: `_host_table` is memoised).
    """

    __slots__ = ("free", "steps", "table")

    def __init__(self, n_free: int, tps: tuple[int, ...], replica_size: int) -> None:
        self.free = n_free
        self.table = _host_table(n_free, tps, replica_size)
        self.steps: dict[int, tuple[_Key, int] | None] = {}

    def step(
        self, m0: int, remaining: int, budget: int, replica_size: int
    ) -> tuple[_Key, int] | None:
        """The best step from m0 replicas under the count and budget left (see `_candidate`)."""
        table = self.table
        top = len(table) - 1
        if remaining < top - m0 or budget < table[top][0] - table[m0][0]:
            return _candidate(table, m0, remaining, budget, self.free, replica_size)
        steps = self.steps
        if m0 not in steps:
            steps[m0] = _candidate(table, m0, top + 1, table[top][0], self.free, replica_size)
        return steps[m0]


def allocate_replicas(
    index: ViewIndex, k: int, budget: int, replica_size: int
) -> Iterator[HostAllocation]:
    """Up to `k` new complete one-host replicas stopping at most `budget` physical GPUs.

    Yields allocations sorted by host (every choice is made before the first is yielded). Fewer
    than k when hosts cannot yield more; none (so no engine is stopped) when not even one
    complete set exists within the budget.

    The greedy keeps one pending step per host in a heap ordered by (key, host); a popped step
    that no longer fits the count or budget left is recomputed and pushed back. Hosts of one
    shape share their table and steps (`_Shape`); the hosts of a shape not yet popped share one
    heap entry (their first steps are equal, so they leave the heap in host order), which keeps
    the heap as small as the shapes plus the hosts already touched.
    """
    free_of = free_by_host(index)
    pickable = index.pickable
    # Each host's shape as one int, in base b (more than any count): digit 0 counts its free
    # GPUs, digit i > 0 its pickable engines of the i-th TP. Equal ints are equal shapes.
    base = max(len(pickable), len(index.odd)) + 1
    weight: dict[int, int] = {}  # TP -> base ** position, positions in order of first sight
    code_of: dict[str, int] = {}
    code_get = code_of.get
    for e in pickable:
        try:
            w = weight[e.tp]
        except KeyError:
            w = weight[e.tp] = base ** (len(weight) + 1)
        host = e.host
        code_of[host] = code_get(host, 0) + w
    for host, free in free_of.items():
        code_of[host] = code_get(host, 0) + len(free)
    groups: dict[int, list[str]] = {}
    groups_get = groups.get
    for host, code in code_of.items():
        members = groups_get(code)
        if members is None:
            groups[code] = [host]
        else:
            members.append(host)
    heap: list[tuple[_Key, str, int, int, _Shape, Iterator[str] | None]] = []
    for code, members in groups.items():
        tps = tuple(sorted([tp for tp, w in weight.items() for _ in range((code // w) % base)]))
        shape = _Shape(code % base, tps, replica_size)
        first = shape.step(0, k, budget, replica_size)
        if first is not None:
            hosts = iter(sorted(members))
            heap.append((first[0], next(hosts), 0, first[1], shape, hosts))
    heapq.heapify(heap)  # (key, host) is unique per entry: later fields are never compared
    level: dict[str, tuple[int, _Shape]] = {}
    remaining = k
    while remaining > 0 and heap:
        key, host, m0, m, shape, rest = heapq.heappop(heap)
        if rest is not None:  # the shape's next untouched host, with the same first step
            after = next(rest, None)
            if after is not None:
                heapq.heappush(heap, (key, after, 0, m, shape, rest))
        table = shape.table
        dc = table[m][0] - table[m0][0]
        if m - m0 <= remaining and dc <= budget:
            level[host] = (m, shape)
            remaining -= m - m0
            budget -= dc
            m0 = m
        nxt = shape.step(m0, remaining, budget, replica_size)
        if nxt is not None:
            heapq.heappush(heap, (nxt[0], host, m0, nxt[1], shape, None))
    engines_of: dict[str, list[EngineView]] = {}
    for e in pickable:
        if e.host in level:
            lst = engines_of.get(e.host)
            if lst is None:
                engines_of[e.host] = [e]
            else:
                lst.append(e)
    # Built one at a time as the caller asks: each allocation is garbage once its actions exist,
    # so on a large cluster it is freed young instead of being walked by full collections.
    return (
        _host_allocation(
            host,
            free_of.get(host, ()),
            engines_of.get(host, ()),
            shape.table[m][2],
            m,
            replica_size,
        )
        for host, (m, shape) in sorted(level.items())
    )


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
