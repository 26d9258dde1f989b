"""Reward functions: `[reward] function = "module:callable"` (or a built-in's name), resolved
once before a run starts, called for every completion.

The calling convention: `fn(prompt, completion, label, metadata) -> float`, positionally —
the raw prompt string, the completion's decoded text, the example's label (a string) and its
metadata (the other keys of its JSONL line). `fn` may be a plain function or an `async def`
(awaited; a sync function that returns an awaitable is awaited too).

Built-ins:
* `exact_match` — 1.0 when the completion, stripped, equals the label, stripped; else 0.0.
* `math_answer` — 1.0 when `math_verify` finds the completion's final answer equal to the label
  (LaTeX, fractions, numbers); needs the optional extra: `pip install 'ehp-fsm[math]'`.
  Its parse/verify timeouts use SIGALRM, which only the main thread may set: in any other
  thread it runs without them.

Failures are never a silent zero. A reward that raises, or returns something that is not a
finite number, raises `RewardError` naming the prompt — unless `on_error = "zero"`, in which
case the failure is counted in the `RewardFailures` the caller passes (reported with the step's
metrics), logged with structlog, and scored 0.0.

What it does not know: datasets, engines, advantages (rewards become advantages elsewhere).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import threading
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import structlog

from ehp_fsm.errors import EhpError, PlanError

OnError = Literal["raise", "zero"]
ON_ERROR: tuple[str, ...] = get_args(OnError)
RewardFn = Callable[[str, str, str, Mapping[str, Any]], float | Awaitable[float]]
_PROMPT_SHOWN = 80

_log = structlog.get_logger("ehp_fsm.rewards")


class RewardError(EhpError):
    """A reward cannot be resolved, or failed on a completion (`prompt` is set then)."""

    def __init__(self, what: str, why: str = "", fix: str = "", *, prompt: str | None = None):
        self.prompt = prompt
        super().__init__(what, why, fix)


def exact_match(prompt: str, completion: str, label: str, metadata: Mapping[str, Any]) -> float:
    """1.0 if the stripped completion equals the stripped label, else 0.0."""
    return 1.0 if completion.strip() == str(label).strip() else 0.0


def _math_verify() -> Any:
    try:
        return importlib.import_module("math_verify")
    except ImportError as exc:
        raise RewardError(
            "the math_answer reward needs the math-verify package",
            f"it cannot be imported ({exc})",
            "install the extra: pip install 'ehp-fsm[math]'",
        ) from exc


def math_answer(prompt: str, completion: str, label: str, metadata: Mapping[str, Any]) -> float:
    """1.0 if math_verify judges the completion's answer equal to the label, else 0.0."""
    mv = _math_verify()
    main = threading.current_thread() is threading.main_thread()
    timeout = 5 if main else None  # SIGALRM-based: main thread only
    gold = mv.parse(str(label), parsing_timeout=timeout)
    answer = mv.parse(completion, parsing_timeout=timeout)
    return 1.0 if mv.verify(gold, answer, timeout_seconds=timeout) else 0.0


BUILTINS: dict[str, RewardFn] = {"exact_match": exact_match, "math_answer": math_answer}


