"""The coordinator's end of the trainer pool's control channel.

`WorkerChannel` owns the ZeroMQ ROUTER socket (`pool_socket`: loopback and plain by default,
another interface with CURVE, a random port), the per-rank worker records
(identity, process handle, version, bound replica, active, dead), sending commands as validated
msgpack COMMAND frames, and waiting for their replies with a deadline while watching every awaited
worker's process (its `Popen` handle when the pool launched it, else its hello identity): a dead
worker ends the wait as a `PoolFailure` naming its rank. A reply that nobody waits for any more
(after a deadline) is logged, and a gradient delivery among them goes to the current step's ledger,
which rejects it. `TrainerPool` (pool.py) builds on it.

After a collective failed, `_settle` waits for *every* awaited rank's outcome (a reply, an error,
or its death) instead of stopping at the first, and `_reform` rebuilds the Gloo world without
the dead: a fresh rendezvous, and every surviving worker (Core ranks and idle warm workers)
destroys its process groups and joins the new world (`reform` command). Before it names the
members it checks each one's process (an idle warm worker can die unnoticed), and when a re-form
fails only because warm workers died during it, it is tried once more without them. A dead warm
worker that this pool launched is replaced by a fresh process on standby (`--standby`) — the old
process, should it still run, is killed and reaped first — and admitted into the world by the
next re-form (`admit_replacements`, at the start of a step or a state load), so the planner can
borrow again. A hello is taken only from the process the pool expects: one carrying another
launch token, or (for a process this pool launched) another pid than its handle's, is dropped.
An error reply marked `local` (the worker failed alone, after its collectives) leaves the world
usable. Ranks on other machines (`PoolConfig.home`: Core lanes of `remote_core`, warm lanes of
`remote_warm`) are launched and stopped (a warm one also replaced) through the pool's `Launcher`
(the run's asks their hosts' agents), and are judged dead only from its word (`report_exit`): a
pid on another machine cannot be checked from here.
What it does not know: what the commands mean, steps, borrowing.

Threads: the run steps the pool on a thread of its own (so its loop keeps serving agents and
engines during a step) while its loop may call the pool too (a Hybrid's return, a GPU's
finalizer). Every public entry point that touches the socket or the worker records is
`exclusive`: it holds the channel's re-entrant lock, so one thread at a time uses the pool and
the other waits; `busy()` says, without waiting, whether another thread holds it.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Concatenate, Final, Literal, ParamSpec, Protocol, TypeVar

import structlog
import zmq

from ehp_fsm.errors import exit_words, last_error_line
from ehp_fsm.runtime import identity as ident
from ehp_fsm.runtime.keys import CurveServerKeys
from ehp_fsm.runtime.pool_launch import (
    POOL_TOKEN_ENV,
    ROUTE_ENV,
    new_route,
    routing_id,
    same_route,
    split_routing_id,
)
from ehp_fsm.runtime.protocol import Dropped, Frame, Kind, decode, encode
from ehp_fsm.stalls import OwnDeadline
from ehp_fsm.throttle import LogThrottle
from ehp_fsm.training.backend import GradientDelivery
from ehp_fsm.training.collect import DeliveryCollector
from ehp_fsm.training.memory import HeldMemory
from ehp_fsm.training.pool_protocol import (
    FOLLOWER_LOST_EXIT,
    PoolConfig,
    PoolError,
    PoolFailure,
    delivery_from_wire,
    delivery_wire_problem,
    hello_problem,
    worker_argv,
)
from ehp_fsm.training.pool_socket import LOOPBACK, PoolSocket
from ehp_fsm.training.prefork import StartedWorker, Starter

#: Signals a process raises on itself when it crashes (C++ `terminate`, a bad pointer): its
#: log's last error line is named with its death. SIGKILL and SIGTERM come from outside.
_CRASHES: Final = frozenset(
    int(sig)
    for sig in (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL)
)
log = structlog.get_logger("ehp_fsm.training.pool")

Outcome = tuple[Literal["ok", "error", "dead", "deadline"], dict[str, Any]]

POOL_SENDER = "trainer-pool"

_P = ParamSpec("_P")
_R = TypeVar("_R")
_C = TypeVar("_C", bound="WorkerChannel")


def exclusive(method: Callable[Concatenate[_C, _P], _R]) -> Callable[Concatenate[_C, _P], _R]:
    """Run `method` holding the channel's lock (see the module docstring: one thread at a
    time uses the pool)."""

    @functools.wraps(method)
    def held(self: _C, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._exclusive:
            return method(self, *args, **kwargs)

    return held


@dataclass
class _Worker:
    rank: int
    role: Literal["core", "hybrid"]
    identity: ident.ProcessIdentity | None = None
    process: subprocess.Popen[bytes] | StartedWorker | None = None
    version: int = 0
    replica: str | None = None  # bound Hybrid replica id (set by load_state)
    active: bool = False
    dead: str | None = None
    shapes: tuple[tuple[int, ...], ...] = ()
    intra_op_threads: int = 0
    standby: bool = False  # a replacement, not yet admitted into the Gloo world
    replaced: str | None = None  # why the worker this one replaces was judged dead
    held: HeldMemory | None = None  # its last park/memory report (None: never parked)
    launch_ref: str | None = None  # the launcher's reference of a remote warm rank's launch
    log_from: int = 0  # where this process's output starts in its rank's log (appended to)
    #: this launch's secret route: the worker's routing id is `trainer-<rank>/<route>`
    #: (`pool_launch.routing_id`); a frame from any other id is dropped
    route: str = field(default_factory=new_route)


class Launcher(Protocol):
    """Starts and stops the ranks the pool does not launch itself (`PoolConfig.home`: Core
    lanes and warm lanes of other machines): a remote host's agent does, for the run. Called
    from whichever thread uses the pool, so an implementation hands the work to the thread
    that owns its sockets. The pool learns of the process's end from
    `WorkerChannel.report_exit(ref, why)`."""

    def launch(self, rank: int, *, standby: bool, route: str) -> str:
        """Ask for rank `rank`'s process, its secret `route` given to it in its environment
        (`pool_launch.ROUTE_ENV`); returns this launch's reference."""
        ...

    def stop(self, ref: str) -> None:
        """Stop launch `ref`'s process, should it still run."""
        ...


