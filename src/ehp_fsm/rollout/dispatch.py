"""The dispatcher: keeps GRPO groups flowing through the request machine to serving engines.

What it knows: how to turn the request machine's commands into SGLang calls — `generate` becomes
one batched `/generate` of the group's n samples (the same prompt n times, one `sampling_seed`
and one `rid` per sample, as SGLang's batch input takes them), `abort_request` becomes
`/abort_request` for the group's rid prefix, `pause_generation` becomes `/pause_generation`;
how to score the returned completions with the task; and how to report what happened back to the
machines as events: `complete` tagged with the revision the engine reports in
`meta_info.weight_version`, `abort` (requeue) on an HTTP failure or an aborted sample, the
engine's `fail` when its process is gone or does not answer, and `expire` for completed groups
older than `current − max_staleness`.

An engine that does not answer at all is judged here: nothing else would while it stays
`serving` (the agent watches process exit, and a frozen process has not exited; the install
deadline of `updating` catches it only once a new revision is published). A `/generate` that
timed out with no answer — as opposed to an HTTP error, or a refused connection — takes the
engine out of routing (no state of its machine: it is still serving as far as anyone knows) and
starts one `/health` probe bounded by `probe_timeout_s`. A probe that gets an answer (200 or
503: the process runs) puts the engine back, after the usual back-off; one that gets none fires
the engine's `fail`, which requeues every group it still holds (those already requeued after
their own time-out are not dispatched there and are not requeued again). Without this, the
frozen engine's groups were requeued after a 1 s back-off and sent straight back to it, each
time for another `generate_timeout_s`.

What it does not know: when engines start or stop, revisions (see `publish`), or training. It
never claims, consumes or hands back a group: those are cascades of a training step's own
transitions (`partition` claims, `stepped` consumes, `fail` hands back — guard
`step_holds_group`), fired by whoever drives the `training_step` machine. The dispatcher only
offers completed groups (`completed_groups`, `results`) and forgets them once consumed. Every
state change goes through `Engine.handle`, so each group's journey (enqueue → dispatch(engine,
revision) → complete | abort → … → claimed → consumed by its step) is in the transition log; a
refused event is logged by the engine and the dispatcher reacts (e.g. a completion that arrives
after its engine was drained is refused because the group was already requeued, and is dropped).

Threads: `Engine.handle` is only ever called from the caller's thread (every public method).
Each engine's `/generate` calls run on a thread pool of its own, as many threads as it may hold
groups (`max_inflight_per_engine`), and hand their results back through a queue that `pump()`
drains: a group dispatched never waits for a thread, and an engine that does not answer (a
frozen process: each of its calls waits out `generate_timeout_s`) holds only its own threads.
One pool shared by every engine (8 threads) let a frozen engine's calls hold the threads the
serving engines' groups waited for. An answer's samples are scored on a thread of the
dispatcher's own (`_submit_score`; the reward itself runs on the reward's thread,
`data.rewards`), one group after another, and reach `pump` through the same queue: the group
stays `dispatched` until it is scored, and the loop goes on meanwhile (scored on the loop's
thread, a slow reward held the whole control plane). Commands of events it fires that are
not its own (`stop_process`, `confirm_gpu_free`, `install`, …) are collected for the caller:
`take_commands()`.

A run loop drives it like this::

    d = Dispatcher(engine, task, config=DispatchConfig(group_size=8))
    d.attach("e0", SGLangClient(url), alive=handle.is_alive)   # once the engine is serving
    while training:
        d.fill(2 * G)                       # keep enough groups queued/in flight
        ids = d.wait_completed(G, timeout_s=60)   # G fresh completed groups
        samples = d.results(ids)
        # the training_step machine claims and consumes them (not the dispatcher):
        #   begin {step} → partition {groups: ids, partition} → … → stepped → published
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import math
import operator
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from queue import SimpleQueue
from typing import Any, Final, Protocol

import msgspec

from ehp_fsm.core.transition import Accepted, Command, Outcome, Rejected
from ehp_fsm.data.rewards import RewardError
from ehp_fsm.rollout.client import GenerateResult, SGLangClient
from ehp_fsm.rollout.errors import EngineError, EngineUnreachable
from ehp_fsm.shell.loop import ANY, Door, Route, no_wake
from ehp_fsm.training.task import GroupSamples, Prompted

REQUEST = "request"
ROLLOUT_ENGINE = "rollout_engine"
OWN_COMMANDS = frozenset({"generate", "abort_request", "pause_generation"})
_MASK63 = (1 << 63) - 1
_REDRAW_STRIDE = 0x9E3779B97F4A7C15  # far from every base seed of the run's groups
_INTEGER = re.compile(r"-?[0-9]+")  # a weight version (ASCII digits: `int()` takes more)
_UP_STATES = frozenset({"serving", "updating", "installing"})


class RolloutTask(Protocol):
    """What the dispatcher asks of a task: prompts, sampling params, scoring."""

    def question(self, index: int) -> Prompted: ...

    def sampling_params(self, seed: int) -> dict[str, object]: ...

    def score_group(
        self,
        group_index: int,
        completions: Sequence[Sequence[int]],
        logprobs: Sequence[Sequence[float]] | None = None,
        *,
        revision: int = 0,
    ) -> GroupSamples: ...


@dataclass(frozen=True, kw_only=True)
class DispatchConfig:
    """How groups are sent. `group_size` is n (samples per prompt); an engine holds at most
    `max_inflight_per_engine` groups at once (so a drain has a bounded amount to requeue), and
    that many threads of its own call its `/generate`; `generate_timeout_s` bounds one group's
    `/generate`; after an HTTP failure that is not an engine death the engine gets no new group
    for `unreachable_backoff_s`; after a `/generate` with no answer at all, none until a
    `/health` probe answers within `probe_timeout_s` (no answer: the engine has failed). The
    embedded engine's probe asks for no work; SGLang's `/health` is its `/health_generate`
    (0.5.3 `http_server.py:384-453`): a one-token request, answered 200 once the engine has
    sent any output since the probe began, looked at after 1 s and then every second (503
    after 20 s), so a bound under ~2 s fails a healthy SGLang engine."""

    group_size: int
    max_inflight_per_engine: int = 4
    generate_timeout_s: float = 60.0
    unreachable_backoff_s: float = 1.0
    probe_timeout_s: float = 5.0
    sampling_seed: int = 0
    #: every sample of an answer must carry its tokens' log-probs (`output_token_logprobs`,
    #: asked with `return_logprob`): the objective's π_old. An answer without them is requeued
    #: (one group without made the whole batch on-policy: every stale group lost its ratio).
    #: False only where nothing is trained from the answers (the simulation's engines).
    behaviour_logprobs: bool = True

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError(
                f"group_size must be ≥ 1 (n samples per prompt), got {self.group_size}"
            )
        if self.max_inflight_per_engine < 1:
            raise ValueError(
                f"max_inflight_per_engine must be ≥ 1, got {self.max_inflight_per_engine}"
            )
        if self.generate_timeout_s <= 0 or self.probe_timeout_s <= 0:
            raise ValueError(
                "generate_timeout_s and probe_timeout_s must be > 0 (a call without a deadline "
                f"can hang forever), got {self.generate_timeout_s} and {self.probe_timeout_s}"
            )
        if self.unreachable_backoff_s < 0:
            raise ValueError(f"unreachable_backoff_s must be ≥ 0, got {self.unreachable_backoff_s}")


@dataclass(frozen=True, kw_only=True)
class CompletedGroup:
    """One group as the engine returned it: request id, the engine and revision that served it,
    and its scored samples (`samples.completions`, `samples.scores`)."""

    group_id: str
    engine: str
    revision: int
    samples: GroupSamples


@dataclass(kw_only=True)
class DispatchStats:
    """Counters since the dispatcher started (read them; the dispatcher writes them)."""

    enqueued: int = 0
    dispatched: int = 0
    completed: int = 0
    aborted: int = 0  # requeued by the dispatcher after an HTTP failure or aborted samples
    expired: int = 0
    consumed: int = 0
    engine_failures: int = 0  # engines the dispatcher reported dead or not answering (`fail`)
    probes: int = 0  # `/health` probes after a `/generate` that got no answer
    refused_completions: int = 0  # `complete` refused by the machine (group already requeued)
    superseded_results: int = 0  # results of an older dispatch of a group; dropped


class _Inflight(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A group's dispatch the dispatcher awaits (one per dispatch: a struct built in C)."""

    attempt: int
    engine: str
    revision: int


