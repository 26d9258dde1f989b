"""The one error tree of ehp-fsm. Every error says what was wrong, why, and what to do.

    EhpError                          base of everything ehp-fsm raises on purpose
    ├── PlanError                     a plan file is invalid (carries the TOML key path)
    ├── SpecError                     a machine spec is invalid (carries file, key and a fix)
    ├── LogFormatError                a transition-log line is not a record of a known schema
    │   └── LogLineTooLong            a line is longer than the line limit (read no further)
    ├── ReplayDivergence              a transition log does not replay (carries the line)
    │   └── ChainBroken               its hash chain or its receipt shows an edited log
    ├── InvariantViolation            an accepted step left the world unsound             (embedded)
    ├── EventError                    an event's fields cannot be interpreted             (embedded)
    ├── OrchestratorError             handle() inside handle(), or after close()          (embedded)
    ├── PlannerInputError             a planner input is inconsistent           (core.planner_model)
    ├── PartitionError                groups cannot be partitioned as asked             (core.batch)
    ├── LayoutError                   two layouts name different parameters        (training.layout)
    ├── TrainingStateError            a training state does not fit its lane         (training.lane)
    ├── ReductionError                gradients cannot be reduced as given      (training.reduction)
    ├── SnapshotError                 a snapshot could not be completed          (training.snapshot)
    ├── StepNotClosedError            the reduced gradient asked for too early    (training.collect)
    ├── PoolError                     trainer-pool misuse (a caller bug)    (training.pool_protocol)
    │   └── StaleStateError           a warm worker given stale state       (training.pool_protocol)
    ├── VerifyError                   a verify record or state dir is unusable     (training.verify)
    ├── ObjectiveError                the GRPO objective's config or inputs     (training.objective)
    ├── ModelError                    a model directory cannot be written or loaded    (models.load)
    ├── DataError                     a dataset file cannot be used (file, line)      (data.dataset)
    ├── RewardError                   a reward cannot be resolved, or it failed       (data.rewards)
    │   └── RewardInterrupted         a stop came while the reward ran                (data.rewards)
    ├── MegatronBackendError          Megatron-Core misused               (backends.megatron.errors)
    │   └── OptimizerStateMismatch    moved optimizer state does not fit  (backends.megatron.errors)
    ├── RolloutError                  base of the rollout shell's errors            (rollout.errors)
    │   ├── RevisionError             the revision store refused or found damage    (rollout.errors)
    │   │   ├── RevisionNotIncreasing                                               (rollout.errors)
    │   │   ├── RevisionNotFound                                                    (rollout.errors)
    │   │   ├── RevisionCorrupt                                                     (rollout.errors)
    │   │   └── RevisionInUse                                                       (rollout.errors)
    │   ├── EngineLaunchError         an engine did not come up (its log tail)      (rollout.errors)
    │   ├── EngineError               an HTTP call failed (endpoint, status, text)  (rollout.errors)
    │   │   ├── EngineUnreachable                                                   (rollout.errors)
    │   │   ├── EngineRequestFailed                                                 (rollout.errors)
    │   │   └── WeightUpdateFailed                                                  (rollout.errors)
    │   └── EngineRefused             the engine cannot take it now (HTTP status)   (rollout.engine)
    ├── TransportError                the control plane was misused                 (runtime.errors)
    │   └── FrameError                an outgoing frame cannot be encoded           (runtime.errors)
    ├── KeyFileError                  CURVE key files missing or malformed          (runtime.errors)
    ├── IdentityError                 a process identity cannot be checked          (runtime.errors)
    ├── AgentError                    the host agent cannot start                    (runtime.agent)
    ├── LoopError                     the shell's loop was misused                      (shell.loop)
    ├── ControllerError               the controller was misused                (runtime.controller)
    ├── PoolWorkersError              a pool worker launch is refused    (runtime.pool_workers)
    ├── RecoveryError                 the transition log cannot be recovered      (runtime.recovery)
    ├── WorkerError                   a role has no launcher / cannot be started   (runtime.workers)
    │   └── TrainerLaunchError        a pool worker's trainer field is refused (runtime.pool_launch)
    ├── StepError                     a training step could not be completed          (run.step)
    ├── RunStateError                 a run directory's run.json is not usable here      (run.owned)
    ├── ResumeError                   a killed run cannot be resumed                    (run.resume)
    ├── ScaleError                    a plan cannot be scaled to the hosts asked     (sim.cluster)
    ├── SimError                      a simulation cannot go on                        (sim.story)
    │   ├── RunStopped                a step failed on every attempt (a designed stop) (sim.story)
    │   └── WaitTooLong               a wait went past a virtual day (the cost model)  (sim.story)
    └── RunError                      `ehp-fsm run` cannot go on                           (run.job)

In parentheses: the module that defines the class (none: this module).

A rejected *event* is not an error: the orchestrator returns a `Rejected` value with the guard's
reason. A malformed frame is not an error either: it is a `Dropped` value with a reason. Errors
are for input that cannot be interpreted at all, or for a job that cannot go on.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path


class EhpError(Exception):
    """Base class. `what`, `why` and `fix` render into one message."""

    def __init__(self, what: str, why: str = "", fix: str = "") -> None:
        self.what, self.why, self.fix = what, why, fix
        super().__init__(str(self))

    def __str__(self) -> str:
        parts = [self.what]
        if self.why:
            parts.append(f"because {self.why}")
        msg = ": ".join(parts)
        return f"{msg}. Fix: {self.fix}" if self.fix else msg


def printable(text: str) -> str:
    """`text` with every character a terminal would act on or hide (newlines, escape
    sequences, bidi overrides, zero-width marks) written as its escape: a plan's own text
    quoted in an error stays on the one line `ehp-fsm: error: ...` and shows what is there."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