@dataclass(frozen=True, kw_only=True)
class Reform:
    """One re-formed Gloo world: who was left out, who is in, how long it took."""

    op: str  # the operation whose collective failed
    dead: tuple[int, ...]
    members: tuple[int, ...]
    rendezvous: str
    seconds: float


class WorkerChannel:
    """The ROUTER end and the worker records of one pool (see the module docstring)."""

    def __init__(
        self,
        config: PoolConfig,
        *,
        work_dir: Path,
        launcher: Launcher | None = None,
        rendezvous_dir: Path | None = None,
        listen: str = LOOPBACK,
        curve: CurveServerKeys | None = None,
        rank_hosts: Mapping[int, str] | None = None,
        local_client_key: Path | None = None,
        prefork: bool | None = None,
    ) -> None:
        """`launcher`: starts the ranks of other machines (`PoolConfig.home`);
        `rendezvous_dir`: where Gloo's rendezvous files go (default `work_dir`; a shared file
        system when ranks run on other machines); `listen`, `curve`, `rank_hosts`,
        `local_client_key`: where the channel listens and who may speak on it
        (`pool_socket.PoolSocket`: loopback and plain by default); `prefork`: fork the ranks
        this pool launches itself from one preloaded process (`prefork`; default: on CPU only),
        else start each as its own `python -m ehp_fsm.training.worker`."""
        if config.remote_ranks and launcher is None:
            raise PoolError(
                f"the pool has lanes on hosts {config.remote_hosts} and no launcher for them",
                "a rank on another machine is launched by its host's agent, through the launcher",
                "pass launcher= (the run does), or leave PoolConfig.remote_warm and remote_core "
                "empty",
            )
        self.config = config
        self._launcher = launcher
        self._prefork = config.device == "cpu" if prefork is None else prefork
        if self._prefork and config.device != "cpu":
            raise PoolError(
                f"prefork=True with device {config.device!r}",
                "a process that initialised CUDA cannot fork a child that uses it",
                "leave prefork unset (it is on for CPU pools only)",
            )
        self._starter: Starter | None = None
        # launch reference -> why its process ended (`report_exit`, from any thread)
        self._exits: dict[str, str] = {}
        self._exclusive = threading.RLock()  # see `exclusive`
        self.work_dir = Path(work_dir).resolve()  # file:// rendezvous needs an absolute path
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._pool_socket = PoolSocket(
            ranks=range(config.world_size),
            listen=listen,
            curve=curve,
            rank_hosts=rank_hosts,
            local_client_key=local_client_key,
            max_message_bytes=config.max_message_bytes,
        )
        self._sock = self._pool_socket.sock
        self.control = self._pool_socket.control
        self.curve_public = self._pool_socket.curve_public  # the pool's Z85 key (None: plain)
        # Gloo's file rendezvous: on a file system every rank sees (a shared one when warm
        # ranks run on other machines)
        self.rendezvous_dir = Path(rendezvous_dir or self.work_dir).resolve()
        self.rendezvous_dir.mkdir(parents=True, exist_ok=True)
        self.rendezvous = self._new_rendezvous()
        self.launch_token = ident.new_launch_token()
        self.identity = ident.capture(os.getpid(), launch_token=self.launch_token)
        self._seq = 0
        self.dropped: Counter[str] = Counter()  # frames not taken, by reason
        self._throttle = LogThrottle()
        self._workers = {
            r: _Worker(rank=r, role="core" if r < config.core_dp else "hybrid")
            for r in range(config.world_size)
        }
        self._broken: PoolFailure | None = None
        # an operation whose wait the caller's checkpoint ended (a stop during a long restore,
        # publish or save): its workers are still at it, in a state nobody awaits — the pool is
        # unusable, and its shutdown ends them without waiting for them (`_await`)
        self._abandoned: str | None = None
        # the stall of this process credited to the step in flight so far (`OwnDeadline`):
        # `on_computed`'s caller judges its own deadline by the same clock (`run.step`)
        self.step_stalled_s = 0.0
        self._closed = False
        self._next_liveness = 0.0
        self.reforms: list[Reform] = []  # every re-formed world, in order
        self.world_members: tuple[int, ...] = tuple(range(config.world_size))
        # the process groups of the current world, in the order they were formed
        self.formed: list[tuple[int, ...]] = [config.core_ranks]
        self._lost: set[str] = set()  # replicas whose dead worker was replaced

    def _new_rendezvous(self) -> str:
        return f"file://{self.rendezvous_dir / f'gloo-{uuid.uuid4().hex[:12]}'}"

    def report_exit(self, ref: str, why: str) -> None:
        """The process of remote launch `ref` is gone (or never started), in words: its agent
        said so. Thread-safe without the pool's lock (one dict store); the next liveness check
        of that rank judges it dead. A report of an older launch of a rank changes nothing."""
        self._exits[ref] = why
        self._next_liveness = 0.0

    def _replica_of(self, rank: int) -> str | None:
        if rank in self.config.core_ranks:
            return self.config.core_replica(rank)
        return self._workers[rank].replica

    def _command(self, rank: int, op: str, args: dict[str, Any]) -> str:
        self._seq += 1
        msg_id = uuid.uuid4().hex
        frame = Frame(
            kind=Kind.COMMAND,
            id=msg_id,
            seq=self._seq,
            epoch=1,
            sender=POOL_SENDER,
            payload={"op": op, "args": args, "target_epoch": 1},
        )
        data = encode(frame, max_bytes=self.config.max_message_bytes)
        try:
            w = self._workers[rank]
            self._sock.send_multipart([routing_id(f"trainer-{rank}", w.route), data])
        except zmq.ZMQError as exc:  # ROUTER_MANDATORY: the worker is not connected (any more)
            w = self._workers[rank]
            if w.dead is None:
                # its process is gone, most likely (the connection goes with it): say how
                # (a Hybrid kill -9'd was "not reachable ... (Host unreachable)", its exit
                # code only in no message)
                unreachable = f"not reachable on the control channel ({exc})"
                gone = self._gone(rank, w, wait_s=1.0)
                w.dead = unreachable if gone is None else f"{gone} ({unreachable})"
                w.active = False
                log.error("worker_dead", rank=rank, replica=self._replica_of(rank), detail=w.dead)
        self._next_liveness = 0.0  # the next wait checks liveness at once
        return msg_id

    def _recv(self, *, timeout_ms: int) -> tuple[int, Frame] | None:
        if not self._sock.poll(timeout_ms):
            return None
        parts = self._sock.recv_multipart(copy=False)
        name, route = split_routing_id(parts[0].bytes)
        if len(parts) != 2 or not name:
            peer = parts[0].bytes.decode(errors="replace")[:64]
            self._dropped("bad_envelope", peer=peer, parts=len(parts))
            return None
        if (problem := self._pool_socket.key_problem(name, parts[1])) is not None:
            self._dropped("key_not_bound", peer=name, detail=problem)
            return None
        data = parts[1].bytes
        frame = decode(data, max_bytes=self.config.max_message_bytes, peer=name)
        if isinstance(frame, Dropped):
            fields = frame.log_fields()
            self._dropped(str(fields.pop("reason")), **fields)
            return None
        if frame.sender != name or not name.startswith("trainer-"):
            self._dropped("sender_mismatch", peer=name, sender=frame.sender)
            return None
        try:
            rank = int(name.removeprefix("trainer-"))
        except ValueError:
            return None
        if rank not in self._workers or name != f"trainer-{rank}":
            # one name per rank: `trainer-01` or `trainer-+1` is not rank 1's route
            self._dropped("unknown_rank", peer=name[:64])
            return None
        if not same_route(route, self._workers[rank].route):
            # the name without its launch's secret: not the process the pool launched (the
            # ROUTER would give it the rank's route; see `pool_launch.routing_id`)
            self._dropped("unknown_route", peer=name[:64])
            return None
        if frame.kind is Kind.HELLO and self._workers[rank].standby:
            self._on_hello(rank, frame)  # a replacement is ready to be admitted
            return None
        return rank, frame

    def _dropped(self, reason: str, **fields: Any) -> None:
        """A frame the channel does not take: counted, and logged at a bounded rate (any local
        process can send them; `ehp_fsm.throttle`)."""
        self.dropped[reason] += 1
        if (extra := self._throttle.let(reason)) is not None:
            log.warning("frame_dropped", **{"reason": reason, **fields, **extra})

    def _on_hello(self, rank: int, frame: Frame) -> bool:
        """Take rank `rank`'s hello; False (logged, nothing changed) when it is malformed (a
        field missing or of the wrong type) or comes from another process than the pool's:
        another launch token, or another pid than the handle's."""
        inv = frame.payload["inventory"]
        w = self._workers[rank]
        why, identity = hello_problem(inv)
        if identity is None:
            log.warning("hello_dropped", rank=rank, pid=None, reason=f"malformed: {why}")
            return False
        if identity.launch_token != self.launch_token:
            why = "its launch token is not this pool's"
        elif w.process is not None and identity.pid != w.process.pid:
            why = f"the pool launched rank {rank} as pid {w.process.pid}"
        if why is not None:
            log.warning("hello_dropped", rank=rank, pid=identity.pid, reason=why)
            return False
        w.identity = identity
        w.version = int(inv["version"])
        w.shapes = tuple(tuple(int(x) for x in s) for s in inv["grad_shapes"])
        w.intra_op_threads = int((inv.get("threads") or {}).get("intra_op", 0))
        log.info(
            "worker_ready",
            rank=rank,
            role=w.role,
            pid=w.identity.pid,
            threads=inv.get("threads"),
            standby=w.standby,
        )
        return True

    def _on_standby(self, op: str, rank: int, replica: str | None) -> PoolFailure:
        """The failure for an operation on warm rank `rank` whose worker is a replacement not yet
        in the Gloo world (it can take part in no transfer until `admit_replacements`)."""
        w = self._workers[rank]
        said = "has said hello" if w.identity is not None else "has not said hello yet"
        detail = (
            f"warm rank {rank}'s worker died ({w.replaced}) and its replacement is on standby, "
            f"not yet admitted into the Gloo world (it {said}); call "
            f"admit_replacements(wait_s=...) and pick from idle_warm_ranks()"
        )
        log.error("pool_failure", op=op, reason="dead", rank=rank, detail=detail)
        return PoolFailure(op=op, reason="dead", rank=rank, replica=replica, detail=detail)

    def worker_argv(
        self, rank: int, *, python: str = sys.executable, standby: bool = False
    ) -> list[str]:
        """The command line of pool rank `rank` (what a host agent launches)."""
        return worker_argv(
            self.config,
            rank=rank,
            control=self.control,
            rendezvous=self.rendezvous,
            parent=self.identity,
            python=python,
            standby=standby,
        )

    def route(self, rank: int) -> str:
        """The secret route of rank `rank`'s current launch (`pool_launch.routing_id`)."""
        return self._workers[rank].route

    def worker_env(self, rank: int) -> dict[str, str]:
        """The environment of rank `rank`'s process when this pool launches it: this one's,
        with the launch's route and, with CURVE, its host's client key (`PoolSocket.launch_env`);
        and the pool's launch token, which its hellos carry (`EHP_POOL_TOKEN`) and the run
        records the worker with (`run.json`): `ehp-fsm stop` signals only a process that
        carries it (`EHP_LAUNCH_TOKEN`, `owned.Owned.refusal`). Neither is on its command line
        (`worker_argv`): every user can read that."""
        env = self._pool_socket.launch_env(rank)
        return {
            **(os.environ if env is None else env),
            ROUTE_ENV: self.route(rank),
            POOL_TOKEN_ENV: self.launch_token,
            "EHP_LAUNCH_TOKEN": self.launch_token,
        }

    def _launch(self, rank: int, *, standby: bool = False) -> None:
        """Start the process of pool rank `rank` (its log appended to `worker-<rank>.log`), or
        for a rank of another machine (Core or warm) ask the launcher (its log is its agent's)."""
        w = self._workers[rank]
        if self.config.home(rank) is not None:
            assert self._launcher is not None  # __init__ refuses remote ranks without one
            w.launch_ref = self._launcher.launch(rank, standby=standby, route=w.route)
            return
        log_path = self.work_dir / f"worker-{rank}.log"
        with open(log_path, "ab") as out:
            w.log_from = os.fstat(out.fileno()).st_size
            if self._prefork:
                argv = self.worker_argv(rank, standby=standby)
                assert argv[1:3] == ["-m", "ehp_fsm.training.worker"], argv
                w.process = self._starter_of(rank).start(
                    argv[3:], self.worker_env(rank), log_path, name=f"trainer-{rank}"
                )
                return
            w.process = subprocess.Popen(
                self.worker_argv(rank, standby=standby),
                env=self.worker_env(rank),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C goes to the coordinator, which stops us
            )

    def _starter_of(self, rank: int) -> Starter:
        """The process local ranks are forked from (`prefork`), started on first use, and again
        if it died. Its environment, every child's as `/proc` shows it (where `ehp-fsm stop`
        looks for the launch token), is the first rank's less that rank's own route."""
        if self._starter is not None and not self._starter.alive():
            log.warning("prefork_restarted", pid=self._starter.process.pid)
            self._starter.close()
            self._starter = None
        if self._starter is None:
            env = {k: v for k, v in self.worker_env(rank).items() if k != ROUTE_ENV}
            # (a worker may take as long to be started as to join: `join_timeout_s`)
            self._starter = Starter(
                env, self.work_dir / "prefork.log", answer_s=self.config.join_timeout_s
            )
        return self._starter

    def _close_starter(self) -> None:
        """End the starter once its children are reaped (a child dies with it)."""
        if self._starter is not None:
            self._starter.close()
            self._starter = None

    def _respawn(self, rank: int) -> None:
        """A replacement for dead warm worker `rank` (only when this pool launched it): a fresh
        process on standby, admitted into the world by `admit_replacements`. A process judged
        dead that still runs (e.g. not reachable yet) is killed and reaped first: the pool never
        drops the handle of a live process."""
        w = self._workers[rank]
        remote = self.config.home(rank) is not None
        if w.role != "hybrid" or w.dead is None or self._closed:
            return
        if not self.config.respawn_warm or (w.process is None and not remote):
            return
        if w.process is not None and w.process.poll() is None:
            log.warning("worker_killed", rank=rank, pid=w.process.pid, detail=w.dead)
            w.process.kill()
            w.process.wait(10)
        elif remote and w.launch_ref is not None and w.launch_ref not in self._exits:
            assert self._launcher is not None
            log.warning("worker_stopped", rank=rank, ref=w.launch_ref, detail=w.dead)
            self._launcher.stop(w.launch_ref)  # judged dead, perhaps still running: ended
        if w.replica is not None:
            self._lost.add(w.replica)  # its deactivate() is then a no-op
        self._workers[rank] = _Worker(rank=rank, role="hybrid", standby=True, replaced=w.dead)
        dead_pid = w.process.pid if w.process is not None else w.identity and w.identity.pid
        try:
            self._launch(rank, standby=True)
        except OSError as exc:  # its log cannot be opened (the pool's folder removed, ...)
            why = f"its replacement did not start: {exc}"
            self._workers[rank].dead = why  # not waited for; not replaced again
            log.error("worker_respawn_failed", rank=rank, dead_pid=dead_pid, detail=why)
            return
        log.warning("worker_respawned", rank=rank, dead_pid=dead_pid, home=self.config.home(rank))

    def _stop_hung_warm(self, ranks: Any, why: str) -> None:
        """Warm workers that did not answer in time (a hung or stopped process: SIGSTOP, a
        deadlock) are judged dead and stopped now, as if they had died (replaced as a dead warm
        worker is): kept, a hung worker stays bound and in the world, and every later command
        to it (its park, its GPU's finalizer) waits out its own time-out (120 s each, on the
        run's loop: a run whose Hybrid was stopped with SIGSTOP hung, and its GPU was confirmed
        free by its host's agent while the worker still held its lane). Core ranks are left as
        they are (the caller stops the run)."""
        for r in sorted(ranks):
            w = self._workers[r]
            if w.role != "hybrid" or w.dead is not None:
                continue
            w.dead = why
            w.active = False
            log.error("worker_dead", rank=r, replica=self._replica_of(r), detail=why)
            if w.process is not None and w.process.poll() is None:
                log.warning("worker_killed", rank=r, pid=w.process.pid, detail=why)
                w.process.kill()
                w.process.wait(10)
            elif w.launch_ref is not None and self._launcher is not None:
                self._launcher.stop(w.launch_ref)  # on another machine: its agent ends it

    def busy(self) -> bool:
        """Whether another thread is using the pool now (a step in flight): never waits."""
        if not self._exclusive.acquire(blocking=False):
            return True
        self._exclusive.release()
        return False

    @exclusive
    def admit_replacements(self, *, wait_s: float = 0.0) -> PoolFailure | None:
        """Replace every dead warm worker not replaced yet, then admit every replacement that
        has said hello (waiting up to `wait_s` for all of them) with one re-form of the world.
        None when there was nothing to do or it worked; a broken-pool failure otherwise."""
        for w in list(self._workers.values()):
            if w.dead is not None and w.role == "hybrid":
                self._respawn(w.rank)  # died outside a collective (a collective's re-form did)
        end = time.monotonic() + wait_s
        while True:
            waiting = [w for w in self._workers.values() if w.standby and w.dead is None]
            if all(w.identity is not None for w in waiting):
                break
            left_ms = int((end - time.monotonic()) * 1000)
            if left_ms <= 0 and not self._sock.poll(0):
                break  # the time is up and nothing more has arrived (a hello already here counts)
            self._recv(timeout_ms=min(20, max(0, left_ms)))
            self._dead_among([w.rank for w in waiting], force=True)
        if not any(w.standby and w.identity is not None for w in self._workers.values()):
            return None
        return self._reform(op="admit", dead=())

    def _dead_among(self, ranks: Any, *, force: bool = False) -> tuple[int, str] | None:
        now = time.monotonic()
        if not force and now < self._next_liveness:
            return None
        self._next_liveness = now + 0.1
        for r in sorted(ranks):
            w = self._workers[r]
            if w.dead is not None:
                return r, w.dead
            gone = self._gone(r, w)
            if gone is not None:
                w.dead = gone
                w.active = False
                log.error("worker_dead", rank=r, replica=self._replica_of(r), detail=gone)
                return r, gone
        return None

    def _gone(self, r: int, w: _Worker, *, wait_s: float = 0.0) -> str | None:
        """How worker `r`'s process ended (its exit code, or its agent's report), or None
        while it runs; `wait_s`: how long its own child may take to be reaped."""
        if w.launch_ref is not None and w.launch_ref in self._exits:
            return f"its agent on {self.config.home(r)}: {self._exits[w.launch_ref]}"
        if w.process is not None:
            try:
                code = w.process.wait(wait_s) if wait_s > 0 else w.process.poll()
            except subprocess.TimeoutExpired:
                code = None
            if code is None:
                return None
            gone = f"process {w.process.pid} " + exit_words(code)
            if isinstance(w.process, StartedWorker) and (end := w.process.starter_end()):
                gone += (
                    f": its worker starter, {end} (the pool's local workers die with it; "
                    f"its log: {self.work_dir / 'prefork.log'})"
                )
            if (code > 0 and code != FOLLOWER_LOST_EXIT) or -code in _CRASHES:
                # it ended by itself: what it said last (a Gloo listener out of descriptors
                # aborted the Core rank, said only in its log: "accept: Too many open files")
                said = last_error_line(self.work_dir / f"worker-{r}.log", since=w.log_from)
                gone += f" (its log: {said!r})" if said else ""
            if code == FOLLOWER_LOST_EXIT and self.config.lane_size > 1:
                # (it named lane rank 0's own exit, the follower whose death caused it —
                # kill -9'd, say — only in the worker's log)
                gone += (
                    ": another rank of its lane exited first, named in "
                    f"{self.work_dir / f'worker-{r}.log'}"
                )
            return gone
        if (
            w.identity is not None
            and w.identity.host == ident.this_host()
            and not ident.is_alive(w.identity)
        ):
            return f"process {w.identity.pid} on {w.identity.host} is gone"
        return None

    def stopped_ranks(self) -> list[tuple[int, int]]:
        """(rank, pid) of every worker whose process this machine sees stopped (SIGSTOP,
        Ctrl-Z): what a step taking long may wait for. Not `exclusive` — asked by the run's
        loop while the step's thread holds the pool — so it reads a copy of the worker table,
        their identities (fixed per process) and `/proc` only."""
        out = []
        for r, w in sorted(list(self._workers.items())):
            if w.identity is not None and ident.process_state(w.identity) == "stopped":
                out.append((r, w.identity.pid))
        return out

    def _stopped(self, rank: int) -> bool:
        """Whether rank `rank`'s process is stopped (SIGSTOP, Ctrl-Z), as this machine sees it."""
        w = self._workers[rank]
        return w.identity is not None and ident.process_state(w.identity) == "stopped"

    def _unanswered(self, ranks: Any, timeout_s: float) -> str:
        """ "no reply in N s", and for each rank what its process is doing as far as this
        machine sees it: a stopped one (SIGSTOP, Ctrl-Z) is said so, with how to resume it."""
        said = []
        for r in sorted(ranks):
            w = self._workers[r]
            state = None if w.identity is None else ident.process_state(w.identity)
            if w.identity is None or state is None:
                where = self.config.home(r) or "this machine"
                said.append(f"rank {r}'s process (on {where}) cannot be seen from here")
            elif state == "stopped":
                pid = w.identity.pid
                said.append(
                    f"rank {r}'s process {pid} is stopped (SIGSTOP or Ctrl-Z; `kill -CONT "
                    f"{pid}` resumes it)"
                )
            else:
                said.append(
                    f"rank {r}'s process {w.identity.pid} is alive ({state}) but did not "
                    "answer: hung, or its work takes longer than the deadline"
                )
        return f"no reply from ranks {sorted(ranks)} in {timeout_s:g} s: " + "; ".join(said)

    def _await(
        self,
        refs: Mapping[int, str],
        *,
        op: str,
        timeout_s: float | None = None,
        collective: bool = False,
        collector: DeliveryCollector | None = None,
        current_step: int | None = None,
        late: list[int] | None = None,
        deadline: OwnDeadline | None = None,
        checkpoint: Callable[[], None] | None = None,
    ) -> dict[int, dict[str, Any]] | PoolFailure:
        """Replies to `refs` (rank → message id) by the deadline (`deadline`, else
        `timeout_s` from now; this process's own stalls not counted). A failure inside a
        collective (`collective=True`) leaves the other ranks possibly stuck: the pool is then
        marked broken. `late`: given, the ranks still awaited at the deadline are added to it.
        `checkpoint`: called at least every 50 ms while the replies are awaited; what it raises
        ends the wait and is raised as it is, and the pool is then abandoned (`_abandoned`)."""
        timeout = self.config.command_timeout_s if timeout_s is None else timeout_s
        if deadline is None:
            deadline = OwnDeadline(timeout)
        want = {ref: rank for rank, ref in refs.items()}
        out: dict[int, dict[str, Any]] = {}

        def fail(reason: Any, rank: int | None, detail: str) -> PoolFailure:
            f = PoolFailure(
                op=op,
                reason=reason,
                rank=rank,
                replica=None if rank is None else self._replica_of(rank),
                detail=detail,
                broken_world=collective,
            )
            if collective:
                self._broken = f
            log.error("pool_failure", op=op, reason=reason, rank=rank, detail=detail)
            return f

        while want:
            if checkpoint is not None:
                try:
                    checkpoint()
                except BaseException:
                    self._abandoned = op
                    log.warning("pool_abandoned", op=op, ranks=sorted(want.values()))
                    raise
            left = deadline.left()
            if left <= 0:
                r = min(want.values())
                if late is not None:
                    late.extend(sorted(want.values()))
                return fail("deadline", r, self._unanswered(want.values(), timeout))
            got = self._recv(timeout_ms=max(1, min(50, int(left * 1000))))
            dead = self._dead_among(want.values())
            if dead is not None:
                return fail("dead", dead[0], dead[1])
            if got is None:
                continue
            rank, frame = got
            if frame.kind is Kind.EVENT and frame.payload["name"] == "worker_failed":
                self._workers[rank].dead = str(frame.payload["data"].get("error", "failed"))
                if rank in want.values():
                    return fail("worker_error", rank, self._workers[rank].dead or "")
                continue
            if frame.kind is not Kind.REPLY:
                continue
            ref = frame.ref
            if want.get(ref, -1) != rank:  # not awaited, or awaited from another rank
                self._stray(rank, frame, collector=collector, current_step=current_step)
                continue
            del want[ref]
            result = frame.payload["result"]
            if not frame.payload["ok"]:
                detail = result.get("error", "") if isinstance(result, dict) else str(result)
                if isinstance(result, dict) and result.get("local") is True:
                    # The worker failed alone after its collectives: no peer is stuck.
                    log.error(
                        "pool_failure", op=op, reason="worker_error", rank=rank, detail=detail
                    )
                    return PoolFailure(
                        op=op,
                        reason="worker_error",
                        rank=rank,
                        replica=self._replica_of(rank),
                        detail=str(detail),
                    )
                return fail("worker_error", rank, str(detail))
            if not isinstance(result, dict):
                return fail("worker_error", rank, f"reply result is {type(result).__name__}")
            out[rank] = {**result, "ref": ref}
        return out

    def _stray(
        self,
        rank: int,
        frame: Frame,
        *,
        collector: DeliveryCollector | None,
        current_step: int | None,
    ) -> None:
        """A reply to a command we stopped waiting for (e.g. after a deadline). A gradient
        delivery of another step goes to the ledger, which rejects it (logged); anything else is
        logged and dropped."""
        result = frame.payload["result"]
        record = result.get("record") if isinstance(result, dict) else None
        if collector is not None and isinstance(record, dict):
            if (problem := delivery_wire_problem(record)) is not None:
                log.warning("stray_reply", rank=rank, ref=frame.ref, detail=problem)
                return
            d = delivery_from_wire(record)
            if d.step != current_step:
                collector.offer(GradientDelivery(record=d, grads=()), now=time.monotonic())
                return
        log.warning("stray_reply", rank=rank, ref=frame.ref)

    def _settle(self, refs: Mapping[int, str], *, timeout_s: float) -> dict[int, Outcome]:
        """Every awaited rank's outcome, whatever the others did: `ok` (its result), `error`
        (its error reply), `dead` (its process is gone) or `deadline` (no answer in time) —
        except once a Core rank is dead: nothing can be re-formed then, so the ranks still
        awaited are `deadline` at once (a survivor stuck in a rendezvous with the dead rank
        would hold the run for the whole time-out)."""
        deadline = OwnDeadline(timeout_s)  # (this process's own stalls not counted)
        want = {ref: rank for rank, ref in refs.items()}
        out: dict[int, Outcome] = {}
        next_look = 0.0
        while want:
            left = deadline.left()
            now = time.monotonic()
            if left <= 0:
                for rank in want.values():
                    out[rank] = ("deadline", {"error": self._unanswered([rank], timeout_s)})
                break
            if now >= next_look:
                next_look = now + 0.05
                for ref, rank in list(want.items()):
                    gone = self._dead_among([rank], force=True)
                    if gone is not None:
                        out[rank] = ("dead", {"error": gone[1]})
                        del want[ref]
                core_dead = [r for r in out if out[r][0] == "dead" and r in self.config.core_ranks]
                if core_dead:  # no re-form can follow: waiting for the others is pointless
                    why = f"not awaited: Core rank {core_dead[0]} died (the world is broken)"
                    for rank in want.values():
                        out[rank] = ("deadline", {"error": why})
                    break
                if not want:
                    break
            got = self._recv(timeout_ms=max(1, min(20, int(left * 1000))))
            if got is None:
                continue
            rank, frame = got
            if frame.kind is Kind.EVENT and frame.payload["name"] == "worker_failed":
                self._workers[rank].dead = str(frame.payload["data"].get("error", "failed"))
                continue
            if frame.kind is not Kind.REPLY:
                continue
            if frame.ref not in want:
                self._stray(rank, frame, collector=None, current_step=None)
                continue
            del want[frame.ref]
            result = frame.payload["result"]
            result = result if isinstance(result, dict) else {"error": str(result)}
            out[rank] = ("ok" if frame.payload["ok"] else "error", result)
        return out

    def _reform(self, *, op: str, dead: tuple[int, ...]) -> PoolFailure | None:
        """A fresh Gloo world of every live worker (see the module docstring). None when every
        survivor joined it (each dead warm worker is then replaced); else the pool is broken and
        the failure says why."""
        t0 = time.monotonic()
        gone = set(dead)
        for attempt in (1, 2):
            candidates = [
                r
                for r, w in sorted(self._workers.items())
                if w.dead is None and (not w.standby or w.identity is not None)
            ]
            for r in candidates:  # an idle warm worker may have died unnoticed
                self._dead_among([r], force=True)
            members = tuple(r for r in candidates if self._workers[r].dead is None)
            gone |= set(candidates) - set(members)
            lost_core = [r for r in self.config.core_ranks if r not in members]
            if lost_core:
                return self._break(op, lost_core[0], f"Core rank {lost_core[0]} is gone")
            if not self.rendezvous_dir.is_dir():  # (its file store retried for 70 s)
                return self._break(
                    op,
                    None,
                    f"the pool's rendezvous folder {self.rendezvous_dir} is gone (removed while "
                    "the pool ran?): a re-formed world meets in a file there",
                )
            rendezvous = self._new_rendezvous()
            args = {"rendezvous": rendezvous, "members": list(members)}
            refs = {r: self._command(r, "reform", args) for r in members}
            got = self._settle(refs, timeout_s=self.config.collective_timeout_s + 10.0)
            bad = {r: o for r, o in got.items() if o[0] != "ok"}
            if not bad:
                break
            for r in bad:
                self._dead_among([r], force=True)
            died = sorted(r for r in members if self._workers[r].dead is not None)
            if attempt == 1 and died and not set(died) & set(self.config.core_ranks):
                # The survivors waited for members that died during the re-form: once more
                # without them (their rendezvous failed only for want of the dead).
                log.warning("world_reform_retried", op=op, died=died, members=list(members))
                gone |= set(died)
                continue
            r = min(bad)
            return self._break(op, r, f"re-forming the world failed: {bad[r][0]}: {bad[r][1]}")
        self.rendezvous = rendezvous
        self._broken = None
        self.world_members = members
        self.formed = [self.config.core_ranks]
        for r in members:
            self._workers[r].standby = False
        for r in sorted(gone):
            self._respawn(r)
        reform = Reform(
            op=op,
            dead=tuple(sorted(gone)),
            members=members,
            rendezvous=rendezvous,
            seconds=time.monotonic() - t0,
        )
        self.reforms.append(reform)
        log.warning(
            "world_reformed",
            op=op,
            dead=list(reform.dead),
            members=list(members),
            seconds=reform.seconds,
        )
        return None

    def _break(self, op: str, rank: int | None, detail: str) -> PoolFailure:
        self._broken = PoolFailure(
            op=op,
            reason="broken",
            rank=rank,
            replica=None if rank is None else self._replica_of(rank),
            detail=detail,
            broken_world=True,
        )
        log.error("pool_failure", op=op, reason="broken", rank=rank, detail=detail)
        return self._broken

    def _collective(
        self, refs: Mapping[int, str], *, op: str, timeout_s: float
    ) -> tuple[dict[int, Outcome], PoolFailure | None]:
        """Await a collective's replies. When it failed because warm workers died (and only
        then), re-form the world without them and return a failure that is *not* broken_world
        (the survivors are usable); any other failure leaves the pool broken."""
        got = self._settle(refs, timeout_s=timeout_s)
        if all(kind == "ok" for kind, _ in got.values()):
            return got, None
        warm = self.config.warm_ranks
        hung = [r for r, (kind, _) in got.items() if kind == "deadline" and r in warm]
        stopped_core = [
            r
            for r, (kind, _) in got.items()
            if kind == "deadline" and r in self.config.core_ranks and self._stopped(r)
        ]
        if hung and stopped_core:
            # a Core rank stopped (SIGSTOP, Ctrl-Z) holds the warm ones in the collective, not
            # the reverse: the warm worker was killed as hung, then the stopped rank waited for
            # again and the world re-formed around it (310 s of a run's loop, a signal unheard)
            r = stopped_core[0]
            return got, self._break(op, r, f"{op} failed inside a collective: {got[r][1]}")
        if hung and not any(kind == "dead" for kind, _ in got.values()):
            # Warm workers hung inside the collective (stopped, deadlocked) hold the others in
            # it: they are stopped as dead, and the others, freed by their peers' exit, answer.
            why = f"no reply to {op} in {timeout_s} s (hung inside the collective; stopped)"
            self._stop_hung_warm(hung, why)
            again = {r: refs[r] for r, (k, _) in got.items() if k == "deadline" and r not in hung}
            for r in hung:
                got[r] = ("dead", {"error": why})
            got.update(self._settle(again, timeout_s=timeout_s))
        dead = tuple(sorted(r for r, (kind, _) in got.items() if kind == "dead"))
        core_dead = [r for r in dead if r in self.config.core_ranks]
        if core_dead and hung:
            # warm workers still in the collective wait for the dead Core rank (a group's
            # formation: up to `FORM_TIMEOUT_S`) and would hold their park, and the run's stop,
            # that long; the world cannot go on without that rank, so they are stopped now
            self._stop_hung_warm(
                hung, f"stopped: Core rank {core_dead[0]} died inside the {op} collective"
            )
        if not dead or core_dead:
            r = core_dead[0] if core_dead else min(r for r, o in got.items() if o[0] != "ok")
            kind, res = got[r]
            return got, self._break(
                op, r, f"{op} failed inside a collective: {kind}: {_reply_words(res)}"
            )
        first = dead[0]
        replica = self._replica_of(first)
        broken = self._reform(op=op, dead=dead)  # replaces the dead warm workers
        if broken is not None:
            return got, broken
        detail = str(got[first][1].get("error", "gone"))
        log.error("pool_failure", op=op, reason="dead", rank=first, detail=detail)
        return got, PoolFailure(
            op=op,
            reason="dead",
            rank=first,
            replica=replica,
            detail=f"{detail} (inside the {op} collective; the world was re-formed without it)",
        )


def _reply_words(res: Any) -> str:
    """A rank's failed reply as its error says it, with whether its optimizer stepped (a
    commit's reply says it, and the version it is at)."""
    if not isinstance(res, dict):
        return str(res)
    said = str(res.get("error", res))
    if isinstance(res.get("stepped"), bool):
        did = "had stepped" if res["stepped"] else "did not step"
        said += f" (its optimizer {did}: version {res.get('version')})"
    return said