class _Result(msgspec.Struct, frozen=True, kw_only=True):
    """A group's `/generate` answer or failure, as the worker hands it to `pump` (one per
    dispatch: a struct built in C)."""

    group_id: str
    attempt: int
    engine: str
    outputs: tuple[GenerateResult, ...] = ()
    error: str | None = None
    unreachable: bool = False
    timed_out: bool = False  # no answer at all within `generate_timeout_s`


@dataclass(frozen=True, slots=True, kw_only=True)
class _Scored:
    """A group's answer scored by the dispatcher's scoring thread (`Dispatcher._submit_score`): its
    samples, or the exception the scoring raised, handed to `pump` through the same queue."""

    result: _Result
    revision: int
    was_inflight: bool
    index: int  # the group's prompt, as the task numbers it
    outputs: list[list[int]]  # each sample's token ids
    logprobs: list[list[float]] | None  # each token's behaviour log-prob, when every one came
    samples: GroupSamples | None = None
    error: Exception | None = None


#: The first wait before a group an engine answered with a failure is sent again, and the
#: longest (the wait doubles after each such answer: `Dispatcher._refused`).
REFUSED_BACKOFF_S = 0.01
REFUSED_BACKOFF_MAX_S = 1.0


@dataclass(kw_only=True)
class _Attached:
    client: SGLangClient
    alive: Callable[[], bool] | None
    cool_until: float = 0.0
    probing: bool = False  # out of routing until its `/health` probe answers


