"""Rewards: "module:callable" resolution with actionable refusals, sync and async callables,
the built-ins, and failures that raise naming the prompt or are counted — never a silent 0."""

from __future__ import annotations

import asyncio
import fractions
import importlib
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from structlog.testing import capture_logs

from ehp_fsm.data import rewards
from ehp_fsm.data.rewards import (
    Reward,
    RewardError,
    RewardFailures,
    RewardInterrupted,
    exact_match,
    make_reward,
    math_answer,
    resolve_reward,
    reward_from_table,
)
from ehp_fsm.errors import PlanError
from tests.data import reward_fns

M = "tests.data.reward_fns"


def test_module_callable_sync_and_async() -> None:
    r = make_reward(f"{M}:length")
    assert r.score_sync("p", "abc", "x", {"bonus": 1}) == 4.0
    a = make_reward(f"{M}:async_match")
    assert a.score_sync("p", "12", "12", {}) == 1.0
    assert asyncio.run(a.score("p", "12", "13", {})) == 0.0
    assert make_reward(f"{M}:Scorers.nested").score_sync("p", "c", "l", {}) == 0.5


@pytest.mark.parametrize(
    ("spec", "needle", "fix"),
    [
        ("no_colon_here", "is not 'module:callable'", "function ="),
        # a built-in's name with a typo: told the name it is close to
        ("exact_matc", "is not 'module:callable'", "did you mean 'exact_match' (a built-in)?"),
        (":fn", "is not 'module:callable'", "function ="),
        ("ehp_fsm_no_such_module:fn", "cannot be imported", "PYTHONPATH"),
        (f"{M}:missing", "has no 'missing'", "after the colon"),
        (f"{M}:NOT_CALLABLE", "is a int, not a callable", "function"),
    ],
)
def test_an_unusable_reward_is_refused_with_what_and_how_to_fix(spec, needle, fix) -> None:
    with pytest.raises(RewardError, match=needle) as err:
        resolve_reward(spec)
    assert fix in err.value.fix


