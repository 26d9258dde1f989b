"""`[run] samples = true`: every trained sample, one JSON line each, in `samples.jsonl`.

Why: a run's outputs held the per-step mean reward alone — no prompt, completion, reward or
advantage of any sample — so a team could not audit what the model was trained on, nor check
its reward function against what it scored, from the run itself (an ML user's find; it logged
its reward's calls to check them).

One line per sample of a trained step, in the order the step's batch holds them: `step`,
`resumes` (how many times the run had been resumed when the step was trained), `group` (the
request id), `prompt_index` (the prompt's place in the data set), `line` (its line in the data
file), `revision` (the weights that generated it), `sample` (its place in the group), `prompt`
(the text the engine was given), `label`, `completion` (decoded as the reward saw it, special
tokens skipped), `tokens` (the completion's token count), `reward`, `exact` (reward ≥ 1),
`advantage` (the group-normalised advantage the step trained it with:
`training.grpo.group_advantages`, bit for bit).

Written after each step is trained. A resume appends: a step a killed run trained and its
resume trains again appears again, and the lines with the higher `resumes` are the ones the run
went on from; a torn last line the killed run left is cut first (`prepare_samples`). A fresh
start removes the file. Mode 0600: the prompts are the user's data.

Knows: the GRPO groups a step trained, the tokenizer's decode. Does not know: the run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

import torch

from ehp_fsm.fspaths import open_own
from ehp_fsm.plan import Plan
from ehp_fsm.training.grpo import group_advantages
from ehp_fsm.training.task import GroupSamples

__all__ = ["SAMPLES_FILE", "prepare_samples", "samples_file", "write_samples"]

SAMPLES_FILE: Final = "samples.jsonl"


def samples_file(plan: Plan) -> Path | None:
    """Where a run of `plan` writes its samples (beside its log); None: `[run] samples` off."""
    return Path(plan.log).resolve().parent / SAMPLES_FILE if plan.samples else None


def prepare_samples(path: Path) -> None:
    """At the run's start: make sure `path` can be written — a link there, or another user's
    file, is refused now (it was refused once step 1 had trained) — and cut back a torn last
    line a killed run left (the next line was appended to it: neither was JSON)."""
    fd = open_own(path, os.O_RDWR | os.O_CREAT, private=True)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            keep, end = 0, size
            while end > 0:  # the last newline, read backwards a chunk at a time
                start = max(0, end - (1 << 16))
                at = os.pread(fd, end - start, start).rfind(b"\n")
                if at >= 0:
                    keep = start + at + 1
                    break
                end = start
            os.ftruncate(fd, keep)
    finally:
        os.close(fd)


def write_samples(
    path: Path,
    step: int,
    groups: Sequence[str],
    samples: Sequence[GroupSamples],
    decode: Callable[[Sequence[int]], str],
    *,
    resumes: int = 0,
) -> None:
    """Append the samples of trained step `step` (its groups' ids and their samples, in
    the batch's order) to `path`, one JSON line each (see the module docstring)."""
    lines = []
    for gid, g in zip(groups, samples, strict=True):
        n = len(g.scores)
        rewards = torch.tensor([s.reward for s in g.scores], dtype=torch.float64)
        advantages = group_advantages(rewards, n).tolist()
        q = g.question
        for i, (tokens, scored) in enumerate(zip(g.completions, g.scores, strict=True)):
            record = {
                "step": step,
                "resumes": resumes,
                "group": gid,
                "prompt_index": q.index,
                "line": getattr(q, "line", None),
                "revision": g.revision,
                "sample": i,
                "prompt": q.text,
                "label": getattr(q, "label", None),
                "completion": decode(tokens),
                "tokens": len(tokens),
                "reward": scored.reward,
                "exact": scored.exact,
                "advantage": advantages[i],
            }
            lines.append(json.dumps(record, ensure_ascii=False))
    fd = open_own(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, private=True)
    with os.fdopen(fd, "a", encoding="utf-8", errors="backslashreplace") as out:
        out.write("\n".join(lines) + "\n")
