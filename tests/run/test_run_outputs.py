"""What a run leaves in its run directory as its report (receipt, summary, timeline): never an
earlier run's beside this run's log, never a file cut short by a full disk."""

from __future__ import annotations

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
