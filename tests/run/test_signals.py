"""A signal at any moment of start-up ends the run as interrupted: 128 + the signal, a receipt
with `interrupted: true` and no error, within seconds — never "did not start within 120 s".

`ehp-fsm run` of the short plan in this process; the signal comes from a real child process
(`kill(getppid(), SIGTERM)`) started at the moment under test, and that process records when it
sent it (CLOCK_MONOTONIC is one clock for every process of the machine).
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ehp_fsm.plan import load_plan
from ehp_fsm.rollout.launch import free_port
from ehp_fsm.run import job as job_module
from ehp_fsm.run.job import RunError
from ehp_fsm.runtime.controller import Controller
from tests.procs import as_from_a_terminal
from tests.run.soundness import assert_run_sound
from tests.run.test_run import SHORT, assert_no_orphans, leftovers, plan_text

#: The longest a run may take from the signal to its return (shutdown of what started).
PROMPT_S = 15.0
_KILLER = (
    "import os, signal, sys, time\n"
    "open(sys.argv[1], 'w').write(repr(time.monotonic()))\n"
    "os.kill(os.getppid(), signal.SIGTERM)\n"
)


def signal_parent(stamp: Path) -> subprocess.Popen[bytes]:
    """A child that writes the time and sends SIGTERM to this process, once."""
    return subprocess.Popen([sys.executable, "-c", _KILLER, str(stamp)])


def signal_after(
    monkeypatch: pytest.MonkeyPatch,
    owner: object,
    name: str,
    killers: list[subprocess.Popen[bytes]],
) -> Callable[[Path], None]:
    """`run_interrupted`'s `arm`: `owner.name` (a function, or a method of a class) runs as
    always, then a child sends this process SIGTERM (kept in `killers`)."""
    real = getattr(owner, name)

    def arm(stamp: Path) -> None:
        def then_signal(*args: Any, **kwargs: Any) -> Any:
            out = real(*args, **kwargs)
            killers.append(signal_parent(stamp))
            return out

        monkeypatch.setattr(owner, name, then_signal)

    return arm


def run_interrupted(
    tmp: Path, monkeypatch: pytest.MonkeyPatch, arm: Callable[[Path], None], *, steps: int = 50
) -> Any:
    run_id = uuid.uuid4().hex
    monkeypatch.setenv("EHP_TEST_RUN", run_id)
    log = tmp / "run" / "transitions.jsonl"
    (tmp / "plan.toml").write_text(plan_text(log, steps))
    stamp = tmp / "signal-sent"
    arm(stamp)
    out = io.StringIO()
    status = job_module.run(load_plan(tmp / "plan.toml"), out=out)
    returned = time.monotonic()
    sent = float(stamp.read_text())
    receipt = json.loads((log.parent / "receipt.json").read_text())
    assert status == 128 + signal.SIGTERM, receipt
    # the summary's revision is the receipt's: a stop while the engines started (revision 1
    # published) said "final revision 0"
    said = f"last step {receipt['last_step']}, final revision {receipt['last_revision'] or 0}\n"
    assert said in out.getvalue(), out.getvalue()
    assert receipt["interrupted"] is True and receipt["error"] is None, receipt
    assert returned - sent < PROMPT_S, f"{returned - sent:.1f} s from the signal to the end"
    assert_no_orphans(run_id)
    assert_run_sound(log, run_id=run_id, interrupted=True)  # the fault matrix's checks
    return receipt


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_signal_while_waiting_for_the_agents_is_an_interruption(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The agents never connect: each is a process that signals the run instead.
    killers: list[subprocess.Popen[bytes]] = []

    def arm(stamp: Path) -> None:
        def agent_that_signals(*_args: object) -> subprocess.Popen[bytes]:
            if not killers:
                killers.append(signal_parent(stamp))
                return killers[0]
            return subprocess.Popen([sys.executable, "-c", "pass"])

        monkeypatch.setattr(job_module, "spawn_agent", agent_that_signals)

    receipt = run_interrupted(tmp_path, monkeypatch, arm)
    assert receipt["clean_controller"] is True


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("owner", "name", "revision"),
    [(Controller, "launch_engines", None), (job_module, "publish_initial", 1)],
    ids=["the_engines_launched", "revision_1_published"],
)
def test_a_signal_while_the_engines_start_is_an_interruption(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, owner: object, name: str, revision: int | None
) -> None:
    # The engines are launched for real; the signal comes right after their launch, or right
    # after revision 1 is published (they are starting). In the second, the summary said "last
    # step 0, final revision 0" while its receipt said `last_revision: 1` (`run_interrupted`
    # checks the two agree).
    killers: list[subprocess.Popen[bytes]] = []
    arm = signal_after(monkeypatch, owner, name, killers)
    receipt = run_interrupted(tmp_path, monkeypatch, arm)
    assert receipt["last_step"] == 0
    if revision is not None:
        assert receipt["last_revision"] == revision, receipt
    assert [k.wait(10) for k in killers] == [0]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("moment", ["carry_out", "return_all"])
def test_a_signal_during_a_borrow_or_the_return_is_an_interruption(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moment: str
) -> None:
    # `carry_out`: the planner's borrow is being posted; `return_all`: the end-of-run return
    # (the signal lands while the Hybrid leaves and its engine restarts, or in the shutdown).
    original = getattr(job_module.Job, moment)
    killers: list[subprocess.Popen[bytes]] = []

    def arm(stamp: Path) -> None:
        def signal_then(self: job_module.Job, *args: Any) -> Any:
            if not killers:
                killers.append(signal_parent(stamp))
            return original(self, *args)

        monkeypatch.setattr(job_module.Job, moment, signal_then)

    steps = 50 if moment == "carry_out" else 2
    run_interrupted(tmp_path, monkeypatch, arm, steps=steps)
    assert [k.wait(10) for k in killers] == [0]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("moment", ["run_step", "record_step"])
def test_a_stop_saves_the_state_of_the_last_step_the_rule_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moment: str
) -> None:
    """A resume goes on from the step a stopped run last finished, whatever the saves' 2 %
    rule skipped: a SIGTERM'd run had saved only after step 1 (a slow first save, under load)
    and its resume trained 16 steps again. Here the rule skips every save (`StateSaves.due`
    patched false: the far edge, a clock under load); the signal is sent as step 3 begins
    (`run_step`: it lands during the step, which the stop waits for) or once it is recorded
    (`record_step`: it lands between steps, during the next one's rollout, or in it)."""
    from ehp_fsm.run import resume

    monkeypatch.setattr(resume.StateSaves, "due", lambda self, now: False)
    original = getattr(job_module, moment)
    killers: list[subprocess.Popen[bytes]] = []

    def arm(stamp: Path) -> None:
        def signal_then(*args: Any, **kwargs: Any) -> Any:
            step = kwargs.get("step", args[1] if len(args) > 1 else None)
            if step == 3 and not killers:
                killers.append(signal_parent(stamp))
            return original(*args, **kwargs)

        monkeypatch.setattr(job_module, moment, signal_then)

    receipt = run_interrupted(tmp_path, monkeypatch, arm)
    assert [k.wait(10) for k in killers] == [0]
    last = receipt["last_step"]
    assert last >= 3, receipt
    assert resume.latest_state(tmp_path / "run")[0] == last, receipt  # saved after it
    assert receipt["state_saves"]["saves"] == 1, receipt  # that one save, no other


#: `ehp-fsm run` as its console script runs it, with one thing added at the far edge: an import
#: hook that sends this process SIGINT when torch's C extension, initialising, imports numpy
#: (the moment a Ctrl-C was lost in), and leaves a file saying it did. A real signal, placed
#: by the import instead of by a clock: a loaded machine moves the moment, not the test.
_CTRL_C_INSIDE_TORCH = """
import os, signal, sys

class CtrlCInsideTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy" and "torch" in sys.modules and not os.path.exists(sys.argv[1]):
            open(sys.argv[1], "w").close()
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlCInsideTorch())
from ehp_fsm.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_ctrl_c_while_the_run_imports_torch_ends_it_with_130_and_one_line(
    tmp_path: Path,
) -> None:
    # Before: torch's C extension dropped the KeyboardInterrupt raised in numpy's import, and
    # the run went on to train (exit 0). Now the Ctrl-C is held through the import and then
    # ends the run before anything starts: 130, the one line a Ctrl-C a moment later gives.
    run_id = uuid.uuid4().hex
    text = SHORT.read_text()
    text = text.replace("runs/short/transitions.jsonl", str(tmp_path / "run" / "t.jsonl"))
    text = text.replace('path = "../runs/models/tiny-qwen3"', f'path = "{tmp_path / "model"}"')
    text = text.replace('train = "data/', f'train = "{SHORT.parent}/data/')
    (tmp_path / "plan.toml").write_text(text.replace("steps = 5", "steps = 1"))
    fired = tmp_path / "sigint-sent"
    argv = ["run", str(tmp_path / "plan.toml")]
    env = {**os.environ, "EHP_TEST_RUN": run_id}
    p = subprocess.Popen(
        [sys.executable, "-c", _CTRL_C_INSIDE_TORCH, str(fired), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
        preexec_fn=as_from_a_terminal,
    )
    try:
        out, err = p.communicate(timeout=150)
    finally:
        p.kill()
        for left in leftovers(run_id):  # the old code's run, if it went on
            left.kill()
    assert fired.exists(), "numpy was imported before torch: the hook never sent the signal"
    assert (p.returncode, err) == (130, "ehp-fsm run: interrupted (Ctrl-C)\n"), (out, err)
    assert out == ""  # nothing started
    assert leftovers(run_id) == []


EXTERNAL = ("--agents", "external")


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_hang_up_stops_the_run_cleanly(tmp_path: Path) -> None:
    # A closed terminal or a dropped ssh session: SIGHUP. Its default ended the run at once, as
    # kill -9 does (killed by signal 1: no receipt, no summary, run.json left behind); now it
    # stops the run as SIGTERM does, 128 + 1. The run waits for agents started outside (none
    # come), the cheapest moment at which a run is up.
    run_id = uuid.uuid4().hex
    log = tmp_path / "run" / "transitions.jsonl"
    text = plan_text(log, 1)
    any_port = 'controller = "tcp://127.0.0.1:*"'
    assert any_port in text
    port = free_port()
    (tmp_path / "plan.toml").write_text(
        text.replace(any_port, f'controller = "tcp://127.0.0.1:{port}"\ncurve = "off"')
    )
    with subprocess.Popen(
        [sys.executable, "-m", "ehp_fsm.cli", "run", str(tmp_path / "plan.toml"), *EXTERNAL],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "EHP_TEST_RUN": run_id},
    ) as p:
        try:
            assert p.stdout is not None
            seen = []
            for line in p.stdout:
                seen.append(line)
                if line.startswith("waiting up to"):
                    p.send_signal(signal.SIGHUP)
                    break
            out = "".join(seen) + p.stdout.read()
            status = p.wait(timeout=60)
        finally:
            p.kill()
    assert status == 128 + signal.SIGHUP, out
    assert "signal SIGHUP: stopping cleanly" in out, out
    receipt = json.loads((log.parent / "receipt.json").read_text())
    assert receipt["interrupted"] is True and receipt["error"] is None, receipt
    assert_no_orphans(run_id)


@pytest.mark.slow  # a run's start: ~6 s
@pytest.mark.timeout(200)
def test_a_run_whose_output_pipe_closes_stops_cleanly_and_writes_its_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # `ehp-fsm run PLAN | head -1`, a `tee` killed, a log pipe gone: the next line the run
    # writes fails with EPIPE. That raised out of the run (which took it for a full disk) and
    # again out of its end, before the receipt, summary and timeline were written. Now it is
    # SIGPIPE's stop, made cleanly: 128 + 13, `interrupted`, every file written. The run waits
    # for agents started outside (none come): its first line of output meets the closed pipe.
    monkeypatch.setenv("EHP_TEST_RUN", uuid.uuid4().hex)
    log = tmp_path / "run" / "transitions.jsonl"
    text = plan_text(log, 1).replace(
        'controller = "tcp://127.0.0.1:*"',
        f'controller = "tcp://127.0.0.1:{free_port()}"\ncurve = "off"',
    )
    (tmp_path / "plan.toml").write_text(text)
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone
    with open(write_end, "w") as pipe:
        status = job_module.run(load_plan(tmp_path / "plan.toml"), out=pipe, agents="external")
    assert status == 128 + signal.SIGPIPE
    receipt = json.loads((log.parent / "receipt.json").read_text())
    assert receipt["interrupted"] is True and receipt["error"] is None, receipt
    assert (log.parent / "summary.txt").is_file()
    assert "its output is gone (Broken pipe): stopping cleanly" in capsys.readouterr().err


@pytest.mark.slow  # a run's start: ~6 s
@pytest.mark.timeout(200)
def test_a_run_with_its_stdout_closed_runs_and_writes_its_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `ehp-fsm run PLAN >&-`: Python's sys.stdout is None. The run's progress display asked it
    # isatty() (an AttributeError traceback); now it shows nothing and the run goes on — here
    # to its end at the agents' deadline (none come), its error and receipt as usual.
    monkeypatch.setenv("EHP_TEST_RUN", uuid.uuid4().hex)
    monkeypatch.setattr(sys, "stdout", None)
    log = tmp_path / "run" / "transitions.jsonl"
    text = plan_text(log, 1).replace(
        'controller = "tcp://127.0.0.1:*"',
        f'controller = "tcp://127.0.0.1:{free_port()}"\ncurve = "off"',
    )
    (tmp_path / "plan.toml").write_text(text + "\n[deadlines.run]\nagents_connect = 1.0\n")
    with pytest.raises(RunError, match="did not connect within 1 s"):
        job_module.run(load_plan(tmp_path / "plan.toml"), agents="external")
    receipt = json.loads((log.parent / "receipt.json").read_text())
    assert receipt["error"] is not None and (log.parent / "summary.txt").is_file()


@pytest.mark.slow  # a run's start and two steps: ~10 s
@pytest.mark.timeout(200)
def test_a_failure_held_while_a_step_ends_comes_after_the_steps_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What stops the loop while the trainer steps (a signal's `RewardInterrupted`, a failure
    the watch raises) is held until the step ends, then raised. The step stands and is
    counted, and now gets its progress line first: a step that ended as a Ctrl-C landed was
    missing from the output. The held failure here is the watch's, raised once inside step 2."""
    from ehp_fsm.run import watch

    inside = {"step": False, "raised": False}
    during = job_module.Job.during_step
    seen = watch.FailureWatch.watch

    def during_step(self: job_module.Job, done: Callable[[], bool]) -> None:
        inside["step"] = self.figures.last_step == 1  # step 2 is being trained
        try:
            during(self, done)
        finally:
            inside["step"] = False

    def failing_watch(self: watch.FailureWatch, world: Any) -> None:
        if inside["step"] and not inside["raised"]:
            inside["raised"] = True
            raise RunError("a failure seen while step 2 trained")
        seen(self, world)

    monkeypatch.setattr(job_module.Job, "during_step", during_step)
    monkeypatch.setattr(watch.FailureWatch, "watch", failing_watch)
    monkeypatch.setenv("EHP_TEST_RUN", uuid.uuid4().hex)
    log = tmp_path / "run" / "transitions.jsonl"
    (tmp_path / "plan.toml").write_text(plan_text(log, 5))
    out = io.StringIO()
    with pytest.raises(RunError, match="a failure seen while step 2 trained"):
        job_module.run(load_plan(tmp_path / "plan.toml"), out=out, live=False)
    text = out.getvalue()
    assert inside["raised"] and "step 2/5" in text, text
    assert "step 3/5" not in text
    assert json.loads((log.parent / "receipt.json").read_text())["last_step"] == 2


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_signal_during_the_shutdown_itself_is_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C while the run shut down (its summary and receipt being written) made it exit
    130 after a complete summary and never said why (an operator's find): the handler's note
    was printed only before the shutdown. It is now said after it. The agents never connect
    (each a process that does nothing: the run stops at its start, the shortest way into its
    shutdown); the signal is sent to this process as the shutdown begins."""
    run_id = uuid.uuid4().hex
    monkeypatch.setenv("EHP_TEST_RUN", run_id)
    monkeypatch.setattr(
        job_module,
        "spawn_agent",
        lambda *_a: subprocess.Popen(["sleep", "600"], env={"EHP_TEST_RUN": run_id}),
    )
    finish = job_module.ending.finish

    def signalled_finish(*args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGINT)  # handled at once, on this (the main) thread
        return finish(*args, **kwargs)

    monkeypatch.setattr(job_module.ending, "finish", signalled_finish)
    log = tmp_path / "run" / "transitions.jsonl"
    (tmp_path / "plan.toml").write_text(
        plan_text(log, 2) + "\n[deadlines.run]\nagents_connect = 1.0\n"
    )
    out = io.StringIO()
    with pytest.raises(RunError, match="did not connect within 1 s"):
        job_module.run(load_plan(tmp_path / "plan.toml"), out=out)
    said = out.getvalue()
    assert "signal SIGINT: stopping cleanly (it came during the run's shutdown)" in said, said
    assert said.index("receipt: ") < said.index("signal SIGINT"), said  # after the summary
    receipt = json.loads((log.parent / "receipt.json").read_text())
    assert receipt["interrupted"] is True, receipt
    assert_no_orphans(run_id)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_an_agent_with_fewer_devices_than_the_plan_gives_its_host_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent started with `--slots 1` for a host the plan gives 2 devices: the run placed
    engines (and a Core rank, on such a host) on the missing device anyway, the only word an
    `inventory_mismatch` warning in controller.log (a user's find with `--agents external`).
    Here h1's agent is a real agent started with one slot; the run stops before any engine
    starts, naming the host, both lists and the two ways to make them agree."""
    import dataclasses

    run_id = uuid.uuid4().hex
    monkeypatch.setenv("EHP_TEST_RUN", run_id)
    spawn = job_module.spawn_agent

    def one_slot_short(plan: Any, host: Any, *rest: Any) -> Any:
        if host.id == "h1":
            host = dataclasses.replace(host, gpus=host.gpus[:1])
        return spawn(plan, host, *rest)

    monkeypatch.setattr(job_module, "spawn_agent", one_slot_short)
    log = tmp_path / "run" / "transitions.jsonl"
    (tmp_path / "plan.toml").write_text(plan_text(log, 2))
    with pytest.raises(RunError) as err:
        job_module.run(load_plan(tmp_path / "plan.toml"), out=io.StringIO())
    said = str(err.value)
    assert (
        "the agent of host h1 reports the devices ['h1:g0'], and the plan gives it "
        "['h1:g0', 'h1:g1']: ['h1:g1'] missing"
    ) in said, said
    assert "`--slots 2`" in said and "gpus = 1" in said, said
    records = [json.loads(x) for x in log.read_text().splitlines()[1:]]
    assert not [r for r in records if r["machine"] == "rollout_engine"], "an engine started"
    assert_no_orphans(run_id)


def _run_verified(
    tmp: Path, monkeypatch: pytest.MonkeyPatch, steps: int
) -> tuple[int, str, dict[str, Any]]:
    """`ehp-fsm run --verify` of the short plan in this process: (status, output, receipt)."""
    run_id = uuid.uuid4().hex
    monkeypatch.setenv("EHP_TEST_RUN", run_id)
    log = tmp / "run" / "transitions.jsonl"
    (tmp / "plan.toml").write_text(plan_text(log, steps))
    out = io.StringIO()
    status = job_module.run(load_plan(tmp / "plan.toml"), out=out, verify=True)
    assert_no_orphans(run_id)
    return status, out.getvalue(), json.loads((log.parent / "receipt.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stop_while_the_verify_replays_ends_it_not_judged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--verify` replays every step the run trained, about as long again as the run's steps:
    a SIGTERM during it was answered once all of it had run (30 steps of the short plan: 5.8
    and 7.1 s after the signal, two runs). The signal (a real one, sent by this process to
    itself) lands as the Core-only replay partitions its second step; the replay ends before
    its third, and the check is neither passed nor failed."""
    from ehp_fsm.training import verify as verify_module

    real = verify_module.partition_groups
    replayed: list[int] = []

    def then_signal(*args: Any, **kwargs: Any) -> Any:
        replayed.append(kwargs["step"])
        if len(replayed) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(verify_module, "partition_groups", then_signal)
    status, out, receipt = _run_verified(tmp_path, monkeypatch, steps=4)
    assert status == 128 + signal.SIGTERM, out
    assert receipt["last_step"] == 4 and len(replayed) == 2, (replayed, out)
    said = "verify: not judged: it was stopped while it replayed the steps"
    assert said in out and "verify: PASS" not in out, out
    assert receipt["verify"]["passed"] is None and receipt["interrupted"] is True, receipt


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stop_during_the_run_skips_its_verify(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run stopped by SIGTERM went on, once stopped, to replay every step it had trained
    (`--verify`) before it wrote its receipt — a scheduler's SIGKILL a grace period after its
    SIGTERM then found no receipt. Now the check is not run: not judged, no final state saved
    for it, the records kept."""
    original = job_module.run_step

    def signal_then(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("step", args[1] if len(args) > 1 else None) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kwargs)

    monkeypatch.setattr(job_module, "run_step", signal_then)
    status, out, receipt = _run_verified(tmp_path, monkeypatch, steps=6)
    assert status == 128 + signal.SIGTERM, out
    assert receipt["last_step"] == 2, receipt  # the step the signal came in was finished
    assert "verify: not judged: the run was stopped" in out, out
    assert "verify: replaying" not in out and "verify: PASS" not in out, out
    assert receipt["verify"]["passed"] is None and "verify_state" not in receipt, receipt
    verify_dir = tmp_path / "run" / "verify"
    assert any((verify_dir / "records").iterdir()) and not (verify_dir / "ehp-state").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stop_while_the_final_state_is_saved_for_the_verify_ends_the_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--verify` saves the Core's final state before it replays the steps (a 7B model's is
    ~100 GB). A stop that comes as that save begins (a real SIGTERM this process sends itself
    as the run asks for it) ends the wait for it: the pool is abandoned, its workers ended at
    its shutdown, nothing replayed, the check not judged."""
    from ehp_fsm.training.pool import TrainerPool

    real = TrainerPool.save_state
    asked: list[Path] = []

    def signal_then(self: TrainerPool, path: Path, **kwargs: Any) -> Any:
        if path.name == "ehp-state":
            asked.append(path)
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, path, **kwargs)

    monkeypatch.setattr(TrainerPool, "save_state", signal_then)
    status, out, receipt = _run_verified(tmp_path, monkeypatch, steps=3)
    assert status == 128 + signal.SIGTERM and len(asked) == 1, out
    said = "verify: not judged: it was stopped while it saved the final state"
    assert said in out and "verify: replaying" not in out, out
    assert receipt["verify"]["passed"] is None and "verify_state" not in receipt, receipt
    assert receipt["last_step"] == 3, receipt
