"""`ehp-fsm run` end to end on a shortened plan: real agents, engines, trainers and sockets.

The plan has the planner borrow at the first step boundary (`[ehp] min_hybrids = 1`), so
every run borrows one engine's slot for a Hybrid on a warm trainer worker and returns it at the
end. Nothing is faked: this is the user's command in a subprocess.
"""

from __future__ import annotations

import atexit
import functools
import io
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest

from ehp_fsm.replay import check_receipt, replay
from ehp_fsm.training.worker import REDUCE_HOOK_ENV
from tests.reduce_hook import KillInsideReduction
from tests.run.soundness import assert_run_sound

SHORT = Path(__file__).resolve().parents[2] / "examples" / "short.toml"


@functools.cache
def session_model() -> Path:
    """One tiny model per test process (every run test trains it; generated once)."""
    from tests.rollout.hf import make_model

    where = Path(tempfile.mkdtemp(prefix="ehp-run-model-"))
    atexit.register(shutil.rmtree, where, ignore_errors=True)
    return make_model(where / "tiny-qwen3")


# The third engine's host and engine tables in the short plan, and the reserve that keeps two
# of its three rollout GPUs serving.
THIRD_ENGINE = (
    '[[hosts]]\nid = "h2"\ngpus = 1\n',
    '[[engines]]\nid = "e2"\nhost = "h2"\ntp = 1\n',
)
THREE_ENGINE_RESERVE = "[rollout]\nreserve = 2\n"


def two_engines(text: str) -> str:
    """The short plan without its third engine and that engine's host, keeping one of the two
    rollout GPUs left serving: the same borrow at the first boundary (of `e0` or `e1` on `h1`)
    and return at the end, with one engine process and one agent fewer (each engine is ~4 s of
    CPU a run, mostly imports; the suite runs ~100 runs on 2 cores)."""
    for table in THIRD_ENGINE:
        assert table in text, table
        text = text.replace(table, "")
    assert THREE_ENGINE_RESERVE in text
    return text.replace(THREE_ENGINE_RESERVE, "[rollout]\nreserve = 1\n")


def plan_text(log: Path, steps: int, *, engines: int = 2) -> str:
    """The short plan with this test's log, step count, the session's model (generated once)
    and the example data by absolute path (the plan is written elsewhere); with two engines
    unless `engines = 3` (the plan as shipped) is asked for."""
    assert engines in (2, 3), engines
    text = SHORT.read_text()
    if engines == 2:
        text = two_engines(text)
    text = text.replace('log = "runs/short/transitions.jsonl"', f'log = "{log}"')
    text = text.replace('path = "../runs/models/tiny-qwen3"', f'path = "{session_model()}"')
    text = text.replace('train = "data/', f'train = "{SHORT.parent}/data/')
    return text.replace("steps = 5", f"steps = {steps}")


def start(
    tmp: Path,
    steps: int,
    extra_env: dict[str, str] | None = None,
    *,
    verify: bool = False,
    transport: str = "",
    tables: str = "",
    engines: int = 2,
) -> tuple[subprocess.Popen[str], Path, str]:
    """`ehp-fsm run` of the short plan in a subprocess; `transport`: lines added to the plan's
    `[transport]` table; `tables`: tables added at the plan's end; `engines`: `plan_text`'s."""
    run_id = uuid.uuid4().hex
    log = tmp / "run" / "transitions.jsonl"
    plan = tmp / "plan.toml"
    text = plan_text(log, steps, engines=engines)
    controller = 'controller = "tcp://127.0.0.1:*"\n'
    assert controller in text
    plan.write_text(
        text.replace(controller, controller + transport + "\n" if transport else controller)
        + tables
    )
    env = {**os.environ, "EHP_TEST_RUN": run_id, **(extra_env or {})}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ehp_fsm.cli", "run", str(plan), *(["--verify"] if verify else [])],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    return proc, log, run_id


