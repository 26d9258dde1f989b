"""ZeroMQ endpoints of the control plane: the controller's ROUTER and an agent's DEALER.

Knows: the two socket kinds and their options (maximum message size, mandatory routing and no
router handover, ZMTP heartbeats, dealer immediate), binding (loopback-only unless allowed) and
connecting, CURVE set-up (`zmq.auth.thread.ThreadAuthenticator` with an allow-list directory,
and each key bound to its host id), how each side routes frames to peers, and the verbs each
side may send. The shared `poll()` loop lives in
`endpoint.Endpoint`; it returns *values* (`deliveries`): what arrived, what was acknowledged or
answered, what was given up, which peers went silent, came back or restarted, and what was
dropped and why.

Does not know: what commands mean, the engine world, processes or logging. The caller (controller
or agent loop) owns all of that, logs every `Dropped` it is handed, and calls `reply()` once per
`Received` command. Endpoints are not thread-safe: one thread owns one endpoint (pyzmq's rule).

The loop, on either side:

    with ControllerEndpoint(bind="tcp://127.0.0.1:5555") as ctl:
        while running:  # after host-a's hello: ctl.send_command("host-a", "launch", {...})
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

import functools
import operator
import struct
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

import zmq
import zmq.auth.thread

from ehp_fsm.addresses import is_loopback_endpoint
from ehp_fsm.runtime.deliveries import (
    Acked,
    FdReady,
    GaveUp,
    Incoming,
    LinkChanged,
    PeerJoined,
    PeerRestarted,
    PeerReturned,
    PeerSilent,
    PeerUnreachable,
    Received,
    Replied,
    Stalled,
)
from ehp_fsm.runtime.endpoint import (
    CONTROLLER_NAME,
    Clock,
    Endpoint,
    TransportConfig,
    _peer_name,
)
from ehp_fsm.runtime.errors import TransportError
from ehp_fsm.runtime.keys import CurveClientKeys, CurveServerKeys
from ehp_fsm.runtime.protocol import Dropped, DropReason, Frame, Kind
from ehp_fsm.runtime.reliability import PeerStatus

# Plain ints, not pyzmq's flag enums: converting an enum costs more than the send itself.
_NOBLOCK: Final = int(zmq.NOBLOCK)
_NOBLOCK_MORE: Final = int(zmq.NOBLOCK | zmq.SNDMORE)
_RCVMORE: Final = int(zmq.RCVMORE)
_POLLIN: Final = int(zmq.POLLIN)
_PEER_NAME_CACHE: Final = 4096  # routing ids remembered; past it names are decoded each time
# The agent's socket monitor: what its connection goes through, by the name it is logged under.
# Not CONNECT_RETRIED/CLOSED: with the controller gone, each refused attempt (every 100 ms)
# would be one.
_LINK_EVENTS: Final = {
    int(zmq.EVENT_CONNECTED): "connected",
    int(zmq.EVENT_HANDSHAKE_SUCCEEDED): "handshake_succeeded",
    int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL): "handshake_failed",
    int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL): "handshake_failed",
    int(zmq.EVENT_HANDSHAKE_FAILED_AUTH): "handshake_failed",
    int(zmq.EVENT_DISCONNECTED): "disconnected",
}
_LINK_EVENT_MASK: Final = functools.reduce(operator.or_, _LINK_EVENTS)

__all__ = [
    "CONTROLLER_NAME",
    "Acked",
    "AgentEndpoint",
    "Clock",
    "ControllerEndpoint",
    "Endpoint",
    "FdReady",
    "GaveUp",
    "Incoming",
    "LinkChanged",
    "PeerJoined",
    "PeerRestarted",
    "PeerReturned",
    "PeerSilent",
    "PeerUnreachable",
    "Received",
    "Replied",
    "Stalled",
    "TransportConfig",
    "is_loopback_endpoint",
]


def _zmtp_heartbeats(sock: zmq.Socket[bytes], config: TransportConfig) -> None:
    """ZMTP PING/PONG on every connection: one that stays quiet for the silence window is
    closed by libzmq (its routing id free again; the agent's side reconnects)."""
    interval_ms = max(1, int(config.heartbeat_interval_s * 1000))
    sock.setsockopt(zmq.HEARTBEAT_IVL, interval_ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, interval_ms * (config.missed_heartbeats + 1))


class ControllerEndpoint(Endpoint):
    """The controller side: one ROUTER, bound (loopback unless allowed), many agent peers.

    Peers are agents' routing ids (their `host_id`); a frame whose `sender` differs from the
    routing id it arrived on is dropped. With `curve`, only agents whose public key is in
    `curve.authorized_dir` complete the handshake; nothing from anyone else reaches `poll()`;
    and a frame whose routing id (host id) is not bound to the key it was sent with
    (`curve.hosts`) is dropped (`key_not_bound`).
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
        self._bound: Mapping[str, str] | None = dict(curve.hosts) if curve is not None else None
        self._routing_frame: zmq.Frame | None = None
        self._routing_ids: dict[str, bytes] = {}  # peer name → routing id (encoded once)
        self._peer_names: dict[bytes, str] = {}  # routing id → peer name (decoded once)
        # peers a send found unroutable, until one succeeds; False: not yet reported by poll()
        self._unreachable: dict[str, bool] = {}
        sock = self._socket
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unreachable peer is an error we count
        # No ROUTER_HANDOVER: a second connection presenting a connected agent's routing id
        # must not take it over (and, closing, cut the real agent off for good). A dead
        # connection frees its id by the ZMTP heartbeat instead, and its agent reconnects; a
        # reconnection that completes its handshake before the id is freed is parked, and the
        # agent replaces it (`AgentEndpoint._parked`).
        _zmtp_heartbeats(sock, config)
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

    def forget_peer(self, peer: str) -> None:
        super().forget_peer(peer)
        self._unreachable.pop(peer, None)
        self._routing_ids.pop(peer, None)

    def _send_raw(self, peer: str, data: bytes) -> bool:
        routing_id = self._routing_ids.get(peer)
        if routing_id is None:
            routing_id = self._routing_ids[peer] = peer.encode("utf-8")
        sock = self._socket
        try:
            # Two sends with int flags: what send_multipart does, without its per-part Python.
            sock.send(routing_id, _NOBLOCK_MORE)
            sock.send(data, _NOBLOCK)
        except zmq.ZMQError as exc:  # EHOSTUNREACH (not connected) or EAGAIN (queue full)
            if exc.errno == zmq.EHOSTUNREACH:
                self._unreachable.setdefault(peer, False)
            return False
        if self._unreachable:
            self._unreachable.pop(peer, None)
        return True

    def poll(self, timeout_s: float = 0.0) -> list[Incoming]:
        out = super().poll(timeout_s)
        if self._unreachable:
            self._report_unreachable(out)
        return out

    def _report_unreachable(self, out: list[Incoming]) -> None:
        now = self._clock()
        for peer, reported in self._unreachable.items():
            if not reported:
                self._unreachable[peer] = True
                record = self._liveness.get(peer)
                heard = None if record is None else now - record.last_seen
                out.append(PeerUnreachable(peer=peer, heard_s_ago=heard))

    def _recv_one(self) -> tuple[str, bytes] | Dropped | None:
        sock = self._socket
        try:
            # The routing part as a zmq.Frame: it carries the sender's address (`_source_address`).
            first = sock.recv(_NOBLOCK, copy=False)
        except zmq.Again:
            return None
        self._routing_frame = first
        raw_peer = first.bytes
        peer = self._peer_names.get(raw_peer)
        if peer is None:
            peer = _peer_name(raw_peer)
            if len(self._peer_names) < _PEER_NAME_CACHE:
                self._peer_names[raw_peer] = peer
        if first.more:
            body = sock.recv(_NOBLOCK, copy=False)
            if not body.more:  # the well-formed case: routing id + one frame
                if self._bound is not None and (problem := self._key_problem(peer, body)):
                    return Dropped(
                        reason=DropReason.KEY_NOT_BOUND,
                        detail=problem,
                        size=len(body.bytes),
                        peer=peer,
                    )
                return peer, body.bytes
            parts = [body.bytes]
            while sock.getsockopt(_RCVMORE):
                parts.append(sock.recv(_NOBLOCK))
        else:
            parts = []
        return Dropped(
            reason=DropReason.BAD_ENVELOPE,
            detail=f"{len(parts)} message parts, expected 1",
            size=sum(len(p) for p in parts),
            peer=peer,
        )

    def _key_problem(self, peer: str, body: zmq.Frame) -> str | None:
        """Why the CURVE key `body` came with may not speak for host `peer` (None: it may)."""
        assert self._bound is not None
        try:
            user_id = body.get("User-Id")  # the ZAP handler's user id: the client's Z85 key
        except zmq.ZMQError:
            user_id = None
        bound = self._bound.get(peer)
        if bound is None:
            return f"host id {peer[:64]!r} has no key in the binding (hosts.json)"
        if user_id != bound:
            return f"the key {str(user_id)[:12]}... is not the one bound to host {peer[:64]!r}"
        return None

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

    def _source_address(self) -> str | None:
        frame = self._routing_frame
        if frame is None:
            return None
        try:
            address = frame.get("Peer-Address")
        except zmq.ZMQError:  # not a TCP connection (ipc, inproc)
            return None
        return str(address) if address else None


class AgentEndpoint(Endpoint):
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
        self._curve = curve
        self._connected_at = clock()
        # when libzmq last dropped the connection, until the controller is heard after it
        self._dropped_at: float | None = None
        # when the current socket's connection completed its ZMTP handshake (None: not yet)
        self._handshake_at: float | None = None
        self._tcp_at: float | None = None  # when its TCP connection was made (the same)
        self._queued = False  # its handshake waited a heartbeat interval or more: see `_parked`
        self._patience_s = self._first_patience()  # see `_parked`
        self._monitor: zmq.Socket[bytes] | None = None
        self.stats["reconnects"] = 0
        try:
            self._connect(self._socket, connect)
        except zmq.ZMQError as exc:
            self.close()
            raise TransportError(
                f"cannot connect to {connect}", str(exc), "pass an endpoint like tcp://HOST:PORT"
            ) from exc
        self.endpoint = connect

    def _connect(self, sock: zmq.Socket[bytes], connect: str) -> None:
        sock.setsockopt(zmq.ROUTING_ID, self.name.encode("utf-8"))
        sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing into a dead connection: retries cover it
        _zmtp_heartbeats(sock, self.config)
        if "[" in connect:
            sock.setsockopt(zmq.IPV6, 1)
        if self._curve is not None:
            sock.curve_secretkey = self._curve.secret
            sock.curve_publickey = self._curve.public
            sock.curve_serverkey = self._curve.server_public
        if self._monitor is not None:
            self._poller.unregister(self._monitor)
            self._monitor.close(linger=0)
        self._monitor = sock.get_monitor_socket(_LINK_EVENT_MASK)
        self._poller.register(self._monitor, _POLLIN)
        sock.connect(connect)

    def poll(self, timeout_s: float = 0.0) -> list[Incoming]:
        out = super().poll(timeout_s)
        self._watch_connection(out)
        return out

    @property
    def connection_dropped(self) -> bool:
        """libzmq dropped the connection to the controller since it was last heard (its side
        closed it, or the ZMTP heartbeat timed out): the controller is gone or frozen, not
        just busy — a busy controller's I/O thread still answers the ZMTP heartbeat."""
        return self._dropped_at is not None

    def _watch_connection(self, out: list[Incoming]) -> None:
        """Report what libzmq did to the connection (`LinkChanged`) and note it dropping the
        connection (its ZMTP heartbeat timed out, the peer closed it); hearing the controller
        clears the note (see `_reconnect`)."""
        mon = self._monitor
        while mon is not None:
            try:
                head, address = mon.recv_multipart(_NOBLOCK)  # [event id + value, address]
            except zmq.Again:
                break
            event, value = struct.unpack("=HI", head[:6])
            what = _LINK_EVENTS.get(event, f"event_{event}")
            now = self._clock()
            if what == "disconnected":
                self._dropped_at, self._handshake_at, self._tcp_at = now, None, None
            elif what == "connected":
                self._tcp_at = now
            elif what == "handshake_succeeded":
                self._handshake_at = now
                waited = now - (now if self._tcp_at is None else self._tcp_at)
                self._queued = waited >= self.config.heartbeat_interval_s
            out.append(
                LinkChanged(
                    what=what,
                    socket=self.stats["reconnects"],
                    address=address.decode("utf-8", "replace"),
                    value=value,
                )
            )
        # Hearing the controller on this connection ends the suspicion (`_parked`), and with it
        # the doubled patience: a fresh agent that had to replace its first connection starts
        # its next drop with the first patience again, as an agent heard after a drop does.
        record = self._liveness.get(self.controller_name)
        if record is None:
            return
        dropped = self._dropped_at
        if record.last_seen > (self._connected_at if dropped is None else dropped):
            self._dropped_at, self._patience_s = None, self._first_patience()

    def _first_patience(self) -> float:
        return 2 * self.config.heartbeat_interval_s

    def _parked_at(self) -> float | None:
        """When the current connection is taken for parked (see `_parked`), None: not now.

        A connection is suspect once its handshake succeeded while the controller is silent
        after a drop, or while the controller was never heard at all: a restarted agent's first
        connection meets its predecessor's, which may still hold the routing id."""
        if self._handshake_at is None:
            return None
        record = self._liveness.get(self.controller_name)
        if record is not None and (
            self._dropped_at is None or record.status is not PeerStatus.SILENT
        ):
            return None
        if self._queued:
            return self._handshake_at + self.config.heartbeat_interval_s / 2
        return self._handshake_at + self._patience_s

    def _next_timer(self) -> float:
        due = super()._next_timer()
        parked = self._parked_at()
        return due if parked is None or parked > due else parked

    def _run_timers(self, now: float, out: list[Incoming]) -> None:
        super()._run_timers(now, out)
        parked = self._parked_at()
        if parked is not None:
            if now >= parked:
                self._parked(now, out)
            return
        record = self._liveness.get(self.controller_name)
        if self._dropped_at is None or record is None or record.status is not PeerStatus.SILENT:
            return
        if now - max(self._connected_at, record.last_seen) >= self._liveness.silence_after_s:
            self._reconnect(now, out, "handshake_pending")

    def _parked(self, now: float, out: list[Incoming]) -> None:
        """The connection's handshake succeeded after a drop (or it is a fresh agent's first
        connection), yet the controller is not heard.

        The controller's ROUTER (no handover: see `ControllerEndpoint`) gives an agent's
        routing id to a new connection only once it has released the old one, and releasing
        takes its loop two turns (read out the old connection's frames, then take libzmq's
        termination acknowledgement), while attaching a new one takes one. A connection whose
        handshake completes before that is parked for good: it answers ZMTP heartbeats, so
        nothing is ever dropped, but no frame passes either way. That is what an agent's
        pending connection meets when a frozen controller resumes: it waited in the frozen
        process's listen queue (TCP connected, no handshake), and its handshake completes at
        once, beside the old connection's teardown. Such a `queued` connection is replaced
        after half a heartbeat interval (a polling controller has released the old one by then).
        A restarted agent meets the same: its first connection's handshake can complete before
        the controller has released its predecessor's.

        Any other connection may be attached and the controller merely slow to send (it sends
        a heartbeat each interval, from a loop a training step may block): it is replaced
        (`unheard`) after two heartbeat intervals, then a pause twice as long each time, up to
        four silence windows. Replacing on a fixed beat, as this agent once did, replaced the
        attached connections too when the controller's loop was blocked longer than the beat
        (a long training step after the resume): each closed connection then held the id
        while its successor's handshake completed, and the agent never heard the controller
        again while the controller kept hearing it (the closed connections' frames). Doubling
        outlasts any finite block."""
        if self._queued:
            self._reconnect(now, out, "queued")
            return
        self._reconnect(now, out, "unheard")
        cap = 4 * self._liveness.silence_after_s
        self._patience_s = min(cap, 2 * self._patience_s)

    def close(self) -> None:
        if self._monitor is not None and not self._closed:
            self._poller.unregister(self._monitor)
            self._monitor.close(linger=0)
            self._monitor = None
        super().close()

    def _reconnect(self, now: float, out: list[Incoming], why: str) -> None:
        """A fresh socket (a new connection) to the controller, only after libzmq dropped the
        connection and while the controller is silent: `queued` or `unheard` (see `_parked`), or
        `handshake_pending` (once per silence window while the handshake has not completed:
        the controller is still away). Never while the controller is merely busy: a long
        training step blocks its loop, but its I/O thread still answers the ZMTP heartbeat,
        so nothing is dropped and the connection is kept — nothing lost.

        Unacknowledged messages are resent by the outbox as usual; hearing the controller
        again yields `PeerReturned` (the agent says hello and reconciles again)."""
        old = self._socket
        old.disable_monitor()
        sock: zmq.Socket[bytes] = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        try:
            self._connect(sock, self.endpoint)
        except zmq.ZMQError:
            sock.close(linger=0)
            return
        self._poller.unregister(old)
        old.close(linger=0)
        self._socket = sock
        self._poller.register(sock, _POLLIN)
        self._connected_at, self._handshake_at, self._tcp_at = now, None, None
        self._queued = False
        self.stats["reconnects"] += 1
        out.append(
            LinkChanged(
                what="reconnected", socket=self.stats["reconnects"], address=self.endpoint, why=why
            )
        )

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
            self._socket.send(data, _NOBLOCK)
        except zmq.ZMQError:  # EAGAIN: not connected (IMMEDIATE) or queue full
            return False
        return True

    def _recv_one(self) -> tuple[str, bytes] | Dropped | None:
        sock = self._socket
        try:
            first = sock.recv(_NOBLOCK, copy=False)
        except zmq.Again:
            return None
        if not first.more:  # the well-formed case: one frame
            return self.controller_name, first.bytes
        parts = [first.bytes]
        while sock.getsockopt(_RCVMORE):
            parts.append(sock.recv(_NOBLOCK))
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
