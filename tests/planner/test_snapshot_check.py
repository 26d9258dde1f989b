"""`ClusterView`'s fast consistency check accepts exactly what the record-by-record check accepts.

`ClusterView.__post_init__` runs `_snapshot_consistent` (a few set operations) and, only when it
says no, `_explain_snapshot` (the record-by-record walk that names the first problem). If the fast
check were looser, an inconsistent snapshot would be planned on; if it were stricter, a
consistent one would still pass but only after the slow walk. Random consistent snapshots are
corrupted by zero to three random edits of the kinds the cross-checks exist for, and both
checks must give the same verdict.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from ehp_fsm.core.planner_model import (
    EngineView,
    GpuView,
    HybridView,
    PlannerInputError,
    _explain_snapshot,
    _snapshot_consistent,
)
from tests.planner.cluster import ClusterBuilder

Fields = tuple[tuple[str, ...], tuple[GpuView, ...], tuple[EngineView, ...], tuple[HybridView, ...]]

ENGINE_STATES = ("serving", "starting", "draining", "stopped", "failed")
HYBRID_STATES = ("requested", "loading", "active", "leaving", "stopped", "cancelled")


@st.composite
def snapshots(draw: st.DrawFn) -> Fields:
    b = ClusterBuilder(replica_size=2)
    for i in range(draw(st.integers(1, 3))):
        host = f"h{i}"
        b.host(host)
        left = 4
        while left > 0:
            kind = draw(st.sampled_from(("engine", "hybrid", "free", "core")))
            if kind == "engine":
                tp = draw(st.sampled_from([t for t in (1, 2, 4) if t <= left]))
                b.engine(host, tp, state=draw(st.sampled_from(ENGINE_STATES)))
                left -= tp
            elif kind == "hybrid" and left >= 2:
                state = draw(st.sampled_from(HYBRID_STATES))
                b.hybrid(host, state=state)
                left -= 0 if state == "requested" else 2
            elif kind == "core":
                b.core(host, 1)
                left -= 1
            else:
                b.free(host, 1)
                left -= 1
        if draw(st.booleans()):
            b.silence_agent(host)
    view = b.build()
    return view.hosts, view.gpus, view.engines, view.hybrids


def _owner(draw: st.DrawFn, fields: Fields) -> str | None:
    _, _, engines, hybrids = fields
    names = [None, "core", "engine:nobody", "hybrid:nobody"]
    names += [e.owner for e in engines] + [h.owner for h in hybrids]
    return draw(st.sampled_from(names))


def _corrupt(draw: st.DrawFn, fields: Fields) -> Fields:
    hosts, gpus, engines, hybrids = fields
    gpu_ids = [g.gpu_id for g in gpus] + ["h0:unknown"]
    kind = draw(
        st.sampled_from(
            (
                "dup_host",
                "drop_host",
                "dup_gpu",
                "gpu_owner",
                "gpu_lost",
                "gpu_host",
                "engine_gpus",
                "extra_gpu",
                "extra_gpu",
                "extra_gpu",
                "engine_state",
                "dup_engine",
                "hybrid_gpus",
                "hybrid_state",
                "dup_hybrid",
            )
        )
    )
    event(f"corruption={kind}")
    if kind == "dup_host" and hosts:
        return (*hosts, draw(st.sampled_from(hosts))), gpus, engines, hybrids
    if kind == "drop_host" and len(hosts) > 1:
        gone = draw(st.sampled_from(hosts))
        return tuple(h for h in hosts if h != gone), gpus, engines, hybrids
    if kind in ("dup_gpu", "gpu_owner", "gpu_lost", "gpu_host") and gpus:
        i = draw(st.integers(0, len(gpus) - 1))
        g = gpus[i]
        if kind == "dup_gpu":
            return hosts, (*gpus, g), engines, hybrids
        if kind == "gpu_owner":
            owner = _owner(draw, fields)
            state = "free" if owner is None else draw(st.sampled_from(("owned", "releasing")))
            g = dataclasses.replace(g, state=state, owner=owner)
        elif kind == "gpu_lost":
            g = dataclasses.replace(
                g, state=draw(st.sampled_from(("quarantined", "failed"))), owner=None
            )
        else:
            g = dataclasses.replace(g, host=draw(st.sampled_from((*hosts, "elsewhere"))))
        return hosts, (*gpus[:i], g, *gpus[i + 1 :]), engines, hybrids
    live = [j for j, e in enumerate(engines) if e.live]
    if kind == "extra_gpu" and live:
        # A live engine also lists another GPU of its host, which may have been lost (failed, no
        # owner): then only the "two owners" rule can stop it, else the ownership rule.
        j = draw(st.sampled_from(live))
        e = engines[j]
        others = [i for i, g in enumerate(gpus) if g.host == e.host and g.gpu_id not in e.gpu_ids]
        if others:
            i = draw(st.sampled_from(others))
            g = gpus[i]
            if draw(st.booleans()):
                g = dataclasses.replace(g, state="failed", owner=None)
            e = dataclasses.replace(e, tp=e.tp + 1, gpu_ids=(*e.gpu_ids, g.gpu_id))
            gpus = (*gpus[:i], g, *gpus[i + 1 :])
            engines = (*engines[:j], e, *engines[j + 1 :])
        return hosts, gpus, engines, hybrids
    if kind == "dup_hybrid" and hybrids:
        return hosts, gpus, engines, (*hybrids, draw(st.sampled_from(hybrids)))
    if kind in ("engine_gpus", "engine_state", "dup_engine") and engines:
        i = draw(st.integers(0, len(engines) - 1))
        e = engines[i]
        if kind == "dup_engine":
            return hosts, gpus, (*engines, e), hybrids
        if kind == "engine_gpus":
            ids = draw(st.lists(st.sampled_from(gpu_ids), min_size=1, max_size=4, unique=True))
            e = dataclasses.replace(e, tp=len(ids), gpu_ids=tuple(ids))
        else:
            e = dataclasses.replace(e, state=draw(st.sampled_from(ENGINE_STATES)))
        return hosts, gpus, (*engines[:i], e, *engines[i + 1 :]), hybrids
    if kind in ("hybrid_gpus", "hybrid_state") and hybrids:
        i = draw(st.integers(0, len(hybrids) - 1))
        h = hybrids[i]
        if kind == "hybrid_gpus":
            ids = draw(st.lists(st.sampled_from(gpu_ids), min_size=1, max_size=2, unique=True))
            h = dataclasses.replace(h, gpu_ids=tuple(ids))
        elif h.gpu_ids:
            h = dataclasses.replace(h, state=draw(st.sampled_from(HYBRID_STATES[1:])))
        return hosts, gpus, engines, (*hybrids[:i], h, *hybrids[i + 1 :])
    return fields


@st.composite
def corrupted_snapshots(draw: st.DrawFn) -> Fields:
    fields = draw(snapshots())
    for _ in range(draw(st.integers(0, 3))):
        fields = _corrupt(draw, fields)
    return fields


@given(corrupted_snapshots())
def test_fast_check_agrees_with_the_record_by_record_check(fields: Fields) -> None:
    try:
        _explain_snapshot(*fields)
    except PlannerInputError:
        slow = False
    else:
        slow = True
    event(f"consistent={slow}")
    assert _snapshot_consistent(*fields) == slow


def _gpu(gid: str, host: str = "a", state: str = "owned", owner: str | None = None) -> GpuView:
    return GpuView(gpu_id=gid, host=host, state=state, owner=owner)


def _engine(eid: str, ids: tuple[str, ...], state: str = "serving", host: str = "a") -> EngineView:
    return EngineView(engine_id=eid, host=host, tp=len(ids), gpu_ids=ids, state=state)


# Cases the random edits reach only rarely: each is decided by one rule of the fast check alone.
EDGE_CASES: dict[str, tuple[Fields, bool]] = {
    "live engine keeps a lost GPU": (
        (("a",), (_gpu("g0", state="failed"),), (_engine("e", ("g0",)),), ()),
        True,
    ),
    "two live engines list one lost GPU": (
        (
            ("a",),
            (_gpu("g0", state="quarantined"),),
            (_engine("e", ("g0",)), _engine("f", ("g0",))),
            (),
        ),
        False,
    ),
    "live engine lists a free GPU": (
        (("a",), (_gpu("g0", state="free"),), (_engine("e", ("g0",)),), ()),
        False,
    ),
    "stopped engine lists a free GPU": (
        (("a",), (_gpu("g0", state="free"),), (_engine("e", ("g0",), "stopped"),), ()),
        True,
    ),
    "stopped engine lists a free GPU of another host": (
        (
            ("a", "b"),
            (_gpu("g0", host="b", state="free"),),
            (_engine("e", ("g0",), "stopped"),),
            (),
        ),
        False,
    ),
    "two replicas with one id": (
        (
            ("a",),
            (),
            (),
            (
                HybridView(hybrid_id="r", host="a", gpu_ids=(), state="requested"),
                HybridView(hybrid_id="r", host="a", gpu_ids=(), state="requested"),
            ),
        ),
        False,
    ),
}


@pytest.mark.parametrize("name", sorted(EDGE_CASES))
def test_fast_check_agrees_on_edge_cases(name: str) -> None:
    fields, consistent = EDGE_CASES[name]
    try:
        _explain_snapshot(*fields)
    except PlannerInputError:
        slow = False
    else:
        slow = True
    assert slow == consistent
    assert _snapshot_consistent(*fields) == consistent
