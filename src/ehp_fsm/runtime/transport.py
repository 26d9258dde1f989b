"""ZeroMQ endpoints of the control plane: the controller's ROUTER and an agent's DEALER.

Knows: sockets (pyzmq), socket options (maximum message size, handover, immediate), the
loopback-only bind rule, CURVE set-up (`zmq.auth.thread.ThreadAuthenticator` with an allow-list
directory), and how `protocol` frames and `reliability` bookkeeping combine into one
single-threaded `poll()` that returns *values*: what arrived, what was acknowledged or answered,
what was given up, which peers went silent, came back or restarted, and what was dropped and why.

Does not know: what commands mean, the engine world, processes or logging. The caller (controller
or agent loop) owns all of that, logs every `Dropped` it is handed, and calls `reply()` once per
`Received` command. Endpoints are not thread-safe: one thread owns one endpoint (pyzmq's rule).

The loop, on either side:

    with ControllerEndpoint(bind="tcp://127.0.0.1:5555") as ctl:
        msg_id = ctl.send_command("host-a", "launch", {"kind": "engine", "gpus": [0, 1]})
        while running:
            for item in ctl.poll(0.1):
                match item:
                    case Received(frame=f) if f.kind is Kind.EVENT: ...
                    case Replied(msg_id=m, ok=ok, result=r): ...
                    case GaveUp(msg_id=m): ...            # the command's fate is unknown
                    case PeerSilent(peer=p): ...          # quarantine p's GPUs
                    case PeerRestarted(peer=p) | PeerReturned(peer=p): ...  # expect reconcile
                    case Dropped() as d: log.warning("frame_dropped", **d.log_fields())
"""

from __future__ import annotations

import ipaddress
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import zmq
import zmq.auth.thread

from ehp_fsm.runtime.errors import TransportError
from ehp_fsm.runtime.keys import CurveClientKeys, CurveServerKeys
from ehp_fsm.runtime.protocol import (
    DEFAULT_MAX_DEPTH,
    DEFAULT_MAX_MESSAGE_BYTES,
    MAX_ID_CHARS,
    MAX_NAME_CHARS,
    REPLIED_KINDS,
    Dropped,
    DropReason,
    Frame,
    Kind,
    decode,
    encode,
    outgoing,
)
from ehp_fsm.runtime.reliability import (
    DEFAULT_DEDUP_CAPACITY,
    DedupCache,
    DedupState,
    Heard,
    LivenessTracker,
    Outbox,
    PeerRecord,
    Pending,
)

Clock = Callable[[], float]
CONTROLLER_NAME: Final = "controller"
_INTERNAL_KINDS: Final = frozenset({Kind.ACK, Kind.HEARTBEAT})


@dataclass(frozen=True, kw_only=True)
class TransportConfig:
    """Limits and timers of one endpoint. Times are seconds of the injected clock."""

    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_depth: int = DEFAULT_MAX_DEPTH
    retry_interval_s: float = 0.25
    deadline_s: float = 30.0
    heartbeat_interval_s: float = 1.0
    missed_heartbeats: int = 3
    dedup_capacity: int = DEFAULT_DEDUP_CAPACITY
    allow_non_loopback: bool = False
    recv_batch: int = 512

    def __post_init__(self) -> None:
        checks = [
            (self.max_message_bytes >= 1024, "max_message_bytes", "at least 1024"),
            (1 <= self.max_depth <= 64, "max_depth", "between 1 and 64"),
            (self.retry_interval_s > 0, "retry_interval_s", "positive"),
            (self.deadline_s >= self.retry_interval_s, "deadline_s", ">= retry_interval_s"),
            (self.heartbeat_interval_s > 0, "heartbeat_interval_s", "positive"),
            (self.missed_heartbeats >= 1, "missed_heartbeats", ">= 1"),
            (self.dedup_capacity >= 1, "dedup_capacity", ">= 1"),
            (self.recv_batch >= 1, "recv_batch", ">= 1"),
        ]
        for ok, name, must in checks:
            if not ok:
                raise TransportError(
                    f"TransportConfig.{name}={getattr(self, name)!r} is invalid",
                    f"it must be {must}",
                    f"set {name} to a value that is {must}",
                )


