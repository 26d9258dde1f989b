"""Two plans that share one `[run] revisions` folder, one after the other: a resume of the
first after the second ran there must not take the second's revisions for its own."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ehp_fsm.cli import main
from tests.run.test_run import plan_text


@pytest.mark.slow
def test_a_resume_into_revisions_another_plan_used_since_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Plan a ran (a real run of 2 steps); plan b, with the same `[run] revisions`, then ran
    there (stood in for by what its start and end leave: a's revisions removed, b's trained
    revision, the folder's lock naming b); then `ehp-fsm run a.toml --resume --steps 3`.
    Before (seen with real runs of both): the resume went on and retired every revision it had
    not written — plan b's trained model — without a word. Now it is refused before anything
    moves, naming plan b and the fix; the lock still names b, so a second try is refused too."""
    rev = tmp_path / "rev"
    plan = tmp_path / "a.toml"
    text = plan_text(tmp_path / "a" / "transitions.jsonl", 2)
    plan.write_text(text.replace('name = "short"', f'name = "a"\nrevisions = "{rev}"'))
    first = subprocess.run(  # its own process: run.json names a run that is gone
        [sys.executable, "-m", "ehp_fsm.cli", "run", str(plan)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert first.returncode == 0, first.stdout + first.stderr
    shutil.rmtree(rev)  # plan b's start removed a's revisions, and b wrote its own
    (rev / "r00000004").mkdir(parents=True)
    lock = tmp_path / "rev.lock"
    lock.write_text("999999\nb\n")  # b's run held it, naming its plan
    for _ in range(2):
        assert main(["run", str(plan), "--resume", "--steps", "3"]) == 2
        err = capsys.readouterr().err
        assert f"[run] revisions {rev} holds the revisions of plan 'b'" in err, err
        assert "give each plan its own [run] revisions" in err, err
        assert sorted(p.name for p in rev.iterdir()) == ["r00000004"]
        assert lock.read_text().split("\n")[1] == "b"
