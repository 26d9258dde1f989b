"""The shared machinery of both endpoint kinds: one socket, one `poll()`, values out.

Knows: endpoint configuration (`TransportConfig`) and how frames (`protocol`) and bookkeeping
(`reliability`) combine into a single-threaded `poll()`: receive and validate, de-duplicate and
acknowledge, match answers to what we sent, retry, give up, heartbeat, and report peer liveness. A
received COMMAND's ACK waits for the end of the caller's turn: a reply sent before the next `poll()`
carries it (the sender takes a REPLY as the ACK as well), so a command answered at once costs one
frame each way; otherwise the next `poll()` sends the ACK.

Does not know: socket types and routing (`transport` subclasses `Endpoint` as the controller's
ROUTER and the agent's DEALER), the loopback rule (`ehp_fsm.addresses`), nor what any message
means.
"""

from __future__ import annotations

import abc
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Self, cast

import zmq

from ehp_fsm.plan import MAX_HEARTBEAT_S, MAX_MESSAGE_BYTES, MIN_MESSAGE_BYTES
from ehp_fsm.runtime.deliveries import (
    Acked,
    FdReady,
    GaveUp,
    Incoming,
    PeerJoined,
    PeerRestarted,
    PeerReturned,
    PeerSilent,
    Received,
    Replied,
    Stalled,
)
from ehp_fsm.runtime.errors import TransportError
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
from ehp_fsm.stalls import time_away

