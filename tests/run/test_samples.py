"""`[run] samples = true`: every trained sample in `samples.jsonl` beside the log.

A run's outputs held the per-step mean reward alone: no prompt, completion, reward or advantage
of any sample, so the samples a run trained on could not be audited from the run (an ML
user's find, 2026-12-07). A real run of the short plan (2 steps) with the key on; what it
wrote is checked against the run's own receipt and the objective's advantage function.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from ehp_fsm.cli import main
from ehp_fsm.errors import EhpError
from ehp_fsm.run.samples import SAMPLES_FILE, prepare_samples
from ehp_fsm.run.startup import clear_run_dir
from ehp_fsm.training.grpo import ADV_EPS
from tests.run.test_run import assert_no_orphans, plan_text

STEPS, GROUPS, SIZE = 2, 4, 4  # the short plan's 4 prompts × 4 samples a step


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_writes_every_trained_sample_with_its_reward_and_advantage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "run" / "transitions.jsonl"
    plan = tmp_path / "plan.toml"
    # (the planner may not move here, so the run also shows the summary saying why: a run that
    # borrowed nothing said only "borrows and returns: none")
    text = plan_text(log, STEPS).replace("[run]\n", "[run]\nsamples = true\n", 1)
    text = text.replace("borrow_threshold = 0.001", "borrow_threshold = 1e6")
    text = text.replace("release_threshold = 0.0005", "release_threshold = 1e-6")
    plan.write_text(text.replace("min_hybrids = 1", "min_hybrids = 0"))
    assert main(["check", str(plan)]) == 0
    written = log.parent / SAMPLES_FILE
    said = capsys.readouterr().out
    assert (
        f"samples: every trained sample (prompt, completion, reward, advantage) to {written}"
        in said
    )
    run_id = uuid.uuid4().hex
    done = subprocess.run(
        [sys.executable, "-m", "ehp_fsm.cli", "run", str(plan)],
        capture_output=True,
        text=True,
        env={**os.environ, "EHP_TEST_RUN": run_id},
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert_no_orphans(run_id)
    (moved,) = [x for x in done.stdout.splitlines() if x.startswith("borrows and returns")]
    assert moved.startswith(
        "borrows and returns: none — the planner's last decision, after step 1: train/rollout "
        "time ratio "
    ), moved
    assert "inside the hysteresis band (1e-06, 1000000.0)" in moved, moved
    assert moved in (log.parent / "summary.txt").read_text()
    receipt = json.loads((log.parent / "receipt.json").read_text())
    assert written.stat().st_mode & 0o777 == 0o600  # the prompts are the user's data
    records = [json.loads(line) for line in written.read_text().splitlines()]
    assert len(records) == STEPS * GROUPS * SIZE
    data = [
        json.loads(line)
        for line in (Path(__file__).parents[2] / "examples/data/add-0-4.jsonl")
        .read_text()
        .splitlines()
    ]
    for step in range(1, STEPS + 1):
        mine = [r for r in records if r["step"] == step]
        groups = sorted({r["group"] for r in mine})
        assert len(groups) == GROUPS and len(mine) == GROUPS * SIZE, mine
        # the step's mean reward is the receipt's
        mean = sum(r["reward"] for r in mine) / len(mine)
        assert mean == pytest.approx(receipt["rewards"][step - 1], abs=1e-9)
        for gid in groups:
            group = [r for r in mine if r["group"] == gid]
            assert [r["sample"] for r in group] == list(range(SIZE))
            assert len({(r["prompt_index"], r["prompt"], r["revision"]) for r in group}) == 1
            # the advantage, recomputed here from the objective's definition: (r − mean) /
            # (population std + ε) in float64, rounded to the float32 the loss takes; 0 for a
            # group whose rewards are all equal
            rewards = [r["reward"] for r in group]
            mean = sum(rewards) / SIZE
            std = (sum((x - mean) ** 2 for x in rewards) / SIZE) ** 0.5
            want = [
                0.0
                if len(set(rewards)) == 1
                else torch.tensor((x - mean) / (std + ADV_EPS), dtype=torch.float64)
                .to(torch.float32)
                .item()
                for x in rewards
            ]
            assert [r["advantage"] for r in group] == pytest.approx(want, rel=1e-6, abs=1e-7)
            assert {r["resumes"] for r in group} == {0}
            for r in group:
                assert 1 <= r["tokens"] <= 3  # max_response_len
                assert r["exact"] == (r["reward"] >= 1.0)
                # the prompt and label are the data file's line's (the reward scored this)
                line = data[r["line"] - 1]
                assert r["label"] == str(line["label"]) and line["prompt"] in r["prompt"]
                # exact_match: reward 1 exactly when the completion is the label
                assert (r["reward"] == 1.0) == (r["completion"].strip() == r["label"]), r


def test_a_fresh_start_removes_the_last_runs_samples_and_a_resume_keeps_them(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / SAMPLES_FILE).write_text('{"step": 1}\n')
    clear_run_dir(run_dir, run_dir / "revisions", resume=True)
    assert (run_dir / SAMPLES_FILE).read_text() == '{"step": 1}\n'
    clear_run_dir(run_dir, run_dir / "revisions", resume=False)
    assert not (run_dir / SAMPLES_FILE).exists()


def test_a_fresh_start_removes_what_recovery_cut_off_the_last_runs_logs(tmp_path: Path) -> None:
    """The cut bytes a recovery kept (`LOG.cut-OFFSET`, `SEGMENT.cut-OFFSET`) outlived a fresh
    start and then lay beside an unrelated run's segments (a reviewer's find)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    log = run_dir / "transitions.jsonl"
    names = ["transitions.jsonl.cut-512", "transitions.1.jsonl", "transitions.1.jsonl.cut-4096"]
    for name in [log.name, *names, "other.jsonl.cut-1"]:
        (run_dir / name).write_text("x")
    clear_run_dir(run_dir, run_dir / "revisions", resume=False, log=log)
    assert sorted(p.name for p in run_dir.iterdir()) == ["other.jsonl.cut-1", "transitions.jsonl"]


def test_a_torn_last_line_is_cut_before_a_resume_appends_and_a_link_is_refused_at_the_start(
    tmp_path: Path,
) -> None:
    """A run killed mid-write left a torn last line, and the resume appended its first line to
    it: neither was JSON. And a link at the path was refused only once step 1 had trained (the
    run then stopped); both are now the start's (`prepare_samples`)."""
    path = tmp_path / SAMPLES_FILE
    path.write_bytes(b'{"step": 1}\n{"step": 2}\n{"step": 3, "gro')
    prepare_samples(path)
    assert path.read_bytes() == b'{"step": 1}\n{"step": 2}\n'
    prepare_samples(path)  # whole: left as it is
    assert path.read_bytes() == b'{"step": 1}\n{"step": 2}\n'
    path.write_bytes(b'{"step": 1, "torn')  # no whole line at all
    prepare_samples(path)
    assert path.read_bytes() == b""
    link = tmp_path / "link.jsonl"
    link.symlink_to(path)
    with pytest.raises(EhpError, match="is a symbolic link"):
        prepare_samples(link)
