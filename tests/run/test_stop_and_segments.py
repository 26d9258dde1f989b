"""The pieces of `ehp-fsm stop` and `--resume` that need no run: stopping recorded processes by
identity (real processes: one that leaves on SIGTERM, one that ignores it, and one whose pid is
recorded with another start time, as a reused pid would be — it must not be touched), the
Core's saved state read back exactly, and replay of a log that resumes another segment."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from torch import nn

from ehp_fsm.cli import main
from ehp_fsm.embedded import Orchestrator
from ehp_fsm.errors import ChainBroken, LogFormatError
from ehp_fsm.plan import load_plan
from ehp_fsm.replay import ReplayResult, replay
from ehp_fsm.run.owned import (
    lock_run_dir,
    read_run_state,
    starting_run,
    stop_owned,
    write_run_state,
)
from ehp_fsm.run.resume import (
    ResumeError,
    StateSaves,
    check_resumed_plan,
    latest_state,
    newest_segment,
    next_group_index,
    next_segment,
    prepare_resume,
    record_plan,
    save_step_state,
)
from ehp_fsm.runtime.identity import capture
from ehp_fsm.training.dpzero import local_dp_zero, scatter_dp_zero
from ehp_fsm.training.lane import LaneSpec, TrainingLane
from ehp_fsm.training.verify import (
    VerifyError,
    check_restored,
    combine_digests,
    read_index,
    read_state,
    state_digest,
    write_state,
)
from tests.core.test_replay_forget import training
from tests.procs import sigterm_when
from tests.run.test_run import SHORT, plan_text, session_model

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "borrow_and_return.jsonl"

_IGNORES_TERM = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)"


def _sleeper(
    setup: str = "pass", *, sleep_s: float = 60, token: str | None = None
) -> subprocess.Popen[bytes]:
    """A process standing in for one a run owns, once it has run `setup` (`_IGNORES_TERM`: its
    handler is installed); it then lives `sleep_s`. With `token`, it carries it as its launch
    token (`EHP_LAUNCH_TOKEN`), as the run's agents, engines and trainer workers do. Waited for
    by its word, not a fixed time: a fixed 0.3 s could end before a loaded machine's interpreter
    had installed the handler, and the stubborn process then died of the SIGTERM."""
    env = None if token is None else {**os.environ, "EHP_LAUNCH_TOKEN": token}
    code = f"import time; {setup}; print('up', flush=True); time.sleep({sleep_s})"
    p = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE)
    assert p.stdout is not None
    with p.stdout:  # (it writes nothing more)
        assert p.stdout.readline() == b"up\n", "the sleeper never started"
    return p


_HOLDS_LOCK = """
import sys, time
from pathlib import Path
from ehp_fsm.run.owned import lock_run_dir
held = lock_run_dir(Path(sys.argv[1]), plan=sys.argv[2])
assert held is not None
print("locked", flush=True)
time.sleep(60)
"""


def _run_sleeper(run_dir: Path, plan: str = "short") -> subprocess.Popen[str]:
    """A process standing in for a live run of `plan` in `run_dir`: it holds the directory's
    lock, as a run does from its start to its end (what proves it is the run to `stop`)."""
    p = subprocess.Popen(
        [sys.executable, "-c", _HOLDS_LOCK, str(run_dir), plan], stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None and p.stdout.readline() == "locked\n"
    return p


def test_stop_stops_what_the_run_recorded_by_identity_and_never_a_reused_pid(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    gone = _sleeper()  # the "run": dead already (kill -9)
    gone_id = capture(gone.pid, launch_token="t")
    gone.kill()
    gone.wait()
    polite, stubborn = _sleeper(token="t"), _sleeper(_IGNORES_TERM, token="t")
    bystander = _sleeper(token="t")
    try:
        reused = capture(bystander.pid, launch_token="t")
        reused = type(reused)(
            host=reused.host, pid=reused.pid, start_time=reused.start_time - 5.0, launch_token="t"
        )  # the pid, as if it had named another process before: a reused pid
        write_run_state(
            run_dir,
            plan="short",
            run=gone_id,
            agents={"h0": capture(polite.pid, launch_token="t")},
            trainers={0: capture(stubborn.pid, launch_token="t"), 1: reused},
        )
        doc = read_run_state(run_dir, "short")
        assert doc is not None
        report = stop_owned(run_dir, doc, grace_s=0.5)
        # (psutil reaped our children while it waited: their exit status is its, not Popen's)
        assert polite.poll() is not None and stubborn.poll() is not None
        assert bystander.poll() is None  # never signalled: its start time is not the recorded one
        assert report.left == ()
        assert sorted(report.stopped) == [
            f"agent h0 (pid {polite.pid}): SIGTERM",
            f"trainer 0 (pid {stubborn.pid}): SIGKILL after 0.5 s",
        ]
        again = stop_owned(run_dir, doc, grace_s=0.5)  # idempotent
        assert again.stopped == () and again.left == ()
    finally:
        for p in (polite, stubborn, bystander):
            p.kill()
            p.wait()


_RUN_STOPS_ITS_OWN = """
import pathlib, signal, subprocess, sys, time
from ehp_fsm.run.owned import lock_run_dir
d = pathlib.Path(sys.argv[1])
held = lock_run_dir(d / "run", plan="short")  # as a run holds it: what proves it is the run
child = subprocess.Popen([sys.executable, "-c", sys.argv[2], str(d)])  # its token, inherited
def term(*_):
    time.sleep(0.3)  # a run's clean stop takes a while: its trainer must live through it
    signalled = (d / "child-term").exists()
    (d / "verdict").write_text("child signalled while the run stopped" if signalled else "ok")
    child.kill()
    child.wait()
    sys.exit(143)
signal.signal(signal.SIGTERM, term)
(d / "child.pid").write_text(str(child.pid))
while True:
    time.sleep(0.05)
"""
_TRAINER = """
import pathlib, signal, sys, time
d = pathlib.Path(sys.argv[1])
signal.signal(signal.SIGTERM, lambda *_: (d / "child-term").touch())
(d / "child-ready").touch()
while True:
    time.sleep(0.05)