Clock = Callable[[], float]
CONTROLLER_NAME: Final = "controller"
_INTERNAL_KINDS: Final = frozenset({Kind.ACK, Kind.HEARTBEAT})
_EVENTS: Final = int(zmq.EVENTS)  # plain ints: no IntFlag arithmetic per message
_POLLIN: Final = int(zmq.POLLIN)


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
    #: Time the endpoint did not listen (`Stalled`: its process stopped or paused, its caller
    #: blocked between polls) beyond half a heartbeat interval counts toward no peer's silence
    #: and no message's deadline. False: every second of the clock counts (a test's fake clock
    #: advanced between polls to make a peer silent).
    discount_own_stalls: bool = True

    def __post_init__(self) -> None:
        checks = [
            (
                MIN_MESSAGE_BYTES <= self.max_message_bytes <= MAX_MESSAGE_BYTES,
                "max_message_bytes",
                f"within {MIN_MESSAGE_BYTES}..{MAX_MESSAGE_BYTES}",
            ),
            (1 <= self.max_depth <= 64, "max_depth", "between 1 and 64"),
            (self.retry_interval_s > 0, "retry_interval_s", "positive"),
            (self.deadline_s >= self.retry_interval_s, "deadline_s", ">= retry_interval_s"),
            (
                0 < self.heartbeat_interval_s <= MAX_HEARTBEAT_S,
                "heartbeat_interval_s",
                f"positive, at most {MAX_HEARTBEAT_S:g}",
            ),
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


def _peer_name(raw: bytes) -> str:
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "0x" + raw.hex()
    return name if name.isprintable() else "0x" + raw.hex()


class Endpoint(abc.ABC):
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
        self._poller.register(self._socket, _POLLIN)
        self._fds: set[int] = set()
        self._seq = 0
        self._id_prefix = uuid.uuid4().hex[:12]
        self._outbox = Outbox(retry_interval_s=config.retry_interval_s)
        self._dedup = DedupCache(capacity=config.dedup_capacity)
        self._liveness = LivenessTracker(
            heartbeat_interval_s=config.heartbeat_interval_s, missed=config.missed_heartbeats
        )
        self._next_heartbeat = clock()
        self._turned_at = self._next_heartbeat  # when the last poll() ended (`_stalled`)
        self.stalled_s = 0.0  # seconds credited to own stalls, in all
        self._closed = False
        self._unsent: dict[str, Pending] = {}
        self._addresses: dict[str, str] = {}
        self._deferred_acks: dict[tuple[str, str], None] = {}  # (peer, command id), in order
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
    @abc.abstractmethod
    def _send_raw(self, peer: str, data: bytes) -> bool:
        """Implemented by the controller and agent endpoints."""

    @abc.abstractmethod
    def _recv_one(self) -> tuple[str, bytes] | Dropped | None:
        """Implemented by the controller and agent endpoints."""

    @abc.abstractmethod
    def _check_sender(self, routed_peer: str, frame: Frame) -> Dropped | None:
        """Implemented by the controller and agent endpoints."""

    @abc.abstractmethod
    def _heartbeat_targets(self) -> Sequence[str]:
        """Implemented by the controller and agent endpoints."""

    # -- lifecycle --
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._socket.close(linger=0)
        if self._owns_context:
            self._context.term()

    def __enter__(self) -> Self:
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
        self._deferred_acks.pop((received.peer, frame.id), None)  # the reply acknowledges it
        data = self._answer(
            received.peer, Kind.REPLY, {"ref": frame.id, "ok": ok, "result": result}
        )
        self._dedup.record_reply(received.peer, frame.id, data)

    def _flush_acks(self) -> None:
        """ACK every command received in the last turn that was not replied to within it."""
        acks, self._deferred_acks = self._deferred_acks, {}
        for peer, msg_id in acks:
            self._answer(peer, Kind.ACK, {"ref": msg_id})

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
        self._addresses.pop(peer, None)

    def peer_address(self, peer: str) -> str | None:
        """The network address `peer` was last seen joining, restarting or returning from
        (TCP: its IP), or None when the transport does not say (ipc, inproc, agent side)."""
        return self._addresses.get(peer)

    def _source_address(self) -> str | None:
        """The sender address of the message being handled (the controller's ROUTER knows)."""
        return None

    # -- fds --
    def watch_fd(self, fd: int) -> None:
        """Report `FdReady(fd)` from poll() while `fd` is readable (pidfds, pipes)."""
        if fd not in self._fds:
            self._fds.add(fd)
            self._poller.register(fd, _POLLIN)

    def unwatch_fd(self, fd: int) -> None:
        if fd in self._fds:
            self._fds.discard(fd)
            self._poller.unregister(fd)

    # -- the loop --
    def _next_timer(self) -> float:
        due = self._next_heartbeat
        t = self._outbox.next_timer()
        if t is not None and t < due:
            due = t
        t = self._liveness.next_timer()
        if t is not None and t < due:
            due = t
        return due

    def poll(self, timeout_s: float = 0.0) -> list[Incoming]:
        """Wait up to `timeout_s` (less when a timer is due), then handle what is there.

        Never raises for anything a peer sent. Returns deliveries in arrival order, then the
        timer outcomes (give-ups, silent peers).
        """
        self._check_open()
        if self._deferred_acks:
            self._flush_acks()
        out: list[Incoming] = []
        due_at = self._next_timer()  # receiving never makes a timer earlier (see _handle)
        start = self._clock()
        wait = max(0.0, min(timeout_s, due_at - start))
        ready = dict(self._poller.poll(int(wait * 1000)))
        if self.config.discount_own_stalls:
            self._stalled(time_away(self._turned_at, start, self._clock(), wait), out)
        if ready.get(self._socket):
            sock = self._socket
            for _ in range(self.config.recv_batch):
                got = self._recv_one()
                if got is None:
                    break
                if isinstance(got, Dropped):
                    self.stats["dropped"] += 1
                    out.append(got)
                else:
                    self._handle(*got, out)
                # Stop when nothing is queued (cheaper than one more recv raising zmq.Again).
                if not cast(int, sock.getsockopt(_EVENTS)) & _POLLIN:
                    break
        for fd in self._fds:
            if ready.get(fd):
                out.append(FdReady(fd=fd))
        now = self._turned_at = self._clock()
        if now >= due_at:
            self._run_timers(now, out)
        elif self._unsent:
            self._retry_unsent(())
        return out

    def _stalled(self, away_s: float, out: list[Incoming]) -> None:
        """Credit the time this endpoint did not listen, beyond half a heartbeat interval (a
        caller's ordinary turn), to every alive peer's silence and every deadline of what it
        sent (`TransportConfig.discount_own_stalls`). A controller stopped for 20 s (SIGSTOP, a
        paused VM) took every agent for silent at its resume, before it had read the
        heartbeats waiting in its socket: their GPUs were quarantined and a command in flight
        could be given up, for its own stall."""
        credit = away_s - self.config.heartbeat_interval_s / 2
        if credit <= 0:
            return
        self._liveness.discount(credit, self._clock())
        self._outbox.postpone(credit)
        self.stalled_s += credit
        out.append(Stalled(away_s=away_s, credited_s=credit))

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

    def _handle(self, routed_peer: str, data: bytes, out: list[Incoming]) -> None:
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
        if heard is not Heard.SAME:  # joined, restarted or back: where from (if the socket says)
            address = self._source_address()
            if address is not None:
                self._addresses[peer] = address
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
                    seq=frame.seq,
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
            if kind in REPLIED_KINDS:
                # Its ACK waits for the caller's turn: a reply sent before the next poll()
                # carries it (the receiver takes a REPLY as its ACK too); else poll() sends it.
                self._deferred_acks[(peer, frame.id)] = None
            else:
                self._answer(peer, Kind.ACK, {"ref": frame.id})
            out.append(Received(peer=peer, frame=frame))
            return
        self.stats["duplicates"] += 1
        self._deferred_acks.pop((peer, frame.id), None)  # answered now, below
        if seen.reply is not None:
            self._send(peer, seen.reply)
        else:
            self._answer(peer, Kind.ACK, {"ref": frame.id})

    def _give_up(self, now: float, out: list[Incoming], entries: list[Pending], why: str) -> None:
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

    def _run_timers(self, now: float, out: list[Incoming]) -> None:
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
