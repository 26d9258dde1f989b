"""The `ehp-fsm` command as a user runs it (a real subprocess of the installed console script)."""

from __future__ import annotations

import errno
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.procs import as_from_a_terminal

ROOT = Path(__file__).resolve().parents[2]
EXE = shutil.which("ehp-fsm", path=str(Path(sys.executable).parent)) or "ehp-fsm"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [EXE, *args], capture_output=True, text=True, cwd=ROOT, timeout=60, check=False
    )


def test_help_lists_the_commands() -> None:
    out = run("--help")
    assert out.returncode == 0
    for cmd in ("check", "spec", "replay", "run"):
        assert cmd in out.stdout


def test_every_option_of_every_command_says_what_it_does() -> None:
    """`ehp-fsm simulate --help` listed `--ehp {on,off,both}` and `--faults {off,on,heavy}`
    with no word of what they do (`both` runs twice and compares, `heavy` is 5,000 times the
    plan's fault rates), nor did `init-model --help` for `--arch`."""
    import argparse

    from ehp_fsm.cli import build_parser
    from ehp_fsm.sim.costs import FAULT_LEVELS

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    silent = [
        f"{name} {action.option_strings[0]}"
        for name, command in sub.choices.items()
        for action in command._actions
        if action.option_strings and not action.help
    ]
    assert silent == [], silent
    simulate = {a.dest: a.help or "" for a in sub.choices["simulate"]._actions}
    assert f"{FAULT_LEVELS['heavy']:,.0f} times" in simulate["faults"], simulate["faults"]
    assert "compared" in simulate["ehp"], simulate["ehp"]


def test_check_prints_roles_and_capacities() -> None:
    out = run("check", "tests/core/plan.toml")
    assert out.returncode == 0, out.stderr
    assert "valid; 7 machine specs checked" in out.stdout
    assert "core: torch TP1×PP1×CP1×DP2" in out.stdout
    assert "3 engines (3×TP1)" in out.stdout
    # which lanes train where, and who launches them (a lane's host's agent, when elsewhere)
    assert "trains on: Core lanes 0, 1 on h0; a Hybrid on the host it is borrowed on (h1, h2)" in (
        out.stdout
    )
    assert "launched by: the run, for a lane whose host's agent runs on its machine" in out.stdout
    assert "not available with this plan: agents on other machines read the revisions" in out.stdout


def test_check_refuses_a_bad_plan_with_its_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(
        (ROOT / "tests/core/plan.toml").read_text().replace("replica_size = 1", "replica_size = 3")
    )
    out = run("check", str(bad))
    assert out.returncode == 2
    assert "plan key `ehp.replica_size` is invalid" in out.stderr
    assert "Fix: set replica_size = 1" in out.stderr


def test_spec_mermaid_diagram() -> None:
    out = run("spec", "rollout_engine", "--format", "mermaid")
    assert out.returncode == 0
    assert "stateDiagram-v2" in out.stdout
    assert "installing --> serving: installed [installed_current_revision]" in out.stdout
    assert "stopped --> [*]" in out.stdout
    assert out.stdout.startswith("---\ntitle: rollout_engine\n---\n")  # the YAML mermaid reads


def test_spec_mermaid_of_every_machine_is_one_markdown_document() -> None:
    """Without a machine, the diagrams were printed one after another, each with its own
    front matter: no one mermaid document (a renderer took the first, or none)."""
    out = run("spec", "--format", "mermaid")
    assert out.returncode == 0
    blocks = out.stdout.split("```mermaid\n")[1:]
    assert len(blocks) == 7 and all(b.split("```")[0].count("stateDiagram-v2") == 1 for b in blocks)
    assert out.stdout.count("```") == 14 and "## rollout_engine" in out.stdout


def test_spec_text_and_unknown_machine() -> None:
    assert "<new> --request--> requested" in run("spec", "hybrid_replica").stdout
    out = run("spec", "toaster")
    assert out.returncode == 2 and "unknown machine 'toaster'" in out.stderr


def test_replay_golden_and_tampered(tmp_path: Path) -> None:
    golden = ROOT / "tests/golden/borrow_and_return.jsonl"
    out = run("replay", str(golden))
    assert out.returncode == 0 and out.stdout.startswith("148 transitions verified")
    lines = golden.read_text().splitlines(keepends=True)
    lines[40] = lines[40].replace('"accepted":true', '"accepted":false', 1)
    bad = tmp_path / "t.jsonl"
    bad.write_text("".join(lines))
    out = run("replay", str(bad))
    assert out.returncode == 2 and "replay diverges at line 41" in out.stderr


