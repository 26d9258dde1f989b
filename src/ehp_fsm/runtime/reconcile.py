"""The controller's side of the agents: what their hellos, events, replies, give-ups, silence
and reconcile reports mean for the engine world.

Knows: the agents heard from (`AgentInfo`), the agent commands in flight or held back
(`SentCommand`), how an agent's process report maps onto the engine's instances (by launch
token, then by identity: host, pid, start time, token — `same_identity`), and which engine events
and agent commands every mismatch becomes (the table in `controller`'s docstring). Does not
know: sockets, the transition log or the loop — the `Reconciler` belongs to the agent link
(`agent_link.AgentLink`), which supplies the endpoint, the commands in flight, `send` (an agent
command: sent, or held until the agent has reconciled) and the loop's door (`post`: an event
handled, its commands performed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from ehp_fsm.core.transition import Accepted, Outcome
from ehp_fsm.core.world import Event, World
from ehp_fsm.runtime.identity import same_record
from ehp_fsm.runtime.messages import report_problem
from ehp_fsm.runtime.pool_workers import POOL_MACHINE, PoolWorkers, is_pool_entry
from ehp_fsm.runtime.transport import ControllerEndpoint
from ehp_fsm.shell.loop import Door
from ehp_fsm.throttle import LogThrottle

PROCESS_MACHINES: Final = ("rollout_engine", "hybrid_replica")
#: The state in which a process exit is the expected end (not a failure).
EXPECTED_EXIT: Final = {"rollout_engine": "stopping", "hybrid_replica": "leaving"}
#: The event an agent's "process is up" report becomes, per machine.
UP_EVENT: Final = {"rollout_engine": "healthy", "hybrid_replica": "launched"}
#: States in which a launched process is waiting for that report.
AWAITING_UP: Final = {"rollout_engine": "starting", "hybrid_replica": "launching"}
#: two identity records name the same process (`identity.same_record`)
same_identity = same_record


@dataclass
class AgentInfo:
    host: str
    epoch: int
    inventory: Mapping[str, Any] = field(default_factory=dict)
    silent: bool = False
    reconciled: bool = False
    joined: bool = False  # reconciled at least once in this epoch: an agent of the run
    address: str | None = None  # where its frames come from (the transport's view)
    #: the newest frame handled from this incarnation (an event, a reply, a snapshot applied):
    #: a snapshot made before it is stale (the agent's frames share one counter)
    last_seq: int = -1

    def saw(self, seq: int) -> None:
        self.last_seq = max(self.last_seq, seq)


@dataclass(frozen=True)
class SentCommand:
    op: str
    host: str
    machine: str
    instance: str
    args: Mapping[str, Any]


def entry_identity(host: str, entry: Mapping[str, Any]) -> dict[str, Any]:
    ident = {
        "host": host,
        "pid": entry["pid"],
        "start_time": entry["start_time"],
        "token": entry["launch_token"],
    }
    url = (entry.get("labels") or {}).get("url")
    if url:
        ident["url"] = url
    return ident


class Link(Protocol):
    """What the reconciler needs of the agent link that owns it."""

    endpoint: ControllerEndpoint
    inflight: dict[str, SentCommand]
    log: Any  # structlog's bound logger (`bind()` is typed Any)
    door: Door

    def send(self, sent: SentCommand) -> None:
        """Send an agent command, or hold it until the agent has reconciled."""

    def drop_message(self, peer: str, what: str, problem: str) -> None:
        """Drop, loudly, an agent's message whose contents have the wrong shape."""

    def machines(self) -> tuple[str, ...]:
        """The process machines whose processes the agents run (a Hybrid on the run's own warm
        trainer workers is not an agent's: no agent report says anything about it)."""

    def refuse(self, peer: str, what: str, why: str) -> None:
        """Refuse, loudly, a delivery its sender may not make (nothing of it is applied)."""

    def finalizes(self, owner: str) -> bool:
        """Whether the agents confirm a GPU of `owner` free (not a Hybrid on the run's warm
        trainer workers: its parked worker's measured report is)."""


