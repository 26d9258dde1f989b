"""Replay that forgets finished instances (`replay(..., forget_finished=True)`, what `ehp-fsm
replay` does): the world it keeps stays the size of the live world while the log grows, and
every verdict and message is the one replay gives keeping every instance — on an honest log, on
an event for a forgotten instance, on a forged record and on a forged checkpoint."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ehp_fsm.replay
from ehp_fsm.errors import ReplayDivergence
from ehp_fsm.finished import FORGETTABLE, IdSet, Unsure
from ehp_fsm.replay import ReplayResult, replay
from ehp_fsm.translog import CHECKPOINT_EVENT
from tests.core.logedit import rechain
from tests.core.scenario import Scenario
from tests.golden.scenarios import train_step

GROUPS = 8  # the plan's groups_per_step
TERMINAL = "request 'g0' is in terminal state 'consumed', which absorbs every event"


def training(
    log: Path, steps: int, *, checkpoint_every: int | None = None, forget_finished: bool = True
) -> Scenario:
    """`steps` training steps of 8 fresh groups each on one engine, each step's revision
    installed and the one before it retired: per step 8 consumed groups, a done step and a
    retired revision that nothing changes again. `forget_finished`: the orchestrator's (False:
    checkpoints list every instance, as before schema 4)."""
    s = Scenario(log_path=log, checkpoint_every=checkpoint_every, forget_finished=forget_finished)
    s.serving_engine("e0", "h1:g0")
    more_steps(s, 1, steps)
    return s


def more_steps(s: Scenario, first: int, last: int, *, group_id: str = "g{}") -> None:
    """Steps `first`..`last` as `training` makes them (8 fresh groups each; `group_id`: the
    format of their ids from their number)."""
    for k in range(first, last + 1):
        rev = s.world.globals["revision"]
        groups = [group_id.format(n) for n in range((k - 1) * GROUPS, k * GROUPS)]
        for g in groups:
            s.ok("request", g, "enqueue", prompt="1+1=")
            s.ok("request", g, "dispatch", engine="e0")
            s.ok("request", g, "complete", engine="e0", revision=rev)
        train_step(s, k, groups, ["core:0", "core:1"])
        s.ok("rollout_engine", "e0", "installed", revision=k + 1)
        s.ok("revision", f"r{k}", "retire")


def retained(result: ReplayResult) -> int:
    """Instances the replayed world holds."""
    return sum(len(by_id) for by_id in result.world.instances.values())


def live_part(result: ReplayResult) -> dict[str, Any]:
    """The snapshot of `result`'s world without the instances a forgetting replay forgets."""
    snap = result.world.snapshot()
    for m, by_id in snap["instances"].items():
        gone = FORGETTABLE.get(m, frozenset())
        snap["instances"][m] = {i: x for i, x in by_id.items() if x["state"] not in gone}
    return snap


