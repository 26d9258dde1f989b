"""kill -9 of a Megatron TP 2 Hybrid mid-run: the run goes on, as it does on the torch backend.

Real processes throughout (the TP 2 plan of `test_run_megatron.py`: a Core lane and a warm
Hybrid lane of two processes each, agents, embedded engines, a Hybrid borrowed from two engine
slots). Once the Hybrid trains, its TP rank 0 — the process the pool knows, from `run.json` —
is killed. What follows:

- the step is retried on the Core; the pool re-formed its TP 2 world without the lane (before,
  a TP > 1 world was never re-formed and the run stopped);
- the lane's TP rank 1 exits on its own (no process of the run is left at the end);
- the dead warm worker is replaced (before, the Megatron backend never replaced one: the planner
  then asked for a Hybrid every step and failed it): the replacement starts on standby, builds
  its Megatron lane when the pool admits it into the world, and the planner's next borrow takes
  the dead Hybrid's free GPUs for it;
- the run ends cleanly and sound (`tests/run/soundness.py`: the fault matrix's checks).

The same run is CI's TP 2 `ehp-fsm run --verify` (one run carries both, as the TP 2 run test
did alone before): the replacement's borrow is returned at the end, `--verify` passes on the
Core's two TP shards (the retried step is recorded as it stood: on the Core), and the last
revision, exported over TP, loads with `from_pretrained`.

And all of it again at PP 2 (`pp2_plan_text`: each lane two pipeline stages, the killed
process the Hybrid's first stage, its second stage exiting by itself; the state dir's two
shards are the stages', each stage's tied-embedding bucket placed in its grad buffer's world
tensor — before that, every state save of a PP run failed with `KeyError: 1` — and the
revision is mbridge's export over the two stages). CI's PP 2 `ehp-fsm run --verify`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.run.soundness import assert_run_sound
from tests.run.test_resume import LogTail, cli
from tests.run.test_run import assert_no_handler_failures, assert_no_orphans
from tests.run.test_run_megatron import loads_with_from_pretrained, pp2_plan_text, tp2_plan_text


def _hybrid_trains(tail: LogTail) -> bool:
    """Whether the records the log gained since the last look hold a partition with a Hybrid."""
    return any(
        r.get("machine") == "training_step"
        and r.get("event") == "partition"
        and any(k.startswith("hybrid") for k in (r.get("payload") or {}).get("partition", {}))
        for r in tail.new()
    )


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("plan_text", [tp2_plan_text, pp2_plan_text], ids=["tp2", "pp2"])
def test_kill9_of_a_megatron_hybrid_lane_mid_run(
    tmp_path: Path, plan_text: Callable[[Path, int], str]
) -> None:
    run_id = uuid.uuid4().hex
    log = tmp_path / "run" / "transitions.jsonl"
    plan = tmp_path / "plan.toml"
    plan.write_text(plan_text(log, 8))
    proc = cli(plan, "run", "--verify", run_id=run_id)
    killed = None
    tail = LogTail(log, None)
    end = time.monotonic() + 300
    try:
        while proc.poll() is None and killed is None and time.monotonic() < end:
            if _hybrid_trains(tail):
                hybrid = json.loads((log.parent / "run.json").read_text())["trainers"]["1"]
                os.kill(int(hybrid["pid"]), signal.SIGKILL)
                killed = int(hybrid["pid"])
            time.sleep(0.05)
        out, _ = proc.communicate(timeout=300)
    finally:  # a run that overran is not left to the tests after this one (its processes
        if proc.poll() is None:  # follow it: they exit when the run is gone)
            proc.kill()
            proc.communicate()
    assert killed is not None, out
    assert proc.returncode == 0, out
    assert f"process {killed} was killed by SIGKILL" in out, out
    assert "no idle warm worker" not in out and "planner: at most" not in out, out
    receipt = assert_run_sound(log, run_id=run_id)  # the fault matrix's checks
    assert receipt["last_step"] == 8, receipt
    moves = [(m["kind"], m["detail"]) for m in receipt["moves"]]
    assert moves[0][0] == "borrow" and moves[1][0] == "failed", moves
    # killed while it computes (dead) or inside the all-reduce (the world re-formed without
    # it): the step is retried on the Core; or killed once the reduction was done (its lane's
    # compute is short: a CI run met it): its gradient counted and the step stands
    assert re.fullmatch(
        r"hybrid \S+ died( \(dead\)| inside the \w+ collective \(world re-formed in \d+ ms\))"
        r"; step retried on the Core"
        rf"|hybrid \S+ died after the gradient reduction \(process {killed} was killed by SIGKILL\)"
        r"; its gradient counted, the step stands",
        moves[1][1],
    ), moves
    again = [d for k, d in moves[2:] if k == "borrow"]
    assert again and again[0].startswith("free GPUs -> hybrid"), moves
    assert "return" in [k for k, _ in moves], moves
    pool_log = [json.loads(x) for x in (log.parent / "controller.log").read_text().splitlines()]
    respawned = [r for r in pool_log if r.get("event") == "worker_respawned"]
    admitted = [r for r in pool_log if r.get("event") == "world_reformed" and r["op"] == "admit"]
    assert [r["rank"] for r in respawned] == [1] and admitted, (respawned, admitted)
    # --verify: the run equals its recorded partitions replayed on a pool of its own lanes, a
    # step the replacement trained among them; both shards of the Core (TP ranks, or PP stages)
    # were compared (the state dir's index joins them)
    verified = receipt["verify"]
    assert verified["passed"] is True and verified["hybrid_steps"] >= 1, verified["lines"]
    index = json.loads((log.parent / "verify" / "ehp-state" / "index.json").read_text())
    shards = {e["key"].split("/")[1] for e in index["tensors"]}
    assert shards == {"tp0", "tp1"}, shards
    # every step's fingerprint (what names the step a run departed at) covers the whole lane:
    # the follower's shard (TP) or stage (PP) under its part's name
    follower = "tp1/" if plan_text is tp2_plan_text else "pp1.tp0/"
    results = sorted((log.parent / "verify" / "records").glob("result-*.json"))
    assert results, "no step's fingerprint was recorded"
    for result in results:
        names = json.loads(result.read_text())["fingerprint"]
        theirs = [n for n in names if n.startswith(follower)]
        assert theirs and not [n for n in names if "/" in n and n not in theirs], sorted(names)
    # the partition replay's pool started with the Core-only replay's, not once that one had
    # saved its state (a Megatron pool's start-up is most of either replay's time)
    replayed = log.parent / "verify" / "replay"
    started = (replayed / "pool").stat().st_mtime  # its workers' logs and Gloo file, at spawn
    assert started < (replayed / "core-only-state" / "index.json").stat().st_mtime
    loads_with_from_pretrained(log.parent / "revisions" / f"r{receipt['last_revision']:08d}")
    assert_no_handler_failures(log)
    assert_no_orphans(run_id)  # the dead lane's other process too
