"""HTTP clients for the rollout engines the world knows, kept in step with their machines.

An engine's process is identified (`healthy`, from its host agent) with the URL it serves on;
from then on the publisher (installs) and the dispatcher (generate, pause, abort) reach it
through an `SGLangClient`. `EngineConnections` is a performer of the shell's loop with no
command of its own: each turn (`poll`) it attaches a client for every engine that has a URL and
is not over, and detaches and closes the clients of engines that stopped or failed. An install
asked for before the client existed waits in the publisher until the attach.

Knows: the world's rollout engines and their identities, the two users of a client. Does not
know: what is sent over the clients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from ehp_fsm.rollout.client import SGLangClient
from ehp_fsm.rollout.dispatch import Dispatcher
from ehp_fsm.rollout.publish import Publisher
from ehp_fsm.shell.loop import Door, Route

ENGINE: Final = "rollout_engine"
_OVER: Final = frozenset({"stopped", "failed"})


class EngineConnections:
    """See the module docstring."""

    routes: frozenset[Route] = frozenset()

    def __init__(
        self,
        door: Door,
        publisher: Publisher,
        dispatcher: Dispatcher,
        *,
        connect: Callable[[str], SGLangClient],
    ) -> None:
        self.door = door
        self.publisher = publisher
        self.dispatcher = dispatcher
        self.connect = connect  # url -> client
        self.clients: dict[str, SGLangClient] = {}

    def perform(self, command: object) -> None:
        return None  # no routes: never called

    def poll(self, timeout_s: float) -> None:
        for inst in self.door.world.of(ENGINE).values():
            eid = inst.id
            if inst.state in _OVER:
                if eid in self.clients:
                    self.publisher.detach(eid)
                    self.dispatcher.detach(eid)
                    self.clients.pop(eid).close()
                continue
            url = (inst.get("identity") or {}).get("url")
            if url and eid not in self.clients:
                client = self.clients[eid] = self.connect(str(url))
                self.publisher.attach(eid, client)
                self.dispatcher.attach(eid, client)

    def close(self) -> None:
        errors = []
        for client in self.clients.values():
            try:
                client.close()
            except Exception as exc:
                errors.append(repr(exc))
        self.clients.clear()
        if errors:
            raise RuntimeError(f"engine clients did not close: {errors}")
