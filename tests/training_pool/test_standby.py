"""A replacement warm worker on standby (started after its predecessor died, not yet admitted
into the Gloo world) is never used as if it were in the world, the pool never loses the handle of
a process it launched, and a hello is taken only from the process the pool expects.

Real processes, real Gloo, real ZeroMQ. Two places fake the far edge, and say so: a stranger's
hello is sent from a DEALER socket in the test (a process that is not the pool's worker), and one
check marks a live worker dead by hand, standing in for the control channel's "not reachable"
verdict on a process that had not connected yet (the path this module's first test closes).
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import psutil
import pytest
import zmq
from structlog.testing import capture_logs

from ehp_fsm.runtime import identity as ident
from ehp_fsm.runtime.pool_launch import routing_id
from ehp_fsm.runtime.protocol import Frame, Kind, encode
from ehp_fsm.training.pool import PoolConfig, PoolFailure, StepResult, TrainerPool
from tests.procs import kill_and_wait, running_after
from tests.training_pool.rig import batch_of, ok, run_step, tiny_config


def _config(**kw: object) -> PoolConfig:
    return tiny_config(**kw)


def _step(pool: TrainerPool, step: int, epoch: int) -> StepResult | PoolFailure:
    return run_step(pool, step, epoch, batch_of(step), publish=False)


def _rank_procs(rank: int) -> list[int]:
    """Running (not zombie) worker processes of pool rank `rank` among this test's children:
    forked by the pool's starter (`prefork`: named `trainer-<rank>`), or each its own
    `python -m ehp_fsm.training.worker --rank <rank>`."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            cl = p.cmdline()
            own = "ehp_fsm.training.worker" in cl and cl[cl.index("--rank") + 1] == str(rank)
            if (own or p.name() == f"trainer-{rank}") and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (psutil.Error, ValueError, IndexError):
            continue
    return out


def _one_rank_proc(rank: int, timeout_s: float = 10.0) -> list[int]:
    """`_rank_procs(rank)` once it is one process (within `timeout_s`), else what it is then."""
    end = time.monotonic() + timeout_s
    while len(procs := _rank_procs(rank)) != 1 and time.monotonic() < end:
        time.sleep(0.02)
    assert len(procs) == 1, f"rank {rank} processes: {procs}"
    return procs