def test_replay_at_prints_the_world() -> None:
    out = run("replay", "tests/golden/borrow_and_return.jsonl", "--at", "12")
    assert out.returncode == 0
    assert '"h0:g0": {' in out.stdout and "world at seq 12" in out.stderr
    json.loads(out.stdout)  # the world alone: `| jq` reads it (what is said of it: stderr)


def test_run_refuses_a_bad_plan_before_anything(tmp_path: Path) -> None:
    out = run("run", str(tmp_path / "nope.toml"))
    assert out.returncode == 2 and "cannot be read" in out.stderr


def test_replay_draws_the_gpu_timeline(tmp_path: Path) -> None:
    out = run("replay", "tests/golden/borrow_and_return.jsonl", "--timeline", str(tmp_path / "tl"))
    assert out.returncode == 0, out.stderr
    png, svg = tmp_path / "tl.png", tmp_path / "tl.svg"
    assert png.read_bytes().startswith(b"\x89PNG")
    assert "<svg" in svg.read_text()


def test_replay_refuses_a_timeline_that_is_no_file_before_replaying(tmp_path: Path) -> None:
    """`--timeline /dev/null` wrote /dev/null.png and /dev/null.svg into /dev (as root), and a
    folder named OUT.png failed only after the whole log was replayed, its verdict unsaid."""
    (tmp_path / "tl.png").mkdir()
    for out, said in (
        ("/dev/null", "'/dev/null' is a device"),
        (str(tmp_path / "tl"), "tl.png is a folder"),
    ):
        done = run("replay", "tests/golden/borrow_and_return.jsonl", "--timeline", out)
        assert done.returncode == 2 and said in done.stderr, done.stderr
        assert "transitions verified" not in done.stdout and "Traceback" not in done.stderr
    assert not Path("/dev/null.png").exists() and not Path("/dev/null.svg").exists()


def test_a_timeline_that_cannot_be_written_comes_after_the_verdict() -> None:
    """/proc takes no new file (not even root's): the log's verdict is said first, then why the
    picture is missing, exit 2."""
    done = run("replay", "tests/golden/borrow_and_return.jsonl", "--timeline", "/proc/tl")
    assert done.returncode == 2, done.stderr
    assert "transitions verified" in done.stdout, done.stdout
    assert "the timeline '/proc/tl' cannot be written" in done.stderr, done.stderr
    assert "the log was verified" in done.stderr and "Traceback" not in done.stderr


