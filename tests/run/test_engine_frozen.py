"""An operator's bad day: one rollout engine is frozen (SIGSTOP) mid-run and never continued.

A frozen engine is not a dead one: its process is there, its port takes connections, nothing
answers. Its install of the next revision hangs, so it stays `updating` until the machine's
install deadline (60 s) fails it. The planner's wait for a settled world between two steps
waited for that deadline: the next step came a minute later while the other engine served, and
the summary's "time: rollout X (Y%), training Z" shares (of their own sum) did not count that
minute. Now an install far slower than every install so far (`Publisher.settle_s`) is not
waited for: the run names the engine, goes on at the pace of the engine that serves, and the
summary splits the whole wall time (rollout, training, between steps with the waits for
installs, start-up and end). The frozen engine is failed by its deadline or stopped with the run
(killed: SIGTERM does not reach a stopped process), its groups requeued, none lost or trained
twice (`assert_run_sound`).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.procs import Watched
from tests.run.test_run import assert_frozen_one_stopped_and_run_clean, plan_text, serving_engine

STEPS = 14
FREEZE_AFTER = 5  # the step whose line is seen before the engine is frozen
#: the longest gap between two steps after the freeze (it was the 60 s install deadline)
MAX_GAP_S = 20.0


def _serving_engine_pid(log: Path, chosen: list[str]) -> int:
    """The pid of an engine that serves now (`serving_engine`: not one the planner drained for
    its borrow, e0 or e1 of host h1, whichever was the least loaded), its id appended to
    `chosen`."""
    eid, pid = serving_engine(log)
    chosen.append(eid)
    return pid


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_frozen_engine_does_not_hold_the_steps_and_the_summary_counts_the_wall_time(
    tmp_path: Path,
) -> None:
    run_id = uuid.uuid4().hex
    log = tmp_path / "run" / "transitions.jsonl"
    plan = tmp_path / "plan.toml"
    plan.write_text(plan_text(log, STEPS, engines=3))  # one borrowed, one frozen, one serving
    proc = subprocess.Popen(
        [sys.executable, "-m", "ehp_fsm.cli", "run", str(plan)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "EHP_TEST_RUN": run_id, "PYTHONUNBUFFERED": "1"},
    )
    chosen: list[str] = []
    with Watched(proc) as watched:
        frozen, frozen_at = watched.stop_when(
            lambda lines: any(x.startswith(f"step {FREEZE_AFTER}/") for x in lines),
            lambda: _serving_engine_pid(log, chosen),
        )
        out = watched.finish(200)
    assert frozen is not None and chosen, out
    engine = chosen[-1]
    assert proc.returncode == 0, out
    assert f"step {STEPS}/{STEPS}" in out, out
    rows = [json.loads(x) for x in log.read_text().splitlines()[1:]]
    stepped = [
        r["time"]
        for r in rows
        if r["machine"] == "training_step" and r["event"] == "stepped" and r["accepted"]
    ]
    after = [t for t in stepped if t >= frozen_at - 1.0]
    assert len(after) >= STEPS - FREEZE_AFTER - 1, (len(after), out)
    gaps = [b - a for a, b in itertools.pairwise(after)]
    # the other engine serves: the steps go on at its pace, not at the frozen one's deadline
    assert max(gaps) < MAX_GAP_S, (gaps, out)
    assert f"rollout_engine {engine} has not finished installing" in out, out
    # the frozen engine ended failed (its install deadline, or the run's end), never serving
    ends = [
        r["event"]
        for r in rows
        if r["machine"] == "rollout_engine" and r["instance"] == engine and r["accepted"]
    ]
    assert ends[-1] in ("deadline", "fail"), ends
    # the summary's time split covers the wall time: its parts add up to it
    line = next(x for x in out.splitlines() if x.startswith("time: "))
    parts = [
        float(re.search(rf"{name} ([0-9.]+)s", line).group(1))  # type: ignore[union-attr]
        for name in ("rollout", "training", "between steps", "steps'", "start-up and end", "wall")
    ]
    assert abs(sum(parts[:3]) - parts[3]) < 0.5, line
    assert abs(parts[3] + parts[4] - parts[5]) < 0.5, line
    assert "waiting for installs" in line, line
    assert_frozen_one_stopped_and_run_clean(frozen, log, run_id, STEPS)
