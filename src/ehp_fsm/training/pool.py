"""The coordinator side of a pool of real trainer processes: Core ranks and warm Hybrid workers.

One Gloo world of `core_dp + max_hybrids` pool ranks, plus the warm lanes of other machines
(`remote_warm`), each rank launched by the pool or, for a Core lane or warm lane of another
machine (`remote_core`, `remote_warm`), there by its host's agent through a `Launcher` (`python -m
ehp_fsm.training.worker`; on the Megatron backend at TP × PP > 1 each pool rank is a lane of
`tp × pp` processes: the worker the pool launches and talks to, and the followers it starts and
relays every command to — the pool sees one worker per lane, see `worker.py`):
pool ranks `0..core_dp-1` are the Core lanes (replicas `core:<i>`, sharded DP-zero optimizer);
the others are warm Hybrid workers (process started and in the world, no lane: it is built when
`load_state` moves the Core's state into it, and dropped again by `park`). A step's process
group (Core ∪ the live Hybrids) is formed before the first commit of that membership — every
rank of the world is told, in one order (torch numbers groups world-wide), and only the members
meet — so the pool forms as many groups as memberships occur, and an idle (or dead) warm worker
takes part in no collective.

Parking: a Hybrid that leaves is deactivated (it trains no more) and parked: its worker drops
the lane and reports what the process still holds, measured (`HeldMemory`: lane tensors by kind
still referenced; on CUDA the allocator after `empty_cache` and NVML). A worker whose report is
not free is not idle — nothing is loaded into it — until `held_memory` reports it free; the GPU
finalizer of the Hybrid (`run/hybrids.py`) asks the same.

A step is two lockstep phases over the control channel (ZeroMQ ROUTER here, one DEALER per
worker, msgpack frames validated by `ehp_fsm.runtime.protocol`):
1. `compute`: every live lane computes the mean gradient over its whole groups and replies with
   its delivery record (step, epoch, replica, samples, shapes), loss and compute time; the pool
   feeds the records through `DeliveryCollector` (the pure ledger decides what counts);
2. `commit`: only once the ledger closed, every live lane takes part in Σ (nᵢ/B)·ḡᵢ over the
   group of the live ranks and applies the same update; Core rank 0 saves the weights as a
   revision (`RevisionStore`) and returns its path. The revision is saved after every lane
   stepped: a failed save (a full disk, a revision not newer than the store's last) leaves the
   step standing and is reported as `StepResult.publish_error`, not as a failed step.

Every wait has a deadline, and a worker whose process is gone is reported as a `PoolFailure`
value naming its rank, never a hang. A Hybrid that dies *inside* a collective (the gradient
all-reduce, a state load) is survived: Gloo raises on the survivors as soon as the peer's socket
closes, the pool collects every rank's outcome, re-forms the Gloo world without the dead worker
(`pool_channel`), and — when no survivor stepped — fails the step in the ledger with the dead
replica missing, so the caller retries it from exactly the state before it. A dead warm worker
is replaced by a fresh process, admitted at the next step or state load (until then it is on
standby: `load_state` and `save_state` refuse it with a `PoolFailure`). A dead Core rank is not
survivable (it holds the authoritative optimizer state): the pool is then broken and says why.
What the pool does not know: the engine's machines (which replica to borrow or return, epochs,
when to publish) — its caller decides and passes them in.

Files: `pool_protocol.py` (config, worker argv, wire encodings, result values), `pool_channel.py`
(the ROUTER socket, worker records, deadlines and liveness), `worker.py` (the trainer process),
`verify.py` (recording, Core-only replay, streaming comparison).
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Self

import structlog
import zmq

from ehp_fsm.core.batch import Delivery, DeliveryAccepted, GroupPartition, LedgerStatus
from ehp_fsm.runtime.protocol import Kind
from ehp_fsm.stalls import OwnDeadline
from ehp_fsm.training.backend import GradientDelivery
from ehp_fsm.training.collect import DeliveryCollector
from ehp_fsm.training.grpo import GroupBatch
from ehp_fsm.training.memory import HeldMemory
from ehp_fsm.training.objective import ObjectiveMetrics
from ehp_fsm.training.pool_channel import Launcher, Reform, WorkerChannel, exclusive
from ehp_fsm.training.pool_protocol import (
    LoadResult,
    PoolConfig,
    PoolError,
    PoolFailure,
    RankReply,
    RankTimings,
    Restored,
    StaleStateError,
    StepResult,
    WorkerInfo,
    as_partition,
    compute_reply_problem,
    delivery_from_wire,
    encode_batch,
    worker_argv,
)

__all__ = [
    "HeldMemory",
    "Launcher",
    "LoadResult",
    "PoolConfig",
    "PoolError",
    "PoolFailure",
    "RankReply",
    "RankTimings",
    "Reform",
    "Restored",
    "StaleStateError",
    "StepResult",
    "TrainerPool",
    "WorkerInfo",
    "worker_argv",
]

log = structlog.get_logger("ehp_fsm.training.pool")


# -- the pool -----------------------------------------------------------------------------------


class TrainerPool(WorkerChannel):
    """Coordinator of one pool. Build with `TrainerPool.spawn(...)` (it launches the processes)
    or `TrainerPool.bind(...)` + `worker_argv(rank)` + `wait_ready()` (someone else launches)."""

    # -- start-up ---------------------------------------------------------------------------
    @classmethod
    def bind(cls, config: PoolConfig, *, work_dir: Path) -> TrainerPool:
        """A pool listening for workers that someone else launches with `worker_argv(rank)`."""
        return cls(config, work_dir=work_dir)

    def launch_all(self) -> Self:
        """Launch every world rank — as a child process, or a rank of another machine through the
        pool's launcher — without waiting: `wait_ready` (as often as needed) waits for the
        hellos. A launch that raises shuts the pool down first."""
        try:
            for r in range(self.config.world_size):
                self._launch(r)
        except BaseException:
            self.shutdown(timeout_s=5.0)
            raise
        return self

    @classmethod
    def spawn(
        cls,
        config: PoolConfig,
        *,
        work_dir: Path,
        start_timeout_s: float = 120.0,
        checkpoint: Callable[[], None] | None = None,
        prefork: bool | None = None,
    ) -> TrainerPool:
        """Launch every world rank as a child process and wait for all hellos.

        Raises `PoolError` (with the failing rank and its log file) if a worker does not start.
        `checkpoint`: `wait_ready`'s; what it raises shuts the pool down and is raised.
        `prefork`: `WorkerChannel`'s (forked from one preloaded starter; default: on CPU).
        """
        pool = cls(config, work_dir=work_dir, prefork=prefork).launch_all()
        try:
            failure = pool.wait_ready(timeout_s=start_timeout_s, checkpoint=checkpoint)
            if failure is not None:
                raise PoolError(
                    f"trainer pool did not start: {failure}",
                    f"see {pool.work_dir}/worker-{failure.rank}.log",
                    "check the worker log; raise start_timeout_s on a loaded machine",
                )
        except BaseException:
            pool.shutdown(timeout_s=5.0)
            raise
        return pool

    @exclusive
    def wait_ready(
        self, *, timeout_s: float = 120.0, checkpoint: Callable[[], None] | None = None
    ) -> PoolFailure | None:
        """Wait for every rank's hello (after Gloo rendezvous, groups and model build); a rank
        whose hello came in an earlier call is not waited for again. `checkpoint`: called at
        least every 50 ms; what it raises ends the wait (the workers go on starting)."""
        deadline = time.monotonic() + timeout_s
        waiting = {r for r, w in self._workers.items() if w.identity is None}
        while waiting:
            if checkpoint is not None:
                checkpoint()
            if time.monotonic() >= deadline:
                r = min(waiting)
                return PoolFailure(
                    op="start",
                    reason="deadline",
                    rank=r,
                    replica=None,
                    detail=f"ranks {sorted(waiting)} sent no hello within {timeout_s} s",
                )
            got = self._recv(timeout_ms=50)
            if got is None:
                dead = self._dead_among(waiting, force=True)
                if dead is not None:
                    return PoolFailure(
                        op="start", reason="dead", rank=dead[0], replica=None, detail=dead[1]
                    )
                continue
            rank, frame = got
            if frame.kind is Kind.HELLO and self._on_hello(rank, frame):
                waiting.discard(rank)
            elif frame.kind is Kind.EVENT and frame.payload["name"] == "worker_failed":
                return PoolFailure(
                    op="start",
                    reason="worker_error",
                    rank=rank,
                    replica=None,
                    detail=str(frame.payload["data"].get("error", "")),
                )
        return None

    # -- views ------------------------------------------------------------------------------
    @property
    def workers(self) -> tuple[WorkerInfo, ...]:
        out = []
        for w in self._workers.values():
            if w.identity is not None:
                out.append(
                    WorkerInfo(
                        rank=w.rank,
                        role=w.role,
                        identity=w.identity,
                        version=w.version,
                        intra_op_threads=w.intra_op_threads,
                    )
                )
        return tuple(out)

    @property
    def core_version(self) -> int:
        return self._workers[0].version

    @exclusive
    def live_replicas(self) -> dict[str, int]:
        """Replica id → world rank of every lane that trains in the next step."""
        out = {self.config.core_replica(r): r for r in self.config.core_ranks}
        for w in self._workers.values():
            if w.role == "hybrid" and w.active and w.replica is not None:
                out[w.replica] = w.rank
        return out

    @exclusive
    def dead_core_rank(self) -> tuple[int, str] | None:
        """A Core rank whose process is known gone now (it exited, or for a rank on another
        machine its agent said so: `report_exit`), and why; None when none is."""
        return self._dead_among(self.config.core_ranks, force=True)

    @exclusive
    def replacements_starting(self) -> bool:
        """Whether a replacement warm worker is starting (on standby, alive, not admitted yet):
        a launch that finds no idle worker can wait for it instead of failing."""
        return any(
            w.role == "hybrid" and w.standby and w.dead is None for w in self._workers.values()
        )

    @exclusive
    def idle_warm_ranks(self) -> tuple[int, ...]:
        """Warm workers that are alive, in the world, bound to no replica and not holding a
        parked lane's memory (candidates for `load_state`); a replacement on standby is not one
        until `admit_replacements`, a worker whose last `park` report was not free not until a
        `held_memory` report is."""
        return tuple(
            w.rank
            for w in self._workers.values()
            if w.role == "hybrid"
            and w.replica is None
            and w.dead is None
            and not w.standby
            and (w.held is None or w.held.free)
        )

    @exclusive
    def rank_of(self, replica: str) -> int:
        for w in self._workers.values():
            if w.replica == replica:
                return w.rank
        raise PoolError(
            f"no warm worker holds replica {replica!r}",
            f"bound replicas: {sorted(w.replica for w in self._workers.values() if w.replica)}",
            "call load_state(rank, replica=...) first",
        )

    @property
    def broken(self) -> PoolFailure | None:
        return self._broken

    # -- borrow and return ------------------------------------------------------------------
    @exclusive
    def load_state(
        self, rank: int, *, replica: str, timeout_s: float | None = None
    ) -> LoadResult | PoolFailure:
        """Core DP shards → DP-zero world on Core rank 0 → point-to-point to warm worker `rank`,
        which scatters it into its DP1 lane (its own padding). Binds `replica` to `rank`."""
        if (bad := self._unusable("load_state")) is not None:
            return bad
        if (bad := self.admit_replacements()) is not None:
            return bad
        w = self._workers.get(rank)
        if w is None or w.role != "hybrid":
            raise PoolError(
                f"rank {rank} is not a warm Hybrid worker",
                f"warm ranks are {list(self.config.warm_ranks)}",
                "pass one of idle_warm_ranks()",
            )
        if w.active:
            raise PoolError(
                f"rank {rank} is active as {w.replica!r}",
                "state is loaded only into an idle warm worker",
                "deactivate it first",
            )
        if w.dead is not None:
            return PoolFailure(
                op="load_state", reason="dead", rank=rank, replica=replica, detail=w.dead
            )
        if w.standby:
            return self._on_standby("load_state", w.rank, replica)
        if replica.startswith("core:") or any(
            o.replica == replica for o in self._workers.values() if o.rank != rank
        ):
            raise PoolError(
                f"replica id {replica!r} is already in use",
                "each replica id names one lane",
                "use the Hybrid replica's own id (hybrid:<id>)",
            )
        t0 = time.monotonic()
        timeout = self.config.command_timeout_s if timeout_s is None else timeout_s
        # its lane first, alone: one it cannot build fails here, before a Core rank sends
        built = self._await(
            {rank: self._command(rank, "build_lane", {})}, op="load_state", timeout_s=timeout
        )
        if isinstance(built, PoolFailure):
            return replace(built, replica=replica)
        self._dead_among([rank], force=True)
        sends = {} if w.dead is not None else {rank: self._command(rank, "recv_state", {"src": 0})}
        if w.dead is not None:  # checked before any Core rank starts sending to it
            return PoolFailure(
                op="load_state", reason="dead", rank=rank, replica=replica, detail=w.dead
            )
        for r in self.config.core_ranks:
            sends[r] = self._command(r, "send_state", {"dst": rank})
        got, failure = self._collective(sends, op="load_state", timeout_s=timeout)
        if failure is not None:
            return failure  # the warm worker died while receiving: the Core only sent
        seconds = time.monotonic() - t0
        version = int(got[rank][1]["version"])
        w.version = version
        w.replica = replica
        log.info("state_loaded", rank=rank, replica=replica, version=version, seconds=seconds)
        return LoadResult(rank=rank, replica=replica, version=version, seconds=seconds)

    @exclusive
    def activate(self, replica: str) -> None:
        """The warm worker holding `replica` trains from the next step on. Refuses
        (`StaleStateError`) unless its loaded version equals the Core's current version."""
        w = self._workers[self.rank_of(replica)]
        if w.dead is not None:
            raise PoolError(
                f"worker of {replica!r} (rank {w.rank}) is dead", w.dead, "deactivate it"
            )
        if w.version != self.core_version:
            raise StaleStateError(
                f"{replica!r} holds state version {w.version}, the Core is at {self.core_version}",
                "a Hybrid replica may only join with the Core's current state",
                "call load_state again right before activate",
            )
        w.active = True
        log.info("hybrid_activated", replica=replica, rank=w.rank, version=w.version)

    @exclusive
    def deactivate(self, replica: str) -> None:
        """The worker holding `replica` goes idle (unbound); the Core state stays authoritative.
        A replica whose worker died and was replaced is already gone: nothing to do."""
        if replica in self._lost and not any(w.replica == replica for w in self._workers.values()):
            self._lost.discard(replica)
            log.info("hybrid_deactivated", replica=replica, rank=None, detail="worker replaced")
            return
        w = self._workers[self.rank_of(replica)]
        w.active = False
        w.replica = None
        log.info("hybrid_deactivated", replica=replica, rank=w.rank)

    # -- parking ----------------------------------------------------------------------------
    @exclusive
    def park(self, rank: int, *, timeout_s: float | None = None) -> HeldMemory | PoolFailure:
        """Warm worker `rank` (deactivated: bound to no replica) drops its lane and reports what
        it still holds, measured (`HeldMemory`). Until a report says free the worker is not
        idle: nothing is loaded into a worker that did not let go of its last lane."""
        return self._ask_memory(rank, "park", timeout_s)

    @exclusive
    def held_memory(self, rank: int, *, timeout_s: float | None = None) -> HeldMemory | PoolFailure:
        """Warm worker `rank` measures again what it holds (the GPU finalizer asks until free)."""
        return self._ask_memory(rank, "memory", timeout_s)

    @exclusive
    def worker_status(self, rank: int) -> dict[str, Any] | PoolFailure:
        """What worker `rank` says of itself: its lane version, whether it holds a lane, and the
        process groups it formed in the current world (memberships, in order)."""
        got = self._await({rank: self._command(rank, "ping", {})}, op="ping")
        return got if isinstance(got, PoolFailure) else got[rank]

    def _ask_memory(self, rank: int, op: str, timeout_s: float | None) -> HeldMemory | PoolFailure:
        w = self._workers.get(rank)
        if w is None or w.role != "hybrid":
            raise PoolError(
                f"rank {rank} is not a warm Hybrid worker",
                f"warm ranks are {list(self.config.warm_ranks)}",
                "park only warm workers (the Core keeps its lane)",
            )
        if w.replica is not None:
            raise PoolError(
                f"warm rank {rank} is still bound to {w.replica!r}",
                "a worker parks only after its replica left the lanes that train",
                f"deactivate({w.replica!r}) first",
            )
        if w.dead is not None:
            return PoolFailure(op=op, reason="dead", rank=rank, replica=None, detail=w.dead)
        if w.standby:
            return self._on_standby(op, rank, None)
        t0 = time.monotonic()
        timeout = self.config.command_timeout_s if timeout_s is None else timeout_s
        late: list[int] = []
        got = self._await({rank: self._command(rank, op, {})}, op=op, timeout_s=timeout, late=late)
        if isinstance(got, PoolFailure):
            # hung (SIGSTOP, a deadlock): stopped as dead, so the next ask is answered at once
            # ("dead": its memory went with it) instead of waiting out the time-out again
            self._stop_hung_warm(late, f"no reply to {op} in {timeout:g} s")
            return got
        w.held = HeldMemory.from_wire(got[rank]["held"])
        log.info(
            "worker_memory",
            op=op,
            rank=rank,
            seconds=time.monotonic() - t0,
            free=w.held.free,
            why=w.held.why_not_free(),
            by_kind=dict(w.held.by_kind),
            other=w.held.other,
        )
        return w.held

    # -- the lockstep step ------------------------------------------------------------------
    @exclusive
    def step(
        self,
        *,
        step: int,
        epoch: int,
        partition: GroupPartition | Mapping[str, Sequence[int]],
        batch: GroupBatch,
        total_samples: int | None = None,
        revision: int | None = None,
        publish: bool = True,
        timeout_s: float | None = None,
        fingerprint: bool = False,
        on_computed: Callable[[tuple[str, ...]], bool] | None = None,
    ) -> StepResult | PoolFailure:
        """One fixed-batch optimizer step over the live lanes (see the module docstring).

        `partition` assigns whole groups of `batch` to live replicas (a live replica left out
        computes nothing and contributes n=0). `revision`: the number Core rank 0 saves the new
        weights under (default: the new Core version); `publish=False` or no `revisions` root in
        the config saves nothing. `fingerprint`: Core rank 0 reports (Σx, Σx²) of each weight
        of its lane (a follower's under its part's name) after the step (`verify.fingerprint`;
        what --verify records per step). `on_computed`: asked with the replicas that delivered
        once the ledger closed, before any collective of the commit — False gives the step up
        there (`cancelled`: nothing reduced or stepped, the world intact); the run's trainer
        says False once the orchestrator gave the step up.
        """
        if (bad := self._unusable("step")) is not None:
            return bad
        t0 = time.monotonic()
        if (bad := self.admit_replacements()) is not None:
            return bad
        part = as_partition(partition, step=step, epoch=epoch, group_size=batch.group_size)
        if self.config.objective.aggregation == "token_mean" and not part.units:
            # weigh each replica by its response tokens: Σ (Tᵢ/T)·ḡᵢ is the full-batch gradient
            part = part.with_units(
                {r: batch.select(part.groups_of(r)).response_tokens for r in part.replicas}
            )
        live = self.live_replicas()
        stray = [r for r in part.replicas if r not in live]
        if stray:
            raise PoolError(
                f"partition names replicas {stray} that are not live",
                f"live replicas: {sorted(live)}",
                "partition over live_replicas() (activate a Hybrid before giving it groups)",
            )
        if total_samples is not None and total_samples != part.total_samples:  # B, not units
            raise PoolError(
                f"total_samples={total_samples} but the partition covers {part.total_samples}",
                "the optimizer consumes exactly the global batch the partition assigns",
                "pass the partition's total_samples",
            )
        self._dead_among(live.values(), force=True)
        for r in live.values():
            if self._workers[r].dead is not None:
                return PoolFailure(
                    op="step",
                    reason="dead",
                    rank=r,
                    replica=self._replica_of(r),
                    detail=str(self._workers[r].dead),
                )
        timeout = self.config.command_timeout_s if timeout_s is None else timeout_s
        # one deadline for the replies and the ledger: the ledger judges a delivery at the
        # time less this process's own stalls (`OwnDeadline`), as the wait for it does
        own = OwnDeadline(timeout)
        self.step_stalled_s = 0.0
        collector = DeliveryCollector(part, shapes=self._workers[0].shapes, deadline=own.at)
        refs: dict[int, str] = {}
        for replica, rank in live.items():
            groups = part.groups_of(replica) if replica in part.replicas else ()
            args: dict[str, Any] = {"step": step, "epoch": epoch, "replica": replica}
            if groups:
                args["batch"] = encode_batch(batch.select(groups))
            refs[rank] = self._command(rank, "compute", args)
        late: list[int] = []
        got = self._await(
            refs,
            op="step",
            timeout_s=timeout,
            collector=collector,
            current_step=step,
            late=late,
            deadline=own,
        )
        if isinstance(got, PoolFailure):
            self._stop_hung_warm(late, f"no reply to its compute of step {step} in {timeout} s")
            return got
        computed: dict[int, tuple[Delivery, float, float, float]] = {}
        metrics: list[ObjectiveMetrics] = []
        for rank in sorted(got):
            res = got[rank]
            if (problem := compute_reply_problem(res)) is not None:
                log.error(
                    "pool_failure", op="step", reason="worker_error", rank=rank, detail=problem
                )
                return PoolFailure(
                    op="step",
                    reason="worker_error",
                    rank=rank,
                    replica=self._replica_of(rank),
                    detail=f"its compute reply cannot be read: {problem}",
                )
            record = delivery_from_wire(res["record"])
            computed[rank] = (
                record,
                float(res["loss"]),
                float(res["compute_s"]),
                float(res.get("compute_cpu_s", 0.0)),
            )
            metrics.append(ObjectiveMetrics(**res.get("metrics", {})))
            if record.samples == 0 and record.replica not in part.working_replicas:
                continue  # an idle live lane: no delivery is expected from it
            outcome = collector.offer(GradientDelivery(record=record, grads=()), now=own.now())
            if not isinstance(outcome, DeliveryAccepted):
                return PoolFailure(
                    op="step",
                    reason="ledger",
                    rank=rank,
                    replica=record.replica,
                    detail=f"{outcome.reason.value}: {outcome.detail}",
                )
        if collector.ledger.status is not LedgerStatus.CLOSED:
            missing = collector.ledger.outstanding()
            return PoolFailure(
                op="step",
                reason="ledger",
                rank=None,
                replica=missing[0] if missing else None,
                detail=f"ledger {collector.ledger.status.value}; missing {list(missing)}",
            )
        delivered = tuple(computed[r][0].replica for r in sorted(computed))
        own.left()  # (a stall since its last reading is credited too)
        self.step_stalled_s = own.stalled_s
        if on_computed is not None and not on_computed(delivered):
            log.warning("step_cancelled", step=step, epoch=epoch)
            return PoolFailure(
                op="step",
                reason="cancelled",
                rank=None,
                replica=None,
                detail="given up before its commit (nothing was reduced or stepped)",
            )
        members = sorted(live.values())
        if (bad := self._form_group(members, timeout, collector, computed)) is not None:
            return bad
        store = self.config.revisions if publish else None
        rev = (self.core_version + 1) if revision is None else revision
        refs = {}
        for rank in live.values():
            args = {
                "step": step,
                "ref": got[rank]["ref"],
                "members": members,
                "total_samples": part.total_units,
            }
            if rank == 0 and store is not None:
                args["publish"] = {"root": store, "revision": rev, "step": step}
            if rank == 0 and fingerprint:
                args["fingerprint"] = True
            refs[rank] = self._command(rank, "commit", args)
        settled, failure = self._collective(refs, op="step", timeout_s=timeout)
        if failure is not None:
            bad = self._commit_failed(failure, settled, collector, computed)
            if bad is not None:
                return bad
        done = {r: res for r, (kind, res) in settled.items() if kind == "ok"}
        versions = {int(done[r]["version"]) for r in done}
        if len(versions) != 1:
            self._broken = PoolFailure(
                op="step",
                reason="worker_error",
                rank=None,
                replica=None,
                detail=f"lanes disagree on the version after the step: {sorted(versions)}",
                broken_world=True,
            )
            return self._broken
        version = versions.pop()
        total = part.total_units
        replies = []
        loss = 0.0
        lost = tuple(computed[r][0].replica for r in sorted(computed) if r not in done)
        lost_why = {  # how each died: its worker's exit, or what the collective saw
            computed[r][0].replica: self._workers[r].dead
            or str(settled.get(r, ("dead", {}))[1].get("error", "no reply"))
            for r in sorted(computed)
            if r not in done
        }
        for rank in sorted(computed):
            record, lane_loss, compute_s, compute_cpu_s = computed[rank]
            loss += lane_loss * record.samples / total
            d = done.get(rank, {"reduce_s": 0.0, "apply_s": 0.0})  # died after the reduction
            if rank in done:
                self._workers[rank].version = version
            replies.append(
                RankReply(
                    rank=rank,
                    replica=record.replica,
                    delivery=record,
                    loss=lane_loss,
                    version=version,
                    timings=RankTimings(
                        compute_s=compute_s,
                        compute_cpu_s=compute_cpu_s,
                        reduce_s=float(d["reduce_s"]),
                        apply_s=float(d["apply_s"]),
                        publish_s=float(d.get("publish_s", 0.0)),
                    ),
                )
            )
        path = done[0].get("revision_path")
        publish_error = done[0].get("publish_error")
        if publish_error is not None:
            log.error("revision_not_saved", step=step, revision=rev, detail=publish_error)
        return StepResult(
            step=step,
            epoch=epoch,
            version=version,
            loss=loss,
            ranks=tuple(replies),
            revision=rev if path is not None else None,
            revision_path=path,
            wall_s=time.monotonic() - t0,
            lost=lost,
            lost_why=lost_why,
            publish_error=None if publish_error is None else str(publish_error),
            metrics=ObjectiveMetrics.merge(metrics),
            fingerprint=_fingerprint(done[0].get("fingerprint")),
        )

    def _form_group(
        self,
        members: Sequence[int],
        timeout_s: float,
        collector: DeliveryCollector,
        computed: Mapping[int, tuple[Delivery, float, float, float]],
    ) -> PoolFailure | None:
        """Before the first commit of a membership: every rank of the world forms its process
        group (the members meet, the others count it; see `worker.py`). Here, after the
        compute phase, not before it: a worker that died before the step is found by the
        compute's wait at once, while a rendezvous would wait for it until its time-out. A warm
        worker dying here fails the step in the ledger with its replica missing (no lane
        stepped; the world re-formed without it): the caller retries on the live replicas. An
        idle warm worker (not a member) dying here fails nothing: the group is formed again in
        the world re-formed without it. A member already dead is not waited for at all
        (`_member_gone`)."""
        key = tuple(sorted(members))
        t0 = time.monotonic()
        while key not in self.formed:
            for r in self.world_members:  # an idle warm worker may have died unnoticed
                self._dead_among([r], force=True)
            gone = [r for r in key if self._workers[r].dead is not None]
            if gone:  # died after its compute: the group can never form (`_member_gone`)
                return self._member_gone(key, gone, collector, computed)
            ranks = [
                r
                for r in self.world_members
                if self._workers[r].dead is None and not self._workers[r].standby
            ]
            refs = {r: self._command(r, "form_group", {"members": list(key)}) for r in ranks}
            got, failure = self._collective(refs, op="step", timeout_s=timeout_s)
            if failure is None:
                self.formed.append(key)
                log.info("group_formed", members=list(key), seconds=time.monotonic() - t0)
                break
            dead = [r for r in key if r in got and got[r][0] == "dead"]
            if failure.broken_world or dead:
                missing = tuple(computed[r][0].replica for r in dead if r in computed)
                collector.fail_reduction(missing, now=time.monotonic(), reason="died_in_group")
                return failure
        return None

    def _member_gone(
        self,
        key: tuple[int, ...],
        gone: Sequence[int],
        collector: DeliveryCollector,
        computed: Mapping[int, tuple[Delivery, float, float, float]],
    ) -> PoolFailure:
        """Members of the group about to form died after their compute (the compute's wait
        watches only the ranks that have not answered yet): the group can never form, and its
        other members would wait in its rendezvous for the dead until the collective time-out
        — so it is not tried. The step fails in the ledger with them missing; a dead Core rank
        breaks the pool (named, as it died), a dead warm worker fails the step as one that died
        before it (the caller retries without it; the world is re-formed when its replacement
        is admitted)."""
        missing = tuple(computed[r][0].replica for r in gone if r in computed)
        collector.fail_reduction(missing, now=time.monotonic(), reason="died_before_group")
        core = [r for r in gone if r in self.config.core_ranks]
        r = core[0] if core else gone[0]
        why = f"{self._workers[r].dead} (after its compute, before the group {list(key)} formed)"
        if core:
            return self._break("step", r, f"Core rank {r} died: {why}")
        log.error("pool_failure", op="step", reason="dead", rank=r, detail=why)
        return PoolFailure(
            op="step", reason="dead", rank=r, replica=self._replica_of(r), detail=why
        )

    def _commit_failed(
        self,
        failure: PoolFailure,
        settled: Mapping[int, Any],
        collector: DeliveryCollector,
        computed: Mapping[int, tuple[Delivery, float, float, float]],
    ) -> PoolFailure | None:
        """A Hybrid died inside the commit and the world was re-formed without it. If no
        survivor stepped — each survivor's commit failed before its optimizer step (`stepped`
        false) and its version is still the Core's — the step fails (the ledger with the dead
        replica missing) and can be retried from exactly the state before it. If every survivor
        completed the step with the same version (the Hybrid died after the reduction), the step
        stands: None. Anything else leaves the pool broken."""
        if failure.broken_world:
            return failure
        before = self.core_version
        survivors = {r: o for r, o in settled.items() if o[0] != "dead"}
        if all(
            kind == "ok" and int(res.get("version", -1)) == before + 1
            for kind, res in survivors.values()
        ):
            log.warning("hybrid_died_after_reduction", rank=failure.rank, replica=failure.replica)
            return None
        untouched = all(
            kind == "error"
            and res.get("stepped") is False
            and int(res.get("version", -1)) == before
            for kind, res in survivors.values()
        )
        if not untouched:
            return self._break(
                "step",
                failure.rank,
                f"{failure.replica} died inside the reduction but the survivors disagree on "
                f"whether they stepped: {dict(survivors)}",
            )
        missing = tuple(computed[r][0].replica for r in sorted(settled) if settled[r][0] == "dead")
        collector.fail_reduction(missing, now=time.monotonic(), reason="died_in_reduction")
        return PoolFailure(
            op="step",
            reason="dead",
            rank=failure.rank,
            replica=failure.replica,
            detail=(
                f"{failure.detail}; ledger failed step {collector.ledger.step} "
                f"epoch {collector.ledger.epoch}, missing {list(missing)}; no survivor stepped "
                f"(version {before}): retry the step on the live replicas"
            ),
        )

    # -- state out --------------------------------------------------------------------------
    @exclusive
    def publish(
        self, revision: int, *, step: int = 0, checkpoint: Callable[[], None] | None = None
    ) -> str | PoolFailure:
        """Save the Core's current weights as `revision` (e.g. revision 0 before training).
        `checkpoint`: called while the save is awaited; what it raises ends the wait and
        abandons the pool (`WorkerChannel._await`)."""
        if self.config.revisions is None:
            raise PoolError(
                "the pool has no revision store",
                "PoolConfig.revisions is None",
                "set PoolConfig.revisions to the RevisionStore root",
            )
        if (bad := self._unusable("publish")) is not None:
            return bad
        args = {"root": self.config.revisions, "revision": revision, "step": step}
        got = self._await(
            {0: self._command(0, "publish", args)}, op="publish", checkpoint=checkpoint
        )
        return got if isinstance(got, PoolFailure) else str(got[0]["revision_path"])

    @exclusive
    def save_state(
        self, path: Path, *, rank: int = 0, checkpoint: Callable[[], None] | None = None
    ) -> Path | PoolFailure:
        """Write a lane's exact training state in the streaming state-dir format of
        `ehp_fsm.training.verify` (params, FP32 master, Adam moments and steps per parameter).
        `rank` 0 (or any Core rank): the Core state, DP-zero gathered; a warm rank: its DP1 lane.
        A failed write (the dir exists, a full disk) is a `worker_error` that leaves the pool
        usable; a replacement warm worker still on standby is refused (`PoolFailure`).
        `checkpoint`: as `publish`'s."""
        if (bad := self._unusable("save_state")) is not None:
            return bad
        if rank not in self.config.core_ranks:
            w = self._workers.get(rank)
            if w is None:
                raise PoolError(
                    f"rank {rank} is not a rank of this pool",
                    f"its ranks are 0..{self.config.world_size - 1}",
                    "pass a Core rank (the Core state) or a warm rank",
                )
            if w.dead is not None:
                return PoolFailure(
                    op="save_state", reason="dead", rank=rank, replica=w.replica, detail=w.dead
                )
            if w.standby:
                return self._on_standby("save_state", rank, None)
        ranks = self.config.core_ranks if rank in self.config.core_ranks else (rank,)
        args = {"path": str(path)}
        got = self._await(
            {r: self._command(r, "save_state", args) for r in ranks},
            op="save_state",
            collective=len(ranks) > 1,
            checkpoint=checkpoint,
        )
        return got if isinstance(got, PoolFailure) else Path(path)

    @exclusive
    def restore_state(
        self, path: Path, *, checkpoint: Callable[[], None] | None = None
    ) -> Restored | PoolFailure:
        """Install a Core state dir written by `save_state` (parameters, FP32 master, Adam
        moments and steps) into every Core rank: a resumed run goes on from it. Each rank then
        holds its lane to the digests the save recorded (`verify.check_restored`); a lane that
        differs is a `worker_error` naming what differs. Returns the restored optimizer version
        and, per TP shard, the tensors compared and the digest computed from the lane.
        `checkpoint`: as `publish`'s (a 7B model's master weights and Adam moments are 84 GB
        to read: minutes)."""
        if (bad := self._unusable("restore_state")) is not None:
            return bad
        ranks = self.config.core_ranks
        refs = {r: self._command(r, "restore_state", {"path": str(path)}) for r in ranks}
        got = self._await(
            refs, op="restore_state", collective=len(ranks) > 1, checkpoint=checkpoint
        )
        if isinstance(got, PoolFailure):
            if got.rank != ranks[0] and not got.broken_world:
                # another rank's answer came first ("the source rank refused the state"): the
                # source rank's own error names the file and what is wrong with it
                source = self._await({ranks[0]: refs[ranks[0]]}, op="restore_state")
                if isinstance(source, PoolFailure) and source.reason == "worker_error":
                    return source
            return got
        version = int(got[ranks[0]]["version"])
        for r in ranks:
            self._workers[r].version = version
        checked = {k: v for r in ranks for k, v in got[r]["checked"].items()}
        return Restored(version=version, checked=checked)

    # -- shutdown ---------------------------------------------------------------------------
    def shutdown(self, *, timeout_s: float = 10.0) -> list[int]:
        """Ask every worker to exit, wait up to `timeout_s`, then kill what is left (only our
        own children, by their process handles). Returns the ranks that had to be killed."""
        if self._closed:
            return []
        if self.busy() or self._abandoned is not None:
            # A step is in flight on another thread (the run is stopping on an error), or the
            # workers are still at an operation whose wait was abandoned (a stop during a
            # long restore): end the workers first — that step's waits see them dead and let
            # go of the pool; a busy worker would read its shutdown only once done.
            for w in self._workers.values():
                if w.process is not None and w.process.poll() is None:
                    w.process.terminate()
                self._stop_remote(w)
        if not self._exclusive.acquire(timeout=max(timeout_s, 1.0) + 30.0):
            log.error("pool_shutdown_busy", detail="a step still holds the pool; killing")
            for w in self._workers.values():
                if w.process is not None:
                    w.process.kill()
                self._stop_remote(w)
            self._close_starter()
            return [w.rank for w in self._workers.values() if w.process is not None]
        try:
            return self._shutdown(timeout_s)
        finally:
            self._exclusive.release()

    def _shutdown(self, timeout_s: float) -> list[int]:
        if self._closed:
            return []
        self._closed = True
        for w in self._workers.values():
            if w.dead is None and w.identity is None and w.process is not None:
                w.process.kill()  # never said hello (e.g. a replacement still starting)
            elif w.dead is None and w.identity is None:
                self._stop_remote(w)
            elif w.launch_ref is not None and w.launch_ref in self._exits:
                continue  # its agent already said it is gone (stopped with the run's agents)
            elif w.dead is None and w.identity is not None:
                with contextlib.suppress(zmq.ZMQError, PoolError):
                    self._command(w.rank, "shutdown", {})
        deadline = time.monotonic() + timeout_s
        killed = []
        for w in self._workers.values():
            if w.process is None:
                continue
            try:
                w.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.process.kill()
                w.process.wait(5)
                killed.append(w.rank)
        self._close_starter()
        self._pool_socket.close()
        return killed

    def _stop_remote(self, w: Any) -> None:
        """Ask the launcher to stop remote warm rank `w`'s process, unless it is known ended."""
        ref = w.launch_ref
        if self._launcher is not None and ref is not None and ref not in self._exits:
            self._launcher.stop(ref)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _unusable(self, op: str) -> PoolFailure | None:
        if self._closed:
            raise PoolError(f"{op} on a pool that was shut down", "", "spawn a new pool")
        if self._abandoned is not None:
            return PoolFailure(
                op=op,
                reason="broken",
                rank=None,
                replica=None,
                detail=f"the wait for {self._abandoned} was abandoned (its caller stopped) "
                "while the workers were at it: their state is unknown; shut the pool down",
                broken_world=True,
            )
        if self._broken is not None:
            return PoolFailure(
                op=op,
                reason="broken",
                rank=self._broken.rank,
                replica=self._broken.replica,
                detail=f"an earlier failure left the Gloo world unusable: {self._broken}",
                broken_world=True,
            )
        for r in self.config.core_ranks:
            if self._workers[r].dead is not None:
                return PoolFailure(
                    op=op,
                    reason="dead",
                    rank=r,
                    replica=self.config.core_replica(r),
                    detail=str(self._workers[r].dead),
                    broken_world=True,
                )
        return None


def _fingerprint(wire: Any) -> dict[str, tuple[float, float]] | None:
    """A commit reply's fingerprint (name → [Σx, Σx²]) as tuples; None when none was asked."""
    if not isinstance(wire, dict):
        return None
    return {str(k): (float(v[0]), float(v[1])) for k, v in wire.items()}
