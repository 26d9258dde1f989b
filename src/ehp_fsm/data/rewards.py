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
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from queue import SimpleQueue
from typing import Any, Literal, get_args

import structlog

from ehp_fsm.errors import EhpError, PlanError, toml_key

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


class RewardInterrupted(RewardError):
    """A stop was asked for (`Reward.interrupt`) while a reward call was still running."""


#: A call of the reward that has not returned after this long fails ("timed_out").
DEFAULT_TIMEOUT_S = 60.0
#: Abandoned calls still running at once before the reward is given up on, whatever on_error.
MAX_STUCK_CALLS = 4
_POLL_S = 0.25  # how often a wait for the reward looks for a stop


class _Call:
    """One reward call: its arguments, then its outcome once `done` is set."""

    __slots__ = ("args", "done", "error", "value")

    def __init__(self, args: tuple[str, str, str, Mapping[str, Any]]) -> None:
        self.args = args
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


class _Caller:
    """Runs the user's reward on a daemon thread, so the run waits for it with a time-out and
    can still stop: a reward that hangs would otherwise hang the whole run, deaf even to
    SIGTERM (the loop that scores is the run's main loop). A call past its time-out is
    abandoned, never joined: its thread keeps its own queue (it can never take a later call)
    and dies with the process; the next call gets a fresh thread. Calls are sequential, as
    before — only where they run changed."""

    def __init__(self, fn: RewardFn) -> None:
        self.fn = fn
        # a plain flag, not an Event: `Reward.interrupt` runs in a signal handler, which may run
        # again inside itself, and Event.set() would wait on the lock its outer call holds
        self.interrupted = False
        self._queue: SimpleQueue[_Call] | None = None
        self._abandoned: list[_Call] = []

    def stuck(self) -> int:
        """Abandoned calls that are still running."""
        self._abandoned = [c for c in self._abandoned if not c.done.is_set()]
        return len(self._abandoned)

    def call(self, args: tuple[str, str, str, Mapping[str, Any]], timeout_s: float) -> _Call:
        """The finished call, or the unfinished one (`done` not set) after `timeout_s`.
        Raises `RewardInterrupted` when `interrupted` is set while it waits."""
        if self._queue is None:
            self._queue = SimpleQueue()
            threading.Thread(
                target=self._serve, args=(self._queue,), name="reward", daemon=True
            ).start()
        c = _Call(args)
        self._queue.put(c)
        deadline = time.monotonic() + timeout_s
        while not c.done.wait(min(_POLL_S, max(0.0, deadline - time.monotonic()))):
            if self.interrupted:
                self._abandon(c)
                raise RewardInterrupted(
                    "the run was asked to stop while the reward was still running",
                    "its call was abandoned",
                    "",
                )
            if time.monotonic() >= deadline:
                self._abandon(c)
                break
        return c

    def _abandon(self, c: _Call) -> None:
        self._abandoned.append(c)
        self._queue = None  # its thread is busy with `c`: the next call starts another

    def _serve(self, queue: SimpleQueue[_Call]) -> None:
        while True:
            c = queue.get()
            try:
                value: Any = self.fn(*c.args)
                if inspect.isawaitable(value):
                    value = asyncio.run(_awaited(value))
                c.value = value
            except BaseException as exc:  # the user's function may raise anything
                c.error = exc
            c.done.set()


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


