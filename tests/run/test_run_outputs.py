"""What a run leaves in its run directory as its report (receipt, summary, timeline): never an
earlier run's beside this run's log, never a file cut short by a full disk."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ehp_fsm.cli import main
from ehp_fsm.embedded import Orchestrator
from ehp_fsm.plan import load_plan
from ehp_fsm.run.startup import clear_run_dir

SHORT = Path(__file__).resolve().parents[2] / "examples" / "short.toml"
REPORT = ("receipt.json", "summary.txt", "timeline.png", "timeline.svg")


@pytest.mark.parametrize("resume", [False, True])
def test_a_run_taking_its_directory_over_removes_the_last_runs_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], resume: bool
) -> None:
    """Before: a new run (or a resume) left the previous run's receipt.json, summary.txt and
    timeline beside its own log until its end — for ever if it was killed — and
    `ehp-fsm replay LOG --receipt receipt.json` then said the live log "was cut short or lines
    were added ... an edited log cannot be trusted". Now the report goes when the run takes the
    directory over, and replay says there is no receipt."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name in REPORT:
        (run_dir / name).write_text("the previous run's\n")
    log = run_dir / "transitions.jsonl"
    orch = Orchestrator.from_plan(load_plan(SHORT), log_path=log)  # this run's log, begun
    orch.close()
    clear_run_dir(run_dir, run_dir / "revisions", resume=resume)
    assert [n for n in REPORT if (run_dir / n).exists()] == []
    assert log.is_file()
    assert main(["replay", str(log), "--receipt", str(run_dir / "receipt.json")]) == 2
    assert "is not a receipt file: because it does not exist" in capsys.readouterr().err


_FULL_DISK = """
import io, resource, signal, sys
from pathlib import Path
from ehp_fsm.plan import load_plan
from ehp_fsm.report.progress import RunFigures
from ehp_fsm.run.ending import finish
from ehp_fsm.run.owned import write_run_state
from ehp_fsm.run.startup import Cluster
from ehp_fsm.runtime.identity import capture
import os

run_dir = Path(sys.argv[2])
c = Cluster(plan=load_plan(sys.argv[1]), run_dir=run_dir, took_dir=True)
me = capture(os.getpid(), launch_token="t")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))  # the disk is full after 64 bytes a file
c.logfile = open(sys.argv[3], "a", encoding="utf-8")  # as `controller.log`: lines buffered
c.logfile.write("{}\\n" * 100)  # ... that cannot be written when the run closes it
try:
    write_run_state(run_dir, plan="short", run=me, agents={}, trainers={})
except OSError as exc:
    print("run.json:", exc.strerror)
out = io.StringIO()
finish(c, RunFigures(), error=None, interrupted=lambda: False, verify=False, out=out,
       say=print, started=0.0)
print(out.getvalue())
"""


