"""Rewards: "module:callable" resolution with actionable refusals, sync and async callables,
the built-ins, and failures that raise naming the prompt or are counted — never a silent 0."""

from __future__ import annotations

import asyncio
import importlib
import sys
import threading
import time

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
        (reward_fns.raises, "raised", "ZeroDivisionError: the reward divided by zero"),
        (reward_fns.returns(float("nan")), "non_finite", "nan"),
        (reward_fns.returns(float("inf")), "non_finite", "inf"),
        (reward_fns.returns(None), "not_a_number", "None"),
        (reward_fns.returns("1.0"), "not_a_number", "'1.0'"),
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
