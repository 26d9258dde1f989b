"""kill -9 of a Core trainer in the middle of a run: the pool cannot go on without it (it holds
the authoritative optimizer state), so the run stops cleanly — exit 2 with the failed step, the
dead rank, and what to do (`--resume`) — leaves nothing running, and `--resume` goes on from the
last saved state. Real processes throughout; the Core rank is found by the identity the run
recorded in `run.json`, and killed when the log shows the step machine's second `partition`."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tests.run.soundness import assert_run_sound
from tests.run.test_resume import LogTail, cli, records
from tests.run.test_run import plan_text


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("victim", ["core", "starter"])
def test_a_dead_core_rank_stops_the_run_cleanly_and_resume_goes_on(
    tmp_path: Path, victim: str
) -> None:
    """`victim`: the Core rank's own process, or the process the pool forks its local ranks
    from (`training.prefork`): the Core rank dies with it, and the failure says so."""
    run_id = uuid.uuid4().hex
    log = tmp_path / "run" / "transitions.jsonl"
    plan = tmp_path / "plan.toml"
    plan.write_text(plan_text(log, 4))
    proc = cli(plan, "run", run_id=run_id)
    end = time.monotonic() + 200
    killed = None
    tail, parts = LogTail(log, None), 0
    while time.monotonic() < end and proc.poll() is None and killed is None:
        parts += sum(
            r.get("machine") == "training_step" and r.get("event") == "partition"
            for r in tail.new()
        )
        if parts >= 2:
            core = json.loads((log.parent / "run.json").read_text())["trainers"]["0"]
            killed = int(core["pid"])
            starter = psutil.Process(killed).ppid()
            assert "ehp_fsm.training.starter" in psutil.Process(starter).cmdline()
            os.kill(starter if victim == "starter" else killed, signal.SIGKILL)
        time.sleep(0.02)
    out = _ended(proc, log, timeout_s=120)
    assert killed is not None, out
    assert proc.returncode == 2, out
    assert f"process {killed} was killed by SIGKILL" in out, out
    said = f"its worker starter, process {starter}, was killed by SIGKILL"
    assert (said in out) == (victim == "starter"), out
    assert "trainer pool step failed on rank 0 (core:0)" in out
    assert "ehp-fsm run PLAN --resume" in out
    receipt = assert_run_sound(log, run_id=run_id, error=True)  # the fault matrix's checks
    assert receipt["clean_controller"] is True and receipt["left_running"] == []
    assert 1 <= receipt["last_step"] < 4

    resumed = cli(plan, "run", "--resume", run_id=run_id)
    out, _ = resumed.communicate(timeout=200)
    assert resumed.returncode == 0, out
    receipt = assert_run_sound(log, run_id=run_id)
    assert receipt["last_step"] == 4 and receipt["resumed"]["from_step"] >= 0


def _ended(proc: subprocess.Popen[str], log: Path, *, timeout_s: float) -> str:
    """The run's output once it ended. A run still going after `timeout_s` fails the test with
    where it waits — every thread's stack of the run and of its trainer workers (SIGUSR1:
    faulthandler) and the log's last records — and is killed with what it started, so that it
    cannot disturb the tests after this one (once, in a full CI run, it did)."""
    try:
        return proc.communicate(timeout=timeout_s)[0]
    except subprocess.TimeoutExpired:
        pass
    workers = json.loads((log.parent / "run.json").read_text()).get("trainers", {})
    for pid in [proc.pid, *(int(w["pid"]) for w in workers.values())]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
    time.sleep(2.0)
    stacks = "\n".join(
        f"--- {p.name}:\n{p.read_text(errors='replace')[-6000:]}"
        for p in sorted((log.parent / "trainers").glob("*.log"))
    )
    tail = [
        f"{r.get('seq')} {r.get('machine')}:{r.get('instance')} {r.get('event')} "
        f"{r.get('source')}->{r.get('dest')} {r.get('reason', '')}"
        for r in records(log, None)[-40:]
    ]
    proc.kill()
    out = proc.communicate()[0]
    subprocess.run(
        [sys.executable, "-m", "ehp_fsm.cli", "stop", str(log.parent.parent / "plan.toml")],
        capture_output=True,
        timeout=60,
        check=False,
    )
    pytest.fail(
        f"the run did not end within {timeout_s:g} s of the kill\n--- run output (with its "
        f"stacks):\n{out}\n--- trainers:\n{stacks}\n--- last records:\n" + "\n".join(tail)
    )
