"""A controller that cannot bind its port (another process holds it) lets go of its transition
log: the caller may free the port and start again on the same log while it still holds the
error. The log stayed open and locked for as long as the error lived (its traceback held the
orchestrator), and the retry was refused: "the transition log ... is held by another
writer". A real socket holds the port.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from ehp_fsm.plan import load_plan
from ehp_fsm.runtime.controller import Controller
from ehp_fsm.runtime.errors import TransportError
from tests.runtime_system.harness import write_plan

pytestmark = pytest.mark.timeout(60)


def test_a_controller_whose_port_is_taken_lets_go_of_its_log(tmp_path: Path) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    plan_path, _ = write_plan(tmp_path, f"tcp://127.0.0.1:{port}")
    plan, log = load_plan(plan_path), tmp_path / "t.jsonl"
    try:
        with pytest.raises(TransportError, match="Address already in use") as refused:
            Controller.start(plan, log_path=log)
        holder.close()  # the port is free again; the error is still held (`refused`)
        ctl = Controller.start(plan, log_path=log)
        ctl.close()
    finally:
        holder.close()
    assert "cannot bind the controller" in str(refused.value)
