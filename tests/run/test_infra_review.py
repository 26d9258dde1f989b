"""An SRE's bad day where the machine misbehaves, not the run's peers — found by running
`ehp-fsm run` of the short plan by hand under a memory limit (`prlimit --as`), a low open-files
limit (`ulimit -n`), a file-size limit (`ulimit -f`), an `ipc://` controller path another run
listens on or too long for a Unix socket, and a run directory whose path is not UTF-8.

Real processes, files, sockets and resource limits throughout; no part of the run is faked.
"""

from __future__ import annotations

import errno
import os
import re
import resource
import socket
import subprocess
import sys
import tempfile
import textwrap
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ehp_fsm.cli import main
from ehp_fsm.errors import PlanError
from ehp_fsm.plan import load_plan
from ehp_fsm.runtime.errors import TransportError
from tests.run.soundness import assert_run_sound, processes_of_test
from tests.run.test_run import plan_text

_READ_UNDER_A_MEMORY_LIMIT = textwrap.dedent(
    """
    import resource, sys
    from pathlib import Path
    from ehp_fsm.fspaths import read_own_json
    path = Path(sys.argv[1])
    used = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
    # room for what the interpreter holds and 32 MiB more: less than the 64 MiB limit
    resource.setrlimit(resource.RLIMIT_AS, (used + (32 << 20), resource.RLIM_INFINITY))
    print(read_own_json(path, 64 << 20)["pid"])
    """
)


def test_a_small_run_file_is_read_under_a_memory_limit(tmp_path: Path) -> None:
    """`ehp-fsm run` under `prlimit --as=1000000000` ended with a `MemoryError` traceback at
    its end (`stop_leftovers` reading `run.json`): a 900-byte file was read with `read(64 MiB
    + 1)`, which takes its 64 MiB before it reads. A real process under a real address-space
    limit reads the file."""
    path = tmp_path / "run.json"
    path.write_text('{"pid": 1234}')
    done = _script(_READ_UNDER_A_MEMORY_LIMIT, str(path))
    assert done.returncode == 0 and done.stdout.strip() == "1234", done.stderr[-2000:]


