"""The trainer pool's lanes on other machines, launched by their hosts' agents.

A Core lane trains on the host of its devices, and a Hybrid on the host it is borrowed on. When that
host's agent runs on another machine than the run (`placement.remote_core`,
`placement.remote_lenders`), the pool's lanes of that host — its Core ranks
(`PoolConfig.remote_core`) and its warm lanes (`PoolConfig.remote_warm`) — are started there by its
agent: `RemoteLanes` is the pool's `Launcher` for them. The pool calls it from whichever thread uses
the pool (the trainer's step thread, or the loop's), and the controller's socket belongs to the
loop's thread, so a launch or a stop is queued here and sent at the loop's next turn (`poll`)
through the controller's pool workers (`Controller.launch_pool_worker`, `stop_pool_worker`). The
agent builds the worker's command line itself from the pool's worker arguments, with itself as the
worker's parent: a worker whose agent is gone exits. What the agent says back about a launch — it
failed, or its process exited — reaches the pool as `report_exit`, the only word the pool has about
a process on another machine (a Core rank's end then fails the run's next wait on the pool, as a
local Core rank's does). Each launch has a fresh token, so the word about an earlier launch of a
rank never touches its replacement.

Knows: the controller (to send commands and hear the launch events), the pool (its worker
arguments and `report_exit`). Does not know: when to borrow, the GPU ledger, what the workers do.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import structlog

from ehp_fsm.core.transition import Command
from ehp_fsm.errors import EhpError
from ehp_fsm.runtime.controller import Controller
from ehp_fsm.runtime.identity import new_launch_token
from ehp_fsm.runtime.pool_launch import TrainerLaunch
from ehp_fsm.runtime.pool_workers import PoolWorkerEvent
from ehp_fsm.training.pool import TrainerPool

log = structlog.get_logger("ehp_fsm.run")


class RemoteLanes:
    """See the module docstring. A loop performer with no routes: it only polls."""

    routes: frozenset[tuple[str, str]] = frozenset()

    def __init__(self, ctl: Controller) -> None:
        self.ctl = ctl
        self.pool: TrainerPool | None = None
        # ("launch", token, rank, standby, route) | ("stop", token): appended by any thread
        # (the pool launches its ranks before `bind`), taken by the loop's (deque appends and
        # pops are atomic)
        self._todo: deque[tuple[Any, ...]] = deque()
        self.launches: dict[str, int] = {}  # token -> rank
        ctl.on_pool_worker(self.on_event)

    def bind(self, pool: TrainerPool) -> None:
        """The pool whose lanes these are (its worker arguments, its `report_exit`)."""
        self.pool = pool

    # -- the pool's Launcher (any thread) ---------------------------------------------------------
    def launch(self, rank: int, *, standby: bool, route: str) -> str:
        token = new_launch_token()
        self.launches[token] = rank
        self._todo.append(("launch", token, rank, standby, route))
        return token

    def stop(self, ref: str) -> None:
        self._todo.append(("stop", ref))

    # -- the loop's performer -------------------------------------------------------------------
    def perform(self, command: Command) -> None:  # no routes: never called
        raise AssertionError(f"RemoteLanes performs no command ({command.kind})")

    def poll(self, timeout_s: float) -> None:
        """Send what the pool asked for since the last turn. A launch the controller refuses
        is the pool's word that the rank's process will not come."""
        while self._todo and self.pool is not None:
            item = self._todo.popleft()
            if item[0] == "stop":
                self.ctl.stop_pool_worker(item[1])
                continue
            _, token, rank, standby, route = item
            host = self.pool.config.home(rank)
            assert host is not None, f"rank {rank} is not on another machine"
            try:
                trainer = TrainerLaunch.for_pool(
                    self.pool,
                    rank,
                    standby=standby,
                    curve_server_key=self.pool.curve_public,
                    route=route,
                )
                self.ctl.launch_pool_worker(host, trainer, token)
            except EhpError as exc:  # not sent: the controller or the launch check refused
                self.pool.report_exit(token, f"its launch was refused: {exc}")
                continue
            role = "core" if rank < self.pool.config.core_dp else "warm"
            log.info(
                "remote_worker_launch",
                host=host,
                rank=rank,
                role=role,
                standby=standby,
                token=token,
            )

    def close(self) -> None:
        self._todo.clear()

    # -- what the agents say (the loop's thread) --------------------------------------------------
    def on_event(self, event: PoolWorkerEvent) -> None:
        """An agent's word about one of the launches (the loop's thread): its process runs,
        or it failed to start, or it exited — then the pool learns the rank's process is gone."""
        pool = self.pool
        if pool is None or event.token not in self.launches:
            return
        if event.kind == "launch_failed":
            pool.report_exit(event.token, f"its launch failed: {event.reason}")
        elif event.kind == "exited":
            how = "stopped" if event.stopped else f"exited (code {event.returncode})"
            pool.report_exit(event.token, f"its process on {event.host} {how}")
        log.info(
            "remote_worker_" + event.kind,
            host=event.host,
            rank=event.rank,
            token=event.token,
            pid=(event.identity or {}).get("pid"),
            returncode=event.returncode,
            reason=event.reason or None,
        )
