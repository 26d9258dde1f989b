"""The trainer pool's warm lanes on other machines, launched by their hosts' agents.

A Hybrid trains on the host it is borrowed on. For a lending host whose agent runs on another
machine than the run (`placement.remote_lenders`), the pool's warm lanes of that host
(`PoolConfig.remote_warm`) are started there by its agent: `RemoteWarm` is the pool's
`Launcher` for them. The pool calls it from whichever thread uses the pool (the trainer's step
thread, or the loop's), and the controller's socket belongs to the loop's thread, so a launch or
a stop is queued here and sent at the loop's next turn (`poll`): an agent `launch` of role
`pool_worker` carrying the pool's own worker arguments (the agent builds the command line
itself, with itself as the worker's parent: a worker whose agent is gone exits), or a
`cancel_launch` of that launch's token. What the agent says back about a launch — it failed,
or its process exited — reaches the pool as `report_exit`, the only word the pool has about a
process on another machine. Each launch has a fresh token, so the word about an earlier launch
of a rank never touches its replacement.

Knows: the controller (to send commands and hear the launch events), the pool (its worker
arguments and `report_exit`). Does not know: when to borrow, the GPU ledger, what the workers do.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any, Final

import structlog

from ehp_fsm.core.transition import Command
from ehp_fsm.plan import Plan
from ehp_fsm.runtime.controller import Controller
from ehp_fsm.runtime.identity import new_launch_token
from ehp_fsm.training.pool import TrainerPool

log = structlog.get_logger("ehp_fsm.run")

ROLE: Final = "pool_worker"


class RemoteWarm:
    """See the module docstring. A loop performer with no routes: it only polls."""

    routes: frozenset[tuple[str, str]] = frozenset()

    def __init__(self, ctl: Controller, plan: Plan) -> None:
        self.ctl = ctl
        self.plan = plan
        self.pool: TrainerPool | None = None
        # ("launch", token, host, rank, standby) | ("stop", token, host): appended by any
        # thread, taken by the loop's (deque's append and popleft are atomic)
        self._todo: deque[tuple[Any, ...]] = deque()
        self.launches: dict[str, tuple[str, int]] = {}  # token -> (host, rank)
        self.identities: dict[str, Mapping[str, Any]] = {}  # token -> its process, once running

    def bind(self, pool: TrainerPool) -> None:
        """The pool whose warm lanes these are (its worker arguments, its `report_exit`)."""
        self.pool = pool

    # -- the pool's Launcher (any thread) ---------------------------------------------------------
    def launch(self, rank: int, *, standby: bool) -> str:
        assert self.pool is not None, "bind(pool) before the pool launches"
        host = self.pool.config.home(rank)
        assert host is not None, f"warm rank {rank} is not a remote one"
        token = new_launch_token()
        self.launches[token] = (host, rank)
        self._todo.append(("launch", token, host, rank, standby))
        return token

    def stop(self, ref: str) -> None:
        host, _ = self.launches[ref]
        self._todo.append(("stop", ref, host))

    # -- the loop's performer -------------------------------------------------------------------
    def perform(self, command: Command) -> None:  # no routes: never called
        raise AssertionError(f"RemoteWarm performs no command ({command.kind})")

    def poll(self, timeout_s: float) -> None:
        """Send what the pool asked for since the last turn."""
        while self._todo:
            item = self._todo.popleft()
            if item[0] == "launch":
                _, token, host, rank, standby = item
                self._send_launch(token, host, rank, standby)
            else:
                _, token, host = item
                self.ctl.send_agent_command(host, "cancel_launch", {"token": token})
                log.info("remote_worker_stop", host=host, token=token)

    def close(self) -> None:
        self._todo.clear()

    def _send_launch(self, token: str, host: str, rank: int, standby: bool) -> None:
        pool = self.pool
        assert pool is not None
        trainer = {
            "rank": rank,
            "control": pool.control,
            "rendezvous": pool.rendezvous,
            "pool_token": pool.launch_token,
            "config": pool.config.to_json(),
            "standby": standby,
            "curve_server_key": pool.curve_public,
        }
        args = {
            "machine": ROLE,
            "instance": f"trainer-{rank}",
            "role": ROLE,
            "gpus": [],
            "token": token,
            "trainer": trainer,
        }
        self.ctl.send_agent_command(host, "launch", args)
        log.info("remote_worker_launch", host=host, rank=rank, standby=standby, token=token)

    # -- what the agents say (the loop's thread) --------------------------------------------------
    def on_event(self, token: str, name: str, data: Mapping[str, Any]) -> None:
        """An agent's word about launch `token`: `launched` (its process runs), `launch_failed`
        or `exited` (the pool learns the process is gone)."""
        if token not in self.launches or self.pool is None:
            return
        host, rank = self.launches[token]
        if name == "launched":
            self.identities[token] = data.get("identity") or {}
        elif name == "launch_failed":
            self.pool.report_exit(token, f"its launch failed: {data.get('reason')}")
        elif name == "exited":
            code = data.get("returncode")
            self.pool.report_exit(token, f"process exited (code {code})")
            log.warning("remote_worker_exited", host=host, rank=rank, returncode=code)
