"""Hybrid replicas on pre-started (warm) trainer workers, driven by the hybrid_replica machine.

The trainer pool starts every warm worker with the Core at start-up: one Gloo world, so a borrow
needs no new process and no new rendezvous — that is what makes the GPU switch fast. When the
machine asks to `launch` a Hybrid on a borrowed slot, a parked warm worker is bound to it and
reported `launched` with its process identity and the Hybrid's launch token; `load_state`
moves the Core's state into it (DP-zero gather + point-to-point + scatter); `activate` at a step
boundary makes it train. `stop_process` for a Hybrid ends the assignment: the worker leaves the
lanes that train and is parked again (its process keeps running for the next borrow), and that
end is what `exited` and the GPU finalizer confirm — on a CPU slot there is no device memory to
free; on GPUs the worker releases its CUDA memory before parking. A warm worker that died (for
instance inside the gradient all-reduce) is replaced by the pool with a fresh process; a launch
first admits every replacement that is ready, so the planner can borrow again.

Knows: the pool, the controller, which warm rank serves which Hybrid. Does not know: when to
borrow (the planner) or the GPU ledger's rules (the machines).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import structlog

from ehp_fsm.core.transition import Accepted, Command
from ehp_fsm.core.world import Event
from ehp_fsm.runtime.controller import Controller
from ehp_fsm.training.pool import LoadResult, PoolError, TrainerPool

log = structlog.get_logger("ehp_fsm.run")


@dataclass
class HybridLeases:
    ctl: Controller
    pool: TrainerPool
    rank_of: dict[str, int] = field(default_factory=dict)  # hybrid id -> warm rank
    identity_of: dict[str, dict[str, Any]] = field(default_factory=dict)
    later: deque[Event] = field(default_factory=deque)
    loads: list[LoadResult] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def command(self, ctl: Controller, cmd: Command) -> None:
        """Controller hook for every command of a Hybrid (and its GPUs' finalizer)."""
        hid = cmd.instance
        if cmd.kind == "launch":
            admitted = self.pool.admit_replacements()  # a replaced warm worker that is ready
            if admitted is not None:
                self._later(hid, "fail", reason=str(admitted))
                return
            idle = self.pool.idle_warm_ranks()
            free = [r for r in idle if r not in self.rank_of.values()]
            if not free:
                self._later(hid, "fail", reason="no idle warm worker")
                return
            rank = free[0]
            info = next(w for w in self.pool.workers if w.rank == rank)
            ident = {
                "host": cmd.args["host"],
                "pid": info.identity.pid,
                "start_time": info.identity.start_time,
                "token": cmd.args["token"],
            }
            self.rank_of[hid] = rank
            self.identity_of[hid] = ident
            self._later(hid, "launched", identity=ident)
        elif cmd.kind == "load_state":
            self.later.append(Event("hybrid_replica", hid, "_load", 0.0))
        elif cmd.kind in ("stop_process", "cancel_launch"):
            with contextlib.suppress(PoolError):  # not bound yet: nothing to park
                self.pool.deactivate(f"hybrid:{hid}")
            self.rank_of.pop(hid, None)
            inst = ctl.world.get("hybrid_replica", hid)
            if inst is not None and inst.state == "leaving":
                self._later(hid, "exited", identity=self.identity_of.get(hid))
        elif cmd.kind == "confirm_gpu_free":
            owner = str(cmd.args["owner"])
            self.later.append(
                Event(
                    "gpu",
                    cmd.instance,
                    "confirm_free",
                    0.0,
                    {"owner": owner, "processes_exited": True, "memory_free": True},
                )
            )

    def _later(self, hid: str, name: str, **payload: Any) -> None:
        self.later.append(Event("hybrid_replica", hid, name, 0.0, payload))

    def drain(self) -> None:
        """Fire what the hook deferred (it runs inside the controller's dispatch)."""
        while self.later:
            ev = self.later.popleft()
            if ev.name == "_load":
                self._load(ev.instance)
                continue
            self.ctl.handle(Event(ev.machine, ev.instance, ev.name, self.ctl.now(), ev.payload))

    def _load(self, hid: str) -> None:
        rank = self.rank_of.get(hid)
        if rank is None:
            return
        t0 = time.monotonic()
        got = self.pool.load_state(rank, replica=f"hybrid:{hid}")
        if isinstance(got, LoadResult):
            self.loads.append(got)
            self.ctl.event("hybrid_replica", hid, "loaded", version=got.version)
            log.info("hybrid_loaded", hybrid=hid, rank=rank, seconds=time.monotonic() - t0)
        else:
            self.failures.append(str(got))
            self.ctl.event("hybrid_replica", hid, "fail", reason=str(got))

    def activate_ready(self) -> list[str]:
        """At a step boundary: every ready Hybrid joins (epoch + 1). One whose state is older
        than the Core's (it missed a boundary) reloads here, at the boundary, and joins: loaded
        any later, the load would come before the next step and be stale again at the next
        boundary, and the Hybrid would never join."""
        joined = []
        world = self.ctl.world
        for inst in list(world.of("hybrid_replica").values()):
            if inst.state != "ready":
                continue
            if inst.get("loaded_version") != world.globals["core_version"]:
                self.ctl.event("hybrid_replica", inst.id, "reload")
                self.drain()  # the load runs now: the Core's state is that of this boundary
                now = world.get("hybrid_replica", inst.id)
                if now is None or now.state != "ready":
                    continue
            out = self.ctl.event("hybrid_replica", inst.id, "activate")
            if isinstance(out, Accepted):
                self.pool.activate(f"hybrid:{inst.id}")
                joined.append(inst.id)
        return joined
