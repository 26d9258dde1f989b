"""Process identities: who a pid *is*, not just which number it has.

Knows: `ProcessIdentity(host, pid, start_time, launch_token)`, how to capture one for a live
process (`start_time_of`: ticks since boot, which no clock step moves), how to tell whether a
pid still names the *same* process (a recycled pid has another start time), and how to learn
of a process's death at once (a pidfd, which an endpoint can watch in its poll loop via
`watch_fd`).

Does not know: which process belongs to whom (the engine world) or how processes are launched.
Identities of other hosts can be carried and compared, but only checked against the live system
on their own host (`same_process` refuses a foreign host rather than guess).
"""

from __future__ import annotations

import math
import os
import socket
import uuid
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import psutil

from ehp_fsm.runtime.errors import IdentityError

#: start times count clock ticks (10 ms on Linux): two readings of the same process agree far
#: better than this, two processes on one pid differ by more.
START_TIME_TOLERANCE_S: Final = 0.005
_TICKS_PER_S: Final = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_boot_offset: float | None = None


def _this_boot() -> float:
    """A number of seconds drawn from this boot's id (0 .. 2**32 - 1, the same for every
    process until the machine restarts): start times of two boots never line up."""
    global _boot_offset
    if _boot_offset is None:
        try:
            boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
            _boot_offset = float(int(boot_id.replace("-", "")[:8], 16))
        except (OSError, ValueError):
            _boot_offset = 0.0
    return _boot_offset