def test_a_module_that_fails_on_import_is_refused_with_its_error(tmp_path, monkeypatch) -> None:
    (tmp_path / "broken_reward_mod.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match="cannot be imported") as err:
        resolve_reward("broken_reward_mod:fn")
    assert "RuntimeError: boom at import" in err.value.why


@pytest.mark.parametrize(
    ("fn", "kind", "why"),
    [
        # where the reward raised is said (there was no traceback anywhere)
        (
            reward_fns.raises,
            "raised",
            "ZeroDivisionError: the reward divided by zero (at "
            f"{reward_fns.__file__}:{reward_fns.raises.__code__.co_firstlineno + 1} in raises)",
        ),
        (reward_fns.exits, "raised", "it called sys.exit(0)"),
        (reward_fns.os_exits, "raised", "it called os._exit(0)"),
        (reward_fns.interrupts, "raised", "it raised KeyboardInterrupt (at "),
        (reward_fns.returns(float("nan")), "non_finite", "nan"),
        (reward_fns.returns(float("inf")), "non_finite", "inf"),
        (reward_fns.returns(None), "not_a_number", "None, a NoneType, not a number"),
        (reward_fns.returns("1.0"), "not_a_number", "'1.0', a str, not a number"),
    ],
)
def test_failures_raise_naming_the_prompt_or_are_counted_as_zero(fn, kind, why) -> None:
    strict = Reward(fn=fn, name="r")
    with pytest.raises(RewardError, match="failed on prompt '7\\+5='") as err:
        strict.score_sync("7+5=", "12", "12", {})
    assert err.value.prompt == "7+5="
    assert why in err.value.why
    assert 'on_error = "zero"' in err.value.fix

    failures = RewardFailures()
    lenient = Reward(fn=fn, name="r", on_error="zero", failures=failures)
    with capture_logs() as logs:
        assert lenient.score_sync("7+5=", "12", "12", {}) == 0.0
        assert lenient.score_sync("1+1=", "2", "2", {}) == 0.0
    assert failures.count == 2
    assert failures.by_kind == {kind: 2}
    assert "1+1=" in failures.last
    assert [e["event"] for e in logs] == ["reward_failed", "reward_failed"]
    assert logs[0]["kind"] == kind


@pytest.mark.parametrize(
    "value",
    [np.float32(0.5), np.int64(1), np.float16(0.5), fractions.Fraction(1, 2), 1, 0.5],
    ids=repr,
)
def test_any_real_number_is_a_score(value) -> None:
    """A reward computed with numpy returns numpy's numbers (np.float32, np.int64 of a sum):
    numbers, as the contract says, not failures (they failed as "not_a_number")."""
    r = Reward(fn=reward_fns.returns(value), name="r")
    score = r.score_sync("p", "c", "l", {})
    assert type(score) is float and score == float(value)
    assert r.score_group_sync("p", ("a", "b"), "l", {}) == [float(value)] * 2


@pytest.mark.parametrize(
    ("value", "kind"),
    [(10**400, "non_finite"), (np.float32("nan"), "non_finite"), (np.bool_(True), "not_a_number")],
    ids=repr,
)
def test_a_number_beyond_a_float_is_a_failure_not_a_crash(value, kind) -> None:
    """An int too large for a float raised OverflowError out of the check (a traceback)."""
    with pytest.raises(RewardError, match="failed on prompt 'p'"):
        Reward(fn=reward_fns.returns(value), name="r").score_sync("p", "c", "l", {})
    lenient = Reward(fn=reward_fns.returns(value), name="r", on_error="zero")
    assert lenient.score_sync("p", "c", "l", {}) == 0.0 and lenient.failures.by_kind == {kind: 1}


@pytest.mark.parametrize("value", [-sys.float_info.max, 1e39], ids=repr)
def test_a_finite_reward_beyond_float32_is_a_failure_not_a_nan_step(value) -> None:
    """A step's batch holds rewards as float32: `-sys.float_info.max` (a "very wrong" score)
    passed as finite, was inf in the batch, made its group's advantages NaN, and the run
    stopped at "the reduced gradient ... holds NaN or Inf", the reward never named."""
    with pytest.raises(RewardError, match=r"beyond ±3\.4028235e\+38") as err:
        Reward(fn=reward_fns.returns(value), name="r").score_group_sync("p", ("a",), "l", {})
    assert "float32" in err.value.why
    lenient = Reward(fn=reward_fns.returns(value), name="r", on_error="zero")
    assert lenient.score_group_sync("p", ("a", "b"), "l", {}) == [0.0, 0.0]
    assert lenient.failures.by_kind == {"non_finite": 2}
    most = float(np.finfo(np.float32).max)  # the largest float32: still a score
    edge = Reward(fn=reward_fns.returns(-most), name="r")
    assert edge.score_group_sync("p", ("a",), "l", {}) == [-most]


def test_a_good_value_is_not_counted_as_a_failure() -> None:
    r = make_reward(f"{M}:length", on_error="zero")
    assert r.score_sync("p", "ab", "l", {}) == 2.0
    assert r.failures.count == 0


def test_unknown_on_error_is_refused() -> None:
    with pytest.raises(RewardError, match="on_error 'ignore'"):
        make_reward("exact_match", on_error="ignore")  # type: ignore[arg-type]


def test_exact_match() -> None:
    assert exact_match("1+1=", " 2\n", "2", {}) == 1.0
    assert exact_match("1+1=", "3", "2", {}) == 0.0
    assert make_reward("exact_match").score_sync("1+1=", "2", "2", {}) == 1.0


def test_math_answer_compares_answers_not_strings() -> None:
    assert math_answer("q", "The answer is $\\frac{1}{2}$", "0.5", {}) == 1.0
    assert math_answer("q", "12", "12", {}) == 1.0
    assert math_answer("q", "13", "12", {}) == 0.0
    assert make_reward("math_answer").score_sync("q", "so $x = 4$", "4", {}) == 1.0


def test_math_answer_runs_outside_the_main_thread() -> None:
    out: list[float] = []
    t = threading.Thread(target=lambda: out.append(math_answer("q", "$2$", "2", {})))
    t.start()
    t.join()
    assert out == [1.0]


def test_math_answer_without_math_verify_says_to_install_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` fail
    with pytest.raises(RewardError, match="needs the math-verify package") as err:
        resolve_reward("math_answer")
    assert "pip install 'ehp-fsm[math]'" in err.value.fix
    with pytest.raises(RewardError, match="math-verify"):
        math_answer("q", "1", "1", {})
    monkeypatch.undo()
    assert importlib.import_module("math_verify")


def test_the_reward_table_is_parsed_and_refused_by_key() -> None:
    r = reward_from_table({"function": f"{M}:length", "on_error": "zero"})
    assert (r.name, r.on_error) == (f"{M}:length", "zero")
    assert reward_from_table({}).name == "exact_match"
    for table, key in (
        ({"fn": "x"}, "reward.fn"),
        ({"function": 3}, "reward.function"),
        ({"on_error": "skip"}, "reward.on_error"),
        ({"timeout_s": 0}, "reward.timeout_s"),
        ({"timeout_s": "60"}, "reward.timeout_s"),
    ):
        with pytest.raises(PlanError) as err:
            reward_from_table(table)
        assert err.value.key == key
    with pytest.raises(RewardError, match="cannot be imported"):
        reward_from_table({"function": "ehp_fsm_no_such_module:f"})


def test_a_module_beside_the_plan_is_found_without_pythonpath(tmp_path) -> None:
    (tmp_path / "beside_plan_reward.py").write_text(
        "def score(prompt, completion, label, metadata):\n    return 0.25\n"
    )
    with pytest.raises(RewardError, match="cannot be imported"):
        resolve_reward("beside_plan_reward:score")
    plan = tmp_path / "plan.toml"
    r = reward_from_table({"function": "beside_plan_reward:score"}, file=str(plan))
    assert r.score_sync("p", "c", "l", {}) == 0.25


def test_a_reward_that_cannot_take_the_four_arguments_is_refused_when_resolved() -> None:
    with pytest.raises(RewardError, match=r"cannot be called as fn\(prompt, completion") as err:
        resolve_reward(f"{M}:two_args")
    assert "two_args(prompt: " in err.value.why and "too many positional" in err.value.why
    assert "four positional parameters" in err.value.fix


def test_a_hanging_reward_times_out_raises_or_counts_and_is_given_up_on() -> None:
    reward_fns.HANG.clear()
    try:
        strict = Reward(fn=reward_fns.hangs, name="h", timeout_s=0.2)
        t0 = time.monotonic()
        with pytest.raises(RewardError, match="failed on prompt '1\\+1='") as err:
            strict.score_sync("1+1=", "2", "2", {})
        assert time.monotonic() - t0 < 5
        assert "did not return within 0.2 s ([reward] timeout_s)" in err.value.why

        lenient = Reward(fn=reward_fns.hangs, name="h", on_error="zero", timeout_s=0.1)
        for _ in range(rewards.MAX_STUCK_CALLS - 1):  # each abandoned call is still running
            assert lenient.score_sync("1+1=", "2", "2", {}) == 0.0
        assert lenient.failures.by_kind == {"timed_out": rewards.MAX_STUCK_CALLS - 1}
        with pytest.raises(RewardError, match=f"hangs: {rewards.MAX_STUCK_CALLS} calls"):
            lenient.score_sync("1+1=", "2", "2", {})
    finally:
        reward_fns.HANG.set()  # the abandoned calls end; their threads were daemons anyway


def test_a_stop_interrupts_a_reward_that_is_still_running() -> None:
    reward_fns.HANG.clear()
    try:
        r = Reward(fn=reward_fns.hangs, name="h", timeout_s=60)
        threading.Timer(0.3, r.interrupt).start()
        t0 = time.monotonic()
        with pytest.raises(RewardInterrupted, match="asked to stop"):
            r.score_sync("1+1=", "2", "2", {})
        assert time.monotonic() - t0 < 5
        with pytest.raises(RewardInterrupted):  # every later call too: the run is stopping
            r.score_sync("1+1=", "2", "2", {})
    finally:
        reward_fns.HANG.set()


def test_a_finished_call_after_an_abandoned_one_gets_its_own_answer() -> None:
    """The abandoned call's thread never takes a later call: each answer is its own call's."""
    gate = threading.Event()
    seen: list[str] = []

    def fn(prompt: str, completion: str, label: str, metadata: object) -> float:
        seen.append(prompt)
        if prompt == "slow":
            gate.wait(30)
            return 5.0
        return float(len(prompt))

    r = Reward(fn=fn, name="f", on_error="zero", timeout_s=0.2)
    assert r.score_sync("slow", "", "", {}) == 0.0  # timed out
    gate.set()
    assert [r.score_sync(p, "", "", {}) for p in ("a", "bbb")] == [1.0, 3.0]
    assert r.failures.by_kind == {"timed_out": 1}


# -- groups: one hand-over for a prompt's n completions, each still judged alone --------------


def _by_completion(prompt: str, completion: str, label: str, metadata: object) -> object:
    """The completion says what to do: "sleep:S" sleeps S seconds then scores 1, "wait" waits
    for the test's gate, "raise" raises, anything else is returned as a float."""
    if completion.startswith("sleep:"):
        time.sleep(float(completion[6:]))
        return 1.0
    if completion == "wait":
        reward_fns.HANG.wait(30)
        return 9.0
    if completion == "raise":
        raise ValueError("no answer in it")
    return float(completion)


def _counting_handovers(r: Reward, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the calls handed to the reward's thread (each one is one hand-over)."""
    handed: list[int] = []
    call = r._caller.call

    def counted(c: rewards._Call, timeout_s: float) -> int | None:
        handed.append(len(c.completions))
        return call(c, timeout_s)

    monkeypatch.setattr(r._caller, "call", counted)
    return handed


def test_a_group_is_scored_in_order_in_one_handover(monkeypatch) -> None:
    seen: list[tuple[str, str]] = []

    def fn(prompt: str, completion: str, label: str, metadata: object) -> float:
        seen.append((completion, threading.current_thread().name))
        return float(completion) + float(label)

    r = Reward(fn=fn, name="f")
    handed = _counting_handovers(r, monkeypatch)
    assert r.score_group_sync("p", ["1", "2", "3", "4"], "10", {}) == [11.0, 12.0, 13.0, 14.0]
    assert handed == [4]
    assert seen == [(c, "reward") for c in "1234"]  # in order, on the reward's thread
    assert r.score_group_sync("p", [], "0", {}) == []  # an empty group: nothing to call


def test_the_time_out_is_each_completions_not_the_groups() -> None:
    # 4 completions of 0.15 s: the group takes 0.6 s, past timeout_s, but none is late
    r = Reward(fn=_by_completion, name="f", timeout_s=0.4)
    assert r.score_group_sync("1+1=", ["sleep:0.15"] * 4, "", {}) == [1.0] * 4


def test_a_slow_completion_in_the_middle_times_out_naming_prompt_and_completion() -> None:
    reward_fns.HANG.clear()
    try:
        strict = Reward(fn=_by_completion, name="f", timeout_s=0.2)
        t0 = time.monotonic()
        with pytest.raises(
            RewardError, match=r"failed on prompt '1\+1=' \(completion 3 of 5: 'wait'\)"
        ) as err:
            strict.score_group_sync("1+1=", ["1", "0.5", "wait", "1", "1"], "", {})
        assert time.monotonic() - t0 < 5
        assert (err.value.prompt, err.value.completion) == ("1+1=", 2)
        assert "did not return within 0.2 s ([reward] timeout_s)" in err.value.why
    finally:
        reward_fns.HANG.set()


def test_under_on_error_zero_only_the_failing_completion_scores_zero(monkeypatch) -> None:
    """The rest of the group keeps its scores, those after a late one included (scored by a
    fresh thread in a second hand-over); each failure is counted once, naming its completion."""
    reward_fns.HANG.clear()
    try:
        r = Reward(fn=_by_completion, name="f", on_error="zero", timeout_s=0.2)
        handed = _counting_handovers(r, monkeypatch)
        with capture_logs() as logs:
            got = r.score_group_sync("2+2=", ["1", "wait", "0.5", "raise", "nan", "0.25"], "", {})
        assert got == [1.0, 0.0, 0.5, 0.0, 0.0, 0.25]
        assert handed == [6, 4]  # the second hand-over: the completions after the late one
        assert r.failures.by_kind == {"timed_out": 1, "raised": 1, "non_finite": 1}
        assert "prompt '2+2=' (completion 5 of 6: 'nan')" in r.failures.last
        assert [e["completion"] for e in logs] == [1, 3, 4]
    finally:
        reward_fns.HANG.set()


@pytest.mark.parametrize(
    ("bad", "needle"),
    [("raise", "ValueError: no answer in it"), ("inf", "returned inf")],
)
def test_a_failure_in_a_group_raises_naming_its_completion_and_stops_scoring(
    bad: str, needle: str
) -> None:
    seen: list[str] = []

    def fn(prompt: str, completion: str, label: str, metadata: object) -> object:
        seen.append(completion)
        return _by_completion(prompt, completion, label, metadata)

    r = Reward(fn=fn, name="f")
    with pytest.raises(RewardError, match=r"on prompt 'q' \(completion 2 of 3") as err:
        r.score_group_sync("q", ["1", bad, "1"], "", {})
    assert needle in err.value.why and err.value.completion == 1
    if bad == "raise":
        assert seen == ["1", "raise"]  # on_error = "raise": the rest of the group is not scored


def test_a_group_of_an_async_reward_runs_on_one_event_loop() -> None:
    loops: set[int] = set()

    async def fn(prompt: str, completion: str, label: str, metadata: object) -> float:
        loops.add(id(asyncio.get_running_loop()))
        return await reward_fns.async_match(prompt, completion, label, {})

    r = Reward(fn=fn, name="a", on_error="zero")
    assert r.score_group_sync("p", ["12", "13", "12"], "12", {}) == [1.0, 0.0, 1.0]
    assert len(loops) == 1
    a = make_reward(f"{M}:async_match")
    assert a.score_group_sync("p", ["x", "12"], "12", {}) == [0.0, 1.0]


def test_a_stop_interrupts_a_group_in_its_middle() -> None:
    reward_fns.HANG.clear()
    try:
        r = Reward(fn=_by_completion, name="f", timeout_s=60)
        threading.Timer(0.3, r.interrupt).start()
        t0 = time.monotonic()
        with pytest.raises(RewardInterrupted, match="asked to stop"):
            r.score_group_sync("1+1=", ["1", "wait", "1"], "", {})
        assert time.monotonic() - t0 < 5
    finally:
        reward_fns.HANG.set()


def test_a_group_of_hanging_completions_is_given_up_on_after_max_stuck_calls() -> None:
    reward_fns.HANG.clear()
    try:
        r = Reward(fn=_by_completion, name="f", on_error="zero", timeout_s=0.1)
        n = rewards.MAX_STUCK_CALLS
        with pytest.raises(RewardError, match=f"hangs: {n} calls") as err:
            r.score_group_sync("1+1=", ["wait"] * (n + 2), "", {})
        assert f"the last on prompt '1+1=' (completion {n} of {n + 2}" in err.value.why
        assert r.failures.by_kind == {"timed_out": n - 1}
    finally:
        reward_fns.HANG.set()


def test_an_abandoned_call_scores_nothing_more_and_its_thread_ends() -> None:
    gate = threading.Event()
    seen: list[str] = []
    slow_thread: list[threading.Thread] = []

    def fn(prompt: str, completion: str, label: str, metadata: object) -> float:
        seen.append(completion)
        if completion == "slow":
            slow_thread.append(threading.current_thread())
            gate.wait(30)
        return 1.0

    r = Reward(fn=fn, name="f", on_error="zero", timeout_s=0.2)
    assert r.score_group_sync("p", ["a", "slow", "b", "c"], "", {}) == [1.0, 0.0, 1.0, 1.0]
    gate.set()
    slow_thread[0].join(5)
    assert not slow_thread[0].is_alive()  # it went back to no queue: it ended
    assert seen == ["a", "slow", "b", "c"]  # "b" and "c" once each: by the fresh thread only


def test_a_module_beside_the_plan_is_found_and_one_a_standard_module_hides_is_named(
    tmp_path, monkeypatch
) -> None:
    """The plan's folder is searched after the standard library: `code.py` there imported
    Python's `code`, refused as "has no 'score'. Fix: check the name after the colon"."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # resolve_reward appends the folder
    body = "def score(prompt, completion, label, metadata):\n    return 1.0\n"
    (tmp_path / "beside_the_plan_reward.py").write_text(body)
    (tmp_path / "code.py").write_text(body)
    try:
        fn = resolve_reward("beside_the_plan_reward:score", folder=tmp_path)
        assert fn("p", "c", "l", {}) == 1.0
        with pytest.raises(RewardError, match="is not the plan's") as err:
            resolve_reward("code:score", folder=tmp_path)
        assert "rename code.py" in err.value.fix and str(tmp_path / "code.py") in err.value.what
    finally:
        sys.modules.pop("beside_the_plan_reward", None)


def test_a_reward_importing_a_name_too_long_for_a_file_is_refused_not_a_crash(
    tmp_path: Path,
) -> None:
    """A reward module whose `import <300 letters>` fails: looking for a helper of that name
    beside the plan (`_hidden_helper`) raised OSError ("File name too long") — a traceback
    from `check` in place of the refusal naming the module and the failed import."""
    import uuid

    name = f"ehp_long_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        f"import {'a' * 300}\n\ndef score(p, c, l, m):\n    return 1.0\n"
    )
    try:
        with pytest.raises(RewardError, match=f"reward module '{name}' cannot be imported"):
            resolve_reward(f"{name}:score", folder=tmp_path)
    finally:
        sys.modules.pop(name, None)
        if str(tmp_path) in sys.path:
            sys.path.remove(str(tmp_path))
