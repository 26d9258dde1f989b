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
        A token already launched is answered ok again and not launched twice.
  command `stop_process` {identity} → SIGTERM (SIGKILL after a grace period) to exactly that
        process; refused (`ok=False`, reason `not_same_process`) when the pid no longer names
        the identified process — a recycled pid is never signalled. Its exit is an `exited` event.
  command `cancel_launch` {token} → stop that launch's process, whenever it appears.
  command `confirm_gpu_free` {gpu, owner} → reply ok at once; event `gpu_free` {gpu, owner,
        processes_exited, memory_free} once every process this agent launched on that GPU has
        exited (and, on CUDA hosts with `nvidia-smi`, no compute process remains on the device).
  event `exited` {machine, instance, identity, returncode, stopped} for every watched exit.
  hello {inventory} + reconcile {processes} at start and whenever the controller restarted or
        came back from silence.

Does not know: the engine world, which processes *should* run (the controller decides and
reconciles), or what the processes do. Clean shutdown (SIGTERM/SIGINT): stop its own processes,
exit 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import psutil
import structlog
import zmq

from ehp_fsm.errors import EhpError
from ehp_fsm.runtime.deliveries import (
    FdReady,
    GaveUp,
    PeerJoined,
    PeerRestarted,
    PeerReturned,
    PeerSilent,
    Received,
)
from ehp_fsm.runtime.endpoint import Clock, TransportConfig
from ehp_fsm.runtime.errors import IdentityError
from ehp_fsm.runtime.identity import (
    ProcessIdentity,
    ProcessWatcher,
    is_alive,
    same_process,
    this_host,
)
from ehp_fsm.runtime.keys import load_client_keys
from ehp_fsm.runtime.protocol import Dropped, Kind, process_entry
from ehp_fsm.runtime.transport import AgentEndpoint
from ehp_fsm.runtime.workers import ROLE_ENGINE, LaunchSpec, WorkerError, WorkerRegistry

log = structlog.get_logger("ehp_fsm.agent")

STATE_FILE: Final = "processes.json"
EVENT_DEADLINE_S: Final = 24 * 3600.0  # events are facts: retried while the agent lives


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
    engine_host: str = "127.0.0.1"
    engine_start_deadline_s: float = 120.0
    stop_grace_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.host_id or ":" in self.host_id:
            raise AgentError(
                f"host id {self.host_id!r} is invalid",
                "it is the plan's host id and the prefix of its GPU ids (`h1:g0`)",
                "pass the [[hosts]] id of this node, e.g. `--host-id h1`",
            )
        if self.slots < 0:
            raise AgentError(f"--slots {self.slots} is invalid", "it counts devices", "use >= 0")
        if self.device not in ("cpu", "cuda", "auto"):
            raise AgentError(
                f"device {self.device!r} is invalid", "", "use cpu, cuda or auto (default)"
            )
        if self.stop_grace_s <= 0 or self.engine_start_deadline_s <= 0:
            raise AgentError("grace and start deadlines must be positive", "", "")


def world_identity(ident: ProcessIdentity, host_id: str, url: str | None = None) -> dict[str, Any]:
    """The identity as the engine world records it: plan host id and `token`."""
    out: dict[str, Any] = {
        "host": host_id,
        "pid": ident.pid,
        "start_time": ident.start_time,
        "token": ident.launch_token,
    }
    if url:
        out["url"] = url
    return out


def local_identity(data: Mapping[str, Any]) -> ProcessIdentity:
    """A world identity (or a RECONCILE entry) → an identity checkable on this host."""
    token = data.get("token", data.get("launch_token"))
    return ProcessIdentity(
        host=this_host(),
        pid=int(data["pid"]),
        start_time=float(data["start_time"]),
        launch_token=str(token),
    )


@dataclass
class Managed:
    """One process this agent launched or adopted."""

    identity: ProcessIdentity
    machine: str
    instance: str
    role: str
    gpus: tuple[str, ...]
    url: str | None = None
    popen: subprocess.Popen[bytes] | None = None
    fd: int | None = None
    stop_at: float | None = None  # SIGKILL after this time (a stop is in progress)
    stopped_by_agent: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "pid": self.identity.pid,
            "start_time": self.identity.start_time,
            "token": self.identity.launch_token,
            "machine": self.machine,
            "instance": self.instance,
            "role": self.role,
            "gpus": list(self.gpus),
            "url": self.url,
        }