class Occupancy:
    """How much generating the engines did, in GPU-seconds at full occupancy: each group in
    flight counts `1 / slots` of its engine (`max_inflight_per_engine`), for as many GPUs as
    the engine's TP — an engine with every slot taken for a second is busy one second.

    Why: the planner predicts a step from the time the serving engines take to generate one
    step's groups (`core.planner_predict.RolloutPace`). The time training waited for its
    groups is not that: with rollout overlapping training, a step's groups were mostly made
    during the previous step, and while rollout keeps up the wait is near 0 — every borrow
    then looked free, and one that made rollout the bottleneck was held. Counting an engine
    busy while any group of it is in flight overstates rollout where a step waits on its
    longest responses rather than on throughput (one long response holds a slot, not the
    engine): that was tried in `ehp-fsm simulate` and stopped a borrow that paid.
    """

    __slots__ = ("_done", "_open", "_slots")

    def __init__(self, slots: int = 1) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self._slots = slots
        # slot-GPU-seconds of each engine's closed intervals, summed exactly (`math.fsum`): the
        # dispatcher may end several engines' groups in an order no seed fixes (`simulate`
        # walks a set), and the total must not depend on it
        self._done: dict[str, float] = {}
        self._open: dict[str, list[float]] = {}  # engine -> [groups in flight, since, tp]

    def _settle(self, engine: str, entry: list[float], now: float) -> None:
        add = entry[0] * max(0.0, now - entry[1]) * entry[2]
        if add:
            self._done[engine] = self._done.get(engine, 0.0) + add
        entry[1] = now

    def begin(self, engine: str, tp: int, now: float) -> None:
        entry = self._open.get(engine)
        if entry is None:
            self._open[engine] = [1, now, tp]
            return
        self._settle(engine, entry, now)
        entry[0] += 1

    def end(self, engine: str, now: float) -> None:
        entry = self._open.get(engine)
        if entry is None:
            return
        self._settle(engine, entry, now)
        entry[0] -= 1
        if entry[0] <= 0:
            del self._open[engine]

    def gpu_seconds(self, now: float) -> float:
        """Busy GPU-seconds so far, the groups in flight now counted up to `now`."""
        live = [e[0] * max(0.0, now - e[1]) * e[2] for e in self._open.values()]
        return math.fsum([*self._done.values(), *live]) / self._slots


@dataclass(kw_only=True)
class _Group:
    index: int
    attempts: int = 0
    # attempts whose samples could not be scored: each one after it samples with other seeds
    # (the same seeds at the same weights would give the same unscorable samples for ever)
    redraws: int = 0
    inflight: _Inflight | None = None
    done: CompletedGroup | None = None
    completed_seq: int = 0
    # answers that were failures (an engine refusing the request: HTTP 400 for a prompt it
    # cannot take), and when it may be sent again (`_refused`)
    refused: int = 0
    not_before: float = 0.0


