"""Indices of the world for the guards that ask cluster-wide questions, kept up to date by
`World.apply` — so that those guards cost what the pending step touches, not the cluster.

Two questions were scans of the whole world on every call, and calls grow with the cluster
too (one per engine drained, failed or stopped), so a run's cost grew with the square of its
size:

- "which groups are in flight on engine e?" (`guards.inflight_requests`, asked by
  `no_inflight_requests` and by the effect that requeues a failed engine's groups): every
  request scanned. Here: the ids of the `dispatched` requests, by the engine they name.
- "how many GPUs serve rollout?" (`guards.rollout_gpus`, asked by `keeps_rollout_reserve`):
  every engine and each of its GPUs. Here: each engine's share (its GPUs the ledger says it
  owns, while it is in `ROLLOUT_STATES`) and their sum.

The answers are defined by the scans (`guards.inflight_requests_scan`,
`guards.rollout_gpus_scan`); the guards read the index for the world as applied and look at the
pending step's few changes themselves. `tests/core/test_index.py` checks index against scan
after every event of runs with faults.

Knows: which instance fields the two questions read. Does not know: why (see `guards`). Written
only through `World.apply` (one change at a time, with the instance it replaces); a world whose
instances are replaced wholesale (a checkpoint restored, a test writing instances directly)
calls `World.reindex`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final

__all__ = ["GROUP_STATES", "ROLLOUT_STATES", "Index", "engine_share"]

#: Engine states whose GPUs count as rollout capacity for the reserve: up (healthy) and either
#: serving or about to serve again. The planner counts `serving` engines only, so every drain it
#: decides passes `guards.keeps_rollout_reserve`; a drain that would leave fewer GPUs than the
#: reserve never does.
ROLLOUT_STATES: Final = frozenset({"installing", "serving", "updating"})
#: Group (request) states whose members `core.invariants` checks on every event of a run: a
#: run's groups grow with its length, and only these few are live.
GROUP_STATES: Final = frozenset({"claimed", "dispatched"})
_ENGINE: Final = "rollout_engine"
_PREFIX: Final = "engine:"


def engine_share(
    state: str, eid: str, gpus: Iterable[object], owner_of: Mapping[str, object]
) -> int:
    """GPUs engine `eid` in `state` counts for rollout: each of its `gpus` whose ledger entry
    (`owner_of`: GPU id -> its owner while `owned`) names it as the owner. As the scan counts."""
    if state not in ROLLOUT_STATES:
        return 0
    key = _PREFIX + eid
    return sum(1 for g in gpus if owner_of.get(str(g)) == key)


class Index:
    """See the module docstring. `inflight[e]`: ids of the dispatched requests naming engine
    `e`; `owner[g]`: the owner of GPU `g` while it is `owned`; `share[e]`: engine `e`'s rollout
    GPUs (`engine_share`), for engines with a non-zero share; `rollout`: their sum;
    `groups[s]`: the ids of the requests in state `s`, for `s` in `GROUP_STATES`."""

    __slots__ = ("engines", "groups", "inflight", "owner", "rollout", "share")

    def __init__(self) -> None:
        self.groups: dict[str, set[str]] = {s: set() for s in GROUP_STATES}
        self.inflight: dict[str, set[str]] = {}
        self.owner: dict[str, object] = {}
        self.engines: dict[str, tuple[str, tuple[object, ...]]] = {}  # engine -> (state, gpus)
        self.share: dict[str, int] = {}
        self.rollout = 0

    @classmethod
    def build(cls, instances: Mapping[str, Mapping[str, Any]]) -> Index:
        """The index of `instances` ({machine: {id: Instance}}), from scratch."""
        idx = cls()
        for machine in ("gpu", _ENGINE, "request"):
            for iid, inst in instances.get(machine, {}).items():
                idx.change(machine, iid, None, inst)
        return idx

    def change(self, machine: str, iid: str, old: Any, new: Any) -> None:
        """Instance `iid` of `machine` goes from `old` to `new` (None: absent)."""
        if machine == "request":
            self.request_changed(iid, old, new)
        elif machine == "gpu":
            self._gpu(iid, old, new)
        elif machine == _ENGINE:
            self._engine(iid, new)

    def request_changed(self, iid: str, old: Any, new: Any) -> None:
        """`change("request", iid, old, new)` (`World.apply` calls it directly)."""
        before = None if old is None else old.state
        after = None if new is None else new.state
        if before != after:
            if before in GROUP_STATES:
                self.groups[before].discard(iid)
            if after in GROUP_STATES:
                self.groups[after].add(iid)
        # The engine a dispatched request names (a string: no other value equals an engine id)
        was = old.data.get("engine") if before == "dispatched" else None
        if type(was) is not str:
            was = None
        now = new.data.get("engine") if after == "dispatched" else None
        if type(now) is not str:
            now = None
        if was == now:
            return
        if was is not None:
            ids = self.inflight[was]
            ids.discard(iid)
            if not ids:
                del self.inflight[was]
        if now is not None:
            self.inflight.setdefault(now, set()).add(iid)

    def _gpu(self, gid: str, old: Any, new: Any) -> None:
        before = self.owner.get(gid)
        after = new.data.get("owner") if new is not None and new.state == "owned" else None
        if before == after:
            return
        if after is None:
            self.owner.pop(gid, None)
        else:
            self.owner[gid] = after
        for o in (before, after):
            if type(o) is str and o.startswith(_PREFIX):
                self._reshare(o[len(_PREFIX) :])

    def _engine(self, eid: str, new: Any) -> None:
        if new is None:
            self.engines.pop(eid, None)
        else:
            gpus = new.data.get("gpus")  # a list, as the launch's guards see to
            self.engines[eid] = (new.state, tuple(gpus) if isinstance(gpus, list | tuple) else ())
        self._reshare(eid)

    def _reshare(self, eid: str) -> None:
        state, gpus = self.engines.get(eid, ("", ()))
        n = engine_share(state, eid, gpus, self.owner)
        self.rollout += n - self.share.get(eid, 0)
        if n:
            self.share[eid] = n
        else:
            self.share.pop(eid, None)

    def inflight_on(self, eid: str) -> Iterable[str]:
        return self.inflight.get(eid, ())
