"""Reward functions: `[reward] function = "module:callable"` (or a built-in's name), resolved
once before a run starts, called for every completion.

The calling convention: `fn(prompt, completion, label, metadata) -> float`, positionally —
the raw prompt string, the completion's decoded text, the example's label (a string) and its
metadata (the other keys of its JSONL line; each call gets its own copy, so a reward may change
it without touching any other call). `fn` may be a plain function or an `async def`
(awaited; a sync function that returns an awaitable is awaited too).

Built-ins:
* `exact_match` — 1.0 when the completion, stripped, equals the label, stripped; else 0.0.
* `math_answer` — 1.0 when `math_verify` finds the completion's final answer equal to the label
  (LaTeX, fractions, numbers); needs the optional extra: `pip install 'ehp-fsm[math]'`.
  Its parse/verify timeouts use SIGALRM, which only the main thread may set: in any other
  thread it runs without them.

The run scores a prompt's group of n completions in one call, `Reward.score_group_sync`: the
group goes to the reward's thread in one hand-over, and the reward is called once per
completion there, one after another. Every completion is still judged alone, as if scored by
itself:

* `[reward] timeout_s` is each completion's budget: its call of the reward fails as
  "timed_out" once it has run that long (measured from when that call started, not from the
  group's start), so a group of n may take up to n × `timeout_s`. The late call is abandoned;
  the completions after it are scored on a fresh thread.
* Failures are never a silent zero. A reward that raises, returns something that is not a
  finite number (or one beyond ±`MOST`, float32's range: a bound on what a step trains
  with, kept now that a step's batch holds rewards in float64), or times out raises
  `RewardError` naming the prompt and, in a group of more than one, which completion (its
  place and the start of its text) — unless
  `on_error = "zero"`, in which case only that completion scores 0.0 and the rest of its group
  keep their scores (as when each completion was handed over alone); the failure is counted in
  the `RewardFailures` the caller passes (one count per failing completion, reported with the
  step's metrics) and logged with structlog.
* After `MAX_STUCK_CALLS` abandoned calls still running, the reward is given up on whatever
  `on_error` says; `Reward.interrupt` (SIGTERM) makes the wait raise `RewardInterrupted` at
  once.

What it does not know: datasets, engines, advantages (rewards become advantages elsewhere).
"""

from __future__ import annotations

import asyncio
import copy
import difflib
import functools
import importlib
import inspect
import json
import math
import numbers
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from queue import SimpleQueue
from typing import Any, Literal, get_args

import structlog

from ehp_fsm.data.dataset import PromptValue
from ehp_fsm.data.import_watch import ExitCalled, exit_refused, watched_import
from ehp_fsm.errors import EhpError, PlanError, toml_key
from ehp_fsm.fspaths import path_kind

OnError = Literal["raise", "zero"]
ON_ERROR: tuple[str, ...] = get_args(OnError)
RewardFn = Callable[[PromptValue, str, str, Mapping[str, Any]], float | Awaitable[float]]
#: The largest reward magnitude: a step's batch holds rewards as float32, and a finite float
#: beyond its range (`-sys.float_info.max` as a "very wrong" score) became inf there, its
#: group's advantages NaN, and the run stopped at "the reduced gradient ... holds NaN or Inf".
MOST: float = 3.4028234663852886e38
_PROMPT_SHOWN = 80
_COMPLETION_SHOWN = 40

_log = structlog.get_logger("ehp_fsm.rewards")


class RewardError(EhpError):
    """A reward cannot be resolved, or failed on a completion (`prompt` and `completion` are
    set then)."""

    def __init__(
        self,
        what: str,
        why: str = "",
        fix: str = "",
        *,
        prompt: str | None = None,
        completion: int | None = None,
    ):
        self.prompt = prompt
        self.completion = completion  # its index in the prompt's group, counted from 0
        super().__init__(what, why, fix)


class RewardInterrupted(RewardError):
    """A stop was asked for (`Reward.interrupt`) while a reward call was still running."""


#: A call of the reward that has not returned after this long fails ("timed_out").
DEFAULT_TIMEOUT_S = 60.0
#: Abandoned calls still running at once before the reward is given up on, whatever on_error.
MAX_STUCK_CALLS = 4
_POLL_S = 0.25  # how often a wait for the reward looks for a stop


