"""An operator's bad day: the Hybrid's warm worker is frozen (SIGSTOP) and never continued.

A frozen process is not a dead one: no exit for the pool to see, no reply either. The step's
`[deadlines.training_step] computing` fires and the step is retried on the Core — but the frozen
worker used to be kept: still bound and in the Gloo world, so its park, its GPU's finalizer (120 s
each, on the run's loop: the agents took the controller for silent) and the retry's commit (a
collective of the world it is in) waited on it, and the run hung for good (> 4 min, until SIGTERM,
which then took another 73 s); on the way an agent's reconcile confirmed its GPU free while the
frozen worker still held its lane. Frozen inside the gradient all-reduce it held the Core there
too, and the pool was declared broken, naming the Core rank. Now a warm worker that misses the
step's deadline is judged dead and killed, and the run goes on as after `kill -9` of a Hybrid:
the step retried on the Core, the worker replaced, the run finished (exit 0), nothing left.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from ehp_fsm.training.worker import REDUCE_HOOK_ENV
from tests.procs import Watched
from tests.run.test_run import assert_frozen_one_stopped_and_run_clean, plan_text

STEPS = 16
#: The step's `computing` deadline here (300 s by default): the frozen worker is given up then.
COMPUTING_S = 10.0


def _start(tmp: Path, extra_env: dict[str, str]) -> tuple[subprocess.Popen[str], Path, str]:
    run_id = uuid.uuid4().hex
    log = tmp / "run" / "transitions.jsonl"
    plan = tmp / "plan.toml"
    plan.write_text(
        plan_text(log, STEPS) + f"\n[deadlines.training_step]\ncomputing = {COMPUTING_S}\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "ehp_fsm.cli", "run", str(plan)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "EHP_TEST_RUN": run_id, "PYTHONUNBUFFERED": "1", **extra_env},
    )
    return proc, log, run_id


class _FreezeInsideReduction(threading.Thread):
    """Holds the Hybrid (rank 1) at the door of a step's reduction (`tests/reduce_hook.py`'s
    file protocol), gives the Core 0.3 s to get inside the all-reduce, then SIGSTOPs the Hybrid
    and lifts the hold: it stays frozen there, the Core waiting for it."""

    def __init__(self, hook: Path) -> None:
        super().__init__(daemon=True)
        self.hook = hook
        self.pid: int | None = None

    def run(self) -> None:
        end = time.monotonic() + 200
        while time.monotonic() < end:
            for f in self.hook.glob("enter-1-*"):
                if (self.hook / f"enter-0-{f.name.rsplit('-', 1)[1]}").exists():
                    time.sleep(0.3)
                    self.pid = int(f.read_text())
                    os.kill(self.pid, signal.SIGSTOP)
                    (self.hook / "hold-1").unlink()
                    return
            time.sleep(0.005)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", ["between_steps", "inside_the_all_reduce"])
def test_a_hybrid_frozen_for_good_is_given_up_and_the_run_finishes(
    tmp_path: Path, where: str
) -> None:
    env: dict[str, str] = {}
    freezer: _FreezeInsideReduction | None = None
    if where == "inside_the_all_reduce":
        hook = tmp_path / "hook"
        hook.mkdir()
        (hook / "hold-1").write_text("")
        env[REDUCE_HOOK_ENV] = str(hook)
        freezer = _FreezeInsideReduction(hook)
        freezer.start()
    proc, log, run_id = _start(tmp_path, env)
    frozen: int | None = None
    with Watched(proc) as watched:
        if freezer is None:  # SIGSTOP the warm worker once it trains (between steps, mostly)
            frozen, _ = watched.stop_when(
                lambda lines: any("hybrid 1" in x and x.startswith("step ") for x in lines),
                lambda: int(
                    json.loads((log.parent / "run.json").read_text())["trainers"]["1"]["pid"]
                ),
                poll_s=0.05,
            )
        # hung for good before: the frozen worker was waited for
        out = watched.finish(200, resume=[freezer.pid if freezer else None])
    frozen = frozen if freezer is None else freezer.pid
    assert frozen is not None, out
    assert proc.returncode == 0, out
    assert f"step {STEPS}/{STEPS}" in out
    # Frozen before its reply, the step is retried on the Core; frozen (between steps) just
    # after the reduction, its gradient counted and the step stands (a CI run froze it there).
    retried = "retrying the step on the Core" in out
    counted = re.search(r"died after the gradient reduction (\(.+\) )?\(its gradient counted", out)
    assert retried if freezer is not None else (retried or counted), out
    assert_frozen_one_stopped_and_run_clean(frozen, log, run_id, STEPS)
