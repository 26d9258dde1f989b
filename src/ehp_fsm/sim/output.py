"""What a simulated run shows: the summary, the `--ehp both` comparison, the timeline, the receipt.

Knows: `SimResult` and the watch's role samples. Does not run anything.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ehp_fsm.fspaths import write_whole
from ehp_fsm.sim.story import SimResult
from ehp_fsm.sim.watch import ROLES

__all__ = ["compare", "draw_roles", "receipt", "summary"]

#: One line per GPU up to this many GPUs; above it the picture shows GPUs per role.
PER_GPU_LIMIT = 64


def _hours(seconds: float, scale: float | None = None) -> str:
    """Hours to 0.01 h; a run (or, given `scale`, the largest of those it is shown beside)
    shorter than 0.1 h in seconds: 0.01 h is 36 s, so short runs showed two different times
    as the same ("0.01 h 0.01 h" over a speed-up of 0.716×)."""
    if (seconds if scale is None else scale) < 360.0:
        return f"{seconds:.1f} s"
    return f"{seconds / 3600:.2f} h"


def _gpu_hours(x: float) -> str:
    """At least three significant digits (0.1 GPU-hours was shown as 0.0 beside 0.1)."""
    return f"{x:,.1f}" if x >= 99.95 else f"{x:#.3g}"


def _median(xs: Sequence[float]) -> str:
    return f"{statistics.median(xs):.1f} s" if xs else "-"


def summary(r: SimResult) -> str:
    mode = "on" if r.ehp else "off"
    steps = r.figures
    lines = [
        f"simulated {r.plan}: {r.hosts} hosts, {r.gpus} GPUs, {len(steps)} steps, seed {r.seed}, "
        f"EHP {mode}, faults {r.faults}",
        f"  time to {len(steps)} steps: {_hours(r.steps_s)} "
        f"(virtual; whole run {_hours(r.virtual_s)})",
        f"  GPU-hours: {_gpu_hours(r.gpu_hours)}; idle share of GPU time: {r.idle_share:.1%}",
        "  GPU time by role: "
        + ", ".join(
            f"{k} {v / max(1e-9, sum(r.gpu_s.values())):.1%}" for k, v in r.gpu_s.items() if v
        ),
    ]
    if steps:
        lines.append(
            f"  per step: rollout {statistics.mean(f.rollout_s for f in steps):.1f} s, training "
            f"{statistics.mean(f.train_s for f in steps):.1f} s, Hybrids active "
            f"{statistics.mean(f.hybrids for f in steps):.1f} on average; "
            f"{sum(f.retried for f in steps)} step attempts retried"
        )
    failed = f", {r.failed_borrows} more failed before training" if r.failed_borrows else ""
    lines.append(
        f"  borrows: {len(r.borrows)} (decision → Hybrid training: median {_median(r.borrows)}"
        f"{failed}); returns: {len(r.returns)} (→ engine serving: median {_median(r.returns)})"
    )
    faults = ", ".join(f"{k} {v}" for k, v in sorted(r.faults_seen.items())) or "none"
    lines.append(f"  faults injected: {faults}")
    rate = r.transitions / r.wall_s if r.wall_s > 0 else 0.0
    lines.append(
        f"  {r.transitions:,} transitions ({r.rejected:,} refused events), {r.checks:,} "
        f"invariant checks; {r.wall_s:.1f} s wall ({rate:,.0f} transitions/s)"
    )
    lines.append(f"  log: {r.log}")
    return "\n".join(lines)


def compare(off: SimResult, on: SimResult) -> str:
    """The same seed with EHP off and on: time to S steps, GPU-hours, idle share."""
    speed = off.steps_s / on.steps_s if on.steps_s > 0 else float("nan")
    longest = max(off.steps_s, on.steps_s)  # one unit for both columns
    rows = [
        f"EHP off vs on ({on.plan}, {on.hosts} hosts, {on.gpus} GPUs, {len(on.figures)} steps, "
        f"seed {on.seed}, faults {on.faults}):",
        f"  {'':22}{'off':>12}{'on':>12}",
        f"  {f'time to {len(on.figures)} steps':22}{_hours(off.steps_s, longest):>12}"
        f"{_hours(on.steps_s, longest):>12}",
        f"  {'GPU-hours':22}{_gpu_hours(off.gpu_hours):>12}{_gpu_hours(on.gpu_hours):>12}",
        f"  {'idle share':22}{off.idle_share:>12.1%}{on.idle_share:>12.1%}",
        f"  {'borrows / returns':22}{f'{len(off.borrows)}/{len(off.returns)}':>12}"
        f"{f'{len(on.borrows)}/{len(on.returns)}':>12}",
        f"  EHP speed-up to {len(on.figures)} steps: {speed:.3f}×",
    ]
    return "\n".join(rows)


def receipt(r: SimResult, command: str) -> dict[str, Any]:
    return {
        "simulated": True,
        "command": command,
        "plan": r.plan,
        "hosts": r.hosts,
        "gpus": r.gpus,
        "seed": r.seed,
        "ehp": r.ehp,
        "faults": r.faults,
        "last_step": len(r.figures),
        "revision": len(r.figures) + 1,
        "virtual_s": round(r.virtual_s, 6),
        "steps_s": round(r.steps_s, 6),
        "gpu_hours": round(r.gpu_hours, 6),
        "idle_share": round(r.idle_share, 6),
        "transitions": r.transitions,
        "invariant_checks": r.checks,
        "faults_injected": r.faults_seen,
        "borrows": len(r.borrows),
        "failed_borrows": r.failed_borrows,
        "returns": len(r.returns),
        "log_chain": r.log_chain,
    }


def write_receipt(r: SimResult, command: str, path: Path) -> None:
    write_whole(path, json.dumps(receipt(r, command), indent=2, sort_keys=True) + "\n")


def draw_roles(
    samples: Sequence[tuple[float, tuple[int, ...]]], end: float, out: Path, title: str
) -> Path:
    """GPUs per role over virtual time (stacked): readable at any cluster size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ehp_fsm.report.timeline import COLORS, missing_glyphs_quiet

    if not samples:
        samples = [(0.0, (0,) * len(ROLES))]
    ts = [t / 3600 for t, _ in samples] + [end / 3600]
    cols = [[c[i] for _, c in samples] for i in range(len(ROLES))]
    cols = [[*c, c[-1]] for c in cols]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.stackplot(ts, cols, labels=ROLES, colors=[COLORS[r] for r in ROLES], step="post")
    ax.set_xlabel("virtual time (h)")
    ax.set_ylabel("GPUs")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    with missing_glyphs_quiet():
        fig.tight_layout()
        fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