class Dispatcher:
    """See the module docstring. Every public method must be called from one thread."""

    def __init__(
        self,
        door: Door,
        task: RolloutTask,
        *,
        config: DispatchConfig,
        first_index: int = 0,
        id_prefix: str = "g",
        wake: Callable[[], None] | None = None,
    ) -> None:
        self.door = door
        # called by a worker thread once its result is queued (`Loop.wake`): a finished group
        # is reported (and its engine given the next) in this loop turn, not when the turn's
        # wait runs out
        self._wake = wake or no_wake
        self.routes: frozenset[Route] = frozenset((ANY, k) for k in OWN_COMMANDS)
        self.task = task
        self.config = config
        self.stats = DispatchStats()
        #: the engines' busy GPU-seconds (`Occupancy`), read with `stats.completed` to pace
        #: rollout for the planner
        self.occupancy = Occupancy(config.max_inflight_per_engine)
        #: the latest failed `/generate` or unusable answer ("engine EID: why"), which a rollout
        #: that never completes names (an engine refusing every request, HTTP 400, was retried
        #: until `[deadlines.run] rollout` ended the run with no cause)
        self.last_failure = ""
        self._prefix = id_prefix
        self._next_index = first_index
        self._engines: dict[str, _Attached] = {}
        self._groups: dict[str, _Group] = {}  # every group not yet consumed
        self._results: queue.Queue[_Result | _Scored] = queue.Queue()
        # scores each answer's samples (`_submit_score`), so the loop goes on while the reward
        # runs: a daemon thread of its own, made at the first answer (a pool's thread is not a
        # daemon, and a reward still scoring at the run's end held the exit: "not waiting for
        # 1 thread still running (ehp-score_0)"); `close` leaves what is queued unscored
        self._scores: SimpleQueue[Callable[[], None] | None] = SimpleQueue()
        self._scorer: threading.Thread | None = None
        self._closed = False
        # engine -> its `/generate` threads (made at its first group, shut down at detach)
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._control = ThreadPoolExecutor(2, thread_name_prefix="ehp-abort")
        # `/health` probes of engines whose `/generate` got no answer, and their verdicts:
        # (engine, client probed, None when it answered, else why not); taken on the loop's
        # thread alone, twice a round: a `SimpleQueue` asked whether it is empty, not a
        # `queue.Queue`'s lock and a raised `queue.Empty` each time
        self._probe_pool = ThreadPoolExecutor(2, thread_name_prefix="ehp-probe")
        self._probed: SimpleQueue[tuple[str, SGLangClient, str | None]] = SimpleQueue()

    # -- engines ---------------------------------------------------------------------------
    def attach(
        self, engine_id: str, client: SGLangClient, *, alive: Callable[[], bool] | None = None
    ) -> None:
        """Route to `engine_id` through `client` whenever its machine says `serving`.
        `alive()` (e.g. `EngineHandle.is_alive`) tells a dead process from a slow one."""
        self._engines[engine_id] = _Attached(client=client, alive=alive)

    def detach(self, engine_id: str) -> None:
        """Stop routing to `engine_id` (after it stopped). Its in-flight results are still
        reported when they arrive (and refused if the group was requeued meanwhile)."""
        self._engines.pop(engine_id, None)
        pool = self._pools.pop(engine_id, None)
        if pool is not None:  # calls still waiting on it end on their own timeout
            pool.shutdown(wait=False, cancel_futures=True)

    def drain_engine(self, engine_id: str) -> list[Outcome]:
        """Borrow path: `drain` (its groups are requeued, the engine is paused with
        mode=retract and their requests aborted), then `drained`. The `stop_process` command
        goes to its performer (the agent link), whose agent reports `exited`."""
        first = self._fire(ROLLOUT_ENGINE, engine_id, "drain")
        if isinstance(first, Rejected):
            return [first]
        return [first, self._fire(ROLLOUT_ENGINE, engine_id, "drained")]

    def engine_failed(self, engine_id: str, reason: str) -> Outcome:
        """Report an engine's death (`fail`): its groups are requeued at once."""
        out = self._fire(ROLLOUT_ENGINE, engine_id, "fail", reason=reason)
        if isinstance(out, Accepted):
            self.stats.engine_failures += 1
        return out

    # -- groups ----------------------------------------------------------------------------
    def enqueue(self, count: int) -> list[str]:
        """Create `count` new groups (the next questions of the task); returns their ids."""
        ids = []
        for _ in range(count):
            index = self._next_index
            self._next_index += 1
            gid = f"{self._prefix}{index}"
            q = self.task.question(index)
            out = self._fire(REQUEST, gid, "enqueue", prompt=q.text, index=index)
            if isinstance(out, Accepted):
                self._groups[gid] = _Group(index=index)
                self.stats.enqueued += 1
                ids.append(gid)
        return ids

    def fill(self, target: int) -> list[str]:
        """Enqueue until `target` groups are queued, dispatched or completed (not claimed, and
        not consumed: a step's groups are consumed before the next `pump` forgets them, and a
        fill right after the step — no planner turn in between — must not count them)."""
        have = sum(1 for gid in self._groups if self._state(gid) not in ("claimed", "consumed"))
        return self.enqueue(max(0, target - have))

    def pump(self, timeout_s: float = 0.0) -> int:
        """One round: dispatch queued groups, report finished HTTP calls (waiting up to
        `timeout_s` for the first), expire stale groups, forget consumed ones, dispatch again.
        Returns the number of results reported (answers and scored answers)."""
        self._reconcile()
        self._judge_probes()
        self._dispatch_queued()
        n = 0
        try:
            first = self._results.get(timeout=timeout_s) if timeout_s > 0 else None
        except queue.Empty:
            first = None
        if first is not None:
            self._report(first)
            n += 1
        while True:
            try:
                result = self._results.get_nowait()
            except queue.Empty:
                break
            self._report(result)
            n += 1
        self._judge_probes()
        self._expire_stale()
        self._forget_consumed()
        self._dispatch_queued()
        return n

    def completed_groups(self, k: int | None = None) -> list[str]:
        """Ids of completed groups fresh enough to train on, oldest completion first (≤ k)."""
        floor = self._floor()
        ids = [
            gid
            for gid, g in self._groups.items()
            if g.done is not None and self._state(gid) == "completed" and g.done.revision >= floor
        ]
        ids.sort(key=lambda gid: self._groups[gid].completed_seq)
        return ids if k is None else ids[:k]

    def wait_completed(self, k: int, *, timeout_s: float) -> list[str]:
        """Pump until `k` fresh completed groups exist or `timeout_s` passes; returns ≤ k ids."""
        deadline = time.monotonic() + timeout_s
        while True:
            ids = self.completed_groups(k)
            left = deadline - time.monotonic()
            if len(ids) >= k or left <= 0:
                return ids
            self.pump(timeout_s=min(left, 0.05))

    def results(self, group_ids: Iterable[str]) -> list[CompletedGroup]:
        """The scored samples of completed (or claimed) groups, in the given order."""
        out = []
        for gid in group_ids:
            g = self._groups.get(gid)
            if g is None or g.done is None:
                raise KeyError(f"group {gid} has no completed result (state {self._state(gid)})")
            out.append(g.done)
        return out

    def pace(self) -> tuple[float, int]:
        """The engines' busy GPU-seconds so far (`Occupancy`) and the groups they made that
        could be trained: completed and not expired (a group that went stale before a step
        took it was generated again, and both generations were busy time)."""
        done = self.stats.completed - self.stats.expired
        return self.occupancy.gpu_seconds(self.door.now()), done

    def inflight(self, engine_id: str | None = None) -> list[str]:
        """Groups the machine says are dispatched (to `engine_id`, or to any engine)."""
        return [
            r.id
            for r in self.door.world.of(REQUEST).values()
            if r.state == "dispatched" and (engine_id is None or r.get("engine") == engine_id)
        ]

    # -- commands --------------------------------------------------------------------------
    def perform(self, command: Command) -> None:
        """Perform a `generate`, `abort_request` or `pause_generation` (the loop's routes)."""
        if command.kind == "generate":
            self._start_generate(command)
        elif command.kind == "abort_request":
            self._abort_http(command.instance, str(command.args.get("engine")))
        elif command.kind == "pause_generation":
            self._pause(command.instance, str(command.args.get("mode", "retract")))

    def poll(self, timeout_s: float) -> None:
        """The loop's turn: `pump`."""
        self.pump(timeout_s)

    def close(self) -> None:
        """Stop the worker pools (HTTP calls in flight finish or time out on their own)."""
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        self._pools.clear()
        self._control.shutdown(wait=False, cancel_futures=True)
        self._probe_pool.shutdown(wait=False, cancel_futures=True)
        self._closed = True
        self._scores.put(None)  # (a score running now ends on its own; nothing after it runs)

    # -- internals -------------------------------------------------------------------------
    def _fire(self, machine: str, instance: str, name: str, **payload: Any) -> Outcome:
        return self.door.event(machine, instance, name, **payload)

    def _state(self, gid: str) -> str | None:
        inst = self.door.world.get(REQUEST, gid)
        return None if inst is None else str(inst.state)

    def _floor(self) -> int:
        cfg = self.door.world.config
        return int(self.door.world.globals.get("revision", 0)) - int(cfg.get("max_staleness", 0))

    def _reconcile(self) -> None:
        """Forget in-flight bookkeeping for groups the machines requeued behind our back (a
        drain, a failure or a deadline fired by someone else)."""
        for gid, g in self._groups.items():
            if g.inflight is None:
                continue
            inst = self.door.world.get(REQUEST, gid)
            if (
                inst is None
                or inst.state != "dispatched"
                or inst.get("engine") != g.inflight.engine
            ):
                self._clear_inflight(g)

    def _dispatch_queued(self) -> None:
        """Each queued group, oldest first, to the least-loaded serving engine below the cap
        (ties by engine id); an engine the machine refuses is passed over this round."""
        now = self.door.now()
        queued = [gid for gid in self._queued_groups() if self._groups[gid].not_before <= now]
        if not queued:
            return
        serving = {
            eid: a
            for eid, a in self._engines.items()
            if a.cool_until <= now and not a.probing and self._engine_state(eid) == "serving"
        }
        if not serving:
            return
        cap = self.config.max_inflight_per_engine
        open_ = [(n, eid) for eid, n in self._load_of(serving).items() if n < cap]
        heapq.heapify(open_)  # the least (load, id) first: one pop per group, not a scan
        for gid in queued:
            if not open_:
                return
            n, eid = heapq.heappop(open_)
            out = self._fire(REQUEST, gid, "dispatch", engine=eid)
            if isinstance(out, Accepted):
                self.stats.dispatched += 1
                if n + 1 < cap:
                    heapq.heappush(open_, (n + 1, eid))
            # refused: the machine refuses this engine now; the others are tried

    def _queued_groups(self) -> list[str]:
        """Queued groups, oldest first (a scan of the open groups; `ehp-fsm simulate` keeps
        them indexed)."""
        queued = [gid for gid in self._groups if self._state(gid) == "queued"]
        queued.sort(key=lambda gid: self._groups[gid].index)
        return queued

    def _load_of(self, engines: Iterable[str]) -> dict[str, int]:
        """Groups the machines say are dispatched to each of `engines` (a scan of the world's
        requests; `ehp-fsm simulate` keeps them indexed)."""
        load = dict.fromkeys(engines, 0)
        for r in self.door.world.of(REQUEST).values():
            if r.state == "dispatched" and r.get("engine") in load:
                load[r.get("engine")] += 1
        return load

    def _engine_state(self, eid: str) -> str | None:
        inst = self.door.world.get(ROLLOUT_ENGINE, eid)
        return None if inst is None else str(inst.state)

    def _start_generate(self, cmd: Command) -> None:
        gid, eid = cmd.instance, str(cmd.args.get("engine"))
        g = self._groups.get(gid)
        attached = self._engines.get(eid)
        if g is None or attached is None:  # dispatched by someone else to an unknown engine
            self._fire(REQUEST, gid, "abort", reason=f"no client attached for engine {eid}")
            return
        g.attempts += 1
        self._clear_inflight(g)  # (requeued and sent again within one round)
        g.inflight = _Inflight(attempt=g.attempts, engine=eid, revision=int(cmd.args["revision"]))
        inst = self.door.world.get(ROLLOUT_ENGINE, eid)
        tp = int(inst.get("tp") or 1) if inst is not None else 1
        self.occupancy.begin(eid, tp, self.door.now())
        g.done = None
        self._submit_generate(gid, g.attempts, eid, attached.client, g.index)

    def _clear_inflight(self, g: _Group) -> None:
        """The dispatcher no longer awaits the group's dispatch: its engine's slot is free."""
        if g.inflight is not None:
            self.occupancy.end(g.inflight.engine, self.door.now())
            g.inflight = None

    def _submit_generate(
        self, gid: str, attempt: int, eid: str, client: SGLangClient, index: int
    ) -> None:
        """Start the group's `/generate` on a worker thread (`ehp-fsm simulate` schedules it
        in virtual time instead); its `_Result` reaches the queue `pump` drains."""
        pool = self._pools.get(eid)
        if pool is None:
            pool = self._pools[eid] = ThreadPoolExecutor(
                self.config.max_inflight_per_engine, thread_name_prefix=f"ehp-generate-{eid}"
            )
        pool.submit(self._generate, gid, attempt, eid, client, index)

    def _sample_seed(self, index: int, i: int, redraw: int = 0) -> int:
        """Sample `i` of group `index`'s seed; `redraw` > 0 after unscorable attempts (a seed
        of its own each time, the same in every run of the same plan)."""
        base = (self.config.sampling_seed * 1_000_003 + index) * 1_024 + i
        return (base + redraw * _REDRAW_STRIDE) & _MASK63

    def _generate(self, gid: str, attempt: int, eid: str, client: SGLangClient, index: int) -> None:
        """Worker thread: one batched `/generate` for the group's n samples. Never touches the
        engine; the result goes to the queue `pump` drains."""
        n = self.config.group_size
        prompt = list(self.task.question(index).prompt_ids)
        group = self._groups.get(gid)  # set on the loop's thread before this was submitted
        redraw = group.redraws if group is not None else 0
        try:
            outs = client.generate_batch(
                input_ids=[prompt] * n,
                sampling_params=[
                    self.task.sampling_params(self._sample_seed(index, i, redraw)) for i in range(n)
                ],
                rids=[f"{gid}.{attempt}.{i}" for i in range(n)],
                return_logprob=True,  # π_old: the behaviour log-probs the objective needs
                timeout_s=self.config.generate_timeout_s,
            )
            result = _Result(group_id=gid, attempt=attempt, engine=eid, outputs=tuple(outs))
        except EngineError as exc:
            result = _Result(
                group_id=gid,
                attempt=attempt,
                engine=eid,
                error=str(exc),
                unreachable=isinstance(exc, EngineUnreachable),
                timed_out=isinstance(exc, EngineUnreachable) and exc.timed_out,
            )
        except Exception as exc:  # a malformed answer: report it as this group's failure
            result = _Result(
                group_id=gid, attempt=attempt, engine=eid, error=f"{type(exc).__name__}: {exc}"
            )
        self._results.put(result)
        self._wake()

    def _report(self, r: _Result | _Scored) -> None:
        if isinstance(r, _Scored):
            self._on_scored(r)
            return
        g = self._groups.get(r.group_id)
        if g is None:
            return
        if r.attempt != g.attempts:
            self.stats.superseded_results += 1  # a newer dispatch of the group is in flight
            return
        current = g.inflight
        self._clear_inflight(g)
        if r.error is not None:
            self._on_failure(r, current is not None)
            return
        judged = judge_answer(r.outputs, f"{r.group_id}.{r.attempt}.", self.config.group_size)
        if isinstance(judged, str):
            # (an answer that is a failure waits as a refusal does: a model whose weights hold
            # a NaN had every sample aborted, and its groups re-sent at once, ~400 times a
            # second, each logged — 67 MB of log in 190 s — until `[deadlines.run] rollout`)
            self.last_failure = f"engine {r.engine}: {judged}"
            self._refused(g)
            self._requeue(r.group_id, r.engine, judged)
            return
        revision = judged
        logprobs = list(map(_LOGPROBS, r.outputs))
        known = [lp for lp in logprobs if lp is not None]
        if self.config.behaviour_logprobs and len(known) != len(logprobs):
            why = (
                f"sample {logprobs.index(None)}'s answer has no meta_info.output_token_logprobs "
                "(asked with return_logprob): the objective's ratio needs every token's "
                "behaviour log-prob"
            )
            self.last_failure = f"engine {r.engine}: {why}"
            self._refused(g)
            self._requeue(r.group_id, r.engine, why)
            return
        # Scored on the dispatcher's scoring thread: the loop goes on meanwhile — heartbeats,
        # deadlines, borrows, the other engines' answers. Scored here, a reward of 0.5 s a
        # completion held the loop 2 s a group of 4, said as the run's own stall ("a paused
        # VM ...") and not counted against any deadline (an ML user's find). The group stays
        # `dispatched` (its engine's slot held) until its samples are scored.
        self._submit_score(
            _Scored(
                result=r,
                revision=revision,
                was_inflight=current is not None,
                index=g.index,
                outputs=list(map(_OUTPUT_IDS, r.outputs)),
                logprobs=known if len(known) == len(logprobs) else None,
            )
        )

    def _submit_score(self, todo: _Scored) -> None:
        """Score the answer on the scoring thread; its `_Scored` reaches the queue `pump`
        drains (`ehp-fsm simulate`, whose scores cost nothing, scores at once instead)."""

        def score() -> None:
            self._results.put(self._scored(todo))
            self._wake()

        if self._scorer is None:
            self._scorer = threading.Thread(target=self._score_all, name="ehp-score", daemon=True)
            self._scorer.start()
        self._scores.put(score)

    def _score_all(self) -> None:
        """The scoring thread: each queued score in turn, until `close`."""
        while (score := self._scores.get()) is not None and not self._closed:
            score()

    def _scored(self, todo: _Scored) -> _Scored:
        """`todo` with the task's scores of the answer (`data.rewards.Reward.score_group_sync`
        hands it to the reward's own thread; the scoring thread is its one caller), or with
        what the scoring raised."""
        try:
            samples = self.task.score_group(
                todo.index, todo.outputs, todo.logprobs, revision=todo.revision
            )
            return dataclasses.replace(todo, samples=samples)
        except Exception as exc:  # a RewardError, or e.g. a token id outside the vocabulary
            return dataclasses.replace(todo, error=exc)
        except BaseException as exc:  # (never left unreported: its group would stay
            # `dispatched` for good) — raised on the loop's thread as a failure of the scoring
            error = RuntimeError(f"scoring raised {type(exc).__name__}: {exc}")
            return dataclasses.replace(todo, error=error)

    def _on_scored(self, s: _Scored) -> None:
        """A scored answer, on the loop's thread: the group completes, or is requeued when its
        samples could not be scored; a reward that failed stops the run (its `RewardError`
        raised here). An answer whose group was sent again meanwhile is dropped."""
        r, revision = s.result, s.revision
        g = self._groups.get(r.group_id)
        if isinstance(s.error, RewardError):
            raise s.error  # the reward itself failed (on_error = "raise"): the run stops
        if g is None or r.attempt != g.attempts:
            self.stats.superseded_results += 1
            return
        if s.error is not None or s.samples is None:
            g.redraws += 1
            why = f"its samples could not be scored: {s.error!r}"
            self.last_failure = f"engine {r.engine}: {why}"
            self._refused(g)
            self._requeue(r.group_id, r.engine, why)
            return
        out = self._fire(REQUEST, r.group_id, "complete", engine=r.engine, revision=revision)
        if isinstance(out, Rejected):
            self.stats.refused_completions += 1
            if s.was_inflight and self._state(r.group_id) == "dispatched":
                # served from another revision than it was dispatched at: regenerate it
                self._requeue(r.group_id, r.engine, f"served by revision {revision}: {out.reason}")
            return
        g.done = CompletedGroup(
            group_id=r.group_id, engine=r.engine, revision=revision, samples=s.samples
        )
        self.stats.completed += 1
        g.completed_seq = self.stats.completed

    def _on_failure(self, r: _Result, was_inflight: bool) -> None:
        gid, eid, error = r.group_id, r.engine, str(r.error)
        self.last_failure = f"engine {eid}: {error}"
        attached = self._engines.get(eid)
        dead = attached is not None and attached.alive is not None and not attached.alive()
        # only an engine that should be up is reported dead; a drained one is being stopped
        if dead and was_inflight and self._engine_state(eid) in _UP_STATES:
            out = self.engine_failed(eid, f"process gone: {error}")
            if isinstance(out, Accepted):
                return  # the engine's `fail` requeued every group it held, this one included
        if r.unreachable and attached is not None:
            attached.cool_until = self.door.now() + self.config.unreachable_backoff_s
            if r.timed_out and was_inflight and self._engine_state(eid) in _UP_STATES:
                self._probe(eid, attached)
        elif (g := self._groups.get(gid)) is not None:
            self._refused(g)
        self._requeue(gid, eid, error)

    def _refused(self, g: _Group) -> None:
        """An engine answered the group with a failure (an error status, an answer aborted or
        without log-probs, samples that cannot be scored): it waits before it is sent again,
        twice as long after each such answer (`REFUSED_BACKOFF_S` … `REFUSED_BACKOFF_MAX_S`). A
        request every engine refuses (a prompt no engine can take) was re-sent at once, ~1,200
        times a second against one engine, each logged, until `[deadlines.run] rollout`."""
        g.refused += 1
        wait = min(REFUSED_BACKOFF_S * 2 ** min(g.refused - 1, 30), REFUSED_BACKOFF_MAX_S)
        g.not_before = self.door.now() + wait

    def _probe(self, eid: str, attached: _Attached) -> None:
        """Take `eid` out of routing and ask its `/health` once (on a probe thread, never the
        engine's own `/generate` threads: those may all be waiting on it), unless a probe is
        under way. `_judge_probes` reads the verdict."""
        if attached.probing:
            return
        attached.probing = True
        self.stats.probes += 1
        client, bound = attached.client, self.config.probe_timeout_s

        def probe() -> None:
            try:
                client.health(timeout_s=bound)  # 503 is an answer too: the process runs
                why = None
            except EngineUnreachable as exc:
                why = exc.why
            except Exception:  # any other failure came with an answer (a status, a body)
                why = None
            self._probed.put((eid, client, why))
            self._wake()

        self._probe_pool.submit(probe)

    def _judge_probes(self) -> None:
        """The verdicts of finished `/health` probes: an engine that answered goes back into
        routing (after the usual back-off); one that did not is failed (`fail`, which requeues
        the groups it still holds), if it is still one that should be up."""
        probed = self._probed
        while not probed.empty():
            eid, client, why = probed.get()  # (the one taker: not empty, so no wait)
            attached = self._engines.get(eid)
            if attached is None or attached.client is not client:
                continue  # detached, or attached again since: not this probe's engine
            attached.probing = False
            if why is None:
                attached.cool_until = self.door.now() + self.config.unreachable_backoff_s
            elif self._engine_state(eid) in _UP_STATES:
                self.engine_failed(
                    eid,
                    f"not answering: a /generate got no answer within "
                    f"{self.config.generate_timeout_s} s, then /health none within "
                    f"{self.config.probe_timeout_s} s ({why})",
                )

    def _requeue(self, gid: str, eid: str, reason: str) -> None:
        if self._state(gid) != "dispatched":
            return
        inst = self.door.world.get(REQUEST, gid)
        if inst is None or inst.get("engine") != eid:
            return
        if isinstance(self._fire(REQUEST, gid, "abort", reason=reason[:500]), Accepted):
            self.stats.aborted += 1

    def _expire_stale(self) -> None:
        floor = self._floor()
        for gid, g in self._groups.items():
            stale = g.done is not None and g.done.revision < floor
            if (
                stale
                and self._state(gid) == "completed"
                and isinstance(self._fire(REQUEST, gid, "expire"), Accepted)
            ):
                g.done = None
                self.stats.expired += 1

    def _forget_consumed(self) -> None:
        gone = [gid for gid in self._groups if self._state(gid) == "consumed"]
        for gid in gone:
            del self._groups[gid]
        self.stats.consumed += len(gone)

    def _abort_http(self, gid: str, eid: str) -> None:
        g = self._groups.get(gid)
        attached = self._engines.get(eid)
        if g is None or attached is None or g.inflight is None or g.inflight.engine != eid:
            return
        if self._engine_state(eid) in ("failed", "stopped"):
            # its process is being stopped: nothing to abort, and a frozen one would hold a
            # control thread for a client timeout per sample
            self._clear_inflight(g)
            return
        # One abort per sample rid: SGLang 0.5.3 ignores a rid it does not hold
        # (`tokenizer_manager.py:1037`), and its scheduler aborts every request whose rid
        # starts with the one given (`scheduler.py:2570`, `2639`): `G.A.1` also ends
        # `G.A.10`..`G.A.19`, samples of this same group.
        rids = [f"{gid}.{g.inflight.attempt}.{i}" for i in range(self.config.group_size)]
        self._clear_inflight(g)  # its result, if it still comes, is reported and refused
        client = attached.client

        def abort() -> None:
            for rid in rids:
                with contextlib.suppress(EngineError):
                    client.abort_request(rid)

        self._control.submit(abort)

    def _pause(self, eid: str, mode: str) -> None:
        attached = self._engines.get(eid)
        if attached is None:
            return
        with contextlib.suppress(EngineError):  # a dead engine needs no pause
            attached.client.pause_generation(mode)


