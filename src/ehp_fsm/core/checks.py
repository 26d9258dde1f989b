"""The safety invariants checked per event: `check_invariants`'s verdict at the cost of what one
accepted step changed, not of the world.

`InvariantChecks(world)` keeps, beside the world, who lists which GPU (the live engines and
Hybrids, by GPU), which busy training step holds which group, and the serving engines. After
each accepted step (`check(outcome)`, the step already applied) it looks only at what the
step changed and what depends on it: the GPUs changed and the GPUs their holders list or
listed, the holders changed, the groups changed and the groups their steps hold or held, the
engines changed (a serving engine's revision, a stopped or failed one's dispatched groups,
which `world.index` keeps), every serving engine when the revision moves. From a sound world
(no problem) a step can only break an invariant there, so the verdict is
`check_invariants(world)`'s — which `tests/property/test_embedded_api.py` compares after every
event of random runs, guards bypassed to break them. When it sees a problem, or data it cannot
read as the full check does (a holder's `gpus` that is not a list of ids, a step's groups that
are not strings), it returns `check_invariants(world, indexed=True)` itself: the same messages
as the full check, and the O(world) cost only where the world is (or may be) unsound. A world
left unsound (the caller went on after an `InvariantViolation`) is checked whole after each
step until it is sound again.

`ehp_fsm.embedded.Orchestrator(check=True)` uses it; the simulator's `sim.watch.EventChecks`
adds its own checks to it. Knows: what `core.invariants` checks and which instance fields it
reads. Does not know: why (see `core.invariants`). The world must be written through
`World.apply` (and the outcomes handed here in order); a world replaced or written another way
needs a new `InvariantChecks`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

from ehp_fsm.core.guards import BUSY_STEP_STATES
from ehp_fsm.core.invariants import HOLDERS, HOLDS_GPUS, NEEDS_OWNER, check_invariants
from ehp_fsm.core.transition import Accepted
from ehp_fsm.core.world import Instance, World

__all__ = ["HOLDS", "PREFIX", "InvariantChecks"]

#: (`core.invariants`' own: the states in which an engine or Hybrid holds the GPUs it lists,
#: a holder's name as a GPU's `owner` gives it, the GPU states that name their owner)
HOLDS: Final = HOLDS_GPUS
PREFIX: Final = HOLDERS
_NEEDS_OWNER: Final = NEEDS_OWNER


class InvariantChecks:
    """See the module docstring."""

    def __init__(self, world: World) -> None:
        self.world = world
        cfg = world.config
        self.core: frozenset[Any] = world.core_gpu_set or frozenset(cfg.get("core_gpus") or ())
        self.gpu_states = frozenset(world.specs["gpu"].states)
        self.engine_terminal = world.specs["rollout_engine"].terminal
        self.listed: dict[str, tuple[Any, ...]] = {}  # live holder key -> the GPUs it lists
        self.listed_by: dict[Any, list[str]] = {}  # GPU -> the live holders listing it
        self.held: dict[str, tuple[str, ...]] = {}  # busy step -> its groups
        self.held_by: dict[str, list[str]] = {}  # group -> the busy steps holding it
        self.serving_engines: set[str] = set()
        self.odd: set[tuple[str, str]] = set()  # instances whose data the indices cannot read
        for machine in HOLDS:
            for inst in world.of(machine).values():
                self._holder_index(machine, inst)
        for st in world.of("training_step").values():
            self._step_index(st)
        self.sound = not check_invariants(world, indexed=True)

    # -- the indices ---------------------------------------------------------------------------
    def _holder_index(self, machine: str, inst: Instance) -> tuple[Any, ...]:
        """Move holder `inst` in the indices; the GPUs it listed before."""
        key = f"{PREFIX[machine]}:{inst.id}"
        old = self.listed.pop(key, ())
        for g in old:
            holders = self.listed_by[g]
            holders.remove(key)
            if not holders:
                del self.listed_by[g]
        if machine == "rollout_engine":
            if inst.state == "serving":
                self.serving_engines.add(inst.id)
            else:
                self.serving_engines.discard(inst.id)
        self.odd.discard((machine, inst.id))
        if inst.state not in HOLDS[machine]:
            return old
        gpus = inst.get("gpus") or ()
        if (type(gpus) is not list and type(gpus) is not tuple) or any(
            type(g) is not str for g in gpus
        ):
            self.odd.add((machine, inst.id))  # read as the full check reads it, there
            return old
        self.listed[key] = new = tuple(gpus)
        for g in new:
            self.listed_by.setdefault(g, []).append(key)
        return old

    def _step_index(self, st: Instance) -> tuple[str, ...]:
        """Move training step `st` in the indices; the groups it held before."""
        old = self.held.pop(st.id, ())
        for g in old:
            steps = self.held_by[g]
            steps.remove(st.id)
            if not steps:
                del self.held_by[g]
        self.odd.discard(("training_step", st.id))
        if st.state not in BUSY_STEP_STATES:
            return old
        groups = st.get("groups") or ()
        if (type(groups) is not list and type(groups) is not tuple) or any(
            type(g) is not str for g in groups
        ):
            self.odd.add(("training_step", st.id))
            return old
        self.held[st.id] = new = tuple(groups)
        for g in new:
            self.held_by.setdefault(g, []).append(st.id)
        return old

    # -- the check -----------------------------------------------------------------------------
    def check(self, outcome: Accepted) -> list[str]:
        """The problems of the world after `outcome` was applied to it (`check_invariants`'s,
        in its words); empty when it is sound."""
        changes = outcome.changes
        if len(changes) == 1:
            # One group changed (most steps: enqueue, dispatch, complete): the general path
            # below with its empty parts left out — no GPU, holder, step or engine changed, so
            # only this group's checks (and the serving engines', if the revision moved) run.
            for (m, _iid), inst in changes.items():
                if m == "request":
                    if not self.sound or self.odd:
                        return self._whole()
                    if self._groups_broken((inst.id,)) or (
                        "revision" in outcome.globals and self._serving_broken()
                    ):
                        return self._whole()
                    return []
        gpus: set[Any] = set()
        hybrids: set[str] = set()
        engines: list[Instance] = []
        groups: set[str] = set()
        for (m, _iid), inst in outcome.changes.items():
            if m == "request":
                groups.add(inst.id)
            elif m == "gpu":
                gpus.add(inst.id)
            elif m in HOLDS:
                old = self._holder_index(m, inst)
                gpus.update(old)
                gpus.update(self.listed.get(f"{PREFIX[m]}:{inst.id}", ()))
                if m == "rollout_engine":
                    engines.append(inst)
                else:
                    hybrids.add(f"hybrid:{inst.id}")
            elif m == "training_step":
                groups.update(self._step_index(inst))
                groups.update(self.held.get(inst.id, ()))
        if not self.sound or self.odd:
            return self._whole()
        if (  # (each part only when it has something to look at: an empty one finds nothing)
            (gpus and self._gpus_broken(gpus, hybrids))
            or (hybrids and self._hybrids_broken(hybrids))
            or (groups and self._groups_broken(groups))
            or (engines and self._engines_broken(engines))
            or ("revision" in outcome.globals and self._serving_broken())
        ):
            return self._whole()
        return []

    def _whole(self) -> list[str]:
        problems = check_invariants(self.world, indexed=True)
        self.sound = not problems
        return problems

    def _gpus_broken(self, gids: set[Any], hybrids: set[str]) -> bool:
        """Whether a check of `core.invariants` fails for GPUs `gids` (adds the Hybrids that
        list them to `hybrids`: a GPU's host decides their one-host set)."""
        ledger = self.world.of("gpu")
        core = self.core
        for gid in gids:
            holders = self.listed_by.get(gid, ())
            if len(holders) > 1:
                return True  # listed twice (by two holders, or twice by one)
            g = ledger.get(gid)
            if g is None:
                if holders:
                    return True  # listed, not in the ledger
                continue
            state, owner = g.state, g.get("owner")
            if state not in self.gpu_states:
                return True
            if (state in _NEEDS_OWNER and owner is None) or (state == "free" and owner is not None):
                return True
            if gid in core and owner is not None and owner != "core":
                return True
            if state == "owned" and owner == "core" and gid not in core:
                return True
            holder = holders[0] if holders else None
            if state == "owned" and owner != "core" and holder != owner:
                return True  # owned by an engine or Hybrid that does not list it: a leak
            if holder is not None:
                if owner != holder:
                    return True  # listed by a holder that does not own it
                if holder.startswith("hybrid:"):
                    hybrids.add(holder)
        return False

    def _hybrids_broken(self, keys: set[str]) -> bool:
        ledger = self.world.of("gpu")
        size = self.world.config.get("replica_size")
        for key in keys:
            ids = self.listed.get(key)
            if ids is None:
                continue  # not holding
            hosts = {ledger[g].get("host") for g in ids if g in ledger}
            if len(ids) != size or len(hosts) != 1:
                return True
        return False

    def _groups_broken(self, gids: Iterable[str]) -> bool:
        instances = self.world.instances
        requests, engines = instances["request"], instances["rollout_engine"]
        for gid in gids:
            steps = self.held_by.get(gid, ())
            if len(steps) > 1:
                return True
            r = requests.get(gid)
            if steps and (r is None or r.state != "claimed"):
                return True
            if r is None:
                continue
            if not steps and r.state == "claimed":
                return True
            if r.state == "dispatched":
                eid = r.data.get("engine")  # (`r.get`, without its call)
                e = engines.get(eid) if type(eid) is str else None
                if e is None or e.state in self.engine_terminal:
                    return True
        return False

    def _engines_broken(self, changed: list[Instance]) -> bool:
        current = self.world.globals.get("revision", 0)
        inflight = self.world.index.inflight
        for e in changed:
            if e.state == "serving" and e.get("installed") != current:
                return True
            if e.state in self.engine_terminal and inflight.get(e.id):
                return True  # groups dispatched to an engine that is gone
        return False

    def _serving_broken(self) -> bool:
        current = self.world.globals.get("revision", 0)
        engines = self.world.of("rollout_engine")
        return any(engines[eid].get("installed") != current for eid in self.serving_engines)
