"""One optimizer step through the training_step machine, and the trainer that computes it.

    begin {step} → partition {groups, partition}   (claims the groups; commands `compute`)
        → the `Trainer` performs `compute`: the pool's fixed-batch step over the partition
        → delivered {replicas} → reduced → stepped {version}   (consumes the groups)
    → the revision is registered and published (every serving engine installs it)
    → published {revision}

`run_step` posts `begin` and `partition`; the loop hands `compute` to the `Trainer`, whose thread
steps the pool while the loop goes on serving agents, engines and rollout (the next step's groups
are generated during this one), and which posts what the pool reports. A Hybrid that dies during
the step — also inside the gradient all-reduce: the pool then re-forms its Gloo world without
it — fails its machine (epoch + 1, its GPU to the finalizer), the step fails (`fail`: the groups
go back, the optimizer did not step), and the step is tried again on the replicas still live,
with the same groups. A dead Core trainer ends the run with the reason: the Core holds the only
authoritative optimizer state.

Knows: the machine's events in order, the pool's step and its failures, the verify records.
Does not know: rollout (it is given the completed groups), the planner, or how the run starts
and ends.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from ehp_fsm.core.batch import partition_groups
from ehp_fsm.core.transition import Outcome, Rejected
from ehp_fsm.errors import EhpError
from ehp_fsm.rollout.publish import Publisher
from ehp_fsm.shell.loop import Door, Route, no_wake
from ehp_fsm.training.grpo import GroupBatch
from ehp_fsm.training.pool import PoolError, PoolFailure, StepResult, TrainerPool
from ehp_fsm.training.pool_protocol import as_partition
from ehp_fsm.training.verify import record_result, record_step

STEP: Final = "training_step"
ATTEMPTS: Final = 3
DEFAULT_STEP_TIMEOUT_S: Final = 300.0  # the `computing` deadline's default (`plan.py`)
#: how long a step broken by a Core rank on another machine waits for its agent's word about
#: that rank's end (an agent reports a child's exit within a turn of its loop: well under it)
AGENT_WORD_S: Final = 3.0


class StepError(EhpError):
    """A training step could not be completed (a Core trainer died, the machine refused)."""


#: What to do after a failed step: every step before it stands, saved as the run went.
RESUME_FIX: Final = (
    "go on from the run's last saved state with `ehp-fsm run PLAN --resume` (the steps after "
    "that state are trained again); see controller.log and trainers/ beside the log for the cause"
)


@dataclass(frozen=True)
class StepDone:
    """A step that stood: the pool's result, the groups it consumed, the Hybrids that failed
    and were retried without (each with why), and when the first attempt failed."""

    result: StepResult
    groups: tuple[str, ...]
    retried: tuple[str, ...] = ()
    first_failure_at: float | None = None  # time.monotonic() of the first failed attempt


@dataclass
class _InFlight:
    """A step the pool is computing on the trainer's thread. `lock` guards the hand-over at the
    commit: the step thread records the replicas that delivered (`computed`) and commits only
    while the orchestrator has not given the step up (`cancelled`) and its deadline is not
    close (`give_up_at`, monotonic), so the log's `delivered` always precedes a commit."""

    sid: str
    step: int
    give_up_at: float
    # the pool's stall of this process credited to the step (`TrainerPool.step_stalled_s`):
    # the loop puts the step's deadline off by its own measure of the same stall
    stalled: Callable[[], float] = lambda: 0.0
    future: Future[StepResult | PoolFailure] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    computed: tuple[str, ...] | None = None
    cancelled: bool = False
    delivered: bool = False

    def commit_ok(self, replicas: tuple[str, ...]) -> bool:
        """The step thread, once every delivery is in: may the pool commit?"""
        with self.lock:
            if self.cancelled or time.monotonic() - self.stalled() >= self.give_up_at:
                self.cancelled = True
                return False
            self.computed = replicas
            return True


