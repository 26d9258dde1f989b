"""Rewards: "module:callable" resolution with actionable refusals, sync and async callables,
the built-ins, and failures that raise naming the prompt or are counted — never a silent 0."""

from __future__ import annotations

import asyncio
import importlib
import sys
import threading

import pytest
from structlog.testing import capture_logs

from ehp_fsm.data.rewards import (
    Reward,
    RewardError,
    RewardFailures,
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
    ):
        with pytest.raises(PlanError) as err:
            reward_from_table(table)
        assert err.value.key == key
    with pytest.raises(RewardError, match="cannot be imported"):
        reward_from_table({"function": "ehp_fsm_no_such_module:f"})
