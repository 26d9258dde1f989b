"""An operator's bad day, found by running `ehp-fsm run` of the short plan by hand and acting on
it (kill -9, signals, `stop`, read-only and deleted run directories, a file-size limit): what
the run, `stop` and `--resume` say must be true, and nothing may be left running.

Each test runs `ehp-fsm run` in a subprocess, as a user does, and acts at a moment it reads from
the run's own output.
"""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path

import pytest

from tests.run.soundness import processes_of_test
from tests.run.test_operator_faults import _run
from tests.run.test_run import plan_text


def _no_process_left(run_id: str, wait_s: float) -> None:
    end = time.monotonic() + wait_s
    while strays := processes_of_test(run_id):
        assert time.monotonic() < end, [p.cmdline() for p in strays]
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_directory_deleted_mid_run_stops_the_run_at_the_step_naming_it(
    tmp_path: Path,
) -> None:
    # `rm -rf` of the run directory as the planner borrows (after step 1). Before: the run
    # wrote on into its unlinked log — steps 2 and on trained, recorded nowhere — until a
    # borrow's trainer world, whose rendezvous file was in the deleted directory, failed a
    # minute later with "DistStoreError: No such file or directory"; the error said to go on
    # with `--resume` (which then found no run to resume) and the summary said "log: not
    # written (the run stopped before it began one)". Now the run stops (exit 2), naming the
    # log and why, within seconds: the Hybrid's group, forming in the removed directory, fails
    # within its formation bound (10 s; the store's minute before: 61.9 s after the removal,
    # 11.7 s now, in one run each), or the log's check before the borrow joins finds it gone.
    log = tmp_path / "run" / "transitions.jsonl"
    plan = tmp_path / "plan.toml"
    plan.write_text(plan_text(log, 8))
    run_id = uuid.uuid4().hex
    proc = _run(plan, run_id)
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 1: planner"):
            for _ in range(5):  # (the run may write a file in it meanwhile)
                shutil.rmtree(log.parent, ignore_errors=True)
                if not log.exists():
                    break
            break
    removed = time.monotonic()
    rest, _ = proc.communicate(timeout=240)
    took = time.monotonic() - removed
    out = "".join(lines) + rest
    assert proc.returncode == 2, out
    error = out[out.index("ehp-fsm: error:") :]
    assert f"the run's transition log {log} was removed while the run ran" in error, error
    fix = error[error.index("Fix:") :]
    assert "--resume" not in fix and "DistStoreError" not in error, error
    assert "start the run anew" in fix, error
    assert "step 8/8" not in out and "step 4/8" not in out, out  # (no step recorded nowhere)
    assert "step 1: planner" in out and took < 50.0, (took, out)  # (the store's minute before)
    assert f"log: gone ({log} was removed while the run ran)" in out, out
    assert not (log.parent / "resume").exists()  # no state saved for a resume that cannot be
    _no_process_left(run_id, wait_s=15.0)


def test_stop_of_a_starting_run_beside_an_earlier_runs_state_says_it_stopped_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `ehp-fsm stop` while a run starts (reading its inputs, before its run.json) in a run
    # directory that holds the previous run's run.json. Before, it said "stopped run (pid N):
    # SIGTERM", then "nothing was running; none of the 1 processes the run recorded is
    # running" (the earlier run's). The starting run stands in as a process holding the run
    # directory's lock, as a run does from its first moment (`_run_sleeper`).
    from ehp_fsm.cli import main
    from tests.run.test_stop_and_segments import _killed_run, _run_sleeper

    run_dir = tmp_path / "run"
    _killed_run(run_dir)  # the previous run's run.json: nothing of it left running
    starting = _run_sleeper(run_dir)
    try:
        assert main(["stop", str(run_dir)]) == 0
        assert starting.wait(timeout=30) != 0  # it was stopped (SIGTERM)
    finally:
        starting.kill()
        starting.communicate()
    out = capsys.readouterr().out
    assert f"stopped run (pid {starting.pid}): SIGTERM" in out, out
    assert "nothing was running" not in out, out
    assert "ehp-fsm stop short: stopped 1;" in out, out