def passes(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each pass a replay makes over a log forgets, as it makes them (a second pass,
    keeping every instance, is how forgetting names a difference it cannot decide)."""
    seen: list[bool] = []
    inner = ehp_fsm.replay._replay

    def spy(*args: Any) -> ReplayResult:
        seen.append(args[4] is not None)  # (the machines it forgets, or None)
        return inner(*args)

    monkeypatch.setattr(ehp_fsm.replay, "_replay", spy)
    return seen


def same_verdict(log: Path, **kw: Any) -> ReplayResult:
    """Replay `log` keeping and forgetting: the same counts, chain and live world, in one pass;
    returns the forgetting replay."""
    keep = replay(log, **kw)
    with pytest.MonkeyPatch.context() as mp:
        seen = passes(mp)
        forget = replay(log, forget_finished=True, **kw)
    assert seen == [True]
    assert (forget.transitions, forget.events, forget.last_seq, forget.chain) == (
        keep.transitions,
        keep.events,
        keep.last_seq,
        keep.chain,
    )
    assert forget.world.snapshot() == live_part(keep)
    return forget


def same_error(log: Path, second_pass: bool = False, **kw: Any) -> str:
    """Both replays refuse `log` with the same error; its message. `second_pass`: forgetting
    needs a second pass, keeping every instance, to name it."""
    with pytest.raises(ReplayDivergence) as keep:
        replay(log, **kw)
    with pytest.MonkeyPatch.context() as mp:
        seen = passes(mp)
        with pytest.raises(ReplayDivergence) as forget:
            replay(log, forget_finished=True, **kw)
    assert seen == ([True, False] if second_pass else [True])
    assert type(forget.value) is type(keep.value)
    assert str(forget.value) == str(keep.value)
    return str(keep.value)


def test_the_world_kept_stays_the_live_world_while_the_log_grows(tmp_path: Path) -> None:
    short, long = tmp_path / "short.jsonl", tmp_path / "long.jsonl"
    training(short, 3).engine.close()
    training(long, 12).engine.close()
    a, b = same_verdict(short), same_verdict(long)
    assert b.transitions > 3 * a.transitions
    assert retained(b) == retained(a)  # the live world: GPUs, the engine, current revisions
    assert retained(replay(long)) - retained(replay(short)) == 9 * (GROUPS + 2)  # as before


def test_an_event_for_a_forgotten_instance_is_refused_as_before(tmp_path: Path) -> None:
    log = tmp_path / "t.jsonl"
    s = training(log, 2)
    assert s.no("request", "g0", "complete", engine="e0", revision=2) == TERMINAL
    assert s.no("request", "g0", "enqueue", prompt="again") == TERMINAL  # its id stays taken
    assert "'step-1' is in terminal state 'done'" in s.no("training_step", "step-1", "fail")
    assert "'r1' is in terminal state 'retired'" in s.no("revision", "r1", "publish")
    s.engine.close()
    result = same_verdict(log)
    assert result.world.get("request", "g0") is not None  # a stand-in: its state ...
    assert result.world.get("request", "g0").state == "consumed"  # type: ignore[union-attr]
    assert "g0" not in result.world.instances["request"]  # ... but not held
    with pytest.raises(Unsure):  # and its data is not there to be read: replay would start over
        result.world.get("request", "g0").get("prompt")  # type: ignore[union-attr]
    # A forger who records the re-enqueue of the consumed g0 as accepted is caught, at the same
    # line with the same message, by both replays.
    lines = log.read_text().splitlines(keepends=True)
    n = next(i for i, x in enumerate(lines) if '"again"' in x)
    rec = json.loads(lines[n])
    assert rec["reason"] == TERMINAL and rec["source"] == "consumed"
    rec.update(accepted=True, reason="", source="<new>", dest="queued")
    lines[n] = json.dumps(rec) + "\n"
    forged = tmp_path / "forged.jsonl"
    forged.write_text("".join(rechain(lines)))
    assert f"line {n + 1}" in same_error(forged)


def checkpoint_lines(lines: list[str]) -> Iterator[int]:
    return (n for n, x in enumerate(lines) if CHECKPOINT_EVENT in x and n > 0)


def test_checkpoints_are_checked_as_before_with_finished_instances_forgotten(
    tmp_path: Path,
) -> None:
    log = tmp_path / "cp.jsonl"  # checkpoints that list every instance (schema 3's)
    training(log, 4, checkpoint_every=7, forget_finished=False).engine.close()
    for jobs in (1, 3):
        same_verdict(log, jobs=jobs)
    lines = log.read_text().splitlines(keepends=True)
    last = max(checkpoint_lines(lines))

    def forge(name: str, edit: Any) -> Path:
        cp = json.loads(lines[last])
        edit(cp["instances"])
        out = tmp_path / name
        out.write_text("".join(rechain([*lines[:last], json.dumps(cp) + "\n", *lines[last + 1 :]])))
        return out

    def data(instances: dict[str, Any]) -> None:
        instances["request"]["g0"][1]["consumed_by"] = "step-9"  # a forgotten group's data

    def state(instances: dict[str, Any]) -> None:
        instances["training_step"]["step-1"][0] = "failed"  # a forgotten step's state

    def missing(instances: dict[str, Any]) -> None:
        del instances["revision"]["r1"]  # a forgotten revision left out

    def extra(instances: dict[str, Any]) -> None:
        instances["request"]["g999"] = ["consumed", {}]  # a group never seen

    for name, edit in (("data", data), ("state", state), ("missing", missing), ("extra", extra)):
        forged = forge(f"{name}.jsonl", edit)
        for jobs in (1, 3):
            assert f"line {last + 1}" in same_error(forged, True, jobs=jobs), name


def test_idset_is_compact_for_numbered_ids_and_exact_for_any_other() -> None:
    ids = IdSet()
    numbered = [f"g{n}" for n in range(100_000)]
    odd = ["g", "g007", "h1:g0x", "step-12", "0", "r" + "9" * 20, "g-1", "g١٢"]  # ١٢: Arabic
    for x in [*numbered[::2], *odd]:
        ids.add(x)
    assert len(ids) == 50_000 + len(odd)
    assert all(x in ids for x in numbered[::2]) and all(x in ids for x in odd)
    assert not any(x in ids for x in numbered[1::2])
    assert not any(x in ids for x in ("g7", "g00", "h1:g0", "step-13", "r9", "g100000", "g"[:0]))
    assert ids.nbytes() < 20_000  # 100,000 ids' bits (12.5 kB), the odd ones as strings
