"""Test harness for the runtime: a hand-driven clock and a loop that polls real endpoints.

Only time is fake here (a clock the test advances); sockets, frames and the proxy are real.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable

import zmq

from ehp_fsm.runtime import (
    AgentEndpoint,
    ControllerEndpoint,
    FaultProxy,
    Incoming,
    Received,
)
from ehp_fsm.runtime.endpoint import Endpoint


class FakeClock:
    """Monotonic seconds that move only when the test says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


Handler = Callable[[Endpoint, Incoming], None]


def auto_reply(effects: dict[str, int] | None = None) -> Handler:
    """An agent behaviour: count each command's effect by id, then reply ok."""

    def handle(endpoint: Endpoint, item: Incoming) -> None:
        if isinstance(endpoint, AgentEndpoint) and isinstance(item, Received):
            if effects is not None:
                effects[item.frame.id] = effects.get(item.frame.id, 0) + 1
            endpoint.reply(item, ok=True, result={"done": item.frame.payload["op"]})

    return handle


class Loop:
    """Polls endpoints (and a proxy) in turn, recording every delivery per endpoint name."""

    def __init__(
        self,
        endpoints: Iterable[Endpoint],
        *,
        proxy: FaultProxy | None = None,
        handler: Handler | None = None,
    ) -> None:
        self.endpoints = list(endpoints)
        self.proxy, self.handler = proxy, handler
        self.log: dict[str, list[Incoming]] = defaultdict(list)

    def once(self, wait_s: float = 0.002) -> int:
        n = 0
        if self.proxy is not None:
            n += self.proxy.pump(wait_s)
        for ep in self.endpoints:
            items = ep.poll(wait_s)
            n += len(items)
            for item in items:
                self.log[ep.name].append(item)
                if self.handler is not None:
                    self.handler(ep, item)
        return n

    def run_until(self, done: Callable[[], bool], *, timeout_s: float = 5.0) -> None:
        end = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > end:
                raise AssertionError(f"condition not reached in {timeout_s}s; log={dict(self.log)}")
            self.once()

    def settle(self, *, quiet_rounds: int = 3, max_s: float = 2.0) -> None:
        """Poll until `quiet_rounds` consecutive rounds move nothing (or `max_s` real time)."""
        end, quiet = time.monotonic() + max_s, 0
        while quiet < quiet_rounds and time.monotonic() < end:
            quiet = quiet + 1 if self.once() == 0 else 0

    def of(self, name: str, kind: type) -> list:  # type: ignore[type-arg]
        return [i for i in self.log[name] if isinstance(i, kind)]


def raw_dealer(ctx: zmq.Context, endpoint: str, routing_id: bytes | None = None) -> zmq.Socket:  # type: ignore[type-arg]
    """A plain DEALER that speaks no protocol: the hostile or careless client."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.connect(endpoint)
    return sock


def controller_and_agent(
    clock: FakeClock, **kwargs: object
) -> tuple[ControllerEndpoint, AgentEndpoint]:
    ctl = ControllerEndpoint(clock=clock, epoch=1, **kwargs)  # type: ignore[arg-type]
    agent = AgentEndpoint(connect=ctl.endpoint, host_id="host-a", clock=clock, epoch=1, **kwargs)  # type: ignore[arg-type]
    return ctl, agent
