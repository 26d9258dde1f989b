"""The real dispatcher with simulated engines behind it.

`SimDispatcher` is `rollout.dispatch.Dispatcher` — its queueing, least-loaded routing with the
per-engine cap, completion checks (n samples, one integer weight version), staleness expiry and
requeueing all run as in the run — with the one HTTP call replaced: a group's `/generate` is
scheduled on the virtual clock (continuous batching: the engine's decode throughput is
one queue all its groups share, while each group also takes at least its longest sample at one
sequence's speed — the long tail) and its answer lands in the dispatcher's result queue, which the
loop's next turn drains. Aborts and pauses cost nothing.

Five scans of the run's dispatcher, each over every open group on every turn, read the watch's
indices here instead (same result, work in proportion to what changed): the per-engine load,
the queued groups, the in-flight bookkeeping to forget (`_reconcile`), stale completions
(`_expire_stale`: all of them only when the staleness floor moved) and consumed groups.

`SimTask` is the task the dispatcher asks for prompts and scores: prompt i is "p{i}", each
sample is its length in tokens, every score is 0 (the simulation trains nothing).
"""

from __future__ import annotations

import functools
import heapq
import queue
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

import msgspec

from ehp_fsm.core.transition import Accepted, Outcome
from ehp_fsm.core.world import Event
from ehp_fsm.rollout.client import GenerateResult, SGLangClient
from ehp_fsm.rollout.dispatch import Dispatcher, _Result, _Scored
from ehp_fsm.sim.clock import VirtualClock
from ehp_fsm.sim.costs import Costs
from ehp_fsm.sim.edge import Accounting
from ehp_fsm.sim.watch import Watch
from ehp_fsm.training.task import GroupSamples, Scored

__all__ = ["SimDispatcher", "SimTask"]


class _Prompt(msgspec.Struct, frozen=True, gc=False):
    """A prompt (`training.task.Prompted`): a struct built in C and not tracked by the cycle
    collector (one per group enqueued and one per group scored)."""

    index: int
    text: str
    prompt_ids: tuple[int, ...]


class SimTask:
    """Prompts and scores for the dispatcher (see the module docstring)."""

    def question(self, index: int) -> _Prompt:
        return _Prompt(index, f"p{index}", (1,))

    def sampling_params(self, seed: int) -> dict[str, object]:
        return {"seed": seed}

    def score_group(
        self,
        group_index: int,
        completions: Sequence[Sequence[int]],
        logprobs: Sequence[Sequence[float]] | None = None,
        *,
        revision: int = 0,
    ) -> GroupSamples:
        if not completions:  # the constructor's own error: a group needs n ≥ 1 completions
            return GroupSamples(
                group_index=group_index,
                question=self.question(group_index),
                completions=(),
                scores=(),
                revision=revision,
            )
        # The constructor's fields, without the frozen dataclass's `__init__`: its checks (a
        # score per completion, n ≥ 1, log-probs matching) cannot fail here — `_scores` gives
        # one score per completion and no log-probs are kept (the simulated engine returns
        # none). One per group; `tests/sim/test_lean.py` compares it with the constructor.
        samples = object.__new__(GroupSamples)
        samples.__dict__.update(
            group_index=group_index,
            question=self.question(group_index),
            completions=tuple(map(tuple, completions)),
            scores=_scores(len(completions)),
            logprobs=None,
            revision=revision,
        )
        return samples


@functools.cache
def _scores(n: int) -> tuple[Scored, ...]:
    """n zero scores: one tuple for every group (`Scored` is frozen: nothing can tell)."""
    return (Scored(reward=0.0, exact=False, well_formed=True),) * n


class _Results:
    """The dispatcher's result queue, for one thread: the simulation's answers are put and
    taken by the loop's thread alone (`_Answer` runs on the virtual clock), so `queue.Queue`'s
    lock and condition per put and per get are not needed. FIFO, and `get_nowait` raises
    `queue.Empty` when it is empty, as the dispatcher's `pump` expects."""

    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: deque[_Result] = deque()

    def put(self, item: _Result) -> None:
        self._items.append(item)

    def get_nowait(self) -> _Result:
        if not self._items:
            raise queue.Empty
        return self._items.popleft()

    def get(self, block: bool = True, timeout: float | None = None) -> _Result:
        """Nothing else can put while the one thread waits: as `get_nowait`."""
        return self.get_nowait()


class _NoClient:
    """What the dispatcher holds per engine: pauses and aborts have nothing to reach."""

    def pause_generation(self, mode: str) -> None:
        return None

    def abort_request(self, rid: str) -> None:
        return None