def start_with_a_hybrid_killed_in_the_all_reduce(
    tmp: Path, steps: int, *, engines: int = 2
) -> tuple[subprocess.Popen[str], Path, str, KillInsideReduction]:
    """`start`, with the Core waiting inside the all-reduce while the Hybrid (rank 1) is held
    at the door and killed there (tests/reduce_hook.py)."""
    hook = tmp / "hook"
    hook.mkdir()
    (hook / "hold-1").write_text("")
    killer = KillInsideReduction(hook, victim=1, hold="hold-1", timeout_s=240)
    killer.start()
    proc, log, run_id = start(
        tmp, steps=steps, extra_env={REDUCE_HOOK_ENV: str(hook)}, engines=engines
    )
    return proc, log, run_id, killer


def run_in_process(
    tmp: Path, monkeypatch: pytest.MonkeyPatch, steps: int
) -> tuple[int, str, dict[str, Any], Path, str]:
    """`ehp-fsm run` of the short plan in this process (so a test can patch one seam): exit
    status, printed output, receipt, log path, run id (its processes carry it)."""
    from ehp_fsm.plan import load_plan
    from ehp_fsm.run import job as job_module

    run_id = uuid.uuid4().hex
    monkeypatch.setenv("EHP_TEST_RUN", run_id)
    log = tmp / "run" / "transitions.jsonl"
    (tmp / "plan.toml").write_text(plan_text(log, steps))
    out = io.StringIO()
    status = job_module.run(load_plan(tmp / "plan.toml"), out=out)
    receipt = json.loads((log.parent / "receipt.json").read_text())
    return status, out.getvalue(), receipt, log, run_id


