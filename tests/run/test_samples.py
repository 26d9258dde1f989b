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
from ehp_fsm.run.samples import SAMPLES_FILE
from ehp_fsm.run.startup import clear_run_dir
from ehp_fsm.training.grpo import group_advantages
from tests.run.test_run import assert_no_orphans, plan_text

STEPS, GROUPS, SIZE = 2, 4, 4  # the short plan's 4 prompts × 4 samples a step


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_writes_every_trained_sample_with_its_reward_and_advantage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "run" / "transitions.jsonl"
    plan = tmp_path / "plan.toml"
    plan.write_text(plan_text(log, STEPS).replace("[run]\n", "[run]\nsamples = true\n", 1))
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
            rewards = torch.tensor([r["reward"] for r in group], dtype=torch.float64)
            want = group_advantages(rewards, SIZE).tolist()
            assert [r["advantage"] for r in group] == want  # what the step trained with
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
