"""Two runs of one plan started at once: the second is refused while the first takes the run
directory over, and the first goes on untouched.

`run.json` names a run only once it has cleared its run directory (seconds when the revisions
are large); a second run started in that window found no live run there, cleared the first
one's revisions and keys, took the log, and at its end stopped every process `run.json` named
— the first run's. Here the first run (a real `ehp-fsm run`) is held inside that window by an
import-time wrapper (its `clear_run_dir` waits for the test's word, standing in for a slow
disk) while the second, a plain `ehp-fsm run` of the same plan, starts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.run.test_run import assert_no_orphans, leftovers, plan_text

_HELD_WHILE_CLEARING = """
import sys, time
from pathlib import Path
from ehp_fsm.run import job

clear = job.clear_run_dir

def held(*args, **kwargs):
    Path(sys.argv[1]).write_text("")
    end = time.monotonic() + 150
    while not Path(sys.argv[2]).exists() and time.monotonic() < end:
        time.sleep(0.05)
    return clear(*args, **kwargs)

job.clear_run_dir = held
from ehp_fsm.cli import main
sys.exit(main(sys.argv[3:]))
"""


def first_held_then_second(
    tmp: Path, first_plan: Path, second_plan: Path
) -> tuple[subprocess.CompletedProcess[str], subprocess.Popen[str], str, str, str]:
    """Start the first run held inside its `clear_run_dir`, run the second to its end, let the
    first go and stop it with SIGTERM: (the second's result, the first, its output, the
    two run ids)."""
    entered, go = tmp / "entered", tmp / "go"
    first_id, second_id = uuid.uuid4().hex, uuid.uuid4().hex
    with subprocess.Popen(
        [sys.executable, "-c", _HELD_WHILE_CLEARING, str(entered), str(go), "run", str(first_plan)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "EHP_TEST_RUN": first_id},
    ) as first:
        try:
            end = time.monotonic() + 150
            while not entered.exists():
                assert first.poll() is None and time.monotonic() < end, "the first run ended"
                time.sleep(0.05)
            second = subprocess.run(
                [sys.executable, "-m", "ehp_fsm.cli", "run", str(second_plan)],
                capture_output=True,
                text=True,
                env={**os.environ, "EHP_TEST_RUN": second_id},
                timeout=150,
            )
            go.write_text("")
            first.send_signal(signal.SIGTERM)  # it goes on: then stops cleanly, as asked
            out, _ = first.communicate(timeout=120)
        finally:
            first.kill()
            for p in leftovers(second_id):  # the old code's second run, had it gone on
                p.kill()
    return second, first, out, first_id, second_id


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_second_run_of_a_plan_starting_is_refused_and_the_first_goes_on(
    tmp_path: Path,
) -> None:
    log = tmp_path / "run" / "transitions.jsonl"
    plan = tmp_path / "plan.toml"
    plan.write_text(plan_text(log, 1))
    second, first, out, first_id, second_id = first_held_then_second(tmp_path, plan, plan)
    assert second.returncode == 2, (second.stdout, second.stderr)
    assert (
        f"another ehp-fsm run (pid {first.pid}) is starting or running in the run directory"
        in second.stderr
    ), second.stderr
    assert first.returncode == 128 + signal.SIGTERM, out
    receipt = json.loads((log.parent / "receipt.json").read_text())
    assert receipt["interrupted"] is True and receipt["error"] is None, receipt
    assert_no_orphans(first_id)
    assert_no_orphans(second_id)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_into_another_runs_revisions_directory_is_refused(tmp_path: Path) -> None:
    # Two plans with their own logs and one `[run] revisions` (a plan copied for a second
    # experiment): the start clears that directory under the other run, and both write r2.
    shared = tmp_path / "shared-revisions"
    plans = []
    for name in ("a", "b"):
        text = plan_text(tmp_path / name / "transitions.jsonl", 1)
        line = f'log = "{tmp_path / name / "transitions.jsonl"}"'
        assert line in text
        plans.append(tmp_path / f"{name}.toml")
        plans[-1].write_text(text.replace(line, f'{line}\nrevisions = "{shared}"'))
    second, first, out, first_id, second_id = first_held_then_second(tmp_path, *plans)
    assert second.returncode == 2, (second.stdout, second.stderr)
    assert (
        f"another ehp-fsm run (pid {first.pid}) uses the revisions directory {shared}"
        in second.stderr
    ), second.stderr
    assert first.returncode == 128 + signal.SIGTERM, out
    assert_no_orphans(first_id)
    assert_no_orphans(second_id)
