"""A failure of one worker alone, after its collectives completed, leaves the pool usable; and a
failed commit says truly whether the optimizer stepped.

- A state write that fails (the dir exists) after the gather is a plain error reply: the worker
  serves on (before the fix it called itself unusable, and every later step, or the next state
  load into that warm worker, failed although the pool said nothing was wrong).
- A revision that cannot be saved after the optimizer stepped (here: a number not newer than
  the store's last, `RevisionNotIncreasing`) leaves the step standing, with the reason in
  `StepResult.publish_error` (before the fix Core rank 0 replied an error while the Hybrid
  replied ok, and the pool broke although every lane had stepped the same).
- A reduced gradient holding NaN is refused before the optimizer steps, and the reply says
  `stepped: False` (it said True).

Real processes, real Gloo, real ZeroMQ, a real `RevisionStore`.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from ehp_fsm.training import verify
from ehp_fsm.training.adam import AdamConfig
from ehp_fsm.training.grpo import GroupBatch
from ehp_fsm.training.pool import PoolConfig, PoolFailure, StepResult, TrainerPool
from tests.procs import still_running, wait_exited
from tests.training_pool.rig import batch_of, ok, run_step, tiny_config


def _config(**kw: object) -> PoolConfig:
    return tiny_config(adam=AdamConfig(eps=1e-6), **kw)


def _step(
    pool: TrainerPool, step: int, epoch: int, *, batch: GroupBatch | None = None, **kw: object
) -> StepResult | PoolFailure:
    return run_step(pool, step, epoch, batch_of(step) if batch is None else batch, **kw)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_failed_state_write_is_a_plain_error_and_the_worker_serves_on(tmp_path: Path) -> None:
    with TrainerPool.spawn(_config(), work_dir=tmp_path / "pool") as pool:
        ok(_step(pool, 0, 0, publish=False))
        empty = pool.save_state(tmp_path / "empty", rank=1)  # a warm worker holds no lane yet
        assert isinstance(empty, PoolFailure) and "holds no lane" in empty.detail, empty
        assert not empty.broken_world and pool.broken is None
        ok(pool.load_state(1, replica="hybrid:w"))
        pool.deactivate("hybrid:w")  # loaded, idle: its lane's state can be written
        for rank, name in ((0, "core"), (1, "warm")):
            (tmp_path / name).mkdir()
            failed = pool.save_state(tmp_path / name, rank=rank)
            assert isinstance(failed, PoolFailure), failed
            assert (failed.reason, failed.rank) == ("worker_error", rank)
            assert "FileExistsError" in failed.detail and "worker unusable" not in failed.detail
            assert not failed.broken_world and pool.broken is None
        res = ok(_step(pool, 1, 0, publish=False))  # the Core rank still trains
        assert res.version == 2
        assert pool.idle_warm_ranks() == (1,)
        ok(pool.load_state(1, replica="hybrid:a"))  # the warm worker still loads
        pool.activate("hybrid:a")
        res = ok(_step(pool, 2, 1, publish=False))
        assert res.replicas == ("core:0", "hybrid:a") and res.version == 3
        core = ok(pool.save_state(tmp_path / "core-2"))
        warm = ok(pool.save_state(tmp_path / "warm-2", rank=1))
        assert pool.broken is None
    report = verify.compare_states(core, warm, exact=True)  # both lanes took the same step
    assert report.passed, report.lines()
    assert report.version == (3, 3)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_revision_that_cannot_be_saved_leaves_the_step_standing(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    revs = tmp_path / "revisions"
    cfg = _config(revisions=str(revs), model=str(tiny_model_dir))  # a publishable model
    with TrainerPool.spawn(cfg, work_dir=tmp_path / "pool") as pool:
        assert Path(ok(pool.publish(1))).exists()
        ok(pool.load_state(1, replica="hybrid:a"))
        pool.activate("hybrid:a")
        res = ok(_step(pool, 0, 1, revision=1))  # not newer than the store's revision 1
        assert res.replicas == ("core:0", "hybrid:a") and res.version == 1
        assert res.revision is None and res.revision_path is None
        assert res.publish_error is not None and "RevisionNotIncreasing" in res.publish_error
        assert pool.broken is None and pool.core_version == 1
        res = ok(_step(pool, 1, 1, revision=2))  # both lanes step on; the next save works
        assert res.version == 2 and res.revision == 2 and res.publish_error is None
        assert res.revision_path is not None and Path(res.revision_path).exists()


def test_a_log_stream_never_raises_writelines_no_stream_or_a_copy() -> None:
    """`LogStream` (a worker's or agent's stdout/stderr): `writelines` went to the stream's own
    (through `__getattr__`) and raised on a full disk; a process started without stdout
    (`sys.stdout` None) raised AttributeError at each write; a copy (`copy.copy`, which asks
    the bare object for `__setstate__`) recursed without end in `__getattr__`. Now each line
    goes through `write`, lines without a stream are dropped and counted, and a missing
    attribute is AttributeError."""
    import copy
    import io

    from ehp_fsm.fspaths import LogStream

    class Full(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError(28, "No space left on device")

    full = LogStream(Full())
    full.writelines(["a\n", "b\n"])
    assert full.dropped == 2
    none = LogStream(None)
    assert none.write("lost\n") == 5
    none.writelines(["x\n"])
    none.flush()
    assert none.dropped == 2
    kept = LogStream(io.StringIO())
    twin = copy.copy(kept)
    twin.write("kept\n")
    assert kept.getvalue() == "kept\n"
    bare = LogStream.__new__(LogStream)
    with pytest.raises(AttributeError):
        bare.fileno  # noqa: B018


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (a full device)")
def test_a_worker_whose_log_is_on_a_full_disk_serves_on(tmp_path: Path) -> None:
    """The worker's log (`worker-<rank>.log`, in the run directory) on a full disk: `/dev/full`,
    whose every write fails with ENOSPC. A failed state write (a full disk too, as in a run on a
    3 MB tmpfs) printed its traceback to that log, the print raised, and the Core rank died
    (exit 1, an empty log), stopping the run as "rank 0 dead" where the save was to fail alone.
    Now the line is dropped and the worker serves on."""
    work = tmp_path / "pool"
    work.mkdir()
    (work / "worker-0.log").symlink_to("/dev/full")
    with TrainerPool.spawn(_config(max_hybrids=0), work_dir=work) as pool:
        ok(_step(pool, 0, 0, publish=False))
        (tmp_path / "core").mkdir()
        failed = pool.save_state(tmp_path / "core")
        assert isinstance(failed, PoolFailure), failed
        assert failed.reason == "worker_error" and "FileExistsError" in failed.detail, failed
        assert pool.broken is None
        res = ok(_step(pool, 1, 0, publish=False))  # the Core rank still trains
        assert res.version == 2


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_revision_on_a_full_disk_names_the_revisions_folder(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """`[run] revisions` on a real full file system (a 1 MiB tmpfs, filled): the step stands and
    its `publish_error`, which the run's stop message shows, names the folder. It said
    "OSError: [Errno 28] No space left on device" alone."""
    if os.geteuid() != 0:
        pytest.skip("mounts a tmpfs: needs root")
    full = tmp_path / "full"
    full.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(full)], check=True)
    try:
        revs = full / "revisions"
        cfg = _config(revisions=str(revs), model=str(tiny_model_dir), max_hybrids=0)
        with TrainerPool.spawn(cfg, work_dir=tmp_path / "pool") as pool:
            with contextlib.suppress(OSError), open(full / "filler", "wb") as fh:
                while True:
                    fh.write(b"\0" * 65536)
                    fh.flush()
            res = ok(_step(pool, 0, 0, revision=1))
            assert res.revision is None and res.publish_error is not None
            assert "No space left on device" in res.publish_error, res.publish_error
            assert f"writing revision 1 in {revs}" in res.publish_error, res.publish_error
            assert pool.broken is None and pool.core_version == 1
            assert [p.name for p in full.iterdir()] == ["filler"] or not any(revs.iterdir())
    finally:
        subprocess.run(["umount", str(full)], check=True)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_non_finite_gradient_is_refused_before_the_optimizer_steps(tmp_path: Path) -> None:
    with TrainerPool.spawn(_config(max_hybrids=0), work_dir=tmp_path / "pool") as pool:
        batch = batch_of(0)
        rewards = batch.rewards.clone()
        rewards[0] = math.nan
        failed = _step(pool, 0, 0, batch=replace(batch, rewards=rewards), publish=False)
        assert isinstance(failed, PoolFailure) and failed.rank == 0, failed
        assert "holds NaN or Inf" in failed.detail, failed
        # the reply says it truly (its `stepped`), at the version it had
        assert "(its optimizer did not step: version 0)" in failed.detail, failed
        assert pool.core_version == 0


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_failed_state_write_on_a_dp2_core_leaves_the_world_usable(tmp_path: Path) -> None:
    """With Core DP2 the save is a collective (the DP-zero gather to rank 0): rank 0's write
    failing after it is still that rank's alone, so the pool is not marked broken."""
    with TrainerPool.spawn(_config(core_dp=2, max_hybrids=0), work_dir=tmp_path / "pool") as pool:
        (tmp_path / "core").mkdir()
        failed = pool.save_state(tmp_path / "core")
        assert isinstance(failed, PoolFailure) and failed.rank == 0, failed
        assert failed.reason == "worker_error" and "FileExistsError" in failed.detail
        assert not failed.broken_world and pool.broken is None
        res = ok(_step(pool, 0, 0, publish=False))
        assert res.replicas == ("core:0", "core:1") and res.version == 1
        ok(pool.save_state(tmp_path / "core-1"))
    assert verify.read_index(tmp_path / "core-1")["version"] == 1


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_core_rank_that_does_not_answer_is_described_by_what_its_process_does(
    tmp_path: Path,
) -> None:
    """A frozen Core rank (SIGSTOP, as Ctrl-Z or an operator's mistake does) failed the step
    with "no reply from ranks [0] in 3 s" only: the operator could not tell a stopped process
    from a slow step. The failure now says the process is stopped and how to resume it."""
    import os
    import signal

    with TrainerPool.spawn(_config(max_hybrids=0), work_dir=tmp_path / "pool") as pool:
        ok(_step(pool, 0, 0, publish=False))
        pid = next(w for w in pool.workers if w.rank == 0).identity.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            got = _step(pool, 1, 0, publish=False, timeout_s=3.0)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert isinstance(got, PoolFailure) and (got.reason, got.rank) == ("deadline", 0), got
        assert f"rank 0's process {pid} is stopped" in got.detail, got.detail
        assert f"`kill -CONT {pid}` resumes it" in got.detail, got.detail


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_warm_worker_that_does_not_answer_its_park_is_stopped_and_replaced(
    tmp_path: Path,
) -> None:
    """A warm worker frozen while idle (SIGSTOP) used to be waited for by its park and then by
    each of its GPU finalizer's asks, 120 s every time, on the run's loop. Now the park's
    deadline (the run gives it `[deadlines.hybrid_replica] leaving`) judges it hung: it is
    killed, the finalizer's next ask is answered at once (dead: its memory went with it), and
    the next admit replaces it with a worker that takes a lane."""
    import signal

    with TrainerPool.spawn(_config(), work_dir=tmp_path / "pool") as pool:
        ok(_step(pool, 0, 0, publish=False))
        ok(pool.load_state(1, replica="hybrid:w"))
        pool.deactivate("hybrid:w")
        pid = next(w for w in pool.workers if w.rank == 1).identity.pid
        os.kill(pid, signal.SIGSTOP)
        got = pool.park(1, timeout_s=2.0)
        assert isinstance(got, PoolFailure) and got.reason == "deadline", got
        assert f"rank 1's process {pid} is stopped" in got.detail, got.detail
        # killed, not left frozen: exited by now; its starter (`training.prefork`), not this
        # process, reaps it, within moments on a loaded machine
        assert not still_running([pid]), psutil.Process(pid).status()
        assert _reaped(pid, 10.0), f"worker {pid} was not reaped in 10 s"
        t0 = time.monotonic()
        again = pool.held_memory(1, timeout_s=60.0)
        assert isinstance(again, PoolFailure) and again.reason == "dead", again
        assert time.monotonic() - t0 < 1.0  # answered at once, not after the time-out
        assert pool.admit_replacements(wait_s=60) is None
        ok(pool.load_state(1, replica="hybrid:v"))
        pool.activate("hybrid:v")
        ok(_step(pool, 1, 0, publish=False))  # the replacement trains beside the Core


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_warm_worker_that_cannot_build_its_lane_fails_its_load_at_once(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The Hugging Face directory a warm worker builds its lane from at its first load is gone
    (an operator moved the model folder mid-run): the load fails at once, naming the folder,
    with nothing sent and the pool usable. Before, the warm worker failed while Core rank 0 was
    already sending it the state: rank 0 waited out the transfer's time-out (a run's Core sat
    120 s in a borrow and then stopped with the hang, not the folder); the pool was broken."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    cfg = _config(model=str(model), collective_timeout_s=30.0)
    with TrainerPool.spawn(cfg, work_dir=tmp_path / "pool") as pool:
        ok(_step(pool, 0, 0, publish=False))
        model.rename(tmp_path / "moved")
        t0 = time.monotonic()
        failed = pool.load_state(1, replica="hybrid:a")
        took = time.monotonic() - t0
        assert isinstance(failed, PoolFailure), failed
        assert (failed.reason, failed.rank) == ("worker_error", 1), failed
        assert str(model) in failed.detail, failed.detail
        assert took < 10.0, took  # not the transfer's 30 s time-out
        assert not failed.broken_world and pool.broken is None
        assert pool.idle_warm_ranks() == (1,)
        ok(_step(pool, 1, 0, publish=False))  # the Core trains on
        (tmp_path / "moved").rename(model)  # put back: the same worker loads and trains
        ok(pool.load_state(1, replica="hybrid:a"))
        pool.activate("hybrid:a")
        res = ok(_step(pool, 2, 1, publish=False))
        assert res.replicas == ("core:0", "hybrid:a") and res.version == 3