def resolve_reward(spec: str, *, folder: Path | None = None) -> RewardFn:
    """A built-in's name, or "module:callable" (dots allowed after the colon for attributes of
    attributes). Refuses what cannot be imported or called as a reward, saying what and how to
    fix it. `folder` (the plan's): a module there is found as a script's neighbour is — the
    folder goes on `sys.path`, so `my_rewards.py` beside the plan needs no PYTHONPATH."""
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
    if folder is not None and str(folder) not in sys.path:
        sys.path.append(str(folder))  # after the installed packages: it never shadows one
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # an import can fail with anything the module raises
        where = f"the plan's folder ({folder}), " if folder is not None else ""
        raise RewardError(
            f"reward module {module_name!r} cannot be imported",
            f"{type(exc).__name__}: {exc}",
            f"check the module name, that it is in {where}PYTHONPATH or installed, and that "
            "it imports cleanly (`python -c 'import " + module_name + "'`)",
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
    _check_signature(spec, obj)
    return obj  # type: ignore[no-any-return]


def _check_signature(spec: str, fn: Any) -> None:
    """Refuse a callable that cannot take (prompt, completion, label, metadata) now, rather
    than at the first completion, minutes into the run."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: its call will tell
        return
    try:
        sig.bind("prompt", "completion", "label", {})
    except TypeError as exc:
        raise RewardError(
            f"reward {spec!r} cannot be called as fn(prompt, completion, label, metadata)",
            f"its signature is {spec.partition(':')[2] or spec}{sig} ({exc})",
            "give it the four positional parameters (prompt, completion, label, metadata)",
        ) from None


def _shown(prompt: str) -> str:
    return prompt if len(prompt) <= _PROMPT_SHOWN else prompt[:_PROMPT_SHOWN] + "…"


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
    timeout_s: float = DEFAULT_TIMEOUT_S
    _caller: _Caller = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.on_error not in ON_ERROR:
            raise RewardError(
                f"on_error {self.on_error!r} is unknown", "", f"use one of {list(ON_ERROR)}"
            )
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise RewardError(f"timeout_s {self.timeout_s!r} is not > 0", "", "use e.g. 60")
        object.__setattr__(self, "_caller", _Caller(self.fn))

    def interrupt(self) -> None:
        """Stop waiting for the reward: the call running now (and every later one) raises
        `RewardInterrupted`. Safe from a signal handler (it takes no lock)."""
        self._caller.interrupted = True

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
        """For synchronous callers with no running event loop (the run's dispatcher). The call
        runs on the reward's thread (`_Caller`; the hand-over costs ~20 µs a completion here)
        and fails as "timed_out" after `timeout_s`. There a plain function is just called (an
        event loop per completion, `asyncio.run`, cost ~1 ms each, most of the scoring time of
        a run with a sync reward); only an awaitable result is run with `asyncio.run`."""
        caller = self._caller
        if caller.interrupted:
            raise RewardInterrupted("the run was asked to stop", "", "")
        c = caller.call((prompt, completion, label, metadata), self.timeout_s)
        if not c.done.is_set():
            stuck = caller.stuck()
            if stuck >= MAX_STUCK_CALLS:
                raise RewardError(
                    f"reward {self.name} hangs: {stuck} calls are still running, each past "
                    f"its {self.timeout_s:g} s",
                    f"the last on prompt {_shown(prompt)!r}",
                    "fix the reward function (or raise [reward] timeout_s if it is just slow)",
                    prompt=prompt,
                )
            why = f"it did not return within {self.timeout_s:g} s ([reward] timeout_s)"
            return self._failed(prompt, "timed_out", why, None)
        if isinstance(c.error, Exception):
            exc = c.error
            return self._failed(prompt, "raised", f"{type(exc).__name__}: {exc}", exc)
        if c.error is not None:  # SystemExit, KeyboardInterrupt raised by the reward itself
            raise c.error
        return self._checked(prompt, c.value)

    def _checked(self, prompt: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return self._failed(prompt, "not_a_number", f"it returned {value!r}", None)
        if not math.isfinite(value):
            return self._failed(prompt, "non_finite", f"it returned {value!r}", None)
        return float(value)

    def _failed(self, prompt: str, kind: str, why: str, exc: BaseException | None) -> float:
        shown = _shown(prompt)
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
    folder: Path | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Reward:
    """Resolve `function` (see `resolve_reward`) into a `Reward` with its failure policy."""
    return Reward(
        fn=resolve_reward(function, folder=folder),
        name=function,
        on_error=on_error,
        timeout_s=timeout_s,
        failures=failures if failures is not None else RewardFailures(),
    )


def reward_from_table(table: Mapping[str, Any], *, file: str = "") -> Reward:
    """A plan's `[reward]` table (`function`, `on_error`, `timeout_s`), every key used or
    refused with its key path; the function is resolved now, so a bad one stops the run before
    it starts."""
    for key in table:
        if key not in ("function", "on_error", "timeout_s"):
            raise PlanError(
                f"reward.{toml_key(key)}",
                "it is not a [reward] key",
                "use function, on_error and timeout_s",
                path=file,
            )
    function = table.get("function", "exact_match")
    on_error = table.get("on_error", "raise")
    timeout_s = table.get("timeout_s", DEFAULT_TIMEOUT_S)
    if not isinstance(function, str):
        raise PlanError("reward.function", f"it is {function!r}", 'write "module:callable"')
    if on_error not in ON_ERROR:
        raise PlanError("reward.on_error", f"it is {on_error!r}", f"use one of {list(ON_ERROR)}")
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, int | float)
        or not (math.isfinite(timeout_s) and timeout_s > 0)
    ):
        raise PlanError("reward.timeout_s", f"it is {timeout_s!r}", "use seconds > 0, e.g. 60")
    return make_reward(
        function,
        on_error=on_error,
        folder=Path(file).parent if file else None,
        timeout_s=float(timeout_s),
    )