# ---- what poll() returns -------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Received:
    """A reliable message (hello, command, event, reconcile) delivered for the first time.

    Delivered once per message id however often it was sent; already acknowledged. A COMMAND
    must be answered with `reply()` (duplicates are answered from the stored reply).
    """

    peer: str
    frame: Frame


@dataclass(frozen=True, kw_only=True, slots=True)
class Acked:
    """The first acknowledgement of a reliable message we sent."""

    msg_id: str
    peer: str
    kind: Kind
    rtt_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Replied:
    """The reply to a command we sent; the command is finished."""

    msg_id: str
    peer: str
    ok: bool
    result: Any
    elapsed_s: float
    attempts: int


@dataclass(frozen=True, kw_only=True, slots=True)
class GaveUp:
    """A reliable message we stopped retrying: whether it took effect is unknown.

    `reason` is "deadline" (unanswered in time) or "peer_restarted" (the controller saw the
    agent's epoch grow; the old incarnation may have acted, the new one would act afresh).
    `acked` True means the receiver got it (a command: it may be acting).
    """

    msg_id: str
    peer: str
    kind: Kind
    acked: bool
    attempts: int
    waited_s: float
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class PeerJoined:
    peer: str
    epoch: int


@dataclass(frozen=True, kw_only=True, slots=True)
class PeerSilent:
    """No frame from `peer` for `missed_heartbeats` heartbeat intervals."""

    peer: str
    epoch: int
    last_seen: float
    silent_for_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class PeerReturned:
    """A silent peer was heard again with the same epoch (same incarnation, a reconnect)."""

    peer: str
    epoch: int
    silent_for_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class PeerRestarted:
    """A peer's epoch grew: it is a new incarnation (restarted agent or controller)."""

    peer: str
    old_epoch: int
    new_epoch: int


@dataclass(frozen=True, kw_only=True, slots=True)
class FdReady:
    """A file descriptor registered with `watch_fd` is readable (e.g. a pidfd: process exited)."""

    fd: int


Delivery = (
    Received
    | Acked
    | Replied
    | GaveUp
    | PeerJoined
    | PeerSilent
    | PeerReturned
    | PeerRestarted
    | FdReady
    | Dropped
)