def _fake_hello(control: str, rank: int, *, launch_token: str, route: str) -> None:
    """A hello as rank `rank` from this test process (not a worker the pool launched): a
    DEALER that sends it, waits until it is out, and closes."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, routing_id(f"trainer-{rank}", route))  # the launch's route
    sock.setsockopt(zmq.LINGER, 5000)
    sock.connect(control)
    me = ident.capture(os.getpid(), launch_token=launch_token)
    frame = Frame(
        kind=Kind.HELLO,
        id=uuid.uuid4().hex,
        seq=1,
        epoch=1,
        sender=f"trainer-{rank}",
        payload={
            "host_id": me.host,
            "inventory": {
                "rank": rank,
                "role": "hybrid",
                "world_size": 2,
                "identity": me.to_dict(),
                "version": 0,
                "grad_shapes": [],
                "standby": True,
                "threads": {"intra_op": 1, "inter_op": 1},
            },
        },
    )
    sock.send(encode(frame))
    sock.close()  # LINGER: the frame is delivered before the socket goes
    ctx.term()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_standby_replacement_is_refused_and_no_process_is_lost(tmp_path: Path) -> None:
    """The warm worker dies; the caller loads state into its rank again at once (as the run's
    Hybrid leases do for a rank bound at launch). Its replacement is on standby: load_state and
    save_state refuse it with a failure that says so, and leave it running (before the fix they
    commanded it as if it were in the world, marked the not-yet-connected process dead, and the
    next admission launched a second rank-1 process and dropped the first one's handle). A hello
    from another process claiming the rank is dropped; the replacement's own is taken, it is
    admitted, loaded and trains. A worker judged dead while its process still runs is killed
    before it is replaced. Nothing outlives the shutdown."""
    seen: set[int] = set()
    # Each worker its own process (`prefork=False`, as on CUDA): the stranger's hello must come
    # before the replacement connects — a second connection with the same ZeroMQ identity is
    # refused by the socket, so the pool would never see (and drop) its hello. A forked
    # replacement connects within a fraction of a second; one that imports torch, in seconds.
    with TrainerPool.spawn(_config(), work_dir=tmp_path / "pool", prefork=False) as pool:
        first = {w.rank: w.identity.pid for w in pool.workers}
        seen |= set(first.values())
        ok(_step(pool, 0, 0))
        kill_and_wait(first[1])
        failed = pool.load_state(1, replica="hybrid:a")  # the death is seen here
        assert isinstance(failed, PoolFailure) and failed.reason == "dead", failed
        assert pool.idle_warm_ranks() == ()

        failed = pool.load_state(1, replica="hybrid:a")  # its replacement is starting
        assert isinstance(failed, PoolFailure), failed
        assert failed.reason == "dead" and failed.rank == 1 and not failed.broken_world
        assert "standby" in failed.detail and "admit_replacements" in failed.detail, failed
        refused = pool.save_state(tmp_path / "warm", rank=1)
        assert isinstance(refused, PoolFailure) and "standby" in refused.detail, refused
        assert not (tmp_path / "warm").exists() and pool.broken is None
        # one rank-1 process: the replacement, still running (waited for: it counts once it
        # has exec'd, and a CI run once found none here at once)
        (replacement,) = _one_rank_proc(1)
        seen.add(replacement)

        # A stranger claims rank 1 (the pool's launch token, another pid): dropped.
        _fake_hello(pool.control, 1, launch_token=pool.launch_token, route=pool.route(1))
        with capture_logs() as logs:
            assert pool.admit_replacements(wait_s=90) is None
        dropped = [e for e in logs if e["event"] == "hello_dropped"]
        assert dropped and dropped[0]["pid"] == os.getpid(), logs
        assert _rank_procs(1) == [replacement]
        member = next(w for w in pool.workers if w.rank == 1)
        assert member.identity.pid == replacement  # the process in the world is the handle's
        assert pool.reforms[-1].members == (0, 1) and pool.idle_warm_ranks() == (1,)

        ok(pool.load_state(1, replica="hybrid:b"))
        pool.activate("hybrid:b")
        res = ok(_step(pool, 1, 1))
        assert res.replicas == ("core:0", "hybrid:b") and res.version == 2
        pool.deactivate("hybrid:b")

        # Judged dead while it still runs (as "not reachable" did): killed, then replaced.
        pool._workers[1].dead = "not reachable on the control channel (test)"
        assert pool.admit_replacements() is None
        end = time.monotonic() + 10
        while replacement in _rank_procs(1) and time.monotonic() < end:
            time.sleep(0.02)
        assert replacement not in _rank_procs(1), "the old process was left running"
        # the new replacement counts once it has exec'd (before that its command line is still
        # this process's: a CI run once saw none here)
        seen |= set(_one_rank_proc(1))  # only the new replacement
        ok(_step(pool, 2, 2))
    left = running_after(seen, timeout_s=10.0)  # the pool's shutdown may still be reaping
    assert not left, f"worker processes {left} outlived the pool"


@pytest.mark.timeout(30)
def test_a_hello_with_another_launch_token_is_dropped(tmp_path: Path) -> None:
    """A pool whose workers someone else launches knows them only by their hello: a hello that
    does not carry the pool's launch token is not taken (the rank stays unready)."""
    pool = TrainerPool.bind(_config(max_hybrids=0), work_dir=tmp_path / "pool")
    try:
        _fake_hello(pool.control, 0, launch_token=ident.new_launch_token(), route=pool.route(0))
        with capture_logs() as logs:
            failed = pool.wait_ready(timeout_s=1.5)
        assert isinstance(failed, PoolFailure) and failed.reason == "deadline", failed
        assert pool.workers == ()
        dropped = [e for e in logs if e["event"] == "hello_dropped"]
        assert dropped and "launch token" in dropped[0]["reason"], logs
    finally:
        pool.shutdown(timeout_s=1)
