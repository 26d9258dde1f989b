"""The dispatcher accepts a group only when the engine's answer is the group: its n samples, in
order, at one integer weight version (every token of it: SGLang's `weight_versions` spans), and
scorable; anything else is requeued, never completed and lost. Aborts name every sample's rid
(SGLang aborts exact rids only).

What is faked: the engine, at the HTTP layer (`httpx.MockTransport`): a misbehaving SGLang
server is the far edge these tests need and a real one cannot be made to misbehave on cue.
Everything else is real: the engine's machines, the publisher (it installs revisions on the
fake) and the dispatcher.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from ehp_fsm import Orchestrator, load_plan
from ehp_fsm.core.transition import Accepted
from ehp_fsm.rollout import RevisionStore, SGLangClient
from ehp_fsm.rollout.client import LOGPROB_CEILING, LOGPROB_FLOOR, logprob_problem
from ehp_fsm.rollout.dispatch import DispatchConfig, Dispatcher
from ehp_fsm.rollout.publish import PublishConfig, Publisher
from ehp_fsm.shell.loop import Loop
from ehp_fsm.training.task import ArithmeticTask
from tests.rollout.hf import revision_state

PLAN = Path(__file__).resolve().parents[2] / "examples" / "local.toml"
Answer = Callable[[list[str], str | None], list[dict[str, Any]]]


def good(rids: list[str], version: str | None) -> list[dict[str, Any]]:
    return [
        {
            "text": "1",
            "output_ids": [5, 2],
            "meta_info": {
                "id": rid,
                "finish_reason": {"type": "stop"},
                "weight_version": version,
                "output_token_logprobs": [[-0.5, 5, None], [-0.1, 2, None]],
            },
        }
        for rid in rids
    ]


class FakeSGLang:
    """Installs revisions; answers `/generate` with `answer` (the first `bad_answers` times,
    then good ones); records every abort."""

    def __init__(self, answer: Answer, bad_answers: int) -> None:
        self.version: str | None = None
        self.answer, self.bad_left = answer, bad_answers
        self.aborts: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"null")
        with self.lock:
            if request.url.path == "/update_weights_from_disk":
                self.version = body.get("weight_version")
                return httpx.Response(200, json={"success": True, "message": "ok"})
            if request.url.path == "/abort_request":
                self.aborts.append(body["rid"])
                return httpx.Response(200, json={})
            if request.url.path == "/generate":
                bad = self.bad_left > 0
                self.bad_left -= bad
                answer, version = (self.answer if bad else good), self.version
            else:
                return httpx.Response(200, json={})
        # outside the lock; NaN as Python's json writes it (httpx's own `json=` refuses it)
        content = json.dumps(answer(body["rid"], version)).encode()
        return httpx.Response(200, content=content, headers={"content-type": "application/json"})


class Rig:
    def __init__(self, root: Path, fake: FakeSGLang, *, base: Path, group_size: int = 4) -> None:
        self.base = base
        plan = load_plan(PLAN)
        # One engine only: no rollout reserve, so that the drain tests may drain it (the core
        # refuses a drain that leaves fewer serving GPUs than the reserve).
        plan = dataclasses.replace(plan, rollout=dataclasses.replace(plan.rollout, reserve=0))
        orch = Orchestrator.from_plan(plan, log_path=root / "t.jsonl", check=True)
        self.loop = Loop(orch, clock=time.monotonic)
        self.pub = Publisher(
            self.loop,
            RevisionStore(root / "revisions"),
            config=PublishConfig(retry_backoff_s=0.0, max_backoff_s=0.0),
        )
        self.disp = Dispatcher(
            self.loop,
            ArithmeticTask(),
            config=DispatchConfig(group_size=group_size, max_inflight_per_engine=4),
        )
        self.loop.add(self.pub)
        self.loop.add(self.disp)
        out = self.pub.save_and_publish(
            revision=1, step=1, state_dict=revision_state(base, 1), base=base
        )
        assert out.accepted, out.reason
        client = SGLangClient("http://e0", transport=httpx.MockTransport(fake))
        self.fire("rollout_engine", "e0", "launch", host="h1", gpus=["h1:g0"], tp=1, token="t")
        self.pub.attach("e0", client)
        self.disp.attach("e0", client)
        ident = {"host": "h1", "pid": 1, "start_time": 1.0, "token": "t"}
        assert self.pub.engine_healthy("e0", ident).accepted
        assert self.pub.wait_installed(timeout_s=5)

    def fire(self, machine: str, inst: str, name: str, **payload: Any) -> None:
        out = self.loop.event(machine, inst, name, **payload)
        assert isinstance(out, Accepted), out

    def close(self) -> None:
        self.loop.close()


def short(rids: list[str], version: str | None) -> list[dict[str, Any]]:
    return good(rids[:-1], version)


def reordered(rids: list[str], version: str | None) -> list[dict[str, Any]]:
    return good(list(reversed(rids)), version)


def odd_version(rids: list[str], version: str | None) -> list[dict[str, Any]]:
    return good(rids, "\u00b2")  # a Unicode digit: `str.isdigit` says yes, `int` says no


def out_of_vocabulary(rids: list[str], version: str | None) -> list[dict[str, Any]]:
    out = good(rids, version)
    out[0]["output_ids"] = [10_000, 2]  # outside any tiny vocabulary: the task cannot score it
    return out


def mixed_versions(rids: list[str], version: str | None) -> list[dict[str, Any]]:
    out = good(rids, version)
    # SGLang's per-token record: the first token under an older version, the second under this
    out[1]["meta_info"]["weight_versions"] = [
        {"version": "0", "start": 0, "end": 1},
        {"version": version, "start": 1, "end": 2},
    ]
    return out


def one_without_logprobs(rids: list[str], version: str | None) -> list[dict[str, Any]]:
    """One sample's answer without its tokens' log-probs (asked with `return_logprob`): taken,
    it made the whole batch on-policy (`layout_batch` keeps π_old only when every group has
    it), so every stale group of that step lost its ratio correction."""
    out = good(rids, version)
    del out[2]["meta_info"]["output_token_logprobs"]
    return out


def with_logprobs(rids: list[str], version: str | None, first: list[float]) -> list[dict[str, Any]]:
    """`good`, with behaviour log-probs: `first` for sample 0, two sound ones for the others."""
    out = good(rids, version)
    for i, o in enumerate(out):
        lps = first if i == 0 else [-0.5, -0.1]
        o["meta_info"]["output_token_logprobs"] = [[lp, 5, None] for lp in lps]
    return out


def nan_logprob(rids: list[str], version: str | None) -> list[dict[str, Any]]:
    """A NaN behaviour log-prob was taken, and its group completed (for the objective's ratio)."""
    return with_logprobs(rids, version, [math.nan, -0.1])


def positive_logprob(rids: list[str], version: str | None) -> list[dict[str, Any]]:
    """A log-prob above 0 (a probability above 1) was taken: not a log-probability."""
    return with_logprobs(rids, version, [0.5, -0.1])


def absurd_logprob(rids: list[str], version: str | None) -> list[dict[str, Any]]:
    """A finite log-prob no softmax gives (a mask value): its ratio exp(logp + 1e30) is inf."""
    return with_logprobs(rids, version, [-1e30, -0.1])


@pytest.mark.parametrize(
    "answer",
    [
        short,
        reordered,
        odd_version,
        out_of_vocabulary,
        mixed_versions,
        nan_logprob,
        positive_logprob,
        absurd_logprob,
        one_without_logprobs,
    ],
)
def test_a_bad_answer_is_requeued_and_the_group_completes_on_a_good_one(
    tmp_path: Path, tiny_model: Path, answer: Answer
) -> None:
    fake = FakeSGLang(answer, bad_answers=1)
    rig = Rig(tmp_path, fake, base=tiny_model)
    try:
        rig.disp.enqueue(1)
        (gid,) = rig.disp.wait_completed(1, timeout_s=10)
        assert fake.bad_left == 0  # the bad answer was given, and did not complete the group
        (done,) = rig.disp.results([gid])
        assert len(done.samples.completions) == 4
        assert rig.disp.stats.aborted == 1  # requeued once, then completed
        req = rig.loop.world.get("request", gid)
        assert req is not None and req.state == "completed"
    finally:
        rig.close()


class SeedBoundFake(FakeSGLang):
    """Unscorable for as long as it is asked with the seeds of the first `/generate` (as a
    deterministic engine is, at the same weights): only a redraw with other seeds completes."""

    def __init__(self) -> None:
        super().__init__(out_of_vocabulary, bad_answers=0)
        self.seeds: list[list[int]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path != "/generate":
            return super().__call__(request)
        body = json.loads(request.content)
        seeds = [p["sampling_seed"] for p in body["sampling_params"]]
        with self.lock:
            self.seeds.append(seeds)
            answer = out_of_vocabulary if seeds == self.seeds[0] else good
        return httpx.Response(200, json=answer(body["rid"], self.version))


def test_an_unscorable_group_is_redrawn_with_other_seeds(tmp_path: Path, tiny_model: Path) -> None:
    """Requeued with the same seeds, a group whose samples cannot be scored would come back
    the same until the weights change (a hot loop that never completes it); its next attempt
    samples with seeds of its own."""
    fake = SeedBoundFake()
    rig = Rig(tmp_path, fake, base=tiny_model)
    try:
        rig.disp.enqueue(1)
        (gid,) = rig.disp.wait_completed(1, timeout_s=10)
        assert len(fake.seeds) == 2 and fake.seeds[0] != fake.seeds[1], fake.seeds
        assert len(set(fake.seeds[1])) == 4  # still one seed per sample
        assert rig.disp.stats.aborted == 1
        (done,) = rig.disp.results([gid])
        assert len(done.samples.completions) == 4
    finally:
        rig.close()


def test_a_drain_aborts_each_sample_of_a_group_in_flight_by_its_exact_rid(
    tmp_path: Path, tiny_model: Path
) -> None:
    answered = threading.Event()

    def slow(rids: list[str], version: str | None) -> list[dict[str, Any]]:
        answered.wait(10)  # held until the test has drained the engine
        return good(rids, version)

    fake = FakeSGLang(slow, bad_answers=1)
    rig = Rig(tmp_path, fake, base=tiny_model)
    try:
        (gid,) = rig.disp.enqueue(1)
        rig.disp.pump(0.05)
        req = rig.loop.world.get("request", gid)
        assert req is not None and req.state == "dispatched"
        rig.disp.drain_engine("e0")
        deadline = time.monotonic() + 5
        while len(fake.aborts) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fake.aborts == [f"{gid}.1.{i}" for i in range(4)]
    finally:
        answered.set()
        rig.close()


def test_a_failing_reward_stops_the_rollout_naming_its_prompt(
    tmp_path: Path, tiny_model: Path
) -> None:
    # A reward that raises (on_error = "raise") is not a bad answer to requeue forever: the
    # error leaves the dispatcher's turn, so the run stops and names the prompt.
    from ehp_fsm.data.rewards import RewardError

    class FailingReward(ArithmeticTask):
        def score_group(self, group_index: int, *_a: Any, **_k: Any) -> Any:
            q = self.question(group_index)
            raise RewardError(f"the reward raised on prompt {q.text}", "ZeroDivisionError")

    rig = Rig(tmp_path, FakeSGLang(good, bad_answers=0), base=tiny_model)
    rig.disp.task = FailingReward()
    try:
        rig.disp.enqueue(1)
        with pytest.raises(RewardError, match=r"on prompt \d\+\d="):
            rig.disp.wait_completed(1, timeout_s=10)
    finally:
        rig.close()


def test_a_hanging_reward_stops_the_rollout_after_its_time_out(
    tmp_path: Path, tiny_model: Path
) -> None:
    # The reward's call runs on its own thread (`data.rewards._Caller`): a reward that never
    # returns fails as "timed_out" after [reward] timeout_s and stops the rollout, naming the
    # prompt, instead of hanging the run's loop (before: forever, deaf even to SIGTERM).
    from ehp_fsm.data.rewards import Reward, RewardError
    from tests.data import reward_fns

    reward = Reward(fn=reward_fns.hangs, name="hangs", timeout_s=0.3)

    class HangingReward(ArithmeticTask):
        def score_group(self, group_index: int, *_a: Any, **_k: Any) -> Any:
            q = self.question(group_index)
            return reward.score_sync(q.text, "1", "1", {})

    rig = Rig(tmp_path, FakeSGLang(good, bad_answers=0), base=tiny_model)
    rig.disp.task = HangingReward()
    reward_fns.HANG.clear()
    try:
        rig.disp.enqueue(1)
        t0 = time.monotonic()
        with pytest.raises(RewardError, match=r"on prompt '\d\+\d='") as err:
            rig.disp.wait_completed(1, timeout_s=20)
        assert "did not return within 0.3 s" in err.value.why
        assert time.monotonic() - t0 < 10
    finally:
        reward_fns.HANG.set()
        rig.close()


def test_the_log_prob_bounds_keep_noise_and_refuse_what_no_softmax_gives() -> None:
    """Rounding just above 0 and a long-tail token pass; above the ceiling or below the floor
    (and NaN, ±inf) the answer is malformed, naming the token."""
    assert logprob_problem([0.0, LOGPROB_CEILING, -100.0, LOGPROB_FLOOR, 4e-6]) is None
    for bad, why in [
        (LOGPROB_CEILING * 2, "not a log-probability"),
        (LOGPROB_FLOOR * 1.001, "not a log-probability"),
        (math.nan, "not finite"),
        (-math.inf, "not finite"),
    ]:
        problem = logprob_problem([-0.1, bad])
        assert problem is not None and problem.startswith("output_token_logprobs[1] is")
        assert why in problem


class RefusingSGLang(FakeSGLang):
    """Refuses every `/generate` as an engine refuses a request it cannot take (HTTP 400)."""

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path != "/generate":
            return super().__call__(request)
        with self.lock:
            self.bad_left += 1  # counts the refusals
        why = "input_ids contain ids outside the vocabulary: [19]"
        return httpx.Response(400, json={"error": {"message": why}})


def test_a_rollout_the_engines_refuse_says_what_they_said(tmp_path: Path, tiny_model: Path) -> None:
    """A prompt every engine refuses (HTTP 400, e.g. a token outside the model's vocabulary):
    the group was dispatched again and again and the run stopped at `[deadlines.run] rollout`
    saying only "rollout did not produce 4 groups in 300 s" — re-sent at once after each
    refusal, ~1,200 times a second against one engine (12,800 refusals logged in 200 s of a
    real run). The dispatcher keeps the last failure, which the run's error names, and a
    group an engine answered with a failure waits before it is sent again, twice as long
    after each one (at most `dispatch.REFUSED_BACKOFF_MAX_S`)."""
    fake = RefusingSGLang(good, bad_answers=0)
    rig = Rig(tmp_path, fake, base=tiny_model)
    try:
        rig.disp.enqueue(1)
        assert rig.disp.wait_completed(1, timeout_s=2.0) == []  # never completes
        assert 1 <= fake.bad_left <= 20, fake.bad_left  # 0.01 + 0.02 + ... s between them
        said = rig.disp.last_failure
        assert said.startswith("engine e0: ") and "HTTP 400" in said, said
        assert "ids outside the vocabulary: [19]" in said, said
    finally:
        rig.close()


def aborted(rids: list[str], version: str | None) -> list[dict[str, Any]]:
    """Every sample aborted by the engine: a model whose weights hold a NaN (the embedded
    engine's sampler raised "probability tensor contains either `inf`, `nan` or element < 0")."""
    out = good(rids, version)
    for o in out:
        o["meta_info"]["finish_reason"] = {"type": "abort", "message": "RuntimeError('nan')"}
    return out


@pytest.mark.parametrize("answer", [aborted, one_without_logprobs, out_of_vocabulary])
def test_a_group_every_answer_fails_waits_between_its_dispatches(
    tmp_path: Path, tiny_model: Path, answer: Answer
) -> None:
    """An answer that is a failure (every sample aborted, log-probs missing, samples that
    cannot be scored) requeued its group at once: with NaN weights a real run dispatched and
    aborted ~400 groups a second, each logged (67 MB in 190 s), until `[deadlines.run]
    rollout`. It now waits as a refused group does (0.01 s, twice as long after each)."""
    many = 10**6
    fake = FakeSGLang(answer, bad_answers=many)
    rig = Rig(tmp_path, fake, base=tiny_model)
    try:
        rig.disp.enqueue(1)
        assert rig.disp.wait_completed(1, timeout_s=2.0) == []  # never completes
        sent = many - fake.bad_left
        assert 1 <= sent <= 20, sent  # 0.01 + 0.02 + ... s between them
        assert rig.disp.last_failure.startswith("engine e0: "), rig.disp.last_failure
    finally:
        rig.close()
