"""A lane of TP > 1 answers the pool as one worker: TP rank 0 merges its followers' replies.

In-process, no Gloo world: a `TrainerWorker` as TP rank 0 of a TP 2 lane (its control socket
points at a port nobody listens on; only its follower channel is used), with a real ZeroMQ
ROUTER for its follower channel and a real child process standing in for a follower that dies
(the far edge faked: a follower that fails to answer). The whole lane — lead, follower, relay —
runs for real in the TP 2 run of `tests/run/test_megatron_hybrid_dies.py`; what is shown here
are the failure paths that run never takes:

- a follower whose process exits answers as failed, naming its TP rank, instead of hanging;
- a follower's failure inside a collective where TP rank 0 succeeded becomes the lane's reply
  (named by TP rank) and leaves the lane unusable (its shards may have diverged); a local one
  does not;
- a restore's reply names every TP shard's check against the save, and a follower whose shard
  differs fails it (locally);
- a parked lane holds what its most holding TP rank still holds (the GPU finalizer must not
  see "free" while a follower keeps its shard).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
import zmq

from ehp_fsm.runtime.pool_launch import new_route
from ehp_fsm.training.memory import HeldMemory
from ehp_fsm.training.pool_protocol import PoolConfig
from ehp_fsm.training.worker import TrainerWorker


@pytest.fixture
def lead() -> Iterator[TrainerWorker]:
    config = PoolConfig(backend="megatron", model="/m", respawn_warm=False, tp=2)
    w = TrainerWorker(
        config,
        rank=1,
        control="tcp://127.0.0.1:9",
        rendezvous="file:///nonexistent",
        launch_token="t",
        parent=None,
        route=new_route(),
    )
    w._tp_sock = w._ctx.socket(zmq.ROUTER)
    w._tp_sock.setsockopt(zmq.LINGER, 0)
    w._tp_sock.bind_to_random_port("tcp://127.0.0.1")
    yield w
    w._sock.setsockopt(zmq.LINGER, 0)
    w.close()


def test_a_follower_that_exits_answers_as_failed_with_its_tp_rank(lead: TrainerWorker) -> None:
    lead._followers = [subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])]
    replies = lead._await_followers("ref-1", timeout_s=30.0)
    assert replies == [(1, False, {"error": "TP rank 1 of the lane exited with code 3"})]
    with pytest.raises(RuntimeError, match="TP rank 1 of pool rank 1 exited with code 3"):
        lead._await_followers(None, timeout_s=30.0)  # at start-up: the worker fails


def test_a_follower_failure_in_a_collective_is_the_lanes_and_breaks_it(
    lead: TrainerWorker,
) -> None:
    mine = {"version": 4, "reduce_s": 0.1}
    theirs = {"error": "RuntimeError: gloo timeout", "local": False, "stepped": False}
    ok, result = lead._merge("commit", True, mine, [(1, False, theirs)])
    assert not ok and result["error"] == "TP rank 1: RuntimeError: gloo timeout"
    assert result["stepped"] is False
    assert lead._broken is not None and "TP rank 1" in lead._broken
    lead._broken = None
    local = {"error": "disk full", "local": True}
    ok, result = lead._merge("save_state", True, {"version": 4}, [(1, False, local)])
    assert not ok and result["local"] is True and lead._broken is None
    assert lead._merge("commit", True, mine, [(1, True, {"version": 4})]) == (True, mine)


def test_a_restore_answers_every_tp_shards_check_and_a_follower_that_differs_fails_it(
    lead: TrainerWorker,
) -> None:
    """After a resume's restore each TP rank holds its shard to the save's digests: the lane's
    reply names both shards' checks; a follower whose shard differs fails the restore, named
    by TP rank, without breaking the lane (its collectives completed)."""
    mine = {"version": 3, "checked": {"tp0": {"tensors": 8, "digest": "a"}}}
    theirs = {"version": 3, "checked": {"tp1": {"tensors": 8, "digest": "b"}}}
    ok, result = lead._merge("restore_state", True, mine, [(1, True, theirs)])
    assert ok and result["checked"] == {**mine["checked"], **theirs["checked"]}
    differs = {"error": "the state restored from s/tp-1 is not the saved one", "local": True}
    ok, result = lead._merge("restore_state", True, mine, [(1, False, differs)])
    assert not ok and result["error"].startswith("TP rank 1: the state restored from s/tp-1")
    assert lead._broken is None


def test_a_parked_lane_holds_what_its_most_holding_tp_rank_holds(lead: TrainerWorker) -> None:
    free = HeldMemory(device="cpu").to_wire()
    held = HeldMemory(device="cpu", by_kind={"master": 4096}).to_wire()
    ok, result = lead._merge("park", True, {"held": free}, [(1, True, {"held": held})])
    assert ok and HeldMemory.from_wire(result["held"]).why_not_free() is not None
    ok, result = lead._merge("memory", True, {"held": free}, [(1, True, {"held": free})])
    assert ok and HeldMemory.from_wire(result["held"]).free
