"""What the simulation watches at every event: invariants, deadlines, load, GPU roles.

`SimOrchestrator` is the real `embedded.Orchestrator` (step, log, apply) with one addition:
after each accepted step it hands the step's changes to `Watch`, which
- checks the safety invariants on what the step touched (`EventChecks`: the run's own, per
  event, from `core.checks.InvariantChecks` — `check_invariants`'s verdict, as
  `Orchestrator(check=True)` checks — and the simulation's on top): no GPU double-owned
  or leaked, owners and holders agree, a Core GPU only the Core's, a Hybrid on a complete
  one-host set and launched only from it, a fixed global batch of distinct groups partitioned
  whole, no group claimed twice or consumed twice, dispatched groups only on live engines,
  revisions, Core versions and epochs never going back, engines serving only the current
  revision — raising `InvariantViolation` (with the event) at the first break;
- arms each deadline a step armed on the virtual clock (the run's loop finds them by scanning
  the world every turn; here the clock fires the `deadline` event at its time, and the guard
  re-checks it as always);
- keeps the dispatched-groups-per-engine index the simulated dispatcher routes by;
- integrates the GPU-seconds spent in each role (free, core, engine, hybrid, releasing,
  quarantined, failed) and samples the role counts for the timeline.
`full_check` runs the real `core.invariants.check_invariants` over the whole world (O(world):
at step boundaries on small clusters, at the end on every cluster).

Knows: the world's machines and the plan's numbers. Does not decide anything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

from ehp_fsm.core.checks import HOLDS, PREFIX, InvariantChecks
from ehp_fsm.core.effects import EFFECTS
from ehp_fsm.core.guards import BUSY_STEP_STATES, GUARDS
from ehp_fsm.core.invariants import check_invariants
from ehp_fsm.core.transition import Accepted, Outcome, Rejected, step
from ehp_fsm.core.world import Event, Instance, World
from ehp_fsm.embedded import InvariantViolation, Orchestrator
from ehp_fsm.sim.clock import VirtualClock

__all__ = ["EventChecks", "GroupIds", "SimOrchestrator", "Watch"]

_ORDER: Final = {
    "training_step": 0,
    "request": 1,
    "rollout_engine": 2,
    "hybrid_replica": 2,
    "gpu": 3,
}
ROLES: Final = ("core", "engine", "hybrid", "free", "releasing", "quarantined", "failed")


def gpu_role(inst: Instance) -> str:
    owner = inst.get("owner")
    if inst.state == "owned" and owner:
        return str(owner).split(":", 1)[0]
    return inst.state


class GroupIds:
    """A set of group ids, compact for the dispatcher's `g<n>` ids (one bit each): after 500
    steps at 1,024 hosts it holds 8.2 M consumed groups, ~1 MiB instead of ~0.5 GiB of
    strings and set entries. Any other id goes to an ordinary set."""

    __slots__ = ("_bits", "_n", "_other")

    def __init__(self) -> None:
        self._bits = bytearray()
        self._other: set[str] = set()
        self._n = 0

    @staticmethod
    def _number(gid: str) -> int:
        tail = gid[1:]
        ok = gid[:1] == "g" and tail.isdigit() and tail.isascii() and tail[:1] != "0"
        return int(tail) if ok else -1  # ASCII: `int` also reads other scripts' digits

    def __contains__(self, gid: str) -> bool:
        tail = gid[1:]  # `_number`, inlined: asked on every event of a group
        if gid[:1] == "g" and tail.isdigit() and tail.isascii() and tail[:1] != "0":
            n = int(tail)
            byte = n >> 3
            return byte < len(self._bits) and bool(self._bits[byte] >> (n & 7) & 1)
        return gid in self._other

    def add(self, gid: str) -> bool:
        """Add `gid`; whether it was new (one parse of the id, not one to ask and one to add)."""
        n = self._number(gid)
        if n < 0:
            if gid in self._other:
                return False
            self._other.add(gid)
        else:
            byte, bit = n >> 3, 1 << (n & 7)
            bits = self._bits
            if byte >= len(bits):
                bits.extend(bytes(max(byte + 1 - len(bits), len(bits))))
            elif bits[byte] & bit:
                return False
            bits[byte] |= bit
        self._n += 1
        return True

    def __len__(self) -> int:
        return self._n


class EventChecks(InvariantChecks):
    """The invariants over what one accepted step changed (see the module docstring): the
    run's own (`core.checks.InvariantChecks`: `check_invariants`'s verdict, per event) and the
    simulation's on top."""

    def __init__(self, world: World) -> None:
        super().__init__(world)
        cfg = world.config
        self.core = frozenset(cfg.get("core_gpus") or ())
        self.replica_size = int(cfg.get("replica_size", 1))
        self.batch = int(cfg.get("groups_per_step", 0))
        self.holder_of: dict[str, str] = {}  # GPU -> the live holder that lists it
        self.claims: dict[str, str] = {}  # group -> the busy step that holds it
        self.consumed = GroupIds()
        # groups seen since they were last found not consumed: asked first, as a set (a
        # `GroupIds` lookup parses the id, ~2 µs; nearly every event of a group asks)
        self.unconsumed: set[str] = set()
        self.finished_steps: set[str] = set()  # training steps done or failed (and forgotten)
        self.steps_done = 0
        self.serving: set[str] = set()
        self.dispatched: dict[str, str] = {}  # group -> engine
        self.by_engine: dict[str, set[str]] = {}
        self.touched: set[str] = set()  # engines whose dispatched count changed
        self.last = {"revision": 0, "core_version": 0, "epoch": 0}
        self.checked = 0

    def check(self, outcome: Accepted) -> list[str]:
        self.checked += 1
        out = InvariantChecks.check(self, outcome)  # (`super().check`, without the `super`)
        world = self.world
        # steps before their groups (claims), groups before engines (a failed engine's groups
        # were requeued in the same step), holders before their GPUs (who lists what)
        changes = outcome.changes
        changed = (
            changes.items()
            if len(changes) == 1
            else sorted(changes.items(), key=lambda kv: _ORDER.get(kv[0][0], 9))
        )
        for (m, _iid), inst in changed:
            if m == "request":  # (the most frequent first)
                self._request(inst, out)
            elif m == "gpu":
                self._gpu(inst, out)
            elif m in HOLDS:
                self._holder(m, inst, out)
            elif m == "training_step":
                self._step(inst, out)
        if outcome.globals:  # the globals change only with a step's own (`World.apply`)
            for key, before in self.last.items():
                now = int(world.globals.get(key, 0))
                if now < before:
                    out.append(f"{key} went back from {before} to {now}")
                self.last[key] = now
        if "revision" in outcome.globals:
            current = world.globals["revision"]
            for eid in self.serving:
                e = world.get("rollout_engine", eid)
                if e is not None and e.get("installed") != current:
                    out.append(
                        f"engine {eid} serves revision {e.get('installed')}, current {current}"
                    )
        for c in outcome.commands:
            if c.machine == "hybrid_replica" and c.kind == "launch":
                h = world.get("hybrid_replica", c.instance)
                if h is not None:
                    out += self._complete_set(h, f"hybrid:{h.id}", "launched from")
        return out

    def _gpu(self, g: Instance, out: list[str]) -> None:
        owner = g.get("owner")
        if g.state in ("owned", "releasing") and owner is None:
            out.append(f"GPU {g.id} is {g.state} without an owner")
        if g.state == "free" and owner is not None:
            out.append(f"GPU {g.id} is free but names owner {owner}")
        if g.id in self.core and owner not in (None, "core"):
            out.append(f"Core GPU {g.id} is owned by {owner}")
        if owner == "core" and g.id not in self.core:
            out.append(f"GPU {g.id} is owned by the Core but is not in its layout")
        leak = g.state == "owned" and owner not in (None, "core")
        if leak and self.holder_of.get(g.id) != owner:
            out.append(f"GPU {g.id} is owned by {owner}, which does not hold it (a leak)")

    def _holder(self, machine: str, inst: Instance, out: list[str]) -> None:
        key = f"{PREFIX[machine]}:{inst.id}"
        gpus = [str(g) for g in inst.get("gpus") or ()]
        ledger = self.world.of("gpu")
        if inst.state in HOLDS[machine]:
            for g in gpus:
                other = self.holder_of.get(g)
                if other is not None and other != key:
                    out.append(f"GPU {g} is held by both {other} and {key}")
                self.holder_of[g] = key
                gi = ledger.get(g)
                if gi is None or gi.get("owner") != key:
                    out.append(f"{key} holds GPU {g}, whose owner is {gi and gi.get('owner')}")
            if machine == "hybrid_replica":
                out += self._complete_set(inst, key, "holds")
        else:
            for g in gpus:
                if self.holder_of.get(g) == key:
                    del self.holder_of[g]
                gi = ledger.get(g)
                if gi is not None and gi.state == "owned" and gi.get("owner") == key:
                    out.append(f"{key} is {inst.state} but GPU {g} is still owned by it (a leak)")
        if machine == "rollout_engine":
            if inst.state == "serving":
                self.serving.add(inst.id)
                current = self.world.globals.get("revision")
                if inst.get("installed") != current:
                    out.append(
                        f"engine {inst.id} serves {inst.get('installed')}, current {current}"
                    )
            else:
                self.serving.discard(inst.id)
            if inst.state in ("stopped", "failed") and self.by_engine.get(inst.id):
                out.append(
                    f"engine {inst.id} is {inst.state} with groups "
                    f"{sorted(self.by_engine[inst.id])[:5]} dispatched to it"
                )

    def _complete_set(self, inst: Instance, key: str, verb: str) -> list[str]:
        gpus = [str(g) for g in inst.get("gpus") or ()]
        ledger = self.world.of("gpu")
        hosts = {ledger[g].get("host") for g in gpus if g in ledger}
        if len(gpus) != self.replica_size or len(hosts) != 1:
            return [f"{key} {verb} {gpus}: not a complete one-host set of {self.replica_size}"]
        return []

    def _request(self, r: Instance, out: list[str]) -> None:
        gid, state = r.id, r.state
        was = self.dispatched.pop(gid, None)
        if was is not None:
            self.by_engine[was].discard(gid)
            self.touched.add(was)
        if state == "dispatched":
            eid = str(r.data.get("engine"))  # (`r.get`, without its call)
            e = self.world.get("rollout_engine", eid)
            if e is None or e.state not in HOLDS["rollout_engine"]:
                out.append(f"group {gid} is dispatched to engine {eid}, which is not live")
            self.dispatched[gid] = eid
            self.touched.add(eid)
            on = self.by_engine.get(eid)  # (`setdefault(eid, set())`, without a set a call)
            if on is None:
                on = self.by_engine[eid] = set()
            on.add(gid)
        elif state == "claimed":
            if gid not in self.claims:
                out.append(f"group {gid} is claimed but no training step holds it")
        elif state == "consumed":
            self.unconsumed.discard(gid)
            if not self.consumed.add(gid):  # (adds it: known since)
                out.append(f"group {gid} was consumed twice")
            return
        if gid in self.unconsumed:
            return  # (not consumed when last asked, and not since: `consumed` is terminal)
        if gid not in self.consumed:
            self.unconsumed.add(gid)
        else:
            # `consumed` is terminal: only a second group under a consumed id gets here (and
            # the world may have forgotten the first: `Watch.forget_consumed`)
            out.append(f"group {gid} is {state} again after it was consumed (a duplicate)")

    def _step(self, st: Instance, out: list[str]) -> None:
        if st.id in self.finished_steps:
            out.append(f"training step {st.id} is {st.state} again after it finished")
        groups = [str(g) for g in st.get("groups") or ()]
        if st.state in BUSY_STEP_STATES:
            if st.state == "computing":
                self._batch(st, groups, out)
            for g in groups:
                holder = self.claims.get(g)
                if holder is not None and holder != st.id:
                    out.append(f"group {g} is held by steps {holder} and {st.id}")
                self.claims[g] = st.id
        else:
            for g in groups:
                if self.claims.get(g) == st.id:
                    del self.claims[g]
        if st.state == "done":
            self.steps_done += 1
            if len(self.consumed) != self.steps_done * self.batch:
                out.append(
                    f"{len(self.consumed)} groups consumed after {self.steps_done} steps of "
                    f"{self.batch}: a group was lost or used twice"
                )

    def _batch(self, st: Instance, groups: list[str], out: list[str]) -> None:
        parts: Mapping[str, Any] = st.get("partition") or {}
        handed = [str(g) for gs in parts.values() for g in gs]
        if len(groups) != self.batch or len(set(groups)) != len(groups):
            out.append(f"step {st.id} holds {len(groups)} groups, not the fixed batch {self.batch}")
        if sorted(handed) != sorted(groups):
            out.append(f"step {st.id}'s partition does not hand out each of its groups once")