class SimDispatcher(Dispatcher):
    """See the module docstring."""

    def __init__(
        self,
        *args: Any,
        clock: VirtualClock,
        costs: Costs,
        acct: Accounting,
        watch: Watch,
        woken: Callable[[], None],
        slow: dict[str, float],
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._results = _Results()  # type: ignore[assignment]  # the one thread's queue
        self.clock, self.costs, self.acct = clock, costs, acct
        self.watch = watch
        self._last_floor: int | None = None
        self._qheap: list[tuple[int, str]] = []  # (group number, group): queued, lazily pruned
        self._eheap: list[tuple[int, str]] = []  # (load, engine): open engines, lazily pruned
        self._woken = woken  # schedules the loop's next turn (a result is waiting)
        self.slow = slow
        self.busy_until: dict[str, float] = {}

    def _fire(self, machine: str, instance: str, name: str, **payload: Any) -> Outcome:
        """`door.event(...)`, which is `door.post(Event(..., now, payload))`, without its call
        and a second copy of the payload (`post` stamps the event with the loop's clock, the
        virtual clock's time: the same float object, so it is not stamped again)."""
        return self.door.post(Event(machine, instance, name, self.clock.t, payload))

    def _submit_score(self, todo: _Scored) -> None:
        """Scored at once, on the one thread (a simulated score costs nothing): the group
        completes in the turn its answer is reported, as in virtual time it does."""
        self._on_scored(self._scored(todo))

    def attach_sim(self, engine_id: str) -> None:
        self.attach(engine_id, _NoClient(), alive=None)  # type: ignore[arg-type]  # no HTTP

    def _load_of(self, engines: Iterable[str]) -> dict[str, int]:
        return self.watch.load(engines)

    def completed_groups(self, k: int | None = None) -> list[str]:
        """The run's answer from the watch's completed groups instead of every open group
        (the story asks it on each happening while a step waits for its groups): the groups in
        state `completed` are exactly the watch's set, the rest of the test and the order
        (oldest completion first; each completion has its own number) are the run's."""
        floor, groups = self._floor(), self._groups
        ids = [
            gid
            for gid in self.watch.completed
            if (g := groups.get(gid)) is not None and g.done is not None
            if g.done.revision >= floor
        ]
        ids.sort(key=lambda gid: groups[gid].completed_seq)
        return ids if k is None else ids[:k]

    def _queued_groups(self) -> list[str]:
        groups = self._groups
        queued = [gid for gid in self.watch.queued if gid in groups]
        queued.sort(key=lambda gid: groups[gid].index)
        return queued

    def _dispatch_queued(self) -> None:
        """The run's rule — each queued group, oldest first, to the least-loaded serving
        engine below the cap (ties by id); a refusing engine is passed over this round — from
        two heaps fed by the watch instead of a sort of every queued group and a scan of every
        engine on every turn. (No engine is ever cooling down here: no HTTP call fails.)"""
        w, cap = self.watch, self.config.max_inflight_per_engine
        if not (w.newly_queued or (self._qheap and self._eheap) or w.load_changes_pending()):
            return  # nothing new to offer, and no group and engine left to pair (twice a turn)
        for gid in w.newly_queued:
            heapq.heappush(self._qheap, (_group_number(gid), gid))
        w.newly_queued = []
        by_engine = w.dispatched_by_engine()  # `w.load_of(e)` is `len(by_engine.get(e, ()))`
        serving = w.serving
        for eid in w.take_load_changed():
            n = len(by_engine.get(eid, ()))
            if eid in serving and n < cap:
                heapq.heappush(self._eheap, (n, eid))
        qheap, eheap = self._qheap, self._eheap
        pop, engines, queued, groups = heapq.heappop, self._engines, w.queued, self._groups
        refused: list[str] = []
        skipped: list[tuple[int, str]] = []
        while qheap and eheap:
            n, eid = eheap[0]
            if (
                eid not in serving
                or eid in refused
                or eid not in engines
                or n != len(by_engine.get(eid, ()))
            ):
                pop(eheap)
                continue
            _, gid = qheap[0]
            if gid not in queued or gid not in groups:
                pop(qheap)
                continue
            pop(eheap)
            entry = pop(qheap)
            out = self._fire("request", gid, "dispatch", engine=eid)
            if isinstance(out, Accepted):
                self.stats.dispatched += 1
                if n + 1 < cap:
                    heapq.heappush(eheap, (n + 1, eid))
            else:
                refused.append(eid)
                skipped.append(entry)
        for entry in skipped:
            heapq.heappush(qheap, entry)
        w.load_changed.update(refused)  # offered again next turn

    def _reconcile(self) -> None:
        changed, self.watch.changed = self.watch.changed, set()
        groups, get = self._groups, self.watch.world.get  # (the loop's world: `door.world`)
        for gid in changed:
            g = groups.get(gid)
            if g is None or g.inflight is None:
                continue
            inst = get("request", gid)
            if (
                inst is None
                or inst.state != "dispatched"
                or inst.data.get("engine") != g.inflight.engine
            ):
                self._clear_inflight(g)

    def _expire_stale(self) -> None:
        floor = self._floor()
        fresh, self.watch.newly_completed = self.watch.newly_completed, set()
        candidates = self.watch.completed if floor != self._last_floor else fresh
        self._last_floor = floor
        groups = self._groups
        stale = [
            gid
            for gid in candidates
            if (g := groups.get(gid)) is not None and g.done is not None and g.done.revision < floor
        ]  # (an expiry changes no other group's result, and the floor stays: filter, then sort)
        for gid in sorted(stale, key=_group_number):
            g = groups[gid]
            if self._state(gid) == "completed" and isinstance(
                self._fire("request", gid, "expire"), Accepted
            ):
                g.done = None
                self.stats.expired += 1

    def _forget_consumed(self) -> None:
        gone, self.watch.newly_consumed = self.watch.newly_consumed, []
        for gid in gone:
            self._groups.pop(gid, None)
        self.stats.consumed += len(gone)
        self.watch.forget_consumed(gone)

    def _submit_generate(
        self, gid: str, attempt: int, eid: str, client: SGLangClient, index: int
    ) -> None:
        inst = self.watch.world.get("rollout_engine", eid)  # (the loop's world: `door.world`)
        if inst is None:
            return
        data = inst.data
        tp, host = int(data["tp"]), str(data.get("host"))
        revision = str(data.get("installed"))
        lengths = self.costs.response_lengths(index)
        work, latency = self.costs.group_seconds(lengths, tp, self.slow.get(host, 1.0))
        now = self.clock.now()
        busy = self.busy_until[eid] = max(now, self.busy_until.get(eid, 0.0)) + work
        done_at = max(busy, now + latency)
        self.acct.busy_gpu_s += work * tp
        self.clock.at(
            done_at,
            _Answer(self, gid, attempt, eid, lengths, revision),
        )

    def _abort_http(self, gid: str, eid: str) -> None:
        g = self._groups.get(gid)
        if g is not None and g.inflight is not None and g.inflight.engine == eid:
            self._clear_inflight(g)  # its answer, if it still comes, is reported and refused


class _Answer:
    """A group's `/generate` answer, due on the virtual clock: it lands in the dispatcher's
    result queue when the clock calls it, and only then are its n `GenerateResult`s built (what
    waits on the clock is five references and the lengths, not n results and their dicts, so
    the cycle collector has fewer live objects to scan at each step boundary; the answer is the
    same). The rid of sample i is `{gid}.{attempt}.{i}`; each sample's tokens are as many zeros
    as its length up to 8 tokens, one zero beyond (the dispatcher trains on nothing)."""

    __slots__ = ("attempt", "dispatcher", "eid", "gid", "lengths", "revision")

    def __init__(
        self,
        dispatcher: SimDispatcher,
        gid: str,
        attempt: int,
        eid: str,
        lengths: list[int],
        revision: str,
    ) -> None:
        self.dispatcher, self.gid, self.attempt, self.eid = dispatcher, gid, attempt, eid
        self.lengths, self.revision = lengths, revision

    def __call__(self) -> None:
        prefix, lengths = f"{self.gid}.{self.attempt}.", self.lengths
        n = self.dispatcher.config.group_size
        # `GenerateResult(rid=..., text="", output_ids=..., output_logprobs=None,
        # finish_reason={"type": "length"}, weight_version=revision, raw={})`, field for
        # field, without the frozen dataclass's `__init__` (one `object.__setattr__` per
        # field: n results a group were a tenth of a run): the fields every sample shares
        # copied in at once, in the constructor's order, then its own. `tests/sim/test_lean.py`
        # compares them with the constructor's.
        same = {
            "rid": None,
            "text": "",
            "output_ids": None,
            "output_logprobs": None,
            "finish_reason": None,
            "weight_version": self.revision,
            "weight_versions": None,
            "raw": None,
        }
        new, samples, numbers = object.__new__, [], _numbers(n)
        for i in range(n):
            k = lengths[i]
            r = new(GenerateResult)
            fields = r.__dict__
            fields.update(same)
            fields["rid"] = prefix + numbers[i]
            fields["output_ids"] = _ZEROS[k] if k <= 8 else _ONE_ZERO
            fields["finish_reason"] = {"type": "length"}
            fields["raw"] = {}
            samples.append(r)
        outputs = tuple(samples)
        d = self.dispatcher
        d._results.put(
            _Result(group_id=self.gid, attempt=self.attempt, engine=self.eid, outputs=outputs)
        )
        d._woken()


_ZEROS: Final = tuple((0,) * n for n in range(9))
_ONE_ZERO: Final = (0,)


@functools.cache
def _numbers(n: int) -> tuple[str, ...]:
    """`str(i)` for i < n: the samples' rid suffixes (`f"{prefix}{i}"` is `prefix + str(i)`)."""
    return tuple(map(str, range(n)))


def _group_number(gid: str) -> int:
    """`g17` → 17: groups in the order they were created (the run's dict order)."""
    return int(gid[1:]) if gid[1:].isdigit() else -1
