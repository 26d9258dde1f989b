"""Test helpers: build `ClusterView`s by hand, and a tiny pure simulator that applies decisions.

The simulator is the far edge faked on purpose: it applies each action as if every drain, stop
confirmation and launch completed at once, and it re-checks each action's precondition the way
the machines' guards do (an action whose precondition no longer holds does nothing). It exists to
check the planner's invariants after a decision is carried out; the real execution goes through
the engine's machines.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from ehp_fsm.core.planner import (
    CancelJoin,
    ClusterView,
    CoreLayout,
    Decision,
    EngineView,
    GpuView,
    HybridView,
    Metrics,
    PlannerPolicy,
    RestartEngine,
    StartHybrid,
    StopEngine,
    StopHybrid,
)

JOINING = ("requested", "allocated", "launching", "loading", "ready")
CURRENT = (*JOINING, "active")


class ClusterBuilder:
    """Lay out hosts GPU by GPU: engines, replicas, free and Core GPUs, and failures."""

    def __init__(self, *, replica_size: int = 4, core_replicas: int = 1) -> None:
        self.replica_size = replica_size
        self.core_replicas = core_replicas
        self.hosts: list[str] = []
        self.gpus: dict[str, GpuView] = {}
        self.engines: list[EngineView] = []
        self.hybrids: list[HybridView] = []
        self._next: dict[str, int] = {}

    def host(self, name: str) -> ClusterBuilder:
        self.hosts.append(name)
        self._next[name] = 0
        return self

    def _take(self, host: str, n: int, state: str, owner: str | None) -> tuple[str, ...]:
        start = self._next[host]
        self._next[host] = start + n
        ids = tuple(f"{host}:g{i:02d}" for i in range(start, start + n))
        for gid in ids:
            self.gpus[gid] = GpuView(gpu_id=gid, host=host, state=state, owner=owner)
        return ids

    def engine(
        self, host: str, tp: int, *, state: str = "serving", name: str | None = None, load: int = 0
    ) -> str:
        eid = name or f"{host}-e{self._next[host]:02d}"
        live = state not in ("stopped", "failed")
        gpu_state, owner = ("owned", f"engine:{eid}") if live else ("free", None)
        ids = self._take(host, tp, gpu_state, owner)
        self.engines.append(
            EngineView(
                engine_id=eid, host=host, tp=tp, gpu_ids=ids, state=state, active_requests=load
            )
        )
        return eid

    def hybrid(self, host: str, *, state: str = "active", name: str | None = None) -> str:
        hid = name or f"{host}-h{len(self.hybrids):02d}"
        live = state not in ("stopped", "cancelled", "failed")
        if state == "requested":
            ids: tuple[str, ...] = ()
        else:
            gpu_state, owner = ("owned", f"hybrid:{hid}") if live else ("free", None)
            ids = self._take(host, self.replica_size, gpu_state, owner)
        self.hybrids.append(HybridView(hybrid_id=hid, host=host, gpu_ids=ids, state=state))
        return hid

    def free(self, host: str, n: int) -> tuple[str, ...]:
        return self._take(host, n, "free", None)

    def core(self, host: str, n: int) -> tuple[str, ...]:
        return self._take(host, n, "owned", "core")

    def crash_engine(self, engine_id: str) -> None:
        """Engine crash: the engine is failed; its GPUs stay with it until reconciled."""
        self.engines = [
            dataclasses.replace(e, state="failed") if e.engine_id == engine_id else e
            for e in self.engines
        ]

    def silence_agent(self, host: str) -> None:
        """Agent silence: every GPU of the host is quarantined, owners kept."""
        for gid, g in self.gpus.items():
            if g.host == host:
                self.gpus[gid] = dataclasses.replace(g, state="quarantined")

    def build(self, *, version: int = 0) -> ClusterView:
        return ClusterView(
            version=version,
            hosts=tuple(self.hosts),
            gpus=tuple(self.gpus.values()),
            engines=tuple(self.engines),
            hybrids=tuple(self.hybrids),
            core=CoreLayout(replicas=self.core_replicas, replica_size=self.replica_size),
        )


def uniform_cluster(
    n_hosts: int, tps: Iterable[int], *, replica_size: int = 4, version: int = 0
) -> ClusterView:
    """`n_hosts` hosts, each carved into serving engines of the given TPs, in order."""
    b = ClusterBuilder(replica_size=replica_size)
    layout = tuple(tps)
    for i in range(n_hosts):
        host = f"h{i}"
        b.host(host)
        for tp in layout:
            b.engine(host, tp)
    return b.build(version=version)


def policy(**overrides: object) -> PlannerPolicy:
    base: dict[str, object] = {
        "rollout_reserve": 4,
        "replica_size": 4,
        "allowed_engine_tps": (1, 2, 4, 8),
        "borrow_threshold": 1.5,
        "release_threshold": 0.67,
        "cooldown_s": 60.0,
        "engine_restart_s": 30.0,
        "release_resume_s": 3.0,
        "max_hybrids": 8,
    }
    base.update(overrides)
    return PlannerPolicy(**base)  # type: ignore[arg-type]


def metrics(train: float, rollout: float, **overrides: float | int) -> Metrics:
    return Metrics(train_seconds=train, rollout_seconds=rollout, **overrides)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- simulator


def apply_decision(view: ClusterView, decision: Decision) -> tuple[ClusterView, int]:
    """Apply the actions that still make sense; return (new view, actions that acted).

    The version goes up by one per action that acted. New ids are derived from the version and
    the first GPU, so they never collide with earlier ones.
    """
    gpus = {g.gpu_id: g for g in view.gpus}
    engines = {e.engine_id: e for e in view.engines}
    hybrids = {h.hybrid_id: h for h in view.hybrids}
    version = view.version
    acted = 0

    def release(ids: Iterable[str]) -> None:
        for gid in ids:
            gpus[gid] = dataclasses.replace(gpus[gid], state="free", owner=None)

    def all_free(host: str, ids: tuple[str, ...]) -> bool:
        return all(
            gid in gpus and gpus[gid].host == host and gpus[gid].state == "free" for gid in ids
        )

    for a in decision.actions:
        if isinstance(a, StopEngine):
            e = engines.get(a.engine_id)
            if e is None or e.state != "serving":
                continue
            engines[e.engine_id] = dataclasses.replace(e, state="stopped")
            release(e.gpu_ids)
        elif isinstance(a, CancelJoin | StopHybrid):
            h = hybrids.get(a.hybrid_id)
            ok = JOINING if isinstance(a, CancelJoin) else ("active",)
            if h is None or h.state not in ok:
                continue
            new_state = "cancelled" if isinstance(a, CancelJoin) else "stopped"
            hybrids[h.hybrid_id] = dataclasses.replace(h, state=new_state)
            release(h.gpu_ids)
        elif isinstance(a, StartHybrid):
            if len(a.gpu_ids) != view.core.replica_size or not all_free(a.host, a.gpu_ids):
                continue
            hid = f"n{version}-{a.gpu_ids[0]}"
            hybrids[hid] = HybridView(
                hybrid_id=hid, host=a.host, gpu_ids=a.gpu_ids, state="allocated"
            )
            for gid in a.gpu_ids:
                gpus[gid] = dataclasses.replace(gpus[gid], state="owned", owner=f"hybrid:{hid}")
        elif isinstance(a, RestartEngine):
            if len(a.gpu_ids) != a.tp or not all_free(a.host, a.gpu_ids):
                continue
            eid = f"r{version}-{a.gpu_ids[0]}"
            engines[eid] = EngineView(
                engine_id=eid, host=a.host, tp=a.tp, gpu_ids=a.gpu_ids, state="starting"
            )
            for gid in a.gpu_ids:
                gpus[gid] = dataclasses.replace(gpus[gid], state="owned", owner=f"engine:{eid}")
        else:  # pragma: no cover - the action union is closed
            raise AssertionError(a)
        acted += 1
        version += 1
    new = ClusterView(
        version=version,
        hosts=view.hosts,
        gpus=tuple(gpus.values()),
        engines=tuple(engines.values()),
        hybrids=tuple(hybrids.values()),
        core=view.core,
    )
    return new, acted


def current_hybrids(view: ClusterView) -> int:
    return sum(1 for h in view.hybrids if h.state in CURRENT)


def actions_of(decision: Decision, kind: type) -> list:  # type: ignore[type-arg]
    return [a for a in decision.actions if isinstance(a, kind)]