class _Call:
    """One hand-over to the reward's thread: the completions of one prompt, scored in order.
    The thread appends each completion's `(value, error)` to `outcomes`, keeps `running` at the
    `(index, start time)` of the one it is scoring, and sets `done` when it is finished with
    the call; the waiter sets `abandoned` when it gives up on it."""

    __slots__ = (
        "abandoned",
        "completions",
        "done",
        "label",
        "metadata",
        "outcomes",
        "prompt",
        "running",
        "stop_on_error",
    )

    def __init__(
        self,
        prompt: PromptValue,
        completions: tuple[str, ...],
        label: str,
        metadata: Mapping[str, Any],
        *,
        stop_on_error: bool,
    ) -> None:
        self.prompt = prompt
        self.completions = completions
        self.label = label
        self.metadata = metadata
        self.stop_on_error = stop_on_error
        self.done = threading.Event()
        self.outcomes: list[tuple[Any, BaseException | None]] = []
        self.running: tuple[int, float] = (0, 0.0)  # one tuple: read untorn; set by `call`
        self.abandoned = False


class _Caller:
    """Runs the user's reward on a daemon thread, so the run waits for it with a time-out and
    can still stop: a reward that hangs would otherwise hang the whole run, deaf even to
    SIGTERM (the loop that scores is the run's main loop).

    One hand-over per group (`_Call`), not per completion: a hand-over costs the loop ~25 µs
    (more on a loaded machine), a trivial reward ~0.1 µs (`benchmarks/reward_handover.py`).
    The time-out is still each completion's own — its call of the reward has `timeout_s` from
    when it starts — checked by the waiter against `running`, so a group of n may take up to
    n × `timeout_s`. A call past
    its time-out is abandoned, never joined: its thread scores no further completion of it,
    keeps its own queue (it can never take a later call) and ends once the late completion
    returns (or with the process); the next call gets a fresh thread. Completions are scored
    one after another, as before — only where they run changed."""

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

    def call(self, c: _Call, timeout_s: float) -> int | None:
        """Hand `c` over and wait until its thread is done with it (None), or until one of its
        completions has run `timeout_s` without returning: that completion's index then, and
        `c` is abandoned. Raises `RewardInterrupted` when `interrupted` is set while it waits."""
        if self._queue is None:
            self._queue = SimpleQueue()
            threading.Thread(
                target=self._serve, args=(self._queue,), name="reward", daemon=True
            ).start()
        c.running = (0, time.monotonic())
        self._queue.put(c)
        while True:
            left = c.running[1] + timeout_s - time.monotonic()
            if c.done.wait(min(_POLL_S, max(0.0, left))):
                return None
            if self.interrupted:
                self._abandon(c)
                raise RewardInterrupted(
                    "the run was asked to stop while the reward was still running",
                    "its call was abandoned",
                    "",
                )
            index, started = c.running  # read again: it may have moved on while we waited
            if time.monotonic() >= started + timeout_s and not c.done.is_set():
                self._abandon(c)
                return index

    def _abandon(self, c: _Call) -> None:
        c.abandoned = True
        self._abandoned.append(c)
        self._queue = None  # its thread is busy with `c`: the next call starts another

    def _serve(self, queue: SimpleQueue[_Call]) -> None:
        with exit_refused():  # the reward's os._exit is its failure, not the run's end
            while True:
                c = queue.get()
                self._score(c)
                c.done.set()
                if c.abandoned:
                    return  # nobody hands this queue anything any more

    def _score(self, c: _Call) -> None:
        """Each completion of `c` in order, until one fails with `stop_on_error` set (or with a
        BaseException: SystemExit, KeyboardInterrupt), or `c` is abandoned. An async reward's
        completions share one event loop (`asyncio.Runner`), made at the first awaitable."""
        runner: asyncio.Runner | None = None
        try:
            for i, completion in enumerate(c.completions):
                if c.abandoned:
                    return
                c.running = (i, time.monotonic())
                try:
                    # (messages: each call its own copy, as the metadata's)
                    prompt = c.prompt if isinstance(c.prompt, str) else copy.deepcopy(c.prompt)
                    value: Any = self.fn(prompt, completion, c.label, own_copy(c.metadata))
                    if type(value) is not float and inspect.isawaitable(value):
                        if runner is None:
                            runner = asyncio.Runner()
                        value = runner.run(_awaited(value))
                    c.outcomes.append((value, None))
                except BaseException as exc:  # the user's function may raise anything
                    c.outcomes.append((None, exc))
                    if c.stop_on_error or not isinstance(exc, Exception):
                        return
        finally:
            if runner is not None:
                _closed(runner)


