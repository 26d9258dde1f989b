"""`ehp-fsm run` frozen (SIGSTOP) for longer than the agents' silence window, then resumed
(SIGCONT): a paused VM, a swap storm, a debugger. The run goes on and ends cleanly (exit 0,
every engine confirmed stopped), and every agent hears the controller again — the Core host's
agent too, which runs no engine and has nothing to send but heartbeats.

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
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from tests.run.soundness import assert_run_sound
from tests.run.test_run import assert_no_orphans, start

FROZEN_S = 10.0  # > the agents' ZMTP time-out (heartbeat 1 s × (3 missed + 1)): dropped
# Enough steps that the run goes on for seconds after the resume (40 ended 1.4 s after the
# last agent heard the controller again, under load): time for every agent to be heard.
STEPS = 60


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_frozen_past_the_silence_window_goes_on_and_ends_cleanly(tmp_path: Path) -> None:
    proc, log, run_id = start(tmp_path, steps=STEPS)
    assert proc.stdout is not None
    try:
        for line in proc.stdout:  # start-up done: the engines serve, training begins
            if f"training {STEPS} steps" in line:
                break
        time.sleep(3.0)
        proc.send_signal(signal.SIGSTOP)
        time.sleep(FROZEN_S)
        proc.send_signal(signal.SIGCONT)
        out = proc.stdout.read()
        assert proc.wait(timeout=240) == 0, out[-3000:]
    finally:
        proc.send_signal(signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    receipt = json.loads((log.parent / "receipt.json").read_text())
    assert receipt["clean_controller"] is True and receipt["unconfirmed_hosts"] == [], receipt
    assert receipt["last_step"] == STEPS
    agents = log.parent / "agents"
    deaf = [
        host
        for host in ("h0", "h1", "h2")
        if '"controller_back"' not in (agents / f"{host}.log").read_text()
    ]
    assert not deaf, f"agents that never heard the controller again: {deaf}"
    assert_no_orphans(run_id)
    assert_run_sound(log, run_id=run_id)