def test_replay_of_a_missing_file_or_a_directory_is_an_error_not_a_traceback(
    tmp_path: Path,
) -> None:
    for target, why in (
        (tmp_path / "missing.jsonl", "because it does not exist."),
        (tmp_path, "because it is a directory."),
        (Path("/dev/null"), "because it is not a regular file (a device, a pipe or a socket)."),
    ):
        out = run("replay", str(target))
        assert out.returncode == 2 and "is not a log file" in out.stderr, out.stderr
        assert why in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_log_that_cannot_be_read_is_told_so_not_to_check_the_disk_has_room(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`replay /proc/self/mem` (EIO on its first read) and `replay /proc/1/environ` (as
    another user: permission denied) ended "Fix: check that the path ... is writable, and
    that its disk has room" — a writer's advice, for a read. Permission is denied at the
    edge here (the tests may run as root, who reads every file)."""
    from ehp_fsm.cli import main

    assert main(["replay", "/proc/self/mem"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ehp-fsm: error: /proc/self/mem cannot be read: because reading it ")
    assert "input/output error (EIO)" in err and "copy it to a regular file" in err, err
    assert "disk has room" not in err and "writable" not in err, err
    log = ROOT / "tests" / "golden" / "borrow_and_return.jsonl"
    real_open = Path.open

    def denied(path: Path, *args: Any, **kw: Any) -> Any:
        if path == log:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kw)

    monkeypatch.setattr(Path, "open", denied)
    assert main(["replay", str(log)]) == 2
    err = capsys.readouterr().err
    assert f"{log} cannot be read: because this user may not read it (permission" in err, err
    assert f"check its permissions (`ls -l {log}`)" in err, err
    assert "disk has room" not in err and "Traceback" not in err, err


def test_an_os_error_no_command_named_gets_a_fix_for_what_failed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The one fix of every unnamed `OSError` said "is writable, and that its disk has
    room", for a read's permission or I/O error too: a write's advice goes with a write's
    errors (a full disk, a read-only file system) alone."""
    import ehp_fsm.cli

    said = {}
    for code in (errno.ENOSPC, errno.EROFS, errno.EIO, errno.EACCES, errno.ENOENT):

        def fail(_: object, code: int = code) -> int:
            raise OSError(code, os.strerror(code), "some/path")

        monkeypatch.setattr(ehp_fsm.cli, "_cmd_spec", fail)
        assert ehp_fsm.cli.main(["spec"]) == 2
        said[code] = capsys.readouterr().err
        assert "(some/path). Fix: " in said[code] and "Traceback" not in said[code]
    for code in (errno.ENOSPC, errno.EROFS):
        assert "is writable and that its disk has room" in said[code], said[code]
    for code in (errno.EIO, errno.EACCES, errno.ENOENT):
        assert "disk has room" not in said[code], said[code]
    assert "must be able to read what the command reads" in said[errno.EACCES]
    assert "special file (under /proc or /dev)" in said[errno.EIO], said[errno.EIO]


def test_run_refuses_steps_below_one() -> None:
    out = run("run", "examples/local.toml", "--steps", "-3")
    assert out.returncode == 2 and "--steps -3" in out.stderr, out.stderr


def test_the_command_exits_without_the_collector_walking_its_heap(tmp_path: Path) -> None:
    """When the command's work is done, its heap is frozen (`cli.entry`): an exit handler sees
    it frozen, whatever the exit code, as the console script and as `python -m ehp_fsm.cli`
    (what the tests start). Before, the interpreter's teardown walked the whole heap with the
    cyclic collector: after a run (torch, transformers, matplotlib, the run's state) 1.5–3 s
    between the receipt's line and the exit, ~8 s after a Megatron `run --verify`, that every
    caller waited for."""
    (tmp_path / "sitecustomize.py").write_text(
        "import atexit, gc, sys\n"
        "atexit.register(lambda: print(f'frozen at exit: {gc.get_freeze_count() > 0}', "
        "file=sys.stderr))\n"
    )
    path = os.pathsep.join(x for x in (str(tmp_path), os.environ.get("PYTHONPATH")) if x)
    for cmd, machine, code in (
        ([EXE], "gpu", 0),
        ([sys.executable, "-m", "ehp_fsm.cli"], "toaster", 2),  # an unknown machine: refused
    ):
        out = subprocess.run(
            [*cmd, "spec", machine],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": path},
            timeout=60,
            check=False,
        )
        assert out.returncode == code, (cmd, out.stderr)
        assert "frozen at exit: True" in out.stderr, (cmd, out.stderr)


def test_a_reader_that_stops_early_gets_no_error() -> None:
    """`ehp-fsm check PLAN | head -1`: the reader closed the pipe; the command stops as one
    killed by SIGPIPE would (status 141), without an error about paths and disks. (The read
    end is closed before the command writes: its first write meets the closed pipe.)"""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        out = subprocess.run(
            [EXE, "check", "tests/core/plan.toml"],
            cwd=ROOT,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)
    assert (out.returncode, out.stderr) == (141, "")


def test_replay_at_a_seq_past_the_log_is_refused_saying_where_the_log_ends() -> None:
    """`--at 99999` on a shorter log printed `world at seq N` as if N were what was asked;
    then the world at the log's end with exit 0, which a script took for the one asked. Now
    it is refused, naming the last seq, and prints no world."""
    lines = (ROOT / "tests/golden/borrow_and_return.jsonl").read_text().splitlines()
    last = json.loads(lines[-1])["seq"]
    out = run("replay", "tests/golden/borrow_and_return.jsonl", "--at", "99999")
    assert out.returncode == 2 and out.stdout == "", out.stdout[-300:]
    assert "--at 99999 is past the end of tests/golden/borrow_and_return.jsonl: its last " in (
        out.stderr
    )
    assert f"its last record is seq {last} " in out.stderr and f"--at {last} or less" in (
        out.stderr
    )
    out = run("replay", "tests/golden/borrow_and_return.jsonl", "--at", str(last))
    assert out.returncode == 0 and f"world at seq {last}: " in out.stderr, out.stderr


def test_replay_at_a_record_inside_a_cascade_says_it_shows_the_events_end() -> None:
    """`--at S` where S starts an event with a cascade printed `world at seq S+k` without a
    word of why (the world after S alone never existed: a cascade is one atomic step); an
    incident reader took it for another record than asked. Now it says so."""
    records = [
        json.loads(line)
        for line in (ROOT / "tests/golden/borrow_and_return.jsonl").read_text().splitlines()
    ][1:]
    seq = next(a["seq"] for a, b in itertools.pairwise(records) if b.get("cause") == a["seq"])
    out = run("replay", "tests/golden/borrow_and_return.jsonl", "--at", str(seq))
    assert out.returncode == 0, out.stderr
    last = out.stderr.splitlines()[-1]
    assert int(last.split()[3]) > seq, last
    assert f"(the end of the event that holds record {seq}: its cascade is applied whole)" in last


def test_replay_at_a_seq_below_one_is_refused() -> None:
    """Records count from 1: `--at -1` printed the world after seq 1 as if asked for it."""
    for at in ("-1", "0"):
        out = run("replay", "tests/golden/borrow_and_return.jsonl", "--at", at)
        assert out.returncode == 2, out.stdout[-300:]
        assert f"--at {at} is not a record's seq" in out.stderr and "world at" not in out.stderr


def _wait_blocked_in_pipe_read(pid: int, limit_s: float = 10.0) -> None:
    """Wait until `pid` sleeps in a pipe read. A SIGINT that lands between `open` returning and
    `read` starting is only acted on once `read` returns (CPython runs Python-level signal
    handlers between bytecodes, and the read does not see the signal that already came), so
    the Ctrl-C would be lost in that window: CI once waited 30 s there. Linux names the wait in
    /proc/PID/wchan (`pipe_read`, `anon_pipe_read` on newer kernels); where it is not readable,
    the limit passes and the signal goes as before."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            if "pipe_read" in Path(f"/proc/{pid}/wchan").read_text():
                return
        except OSError:
            return
        time.sleep(0.01)


def test_ctrl_c_outside_a_run_is_a_message_not_a_traceback(tmp_path: Path) -> None:
    """Ctrl-C while `check` waits on its plan (a FIFO nobody writes yet): exit 130 and one
    line saying so, not a KeyboardInterrupt traceback."""
    fifo = tmp_path / "plan.toml"
    os.mkfifo(fifo)
    writer = -1
    with subprocess.Popen(
        [EXE, "check", str(fifo)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=as_from_a_terminal,
    ) as p:
        try:
            deadline = time.monotonic() + 30
            while writer < 0 and p.poll() is None and time.monotonic() < deadline:
                try:  # opens once `check` has opened the plan to read it: it waits there now
                    writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                except OSError:
                    time.sleep(0.02)
            assert writer >= 0, p.communicate(timeout=5)
            _wait_blocked_in_pipe_read(p.pid)
            p.send_signal(signal.SIGINT)
            _, err = p.communicate(timeout=30)
        finally:
            if writer >= 0:
                os.close(writer)
            p.kill()
    assert p.returncode == 130, err
    assert "ehp-fsm check: interrupted (Ctrl-C)" in err and "Traceback" not in err, err


def test_replay_of_a_log_still_being_written_says_so(tmp_path: Path) -> None:
    """`ehp-fsm replay` of a live run's log verified what was there and said nothing of the
    run going on (and `--receipt` then found no receipt, or an earlier run's); now it says
    the log is still being written. The writer is a real Orchestrator holding the log."""
    from ehp_fsm import Event, Orchestrator, load_plan

    log = tmp_path / "t.jsonl"
    orch = Orchestrator.from_plan(load_plan(ROOT / "examples" / "short.toml"), log_path=log)
    try:
        orch.handle(Event("rollout_engine", "e0", "drain", time=1.0))
        out = run("replay", str(log))
        assert out.returncode == 0, out.stderr
        assert "the log is still being written (a live run or Orchestrator holds it)" in out.stdout
    finally:
        orch.close()
    out = run("replay", str(log))
    assert out.returncode == 0 and "still being written" not in out.stdout, out.stdout
