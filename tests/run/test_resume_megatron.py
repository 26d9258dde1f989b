"""kill -9 of a Megatron-Core run at TP 2 in the middle of a step, then `ehp-fsm run --resume`.

The short plan on Megatron at TP 2 (`tp2_plan_text`: the Core a lane of two processes, a Hybrid
of two slots), the user's commands in subprocesses, nothing faked. The run is killed with
SIGKILL when its transition log shows the partition of step 2 — the state after step 1 is
saved by then (the first save is always due), and the Core's two TP processes are computing.
The resume stops what is left (both TP ranks of every lane, the TP followers included), restores
the Core's two TP shards from the saved state and checks each tensor bit for bit against the
digest written at the save (`verify.check_restored`), and trains the remaining steps: exit 0, a
receipt that says it resumed after step 1 and that the restored state was the saved one, a log
of two segments that replays clean, the fault matrix's checks (`soundness`), no process left,
and the saves' size in the receipt counts both TP shards (it counted only the index).
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ehp_fsm.training.verify import iter_state, read_index, state_digest, tensor_digest
from tests.run.soundness import assert_run_sound, recorded_identities
from tests.run.test_resume import cli, kill_when, saved_step
from tests.run.test_run import assert_no_orphans
from tests.run.test_run_megatron import tp2_plan_text

#: Steps of ~0.15 s each here: the eight after the kill's moment give the poll (~0.3 s behind
#: the log under load) room to kill before the last step's state is saved (then a resume
#: would have nothing left to train).
STEPS = 10


def _step_partition(at_least: int) -> Callable[[dict[str, Any]], bool]:
    """The moment: the partition of step `at_least` or later (its training is under way)."""

    def moment(r: dict[str, Any]) -> bool:
        if r.get("machine") != "training_step" or r.get("event") != "partition":
            return False
        return int(str(r.get("instance")).split("-", 1)[1].split(".", 1)[0]) >= at_least

    return moment


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_kill9_of_a_megatron_tp2_run_mid_step_then_resume(tmp_path: Path) -> None:
    run_id = uuid.uuid4().hex
    log = tmp_path / "run" / "transitions.jsonl"
    plan = tmp_path / "plan.toml"
    plan.write_text(tp2_plan_text(log, STEPS))
    run_dir = log.parent

    kill_when(lambda: cli(plan, "run", run_id=run_id), log, _step_partition(2))
    seen = recorded_identities(run_dir)
    resumed_from = saved_step(run_dir)
    assert 1 <= resumed_from < STEPS, resumed_from
    # what the killed run saved, kept for the check below (the resumed run replaces it)
    saved = json.loads((run_dir / "resume" / "latest.json").read_text())["state"]
    kept = tmp_path / "saved-state"
    shutil.copytree(run_dir / "resume" / saved, kept)

    last = cli(plan, "run", "--resume", run_id=run_id)
    out, _ = last.communicate(timeout=300)
    assert last.returncode == 0, out
    assert f"resumed after step {resumed_from}" in out, out
    assert f"step {STEPS}/{STEPS}" in out, out
    receipt = assert_run_sound(log, run_id=run_id, identities=seen)
    resumed = receipt["resumed"]
    assert resumed["from_step"] == resumed_from and receipt["last_step"] == STEPS
    # the Core's state after the restore, both TP shards, was bit for bit the saved one: the
    # lanes' tensors hashed after the restore equal the digests the save recorded, and those
    # are the saved files' (read here, apart from the run)
    restored = resumed["restored"]
    assert restored["bit_exact"] is True and restored["shards"] == ["tp0", "tp1"], restored
    assert restored["digest"] == state_digest(kept), restored
    index = read_index(kept)
    assert restored["tensors"] == len(index["tensors"]) > 0
    files = {key: tensor_digest(t) for key, t in iter_state(kept)}
    assert files == {e["key"]: e["sha256"] for e in index["tensors"]}
    assert f"the Core holds the state saved after step {resumed_from}, bit for bit" in out, out
    # the saves' size counts both TP shards (the last save's index differs from the kept one's
    # only in its step numbers)
    kept_bytes = sum(f.stat().st_size for f in kept.rglob("*") if f.is_file())
    assert abs(receipt["state_saves"]["bytes"] - kept_bytes) < kept_bytes // 100, kept_bytes
    segments = sorted(p.name for p in run_dir.glob("transitions.*jsonl"))
    assert segments == ["transitions.1.jsonl", "transitions.jsonl"], segments
    assert_no_orphans(run_id)  # the TP followers too
