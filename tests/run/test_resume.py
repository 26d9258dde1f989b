"""kill -9 of `ehp-fsm run` at several moments, and both ways on from there: `ehp-fsm stop`
leaves nothing running, `ehp-fsm run --resume` finishes the run.

One run of the short plan (6 steps), the user's commands in subprocesses, nothing faked. It is
killed with SIGKILL three times, each time when its transition log shows the moment under test:
1. during a borrow (its first transition, the engine's `drain`, is logged: the planner borrows
   at the first step boundary, so a resume has most steps left) — then `ehp-fsm stop` (twice:
   the second finds nothing), and every process the run recorded or the log names is gone, by
   pid and start time, the moment `stop` returns;
2. the resumed run, during a step (its first step's `partition` is logged) — not stopped: the
   next resume stops what is left itself;
3. the run resumed again, during a return (the Hybrid's `leave`, or `cancel` when the return
   came before it joined);
then a last `--resume` finishes: exit 0, a receipt that says from which step it resumed, a log
of four segments that replays clean, and the fault matrix's checks (`soundness`). (The return
is the end-of-run one, after the last step's state was saved: a plain `--resume` is then refused
as having nothing left to train, and the last one is asked for two more steps.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.run.soundness import (
    assert_run_sound,
    processes_of_test,
    recorded_identities,
    running,
)
from tests.run.test_run import plan_text

# the resume of step 3 below must borrow before its run ends: the short plan's floor
# (`[ehp] min_hybrids = 1`) borrows at its first step boundary, whatever the measured times
STEPS = 6


def cli(plan: Path, *args: str, run_id: str) -> subprocess.Popen[str]:
    env = {**os.environ, "EHP_TEST_RUN": run_id}
    return subprocess.Popen(
        [sys.executable, "-m", "ehp_fsm.cli", *args, str(plan)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def records(log: Path, old: int | None) -> list[dict[str, Any]]:
    """The complete lines of the log written so far; none while the log is still the file
    with inode `old` (a resume has not set the killed run's log aside yet)."""
    try:
        with log.open("rb") as fh:
            if os.fstat(fh.fileno()).st_ino == old:
                return []
            data = fh.read()
    except FileNotFoundError:
        return []
    return [json.loads(x) for x in data[: data.rfind(b"\n") + 1].splitlines()]


class LogTail:
    """The complete records appended to a run's log since the last `new()`, read on from where
    the last read ended (a poll every 10 ms re-read and re-parsed the whole log, on a 2-core
    CI machine beside the run it watched); none while the log is still the file with inode
    `old` (a resume has not set the killed run's log aside yet)."""

    def __init__(self, log: Path, old: int | None) -> None:
        self.log, self.old = log, old
        self.inode: int | None = None
        self.offset = 0

    def new(self) -> list[dict[str, Any]]:
        try:
            with self.log.open("rb") as fh:
                ino = os.fstat(fh.fileno()).st_ino
                if ino == self.old:
                    return []
                if ino != self.inode:  # the run's own log, read from its start
                    self.inode, self.offset = ino, 0
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        return [json.loads(x) for x in data[:end].splitlines()]


def inode(log: Path) -> int | None:
    return log.stat().st_ino if log.exists() else None


def kill_when(
    start: Callable[[], subprocess.Popen[str]],
    log: Path,
    moment: Callable[[dict[str, Any]], bool],
) -> str:
    """Start the run (`start`) and SIGKILL it as soon as its own log holds a record for which
    `moment` holds; its output. The log there before is noted before the run starts: a
    resume sets it aside and writes its own at the same path, and a note taken after the start
    could already be of the new log (whose records would then never be read)."""
    tail = LogTail(log, inode(log))
    proc = start()
    end = time.monotonic() + 200
    while time.monotonic() < end and proc.poll() is None:
        if any(r.get("accepted") and moment(r) for r in tail.new()):
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL, f"not killed at the moment:\n{out}"
    return out


def event(machine: str, name: str) -> Callable[[dict[str, Any]], bool]:
    return lambda r: r.get("machine") == machine and r.get("event") == name


def saved_step(run_dir: Path) -> int:
    latest = run_dir / "resume" / "latest.json"
    return int(json.loads(latest.read_text())["step"]) if latest.exists() else 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kill9_of_the_run_then_stop_or_resume(tmp_path: Path) -> None:
    run_id = uuid.uuid4().hex
    log = tmp_path / "run" / "transitions.jsonl"
    plan = tmp_path / "plan.toml"
    plan.write_text(plan_text(log, STEPS))
    run_dir = log.parent
    seen: list[tuple[str, int, float]] = []  # every process any of the runs recorded

    # 1. killed during a borrow; `stop` leaves nothing
    kill_when(lambda: cli(plan, "run", run_id=run_id), log, event("rollout_engine", "drain"))
    seen += recorded_identities(run_dir)
    stop = cli(plan, "stop", run_id=run_id)
    out, _ = stop.communicate(timeout=120)
    assert stop.returncode == 0, out
    alive = [x for x in [*seen, *recorded_identities(run_dir)] if running(x[1], x[2])]
    assert alive == [] and processes_of_test(run_id) == [], (alive, out)
    # the agents stop their engines themselves when the run dies (within ~4 s): what they
    # had not stopped yet by the time `stop` looked, it stopped
    assert "stopped" in out or "nothing was running" in out, out
    again = cli(plan, "stop", run_id=run_id)
    out, _ = again.communicate(timeout=60)
    assert again.returncode == 0 and "nothing was running" in out, out

    # 2. resumed, killed during its first step
    resumed_from = [saved_step(run_dir)]

    def resume() -> subprocess.Popen[str]:
        return cli(plan, "run", "--resume", run_id=run_id)

    kill_when(resume, log, event("training_step", "partition"))
    seen += recorded_identities(run_dir)

    # 3. resumed at once (what is left of 2 is stopped by the resume), killed during a return
    resumed_from.append(saved_step(run_dir))
    returning = event("hybrid_replica", "leave")  # an active Hybrid's return
    cancelled = event("hybrid_replica", "cancel")  # a Hybrid returned before it joined
    out = kill_when(resume, log, lambda r: returning(r) or cancelled(r))
    seen += recorded_identities(run_dir)

    # 4. resumed, runs to the end. A return killed at the end of the run comes after the last
    # step's state was saved: a plain resume then has nothing left to train and is refused
    # (the log untouched, nothing left running); asked for two more steps, it trains them.
    resumed_from.append(saved_step(run_dir))
    with log.open("ab") as torn:  # the kill tore the log's last line (as one mid-write does)
        torn.write(b'{"seq": 99999, "ti')
    if resumed_from[-1] == STEPS:
        refused = cli(plan, "run", "--resume", run_id=run_id)
        out, _ = refused.communicate(timeout=120)
        assert refused.returncode == 2 and "nothing left to resume" in out, out
        assert processes_of_test(run_id) == [], out
    steps = STEPS + 2  # a longer run than the killed one, said as the change it is
    last = cli(plan, "run", "--resume", "--steps", str(steps), run_id=run_id)
    out, _ = last.communicate(timeout=300)
    assert last.returncode == 0, out
    assert f"resumed after step {resumed_from[-1]}" in out, out
    # the repair is said (it was in the receipt alone), and what it cut is kept
    assert "resume: the killed run's log was repaired: recovered " in out, out
    assert "the cut bytes are kept in " in out, out
    assert any(run_dir.glob("transitions.3.jsonl.cut-*")), sorted(run_dir.iterdir())
    changed = f"grpo.steps: {STEPS} -> {steps}"  # (it said nothing of it)
    assert f"resume: the plan changed since the run being resumed started: {changed}" in out, out
    assert f"step {steps}/{steps}" in out, out
    receipt = assert_run_sound(log, run_id=run_id, identities=seen)
    assert receipt["resumed"]["from_step"] == resumed_from[-1]
    assert receipt["resumed"]["plan_changes"] == [changed]
    assert receipt["last_step"] == steps
    assert receipt["state_saves"]["saves"] >= 1  # it trained, and saved after its last step
    segments = sorted(p.name for p in run_dir.glob("transitions.*jsonl"))
    assert segments == [f"transitions.{n}.jsonl" for n in (1, 2, 3)] + ["transitions.jsonl"]
    # each resume started from the state saved before its kill, and said so in its header
    for n, step in zip((2, 3), resumed_from, strict=False):
        header = json.loads((run_dir / f"transitions.{n}.jsonl").read_bytes().split(b"\n")[0])
        assert header["meta"]["resumes"]["step"] == step
