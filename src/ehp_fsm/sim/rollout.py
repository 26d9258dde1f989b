"""The real dispatcher with simulated engines behind it.

`SimDispatcher` is `rollout.dispatch.Dispatcher` — its queueing, least-loaded routing with the
per-engine cap, completion checks (n samples, one integer weight version), staleness expiry and
requeueing all run as in the run — with the one HTTP call replaced: a group's `/generate` is
scheduled on the virtual clock (continuous batching: the engine's decode throughput is
one queue all its groups share, while each group also takes at least its longest sample at one
sequence's speed — the long tail) and its answer lands in the dispatcher's result queue, which the
loop's next turn drains. Aborts and pauses cost nothing. The per-engine load comes from an
index the watch keeps (the run scans the world's requests, which grows with every step).

`SimTask` is the task the dispatcher asks for prompts and scores: prompt i is "p{i}", each
sample is its length in tokens, every score is 0 (the simulation trains nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ehp_fsm.rollout.client import GenerateResult, SGLangClient
from ehp_fsm.rollout.dispatch import Dispatcher, _Result
from ehp_fsm.sim.clock import VirtualClock
from ehp_fsm.sim.costs import Costs
from ehp_fsm.sim.edge import Accounting
from ehp_fsm.training.task import GroupSamples, Scored

__all__ = ["SimDispatcher", "SimTask"]


@dataclass(frozen=True)
class _Prompt:
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
        return GroupSamples(
            group_index=group_index,
            question=self.question(group_index),
            completions=tuple(tuple(c) for c in completions),
            scores=tuple(Scored(reward=0.0, exact=False, well_formed=True) for _ in completions),
            revision=revision,
        )


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
        load: Callable[[Iterable[str]], dict[str, int]],
        woken: Callable[[], None],
        slow: dict[str, float],
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.clock, self.costs, self.acct = clock, costs, acct
        self._load_index = load
        self._woken = woken  # schedules the loop's next turn (a result is waiting)
        self.slow = slow
        self.busy_until: dict[str, float] = {}

    def attach_sim(self, engine_id: str) -> None:
        self.attach(engine_id, _NoClient(), alive=None)  # type: ignore[arg-type]  # no HTTP

    def _load_of(self, engines: Iterable[str]) -> dict[str, int]:
        return self._load_index(engines)

    def _submit_generate(
        self, gid: str, attempt: int, eid: str, client: SGLangClient, index: int
    ) -> None:
        inst = self.door.world.get("rollout_engine", eid)
        if inst is None:
            return
        tp, host = int(inst.get("tp")), str(inst.get("host"))
        revision = str(inst.get("installed"))
        lengths = self.costs.response_lengths(index)
        work, latency = self.costs.group_seconds(lengths, tp, self.slow.get(host, 1.0))
        now = self.clock.now()
        self.busy_until[eid] = max(now, self.busy_until.get(eid, 0.0)) + work
        done_at = max(self.busy_until[eid], now + latency)
        self.acct.busy_gpu_s += work * tp
        n = self.config.group_size
        outputs = tuple(
            GenerateResult(
                rid=f"{gid}.{attempt}.{i}",
                text="",
                output_ids=(0,) * lengths[i] if lengths[i] <= 8 else (0,),
                output_logprobs=None,
                finish_reason={"type": "length"},
                weight_version=revision,
                raw={},
            )
            for i in range(n)
        )
        result = _Result(group_id=gid, attempt=attempt, engine=eid, outputs=outputs)

        def answered() -> None:
            self._results.put(result)
            self._woken()

        self.clock.at(done_at, answered)

    def _abort_http(self, gid: str, eid: str) -> None:
        g = self._groups.get(gid)
        if g is not None and g.inflight is not None and g.inflight.engine == eid:
            g.inflight = None  # its answer, if it still comes, is reported and refused
