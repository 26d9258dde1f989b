"""kill -9 of a host agent in the middle of `ehp-fsm run` (the user's command in a subprocess,
nothing faked): the run goes on without that host and ends saying so, and nothing of it is left
running — the engine the dead agent can no longer stop is stopped by the run at its end, by
identity (`receipt.stopped_at_end`) — and it says why it exits 1. A row of the fault matrix
(`soundness`).

The end does not wait out the 30 s deadline of a stop sent to the agent just before it fell
silent (`AgentLink.settled`): it did, whenever the run ended within the silence window of the
kill (most runs here), and then reported the host confirmed (`unconfirmed_hosts` empty) when
the stop's retry found nothing left to stop, though its GPU was quarantined while releasing."""

from __future__ import annotations

import json
import signal
from datetime import datetime
from pathlib import Path

import psutil
import pytest

from ehp_fsm.runtime.identity import start_time_of
from tests.run.soundness import assert_run_sound
from tests.run.test_run import start


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kill9_of_an_agent_mid_run(tmp_path: Path) -> None:
    proc, log, run_id = start(tmp_path, steps=6, engines=3)  # h2 and its engine e2: killed
    assert proc.stdout is not None
    seen, victim = [], None
    for line in proc.stdout:
        seen.append(line)
        if victim is None and "step 2/6" in line:
            agent = json.loads((log.parent / "run.json").read_text())["agents"]["h2"]
            victim = psutil.Process(agent["pid"])
            assert start_time_of(victim.pid) == pytest.approx(agent["start_time"], abs=0.01)
            victim.send_signal(signal.SIGKILL)
    out = "".join(seen)
    proc.stdout.close()
    proc.wait(120)
    assert victim is not None, out
    # The run finished its steps, but not every process was confirmed stopped by its agent:
    # an unclean end, and the receipt says where.
    assert "step 6/6" in out, out
    assert proc.returncode == 1, out
    # ... and says why it exits 1 after a whole summary (it said nothing: a finished run's
    # output, exit 1, the cause only in the receipt)
    said = out[out.index("receipt: ") :]
    assert "the steps ran, but the run did not end cleanly" in said, out
    assert "host(s) h2: their agent did not confirm" in said, out
    assert "stopped by the run at its end, by identity: engine e2 " in said, out
    receipt = assert_run_sound(log, run_id=run_id)
    assert receipt["clean_controller"] is False and receipt["unconfirmed_hosts"] == ["h2"]
    assert any(x.startswith("engine e2 ") for x in receipt["stopped_at_end"]), receipt
    assert receipt["left_running"] == []
    assert _shutdown_seconds(log.parent / "controller.log") < 20.0  # not the stop's 30 s


def _shutdown_seconds(controller_log: Path) -> float:
    """From the controller's shutdown to its verdict on the hosts (`controller.log`)."""
    at = {}
    for line in controller_log.read_text().splitlines():
        if '"controller_shutdown"' in line or '"shutdown_unconfirmed"' in line:
            record = json.loads(line)
            at[record["event"]] = datetime.fromisoformat(record["timestamp"])
    return (at["shutdown_unconfirmed"] - at["controller_shutdown"]).total_seconds()