class Trainer:
    """The loop's performer of `compute`: one fixed-batch step of the trainer pool, computed on
    a thread of its own so the loop goes on serving agents, engines and rollout meanwhile.

    `perform` hands the step to the thread; `poll` (the loop's turn) posts `delivered` once
    every delivery is in, and `reduced` + `stepped` (or `fail`) once the pool answered. When the
    orchestrator gives the step up first (its `computing` deadline, a `fail`), the pool is told
    not to commit; a pool that stepped anyway (the loop took no turn for the whole margin)
    stops the run, since the optimizer would then hold a step the log does not."""

    routes: frozenset[Route] = frozenset({(STEP, "compute")})

    def __init__(
        self,
        door: Door,
        pool: TrainerPool,
        *,
        batch_of: Callable[[Sequence[str]], GroupBatch],
        records: Path | None = None,
        timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
        wake: Callable[[], None] | None = None,
    ) -> None:
        self.door = door
        self.pool = pool
        # called by the step thread once the step ended (`Loop.wake`): its end is posted in
        # this loop turn, not when the turn's wait runs out
        self._wake = wake or no_wake
        self.batch_of = batch_of
        self.records = records  # --verify: every step's partition and batch are written here
        self.timeout_s = timeout_s  # each phase of a step (compute, commit) in the pool
        self.results: dict[str, StepResult | PoolFailure] = {}
        self.step_of: dict[str, int] = {}  # step instance -> its step number (`begin`'s)
        self._flight: _InFlight | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="ehp-train")

    def busy(self) -> bool:
        """Whether a step is in flight."""
        return self._flight is not None

    def perform(self, command: Any) -> None:
        sid = command.instance
        inst = self.door.world.get(STEP, sid)
        step = self.step_of.pop(sid, None)
        if inst is None or step is None:
            self.door.event(STEP, sid, "fail", reason="no step number was given to the trainer")
            return
        if self._flight is not None:
            self.door.event(STEP, sid, "fail", reason=f"step {self._flight.sid} is in flight")
            return
        epoch = int(command.args["epoch"])
        groups = [str(g) for g in inst.get("groups")]
        batch = self.batch_of(groups)
        part = as_partition(
            {r: [int(g[1:]) for g in gs] for r, gs in command.args["partition"].items()},
            step=step,
            epoch=epoch,
            group_size=batch.group_size,
        )
        if self.records is not None:
            record_step(
                self.records,
                step=step,
                epoch=epoch,
                partition={r: part.groups_of(r) for r in part.replicas},
                batch=batch,
                ranks=_hybrid_ranks(self.pool, part.replicas),
            )
        deadline = inst.get("deadline")
        left = self.timeout_s if deadline is None else float(deadline) - self.door.now()
        margin = min(30.0, max(1.0, 0.1 * left))
        flight = _InFlight(
            sid=sid,
            step=step,
            give_up_at=time.monotonic() + left - margin,
            stalled=lambda: self.pool.step_stalled_s,
        )
        flight.future = self._thread.submit(
            self.pool.step,
            step=step,
            epoch=epoch,
            partition=part,
            batch=batch,
            revision=step + 1,
            fingerprint=self.records is not None,
            timeout_s=self.timeout_s,
            on_computed=flight.commit_ok,
        )
        flight.future.add_done_callback(lambda _: self._wake())
        self._flight = flight

    def poll(self, timeout_s: float) -> None:
        """The loop's turn: post what the step thread has reached (see the class docstring)."""
        f = self._flight
        if f is None or f.future is None:
            return
        inst = self.door.world.get(STEP, f.sid)
        with f.lock:
            computed = f.computed
            if computed is None and (inst is None or inst.state != "computing"):
                f.cancelled = True  # given up by the orchestrator: the pool must not commit
        if computed is not None and not f.delivered:
            f.delivered = True
            self.door.event(STEP, f.sid, "delivered", replicas=list(computed))
        if not f.future.done():
            return
        self._flight = None
        self._finish(f, f.future.result())  # a PoolError raised by the step is raised here

    def _finish(self, f: _InFlight, result: StepResult | PoolFailure) -> None:
        self.results[f.sid] = result
        inst = self.door.world.get(STEP, f.sid)
        if isinstance(result, PoolFailure):
            if inst is not None and inst.state not in ("done", "failed"):
                self.door.event(STEP, f.sid, "fail", reason=str(result))
            return
        if inst is None or inst.state != "reducing":
            # (a step `done` is forgotten by the world: its state is known, its data is not)
            why = "gone" if inst is None else "done" if inst.state == "done" else inst.get("reason")
            raise StepError(
                f"step {f.step}: the trainer pool stepped after the orchestrator gave the step "
                f"up (the step is {None if inst is None else inst.state!r}, {why}): the "
                "optimizer holds a step the log does not",
                "the run's loop took no turn for the step's whole deadline margin (a reward or "
                "an engine call that blocked it?)",
                RESUME_FIX,
            )
        if self.records is not None and result.fingerprint is not None:
            record_result(self.records, step=f.step, weights=result.fingerprint)
        self.door.event(STEP, f.sid, "reduced")
        self.door.event(STEP, f.sid, "stepped", version=result.version)

    def close(self) -> None:
        """Stop taking steps (one in flight ends with the pool, which the run shuts down)."""
        self._thread.shutdown(wait=False, cancel_futures=True)


