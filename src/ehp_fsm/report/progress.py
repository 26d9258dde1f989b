"""The live progress display of `ehp-fsm run` and its end-of-run summary.

`Progress` shows one block per update — step, reward, exact-answer rate, loss, revision, Core and
Hybrid replica counts, GPU roles, the current shortfall — redrawn in place on a terminal and
written as one plain line per update otherwise (a log file, CI, a pipe). `render_summary` turns the
run's figures into the closing text: the reward curve, the time split between rollout and
training, and every borrow and return with its latency. Nothing here computes a figure; callers
pass what they measured.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TextIO

_BARS = " ▁▂▃▄▅▆▇█"


@dataclass(frozen=True, kw_only=True)
class StepStatus:
    step: int
    steps: int
    reward: float
    exact: float
    loss: float
    revision: int
    core: int
    hybrids: int
    gpu_roles: Mapping[str, int]
    shortfall: str | None = None
    note: str = ""


@dataclass(frozen=True, kw_only=True)
class Move:
    """One borrow or return as the summary lists it."""

    kind: str  # "borrow" | "return"
    step: int
    latency_s: float
    detail: str


@dataclass(kw_only=True)
class RunFigures:
    # the loss has a KL term to the initial model (`grpo.kl_coef > 0`): its k3 estimate
    # (`ref_kl`) is said beside the approximate KL to the behaviour policy, which it is not
    kl_reference: bool = False
    rewards: list[float] = field(default_factory=list)
    exact: list[float] = field(default_factory=list)
    rollout_s: float = 0.0
    training_s: float = 0.0
    # the step loop's time in all (rollout and training are parts of it; the rest is spent
    # between steps: the planner's wait for installs, borrows joining, state saves), and of
    # it the waits for engines to install a revision before the planner decides
    steps_s: float = 0.0
    install_wait_s: float = 0.0
    # of the wall time, the run's own process's stalls named as they came (a SIGSTOP, a
    # paused VM: `AgentLink.long_stalls`)
    stalled_s: float = 0.0
    moves: list[Move] = field(default_factory=list)
    # why nothing moved: "[ehp] enabled = false", or the planner's last decision that moved
    # nothing ("after step N: <its reason>"); a run that borrowed nothing said only "none"
    unmoved: str = ""
    final_revision: int = 0
    last_step: int = 0
    wall_s: float = 0.0
    # per step: the objective's metrics (clip fraction, ratio mean/max, approx KL) and the
    # staleness of its groups (step revision − generating revision → groups)
    step_metrics: list[dict[str, float]] = field(default_factory=list)
    staleness: list[dict[int, int]] = field(default_factory=list)
    # generating revision → (reward sum, samples): the reward of each revision's own samples
    by_revision: dict[int, tuple[float, int]] = field(default_factory=dict)
    reward_failures: int = 0  # completions the reward failed on, scored 0 (on_error = "zero")
    # of them by kind ("not_a_number": 3, ...), and the last one's message (which prompt and
    # completion, what the reward did): the count alone said nothing of why
    reward_failure_kinds: dict[str, int] = field(default_factory=dict)
    reward_failure_last: str = ""
    # a resumed run: the step it went on after. Every figure above but the last step and
    # revision is this segment's own (its process measured them; a resume removes the summary
    # and receipt of the run it resumes), and the summary says so
    resumed_after: int | None = None


def _cut(text: str, most: int) -> str:
    return text if len(text) <= most else text[:most] + "…"


def sparkline(values: Sequence[float]) -> str:
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(_BARS[round((v - lo) / span * (len(_BARS) - 1))] for v in values)


class GuardedOutput(io.TextIOBase):
    """The run's output stream, whose loss ends the printing, never the run's bookkeeping: the
    first write or flush that fails (EPIPE: the pipe's reader is gone — `| head`, a killed
    `tee`; EIO: the terminal is gone) calls `on_lost` with its error, the stream's descriptor
    is pointed at /dev/null (nothing fails again at exit), and every later write is dropped.
    Unguarded, the failed write raised out of the step loop (the run then said a disk was
    full) and again out of the run's end, before its receipt, summary and timeline were
    written. A `stream` of None — stdout closed before the start (`>&-`: Python's sys.stdout
    is None then; it was an AttributeError traceback) — takes every write and shows nothing,
    as /dev/null would: the run goes on."""

    def __init__(self, stream: TextIO | None, on_lost: Callable[[OSError], None]) -> None:
        super().__init__()
        self._stream, self._on_lost = stream, on_lost
        self.lost: OSError | None = None

    def write(self, s: str) -> int:
        if self.lost is None and self._stream is not None:
            try:
                return self._stream.write(s)
            except OSError as exc:
                self._lose(exc)
        return len(s)

    def flush(self) -> None:
        if self.lost is None and self._stream is not None:
            try:
                self._stream.flush()
            except OSError as exc:
                self._lose(exc)

    def isatty(self) -> bool:
        try:
            return self._stream is not None and self._stream.isatty()
        except (OSError, ValueError):
            return False

    def _lose(self, exc: OSError) -> None:
        self.lost = exc
        with contextlib.suppress(OSError, ValueError, io.UnsupportedOperation, AttributeError):
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())  # type: ignore[union-attr]  # lost: it wrote
            os.close(null)
        self._on_lost(exc)


class Progress:
    def __init__(self, out: TextIO, *, live: bool | None = None) -> None:
        self.out = out
        self.live = out.isatty() if live is None else live
        self._drawn = 0

    def _lines(self, s: StepStatus) -> list[str]:
        roles = " ".join(f"{k}={v}" for k, v in sorted(s.gpu_roles.items()))
        lines = [
            f"step {s.step}/{s.steps}  reward {s.reward:.3f}  exact {s.exact:.0%}  "
            f"loss {s.loss:+.4f}  revision {s.revision}",
            f"replicas: core {s.core} + hybrid {s.hybrids}   GPUs: {roles}",
        ]
        if s.shortfall:
            lines.append(f"shortfall: {s.shortfall}")
        if s.note:
            lines.append(s.note)
        return lines

    def update(self, status: StepStatus) -> None:
        lines = self._lines(status)
        if self.live:
            if self._drawn:
                self.out.write(f"\x1b[{self._drawn}F\x1b[J")
            self.out.write("\n".join(lines) + "\n")
            self._drawn = len(lines)
        else:
            self.out.write(" | ".join(lines) + "\n")
        self.out.flush()

    def message(self, text: str) -> None:
        """A line that stays (an event worth keeping on screen: a borrow, a failure)."""
        if self.live and self._drawn:
            self.out.write(f"\x1b[{self._drawn}F\x1b[J")
            self._drawn = 0
        self.out.write(text + "\n")
        self.out.flush()


def time_split(f: RunFigures) -> str:
    """Where the wall time went: the step loop's time split into waiting for a step's groups
    (rollout), the trainer's steps (training) and the rest of the loop (between steps: the
    planner's waits for installs, named, borrows joining, state saves), each a share of the
    loop's time, so the three add up to it; then start-up and the end, and the wall time. It
    gave rollout and training as shares of their own sum alone: a run whose steps waited a
    minute for a frozen engine's install deadline said 21 % rollout, 79 % training."""
    steps = max(f.steps_s, f.rollout_s + f.training_s)
    between = steps - f.rollout_s - f.training_s
    outside = max(0.0, f.wall_s - steps)

    def part(s: float, more: str = "") -> str:
        return f"{s:.1f}s ({s / steps:.0%}{more})"

    waits = f", waiting for installs {f.install_wait_s:.1f}s" if f.install_wait_s >= 0.05 else ""
    return (
        f"time: rollout {part(f.rollout_s)}, training {part(f.training_s)}, between steps "
        f"{part(between, waits)} of the steps' {steps:.1f}s; start-up and end {outside:.1f}s; "
        f"wall {f.wall_s:.1f}s"
        + (f" (the run's own process stalled {f.stalled_s:.1f}s of it)" if f.stalled_s else "")
    )