def _reaped(pid: int, timeout_s: float) -> bool:
    """Process `pid` is gone from the process table (not even a zombie) within `timeout_s`."""
    end = time.monotonic() + timeout_s
    while psutil.pid_exists(pid):
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def _kill_and_wait(pid: int, sig: int) -> None:
    """Send `sig` to worker `pid` and wait (10 s at most) until it has exited, then 1 s more:
    ZeroMQ sees the connection close on its own thread."""
    os.kill(pid, sig)
    wait_exited(pid, 10.0)
    time.sleep(1.0)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_worker_killed_before_a_command_is_named_by_its_exit(tmp_path: Path) -> None:
    """A warm worker kill -9'd, then sent a command: the send fails (the worker is not
    connected any more), and the failure said only "not reachable on the control channel (Host
    unreachable)" — a run's Hybrid killed so said nothing of the kill (a CI run met it). It now
    names the process's exit, as the liveness check does."""
    import signal

    with TrainerPool.spawn(_config(), work_dir=tmp_path / "pool") as pool:
        ok(_step(pool, 0, 0, publish=False))
        pid = next(w.identity.pid for w in pool.workers if w.rank == 1)
        _kill_and_wait(pid, signal.SIGKILL)
        failed = pool.load_state(1, replica="hybrid:a")
        assert isinstance(failed, PoolFailure) and failed.reason == "dead", failed
        assert failed.detail.startswith(f"process {pid} was killed by SIGKILL"), failed.detail
        assert "not reachable on the control channel" in failed.detail, failed.detail
        ok(_step(pool, 1, 0, publish=False))  # the Core trains on