def _dead_core(
    pool: TrainerPool, failure: PoolFailure, wait: Callable[[Callable[[], bool]], None]
) -> str:
    """The Core rank whose death broke the world when `failure` names another rank (or none),
    as the start of the step's error; "" when none is known. A Core rank on another machine is
    known dead only from its agent's word, which the loop hears: the loop is turned up to
    `AGENT_WORD_S` for it (a rank-0 Gloo error can come first — a peer reset — while the
    loop took no turn since: the Core's state save after a step runs on the loop's thread)."""
    if failure.reason == "dead" or not failure.broken_world:
        return ""  # it names the dead rank itself
    dead = pool.dead_core_rank()
    if dead is None and pool.config.remote_core:
        end = time.monotonic() + AGENT_WORD_S
        wait(lambda: pool.dead_core_rank() is not None or time.monotonic() > end)
        dead = pool.dead_core_rank()
    if dead is None or dead[0] == failure.rank:
        return ""
    return f"Core rank {dead[0]} ({pool.config.core_replica(dead[0])}) died ({dead[1]}); "


def _hybrid_ranks(pool: TrainerPool, replicas: Sequence[str]) -> dict[str, int]:
    """The warm rank of each Hybrid of a step (what `--verify`'s pool replay puts it on)."""
    out = {}
    for r in replicas:
        if not r.startswith("core:"):
            with contextlib.suppress(PoolError):  # not bound: the step fails on it anyway
                out[r] = pool.rank_of(r)
    return out


def run_step(
    door: Door,
    trainer: Trainer,
    publisher: Publisher,
    *,
    step: int,
    groups: Sequence[str],
    group_size: int,
    say: Callable[[str], None],
    wait: Callable[[Callable[[], bool]], None],
) -> StepDone:
    """Step `step` over the completed `groups` (tried up to three times, see the module
    docstring); the new revision is published before it returns. `wait(done)` turns the loop
    until `done()` holds: the trainer's thread computes while the loop serves."""
    retried: list[str] = []
    failed_at: float | None = None
    for attempt in range(ATTEMPTS):
        sid = f"step-{step}" if attempt == 0 else f"step-{step}.{attempt}"
        result = _attempt(door, trainer, sid, step, groups, group_size, wait)
        if isinstance(result, StepResult):
            try:
                _publish(door, trainer, publisher, sid, step, result, say)
            except Exception as exc:
                _unpublished(door, sid, step, exc)
                raise
            publisher.retire_unreferenced()  # a file that will not go: pub.stats.retire_errors
            return StepDone(
                result=result,
                groups=tuple(groups),
                retried=tuple(retried),
                first_failure_at=failed_at,
            )
        replica = result.replica or ""
        if result.reason == "cancelled":
            raise StepError(
                f"training step {step} was given up: its computation did not end within "
                f"[deadlines.training_step] computing ({trainer.timeout_s:g} s)",
                "nothing was reduced or stepped; its groups went back",
                "raise [deadlines.training_step] computing for this model and batch, then "
                "`ehp-fsm run PLAN --resume`",
            )
        if result.broken_world or not replica.startswith("hybrid:"):
            raise StepError(
                f"training step {step} failed: {_dead_core(trainer.pool, result, wait)}{result}",
                "the trainer pool cannot go on without that rank (a Core rank holds the "
                "authoritative optimizer state; a TP world is not re-formed), so the run stops "
                "cleanly",
                RESUME_FIX,
            )
        hid = replica.split(":", 1)[1]
        failed_at = failed_at or time.monotonic()
        reform = trainer.pool.reforms[-1] if trainer.pool.reforms else None
        inside = reform is not None and reform.dead == (result.rank,)
        note = f"hybrid {hid} died" + (
            f" inside the {reform.op} collective (world re-formed in "
            f"{reform.seconds * 1000:.0f} ms)"
            if inside and reform is not None
            else f" ({result.reason})"
        )
        retried.append(note)
        say(
            f"step {step}: Hybrid {hid} failed ({result.reason}: {result.detail}); "
            "retrying the step on the Core"
        )
        door.event("hybrid_replica", hid, "fail", reason=str(result))
        with contextlib.suppress(PoolError):
            trainer.pool.deactivate(replica)
    raise StepError(
        f"training step {step} failed {ATTEMPTS} times",
        "a Hybrid failed in every attempt (each failure is named above)",
        RESUME_FIX,
    )