def test_a_plan_renamed_since_its_run_is_told_how_to_resume_it(tmp_path: Path) -> None:
    # `[run] name` edited after a run was killed, then `run --resume` (or `stop PLAN`): the
    # refusal's why named the rename, but its fix said only "give each plan its own log
    # folder" — no way back to the run. Now it names the key and the value to put back.
    from ehp_fsm.run.owned import RunStateError, read_run_state
    from tests.run.test_stop_and_segments import _killed_run

    run_dir = tmp_path / "run"
    _killed_run(run_dir)  # a run of plan "short", killed
    with pytest.raises(RunStateError) as refused:
        read_run_state(run_dir, "short-renamed")
    assert refused.value.fix is not None
    assert '`[run] name = "short"` back to stop or resume that run' in refused.value.fix


def test_a_resume_of_a_run_killed_at_its_end_says_its_log_replays(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # kill -9 during the run's end (the Hybrid's return after the last step, whose state was
    # saved): the killed run wrote no receipt, and `--resume` has nothing left to train. The
    # refusal said only "give --steps N ... or start the run anew" (which removes the log); it
    # now says why (killed at its end) and that the log of those steps replays — which it does.
    from ehp_fsm.cli import main
    from ehp_fsm.run.resume import ResumeError, prepare_resume
    from tests.run.test_stop_and_segments import GOLDEN, _killed_run

    run_dir = tmp_path / "run dir"  # (the command it names is quoted)
    _killed_run(run_dir)
    log = run_dir / "transitions.jsonl"
    log.write_bytes(GOLDEN.read_bytes())  # ends with the Core after step 2
    state = run_dir / "resume" / "state-000002"
    state.mkdir(parents=True)
    (state / "index.json").write_text("{}")
    (run_dir / "resume" / "latest.json").write_text('{"step": 2, "state": "state-000002"}')
    with pytest.raises(ResumeError) as refused:
        prepare_resume("short", log, say=print, steps=2)
    error = str(refused.value)
    assert "was stopped after that, before it wrote its receipt (killed at its end)" in error
    assert f"`ehp-fsm replay '{log}'` verifies their log" in error, error
    assert main(["replay", str(log)]) == 0  # what it says is so
    assert "transitions verified" in capsys.readouterr().out
    # a run that ended (its receipt written) is refused as before, without the note
    (run_dir / "receipt.json").write_text("{}")
    with pytest.raises(ResumeError) as finished:
        prepare_resume("short", log, say=print, steps=2)
    assert "killed at its end" not in str(finished.value)
    assert "ehp-fsm replay" not in str(finished.value)


def test_a_write_failing_after_the_log_was_removed_is_named_as_the_removal(
    tmp_path: Path,
) -> None:
    """A write into the deleted run directory (a revision's config.json) can fail before the
    step boundary's look at the log: the error said "No such file or directory (config.json)
    ... free space on that disk" (seen once in a README-command run of the test above), where
    the cause was the removed log. The run's OSError path asks the log first."""
    import os
    import sys

    from ehp_fsm.plan import load_plan
    from ehp_fsm.run.job import Job, _log_removed

    log = tmp_path / "run" / "transitions.jsonl"
    plan_file = tmp_path / "plan.toml"
    plan_file.write_text(plan_text(log, 2))
    job = Job(load_plan(plan_file), out=sys.stdout, live=False, verify=False, steps=None)
    assert _log_removed(job) is None  # no log begun yet: nothing to say
    log.parent.mkdir(parents=True)
    log.write_text("{}\n")
    st = os.stat(log)
    job.log_id = (st.st_dev, st.st_ino)
    assert _log_removed(job) is None  # there: the OSError is what it says
    shutil.rmtree(log.parent)
    error = _log_removed(job)
    assert error is not None
    assert f"the run's transition log {log} was removed while the run ran" in str(error)
