"""An operator's bad day: the run's surroundings change under it mid-run. The run either goes
on or stops with one message naming what went wrong and what to do, and `--resume` finishes.

`ehp-fsm run` of the short plan in a subprocess, as a user runs it; the test acts on the files
at a moment it reads from the run's own output.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ehp_fsm.replay import check_receipt, replay
from tests.run.soundness import (
    assert_gpus_end_free,
    assert_invariants_at_every_event,
    assert_run_sound,
)
from tests.run.test_run import assert_no_orphans, plan_text, session_model


def _run(plan: Path, run_id: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "ehp_fsm.cli", "run", str(plan), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "EHP_TEST_RUN": run_id},
    )


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_model_folder_moved_mid_run_is_named_with_resume_as_the_fix(tmp_path: Path) -> None:
    # The plan's model folder is renamed after step 2 (an operator tidying a disk). Each
    # revision copies its config and tokenizer files from there, so the next revision cannot
    # be saved and the run stops (exit 2). Before: the message blamed the revision store —
    # "free space under the revision store (or fix its permissions) and start again" — with
    # a library hint ("pass the HF directory the model was loaded from as `base`"); the fix is
    # to put the model folder back and resume, which finishes. (The message also said the
    # same cause twice, for the first and the second try.)
    model = tmp_path / "model"
    shutil.copytree(session_model(), model)
    log = tmp_path / "run" / "transitions.jsonl"
    plan = tmp_path / "plan.toml"
    plan.write_text(plan_text(log, 8).replace(str(session_model()), str(model)))
    run_id = uuid.uuid4().hex
    proc = _run(plan, run_id)
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 2/8"):
            model.rename(tmp_path / "model.moved")
            break
    rest, _ = proc.communicate(timeout=300)
    out = "".join(lines) + rest
    assert proc.returncode == 2, out
    error = out[out.index("ehp-fsm: error:") :]
    assert f"model directory {model} " in error, error
    assert "--resume" in error and "free space" not in error, error
    assert "`base`" not in error, error  # the library's own hint is no help to an operator
    assert error.count("has no config.json") == 1, error  # the second try's: "the same way"
    receipt = json.loads((log.parent / "receipt.json").read_text())
    assert receipt["error"] is not None and receipt["last_step"] >= 2, receipt
    assert_no_orphans(run_id)
    # the log replays and matches the receipt, every GPU free but the Core's (not the whole of
    # `assert_run_sound`: step 3 stays `publishing` — the Core stepped, its revision was never
    # saved — so its groups are consumed by a step that is not done, which that check refuses)
    result = replay(log)
    check_receipt(result, receipt)
    assert_invariants_at_every_event(log)
    assert_gpus_end_free(result, receipt)

    (tmp_path / "model.moved").rename(model)
    resumed = _run(plan, run_id, "--resume")
    t0 = time.monotonic()
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, out
    assert "step 8/8" in out, out
    assert time.monotonic() - t0 < 300
    assert_no_orphans(run_id)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stop_during_a_step_plans_nothing_after_it_and_prints_its_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SIGTERM (a real one, from a child process) lands as step 3 ends (after it the planner
    # would borrow). Before: the planner still ran after that step, while the engines
    # installed the new revision (the install wait ends at once when a stop is asked): seen
    # as the step's line "shortfall: wanted 1, granted 0: serving rollout GPUs (0) are below
    # the rollout reserve (2) after failures" with no failure (a SIGHUP mid-run); and a signal
    # landing in the planner's loop turn let its reward's interruption escape before the
    # step's line ("last step 5" under a last line of step 4, two `ehp-fsm stop` at once). The
    # planner is watched here, not changed: what it decides after a stop depends on how far
    # the installs got; that it is called does not.
    from ehp_fsm.plan import load_plan
    from ehp_fsm.run import job as job_module
    from tests.run.test_signals import signal_parent

    run_id = uuid.uuid4().hex
    monkeypatch.setenv("EHP_TEST_RUN", run_id)
    log = tmp_path / "run" / "transitions.jsonl"
    (tmp_path / "plan.toml").write_text(plan_text(log, 6))
    original = job_module.run_step
    killers: list[subprocess.Popen[bytes]] = []

    def then_signal(*args: object, **kwargs: object) -> object:
        done = original(*args, **kwargs)  # type: ignore[arg-type]
        if kwargs.get("step") == 3 and not killers:
            killers.append(signal_parent(tmp_path / "signal-sent"))
            killers[0].wait(30)  # sent: the handler runs in this thread, as the step ends
        return done

    monkeypatch.setattr(job_module, "run_step", then_signal)
    plan_next = job_module.Job.plan_next
    planned: list[tuple[int, bool]] = []  # (step, a stop asked for): watched, not changed

    def watched(self: job_module.Job, step: int, *args: float) -> None:
        planned.append((step, self.stop_requested))
        plan_next(self, step, *args)

    monkeypatch.setattr(job_module.Job, "plan_next", watched)
    out = io.StringIO()
    status = job_module.run(load_plan(tmp_path / "plan.toml"), out=out)
    text = out.getvalue()
    assert status == 128 + signal.SIGTERM, text
    assert killers and killers[0].returncode == 0
    assert planned == [(1, False), (2, False)], planned  # none after the stop
    line = next((x for x in text.splitlines() if x.startswith("step 3/6")), None)
    assert line is not None, text
    assert "shortfall" not in line, line
    receipt = assert_run_sound(log, run_id=run_id, interrupted=True)
    assert receipt["last_step"] == 3, receipt
