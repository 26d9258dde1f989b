"""Hybrid replicas on pre-started (warm) trainer workers: the loop's performer for the
hybrid_replica machine.

The trainer pool starts every warm worker with the Core at start-up: one Gloo world, so a borrow
needs no new process and no new rendezvous — that is what makes the GPU switch fast. When the
machine asks to `launch` a Hybrid on a borrowed slot, a parked warm worker is bound to it and
reported `launched` with its process identity and the Hybrid's launch token; `load_state`
moves the Core's state into it (DP-zero gather + point-to-point + scatter) and reports `loaded`
with the version it holds; `activate` at a step boundary (`join_ready`) makes it train.
`stop_process` for a Hybrid ends the assignment: the worker leaves the lanes that train and is
parked (its process keeps running for the next borrow, its lane is dropped), and that end is
what `exited` confirms. The GPU's finalizer (`confirm_gpu_free`) is a check, not the pool's
word: the parked worker reports what it still holds, measured (lane tensors by kind; on CUDA
torch's allocator after `empty_cache` and NVML for its process), and the GPU leaves `releasing`
only once that report is free. A worker that still holds memory keeps the GPU `releasing`; it
is asked again every `recheck_s` until it lets go (and is not borrowed again meanwhile). A worker
that died holds nothing: its process is gone (the pool replaces it).
A warm worker that died (for instance inside the gradient all-reduce) is replaced by the pool
with a fresh process; a launch first admits every replacement that is ready, so the planner can
borrow again, and a launch that finds no idle worker while a replacement is still starting waits
for it (within the Hybrid's `launching` deadline) instead of failing. While a training step holds
the pool (the trainer steps on its own thread), these commands wait, in order, until the step is
over, so the loop never waits for a step: a Hybrid borrowed during a step is launched and loaded
right after it, with the state that step made.

A Hybrid is bound only to a warm worker on its own host's machine: a lane of the pool's
`remote_warm` (launched by that host's agent) for a host on another machine, else one of the
lanes the pool launched on the run's machine.

Knows: the pool, the loop's door, which warm rank serves which Hybrid. Does not know: when to
borrow (the planner) or the GPU ledger's rules (the machines).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from typing import Any, Final

import structlog

from ehp_fsm.core.transition import Accepted, Command
from ehp_fsm.shell.loop import Door, Route
from ehp_fsm.training.pool import HeldMemory, LoadResult, PoolError, PoolFailure, TrainerPool

log = structlog.get_logger("ehp_fsm.run")

HYBRID: Final = "hybrid_replica"
KINDS: Final = ("launch", "load_state", "stop_process", "cancel_launch", "confirm_gpu_free")


class WarmHybrids:
    """See the module docstring."""

    routes: frozenset[Route] = frozenset((HYBRID, k) for k in KINDS)

    def __init__(
        self,
        door: Door,
        pool: TrainerPool,
        *,
        recheck_s: float = 0.2,
        answer_s: float | None = None,
        load_s: float | None = None,
    ) -> None:
        self.door = door
        self.pool = pool
        self.recheck_s = recheck_s
        #: how long a parking or measuring warm worker has to answer (the plan's
        #: `[deadlines.hybrid_replica] leaving`; None: the pool's command time-out): one that
        #: does not is judged hung and stopped, not waited for again on the loop
        self.answer_s = answer_s
        #: how long a Hybrid's state load has (the plan's `[deadlines.hybrid_replica]
        #: loading`; None: the pool's command time-out)
        self.load_s = load_s
        self.rank_of: dict[str, int] = {}  # hybrid id -> warm rank
        self.parked: dict[str, tuple[int, HeldMemory | None]] = {}  # hybrid id -> rank, report
        self.unconfirmed: dict[str, str] = {}  # GPU -> owner whose memory is not free yet
        self._next_check = 0.0
        self.identity_of: dict[str, dict[str, Any]] = {}
        self.loads: list[LoadResult] = []
        self.failures: list[str] = []
        self._deferred: deque[Command] = deque()  # held back by a step in flight (`perform`)
        self._retry: list[Command] = []  # launches waiting for a replacement warm worker
        self._next_retry = 0.0

    # -- performer ---------------------------------------------------------------------------
    def perform(self, command: Command) -> None:
        """Carry `command` out now, or — while a step in flight holds the pool — once the
        step is over (`poll`), in the order given: the loop goes on serving meanwhile."""
        if self._deferred or self.pool.busy():
            self._deferred.append(command)
            return
        self._carry_out(command)

    def _carry_out(self, command: Command) -> None:
        hid = command.instance
        if command.kind == "launch":
            if not self._launch(hid, command.args):
                self._retry.append(command)
        elif command.kind == "load_state":
            self._load(hid)
        elif command.kind in ("stop_process", "cancel_launch"):
            self._park(hid)
        elif command.kind == "confirm_gpu_free":
            self._confirm_free(command.instance, str(command.args["owner"]))

    def poll(self, timeout_s: float) -> None:
        """Carry out the commands a step in flight held back; every `recheck_s`, try again the
        launches waiting for a replacement warm worker and ask again the parked workers whose
        GPUs are still `releasing` (neither while a step is in flight: the loop would wait for
        the whole step)."""
        while self._deferred and not self.pool.busy():
            self._carry_out(self._deferred.popleft())
        now = time.monotonic()
        if self._retry and now >= self._next_retry and not self.pool.busy():
            self._next_retry = now + self.recheck_s
            waiting, self._retry = self._retry, []
            for command in waiting:
                inst = self.door.world.get(HYBRID, command.instance)
                if inst is not None and inst.state == "launching":  # else: failed, cancelled
                    self._carry_out(command)
        if not self.unconfirmed or now < self._next_check or self.pool.busy():
            return  # a step in flight holds the pool: asked again after it
        self._next_check = now + self.recheck_s
        for gpu, owner in list(self.unconfirmed.items()):
            self._confirm_free(gpu, owner)

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
    def _launch(self, hid: str, args: Any) -> bool:
        """Bind an idle warm worker and report `launched`; False when none is idle yet but a
        replacement is starting (a warm worker died and the pool starts a fresh one): `poll`
        tries again while the Hybrid is `launching` (its deadline bounds the wait)."""
        admitted = self.pool.admit_replacements()  # a replaced warm worker that is ready
        if admitted is not None:
            self.door.event(HYBRID, hid, "fail", reason=str(admitted))
            return True
        free = [
            r
            for r in self.pool.idle_warm_ranks()
            if r not in self.rank_of.values() and self._serves(r, str(args["host"]))
        ]
        if not free:
            if self.pool.replacements_starting():
                return False
            self.door.event(HYBRID, hid, "fail", reason="no idle warm worker")
            return True
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
        return True

    def _serves(self, rank: int, host: str) -> bool:
        """Whether warm rank `rank` may train a Hybrid borrowed on `host`: a lane launched on
        another machine only that machine's host's; one the pool launched here only the hosts
        on this machine (those with no remote lanes)."""
        home = self.pool.config.home(rank)
        return home == host if home is not None else host not in self.pool.config.remote_warm

    def _load(self, hid: str) -> None:
        rank = self.rank_of.get(hid)
        if rank is None:
            self.door.event(HYBRID, hid, "fail", reason="no warm worker is bound to it")
            return
        t0 = time.monotonic()
        # bounded by the plan's `[deadlines.hybrid_replica] loading`, which cannot fire while
        # this call holds the loop (it waited the pool's own 120 s per collective)
        got = self.pool.load_state(rank, replica=f"hybrid:{hid}", timeout_s=self.load_s)
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
        rank = self.rank_of.pop(hid, None)
        if rank is not None:
            got = self.pool.park(rank, timeout_s=self.answer_s)
            report = got if isinstance(got, HeldMemory) else None
            self.parked[hid] = (rank, report)
            if report is None:
                log.warning("hybrid_park_failed", hybrid=hid, rank=rank, detail=str(got))
        inst = self.door.world.get(HYBRID, hid)
        if inst is not None and inst.state == "leaving":
            self.door.event(HYBRID, hid, "exited", identity=self.identity_of.get(hid))

    def _confirm_free(self, gpu: str, owner: str) -> None:
        """The finalizer of a Hybrid's GPU: the Hybrid's worker is parked (no lane of it trains,
        no warm rank is bound to it) and reports holding nothing (see the module docstring).
        Not confirmed: the GPU stays `releasing` and is asked again from `poll`."""
        hid = owner.partition(":")[2]
        parked = owner not in self.pool.live_replicas() and hid not in self.rank_of
        why = "its worker is still bound" if not parked else self._still_held(hid)
        if why is not None:
            if self.unconfirmed.get(gpu) != owner:
                log.warning("hybrid_gpu_not_free", gpu=gpu, owner=owner, why=why)
            self.unconfirmed[gpu] = owner
            return
        self.unconfirmed.pop(gpu, None)
        self.door.event(
            "gpu", gpu, "confirm_free", owner=owner, processes_exited=True, memory_free=True
        )

    def _still_held(self, hid: str) -> str | None:
        """What the parked worker of `hid` still holds, in words (None: nothing). A park
        report that said free stands (the worker may serve another Hybrid since); otherwise
        the worker measures again."""
        rank, report = self.parked.get(hid, (None, None))
        if rank is None:
            return None  # never bound to a worker: nothing of it ran
        if report is not None and report.free:
            return None
        try:
            got = self.pool.held_memory(rank, timeout_s=self.answer_s)
        except PoolError as exc:  # bound again after a park that could not report
            return f"its worker cannot be asked: {exc}"
        if isinstance(got, PoolFailure):
            if got.reason == "dead":
                return None  # its process is gone, and its memory with it
            return f"its worker did not answer: {got}"
        self.parked[hid] = (rank, got)
        return got.why_not_free()