"""


def test_stop_of_a_live_run_signals_the_run_alone_and_lets_it_stop_its_pieces(
    tmp_path: Path,
) -> None:
    """`ehp-fsm stop` on a live run SIGTERMed the run and every process under it at once: its
    Core trainer died mid-step and the run ended "training step N failed" (exit 2, --resume
    advised) instead of stopping cleanly (128 + 15, `interrupted`)."""
    run_dir = tmp_path / "run"
    run = subprocess.Popen(
        [sys.executable, "-c", _RUN_STOPS_ITS_OWN, str(tmp_path), _TRAINER],
        text=True,
        env={**os.environ, "EHP_LAUNCH_TOKEN": "t"},
    )
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "child-ready").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        child = int((tmp_path / "child.pid").read_text())
        write_run_state(
            run_dir,
            plan="short",
            run=capture(run.pid, launch_token="t"),
            agents={},
            trainers={0: capture(child, launch_token="t")},
        )
        doc = read_run_state(run_dir, "short")
        assert doc is not None
        report = stop_owned(run_dir, doc, run_grace_s=10.0, grace_s=0.5)
        assert (tmp_path / "verdict").read_text() == "ok"
        assert report.stopped == (f"run (pid {run.pid}): SIGTERM",) and report.left == ()
    finally:
        run.kill()
        run.wait()


_NEVER_REAPS = (
    "import subprocess, sys, time;"
    "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
    "print(c.pid, flush=True); time.sleep(60)"
)


def test_an_exited_agent_its_parent_has_not_reaped_is_stopped_not_waited_for(
    tmp_path: Path,
) -> None:
    """A killed run's agents are orphans, reaped by pid 1 — here seconds after they exit. An
    agent that left on SIGTERM is stopped, even while a zombie: `stop` neither waits its grace
    for it nor reports it SIGKILLed. Real processes: the agent's parent is a process that
    never reaps it (as a slow reaper)."""
    parent = subprocess.Popen(  # the agent inherits its launch token
        [sys.executable, "-c", _NEVER_REAPS],
        stdout=subprocess.PIPE,
        env={**os.environ, "EHP_LAUNCH_TOKEN": "t"},
    )
    try:
        assert parent.stdout is not None
        agent = psutil.Process(int(parent.stdout.readline()))
        time.sleep(0.3)  # the interpreter is up
        run = _sleeper()  # the run: dead already (kill -9)
        run_id = capture(run.pid, launch_token="t")
        run.kill()
        run.wait()
        write_run_state(
            tmp_path,
            plan="short",
            run=run_id,
            agents={"h0": capture(agent.pid, launch_token="t")},
            trainers={},
        )
        doc = read_run_state(tmp_path, "short")
        assert doc is not None
        began = time.monotonic()
        report = stop_owned(tmp_path, doc)
        took = time.monotonic() - began
        assert agent.status() == psutil.STATUS_ZOMBIE  # exited, not reaped
        assert report.stopped == (f"agent h0 (pid {agent.pid}): SIGTERM",), report
        assert report.left == ()
        assert took < 5.0, took  # not the agent's 10 s grace (and room for a loaded machine)
    finally:
        parent.kill()
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()


def _killed_run(run_dir: Path) -> None:
    """A run directory whose run was killed (kill -9) and left nothing running."""
    gone = _sleeper()
    me = capture(gone.pid, launch_token="t")
    gone.kill()
    gone.wait()
    write_run_state(run_dir, plan="short", run=me, agents={}, trainers={})


def _plan_recorded(run_dir: Path) -> None:
    """The record of its plan every start writes before it trains (`resume/plan.json`; what
    it holds is compared only by `check_resumed_plan`, which these tests do not reach)."""
    (run_dir / "resume").mkdir(parents=True, exist_ok=True)
    (run_dir / "resume" / "plan.json").write_text("{}")


@pytest.mark.parametrize("removed", ["resume/plan.json", "resume"])
def test_a_resume_of_a_run_whose_plan_record_is_gone_is_refused(
    tmp_path: Path, removed: str
) -> None:
    """Every start records its plan in `resume/` before it trains. With that record removed
    a resume took any edit of the plan without a word (a new seed and group count:
    `plan_changes: []`); with the whole `resume/` folder removed it went on from the initial
    weights, "resumed after step 0", dropping the 2 steps the log holds. Both are refused,
    naming what is gone, the log where it was; a log of no trained step is resumed."""
    run_dir = tmp_path / "run"
    _killed_run(run_dir)
    _plan_recorded(run_dir)
    log = run_dir / "transitions.jsonl"
    log.write_bytes(GOLDEN.read_bytes())  # ends with the Core after step 2
    shutil.rmtree(run_dir / removed) if removed == "resume" else (run_dir / removed).unlink()
    with pytest.raises(
        ResumeError, match=rf"trained 2 step\(s\), and .*{removed} is gone: .*Fix: put back"
    ):
        prepare_resume("short", log, say=print, steps=5)
    assert log.read_bytes() == GOLDEN.read_bytes()
    assert not (run_dir / "transitions.1.jsonl").exists()
    # killed before its first step (its header alone): nothing trained, nothing to hold to
    log.write_bytes(GOLDEN.read_bytes().splitlines(keepends=True)[0])
    assert prepare_resume("short", log, say=print, steps=5).step == 0


def test_a_live_run_is_asked_to_stop_first_and_is_never_resumed(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run = _run_sleeper(run_dir)
    try:
        write_run_state(
            run_dir, plan="short", run=capture(run.pid, launch_token="t"), agents={}, trainers={}
        )
        (run_dir / "transitions.jsonl").write_text("")
        with pytest.raises(ResumeError, match=f"still running \\(pid {run.pid}\\)"):
            prepare_resume("short", run_dir / "transitions.jsonl", say=print, steps=5)
        doc = read_run_state(run_dir, "short")
        assert doc is not None
        said: list[str] = []
        report = stop_owned(run_dir, doc, grace_s=0.5, say=said.append)
        assert said == [f"the run (pid {run.pid}) is running: asking it to stop (SIGTERM)"]
        assert report.stopped == (f"run (pid {run.pid}): SIGTERM",) and report.left == ()
    finally:
        run.kill()
        run.communicate()


def test_a_resume_with_nothing_left_is_refused_before_the_log_is_touched(tmp_path: Path) -> None:
    """A run whose newest saved state is at the steps asked for (it finished, or was killed
    during its end) has nothing to resume: refused with what to do, its log where it was."""
    run_dir = tmp_path / "run"
    _killed_run(run_dir)
    log = run_dir / "transitions.jsonl"
    log.write_text("")
    state = run_dir / "resume" / "state-000005"
    state.mkdir(parents=True)
    (state / "index.json").write_text("{}")
    (run_dir / "resume" / "latest.json").write_text('{"step": 5, "state": "state-000005"}')
    with pytest.raises(
        ResumeError,
        match="nothing left to resume: its newest saved state is "
        "after step 5, and this resume would train to step 5",
    ) as err:
        prepare_resume("short", log, say=print, steps=5)
    assert "give --steps N with N > 5" in str(err.value)
    assert log.exists() and not (run_dir / "transitions.1.jsonl").exists()


def test_a_resume_of_a_log_cut_back_before_its_saved_state_is_refused(tmp_path: Path) -> None:
    """A killed run's log whose last lines were deleted (or an older copy put back) ends
    before the step its newest saved state is of: the groups of the steps between are in the
    weights and not in the log. Refused, naming both steps, the log left where it was (it was
    resumed from the state, and those steps' groups trained again). A state the log reaches
    is taken."""
    run_dir = tmp_path / "run"
    _killed_run(run_dir)
    _plan_recorded(run_dir)
    log = run_dir / "transitions.jsonl"
    log.write_bytes(GOLDEN.read_bytes())  # ends with the Core after step 2
    for step in (3, 2):
        state = run_dir / "resume" / f"state-{step:06d}"
        state.mkdir(parents=True)
        (state / "index.json").write_text("{}")
        (run_dir / "resume" / "latest.json").write_text(
            json.dumps({"step": step, "state": state.name})
        )
        if step == 3:
            with pytest.raises(
                ResumeError,
                match=r"saved state is after step 3, but the transition log .* ends with the "
                r"Core after step 2: .*groups of steps 3\.\.3 .*Fix: put back the log",
            ):
                prepare_resume("short", log, say=print, steps=5)
            assert log.read_bytes() == GOLDEN.read_bytes()
            assert not (run_dir / "transitions.1.jsonl").exists()
    point = prepare_resume("short", log, say=print, steps=5)
    assert point.step == 2 and point.segment == run_dir / "transitions.1.jsonl"


def test_a_resumes_log_repair_names_the_segment_the_log_became(tmp_path: Path) -> None:
    """The receipt's `resumed.log_repair` said "recovered .../transitions.jsonl: ... cut N
    bytes off the tail": the path the log had when it was repaired, before it was moved aside
    as the segment `transitions.1.jsonl` — the new run's log is at that path now, and was
    never repaired."""
    run_dir = tmp_path / "run"
    _killed_run(run_dir)
    _plan_recorded(run_dir)
    log = run_dir / "transitions.jsonl"
    log.write_bytes(GOLDEN.read_bytes() + b'{"seq": 99, "ti')  # torn mid-write by the kill
    point = prepare_resume("short", log, say=print, steps=5)
    segment = run_dir / "transitions.1.jsonl"
    assert point.segment == segment and segment.is_file() and not log.exists()
    repair = point.receipt()["log_repair"]
    assert repair.startswith(f"recovered {segment}: "), repair
    assert "cut 15 bytes off the tail" in repair and str(log) not in repair, repair
    assert point.receipt()["previous_log"] == str(segment)
    # the cut bytes are kept, named after the segment they were cut from
    kept = run_dir / f"transitions.1.jsonl.cut-{len(GOLDEN.read_bytes())}"
    assert kept.read_bytes() == b'{"seq": 99, "ti' and point.repaired, repair
    assert f"the cut bytes are kept in {kept}" in repair, repair


def test_a_resume_without_a_run_directory_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused before the plan's inputs are read: a model to be generated is not (it was
    written first, then the resume refused)."""
    plan = tmp_path / "plan.toml"
    log = tmp_path / "run" / "transitions.jsonl"
    model = tmp_path / "model"
    text = plan_text(log, 5)
    model_line = next(line for line in text.splitlines() if line.startswith("path = "))
    plan.write_text(text.replace(model_line, f'path = "{model}"'))
    assert main(["run", str(plan), "--resume"]) == 2  # an error naming the cause, no traceback
    err = capsys.readouterr().err
    assert "there is no run of plan 'short' to resume" in err and "Traceback" not in err
    assert not (log.parent / "receipt.json").exists()  # no run: no receipt of one (it left one)
    assert not model.exists()


def test_a_resume_of_a_log_with_bytes_that_are_not_text_is_refused_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A killed run's log damaged on disk inside its lines (bytes that are not UTF-8, as a
    disk's corruption leaves them): the resume refuses it naming the log and the line. It was
    a UnicodeDecodeError traceback (the tail repair read the lines as JSON and took only
    JSONDecodeError for "not JSON")."""
    plan = tmp_path / "plan.toml"
    log = tmp_path / "run" / "transitions.jsonl"
    plan.write_text(plan_text(log, 5))
    _killed_run(log.parent)
    lines = GOLDEN.read_bytes().split(b"\n")  # the last is "": the log ends with a newline
    for i in (50, -2):  # a line inside, and the last line
        lines[i] = b"\x80" + lines[i][1:]  # a byte no UTF-8 text begins with
    log.write_bytes(b"\n".join(lines))
    assert main(["run", str(plan), "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"cannot recover from {log}" in err and "line 51 is not a valid record" in err, err


def test_stop_of_a_plan_without_a_run_and_a_foreign_run_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = tmp_path / "plan.toml"
    log = tmp_path / "run" / "transitions.jsonl"
    plan.write_text(SHORT.read_text().replace("runs/short/transitions.jsonl", str(log)))
    assert main(["stop", str(plan)]) == 0
    assert "nothing to stop" in capsys.readouterr().out
    assert main(["run", str(plan), "--resume", "--verify"]) == 2
    assert "--verify cannot check a resumed run" in capsys.readouterr().err
    assert not log.parent.exists()  # refused before anything was written
    me = capture(psutil.Process().pid, launch_token="t")
    write_run_state(log.parent, plan="other", run=me, agents={}, trainers={})
    assert main(["stop", str(plan)]) == 2
    assert "belongs to plan 'other'" in capsys.readouterr().err


def test_stop_of_a_path_that_does_not_exist_says_so_on_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing path holding a newline and an escape sequence was printed raw: the error
    took two lines, the second starting with the escape a terminal acts on."""
    missing = str(tmp_path / "a\n\x1b[31mb.toml")
    assert main(["stop", missing]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\x1b" not in err, err
    assert "a\\n\\x1b[31mb.toml does not exist" in err, err


def _lane(seed: int) -> TrainingLane:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    return TrainingLane(model, LaneSpec(role="hybrid", replica="h", pad_multiple=4))


def test_a_saved_core_state_reads_back_exactly(tmp_path: Path) -> None:
    a = _lane(0)
    for _ in range(3):  # Adam moments and steps that are not the initial ones
        a.apply([torch.randn(s) for s in a.grad_shapes()])
    saved = local_dp_zero(a)
    write_state(tmp_path / "s", params=dict(a.named), world=saved, layout=a.layout)
    b = _lane(1)
    scatter_dp_zero(read_state(tmp_path / "s", b.layout), b, group=None)
    got = local_dp_zero(b)
    assert got.version == saved.version == 3 and got.steps == saved.steps
    assert got.hyper == saved.hyper
    for i, by_key in saved.buffers.items():
        for key, entry in by_key.items():
            for k in ("param", "exp_avg", "exp_avg_sq"):
                assert torch.equal(got.buffers[i][key][k], entry[k]), (i, k)
    for (n, p), (_, q) in zip(a.named, b.named, strict=True):
        assert torch.equal(p, q), n


def test_a_restored_state_is_held_to_the_digests_of_its_save(tmp_path: Path) -> None:
    """`check_restored` (what every Core rank runs after a resume's restore): a lane restored
    from the state dir passes, with the digest `state_digest` reads from the dir; a lane that
    holds one element other than the save — a restore that installed something else, or a
    damaged state file read back — is refused, naming the tensor."""
    a = _lane(0)
    for _ in range(3):
        a.apply([torch.randn(s) for s in a.grad_shapes()])
    path = tmp_path / "s"
    write_state(path, params=dict(a.named), world=local_dp_zero(a), layout=a.layout)
    b = _lane(1)
    scatter_dp_zero(read_state(path, b.layout), b, group=None)
    world = local_dp_zero(b)
    n, digest = check_restored(path, params=dict(b.named), world=world, layout=b.layout)
    assert n == 4 * len(b.layout.params) and digest is not None
    assert combine_digests({"tp0": digest}) == state_digest(path)  # one TP shard
    assert check_restored(path, params=dict(b.named), world=None, layout=b.layout)[1] is None

    name = b.layout.params[1].name
    moment = world.buffers[0][b.layout.buffer(0).dtype_key]["exp_avg"]
    moment[b.layout.params[1].offset] += 1e-7  # one element, one rounding step off
    with pytest.raises(VerifyError, match=f"exp_avg/{name} differ"):
        check_restored(path, params=dict(b.named), world=world, layout=b.layout)
    params = {n: p.detach().clone() for n, p in b.named}
    params[name].view(-1)[0] = torch.nextafter(params[name].view(-1)[0], torch.tensor(9.0))
    with pytest.raises(VerifyError, match=f"param/{name} differ"):  # every Core rank's check
        check_restored(path, params=params, world=None, layout=b.layout)

    # a damaged file: read back and installed as it is, the lane is not what was saved
    entry = next(e for e in read_index(path)["tensors"] if e["key"] == f"master/{name}")
    damaged = torch.load(path / entry["file"], weights_only=True)
    damaged[0] = -damaged[0]
    torch.save(damaged, path / entry["file"])
    c = _lane(2)
    scatter_dp_zero(read_state(path, c.layout), c, group=None)
    with pytest.raises(VerifyError, match=f"master/{name} differ"):
        check_restored(path, params=dict(c.named), world=local_dp_zero(c), layout=c.layout)


def test_a_failed_state_save_leaves_no_partial_state_and_is_counted(tmp_path: Path) -> None:
    """A save that fails half way (a full disk under the run's folder) left its partial
    `state-<n>/` beside the good one until the next save — on the disk that was full — and the
    receipt said nothing of it. Now the partial files go, `latest.json` still names the good
    save, and `state_saves` counts the failure with its reason. The pool is the far edge here
    (a stand-in whose save writes part of a state and fails, as a worker's full-disk write
    does): a real save cannot be made to fail portably as root."""
    from ehp_fsm.training.pool_protocol import PoolFailure

    class HalfSaved:
        def save_state(self, path: Path) -> PoolFailure:
            path.mkdir(parents=True)
            (path / "t00000.pt").write_bytes(b"x" * 1000)
            return PoolFailure(
                op="save_state",
                reason="worker_error",
                rank=0,
                replica=None,
                detail="No space left on device",
            )

    saves = StateSaves()
    (tmp_path / "resume" / "state-000003").mkdir(parents=True)
    (tmp_path / "resume" / "latest.json").write_text('{"step": 3, "state": "state-000003"}')
    save_step_state(HalfSaved(), tmp_path, 4, saves, last=True)  # type: ignore[arg-type]
    assert sorted(p.name for p in (tmp_path / "resume").iterdir()) == [
        "latest.json",
        "state-000003",
    ]
    assert saves.as_dict()["failed"] == 1 and saves.saves == 0
    assert "after step 4: trainer pool save_state failed" in saves.last_failure
    assert "No space left on device" in saves.last_failure


def test_resume_bookkeeping(tmp_path: Path) -> None:
    log = tmp_path / "transitions.jsonl"
    assert next_segment(log).name == "transitions.1.jsonl"
    (tmp_path / "transitions.1.jsonl").write_text("")
    (tmp_path / "transitions.7.jsonl").write_text("")
    assert next_segment(log).name == "transitions.8.jsonl"
    assert newest_segment(log) == tmp_path / "transitions.7.jsonl"
    assert newest_segment(tmp_path / "other.jsonl") is None

    class R:
        def __init__(self, data: dict[str, int]) -> None:
            self.data = data

        def get(self, key: str) -> int | None:
            return self.data.get(key)

    assert next_group_index({}) == 0
    assert next_group_index({"g3": R({}), "g12": R({}), "g5": R({})}) == 13
    assert latest_state(tmp_path) == (0, None)
    (tmp_path / "resume" / "state-000004").mkdir(parents=True)
    (tmp_path / "resume" / "latest.json").write_text(
        json.dumps({"step": 4, "state": "state-000004"})
    )
    # latest.json names a state only once it is complete: one without its index, or a
    # latest.json that cannot be read, is refused (a resume then went on from step 0's
    # initial weights, dropping the killed run's trained steps)
    with pytest.raises(ResumeError, match="state-000004, which is not a complete saved state"):
        latest_state(tmp_path)
    (tmp_path / "resume" / "state-000004" / "index.json").write_text("{}")
    assert latest_state(tmp_path) == (4, tmp_path / "resume" / "state-000004")
    for damaged in ('{"step": "x"}', "{", '{"step": 4}', '{"step": 0, "state": "state-000004"}'):
        (tmp_path / "resume" / "latest.json").write_text(damaged)
        with pytest.raises(ResumeError, match=r"latest\.json"):
            latest_state(tmp_path)
    # no latest.json (deleted, or the run killed between a save and its naming): the newest
    # complete state, not the initial weights (a resume went on from step 0 and said only
    # "resumed after step 0", every saved step dropped); one without its index is no save
    (tmp_path / "resume" / "latest.json").unlink()
    (tmp_path / "resume" / "state-000009").mkdir()  # a save cut short: no index
    (tmp_path / "resume" / "state-000002").mkdir()
    (tmp_path / "resume" / "state-000002" / "index.json").write_text("{}")
    assert latest_state(tmp_path) == (4, tmp_path / "resume" / "state-000004")


def test_a_saved_state_is_a_folder_of_the_runs_never_a_link_a_fifo_or_a_step_past_any_plan(
    tmp_path: Path,
) -> None:
    """Without latest.json, a `state-<n>` that was a link to a folder elsewhere (with an
    index) was taken, and the resume restored what the link pointed at; a `state-<n>` past
    any plan's steps (`state-0000999999999999999999`) was taken as the newest save, and the
    resume refused as having "nothing left to resume". With latest.json naming a link it was
    restored from too, and a FIFO as latest.json hung the resume for ever."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "index.json").write_text("{}")
    resume = tmp_path / "resume"
    (resume / "state-000002").mkdir(parents=True)
    (resume / "state-000002" / "index.json").write_text("{}")
    (resume / "state-000007").symlink_to(elsewhere, target_is_directory=True)
    (resume / "state-0000999999999999999999").mkdir()
    (resume / "state-0000999999999999999999" / "index.json").write_text("{}")
    assert latest_state(tmp_path) == (2, resume / "state-000002")
    (resume / "latest.json").write_text(json.dumps({"step": 7, "state": "state-000007"}))
    with pytest.raises(ResumeError, match=r"state-000007, which is a symbolic link \(to "):
        latest_state(tmp_path)
    (resume / "latest.json").unlink()
    os.mkfifo(resume / "latest.json")
    with pytest.raises(ResumeError, match=r"latest\.json is not a file"):
        latest_state(tmp_path)


def _segments(tmp_path: Path) -> Path:
    """Two logs of the short plan's world: `transitions.1.jsonl`, and `transitions.jsonl`
    resuming it after step 2 (its world starts with the Core at version 2)."""
    plan = load_plan(SHORT)
    first = tmp_path / "transitions.1.jsonl"
    orch = Orchestrator.from_plan(plan, log_path=first)
    assert orch.log is not None
    orch.log.close()
    head = replay(first).chain
    assert head is not None
    meta = {
        "resumes": {
            "log": first.name,
            "count": head[0],
            "hash": head[1],
            "step": 2,
            "stopped": [],
            "abandoned_groups": [],
        }
    }
    log = tmp_path / "transitions.jsonl"
    orch = Orchestrator.from_plan(plan, log_path=log, log_meta=meta, core_version=2)
    assert orch.log is not None
    orch.log.close()
    return log


def test_replay_follows_a_resumed_log_to_the_segment_before(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = _segments(tmp_path)
    result = replay(log)
    assert result.previous is not None and result.previous.previous is None
    assert result.world.globals["core_version"] == 2
    assert main(["replay", str(log)]) == 0
    assert "resumes transitions.1.jsonl after step 2" in capsys.readouterr().out


def test_replay_refuses_a_segment_changed_after_the_resume_or_missing(tmp_path: Path) -> None:
    log = _segments(tmp_path)
    first = tmp_path / "transitions.1.jsonl"
    lines = first.read_bytes().splitlines(keepends=True)
    first.write_bytes(b"".join(lines[:-1]))  # cut short: still a valid log on its own
    replay(first)
    with pytest.raises(ChainBroken, match="does not end where the log that resumes it says"):
        replay(log)
    first.unlink()
    with pytest.raises(LogFormatError, match="not beside it"):
        replay(log)


def test_replay_follows_a_long_chain_of_segments_without_recursing(tmp_path: Path) -> None:
    """A run resumed 500 times (anyone may write such a chain): every segment is replayed and
    checked, as two are. Replay recursed once per segment and ended in a RecursionError."""
    plan = load_plan(SHORT)
    meta: dict[str, object] | None = None
    for k in range(500):
        log = tmp_path / f"transitions.{k}.jsonl"
        orch = Orchestrator.from_plan(plan, log_path=log, log_meta=meta)
        head = orch.chain_head
        orch.close()
        assert head is not None
        meta = {"resumes": {"log": log.name, "count": head[0], "hash": head[1], "step": 0}}
    result: ReplayResult | None = replay(log)
    segments = 0
    while result is not None:
        segments, result = segments + 1, result.previous
    assert segments == 500


def test_a_new_run_clears_the_last_runs_verify_records(tmp_path: Path) -> None:
    """A second `--verify` in the same run directory found the first one's records and state
    (its check failed, said only in the receipt): a run starts from a clean directory."""
    from ehp_fsm.run.startup import clear_run_dir

    run_dir = tmp_path / "run"
    for sub in ("verify/records", "verify/ehp-state", "trainers", "resume"):
        (run_dir / sub).mkdir(parents=True)
    (run_dir / "transitions.jsonl").write_text("{}\n")
    clear_run_dir(run_dir, run_dir / "revisions")
    # (`trainers/` is made anew when the run's trainer pool starts: `spawn_pool`)
    assert sorted(p.name for p in run_dir.iterdir()) == ["transitions.jsonl"]


def test_a_run_makes_its_agents_and_trainers_folders_its_users_alone(tmp_path: Path) -> None:
    """`agents/` holds every engine's output (SGLang logs its `--api-key` at start, and the
    engines' key outlives the run) and the agents' records of their processes; `trainers/` the
    trainer workers' logs and Gloo rendezvous. They were made 0755 (the umask), their logs
    0644: any user of the machine read them. The first agent a start starts makes `agents/`
    mode 0700 (the trainer pool `trainers/`: `test_run.py`'s
    `test_run_borrows_returns_and_ends_clean` checks both after a real run). A real agent
    process (no controller: stopped)."""
    from ehp_fsm.run.startup import clear_run_dir, spawn_agent

    run_dir = tmp_path / "run"
    plan_file = tmp_path / "plan.toml"
    plan_file.write_text(plan_text(run_dir / "transitions.jsonl", 5))
    plan = load_plan(plan_file)
    old = os.umask(0o022)
    try:
        (run_dir / "agents" / "h1" / "logs").mkdir(parents=True)  # the last run's, 0755
        (run_dir / "agents" / "h1" / "logs" / "e0-1234abcd.log").write_text("api_key='k'")
        clear_run_dir(run_dir, run_dir / "revisions")
        agent = spawn_agent(plan, plan.hosts[1], "tcp://127.0.0.1:9", run_dir, "t")
    finally:
        os.umask(old)
    agent.terminate()
    assert agent.wait(timeout=30) is not None
    mode = (run_dir / "agents").stat().st_mode & 0o777
    assert mode == 0o700, oct(mode)
    assert not (run_dir / "trainers").exists()  # (no pool started)


@pytest.mark.parametrize(
    ("owner", "needle"),
    [
        ("short", "a run of plan 'short' is still running (pid {pid})"),
        # another plan whose log shares the folder: a start cleared the live run's directory
        # (its engines failed and its trainer died) before this was refused
        ("other", "is in use by a live run of plan 'other' (pid {pid})"),
    ],
)
def test_a_run_into_a_live_runs_directory_is_refused_and_writes_nothing_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], owner: str, needle: str
) -> None:
    """The run directory is the live run's: the refused run's receipt, summary and timeline
    would replace its files (a receipt saying "error" for a run that is fine)."""
    plan = tmp_path / "plan.toml"
    log = tmp_path / "run" / "transitions.jsonl"
    plan.write_text(plan_text(log, 5))
    live = _run_sleeper(log.parent, owner)  # the live run's process: it holds the lock
    try:
        write_run_state(
            log.parent,
            plan=owner,
            run=capture(live.pid, launch_token="t"),
            agents={},
            trainers={},
        )
        log.write_text("")
        before = sorted(p.name for p in log.parent.iterdir())
        assert main(["run", str(plan)]) == 2
        err = capsys.readouterr().err
        assert needle.format(pid=live.pid) in err
        assert sorted(p.name for p in log.parent.iterdir()) == before  # no receipt, no summary
        assert live.poll() is None  # and the live run was left alone
    finally:
        live.kill()
        live.communicate()


def test_a_start_refused_for_its_inputs_leaves_the_last_runs_files_as_they_were(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A finished run's directory, and a run of the same plan refused before it starts (a
    data file that is not there): the finished run's receipt, summary and log stay its own
    (its receipt was overwritten with the refusal's, so `replay LOG --receipt` failed), and
    the output names no log the refused run did not write."""
    plan = tmp_path / "plan.toml"
    log = tmp_path / "run" / "transitions.jsonl"
    plan.write_text(plan_text(log, 5).replace(f"{SHORT.parent}/data/add-0-4.jsonl", "gone.jsonl"))
    log.parent.mkdir()
    # (a log's header line first: `run.log` may name a log, or no file, not any file)
    files = {"transitions.jsonl": '{"event": "ehp-fsm.log"}\nthe last run\'s log\n'}
    files["receipt.json"] = '{"log_chain": 1}'
    files["summary.txt"] = "the last run's summary\n"
    for name, text in files.items():
        (log.parent / name).write_text(text)
    assert main(["run", str(plan)]) == 2
    out, err = capsys.readouterr()
    assert "gone.jsonl" in err and "does not exist" in err
    # (its lock file, taken before the inputs are read, is no run's file)
    left = {p.name: p.read_text() for p in log.parent.iterdir() if p.name != "run.lock"}
    assert left == files
    assert "log:" not in out and "receipt:" not in out
    # into an empty run directory the refusal is written up, naming no log
    for name in files:
        (log.parent / name).unlink()
    assert main(["run", str(plan)]) == 2
    out = capsys.readouterr().out
    assert "log: not written (the run stopped before it began one)" in out
    assert json.loads((log.parent / "receipt.json").read_text())["log"] is None
    assert not log.exists()


@pytest.mark.slow
def test_a_full_disk_mid_run_names_the_step_and_resume_and_hides_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills mid-run (faked at the far edge: the run's own state file write
    raises ENOSPC, as it did on a 2.2 MB tmpfs; the receipt cannot be written either). Before:
    the receipt's write failed in turn and that OSError replaced the run's, with no file and
    no step. Now: a RunError naming the step, the path and `--resume`, and the receipt line
    says it was not written."""
    import errno
    import io

    from ehp_fsm.run import ending
    from ehp_fsm.run import job as job_module

    real_write = job_module.write_run_state
    writes = {"n": 0}

    def fill_after_step_two(run_dir: Path, **kw: object) -> None:
        writes["n"] += 1
        if writes["n"] > 3:  # after start-up's writes and a first step
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(run_dir, **kw)  # type: ignore[arg-type]

    real_whole = ending.write_whole  # the receipt is written whole or not at all through it

    def no_receipt(path: Path, text: str, **k: Any) -> None:
        if path.name == "receipt.json" and writes["n"] > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_whole(path, text, **k)

    monkeypatch.setattr(job_module, "write_run_state", fill_after_step_two)
    monkeypatch.setattr(ending, "write_whole", no_receipt)
    log = tmp_path / "run" / "transitions.jsonl"
    (tmp_path / "plan.toml").write_text(plan_text(log, 6))
    out = io.StringIO()
    with pytest.raises(job_module.RunError) as err:
        job_module.run(load_plan(tmp_path / "plan.toml"), out=out)
    assert re.search(r"the run stopped after step [1-5]: No space left on device", str(err.value))
    assert str(log.parent) in str(err.value) and "--resume" in err.value.fix
    assert "receipt: not written (No space left on device" in out.getvalue()


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        ({"run": None}, "its entry for run is missing"),
        ({"run": {"pid": "x"}}, "its entry for run is \"{'pid': 'x'}\", not {pid, start_time}"),
        ({"agents": 5}, "its `agents` is '5', not a table of process identities"),
        ({"agents": {"h0": []}}, "its entry for agents h0 is '[]', not {pid, start_time}"),
        ({"trainers": {"0": {"pid": 2, "start_time": None}}}, "its entry for trainers 0 is"),
        # a pid below 1 was psutil's ValueError traceback (`Owned._live`), a NaN start time
        # the same as any process's
        ({"run": {"pid": -1, "start_time": 1.0}}, "its entry for run is \"{'pid': -1, "),
        ({"run": {"pid": 0, "start_time": 1.0}}, "its entry for run is \"{'pid': 0, "),
        ({"agents": {"h1": {"pid": -5, "start_time": 1.0}}}, "its entry for agents h1 is"),
        ({"trainers": {"0": {"pid": 2, "start_time": float("nan")}}}, "for trainers 0 is"),
    ],
)
def test_stop_with_an_edited_run_state_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: dict[str, object], why: str
) -> None:
    """A run.json edited by hand (its format, plan and host right) was a KeyError or an
    AttributeError out of `ehp-fsm stop`; now the file, what is wrong, and what to do."""
    plan = tmp_path / "plan.toml"
    log = tmp_path / "run" / "transitions.jsonl"
    plan.write_text(SHORT.read_text().replace("runs/short/transitions.jsonl", str(log)))
    write_run_state(
        log.parent,
        plan="short",
        run=capture(psutil.Process().pid, launch_token="t"),
        agents={},
        trainers={},
    )
    state = log.parent / "run.json"
    doc = json.loads(state.read_text())
    doc["run"]["start_time"] = 1.0  # an identity no live process has: nothing is signalled
    doc.update(edit)
    if edit.get("run", 0) is None:
        del doc["run"]
    state.write_text(json.dumps(doc))
    for given in (plan, log.parent):  # the plan, or the run's directory
        assert main(["stop", str(given)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"ehp-fsm: error: {state} is not a run state this ehp-fsm wrote")
        assert why in err and f"remove {state} by hand" in err and "Traceback" not in err, err


def test_stop_with_a_negative_pid_in_an_agents_state_file_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An engine entry of `agents/<host>/processes.json` with pid -3 was psutil's ValueError
    traceback out of `ehp-fsm stop` (`Owned._live`)."""
    run_dir = tmp_path / "run"
    _killed_run(run_dir)
    state = run_dir / "agents" / "h1" / "processes.json"
    state.parent.mkdir(parents=True)
    entry = {"pid": -3, "start_time": 1.0, "machine": "rollout_engine", "instance": "e0"}
    state.write_text(json.dumps([entry]))
    assert main(["stop", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert f"{state} is not an agent state file this ehp-fsm wrote" in err, err
    assert "entry for engine e0 is not an identity" in err and f"remove {state} by hand" in err
    assert "Traceback" not in err, err


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("garbage", "it is not JSON (Expecting value"),
        ("", "it is empty"),
        ("[]", "it holds '[]', not a run state this ehp-fsm wrote"),
        ("{}", "it holds '{}', not a run state this ehp-fsm wrote"),
        ('{"format": "ehp-fsm-run-state/1"}', "it names no plan"),
    ],
)
def test_stop_of_a_run_directory_whose_run_state_cannot_be_read_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, why: str
) -> None:
    """`ehp-fsm stop RUN_DIR` with a run.json there that it could not read said "no run state
    in RUN_DIR: nothing to stop" and exited 0 — false, and what the run recorded may still
    run. Now: the file cannot be read, why, what to check; exit 2. A folder without a
    run.json is still "nothing to stop" (`test_run_outputs.py`)."""
    state = tmp_path / "run.json"
    state.write_text(text)
    assert main(["stop", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert "nothing to stop" not in out, out
    assert err.startswith(f"ehp-fsm: error: {state} cannot be read, so nothing was stopped"), err
    assert "may still run" in err and f"because {why}" in err, err
    assert "grep -E 'ehp[-_]fsm|sglang'" in err and str(tmp_path / "controller.log") in err, err
    assert f"then remove {state}" in err and "Traceback" not in err, err


def test_stop_of_a_run_state_nested_too_deep_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run.json (or an agent's state file) of `[[[...` 200,000 deep raised a RecursionError
    traceback out of `ehp-fsm stop`, given the plan or the run's directory."""
    plan = tmp_path / "plan.toml"
    log = tmp_path / "run" / "transitions.jsonl"
    plan.write_text(SHORT.read_text().replace("runs/short/transitions.jsonl", str(log)))
    log.parent.mkdir()
    state = log.parent / "run.json"
    state.write_text("[" * 200_000)
    assert main(["stop", str(log.parent)]) == 2  # no plan named there, but a run.json is
    err = capsys.readouterr().err
    assert err.startswith(f"ehp-fsm: error: {state} cannot be read"), err
    assert "nests deeper than any JSON the run writes" in err and "Traceback" not in err, err
    assert main(["stop", str(plan)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ehp-fsm: error: {state} is unreadable"), err
    assert "nests deeper than any JSON the run writes" in err and "Traceback" not in err, err
    _killed_run(log.parent)
    (log.parent / "agents" / "h1").mkdir(parents=True)
    (log.parent / "agents" / "h1" / "state.json").write_text("[" * 200_000)
    assert main(["stop", str(plan)]) == 0, capsys.readouterr().err


def test_stop_and_resume_of_a_run_directory_holding_fifos_do_not_hang(tmp_path: Path) -> None:
    """A FIFO as run.json, run.lock or an agent's state file (planted in a run directory
    others can write) hung `ehp-fsm stop` and `--resume` for ever: each read waited for a
    writer. Each is read only as a regular file now."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stop = [sys.executable, "-m", "ehp_fsm.cli", "stop", str(run_dir)]
    os.mkfifo(run_dir / "run.json")
    os.mkfifo(run_dir / "run.lock")
    done = subprocess.run(stop, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 2, done  # a run.json there that cannot be read: not "nothing"
    assert "run.json is a FIFO, not a file" in done.stderr, done.stderr
    (run_dir / "run.json").unlink()
    (run_dir / "run.lock").unlink()
    _killed_run(run_dir)
    (run_dir / "agents" / "h1").mkdir(parents=True)
    os.mkfifo(run_dir / "agents" / "h1" / "state.json")
    done = subprocess.run(stop, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    (run_dir / "resume").mkdir()
    os.mkfifo(run_dir / "resume" / "plan.json")
    read = [
        sys.executable,
        "-c",
        "import sys; from pathlib import Path; "
        "from ehp_fsm.run.resume import check_resumed_plan; from ehp_fsm.plan import "
        "load_plan; check_resumed_plan(Path(sys.argv[1]), load_plan(sys.argv[2]))",
    ]
    done = subprocess.run(
        [*read, str(run_dir), str(SHORT)], capture_output=True, text=True, timeout=30, check=False
    )
    assert "plan.json (the plan the run being resumed trained by) cannot be read" in done.stderr


def test_run_steps_beyond_a_plans_limit_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--steps 10**20` started a run (a plan's grpo.steps is at most MAX_COUNT); now refused
    first (`--verify --resume`, refused next, shows that nothing else was looked at)."""
    plan = tmp_path / "plan.toml"
    log = tmp_path / "run" / "transitions.jsonl"
    plan.write_text(SHORT.read_text().replace("runs/short/transitions.jsonl", str(log)))
    assert main(["run", str(plan), "--steps", str(10**20), "--verify", "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"--steps {10**20} is not a number of steps" in err, err
    assert f"give --steps within 1..{1 << 30}" in err and not log.parent.exists(), err


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--resume", "--fresh"], "--resume and --fresh contradict each other"),
        (["--resume", "--verify"], "--verify cannot check a resumed run"),
        (["--resume", "--steps", "0"], "--steps 0 is not a number of steps"),
    ],
)
def test_contradicting_flags_are_said_before_a_run_to_resume_is_looked_for(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    said: str,
) -> None:
    """With a relative `[run] log` (the examples'), `--resume --fresh` where no run is was
    answered "there is no run of plan 'short' to resume": the flags' contradiction is what to
    mend, and it is said first."""
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(SHORT), *flags]) == 2
    err = capsys.readouterr().err
    assert said in err and "to resume" not in err.split("Fix:")[0], err
    assert not (tmp_path / "runs").exists()


def test_a_new_run_keeps_the_last_runs_newest_revision_and_says_where(tmp_path: Path) -> None:
    """A second `ehp-fsm run` of a plan removed the first run's trained revisions — its trained
    model — without a word. It now keeps the newest one beside the revisions folder (one run
    back: a third run replaces it with the second's) and says where. A resume keeps them all
    and says nothing; a leftover that is not a revision is not taken for one."""
    from ehp_fsm.run.startup import clear_run_dir

    run_dir = tmp_path / "run"
    revisions, previous = run_dir / "revisions", run_dir / "revisions.previous"
    for rev in ("r00000003", "r00000004", ".tmp-r00000005", "readme"):
        (revisions / rev).mkdir(parents=True)
    (revisions / "r00000004" / "model.safetensors").write_bytes(b"trained")
    said: list[str] = []
    clear_run_dir(run_dir, revisions, resume=True, say=said.append)
    assert said == [] and (revisions / "r00000004").is_dir() and not previous.exists()
    clear_run_dir(run_dir, revisions, say=said.append)
    assert len(said) == 1 and f"kept as {previous / 'r00000004'} (1 older removed);" in said[0]
    assert not revisions.exists()
    assert [p.name for p in previous.iterdir()] == ["r00000004"]
    assert (previous / "r00000004" / "model.safetensors").read_bytes() == b"trained"
    clear_run_dir(run_dir, revisions, say=said.append)  # nothing there: no word, kept kept
    assert len(said) == 1 and (previous / "r00000004").is_dir()
    (revisions / "r00000009").mkdir(parents=True)  # a third run replaces it with the second's
    clear_run_dir(run_dir, revisions, say=said.append)
    assert [p.name for p in previous.iterdir()] == ["r00000009"] and len(said) == 2
    assert f"kept as {previous / 'r00000009'} (the one kept by the run before removed);" in said[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_resume_whose_plan_names_another_model_is_refused_before_anything_moves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The model's files changed between a run and its resume (here its config.json, as an
    edited plan pointing at another model would change them): refused naming the file and
    `[model] path`, before the run's log is set aside. It was taken: the resume restored the
    saved state into that model and trained on (exit 0)."""
    monkeypatch.setenv("EHP_TEST_RUN", uuid.uuid4().hex)
    model = tmp_path / "model"
    shutil.copytree(session_model(), model)
    log = tmp_path / "run" / "transitions.jsonl"
    plan = tmp_path / "plan.toml"
    plan.write_text(plan_text(log, 1).replace(str(session_model()), str(model)))
    first = subprocess.run(  # its own process: the resume's is another
        [sys.executable, "-m", "ehp_fsm.cli", "run", str(plan)], capture_output=True, text=True
    )
    assert first.returncode == 0, first.stdout + first.stderr
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "rope_theta": 12345.0}))
    assert main(["run", str(plan), "--resume", "--steps", "2"]) == 2
    err = capsys.readouterr().err
    model_is = f"the plan's model {model} ([model] path) is not the model the run being resumed"
    assert f"{model_is} trained" in err, err
    assert "its config.json differs from revision" in err, err
    assert log.exists() and not (log.parent / "transitions.1.jsonl").exists()


_SLOW_REWARD = """
import pathlib
here = pathlib.Path(__file__).parent
(here / "importing").write_text("")
(here / "go").read_text()  # a FIFO: blocks until the test writes it
def score(prompt, completion, label, metadata):
    return 0.0
"""


@pytest.mark.timeout(120)
def test_stop_finds_a_run_still_reading_its_inputs(tmp_path: Path) -> None:
    """A run still importing its reward module (blocked on a FIFO nobody writes yet) has
    written no `run.json`: `ehp-fsm stop` used to say "nothing to stop", and the run then went
    on. It finds the run by its run-directory lock and asks it to stop; the run ends cleanly
    (143) before it clears or starts anything, and the earlier run's receipt stays.

    The prompts are read after the reward is imported: 600,000 of them, which the run read and
    tokenized whole (14.5 s here) before it said it stopped; the reading now ends at the stop."""
    log = tmp_path / "run" / "transitions.jsonl"
    log.parent.mkdir()
    (log.parent / "receipt.json").write_text('{"earlier": true}')
    (tmp_path / "slow_reward.py").write_text(_SLOW_REWARD)
    os.mkfifo(tmp_path / "go")
    prompts = tmp_path / "many.jsonl"
    line = b'{"prompt": "1+2=", "label": "3"}\n'
    prompts.write_bytes(line * 600_000)
    plan = tmp_path / "plan.toml"
    text = plan_text(log, 5).replace('function = "exact_match"', 'function = "slow_reward:score"')
    text = re.sub(r'train = "[^"]*"', f'train = "{prompts}"', text)
    assert f'train = "{prompts}"' in text
    plan.write_text(text)
    exe = [sys.executable, "-m", "ehp_fsm.cli"]
    run = subprocess.Popen([*exe, "run", str(plan)], stdout=subprocess.PIPE, text=True)
    stop: subprocess.Popen[str] | None = None
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "importing").exists():
            assert time.monotonic() < deadline and run.poll() is None, "no reward import"
            time.sleep(0.05)
        stop = subprocess.Popen([*exe, "stop", str(plan)], stdout=subprocess.PIPE, text=True)
        assert stop.stdout is not None
        said = stop.stdout.readline()
        assert f"a run (pid {run.pid}) is starting" in said and "SIGTERM" in said
        time.sleep(0.5)  # the signal is delivered; the import goes on until the FIFO opens
        (tmp_path / "go").write_text("go")
        released = time.monotonic()
        out, _ = run.communicate(timeout=60)
        took = time.monotonic() - released
        rest, _ = stop.communicate(timeout=60)
        assert run.returncode == 128 + 15, out
        assert "stopped by a signal while reading the plan's inputs" in out
        assert took < 6.0, (took, out)  # no prompt read past the stop (14.5 s of them before)
        assert stop.returncode == 0, rest
        assert f"stopped run (pid {run.pid}): SIGTERM" in rest
        assert not log.exists() and not (log.parent / "run.json").exists()
        assert json.loads((log.parent / "receipt.json").read_text()) == {"earlier": True}
    finally:
        for p in (run, stop):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def test_a_stop_while_a_resume_replays_the_log_ends_it_with_the_log_as_it_was(
    tmp_path: Path,
) -> None:
    """`ehp-fsm run --resume` replays the killed run's log before anything starts. A stop was
    answered only once the whole log had replayed (the log below: 260,028 lines, 2.15 s alone;
    a long run's log of millions, a minute or more); it now ends the replay within a batch of
    lines, the log where and as it was (its torn tail written back), no segment set aside and
    nothing written in the run directory.

    The killed run is made as in the tests above (a run state whose process is gone, its plan
    recorded). Its log is a long log of the same engine (`training`: 5,000 steps, 260,028
    records on one engine), a stand-in for the log of a long real run, which no run on this
    machine writes in a test's time. The stop is sent once the run has mapped the log, which
    only the replay does."""
    run_dir = tmp_path / "run"
    log = run_dir / "transitions.jsonl"
    plan = tmp_path / "plan.toml"
    plan.write_text(plan_text(log, 5))
    _killed_run(run_dir)
    record_plan(run_dir, load_plan(plan))
    training(log, 5000).engine.close()
    torn = log.read_bytes() + b'{"seq": 1'  # killed mid-line: the recovery cuts it first
    log.write_bytes(torn)
    name = str(log.resolve())
    status, out, took = sigterm_when(
        [sys.executable, "-m", "ehp_fsm.cli", "run", str(plan), "--resume"],
        lambda pid: name in Path(f"/proc/{pid}/maps").read_text(),
        "replay of the log",
    )
    assert status == 128 + 15, out
    assert "stopped by a signal while replaying the log of the run it resumes" in out, out
    # (the message says the replay ended; this bounds the ending: 0.17 s measured, while the
    # whole recovery of this log takes 2.15 s alone)
    assert took < 10.0, took
    assert log.read_bytes() == torn
    assert not (run_dir / "transitions.1.jsonl").exists()
    assert not (run_dir / "receipt.json").exists()


def test_a_resume_whose_plan_changed_how_the_run_trains_is_refused_naming_each_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A killed run, then its plan edited: another learning rate and group size are refused
    before anything moves (they were taken without a word, and the run went on as neither plan
    would have trained it); another EHP policy or step count is said and taken."""
    plan = tmp_path / "plan.toml"
    log = tmp_path / "run" / "transitions.jsonl"
    text = plan_text(log, 5)
    plan.write_text(text)
    record_plan(log.parent, load_plan(plan))  # as the killed run's start did
    _killed_run(log.parent)
    shutil.copy(GOLDEN, log)
    assert "group_size = 4" in text and "max_hybrids = 1" in text
    edited = text.replace("group_size = 4", "group_size = 2").replace(
        "[grpo]", "[grpo]\nlearning_rate = 0.5"
    )
    plan.write_text(edited)
    assert main(["run", str(plan), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "the plan changed how the run trains since the run being resumed started" in err, err
    assert "killed" not in err, err  # a stopped run is resumed as well
    assert "grpo.group_size: 4 -> 2" in err and "grpo.learning_rate: 0.001 -> 0.5" in err
    assert log.read_bytes() == GOLDEN.read_bytes() and not newest_segment(log)
    # what does not change how the run trains is listed, and taken
    plan.write_text(
        text.replace("max_hybrids = 1", "max_hybrids = 2").replace("steps = 5", "steps = 7")
    )
    assert check_resumed_plan(log.parent, load_plan(plan)) == [
        "ehp.max_hybrids: 1 -> 2",
        "grpo.steps: 5 -> 7",
    ]
    # `run --steps N` trains to N whatever the plan says: the killed run's N is what was, the
    # resume's N is what is (a resume to more steps than the killed run said nothing of it)
    plan.write_text(text)
    record_plan(log.parent, load_plan(plan), steps=3)  # as `run PLAN --steps 3` started
    assert check_resumed_plan(log.parent, load_plan(plan), steps=6) == ["grpo.steps: 3 -> 6"]
    assert check_resumed_plan(log.parent, load_plan(plan)) == ["grpo.steps: 3 -> 5"]
    assert check_resumed_plan(log.parent, load_plan(plan), steps=3) == []
    # a run of an older ehp-fsm recorded no plan: nothing to compare
    (log.parent / "resume" / "plan.json").unlink()
    plan.write_text(edited)
    assert check_resumed_plan(log.parent, load_plan(plan)) == []


def _files(root: Path) -> dict[str, bytes]:
    """Every file under `root` (its path under `root`: its bytes)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_fresh_start_whose_controller_port_is_taken_keeps_the_last_runs_resume_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A killed run's directory (saved state after step 2, its log and the segment before it,
    its revisions) and `ehp-fsm run PLAN` without --resume on a machine where another process
    holds the plan's controller port: refused naming the port, and everything a resume needs
    is as the killed run left it. The start cleared the run directory (resume state, log
    segments, revisions moved to `revisions.previous`) and replaced the log with its own
    header, then failed to bind: the run never began, and the resume it was mistyped for had
    nothing left. Into an empty run directory the refusal is written up naming no log. A real
    socket holds the port."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    plan = tmp_path / "plan.toml"
    log = tmp_path / "run" / "transitions.jsonl"
    plan.write_text(plan_text(log, 5).replace("tcp://127.0.0.1:*", f"tcp://127.0.0.1:{port}"))
    run_dir = log.parent
    _killed_run(run_dir)
    _plan_recorded(run_dir)
    log.write_bytes(GOLDEN.read_bytes())  # ends with the Core after step 2
    (run_dir / "transitions.1.jsonl").write_text("the segment the log resumes\n")
    state = run_dir / "resume" / "state-000002"
    state.mkdir(parents=True)
    (state / "index.json").write_text("{}")
    (run_dir / "resume" / "latest.json").write_text('{"step": 2, "state": "state-000002"}')
    (run_dir / "revisions" / "r00000003").mkdir(parents=True)
    (run_dir / "revisions" / "r00000003" / "model.safetensors").write_text("weights")
    before = _files(run_dir)
    try:
        # a plain start over the stopped run is refused first (`Job.claim`), touching nothing
        assert main(["run", str(plan)]) == 2
        out, err = capsys.readouterr()
        assert "stopped after step 2" in err and "ehp-fsm run PLAN --fresh" in err, err
        assert {k: v for k, v in _files(run_dir).items() if k != "run.lock"} == before
        # asked for a fresh start, the port is refused before anything is removed
        assert main(["run", str(plan), "--fresh"]) == 2
        out, err = capsys.readouterr()
        assert f"cannot bind the controller to tcp://127.0.0.1:{port}" in err, err
        assert "Address already in use" in err and "pick a free port" in err, err
        # (its lock file, taken before anything, is no run's file)
        assert {k: v for k, v in _files(run_dir).items() if k != "run.lock"} == before
        assert not (run_dir / "revisions.previous").exists()
        point = prepare_resume("short", log, say=print, steps=5)  # the resume still goes on
        assert point.step == 2 and point.segment == run_dir / "transitions.2.jsonl"
        shutil.rmtree(run_dir)
        assert main(["run", str(plan)]) == 2
    finally:
        holder.close()
    out, err = capsys.readouterr()
    assert "cannot bind the controller" in err
    assert "log: not written (the run stopped before it began one)" in out
    assert json.loads((run_dir / "receipt.json").read_text())["log"] is None
    assert not log.exists()


def test_stop_signals_only_the_process_that_holds_the_run_directory_lock(tmp_path: Path) -> None:
    """`stop` finds a starting run by its `run.lock`; it believes the pid written there only
    when the kernel names that process as the lock's holder (`/proc/locks`), and only for its
    own plan: a file naming another process (a forged or stale one) signals nothing."""
    run_dir = tmp_path / "run"
    assert starting_run(run_dir, "short") is None  # no lock file at all
    held = lock_run_dir(run_dir, plan="short")
    assert held is not None
    victim = _sleeper()
    try:
        me = starting_run(run_dir, "short")
        assert me is not None and me.pid == os.getpid() and me.process() is not None
        assert starting_run(run_dir, "other") is None  # another plan's run in a shared folder
        (run_dir / "run.lock").write_text(f"{victim.pid}\nshort\n")  # the lock is still held
        assert starting_run(run_dir, "short") is None
        held.close()  # nobody holds it: the file names nobody, whatever it says
        (run_dir / "run.lock").write_text(f"{os.getpid()}\nshort\n")
        assert starting_run(run_dir, "short") is None
        assert victim.poll() is None
    finally:
        held.close()
        victim.kill()
        victim.wait()


@pytest.mark.slow
def test_stop_signals_no_process_a_forged_run_state_names_by_its_right_identity(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Security review: anyone who can write a run directory (a shared or world-writable
    runs/) could forge `run.json` — or an agent's `processes.json` — naming an unrelated process
    of the user by its right pid and start time (both in `ps`), and `ehp-fsm stop RUN_DIR`
    SIGTERMed it. A process is signalled only when it proves it is the run's: the run by
    holding its directory's lock, the others by carrying their recorded launch token in their
    own environment. Real processes; nothing of theirs carries a token or holds the lock."""
    run_dir = tmp_path / "run"
    victim, bystander, stranger = _sleeper(), _sleeper(), _sleeper()
    try:
        write_run_state(
            run_dir,
            plan="short",
            run=capture(victim.pid, launch_token="forged"),
            agents={"h0": capture(bystander.pid, launch_token="forged")},
            trainers={},
        )
        me = capture(stranger.pid, launch_token="forged")
        (run_dir / "agents" / "h0").mkdir(parents=True)
        (run_dir / "agents" / "h0" / "processes.json").write_text(
            json.dumps([{**me.to_dict(), "token": "forged", "machine": "rollout_engine"}])
        )
        assert main(["stop", str(run_dir)]) == 1
        out = capsys.readouterr().out
        for p in (victim, bystander, stranger):
            assert p.poll() is None, out  # never signalled
        assert f"pid {victim.pid} does not hold this run's lock" in out, out
        for p in (bystander, stranger):
            assert f"pid {p.pid} does not carry this run's launch token: not signalled" in out
        assert "stopped" not in out.replace("were not signalled", ""), out
    finally:
        for p in (victim, bystander, stranger):
            p.kill()
            p.wait()


def test_stop_of_a_path_that_does_not_exist_says_what_stop_takes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ehp-fsm stop /no/such/run` was refused as a plan alone ("plan key `<file>` is invalid
    ... cannot be read"), without a word that a run's directory is taken too."""
    assert main(["stop", str(tmp_path / "gone")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'gone'} does not exist" in err and "a run's directory" in err, err
    assert "plan key" not in err, err


def test_stop_of_a_runs_own_file_says_what_stop_takes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ehp-fsm stop runs/x/transitions.jsonl` (a run's file, not its folder) was refused as a
    plan alone: "the plan ... cannot be used: it is not valid TOML. Fix: fix the syntax" — a
    fix that sends the operator to edit the run's log. Now: what stop takes, and the folder."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    log = run_dir / "transitions.jsonl"
    log.write_text('{"schema_version":3}\n', encoding="utf-8")
    assert main(["stop", str(log)]) == 2
    err = capsys.readouterr().err
    assert f"{log} is neither a plan nor a run's directory" in err, err
    assert f"holding run.json: e.g. {run_dir})" in err and "fix the syntax" not in err, err


def test_stop_ends_a_stopped_process_with_sigterm_not_at_the_grace(tmp_path: Path) -> None:
    """A process of the run frozen by SIGSTOP (Ctrl-Z, an operator's mistake) holds SIGTERM
    pending until it is continued: `stop` SIGKILLed it after the whole grace ("SIGKILL after
    N s", and an agent's engine left its GPU `releasing` that long). SIGTERM is now followed by
    SIGCONT, as systemd does: it ends at once, by its own SIGTERM."""
    run_dir = tmp_path / "run"
    frozen = _sleeper(token="t")
    gone = _sleeper()
    gone_id = capture(gone.pid, launch_token="t")
    gone.kill()
    gone.wait()
    try:
        os.kill(frozen.pid, signal.SIGSTOP)
        write_run_state(
            run_dir,
            plan="short",
            run=gone_id,
            agents={},
            trainers={0: capture(frozen.pid, launch_token="t")},
        )
        doc = read_run_state(run_dir, "short")
        assert doc is not None
        t0 = time.monotonic()
        report = stop_owned(run_dir, doc, grace_s=20.0)
        assert report.stopped == (f"trainer 0 (pid {frozen.pid}): SIGTERM",), report
        assert time.monotonic() - t0 < 10.0 and report.left == ()
    finally:
        frozen.kill()
        frozen.wait()


def test_why_a_run_did_not_end_cleanly_is_one_printable_line(tmp_path: Path) -> None:
    """What exit 1 prints after the summary (`ending.unclean_end`) quotes the run's files: a
    run.json edited during the run (its host) came back in the reason it could not be read,
    and was printed raw to the terminal — escape sequences acted on, a newline starting a
    line that looked like ehp-fsm's own. Now each such character shows as its escape."""
    from ehp_fsm.run.ending import unclean_end

    hostile = "\x1b]0;owned\x07\x1b[2J\u202e"
    receipt = {
        "unconfirmed_hosts": ["h1"],
        "stopped_at_end": [f"engine e1{hostile} (pid 7): SIGTERM"],
        "shutdown_errors": ["controller: RuntimeError('x\\ny')", f"a\n{hostile}"],
        "left_running": [f"run.json: ... Fix: run the command on {hostile}\nehp-fsm: ok"],
    }
    said = unclean_end("short", tmp_path / "run", receipt)
    assert said.isprintable(), repr(said)
    assert "\\x1b]0;owned\\x07\\x1b[2J\\u202e" in said and "\\nehp-fsm: ok" in said
    assert said.startswith("ehp-fsm run short: the steps ran, but the run did not end cleanly")
    assert f"stop them with `ehp-fsm stop {tmp_path / 'run'}`" in said


def test_a_process_that_ends_as_stop_looks_at_it_is_not_named_as_a_strangers() -> None:
    """An agent of a killed run stops by itself; looked at as it ends, its environment is
    already gone (no launch token to read) while it is not yet a zombie, and `stop` named it as
    a process that "does not carry this run's launch token" and exited 1 (seen in CI, in
    `test_kill9_of_the_run_then_stop_or_resume`). A process without the token that ends within
    `EXITING_S` is nothing left of the run; one that stays is still refused by name."""
    from ehp_fsm.run.owned import EXITING_S, Owned
    from ehp_fsm.runtime.identity import start_time_of

    staying = _sleeper()
    # started last, so that it is still running when `stop` looks at it (started first, a
    # fixed wait for each had it exited, a zombie, before: the test did not see it end)
    ending = _sleeper(sleep_s=0.5)  # (no token: its environ lacks it)
    try:
        for p in (ending, staying):
            owned = Owned("agent h1", p.pid, start_time_of(p.pid), token="the-runs-token")
            t0 = time.monotonic()
            why = owned.refusal()
            if p is ending:
                assert why is None and time.monotonic() - t0 < EXITING_S + 1
            else:
                assert why is not None and "does not carry this run's launch token" in why
    finally:
        for p in (ending, staying):
            p.kill()
            p.wait()


def test_a_resume_from_another_directory_says_the_log_is_taken_from_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plan's relative `[run] log` is taken from the directory the command runs in: a
    `--resume` from another directory found no run and advised starting without --resume —
    a fresh start, training from the beginning. It says where it looked and why, and to
    resume from the run's directory."""
    plan = tmp_path / "plan.toml"
    plan.write_text(plan_text(Path("runs/short/transitions.jsonl"), 5))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["run", str(plan), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "[run] log = 'runs/short/transitions.jsonl' is relative" in err, err
    assert str(elsewhere) in err and "from the directory the run was started in" in err, err
    assert "start the run without --resume" not in err, err
    assert not (elsewhere / "runs").exists()