def _raised_at(error: BaseException) -> str:
    """Where the reward's own code raised `error`: " (at FILE:LINE in FUNC)" of the last frame
    outside the standard library and the installed packages' `site-packages` (the reward's
    module, or a helper beside it); "" when none is found. A failing reward was said as
    "ValueError: boom" alone, with no traceback anywhere."""
    frames = traceback.extract_tb(error.__traceback__)
    for frame in reversed(frames):
        name = frame.filename
        if "site-packages" in name or name.startswith(_STDLIB) or name == __file__:
            continue
        return f" (at {name}:{frame.lineno} in {frame.name})"
    return ""


_STDLIB = sysconfig.get_paths()["stdlib"]


def own_copy(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The line's metadata for one call, as its file has it. The reward was handed the
    dataset's own dict: one that took what it needed (`metadata.pop("meta")`) made its group's
    other completions fail (`KeyError`: under `on_error = "zero"` a spread of rewards, and an
    advantage, among equal answers) and the prompt lose the key in every later epoch. Flat
    metadata is copied as a dict (~0.3 µs); nested values deeply, since a nested dict may be
    changed too (~5 µs for a line's few keys)."""
    out = dict(metadata)
    if all(v is None or isinstance(v, str | int | float) for v in out.values()):
        return out  # nothing inside to change (a bool is an int)
    return copy.deepcopy(out)


def _output_gone(error: BaseException) -> bool:
    """`error` is a broken pipe, and this process's stdout or stderr is a pipe whose reader has
    gone (poll says POLLERR) or a hung-up terminal: what a reward's `print` raises under
    `ehp-fsm run ... | head` once `head` has ended."""
    if not isinstance(error, BrokenPipeError):
        return False
    import select

    try:
        poll = select.poll()
        for fd in (1, 2):
            poll.register(fd, 0)  # POLLERR and POLLHUP are reported whatever is asked
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poll.poll(0))
    except (OSError, ValueError, AttributeError):  # no poll here, or no such descriptor
        return False


def _closed(runner: asyncio.Runner) -> None:
    """Close a group's event loop (its leftover tasks cancelled, as `asyncio.run` does after
    each call). A failure there is the reward's, not a completion's: logged, and the thread
    goes on serving (dying, it would leave its queue to time out every later call)."""
    try:
        runner.close()
    except Exception as exc:  # whatever the reward's leftover tasks raise when cancelled
        _log.warning("reward_loop_close_failed", why=f"{type(exc).__name__}: {exc}")


def exact_match(
    prompt: PromptValue, completion: str, label: str, metadata: Mapping[str, Any]
) -> float:
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


def math_answer(
    prompt: PromptValue, completion: str, label: str, metadata: Mapping[str, Any]
) -> float:
    """1.0 if math_verify judges the completion's answer equal to the label, else 0.0."""
    mv = _math_verify()
    main = threading.current_thread() is threading.main_thread()
    timeout = 5 if main else None  # SIGALRM-based: main thread only
    gold = mv.parse(str(label), parsing_timeout=timeout)
    answer = mv.parse(completion, parsing_timeout=timeout)
    return 1.0 if mv.verify(gold, answer, timeout_seconds=timeout) else 0.0


BUILTINS: dict[str, RewardFn] = {"exact_match": exact_match, "math_answer": math_answer}


class _ArgparseHeld:
    """`sys.stderr` while a reward module is imported: every write goes through at once but
    argparse's usage block and its "<prog>: error: ..." line, which are held. A module that
    parses the command line at its top level ran argparse on ehp-fsm's own arguments, and its
    "usage: ehp-fsm [-h] [--scale SCALE]" and "ehp-fsm: error: unrecognized arguments: check
    plan.toml" read as ehp-fsm's own usage being wrong, above the refusal that named the
    module. When the module then exits, the refusal says what argparse said (`said`); else
    the held text is written after all (`release`)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.held: list[str] = []
        self.importing = True  # (a handler the module made keeps this object: it passes all)

    def write(self, text: str) -> int:
        prog = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
        argparse_said = text.startswith("usage: ") or (prog and text.startswith(f"{prog}: error: "))
        if self.importing and argparse_said:
            self.held.append(text)
            return len(text)
        self.release()  # (in order: what came after it is not argparse's)
        written = self.stream.write(text)
        # (a stderr of the caller's whose `write` returns None, as `print` allows: its int()
        # raised TypeError inside the module's import, which was refused for it)
        return written if isinstance(written, int) else len(text)

    def said(self) -> str:
        """argparse's error message, without its "<prog>: error: " (or the usage line, where
        no error line came); "" when nothing was held."""
        lines = [ln for t in self.held for ln in t.splitlines() if ln.strip()]
        self.held.clear()
        if not lines:
            return ""
        return lines[-1].split(": error: ", 1)[-1].strip()[:300]

    def release(self) -> None:
        if self.held:
            text, self.held = "".join(self.held), []
            self.stream.write(text)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding, ...
        # `stream` from the instance's own dict: where it is not set yet (a copy, as
        # `copy.copy` makes it, asked for `__setstate__`; a lookup before `__init__`),
        # `self.stream` came back here, without end (RecursionError)
        stream = self.__dict__.get("stream", _UNSET)
        if stream is _UNSET:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(stream, name)


_UNSET = object()


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
            _name_fix(
                spec,
                sorted(BUILTINS),
                'write e.g. function = "my_rewards:score" with my_rewards importable',
                " (a built-in)",
            ),
        )
    if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:
        # a file path was refused as "No module named 'my_rewards.py'", told to run
        # `python -c 'import my_rewards.py'`
        stem = Path(module_name).stem or "my_rewards"
        raise RewardError(
            f"reward module {module_name!r} is a file path, not a module name",
            "[reward] function names a module to import, as 'module:callable'",
            f"put {stem}.py beside the plan (or on PYTHONPATH) and write "
            f'function = "{stem}:{attr}"',
        )
    if folder is not None and str(folder) not in sys.path:
        sys.path.append(str(folder))  # after the installed packages: it never shadows one
    held = _ArgparseHeld(sys.stderr)
    if held.stream is not None:  # (no stderr: nothing to hold, and `None.write` to raise)
        sys.stderr = held
    try:
        with watched_import(module_name):
            obj: Any = importlib.import_module(module_name)
    except ExitCalled as exc:  # `check` ended with exit 0, saying nothing
        raise RewardError(
            f"reward module {module_name!r} ended the process as it was imported "
            f"(os._exit({exc.code!r}))",
            "its top level calls os._exit, which no caller survives",
            'put the module\'s script code under `if __name__ == "__main__":`, so that '
            "importing it only defines the reward",
        ) from None
    except SystemExit as exc:  # `check` exited 0 saying nothing (or argparse's "usage: ehp-fsm
        # [-h] [--scale SCALE] ... unrecognized arguments: check plan.toml", as if its own)
        said = held.said()
        raise RewardError(
            f"reward module {module_name!r} ended the process as it was imported "
            f"(sys.exit({exc.code!r}))",
            "its top level exits, or parses the command line (argparse"
            + (f", which said {said!r}" if said else "")
            + "), which is ehp-fsm's own when the module is imported by it",
            'put the module\'s script code under `if __name__ == "__main__":`, so that '
            "importing it only defines the reward",
        ) from None
    except Exception as exc:  # an import can fail with anything the module raises
        if (hidden := _hidden_helper(exc, folder)) is not None:
            mine, theirs = hidden
            raise RewardError(
                f"reward module {module_name!r} cannot be imported",
                f"{type(exc).__name__}: {exc} — its {mine.name} beside the plan is hidden by "
                f"{theirs}: the plan's folder is searched after the standard library and the "
                "installed packages",
                f"rename {mine} to a name of its own (e.g. my_{mine.name}) and import it by "
                "that name",
            ) from exc
        where = f"the plan's folder ({folder}), " if folder is not None else ""
        fix = (
            f"check the module name, that it is in {where}PYTHONPATH or installed, and that "
            "it imports cleanly (`python -c 'import " + module_name + "'`)"
        )
        if isinstance(exc, ModuleNotFoundError) and exc.name == module_name and folder:
            fix = _name_fix(module_name, _modules_in(folder), fix, " (a module beside the plan)")
        raise RewardError(
            f"reward module {module_name!r} cannot be imported",
            f"{type(exc).__name__}: {exc}",
            fix,
        ) from exc
    finally:
        if sys.stderr is held:  # (a module that set its own keeps it)
            sys.stderr = held.stream
        held.importing = False
        held.release()  # what argparse wrote, when the module did not exit after it
    _check_not_shadowed(module_name, obj, folder)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RewardError(
                f"reward module {module_name!r} has no {attr!r}",
                f"{part!r} is not an attribute of {obj!r}",
                _name_fix(part, _callables(obj), "check the name after the colon"),
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardError(
            f"reward {spec!r} is a {type(obj).__name__}, not a callable",
            "a reward is called as fn(prompt, completion, label, metadata)",
            "point at a function",
        )
    if inspect.isclass(obj):  # its call makes an instance, never a score (`check` said valid)
        name = attr.rsplit(".", 1)[-1]
        raise RewardError(
            f"reward {spec!r} is a class",
            "calling it makes an instance, not a score: a reward is called as "
            "fn(prompt, completion, label, metadata) for each completion",
            f"make an instance in {module_name} (e.g. {name.lower()} = {name}(...), a class "
            f"with __call__(self, prompt, completion, label, metadata)) and set "
            f'function = "{module_name}:{name.lower()}", or point at a function',
        )
    _check_signature(spec, obj)
    _check_not_generator(spec, obj)
    return obj  # type: ignore[no-any-return]


def reward_code(spec: str, *, folder: Path | None = None) -> dict[str, str] | None:
    """The code a reward runs, as `{source file: "sha256:<hex>"}` of its bytes on disk: the file
    of the module `spec` names ("module:callable"; a package's `__init__.py`), of the module
    that defines the callable, where that is another (a function imported from a helper module),
    the `__init__.py` of the packages either is in (`reward_imports.enclosing_packages`),
    and of every module of the user's own those import, transitively (`reward_imports.
    local_imports`: an `import` or `from ... import` anywhere in the file, functions included,
    of a module found in the folder the reward's module was imported from, within its bounds);
    a built-in's: its function's own source (`builtin_code`). What `--resume` holds the reward
    to beside its name. Not included: installed packages and the standard library, and files
    the reward reads. None when the reward cannot be resolved (`resolve_reward` says why) or its
    module has no file."""
    from ehp_fsm.data.reward_imports import (  # (ast: on use)
        enclosing_packages,
        local_imports,
        source_digest,
    )

    try:
        fn: Any = resolve_reward(spec, folder=folder)  # imported already by the run: cached
    except RewardError:
        return None
    if spec in BUILTINS:
        return builtin_code(fn)
    named = spec.partition(":")[0]
    while isinstance(fn, functools.partial):  # (its `__module__` is "functools": the code
        fn = fn.func  # recorded was the standard library's, not the function it calls)
    defining = getattr(fn, "__module__", None)
    files: dict[Path, None] = {}
    for module_name in dict.fromkeys(m for m in (named, defining) if isinstance(m, str)):
        where = getattr(sys.modules.get(module_name), "__file__", None)
        if not where:
            continue
        for init, package in enclosing_packages(module_name, Path(where)):  # run first
            files[init] = None
            files.update(dict.fromkeys(local_imports(package, init)))
        files[Path(where)] = None
        files.update(dict.fromkeys(local_imports(module_name, Path(where))))
    out: dict[str, str] = {}
    seen: set[Path] = set()
    for path in files:
        if (same := path.resolve()) in seen:  # the named module's own, through a link
            continue
        seen.add(same)
        if (digest := source_digest(path)) is not None:
            out[str(path)] = digest
    return out or None


def builtin_code(fn: Any) -> dict[str, str] | None:
    """A built-in reward's code as `reward_code` gives it: `{"<module>:<name>": "sha256:<hex>"}`
    of the function's own source. It was the digest of the whole of ehp-fsm's `rewards.py`, so
    any change to that file (an upgrade of ehp-fsm between a crash and its resume) refused the
    resume, and "restore rewards.py as the run had it" is nothing an operator can do. None
    when its source cannot be read (an install without sources)."""
    import hashlib

    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return None
    digest = "sha256:" + hashlib.sha256(source.encode("utf-8")).hexdigest()
    return {f"{fn.__module__}:{fn.__qualname__}": digest}


def _name_fix(name: str, known: Sequence[str], fix: str, where: str = "") -> str:
    """`fix`, led by "did you mean ...?" when `known` holds a name close to `name` (a reward
    named with a typo, `my_rewards:scroe`, was told only to check the name after the colon)."""
    close = difflib.get_close_matches(name.strip(), list(known), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}{where}? Else {fix}" if close else fix


def _callables(obj: Any) -> list[str]:
    """The public callables of a module (or an object): the names a reward may be."""
    try:
        names = [n for n in dir(obj) if not n.startswith("_")]
        return [n for n in names if callable(getattr(obj, n, None))]
    except Exception:  # an object's own __dir__ or __getattr__ may raise anything
        return []


def _modules_in(folder: Path) -> list[str]:
    """The modules the plan's folder holds: its `*.py` files and package folders."""
    try:
        entries = list(folder.iterdir())
    except OSError:
        return []
    return sorted(
        e.stem if e.suffix == ".py" else e.name
        for e in entries
        if (e.suffix == ".py" and e.stem.isidentifier())
        or (e.name.isidentifier() and (e / "__init__.py").is_file())
    )


def _check_not_shadowed(module_name: str, module: Any, folder: Path | None) -> None:
    """Refuse a module of the plan's folder that another of the same name hides: the folder is
    searched after the installed packages and the standard library, so `code.py` beside the
    plan imported Python's own `code` (and the refusal said to check the name after the
    colon)."""
    if folder is None:
        return
    top = module_name.split(".")[0]
    mine = [
        p for p in (folder / f"{top}.py", folder / top / "__init__.py") if path_kind(p) == "a file"
    ]
    if not mine:
        return
    top_module = sys.modules.get(top, module)
    where = getattr(top_module, "__file__", None)
    try:
        inside = where is not None and Path(where).resolve().is_relative_to(folder.resolve())
    except OSError:
        inside = False
    if not inside:
        raise RewardError(
            f"reward module {module_name!r} is not the plan's {mine[0]}",
            f"{top!r} imports {where or 'a built-in module'} first: the plan's folder is "
            "searched after the standard library and the installed packages",
            f"rename {mine[0].name} to a name of its own (e.g. my_{top}.py) and set "
            f'[reward] function = "my_{module_name}:..."',
        )


def _hidden_helper(exc: BaseException, folder: Path | None) -> tuple[Path, str] | None:
    """The plan folder's module that `exc` (the reward module's failed import) shows hidden, and
    what hides it: `from statistics import mean_reward` in a reward beside its helper
    `statistics.py` got Python's own statistics ("cannot import name 'mean_reward' from
    'statistics' (/usr/lib/python3.11/statistics.py)"), and was told to check its PYTHONPATH."""
    if folder is None or not isinstance(exc, ImportError) or not exc.name:
        return None
    top = exc.name.split(".")[0]
    mine = next((p for p in (folder / f"{top}.py", folder / top) if path_kind(p)), None)
    found = getattr(sys.modules.get(top), "__file__", None)
    if mine is None or found is None:
        return None
    try:
        if Path(found).resolve().is_relative_to(folder.resolve()):
            return None  # the plan's own: it failed for another reason
    except OSError:
        return None
    return mine, found


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


def _check_not_generator(spec: str, fn: Any) -> None:
    """Refuse a generator function (`yield` in its body: each call returns a generator, never
    a score) now: `check` said valid, and the run failed at its first completion ("it returned
    <generator object ...>") once every process had started."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    target = fn if inspect.isroutine(fn) else type(fn).__call__
    if inspect.isgeneratorfunction(target) or inspect.isasyncgenfunction(target):
        raise RewardError(
            f"reward {spec!r} is a generator function",
            "it has `yield` in its body, so each call returns a generator, not a score",
            "return the score (`return value`, not `yield value`)",
        )


def _shown(text: str, width: int = _PROMPT_SHOWN) -> str:
    return text if len(text) <= width else text[:width] + "…"


def _as_text(prompt: PromptValue) -> str:
    """A prompt as an error names it: a list of messages as its JSON."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)


@dataclass(frozen=True)
class _Which:
    """The completion a failure is about: its prompt and, in a group of more than one, its
    place there and the start of its text (a group of one reads as before: the prompt)."""

    prompt: str
    index: int = 0
    n: int = 1
    completion: str = ""

    def __str__(self) -> str:
        where = f"prompt {_shown(self.prompt)!r}"
        if self.n > 1:
            where += (
                f" (completion {self.index + 1} of {self.n}: "
                f"{_shown(self.completion, _COMPLETION_SHOWN)!r})"
            )
        return where


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
        self, prompt: PromptValue, completion: str, label: str, metadata: Mapping[str, Any]
    ) -> float:
        """For callers inside an event loop: the reward is called there, with no time-out."""
        which = _Which(_as_text(prompt))
        try:
            if not isinstance(prompt, str):  # (its own copy, as the metadata's)
                prompt = copy.deepcopy(prompt)
            value: Any = self.fn(prompt, completion, label, own_copy(metadata))
            if inspect.isawaitable(value):
                value = await value
        except Exception as exc:  # the user's function may raise anything
            return self._failed(which, "raised", f"{type(exc).__name__}: {exc}", exc)
        return self._checked(which, value)

    def score_sync(
        self, prompt: PromptValue, completion: str, label: str, metadata: Mapping[str, Any]
    ) -> float:
        """One completion: `score_group_sync` of a group of one (one hand-over for it)."""
        return self.score_group_sync(prompt, (completion,), label, metadata)[0]

    def score_group_sync(
        self,
        prompt: PromptValue,
        completions: Sequence[str],
        label: str,
        metadata: Mapping[str, Any],
    ) -> list[float]:
        """The completions of one prompt, scored in order, for synchronous callers with no
        running event loop (the run's dispatcher). They are handed to the reward's thread in
        one call (`_Caller`: one hand-over, ~25 µs, for the whole group). Each completion is
        judged on its own, as if scored alone: its call of the reward fails as "timed_out"
        `timeout_s` after it started; a failure raises `RewardError` naming the prompt and, in
        a group of more than one, which completion — or, under `on_error = "zero"`, scores
        that completion 0.0 (counted) and the others keep their scores. There a plain function
        is just called; an awaitable result runs on one event loop per group."""
        caller = self._caller
        if caller.interrupted:
            raise RewardInterrupted("the run was asked to stop", "", "")
        todo = tuple(completions)
        n, shown = len(todo), _as_text(prompt)
        out: list[float] = []
        while len(out) < n:  # a second turn only after a time-out under on_error = "zero"
            first = len(out)
            c = _Call(prompt, todo[first:], label, metadata, stop_on_error=self.on_error == "raise")
            late = caller.call(c, self.timeout_s)
            for value, error in c.outcomes[: len(c.completions) if late is None else late]:
                if error is None and type(value) is float and -MOST <= value <= MOST:
                    out.append(value)  # the common case, without the checks' cost
                else:
                    which = _Which(shown, len(out), n, todo[len(out)])
                    out.append(self._outcome(which, value, error))
            if late is not None:
                out.append(self._timed_out(_Which(shown, first + late, n, todo[first + late])))
        return out

    def _outcome(self, which: _Which, value: Any, error: BaseException | None) -> float:
        if error is not None and _output_gone(error):
            # the reward's own print() to the run's stdout (a `| head` that has ended): the
            # run's output is gone, not the reward broken — the run stops as for SIGPIPE
            # (it ended with exit 2 and "fix the reward function")
            raise RewardInterrupted(
                "the run's output is gone (its stdout or stderr has no reader): the reward "
                f"raised {type(error).__name__}: {error} on {which}",
                "",
                "",
            ) from error
        if error is not None and self._caller.interrupted:  # a stop came meanwhile
            raise RewardInterrupted(
                "the run was asked to stop while the reward was running", "", ""
            ) from error
        if isinstance(error, Exception):
            said = f"{type(error).__name__}: {error}{_raised_at(error)}"
            return self._failed(which, "raised", said, error)
        if isinstance(error, SystemExit):  # the reward's exit() is its failure: let through,
            # it ended `ehp-fsm run` with its status, exit 0 before a step was trained
            return self._failed(which, "raised", f"it called sys.exit({error.code!r})", error)
        if isinstance(error, ExitCalled):  # it ended the run with exit 0 and no summary
            return self._failed(which, "raised", f"it called os._exit({error.code!r})", error)
        if error is not None:  # a KeyboardInterrupt the reward raised itself (a Ctrl-C goes
            # to the main thread, never the reward's): it ended the run with exit 130, unsaid
            said = f"it raised {type(error).__name__}{_raised_at(error)}"
            return self._failed(which, "raised", said, error)
        return self._checked(which, value)

    def _timed_out(self, which: _Which) -> float:
        stuck = self._caller.stuck()
        if stuck >= MAX_STUCK_CALLS:
            raise RewardError(
                f"reward {self.name} hangs: {stuck} calls are still running, each past "
                f"its {self.timeout_s:g} s",
                f"the last on {which}",
                "fix the reward function (or raise [reward] timeout_s if it is just slow)",
                prompt=which.prompt,
                completion=which.index,
            )
        why = f"it did not return within {self.timeout_s:g} s ([reward] timeout_s)"
        return self._failed(which, "timed_out", why, None)

    def _checked(self, which: _Which, value: Any) -> float:
        # any real number: numpy's float32 and int64 (a reward computed with numpy) and a
        # Fraction are numbers as a float is; a bool, a string, None, a tensor are not
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            why = f"it returned {_shown(repr(value))}, a {type(value).__name__}, not a number"
            if isinstance(value, bool) or str(getattr(value, "dtype", "")).endswith("bool"):
                # (a bool's `.item()` is a bool, refused too: `np.True_` was told to use it)
                why += " (a reward returns a number: return float(value))"
            elif callable(getattr(value, "item", None)) and not isinstance(value, str | bytes):
                # a tensor or an array (`(pred == gold).float().mean()`): its one number
                why += " (a reward returns a Python or numpy number: return value.item())"
            elif isinstance(value, numbers.Number):  # a Decimal, a complex
                why += " (a reward returns a real number: return float(value))"
            return self._failed(which, "not_a_number", why, None)
        try:
            number = float(value)
        except OverflowError:  # an int (or a Fraction) past a float's range
            shown = f"{str(value)[:40]}… (beyond a float's range)"
            return self._failed(which, "non_finite", f"it returned {shown}", None)
        if not math.isfinite(number):
            return self._failed(which, "non_finite", f"it returned {value!r}", None)
        if not -MOST <= number <= MOST:
            return self._failed(
                which,
                "non_finite",
                f"it returned {number!r}, beyond ±{MOST:.8g}, the largest reward a step trains "
                "with (float32's range; near float64's own end, ±1.8e308, a group's variance "
                "overflows and its advantages are lost)",
                None,
            )
        return number

    def _failed(self, which: _Which, kind: str, why: str, exc: BaseException | None) -> float:
        if self.on_error == "raise":
            raise RewardError(
                f"reward {self.name} failed on {which}",
                why,
                'fix the reward function, or set on_error = "zero" to count such failures '
                "and score them 0.0",
                prompt=which.prompt,
                completion=which.index,
            ) from exc
        self.failures.add(kind, f"{which}: {why}")
        _log.warning(
            "reward_failed",
            reward=self.name,
            kind=kind,
            prompt=_shown(which.prompt),
            completion=which.index,
            why=why,
        )
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
