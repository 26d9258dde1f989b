"""The GPU-role timeline: every GPU's owner over time, from a transition log, as PNG and SVG.

`role_intervals(path)` reads the accepted gpu-machine records of a transition log (assign,
release, confirm_free, quarantine, reconcile_*, fail) and returns, per GPU, contiguous intervals
with the role it had: `core`, `engine`, `hybrid`, `free`, `releasing`, `quarantined`, `failed`.
`draw_timeline` renders them with matplotlib (Agg backend: no display needed). The same picture
is drawn by `ehp-fsm run` beside its log and by `ehp-fsm replay LOG --timeline OUT`.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ehp_fsm.errors import EhpError, printable
from ehp_fsm.fspaths import path_kind
from ehp_fsm.loglines import check_line_lengths, line_limit
from ehp_fsm.translog import CHECKPOINT_EVENT

COLORS = {
    "core": "#1f77b4",
    "engine": "#2ca02c",
    "hybrid": "#ff7f0e",
    "free": "#dddddd",
    "releasing": "#bcbd22",
    "quarantined": "#d62728",
    "failed": "#000000",
}


@dataclass(frozen=True, slots=True)
class Interval:
    gpu: str
    role: str
    owner: str | None
    start: float
    end: float


def _role(state: str, owner: str | None) -> str:
    if state == "owned" and owner:
        return owner.split(":", 1)[0]
    return state


def role_intervals(path: str | Path, *, until_seq: int | None = None) -> list[Interval]:
    """Per-GPU role intervals from a log, read to its record `until_seq` (None: its end: what
    `replay` verified — `ehp-fsm replay --at N --timeline` passes N's); the last interval ends
    at the last time read. A line at a time, each within the line limit (`loglines`): the
    whole log was read into memory (as text, then as lines), and with `--at` its unverified
    lines past N were read too (a line that was no record ended in a KeyError traceback)."""
    with open(path, "rb") as fh:
        check_line_lengths(fh, 0, os.fstat(fh.fileno()).st_size, line_limit())
        first = fh.readline()
        if not first:  # a run that stopped before its log's header: no GPU had a role yet
            return []
        header = json.loads(first)
        return _intervals(header, fh, until_seq)


def _intervals(
    header: dict[str, Any], lines: Iterable[bytes], until_seq: int | None
) -> list[Interval]:
    inventory = header.get("config", {}).get("inventory") or {}
    current: dict[str, tuple[str, str | None, float]] = {}
    t0 = None
    last = 0.0
    out: list[Interval] = []
    owners: dict[str, str | None] = {}
    for rec in _records(lines, until_seq):
        last = float(rec["time"])
        if t0 is None:
            t0 = last
            for gid in inventory:
                current[gid] = ("free", None, last)
                owners[gid] = None
        if rec["machine"] != "gpu" or not rec["accepted"]:
            continue
        gid = rec["instance"]
        owner = owners.get(gid)
        if rec["event"] in ("assign", "reconcile_owned"):
            owner = (rec.get("payload") or {}).get("owner")
        if rec["dest"] == "free":
            owner = None
        owners[gid] = owner
        role = _role(rec["dest"], owner)
        prev = current.get(gid)
        if prev is not None and (prev[0], prev[1]) == (role, owner):
            continue
        if prev is not None and last > prev[2]:
            out.append(Interval(gid, prev[0], prev[1], prev[2], last))
        current[gid] = (role, owner, last)
    for gid, (role, owner, start) in current.items():
        out.append(Interval(gid, role, owner, start, max(last, start)))
    base = t0 or 0.0
    return sorted(
        (Interval(i.gpu, i.role, i.owner, i.start - base, i.end - base) for i in out),
        key=lambda i: (i.gpu, i.start),
    )


def _records(lines: Iterable[bytes], until_seq: int | None) -> Iterator[dict[str, Any]]:
    """The records of `lines` (checkpoints left out), to the one of seq `until_seq`: no line
    after it is read (with `--at`, replay verified none of them)."""
    for raw in lines:
        rec = json.loads(raw)
        if rec.get("event") == CHECKPOINT_EVENT:
            continue
        yield rec
        if until_seq is not None and rec["seq"] >= until_seq:
            return


@contextlib.contextmanager
def missing_glyphs_quiet() -> Iterator[None]:
    """A plan's name and ids may be in any script; matplotlib's bundled font draws Latin, Greek
    and Cyrillic, and warned once per other character (a CJK plan name: a dozen lines of
    warnings on every run). Such characters are drawn as boxes, without a word."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Glyph \d+ .*missing from font")
        yield


def timeline_paths(out: str | Path) -> list[Path]:
    """The two files `draw_timeline` writes for `out`: OUT.png and OUT.svg, or
    `OUT/timeline.*` when `out` is a folder. Refuses (`EhpError`) an `out` that is a device,
    a FIFO or a socket, and a .png or .svg there that is not a file: `--timeline /dev/null`
    wrote /dev/null.png and /dev/null.svg into /dev, and a folder named x.png failed only once
    the whole log was replayed."""
    base = Path(out)
    if base.is_dir():
        base = base / "timeline"
    elif (kind := path_kind(base)) not in (None, "a file"):
        raise EhpError(
            f"--timeline {printable(str(out))!r} is {kind}",
            "the timeline is two files, OUT.png and OUT.svg, written beside OUT",
            "give --timeline a file name (or a folder) of your own, e.g. runs/local/timeline",
        )
    paths = [base.with_suffix(".png"), base.with_suffix(".svg")]
    for path in paths:
        if (kind := path_kind(path)) not in (None, "a file"):
            raise EhpError(
                f"the timeline's {path} is {kind}, not a file",
                "the timeline is written to OUT.png and OUT.svg",
                "move it away, or give --timeline another name",
            )
    return paths


def draw_timeline(intervals: list[Interval], out: str | Path, *, title: str = "") -> list[Path]:
    """Write `out` with .png and .svg suffixes (into `out/timeline.*` when `out` is a folder:
    they went beside it, `DIR.png`); returns the two paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    gpus = sorted({i.gpu for i in intervals})
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(gpus) + 1.6))
    for row, gid in enumerate(gpus):
        spans = [i for i in intervals if i.gpu == gid]
        ax.broken_barh(
            [(i.start, max(i.end - i.start, 1e-3)) for i in spans],
            (row - 0.4, 0.8),
            facecolors=[COLORS.get(i.role, "#999999") for i in spans],
        )
    ax.set_yticks(range(len(gpus)), gpus)
    ax.set_xlabel("seconds since the first transition")
    ax.set_title(title or "GPU roles over time")
    used = sorted({i.role for i in intervals}, key=list(COLORS).index)
    if used:  # an empty log (a run stopped before any GPU had a role) draws empty axes
        ax.legend(
            handles=[Patch(color=COLORS[r], label=r) for r in used],
            loc="upper center",
            bbox_to_anchor=(0.5, -0.25),
            ncol=len(used),
            frameon=False,
        )
    paths = timeline_paths(out)
    with missing_glyphs_quiet():
        fig.tight_layout()
        for p in paths:
            p.parent.mkdir(parents=True, exist_ok=True)
            # the same picture, the same bytes: the SVG carried its date and random clip ids
            # (a simulation's same seed gave another timeline-gpus.svg)
            with matplotlib.rc_context({"svg.hashsalt": "ehp-fsm"}):
                fig.savefig(p, metadata={"Date": None} if p.suffix == ".svg" else None)
    plt.close(fig)
    return paths
