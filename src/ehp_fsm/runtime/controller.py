"""The controller: owns the engine world and its transition log, talks to the host agents.

    controller = Controller.start(plan, log_path="runs/x/transitions.jsonl")
    controller.on("install", my_install_handler)      # commands the embedding code performs
    controller.handle(Event("rollout_engine", "e0", "launch", controller.now(), {...}))
    while running:
        controller.tick(0.1)                            # sockets, replies, timers, deadlines

Knows: the orchestrator (`embedded.Orchestrator`; its transition log is the write-ahead log),
an injected clock (every engine event's time), the `ControllerEndpoint`, the agents it has
heard from, the agent commands in flight, and the mapping below. Does not know: how to install a
revision, generate, load state or compute — the embedding run loop registers handlers for those
command kinds with `on(kind, handler)`; nor the planner (the run loop feeds its decisions in as
events with `handle`).

Machine command → agent command (sent to the agent named by the command's host):
    launch {role, host, gpus, token}      → `launch` {machine, instance, role, gpus, token}
    stop_process {identity}               → `stop_process` {machine, instance, identity}
    cancel_launch {host, token}           → `cancel_launch` {machine, instance, token}
    confirm_gpu_free {host, owner} (gpu)  → `confirm_gpu_free` {gpu, owner}
    anything else                         → the handlers registered with `on(kind, ...)`
  A command for an agent not yet heard from (or silent) is held and sent after its reconcile.

Agent event / reply / timeout → engine event:
    event healthy {identity}                  → rollout_engine `healthy` {identity}
    event launched {identity}                 → hybrid_replica `launched` {identity}
    event launch_failed {reason}              → `fail` {reason}
    event exited {identity, returncode}       → `exited` {identity} when the instance is
                                                stopping (engine) / leaving (Hybrid) with that
                                                identity; otherwise `fail` {reason}
    event gpu_free {gpu, owner, ...}          → gpu `confirm_free` {owner, processes_exited,
                                                memory_free}
    reply launch ok=False                     → `fail` {reason}
    reply stop_process ok=False (not_same_process)
                                              → `exited` {recorded identity} if stopping/leaving
                                                (the identified process is gone), else `fail`
    give-up (deadline) of an agent command    → sent again while the world still wants it
    PeerSilent(host)                          → gpu `quarantine` for each of the host's GPUs
    hello + reconcile {processes}             → per mismatch: `healthy`/`launched` (a process the
                                                agent runs that the world waits for), `fail` (an
                                                engine/Hybrid the world thinks alive that the
                                                agent does not run), `stop_process` by identity
                                                (a process the agent runs that nobody owns), and
                                                for each quarantined GPU `reconcile_owned` /
                                                `reconcile_released` (+ the finalizer) /
                                                `reconcile_free`; stops and finalizers in
                                                progress are sent again.
    every tick                                → `deadline` for each armed deadline that passed
                                                (`core.timers.due_deadlines`)

Split: this module is the loop, the engine side and command dispatch; `reconcile` (`AgentSync`,
mixed in) turns hellos, agent events, replies, give-ups, silence and reconcile reports into the
engine events and agent commands of the table above.

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

from ehp_fsm.core.timers import due_deadlines, next_deadline
from ehp_fsm.core.transition import Command, Outcome, Rejected
from ehp_fsm.core.world import Event, World
from ehp_fsm.embedded import Orchestrator
from ehp_fsm.errors import EhpError
from ehp_fsm.plan import Plan
from ehp_fsm.runtime.deliveries import (
    GaveUp,
    PeerJoined,
    PeerRestarted,
    PeerReturned,
    PeerSilent,
    Received,
    Replied,
)
from ehp_fsm.runtime.endpoint import Clock, TransportConfig
from ehp_fsm.runtime.keys import generate_keys, load_server_keys
from ehp_fsm.runtime.messages import event_problem, inventory_problem
from ehp_fsm.runtime.protocol import Dropped, Frame, Kind
from ehp_fsm.runtime.reconcile import (
    PROCESS_MACHINES,
    AgentInfo,
    AgentSync,
    SentCommand,
)
from ehp_fsm.runtime.recovery import RecoveryReport, next_epoch, recover_log
from ehp_fsm.runtime.transport import ControllerEndpoint
from ehp_fsm.translog import TransitionLog

log = structlog.get_logger("ehp_fsm.controller")

AGENT_COMMANDS: Final = frozenset({"launch", "stop_process", "cancel_launch", "confirm_gpu_free"})
Handler = Callable[["Controller", Command], None]


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


class Controller(AgentSync):
    """The controller loop around one `Orchestrator`. Single-threaded: call everything from one
    thread (signal handlers may call `request_shutdown`)."""

    def __init__(
        self,
        *,
        plan: Plan,
        engine: Orchestrator,
        endpoint: ControllerEndpoint,
        clock: Clock,
        recovery: RecoveryReport | None = None,
    ) -> None:
        self.plan, self.engine, self.endpoint, self.clock = plan, engine, endpoint, clock
        self.recovery = recovery
        self.agents: dict[str, AgentInfo] = {}
        self.inflight: dict[str, SentCommand] = {}
        self.held: dict[str, list[SentCommand]] = {}
        self.handlers: dict[str, list[Handler]] = {}
        self.claimed: dict[str, Handler] = {}
        self.unhandled: deque[Command] = deque(maxlen=1000)
        self.drops: Counter[str] = Counter()
        self.rejected: deque[Rejected] = deque(maxlen=1000)
        self.replies: deque[tuple[str, str, bool, Any]] = deque(maxlen=1000)  # id, op, ok, result
        self.admitting = True
        self._closed = False
        self._shutdown_requested = False
        self._awaiting: dict[str, float] = {}  # host → reconcile expected by (after recovery)
        self.log = log.bind(epoch=endpoint.epoch)
        if recovery is not None:
            window = self._silence_window()
            for host in self._agent_hosts():
                self._awaiting[host] = clock() + window

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
    ) -> Controller:
        """A fresh controller: a new transition log from the plan, bound to the plan's endpoint
        (or `bind`, e.g. `tcp://127.0.0.1:*` in tests)."""
        engine = Orchestrator.from_plan(plan, log_path=log_path, check=check, time=clock())
        endpoint = cls._endpoint(plan, bind, transport, clock, next_epoch(log_path))
        return cls(plan=plan, engine=engine, endpoint=endpoint, clock=clock)

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
        larger epoch, and reconcile with the agents as they reconnect."""
        result, report = recover_log(log_path)
        engine = Orchestrator(
            result.header.get("config") or {},
            log=TransitionLog(
                Path(log_path).open("ab"),  # noqa: SIM115 - the log owns it
                first_seq=report.last_seq + 1,
            ),
            check=check,
        )
        engine.world = result.world
        endpoint = cls._endpoint(plan, bind, transport, clock, next_epoch(log_path))
        ctl = cls(plan=plan, engine=engine, endpoint=endpoint, clock=clock, recovery=report)
        ctl.log.info("controller_recovered", report=report.describe())
        return ctl

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

    def _drop_message(self, peer: str, what: str, problem: str) -> None:
        """A frame the transport accepted whose contents do not have the shape the controller
        reads (a faulty or hostile agent): dropped, loudly; the loop goes on."""
        self.drops["bad_contents"] += 1
        self.log.error(
            "delivery_dropped",
            peer=peer,
            what=what,
            problem=problem,
            fix="run an agent of this ehp-fsm version; nothing of this message was applied",
        )

    # -- public API --------------------------------------------------------------------------
    @property
    def world(self) -> World:
        return self.engine.world

    def now(self) -> float:
        return self.clock()

    def on(self, kind: str, handler: Handler) -> None:
        """Perform commands of `kind` (install, generate, load_state, ...) with `handler`.

        Called as `handler(controller, command)` right after the step that emitted it; feed the
        outcome back as events with `controller.handle(...)` (now or later)."""
        if kind in AGENT_COMMANDS:
            raise ControllerError(
                f"cannot register a handler for {kind!r}",
                "the controller sends it to the host agents itself",
                f"register handlers only for other kinds (not {sorted(AGENT_COMMANDS)})",
            )
        self.handlers.setdefault(kind, []).append(handler)

    def claim_machine(self, machine: str, handler: Handler) -> None:
        """Perform *every* command of `machine`'s instances with `handler`, agent commands
        included, plus the GPU finalizer (`confirm_gpu_free`) of GPUs it owns. The run uses this
        for Hybrids on pre-started warm trainer workers, which no agent launches or stops."""
        self.claimed[machine] = handler

    def dispatch(self, command: Command) -> None:
        """Perform a command that embedding code got from an outcome it handled itself."""
        self._dispatch(command)

    def handle(self, event: Event) -> Outcome:
        """Feed an event from the embedding code; its commands are dispatched at once."""
        if not self.admitting and event.name in ("launch", "request", "enqueue", "begin"):
            raise ControllerError(
                f"refusing {event.machine} {event.instance!r} {event.name!r}",
                "the controller is shutting down and admits no new work",
                "start a new controller (or recover this one) to continue",
            )
        return self._handle(event)

    def event(self, machine: str, instance: str, name: str, **payload: Any) -> Outcome:
        """`handle(Event(machine, instance, name, now, payload))`."""
        return self.handle(Event(machine, instance, name, self.now(), payload))

    def tick(self, timeout_s: float = 0.05) -> None:
        """One loop iteration: poll the socket (up to `timeout_s`, less if a deadline is due),
        turn what arrived into events, fire due deadlines."""
        wait = timeout_s
        due = next_deadline(self.world)
        if due is not None:
            wait = max(0.0, min(wait, due - self.now()))
        for item in self.endpoint.poll(wait):
            self._on_delivery(item)
        self._fire_deadlines()
        self._check_awaiting()

    def run_until(
        self, predicate: Callable[[Controller], bool], timeout_s: float, *, tick_s: float = 0.02
    ) -> bool:
        """Tick until `predicate(self)` holds (True) or `timeout_s` real seconds pass (False)."""
        end = time.monotonic() + timeout_s
        while True:
            if predicate(self):
                return True
            if time.monotonic() > end:
                return False
            self.tick(tick_s)

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

    def send_agent_command(self, host: str, op: str, args: Mapping[str, Any]) -> str:
        """Send an agent command directly (diagnostics, tests); its reply lands in `replies`."""
        msg_id = self.endpoint.send_command(host, op, args)
        self.inflight[msg_id] = SentCommand(op, host, "", "", args)
        return msg_id

    def request_shutdown(self) -> None:
        """From a signal handler: the loop calls `shutdown()` at its next turn."""
        self._shutdown_requested = True

    @property
    def shutdown_requested(self) -> bool:
        return self._shutdown_requested

    def shutdown(self, *, timeout_s: float = 60.0) -> bool:
        """Stop admitting work, stop every process this controller owns (through the agents,
        by identity), wait for the GPUs' finalizers, flush and close the log. True when every
        process was confirmed stopped within `timeout_s` — not when an agent went silent with
        a GPU still releasing or a stop held for it (the wait does not hang on such a host, but
        its processes were not confirmed stopped)."""
        self.admitting = False
        self.log.info("controller_shutdown")
        for machine in PROCESS_MACHINES:
            spec = self.world.specs[machine]
            for inst in list(self.world.of(machine).values()):
                if inst.state not in spec.terminal:
                    self._handle(
                        Event(machine, inst.id, "fail", self.now(), {"reason": "shutdown"})
                    )
        done = self.run_until(lambda c: c._settled(), timeout_s)
        unconfirmed = self.unconfirmed_hosts()
        if unconfirmed:
            self.log.warning("shutdown_unconfirmed", hosts=unconfirmed)
        self.close()
        return done and not unconfirmed

    def unconfirmed_hosts(self) -> list[str]:
        """Hosts whose processes were not confirmed stopped: a GPU there still releasing, or a
        stop held for its (silent) agent."""
        hosts = {g.get("host") for g in self.world.of("gpu").values() if g.state == "releasing"}
        hosts |= {
            h
            for h, cmds in self.held.items()
            if any(c.op in ("stop_process", "cancel_launch") for c in cmds)
        }
        return sorted(str(h) for h in hosts if h is not None)

    def _settled(self) -> bool:
        """No GPU waits for its finalizer on a host whose agent is reachable, no stop in flight."""
        live = {h for h, a in self.agents.items() if not a.silent}
        for g in self.world.of("gpu").values():
            if g.state == "releasing" and g.get("host") in live:
                return False
        return not any(c.op in ("stop_process", "cancel_launch") for c in self.inflight.values())

    def close(self) -> None:
        """Flush and close the log, close the socket (does not stop processes). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.engine.close()
        self.endpoint.close()

    # -- engine events -----------------------------------------------------------------------
    def _handle(self, event: Event) -> Outcome:
        outcome = self.engine.handle(event)
        if isinstance(outcome, Rejected):
            self.rejected.append(outcome)
            self.log.info(
                "event_rejected",
                machine=event.machine,
                instance=event.instance,
                name=event.name,  # not `event=`: structlog's first argument is the event
                reason=outcome.reason,
            )
            return outcome
        for command in outcome.commands:
            self._dispatch(command)
        return outcome

    def _fire_deadlines(self) -> None:
        for ev in due_deadlines(self.world, self.now()):
            self._handle(ev)

    def _dispatch(self, command: Command) -> None:
        claimer = self.claimed.get(command.machine)
        if claimer is None and command.kind == "confirm_gpu_free":
            owner = str(command.args.get("owner") or "")
            prefix = {"hybrid": "hybrid_replica", "engine": "rollout_engine"}.get(
                owner.partition(":")[0], ""
            )
            claimer = self.claimed.get(prefix)
        if claimer is not None:
            claimer(self, command)
            return
        if command.kind in AGENT_COMMANDS:
            sent = self._agent_command(command)
            if sent is not None:
                self._send(sent)
            return
        handlers = self.handlers.get(command.kind)
        if not handlers:
            self.unhandled.append(command)
            return
        for handler in handlers:
            try:
                handler(self, command)
            except Exception as exc:  # a failing handler must not take the controller down
                self.log.error(
                    "handler_failed", kind=command.kind, instance=command.instance, error=repr(exc)
                )

    @staticmethod
    def _agent_command(command: Command) -> SentCommand | None:
        a, m, i = command.args, command.machine, command.instance
        if command.kind == "launch":
            args = {
                "machine": m,
                "instance": i,
                "role": a.get("role", m),
                "gpus": list(a["gpus"]),
                "token": a["token"],
            }
            return SentCommand("launch", str(a["host"]), m, i, args)
        if command.kind == "stop_process":
            ident = dict(a["identity"])
            args = {"machine": m, "instance": i, "identity": ident}
            return SentCommand("stop_process", str(ident["host"]), m, i, args)
        if command.kind == "cancel_launch":
            args = {"machine": m, "instance": i, "token": a["token"]}
            return SentCommand("cancel_launch", str(a["host"]), m, i, args)
        if command.kind == "confirm_gpu_free":
            if a.get("owner") is None:
                return None
            args = {"gpu": i, "owner": a["owner"]}
            return SentCommand("confirm_gpu_free", str(a["host"]), m, i, args)
        return None

    def _send(self, sent: SentCommand) -> None:
        agent = self.agents.get(sent.host)
        if agent is None or agent.silent or not agent.reconciled:
            self.held.setdefault(sent.host, []).append(sent)
            return
        msg_id = self.endpoint.send_command(sent.host, sent.op, sent.args)
        self.inflight[msg_id] = sent

    # -- deliveries --------------------------------------------------------------------------
    def _on_delivery(self, item: Any) -> None:
        match item:
            case Received(peer=peer, frame=frame):
                problem = _frame_problem(frame)
                if problem is not None:
                    self._drop_message(peer, str(frame.kind), problem)
                elif frame.kind is Kind.HELLO:
                    self._on_hello(peer, frame.epoch, frame.payload["inventory"])
                elif frame.kind is Kind.RECONCILE:
                    self._reconcile(peer, frame.payload["processes"], seq=frame.seq)
                elif frame.kind is Kind.EVENT:
                    self._on_agent_event(peer, frame.payload["name"], frame.payload["data"])
                    info = self.agents.get(peer)
                    if info is not None and info.epoch == frame.epoch:
                        info.last_event_seq = max(info.last_event_seq, frame.seq)
            case Replied(msg_id=msg_id, ok=ok, result=result, seq=seq):
                sent = self.inflight.pop(msg_id, None)
                self.replies.append((msg_id, sent.op if sent else "", ok, result))
                if sent is not None:
                    self._on_reply(sent, ok, result, seq=seq)
            case GaveUp(msg_id=msg_id, reason=reason):
                sent = self.inflight.pop(msg_id, None)
                if sent is not None:
                    self._on_gave_up(sent, reason)
            case PeerSilent(peer=peer):
                self._on_silent(peer)
            case PeerReturned(peer=peer):
                self.log.info("agent_returned", host=peer)
                self._ask_report(peer)
            case PeerRestarted(peer=peer, new_epoch=epoch):
                self.log.info("agent_restarted", host=peer, epoch=epoch)
                info = self.agents.get(peer)
                if info is not None:
                    info.reconciled = False
            case PeerJoined(peer=peer):
                self.log.info("agent_joined", host=peer)
            case Dropped() as d:
                self.drops[str(d.reason)] += 1
                self.log.warning("frame_dropped", **d.log_fields())
            case _:
                pass


def _frame_problem(frame: Frame) -> str | None:
    if frame.kind is Kind.HELLO:
        return inventory_problem(frame.payload["inventory"])
    if frame.kind is Kind.EVENT:
        return event_problem(frame.payload["name"], frame.payload["data"])
    return None  # RECONCILE entries: checked by the transport (`PROCESS_ENTRY_SCHEMA`)


# ---- command-line helpers (wired by the lead's cli) ------------------------------------------


def keys_main(argv: Sequence[str] | None = None) -> int:
    """`ehp-fsm keys DIR [--agent NAME ...] [--force]`: generate CURVE keys for the control
    plane and print where each file must go."""
    p = argparse.ArgumentParser(prog="ehp-fsm keys", description=keys_main.__doc__)
    p.add_argument("directory")
    p.add_argument(
        "--agent",
        action="append",
        default=[],
        metavar="NAME",
        help="one keypair per agent (repeat; default: one named `agent`)",
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
