"""The agent's process table: the processes one host agent launched or adopted, and how it
launches, watches, signals, forgets and records them.

Knows: each process's identity (host, pid, process start time, launch token) and labels
(`Managed`), engine launches still starting in helper threads (`PendingLaunch`), the pidfds
that turn an exit into an immediate event, signalling through a pidfd (never a recycled pid),
the SIGTERM → SIGKILL escalation, the GPU finalizer (a GPU is free once no process of ours runs
on it and, on CUDA hosts, NVML — or, without `nvidia-ml-py`, `nvidia-smi` — lists no compute
process on it), and the state file (`STATE_DIR/processes.json`) from which a restarted agent
adopts the processes that survived it. A pool worker (role `pool_worker`,
`runtime.pool_launch`) is one more process of the table: launched from its checked `trainer`
field with this agent as its parent, recorded, adopted, stopped, finalized on its GPUs (a warm
worker launched on none holds none here; on CUDA hosts NVML or `nvidia-smi` still sees what it
holds) and reported like the others. Since its parent is the agent, a restarted agent adopts it
only to see it exit (and report that).

Does not know: sockets, the protocol or the controller — the `Agent` owns one `ProcessTable` and
hands it what it needs: something that watches fds for it (the endpoint),
`emit` (a reliable event to the controller) and `wake` (wakes the agent's loop); the agent
answers the controller's commands by calling the table's methods.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

import psutil

from ehp_fsm import nvml
from ehp_fsm.engine_command import EngineLaunchConfig
from ehp_fsm.fspaths import write_whole
from ehp_fsm.runtime.errors import IdentityError
from ehp_fsm.runtime.identity import (
    ProcessIdentity,
    ProcessWatcher,
    capture,
    is_alive,
    new_launch_token,
    same_process,
    start_time_of,
    this_host,
    token_hint,
)
from ehp_fsm.runtime.keys import read_api_key
from ehp_fsm.runtime.pool_launch import INSTANCE, TOKEN, TrainerLaunch, TrainerLaunchError
from ehp_fsm.runtime.workers import (
    ROLE_ENGINE,
    ROLE_POOL_WORKER,
    LaunchSpec,
    WorkerError,
    WorkerRegistry,
)

STATE_FILE: Final = "processes.json"
#: An engine's or Hybrid's launch token: with the instance (`INSTANCE`) it names its log file,
#: so it is one plain name, never a path (a pool worker's is `pool_launch.TOKEN`). (An engine's
#: pin folder in the revision store is `.launch-<random>`, not its token: the folder's name is
#: on the engine's command line, which `ps` shows every user.)
LAUNCH_TOKEN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")
#: The keys of a pool worker's `launch` (any other is refused: nothing else reaches its argv).
POOL_LAUNCH_ARGS: Final = frozenset({"machine", "instance", "role", "gpus", "token", "trainer"})

#: How long the agent's own stop of everything it runs (`ProcessTable.stop_all`: at its
#: SIGTERM/SIGINT, its owner's death, or the controller's lease) lets its processes end after
#: SIGTERM before it SIGKILLs them. Whoever stops an agent gives it a grace of its own and
#: SIGKILLs it after — `ehp-fsm stop` 10 s, the run's end 15 s, Slurm's KillWait 30 s by
#: default — so the agent's own grace must be well shorter than the shortest of them: an agent
#: that still waits on a hung engine when its grace runs out is killed with the engine running,
#: and nobody stops the engine then (it took 10 s here, the same as `stop`'s, and `stop` killed
#: agents stuck on a hung engine). A stop the controller asks for (`stop_process`) keeps the
#: agent's `stop_grace_s`: the agent's loop goes on meanwhile and nobody waits on it.
SHUTDOWN_GRACE_S: Final = 3.0
#: After SIGKILL, how long `stop_all` waits to see its processes gone (a process stuck in the
#: kernel outlives SIGKILL; it stays in the state file for `ehp-fsm stop`).
KILL_WAIT_S: Final = 1.0
#: The longest an agent's own stop takes: what a caller's grace for an agent must exceed, with
#: room for the agent's exit (`owned.stop_owned` gives agents at least this plus a margin).
SHUTDOWN_BOUND_S: Final = SHUTDOWN_GRACE_S + KILL_WAIT_S


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


def launch_token_of(pid: int) -> str | None:
    """The `EHP_LAUNCH_TOKEN` in process `pid`'s environment; None if unset or unreadable."""
    try:
        token = psutil.Process(pid).environ().get("EHP_LAUNCH_TOKEN")
    except psutil.Error:
        return None
    return token or None


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