def test_a_crashed_workers_log_line_is_its_own_not_an_earlier_processs(tmp_path: Path) -> None:
    """Every process of a rank appends to one log: a replacement that exited by itself was
    named with the error of the process before it (a reviewer's find). Only what was written
    since the process started counts."""
    from ehp_fsm.errors import last_error_line

    log = tmp_path / "worker-1.log"
    log.write_text("RuntimeError: the first process's\n")
    since = log.stat().st_size
    assert last_error_line(log, since=since) == ""
    with log.open("a") as fh:
        fh.write("starting\nValueError: the second process's\nFatal Python error: Aborted\n")
    assert last_error_line(log, since=since) == "ValueError: the second process's"
    assert last_error_line(log) == "ValueError: the second process's"


def test_a_worker_that_crashed_is_named_with_its_logs_last_error(tmp_path: Path) -> None:
    """A trainer that aborted itself was named only as "killed by SIGABRT": the cause — a Gloo
    listener out of file descriptors ("accept: Too many open files", a local user flooding its
    port: an attacker's find) — was in its log alone. Its death now names its log's last
    error line, not Python's own "Fatal Python error: Aborted" after it. (The far edge faked:
    the line is appended to the worker's log and the signal sent from here.)"""
    import signal

    with TrainerPool.spawn(_config(), work_dir=tmp_path / "pool") as pool:
        ok(_step(pool, 0, 0, publish=False))
        pid = next(w.identity.pid for w in pool.workers if w.rank == 1)
        said = "  what():  [enforce fail at listener.cc:63] accept: Too many open files"
        with open(tmp_path / "pool" / "worker-1.log", "a") as fh:
            fh.write(
                "terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
                f'{said}\nFatal Python error: Aborted\n\n  File "x.py", line 1 in f\n'
            )
        _kill_and_wait(pid, signal.SIGABRT)
        failed = pool.load_state(1, replica="hybrid:a")
        assert isinstance(failed, PoolFailure) and failed.reason == "dead", failed
        assert failed.detail.startswith(
            f"process {pid} was killed by SIGABRT (its log: {said.strip()!r})"
        ), failed.detail
        ok(_step(pool, 1, 0, publish=False))  # the Core trains on


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_stopped_core_rank_in_a_load_is_blamed_and_the_warm_worker_left_alone(
    tmp_path: Path,
) -> None:
    """Core rank 0 frozen (SIGSTOP) while a Hybrid's state loads: the warm worker waits for
    its send, so neither answers. The warm worker was judged hung and killed, the stopped
    rank waited for again and the world re-formed around it — three time-outs on the run's
    loop (310 s in a run, SIGTERM unheard), the innocent worker blamed. Now the stopped Core
    rank is named after one time-out and the warm worker is not touched."""
    import signal

    import psutil

    with TrainerPool.spawn(_config(), work_dir=tmp_path / "pool") as pool:
        ok(_step(pool, 0, 0, publish=False))
        pids = {w.rank: w.identity.pid for w in pool.workers}
        os.kill(pids[0], signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            got = pool.load_state(1, replica="hybrid:w", timeout_s=3.0)
            took = time.monotonic() - t0
            assert isinstance(got, PoolFailure) and got.broken_world and got.rank == 0, got
            assert f"rank 0's process {pids[0]} is stopped" in got.detail, got.detail
            assert took < 8.0, took  # one time-out (it took three, the last one twice as long)
            assert psutil.Process(pids[1]).status() != psutil.STATUS_ZOMBIE  # not killed
        finally:
            os.kill(pids[0], signal.SIGCONT)


def test_a_process_killed_by_a_signal_is_said_so() -> None:
    from ehp_fsm.errors import exit_words

    assert exit_words(-9) == "was killed by SIGKILL"  # it said "exited with code -9"
    assert exit_words(-15) == "was killed by SIGTERM"
    assert exit_words(3) == "exited with code 3"
    assert exit_words(-200) == "was killed by signal 200"


def test_a_step_held_by_a_stopped_rank_is_said_while_it_runs(tmp_path: Path) -> None:
    """A Core rank frozen (SIGSTOP) mid-step left the run without a word until the step's
    `computing` deadline, 300 s by default (an operator's find). The run's loop now says a step
    still training after `SLOW_STEP_S` (`Job.slow_step`), naming the stopped rank and how to
    resume it; it asks the pool while the step's thread holds it (here: the pool's lock held by
    another thread, as a step holds it), so the question must not wait for that lock."""
    import io
    import signal
    import threading

    from ehp_fsm.plan import load_plan
    from ehp_fsm.run.job import Job

    with TrainerPool.spawn(_config(), work_dir=tmp_path / "pool") as pool:
        ok(_step(pool, 0, 0, publish=False))
        pid = pool.workers[0].identity.pid
        assert pool.stopped_ranks() == []
        held, release = threading.Event(), threading.Event()

        def step_thread() -> None:
            with pool._exclusive:  # as the step's thread holds the pool
                held.set()
                release.wait(30)

        holder = threading.Thread(target=step_thread)
        holder.start()
        os.kill(pid, signal.SIGSTOP)
        try:
            assert held.wait(10)
            t0 = time.monotonic()
            deadline = t0 + 10
            while pool.stopped_ranks() != [(0, pid)] and time.monotonic() < deadline:
                time.sleep(0.05)  # (the kernel marks it stopped within moments)
            assert pool.stopped_ranks() == [(0, pid)]
            assert time.monotonic() - t0 < 5  # not held behind the step
            plan = Path(__file__).resolve().parents[2] / "examples" / "local.toml"
            job = Job(load_plan(plan), io.StringIO(), live=False, verify=False, steps=None)
            job.cluster.pool = pool
            job.stepping, job.longest_step_s = 7, 0.4
            said = job.slow_step(45.0)
            assert said.startswith("step 7: still training after 45 s (the longest step"), said
            assert f"trainer rank 0's process {pid} is stopped" in said, said
            assert f"`kill -CONT {pid}` resumes it" in said and "computing = 300 s" in said, said
        finally:
            os.kill(pid, signal.SIGCONT)
            release.set()
            holder.join(10)