def start_time_of(pid: int) -> float:
    """When process `pid` started, as identities carry it: its start in clock ticks since boot
    (`/proc/PID/stat`), in seconds, plus an offset drawn from the boot id (`_this_boot`).
    Raises `psutil.NoSuchProcess` when the pid is gone.

    Not psutil's `create_time()`: that adds the boot time, which the kernel derives from the
    wall clock (now minus uptime), and a process reads it once. Once the wall clock was set
    (an NTP step, an operator), a process started after it read every identity recorded before
    it off by the step: `stop`, `--resume` and a restarted agent then took the run's live
    processes for strangers. Ticks since boot do not move with the clock."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as fh:
            stat = fh.read()
    except (FileNotFoundError, ProcessLookupError):
        raise psutil.NoSuchProcess(pid) from None
    except OSError:  # no /proc (not Linux): psutil's own reading
        return float(psutil.Process(pid).create_time())
    # the command name (field 2) may hold spaces and parentheses: fields after its last ')'
    ticks = int(stat[stat.rindex(b")") + 2 :].split()[19])  # field 22: starttime
    return _this_boot() + ticks / _TICKS_PER_S


#: The machine name identities carry where the host name does not tell machines apart (e.g.
#: containers that share one): set it alike for every process of one machine (children inherit
#: it). The tests run "another machine" on this one with it; nothing else is faked by it.
MACHINE_ENV: Final = "EHP_MACHINE"


def this_host() -> str:
    """The machine name identities captured here carry: `EHP_MACHINE`, else the host name."""
    return os.environ.get(MACHINE_ENV) or socket.gethostname()


def new_launch_token() -> str:
    """A fresh random token to tag one launch (passed to the child in its environment, never
    on its command line: it is a secret, `run.owned`)."""
    return uuid.uuid4().hex


#: The keys under which a log record holds a launch token (`hide_launch_tokens`).
TOKEN_KEYS: Final = frozenset({"token", "launch_token", "pool_token"})
#: How many characters of a token a log line keeps: enough to tell launches apart (the agents'
#: per-launch log files are named with as many), too few to stand for the token.
TOKEN_HINT_CHARS: Final = 8


def token_hint(token: str) -> str:
    """What a log line says of launch token `token`: its first characters."""
    return token[:TOKEN_HINT_CHARS] + "…" if len(token) > TOKEN_HINT_CHARS else token


def hide_launch_tokens(
    _logger: Any, _method: str, event: MutableMapping[str, Any]
) -> Mapping[str, Any]:
    """A structlog processor: every launch token in the record (under `TOKEN_KEYS`, at any
    depth — an identity an agent reports) cut to its `token_hint`. Tokens are secrets (`ehp-fsm
    stop` trusts a process that carries its recorded one), and an agent's log goes where its
    starter sends it (`srun`'s output file, often readable by others)."""
    return {k: _hidden(k, v) for k, v in event.items()}


def _hidden(key: str, value: Any) -> Any:
    if key in TOKEN_KEYS and isinstance(value, str):
        return token_hint(value)
    if isinstance(value, Mapping):
        return {k: _hidden(str(k), v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_hidden("", v) for v in value]
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class ProcessIdentity:
    """One process, unambiguously: a pid alone can be reused after the process dies."""

    host: str
    pid: int
    start_time: float  # `start_time_of(pid)`: seconds since boot, plus the boot's offset
    launch_token: str

    def __post_init__(self) -> None:
        if not self.host:
            raise IdentityError(
                "process identity has no host",
                "identities are per host",
                "capture it with `capture(pid, launch_token=...)`",
            )
        if isinstance(self.pid, bool) or not isinstance(self.pid, int) or self.pid <= 0:
            raise IdentityError(
                f"pid {self.pid!r} is invalid",
                "pids are positive integers",
                "pass the pid the launcher returned",
            )
        if not (
            isinstance(self.start_time, int | float)
            and math.isfinite(self.start_time)
            and self.start_time > 0
        ):
            raise IdentityError(
                f"start time {self.start_time!r} is invalid",
                "it is `start_time_of(pid)`: a positive number of seconds",
                "capture the identity with `capture()`",
            )
        if not self.launch_token:
            raise IdentityError(
                "process identity has no launch token",
                "the token tells our launch from a stranger's process",
                "pass new_launch_token() when launching",
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain fields, as a RECONCILE process entry or a log record carries them."""
        return {
            "host": self.host,
            "pid": self.pid,
            "start_time": self.start_time,
            "launch_token": self.launch_token,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ProcessIdentity:
        try:
            return cls(
                host=data["host"],
                pid=data["pid"],
                start_time=float(data["start_time"]),
                launch_token=data["launch_token"],
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise IdentityError(
                "cannot read a process identity",
                f"{type(exc).__name__}: {exc}",
                "pass host, pid, start_time and launch_token",
            ) from exc

    def matches(self, other: ProcessIdentity) -> bool:
        """Same host, pid, launch token and (within tolerance) start time."""
        return (
            self.host == other.host
            and self.pid == other.pid
            and self.launch_token == other.launch_token
            and abs(self.start_time - other.start_time) <= START_TIME_TOLERANCE_S
        )


def same_record(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> bool:
    """Whether two identity records — plain maps `{host, pid, start_time, token}`, as the
    engine world and the agents' events carry them — name the same process (start times within
    the tolerance). A missing record names nothing."""
    if a is None or b is None:
        return False
    return (
        a.get("host") == b.get("host")
        and a.get("pid") == b.get("pid")
        and a.get("token") == b.get("token")
        and abs(float(a.get("start_time", 0)) - float(b.get("start_time", -1)))
        <= START_TIME_TOLERANCE_S
    )


def capture(pid: int, *, launch_token: str, host: str | None = None) -> ProcessIdentity:
    """The identity of live process `pid` on this host. Raises `IdentityError` if it is gone."""
    try:
        start = start_time_of(pid)
    except psutil.NoSuchProcess as exc:
        raise IdentityError(
            f"process {pid} does not exist",
            "it exited or was never started",
            "capture the identity right after launching",
        ) from exc
    return ProcessIdentity(
        host=host or this_host(), pid=pid, start_time=start, launch_token=launch_token
    )


def _check_local(identity: ProcessIdentity) -> None:
    if identity.host != this_host():
        raise IdentityError(
            f"cannot check a process of host {identity.host!r} from {this_host()!r}",
            "pids and start times are only meaningful on their own host",
            "ask that host's agent (it reports its processes in RECONCILE)",
        )


def same_process(identity: ProcessIdentity) -> bool:
    """True while `identity.pid` still names the process that was captured.

    False when the pid is gone, or is reused by another process (other start time). An exited
    but unreaped child (zombie) is still the same process: see `is_alive`.
    """
    _check_local(identity)
    try:
        start = start_time_of(identity.pid)
    except psutil.NoSuchProcess:
        return False
    return abs(start - identity.start_time) <= START_TIME_TOLERANCE_S


def is_alive(identity: ProcessIdentity) -> bool:
    """`same_process` and not a zombie: the process is still running code."""
    if not same_process(identity):
        return False
    try:
        return bool(psutil.Process(identity.pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def process_state(identity: ProcessIdentity) -> str | None:
    """What `identity`'s process is doing, in psutil's words ("running", "sleeping",
    "stopped", "zombie", ...); None when it is not this machine's or no longer that process."""
    if identity.host != this_host() or not same_process(identity):
        return None
    try:
        return str(psutil.Process(identity.pid).status())
    except psutil.Error:
        return None


@dataclass(frozen=True, kw_only=True, slots=True)
class ProcessExit:
    """A watched process exited. `returncode` is known only for reaped children of ours."""

    identity: ProcessIdentity
    returncode: int | None


def _wait_nohang(pidfd: int) -> os.waitid_result | None:
    """Reap the child behind `pidfd` if it has exited; None while it runs (or if another
    waiter reaped it first)."""
    try:
        return os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)
    except ChildProcessError:
        return None


class ProcessWatcher:
    """pidfds for watched processes: readable the moment the process exits (Linux ≥ 5.3).

    Race-free against pid reuse: the pidfd is opened *first*, then the identity is checked,
    so the fd provably refers to the identified process. Register `fd` with an endpoint's
    `watch_fd`, and call `collect(fd)` when `FdReady(fd)` arrives.
    """

    def __init__(self) -> None:
        if not hasattr(os, "pidfd_open"):
            raise IdentityError(
                "pidfd_open is not available",
                "it needs Linux >= 5.3",
                "poll `is_alive()` from a timer instead",
            )
        self._watched: dict[int, tuple[ProcessIdentity, bool]] = {}

    def watch(self, identity: ProcessIdentity, *, reap: bool = False) -> int:
        """Open a pidfd for `identity`; returns the fd. `reap`: our child, collect its status.

        Only pass `reap=True` for children nobody else waits for (not `subprocess.Popen`
        children: their own `wait()` must reap them). Raises `IdentityError` if the pid is no
        longer that process.
        """
        _check_local(identity)
        try:
            fd = os.pidfd_open(identity.pid)
        except ProcessLookupError as exc:
            raise IdentityError(
                f"process {identity.pid} is gone",
                "it exited before the watch",
                "treat it as exited",
            ) from exc
        if not same_process(identity):
            os.close(fd)
            raise IdentityError(
                f"pid {identity.pid} is another process now",
                "its start time differs from the captured identity",
                "treat the original process as exited",
            )
        self._watched[fd] = (identity, reap)
        return fd

    def collect(self, fd: int) -> ProcessExit | None:
        """If the process behind `fd` has exited: close the fd and return its exit."""
        identity, reap = self._watched[fd]
        returncode: int | None = None
        if reap:
            result = _wait_nohang(fd)
            if result is None:
                if is_alive(identity):
                    return None
                # It exited between the two looks: its status is there now (a zombie is not
                # alive). Without this second look the status was lost and the zombie left.
                result = _wait_nohang(fd)
            if result is not None:
                returncode = (
                    result.si_status if result.si_code == os.CLD_EXITED else -result.si_status
                )
        elif is_alive(identity):
            return None
        self.unwatch(fd)
        return ProcessExit(identity=identity, returncode=returncode)

    def unwatch(self, fd: int) -> None:
        if self._watched.pop(fd, None) is not None:
            os.close(fd)

    def fds(self) -> list[int]:
        return list(self._watched)

    def close(self) -> None:
        for fd in list(self._watched):
            self.unwatch(fd)