class Watch:
    """Per-event duties of the simulation (see the module docstring)."""

    def __init__(self, world: World, clock: VirtualClock, *, check: bool) -> None:
        self.world, self.clock = world, clock
        self.checks = EventChecks(world) if check else None
        self.armed: dict[tuple[str, str], float] = {}
        self.fire: Callable[[Event], object] = lambda ev: None  # the loop's post, once built
        self.woken: Callable[[], None] = lambda: None  # the dispatcher's next turn
        self.index = EventChecks(world)  # the dispatched index (checks or not)
        self.role_of: dict[str, str] = {g.id: gpu_role(g) for g in world.of("gpu").values()}
        self.counts = dict.fromkeys(ROLES, 0)
        for r in self.role_of.values():
            self.counts[r] += 1
        self.gpu_s = dict.fromkeys(ROLES, 0.0)
        self.since = clock.now()
        self.samples: list[tuple[float, tuple[int, ...]]] = []
        self.completed: set[str] = set()  # groups in state `completed`
        self.queued: set[str] = set()  # groups in state `queued`
        self.changed: set[str] = set()  # groups whose state changed since the dispatcher's turn
        self.newly_completed: set[str] = set()
        self.newly_consumed: list[str] = []
        self.newly_queued: list[str] = []
        self.serving: set[str] = set()
        self.load_changed: set[str] = set()  # engines whose load or serving changed
        self.updating: set[str] = set()  # engines installing a revision (out of routing)
        self.moved = False  # an engine or Hybrid changed since the story last looked
        self.transitions = 0  # records written: roots and cascades, accepted or refused
        self.rejected = 0

    def after(self, event: Event, outcome: Accepted) -> None:
        if self.checks is not None:
            problems = self.checks.check(outcome)
            if problems:
                raise InvariantViolation(event, problems)
        else:
            for (m, _), inst in outcome.changes.items():
                if m == "request":
                    self.index._request(inst, [])
        for (m, iid), inst in outcome.changes.items():
            if m == "request":  # (the most frequent first; one test of its state)
                self.changed.add(iid)
                state = inst.state
                if state == "queued":
                    self.completed.discard(iid)
                    if iid not in self.queued:
                        self.newly_queued.append(iid)
                        self.queued.add(iid)
                elif state == "completed":
                    self.completed.add(iid)
                    self.newly_completed.add(iid)
                    self.queued.discard(iid)
                else:
                    self.completed.discard(iid)
                    self.queued.discard(iid)
                    if state == "consumed":
                        self.newly_consumed.append(iid)
            elif m == "gpu":
                self._role(inst)
            elif m == "rollout_engine":
                self.moved = True
                self.load_changed.add(iid)
                if inst.state == "serving":
                    self.serving.add(iid)
                else:
                    self.serving.discard(iid)
                if inst.state in ("installing", "updating"):
                    self.updating.add(iid)
                else:
                    self.updating.discard(iid)
            elif m == "hybrid_replica":
                self.moved = True
            d = inst.data.get("deadline") if inst.data else None
            if d is not None and isinstance(d, (float, int)) and self.armed.get((m, iid)) != d:
                self.armed[(m, iid)] = float(d)
                self.clock.at(float(d), self._deadline(m, iid, float(d)))
        self.woken()

    def load_changes_pending(self) -> bool:
        """Whether `take_load_changed` would give any engine."""
        src = self.checks if self.checks is not None else self.index
        return bool(self.load_changed or src.touched)

    def take_load_changed(self) -> set[str]:
        """Engines whose load or serving state changed since the last call."""
        src = self.checks if self.checks is not None else self.index
        out = self.load_changed | src.touched
        self.load_changed, src.touched = set(), set()
        return out

    def dispatched_by_engine(self) -> Mapping[str, set[str]]:
        """The groups dispatched to each engine (kept at every event; read, never write)."""
        src = self.checks if self.checks is not None else self.index
        return src.by_engine

    def load_of(self, engine: str) -> int:
        src = self.checks if self.checks is not None else self.index
        return len(src.by_engine.get(engine, ()))

    def load(self, engines: Iterable[str]) -> dict[str, int]:
        src = self.checks.by_engine if self.checks is not None else self.index.by_engine
        return {e: len(src.get(e, ())) for e in engines}

    def _deadline(self, machine: str, iid: str, when: float) -> Callable[[], None]:
        def fire() -> None:
            inst = self.world.get(machine, iid)
            spec = self.world.specs[machine]
            if (
                inst is None
                or inst.get("deadline") != when
                or inst.state in spec.terminal
                or (inst.state, "deadline") not in spec.table
            ):
                return
            self.fire(
                Event(machine, iid, "deadline", self.clock.now(), {"deadline": when}, "timer")
            )

        return fire

    def forget_consumed(self, gids: Iterable[str]) -> None:
        """Drop consumed groups from the simulation's world, once the dispatcher has
        forgotten them too (its `fill` counts the groups it still holds by their state).

        `consumed` is terminal and nothing in the core reads a consumed group again: the
        guards and invariants ask for groups that are completed, claimed or dispatched, and a
        step's claim names its groups, which are claimed until the step consumes them. So the
        log, and every later outcome, is the same with or without them (replay, which keeps
        them, verifies it), while a long run's world stays the size of the cluster instead of
        growing by G groups a step. What the invariants need stays: `EventChecks.consumed`,
        the set of consumed ids (a group lost, consumed twice, or created again under a
        consumed id is still caught). The run's own world keeps them (its snapshots show
        them); this is the simulation's world only. (The world's index, `core.index`, holds
        dispatched groups only: a consumed one is not in it.)"""
        requests = self.world.instances["request"]
        for gid in gids:
            inst = requests.get(gid)
            if inst is not None and inst.state == "consumed":
                del requests[gid]

    def forget_finished_steps(self) -> None:
        """Drop the training steps that are done or failed from the simulation's world (at a
        step boundary). Like consumed groups (`forget_consumed`): their states are terminal,
        the guards and invariants ask only for busy or open steps (`BUSY_STEP_STATES`, not
        terminal), and each holds its G group ids twice (groups and partition) — at 1,024
        hosts 16,384 of each per step, the largest thing a long run kept. Their ids stay known
        to the checks, so a step id used twice is still caught."""
        steps = self.world.instances["training_step"]
        terminal = self.world.specs["training_step"].terminal
        done = [sid for sid, st in steps.items() if st.state in terminal]
        for sid in done:
            del steps[sid]
        for checks in (self.checks, self.index):
            if checks is not None:
                checks.finished_steps.update(done)

    def _role(self, g: Instance) -> None:
        role = gpu_role(g)
        old = self.role_of.get(g.id)
        if role == old:
            return
        self.integrate()
        if old is not None:
            self.counts[old] -= 1
        self.counts[role] += 1
        self.role_of[g.id] = role
        now = self.clock.now()
        snap = tuple(self.counts[r] for r in ROLES)
        if self.samples and self.samples[-1][0] == now:
            self.samples[-1] = (now, snap)
        else:
            self.samples.append((now, snap))

    def integrate(self) -> None:
        now = self.clock.now()
        dt = now - self.since
        if dt > 0:
            for r, n in self.counts.items():
                self.gpu_s[r] += n * dt
            self.since = now


class SimOrchestrator(Orchestrator):
    """The real orchestrator; each accepted step is also handed to the `Watch`."""

    watch: Watch | None = None

    def handle(self, event: Event) -> Outcome:
        outcome = Orchestrator.handle(self, event)  # (`super().handle`, without the `super`)
        watch = self.watch
        if watch is not None:
            watch.transitions += len(outcome.records)
            if isinstance(outcome, Accepted):
                watch.after(event, outcome)
            else:
                watch.rejected += 1
        return outcome


def full_check(world: World) -> list[str]:
    """The run's own invariants over the whole world (`core.invariants`)."""
    return check_invariants(world)


def would_accept(world: World, event: Event) -> bool:
    """Whether `event` would be accepted now (a pure step; nothing is logged or applied)."""
    return not isinstance(step(world, event, GUARDS, EFFECTS), Rejected)
