"""An agent restarted after the wall clock was set back is heard as a restart of its host, not
dropped as a stale incarnation: its epoch is above every epoch its state directory recorded.

Epochs order incarnations: the controller drops the frames of an epoch below the one it knows
for the host (`reliability.PeerLiveness.heard`). An agent's epoch was the wall clock in ms, so
an agent restarted after the clock was set back (NTP stepping it, a VM resumed) spoke with a
smaller epoch than its predecessor, and the controller dropped every frame of it: the host
never came back and its GPUs stayed quarantined. A real agent and a real controller endpoint
over real sockets; the machine's clock cannot be set by a test, so the second agent reads a
wall clock an hour behind (`time.time_ns`, where the epoch is read).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ehp_fsm.runtime.agent import Agent, AgentConfig
from ehp_fsm.runtime.deliveries import Dropped, PeerRestarted
from ehp_fsm.runtime.transport import ControllerEndpoint

pytestmark = pytest.mark.timeout(60)
HOUR_NS = 3600 * 10**9


def test_an_agent_restarted_after_the_clock_was_set_back_is_heard_as_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctl = ControllerEndpoint(bind="tcp://127.0.0.1:*")
    config = AgentConfig(controller=ctl.endpoint, host_id="h1", state_dir=tmp_path / "h1")
    agents: list[Agent] = []
    seen: list[object] = []

    def pump_until(done: object, seconds: float = 15.0) -> None:
        end = time.monotonic() + seconds
        while not done() and time.monotonic() < end:  # type: ignore[operator]
            seen.extend(ctl.poll(0.01))
            agents[-1].step(0.01)

    try:
        agents.append(Agent(config))
        pump_until(lambda: "h1" in ctl.peers())
        before = ctl.peers()["h1"].epoch
        agents.pop().close()
        end = time.monotonic() + 0.5  # the controller's loop goes on (it lets the old
        while time.monotonic() < end:  # connection go, and frees the host's routing id)
            seen.extend(ctl.poll(0.01))
        real = time.time_ns
        monkeypatch.setattr(time, "time_ns", lambda: real() - HOUR_NS)
        agents.append(Agent(config))  # the same host's agent, restarted
        pump_until(lambda: any(isinstance(x, PeerRestarted) for x in seen))
    finally:
        for a in agents:
            a.close()
        ctl.close()
    stale = [x for x in seen if isinstance(x, Dropped) and x.reason == "stale_epoch"]
    assert stale == []
    assert ctl.peers()["h1"].epoch > before


def test_the_epoch_file_is_never_written_through_a_link_nor_read_from_a_fifo(
    tmp_path: Path,
) -> None:
    """`next_epoch` wrote `<log>.tmp` with a plain open, which followed a symbolic link
    planted there (a run directory others can write: the run overwrote the link's target,
    any file of the user's — a root-owned one when root ran it) and read `<log>.epoch` with a
    plain read, which waited for ever on a FIFO planted there (SIGTERM did not end the run)."""
    import os
    import threading

    from ehp_fsm.runtime.reliability import epoch_path, next_epoch

    log = tmp_path / "transitions.jsonl"
    victim = tmp_path / "victim.txt"
    victim.write_text("a file of the user's\n")
    for planted in (f"{log}.tmp", f"{epoch_path(log)}.tmp"):  # the old and the new name
        os.symlink(victim, planted)
    first = next_epoch(log)
    assert victim.read_text() == "a file of the user's\n"
    assert not epoch_path(log).is_symlink() and int(epoch_path(log).read_text()) == first
    assert next_epoch(log) > first

    fifo_log = tmp_path / "fifo" / "transitions.jsonl"
    fifo_log.parent.mkdir()
    os.mkfifo(epoch_path(fifo_log))
    got: list[int] = []
    reader = threading.Thread(target=lambda: got.append(next_epoch(fifo_log)), daemon=True)
    reader.start()
    reader.join(10)
    hung = reader.is_alive()
    if hung:  # unblock the old code's read, so the test process can end
        with open(epoch_path(fifo_log), "w"):
            pass
        reader.join(10)
    assert not hung, "next_epoch waited on a FIFO"
    assert got and got[0] >= time.time_ns() // 1_000_000 - 60_000
    assert epoch_path(fifo_log).is_file()  # the FIFO replaced by the epoch's file