def leftovers(run_id: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("EHP_TEST_RUN") == run_id:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def assert_no_handler_failures(log: Path) -> None:
    """No command handler of the controller failed (e.g. the rollout shell, closed at
    shutdown, asked to abort a request)."""
    lines = (log.parent / "controller.log").read_text().splitlines()
    failed = [x for x in lines if '"handler_failed"' in x]
    assert failed == [], failed[:3]


#: How the end-of-run return's move ends: its GPUs stay free, as the run stops every engine.
END_RETURN = "GPUs free (the run ends: no engine restarted)"


def assert_engines_at_end(receipt: dict[str, Any], *, slots: int) -> None:
    """Every engine serving at the end serves the last revision, and the plan's `slots` rollout
    GPUs are those engines' (one GPU each) or were freed by the end-of-run return."""
    serving = receipt["engine_revisions"]
    assert set(serving.values()) == {str(receipt["last_revision"])}, serving
    returns = [m for m in receipt["moves"] if m["kind"] == "return"]
    freed = [m for m in returns if m["detail"].endswith(END_RETURN)]
    assert len(serving) == slots - len(freed), (serving, receipt["moves"])


def assert_no_orphans(run_id: str) -> None:
    deadline = time.monotonic() + 10
    while leftovers(run_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftovers(run_id) == [], [p.cmdline() for p in leftovers(run_id)]


def assert_frozen_one_stopped_and_run_clean(
    frozen: int, log: Path, run_id: str, steps: int
) -> None:
    """After a run in which process `frozen` was SIGSTOPped for good: the run stopped it (not
    left behind, frozen), its log is sound, its controller shut down clean at step `steps`, and
    nothing of it is left running."""
    with pytest.raises(psutil.NoSuchProcess):
        psutil.Process(frozen).status()
    receipt = assert_run_sound(log, run_id=run_id)
    assert receipt["clean_controller"] is True and receipt["shutdown_errors"] == []
    assert receipt["last_step"] == steps
    assert_no_orphans(run_id)


#: A launch token where the run writes one: `"token": "…"` / `"launch_token": "…"` (JSON).
_TOKEN_FIELD = re.compile(rb'"(?:launch_)?token": ?"([A-Za-z0-9_.:-]{8,128})"')


class TokenWatch(threading.Thread):
    """While a run of `start` runs (found by its run id): every process it started — command
    line and the launch tokens in its environment — and every file of its run directory that
    holds a token, with its mode (polled: an agent's `processes.json` holds its launches'
    tokens only while they run). `check` then holds them to what `ehp-fsm stop` relies on:
    tokens are secrets, in no command line (every user reads `/proc/PID/cmdline`) and in no
    file others can read (else they could be copied into a forged run folder)."""

    ENV = ("EHP_LAUNCH_TOKEN", "EHP_POOL_TOKEN")

    def __init__(self, run_id: str, run_dir: Path) -> None:
        super().__init__(daemon=True)
        self.run_id, self.run_dir = run_id, run_dir
        self.tokens: set[bytes] = set()
        self.cmdlines: dict[tuple[int, float], str] = {}
        self.files: dict[str, set[int]] = {}  # file holding a token → its modes seen
        self._done = threading.Event()

    def __enter__(self) -> TokenWatch:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self.join(30)
        self._look()  # what the run left

    def run(self) -> None:
        while not self._done.wait(0.2):
            self._look()

    def _look(self) -> None:
        for p in psutil.process_iter():
            try:
                env = p.environ()
                if env.get("EHP_TEST_RUN") != self.run_id:
                    continue
                self.tokens |= {env[k].encode() for k in self.ENV if env.get(k)}
                self.cmdlines.setdefault((p.pid, p.create_time()), " ".join(p.cmdline()))
            except psutil.Error:
                continue
        found = []
        # os.walk: a folder the run removes meanwhile is passed over (rglob raised)
        for top, _, names in os.walk(self.run_dir):
            for f in (Path(top) / n for n in names):
                try:
                    st = f.lstat()
                    if stat.S_ISREG(st.st_mode) and st.st_size <= 1 << 20:
                        found.append((str(f.relative_to(self.run_dir)), st.st_mode, f.read_bytes()))
                except OSError:  # removed or replaced meanwhile
                    continue
        for _, _, data in found:
            self.tokens |= set(_TOKEN_FIELD.findall(data))
        for name, st_mode, data in found:
            if any(t in data for t in self.tokens):
                self.files.setdefault(name, set()).add(st_mode & 0o777)

    def check(self) -> None:
        # the watch saw what it must judge: the run's processes of every kind, their tokens
        # and the files that must hold them
        # (the trainer workers are forked from the pool's starter, and carry its command line)
        kinds = ("ehp_fsm.cli run", "ehp_fsm.cli agent", "training.starter", "rollout.server")
        assert all(any(k in c for c in self.cmdlines.values()) for k in kinds), self.cmdlines
        assert len(self.tokens) >= 5, self.tokens  # the run's, the pool's, three engines'
        assert {"run.json", "transitions.jsonl", "agents/h1/processes.json"} <= set(self.files)
        shown = {c[:160]: t for c in self.cmdlines.values() for t in self.tokens if t.decode() in c}
        assert shown == {}, shown
        readable = {f: sorted(map(oct, m)) for f, m in self.files.items() if m != {0o600}}
        assert readable == {}, readable
        # nor in a log at all: the run's, the agents' and their launches' logs name a launch
        # by its first characters alone (an external agent's log goes where srun sends it)
        logs = [f for f in self.files if f.endswith(".log")]
        assert logs == [], logs


#: Steps of `test_run_borrows_returns_and_ends_clean` (see there).
STEPS_BORROWED = 6


def test_a_trainer_pool_that_does_not_start_stops_the_engines_launched_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engines are launched while the trainers start. Here the workers cannot say hello
    # within the plan's `trainers_start` (0.5 s; they take seconds to import): the run stops,
    # and the engines already starting are stopped with it — none left running, every GPU
    # handed back, the log sound.
    from ehp_fsm.plan import load_plan
    from ehp_fsm.run import job as job_module

    run_id = uuid.uuid4().hex
    monkeypatch.setenv("EHP_TEST_RUN", run_id)
    log = tmp_path / "run" / "transitions.jsonl"
    (tmp_path / "plan.toml").write_text(
        plan_text(log, 2) + "\n[deadlines.run]\ntrainers_start = 0.5\n"
    )
    with pytest.raises(job_module.RunError, match="trainer pool did not start"):
        job_module.run(load_plan(tmp_path / "plan.toml"), out=io.StringIO())
    events = [json.loads(x) for x in log.read_text().splitlines()[1:]]
    launched = {
        r["instance"] for r in events if r["machine"] == "rollout_engine" and r["event"] == "launch"
    }
    assert launched == {"e0", "e1"}, launched
    receipt = assert_run_sound(log, run_id=run_id, error=True)
    assert "trainer pool did not start" in receipt["error"]
    assert receipt["shutdown_errors"] == [] and receipt["clean_controller"] is True


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_run_borrows_returns_and_ends_clean(tmp_path: Path) -> None:
    # The planner borrows at the first step boundary (the short plan's floor, `min_hybrids =
    # 1`) and a step boundary waits for a borrow on its way (`decisions.BORROW_ON_THE_WAY`),
    # so the Hybrid trains from step 2 or 3 however slow the engine's stop: 6 steps give it
    # four or more, then the end-of-run return. (20 steps were needed before that wait, when a
    # borrow could still be on its way at the last step; each step is also replayed twice by
    # --verify.)
    # The run takes the authenticated path, a loopback plan's default (`transport.curve =
    # "local"`: CURVE keys made for its own agents, one per host id and bound to it): the
    # controller's CURVE server refuses any agent without its own host's key, so a run that
    # ends clean proves every agent authenticated (one run carries this and the rest; see
    # test_curve_local.py).
    # Launch tokens are secrets (`TokenWatch`): every process of the run is watched as it runs.
    proc, log, run_id = start(tmp_path, steps=STEPS_BORROWED, verify=True)
    with TokenWatch(run_id, log.parent) as watch:
        out, _ = proc.communicate(timeout=280)
    assert proc.returncode == 0, out
    assert f"step {STEPS_BORROWED}/{STEPS_BORROWED}" in out
    assert "borrow" in out and "return" in out
    receipt = json.loads((log.parent / "receipt.json").read_text())
    assert receipt["error"] is None and receipt["last_step"] == STEPS_BORROWED
    assert receipt["clean_controller"] is True and receipt["agents_exit"] == [0, 0]
    assert receipt["shutdown_errors"] == [] and receipt["unconfirmed_hosts"] == []
    bound = json.loads((log.parent / "keys" / "hosts.json").read_text())
    assert sorted(bound) == ["h0", "h1"]  # a key per host id, each bound to it
    # every engine request carried the run's API key (an engine refuses any other: the run
    # trained, so its requests had it); the key is the run's alone
    key = log.parent / "keys" / "engine-api-key"
    assert key.stat().st_mode & 0o777 == 0o600, oct(key.stat().st_mode)
    # the engines' and trainer workers' output (SGLang logs its --api-key) is the user's alone,
    # and so are the trained weights and optimizer state (they were 0755 folders of 0644 files)
    mine = ("agents", "agents/h1", "agents/h1/logs", "trainers", "resume", "revisions", "verify")
    for folder in mine:
        mode = (log.parent / folder).stat().st_mode & 0o777
        assert mode == 0o700, (folder, oct(mode))
    asked = receipt["asked_to_stop"]  # the serving engines (Hybrids end on the pool)
    assert all(p.startswith("rollout_engine:") for p in asked), asked
    final = receipt["last_revision"]
    assert final == STEPS_BORROWED + 1
    # every engine, one restarted on a mid-run return included, serves the final revision
    assert_engines_at_end(receipt, slots=2)
    assert len(asked) == len(receipt["engine_revisions"]), asked
    result = replay(log)
    check_receipt(result, receipt)  # the log is the one the run wrote: not cut, not rewritten
    assert receipt["log_chain"]["count"] == len(log.read_text().splitlines())
    world = result.world
    events = [json.loads(x) for x in log.read_text().splitlines()[1:]]
    # The engines start while the trainers do: each first launch comes before revision 1 is
    # saved (the engines start from the model directory and install it before they serve).
    saved = next(i for i, r in enumerate(events) if r["machine"] == "revision")
    launched = {
        r["instance"]: i
        for i, r in reversed(list(enumerate(events)))
        if r["machine"] == "rollout_engine" and r["event"] == "launch"
    }
    assert sorted(launched) == ["e0", "e1"] and max(launched.values()) < saved, launched
    hybrid = {(r["event"], r["accepted"]) for r in events if r["machine"] == "hybrid_replica"}
    assert {("activate", True), ("leave", True), ("exited", True)} <= hybrid
    assert all(g.state == "free" for g in world.of("gpu").values() if g.id != "h0:g0")
    assert (log.parent / "timeline.png").exists() and (log.parent / "timeline.svg").exists()
    assert "=== ehp-fsm run summary ===" in (log.parent / "summary.txt").read_text()
    # --verify: the run repeated Core-only on the same rollout data matches, tensor by tensor,
    # within the fixed-batch tolerance (a Hybrid computed groups, so not necessarily bit-exact),
    # and says what the check cost.
    verified = receipt["verify"]
    assert verified["passed"] is True, verified["lines"]
    assert verified["hybrid_steps"] >= 1 and verified["replay_seconds"] > 0
    lines = verified["lines"]
    assert lines[0].startswith("verify: PASS") and "steps equal" in lines[0], lines
    # parameters, FP32 masters and both Adam moments, each with its largest difference
    assert sum("max|Δ|" in line for line in lines) >= 4, lines
    assert any(line.strip().startswith("cost:") for line in lines), lines  # its own cost
    assert_no_handler_failures(log)
    assert_no_orphans(run_id)
    watch.check()


# SIGTERM mid-run (exit 128 + 15, a receipt that says `interrupted`, the fault matrix's checks)
# and SIGUSR1 before it (every thread's stack, nothing changed): on the run that
# `test_controller_frozen.py` freezes and then stops with SIGTERM (one run carries both).


def test_bad_plan_fails_before_anything_starts(tmp_path: Path) -> None:
    plan = tmp_path / "plan.toml"
    plan.write_text(plan_text(tmp_path / "x" / "t.jsonl", 2).replace("reserve = 1", "reserve = 9"))
    out = subprocess.run(
        [sys.executable, "-m", "ehp_fsm.cli", "run", str(plan)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2
    assert "plan key `rollout.reserve` is invalid" in out.stderr
    assert not (tmp_path / "x").exists()


def _find(run_id: str, needle: str) -> psutil.Process:
    for p in leftovers(run_id):
        try:
            if needle in " ".join(p.cmdline()):
                return p
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no process of this run matches {needle!r}")


def _serving_engine(log: Path) -> psutil.Process:
    """A process of an engine that is serving now (not one the planner is draining), from the
    run's own transition log: its `healthy` record carries the process identity."""
    return psutil.Process(serving_engine(log)[1])


def serving_engine(log: Path) -> tuple[str, int]:
    """(id, pid) of the first engine (by id) that serves now: healthy in the run's log, and not
    drained, stopped or failed since (the planner drains the least loaded for a borrow)."""
    pids: dict[str, int] = {}
    gone: set[str] = set()
    for raw in log.read_text().splitlines()[1:]:
        try:
            r = json.loads(raw)
        except json.JSONDecodeError:  # the line being written right now
            continue
        if r["machine"] != "rollout_engine" or not r["accepted"]:
            continue
        if r["event"] == "healthy":
            pids[r["instance"]] = r["payload"]["identity"]["pid"]
        elif r["event"] in ("drain", "stop", "fail", "deadline"):
            gone.add(r["instance"])
    eid = next((e for e in sorted(pids) if e not in gone), None)
    assert eid is not None, f"no serving engine in the log ({sorted(pids)}, gone {sorted(gone)})"
    return eid, int(pids[eid])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_dead_engine_and_a_hybrid_killed_inside_the_all_reduce_are_survived(
    tmp_path: Path,
) -> None:
    # three engines: one killed, one borrowed, one left serving
    proc, log, run_id, killer = start_with_a_hybrid_killed_in_the_all_reduce(
        tmp_path, steps=8, engines=3
    )
    assert proc.stdout is not None
    seen = []
    killed_engine = False
    for line in proc.stdout:
        seen.append(line)
        if not killed_engine and "step 2/8" in line:
            _serving_engine(log).kill()  # SIGKILL, no goodbye
            killed_engine = True
    out = "".join(seen)
    proc.stdout.close()
    proc.wait(60)
    killer.join(5)
    assert killed_engine and killer.step is not None, out
    k = killer.step
    # Both failures were survived: the run finished every step and stopped cleanly.
    assert proc.returncode == 0, out
    assert "failed: process exited unexpectedly (code -9)" in out  # the engine, shown
    assert f"step {k}: Hybrid" in out and "retrying the step on the Core" in out  # shown
    assert "step 8/8" in out
    receipt = json.loads((log.parent / "receipt.json").read_text())
    assert receipt["error"] is None and receipt["last_step"] == 8
    assert receipt["clean_controller"] is True and receipt["shutdown_errors"] == []
    summary = (log.parent / "summary.txt").read_text()
    assert f"step {k:>3}  failed" in summary and "inside the step collective" in summary
    # The log replays clean and tells the story.
    world = replay(log).world
    assert any(e.state == "failed" for e in world.of("rollout_engine").values())
    (hybrid,) = [h for h in world.of("hybrid_replica").values() if h.state == "failed"]
    assert "inside the step collective" in str(hybrid.get("reason")), hybrid
    failed_step = world.get("training_step", f"step-{k}")
    retried = world.get("training_step", f"step-{k}.1")
    assert failed_step is not None and failed_step.state == "failed"
    assert "missing ['hybrid:" in str(failed_step.get("reason"))  # the ledger's verdict
    assert "no survivor stepped" in str(failed_step.get("reason"))
    assert retried is not None and retried.state == "done"
    assert retried.get("epoch") == failed_step.get("epoch") + 1  # membership epoch + 1
    assert sorted(retried.get("groups")) == sorted(failed_step.get("groups"))  # none lost
    assert list(retried.get("partition")) == ["core:0"]
    records = [json.loads(x) for x in log.read_text().splitlines()[1:]]
    (gid,) = hybrid.get("gpus")
    gpu_events = [
        r["event"]
        for r in records
        if r["machine"] == "gpu"
        and r["instance"] == gid
        and r["accepted"]
        and r["seq"]
        > next(
            x["seq"]
            for x in records
            if x["machine"] == "hybrid_replica"
            and x["instance"] == hybrid.id
            and x["event"] == "fail"
            and x["accepted"]
        )
    ]
    assert gpu_events[:2] == ["release", "confirm_free"], gpu_events
    assert_no_handler_failures(log)
    assert_run_sound(log, run_id=run_id)  # the fault matrix: kill -9 of an engine, a Hybrid


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_start_up_that_stops_half_way_still_stops_everything_and_writes_a_receipt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The controller starts; the host agents never connect, so the trainer pool (started once
    # they have: a lending host's warm workers may be its agent's to launch) never starts. Each
    # "agent" is a real process that never dials the controller (`sleep`): the far edge this
    # test cannot have is an agent that cannot reach it. The plan cuts the connect wait to 1 s
    # (the whole wait is spent: no agent ever connects).
    from ehp_fsm.plan import load_plan
    from ehp_fsm.run import job as job_module

    def silent_agent(*_args: object) -> subprocess.Popen[bytes]:
        return subprocess.Popen(["sleep", "600"], env={"EHP_TEST_RUN": run_id})

    run_id = uuid.uuid4().hex
    monkeypatch.setenv("EHP_TEST_RUN", run_id)  # the trainers inherit it: orphans are found
    monkeypatch.setattr(job_module, "spawn_agent", silent_agent)
    log = tmp_path / "run" / "transitions.jsonl"
    (tmp_path / "plan.toml").write_text(
        plan_text(log, 2) + "\n[deadlines.run]\nagents_connect = 1.0\n"
    )
    plan = load_plan(tmp_path / "plan.toml")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(job_module.RunError, match="did not connect within 1 s"):
        job_module.run(plan, out=io.StringIO())
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # restored
    receipt = json.loads((log.parent / "receipt.json").read_text())
    assert "did not connect within 1 s" in receipt["error"]
    assert receipt["shutdown_errors"] == [] and receipt["clean_controller"] is True
    assert len(receipt["agents_exit"]) == len(plan.hosts)  # each asked to stop, and gone
    assert "killed_trainers" not in receipt and not (log.parent / "trainers").exists()
    assert_no_handler_failures(log)
    assert_no_orphans(run_id)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_planner_borrows_again_after_a_hybrid_died_inside_the_all_reduce(
    tmp_path: Path,
) -> None:
    # As above without the engine kill: rollout keeps its reserve, so the planner borrows again
    # at once, while the dead warm worker's replacement is still starting (on standby, not in
    # the world). That launch must be refused with a reason, not bound to the replacement.
    # 12 steps: the planner decides from three steps measured in the cluster's new shape and
    # waits out its cooldown; in 8, a loaded machine left it too few to borrow again (CI, once).
    proc, log, run_id, killer = start_with_a_hybrid_killed_in_the_all_reduce(tmp_path, steps=12)
    out, _ = proc.communicate(timeout=280)
    killer.join(5)
    assert killer.step is not None, out
    assert proc.returncode == 0, out
    receipt = json.loads((log.parent / "receipt.json").read_text())
    assert receipt["error"] is None and receipt["last_step"] == 12
    assert receipt["clean_controller"] is True and receipt["shutdown_errors"] == []
    records = [json.loads(x) for x in log.read_text().splitlines()[1:]]
    launches = [
        r
        for r in records
        if r.get("machine") == "hybrid_replica" and r["event"] == "launch" and r["accepted"]
    ]
    died = next(
        r["seq"]
        for r in records
        if r.get("machine") == "hybrid_replica"
        and r["event"] == "fail"
        and "inside the step collective" in r["payload"].get("reason", "")
    )
    later = [r["instance"] for r in launches if r["seq"] > died]
    assert later, "the planner did not borrow again after the Hybrid died"
    world = replay(log).world
    for hid in later:  # each either trained on an admitted worker or was refused, and said why
        h = world.get("hybrid_replica", hid)
        assert h is not None
        assert h.state != "failed" or h.get("reason") in ("no idle warm worker", "shutdown"), h
    assert_no_handler_failures(log)
    assert_no_orphans(run_id)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_return_at_the_end_waits_for_its_own_engines_after_another_engine_died(
    tmp_path: Path,
) -> None:
    # An engine dies mid-run (survived by design), so the fleet never counts as many serving
    # engines as the plan has; the end-of-run return must still see its own engine serve.
    # The Hybrid trains from step 4 (a step boundary waits for a borrow on its way): 8 steps
    # leave the run four after the kill, then the end-of-run return (20 did before that wait).
    # Three engines: one killed, one borrowed, one left serving.
    proc, log, run_id = start(tmp_path, steps=STEPS_BORROWED, engines=3)
    assert proc.stdout is not None
    seen = []
    killed = False
    for line in proc.stdout:
        seen.append(line)
        if not killed and "trains" in line and "after the decision" in line:
            _serving_engine(log).kill()
            killed = True
    proc.stdout.close()
    proc.wait(60)
    out = "".join(seen)
    assert killed and proc.returncode == 0, out
    receipt = json.loads((log.parent / "receipt.json").read_text())
    assert receipt["error"] is None and receipt["last_step"] == STEPS_BORROWED
    (ret,) = [m for m in receipt["moves"] if m["kind"] == "return"]
    assert ret["latency_s"] < 60, ret
    if ret["detail"].endswith(" serving"):  # a mid-run return: its engine serves the last
        engine = ret["detail"].split(" -> ")[1].removesuffix(" serving")
        assert receipt["engine_revisions"][engine] == str(receipt["last_revision"])
    else:  # the end-of-run return: the Hybrid's GPUs confirmed free, no engine started
        assert ret["detail"].endswith(END_RETURN), ret
        assert receipt["unconfirmed_hosts"] == [], receipt
    assert_no_handler_failures(log)
    assert_no_orphans(run_id)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_hybrid_that_missed_a_step_boundary_reloads_and_joins_at_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The only thing changed about the Hybrid is when activation is offered: the first boundary
    # at which a Hybrid is ready passes it by (as when it became ready just after that
    # boundary), so at the next one its state is a step old. It used to reload lazily — the load
    # ran before the step that made it stale again — and it never joined.
    # The same run carries a revision not saved after the optimizer stepped (one run for both:
    # the full disk is at step 2, before the borrow is decided).
    from ehp_fsm.run.hybrids import WarmHybrids

    offered = WarmHybrids.join_ready
    passed_by: set[str] = set()

    def miss_the_first_boundary(self: WarmHybrids) -> list[str]:
        ready = [h.id for h in self.door.world.of("hybrid_replica").values() if h.state == "ready"]
        if ready and not passed_by:  # the first Hybrid ready at a boundary: passed by, once
            passed_by.update(ready)
            return []
        return offered(self)

    monkeypatch.setattr(WarmHybrids, "join_ready", miss_the_first_boundary)
    _full_disk_at_step_2(monkeypatch)
    # The borrow is decided before step 3 and waited for at the next boundary (a step boundary
    # waits for a borrow on its way), where it is passed by; at the one after, it reloads there
    # (`join_ready`) and joins: 10 steps leave it room (30 did before that wait existed).
    status, out, receipt, log, run_id = run_in_process(tmp_path, monkeypatch, steps=10)
    assert status == 0, out
    assert receipt["error"] is None and receipt["last_step"] == 10
    assert passed_by, "no Hybrid was ready at a boundary"
    records = [json.loads(x) for x in log.read_text().splitlines()[1:]]
    for hid in passed_by:
        events = [
            r["event"]
            for r in records
            if r.get("machine") == "hybrid_replica" and r["instance"] == hid and r["accepted"]
        ]
        assert "reload" in events and "activate" in events, (hid, events)
        assert events.count("reload") == 1, events  # one reload, then it joined
    assert any(m["kind"] == "borrow" for m in receipt["moves"])
    # the revision step 2 could not write was saved again, and the run went on to the last
    assert "revision 3 was not saved (OSError: [Errno 28]" in out
    assert receipt["last_revision"] == 11
    served = receipt["engine_revisions"]  # the serving engines (one may be out for a borrow)
    assert len(served) >= 1 and set(served.values()) == {"11"}, served
    assert_no_handler_failures(log)
    assert_no_orphans(run_id)


def _full_disk_at_step_2(monkeypatch: pytest.MonkeyPatch) -> None:
    """A revision not saved after the optimizer stepped is saved again. The far edge faked: a
    full disk when step 2's revision is written inside the step (the folder is removed and the
    pool reports `publish_error`, as the worker does for an OSError). The step stands; the job
    saves the revision again and the run goes on. It used to register the missing revision and
    stop with RevisionNotFound."""
    import dataclasses
    import shutil

    from ehp_fsm.training.pool import TrainerPool

    real_step = TrainerPool.step

    def full_disk_at_step_2(self: TrainerPool, **kw: Any) -> Any:
        result = real_step(self, **kw)
        if kw["step"] != 2 or not hasattr(result, "publish_error"):
            return result
        shutil.rmtree(result.revision_path)
        return dataclasses.replace(
            result,
            revision=None,
            revision_path=None,
            publish_error="OSError: [Errno 28] No space left on device",
        )

    monkeypatch.setattr(TrainerPool, "step", full_disk_at_step_2)
