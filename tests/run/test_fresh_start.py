"""A plain `ehp-fsm run PLAN` over a run of that plan that stopped before its last step.

Before: it started anew and removed the stopped run's saved state (the Core's weights and
optimizer state) and its transition log, so `--resume` typed a moment later found nothing to
go on from — every trained step lost to a missing flag (only the newest revision was kept).
Now such a start is refused, naming both ways on (`--resume`, or `--fresh` to start anew and
remove it), and nothing of the stopped run is touched; `--fresh` starts anew.

One real run of the short plan, stopped by SIGTERM as an operator stops it, and the user's
commands in subprocesses: nothing faked."""

from __future__ import annotations

import signal
import time
import uuid
from pathlib import Path

import pytest

from ehp_fsm.run.resume import unfinished_state
from tests.run.soundness import processes_of_test
from tests.run.test_resume import LogTail, cli, event, saved_step
from tests.run.test_run import plan_text

STEPS = 4


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_start_over_a_stopped_run_is_refused_unless_fresh(tmp_path: Path) -> None:
    run_id = uuid.uuid4().hex
    log = tmp_path / "run" / "transitions.jsonl"
    run_dir = log.parent
    plan = tmp_path / "plan.toml"
    plan.write_text(plan_text(log, STEPS))

    # the run, stopped by SIGTERM once its first step is published
    tail = LogTail(log, None)
    proc = cli(plan, "run", run_id=run_id)
    published = event("training_step", "published")
    end = time.monotonic() + 240
    while time.monotonic() < end and proc.poll() is None:
        if any(r.get("accepted") and published(r) for r in tail.new()):
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.01)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out
    saved = saved_step(run_dir)
    assert 1 <= saved < STEPS, out
    assert unfinished_state(run_dir) == (
        f"the last run of plan 'short' in {run_dir} stopped after step {saved} of {STEPS}"
    )
    before = {"log": log.read_bytes(), "resume": _files(run_dir / "resume")}

    # a plain start: refused, naming both ways on; the stopped run's files untouched
    plain = cli(plan, "run", run_id=run_id)
    out, _ = plain.communicate(timeout=120)
    assert plain.returncode == 2, out
    assert f"stopped after step {saved} of {STEPS}" in out, out
    assert "ehp-fsm run PLAN --resume" in out and "ehp-fsm run PLAN --fresh" in out, out
    assert {"log": log.read_bytes(), "resume": _files(run_dir / "resume")} == before
    assert processes_of_test(run_id) == []

    both = cli(plan, "run", "--resume", "--fresh", run_id=run_id)
    out, _ = both.communicate(timeout=120)
    assert both.returncode == 2 and "--resume and --fresh contradict each other" in out, out
    assert log.read_bytes() == before["log"]

    # --fresh: a new run from the model's weights, the stopped one's state and log replaced
    fresh = cli(plan, "run", "--fresh", "--steps", "1", run_id=run_id)
    out, _ = fresh.communicate(timeout=300)
    assert fresh.returncode == 0, out
    assert "step 1/1" in out and "resumed" not in out, out
    assert log.read_bytes() != before["log"]
    assert sorted(p.name for p in run_dir.glob("transitions*.jsonl")) == ["transitions.jsonl"]
    assert saved_step(run_dir) == 1
    assert unfinished_state(run_dir) is None  # it finished: a plain start may replace it
    assert processes_of_test(run_id) == []


def _saved_state(run_dir: Path, *, step: int, steps: int, plan: str) -> None:
    """A run's saved state after `step` and its plan record, as `resume.save_step_state` and
    `record_plan` leave them (the state's index is what marks it complete)."""
    import json

    from ehp_fsm.training.verify import INDEX_FILE

    state = run_dir / "resume" / f"state-{step:06d}"
    state.mkdir(parents=True)
    (state / INDEX_FILE).write_text("{}")
    (run_dir / "resume" / "latest.json").write_text(json.dumps({"step": step, "state": state.name}))
    record = {"grpo.steps": steps, "run.name": plan}
    (run_dir / "resume" / "plan.json").write_text(json.dumps(record))


@pytest.mark.parametrize("case", ["another_host", "no_run_state", "unreadable", "log_gone"])
def test_a_start_is_refused_whatever_run_json_says(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The refusal read `run.json` first: a run state of another host (a Slurm job's next
    allocation on another node, the run directory on shared storage) or none at all let the
    start go on and remove the saved state; so did a `latest.json` that cannot be read (a
    reviewer's find). The state in `resume/` decides now; with the log gone, only `--fresh`
    is offered (a resume needs it)."""
    import json

    from ehp_fsm import Orchestrator, load_plan
    from ehp_fsm.cli import main

    log = tmp_path / "run" / "transitions.jsonl"
    run_dir = log.parent
    plan = tmp_path / "plan.toml"
    plan.write_text(plan_text(log, STEPS))
    _saved_state(run_dir, step=2, steps=STEPS, plan="short-before")
    if case != "log_gone":  # the killed run's log (its header: what `check` takes for a log)
        Orchestrator.from_plan(load_plan(plan), log_path=log).close()
    if case == "another_host":
        (run_dir / "run.json").write_text(json.dumps({"format": 1, "plan": "short", "host": "n7"}))
    if case == "unreadable":
        (run_dir / "resume" / "latest.json").write_text("{")
    before = _files(run_dir)
    assert main(["run", str(plan)]) == 2
    err = capsys.readouterr().err
    if case == "unreadable":
        assert f"the saved state in {run_dir / 'resume'} cannot be read" in err, err
    else:
        assert f"the last run of plan 'short-before' in {run_dir} stopped after step 2 of 4" in err
    if case == "log_gone":
        assert "cannot be resumed: start anew, removing it, with ehp-fsm run PLAN --fresh" in err
    else:
        assert "ehp-fsm run PLAN --resume" in err and "ehp-fsm run PLAN --fresh" in err, err
    assert _files(run_dir) == before  # nothing removed, nothing written
