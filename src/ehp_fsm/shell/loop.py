"""The shell's one loop: the one door into the orchestrator, one performer per command.

    loop = Loop(orchestrator, clock=steady_wall_clock())
    loop.add(agent_link)          # launch, stop_process, cancel_launch, confirm_gpu_free
    loop.add(dispatcher)          # generate, abort_request, pause_generation
    loop.add(publisher)           # install, delete_revision
    loop.event("rollout_engine", "e0", "drain")          # the one way in: `post`
    loop.run_until(lambda: engine_is("e0", "stopped"), timeout_s=30.0)

`post(event)` stamps the event with the loop's clock, hands it to the orchestrator (which writes
the transition log before the world changes) and queues the commands of an accepted outcome.
Unless the loop is already performing (a performer posting from inside `perform`), it then
performs the queue in order: each command goes to the one performer whose routes name it. What
a performer learns — at once in `perform`, or later in `poll` (agent frames, HTTP results,
trainer replies) — comes back the same way, as events it posts. `tick` polls every performer
and fires the deadlines that passed. Nothing else reaches the orchestrator.

A route is `(machine, kind)`: a command of `machine` of that `kind`, or `("*", kind)` for any
machine. A GPU's finalizer (`confirm_gpu_free`) is routed by the machine of the GPU's owner, so
whoever runs a Hybrid (an agent, or the run's warm trainer workers) also confirms its GPUs free.
A command that no route names is kept in `unhandled` and logged.

Knows: the orchestrator, the clock, the performers and their routes, the commands waiting to be
performed. Does not know: what any command means, sockets, HTTP or training. Single-threaded:
every call comes from the thread that made the loop (a performer's worker threads hand their
results to its `poll`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Final, Protocol

import structlog

from ehp_fsm.core.timers import armed_deadlines, due_deadlines, next_deadline
from ehp_fsm.core.transition import Accepted, Command, Outcome, Rejected
from ehp_fsm.core.world import Event, World
from ehp_fsm.embedded import Orchestrator
from ehp_fsm.errors import EhpError
from ehp_fsm.stalls import time_away

__all__ = [
    "Door",
    "Loop",
    "LoopError",
    "Performer",
    "Route",
    "no_wake",
    "route_of",
    "steady_wall_clock",
]

log = structlog.get_logger("ehp_fsm.loop")

Route = tuple[str, str]  # (machine or "*", command kind)
ANY: Final = "*"
#: The machine behind each owner prefix of a GPU (`engine:e0`, `hybrid:x1`).
OWNER_MACHINE: Final = {"engine": "rollout_engine", "hybrid": "hybrid_replica"}


class LoopError(EhpError):
    """The loop was misused: two performers for one route, a call from another thread."""


class Door(Protocol):
    """What a performer sees of the loop: the world to read, the clock, the one way in."""

    @property
    def world(self) -> World: ...

    def now(self) -> float: ...

    def post(self, event: Event) -> Outcome: ...

    def event(self, machine: str, instance: str, name: str, **payload: Any) -> Outcome: ...


class Performer(Protocol):
    """Performs the commands of its routes; posts what it learns through the door."""

    routes: frozenset[Route]

    def perform(self, command: Command) -> None:
        """Carry `command` out (or start it); post the events known at once."""

    def poll(self, timeout_s: float) -> object:
        """Post the events learned since the last call; may wait up to `timeout_s` (what it
        returns is the performer's own business: a count, or None)."""

    def close(self) -> None:
        """Release sockets, threads and clients (processes are stopped through commands)."""


def steady_wall_clock(wall: Callable[[], float] = time.time) -> Callable[[], float]:
    """A clock for the loop: seconds since the epoch, read from `wall` once, when it is made,
    and advanced by `time.monotonic` from then on. The log and the timeline show wall times;
    the deadlines, heartbeats and silence windows timed by it do not move when the wall clock
    is set (NTP stepping it, an operator's `date -s`, a VM resumed). On the wall clock itself,
    a step forward of an hour fired every waiting state's deadline and took every agent for
    silent (its GPUs quarantined, the commands in flight given up), and a step back held the
    controller's heartbeats and every deadline back by the hour."""
    anchor = wall() - time.monotonic()
    return lambda: anchor + time.monotonic()


def no_wake() -> None:
    """The `wake` of a performer that has no loop to wake (`Loop.wake`): its results wait
    for the loop's next turn."""


def route_of(command: Command) -> Route:
    """The route of `command`: its machine and kind; a GPU finalizer by its owner's machine."""
    if command.kind == "confirm_gpu_free":
        prefix = str(command.args.get("owner") or "").partition(":")[0]
        return (OWNER_MACHINE.get(prefix, command.machine), command.kind)
    return (command.machine, command.kind)


class Loop:
    """See the module docstring."""

    def __init__(
        self,
        orchestrator: Orchestrator,
        *,
        clock: Callable[[], float],
        stall_allowance_s: float | None = None,
    ) -> None:
        self.orchestrator = orchestrator
        self.clock = clock
        # given: time the loop does not turn beyond this (its process stopped or paused, a
        # call that blocked it) puts every armed deadline off (`tick`, `postpone_deadlines`);
        # None: every second of the clock counts (a virtual clock that jumps between events)
        self.stall_allowance_s = stall_allowance_s
        self._turned_at = clock()  # when the last turn ended
        self.performers: list[Performer] = []
        self.table: dict[Route, Performer] = {}
        self.queue: deque[Command] = deque()
        self.unhandled: deque[Command] = deque(maxlen=1000)
        self.rejected: deque[Rejected] = deque(maxlen=1000)
        self._performing = False
        # armed deadlines put off by the loop's own stalls (`postpone_deadlines`)
        self._postponed: dict[tuple[str, str], tuple[float, float]] = {}
        self._thread = threading.get_ident()
        # the wake-up pipe (made by the first `wake_fd`) and its lock: `wake` writes from any
        # thread, `close` closes it (a write after that could reach a reused descriptor)
        self._wake_lock = threading.Lock()
        self._wake_r: int | None = None
        self._wake_w: int | None = None

    # -- the door ----------------------------------------------------------------------------
    @property
    def world(self) -> World:
        return self.orchestrator.world

    def now(self) -> float:
        return self.clock()

    def post(self, event: Event) -> Outcome:
        """Handle `event` (stamped with the loop's clock) and perform what it commands."""
        if threading.get_ident() != self._thread:
            raise LoopError(
                f"post({event.machine} {event.instance!r} {event.name!r}) from another thread",
                "the orchestrator's world is owned by the loop's thread",
                "hand results to a performer's queue and post them from its poll()",
            )
        now = self.clock()  # (`now()`, without its call: once per event)
        stamped = (
            event  # already stamped with this very time object (`event` builds it so)
            if event.time is now
            else Event(
                event.machine, event.instance, event.name, now, event.payload, event.correlation
            )
        )
        outcome = self.orchestrator.handle(stamped)
        if isinstance(outcome, Accepted):
            if outcome.commands:
                self.queue.extend(outcome.commands)
            if not self._performing and self.queue:  # (most events command nothing)
                self._perform_queue()
        else:
            self.rejected.append(outcome)
            log.info(
                "event_rejected",
                machine=event.machine,
                instance=event.instance,
                name=event.name,  # not `event=`: structlog's first argument is the event
                reason=outcome.reason,
            )
        return outcome

    def event(self, machine: str, instance: str, name: str, **payload: Any) -> Outcome:
        """`post(Event(machine, instance, name, now, payload))`."""
        return self.post(Event(machine, instance, name, self.clock(), payload))

    # -- performers --------------------------------------------------------------------------
    def add(self, performer: Performer) -> None:
        """Route `performer.routes` to `performer`; a route has exactly one performer."""
        taken = sorted(r for r in performer.routes if r in self.table)
        if taken:
            raise LoopError(
                f"routes {taken} already have a performer",
                f"{type(self.table[taken[0]]).__name__} performs them",
                "give each (machine, kind) exactly one performer",
            )
        self.performers.append(performer)
        for r in performer.routes:
            self.table[r] = performer

    def performer_of(self, command: Command) -> Performer | None:
        machine, kind = route_of(command)
        return self.table.get((machine, kind)) or self.table.get((ANY, kind))

    def _perform_queue(self) -> None:
        self._performing = True
        try:
            while self.queue:
                command = self.queue.popleft()
                performer = self.performer_of(command)
                if performer is None:
                    self.unhandled.append(command)
                    log.warning(
                        "command_unhandled",
                        kind=command.kind,
                        machine=command.machine,
                        instance=command.instance,
                    )
                    continue
                performer.perform(command)
        finally:
            self._performing = False

    # -- wake-ups ----------------------------------------------------------------------------
    def wake_fd(self) -> int:
        """The read end of the loop's wake-up pipe, made on the first call. The first
        performer's wait watches it (the controller's agent socket: `Controller`), so a `wake`
        ends that wait at once: a result a worker thread hands to its performer (an engine's
        HTTP answer, a finished training step) is posted in this turn, not when the turn's
        timeout runs out (up to `tick`'s 20 ms, every hop: an install was reported 13 ms after
        its answer, a finished group 11 ms, the median of a default run)."""
        with self._wake_lock:
            if self._wake_r is None:
                r, w = os.pipe()
                os.set_blocking(r, False)
                os.set_blocking(w, False)  # a full pipe wakes the loop already: never block
                self._wake_r, self._wake_w = r, w
            return self._wake_r

    def wake(self) -> None:
        """End the wait of the loop's turn (any thread; see `wake_fd`). Nothing without a
        `wake_fd` (nobody waits on it) or once the loop is closed."""
        with self._wake_lock:
            if self._wake_w is None:
                return
            with contextlib.suppress(BlockingIOError):  # full: the loop is woken already
                os.write(self._wake_w, b"w")

    def _drain_wakes(self) -> None:
        r = self._wake_r
        if r is None:
            return
        try:
            while os.read(r, 4096):
                pass
        except BlockingIOError:
            pass

    # -- time --------------------------------------------------------------------------------
    def tick(self, timeout_s: float = 0.02) -> None:
        """One turn: poll every performer (waiting up to `timeout_s` in all, less when a
        deadline is due sooner), then fire the deadlines that passed."""
        wait = timeout_s
        start = self.now()
        due = next_deadline(self.world, self._postponed or None)
        if due is not None:
            wait = max(0.0, min(wait, due - start))
        for i, performer in enumerate(self.performers):
            performer.poll(wait if i == 0 else 0.0)
            if i == 0:
                # after the wait and before the others' polls: a wake from here on is for a
                # result these polls may miss, and its byte ends the next turn's wait at once
                self._drain_wakes()
        now = self.now()
        allowance = self.stall_allowance_s
        if allowance is not None:
            # what passed the allowance was not the peers' time
            away = time_away(self._turned_at, start, now, wait)
            if away > allowance:
                self.postpone_deadlines(away - allowance)
        for ev in due_deadlines(self.world, now, self._postponed or None):
            self.post(ev)
        self._turned_at = self.now()

    def postpone_deadlines(self, seconds: float) -> None:
        """The loop did not turn for `seconds` (its process stopped or paused, a call that
        blocked it: `tick` measures it with a `stall_allowance_s`): every armed deadline is
        put off by as much. A deadline bounds a peer's time, not the loop's own: a run stopped
        for 8 s in a step with a 3 s `computing` deadline had the step given up at the resume,
        before the trainer's answer was read, and stopped. Entries of deadlines no longer armed
        are dropped here."""
        keep: dict[tuple[str, str], tuple[float, float]] = {}
        for machine, iid, deadline in armed_deadlines(self.world):
            old = self._postponed.get((machine, iid))
            extra = old[1] if old is not None and old[0] == deadline else 0.0
            keep[(machine, iid)] = (deadline, extra + seconds)
        self._postponed = keep

    def run_until(
        self, predicate: Callable[[], bool], timeout_s: float, *, tick_s: float = 0.02
    ) -> bool:
        """Tick until `predicate()` holds (True) or `timeout_s` real seconds pass (False)."""
        end = time.monotonic() + timeout_s
        while True:
            if predicate():
                return True
            if time.monotonic() > end:
                return False
            self.tick(tick_s)

    def close(self, performers: Iterable[Performer] | None = None) -> list[str]:
        """Close the performers (all, or those given) and take them out of the table — a
        command for one of them later is `unhandled` — then, when closing all, the
        orchestrator's log. What failed to close, one line each (the rest is still closed)."""
        errors = []
        chosen = list(self.performers if performers is None else performers)
        for p in chosen:
            try:
                p.close()
            except Exception as exc:
                errors.append(f"{type(p).__name__}: {exc!r}")
            if p in self.performers:
                self.performers.remove(p)
            for r in p.routes:
                if self.table.get(r) is p:
                    del self.table[r]
        if performers is None:
            self.orchestrator.close()
            with self._wake_lock:
                for fd in (self._wake_r, self._wake_w):
                    if fd is not None:
                        os.close(fd)
                self._wake_r = self._wake_w = None
        return errors
