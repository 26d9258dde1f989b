"""`ehp-fsm run` frozen (SIGSTOP) for longer than the agents' silence window, then resumed
(SIGCONT): a paused VM, a swap storm, a debugger. The run goes on, every agent hears the
controller again — the Core host's agent too, which runs no engine and has nothing to send but
heartbeats — and a SIGTERM then stops it cleanly (every engine confirmed stopped, no host
unconfirmed).

Before `AgentEndpoint._reconnect`, this run's agents were cut off for good: after the freeze
neither they nor the controller heard the other again (no frame either way, no disconnection
reported), the hosts' GPUs stayed quarantined and the run ended with exit 1
(`unconfirmed_hosts`). The cause: at the resume, each agent's pending connection completes its
handshake while the controller's ROUTER (no handover) still holds the agent's routing id for the
dead connection, and is parked. Later, in a loaded CI run, the Core host's agent never heard the
controller again while the controller kept hearing it: it replaced its connection once per
silence window, closing each one the controller had attached before the controller's blocked
loop could send on it. Now a connection that waited in the frozen process's queue is replaced
after half a heartbeat interval, any other unheard one after pauses that double
(`AgentEndpoint._parked`; `tests/runtime/test_frozen_controller.py` is the focused form).
Real processes, real sockets; the freeze is a real SIGSTOP of the run's process.

The same run is the fault matrix's "SIGTERM mid-run" row (one run carries both; each run costs
~25 s of start-up in CI): at its first step an operator asks where it waits (SIGUSR1 to the run
and to its Core worker: every thread's stack to the run's stderr and to the worker's log,
changing nothing), and the SIGTERM that ends it stops it cleanly with exit 128 + 15 and a
receipt that says it was interrupted.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.run.soundness import assert_run_sound
from tests.run.test_run import assert_no_handler_failures, assert_no_orphans, start

FROZEN_S = 6.0  # > the agents' ZMTP time-out (heartbeat 1 s × (3 missed + 1)): dropped, and
# each agent's replacement connection (after its 3 s silence window) is pending at the resume
# More steps than the test lets it train: once every agent has heard the controller again, the
# run is stopped by SIGTERM. (A fixed number of steps made the test a race: once the default
# run stopped thrashing, 60 steps ended 2.7 s after the resume, before the Core host's agent
# had replaced its parked connection — it would have heard the controller a moment later.)
STEPS = 500
HEARD_WITHIN_S = 60.0
#: The step after which the run is frozen: training goes on with the borrowed Hybrid.
FREEZE_AFTER = 6
#: A step's deadline shorter than the freeze (a step here takes well under a second): when the
#: freeze lands in a step's computing (it may: the next step trains as soon as the line is out),
#: the step's deadline, the trainer pool's wait for its ranks and its ledger do not count it
#: (`Loop.postpone_deadlines`, `OwnDeadline`; before, such a step failed at the resume — "no
#: reply from ranks [0] in 3 s" in a manual run — and the run stopped). The focused, certain
#: forms: `tests/training_pool/test_own_stall.py`, `tests/core/test_postponed_deadlines.py`
COMPUTING = "\n[deadlines.training_step]\ncomputing = 5.0\n"


def _step_of(line: str) -> int | None:
    head = line.split("/", 1)[0]
    return int(head[5:]) if head.startswith("step ") and head[5:].isdigit() else None


def _deaf(agents: Path) -> list[str]:
    """The hosts whose agent has not logged hearing the controller again yet."""
    return [
        host
        for host in ("h0", "h1")
        if '"controller_back"' not in (agents / f"{host}.log").read_text()
    ]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_frozen_past_the_silence_window_goes_on_and_a_sigterm_ends_it_cleanly(
    tmp_path: Path,
) -> None:
    proc, log, run_id = start(tmp_path, steps=STEPS, tables=COMPUTING)
    agents = log.parent / "agents"
    assert proc.stdout is not None
    frozen_at = after = 0
    seen: list[str] = []
    try:
        for line in proc.stdout:  # start-up done: the engines serve, training begins
            seen.append(line)
            if f"step 1/{STEPS}" in line:  # where does it wait? (SIGUSR1: stacks, no change)
                core = json.loads((log.parent / "run.json").read_text())["trainers"]["0"]
                proc.send_signal(signal.SIGUSR1)
                os.kill(int(core["pid"]), signal.SIGUSR1)
            if f"step {FREEZE_AFTER}/{STEPS}" in line:  # the stacks were written by now, and
                break  # the Hybrid borrowed at step 3's boundary trains (a fixed 3 s sleep did)
        proc.send_signal(signal.SIGSTOP)
        time.sleep(FROZEN_S)
        proc.send_signal(signal.SIGCONT)
        end = time.monotonic() + HEARD_WITHIN_S
        for line in proc.stdout:  # one line a step: the run goes on after the resume
            seen.append(line)
            step = _step_of(line)
            if step is not None:
                frozen_at = frozen_at or step
                after += 1
            # both: steps after the resume, and every agent hearing the controller again (a CI
            # run's agents heard it before the second step's line: the loop ended at one)
            if (after >= 2 and not _deaf(agents)) or time.monotonic() > end:
                break
        proc.send_signal(signal.SIGTERM)
        out = "".join(seen) + proc.stdout.read()
        # stopped cleanly, but not finished
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM, out[-3000:]
    finally:
        proc.send_signal(signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    deaf = _deaf(agents)
    assert not deaf, f"agents that never heard the controller again: {deaf}"
    # the freeze is named as the run's own, and no agent is blamed for it (`Stalled`): each
    # was taken for silent at the resume, its GPUs quarantined, before its heartbeats were read
    assert "the run's own process did not turn for" in out, out[-3000:]
    assert "went silent" not in out, out[-3000:]
    assert after >= 2, "the run did not go on after the resume"
    assert "most recent call first" in out and "job.py" in out, out  # the run's stacks
    assert "most recent call first" in (log.parent / "trainers" / "worker-0.log").read_text()
    assert "stopping cleanly" in out, out[-3000:]
    receipt = json.loads((log.parent / "receipt.json").read_text())
    assert receipt["clean_controller"] is True and receipt["unconfirmed_hosts"] == [], receipt
    assert receipt["interrupted"] is True and frozen_at < receipt["last_step"] < STEPS
    assert receipt["last_step"] >= FREEZE_AFTER  # the SIGTERM came after the freeze
    assert FROZEN_S - 0.5 < receipt["time_s"]["own_stalls"] < FROZEN_S + 5, receipt["time_s"]
    assert_no_orphans(run_id)
    assert_run_sound(log, run_id=run_id, interrupted=True)  # the fault matrix: SIGTERM mid-run
    assert_no_handler_failures(log)
