"""The host agent: one per host, it launches, watches and stops the processes the controller asks
for, and reports what happens.

    ehp-fsm agent --controller tcp://127.0.0.1:5555 --host-id h1 [--slots 2] [--keys DIR]

Knows: this host's inventory (CPU "device" slots `ID:g0..` in local mode, CUDA devices where
`torch.cuda` sees them), the processes it launched or adopted (each with its identity: host, pid,
process start time, launch token — kept in `STATE_DIR/processes.json`, so a restarted agent
adopts the processes that survived it, and drops entries whose pid now names another process),
pidfds for immediate exit events, and the agent's side of the protocol:

  command `launch` {machine, instance, role, gpus, token}
      → reply ok at once; then event `healthy` (engines, once their HTTP endpoint answers) or
        `launched` (Hybrids and other roles, once the process runs), or `launch_failed`.
        A token already launched is answered ok again and not launched twice. A token or
        instance that is not a plain name (they name the process's files here) is refused
        (ok=False, reason `bad_args`).
      With role `pool_worker` and a `trainer` field {rank, control, rendezvous, pool_token,
        config, standby, curve_server_key}: one rank of the run's trainer pool, its argv built
        here from the pool's own command line with this agent as its parent
        (`runtime.pool_launch`); a field that does not hold is refused (ok=False, reason
        `bad_trainer`, its name in `detail`).
  command `stop_process` {identity} → SIGTERM (SIGKILL after a grace period) to exactly that
        process; refused (`ok=False`, reason `not_same_process`) when the pid no longer names
        the identified process — a recycled pid is never signalled. Its exit is an `exited` event.
  command `cancel_launch` {token} → stop that launch's process, whenever it appears.
  command `confirm_gpu_free` {gpu, owner} → reply ok at once; event `gpu_free` {gpu, owner,
        processes_exited, memory_free} once every process this agent launched on that GPU has
        exited (and, on CUDA hosts with `nvidia-smi`, no compute process remains on the device;
        while `nvidia-smi` cannot tell, no `gpu_free`).
  event `exited` {machine, instance, identity, returncode, stopped} for every watched exit.
  hello {inventory} + reconcile {processes} at start and whenever the controller restarted or
        came back from silence.

Split: this module is the agent loop, its side of the protocol (hello, reconcile, command
dispatch, events), the inventory and the command line; the agent owns a `ProcessTable`
(`agent_processes`), which launches, watches and signals the processes, runs the GPU finalizer and
keeps the state file; the agent calls it for each command and each turn of its loop.

Does not know: the engine world, which processes *should* run (the controller decides and
reconciles), or what the processes do. Clean shutdown (SIGTERM/SIGINT/SIGHUP, its owner's
death): stop its own processes — SIGTERM, SIGKILL after `agent_processes.SHUTDOWN_GRACE_S` — and
exit 0 within `SHUTDOWN_BOUND_S` or so, well inside the grace whoever stopped it gives it; the
controller is not waited for (it may be gone).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import ipaddress
import json
import os
import shutil
import signal
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import structlog
import zmq

from ehp_fsm import stacks
from ehp_fsm.addresses import endpoint_problem
from ehp_fsm.engine_command import BACKENDS, EngineLaunchConfig
from ehp_fsm.errors import EhpError, printable
from ehp_fsm.fspaths import LogStream
from ehp_fsm.plan import Plan, host_id_problem, load_plan
from ehp_fsm.runtime.agent_processes import Managed, ProcessTable
from ehp_fsm.runtime.deliveries import (
    FdReady,
    GaveUp,
    LinkChanged,
    PeerJoined,
    PeerRestarted,
    PeerReturned,
    PeerSilent,
    Received,
    Stalled,
)
from ehp_fsm.runtime.endpoint import CONTROLLER_NAME, Clock, TransportConfig
from ehp_fsm.runtime.identity import hide_launch_tokens, this_host, token_hint
from ehp_fsm.runtime.keys import client_key_file, load_client_keys
from ehp_fsm.runtime.protocol import Dropped, Kind, process_entry
from ehp_fsm.runtime.reliability import next_epoch
from ehp_fsm.runtime.transport import AgentEndpoint
from ehp_fsm.runtime.workers import WorkerRegistry
from ehp_fsm.throttle import LogThrottle

log = structlog.get_logger("ehp_fsm.agent")

EVENT_DEADLINE_S: Final = 24 * 3600.0  # events are facts: retried while the agent lives
#: After this long without a word from the controller since it started, the agent says so (once)
UNANSWERED_S: Final = 30.0


class AgentError(EhpError):
    """The agent cannot start: bad inventory, unreadable state directory, bad arguments."""


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """One agent. `slots` CPU device slots unless `device` resolves to `cuda`."""

    controller: str
    host_id: str
    slots: int = 1
    device: str = "cpu"  # "cpu", "cuda" or "auto" (cuda when torch sees devices)
    state_dir: Path | None = None
    keys_dir: Path | None = None
    key_name: str | None = None  # agent key name in keys_dir (default: host_id)
    transport: TransportConfig = field(default_factory=TransportConfig)
    engine_host: str | None = None  # default: `address`, else 127.0.0.1
    #: This agent's own address (e.g. 127.0.0.2 in a one-machine multi-host test, the node's IP
    #: on a cluster): it connects to the controller from it, its engines listen on it, and it
    #: reports it in its inventory. None: the OS picks the source address.
    address: str | None = None
    engine_start_deadline_s: float = 120.0
    stop_grace_s: float = 10.0
    #: The controller's lease on this agent's processes: when nothing has been heard from the
    #: controller for this long, the agent stops everything it launched or adopted (their
    #: controller is gone: nobody would stop them, their GPUs would never be freed) and waits
    #: on, idle, for a controller to come back. None: never (the agent's owner stops it).
    orphan_after_s: float | None = 300.0
    #: how engines are started (backend, revision store, extra arguments, flags)
    engines: EngineLaunchConfig = field(default_factory=EngineLaunchConfig)

    def __post_init__(self) -> None:
        if (problem := host_id_problem(self.host_id)) is not None:
            raise AgentError(
                f"host id {self.host_id[:80]!r} is invalid",
                problem,
                "pass the [[hosts]] id of this node, e.g. `--host-id h1`",
            )
        if self.controller.startswith("tcp://") and (
            (problem := endpoint_problem(self.controller)) is not None
            or self.controller.endswith(":*")
        ):  # ZeroMQ took port 99999 as 34463 (modulo 65536) and waited there in silence
            raise AgentError(
                f"--controller {self.controller[:80]!r} is not an endpoint to connect to",
                problem or "`*` is a port to bind, not one to connect to",
                "pass the run's endpoint, tcp://HOST:PORT with PORT in 1..65535",
            )
        if self.slots < 0:
            raise AgentError(f"--slots {self.slots} is invalid", "it counts devices", "use >= 0")
        if self.device not in ("cpu", "cuda", "auto"):
            raise AgentError(
                f"device {self.device!r} is invalid", "", "use cpu, cuda or auto (default)"
            )
        if self.stop_grace_s <= 0 or self.engine_start_deadline_s <= 0:
            raise AgentError("grace and start deadlines must be positive", "", "")
        if self.orphan_after_s is not None and self.orphan_after_s <= 0:
            raise AgentError(
                f"--orphan-after-s {self.orphan_after_s} is invalid",
                "it is how long the controller may be silent before the agent stops its processes",
                "give a positive number of seconds (0 is not 'never': omit the lease with none)",
            )
        if self.address is not None:
            try:
                ipaddress.ip_address(self.address)
            except ValueError:
                raise AgentError(
                    f"--address {self.address!r} is not an IP address",
                    "the agent connects from it and its engines listen on it",
                    "pass this node's address, e.g. --address 10.0.0.3 (or 127.0.0.2 in a test)",
                ) from None
            if not self.controller.startswith("tcp://"):
                raise AgentError(
                    f"--address needs a tcp:// controller endpoint, not {self.controller!r}",
                    "a source address only exists for TCP connections",
                    "connect with tcp://HOST:PORT, or drop --address",
                )

    @property
    def connect_endpoint(self) -> str:
        """The controller endpoint, from `address` when set (ZeroMQ `tcp://SRC:0;DEST`)."""
        if self.address is None:
            return self.controller
        return f"tcp://{self.address}:0;{self.controller.removeprefix('tcp://')}"

    @property
    def engines_listen_on(self) -> str:
        return self.engine_host or self.address or "127.0.0.1"


def detect_inventory(host_id: str, slots: int, device: str) -> tuple[str, list[str]]:
    """(device kind, GPU ids). `auto` uses CUDA when `nvidia-smi` exists and torch sees devices."""
    if device in ("cuda", "auto") and (device == "cuda" or shutil.which("nvidia-smi")):
        try:
            import torch

            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        except Exception:  # torch missing or broken CUDA: fall back to slots
            count = 0
        if count:
            return "cuda", [f"{host_id}:g{i}" for i in range(count)]
        if device == "cuda":
            raise AgentError(
                "--device cuda but no CUDA device is visible",
                "torch.cuda.is_available() is False or no device is listed",
                "check CUDA_VISIBLE_DEVICES and the driver, or use --device cpu --slots N",
            )
    return "cpu", [f"{host_id}:g{i}" for i in range(slots)]


class Agent:
    """The agent loop. `step()` runs one iteration; `run()` loops until stopped.

    Not thread-safe except `request_stop()` (a signal handler or another thread may call it).
    Engine launches run in helper threads (they wait for the engine's HTTP endpoint); their
    results are handed back through a pipe the endpoint watches.
    """

    def __init__(
        self,
        config: AgentConfig,
        *,
        clock: Clock = time.monotonic,
        workers: WorkerRegistry | None = None,
        epoch: int | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self.config = config
        self.host_id = config.host_id
        device, gpus = detect_inventory(config.host_id, config.slots, config.device)
        state_dir = config.state_dir or Path(tempfile.gettempdir()) / f"ehp-agent-{self.host_id}"
        self.state_dir = Path(state_dir)
        own_state_dir(self.state_dir)
        self._state_lock = lock_state_dir(self.state_dir, self.host_id)
        curve, key_file = None, None
        if config.keys_dir is not None:
            key_name = config.key_name or config.host_id
            curve = load_client_keys(config.keys_dir, key_name)
            key_file = client_key_file(config.keys_dir, key_name).resolve()
        self.endpoint = AgentEndpoint(
            connect=config.connect_endpoint,
            host_id=config.host_id,
            config=config.transport,
            clock=clock,
            # above every epoch of this host's agents before (the wall clock may have been set
            # back: the controller took a smaller epoch for a stale incarnation and dropped
            # every frame of the restarted agent, whose GPUs stayed quarantined)
            epoch=epoch if epoch is not None else next_epoch(self.state_dir / "agent"),
            curve=curve,
            context=context,
        )
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)  # a full pipe wakes the loop already: never block
        self.endpoint.watch_fd(self._wake_r)
        self._stop_requested = False  # a plain flag: see `request_stop`
        self._closed = False
        self._clock = clock
        self._started_at = clock()
        self._told_unanswered = False
        self._commanded = False  # a command came: the controller took this agent's hello
        self._handshakes_failed = 0  # ZMTP/CURVE handshakes with the controller that failed
        self._reconcile_id: str | None = None
        self.log = log.bind(host=self.host_id, epoch=self.endpoint.epoch)
        self._throttle = LogThrottle()  # frames dropped: whoever reaches the socket sends them
        self.processes = ProcessTable(
            host_id=self.host_id,
            device=device,
            gpus=gpus,
            state_dir=self.state_dir,
            workers=workers or WorkerRegistry(),
            fds=self.endpoint,
            emit=self._event,
            wake=self._wake_for_launches,
            clock=clock,
            log=self.log,
            engines_listen_on=config.engines_listen_on,
            engine_start_deadline_s=config.engine_start_deadline_s,
            stop_grace_s=config.stop_grace_s,
            engines=config.engines,
            curve_key_file=key_file,
        )
        self.processes.adopt()
        self.announce()

    @property
    def device(self) -> str:
        """ "cuda" or "cpu": what `--device` resolved to on this host."""
        return self.processes.device

    @property
    def gpus(self) -> list[str]:
        return self.processes.gpus

    @property
    def managed(self) -> dict[str, Managed]:
        """The processes this agent launched or adopted, by launch token."""
        return self.processes.managed

    # -- protocol ----------------------------------------------------------------------------
    def inventory(self) -> dict[str, Any]:
        return {
            "gpus": list(self.gpus),
            "device": self.device,
            "hostname": this_host(),
            "agent_pid": os.getpid(),
            "address": self.config.address,
        }

    def process_entries(self) -> list[dict[str, Any]]:
        """The RECONCILE list: every live managed process and every launch still starting."""
        out = []
        for m in self.processes.managed.values():
            labels: dict[str, Any] = {
                "machine": m.machine,
                "instance": m.instance,
                "role": m.role,
                "gpus": list(m.gpus),
                "phase": "stopping" if m.stop_at is not None else "running",
            }
            if m.url:
                labels["url"] = m.url
            entry = process_entry(m.identity.to_dict(), **labels)
            entry["host"] = self.host_id
            out.append(entry)
        return out

    def _report(self, args: Mapping[str, Any]) -> tuple[bool, dict[str, Any]]:
        return True, {"processes": self._reconcile_entries()}

    def announce(self) -> None:
        """hello + reconcile (at start, and after the controller restarted or came back)."""
        self.endpoint.hello(self.inventory(), deadline_s=EVENT_DEADLINE_S)
        if self._reconcile_id is not None:
            self.endpoint.cancel(self._reconcile_id)
        self._reconcile_id = self.endpoint.reconcile(
            self._reconcile_entries(), deadline_s=EVENT_DEADLINE_S
        )

    def _reconcile_entries(self) -> list[dict[str, Any]]:
        entries = self.process_entries()
        for spec in self.processes.starting():
            entries.append(
                {
                    "host": self.host_id,
                    "pid": 1,  # placeholder: no process yet (labels say so)
                    "start_time": 1.0,
                    "launch_token": spec.token,
                    "labels": {
                        "machine": spec.machine,
                        "instance": spec.instance,
                        "role": spec.role,
                        "gpus": list(spec.gpus),
                        "phase": "starting",
                    },
                }
            )
        return entries

    def _event(self, name: str, data: Mapping[str, Any]) -> None:
        self.endpoint.send_event(name, data, deadline_s=EVENT_DEADLINE_S)
        self.log.info("event_sent", name=name, **{k: v for k, v in data.items() if k != "gpus"})

    # -- the loop ----------------------------------------------------------------------------
    def _wake_for_launches(self) -> None:
        """An engine launch thread finished: wake the loop (it calls `finish_launches`)."""
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"l")

    def request_stop(self) -> None:
        """Ask the loop to stop. Called from the SIGTERM/SIGINT handler, so it takes no lock: a
        handler runs again inside itself when a signal comes while it runs — the parent-death
        SIGTERM comes once per thread of the dying run that held the agent (the "parent" is a
        thread), several within microseconds — and a `threading.Event.set()` here blocked on
        the lock its outer call held: the agent hung until SIGKILL, its engines running (8 of
        10 agents given a burst of SIGTERMs). A flag and a byte on the wake pipe are safe."""
        self._stop_requested = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"s")

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested

    def step(self, timeout_s: float = 0.1) -> None:
        """One iteration: poll the socket, handle what arrived, supervise processes."""
        wait = min(timeout_s, 0.05) if self.processes.busy else timeout_s
        for item in self.endpoint.poll(wait):
            self._dispatch(item)
        self.processes.supervise()
        self._check_lease()
        self._check_answered()

    def _check_answered(self) -> None:
        """Say once (its log: stderr) when the controller has not answered at all since the
        agent started. A second agent started for the same host id is never answered — the
        controller hears one connection per host id — and it only logged reconnections, while
        the run's error named no such agent; nor is an agent whose run is not up, or listens
        elsewhere."""
        if self._told_unanswered or self._commanded:
            return
        waited = self._clock() - self._started_at
        if waited < UNANSWERED_S:
            return
        self._told_unanswered = True
        if CONTROLLER_NAME in self.endpoint.peers():
            # the controller acknowledges every frame, but sends a command (its reconcile)
            # only to an agent whose hello it took: one whose host id the plan lacks (a node
            # name that is not a [[hosts]] id) was refused there, and logged nothing here
            self.log.warning(
                "controller_unanswered",
                waited_s=round(waited, 1),
                controller=self.config.controller,
                why=f"the controller hears this agent but refused its hello: host id "
                f"{self.host_id!r} is not a [[hosts]] id of the run's plan",
                fix="start the agent with a [[hosts]] id of the plan as --host-id (under Slurm "
                "the default is the node's name, $SLURMD_NODENAME: name the plan's hosts after "
                "the nodes)",
            )
            return
        if self._handshakes_failed:
            # an agent without --keys facing a CURVE controller, or with keys of another
            # `ehp-fsm keys` run, only logged `handshake_failed` at info, over and over
            keys = self.config.keys_dir
            self.log.warning(
                "controller_unanswered",
                waited_s=round(waited, 1),
                controller=self.config.controller,
                handshakes_failed=self._handshakes_failed,
                why="every handshake with the controller failed: "
                + (
                    "this agent has no CURVE keys (no --keys) while the run uses "
                    "[transport] curve_keys"
                    if keys is None
                    else f"its key in {keys} is not one the run's [transport] curve_keys "
                    "authorizes, or the run uses no CURVE keys"
                ),
                fix="start the agent with --keys DIR, DIR the plan's [transport] curve_keys "
                "(the folder `ehp-fsm keys DIR --agent HOST` wrote, with agents/HOST.key_secret; "
                "with --plan PLAN and no --keys the agent takes the plan's), or drop --keys when "
                "the plan has no curve_keys",
            )
            return
        self.log.warning(
            "controller_unanswered",
            waited_s=round(waited, 1),
            controller=self.config.controller,
            fix=f"check that the run is up and listens at {self.config.controller}, and that no "
            f"other agent runs as host {self.host_id!r} (the controller hears one agent per host "
            "id: a second one is never answered)",
        )

    def _check_lease(self) -> None:
        """Stop every own process once the controller has been silent past the lease with its
        connection dropped. A controller that is only busy (a training step longer than the
        lease blocks its loop) keeps its connection — its I/O thread answers the ZMTP
        heartbeat — and keeps its engines: stopping them mid-run was the lease's only effect
        there. A controller that died, froze or lost the network drops the connection."""
        lease = self.config.orphan_after_s
        if lease is None or not (self.processes.managed or self.processes.busy):
            return
        record = self.endpoint.peers().get(CONTROLLER_NAME)
        if record is not None and not self.endpoint.connection_dropped:
            return
        # (less the agent's own stalls since: an agent stopped past its lease did not find
        # its controller gone, its controller's heartbeats wait in its socket)
        if record is not None:
            last = record.last_seen + record.deaf_s
        else:
            last = self._started_at + self.endpoint.stalled_s
        silent = self._clock() - last
        if silent <= lease:
            return
        self.log.warning(
            "controller_gone_stopping_processes",
            silent_for_s=round(silent, 1),
            lease_s=lease,
            processes=[token_hint(t) for t in self.processes.managed],
            fix="a controller that comes back reconciles with this agent (it runs nothing now)",
        )
        self.processes.stop_all()

    def run(self) -> int:
        """Loop until `request_stop()`; then stop every own process and return 0."""
        try:
            while not self.stop_requested:
                self.step(0.2)
        finally:
            self.shutdown()
        return 0

    def _dispatch(self, item: Any) -> None:
        match item:
            case Received(frame=f) if f.kind is Kind.COMMAND:
                self._command(item)
            case FdReady(fd=fd):
                if fd == self._wake_r:
                    with contextlib.suppress(BlockingIOError, OSError):
                        os.read(self._wake_r, 4096)
                    self.processes.finish_launches()
                else:
                    self.processes.collect(fd)
            case PeerRestarted() | PeerReturned():
                self.log.info("controller_back", kind=type(item).__name__)
                self.announce()
            case PeerSilent():
                self.log.warning("controller_silent", silent_for_s=item.silent_for_s)
            case Stalled(away_s=away, credited_s=credited):
                self.log.info(
                    "agent_stalled",
                    away_s=round(away, 3),
                    credited_s=round(credited, 3),
                    why="this agent's process did not listen (stopped, paused, swapped out): not "
                    "counted against the controller's heartbeats or its lease",
                )
            case PeerJoined():
                pass
            case LinkChanged(what=what, socket=socket, address=address, value=value, why=why):
                if what == "handshake_failed":
                    self._handshakes_failed += 1
                self.log.info(
                    "controller_link",
                    what=what,
                    socket=socket,
                    address=address,
                    value=value,
                    **({"why": why} if why else {}),
                )
            case GaveUp():
                self.log.warning("message_given_up", msg_id=item.msg_id, kind=str(item.kind))
            case Dropped() as d:
                if (extra := self._throttle.let(f"frame_dropped:{d.reason}")) is not None:
                    self.log.warning("frame_dropped", **d.log_fields(), **extra)
            case _:
                pass

    # -- commands ----------------------------------------------------------------------------
    def _command(self, received: Received) -> None:
        self._commanded = True
        op = received.frame.payload["op"]
        args = received.frame.payload["args"]
        handler: dict[str, Callable[[Mapping[str, Any]], tuple[bool, dict[str, Any]]]] = {
            "launch": self.processes.launch,
            "stop_process": self.processes.stop_process,
            "cancel_launch": self.processes.cancel_launch,
            "confirm_gpu_free": self.processes.confirm_gpu_free,
            "report": self._report,
        }
        fn = handler.get(op)
        if fn is None:
            self.endpoint.reply(received, ok=False, result={"reason": f"unknown op {op!r}"})
            return
        try:
            ok, result = fn(args)
        except (KeyError, TypeError, ValueError, AttributeError, EhpError) as exc:
            ok, result = False, {"reason": "bad_args", "detail": f"{type(exc).__name__}: {exc}"}
        except Exception as exc:  # e.g. a full disk: this command fails, the agent goes on
            self.log.exception("command_failed", op=op)
            ok, result = False, {"reason": "internal", "detail": f"{type(exc).__name__}: {exc}"}
        self.log.info("command", op=op, ok=ok, **{k: v for k, v in result.items() if k != "gpus"})
        self.endpoint.reply(received, ok=ok, result=result)

    # -- shutdown ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every own process (bounded: `ProcessTable.stop_all`), then close the socket
        (linger 0: nothing unsent is waited for)."""
        self.processes.stop_all()
        self.close()

    def close(self) -> None:
        """Close the socket and fds without touching processes (what a crash leaves). Once: a
        second call closed the wake pipe's descriptor numbers again, by then another file's
        (in a test process, another agent's ZeroMQ context: libzmq aborted the process)."""
        if self._closed:
            return
        self._closed = True
        self.processes.close()
        self.endpoint.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._state_lock.close()  # the next agent of this state directory may start


STATE_LOCK: Final = "agent.lock"


def own_state_dir(state_dir: Path) -> None:
    """Make `state_dir` the agent's: created mode 0700, refused when another user owns it, and
    its `logs/` folder (the output of every engine and trainer worker the agent launches) mode
    0700. The logs were 0644 in a 0755 folder: SGLang logs its arguments at start, `--api-key`
    among them, and the engines' key outlives the run (`keys.ensure_api_key` keeps it), so any
    user of the node could read it and load weights into, pause or abort the run's engines.
    The default state directory (`/tmp/ehp-agent-<host>`) is the same path for every user: one
    made by another user would have held those logs for them to read, and their links.
    A state directory already there (an older agent's, made 0755) is narrowed to 0700 too:
    through it any user opened the 0644 `agent.lock` and held its `flock`, and the agent
    refused to start ("in use by another agent"). A sticky folder others write in (`/tmp`
    itself) is refused rather than narrowed: it is every user's."""
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = state_dir.stat()
    owner = st.st_uid
    if owner != os.geteuid():
        raise AgentError(
            f"--state-dir {state_dir} belongs to another user (uid {owner})",
            "they could read the engines' logs there (SGLang logs its --api-key) and replace "
            "the agent's records of its processes",
            "give the agent a --state-dir of your own (the default, "
            f"{Path(tempfile.gettempdir())}/ehp-agent-<host>, is one path for every user of "
            "the machine)",
        )
    if st.st_mode & 0o077:
        if st.st_mode & stat.S_ISVTX and st.st_mode & 0o022:  # others write in it
            raise AgentError(
                f"--state-dir {state_dir} is a folder every user writes in (sticky, as /tmp)",
                "the agent keeps its records, lock and the engines' logs in its state "
                "directory, which must be its user's alone",
                "give the agent a folder of its own (the default is "
                f"{Path(tempfile.gettempdir())}/ehp-agent-<host>)",
            )
        state_dir.chmod(0o700)  # (one an older agent made 0755)
    logs = state_dir / "logs"
    logs.mkdir(mode=0o700, exist_ok=True)
    if logs.is_symlink() or not logs.is_dir():
        raise AgentError(
            f"{logs} is not a folder of the agent's (a symbolic link, or a file)",
            "the output of every engine and trainer worker the agent launches goes there",
            f"remove {logs}, or give the agent another --state-dir",
        )
    logs.chmod(0o700)  # (one an older agent made 0755)


def lock_state_dir(state_dir: Path, host_id: str) -> Any:
    """Hold `state_dir` for this agent (an exclusive lock on a file there, held until `close`)
    or refuse to start. Two agents on one state directory — an srun step started twice on a
    node, or nodes whose --state-dir is one shared folder — read each other's processes.json:
    the second adopted the first's engines, was never answered (one agent per host id), and
    after --orphan-after-s stopped them in the middle of the run; at exit they tore each
    other's processes.json.tmp (a FileExistsError traceback)."""
    path = state_dir / STATE_LOCK
    held = path.open("a+", encoding="utf-8")  # not inherited by the agent's processes
    try:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        held.seek(0)
        holder = held.read(200).strip() or "unknown"
        held.close()
        raise AgentError(
            f"--state-dir {state_dir} is in use by another agent ({printable(holder)})",
            "two agents on one state directory adopt and stop each other's processes (an "
            "srun step started twice, or nodes sharing one --state-dir)",
            "stop that agent first, or give each agent its own --state-dir (under Slurm, one "
            "per node: .../ehp-agent-$SLURM_JOB_ID-$SLURMD_NODENAME)",
        ) from None
    held.seek(0)
    held.truncate()
    held.write(f"host {host_id}, pid {os.getpid()}, on {this_host()}\n")
    held.flush()
    return held


# ---- the command line ------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ehp-fsm agent", description="Run the host agent (one per host)."
    )
    p.add_argument("--controller", required=True, help="controller endpoint, tcp://HOST:PORT")
    p.add_argument(
        "--host-id",
        default=os.environ.get("SLURMD_NODENAME"),
        help="this host's id in the plan ([[hosts]] id); default under Slurm: the node's name "
        "($SLURMD_NODENAME)",
    )
    p.add_argument("--slots", type=int, default=1, help="CPU device slots in local mode")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto")
    p.add_argument(
        "--keys",
        type=Path,
        help="CURVE key directory (`ehp-fsm keys DIR`); default with --plan: the plan's "
        "[transport] curve_keys",
    )
    p.add_argument("--key-name", help="agent key name in --keys (default: the host id)")
    p.add_argument("--state-dir", type=Path, help="where the agent records its processes")
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--max-message-bytes", type=int, default=1 << 20)
    p.add_argument("--stop-grace-s", type=float, default=10.0)
    p.add_argument(
        "--orphan-after-s",
        type=lambda v: None if v == "none" else float(v),
        default=300.0,
        help="stop every launched process when the controller has been silent this long "
        "(default 300; 'none': never)",
    )
    p.add_argument(
        "--address",
        help="this node's own address: the agent connects from it, engines listen on it",
    )
    p.add_argument("--engine-host", help="address engines listen on (default: --address)")
    p.add_argument(
        "--parent-pid",
        type=int,
        help="stop (and stop own processes) when this process, the agent's owner, dies",
    )
    p.add_argument(
        "--standin",
        action="append",
        default=[],
        metavar="ROLE",
        help="launch the idle stand-in process for ROLE (tests only)",
    )
    p.add_argument(
        "--plan",
        default=None,
        help="start engines as the plan's run does (backend, [sglang] args, [run] revisions); "
        "for agents the cluster starts (srun)",
    )
    p.add_argument(
        "--engine-backend",
        choices=BACKENDS,
        default=None,
        help="how engines are started: python -m sglang.launch_server (sglang, CUDA hosts) or "
        "the embedded CPU engine (default)",
    )
    p.add_argument(
        "--revisions",
        default=None,
        help="the run's revision store: an engine starts from its newest revision directory",
    )
    p.add_argument(
        "--engine-base-model",
        default=None,
        help="the model directory an engine starts from while the revision store holds no "
        "revision yet (it installs revision 1 before it serves)",
    )
    p.add_argument(
        "--engine-args",
        default=None,
        help='extra engine arguments as a JSON list, e.g. \'["--mem-fraction-static", "0.8"]\'',
    )
    p.add_argument("--engine-memory-saver", action="store_true", help="--enable-memory-saver")
    p.add_argument(
        "--engine-deterministic", action="store_true", help="--enable-deterministic-inference"
    )
    p.add_argument(
        "--engine-api-key-file",
        default=None,
        help="the file holding the API key every engine request must carry (read at each "
        "launch; the run writes it)",
    )
    p.add_argument(
        "--engine-start-deadline-s",
        type=float,
        default=None,
        help="how long an engine may take to answer after its launch (default 120)",
    )
    return p