def _attempt(
    door: Door,
    trainer: Trainer,
    sid: str,
    step: int,
    groups: Sequence[str],
    group_size: int,
    wait: Callable[[Callable[[], bool]], None],
) -> StepResult | PoolFailure:
    live = trainer.pool.live_replicas()
    epoch = int(door.world.globals["epoch"])
    part = partition_groups(
        groups=[int(g[1:]) for g in groups],
        live=dict.fromkeys(live, 1),
        group_size=group_size,
        step=step,
        epoch=epoch,
    )
    _must(door.event(STEP, sid, "begin", step=step))
    trainer.step_of[sid] = step
    partition = {r: [f"g{x}" for x in gs] for r, gs in part.assignments}
    _must(door.event(STEP, sid, "partition", groups=list(groups), partition=partition))
    # the loop handed `compute` to the Trainer before `partition` returned; its thread steps
    if sid not in trainer.results and trainer.busy():
        wait(lambda: sid in trainer.results)
    result = trainer.results.pop(sid, None)
    if result is None:
        raise StepError(f"step {step}: no trainer performed its compute")
    return result


def _publish(
    door: Door,
    trainer: Trainer,
    publisher: Publisher,
    sid: str,
    step: int,
    result: StepResult,
    say: Callable[[str], None],
) -> None:
    """The end of a step that stood (the optimizer stepped): the Hybrids lost after the
    reduction leave, and the new revision is saved, published and logged (`published`)."""
    for replica in result.lost:  # died after the reduction: the step stands
        hid = replica.split(":", 1)[1]
        why = result.lost_why.get(replica)
        say(
            f"step {step}: Hybrid {hid} died after the gradient reduction "
            f"{'' if why is None else f'({why}) '}"
            "(its gradient counted); the run goes on without it"
        )
        door.event("hybrid_replica", hid, "fail", reason="died after reduction")
        with contextlib.suppress(PoolError):
            trainer.pool.deactivate(replica)
    if result.publish_error is not None:  # the step stands; its revision was not saved
        why = result.publish_error
        say(f"step {step}: revision {step + 1} was not saved ({why}); again")
        _save_again(trainer.pool, step, result.publish_error)
    publisher.register_saved(step + 1)
    publisher.publish(step + 1)
    _must(door.event(STEP, sid, "published", revision=step + 1))


def _unpublished(door: Door, sid: str, step: int, exc: Exception) -> None:
    """A step whose optimizer stepped but whose revision was not published (it could not be
    saved, the orchestrator refused it) ends `failed`, so the run stops with no step open.
    Its groups stay consumed — the Core trained on them, and the state the run saves as it
    stops (`Job.save_after_error`) holds that step — and the Core's version stays the step's;
    the receipt's last step is the one before it, the last whose revision was published."""
    inst = door.world.get(STEP, sid)
    if inst is not None and inst.state == "publishing":
        what = exc.what if isinstance(exc, EhpError) else f"{type(exc).__name__}: {exc}"
        door.event(STEP, sid, "fail", reason=f"revision {step + 1} was not published: {what}")


def _save_again(pool: TrainerPool, step: int, why: str) -> None:
    """Save the Core's weights as the step's revision once more (the first try, inside the
    step, failed after the optimizer stepped); stop the run if that fails too: the engines
    cannot be given the new weights."""
    again = pool.publish(step + 1, step=step)
    if isinstance(again, PoolFailure):
        # the same cause twice was the same long message twice in one line
        second = "failed the same way" if again.detail == why else f"{again}"
        raise StepError(
            f"revision {step + 1} could not be saved after step {step}",
            f"{why}; the second try: {second}",
            # not only space: a model folder moved mid-run fails here too (its config is copied)
            "fix the cause named above (the revision store's space or permissions, or the model "
            "directory), then go on with `ehp-fsm run PLAN --resume` (the steps after the last "
            "saved state are trained again)",
        )


def _must(out: Outcome) -> Outcome:
    if isinstance(out, Rejected):
        raise StepError(f"the orchestrator refused a step of the job: {out.reason}")
    return out