def is_loopback_endpoint(endpoint: str) -> bool:
    """True for ipc://, inproc:// and tcp:// on a loopback address or `localhost`."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return False
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = rest.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # '*', an interface name or a host name: not provably loopback


def _peer_name(raw: bytes) -> str:
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "0x" + raw.hex()
    return name if name.isprintable() else "0x" + raw.hex()


class _Endpoint:
    """Shared machinery of both sides. Subclasses provide the socket and the peer routing."""

    _accepts: frozenset[Kind] = frozenset()
    _abandon_on_restart: bool = False

    def __init__(
        self,
        *,
        name: str,
        epoch: int | None,
        config: TransportConfig,
        clock: Clock,
        context: zmq.Context[zmq.Socket[bytes]] | None,
        socket_type: int,
    ) -> None:
        if not 0 < len(name) <= MAX_NAME_CHARS:
            raise TransportError(
                f"endpoint name {name!r} is invalid",
                f"names are 1..{MAX_NAME_CHARS} characters (they are routing ids)",
                "use the host id, e.g. `node-03`",
            )
        self.name, self.config, self._clock = name, config, clock
        self.epoch = time.time_ns() // 1_000_000 if epoch is None else epoch
        self._owns_context = context is None
        self._context: zmq.Context[zmq.Socket[bytes]] = context or zmq.Context()
        self._socket: zmq.Socket[bytes] = self._context.socket(socket_type)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._fds: set[int] = set()
        self._seq = 0
        self._id_prefix = uuid.uuid4().hex[:12]
        self._outbox = Outbox(retry_interval_s=config.retry_interval_s)
        self._dedup = DedupCache(capacity=config.dedup_capacity)
        self._liveness = LivenessTracker(
            heartbeat_interval_s=config.heartbeat_interval_s, missed=config.missed_heartbeats
        )
        self._next_heartbeat = clock()
        self._closed = False
        self._unsent: dict[str, Pending] = {}
        self.stats: dict[str, int] = {
            "sent": 0,
            "resent": 0,
            "send_failed": 0,
            "received": 0,
            "duplicates": 0,
            "dropped": 0,
            "late_answers": 0,
        }

    # -- subclass hooks --
    def _send_raw(self, peer: str, data: bytes) -> bool:
        raise NotImplementedError

    def _recv_one(self) -> tuple[str, bytes] | Dropped | None:
        raise NotImplementedError

    def _check_sender(self, routed_peer: str, frame: Frame) -> Dropped | None:
        raise NotImplementedError

    def _heartbeat_targets(self) -> Sequence[str]:
        raise NotImplementedError

    # -- lifecycle --
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._socket.close(linger=0)
        if self._owns_context:
            self._context.term()

    def __enter__(self) -> _Endpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(
                f"endpoint {self.name} is closed", "close() was called", "open a new endpoint"
            )

    # -- sending --
    def _frame(self, kind: Kind, payload: Mapping[str, Any], msg_id: str | None = None) -> Frame:
        self._seq += 1
        fields = {
            "id": msg_id or f"{self._id_prefix}-{self._seq}",
            "seq": self._seq,
            "epoch": self.epoch,
            "sender": self.name,
        }
        if kind in _INTERNAL_KINDS:  # payload made here from values we control
            return Frame.unchecked(kind=kind, payload=payload, **fields)  # type: ignore[arg-type]
        if msg_id is not None and not 0 < len(msg_id) <= MAX_ID_CHARS:
            raise TransportError(
                f"message id {msg_id[:80]!r} is invalid",
                f"ids have 1..{MAX_ID_CHARS} characters",
                "use a shorter id (e.g. a hash of what it names)",
            )
        return outgoing(kind, payload=payload, **fields)  # type: ignore[arg-type]

    def _send(self, peer: str, data: bytes) -> bool:
        ok = self._send_raw(peer, data)
        self.stats["sent" if ok else "send_failed"] += 1
        return ok

    def _send_reliable(
        self,
        peer: str,
        kind: Kind,
        payload: Mapping[str, Any],
        *,
        msg_id: str | None,
        deadline_s: float | None,
    ) -> str:
        self._check_open()
        if msg_id is not None and msg_id in self._outbox:
            raise TransportError(
                f"message id {msg_id!r} is already in flight",
                "ids are the dedup key: a second message with the same id would be ignored",
                "wait for its Replied/Acked/GaveUp, or cancel() it first",
            )
        frame = self._frame(kind, payload, msg_id)
        data = encode(frame, max_bytes=self.config.max_message_bytes)
        now = self._clock()
        entry = self._outbox.add(
            msg_id=frame.id,
            peer=peer,
            kind=kind,
            data=data,
            now=now,
            deadline=now + (self.config.deadline_s if deadline_s is None else deadline_s),
            completes_on_reply=kind in REPLIED_KINDS,
        )
        self._track(entry, self._send(peer, data))
        return frame.id

    def _answer(self, peer: str, kind: Kind, payload: Mapping[str, Any]) -> bytes:
        data = encode(self._frame(kind, payload), max_bytes=self.config.max_message_bytes)
        self._send(peer, data)
        return data

    def reply(self, received: Received, *, ok: bool, result: Any = None) -> None:
        """Answer a received COMMAND. Stored, so a retransmitted command gets the same answer."""
        self._check_open()
        frame = received.frame
        if frame.kind is not Kind.COMMAND:
            raise TransportError(
                f"cannot reply to a {frame.kind!s} frame",
                "only commands are answered with a reply; the rest are finished by their ack",
                "call reply() only for Received items whose frame.kind is Kind.COMMAND",
            )
        data = self._answer(
            received.peer, Kind.REPLY, {"ref": frame.id, "ok": ok, "result": result}
        )
        self._dedup.record_reply(received.peer, frame.id, data)

    def cancel(self, msg_id: str) -> bool:
        """Stop retrying a reliable message (no GaveUp will be reported for it)."""
        return self._outbox.cancel(msg_id) is not None

    @property
    def in_flight(self) -> int:
        return len(self._outbox)

    def peers(self) -> dict[str, PeerRecord]:
        """Snapshot of every peer heard from: epoch, first/last seen, alive or silent."""
        return self._liveness.peers()

    def forget_peer(self, peer: str) -> None:
        """Stop tracking a peer (no more heartbeats to it, no silence report)."""
        self._liveness.forget(peer)

    # -- fds --
    def watch_fd(self, fd: int) -> None:
        """Report `FdReady(fd)` from poll() while `fd` is readable (pidfds, pipes)."""
        if fd not in self._fds:
            self._fds.add(fd)
            self._poller.register(fd, zmq.POLLIN)

    def unwatch_fd(self, fd: int) -> None:
        if fd in self._fds:
            self._fds.discard(fd)
            self._poller.unregister(fd)

    # -- the loop --
    def _next_timer(self) -> float:
        candidates = [self._next_heartbeat]
        for t in (self._outbox.next_timer(), self._liveness.next_timer()):
            if t is not None:
                candidates.append(t)
        return min(candidates)

    def poll(self, timeout_s: float = 0.0) -> list[Delivery]:
        """Wait up to `timeout_s` (less when a timer is due), then handle what is there.

        Never raises for anything a peer sent. Returns deliveries in arrival order, then the
        timer outcomes (give-ups, silent peers).
        """
        self._check_open()
        out: list[Delivery] = []
        due_at = self._next_timer()  # receiving never makes a timer earlier (see _handle)
        wait = max(0.0, min(timeout_s, due_at - self._clock()))
        ready = dict(self._poller.poll(int(wait * 1000)))
        if ready.get(self._socket):
            for _ in range(self.config.recv_batch):
                got = self._recv_one()
                if got is None:
                    break
                if isinstance(got, Dropped):
                    self.stats["dropped"] += 1
                    out.append(got)
                    continue
                self._handle(*got, out)
        for fd in self._fds:
            if ready.get(fd):
                out.append(FdReady(fd=fd))
        now = self._clock()
        if now >= due_at:
            self._run_timers(now, out)
        elif self._unsent:
            self._retry_unsent(())
        return out

    def _track(self, entry: Pending, sent: bool) -> None:
        entry.unsent = not sent
        if sent:
            self._unsent.pop(entry.msg_id, None)
        else:
            self._unsent[entry.msg_id] = entry

    def _retry_unsent(self, skip: Sequence[Pending]) -> None:
        """Entries whose last hand-over failed (e.g. sent before the connection was up)."""
        for entry in list(self._unsent.values()):
            if entry.msg_id not in self._outbox:
                self._unsent.pop(entry.msg_id, None)
            elif entry not in skip:
                self._track(entry, self._send(entry.peer, entry.data))

    def _handle(self, routed_peer: str, data: bytes, out: list[Delivery]) -> None:
        cfg = self.config
        item = decode(
            data, max_bytes=cfg.max_message_bytes, max_depth=cfg.max_depth, peer=routed_peer
        )
        if isinstance(item, Frame):
            item = self._check_sender(routed_peer, item) or item
        if isinstance(item, Frame) and item.kind not in self._accepts:
            item = Dropped(
                reason=DropReason.UNEXPECTED_KIND,
                detail=f"{self.name} does not accept {item.kind!s} frames",
                size=len(data),
                peer=routed_peer,
            )
        if isinstance(item, Dropped):
            self.stats["dropped"] += 1
            out.append(item)
            return
        frame, peer, now = item, routed_peer, self._clock()
        self.stats["received"] += 1
        before = self._liveness.get(peer)
        old_epoch, old_last_seen = (before.epoch, before.last_seen) if before else (-1, now)
        heard, record = self._liveness.heard(peer, frame.epoch, now)
        if heard is Heard.STALE:
            self.stats["dropped"] += 1
            out.append(
                Dropped(
                    reason=DropReason.STALE_EPOCH,
                    detail=f"epoch {frame.epoch} < known epoch {record.epoch}",
                    size=len(data),
                    peer=peer,
                )
            )
            return
        if heard is Heard.NEW:
            out.append(PeerJoined(peer=peer, epoch=frame.epoch))
        elif heard is Heard.RESTARTED:
            out.append(PeerRestarted(peer=peer, old_epoch=old_epoch, new_epoch=frame.epoch))
            if self._abandon_on_restart:
                # The old incarnation may or may not have acted; the new one has no memory of
                # these ids and would act on them afresh. Hand the decision to the caller.
                self._give_up(now, out, self._outbox.abandon_peer(peer), "peer_restarted")
        elif heard is Heard.RETURNED:
            out.append(PeerReturned(peer=peer, epoch=frame.epoch, silent_for_s=now - old_last_seen))
        kind = frame.kind
        if kind is Kind.HEARTBEAT:
            return
        if kind is Kind.ACK:
            entry, _finished = self._outbox.on_ack(frame.ref, peer, now)
            if entry is not None:
                out.append(
                    Acked(
                        msg_id=entry.msg_id,
                        peer=peer,
                        kind=entry.kind,
                        rtt_s=now - entry.first_sent,
                    )
                )
            else:
                self.stats["late_answers"] += 1
            return
        if kind is Kind.REPLY:
            entry = self._outbox.on_reply(frame.ref, peer)
            if entry is None:
                self.stats["late_answers"] += 1
                return
            if entry.acked_at is None:  # the ack was lost; the reply implies it
                out.append(
                    Acked(
                        msg_id=entry.msg_id,
                        peer=peer,
                        kind=entry.kind,
                        rtt_s=now - entry.first_sent,
                    )
                )
            out.append(
                Replied(
                    msg_id=entry.msg_id,
                    peer=peer,
                    ok=bool(frame.payload["ok"]),
                    result=frame.payload["result"],
                    elapsed_s=now - entry.first_sent,
                    attempts=entry.attempts,
                )
            )
            return
        if kind is Kind.COMMAND and frame.payload["target_epoch"] != self.epoch:
            self.stats["dropped"] += 1
            out.append(
                Dropped(
                    reason=DropReason.WRONG_INCARNATION,
                    detail=f"meant for epoch {frame.payload['target_epoch']}, this is {self.epoch}",
                    size=len(data),
                    peer=peer,
                )
            )
            return
        # A reliable kind: act at most once, answer every copy.
        seen = self._dedup.lookup(peer, frame.id)
        if seen is None:
            state = DedupState.ACTING if kind in REPLIED_KINDS else DedupState.DONE
            self._dedup.admit(peer, frame.id, state=state)
            self._answer(peer, Kind.ACK, {"ref": frame.id})
            out.append(Received(peer=peer, frame=frame))
            return
        self.stats["duplicates"] += 1
        if seen.reply is not None:
            self._send(peer, seen.reply)
        else:
            self._answer(peer, Kind.ACK, {"ref": frame.id})

    def _give_up(self, now: float, out: list[Delivery], entries: list[Pending], why: str) -> None:
        for entry in entries:
            out.append(
                GaveUp(
                    msg_id=entry.msg_id,
                    peer=entry.peer,
                    kind=entry.kind,
                    acked=entry.acked_at is not None,
                    attempts=entry.attempts,
                    waited_s=now - entry.first_sent,
                    reason=why,
                )
            )

    def _run_timers(self, now: float, out: list[Delivery]) -> None:
        self._give_up(now, out, self._outbox.expired(now), "deadline")
        due = self._outbox.due(now)
        for entry in due:
            self.stats["resent"] += 1
            self._track(entry, self._send(entry.peer, entry.data))
        self._retry_unsent(due)
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.config.heartbeat_interval_s
            targets = self._heartbeat_targets()
            if targets:
                frame = self._frame(Kind.HEARTBEAT, {})
                data = encode(frame, max_bytes=self.config.max_message_bytes)
                for peer in targets:
                    self._send(peer, data)
        for peer, record in self._liveness.newly_silent(now):
            out.append(
                PeerSilent(
                    peer=peer,
                    epoch=record.epoch,
                    last_seen=record.last_seen,
                    silent_for_s=now - record.last_seen,
                )
            )


class ControllerEndpoint(_Endpoint):
    """The controller side: one ROUTER, bound (loopback unless allowed), many agent peers.

    Peers are agents' routing ids (their `host_id`); a frame whose `sender` differs from the
    routing id it arrived on is dropped. With `curve`, only agents whose public key is in
    `curve.authorized_dir` complete the handshake; nothing from anyone else reaches `poll()`.
    """

    _accepts = frozenset(
        {Kind.HELLO, Kind.EVENT, Kind.RECONCILE, Kind.ACK, Kind.REPLY, Kind.HEARTBEAT}
    )
    _abandon_on_restart = True

    def __init__(
        self,
        *,
        bind: str = "tcp://127.0.0.1:*",
        config: TransportConfig | None = None,
        clock: Clock = time.monotonic,
        epoch: int | None = None,
        name: str = CONTROLLER_NAME,
        curve: CurveServerKeys | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        config = config or TransportConfig()
        if not config.allow_non_loopback and not is_loopback_endpoint(bind):
            raise TransportError(
                f"refusing to bind the controller to {bind}",
                "it is not a loopback address, and the control plane must not be exposed by "
                "accident",
                "bind to tcp://127.0.0.1:PORT, or set allow_non_loopback=True (the plan's "
                "deliberate choice for multi-host runs, with CURVE keys)",
            )
        super().__init__(
            name=name,
            epoch=epoch,
            config=config,
            clock=clock,
            context=context,
            socket_type=zmq.ROUTER,
        )
        self._auth: zmq.auth.thread.ThreadAuthenticator | None = None
        sock = self._socket
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unreachable peer is an error we count
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting agent takes over its id
        if "[" in bind:
            sock.setsockopt(zmq.IPV6, 1)
        try:
            if curve is not None:
                self._auth = zmq.auth.thread.ThreadAuthenticator(self._context)
                self._auth.start()
                self._auth.configure_curve(domain="*", location=str(curve.authorized_dir))
                sock.curve_secretkey = curve.secret
                sock.curve_publickey = curve.public
                sock.curve_server = True
            sock.bind(bind)
        except zmq.ZMQError as exc:
            self.close()
            raise TransportError(
                f"cannot bind the controller to {bind}",
                str(exc),
                "pick a free port (or `*` for any), and check the address exists",
            ) from exc
        self.endpoint: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def close(self) -> None:
        if self._closed:
            return
        auth = getattr(self, "_auth", None)
        if auth is not None:
            auth.stop()
        super().close()

    def send_command(
        self,
        peer: str,
        op: str,
        args: Mapping[str, Any],
        *,
        msg_id: str | None = None,
        deadline_s: float | None = None,
    ) -> str:
        """Send a command to agent `peer`; retried until replied or `deadline_s` passes.

        Returns the message id. Outcomes arrive from poll(): Acked (received), then Replied
        (done) or GaveUp (unknown). Pass `msg_id` to re-send a logged command after a
        controller restart so that an agent that already acted answers from its memory.
        """
        self._check_open()
        record = self._liveness.get(peer)
        if record is None:
            raise TransportError(
                f"cannot command unknown agent {peer!r}",
                "a command is addressed to one incarnation of an agent, known from its frames",
                "wait for the agent's hello (PeerJoined) before commanding it",
            )
        payload = {"op": op, "args": dict(args), "target_epoch": record.epoch}
        return self._send_reliable(
            peer, Kind.COMMAND, payload, msg_id=msg_id, deadline_s=deadline_s
        )

    def _send_raw(self, peer: str, data: bytes) -> bool:
        try:
            self._socket.send_multipart([peer.encode("utf-8"), data], flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # EHOSTUNREACH (not connected) or EAGAIN (its queue is full)
            return False
        return True

    def _recv_one(self) -> tuple[str, bytes] | Dropped | None:
        try:
            parts = self._socket.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            return None
        peer = _peer_name(parts[0])
        if len(parts) != 2:
            size = sum(len(p) for p in parts[1:])
            return Dropped(
                reason=DropReason.BAD_ENVELOPE,
                detail=f"{len(parts) - 1} message parts, expected 1",
                size=size,
                peer=peer,
            )
        return peer, parts[1]

    def _check_sender(self, routed_peer: str, frame: Frame) -> Dropped | None:
        if frame.sender == routed_peer:
            return None
        return Dropped(
            reason=DropReason.SENDER_MISMATCH,
            detail=f"frame says sender {frame.sender[:64]!r}",
            size=0,
            peer=routed_peer,
        )

    def _heartbeat_targets(self) -> Sequence[str]:
        return list(self._liveness.peers())


class AgentEndpoint(_Endpoint):
    """One agent's side: a DEALER whose routing id is `host_id`, connected to the controller.

    Frames from a controller epoch older than one already seen are dropped (`stale_epoch`):
    a restarted controller must use a larger epoch. `PeerRestarted`/`PeerReturned` for the
    controller mean: send `hello()` and `reconcile()` again.
    """

    _accepts = frozenset({Kind.COMMAND, Kind.ACK, Kind.HEARTBEAT})

    def __init__(
        self,
        *,
        connect: str,
        host_id: str,
        config: TransportConfig | None = None,
        clock: Clock = time.monotonic,
        epoch: int | None = None,
        controller_name: str = CONTROLLER_NAME,
        curve: CurveClientKeys | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        super().__init__(
            name=host_id,
            epoch=epoch,
            config=config or TransportConfig(),
            clock=clock,
            context=context,
            socket_type=zmq.DEALER,
        )
        self.controller_name = controller_name
        sock = self._socket
        sock.setsockopt(zmq.ROUTING_ID, host_id.encode("utf-8"))
        sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing into a dead connection: retries cover it
        if "[" in connect:
            sock.setsockopt(zmq.IPV6, 1)
        if curve is not None:
            sock.curve_secretkey = curve.secret
            sock.curve_publickey = curve.public
            sock.curve_serverkey = curve.server_public
        try:
            sock.connect(connect)
        except zmq.ZMQError as exc:
            self.close()
            raise TransportError(
                f"cannot connect to {connect}", str(exc), "pass an endpoint like tcp://HOST:PORT"
            ) from exc
        self.endpoint = connect

    def hello(self, inventory: Mapping[str, Any], *, deadline_s: float | None = None) -> str:
        """Introduce this agent; finished by the controller's ack."""
        return self._send_reliable(
            self.controller_name,
            Kind.HELLO,
            {"host_id": self.name, "inventory": dict(inventory)},
            msg_id=None,
            deadline_s=deadline_s,
        )

    def reconcile(
        self, processes: Sequence[Mapping[str, Any]], *, deadline_s: float | None = None
    ) -> str:
        """Report the processes this agent actually runs (see `protocol.process_entry`)."""
        return self._send_reliable(
            self.controller_name,
            Kind.RECONCILE,
            {"processes": [dict(p) for p in processes]},
            msg_id=None,
            deadline_s=deadline_s,
        )

    def send_event(
        self,
        name: str,
        data: Mapping[str, Any],
        *,
        msg_id: str | None = None,
        deadline_s: float | None = None,
    ) -> str:
        """Report an event; retried until the controller acknowledges it."""
        return self._send_reliable(
            self.controller_name,
            Kind.EVENT,
            {"name": name, "data": dict(data)},
            msg_id=msg_id,
            deadline_s=deadline_s,
        )

    def _send_raw(self, peer: str, data: bytes) -> bool:
        try:
            self._socket.send(data, flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # EAGAIN: not connected (IMMEDIATE) or queue full
            return False
        return True

    def _recv_one(self) -> tuple[str, bytes] | Dropped | None:
        try:
            parts = self._socket.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            return None
        if len(parts) != 1:
            return Dropped(
                reason=DropReason.BAD_ENVELOPE,
                detail=f"{len(parts)} message parts, expected 1",
                size=sum(len(p) for p in parts),
                peer=self.controller_name,
            )
        return self.controller_name, parts[0]

    def _check_sender(self, routed_peer: str, frame: Frame) -> Dropped | None:
        if frame.sender == self.controller_name:
            return None
        return Dropped(
            reason=DropReason.SENDER_MISMATCH,
            detail=f"frame says sender {frame.sender[:64]!r}",
            size=0,
            peer=routed_peer,
        )

    def _heartbeat_targets(self) -> Sequence[str]:
        return [self.controller_name]