_LOGPROBS: Final = operator.attrgetter("output_logprobs")
_OUTPUT_IDS: Final = operator.attrgetter("output_ids")


def judge_answer(outputs: Sequence[GenerateResult], rid_prefix: str, n: int) -> str | int:
    """An engine's answer to a group's `/generate`: the revision (an int) when it is the
    group's n samples, in order (each `rid` is `rid_prefix` + its index, or absent), none
    aborted, each at one weight version (its per-token spans agree) and all at the same integer
    weight version; else why not (a str: the group is requeued with that reason).

    The checks, in the order their reasons take precedence, are `_judge_each`'s: every sample
    through each check in turn. A well-formed answer — every answer the run gets from a healthy
    engine, and every one the simulation makes — passes all of them, so it is first taken
    through every check in one pass over its samples (the same per-sample tests, without a
    list per check); anything it does not pass goes through `_judge_each`, which names the
    first check it fails. `tests/rollout_flow/test_judge.py` compares the two on random
    answers."""
    if len(outputs) == n and n > 0:
        version = outputs[0].weight_version
        if version is not None and _INTEGER.fullmatch(version):
            for i, o in enumerate(outputs):
                rid, spans = o.rid, o.weight_versions
                if (
                    (
                        # `o.aborted`, without its call for the client's own results
                        (fr := o.finish_reason) is not None and fr.get("type") == "abort"
                        if type(o) is GenerateResult
                        else o.aborted
                    )
                    or (rid is not None and rid != f"{rid_prefix}{i}")
                    or o.weight_version != version
                    or (spans and len(spans) > 1 and len({s.version for s in spans}) > 1)
                ):
                    break
            else:
                return int(version)
    return _judge_each(outputs, rid_prefix, n)


