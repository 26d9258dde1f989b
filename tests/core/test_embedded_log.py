"""The embedding API's transition log where the file system says no: a log path that cannot be
written, two orchestrators given the same path, a write that fails half-way (a file size limit:
what a full disk does to a write), and a process killed between events."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ehp_fsm import Event, Orchestrator, load_plan
from ehp_fsm.cli import main as ehp_fsm_main
from ehp_fsm.embedded import OrchestratorError
from ehp_fsm.errors import EhpError, LogFormatError
from ehp_fsm.replay import replay
from ehp_fsm.specfiles import load_specs
from tests.core.logedit import as_schema_2, render

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "examples" / "local.toml"


@pytest.mark.parametrize(
    ("where", "named"),
    [
        ("file/t.jsonl", "File exists"),  # a parent that is a file
        (".", "Is a directory"),
        ("a\0b", "a\\x00b cannot be created: because embedded null byte"),
    ],
)
def test_a_log_path_that_cannot_be_written_is_refused_naming_it(
    tmp_path: Path, where: str, named: str
) -> None:
    """Before: a bare FileExistsError / IsADirectoryError / ValueError from `from_plan`."""
    (tmp_path / "file").write_text("")
    path = where if "\0" in where else str(tmp_path / where)
    with pytest.raises(EhpError, match=r"the transition log .* cannot be created") as err:
        Orchestrator.from_plan(load_plan(PLAN), log_path=path)
    assert named in str(err.value) and "Fix: pass a log_path in a folder" in str(err.value)


@pytest.mark.parametrize(
    "held",
    [b"prompt,answer\n1,2\n", b'{"prompt": "1+1=", "label": "2"}\n', b"\x00\x01junk"],
)
def test_a_log_path_naming_a_file_that_is_no_log_is_refused_and_the_file_kept(
    tmp_path: Path, held: bytes
) -> None:
    """Before: `from_plan(log_path="data.csv")` emptied the user's file and wrote the log in it,
    without a word (`ehp-fsm run` refused such a `run.log`; the embedding API did not). An
    earlier log and an empty file are still replaced."""
    data = tmp_path / "data.csv"
    data.write_bytes(held)
    with pytest.raises(EhpError, match="would replace a file that is not a transition log"):
        Orchestrator.from_plan(load_plan(PLAN), log_path=data)
    assert data.read_bytes() == held
    for kept in (tmp_path / "empty.jsonl", tmp_path / "old.jsonl"):
        kept.write_bytes(b"")
    Orchestrator.from_plan(load_plan(PLAN), log_path=tmp_path / "old.jsonl").close()
    Orchestrator.from_plan(load_plan(PLAN), log_path=tmp_path / "empty.jsonl").close()
    again = Orchestrator.from_plan(load_plan(PLAN), log_path=tmp_path / "old.jsonl")
    again.close()
    assert replay(tmp_path / "old.jsonl").transitions >= 1


def test_a_second_orchestrator_on_a_log_in_use_is_refused_and_the_first_log_replays(
    tmp_path: Path,
) -> None:
    """Before: the second emptied the file under the first and both appended to it; the log
    replayed neither (`source` recorded 'starting', engine computed '<new>')."""
    log = tmp_path / "t.jsonl"
    first = Orchestrator.from_plan(load_plan(PLAN), log_path=log)
    launch = {"host": "h1", "gpus": ["h1:g0"], "tp": 1, "token": "t"}
    assert first.handle(Event("rollout_engine", "e0", "launch", 1.0, launch)).accepted
    with pytest.raises(EhpError, match="is held by another writer") as err:
        Orchestrator.from_plan(load_plan(PLAN), log_path=log)
    # it names what holds the log and what to do (before: "is being written by another log")
    message = str(err.value)
    assert "an Orchestrator or an `ehp-fsm run`" in message and "another log" not in message
    assert "give each Orchestrator its own log_path" in message
    assert "stop it (`ehp-fsm stop PLAN`)" in message
    assert first.handle(Event("rollout_engine", "e0", "fail", 2.0)).accepted
    first.close()
    assert replay(log).world.snapshot() == first.world.snapshot()
    second = Orchestrator.from_plan(load_plan(PLAN), log_path=log)  # closed: a new log there
    second.close()
    assert replay(log).transitions == 2  # the inventory's events alone


def test_an_orchestrator_that_fails_to_start_frees_its_log_path(tmp_path: Path) -> None:
    """`from_plan` with a start time that is not a number raised with its log still open (and
    locked): a second try on the same path was refused while the error was alive. The time is
    refused as from_plan's now, before the log is made (its fix told the caller, who built no
    event, to "build it as Event(...)"); so is a log path in bytes (told to "pass a log_path
    in a folder this process can write")."""
    log = tmp_path / "t.jsonl"
    with pytest.raises(EhpError, match="from_plan's time is nan") as err:
        Orchestrator.from_plan(load_plan(PLAN), log_path=log, time=float("nan"))
    with pytest.raises(EhpError, match=r"from_plan's log_path is b'.*' .* a str or a Path"):
        Orchestrator.from_plan(load_plan(PLAN), log_path=os.fsencode(log))
    again = Orchestrator.from_plan(load_plan(PLAN), log_path=log)  # `err` still holds the frame
    again.close()
    assert err.value is not None and replay(log).transitions == 2


_WRITER = textwrap.dedent(
    """
    import resource, signal, sys
    from ehp_fsm import Event, EventError, Orchestrator, load_plan

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    orch = Orchestrator.from_plan(load_plan(sys.argv[1]), log_path=sys.argv[2])
    size = int(sys.argv[3])
    limit = {"room": size, "none": resource.RLIM_INFINITY}
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit["room"], resource.RLIM_INFINITY))
    failed = []
    for i in range(40):
        event = Event("request", f"g{i}", "enqueue", float(i), {"prompt": "p" * 50})
        try:
            orch.handle(event)
        except OSError as exc:
            failed.append((i, orch.world.get("request", f"g{i}") is None, exc.errno))
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit["none"], resource.RLIM_INFINITY))
            orch.handle(event)  # the space is back: the same event again
    orch.close()
    print(failed, orch.world.version)
    """
)


@pytest.mark.slow
def test_a_write_that_fails_half_way_leaves_no_part_of_the_event_in_the_log(
    tmp_path: Path,
) -> None:
    """A full disk (here: a file size limit, so the test needs no small file system) cuts a
    write short. Before, the failed event's bytes stayed in the log's buffer and reached the
    file with the next event's; its record (an event never applied) and its seq given again
    broke the log (`seq` recorded 8, engine computed 9) while the orchestrator went on."""
    log = tmp_path / "t.jsonl"
    header = Orchestrator.from_plan(load_plan(PLAN), log_path=tmp_path / "probe.jsonl")
    header.close()
    room = (tmp_path / "probe.jsonl").stat().st_size + 1500  # some events, then one cut short
    out = subprocess.run(
        [sys.executable, "-c", _WRITER, str(PLAN), str(log), str(room)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    failed, version = out.stdout.split("]")[0] + "]", int(out.stdout.split("]")[1])
    assert failed.startswith("[(") and ", True, 27)" in failed  # EFBIG; not applied
    result = replay(log)
    assert result.world.version == version and result.transitions == version


@pytest.mark.slow
def test_a_writer_killed_between_events_leaves_a_log_that_replays_to_its_last_record(
    tmp_path: Path,
) -> None:
    """kill -9 of a process handling events as fast as it can: every line the log holds is
    whole (each event is one write), and it replays to its last record."""
    log = tmp_path / "t.jsonl"
    code = textwrap.dedent(
        """
        import sys
        from ehp_fsm import Event, EventError, Orchestrator, load_plan
        orch = Orchestrator.from_plan(load_plan(sys.argv[1]), log_path=sys.argv[2])
        print("ready", flush=True)
        i = 0
        while True:
            i += 1
            orch.handle(Event("request", f"g{i}", "enqueue", float(i), {"prompt": "p" * i}))
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(PLAN), str(log)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    while log.stat().st_size < 200_000:
        pass
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()
    data = log.read_bytes()
    if not data.endswith(b"\n"):  # a torn line is named as one (not seen: one write an event)
        with pytest.raises(LogFormatError, match="last line is cut short"):
            replay(log)
        return
    result = replay(log)
    assert result.transitions == data.count(b"\n") - 1 - data.count(b'{"checkpoint":')


def test_a_checkpoint_that_cannot_be_written_does_not_fail_an_event_already_applied(
    tmp_path: Path,
) -> None:
    """The log writes a checkpoint line after an event is applied. When that write failed (a
    full disk), `handle` raised its OSError — which the API documents as "nothing of the
    event logged or applied, handle it again" — though the event was logged and applied: a
    scheduler that handled it again had it refused (or, for an event that may repeat, taken
    twice). Now the checkpoint is left for later (replay needs none) and `handle` returns the
    outcome; the next write that fails raises as documented, with nothing applied."""
    import io

    from ehp_fsm import Accepted
    from ehp_fsm.specfiles import load_specs
    from ehp_fsm.translog import TransitionLog

    class Disk(io.BytesIO):
        full = False

        def write(self, data: bytes) -> int:  # type: ignore[override]
            if self.full and bytes(data).startswith(b'{"checkpoint"'):
                raise OSError(28, "No space left on device")
            return super().write(data)

    plan = load_plan(PLAN)
    config = plan.world_config()
    disk = Disk()
    log = TransitionLog(disk, checkpoint_every=1, checkpoint_events_per_instance=0.0)
    log.header(config=config, specs=load_specs(), meta={})
    orch = Orchestrator(config, log=log)
    first = Event("request", "g0", "enqueue", 1.0, {"prompt": "p"})
    assert isinstance(orch.handle(first), Accepted)  # a checkpoint follows it
    disk.full = True
    second = Event("request", "g1", "enqueue", 2.0, {"prompt": "p"})
    out = orch.handle(second)  # its checkpoint cannot be written
    assert isinstance(out, Accepted) and orch.world.get("request", "g1") is not None
    disk.full = False
    third = Event("request", "g2", "enqueue", 3.0, {"prompt": "p"})
    assert isinstance(orch.handle(third), Accepted)  # the checkpoint is written now
    path = tmp_path / "t.jsonl"
    path.write_bytes(disk.getvalue())
    result = replay(path)
    assert result.events == 3 and result.world.snapshot() == orch.world.snapshot()
    assert disk.getvalue().count(b'{"checkpoint"') == 2


def _story() -> list[Event]:
    """Events an embedder handles: groups queued, engines launched and failed, their GPUs
    freed by the finalizer, one refused (a launch on a GPU that is not free)."""
    out = []
    for i in range(6):
        t = float(i + 1)
        launch = {"host": "h1", "gpus": ["h1:g0"], "tp": 1, "token": f"t{i}"}
        confirm = {"owner": f"engine:e{i}", "processes_exited": True, "memory_free": True}
        out += [
            Event("request", f"g{i}", "enqueue", t, {"prompt": "p" * i}),
            Event("rollout_engine", f"e{i}", "launch", t, launch),
            Event("rollout_engine", f"x{i}", "launch", t, {**launch, "token": "x"}),  # refused
            Event("rollout_engine", f"e{i}", "fail", t + 0.5),
            Event("gpu", "h1:g0", "confirm_free", t + 0.5, confirm),
        ]
    return out


_KILLED = textwrap.dedent(
    """
    import sys, time
    from ehp_fsm import Orchestrator, load_plan
    from tests.core.test_embedded_log import _story
    orch = Orchestrator.from_plan(load_plan(sys.argv[1]), log_path=sys.argv[2], check=True)
    for event in _story()[: int(sys.argv[3])]:
        orch.handle(event)
    print("handled", flush=True)
    time.sleep(600)  # killed here: never closed
    """
)


@pytest.mark.slow
def test_an_embedder_killed_resumes_from_its_log_and_goes_on_writing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An embedder's process is killed (SIGKILL, its orchestrator never closed) after 13 of
    30 events, its log keyed (`EHP_LOG_KEY`); the kill left a torn line (faked: appended, as
    a kill mid-write would leave it — one write an event makes that rare). Before, there was
    no way back but `Controller.recover`, the run's own. `Orchestrator.resume` verifies and
    replays the log (the torn line cut), rebuilds the world and goes on writing the same log:
    `ehp-fsm replay` verifies the whole file, and its world is the one an uninterrupted run
    of the 30 events gives. A log being written, or one of another config or other specs, is
    refused before anything is cut."""
    plan, log, key = load_plan(PLAN), tmp_path / "t.jsonl", "a secret"
    monkeypatch.delenv("EHP_LOG_KEY", raising=False)
    events, cut = _story(), 13
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED, str(PLAN), str(log), str(cut)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "EHP_LOG_KEY": key},
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "handled\n"
        with pytest.raises(EhpError, match=r"(is being written by|is held by) another"):
            Orchestrator.resume(log, plan=plan, key=key)  # the embedder still runs
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert proc.stdout is not None
        proc.stdout.close()
    whole = log.read_bytes()
    with log.open("ab") as fh:
        fh.write(b'{"seq":99,"time":14.0,"mach')  # a torn last line
    with pytest.raises(OrchestratorError, match=r"another config: \['core_version'\]"):
        Orchestrator.resume(log, plan=plan, core_version=3, key=key)
    other = {k: v for k, v in load_specs().items() if k != "capacity"}
    with pytest.raises(OrchestratorError, match=r"other machine specs than these: \['capacity'\]"):
        Orchestrator.resume(log, plan=plan, specs=other, key=key)
    assert log.read_bytes().endswith(b'"mach'), "a refused resume cut the log"

    orch = Orchestrator.resume(log, plan=plan, check=True, key=key)
    assert log.read_bytes() == whole, "the torn line was not cut (or more was)"
    for event in events[cut:]:
        orch.handle(event)
    orch.close()

    straight = Orchestrator.from_plan(plan, log_path=tmp_path / "straight.jsonl")
    for event in events:
        straight.handle(event)
    straight.close()
    transitions = replay(tmp_path / "straight.jsonl").transitions
    monkeypatch.setenv("EHP_LOG_KEY", key)  # (the resumed log goes on with the keyed chain)
    assert ehp_fsm_main(["replay", str(log)]) == 0
    result = replay(log)
    assert result.world.snapshot() == orch.world.snapshot() == straight.world.snapshot()
    assert result.transitions == transitions


@pytest.mark.parametrize("what", ["fifo", "folder", "link", "another user's"])
def test_resume_refuses_a_path_it_cannot_append_to_naming_what_it_is(
    tmp_path: Path, what: str
) -> None:
    """Before: a FIFO or a folder was "the transition log does not exist"; a link and another
    user's log were refused by the writer's own checks, whose fix ("remove the link; the run
    makes the file", "remove LOG (the run makes its own)") sent the embedder to delete the log
    it meant to resume. Each is named for what it is, with what to do, and left as it was."""
    from ehp_fsm.runtime.recovery import RecoveryError

    log = tmp_path / "t.jsonl"
    Orchestrator.from_plan(load_plan(PLAN), log_path=log).close()
    whole = log.read_bytes()
    path, why, fix = tmp_path / "p.jsonl", "", ""
    if what == "fifo":
        os.mkfifo(path)
        why = "it is a FIFO: a transition log is a file"
    elif what == "folder":
        path.mkdir()
        why = "it is a folder"
    elif what == "link":
        path.symlink_to(log)
        why, fix = "it is a symbolic link (to ", f"pass the log's own path ({log})"
    else:
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user takes root")
        path = log
        os.chown(log, 4321, 4321)
        why, fix = "belongs to another user (uid 4321)", "copy it to a file of yours"
    with pytest.raises(RecoveryError, match="cannot resume from") as err:
        Orchestrator.resume(path)
    assert why in err.value.why and fix in err.value.fix
    assert "remove" not in err.value.fix
    assert log.read_bytes() == whole


def test_resume_refuses_a_log_from_before_the_hash_chain_and_leaves_it_as_it_was(
    tmp_path: Path,
) -> None:
    """A schema-2 log (no hash chain) resumed went on writing chained lines whose chain began
    from nothing in the middle of the file (replay of schema 2 ignores it: nothing checked
    them). Refused, naming the schema and what to do; the file's bytes are as they were."""
    plan = load_plan(PLAN)
    log = tmp_path / "t.jsonl"
    orch = Orchestrator.from_plan(plan, log_path=log)
    orch.handle(Event("rollout_engine", "e9", "drain", time=1.0))  # refused: logged
    orch.close()
    log.write_text("\n".join(as_schema_2(log.read_text().splitlines())) + "\n")
    whole, events = log.read_bytes(), replay(log).events
    with pytest.raises(EhpError, match=r"is schema 2 .*cannot be appended to") as err:
        Orchestrator.resume(log, plan=plan)
    assert "start a new log" in err.value.fix
    assert log.read_bytes() == whole
    assert replay(log).events == events


def test_resume_refuses_a_log_from_before_the_hash_chain_whose_header_is_past_1_mib(
    tmp_path: Path,
) -> None:
    """The schema was read from the header's first 1 MiB: a schema-2 header longer than that
    (a plan of some 10,000 GPUs) did not parse, and the log was resumed and appended to with
    chained lines, as the refusal above says it must not be."""
    plan = load_plan(PLAN)
    log = tmp_path / "t.jsonl"
    orch = Orchestrator.from_plan(plan, log_path=log)
    orch.handle(Event("rollout_engine", "e9", "drain", time=1.0))  # refused: logged
    orch.close()
    lines = as_schema_2(log.read_text().splitlines())
    head = json.loads(lines[0])
    head["meta"] = {**head.get("meta", {}), "note": "x" * (2 << 20)}  # a header of 2 MiB
    lines[0] = render(head) + "\n"
    log.write_text("".join(x if x.endswith("\n") else x + "\n" for x in lines))
    whole = log.read_bytes()
    with pytest.raises(EhpError, match=r"is schema 2 .*cannot be appended to"):
        Orchestrator.resume(log, plan=plan)
    assert log.read_bytes() == whole


@pytest.mark.parametrize(
    ("meta", "said"),
    [
        ({"plan": "other"}, "log_meta['plan'] cannot be set"),
        ({"resumes": {"log": "x.jsonl"}}, "'x.jsonl', which cannot be read beside the log"),
        ({"resumes": {"log": "../t.jsonl"}}, "does not name a log segment"),
        ({"resumes": "t0.jsonl"}, "does not name a log segment"),
        ({"resumes": {"log": "data.csv"}}, "'data.csv', which is not a transition log"),
    ],
)
def test_log_meta_that_replay_would_refuse_is_refused_when_the_log_is_made(
    tmp_path: Path, meta: dict[str, object], said: str
) -> None:
    """Before: `log_meta={'resumes': {'log': 'x.jsonl'}}` (the README's example of its use) made
    a log that `replay` refused ("resumes the segment x.jsonl, which is not beside it"), and
    `log_meta={'plan': ...}` replaced the plan name the receipt check compares."""
    (tmp_path / "data.csv").write_text("a,b\n")
    log = tmp_path / "t.jsonl"
    with pytest.raises(EhpError, match=re.escape(said)):
        Orchestrator.from_plan(load_plan(PLAN), log_path=log, log_meta=meta)
    assert not log.exists()


def test_log_meta_resuming_a_segment_beside_the_log_is_taken(tmp_path: Path) -> None:
    Orchestrator.from_plan(load_plan(PLAN), log_path=tmp_path / "t0.jsonl").close()
    with pytest.raises(EhpError, match="without a log_path"):
        Orchestrator.from_plan(load_plan(PLAN), log_meta={"resumes": {"log": "t0.jsonl"}})
    meta = {"resumes": {"log": "t0.jsonl"}, "mine": 1}
    Orchestrator.from_plan(load_plan(PLAN), log_path=tmp_path / "t1.jsonl", log_meta=meta).close()


@pytest.mark.parametrize("kept", [1, 2])
def test_a_log_that_ends_inside_the_inventory_resumes_with_it_completed(
    tmp_path: Path, kept: int
) -> None:
    """The process ended between `from_plan`'s header and its last inventory event (`kept`
    lines: the header alone, or some of the Core's GPUs assigned): the log resumed into a world
    with the Core's GPUs free — a Hybrid could be granted one — and no capacity record, with
    `recovery.notes == ()`. The missing events are handled at the resume, and said."""
    plan = load_plan(PLAN)
    whole = tmp_path / "whole.jsonl"
    Orchestrator.from_plan(plan, log_path=whole).close()
    lines = whole.read_text().splitlines(keepends=True)
    assert len(lines) > kept  # (the plan's inventory: its Core's GPUs, then the capacity)
    log = tmp_path / "t.jsonl"
    log.write_text("".join(lines[:kept]))
    orch = Orchestrator.resume(log, plan=plan, check=True)
    try:
        for g in plan.core.gpus:
            gpu = orch.world.get("gpu", g)
            assert gpu is not None and gpu.get("owner") == "core", g
        assert orch.world.get("capacity", "grp") is not None
        assert orch.recovery is not None
        assert any("ended inside from_plan's inventory" in n for n in orch.recovery.notes)
    finally:
        orch.close()
    assert replay(log).world.snapshot() == replay(whole).world.snapshot()
    again = Orchestrator.resume(log, plan=plan)  # complete now: nothing more is added
    again.close()
    assert replay(log).transitions == replay(whole).transitions


@pytest.mark.parametrize("left", [0, 100])
def test_resume_of_a_log_begun_and_stopped_before_its_header_says_to_start_afresh(
    tmp_path: Path, left: int
) -> None:
    """A process killed as `from_plan` began its log leaves an empty file, or a header line cut
    short. `Orchestrator.resume` said to "replay the log of a run that began" or "a file written
    by ehp-fsm" — it was one, and there is nothing to replay. Now it says to start afresh (an
    auditor's find), and leaves the file as it was."""
    whole = tmp_path / "whole.jsonl"
    Orchestrator.from_plan(load_plan(PLAN), log_path=whole).close()
    log = tmp_path / "t.jsonl"
    log.write_bytes(whole.read_bytes()[:left])
    with pytest.raises(EhpError) as err:
        Orchestrator.resume(log, plan=load_plan(PLAN))
    said = str(err.value)
    assert "file is empty" in said if left == 0 else "first line is cut short" in said, said
    assert "start afresh: Orchestrator.from_plan" in said and "replay" not in said, said
    assert log.read_bytes() == whole.read_bytes()[:left]


def test_resume_keeps_a_last_line_that_lost_only_its_newline(tmp_path: Path) -> None:
    """The last line without its newline but whole (an editor's save, or a write cut exactly
    before it): `ehp-fsm replay` verifies it, and `Orchestrator.resume` cut it as torn,
    dropping that event. Now the event stays, the newline is put back, and the log the
    resumed orchestrator goes on writing replays whole."""
    log = tmp_path / "t.jsonl"
    orch = Orchestrator.from_plan(load_plan(PLAN), log_path=log)
    launch = {"host": "h1", "gpus": ["h1:g0"], "tp": 1, "token": "t0"}
    assert orch.handle(Event("rollout_engine", "e0", "launch", time=1.0, payload=launch)).accepted
    orch.close()
    events = replay(log).events
    log.write_bytes(log.read_bytes().rstrip(b"\n"))
    orch = Orchestrator.resume(log, plan=load_plan(PLAN))
    assert orch.recovery is not None and "the newline put back" in orch.recovery.describe()
    assert orch.world.get("rollout_engine", "e0") is not None  # the launch was kept
    launch = {"host": "h1", "gpus": ["h1:g1"], "tp": 1, "token": "t1"}
    assert orch.handle(Event("rollout_engine", "e1", "launch", time=2.0, payload=launch)).accepted
    orch.close()
    assert replay(log).events == events + 1
