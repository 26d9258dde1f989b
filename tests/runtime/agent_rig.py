"""One real agent facing a real controller endpoint, pumped from the test's thread: what the
agent tests share (their own far edges are faked in each test, and said there)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ehp_fsm.runtime.agent import Agent, AgentConfig
from ehp_fsm.runtime.deliveries import Received, Replied
from ehp_fsm.runtime.protocol import Kind
from ehp_fsm.runtime.transport import ControllerEndpoint


@dataclass
class Rig:
    ctl: ControllerEndpoint
    agent: Agent
    replies: dict[str, Replied] = field(default_factory=dict)
    events: list[tuple[float, str, dict[str, Any]]] = field(default_factory=list)

    def pump(self, seconds: float) -> None:
        """Run both ends for `seconds`, keeping every reply and event the controller got."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for item in self.ctl.poll(0.01):
                if isinstance(item, Replied):
                    self.replies[item.msg_id] = item
                elif isinstance(item, Received) and item.frame.kind is Kind.EVENT:
                    p = item.frame.payload
                    self.events.append((time.monotonic(), p["name"], p["data"]))
            self.agent.step(0.01)

    def command(self, op: str, args: dict[str, Any], seconds: float = 0.5) -> Replied | None:
        msg = self.ctl.send_command(self.agent.host_id, op, args)
        self.pump(seconds)
        return self.replies.get(msg)

    def freed(self) -> list[str]:
        return [data["gpu"] for _, name, data in self.events if name == "gpu_free"]


@contextmanager
def agent_rig(state_dir: Path, **config: Any) -> Iterator[Rig]:
    """An agent `h1` connected to a fresh controller endpoint (waits for its hello)."""
    ctl = ControllerEndpoint(bind="tcp://127.0.0.1:*")
    agent = Agent(AgentConfig(controller=ctl.endpoint, host_id="h1", state_dir=state_dir, **config))
    rig = Rig(ctl, agent)
    try:
        end = time.monotonic() + 10
        while "h1" not in ctl.peers() and time.monotonic() < end:
            rig.pump(0.05)
        assert "h1" in ctl.peers(), "the agent never said hello"
        yield rig
    finally:
        agent.close()
        ctl.close()


def engine_launch_args(token: str, instance: str = "e0", gpu: str = "h1:g0") -> dict[str, Any]:
    """The `launch` command's args for one rollout engine on `gpu` (the tests' one shape)."""
    return {
        "machine": "rollout_engine",
        "instance": instance,
        "role": "rollout_engine",
        "gpus": [gpu],
        "token": token,
    }
