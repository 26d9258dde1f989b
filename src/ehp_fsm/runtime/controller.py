"""The controller: the loop with the agent link, as a control-plane process runs it.

    controller = Controller.start(plan, log_path="runs/x/transitions.jsonl")
    controller.on("install", my_install_handler)      # commands the embedding code performs
    controller.event("rollout_engine", "e0", "launch", host="h1", gpus=["h1:g0"], tp=1, ...)
    while running:
        controller.tick(0.1)                            # sockets, replies, timers, deadlines

A `Controller` is a `shell.loop.Loop` (the one door into the orchestrator, whose transition log
is the write-ahead log) whose first performer is the `AgentLink` (launches, stops, GPU
finalizers over ZeroMQ; what agent news means is its `Reconciler`'s — the table is in
`agent_link`'s docstring). Other performers join the same loop (`ctl.loop.add(...)`): the run's
dispatcher, publisher, warm Hybrids and trainer; or, for scripts and tests, a handler per
command kind (`on`).

The run's trainer pool workers that must run on a given host are launched by that host's agent
(`launch_pool_worker`); their news comes back as `PoolWorkerEvent`s (`on_pool_worker`,
`pool_worker_events`), never as events of the state machines; an agent's report of a pool worker
no live launch of the current pool wants gets it stopped (`pool_workers`).

Recovery (`Controller.recover`) replays the log (cutting a torn tail, see `recovery`), appends
to it with the seq continuing, takes a larger epoch, and reconciles with every agent as it
reconnects; a host that does not come back within the silence window is quarantined.
Shutdown (`shutdown`) stops admitting work, fails every engine and Hybrid this controller owns
(their processes are stopped by identity through their agents), waits for the agents'
confirmations, flushes the log.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import structlog

from ehp_fsm.core.transition import Command, Outcome, Rejected
from ehp_fsm.core.world import Event, World
from ehp_fsm.embedded import Orchestrator
from ehp_fsm.errors import EhpError
from ehp_fsm.plan import Plan
from ehp_fsm.runtime.agent_link import AGENT_COMMANDS, AgentLink
from ehp_fsm.runtime.endpoint import Clock, TransportConfig
from ehp_fsm.runtime.keys import generate_keys, load_server_keys
from ehp_fsm.runtime.pool_launch import TrainerLaunch
from ehp_fsm.runtime.pool_workers import PoolWorkerEvent, PoolWorkers
from ehp_fsm.runtime.reconcile import PROCESS_MACHINES, AgentInfo
from ehp_fsm.runtime.recovery import RecoveryReport, next_epoch
from ehp_fsm.runtime.transport import ControllerEndpoint
from ehp_fsm.shell.loop import ANY, Loop, Route, steady_wall_clock

log = structlog.get_logger("ehp_fsm.controller")

Handler = Callable[["Controller", Command], None]
NEW_WORK = frozenset({"launch", "request", "enqueue", "begin"})
#: Time beyond this without a turn of the controller's loop puts its deadlines off (`Loop.tick`;
#: a turn waits at most 20 ms while the run waits for something).
LOOP_STALL_ALLOWANCE_S: Final = 1.0


class ControllerError(EhpError):
    """The controller was misused: work submitted while shutting down, a bad handler kind."""


def transport_config(plan: Plan, **overrides: Any) -> TransportConfig:
    """The plan's transport section as the endpoints' config."""
    fields: dict[str, Any] = {
        "max_message_bytes": plan.transport.max_message_bytes,
        "heartbeat_interval_s": plan.transport.heartbeat_s,
        "allow_non_loopback": plan.transport.allow_non_loopback,
    }
    fields.update(overrides)
    return TransportConfig(**fields)


class Callbacks:
    """A performer for scripts and tests: `handler(controller, command)` for one command kind.
    A handler that raises is logged, and the loop goes on."""

    def __init__(self, ctl: Controller, kind: str) -> None:
        self.ctl = ctl
        self.routes: frozenset[Route] = frozenset({(ANY, kind)})
        self.handlers: list[Handler] = []

    def perform(self, command: Command) -> None:
        for handler in self.handlers:
            try:
                handler(self.ctl, command)
            except Exception as exc:  # a failing script handler must not stop the loop
                log.error(
                    "handler_failed", kind=command.kind, instance=command.instance, error=repr(exc)
                )

    def poll(self, timeout_s: float) -> None:
        return None

    def close(self) -> None:
        return None


class Controller:
    """The loop and its agent link. Single-threaded: call everything from one thread (signal
    handlers may call `request_shutdown`)."""

    def __init__(
        self,
        *,
        plan: Plan,
        orchestrator: Orchestrator,
        endpoint: ControllerEndpoint,
        clock: Clock,
        recovery: RecoveryReport | None = None,
    ) -> None:
        self.plan, self.clock, self.recovery = plan, clock, recovery
        self.loop = Loop(orchestrator, clock=clock, stall_allowance_s=LOOP_STALL_ALLOWANCE_S)
        awaiting = _agent_hosts(orchestrator.world) if recovery is not None else ()
        self.link = AgentLink(
            self.loop, endpoint, awaiting=awaiting, performer_of=self.loop.performer_of
        )
        self.loop.add(self.link)
        # the link is polled first and waits on the agents' socket: a performer's worker
        # thread (an engine's HTTP answer, a finished step) ends that wait (`Loop.wake`)
        endpoint.watch_fd(self.loop.wake_fd())
        self.callbacks: dict[str, Callbacks] = {}
        self.admitting = True
        self._closed = False
        self._shutdown_requested = False
        self.log = self.link.log

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def start(
        cls,
        plan: Plan,
        *,
        log_path: str | Path | None = None,
        clock: Clock = time.time,
        bind: str | None = None,
        transport: TransportConfig | None = None,
        check: bool = True,
        log_meta: Mapping[str, Any] | None = None,
        core_version: int = 0,
    ) -> Controller:
        """A fresh controller: a new transition log from the plan (`log_meta`: more entries
        for its header's `meta`; `core_version`: where a resumed run's Core starts), bound to
        the plan's endpoint (or `bind`, e.g. `tcp://127.0.0.1:*` in tests). `clock` is the
        wall clock, read once: the controller's times advance by the monotonic clock from
        there (`shell.loop.steady_wall_clock`), so setting the wall clock moves no deadline."""
        clock = steady_wall_clock(clock)
        orch = Orchestrator.from_plan(
            plan,
            log_path=log_path,
            check=check,
            time=clock(),
            log_meta=log_meta,
            core_version=core_version,
        )
        endpoint = cls._endpoint_for(orch, plan, bind, transport, clock, log_path)
        return cls(plan=plan, orchestrator=orch, endpoint=endpoint, clock=clock)

    @classmethod
    def recover(
        cls,
        plan: Plan,
        log_path: str | Path,
        *,
        clock: Clock = time.time,
        bind: str | None = None,
        transport: TransportConfig | None = None,
        check: bool = True,
    ) -> Controller:
        """Rebuild the world from the log (its tail repaired), append to the same log, take a
        larger epoch, and reconcile with the agents as they reconnect. `clock`: as `start`'s."""
        clock = steady_wall_clock(clock)
        # `Orchestrator.resume`: the log locked before its tail is repaired (a log another
        # orchestrator or run is writing lost the line being written, cut as "torn"), then
        # replayed, and written on unbuffered (each event whole or not at all) with its chain;
        # a missing file, a link, a FIFO or another user's file refused (it holds launch tokens)
        orch = Orchestrator.resume(log_path, check=check)
        report = orch.recovery
        assert report is not None  # (`resume` sets it)
        endpoint = cls._endpoint_for(orch, plan, bind, transport, clock, log_path)
        ctl = cls(plan=plan, orchestrator=orch, endpoint=endpoint, clock=clock, recovery=report)
        ctl.log.info("controller_recovered", report=report.describe())
        return ctl

    @classmethod
    def _endpoint_for(
        cls,
        orch: Orchestrator,
        plan: Plan,
        bind: str | None,
        transport: TransportConfig | None,
        clock: Clock,
        log_path: str | Path | None,
    ) -> ControllerEndpoint:
        """The endpoint of a controller whose orchestrator `orch` has its log open; when it
        cannot be made (the port is taken), the log is closed before the error goes on: it
        stayed open and locked for as long as the error was kept (a caller retrying from its
        handler found the log "held by another writer")."""
        try:
            return cls._endpoint(plan, bind, transport, clock, next_epoch(log_path))
        except BaseException:
            orch.close()
            raise

    @staticmethod
    def _endpoint(
        plan: Plan,
        bind: str | None,
        transport: TransportConfig | None,
        clock: Clock,
        epoch: int,
    ) -> ControllerEndpoint:
        curve = load_server_keys(plan.transport.curve_keys) if plan.transport.curve_keys else None
        return ControllerEndpoint(
            bind=bind or plan.transport.controller,
            config=transport or transport_config(plan),
            clock=clock,
            epoch=epoch,
            curve=curve,
        )

    # -- public API --------------------------------------------------------------------------
    @property
    def world(self) -> World:
        return self.loop.world

    @property
    def endpoint(self) -> ControllerEndpoint:
        return self.link.endpoint

    @property
    def agents(self) -> dict[str, AgentInfo]:
        return self.link.agents

    @property
    def drops(self) -> Counter[str]:
        return self.link.drops

    @property
    def replies(self) -> deque[tuple[str, str, bool, Any]]:
        return self.link.replies

    @property
    def rejected(self) -> deque[Rejected]:
        return self.loop.rejected

    @property
    def unhandled(self) -> deque[Command]:
        return self.loop.unhandled

    def now(self) -> float:
        return self.clock()

    def on(self, kind: str, handler: Handler) -> None:
        """Perform commands of `kind` (install, generate, load_state, ...) with `handler`,
        called as `handler(controller, command)`; it posts what it learns with
        `controller.handle(...)` / `controller.event(...)` (now or later)."""
        if kind in AGENT_COMMANDS:
            raise ControllerError(
                f"cannot register a handler for {kind!r}",
                "the controller sends it to the host agents itself",
                f"register handlers only for other kinds (not {sorted(AGENT_COMMANDS)})",
            )
        cb = self.callbacks.get(kind)
        if cb is None:
            cb = self.callbacks[kind] = Callbacks(self, kind)
            self.loop.add(cb)
        cb.handlers.append(handler)

    def handle(self, event: Event) -> Outcome:
        """Post an event through the loop (stamped with the loop's clock)."""
        if not self.admitting and event.name in NEW_WORK:
            raise ControllerError(
                f"refusing {event.machine} {event.instance!r} {event.name!r}",
                "the controller is shutting down and admits no new work",
                "start a new controller (or recover this one) to continue",
            )
        return self.loop.post(event)

    def event(self, machine: str, instance: str, name: str, **payload: Any) -> Outcome:
        """`handle(Event(machine, instance, name, now, payload))`."""
        return self.handle(Event(machine, instance, name, self.now(), payload))

    def tick(self, timeout_s: float = 0.05) -> None:
        """One loop turn: poll the socket (up to `timeout_s`, less if a deadline is due) and
        the other performers, turn what arrived into events, fire due deadlines."""
        self.loop.tick(timeout_s)

    def run_until(
        self, predicate: Callable[[Controller], bool], timeout_s: float, *, tick_s: float = 0.02
    ) -> bool:
        """Tick until `predicate(self)` holds (True) or `timeout_s` real seconds pass (False)."""
        return self.loop.run_until(lambda: predicate(self), timeout_s, tick_s=tick_s)

    def launch_engines(self, token: Callable[[str], str]) -> list[Outcome]:
        """Launch every engine of the plan (the first start of a run)."""
        outs = []
        for e in self.plan.engines:
            if self.world.get("rollout_engine", e.id) is None:
                outs.append(
                    self.event(
                        "rollout_engine",
                        e.id,
                        "launch",
                        host=e.host,
                        gpus=list(e.gpus),
                        tp=e.tp,
                        token=token(e.id),
                    )
                )
        return outs

    def owned_processes(self) -> list[tuple[str, str, Mapping[str, Any]]]:
        """(machine, instance, identity) of every live engine/Hybrid with a known process."""
        out = []
        for machine in PROCESS_MACHINES:
            spec = self.world.specs[machine]
            for inst in self.world.of(machine).values():
                ident = inst.get("identity")
                if inst.state not in spec.terminal and ident is not None:
                    out.append((machine, inst.id, ident))
        return out

    # -- the run's trainer pool workers, launched by the agents -----------------------------
    @property
    def pool_workers(self) -> PoolWorkers:
        """The pool worker launches the run asked for, and their events (`pool_workers`)."""
        return self.link.pool

    def launch_pool_worker(
        self, host: str, trainer: TrainerLaunch, token: str, *, gpus: Sequence[str] = ()
    ) -> None:
        """Ask `host`'s agent to start one rank of the run's trainer pool
        (`TrainerLaunch.for_pool(pool, rank)`), under launch token `token` (a fresh one per
        launch; the events name it). Sent once the agent has reconciled; what follows is a
        `PoolWorkerEvent` (`on_pool_worker`, `pool_worker_events`): `launched` with the
        worker's identity, or `launch_failed`; later `exited`."""
        if not self.admitting:
            raise ControllerError(
                f"refusing to launch pool rank {trainer.rank} on {host}",
                "the controller is shutting down and admits no new work",
                "start a new controller (or recover this one) to continue",
            )
        if host not in self.link.reconciler.plan_hosts():
            raise ControllerError(
                f"host {host[:64]!r} is not a host of the plan",
                "only a plan host's agent can launch a pool worker",
                f"pick one of {sorted(self.link.reconciler.plan_hosts())}",
            )
        self.link.pool.launch(host, trainer, token, gpus=gpus)

    def stop_pool_worker(self, token: str) -> bool:
        """Stop launch `token`'s pool worker through its agent (its `exited` follows, with
        stopped=True). False: no such launch running."""
        return self.link.pool.stop(token)

    def retire_pool(self) -> list[str]:
        """Stop every worker of the current pool and forget it: a new pool may launch. The
        launch tokens stopped."""
        return self.link.pool.retire()

    def on_pool_worker(self, listener: Callable[[PoolWorkerEvent], None]) -> None:
        """Call `listener(event)` for every pool worker event, on this controller's loop
        thread, during `tick` (it must not block)."""
        self.link.pool.subscribe(listener)

    def pool_worker_events(self) -> list[PoolWorkerEvent]:
        """The pool worker events not taken yet, oldest first; any thread may call it."""
        return self.link.pool.drain()

    def send_agent_command(self, host: str, op: str, args: Mapping[str, Any]) -> str:
        """Send an agent command directly (diagnostics, tests); its reply lands in `replies`."""
        return self.link.send_direct(host, op, args)

    def request_shutdown(self) -> None:
        """From a signal handler: the loop calls `shutdown()` at its next turn."""
        self._shutdown_requested = True

    @property
    def shutdown_requested(self) -> bool:
        return self._shutdown_requested

    def shutdown(self, *, timeout_s: float = 60.0) -> bool:
        """Stop admitting work, stop every process this controller owns (through its
        performers, by identity; the pool workers too), wait for the GPUs' finalizers and the
        stops, flush and close the log. True
        when every process was confirmed stopped within `timeout_s` — not when an agent went
        silent with a GPU still releasing or a stop held for it (the wait does not hang on such
        a host, but its processes were not confirmed stopped)."""
        self.admitting = False
        self.log.info("controller_shutdown")
        self.link.pool.retire()
        for machine in PROCESS_MACHINES:
            spec = self.world.specs[machine]
            for inst in list(self.world.of(machine).values()):
                if inst.state not in spec.terminal:
                    self.loop.event(machine, inst.id, "fail", reason="shutdown")
        done = self.run_until(lambda c: c.link.settled(), timeout_s)
        unconfirmed = self.unconfirmed_hosts()
        if unconfirmed:
            self.log.warning("shutdown_unconfirmed", hosts=unconfirmed)
        self.close()
        return done and not unconfirmed

    def unconfirmed_hosts(self) -> list[str]:
        """Hosts whose processes were not confirmed stopped (see `AgentLink.unconfirmed_hosts`)."""
        return self.link.unconfirmed_hosts()

    def close(self) -> list[str]:
        """Close the performers and the socket, flush and close the log (does not stop
        processes). Idempotent; what failed to close, one line each."""
        if self._closed:
            return []
        self._closed = True
        return self.loop.close()


