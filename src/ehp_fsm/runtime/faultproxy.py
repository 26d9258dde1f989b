"""A fault-injecting proxy between agent DEALERs and the controller's ROUTER, for tests.

Knows: how to relay control-plane messages in both directions while dropping, delaying,
duplicating and reordering them by a seeded schedule, and how to cut one peer off entirely
(a partition). Agents connect to `proxy.endpoint`; for each agent the proxy opens its own DEALER
to the controller with the *same* routing id, so the controller sees the agent's real name.

Does not know: the protocol — it relays opaque bytes (so it cannot sit inside CURVE; it is for
plain-text tests on loopback). Delays use the injected clock, so a test that drives time by hand
also drives the proxy: call `pump()` from the test's thread, or `start()` a background thread
(real time) and `stop()` it. Never both.
"""

from __future__ import annotations

import heapq
import itertools
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from ehp_fsm.runtime.errors import TransportError
from ehp_fsm.runtime.transport import is_loopback_endpoint

Clock = Callable[[], float]
UP, DOWN = "up", "down"  # up: agent → controller; down: controller → agent


@dataclass(frozen=True, kw_only=True)
class FaultSchedule:
    """Per-message fault probabilities (each message draws once from a seeded RNG)."""

    seed: int = 0
    drop: float = 0.0
    duplicate: float = 0.0
    delay: float = 0.0
    reorder: float = 0.0
    delay_s: tuple[float, float] = (0.01, 0.1)

    def __post_init__(self) -> None:
        probs = {
            "drop": self.drop,
            "duplicate": self.duplicate,
            "delay": self.delay,
            "reorder": self.reorder,
        }
        for name, p in probs.items():
            if not 0.0 <= p <= 1.0:
                raise TransportError(
                    f"FaultSchedule.{name}={p!r} is invalid",
                    "it is a probability",
                    "use a value in [0, 1]",
                )
        if sum(probs.values()) > 1.0:
            raise TransportError(
                "FaultSchedule probabilities add up to more than 1",
                "each message suffers at most one fault",
                "lower drop + duplicate + delay + reorder to <= 1",
            )
        lo, hi = self.delay_s
        if not 0.0 <= lo <= hi:
            raise TransportError(
                f"FaultSchedule.delay_s={self.delay_s!r} is invalid",
                "it is a (min, max) range of seconds",
                "use 0 <= min <= max",
            )


@dataclass(order=True)
class _Held:
    release_at: float
    order: int
    direction: str = field(compare=False)
    peer: bytes = field(compare=False)
    data: bytes = field(compare=False)