@dataclass(frozen=True)
class Started:
    """A pool worker's process, as its launch thread hands it to the loop (the fields of an
    engine's `EngineHandle` the table reads)."""

    process: subprocess.Popen[bytes]
    pid: int
    start_time: float  # 0.0: gone before it could be read (`_adopt_launched` sees it exited)
    url: str | None = None


def _start_time(pid: int) -> float:
    try:
        return start_time_of(pid)
    except psutil.NoSuchProcess:
        return 0.0


@dataclass
class PendingLaunch:
    spec: LaunchSpec
    cancelled: bool = False
    result: Any = None  # EngineHandle, Started or an exception, set by the launch thread
    done: bool = False


CUDA_CHECK_EVERY_S = 1.0  # one look per device per second at most: the loop waits on it
CUDA_CHECK_TIMEOUT_S = 5.0


def cuda_check_tool() -> str | None:
    """What an agent asks whether a GPU is free of processes: "nvml" (`nvidia-ml-py`, the `gpu`
    extra), else "nvidia-smi", else None (process exit is then the only evidence)."""
    if nvml.installed():
        return "nvml"
    return "nvidia-smi" if shutil.which("nvidia-smi") is not None else None


def cuda_device_busy(index: str, *, timeout_s: float = CUDA_CHECK_TIMEOUT_S) -> bool | None:
    """Whether a process is on device `index`: True or False, or None when it cannot be told
    (NVML could not be asked; `nvidia-smi` failed, timed out or exited non-zero) — a doubt is
    never "free". Asked of NVML where it is installed, else of `nvidia-smi`: the compute
    processes either lists (a display server's graphics context stays for good). Without
    either: False, process exit being the only evidence there is (`cuda_check_tool` says
    which)."""
    if nvml.installed():
        processes = nvml.device_processes(int(index), graphics=False)
        return None if processes is None else bool(processes)
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return False
    try:
        out = subprocess.run(
            [exe, "--query-compute-apps=pid", "--format=csv,noheader", "-i", index],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return bool(out.stdout.strip())


PIN_PREFIX = ".launch-"  # a starting engine's private links to its revision, in the store
PIN_TRIES = 5


def newest_revision(
    revisions: str | None, *, base_model: str | None = None
) -> tuple[str | None, str | None]:
    """(model path, weight version) an engine starts from: the newest revision of the run's
    store, pinned, and its number; (None, None) without a store (an empty embedded engine);
    `base_model` and no weight version while the store holds no revision yet (the run launches
    its engines while its trainers start). An engine installs the run's current revision before
    it serves either way (the engine machine's `installing`; the machine never lets it serve
    base weights), so a newer one saved meanwhile only shortens that install.

    The run retires a revision as soon as no engine uses it — while a started engine is still
    importing, the newest revision is often already an older one, and gone. So the engine gets
    hard links to the revision's files in `<store>/.launch-<random>` (same file system: the
    store's own folder; a link keeps a retired file's data until the engine has read it) and
    the caller removes them once the engine answers (`unpin`). A revision retired while it was
    being linked is seen (the manifest's file list does not hold) and the newest one is taken
    again. The folder's name is random, not the launch's token: it is the engine's
    `--model-path`, which every user reads in `ps`, and the token is a secret (`run.owned`)."""
    if revisions is None:
        return None, None
    from ehp_fsm.models import revision_dir
    from ehp_fsm.models.load import ModelError
    from ehp_fsm.rollout.errors import RevisionCorrupt
    from ehp_fsm.rollout.revisions import RevisionStore

    store = RevisionStore(revisions)
    pin = store.root / f"{PIN_PREFIX}{secrets.token_hex(16)}"
    why = ""
    for _ in range(PIN_TRIES):
        latest = store.latest()
        if latest is None and base_model is not None:
            return base_model, None  # the run's own model directory: never deleted under it
        if latest is None:
            raise WorkerError(
                f"the revision store {revisions} holds no revision",
                "an engine starts from the newest revision the run has published",
                "launch engines after revision 1 is published, or give the agent the model "
                "directory to start from (--engine-base-model; the run does)",
            )
        src = store.root / f"r{latest:08d}"
        shutil.rmtree(pin, ignore_errors=True)
        try:
            pin.mkdir()
            for f in sorted(src.iterdir()):
                os.link(f, pin / f.name)
            revision_dir.open_revision(pin)  # the manifest's file list and sizes hold
            return str(pin), str(latest)
        except (OSError, RevisionCorrupt, ModelError) as exc:  # retired while linked
            why = f"{type(exc).__name__}: {exc}"
            shutil.rmtree(pin, ignore_errors=True)
    raise WorkerError(
        f"no revision of {revisions} could be pinned for an engine in {PIN_TRIES} tries",
        why,
        "check that the store's folder is writable by the agent and on one file system",
    )


def unpin(model_path: str | None) -> None:
    """Remove a started engine's links to its revision (it has read what it needs)."""
    if model_path is not None and Path(model_path).name.startswith(PIN_PREFIX):
        shutil.rmtree(model_path, ignore_errors=True)


def _descendants(pid: int) -> list[psutil.Process]:
    """Every live process `pid` started, and those they started (empty when `pid` is gone)."""
    try:
        return list(psutil.Process(pid).children(recursive=True))
    except psutil.Error:
        return []


class FdWatch(Protocol):
    """What the table needs from the agent's endpoint: pidfds polled beside the socket."""

    def watch_fd(self, fd: int) -> None: ...

    def unwatch_fd(self, fd: int) -> None: ...


class ProcessTable:
    """The processes of one agent (by launch token) and the commands that act on them.
    Owned by `Agent`; not thread-safe (engine launch threads hand results back under `_lock`
    and wake the agent's loop through `wake`)."""

    def __init__(
        self,
        *,
        host_id: str,
        device: str,
        gpus: Sequence[str],
        state_dir: Path,
        workers: WorkerRegistry,
        fds: FdWatch,
        emit: Callable[[str, Mapping[str, Any]], None],
        wake: Callable[[], None],
        clock: Callable[[], float],
        log: Any,  # structlog's bound logger
        engines_listen_on: str,
        engine_start_deadline_s: float,
        stop_grace_s: float,
        engines: EngineLaunchConfig | None = None,
        curve_key_file: Path | None = None,
    ) -> None:
        self.host_id = host_id
        self.device = device  # "cuda" or "cpu"
        self.gpus = list(gpus)
        self.state_dir = state_dir
        self.workers = workers
        self.log = log
        self.engines_listen_on = engines_listen_on
        self.engine_start_deadline_s = engine_start_deadline_s
        self.stop_grace_s = stop_grace_s
        #: the grace of `stop_all`, which its callers wait on (`SHUTDOWN_GRACE_S` at most)
        self.shutdown_grace_s = min(stop_grace_s, SHUTDOWN_GRACE_S)
        self.engines = engines or EngineLaunchConfig()
        #: this agent's CURVE secret key file: the pool workers it launches authenticate to
        #: their pool with it (None: no --keys, no CURVE pool worker)
        self.curve_key_file = curve_key_file
        #: this agent, as the parent its pool workers watch (they exit when it is gone)
        self.identity = capture(os.getpid(), launch_token=new_launch_token())
        self._fds = fds
        self._event = emit  # a reliable event to the controller
        self._wake = wake
        self._clock = clock
        self.watcher = ProcessWatcher()
        self.managed: dict[str, Managed] = {}  # token → process
        self.exited_tokens: set[str] = set()
        self._by_fd: dict[int, str] = {}
        self._pending: dict[str, PendingLaunch] = {}
        # write-ahead: launches whose process is not recorded yet
        self._launching: dict[str, dict[str, Any]] = {}
        self._cancelled: set[str] = set()
        self._confirms: dict[tuple[str, str], float] = {}  # (gpu, owner) → asked at
        # device index → (checked at, answer)
        self._cuda_checked: dict[str, tuple[float, bool | None]] = {}
        self._cuda_tool_said = False  # `gpu_free_by_exit_only` is logged once
        self._lock = threading.Lock()

    @property
    def busy(self) -> bool:
        """A stop or a GPU confirmation is in progress: the loop should come back soon."""
        return any(m.stop_at is not None for m in self.managed.values()) or bool(self._confirms)

    def starting(self) -> list[LaunchSpec]:
        """The launches still starting (engine launch threads not done yet)."""
        return [p.spec for p in self._pending.values() if not p.done]

    def close(self) -> None:
        """Close the pidfds without touching processes (what a crash leaves)."""
        self.watcher.close()
        self._by_fd.clear()

    # -- state file --------------------------------------------------------------------------
    @property
    def state_path(self) -> Path:
        return self.state_dir / STATE_FILE

    def _save(self) -> None:
        entries = [m.to_json() for m in self.managed.values()]
        entries += [{"launching": True, **spec} for spec in self._launching.values()]
        # whole or not at all, mode 0600: it holds the launch tokens that prove to `ehp-fsm
        # stop` a process is the run's (readable by others, they could be copied into a forged
        # run folder); a link planted at its `.tmp` is not written through
        write_whole(self.state_path, json.dumps(entries, indent=1), private=True)

    def _save_after_exit(self) -> None:
        """`_save` once a process is gone (it exited, or every one was stopped): on a full disk
        the file keeps naming what is gone — harmless, as `ehp-fsm stop` and the next agent
        signal only a live process of the recorded identity and token — and the agent goes
        on. Raising here killed the agent (its dispatch loop, then its shutdown): its host went
        silent, its GPUs quarantined, and the run ended unconfirmed (exit 1)."""
        try:
            self._save()
        except OSError as exc:
            self.log.warning("state_file_not_saved", path=str(self.state_path), error=str(exc))

    def _intend(self, spec: LaunchSpec) -> None:
        """Write-ahead: record a launch before its process exists. A previous incarnation
        killed between fork and recording the process leaves this entry; `adopt` then finds
        the process by its launch token and kills it (it was never reported to anyone)."""
        self._launching[spec.token] = {
            "token": spec.token,
            "machine": spec.machine,
            "instance": spec.instance,
            "role": spec.role,
            "gpus": list(spec.gpus),
        }
        self._save()

    def _kill_interrupted_launch(self, entry: Mapping[str, Any]) -> None:
        token = str(entry.get("token", ""))
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if token and launch_token_of(proc.pid) == token:
                    proc.kill()  # psutil checks the create time: never a recycled pid
                    self.log.warning(
                        "interrupted_launch_killed",
                        pid=proc.pid,
                        token=token,
                        instance=entry.get("instance"),
                    )

    def adopt(self) -> None:
        """Take over the processes a previous incarnation recorded, if they are still them."""
        if not self.state_path.exists():
            return
        try:
            entries = json.loads(self.state_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            self.log.warning("state_file_unreadable", path=str(self.state_path), error=str(exc))
            entries = []
        for e in entries if isinstance(entries, list) else []:
            if isinstance(e, dict) and e.get("launching") is True:
                self._kill_interrupted_launch(e)
                continue
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
            if launch_token_of(ident.pid) != ident.launch_token:
                self.log.warning(
                    "process_not_adopted",
                    pid=ident.pid,
                    token=ident.launch_token,
                    reason="token_mismatch",
                )
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

    def launch(self, args: Mapping[str, Any]) -> tuple[bool, dict[str, Any]]:
        token = str(args["token"])
        if token in self.managed or token in self._pending or token in self.exited_tokens:
            return True, {"already": True}
        gpus = tuple(str(g) for g in args.get("gpus") or ())
        foreign = [g for g in gpus if g not in self.gpus]
        if foreign:
            return False, {"reason": "unknown_gpus", "detail": f"{foreign} not in {self.gpus}"}
        role = str(args.get("role") or args["machine"])
        if role == ROLE_POOL_WORKER or "trainer" in args:
            return self._launch_pool_worker(args, token, gpus)
        instance = str(args["instance"])
        for field, value, name in (
            ("token", token, LAUNCH_TOKEN),
            ("instance", instance, INSTANCE),
        ):
            if not name.fullmatch(value):  # `x/../../victim` had the pin's rmtree empty a folder
                return False, {
                    "reason": "bad_args",
                    "detail": f"the launch's {field} {value[:64]!r} is not a plain name (a "
                    "letter or digit, then letters, digits and '_.:-'): it names the process's "
                    "files on this host. Nothing was started; send the token "
                    "new_launch_token() makes and the instance's id",
                }
        spec = LaunchSpec(
            role=role,
            machine=str(args["machine"]),
            instance=instance,
            host_id=self.host_id,
            gpus=gpus,
            token=token,
            device="cuda" if self.device == "cuda" else "cpu",
        )
        if spec.role == ROLE_ENGINE and not self.workers.has(ROLE_ENGINE):
            pending = PendingLaunch(spec=spec)
            self._pending[token] = pending
            self._intend(spec)
            threading.Thread(
                target=self._launch_engine_thread, args=(pending,), daemon=True
            ).start()
            return True, {"starting": True}
        try:
            argv = self.workers.argv(spec)
        except WorkerError as exc:
            return False, {"reason": "no_launcher", "detail": str(exc)}
        self._spawn(spec, argv)
        return True, {"starting": True}

    def _launch_pool_worker(
        self, args: Mapping[str, Any], token: str, gpus: tuple[str, ...]
    ) -> tuple[bool, dict[str, Any]]:
        """Start one rank of the run's trainer pool (`runtime.pool_launch`): the argv is the
        pool's own worker command line, built with this agent as the worker's parent; nothing
        of the launch but the checked `trainer` fields reaches it. What can be checked at once
        is (a refusal: ok=False, `bad_trainer`); the configuration is read — importing torch,
        a second or more — in a launch thread, as an engine's start is waited for, so the
        loop goes on answering its controller (its failure: `launch_failed`)."""
        try:
            spec, trainer = self._pool_worker_spec(args, token, gpus)
        except TrainerLaunchError as exc:
            self.log.warning("pool_worker_refused", token=token[:64], detail=str(exc))
            return False, {"reason": "bad_trainer", "detail": str(exc)[:1000]}
        pending = PendingLaunch(spec=spec)
        self._pending[token] = pending
        self._intend(spec)
        threading.Thread(
            target=self._launch_pool_worker_thread, args=(pending, trainer), daemon=True
        ).start()
        return True, {"starting": True}

    def _launch_pool_worker_thread(self, pending: PendingLaunch, trainer: TrainerLaunch) -> None:
        spec = pending.spec
        result: Any
        try:
            argv = trainer.argv(parent=self.identity)  # reads and checks the configuration
            if pending.cancelled:
                raise WorkerError(f"launch of {spec.instance} was cancelled before it started")
            logfile = self.state_dir / "logs" / f"{spec.instance}-{spec.token[:8]}.log"
            with logfile.open("ab") as fh:
                popen = subprocess.Popen(
                    argv, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **spec.env()}
                )
            result = Started(process=popen, pid=popen.pid, start_time=_start_time(popen.pid))
        except Exception as exc:  # reported as launch_failed by the loop
            result = exc
        with self._lock:
            pending.result, pending.done = result, True
        self._wake()

    def _pool_worker_spec(
        self, args: Mapping[str, Any], token: str, gpus: tuple[str, ...]
    ) -> tuple[LaunchSpec, TrainerLaunch]:
        unknown = sorted(str(k)[:40] for k in args if k not in POOL_LAUNCH_ARGS)
        if unknown:
            raise TrainerLaunchError(
                "the pool worker's launch is refused",
                f"it has unknown keys {unknown[:5]} (the agent builds the command line itself)",
                f"send only {sorted(POOL_LAUNCH_ARGS)}",
            )
        for key in ("machine", "role"):
            if args.get(key, ROLE_POOL_WORKER) != ROLE_POOL_WORKER:
                raise TrainerLaunchError(
                    f"a launch with a trainer field names {key} {str(args[key])[:40]!r}",
                    f"a trainer field starts a pool worker: its {key} is {ROLE_POOL_WORKER!r}",
                    f"send {key} {ROLE_POOL_WORKER!r}",
                )
        instance = args["instance"]
        if type(instance) is not str or not INSTANCE.fullmatch(instance):
            raise TrainerLaunchError(
                f"instance {str(instance)[:40]!r} is refused",
                "it names the worker's log file: 1..64 letters, digits or '._:-'",
                "send pool_instance(rank), e.g. 'pool-r1'",
            )
        if not TOKEN.fullmatch(token):
            raise TrainerLaunchError(
                "the pool worker's launch token is refused",
                "it is not 8..128 letters, digits, '_' or '-'",
                "send a fresh token (identity.new_launch_token())",
            )
        if "trainer" not in args:
            raise TrainerLaunchError(
                "a pool worker's launch has no trainer field",
                "the agent starts a pool worker only from the pool's endpoints, token, "
                "configuration and rank",
                "send trainer = TrainerLaunch.for_pool(pool, rank).to_wire()",
            )
        trainer = TrainerLaunch.from_wire(args["trainer"])
        spec = LaunchSpec(
            role=ROLE_POOL_WORKER,
            machine=ROLE_POOL_WORKER,
            instance=instance,
            host_id=self.host_id,
            gpus=gpus,
            token=token,
            device="cuda" if self.device == "cuda" else "cpu",
            extra=trainer.env(self.curve_key_file),
        )
        return spec, trainer

    def _spawn(self, spec: LaunchSpec, argv: Sequence[str]) -> None:
        """Start `argv` for `spec` (its output appended to `logs/<instance>-<token>.log`) and
        take it into the table: `launched`, or `launch_failed` when it cannot start."""
        logfile = self.state_dir / "logs" / f"{spec.instance}-{spec.token[:8]}.log"
        self._intend(spec)
        try:
            with logfile.open("ab") as fh:
                popen = subprocess.Popen(
                    list(argv),
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **spec.env()},
                )
        except OSError as exc:
            self._launch_failed(spec, f"cannot start {argv[0]}: {exc}")
            return
        self._adopt_launched(spec, popen, url=None)

    def _launch_engine_thread(self, pending: PendingLaunch) -> None:
        from ehp_fsm.rollout.launch import launch_engine

        spec = pending.spec
        cfg = self.engines
        model_path: str | None = None
        try:
            api_key = None if cfg.api_key_file is None else read_api_key(cfg.api_key_file)
            model_path, version = newest_revision(cfg.revisions, base_model=cfg.base_model)
            result: Any = launch_engine(
                backend=cfg.backend,
                host=self.engines_listen_on,
                model_path=model_path,
                weight_version=version,
                tp_size=max(1, len(spec.gpus)),
                memory_saver=cfg.memory_saver,
                deterministic=cfg.deterministic,
                extra_args=cfg.extra_args,
                deadline_s=cfg.start_deadline_s or self.engine_start_deadline_s,
                log_path=self.state_dir / "logs" / f"{spec.instance}-{spec.token[:8]}.log",
                env=spec.env(),
                cancelled=lambda: pending.cancelled,  # cancel_launch stops it at once
                api_key=api_key,
            )
        except Exception as exc:  # reported as launch_failed by the loop
            result = exc
        unpin(model_path)  # an engine that answers has loaded it; one that failed needs none
        with self._lock:
            pending.result, pending.done = result, True
        self._wake()

    def finish_launches(self) -> None:
        with self._lock:
            done = [p for p in self._pending.values() if p.done]
        for p in done:
            del self._pending[p.spec.token]
            if isinstance(p.result, TrainerLaunchError):
                self._launch_failed(p.spec, f"bad_trainer: {p.result}")
                continue
            if isinstance(p.result, BaseException):
                self._launch_failed(p.spec, f"{type(p.result).__name__}: {p.result}")
                continue
            handle = p.result
            self._adopt_launched(p.spec, handle.process, url=handle.url)

    def _launch_failed(self, spec: LaunchSpec, reason: str) -> None:
        self.exited_tokens.add(spec.token)
        if self._launching.pop(spec.token, None) is not None:
            self._save()
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
            start = start_time_of(popen.pid)
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
        self._launching.pop(spec.token, None)
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
        self._fds.watch_fd(fd)

    def _find(self, ident: ProcessIdentity) -> Managed | None:
        m = self.managed.get(ident.launch_token)
        if m is not None and m.identity.pid == ident.pid:
            return m
        for m in self.managed.values():
            if m.identity.pid == ident.pid:
                return m
        return None

    def stop_process(self, args: Mapping[str, Any]) -> tuple[bool, dict[str, Any]]:
        host = args["identity"].get("host")
        if host is not None and str(host) != self.host_id:
            return False, {
                "reason": "wrong_host",
                "detail": f"the identity names host {host!r}, this agent is {self.host_id!r}: "
                "nothing was signalled; send the stop to that host's agent",
            }
        ident = local_identity(args["identity"])
        m = self._find(ident)
        why = None
        if not same_process(ident) or (m is not None and not m.identity.matches(ident)):
            why = "no longer names the identified process (it exited, or the pid was reused)"
        elif m is None and launch_token_of(ident.pid) != ident.launch_token:
            # not launched by this incarnation, and not carrying the identity's launch token:
            # start time alone does not make it the process the controller means
            # (named by its first characters: the reply reaches logs, and the token is a secret)
            hint = token_hint(ident.launch_token)
            why = f"does not carry the identity's launch token {hint} (EHP_LAUNCH_TOKEN)"
        if why is not None:
            self.log.warning("stop_refused", pid=ident.pid, token=ident.launch_token, why=why)
            return False, {
                "reason": "not_same_process",
                "detail": f"pid {ident.pid} {why}: nothing was signalled",
            }
        if m is None:  # the identified process, but not launched by this incarnation: adopt
            # Which GPUs it holds is not known here: it holds them all until it is gone, so no
            # GPU of this host is confirmed free while it may still run on it.
            m = Managed(
                identity=ident,
                machine=str(args.get("machine", "")),
                instance=str(args.get("instance", "")),
                role="",
                gpus=tuple(self.gpus),
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
        m.stop_at = now + self.stop_grace_s
        m.stopped_by_agent = True
        self._send_signal(m, signal.SIGTERM)

    def _send_signal(self, m: Managed, sig: int) -> None:
        """Signal through the pidfd: it names exactly the watched process, never a reused pid.
        SIGTERM is followed by SIGCONT (as systemd does): a stopped process (SIGSTOP, Ctrl-Z)
        holds SIGTERM pending until continued, and a frozen engine ended only at the SIGKILL
        after the whole grace, its GPU `releasing` that long."""
        if m.fd is None:
            return
        with contextlib.suppress(ProcessLookupError, OSError):
            signal.pidfd_send_signal(m.fd, sig)
            if sig == signal.SIGTERM:
                signal.pidfd_send_signal(m.fd, signal.SIGCONT)

    def cancel_launch(self, args: Mapping[str, Any]) -> tuple[bool, dict[str, Any]]:
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

    def confirm_gpu_free(self, args: Mapping[str, Any]) -> tuple[bool, dict[str, Any]]:
        gpu, owner = str(args["gpu"]), str(args.get("owner"))
        if gpu not in self.gpus:
            return False, {"reason": "unknown_gpus", "detail": f"{gpu} not in {self.gpus}"}
        self._confirms[(gpu, owner)] = self._clock()
        return True, {"pending": True}

    # -- supervision -------------------------------------------------------------------------
    def collect(self, fd: int) -> None:
        token = self._by_fd.get(fd)
        if token is None:
            self._fds.unwatch_fd(fd)
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
            self._fds.unwatch_fd(m.fd)
            self._by_fd.pop(m.fd, None)
            self.watcher.unwatch(m.fd)
            m.fd = None
        token = m.identity.launch_token
        self.managed.pop(token, None)
        self.exited_tokens.add(token)
        self._save_after_exit()
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

    def supervise(self) -> None:
        now = self._clock()
        for m in list(self.managed.values()):
            if m.popen is not None and m.popen.poll() is not None and m.fd is not None:
                self.collect(m.fd)
                continue
            if m.stop_at is not None and now >= m.stop_at:
                self.log.warning("stop_escalated", pid=m.identity.pid, signal="SIGKILL")
                self._send_signal(m, signal.SIGKILL)
                m.stop_at = now + self.stop_grace_s
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
        if self.device != "cuda":
            return False
        index = gpu.rsplit(":g", 1)[-1]
        now = self._clock()
        checked = self._cuda_checked.get(index)
        if checked is not None and now - checked[0] < CUDA_CHECK_EVERY_S:
            return checked[1] is not False
        busy = cuda_device_busy(index)
        self._cuda_checked[index] = (now, busy)
        if busy is None:
            self.log.warning(
                "gpu_free_unconfirmed",
                gpu=gpu,
                tool=cuda_check_tool(),
                why="NVML could not be asked, or nvidia-smi failed, timed out or exited non-zero",
                fix="check the driver (and nvidia-smi) on this host; the GPU stays unconfirmed",
            )
        elif not self._cuda_tool_said and cuda_check_tool() is None:
            self._cuda_tool_said = True
            self.log.warning(
                "gpu_free_by_exit_only",
                gpu=gpu,
                why="neither NVML (nvidia-ml-py) nor nvidia-smi is on this host: a GPU is "
                "confirmed free when the processes the agent started on it have exited, and "
                "a process it did not start is not seen",
                fix="install the `gpu` extra (pip install 'ehp-fsm[gpu]') in the agent's "
                "environment",
            )
        return busy is not False

    def stop_all(self, *, grace_s: float | None = None) -> None:
        """Stop every own process and every launch still starting, and return within
        `grace_s` (default `shutdown_grace_s`) + `KILL_WAIT_S`, whatever they do.

        Everything gets SIGTERM at once — the processes of launches still starting too (found
        by their launch token: the launch thread holds their handle, and is not waited for);
        whatever still runs at the grace is SIGKILLed with every process it started, and seen
        gone. Sends nothing to the controller (it may be gone: the agent's shutdown and the
        lease call this) and never waits on it. A process that survives even SIGKILL (stuck in
        the kernel) and a launch whose process appears only after this stays in the state
        file, so `ehp-fsm stop` and the next agent still find it by its identity or token."""
        grace = self.shutdown_grace_s if grace_s is None else grace_s
        began = time.monotonic()
        with self._lock:
            for p in self._pending.values():
                p.cancelled = True  # a launch still waiting for its engine stops it at once
        self._signal_all(signal.SIGTERM, launches=True)
        while self._still_running() and time.monotonic() < began + grace:
            time.sleep(0.02)
            self._signal_all(signal.SIGTERM)  # a launch finished meanwhile is managed now
        killed = 0
        if self._still_running():
            killed = self._signal_all(signal.SIGKILL, launches=True, with_descendants=True)
            end = time.monotonic() + KILL_WAIT_S
            while self._still_running() and time.monotonic() < end:
                time.sleep(0.02)
        self._save_after_exit()
        left = [m.identity.pid for m in self.managed.values()]
        left += [p.pid for p in self._launch_processes()]
        (self.log.warning if left else self.log.info)(
            "processes_stopped",
            seconds=round(time.monotonic() - began, 2),
            grace_s=grace,
            killed=killed,
            left=left,
            launches_unfinished=[p.spec.instance for p in self._pending.values()],
        )

    def _signal_all(
        self, sig: int, *, launches: bool = False, with_descendants: bool = False
    ) -> int:
        """`sig` to every managed process (SIGTERM only to those not asked yet); with
        `launches`, to the processes of launches still starting too; with `with_descendants`,
        to every process they started, gathered before the signal (a killed parent's children
        are re-parented, and found no more). Returns how many processes were signalled."""
        now = self._clock()
        targets: list[psutil.Process] = []
        signalled = 0
        for m in self.managed.values():
            if sig == signal.SIGTERM and m.stop_at is not None:
                continue  # asked already: a stop the controller wanted, or a previous pass
            if m.stop_at is None:
                m.stop_at, m.stopped_by_agent = now + self.shutdown_grace_s, True
            if with_descendants:
                targets += _descendants(m.identity.pid)
            self._send_signal(m, sig)
            signalled += 1
        if launches:
            targets += self._launch_processes()
        for p in targets:
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)  # psutil checks the start time: never a recycled pid
                if sig == signal.SIGTERM:
                    p.resume()  # SIGCONT: a stopped process acts on SIGTERM (`_send_signal`)
        return signalled + len(targets)

    def _launch_processes(self) -> list[psutil.Process]:
        """The live processes of this agent's launches still starting: its descendants that
        carry one of their launch tokens (`EHP_LAUNCH_TOKEN`)."""
        tokens = {t for t, p in self._pending.items() if not p.done} | set(self._launching)
        tokens -= set(self.managed)
        if not tokens:
            return []
        out = []
        for p in _descendants(os.getpid()):
            with contextlib.suppress(psutil.Error):
                if p.status() != psutil.STATUS_ZOMBIE and launch_token_of(p.pid) in tokens:
                    out.append(p)
        return out

    def _still_running(self) -> bool:
        """Finish the launches that ended, forget the processes that exited; True while a
        managed process or the process of a launch still starting runs."""
        self._finish_launches_silently()
        for m in list(self.managed.values()):
            gone = m.popen.poll() is not None if m.popen is not None else not is_alive(m.identity)
            if gone:
                self._drop(m)
        return bool(self.managed) or bool(self._launch_processes())

    def _finish_launches_silently(self) -> None:
        with self._lock:
            done = [p for p in self._pending.values() if p.done]
        for p in done:
            del self._pending[p.spec.token]
            self._launching.pop(p.spec.token, None)
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
            self._fds.unwatch_fd(m.fd)
            self._by_fd.pop(m.fd, None)
            self.watcher.unwatch(m.fd)
            m.fd = None
        self.managed.pop(m.identity.launch_token, None)
