"""The simulated far edge: host agents, engine processes, trainer ranks — answering in virtual time.

Each performer takes the commands of its routes from the real loop, exactly as the run's
performers do, and posts what a real agent, engine or trainer would report, after a delay from
the cost model: `healthy` after the engine's start-up, `installed` after the weights are read,
`exited` after a stop, a GPU's `confirm_free` only after its owner's process is gone (the
finalizer), `launched`/`loaded` for a Hybrid, a step's `delivered`/`reduced`/`stepped` after
its slowest replica. A host whose agent is silent receives nothing and reports nothing until it
comes back; then its GPUs are reconciled as `runtime.reconcile` does. Faults (a process dying,
an agent going silent) are scheduled here from the cost model's draws.

Knows: the clock, the loop's door, the cost model, which processes it "runs". Does not know the
rules: every report goes through the machines' guards like a real one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from ehp_fsm.core.transition import Accepted, Command
from ehp_fsm.core.world import Event
from ehp_fsm.shell.loop import ANY, Door, Route
from ehp_fsm.sim.clock import VirtualClock
from ehp_fsm.sim.costs import Costs

__all__ = ["Accounting", "Agents", "SimTrainer"]

ENGINE: Final = "rollout_engine"
HYBRID: Final = "hybrid_replica"
STEP: Final = "training_step"
AGENT_KINDS: Final = (
    "launch",
    "stop_process",
    "cancel_launch",
    "confirm_gpu_free",
    "install",
    "delete_revision",
    "load_state",
)


@dataclass
class Accounting:
    """GPU-seconds of useful work (generation, training), faults injected, what happened."""

    busy_gpu_s: float = 0.0
    faults: dict[str, int] = field(default_factory=dict)

    def fault(self, kind: str) -> None:
        self.faults[kind] = self.faults.get(kind, 0) + 1


class Agents:
    """Every host agent, and the engine and Hybrid processes they run (see the module doc)."""

    routes: frozenset[Route] = frozenset((ANY, k) for k in AGENT_KINDS)

    def __init__(
        self,
        door: Door,
        clock: VirtualClock,
        costs: Costs,
        acct: Accounting,
        *,
        slow: dict[str, float],
        engine_start_s: float,
        hybrid_launch_s: float,
    ) -> None:
        self.door, self.clock, self.costs, self.acct = door, clock, costs, acct
        self.slow = slow
        self.engine_start_s, self.hybrid_launch_s = engine_start_s, hybrid_launch_s
        self._pid = 1000
        self.identity: dict[tuple[str, str], dict[str, Any]] = {}  # live processes
        self.starting: dict[tuple[str, str], dict[str, Any]] = {}  # launched, not yet up
        self.exit_at: dict[str, float] = {}  # owner key -> when its process is gone
        self.cancelled: set[str] = set()  # launch tokens withdrawn before the process spoke
        self.silent: dict[str, list[Callable[[], None]]] = {}  # host -> reports held back
        self.installing: dict[str, int] = {}  # engine -> the revision being read
        #: engine -> when its decode queue drains (shared with the dispatcher): an install
        #: waits for the groups ahead of it, and the groups after it wait for the install
        self.engine_busy: dict[str, float] = {}
        self.wanted: dict[str, int] = {}  # engine -> the newest revision asked for
        #: when the trainer pool is free of its step in flight (`SimTrainer.busy_until`)
        self.pool_free_at: Callable[[], float] = lambda: 0.0

    # -- delivery ------------------------------------------------------------------------------
    def report(self, host: str, delay: float, fn: Callable[[], None]) -> None:
        """After `delay`, `fn` posts what the host's agent saw (held while the host is silent)."""

        def deliver() -> None:
            held = self.silent.get(host)
            if held is not None:
                held.append(fn)
            else:
                fn()

        self.clock.after(delay, deliver)

    def _post(self, machine: str, iid: str, name: str, **payload: Any) -> None:
        self.door.post(Event(machine, iid, name, self.door.now(), payload))

    def _state(self, machine: str, iid: str) -> str | None:
        inst = self.door.world.get(machine, iid)
        return None if inst is None else inst.state

    # -- the loop's performer ------------------------------------------------------------------
    def perform(self, command: Command) -> None:
        kind, m, iid, a = command.kind, command.machine, command.instance, command.args
        if kind == "launch":
            self._launch(m, iid, str(a["host"]), len(a["gpus"]), str(a["token"]))
        elif kind == "stop_process":
            self._stop(m, iid, dict(a["identity"]))
        elif kind == "cancel_launch":
            self.cancelled.add(str(a.get("token")))
            self.exit_at[f"{_prefix(m)}:{iid}"] = self.clock.now()
        elif kind == "confirm_gpu_free":
            self._finalize(iid, str(a["owner"]))
        elif kind == "install":
            self._install(iid, int(a["revision"]))
        elif kind == "load_state":
            self._load(iid, int(a["version"]))
        # delete_revision: the simulated store holds no bytes

    def poll(self, timeout_s: float) -> None:
        return None  # reports arrive through the clock

    def close(self) -> None:
        return None

    # -- processes -----------------------------------------------------------------------------
    def _launch(self, machine: str, iid: str, host: str, gpus: int, token: str) -> None:
        self._pid += 1
        ident = {"host": host, "pid": self._pid, "start_time": self.clock.now(), "token": token}
        slow = self.slow.get(host, 1.0)
        if machine == ENGINE:
            delay, name = self.engine_start_s * slow, "healthy"
        else:  # bound to a warm worker once no step holds the pool (`run.hybrids`)
            delay, name = self._pool_wait() + self.hybrid_launch_s * slow, "launched"

        self.starting[(machine, iid)] = ident

        def up() -> None:
            if self.starting.get((machine, iid)) is not ident:
                return  # it died while it started
            del self.starting[(machine, iid)]
            if token in self.cancelled or self._state(machine, iid) not in (
                "starting",
                "launching",
            ):
                return
            self.identity[(machine, iid)] = ident
            self._post(machine, iid, name, identity=ident)

        self.report(host, delay, up)
        death = self.costs.time_to_gpu_fault(gpus)
        if death is not None:
            self.clock.after(death, lambda: self._die(machine, iid, ident))

    def _die(self, machine: str, iid: str, ident: dict[str, Any]) -> None:
        """The process dies: its agent reports it (a silent agent reports on return). A
        process still starting dies too (its start never ends): the rate is per GPU-hour of
        the process, start-up included, so a higher rate never means fewer deaths."""
        key = (machine, iid)
        if self.identity.get(key) is ident:
            live = self.identity
        elif self.starting.get(key) is ident and ident["token"] not in self.cancelled:
            live = self.starting
        else:
            return  # already stopped, or its launch was withdrawn
        spec = self.door.world.specs[machine]
        if self._state(machine, iid) in spec.terminal:
            return
        self.acct.fault(f"{_prefix(machine)}_death")
        del live[key]
        self.exit_at[f"{_prefix(machine)}:{iid}"] = self.clock.now()
        self.report(str(ident["host"]), 0.0, lambda: self._failed(machine, iid))

    def _failed(self, machine: str, iid: str) -> None:
        spec = self.door.world.specs[machine]
        if self._state(machine, iid) not in (None, *spec.terminal):
            self._post(machine, iid, "fail", reason="process died (simulated fault)")

    def _stop(self, machine: str, iid: str, ident: dict[str, Any]) -> None:
        host = str(ident["host"])
        delay = self.costs.spec.engine_stop_s if machine == ENGINE else 0.0
        self.exit_at[f"{_prefix(machine)}:{iid}"] = self.clock.now() + delay
        waiting = "stopping" if machine == ENGINE else "leaving"

        def gone() -> None:
            if self.identity.get((machine, iid)) == ident:
                del self.identity[(machine, iid)]
            if self._state(machine, iid) == waiting:
                self._post(machine, iid, "exited", identity=ident)

        self.report(host, delay, gone)

    def _finalize(self, gpu: str, owner: str) -> None:
        """The GPU's finalizer: confirmed once the owner's process is gone and memory free."""
        inst = self.door.world.get("gpu", gpu)
        host = str(inst.get("host")) if inst is not None else ""
        gone = self.exit_at.get(owner, self.clock.now())
        delay = max(0.0, gone - self.clock.now()) + self.costs.spec.finalizer_s

        def confirm() -> None:
            g = self.door.world.get("gpu", gpu)
            if g is not None and g.state == "releasing" and g.get("owner") == owner:
                self._post(
                    "gpu", gpu, "confirm_free", owner=owner, processes_exited=True, memory_free=True
                )

        self.report(host, delay, confirm)

    def _install(self, eid: str, revision: int) -> None:
        """One install at a time per engine; the newest wanted revision wins."""
        self.wanted[eid] = max(revision, self.wanted.get(eid, 0))
        if eid not in self.installing:
            self._start_install(eid)

    def _start_install(self, eid: str) -> None:
        inst = self.door.world.get(ENGINE, eid)
        if inst is None:
            return
        host = str(inst.get("host"))
        revision = self.wanted[eid]
        self.installing[eid] = revision

        def done() -> None:
            del self.installing[eid]
            if self.wanted.get(eid, 0) > revision:
                self._start_install(eid)
            elif self._state(ENGINE, eid) in ("installing", "updating"):
                self._post(ENGINE, eid, "installed", revision=revision)

        now = self.clock.now()
        start = max(now, self.engine_busy.get(eid, now))
        self.engine_busy[eid] = start + self.costs.install_seconds(self.slow.get(host, 1.0))
        self.report(host, self.engine_busy[eid] - now, done)

    def _pool_wait(self) -> float:
        """How long a Hybrid command waits for the step in flight (the run's trainer holds the
        pool for a whole step; `WarmHybrids` carries such commands out after it)."""
        return max(0.0, self.pool_free_at() - self.clock.now())

    def _load(self, hid: str, version: int) -> None:
        inst = self.door.world.get(HYBRID, hid)
        host = str(inst.get("host")) if inst is not None else ""

        def start() -> None:
            # the state moved is the Core's when the load starts: after the step in flight
            now_version = max(version, int(self.door.world.globals["core_version"]))

            def loaded() -> None:
                if self._state(HYBRID, hid) == "loading":
                    self._post(HYBRID, hid, "loaded", version=now_version)

            self.report(host, self.costs.state_load_seconds(), loaded)

        wait = self._pool_wait()
        if wait > 0:
            self.clock.after(wait, start)
        else:
            start()

    # -- silent agents -------------------------------------------------------------------------
    def go_silent(self, host: str, seconds: float) -> None:
        """The host's agent stops answering: its GPUs are quarantined (as the reconciler does
        after missed heartbeats); it comes back after `seconds` and is reconciled."""
        if host in self.silent:
            return
        self.acct.fault("agent_silence")
        self.silent[host] = []
        for g in list(self.door.world.of("gpu").values()):
            if g.get("host") == host and g.state in ("free", "owned", "releasing"):
                self._post("gpu", g.id, "quarantine", reason="silent")
        self.clock.after(seconds, lambda: self._back(host))

    def _back(self, host: str) -> None:
        held = self.silent.pop(host, [])
        world = self.door.world
        for g in list(world.of("gpu").values()):
            if g.get("host") != host or g.state != "quarantined":
                continue
            owner = g.get("owner")
            if owner is None:
                self._post("gpu", g.id, "reconcile_free")
            elif g.get("prior") == "owned" and self._owner_live(str(owner), g.id):
                self._post("gpu", g.id, "reconcile_owned", owner=owner)
            else:
                self._post("gpu", g.id, "reconcile_released", owner=owner)
        for fn in held:
            fn()

    def _owner_live(self, owner: str, gpu: str) -> bool:
        if owner == "core":
            return True
        kind, _, oid = owner.partition(":")
        machine = {"engine": ENGINE, "hybrid": HYBRID}.get(kind)
        inst = self.door.world.get(machine, oid) if machine else None
        if inst is None or machine is None or inst.state in self.door.world.specs[machine].terminal:
            return False
        return gpu in (inst.get("gpus") or ())