def _judge_each(outputs: Sequence[GenerateResult], rid_prefix: str, n: int) -> str | int:
    """`judge_answer`, check by check over every sample (the definition; the reasons)."""
    aborted = [o for o in outputs if o.aborted]
    if aborted:
        why = (aborted[0].finish_reason or {}).get("message", "aborted")
        return f"engine aborted {len(aborted)} samples: {why}"
    rids = [f"{rid_prefix}{i}" for i in range(n)]
    got = [o.rid for o in outputs]
    if len(got) != n or any(x is not None and x != w for x, w in zip(got, rids, strict=True)):
        return f"engine answered samples {got}, not {rids}"
    # a sample whose tokens came from two weight versions (SGLang's per-token spans) has no
    # one behaviour policy: its log-probs are not one revision's
    mixed = [o for o in outputs if len({s.version for s in o.weight_versions or ()}) > 1]
    if mixed:
        seen = sorted({s.version for o in mixed for s in o.weight_versions or ()})
        return f"{len(mixed)} samples mix weight versions {seen}"
    versions = {o.weight_version for o in outputs}
    version = next(iter(versions)) if len(versions) == 1 else None
    if version is None or not _INTEGER.fullmatch(version):
        return f"samples report weight versions {sorted(map(str, versions))}"
    return int(version)
