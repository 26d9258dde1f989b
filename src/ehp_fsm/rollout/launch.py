"""Start and stop engine processes (SGLang or the embedded engine).

`launch_engine` picks a free port, starts the command line `engine_command.engine_argv` builds —
`python -m sglang.launch_server ...` or, with the module swapped, `python -m
ehp_fsm.rollout.server ...` — as a child process (its stdout/stderr go to a log file, never to a
pipe that could fill up), and waits — with a deadline — until the engine answers: `/health` ==
200 when it was given a model path, `/model_info` == 200 otherwise (an empty embedded engine is
alive but must be installed before it serves).
The returned `EngineHandle` carries the identity the controller checks before it ever stops the
process: host, pid, the process start time read with psutil, and a launch token.

`stop_engine` sends SIGTERM, waits, then SIGKILL after a deadline — but only after re-reading the
pid's start time: a pid that now belongs to another process is never signalled.

It knows nothing of engine states or revisions; the rollout machine decides when to launch/stop.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import httpx
import psutil

from ehp_fsm.engine_command import (
    Backend,
    EngineCommand,
    api_key_headers,
    engine_argv,
    engine_env,
)
from ehp_fsm.errors import exit_words
from ehp_fsm.rollout.errors import EngineLaunchError
from ehp_fsm.runtime.identity import start_time_of


@dataclass(frozen=True, kw_only=True)
class EngineHandle:
    host: str
    port: int
    pid: int
    start_time: float  # identity.start_time_of(pid)
    launch_token: str
    log_path: Path
    process: subprocess.Popen[bytes] = field(repr=False, compare=False)
    argv: tuple[str, ...] = ()  # the command line it was started with
    temp_log: bool = False  # `log_path` is a temporary file of ours: `stop_engine` removes it

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def is_alive(self) -> bool:
        """True while the pid is running *and* is still the process this handle launched."""
        if self.process.poll() is not None:
            return False
        try:
            return start_time_of(self.pid) == self.start_time
        except psutil.NoSuchProcess:
            return False


#: How long one readiness probe of the embedded engine waits for its answer (it answers at once).
PROBE_S: Final = 2.0
#: ... and of an SGLang engine: its `/health` is `/health_generate`, a one-token generation it
#: answers no sooner than 1 s after the request and then on a once-a-second check (SGLang
#: 0.5.3 `entrypoints/http_server.py`): a 2 s wait timed out whenever the token took more than
#: about a second (a fresh engine compiling its kernels, a busy one), and a launch whose every
#: probe did so failed, at its deadline, an engine that was serving.
SGLANG_PROBE_S: Final = 10.0


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free now (another process may still take it before the child binds;
    `launch_engine` retries on that)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def launch_engine(
    *,
    backend: Backend = "embedded",
    host: str = "127.0.0.1",
    port: int | None = None,
    model_path: str | os.PathLike[str] | None = None,
    weight_version: str | None = None,
    tp_size: int = 1,
    memory_saver: bool = False,
    deterministic: bool = False,
    extra_args: Sequence[str] = (),
    max_running_requests: int | None = None,
    torch_threads: int = 1,
    decode_delay_ms: float = 0.0,
    deadline_s: float = 60.0,
    log_path: str | os.PathLike[str] | None = None,
    env: dict[str, str] | None = None,
    context_length: int | None = None,
    cancelled: Callable[[], bool] | None = None,
    python: str = sys.executable,
    api_key: str | None = None,
) -> EngineHandle:
    """Start an engine — `python -m sglang.launch_server` or the embedded engine, with the
    command line `engine_command.engine_argv` builds — and wait until it answers; raise
    `EngineLaunchError` otherwise (also when `cancelled()` turns true while it waits: the process
    is stopped at once). `torch_threads` and `decode_delay_ms` are the embedded engine's own
    options (refused for SGLang). `env` is added to the engine's environment; its
    `EHP_LAUNCH_TOKEN`, when given, is the engine's launch token (an agent finds an interrupted
    launch's process by it), otherwise a fresh one is made. `api_key`: every request but the
    health probes must carry it (SGLang's `--api-key`; the embedded engine's environment)."""
    own: list[str] = []
    if max_running_requests is not None:
        own += ["--max-running-requests", str(max_running_requests)]
    if context_length is not None:
        own += ["--context-length", str(context_length)]
    if backend == "embedded":
        own += ["--torch-threads", str(torch_threads), "--decode-delay-ms", str(decode_delay_ms)]
    elif torch_threads != 1 or decode_delay_ms:
        raise ValueError("torch_threads and decode_delay_ms are the embedded engine's options")
    attempts = 1 if port is not None else 3
    last: EngineLaunchError | None = None
    for _ in range(attempts):
        cmd = EngineCommand(
            model_path=None if model_path is None else str(model_path),
            weight_version=weight_version,
            host=host,
            port=port if port is not None else free_port(host),
            tp_size=tp_size,
            memory_saver=memory_saver,
            deterministic=deterministic,
            extra_args=(*own, *extra_args),
            api_key=api_key,
        )
        try:
            return _launch_once(
                engine_argv(cmd, backend=backend, python=python),
                host=host,
                port=cmd.port,
                probe="/health" if model_path is not None else "/model_info",
                probe_s=SGLANG_PROBE_S if backend == "sglang" else PROBE_S,
                deadline_s=deadline_s,
                log_path=log_path,
                env={**(env or {}), **engine_env(cmd, backend=backend)},
                cancelled=cancelled,
                api_key=api_key,
            )
        except EngineLaunchError as exc:
            last = exc
            if "address already in use" not in exc.log_tail.lower():
                raise
    assert last is not None
    raise last


def _launch_once(
    argv: list[str],
    *,
    host: str,
    port: int,
    probe: str,
    deadline_s: float,
    log_path: str | os.PathLike[str] | None,
    probe_s: float = 2.0,
    env: dict[str, str] | None,
    cancelled: Callable[[], bool] | None = None,
    api_key: str | None = None,
) -> EngineHandle:
    token = (env or {}).get("EHP_LAUNCH_TOKEN") or uuid.uuid4().hex
    child_env = {**os.environ, **(env or {}), "EHP_LAUNCH_TOKEN": token}
    if cancelled is not None and cancelled():  # e.g. its agent is stopping: start nothing
        raise EngineLaunchError(
            f"the engine launch on port {port} was cancelled before it started",
            "its launch was cancelled",
            "",
        )
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix=f"ehp-engine-{port}-", suffix=".log")
        os.close(fd)
        log = Path(name)
    else:
        log = Path(log_path)
    with log.open("ab") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=child_env)
    try:
        start_time = start_time_of(proc.pid)
    except psutil.NoSuchProcess:
        start_time = 0.0
    handle = EngineHandle(
        host=host,
        port=port,
        pid=proc.pid,
        start_time=start_time,
        launch_token=token,
        log_path=log,
        process=proc,
        argv=tuple(argv),
        temp_log=log_path is None,
    )
    deadline = time.monotonic() + deadline_s
    with httpx.Client(base_url=handle.url, timeout=2.0, headers=api_key_headers(api_key)) as client:
        # (each probe waits `probe_s` for its answer, within the deadline)
        while True:
            code = proc.poll()
            if code is not None:
                raise EngineLaunchError(
                    f"engine process {proc.pid} on port {port} {exit_words(code)}",
                    "it failed before answering " + probe,
                    _stop_for_good(handle),
                )
            wait = min(probe_s, max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(httpx.TransportError):
                if client.get(probe, timeout=httpx.Timeout(wait, connect=2.0)).status_code == 200:
                    return handle
            if cancelled is not None and cancelled():
                tail = _stop_for_good(handle)
                raise EngineLaunchError(
                    f"engine process {proc.pid} on port {port} was cancelled while starting",
                    "its launch was cancelled",
                    tail,
                )
            if time.monotonic() > deadline:
                tail = _stop_for_good(handle)
                raise EngineLaunchError(
                    f"engine process {proc.pid} on port {port} did not answer {probe} in "
                    f"{deadline_s}s",
                    "it is too slow to start or stuck",
                    tail,
                )
            time.sleep(0.05)


def _stop_for_good(handle: EngineHandle) -> str:
    """Stop an engine whose launch failed; its log's tail (read before a temporary log goes)."""
    tail = _tail(handle.log_path)
    stop_engine(handle, grace_s=2.0)
    return tail


def stop_engine(handle: EngineHandle, *, grace_s: float = 10.0) -> int | None:
    """SIGTERM, then SIGKILL after `grace_s`; returns the exit code (None if the pid had been
    reused by another process and was therefore left alone). Once the process has exited, a
    temporary log `launch_engine` made for it (no `log_path` given) is removed."""
    proc = handle.process
    if proc.poll() is None:
        if not handle.is_alive():
            return None
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    if handle.temp_log:
        handle.log_path.unlink(missing_ok=True)
    return proc.returncode