def _prefix(machine: str) -> str:
    return "engine" if machine == ENGINE else "hybrid"


class SimTrainer:
    """The trainer pool in virtual time: performs a step's `compute`; reports after the slowest
    replica, the reduction, the optimizer and the revision's save. A Hybrid of the partition
    that died meanwhile fails the step (its groups go back), as the pool's failure does."""

    routes: frozenset[Route] = frozenset({(STEP, "compute")})

    def __init__(
        self,
        door: Door,
        clock: VirtualClock,
        costs: Costs,
        acct: Accounting,
        *,
        replica_size: int,
        group_size: int,
        slow: dict[str, float],
        core_host: dict[str, str],
    ) -> None:
        self.door, self.clock, self.costs, self.acct = door, clock, costs, acct
        self.replica_size, self.group_size = replica_size, group_size
        self.slow, self.core_host = slow, core_host
        self.results: dict[str, bool] = {}  # step instance -> stood (True) or failed
        self.busy_until = 0.0  # the step in flight holds the pool until then

    def perform(self, command: Command) -> None:
        sid = command.instance
        partition: dict[str, list[str]] = {k: list(v) for k, v in command.args["partition"].items()}
        epoch = int(command.args["epoch"])
        slowest = 0.0
        for replica, groups in partition.items():
            samples = len(groups) * self.group_size
            t = self.costs.compute_seconds(samples, self.slow.get(self._host(replica), 1.0))
            self.acct.busy_gpu_s += t * self.replica_size
            slowest = max(slowest, t)
        rest = self.costs.reduce_seconds(len(partition)) + self.costs.spec.optimizer_s
        rest += self.costs.save_seconds()
        self.acct.busy_gpu_s += rest * self.replica_size * len(partition)
        # The run's trainer steps on a thread of its own: the loop goes on meanwhile (rollout
        # of the next step's groups, agents, engines); Hybrid commands wait for the pool.
        self.busy_until = self.clock.now() + slowest + rest
        self.clock.after(slowest + rest, lambda: self._finish(sid, sorted(partition), epoch))

    def _host(self, replica: str) -> str:
        if replica.startswith("hybrid:"):
            inst = self.door.world.get(HYBRID, replica.split(":", 1)[1])
            return str(inst.get("host")) if inst is not None else ""
        return self.core_host.get(replica, "")

    def _finish(self, sid: str, replicas: list[str], epoch: int) -> None:
        world = self.door.world
        inst = world.get(STEP, sid)
        if inst is None or inst.state != "computing":
            self.results[sid] = False
            return
        dead = [
            r
            for r in replicas
            if r.startswith("hybrid:")
            and (h := world.get(HYBRID, r.split(":", 1)[1])) is not None
            and h.state != "active"
        ]
        if dead or int(world.globals["epoch"]) != epoch:
            why = f"replicas {dead} died during the step" if dead else "the epoch changed"
            self.door.post(Event(STEP, sid, "fail", self.door.now(), {"reason": why}))
            self.results[sid] = False
            return
        now = self.door.now()
        outs = [
            self.door.post(Event(STEP, sid, "delivered", now, {"replicas": replicas})),
            self.door.post(Event(STEP, sid, "reduced", now)),
            self.door.post(
                Event(
                    STEP, sid, "stepped", now, {"version": int(world.globals["core_version"]) + 1}
                )
            ),
        ]
        self.results[sid] = all(isinstance(o, Accepted) for o in outs)

    def poll(self, timeout_s: float) -> None:
        return None

    def close(self) -> None:
        return None
