"""What an endpoint's `poll()` returns: plain, frozen values (plus `protocol.Dropped`).

Knows: the outcome vocabulary of the transport — a first delivery (`Received`), an answer to
something we sent (`Acked`, `Replied`), a give-up (`GaveUp`), peer liveness changes
(`PeerJoined`, `PeerSilent`, `PeerReturned`, `PeerRestarted`, `PeerUnreachable`), its own
stalls (`Stalled`), readable watched fds
(`FdReady`) and, on an agent, what libzmq did to its connection (`LinkChanged`).
Does not know: sockets or timers; `endpoint` produces these values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ehp_fsm.runtime.protocol import Dropped, Frame, Kind


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
    # The reply frame's seq on its sender, one counter with the sender's events: a reply the
    # sender answers again from its memory keeps the seq it had when it was made.
    seq: int = -1


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
class PeerUnreachable:
    """The controller's ROUTER had no connection for `peer` (a send failed with EHOSTUNREACH);
    reported once until a send to it succeeds again. `heard_s_ago` (seconds since the peer's
    last frame) small means the peer is heard yet cannot be sent to: its connection is parked
    behind an old one holding its routing id (see `AgentEndpoint._parked`)."""

    peer: str
    heard_s_ago: float | None


@dataclass(frozen=True, kw_only=True, slots=True)
class Stalled:
    """This endpoint did not listen for `away_s` seconds: between two `poll()` calls, or in a
    poll that returned that much later than asked (its process stopped by SIGSTOP, a paused
    VM, swapping, or its caller blocked). `credited_s` of it (all but half a heartbeat
    interval) counts toward no peer's silence and no message's deadline: a peer heard again
    soon is not reported silent, an answer waiting in the socket is not given up
    (`LivenessTracker.discount`: after a stall as long as the silence window a peer has a
    whole window to connect again)."""

    away_s: float
    credited_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class FdReady:
    """A file descriptor registered with `watch_fd` is readable (e.g. a pidfd: process exited)."""

    fd: int


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkChanged:
    """An agent's connection to the controller changed (its socket monitor said so, or the
    agent opened a fresh one): for the log, so that a run whose agent stopped hearing the
    controller says what its connection went through.

    `what`: "connected", "handshake_succeeded", "handshake_failed", "disconnected" or
    "closed" (libzmq's monitor events), "reconnected" (a fresh socket, `AgentEndpoint`'s
    `_reconnect`). `socket`: which socket of this agent (0, then one more per reconnect).
    `value`: the event's value (an fd, an errno; 0 for "reconnected"). `why`: for
    "reconnected", the reason it was opened."""

    what: str
    socket: int
    address: str
    value: int = 0
    why: str = ""


Incoming = (
    Received
    | Acked
    | Replied
    | GaveUp
    | PeerJoined
    | PeerSilent
    | PeerReturned
    | PeerRestarted
    | PeerUnreachable
    | Stalled
    | FdReady
    | LinkChanged
    | Dropped
)
