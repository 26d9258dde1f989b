"""At-least-once sending, at-most-once acting, and peer liveness — as pure bookkeeping.

Knows: which reliable messages are waiting for an ACK or REPLY and when each is due for a retry
or past its deadline (`Outbox`); which message ids a receiver has already acted on and the reply
it gave (`DedupCache`, bounded); when each peer was last heard and whether it has gone silent or
come back (`LivenessTracker`). Together, retries + dedup give "exactly once in effect": the sender
repeats until answered, the receiver acts on the first copy and answers later copies from memory.

Does not know: sockets, encoding, or the clock — every method takes `now` (seconds, from the
caller's injected clock). Nothing here blocks, sleeps or logs.

Limits, stated plainly: the dedup memory holds `capacity` ids per receiver. An id evicted from it
and then retransmitted would be acted on again, so `capacity` must exceed the number of distinct
reliable messages a receiver can get from one sender within one sender deadline. A receiver that
restarts loses its memory; the controller covers that case by reconciling process identities.
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final

from ehp_fsm.fspaths import read_own_text, write_whole
from ehp_fsm.runtime.errors import TransportError
from ehp_fsm.runtime.protocol import Kind

DEFAULT_DEDUP_CAPACITY: Final = 65_536


@dataclass(kw_only=True, slots=True)
class Pending:
    """A reliable message in flight. Mutable bookkeeping owned by one `Outbox`."""

    msg_id: str
    peer: str
    kind: Kind
    data: bytes  # the encoded frame, resent unchanged
    first_sent: float
    next_retry: float
    deadline: float
    completes_on_reply: bool
    attempts: int = 1
    acked_at: float | None = None
    unsent: bool = False  # the last hand-over to the socket failed (not connected, queue full)


@dataclass(kw_only=True, slots=True)
class Outbox:
    """Reliable messages waiting for their answer, with retry timers and deadlines."""

    retry_interval_s: float
    _pending: dict[str, Pending] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.retry_interval_s > 0:
            raise TransportError(
                f"retry interval {self.retry_interval_s!r} s is invalid",
                "a sender retries every `retry_interval_s` seconds until answered",
                "use a positive interval, e.g. 0.2",
            )

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, msg_id: object) -> bool:
        return msg_id in self._pending

    def get(self, msg_id: str) -> Pending | None:
        return self._pending.get(msg_id)

    def add(
        self,
        *,
        msg_id: str,
        peer: str,
        kind: Kind,
        data: bytes,
        now: float,
        deadline: float,
        completes_on_reply: bool,
    ) -> Pending:
        if msg_id in self._pending:
            raise TransportError(
                f"message id {msg_id!r} is already in flight",
                "ids are the dedup key: two messages with one id would be acted on once",
                "let the transport choose ids, or derive them from something unique",
            )
        entry = Pending(
            msg_id=msg_id,
            peer=peer,
            kind=kind,
            data=data,
            first_sent=now,
            next_retry=now + self.retry_interval_s,
            deadline=deadline,
            completes_on_reply=completes_on_reply,
        )
        self._pending[msg_id] = entry
        return entry

    def on_ack(self, msg_id: str, peer: str, now: float) -> tuple[Pending | None, bool]:
        """Record an ACK from `peer`. Returns (entry if this is its *first* ack, finished?)."""
        entry = self._pending.get(msg_id)
        if entry is None or entry.peer != peer or entry.acked_at is not None:
            return None, False
        entry.acked_at = now
        if entry.completes_on_reply:
            return entry, False  # keep retrying (slowly answered from dedup) until the reply
        del self._pending[msg_id]
        return entry, True

    def on_reply(self, msg_id: str, peer: str) -> Pending | None:
        """Record a REPLY from `peer`; returns the finished entry (None if unknown / duplicate)."""
        entry = self._pending.get(msg_id)
        if entry is None or entry.peer != peer or not entry.completes_on_reply:
            return None
        del self._pending[msg_id]
        return entry

    def cancel(self, msg_id: str) -> Pending | None:
        return self._pending.pop(msg_id, None)

    def abandon_peer(self, peer: str) -> list[Pending]:
        """Remove and return every entry addressed to `peer`."""
        gone = [e for e in self._pending.values() if e.peer == peer]
        for entry in gone:
            del self._pending[entry.msg_id]
        return gone

    def postpone(self, seconds: float) -> None:
        """Move every deadline `seconds` later: the sender did not listen for that long (its
        process stopped, paused or blocked), so an answer that came meanwhile is still unread
        (`Endpoint.poll`). Retry times are kept: a late retry is answered from dedup."""
        for entry in self._pending.values():
            entry.deadline += seconds

    def expired(self, now: float) -> list[Pending]:
        """Remove and return every entry whose deadline has passed (the caller's give-ups)."""
        gone = [e for e in self._pending.values() if now >= e.deadline]
        for entry in gone:
            del self._pending[entry.msg_id]
        return gone

    def due(self, now: float) -> list[Pending]:
        """Entries whose retry time has come; their timers are advanced and attempts counted."""
        ready = [e for e in self._pending.values() if now >= e.next_retry]
        for entry in ready:
            entry.attempts += 1
            entry.next_retry = now + self.retry_interval_s
        return ready

    def next_timer(self) -> float | None:
        """The earliest retry time or deadline, for the caller's poll timeout."""
        due: float | None = None
        for e in self._pending.values():
            t = e.next_retry if e.next_retry < e.deadline else e.deadline
            if due is None or t < due:
                due = t
        return due


class DedupState(enum.Enum):
    ACTING = "acting"  # delivered to the application; no reply yet
    DONE = "done"  # replied (or, for kinds without a reply, acknowledged)


@dataclass(kw_only=True, slots=True)
class DedupEntry:
    state: DedupState
    reply: bytes | None = None


@dataclass(kw_only=True, slots=True)
class DedupCache:
    """Bounded memory of (peer, message id) a receiver has acted on, with the stored reply.

    When full, it forgets the least recently seen id of the peer that came in — if that peer
    holds more than its share (`capacity` over the peers it holds ids of) — else the least
    recently seen id of all. One peer's flood so evicts its own ids, not another's: with one
    order for all, a host that sent `capacity` events (junk its key may still send) made the
    receiver forget another host's ids, and act again on that host's next retransmission."""

    capacity: int = DEFAULT_DEDUP_CAPACITY
    _seen: OrderedDict[tuple[str, str], DedupEntry] = field(default_factory=OrderedDict)
    #: each peer's ids, least recently seen first
    _by_peer: dict[str, OrderedDict[str, None]] = field(default_factory=dict)
    evictions: int = 0

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise TransportError(
                f"dedup capacity {self.capacity} is invalid",
                "the receiver must remember at least the messages in flight to act once",
                "use a capacity above the reliable messages one sender sends per deadline",
            )

    def __len__(self) -> int:
        return len(self._seen)

    def lookup(self, peer: str, msg_id: str) -> DedupEntry | None:
        entry = self._seen.get((peer, msg_id))
        if entry is not None:
            self._seen.move_to_end((peer, msg_id))
            self._by_peer[peer].move_to_end(msg_id)
        return entry

    def admit(self, peer: str, msg_id: str, *, state: DedupState) -> DedupEntry:
        """Remember a first copy. Evicts an id when full (see the class docstring)."""
        entry = DedupEntry(state=state)
        self._seen[(peer, msg_id)] = entry
        own = self._by_peer.setdefault(peer, OrderedDict())
        own[msg_id] = None
        while len(self._seen) > self.capacity:
            if len(own) > max(1, self.capacity // len(self._by_peer)):
                oldest = next(iter(own))  # (not the id just admitted: it holds more than one)
                del self._seen[(peer, oldest)]
                del own[oldest]
            else:
                (holder, oldest), _ = self._seen.popitem(last=False)
                theirs = self._by_peer[holder]
                del theirs[oldest]
                if not theirs:
                    del self._by_peer[holder]
            self.evictions += 1
        return entry

    def record_reply(self, peer: str, msg_id: str, reply: bytes) -> bool:
        """Store the reply for later duplicates. False if the id was already evicted."""
        entry = self._seen.get((peer, msg_id))
        if entry is None:
            return False
        entry.state, entry.reply = DedupState.DONE, reply
        return True


class PeerStatus(enum.Enum):
    ALIVE = "alive"
    SILENT = "silent"


@dataclass(kw_only=True, slots=True)
class PeerRecord:
    epoch: int
    first_seen: float
    last_seen: float
    status: PeerStatus = PeerStatus.ALIVE
    silent_since: float | None = None
    #: Seconds of this endpoint's own stalls since the peer was last heard
    #: (`LivenessTracker.discount`): not counted toward its silence.
    deaf_s: float = 0.0


class Heard(enum.Enum):
    """What hearing from a peer meant (see `LivenessTracker.heard`)."""

    NEW = "new"  # first frame ever from this peer
    SAME = "same"  # an alive peer, same epoch
    RETURNED = "returned"  # a silent peer is heard again with the same epoch (a network blip)
    RESTARTED = "restarted"  # the peer's epoch grew: a new incarnation
    STALE = "stale"  # the frame carries an epoch older than the peer's known one: drop it


@dataclass(kw_only=True, slots=True)
class LivenessTracker:
    """Last-heard times per peer; a peer silent for `missed` heartbeat intervals is reported."""

    heartbeat_interval_s: float
    missed: int
    _peers: dict[str, PeerRecord] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.heartbeat_interval_s > 0 or self.missed < 1:
            raise TransportError(
                f"heartbeat interval {self.heartbeat_interval_s!r} s / missed {self.missed!r} "
                "is invalid",
                "a peer is silent after `missed` heartbeat intervals without a frame",
                "use a positive interval and missed >= 1 (e.g. 1.0 s and 3)",
            )

    @property
    def silence_after_s(self) -> float:
        return self.heartbeat_interval_s * self.missed

    def peers(self) -> dict[str, PeerRecord]:
        """Copies: changing them changes nothing here."""
        return {peer: replace(record) for peer, record in self._peers.items()}

    def get(self, peer: str) -> PeerRecord | None:
        return self._peers.get(peer)

    def heard(self, peer: str, epoch: int, now: float) -> tuple[Heard, PeerRecord]:
        record = self._peers.get(peer)
        if record is None:
            record = PeerRecord(epoch=epoch, first_seen=now, last_seen=now)
            self._peers[peer] = record
            return Heard.NEW, record
        if epoch < record.epoch:
            return Heard.STALE, record
        was_silent = record.status is PeerStatus.SILENT
        record.last_seen, record.status, record.silent_since = now, PeerStatus.ALIVE, None
        record.deaf_s = 0.0
        if epoch > record.epoch:
            record.epoch = epoch
            return Heard.RESTARTED, record
        return (Heard.RETURNED if was_silent else Heard.SAME), record

    def discount(self, seconds: float, now: float) -> None:
        """This endpoint did not listen for `seconds` (its process stopped, paused or blocked):
        that time does not count toward any alive peer's silence. Its frames sent meanwhile
        wait in the socket; a peer is not silent because nobody read them.

        A stall as long as the silence window (long enough for libzmq to drop the peers'
        connections: they must connect again) gives each peer heard since the last stall a
        whole window from `now`. A peer not heard since then is credited only `seconds`: a
        dead one is still found silent, however often its endpoint stalls."""
        fresh = seconds >= self.silence_after_s
        for record in self._peers.values():
            if record.status is not PeerStatus.ALIVE:
                continue
            if fresh and record.deaf_s == 0.0:
                record.deaf_s = max(seconds, now - record.last_seen)
            else:
                record.deaf_s += seconds

    def newly_silent(self, now: float) -> list[tuple[str, PeerRecord]]:
        """Peers that crossed the silence threshold since the last call (each reported once):
        `silence_after_s` of listening without a frame from them."""
        out = []
        for peer, record in self._peers.items():
            if (
                record.status is PeerStatus.ALIVE
                and now - record.last_seen - record.deaf_s >= self.silence_after_s
            ):
                record.status, record.silent_since = PeerStatus.SILENT, now
                out.append((peer, record))
        return out

    def forget(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def next_timer(self) -> float | None:
        earliest: float | None = None
        for r in self._peers.values():
            heard = r.last_seen + r.deaf_s
            if r.status is PeerStatus.ALIVE and (earliest is None or heard < earliest):
                earliest = heard
        return None if earliest is None else earliest + self.silence_after_s


def epoch_path(log_path: str | Path) -> Path:
    return Path(f"{log_path}.epoch")


def next_epoch(log_path: str | Path | None) -> int:
    """An incarnation's epoch: larger than any used before with `log_path` (the controller's
    transition log; an agent's `<state dir>/agent`) and than the wall clock in milliseconds,
    so fresh runs also order. Recorded beside it (`epoch_path`): a restart after the wall
    clock was set back still takes a larger epoch than the incarnation its peers knew (they
    drop a smaller one's frames as stale)."""
    now_ms = time.time_ns() // 1_000_000
    if log_path is None:
        return now_ms
    side = epoch_path(log_path)
    last = 0
    try:  # a regular file alone: a FIFO planted there hung the run's start for good
        last = int(read_own_text(side, 64).strip() or 0)
    except (OSError, ValueError):
        last = 0
    epoch = max(now_ms, last + 1)
    side.parent.mkdir(parents=True, exist_ok=True)
    # into `<side>.tmp`, made exclusively (never through a link planted there: it overwrote
    # the link's target, any file of the user's), then renamed over `side`
    write_whole(side, str(epoch))
    return epoch