def render_summary(f: RunFigures) -> str:
    lines = ["", "=== ehp-fsm run summary ==="]
    if (r := f.resumed_after) is not None:
        lines.append(
            f"resumed after step {r}: the figures below are this segment's, steps "
            f"{r + 1}..{f.last_step}, not the whole run's"
            if f.last_step > r
            else f"resumed after step {r}: no step trained since"
        )
    if f.rewards:
        k = max(1, min(5, len(f.rewards) // 4))
        first, last = sum(f.rewards[:k]) / k, sum(f.rewards[-k:]) / k
        lines.append(
            f"reward  {sparkline(f.rewards)}  first {k}: {first:.3f} -> last {k}: {last:.3f}"
        )
    if f.exact:
        lines.append(f"exact   {sparkline(f.exact)}  last: {f.exact[-1]:.0%}")
    if f.by_revision:
        revs = sorted(f.by_revision)
        means = [f.by_revision[r][0] / max(1, f.by_revision[r][1]) for r in revs]
        lines.append(
            f"reward by generating revision {revs[0]}..{revs[-1]}  {sparkline(means)}  "
            f"first: {means[0]:.3f} -> last: {means[-1]:.3f}"
        )
    if f.reward_failures:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(f.reward_failure_kinds.items()))
        since = f" since the resume after step {r}" if r is not None else ""
        lines.append(
            f'reward failures{since} (scored 0, on_error = "zero"): {f.reward_failures}'
            + (f" ({kinds})" if kinds else "")
            + (f"; the last: {_cut(f.reward_failure_last, 300)}" if f.reward_failure_last else "")
        )
    if f.step_metrics:
        sm = f.step_metrics

        def mean(key: str) -> float:
            return sum(x[key] for x in sm) / len(sm)

        top = max(x["ratio_max"] for x in sm)
        lines.append(
            f"objective (mean over steps): clip fraction {mean('clip_fraction'):.3f}, ratio "
            f"mean {mean('ratio_mean'):.4f} (max {top:.3f}), approx KL {mean('approx_kl'):.2e}"
            + (
                f", KL to the reference {mean('ref_kl'):.2e} (last step "
                f"{sm[-1].get('ref_kl', 0.0):.2e})"
                if f.kl_reference
                else ""
            )
        )
    if f.staleness:
        groups: dict[int, int] = {}
        for h in f.staleness:
            for lag, n in h.items():
                groups[lag] = groups.get(lag, 0) + n
        hist = ", ".join(f"{lag}: {n}" for lag, n in sorted(groups.items()))
        lines.append(f"staleness of trained groups (revisions behind: groups): {hist}")
    if f.rollout_s + f.training_s > 0:
        lines.append(time_split(f))
    if f.moves:
        lines.append("borrows and returns:")
        for m in f.moves:
            lines.append(
                f"  step {m.step:>3}  {m.kind:<6}  {m.latency_s * 1000:8.0f} ms  {m.detail}"
            )
    elif f.unmoved:
        lines.append(f"borrows and returns: none — {_cut(f.unmoved, 400)}")
    else:
        lines.append("borrows and returns: none")
    lines.append(f"last step {f.last_step}, final revision {f.final_revision}")
    return "\n".join(lines) + "\n"