#: What `last_error_line` looks for: a C++ exception's `what():`, a Python exception line
#: (`ValueError: ...`), a fatal error, or the OS's words for a failed call.
_ERROR_LINE = re.compile(
    r"what\(\):|^[A-Za-z_.]*(Error|Exception|Exit)\b|[Ff]atal|[Ee]rror:"
    r"|[Tt]oo many open files"
)


_GENERIC = re.compile(r"Fatal Python error: (Aborted|Segmentation fault|Bus error)")


def last_error_line(log: Path, tail_bytes: int = 16384, *, since: int = 0) -> str:
    """The last line of `log`'s last `tail_bytes` past byte `since` (where the process of
    interest began appending: an earlier process's error is not its) that reads as an error
    (see `_ERROR_LINE`), printable and at most 300 characters; "" when there is none or the
    file cannot be read. A crashed process (SIGABRT) said why only in its log; its death was
    named without it."""
    try:
        with open(log, "rb") as fh:
            fh.seek(max(since, os.fstat(fh.fileno()).st_size - tail_bytes))
            lines = fh.read(tail_bytes).decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    generic = ""  # Python's own "Fatal Python error: Aborted": the line before it says why
    for line in reversed(lines):
        text = line.strip()
        if text and not text.startswith("File ") and _ERROR_LINE.search(text):
            if not _GENERIC.match(text):
                return printable(text)[:300]
            generic = generic or printable(text)[:300]
    return generic


def toml_key(name: str) -> str:
    """One part of a TOML key path as a user would write it: bare when it may be bare, else
    quoted (an empty name, a space, a dot or a non-ASCII letter would otherwise not show)."""
    if name and all(c.isascii() and (c.isalnum() or c in "_-") for c in name):
        return name
    return '"' + printable(name).replace('"', '\\"') + '"'