@dataclass
class _PendingLaunch:
    spec: LaunchSpec
    cancelled: bool = False
    result: Any = None  # EngineHandle or an exception, set by the launch thread
    done: bool = False


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


def _cuda_device_busy(index: str) -> bool:
    """True when `nvidia-smi` lists a compute process on device `index` (False if unknown)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return False
    try:
        out = subprocess.run(
            [exe, "--query-compute-apps=pid", "--format=csv,noheader", "-i", index],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return bool(out.stdout.strip())


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
        self._clock = clock
        self.workers = workers or WorkerRegistry()
        self.device, self.gpus = detect_inventory(config.host_id, config.slots, config.device)
        state_dir = config.state_dir or Path(tempfile.gettempdir()) / f"ehp-agent-{self.host_id}"
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "logs").mkdir(exist_ok=True)
        curve = None
        if config.keys_dir is not None:
            curve = load_client_keys(config.keys_dir, config.key_name or config.host_id)
        self.endpoint = AgentEndpoint(
            connect=config.controller,
            host_id=config.host_id,
            config=config.transport,
            clock=clock,
            epoch=epoch,
            curve=curve,
            context=context,
        )
        self.watcher = ProcessWatcher()
        self.managed: dict[str, Managed] = {}  # token → process
        self.exited_tokens: set[str] = set()
        self._by_fd: dict[int, str] = {}
        self._pending: dict[str, _PendingLaunch] = {}
        self._cancelled: set[str] = set()
        self._confirms: dict[tuple[str, str], float] = {}  # (gpu, owner) → asked at
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self.endpoint.watch_fd(self._wake_r)
        self._lock = threading.Lock()
        self._stop_requested = threading.Event()
        self._reconcile_id: str | None = None
        self.log = log.bind(host=self.host_id, epoch=self.endpoint.epoch)
        self._adopt()
        self.announce()

    # -- state file --------------------------------------------------------------------------
    @property
    def state_path(self) -> Path:
        return self.state_dir / STATE_FILE

    def _save(self) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps([m.to_json() for m in self.managed.values()], indent=1))
        os.replace(tmp, self.state_path)

    def _adopt(self) -> None:
        """Take over the processes a previous incarnation recorded, if they are still them."""
        if not self.state_path.exists():
            return
        try:
            entries = json.loads(self.state_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            self.log.warning("state_file_unreadable", path=str(self.state_path), error=str(exc))
            entries = []
        for e in entries if isinstance(entries, list) else []:
            try:
                ident = local_identity(e)
            except (KeyError, TypeError, ValueError, IdentityError) as exc:
                self.log.warning("state_entry_invalid", entry=str(e)[:200], error=str(exc))
                continue
            if not same_process(ident):
                exists = psutil.pid_exists(ident.pid)
                self.log.warning(
                    "process_not_adopted",
                    pid=ident.pid,
                    token=ident.launch_token,
                    reason="pid_recycled" if exists else "process_gone",
                )
                continue
            if not is_alive(ident):
                continue
            m = Managed(
                identity=ident,
                machine=str(e.get("machine", "")),
                instance=str(e.get("instance", "")),
                role=str(e.get("role", "")),
                gpus=tuple(e.get("gpus") or ()),
                url=e.get("url"),
            )
            try:
                self._watch(m)
            except IdentityError:
                continue
            self.managed[ident.launch_token] = m
            self.log.info("process_adopted", pid=ident.pid, instance=m.instance)
        self._save()

    # -- protocol ----------------------------------------------------------------------------
    def inventory(self) -> dict[str, Any]:
        return {
            "gpus": list(self.gpus),
            "device": self.device,
            "hostname": this_host(),
            "agent_pid": os.getpid(),
        }

    def process_entries(self) -> list[dict[str, Any]]:
        """The RECONCILE list: every live managed process and every launch still starting."""
        out = []
        for m in self.managed.values():
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

    def starting_tokens(self) -> list[str]:
        return [t for t, p in self._pending.items() if not p.done]

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
        for token in self.starting_tokens():
            spec = self._pending[token].spec
            entries.append(
                {
                    "host": self.host_id,
                    "pid": 1,  # placeholder: no process yet (labels say so)
                    "start_time": 1.0,
                    "launch_token": token,
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
    def request_stop(self) -> None:
        self._stop_requested.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"s")

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested.is_set()

    def step(self, timeout_s: float = 0.1) -> None:
        """One iteration: poll the socket, handle what arrived, supervise processes."""
        busy = any(m.stop_at is not None for m in self.managed.values()) or self._confirms
        wait = min(timeout_s, 0.05) if busy else timeout_s
        for item in self.endpoint.poll(wait):
            self._dispatch(item)
        self._supervise()

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
                    self._finish_launches()
                else:
                    self._collect(fd)
            case PeerRestarted() | PeerReturned():
                self.log.info("controller_back", kind=type(item).__name__)
                self.announce()
            case PeerSilent():
                self.log.warning("controller_silent", silent_for_s=item.silent_for_s)
            case PeerJoined():
                pass
            case GaveUp():
                self.log.warning("message_given_up", msg_id=item.msg_id, kind=str(item.kind))
            case Dropped() as d:
                self.log.warning("frame_dropped", **d.log_fields())
            case _:
                pass

    # -- commands ----------------------------------------------------------------------------
    def _command(self, received: Received) -> None:
        op = received.frame.payload["op"]
        args = received.frame.payload["args"]
        handler: dict[str, Callable[[Mapping[str, Any]], tuple[bool, dict[str, Any]]]] = {
            "launch": self._launch,
            "stop_process": self._stop_process,
            "cancel_launch": self._cancel_launch,
            "confirm_gpu_free": self._confirm_gpu_free,
            "report": self._report,
        }
        fn = handler.get(op)
        if fn is None:
            self.endpoint.reply(received, ok=False, result={"reason": f"unknown op {op!r}"})
            return
        try:
            ok, result = fn(args)
        except (KeyError, TypeError, ValueError, EhpError) as exc:
            ok, result = False, {"reason": "bad_args", "detail": f"{type(exc).__name__}: {exc}"}
        self.log.info("command", op=op, ok=ok, **{k: v for k, v in result.items() if k != "gpus"})
        self.endpoint.reply(received, ok=ok, result=result)

    def _launch(self, args: Mapping[str, Any]) -> tuple[bool, dict[str, Any]]:
        token = str(args["token"])
        if token in self.managed or token in self._pending or token in self.exited_tokens:
            return True, {"already": True}
        gpus = tuple(str(g) for g in args.get("gpus") or ())
        foreign = [g for g in gpus if g not in self.gpus]
        if foreign:
            return False, {"reason": "unknown_gpus", "detail": f"{foreign} not in {self.gpus}"}
        spec = LaunchSpec(
            role=str(args.get("role") or args["machine"]),
            machine=str(args["machine"]),
            instance=str(args["instance"]),
            host_id=self.host_id,
            gpus=gpus,
            token=token,
            device="cuda" if self.device == "cuda" else "cpu",
        )
        if spec.role == ROLE_ENGINE and not self.workers.has(ROLE_ENGINE):
            pending = _PendingLaunch(spec=spec)
            self._pending[token] = pending
            threading.Thread(
                target=self._launch_engine_thread, args=(pending,), daemon=True
            ).start()
            return True, {"starting": True}
        try:
            argv = self.workers.argv(spec)
        except WorkerError as exc:
            return False, {"reason": "no_launcher", "detail": str(exc)}
        logfile = self.state_dir / "logs" / f"{spec.instance}-{token[:8]}.log"
        try:
            with logfile.open("ab") as fh:
                popen = subprocess.Popen(
                    argv,
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **spec.env()},
                )
        except OSError as exc:
            self._launch_failed(spec, f"cannot start {argv[0]}: {exc}")
            return True, {"starting": True}
        self._adopt_launched(spec, popen, url=None)
        return True, {"starting": True}

    def _launch_engine_thread(self, pending: _PendingLaunch) -> None:
        from ehp_fsm.rollout.launch import launch_engine

        spec = pending.spec
        try:
            result: Any = launch_engine(
                host=self.config.engine_host,
                deadline_s=self.config.engine_start_deadline_s,
                log_path=self.state_dir / "logs" / f"{spec.instance}-{spec.token[:8]}.log",
                env=spec.env(),
            )
        except Exception as exc:  # reported as launch_failed by the loop
            result = exc
        with self._lock:
            pending.result, pending.done = result, True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"l")

    def _finish_launches(self) -> None:
        with self._lock:
            done = [p for p in self._pending.values() if p.done]
        for p in done:
            del self._pending[p.spec.token]
            if isinstance(p.result, BaseException):
                self._launch_failed(p.spec, f"{type(p.result).__name__}: {p.result}")
                continue
            handle = p.result
            self._adopt_launched(p.spec, handle.process, url=handle.url)

    def _launch_failed(self, spec: LaunchSpec, reason: str) -> None:
        self.exited_tokens.add(spec.token)
        self._event(
            "launch_failed",
            {
                "machine": spec.machine,
                "instance": spec.instance,
                "token": spec.token,
                "reason": reason[:500],
            },
        )

    def _adopt_launched(
        self, spec: LaunchSpec, popen: subprocess.Popen[bytes], url: str | None
    ) -> None:
        try:
            start = psutil.Process(popen.pid).create_time()
        except psutil.NoSuchProcess:
            start = 0.0
        if start <= 0 or popen.poll() is not None:
            popen.wait()
            self._launch_failed(spec, f"process exited at once with code {popen.returncode}")
            return
        ident = ProcessIdentity(
            host=this_host(), pid=popen.pid, start_time=start, launch_token=spec.token
        )
        m = Managed(
            identity=ident,
            machine=spec.machine,
            instance=spec.instance,
            role=spec.role,
            gpus=spec.gpus,
            url=url,
            popen=popen,
        )
        try:
            self._watch(m)
        except IdentityError:
            popen.wait()
            self._launch_failed(spec, "process exited before it could be watched")
            return
        self.managed[spec.token] = m
        self._save()
        if spec.token in self._cancelled:
            self._signal_stop(m, self._clock())
            return
        name = "healthy" if spec.role == ROLE_ENGINE else "launched"
        self._event(
            name,
            {
                "machine": spec.machine,
                "instance": spec.instance,
                "identity": world_identity(ident, self.host_id, url),
            },
        )

    def _watch(self, m: Managed) -> None:
        fd = self.watcher.watch(m.identity, reap=False)
        m.fd = fd
        self._by_fd[fd] = m.identity.launch_token
        self.endpoint.watch_fd(fd)

    def _find(self, ident: ProcessIdentity) -> Managed | None:
        m = self.managed.get(ident.launch_token)
        if m is not None and m.identity.pid == ident.pid:
            return m
        for m in self.managed.values():
            if m.identity.pid == ident.pid:
                return m
        return None

    def _stop_process(self, args: Mapping[str, Any]) -> tuple[bool, dict[str, Any]]:
        ident = local_identity(args["identity"])
        m = self._find(ident)
        if not same_process(ident) or (m is not None and not m.identity.matches(ident)):
            self.log.warning(
                "stop_refused", pid=ident.pid, token=ident.launch_token, reason="not_same_process"
            )
            return False, {
                "reason": "not_same_process",
                "detail": f"pid {ident.pid} no longer names the identified process (it exited, "
                "or the pid was reused): nothing was signalled",
            }
        if m is None:  # the identified process, but not launched by this incarnation: adopt
            m = Managed(
                identity=ident,
                machine=str(args.get("machine", "")),
                instance=str(args.get("instance", "")),
                role="",
                gpus=(),
            )
            try:
                self._watch(m)
            except IdentityError:
                return False, {"reason": "not_same_process", "detail": "it exited meanwhile"}
            self.managed[ident.launch_token] = m
            self._save()
        if m.stop_at is None:
            self._signal_stop(m, self._clock())
        return True, {"stopping": True, "pid": ident.pid}

    def _signal_stop(self, m: Managed, now: float) -> None:
        m.stop_at = now + self.config.stop_grace_s
        m.stopped_by_agent = True
        self._send_signal(m, signal.SIGTERM)

    def _send_signal(self, m: Managed, sig: int) -> None:
        """Signal through the pidfd: it names exactly the watched process, never a reused pid."""
        if m.fd is None:
            return
        with contextlib.suppress(ProcessLookupError, OSError):
            signal.pidfd_send_signal(m.fd, sig)

    def _cancel_launch(self, args: Mapping[str, Any]) -> tuple[bool, dict[str, Any]]:
        token = str(args["token"])
        self._cancelled.add(token)
        m = self.managed.get(token)
        if m is not None and m.stop_at is None:
            self._signal_stop(m, self._clock())
            return True, {"stopping": True}
        if token in self._pending:
            self._pending[token].cancelled = True
            return True, {"cancelled": "pending"}
        return True, {"cancelled": "not_running"}

    def _confirm_gpu_free(self, args: Mapping[str, Any]) -> tuple[bool, dict[str, Any]]:
        gpu, owner = str(args["gpu"]), str(args.get("owner"))
        if gpu not in self.gpus:
            return False, {"reason": "unknown_gpus", "detail": f"{gpu} not in {self.gpus}"}
        self._confirms[(gpu, owner)] = self._clock()
        return True, {"pending": True}

    # -- supervision -------------------------------------------------------------------------
    def _collect(self, fd: int) -> None:
        token = self._by_fd.get(fd)
        if token is None:
            self.endpoint.unwatch_fd(fd)
            return
        m = self.managed.get(token)
        if m is None:
            return
        # The pidfd of a Popen child becomes readable when it exits (a zombie until reaped).
        returncode = m.popen.poll() if m.popen is not None else None
        if returncode is None and m.popen is not None:
            return
        exit_ = self.watcher.collect(fd)
        if exit_ is None and m.popen is None:
            return
        self._forget(m, returncode)

    def _forget(self, m: Managed, returncode: int | None) -> None:
        if m.fd is not None:
            self.endpoint.unwatch_fd(m.fd)
            self._by_fd.pop(m.fd, None)
            self.watcher.unwatch(m.fd)
            m.fd = None
        token = m.identity.launch_token
        self.managed.pop(token, None)
        self.exited_tokens.add(token)
        self._save()
        self._event(
            "exited",
            {
                "machine": m.machine,
                "instance": m.instance,
                "identity": world_identity(m.identity, self.host_id, m.url),
                "returncode": returncode,
                "stopped": m.stopped_by_agent,
            },
        )

    def _supervise(self) -> None:
        now = self._clock()
        for m in list(self.managed.values()):
            if m.popen is not None and m.popen.poll() is not None and m.fd is not None:
                self._collect(m.fd)
                continue
            if m.stop_at is not None and now >= m.stop_at:
                self.log.warning("stop_escalated", pid=m.identity.pid, signal="SIGKILL")
                self._send_signal(m, signal.SIGKILL)
                m.stop_at = now + self.config.stop_grace_s
        for token, p in list(self._pending.items()):
            if token in self._cancelled:
                p.cancelled = True
        for gpu, owner in list(self._confirms):
            if self._gpu_busy(gpu):
                continue
            del self._confirms[(gpu, owner)]
            self._event(
                "gpu_free",
                {"gpu": gpu, "owner": owner, "processes_exited": True, "memory_free": True},
            )

    def _gpu_busy(self, gpu: str) -> bool:
        if any(gpu in m.gpus for m in self.managed.values()):
            return True
        if any(gpu in p.spec.gpus for p in self._pending.values()):
            return True
        if self.device == "cuda":
            return _cuda_device_busy(gpu.rsplit(":g", 1)[-1])
        return False

    # -- shutdown ----------------------------------------------------------------------------
    def stop_all(self, *, grace_s: float | None = None) -> None:
        """SIGTERM every own process (and launches still starting), SIGKILL after the grace."""
        grace = self.config.stop_grace_s if grace_s is None else grace_s
        deadline = time.monotonic() + grace + 15.0
        while self._pending and time.monotonic() < deadline:  # wait for launch threads
            time.sleep(0.05)
            self._finish_launches_silently()
        now = self._clock()
        for m in self.managed.values():
            if m.stop_at is None:
                m.stop_at = now + grace
                m.stopped_by_agent = True
                self._send_signal(m, signal.SIGTERM)
        end = time.monotonic() + grace
        while self.managed and time.monotonic() < end + grace:
            for m in list(self.managed.values()):
                gone = (
                    m.popen.poll() is not None if m.popen is not None else not is_alive(m.identity)
                )
                if gone:
                    self._drop(m)
                elif time.monotonic() >= end:
                    self._send_signal(m, signal.SIGKILL)
            time.sleep(0.02)
        self._save()

    def _finish_launches_silently(self) -> None:
        with self._lock:
            done = [p for p in self._pending.values() if p.done]
        for p in done:
            del self._pending[p.spec.token]
            if not isinstance(p.result, BaseException):
                self._cancelled.add(p.spec.token)
                m = Managed(
                    identity=ProcessIdentity(
                        host=this_host(),
                        pid=p.result.pid,
                        start_time=p.result.start_time or 1.0,
                        launch_token=p.spec.token,
                    ),
                    machine=p.spec.machine,
                    instance=p.spec.instance,
                    role=p.spec.role,
                    gpus=p.spec.gpus,
                    popen=p.result.process,
                )
                with contextlib.suppress(IdentityError):
                    self._watch(m)
                self.managed[p.spec.token] = m

    def _drop(self, m: Managed) -> None:
        if m.fd is not None:
            self.endpoint.unwatch_fd(m.fd)
            self._by_fd.pop(m.fd, None)
            self.watcher.unwatch(m.fd)
            m.fd = None
        self.managed.pop(m.identity.launch_token, None)

    def shutdown(self) -> None:
        self.stop_all()
        self.close()

    def close(self) -> None:
        """Close the socket and fds without touching processes (what a crash leaves)."""
        self.watcher.close()
        self._by_fd.clear()
        self.endpoint.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


# ---- the command line ------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ehp-fsm agent", description="Run the host agent (one per host)."
    )
    p.add_argument("--controller", required=True, help="controller endpoint, tcp://HOST:PORT")
    p.add_argument("--host-id", required=True, help="this host's id in the plan ([[hosts]] id)")
    p.add_argument("--slots", type=int, default=1, help="CPU device slots in local mode")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto")
    p.add_argument("--keys", type=Path, help="CURVE key directory (`ehp-fsm keys DIR`)")
    p.add_argument("--key-name", help="agent key name in --keys (default: the host id)")
    p.add_argument("--state-dir", type=Path, help="where the agent records its processes")
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--max-message-bytes", type=int, default=1 << 20)
    p.add_argument("--stop-grace-s", type=float, default=10.0)
    p.add_argument("--engine-host", default="127.0.0.1", help="address engines listen on")
    p.add_argument(
        "--standin",
        action="append",
        default=[],
        metavar="ROLE",
        help="launch the idle stand-in process for ROLE (tests only)",
    )
    return p


def configure_logging() -> None:
    """JSON lines on stderr (the agent's own log; the transition log is the controller's)."""
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.JSONRenderer(),
        ],
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


def agent_main(argv: Sequence[str] | None = None) -> int:
    """`ehp-fsm agent ...`: run until SIGTERM/SIGINT, then stop own processes and exit 0."""
    args = build_parser().parse_args(argv)
    configure_logging()
    config = AgentConfig(
        controller=args.controller,
        host_id=args.host_id,
        slots=args.slots,
        device=args.device,
        state_dir=args.state_dir,
        keys_dir=args.keys,
        key_name=args.key_name,
        transport=TransportConfig(
            heartbeat_interval_s=args.heartbeat_s,
            max_message_bytes=args.max_message_bytes,
            allow_non_loopback=True,  # agents connect; only the controller binds
        ),
        engine_host=args.engine_host,
        stop_grace_s=args.stop_grace_s,
    )
    agent = Agent(config, workers=WorkerRegistry.from_names(args.standin))
    signal.signal(signal.SIGTERM, lambda *_: agent.request_stop())
    signal.signal(signal.SIGINT, lambda *_: agent.request_stop())
    log.info("agent_started", host=agent.host_id, gpus=agent.gpus, device=agent.device)
    return agent.run()


if __name__ == "__main__":
    try:
        sys.exit(agent_main())
    except EhpError as exc:
        print(f"ehp-fsm agent: error: {exc}", file=sys.stderr)
        sys.exit(2)