def resolve_reward(spec: str) -> RewardFn:
    """A built-in's name, or "module:callable" (dots allowed after the colon for attributes of
    attributes). Refuses what cannot be imported or called, saying what and how to fix it."""
    if spec in BUILTINS:
        if spec == "math_answer":
            _math_verify()  # refuse now, not at the first completion
        return BUILTINS[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise RewardError(
            f"reward function {spec!r} is not 'module:callable'",
            f"it is neither that nor a built-in ({', '.join(sorted(BUILTINS))})",
            'write e.g. function = "my_rewards:score" with my_rewards importable',
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # an import can fail with anything the module raises
        raise RewardError(
            f"reward module {module_name!r} cannot be imported",
            f"{type(exc).__name__}: {exc}",
            "check the module name, that it is on PYTHONPATH (or installed), and that it "
            "imports cleanly (`python -c 'import " + module_name + "'`)",
        ) from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RewardError(
                f"reward module {module_name!r} has no {attr!r}",
                f"{part!r} is not an attribute of {obj!r}",
                "check the name after the colon",
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardError(
            f"reward {spec!r} is a {type(obj).__name__}, not a callable",
            "a reward is called as fn(prompt, completion, label, metadata)",
            "point at a function",
        )
    return obj  # type: ignore[no-any-return]


async def _awaited(value: Awaitable[Any]) -> Any:
    """`asyncio.run` takes a coroutine; an async reward may return any awaitable."""
    return await value


@dataclass
class RewardFailures:
    """Failures scored 0.0 under `on_error = "zero"`: how many, of which kind, the last one."""

    count: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    last: str = ""

    def add(self, kind: str, message: str) -> None:
        self.count += 1
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1
        self.last = message


@dataclass(frozen=True)
class Reward:
    """A resolved reward with its failure policy. `score` (async) and `score_sync` return the
    float; failures raise `RewardError` or, under `on_error = "zero"`, count and return 0.0."""

    fn: RewardFn
    name: str
    on_error: OnError = "raise"
    failures: RewardFailures = field(default_factory=RewardFailures)

    def __post_init__(self) -> None:
        if self.on_error not in ON_ERROR:
            raise RewardError(
                f"on_error {self.on_error!r} is unknown", "", f"use one of {list(ON_ERROR)}"
            )

    async def score(
        self, prompt: str, completion: str, label: str, metadata: Mapping[str, Any]
    ) -> float:
        try:
            value: Any = self.fn(prompt, completion, label, metadata)
            if inspect.isawaitable(value):
                value = await value
        except Exception as exc:  # the user's function may raise anything
            return self._failed(prompt, "raised", f"{type(exc).__name__}: {exc}", exc)
        return self._checked(prompt, value)

    def score_sync(
        self, prompt: str, completion: str, label: str, metadata: Mapping[str, Any]
    ) -> float:
        """For synchronous callers with no running event loop. A plain function is just
        called: an event loop per completion (`asyncio.run`) cost ~1 ms each, most of the
        scoring time of a run with a sync reward. Only an awaitable result is run to
        completion with `asyncio.run`."""
        try:
            value: Any = self.fn(prompt, completion, label, metadata)
            if inspect.isawaitable(value):
                value = asyncio.run(_awaited(value))
        except Exception as exc:  # the user's function may raise anything
            return self._failed(prompt, "raised", f"{type(exc).__name__}: {exc}", exc)
        return self._checked(prompt, value)

    def _checked(self, prompt: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return self._failed(prompt, "not_a_number", f"it returned {value!r}", None)
        if not math.isfinite(value):
            return self._failed(prompt, "non_finite", f"it returned {value!r}", None)
        return float(value)

    def _failed(self, prompt: str, kind: str, why: str, exc: BaseException | None) -> float:
        shown = prompt if len(prompt) <= _PROMPT_SHOWN else prompt[:_PROMPT_SHOWN] + "…"
        if self.on_error == "raise":
            raise RewardError(
                f"reward {self.name} failed on prompt {shown!r}",
                why,
                'fix the reward function, or set on_error = "zero" to count such failures '
                "and score them 0.0",
                prompt=prompt,
            ) from exc
        self.failures.add(kind, f"prompt {shown!r}: {why}")
        _log.warning("reward_failed", reward=self.name, kind=kind, prompt=shown, why=why)
        return 0.0


def make_reward(
    function: str = "exact_match",
    *,
    on_error: OnError = "raise",
    failures: RewardFailures | None = None,
) -> Reward:
    """Resolve `function` (see `resolve_reward`) into a `Reward` with its failure policy."""
    return Reward(
        fn=resolve_reward(function),
        name=function,
        on_error=on_error,
        failures=failures if failures is not None else RewardFailures(),
    )


def reward_from_table(table: Mapping[str, Any], *, file: str = "") -> Reward:
    """A plan's `[reward]` table (`function`, `on_error`), every key used or refused with its
    key path; the function is resolved now, so a bad one stops the run before it starts."""
    for key in table:
        if key not in ("function", "on_error"):
            raise PlanError(
                f"reward.{key}", "it is not a [reward] key", "use function and on_error", path=file
            )
    function = table.get("function", "exact_match")
    on_error = table.get("on_error", "raise")
    if not isinstance(function, str):
        raise PlanError("reward.function", f"it is {function!r}", 'write "module:callable"')
    if on_error not in ON_ERROR:
        raise PlanError("reward.on_error", f"it is {on_error!r}", f"use one of {list(ON_ERROR)}")
    return make_reward(function, on_error=on_error)