def test_a_full_disk_at_the_end_leaves_no_cut_receipt_summary_or_run_state(tmp_path: Path) -> None:
    """The disk full as the run ends (a real write limit: RLIMIT_FSIZE in a process of its
    own, each file cut at 64 bytes). Before: an empty or cut `receipt.json` and `summary.txt`
    and a `run.json.tmp` stayed, and `replay --receipt` called the receipt unreadable JSON.
    Now each is written whole or not at all; the run says the receipt was not written. And
    `controller.log`'s last lines, which cannot be written as the run closes it: that close
    raised its OSError out of the run's end, and the run's own error (the step, the path,
    `--resume`) became "OSError: No space left on device" alone (seen on a 20 MB tmpfs)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(SHORT), str(run_dir), str(tmp_path / "ctl.log")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "run.json: File too large" in done.stdout, done.stdout
    assert "receipt: not written (File too large" in done.stdout, done.stdout
    assert sorted(p.name for p in run_dir.iterdir()) == [], done.stdout


_FULL_AT_START = """
import resource, signal, sys
from ehp_fsm.cli import main
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))  # the disk is full after 64 bytes a file
sys.exit(main(["run", sys.argv[1]]))
"""


def test_a_fresh_start_on_a_full_disk_says_to_start_again(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The disk is full as a fresh start writes its first files (a real write limit, as
    above; on a full 20 MB tmpfs it stopped the same way). It said "then go on with `ehp-fsm
    run PLAN --resume` (or start anew)", and that resume is refused: "there is no run of plan
    ... to resume" (a fresh start clears the previous run before it writes). Now: start again."""
    plan = _short_copy(tmp_path / "plan.toml", name="full-start", log=tmp_path / "run" / "t.jsonl")
    plan.write_text(
        plan.read_text().replace(
            f"{SHORT.parent.parent}/runs/models/tiny-qwen3", str(tiny_model_dir)
        )
    )
    done = subprocess.run(
        [sys.executable, "-c", _FULL_AT_START, str(plan)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "the run stopped after step 0: File too large" in done.stderr, done.stderr
    assert "then start the run again with `ehp-fsm run PLAN`" in done.stderr, done.stderr
    assert "--resume" not in done.stderr, done.stderr


def _short_copy(plan: Path, *, name: str, log: Path | None = None) -> Path:
    """The short plan written at `plan` under another `[run] name` (and `log`, if given), its
    model and data paths made absolute."""
    text = SHORT.read_text().replace('name = "short"', f'name = "{name}"')
    if log is not None:
        text = text.replace("runs/short/transitions.jsonl", str(log))
    text = text.replace('"../runs/models', f'"{SHORT.parent.parent}/runs/models')
    plan.write_text(text.replace('"data/', f'"{SHORT.parent}/data/'))
    return plan


_HOLDER = """
import sys
from pathlib import Path
from ehp_fsm.run.owned import lock_run_dir
fh = lock_run_dir(Path(sys.argv[1]), plan=sys.argv[2])  # as `ehp-fsm run` holds its directory
print("locked" if fh is not None else "refused", flush=True)
sys.stdin.read()  # until the test lets go
"""


def test_stop_from_another_directory_names_the_run_it_did_not_find(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The plan's `[run] log` is relative, so a run's directory is taken from where the run
    started. Before: `ehp-fsm stop PLAN` from another directory said "no run state ...:
    nothing to stop" and exited 0 while the run went on. Now it names the live run (pid, run
    directory, `ehp-fsm stop RUN_DIR` to stop it) and exits 1. The run is a real process holding its
    run directory's lock, as a run does from its first moment. The plan is the short one under
    a name of this test's own: `stop` looks for runs of the plan's name, and other tests (in
    the other pytest-xdist worker) run the short plan."""
    name = f"short-{tmp_path.name}"
    plan = _short_copy(tmp_path / "plan.toml", name=name)
    started_in = tmp_path / "started in"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(started_in / "runs" / "short"), name],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        (tmp_path / "elsewhere").mkdir()
        monkeypatch.chdir(tmp_path / "elsewhere")
        assert main(["stop", str(plan)]) == 1
        out = capsys.readouterr().out
        assert "but a run of this plan runs elsewhere" in out, out
        assert f"pid {holder.pid}, run directory {started_in / 'runs' / 'short'}" in out, out
        assert f"to stop it, ehp-fsm stop '{started_in / 'runs' / 'short'}'" in out, out
        assert holder.poll() is None  # nothing was stopped
    finally:
        holder.communicate(input="", timeout=30)
    assert main(["stop", str(plan)]) == 0  # gone: nothing to stop, as before
    assert "nothing to stop" in capsys.readouterr().out


_RUN = """
import os, sys
from pathlib import Path
from ehp_fsm.run.owned import lock_run_dir, write_run_state
from ehp_fsm.runtime.identity import capture
run_dir = Path(sys.argv[1])
fh = lock_run_dir(run_dir, plan="short")
me = capture(os.getpid(), launch_token="t")
write_run_state(run_dir, plan="short", run=me, agents={}, trainers={})
print("running", flush=True)
sys.stdin.read()  # until SIGTERM, as a run waits for its steps
"""


def test_stop_takes_the_run_directory_when_the_plan_was_edited_since(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The operator edited the plan while its run ran — renamed it, or left it broken — and
    then could not stop the run with `ehp-fsm stop PLAN`: "belongs to plan 'short', not
    'renamed' because two plans share a run directory", or a TOML error. `ehp-fsm stop
    RUN_DIR` stops what the run recorded there, whatever the plan says now (the run is a real
    process that recorded itself in `run.json`, as a run does)."""
    run_dir = tmp_path / "runs" / "short"
    plan = _short_copy(tmp_path / "plan.toml", name="renamed", log=run_dir / "transitions.jsonl")
    run = subprocess.Popen(
        [sys.executable, "-c", _RUN, str(run_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert run.stdout is not None and run.stdout.readline() == "running\n"
        assert main(["stop", str(plan)]) == 2
        err = capsys.readouterr().err
        assert "or this plan's `[run] name` was changed since that run started" in err, err
        assert f"(`ehp-fsm stop {run_dir}` stops what that run left running" in err, err
        plan.write_text("[run\n")  # broken mid-edit
        assert main(["stop", str(plan)]) == 2
        assert main(["stop", str(run_dir)]) == 0
        out = capsys.readouterr().out
        assert f"stopped run (pid {run.pid}): SIGTERM" in out, out
        assert run.wait(timeout=30) == -15
    finally:
        if run.poll() is None:
            run.kill()
        run.communicate(timeout=30)
    assert main(["stop", str(run_dir)]) == 0
    assert "nothing was running" in capsys.readouterr().out
    assert main(["stop", str(tmp_path)]) == 0  # a folder that holds no run
    assert f"no run state in {tmp_path}: nothing to stop" in capsys.readouterr().out


def test_stop_of_a_folder_above_or_below_a_live_run_names_its_run_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ehp-fsm stop runs` or `stop runs/short/agents` — a folder above or below a live run's
    directory — said "no run state ...: nothing to stop" and exited 0 while the run went on.
    Now it names the run directory and the command that stops it, and exits 1, as `stop PLAN`
    from the wrong folder does; with the run gone it is "nothing to stop" again. The run is a
    real process that locked its directory and recorded itself in `run.json`, as a run does."""
    run_dir = tmp_path / "runs" / "short"
    (run_dir / "agents" / "h1").mkdir(parents=True)
    run = subprocess.Popen(
        [sys.executable, "-c", _RUN, str(run_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert run.stdout is not None and run.stdout.readline() == "running\n"
        for folder in (tmp_path, run_dir.parent, run_dir / "agents", run_dir / "agents" / "h1"):
            assert main(["stop", str(folder)]) == 1, folder
            out = capsys.readouterr().out
            assert f"no run state in {folder}, but a run runs in a folder" in out, out
            assert "nothing was stopped" in out, out
            assert f"run pid {run.pid}, run directory {run_dir}: to stop it, " in out, out
            assert f"ehp-fsm stop {shlex.quote(str(run_dir))}" in out, out
        assert run.poll() is None  # nothing was stopped
    finally:
        run.communicate(input="", timeout=30)
    for folder in (tmp_path, run_dir / "agents"):
        assert main(["stop", str(folder)]) == 0  # nothing of it runs: nothing to stop
        assert f"no run state in {folder}: nothing to stop" in capsys.readouterr().out


def test_a_full_disk_error_says_from_which_saved_step_a_resume_goes_on(tmp_path: Path) -> None:
    """Seen on a real 3 MB tmpfs: "the run stopped after step 26 ... go on with --resume", and
    the resume went on after step 1 — the last state saved (saves take at most 2% of the run's
    time, so they are far apart) — training 25 steps again without having said so. Now the
    error says from which saved step. (The job is a stand-in holding the two things the error
    reads — its last step and run directory; the saved state's files are real.)"""
    import errno
    from types import SimpleNamespace

    from ehp_fsm.run.job import _os_error
    from ehp_fsm.training.verify import INDEX_FILE

    run_dir = tmp_path / "run"
    (run_dir / "resume" / "state-000001").mkdir(parents=True)
    (run_dir / "resume" / "state-000001" / INDEX_FILE).write_text("{}")
    (run_dir / "resume" / "latest.json").write_text('{"step": 1, "state": "state-000001"}')
    job = SimpleNamespace(
        figures=SimpleNamespace(last_step=26), cluster=SimpleNamespace(run_dir=run_dir)
    )
    err = _os_error(OSError(errno.ENOSPC, "No space left on device"), job)  # type: ignore[arg-type]
    assert "the run stopped after step 26: No space left on device" in err.what
    assert err.fix.endswith(
        "it goes on from the state saved after step 1 (steps 2..26 are trained again)"
    ), err.fix


@pytest.mark.parametrize("resume", [False, True])
def test_a_fresh_start_removes_the_segments_of_the_log_it_replaces(
    tmp_path: Path, resume: bool
) -> None:
    """A run killed, resumed (its log set aside as `transitions.1.jsonl`), then started anew:
    the new log replaces the old one, whose segment stayed beside an unrelated log (and the
    next resume numbered its own segment after it). A resume keeps every segment: its log
    goes on from them."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    log = run_dir / "transitions.jsonl"
    kept = [run_dir / "transitions.x.jsonl", run_dir / "other.1.jsonl"]  # not segments of it
    segments = [run_dir / "transitions.1.jsonl", run_dir / "transitions.2.jsonl"]
    for path in (log, *kept, *segments):
        path.write_text("a log\n")
    clear_run_dir(run_dir, run_dir / "revisions", resume=resume, log=log)
    assert [p.name for p in segments if p.exists()] == (
        [p.name for p in segments] if resume else []
    )
    assert all(p.exists() for p in (log, *kept))


def test_a_link_planted_where_a_report_is_staged_is_not_written_through(tmp_path: Path) -> None:
    """Each report file is written to `NAME.tmp` and renamed over `NAME` (`write_whole`).
    Before: a `run.json.tmp` or `receipt.json.tmp` that was a symbolic link (planted in a run
    directory others can write, or left by a careless `ln -s`) was followed — the link's
    target (here another file of the user's) was overwritten with the run's state, and the
    rename then left `run.json` a link to it. Now the stale entry is replaced, never written
    through: the target keeps its bytes and `run.json` is a file of its own."""
    from ehp_fsm.fspaths import write_whole
    from ehp_fsm.run.owned import write_run_state
    from ehp_fsm.runtime.identity import capture, new_launch_token

    run_dir, victim = tmp_path / "run", tmp_path / "notes.txt"
    run_dir.mkdir()
    victim.write_text("precious\n")
    (run_dir / "run.json.tmp").symlink_to(victim)
    (run_dir / "receipt.json.tmp").symlink_to(victim)
    me = capture(os.getpid(), launch_token=new_launch_token())
    write_run_state(run_dir, plan="short", run=me, agents={}, trainers={})
    write_whole(run_dir / "receipt.json", "{}\n")
    assert victim.read_text() == "precious\n"
    for name in ("run.json", "receipt.json"):
        assert not (run_dir / name).is_symlink() and (run_dir / name).is_file()
    assert '"short"' in (run_dir / "run.json").read_text()
    assert (run_dir / "receipt.json").read_text() == "{}\n"
    assert sorted(p.name for p in run_dir.iterdir()) == ["receipt.json", "run.json"]


def test_a_link_planted_where_the_run_opens_its_own_files_is_refused(tmp_path: Path) -> None:
    """The run opens three files of its run directory in place: its lock (`run.lock`, and
    `<revisions>.lock`), `controller.log` and the transition log. Before, a symbolic link
    planted at any of them (a run directory others can write, or a careless `ln -s`) was
    followed: the lock emptied its target and wrote a pid and plan name into it, the
    controller log appended the run's log lines to it, the transition log emptied it and wrote
    the log there. Now each is refused naming the link, its target left as it was (the
    transition log's own refusal is for a library `Orchestrator`; `ehp-fsm run` refuses a
    linked `run.log` as a plan key: `test_inputs`)."""
    from ehp_fsm.errors import EhpError
    from ehp_fsm.run.owned import lock_run_dir
    from ehp_fsm.run.startup import log_beside
    from ehp_fsm.translog import TransitionLog

    run_dir, victim = tmp_path / "run", tmp_path / "notes.txt"
    run_dir.mkdir()
    victim.write_text("precious\n")
    opens = {
        "run.lock": lambda: lock_run_dir(run_dir, plan="short"),
        "controller.log": lambda: log_beside(run_dir),
        "transitions.jsonl": lambda: TransitionLog.create(
            run_dir / "transitions.jsonl", config={"inventory": {}}, specs={}, key=None
        ),
    }
    for name, open_it in opens.items():
        (run_dir / name).symlink_to(victim)
        with pytest.raises(EhpError, match="symbolic link") as err:
            open_it()
        assert str(run_dir / name) in str(err.value) and str(victim) in str(err.value)
        assert victim.read_text() == "precious\n", name


def test_a_run_lock_is_its_users_alone(tmp_path: Path) -> None:
    """`run.lock` (and the revisions' lock, the same function) was made 0644: any user of the
    machine could open it read-only and hold its `flock`, and every `ehp-fsm run` of that
    directory was then refused as a run starting elsewhere. It is made 0600, and one an older
    run left 0644 is narrowed before it is locked."""
    from ehp_fsm.run.owned import lock_run_dir

    fh = lock_run_dir(tmp_path / "fresh", plan="p")
    assert fh is not None
    try:
        assert (tmp_path / "fresh" / "run.lock").stat().st_mode & 0o777 == 0o600
    finally:
        fh.close()
    old = tmp_path / "old" / "run.lock"
    old.parent.mkdir()
    old.write_text("")
    old.chmod(0o644)
    fh = lock_run_dir(old.parent, plan="p")
    assert fh is not None
    try:
        assert old.stat().st_mode & 0o777 == 0o600
    finally:
        fh.close()


def test_the_receipt_holds_the_reward_failures_by_kind_and_the_step_before_a_controller(
    tmp_path: Path,
) -> None:
    """The summary gave the reward failures by kind with the last one's message; the receipt
    kept the count alone. A run stopped before its controller started (a resume stopped as it
    took its run directory over) had no `last_step` in its receipt. (The end of a run on a
    start-up that built nothing: `ending.finish` as `job.run` calls it.)"""
    import io
    import json
    import time

    from ehp_fsm.report.progress import RunFigures
    from ehp_fsm.run import ending
    from ehp_fsm.run.startup import Cluster

    run_dir = tmp_path / "run"
    cluster = Cluster(plan=load_plan(SHORT), run_dir=run_dir, took_dir=True)
    last = "prompt '2+3=' (completion 4 of 16: '5'): it returned None, a NoneType, not a number"
    figures = RunFigures(
        last_step=12,
        final_revision=13,
        reward_failures=3,
        reward_failure_kinds={"not_a_number": 2, "non_finite": 1},
        reward_failure_last=last,
    )
    out = io.StringIO()
    ending.finish(
        cluster,
        figures,
        error=None,
        interrupted=lambda: True,
        verify=False,
        out=out,
        say=lambda _: None,
        started=time.monotonic(),
    )
    receipt = json.loads((run_dir / "receipt.json").read_text())
    assert receipt["reward_failures"] == 3, receipt
    assert receipt["reward_failure_kinds"] == {"not_a_number": 2, "non_finite": 1}, receipt
    assert receipt["reward_failure_last"] == last and receipt["last_step"] == 12, receipt
    summary = (run_dir / "summary.txt").read_text()
    assert summary == out.getvalue()[: len(summary)]
    assert 'reward failures (scored 0, on_error = "zero"): 3 (non_finite 1, not_a_number 2)' in (
        summary
    ), summary


def test_a_write_that_fails_for_its_size_names_the_file(tmp_path: Path) -> None:
    """Under a file-size limit (a stand-in for a full disk) a write's `OSError` named no file
    ("File too large"), and the run's error named only its run directory. Real OS limit, in a
    child process (Python ignores SIGXFSZ, so the write fails with EFBIG)."""
    code = (
        "import resource, sys\n"
        "from pathlib import Path\n"
        "from ehp_fsm.fspaths import write_whole\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))\n"
        "try:\n"
        "    write_whole(Path(sys.argv[1]), 'x' * 100_000)\n"
        "except OSError as exc:\n"
        "    print(exc.errno, exc.filename, exc)\n"
    )
    target = tmp_path / "receipt.json"
    out = subprocess.run(
        [sys.executable, "-c", code, str(target)], capture_output=True, text=True, timeout=60
    )
    assert out.stdout.startswith(f"27 {target} "), (out.stdout, out.stderr)
    assert str(target) in out.stdout.split(" ", 2)[2]  # (the message names it too)
    assert not target.exists() and not (tmp_path / "receipt.json.tmp").exists()