def _script(text: str, *args: str, **how: Any) -> subprocess.CompletedProcess[str]:
    """`python -c TEXT ARGS...` in a process of its own, from the repository's root, its output
    captured; 60 s at most. `how`: more of `subprocess.run`'s arguments."""
    return subprocess.run(
        [sys.executable, "-c", text, *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
        **how,
    )


def _short_plan(tmp: Path, steps: int = 2, controller: str | None = None) -> Path:
    log = tmp / "run" / "transitions.jsonl"
    text = plan_text(log, steps)
    if controller is not None:
        text = text.replace('controller = "tcp://127.0.0.1:*"', f'controller = "{controller}"')
    plan = tmp / "plan.toml"
    plan.write_text(text)
    return plan


def _limited(soft: int, hard: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _run_limited(
    plan: Path, limit: Callable[..., None], *args: int
) -> tuple[str, subprocess.CompletedProcess[str]]:
    """`ehp-fsm run PLAN` in a process (and all it starts) under `limit(*args)`, tagged with a
    fresh test-run id so that what it left running can be found: (the id, its result)."""
    run_id = uuid.uuid4().hex
    done = subprocess.run(
        [sys.executable, "-m", "ehp_fsm.cli", "run", str(plan)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "EHP_TEST_RUN": run_id},
        preexec_fn=lambda: limit(*args),
    )
    return run_id, done


@pytest.mark.slow  # the CLI's imports in a fresh process: ~5 s on a busy machine
@pytest.mark.timeout(200)
def test_a_run_with_too_few_open_files_is_refused_before_it_starts(tmp_path: Path) -> None:
    """`prlimit --nofile=20:20 ehp-fsm run PLAN`: before, the run started its agents and
    engines, then ended in a traceback (`zmq.error.ZMQError: Too many open files`, exit 1),
    or libzmq aborted it (`Too many open files (src/epoll.cpp:38)`, SIGABRT: no receipt, no
    word); at 32, an error blaming a damaged revision ("re-publish the revision ... never
    install a damaged one"). Now: exit 2 before anything starts or is written, one line
    naming the limit, what the plan needs and `ulimit -n`; nothing left running."""
    run_id, done = _run_limited(_short_plan(tmp_path), _limited, 20, 20)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "the run may hold 20 open files (`ulimit -n`; hard limit 20)" in done.stderr
    # 48 + 2 for each host and each engine (`open_files_needed`): 2 hosts and 2 engines
    assert "needs at least 56" in done.stderr and "`ulimit -n 1024`" in done.stderr
    assert not (tmp_path / "run" / "run.lock").exists()  # nothing written
    assert not processes_of_test(run_id)


_RAISES_ITS_LIMIT = textwrap.dedent(
    """
    import resource, sys
    from ehp_fsm.plan import load_plan
    from ehp_fsm.run.job import raise_open_files
    raise_open_files(load_plan(sys.argv[1]))
    print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    """
)


def test_a_run_raises_a_low_soft_open_files_limit_within_the_hard_one(tmp_path: Path) -> None:
    """`prlimit --nofile=20:4096 ehp-fsm run PLAN` failed as above although the hard limit
    allowed 4096: the run now raises its soft limit (which what it starts inherits) to the
    hard one. A real process with the real limits."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    want = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    done = _script(
        _RAISES_ITS_LIMIT, str(_short_plan(tmp_path)), preexec_fn=lambda: _limited(20, want)
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout) == want


_OUT_OF_FILES_IN_THE_RUN = textwrap.dedent(
    """
    import os, resource, sys
    from ehp_fsm.errors import EhpError
    from ehp_fsm.plan import load_plan
    from ehp_fsm.run.job import Job, _out_of_files
    job = Job(load_plan(sys.argv[1]), out=sys.stdout, live=False, verify=False, steps=None)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    held = []
    try:
        while True:
            held.append(os.open(sys.argv[1], os.O_RDONLY))
    except OSError as exc:
        cause = exc
    for fd in held:
        os.close(fd)
    try:  # as the revision store says it, quoting the OS's error
        raise EhpError("revision r2 cannot be used", f"the manifest cannot be read ({cause})",
                       "re-publish the revision from the trainer") from None
    except EhpError as exc:
        print(_out_of_files(exc, job))
    print(_out_of_files(OSError(2, "No such file or directory"), job))
    """
)


def test_too_many_open_files_during_a_run_is_named_as_such(tmp_path: Path) -> None:
    """The run's soft limit at 32 (under what the short plan needs, before the run refused
    such a limit): its revision's manifest could not be opened, and the error said to
    re-publish a damaged revision. An error that quotes "Too many open files" now stops the
    run naming the limit and how to raise it; other errors are left as they are. A real
    EMFILE, from a real process past its real limit."""
    done = _script(_OUT_OF_FILES_IN_THE_RUN, str(_short_plan(tmp_path)))
    assert done.returncode == 0, done.stderr[-2000:]
    first, second = done.stdout.splitlines()
    assert first.startswith("the run stopped after step 0: [Errno 24] Too many open files: '")
    assert "may hold 64 open files (`ulimit -n`" in first and "raise the limit" in first
    assert "damaged" not in first and "re-publish" not in first
    assert second == "None"


_OUT_OF_FILES_BY_A_FLOOD = textwrap.dedent(
    """
    import os, resource, socket, sys
    from ehp_fsm.plan import load_plan
    from ehp_fsm.run.job import Job, _out_of_files
    job = Job(load_plan(sys.argv[1]), out=sys.stdout, live=False, verify=False, steps=None)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    flood = [socket.socketpair() for _ in range(int(sys.argv[2]))]  # connections held open
    held = []
    try:
        while True:
            held.append(os.open(sys.argv[1], os.O_RDONLY))
    except OSError as exc:
        cause = exc
    said = _out_of_files(cause, job)  # while every descriptor is taken, as in a flood
    for fd in held:
        os.close(fd)
    print(said)
    """
)


@pytest.mark.parametrize("pairs", [10, 400])
def test_too_many_open_files_held_by_a_connection_flood_names_the_flood(
    tmp_path: Path, pairs: int
) -> None:
    """Another local user's 20,000 idle connections to the run's ports (a CURVE socket holds
    each one until its handshake times out) stopped the run with "Too many open files", and
    the error blamed `ulimit -n` alone (an attacker's find). With far more sockets open than
    the plan's run opens (800 here; the short plan's run needs ~60 files), it names them and
    how to find what holds them; with a few (20), the limit as before. Real sockets (socket
    pairs: the far edge, another user's connections, faked), a real EMFILE."""
    done = _script(_OUT_OF_FILES_BY_A_FLOOD, str(_short_plan(tmp_path)), str(pairs))
    assert done.returncode == 0, done.stderr[-2000:]
    said = done.stdout.strip()
    assert said.startswith("the run stopped after step 0: [Errno 24] Too many open files"), said
    if pairs == 10:
        assert "may hold 1024 open files (`ulimit -n`" in said and "are sockets" not in said, said
    else:
        assert f"{2 * pairs} of the " in said and "are sockets, far more than" in said, said
        assert "`ss -tlnp` shows them for pid" in said and "hosts of your own" in said, said


def test_an_ipc_controller_path_a_live_process_listens_on_is_refused_and_left_to_it() -> None:
    """Two runs of two plans with the same `ipc://` controller path: the second bound it
    without a word (ZeroMQ removes the socket file there first), and the first's agents,
    reconnecting, reached the second's controller; the start's own port check, binding and
    closing, removed the path, so nothing new reached the first run at all. A real Unix socket
    listens there (a short folder: a socket's path holds 107 bytes)."""
    where = Path(tempfile.mkdtemp(prefix="ehp-ipc-", dir="/tmp"))
    path = where / "ctl.sock"
    holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        holder.bind(str(path))
        holder.listen()
        plan = load_plan(_short_plan(where, controller=f"ipc://{path}"))
        from ehp_fsm.run.startup import check_controller_port

        with pytest.raises(TransportError) as err:
            check_controller_port(plan)
        assert f"cannot bind the controller to ipc://{path}" in str(err.value)
        assert "another process listens on that path" in str(err.value)
        assert "give each run its own ipc:// path" in err.value.fix
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with probe:  # the live listener's path is as it was
            probe.connect(str(path))
        holder.close()  # a socket file no one listens on (a killed run's) is the bind's to take
        check_controller_port(plan)
    finally:
        holder.close()
        import shutil

        shutil.rmtree(where, ignore_errors=True)


def test_an_ipc_controller_path_too_long_for_a_socket_says_to_shorten_it(tmp_path: Path) -> None:
    """An `ipc://` path over 107 bytes: refused with ZeroMQ's words and the fix "pick a free
    port (or `*` for any), and check the address exists", which no port fixes."""
    path = tmp_path / ("d" * 100) / "controller.sock"
    with pytest.raises(PlanError) as err:  # by `check` too: the plan refuses it
        load_plan(_short_plan(tmp_path, controller=f"ipc://{path}"))
    assert "transport.controller" in str(err.value)
    assert f"its path is {len(str(path))} bytes" in str(err.value)
    assert "shorter ipc:// path" in str(err.value) and "free port" not in str(err.value)


def test_a_file_past_the_file_size_limit_is_not_called_a_full_disk(tmp_path: Path) -> None:
    """`prlimit --fsize=320000 ehp-fsm run PLAN` (40 steps): the log's write failed with
    "File too large" and the error said to free space on the disk — no space was missing: the
    shell's `ulimit -f` was reached. A real write past a real file-size limit (Python ignores
    SIGXFSZ, so the write fails with EFBIG)."""
    from ehp_fsm.run.job import Job, _os_error

    plan = load_plan(_short_plan(tmp_path))
    job = Job(plan, out=sys.stdout, live=False, verify=False, steps=None)
    before = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, before[1]))
    caught: OSError | None = None
    try:
        with open(tmp_path / "big", "wb") as fh:
            fh.write(b"x" * 8192)
            fh.flush()
    except OSError as exc:
        caught = exc
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, before)
    assert caught is not None and caught.errno == errno.EFBIG
    error = _os_error(caught, job)
    assert "File too large" in str(error)
    assert "raise the file-size limit" in error.fix and "`ulimit -f" in error.fix
    assert "4096 bytes" not in error.fix  # the limit as it is now, put back
    assert "free space" not in error.fix
    assert "ehp-fsm run PLAN" in error.fix