class PlanError(EhpError):
    """A plan is invalid. `key` is the dotted TOML key path, e.g. `engines[2].tp`. Every part
    part of the message is made `printable`: a plan's own text cannot break its one line.

    A `key` in angle brackets (`<file>`, `<toml>`, `<root>`) is no key of the plan but the
    file as a whole (it cannot be read, or is not TOML): "the plan PATH cannot be used"."""

    def __init__(self, key: str, why: str, fix: str = "", *, path: str = "") -> None:
        self.key, self.path = key, path
        if key.startswith("<"):  # "plan key `<file>` is invalid" named no key of the plan
            what = f"the plan {_clip(printable(path))} " if path else "the plan "
            what += "cannot be used"
        else:
            where = f"{printable(path)}: " if path else ""
            what = f"{where}plan key `{_clip(printable(key))}` is invalid"
        super().__init__(what, _clip(printable(why)), printable(fix))


#: The longest part of a plan error: a plan's value quoted in full (a megabyte string, a
#: list of thousands of GPU ids) would bury the key and the reason.
MAX_QUOTED = 1000


def _clip(text: str) -> str:
    return text if len(text) <= MAX_QUOTED else f"{text[:MAX_QUOTED]}… ({len(text)} characters)"


class SpecError(EhpError):
    """A machine spec is invalid. `file` and `key` point at the offending entry."""

    def __init__(self, file: str, key: str, why: str, fix: str) -> None:
        self.file, self.key = file, key
        super().__init__(f"{file}: spec key `{key}` is invalid", why, fix)


class LogFormatError(EhpError):
    """A transition-log line cannot be read as a record."""

    def __init__(self, line: int, why: str, fix: str = "") -> None:
        self.line = line
        what = (
            "the transition log cannot be verified"  # (line 0: the log as a whole, a receipt)
            if line == 0
            else "transition log line 1, its header, is not valid"
            if line == 1
            else f"transition log line {line} is not a valid record"
        )
        super().__init__(what, why, fix)


class LogLineTooLong(LogFormatError):
    """A transition-log line is longer than the line limit (`loglines`): reading stopped
    inside it, `read` bytes from its start, before it was held whole."""

    def __init__(self, line: int, read: int, limit: int, why: str, fix: str) -> None:
        self.line, self.read, self.limit = line, read, limit
        EhpError.__init__(
            self,
            f"transition log line {line} is longer than the line limit ({limit:,} bytes)",
            why,
            fix,
        )


class ReplayDivergence(EhpError):
    """Replaying a log produced something other than what the log recorded."""

    def __init__(
        self, line: int, field: str, expected: object, actual: object, *, said: str = ""
    ) -> None:
        self.line, self.field, self.expected, self.actual = line, field, expected, actual
        self.said = said  # what the engine says of it, where it decides otherwise
        super().__init__(
            f"replay diverges at line {line}: `{field}` recorded {expected!r}, "
            f"engine computed {actual!r}" + (f" ({said})" if said else ""),
            "the log was edited, truncated out of order, or written by a different spec",
            "restore the original log, or replay with the specs that wrote it",
        )


class ChainBroken(ReplayDivergence):
    """A line's link in the log's hash chain (schema 3) is not the hash of the line before it
    and its own bytes, or the log does not end where the run's receipt says."""

    def __init__(
        self,
        line: int,
        expected: object,
        actual: object,
        *,
        why: str | None = None,
        fix: str | None = None,
        what: str | None = None,
    ) -> None:
        self.line, self.field, self.expected, self.actual = line, "chain", expected, actual
        self.said = ""
        EhpError.__init__(
            self,
            what
            or f"the log's hash chain breaks at line {line}: recorded {expected!r}, the lines "
            f"hash to {actual!r}",
            why
            or f"line {line} or the line before it was edited, inserted, deleted or moved "
            "(or the chain's key differs)",
            fix or "restore the original log; an edited log cannot be trusted",
        )


def exit_words(code: int) -> str:
    """How a process ended, from its exit code: "exited with code 3", or "was killed by
    SIGKILL" for a negative one (Popen's -N: signal N; "exited with code -9" named none)."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