def _agent_hosts(world: World) -> list[str]:
    """The hosts an agent runs on: every host with a GPU that is not the Core's."""
    core = set(world.config.get("core_gpus") or ())
    return sorted({str(g.get("host")) for g in world.of("gpu").values() if g.id not in core})


# ---- command-line helpers (wired by the lead's cli) ------------------------------------------


def keys_main(argv: Sequence[str] | None = None) -> int:
    """`ehp-fsm keys DIR [--agent HOST ...] [--force]`: generate CURVE keys for the control
    plane, one agent keypair per host id, bound to it (`DIR/hosts.json`: a key is accepted only
    for its own host id), and print where each file must go."""
    p = argparse.ArgumentParser(prog="ehp-fsm keys", description=keys_main.__doc__)
    p.add_argument("directory")
    p.add_argument(
        "--agent",
        action="append",
        default=[],
        metavar="HOST",
        help="one keypair per agent host id, bound to it (repeat; default: one host `agent`)",
    )
    p.add_argument("--force", action="store_true", help="replace existing keys")
    args = p.parse_args(argv)
    try:
        layout = generate_keys(
            args.directory, agents=tuple(args.agent) or ("agent",), overwrite=args.force
        )
    except EhpError as exc:
        print(f"ehp-fsm keys: error: {exc}", file=sys.stderr)
        return 2
    print(layout.describe())
    return 0


def install_signal_handlers(controller: Controller) -> None:
    """SIGINT/SIGTERM → `controller.request_shutdown()` (the loop then calls `shutdown()`)."""
    signal.signal(signal.SIGTERM, lambda *_: controller.request_shutdown())
    signal.signal(signal.SIGINT, lambda *_: controller.request_shutdown())
