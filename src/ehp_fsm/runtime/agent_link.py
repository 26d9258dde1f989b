"""The agent link: the performer that talks to the host agents over ZeroMQ.

Machine command → agent command (sent to the agent named by the command's host):
    launch {role, host, gpus, token}      → `launch` {machine, instance, role, gpus, token}
    stop_process {identity}               → `stop_process` {machine, instance, identity}
    cancel_launch {host, token}           → `cancel_launch` {machine, instance, token}
    confirm_gpu_free {host, owner} (gpu)  → `confirm_gpu_free` {gpu, owner}
  A command for an agent not yet heard from (or silent) is held and sent after its reconcile.

Every agent event is first checked against its sender (`Reconciler.sender_problem`): only the
current epoch of a plan host's agent that said hello and reconciled, reporting on its own host's
GPUs and processes (the instance's host and the identity's host), is applied. Anything else is
refused (`delivery_refused`, naming the sender; `drops["refused"]`, `refused`) and creates no
work: no stop_process, no held command for a peer that is not a known agent.

Agent event / reply / timeout → event posted through the loop's door:
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
    PeerUnreachable(host)                     → logged (`agent_unreachable`): frames to it fail
    anything about machine `pool_worker`      → the run's pool workers (`pool_workers`): a
                                                `PoolWorkerEvent` for the run, never an event
                                                of the state machines
    hello + reconcile {processes}             → per mismatch: `healthy`/`launched` (a process the
                                                agent runs that the world waits for), `fail` (an
                                                engine/Hybrid the world thinks alive that the
                                                agent does not run), `stop_process` by identity
                                                (a process the agent runs that nobody owns), and
                                                for each quarantined GPU `reconcile_owned` /
                                                `reconcile_released` (+ the finalizer) /
                                                `reconcile_free`; stops and finalizers in
                                                progress are sent again.

Knows: the endpoint (socket, heartbeats, retries), the agent commands in flight, the frames'
shapes (`messages`); what agent news means for the world is the `Reconciler`'s (composition: the
link owns one). Does not know: the orchestrator (it posts through the loop's door), HTTP,
training, or what the other performers do.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import structlog

from ehp_fsm.core.transition import Command
from ehp_fsm.runtime.deliveries import (
    GaveUp,
    Incoming,
    PeerJoined,
    PeerRestarted,
    PeerReturned,
    PeerSilent,
    PeerUnreachable,
    Received,
    Replied,
    Stalled,
)
from ehp_fsm.runtime.messages import event_problem, inventory_problem, processes_problem
from ehp_fsm.runtime.pool_workers import PoolWorkers
from ehp_fsm.runtime.protocol import Dropped, DropReason, Frame, Kind
from ehp_fsm.runtime.reconcile import PROCESS_MACHINES, AgentInfo, Reconciler, SentCommand
from ehp_fsm.runtime.transport import ControllerEndpoint
from ehp_fsm.shell.loop import ANY, Door, Route
from ehp_fsm.throttle import LogThrottle

log = structlog.get_logger("ehp_fsm.controller")

AGENT_COMMANDS: Final = frozenset({"launch", "stop_process", "cancel_launch", "confirm_gpu_free"})


#: How many hosts' key drops `AgentLink.key_drops` keeps (a stranger may claim any host id).
KEY_DROPS_KEPT: Final = 64


@dataclass(slots=True)
class LongStalls:
    """The controller's own stalls as long as an agent's silence window (`Stalled`): how many,
    their seconds and the last. The run names each; its agents were not blamed for them."""

    count: int = 0
    seconds: float = 0.0
    last: Stalled | None = None

    def add(self, stall: Stalled) -> None:
        self.count += 1
        self.seconds += stall.away_s
        self.last = stall


class AgentLink:
    """See the module docstring. `routes`: the agent commands of any machine."""

    def __init__(
        self,
        door: Door,
        endpoint: ControllerEndpoint,
        *,
        awaiting: Sequence[str] = (),
        routes: frozenset[Route] | None = None,
        performer_of: Callable[[Command], object] | None = None,
    ) -> None:
        self.door = door
        self.performer_of = performer_of  # the loop's routing table (`Loop.performer_of`)
        self.endpoint = endpoint
        self.routes = routes if routes is not None else frozenset((ANY, k) for k in AGENT_COMMANDS)
        self.inflight: dict[str, SentCommand] = {}
        self.drops: Counter[str] = Counter()
        self.replies: deque[tuple[str, str, bool, Any]] = deque(maxlen=1000)  # id, op, ok, result
        self.refused: deque[tuple[str, str, str]] = deque(maxlen=1000)  # peer, what, why
        #: the last frame per host id dropped for a CURVE key not bound to that host (why): the
        #: run names it for an agent that never said hello (at most `KEY_DROPS_KEPT` hosts)
        self.key_drops: dict[str, str] = {}
        self.long_stalls = LongStalls()
        # what strangers can cause to be logged, at a bounded rate (`drops` counts it all)
        self.throttle = LogThrottle()
        self.log = log.bind(epoch=endpoint.epoch)
        self.reconciler = Reconciler(self, awaiting=awaiting, window_s=self.silence_window())

    @property
    def agents(self) -> dict[str, AgentInfo]:
        return self.reconciler.agents

    @property
    def held(self) -> dict[str, list[SentCommand]]:
        return self.reconciler.held

    @property
    def pool(self) -> PoolWorkers:
        """The run's pool worker launches (`pool_workers`)."""
        return self.reconciler.pool

    def machines(self) -> tuple[str, ...]:
        """The process machines this link launches (whose `launch` the loop routes here): only
        their instances are judged by the agents' reports."""
        if self.performer_of is None:  # no routing table given: every one is the agents'
            return PROCESS_MACHINES
        return tuple(
            m
            for m in PROCESS_MACHINES
            if self.performer_of(Command(kind="launch", machine=m, instance="")) is self
        )

    def finalizes(self, owner: str) -> bool:
        """Whether the agents confirm a GPU of `owner` free (the loop routes that owner's
        `confirm_gpu_free` here): a Hybrid on the run's warm trainer workers is confirmed by
        its parked worker's measured report instead (`run.hybrids`), which no agent has."""
        if self.performer_of is None:
            return True
        probe = Command(kind="confirm_gpu_free", machine="gpu", instance="", args={"owner": owner})
        return self.performer_of(probe) is self

    def silence_window(self) -> float:
        cfg = self.endpoint.config
        return cfg.heartbeat_interval_s * (cfg.missed_heartbeats + 1)

    # -- performer ---------------------------------------------------------------------------
    def perform(self, command: Command) -> None:
        sent = agent_command(command)
        if sent is not None:
            self.send(sent)

    def poll(self, timeout_s: float) -> None:
        for item in self.endpoint.poll(timeout_s):
            self._on_delivery(item)
        self.reconciler.check_awaiting()

    def close(self) -> None:
        self.endpoint.close()

    # -- the reconciler's side ---------------------------------------------------------------
    def send(self, sent: SentCommand) -> None:
        agent = self.agents.get(sent.host)
        if agent is None or agent.silent or not agent.reconciled:
            self.held.setdefault(sent.host, []).append(sent)
            return
        msg_id = self.endpoint.send_command(sent.host, sent.op, sent.args)
        self.inflight[msg_id] = sent

    def send_direct(self, host: str, op: str, args: Mapping[str, Any]) -> str:
        """Send an agent command now (diagnostics, tests); its reply lands in `replies`."""
        msg_id = self.endpoint.send_command(host, op, args)
        self.inflight[msg_id] = SentCommand(op, host, "", "", args)
        return msg_id

    def drop_message(self, peer: str, what: str, problem: str) -> None:
        """A frame the transport accepted whose contents do not have the shape the controller
        reads (a faulty or hostile agent): dropped, loudly; the loop goes on."""
        self.drops["bad_contents"] += 1
        if (extra := self.throttle.let("delivery_dropped")) is None:
            return
        self.log.error(
            "delivery_dropped",
            peer=peer,
            what=what,
            problem=problem,
            fix="run an agent of this ehp-fsm version; nothing of this message was applied",
            **extra,
        )

    def refuse(self, peer: str, what: str, why: str) -> None:
        """A delivery its sender may not make (not the agent of what it is about, not an agent
        at all, an old incarnation): refused, loudly, naming the sender; nothing of it is
        applied and no work is created for that peer."""
        self.drops["refused"] += 1
        self.refused.append((peer, what, why))
        if (extra := self.throttle.let("delivery_refused")) is None:
            return
        self.log.error(
            "delivery_refused",
            peer=peer,
            what=what,
            why=why,
            fix="only a plan host's agent, in its current epoch, after its reconcile, reports "
            "on its own host's GPUs and processes; look for a stray or hostile process",
            **extra,
        )

    def settled(self) -> bool:
        """No GPU waits for its finalizer and no stop is in flight on a host whose agent is
        reachable. A stop sent before its agent fell silent is not waited for: nothing can
        answer it until the agent returns (a run's shutdown waited its full 30 s command
        deadline for an agent killed just before it); its host is in `unconfirmed_hosts`."""
        live = {h for h, a in self.agents.items() if not a.silent}
        for g in self.door.world.of("gpu").values():
            if g.state == "releasing" and g.get("host") in live:
                return False
        return not any(c.host in live for c in self._stops_in_flight())

    def unconfirmed_hosts(self) -> list[str]:
        """Hosts whose processes were not confirmed stopped: a GPU there still releasing (or
        quarantined while releasing: its agent fell silent before it confirmed), or a stop held
        for its (silent) agent or sent to it and not answered."""
        world = self.door.world
        hosts = {g.get("host") for g in world.of("gpu").values() if _releasing(g.state, g.data)}
        hosts |= {
            h
            for h, cmds in self.held.items()
            if any(c.op in ("stop_process", "cancel_launch") for c in cmds)
        }
        silent = {h for h, a in self.agents.items() if a.silent}
        hosts |= {c.host for c in self._stops_in_flight() if c.host in silent}
        return sorted(str(h) for h in hosts if h is not None)

    def _stops_in_flight(self) -> list[SentCommand]:
        return [c for c in self.inflight.values() if c.op in ("stop_process", "cancel_launch")]

    # -- deliveries --------------------------------------------------------------------------
    def _on_delivery(self, item: Incoming) -> None:
        rec = self.reconciler
        match item:
            case Received(peer=peer, frame=frame):
                problem = _frame_problem(frame)
                if problem is not None:
                    self.drop_message(peer, str(frame.kind), problem)
                elif frame.kind is Kind.HELLO:
                    rec.on_hello(peer, frame.epoch, frame.payload["inventory"])
                elif frame.kind is Kind.RECONCILE:
                    rec.reconcile(
                        peer, frame.payload["processes"], seq=frame.seq, epoch=frame.epoch
                    )
                elif frame.kind is Kind.EVENT:
                    payload = frame.payload
                    rec.on_agent_event(peer, payload["name"], payload["data"], epoch=frame.epoch)
                    info = self.agents.get(peer)
                    if info is not None and info.epoch == frame.epoch:
                        info.saw(frame.seq)
            case Replied(msg_id=msg_id, ok=ok, result=result, seq=seq):
                sent = self.inflight.pop(msg_id, None)
                self.replies.append((msg_id, sent.op if sent else "", ok, result))
                if sent is not None:
                    rec.on_reply(sent, ok, result, seq=seq)
                    info = self.agents.get(sent.host)
                    if info is not None and sent.host == item.peer:
                        info.saw(seq)  # made after any snapshot the agent sent before it
            case GaveUp(msg_id=msg_id, reason=reason):
                sent = self.inflight.pop(msg_id, None)
                if sent is not None:
                    rec.on_gave_up(sent, reason)
            case PeerSilent(peer=peer):
                rec.on_silent(peer)
            case Stalled(away_s=away, credited_s=credited):
                cfg = self.endpoint.config
                long = away >= cfg.heartbeat_interval_s * cfg.missed_heartbeats
                if long:
                    self.long_stalls.add(item)
                (self.log.warning if long else self.log.info)(
                    "controller_stalled",
                    away_s=round(away, 3),
                    credited_s=round(credited, 3),
                    why="the controller's process did not listen (stopped, paused, swapped out, "
                    "or its loop blocked): not counted against its agents' heartbeats or its "
                    "commands' deadlines",
                )
            case PeerReturned(peer=peer):
                self.log.info("agent_returned", host=peer)
                rec.ask_report(peer)
            case PeerRestarted(peer=peer, new_epoch=epoch):
                self.log.info("agent_restarted", host=peer, epoch=epoch)
                info = self.agents.get(peer)
                if info is not None:
                    info.reconciled = False
            case PeerJoined(peer=peer):
                self.log.info("agent_joined", host=peer)
            case PeerUnreachable(peer=peer, heard_s_ago=heard):
                self.log.warning(
                    "agent_unreachable",
                    host=peer,
                    heard_s_ago=None if heard is None else round(heard, 2),
                    why="no connection holds its routing id (gone, or its connection parked "
                    "behind an old one: its agent replaces it, see its controller_link lines)",
                )
            case Dropped() as d:
                self.drops[str(d.reason)] += 1
                if d.reason == DropReason.KEY_NOT_BOUND and (
                    d.peer in self.key_drops or len(self.key_drops) < KEY_DROPS_KEPT
                ):
                    self.key_drops[d.peer] = d.detail[:300]
                if (extra := self.throttle.let(f"frame_dropped:{d.reason}")) is not None:
                    self.log.warning("frame_dropped", **d.log_fields(), **extra)
            case _:
                pass


def agent_command(command: Command) -> SentCommand | None:
    """The agent command that performs a machine's `command` (None: nothing to send)."""
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


def _frame_problem(frame: Frame) -> str | None:
    if frame.kind is Kind.HELLO:
        return inventory_problem(frame.payload["inventory"])
    if frame.kind is Kind.EVENT:
        return event_problem(frame.payload["name"], frame.payload["data"])
    if frame.kind is Kind.RECONCILE:  # its entries' fields: checked by the transport
        return processes_problem(frame.payload["processes"], "reconcile")
    return None


def _releasing(state: str, data: Mapping[str, Any]) -> bool:
    """A GPU whose release was not confirmed: still releasing, or quarantined while it was."""
    return state == "releasing" or (state == "quarantined" and data.get("prior") == "releasing")