def test_a_run_directory_whose_path_is_not_utf8_is_refused_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A relative `[run] log` from a current directory named in Latin-1 (a byte that is not
    UTF-8): the run started its agents and engines, then its trainer pool failed with torch's
    "TypeError: __init__(): incompatible constructor arguments" for the rendezvous file, and
    the fix to start fewer warm workers. Now refused at once, naming the folder."""
    odd = Path(os.fsdecode(os.fsencode(str(tmp_path)) + b"/caf\xe9"))
    odd.mkdir()
    plan = _short_plan(tmp_path)  # the plan itself in a UTF-8 folder, its log relative
    text, n = re.subn(r"(?m)^log = .*$", 'log = "run/transitions.jsonl"', plan.read_text())
    assert n == 1
    plan.write_text(text)
    monkeypatch.chdir(odd)
    assert main(["run", str(plan)]) == 2
    err = capsys.readouterr().err
    assert "is not UTF-8 text" in err and "rename that folder" in err, err
    assert not (odd / "run" / "run.lock").exists()


def _fsize(limit: int) -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


@pytest.mark.slow  # a run's start: ~10-15 s
@pytest.mark.timeout(300)
def test_a_first_revision_past_the_file_size_limit_says_how_to_go_on(tmp_path: Path) -> None:
    """`prlimit --fsize=100000 ehp-fsm run PLAN` (the tiny model's revision is ~300 KB): the
    error's fix was "check the disk under the run directory" — nothing of the limit, nor of
    how to go on once it is seen to. Now it says to raise the file-size limit and to start
    again; the receipt is written and nothing is left running. A real limit on the run and
    every process it starts."""
    run_id, done = _run_limited(_short_plan(tmp_path), _fsize, 100_000)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "revision 1 (the weights the run starts from) could not be saved" in done.stderr
    assert "File too large" in done.stderr and "`ulimit -f unlimited`" in done.stderr
    assert "then start the run again with `ehp-fsm run PLAN`" in done.stderr
    assert (tmp_path / "run" / "receipt.json").is_file()
    assert not processes_of_test(run_id)


_END_WITHOUT_THREADS = textwrap.dedent(
    """
    import resource, sys, threading
    from pathlib import Path
    from ehp_fsm.rollout.client import SGLangClient
    from ehp_fsm.run.ending import engine_revisions
    from tests.core.scenario import Scenario
    s = Scenario()
    s.serving_engine("e0")
    client = SGLangClient("http://127.0.0.1:9", timeout_s=1.0)  # nothing listens there
    used = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
    threading.stack_size(256 << 20)  # a thread's stack no longer fits under the limit
    resource.setrlimit(resource.RLIMIT_AS, (used + (128 << 20), resource.RLIM_INFINITY))
    try:
        threading.Thread(target=print).start()
    except RuntimeError as exc:
        print("no thread:", exc)
    print(engine_revisions({"e0": client}, s.world))
    """
)


def test_the_runs_end_asks_the_engines_when_no_thread_can_start(tmp_path: Path) -> None:
    """The run process's memory limit reached at its end (`prlimit --pid RUN --as=<its size
    + 2 MB>` after step 3 of 40): every step ran, then `engine_revisions` could not start
    its threads and "RuntimeError: can't start new thread" raised out of the run's end —
    a traceback, exit 1, no summary and no receipt, before the engines were stopped. Now the
    engines are asked one at a time. A real process whose threads cannot start under a real
    address-space limit; the engine's address answers nothing (a real refused connection)."""
    done = _script(_END_WITHOUT_THREADS)
    assert done.returncode == 0, done.stderr[-2000:]
    said, answers = done.stdout.splitlines()
    assert said == "no thread: can't start new thread"
    assert answers.startswith("{'e0': 'unreachable:"), answers


def _address_space(limit: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


_OUT_OF_MEMORY_IN_THE_RUN = textwrap.dedent(
    """
    import resource, sys, threading
    from pathlib import Path
    from ehp_fsm.errors import EhpError
    from ehp_fsm.plan import load_plan
    from ehp_fsm.run.job import Job, _out_of_memory
    job = Job(load_plan(sys.argv[1]), out=sys.stdout, live=False, verify=False, steps=None)
    used = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (used + (256 << 20), resource.RLIM_INFINITY))
    try:
        held = bytearray(1 << 30)
    except MemoryError as exc:
        print(_out_of_memory(exc, job))
    started = []
    try:  # each thread maps a stack: the limit stops one from starting
        while True:
            started.append(threading.Thread(target=threading.Event().wait, args=(5,), daemon=True))
            started[-1].start()
    except RuntimeError as exc:
        cause = exc
    try:  # as a step says it, during the handling of the thread's error
        try:
            raise cause
        except RuntimeError:
            raise EhpError("revision r2 was not published", "an install failed", "resume")
    except EhpError as exc:
        print(_out_of_memory(exc, job))
    print(_out_of_memory(OSError(2, "No such file or directory"), job))
    """
)


def test_out_of_memory_or_threads_during_a_run_is_named_as_such(tmp_path: Path) -> None:
    """Under `prlimit --as=1500000000` (before the run refused such a limit) the run died now
    and then with a traceback ("RuntimeError: can't start new thread" as an install was
    kicked). A `MemoryError` or a thread that cannot start, anywhere in an error's chain, now
    stops the run naming the limits and how to go on; other errors are left as they are. A
    real `MemoryError` and a real thread refused, in a real process past its real limit."""
    done = _script(_OUT_OF_MEMORY_IN_THE_RUN, str(_short_plan(tmp_path)))
    assert done.returncode == 0, done.stderr[-2000:]
    memory, thread, other = done.stdout.splitlines()
    assert memory.startswith("the run stopped after step 0: out of memory (MemoryError"), memory
    assert thread.startswith("the run stopped after step 0: a thread could not start ("), thread
    for said in (memory, thread):
        assert "bytes of memory each (`ulimit -v`)" in said and "(`ulimit -u`)" in said, said
        assert "raise the limit or free the machine's memory" in said, said
    assert other == "None"


@pytest.mark.slow  # the CLI's imports in a fresh process, twice: ~5-10 s on a busy machine
@pytest.mark.timeout(200)
@pytest.mark.parametrize("limit", [1_000_000_000, 1_500_000_000])
def test_a_run_under_a_low_memory_limit_is_refused_before_anything_starts(
    tmp_path: Path, limit: int
) -> None:
    """`prlimit --as=1000000000 ehp-fsm run PLAN`: the Core's worker died importing
    transformers, and the error named the limit; but on another machine (more cores, more
    threads) the run's own process passed the limit first and libzmq aborted it ("FATAL ERROR:
    OUT OF MEMORY", exit -6, no receipt). Under 1.5 GB the run died now and then with a
    traceback (a thread could not start). Now such a limit is refused before anything
    starts, naming it and `ulimit -v`; nothing is started, no log is begun. A real limit on
    the run's process."""
    plan = _short_plan(tmp_path)
    run_id, done = _run_limited(plan, _address_space, limit)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"may map at most {limit:,} bytes of memory each (`ulimit -v`)" in done.stderr
    assert "`ulimit -v unlimited`" in done.stderr, done.stderr
    assert not (tmp_path / "run" / "transitions.jsonl").exists()
    assert not processes_of_test(run_id)


@pytest.mark.slow  # a run to its third step, then its resume to the end: ~40 s
@pytest.mark.timeout(400)
def test_a_log_past_the_file_size_limit_mid_run_is_named_and_the_resume_finishes(
    tmp_path: Path,
) -> None:
    """`prlimit --pid RUN --fsize=<the log's size + 3000>` after step 3 of 30: the run stopped
    naming its run directory ("File too large (/runs/x)") and saying to free space, which was
    not what was missing. Now it names the log and the file-size limit; the log replays, and
    once the limit is gone `--resume` finishes and the log — both segments — replays. Real
    processes and a real limit, set on the running run as `prlimit --pid` does."""
    import psutil

    from ehp_fsm.replay import replay

    plan = _short_plan(tmp_path, steps=30)
    log = tmp_path / "run" / "transitions.jsonl"
    run_id = uuid.uuid4().hex
    env = {**os.environ, "EHP_TEST_RUN": run_id}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ehp_fsm.cli", "run", str(plan)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("step 3/"):
                break
        else:
            pytest.fail("the run ended before its third step")
        hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        psutil.Process(proc.pid).rlimit(resource.RLIMIT_FSIZE, (log.stat().st_size + 3000, hard))
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 2, err[-3000:]
    assert f"File too large ({log})" in err, err[-3000:]
    assert "raise the file-size limit" in err and "--resume" in err, err[-3000:]
    replay(log)  # (raises on a line that does not verify)
    done = subprocess.run(
        [sys.executable, "-m", "ehp_fsm.cli", "run", str(plan), "--resume"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "last step 30, final revision 31" in done.stdout
    # both segments replay; ledger, groups, GPUs free, nothing the run recorded running
    assert_run_sound(log, run_id=run_id)
