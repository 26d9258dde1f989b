"""Process identities against real processes: spawned, killed, reaped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ehp_fsm.runtime import (
    AgentEndpoint,
    ControllerEndpoint,
    FdReady,
    IdentityError,
    ProcessIdentity,
    ProcessWatcher,
    capture,
    is_alive,
    new_launch_token,
    same_process,
    this_host,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]
SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(SLEEPER)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_live_process_is_itself(child: subprocess.Popen[bytes]) -> None:
    ident = capture(child.pid, launch_token=new_launch_token())
    assert ident.host == this_host()
    assert same_process(ident) and is_alive(ident)
    assert ProcessIdentity.from_dict(ident.to_dict()) == ident
    assert ident.matches(capture(child.pid, launch_token=ident.launch_token))
    assert not ident.matches(capture(child.pid, launch_token="someone-else"))


def test_killed_process_is_not_alive_then_not_itself(child: subprocess.Popen[bytes]) -> None:
    ident = capture(child.pid, launch_token="t")
    child.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while is_alive(ident):  # exited but not yet reaped: a zombie, still "the same process"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert same_process(ident)
    child.wait()
    assert not same_process(ident) and not is_alive(ident)


def test_recycled_pid_is_not_the_same_process(child: subprocess.Popen[bytes]) -> None:
    # Making the kernel hand out one exact pid again is impractical in a test. A recycled pid
    # looks like this to us: the pid is live, but the process behind it started at another
    # time than the one we captured. So we take a live pid and an identity with a start time
    # one second earlier — exactly what a controller holds for a dead process whose pid a new
    # process reuses — and check that it is refused.
    real = capture(child.pid, launch_token="t")
    recycled = ProcessIdentity(
        host=real.host, pid=real.pid, start_time=real.start_time - 1.0, launch_token="t"
    )
    assert same_process(real)
    assert not same_process(recycled) and not is_alive(recycled)
    with pytest.raises(IdentityError, match="another process"):
        ProcessWatcher().watch(recycled)


def test_identities_of_other_hosts_are_not_checked_here() -> None:
    other = ProcessIdentity(
        host=this_host() + "-elsewhere", pid=os.getpid(), start_time=1.0, launch_token="t"
    )
    with pytest.raises(IdentityError, match="only meaningful on their own host"):
        same_process(other)


@pytest.mark.parametrize(
    "fields",
    [
        {"host": "", "pid": 1, "start_time": 1.0, "launch_token": "t"},
        {"host": "h", "pid": 0, "start_time": 1.0, "launch_token": "t"},
        {"host": "h", "pid": True, "start_time": 1.0, "launch_token": "t"},
        {"host": "h", "pid": 1, "start_time": float("nan"), "launch_token": "t"},
        {"host": "h", "pid": 1, "start_time": 1.0, "launch_token": ""},
    ],
)
def test_invalid_identities_are_refused(fields: dict[str, object]) -> None:
    with pytest.raises(IdentityError, match="Fix:"):
        ProcessIdentity(**fields)  # type: ignore[arg-type]


def test_capture_of_a_missing_process_raises() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    with pytest.raises(IdentityError, match="does not exist"):
        capture(proc.pid, launch_token="t")


def test_watcher_reports_death_through_an_endpoint_poll(child: subprocess.Popen[bytes]) -> None:
    watcher = ProcessWatcher()
    ident = capture(child.pid, launch_token="t")
    fd = watcher.watch(ident)  # Popen reaps its own child: reap=False
    with ControllerEndpoint() as ctl, AgentEndpoint(connect=ctl.endpoint, host_id="h") as agent:
        agent.watch_fd(fd)
        assert not [i for i in agent.poll(0.05) if isinstance(i, FdReady)]
        assert watcher.collect(fd) is None  # still running: nothing to collect
        killed_at = time.monotonic()
        child.kill()
        ready: list[object] = []
        while not ready:
            assert time.monotonic() - killed_at < 5
            ready = [i for i in agent.poll(1.0) if isinstance(i, FdReady)]
        assert ready == [FdReady(fd=fd)]
        agent.unwatch_fd(fd)
        exit_ = watcher.collect(fd)
        assert exit_ is not None and exit_.identity == ident and exit_.returncode is None
    assert child.wait() == -signal.SIGKILL
    assert watcher.fds() == []


def _child_that_exits_3_when_its_stdin_closes() -> tuple[int, int]:
    """A child of ours (posix_spawn, no Popen to reap it) and the write end of its stdin."""
    read_end, write_end = os.pipe()
    pid = os.posix_spawn(
        sys.executable,
        [sys.executable, "-c", "import sys; sys.stdin.read(); sys.exit(3)"],
        os.environ,
        file_actions=[(os.POSIX_SPAWN_DUP2, read_end, 0)],
    )
    os.close(read_end)
    return pid, write_end


def test_watcher_reaps_its_own_children_with_their_status() -> None:
    watcher = ProcessWatcher()
    pid, write_end = _child_that_exits_3_when_its_stdin_closes()
    fd = watcher.watch(capture(pid, launch_token="t"), reap=True)
    assert watcher.collect(fd) is None
    os.close(write_end)
    deadline = time.monotonic() + 10
    while (exit_ := watcher.collect(fd)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert exit_.returncode == 3
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # already reaped by the watcher
    watcher.close()


def test_a_child_that_exits_between_the_watchers_two_looks_keeps_its_status(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The watcher's first look (waitid) sees the child running; it exits before the second
    # (is_alive). Its exit status must still be collected, and the zombie reaped.
    from ehp_fsm.runtime import identity as identity_module

    watcher = ProcessWatcher()
    pid, write_end = _child_that_exits_3_when_its_stdin_closes()
    fd = watcher.watch(capture(pid, launch_token="t"), reap=True)
    real_is_alive = identity_module.is_alive

    def exits_now(ident: ProcessIdentity) -> bool:
        os.close(write_end)  # the child exits now, after the watcher's waitid saw it running
        deadline = time.monotonic() + 10
        while real_is_alive(ident):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        return False

    monkeypatch.setattr(identity_module, "is_alive", exits_now)
    exit_ = watcher.collect(fd)
    assert exit_ is not None and exit_.returncode == 3
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # reaped, not left a zombie
    watcher.close()


def test_a_start_time_counts_ticks_since_boot_and_reads_no_clock(
    child: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """psutil's create_time() adds the boot time the kernel derives from the wall clock: once
    the clock was set, a process started afterwards read every identity recorded before off by
    the step, and `stop`, `--resume` and restarted agents took the run's live processes for
    strangers. A start time is ticks since boot (plus a per-boot offset): no clock is read."""
    from ehp_fsm.runtime import identity

    first = identity.start_time_of(child.pid)
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    since_boot = first - identity._this_boot()
    assert 0 < since_boot <= uptime + 0.02  # the child started after boot, before now
    assert uptime - since_boot < 60  # ... and recently (this test started it)

    def no_clock(*_: object) -> float:
        raise AssertionError("a start time must not read a clock")

    monkeypatch.setattr(time, "time", no_clock)
    monkeypatch.setattr(identity.psutil, "boot_time", no_clock)
    assert identity.start_time_of(child.pid) == first
    with pytest.raises(identity.psutil.NoSuchProcess):
        identity.start_time_of(2**22 + 1)  # above Linux's pid limit: never a process
