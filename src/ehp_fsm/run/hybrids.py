"""Hybrid replicas on pre-started (warm) trainer workers: the loop's performer for the
hybrid_replica machine.

The trainer pool starts every warm worker with the Core at start-up: one Gloo world, so a borrow
needs no new process and no new rendezvous — that is what makes the GPU switch fast. When the
machine asks to `launch` a Hybrid on a borrowed slot, a parked warm worker is bound to it and
reported `launched` with its process identity and the Hybrid's launch token; `load_state`
moves the Core's state into it (DP-zero gather + point-to-point + scatter) and reports `loaded`
with the version it holds; `activate` at a step boundary (`join_ready`) makes it train.
`stop_process` for a Hybrid ends the assignment: the worker leaves the lanes that train and is
parked again (its process keeps running for the next borrow), and that end is what `exited`
confirms. The GPU's finalizer (`confirm_gpu_free`) is confirmed from the pool's own record that
the worker is parked (no lane of it trains); on a CPU slot there is no device memory to free.
A warm worker that died (for instance inside the gradient all-reduce) is replaced by the pool
with a fresh process; a launch first admits every replacement that is ready, so the planner can
borrow again.

Knows: the pool, the loop's door, which warm rank serves which Hybrid. Does not know: when to
borrow (the planner) or the GPU ledger's rules (the machines).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Final

import structlog

from ehp_fsm.core.transition import Accepted, Command
from ehp_fsm.shell.loop import Door, Route
from ehp_fsm.training.pool import LoadResult, PoolError, TrainerPool

log = structlog.get_logger("ehp_fsm.run")

HYBRID: Final = "hybrid_replica"
KINDS: Final = ("launch", "load_state", "stop_process", "cancel_launch", "confirm_gpu_free")


class WarmHybrids:
    """See the module docstring."""

    routes: frozenset[Route] = frozenset((HYBRID, k) for k in KINDS)

    def __init__(self, door: Door, pool: TrainerPool) -> None:
        self.door = door
        self.pool = pool
        self.rank_of: dict[str, int] = {}  # hybrid id -> warm rank
        self.identity_of: dict[str, dict[str, Any]] = {}
        self.loads: list[LoadResult] = []
        self.failures: list[str] = []

    # -- performer ---------------------------------------------------------------------------
    def perform(self, command: Command) -> None:
        hid = command.instance
        if command.kind == "launch":
            self._launch(hid, command.args)
        elif command.kind == "load_state":
            self._load(hid)
        elif command.kind in ("stop_process", "cancel_launch"):
            self._park(hid)
        elif command.kind == "confirm_gpu_free":
            self._confirm_free(command.instance, str(command.args["owner"]))

    def poll(self, timeout_s: float) -> None:
        return None  # everything is known when performed

    def close(self) -> None:
        """End every Hybrid that is not over (their warm workers are the pool's to stop)."""
        spec = self.door.world.specs[HYBRID]
        for h in list(self.door.world.of(HYBRID).values()):
            if h.state not in spec.terminal:
                self.door.event(HYBRID, h.id, "fail", reason="shutdown")

    # -- the step boundary -------------------------------------------------------------------
    def join_ready(self) -> list[str]:
        """At a step boundary: every ready Hybrid joins (epoch + 1). One whose state is older
        than the Core's (it missed a boundary) reloads here, at the boundary, and joins: loaded
        any later, the load would come before the next step and be stale again at the next
        boundary, and the Hybrid would never join."""
        joined = []
        world = self.door.world
        for inst in list(world.of(HYBRID).values()):
            if inst.state != "ready":
                continue
            if inst.get("loaded_version") != world.globals["core_version"]:
                self.door.event(HYBRID, inst.id, "reload")  # its load_state is performed now
                now = world.get(HYBRID, inst.id)
                if now is None or now.state != "ready":
                    continue
            if isinstance(self.door.event(HYBRID, inst.id, "activate"), Accepted):
                self.pool.activate(f"hybrid:{inst.id}")
                joined.append(inst.id)
        return joined

    # -- commands ----------------------------------------------------------------------------
    def _launch(self, hid: str, args: Any) -> None:
        admitted = self.pool.admit_replacements()  # a replaced warm worker that is ready
        if admitted is not None:
            self.door.event(HYBRID, hid, "fail", reason=str(admitted))
            return
        free = [r for r in self.pool.idle_warm_ranks() if r not in self.rank_of.values()]
        if not free:
            self.door.event(HYBRID, hid, "fail", reason="no idle warm worker")
            return
        rank = free[0]
        info = next(w for w in self.pool.workers if w.rank == rank)
        ident = {
            "host": args["host"],
            "pid": info.identity.pid,
            "start_time": info.identity.start_time,
            "token": args["token"],
        }
        self.rank_of[hid] = rank
        self.identity_of[hid] = ident
        self.door.event(HYBRID, hid, "launched", identity=ident)

    def _load(self, hid: str) -> None:
        rank = self.rank_of.get(hid)
        if rank is None:
            self.door.event(HYBRID, hid, "fail", reason="no warm worker is bound to it")
            return
        t0 = time.monotonic()
        got = self.pool.load_state(rank, replica=f"hybrid:{hid}")
        if isinstance(got, LoadResult):
            self.loads.append(got)
            log.info("hybrid_loaded", hybrid=hid, rank=rank, seconds=time.monotonic() - t0)
            self.door.event(HYBRID, hid, "loaded", version=got.version)
        else:
            self.failures.append(str(got))
            self.door.event(HYBRID, hid, "fail", reason=str(got))

    def _park(self, hid: str) -> None:
        with contextlib.suppress(PoolError):  # not bound yet: nothing to park
            self.pool.deactivate(f"hybrid:{hid}")
        self.rank_of.pop(hid, None)
        inst = self.door.world.get(HYBRID, hid)
        if inst is not None and inst.state == "leaving":
            self.door.event(HYBRID, hid, "exited", identity=self.identity_of.get(hid))

    def _confirm_free(self, gpu: str, owner: str) -> None:
        """The finalizer of a Hybrid's GPU: confirmed once the pool has parked its worker (no
        lane of it trains and no warm rank is bound to it any more)."""
        hid = owner.partition(":")[2]
        parked = owner not in self.pool.live_replicas() and hid not in self.rank_of
        if not parked:
            log.warning("hybrid_gpu_not_free", gpu=gpu, owner=owner)
            return
        self.door.event(
            "gpu", gpu, "confirm_free", owner=owner, processes_exited=parked, memory_free=parked
        )