class Reconciler:
    """Agent news → orchestrator events and agent commands; owned by the agent link."""

    def __init__(self, link: Link, *, awaiting: Sequence[str] = (), window_s: float = 0.0) -> None:
        self.link = link
        self._throttle = LogThrottle()  # strangers come and go as often as one likes
        self.agents: dict[str, AgentInfo] = {}
        self.held: dict[str, list[SentCommand]] = {}
        #: the run's pool workers: their news goes to the run, never to the state machines
        self.pool = PoolWorkers(send=self._send_pool, log=link.log)
        now = link.door.now()
        self._awaiting: dict[str, float] = {h: now + window_s for h in awaiting}

    @property
    def world(self) -> World:
        return self.link.door.world

    @property
    def endpoint(self) -> ControllerEndpoint:
        return self.link.endpoint

    @property
    def inflight(self) -> dict[str, SentCommand]:
        return self.link.inflight

    @property
    def log(self) -> Any:
        return self.link.log

    def now(self) -> float:
        return self.link.door.now()

    def _handle(self, event: Event) -> Outcome:
        return self.link.door.post(event)

    def _send(self, sent: SentCommand) -> None:
        self.link.send(sent)

    def _send_pool(self, op: str, host: str, instance: str, args: Mapping[str, Any]) -> None:
        self._send(SentCommand(op, host, POOL_MACHINE, instance, args))

    def _drop_message(self, peer: str, what: str, problem: str) -> None:
        self.link.drop_message(peer, what, problem)

    def _inflight_for(self, host: str, op: str) -> list[SentCommand]:
        return [c for c in self.inflight.values() if c.host == host and c.op == op]

    def plan_hosts(self) -> set[str]:
        """The hosts of the plan: the only peers that can be agents."""
        return {str(h) for h in (self.world.config.get("inventory") or {}).values()}

    def sender_problem(self, peer: str, epoch: int) -> str | None:
        """Why `peer` (a connection, in `epoch`) may not report agent news; None: it may.
        Only the current incarnation of a plan host's agent that said hello and reconciled is
        an agent."""
        info = self.agents.get(peer)
        if info is None:
            return "it is not an agent of this run (no hello from a host of the plan)"
        if epoch != info.epoch:
            return f"epoch {epoch} is not the agent's current epoch {info.epoch}"
        if not info.joined:
            return "the agent has not reconciled since its hello"
        return None

    def on_hello(self, host: str, epoch: int, inventory: Mapping[str, Any]) -> None:
        if host not in self.plan_hosts():
            self.link.refuse(host, "hello", "it is not a host of the plan")
            return
        info = before = self.agents.get(host)
        if info is None or info.epoch != epoch:
            info = AgentInfo(host=host, epoch=epoch)
            self.agents[host] = info
        info.inventory = dict(inventory)
        info.address = self.endpoint.peer_address(host)
        if before is not None and before.address and info.address != before.address:
            self.log.warning(
                "agent_address_changed", host=host, old=before.address, new=info.address
            )
        reported = inventory.get("address")
        if reported and info.address and reported != info.address:
            self.log.warning(
                "agent_address_mismatch", host=host, reported=reported, seen=info.address
            )
        expected = [g.id for g in self.world.of("gpu").values() if g.get("host") == host]
        missing = sorted(set(expected) - set(inventory.get("gpus") or ()))
        if missing:
            self.log.warning("inventory_mismatch", host=host, missing=missing)
        self.log.info("agent_hello", host=host, gpus=inventory.get("gpus"))
        # The agent's own reconcile may have overtaken this hello on a lossy network (and been
        # dropped as coming before it): ask for a report; a duplicate answer is ignored.
        self.ask_report(host)

    def on_silent(self, host: str) -> None:
        """A known agent fell silent: its GPUs are quarantined. The silence of a peer that
        never was an agent (no hello from a plan host) says nothing about any host's GPUs (an
        agent that never comes is the `awaiting` deadline's); it is forgotten, so no heartbeat
        goes to it any more (each stranger was kept and heartbeated for good: a peer that
        connects under ever new names grew the controller's records and sends without bound)."""
        info = self.agents.get(host)
        if info is None:
            if (extra := self._throttle.let("stranger_silent")) is not None:
                self.log.warning("stranger_silent", peer=host, **extra)
            self.endpoint.forget_peer(host)
            return
        info.silent, info.reconciled = True, False
        self._quarantine(host)

    def _quarantine(self, host: str) -> None:
        self.log.warning("agent_silent", host=host)
        for g in list(self.world.of("gpu").values()):
            if g.get("host") == host and g.state in ("free", "owned", "releasing"):
                self._handle(Event("gpu", g.id, "quarantine", self.now(), {"reason": "silent"}))

    def check_awaiting(self) -> None:
        if not self._awaiting:
            return
        now = self.now()
        for host, by in list(self._awaiting.items()):
            info = self.agents.get(host)
            if info is not None and info.reconciled:
                del self._awaiting[host]
            elif now >= by:
                del self._awaiting[host]
                self._quarantine(host)

    # -- agent events ------------------------------------------------------------------------
    def on_agent_event(self, host: str, name: str, data: Mapping[str, Any], *, epoch: int) -> None:
        """An agent's event, from connection `host` in `epoch`: applied only when the sender is
        the current, reconciled agent of the host the event is about (the GPU's host, the
        instance's host and the identity's host); anything else is refused and creates no
        work."""
        problem = self.sender_problem(host, epoch)
        if problem is None:
            problem = self._subject_problem(host, name, data)
        if problem is not None:
            self.link.refuse(host, f"event {name}", problem)
            return
        now = self.now()
        if name == "gpu_free":
            payload = {
                "owner": data.get("owner"),
                "processes_exited": data.get("processes_exited") is True,
                "memory_free": data.get("memory_free") is True,
            }
            gpu = self.world.get("gpu", str(data.get("gpu")))
            if gpu is not None and gpu.state == "releasing":
                self._handle(Event("gpu", gpu.id, "confirm_free", now, payload))
            return
        machine, iid = str(data.get("machine", "")), str(data.get("instance", ""))
        if machine == POOL_MACHINE:
            self.pool.on_event(host, name, data)
            return
        if machine not in self.link.machines():
            self.log.warning("agent_event_ignored", host=host, name=name, machine=machine)
            return
        inst = self.world.get(machine, iid)
        live = inst is not None and inst.state not in self.world.specs[machine].terminal
        ident = data.get("identity")
        if name in ("healthy", "launched"):
            if not isinstance(ident, Mapping):
                return
            if live and inst is not None and inst.state == AWAITING_UP[machine]:
                out = self._handle(Event(machine, iid, UP_EVENT[machine], now, {"identity": ident}))
                if isinstance(out, Accepted):
                    return
            if live and inst is not None and same_identity(inst.get("identity"), ident):
                return  # a duplicate report of the process we know
            self._stop_orphan(host, machine, iid, ident, "no live instance owns it")
        elif name == "launch_failed":
            if live and inst is not None and inst.get("token") == data.get("token"):
                reason = _bounded(f"launch failed on {host}: {data.get('reason', '')}")
                self._handle(Event(machine, iid, "fail", now, {"reason": reason}))
        elif name == "exited":
            if not live or inst is None or not isinstance(ident, Mapping):
                return
            known = inst.get("identity")
            if known is None and inst.get("token") != ident.get("token"):
                return
            if known is not None and not same_identity(known, ident):
                return  # another process of ours (a stray) exited: not this instance's
            if known is not None and inst.state == EXPECTED_EXIT[machine]:
                self._handle(Event(machine, iid, "exited", now, {"identity": dict(known)}))
            else:
                code = data.get("returncode")
                reason = f"process exited unexpectedly (code {code}) in state {inst.state}"
                self._handle(Event(machine, iid, "fail", now, {"reason": reason}))

    def _subject_problem(self, host: str, name: str, data: Mapping[str, Any]) -> str | None:
        """Why the agent of `host` may not report this event (it is about another host)."""
        if name == "gpu_free":
            gpu = self.world.get("gpu", str(data.get("gpu")))
            if gpu is not None and gpu.get("host") != host:
                return f"GPU {gpu.id} is on host {gpu.get('host')}, not {host}"
            return None
        ident = data.get("identity")
        if isinstance(ident, Mapping) and ident.get("host") != host:
            return f"the identity names host {str(ident.get('host'))[:64]!r}, not {host}"
        machine, iid = str(data.get("machine", "")), str(data.get("instance", ""))
        inst = self.world.get(machine, iid) if machine in PROCESS_MACHINES else None
        if inst is not None and inst.get("host") != host:
            return f"{machine} {iid} runs on host {inst.get('host')}, not {host}"
        return None

    def _stop_orphan(
        self, host: str, machine: str, iid: str, ident: Mapping[str, Any], why: str
    ) -> None:
        self.log.warning("orphan_stopped", host=host, instance=iid, pid=ident.get("pid"), why=why)
        self._send(
            SentCommand(
                "stop_process",
                host,
                machine,
                iid,
                {"machine": machine, "instance": iid, "identity": dict(ident)},
            )
        )

    # -- replies and give-ups ----------------------------------------------------------------
    def ask_report(self, host: str) -> None:
        """A returned agent may not know it was silent: ask it for its processes."""
        info = self.agents.get(host)
        if info is None or info.reconciled:
            return
        msg_id = self.endpoint.send_command(host, "report", {})
        self.inflight[msg_id] = SentCommand("report", host, "", "", {})

    def on_reply(self, sent: SentCommand, ok: bool, result: Any, *, seq: int = -1) -> None:
        if sent.op == "report":
            info = self.agents.get(sent.host)
            if ok and (problem := report_problem(result)) is not None:
                self._drop_message(sent.host, "report reply", problem)
                return
            if ok and isinstance(result, Mapping) and info is not None and not info.reconciled:
                if 0 <= seq < info.last_seq:
                    # Made before an event already handled (a lost reply, answered again from
                    # the agent's memory): it would fail what was launched since. Ask anew.
                    self.log.warning("stale_report_ignored", host=sent.host, seq=seq)
                    self.ask_report(sent.host)
                    return
                self.reconcile(sent.host, list(result.get("processes") or ()), seq=seq)
            return
        if sent.machine == POOL_MACHINE:
            self.pool.on_reply(sent.op, sent.host, sent.args, ok, result)
            return
        if ok:
            return
        reason = result.get("reason") if isinstance(result, Mapping) else None
        self.log.warning("command_refused", op=sent.op, host=sent.host, result=result)
        inst = self.world.get(sent.machine, sent.instance) if sent.machine else None
        if inst is None or sent.machine not in self.link.machines():
            return
        if inst.state in self.world.specs[sent.machine].terminal:
            return
        now = self.now()
        if sent.op == "launch" and inst.get("token") == sent.args.get("token"):
            why = f"agent {sent.host} refused the launch: {result}"[:300]
            self._handle(Event(sent.machine, sent.instance, "fail", now, {"reason": why}))
        elif sent.op == "stop_process" and reason == "not_same_process":
            known = inst.get("identity")
            if not same_identity(known, sent.args.get("identity")):
                return  # the refused stop was for a stray, not for this instance's process
            if inst.state == EXPECTED_EXIT[sent.machine] and known is not None:
                self._handle(
                    Event(sent.machine, sent.instance, "exited", now, {"identity": dict(known)})
                )
            else:
                why = "its process is gone (the agent found the pid absent or reused)"
                self._handle(Event(sent.machine, sent.instance, "fail", now, {"reason": why}))

    def still_wanted(self, sent: SentCommand) -> bool:
        if sent.machine == POOL_MACHINE:
            return self.pool.still_wanted(sent.op, sent.args)
        if sent.op == "confirm_gpu_free":
            g = self.world.get("gpu", sent.instance)
            return g is not None and g.state == "releasing" and g.get("owner") == sent.args["owner"]
        inst = self.world.get(sent.machine, sent.instance)
        if sent.op == "launch":
            return (
                inst is not None
                and inst.state == AWAITING_UP.get(sent.machine)
                and inst.get("identity") is None
            )
        return True  # stops and cancels: an extra one is harmless (agents are idempotent)

    def on_gave_up(self, sent: SentCommand, reason: str) -> None:
        self.log.warning("command_gave_up", op=sent.op, host=sent.host, reason=reason)
        if sent.op == "report":
            self.ask_report(sent.host)
        elif reason == "deadline" and self.still_wanted(sent):
            self._send(sent)
        elif sent.machine == POOL_MACHINE and self.still_wanted(sent):
            self._send(sent)  # held until the restarted agent's reconcile; its token is kept
        # "peer_restarted": the agent's reconcile decides (it follows its hello)

    # -- reconcile ---------------------------------------------------------------------------
    def reconcile(
        self,
        host: str,
        entries: Sequence[Mapping[str, Any]],
        *,
        seq: int | None = None,
        epoch: int | None = None,
    ) -> None:
        info = self.agents.get(host)
        if info is None:
            # On a lossy network a reconcile can overtake a dropped hello; the hello that follows
            # asks for a fresh report (see `on_hello`). A stranger's report creates no work.
            self.link.refuse(host, "reconcile", "no hello from this agent (or not a plan host)")
            return
        if epoch is not None and epoch != info.epoch:
            why = f"epoch {epoch} is not the agent's current epoch {info.epoch}"
            self.link.refuse(host, "reconcile", why)
            return
        if seq is not None and seq < info.last_seq:
            # A snapshot older than a frame already handled from this agent (delayed or
            # reordered on a lossy network): applying it would fail instances launched since.
            # Seen in CI: the agent's start-up reconcile, delayed, came after the report asked
            # for at its hello had reconciled it and after its reply to a launch: the snapshot
            # ("no processes") failed the engine the agent had just started. A newer report was
            # applied, or is asked for now.
            self.log.warning("stale_reconcile_ignored", host=host, seq=seq, last_seq=info.last_seq)
            if not self._inflight_for(host, "report"):
                self.ask_report(host)
            return
        now = self.now()
        reported: dict[str, Mapping[str, Any]] = {str(e["launch_token"]): e for e in entries}
        launching = {str(c.args.get("token")) for c in self._inflight_for(host, "launch")}
        launching |= {str(c.args.get("token")) for c in self.held.get(host, ()) if c.op == "launch"}
        pool = {t: e for t, e in reported.items() if is_pool_entry(e)}
        for token in pool:
            del reported[token]  # the run's, never an engine's or a Hybrid's
        self.pool.reconcile(
            host,
            {t: (entry_identity(host, e), e.get("labels") or {}) for t, e in pool.items()},
            launching,
        )
        for machine in self.link.machines():
            spec = self.world.specs[machine]
            for inst in list(self.world.of(machine).values()):
                token = inst.get("token")
                if inst.state in spec.terminal or inst.get("host") != host or not token:
                    continue
                entry = reported.pop(str(token), None)
                known = inst.get("identity")
                if entry is None:
                    if token in launching and known is None:
                        continue
                    why = f"agent {host} does not run its process (reconcile)"
                    self._handle(Event(machine, inst.id, "fail", now, {"reason": why}))
                    continue
                labels = entry.get("labels") or {}
                if labels.get("phase") == "starting":
                    continue
                ident = entry_identity(host, entry)
                if known is None:
                    if inst.state == AWAITING_UP[machine]:
                        self._handle(
                            Event(machine, inst.id, UP_EVENT[machine], now, {"identity": ident})
                        )
                    continue
                if not same_identity(known, ident):
                    why = f"agent {host} runs another process under its token (reconcile)"
                    self._handle(Event(machine, inst.id, "fail", now, {"reason": why}))
                    self._stop_orphan(host, machine, inst.id, ident, "identity differs")
                elif inst.state == EXPECTED_EXIT[machine] and labels.get("phase") != "stopping":
                    self.held.setdefault(host, []).append(
                        SentCommand(
                            "stop_process",
                            host,
                            machine,
                            inst.id,
                            {"machine": machine, "instance": inst.id, "identity": dict(known)},
                        )
                    )
        for token, entry in reported.items():
            labels = entry.get("labels") or {}
            machine, iid = str(labels.get("machine", "")), str(labels.get("instance", ""))
            if labels.get("phase") == "starting":
                self.held.setdefault(host, []).append(
                    SentCommand(
                        "cancel_launch",
                        host,
                        machine,
                        iid,
                        {"machine": machine, "instance": iid, "token": token},
                    )
                )
            else:
                self._stop_orphan(host, machine, iid, entry_identity(host, entry), "not owned")
        self._reconcile_gpus(host)
        info.silent, info.reconciled, info.joined = False, True, True
        if seq is not None:
            info.saw(seq)
        self._awaiting.pop(host, None)
        self._flush_held(host)
        self.log.info("agent_reconciled", host=host, processes=len(entries))

    def _reconcile_gpus(self, host: str) -> None:
        now = self.now()
        confirming = {c.args["gpu"] for c in self._inflight_for(host, "confirm_gpu_free")}
        for g in list(self.world.of("gpu").values()):
            if g.get("host") != host:
                continue
            owner = g.get("owner")
            if g.state == "quarantined":
                if owner is None:
                    self._handle(Event("gpu", g.id, "reconcile_free", now))
                    continue
                if g.get("prior") == "owned" and self._owner_live(str(owner), g.id):
                    self._handle(Event("gpu", g.id, "reconcile_owned", now, {"owner": owner}))
                    continue
                self._handle(Event("gpu", g.id, "reconcile_released", now, {"owner": owner}))
            elif (
                g.state == "releasing"
                and g.id not in confirming
                and owner is not None
                and self.link.finalizes(str(owner))
            ):  # (not a Hybrid on the run's warm workers: its finalizer is the parked worker's
                # measured report, asked until it lets go; the agent, which runs no warm worker,
                # confirmed free a GPU whose stopped worker still held its lane)
                self.held.setdefault(host, []).append(
                    SentCommand(
                        "confirm_gpu_free", host, "gpu", g.id, {"gpu": g.id, "owner": owner}
                    )
                )

    def _owner_live(self, owner: str, gpu: str) -> bool:
        if owner == "core":
            return True
        kind, _, oid = owner.partition(":")
        machine = {"engine": "rollout_engine", "hybrid": "hybrid_replica"}.get(kind)
        inst = self.world.get(machine, oid) if machine else None
        if inst is None or machine is None or inst.state in self.world.specs[machine].terminal:
            return False
        return gpu in (inst.get("gpus") or ())

    def _flush_held(self, host: str) -> None:
        held = self.held.pop(host, [])
        for sent in held:
            if sent.op in ("launch", "confirm_gpu_free") and not self.still_wanted(sent):
                continue
            self._send(sent)


def _bounded(text: str, most: int = 300) -> str:
    """`text` within `most` characters for the log: its start and its end (where an engine's
    failure puts its cause: the last lines of its log), the cut marked. It was cut at 300
    characters mid-word, the cause lost."""
    if len(text) <= most:
        return text
    keep = (most - 5) // 2
    return f"{text[:keep]} […] {text[-keep:]}"
