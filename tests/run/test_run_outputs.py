"""What a run leaves in its run directory as its report (receipt, summary, timeline): never an
earlier run's beside this run's log, never a file cut short by a full disk."""

from __future__ import annotations

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
    Now each is written whole or not at all; the run says the receipt was not written."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(SHORT), str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "run.json: File too large" in done.stdout, done.stdout
    assert "receipt: not written (File too large" in done.stdout, done.stdout
    assert sorted(p.name for p in run_dir.iterdir()) == [], done.stdout