class FaultProxy:
    """Relays [agent DEALERs] ⇄ proxy ⇄ [controller ROUTER] with faults. See module docstring."""

    def __init__(
        self,
        *,
        upstream: str,
        schedule: FaultSchedule | None = None,
        clock: Clock = time.monotonic,
        bind: str = "tcp://127.0.0.1:*",
    ) -> None:
        if not is_loopback_endpoint(bind):
            raise TransportError(
                f"refusing to bind the fault proxy to {bind}",
                "it is a test tool",
                "bind it to loopback",
            )
        self.upstream, self._clock = upstream, clock
        self._schedule = schedule or FaultSchedule()
        self._rng = random.Random(self._schedule.seed)  # noqa: S311 - fault dice, not crypto
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._front: zmq.Socket[bytes] = self._context.socket(zmq.ROUTER)
        self._front.setsockopt(zmq.LINGER, 0)
        self._front.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._front.bind(bind)
        self.endpoint: str = self._front.getsockopt_string(zmq.LAST_ENDPOINT)
        self._back: dict[bytes, zmq.Socket[bytes]] = {}
        self._back_peer: dict[zmq.Socket[bytes], bytes] = {}
        self._poller = zmq.Poller()
        self._poller.register(self._front, zmq.POLLIN)
        self._held: list[_Held] = []
        self._reorder_slot: dict[tuple[str, bytes], bytes] = {}
        self._order = itertools.count()
        self._partitioned: set[bytes] = set()
        self.counts: Counter[str] = Counter()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards schedule/partition changes from other threads

    # -- control --
    def set_schedule(self, schedule: FaultSchedule) -> None:
        """Change the fault rates (keeps the RNG stream, so a run stays reproducible)."""
        with self._lock:
            self._schedule = schedule

    def partition(self, peer: str, *, cut: bool = True) -> None:
        """Drop everything to and from `peer` (cut=True) or heal it (cut=False)."""
        with self._lock:
            (self._partitioned.add if cut else self._partitioned.discard)(peer.encode())

    def release_all(self) -> None:
        """Release every held (delayed or reordered) message now, in hold order."""
        for held in sorted(self._held, key=lambda h: h.order):
            self._emit(held.direction, held.peer, held.data)
        self._held.clear()
        for (direction, peer), data in list(self._reorder_slot.items()):
            self._emit(direction, peer, data)
        self._reorder_slot.clear()

    # -- relaying --
    def _backend_for(self, peer: bytes) -> zmq.Socket[bytes]:
        sock = self._back.get(peer)
        if sock is None:
            sock = self._context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTING_ID, peer)
            sock.connect(self.upstream)
            self._back[peer], self._back_peer[sock] = sock, peer
            self._poller.register(sock, zmq.POLLIN)
        return sock

    def _emit(self, direction: str, peer: bytes, data: bytes) -> None:
        try:
            if direction == UP:
                self._backend_for(peer).send(data, flags=zmq.NOBLOCK)
            else:
                self._front.send_multipart([peer, data], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            self.counts["lost_in_relay"] += 1
            return
        self.counts[f"{direction}_forwarded"] += 1

    def _route(self, direction: str, peer: bytes, data: bytes) -> None:
        with self._lock:
            schedule, cut = self._schedule, peer in self._partitioned
        if cut:
            self.counts[f"{direction}_partitioned"] += 1
            return
        r = self._rng.random()
        p = schedule
        if r < p.drop:
            self.counts[f"{direction}_dropped"] += 1
            return
        r -= p.drop
        if r < p.duplicate:
            self.counts[f"{direction}_duplicated"] += 1
            self._send_or_release(direction, peer, data)
            self._send_or_release(direction, peer, data)
            return
        r -= p.duplicate
        if r < p.delay:
            self.counts[f"{direction}_delayed"] += 1
            lo, hi = p.delay_s
            heapq.heappush(
                self._held,
                _Held(
                    self._clock() + self._rng.uniform(lo, hi),
                    next(self._order),
                    direction,
                    peer,
                    data,
                ),
            )
            return
        r -= p.delay
        if r < p.reorder and (direction, peer) not in self._reorder_slot:
            self.counts[f"{direction}_reordered"] += 1
            self._reorder_slot[(direction, peer)] = data  # goes out after the next one
            return
        self._send_or_release(direction, peer, data)

    def _send_or_release(self, direction: str, peer: bytes, data: bytes) -> None:
        self._emit(direction, peer, data)
        held = self._reorder_slot.pop((direction, peer), None)
        if held is not None:
            self._emit(direction, peer, held)

    def pump(self, timeout_s: float = 0.0) -> int:
        """Relay what is waiting (up to `timeout_s` for something); returns messages seen."""
        moved = 0
        now = self._clock()
        wait = timeout_s
        if self._held:
            wait = max(0.0, min(wait, self._held[0].release_at - now))
        ready = dict(self._poller.poll(int(wait * 1000)))
        for sock, _ in ready.items():
            for _ in range(1000):
                try:
                    parts = sock.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                moved += 1
                if sock is self._front:
                    if len(parts) == 2:
                        self._route(UP, parts[0], parts[1])
                elif len(parts) == 1:
                    self._route(DOWN, self._back_peer[sock], parts[0])
        now = self._clock()
        while self._held and self._held[0].release_at <= now:
            held = heapq.heappop(self._held)
            self._emit(held.direction, held.peer, held.data)
        return moved

    @property
    def held(self) -> int:
        return len(self._held) + len(self._reorder_slot)

    # -- background mode --
    def start(self) -> None:
        """Relay in a background thread (real time) until `stop()`."""
        if self._thread is not None:
            raise TransportError(
                "fault proxy already started", "one relay thread at a time", "call stop() first"
            )
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.pump(0.01)

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None

    def close(self) -> None:
        self.stop()
        for sock in self._back.values():
            sock.close(linger=0)
        self._front.close(linger=0)
        self._context.term()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