PR_SET_PDEATHSIG: Final = 1


def die_with_parent(parent_pid: int) -> bool:
    """Ask the kernel for SIGTERM when the parent dies (Linux `PR_SET_PDEATHSIG`; the agent's
    SIGTERM stops its processes); False when the parent is not `parent_pid` any more (it died
    before the request was in place) — the caller then stops at once."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    except (OSError, AttributeError) as exc:
        log.warning(
            "parent_death_signal_unavailable",
            error=str(exc),
            fix="stop this agent with its owner by other means (not Linux?)",
        )
    return os.getppid() == parent_pid


def configure_logging() -> None:
    """JSON lines on stderr (the agent's own log; the transition log is the controller's),
    launch tokens cut to a hint (`identity.hide_launch_tokens`: they are secrets, and the log
    goes wherever the agent's starter sends it)."""
    structlog.configure(
        processors=[
            hide_launch_tokens,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.JSONRenderer(),
        ],
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


def _engine_launch(args: argparse.Namespace, plan: Plan | None = None) -> EngineLaunchConfig:
    """`--plan` (`plan`: read already), or `--engine-*` and `--revisions` → the engines' launch
    config (refused with its flag)."""
    if plan is None and args.plan is not None:
        plan = load_plan(args.plan)
    if plan is not None:
        if (
            args.engine_backend
            or args.revisions
            or args.engine_base_model
            or args.engine_api_key_file
            or args.engine_args
            or args.engine_start_deadline_s
        ):
            raise AgentError(
                "--plan and --engine-backend/--revisions/--engine-base-model/--engine-args were "
                "both given",
                "the plan says how engines start",
                "give one of them",
            )
        from ehp_fsm.run.engines import agent_engine_launch

        return agent_engine_launch(plan)
    try:
        extra = json.loads(args.engine_args) if args.engine_args else []
        if not isinstance(extra, list):
            raise ValueError("it is not a JSON list")
        return EngineLaunchConfig(
            backend=args.engine_backend or "embedded",
            revisions=args.revisions,
            base_model=args.engine_base_model,
            extra_args=tuple(extra),
            memory_saver=args.engine_memory_saver,
            deterministic=args.engine_deterministic,
            start_deadline_s=args.engine_start_deadline_s,
            api_key_file=args.engine_api_key_file,
        )
    except ValueError as exc:  # json.JSONDecodeError is one
        raise AgentError(
            "the engine launch options are invalid",
            str(exc),
            "pass --engine-args as a JSON list of strings, and --revisions with an SGLang backend",
        ) from None


def agent_main(argv: Sequence[str] | None = None) -> int:
    """`ehp-fsm agent ...`: run until SIGTERM/SIGINT/SIGHUP, then stop own processes and exit
    0."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.host_id:
        parser.error("--host-id is required (outside Slurm, where $SLURMD_NODENAME names it)")
    # its log (`agents/<host>.log` under `ehp-fsm run`) may be on a full disk: a log line that
    # cannot be written is dropped, where it raised and the agent died, its engines with it
    sys.stdout, sys.stderr = LogStream(sys.stdout), LogStream(sys.stderr)
    configure_logging()
    plan = load_plan(args.plan) if args.plan is not None else None
    # the plan's CURVE keys unless --keys says otherwise: an agent given only --plan had none,
    # and every handshake with the run's controller failed
    keys = args.keys
    if keys is None and plan is not None and plan.transport.curve_keys is not None:
        keys = Path(plan.transport.curve_keys)  # (resolved against the plan's folder)
    config = AgentConfig(
        controller=args.controller,
        host_id=args.host_id,
        slots=args.slots,
        device=args.device,
        state_dir=args.state_dir,
        keys_dir=keys,
        key_name=args.key_name,
        transport=TransportConfig(
            heartbeat_interval_s=args.heartbeat_s,
            max_message_bytes=args.max_message_bytes,
            allow_non_loopback=True,  # agents connect; only the controller binds
        ),
        engine_host=args.engine_host,
        address=args.address,
        stop_grace_s=args.stop_grace_s,
        orphan_after_s=args.orphan_after_s,
        engines=_engine_launch(args, plan),
    )
    # `kill -USR1 PID` writes every thread's stack to the agent's log: where a slow agent waits
    stacks.install(sys.stderr.fileno())
    # The stop signals are taken before the agent is made: making it connects to the
    # controller (on ZeroMQ's own thread), so the run could see the agent and stop it while
    # the signals still had their defaults — the agent then died of its SIGTERM (-15, not a
    # clean exit 0; a CI run met it). One that comes first stops the agent once it is made.
    made: list[Agent] = []
    asked: list[int] = []

    def stop(signum: int, _frame: object) -> None:
        if made:
            made[0].request_stop()
        else:
            asked.append(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # (nohup: leave it ignored)
        # an agent started by hand whose terminal closed: its default ended the agent at
        # once, without stopping its engines (they went by the parent-death signal, unreported)
        signal.signal(signal.SIGHUP, stop)
    agent = Agent(config, workers=WorkerRegistry.from_names(args.standin))
    made.append(agent)
    if asked:
        agent.request_stop()
    if args.parent_pid is not None and not die_with_parent(args.parent_pid):
        agent.request_stop()  # the owner is already gone
    log.info(
        "agent_started",
        host=agent.host_id,
        gpus=agent.gpus,
        device=agent.device,
        keys=str(keys) if keys is not None else None,  # (with --plan: its curve_keys)
    )
    return agent.run()


if __name__ == "__main__":
    try:
        sys.exit(agent_main())
    except EhpError as exc:
        print(f"ehp-fsm agent: error: {exc}", file=sys.stderr)
        sys.exit(2)
