"""The orchestrator's own world forgets its finished instances (`finished.WRITER_FORGETS`), so a
long run's world and its checkpoint lines (schema 4: live instances whole, finished ones as runs
of ids) stay the size of the live world; replay verifies such checkpoints exactly (forgetting or
not, in one stretch or several, `--at`), names a forged one's difference, and a log written so
resumes and goes on forgetting."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ehp_fsm import Orchestrator
from ehp_fsm import finished as fin
from ehp_fsm.cli import main
from ehp_fsm.core.transition import Rejected
from ehp_fsm.errors import LogFormatError, ReplayDivergence
from ehp_fsm.replay import replay
from ehp_fsm.translog import CHECKPOINT_EVENT
from tests.core.logedit import rechain
from tests.core.scenario import Scenario
from tests.core.test_replay_forget import GROUPS, training
from tests.golden.scenarios import train_step


def size(world: Any) -> int:
    return sum(len(by_id) for by_id in world.instances.values())


def last_line(log: Path) -> bytes:
    return log.read_bytes().splitlines()[-1]


def test_a_long_runs_world_and_checkpoints_stay_the_size_of_its_live_world(
    tmp_path: Path,
) -> None:
    """Each step leaves 8 consumed groups, a done step and a retired revision: the world used
    to keep them all (+100 instances and +1.4 kB of checkpoint a step here)."""
    worlds, lines = {}, {}
    for steps in (5, 40):
        log = tmp_path / f"{steps}.jsonl"
        s = training(log, steps)
        s.engine.log.checkpoint(s.world)  # the world after the last step, as a checkpoint
        s.engine.close()
        worlds[steps], lines[steps] = size(s.world), last_line(log)
    assert worlds[40] == worlds[5]
    assert len(lines[40]) <= len(lines[5]) + 40  # (its numbers have a digit more)
    finished = json.loads(lines[40])["finished"]
    assert finished["request"] == {
        "consumed": {"count": 40 * GROUPS, "runs": [["g", 0, 40 * GROUPS - 1]], "ids": []}
    }
    assert finished["training_step"]["done"]["runs"] == [["step-", 1, 40]]
    assert finished["revision"]["retired"]["runs"] == [["r", 1, 40]]


def test_a_forgotten_instance_is_still_refused_as_finished(tmp_path: Path) -> None:
    s = training(tmp_path / "t.jsonl", 2)
    assert s.world.of("request") == {}  # every group consumed: forgotten
    out = s.fire("request", "g0", "dispatch", engine="e0")
    assert isinstance(out, Rejected)
    assert out.reason == "request 'g0' is in terminal state 'consumed', which absorbs every event"
    again = s.fire("request", "g3", "enqueue", prompt="1+1=")  # a create under a finished id
    assert isinstance(again, Rejected) and "terminal state 'consumed'" in again.reason
    assert s.world.get("training_step", "step-1").state == "done"  # (its state is known)
    s.engine.close()


def test_replay_verifies_the_checkpoints_of_a_world_that_forgets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "t.jsonl"
    s = training(log, 12, checkpoint_every=7)
    s.engine.close()
    text = log.read_text()
    assert text.count(CHECKPOINT_EVENT) > 10 and '"finished":{"request"' in text
    kept = replay(log)
    assert kept.stretches == 1  # keeping every instance: from the header
    fin.Forgetter(kept.world, fin.WRITER_FORGETS)
    assert kept.world.snapshot() == s.world.snapshot()
    for jobs in (1, 2, 3):
        forgot = replay(log, jobs=jobs, forget_finished=True)
        assert (forgot.transitions, forgot.chain) == (kept.transitions, kept.chain)
        assert forgot.stretches == jobs
    at = kept.last_seq // 2
    half = replay(log, until_seq=at, jobs=2)  # `--at`: every instance, to print them
    assert half.last_seq >= at and half.world.of("request")  # consumed groups among them
    assert main(["replay", str(log), "--jobs", "2"]) == 0
    assert main(["replay", str(log), "--jobs", "2", "--at", str(at)]) == 0
    assert '"consumed"' in capsys.readouterr().out


def forged(tmp_path: Path, name: str, edit: Any) -> tuple[Path, int]:
    """The 12-step log with its last checkpoint edited (`edit(checkpoint)`) and the chain
    rebuilt; the checkpoint's line number."""
    log = tmp_path / "t.jsonl"
    if not log.exists():
        training(log, 12, checkpoint_every=7).engine.close()
    lines = log.read_text().splitlines(keepends=True)
    last = max(n for n, x in enumerate(lines) if CHECKPOINT_EVENT in x and n > 0)
    cp = json.loads(lines[last])
    edit(cp)
    out = tmp_path / f"{name}.jsonl"
    out.write_text("".join(rechain([*lines[:last], json.dumps(cp) + "\n", *lines[last + 1 :]])))
    return out, last + 1


def refused(log: Path) -> list[str]:
    """The error of every replay of `log` (forgetting or not, 1 or 3 stretches): the same."""
    seen = set()
    for kw in ({}, {"jobs": 3}, {"forget_finished": True}, {"forget_finished": True, "jobs": 3}):
        with pytest.raises((ReplayDivergence, LogFormatError)) as info:
            replay(log, **kw)
        seen.add(str(info.value))
    assert len(seen) == 1, seen
    return list(seen)


def test_a_checkpoint_whose_finished_ids_differ_is_refused_naming_the_id(tmp_path: Path) -> None:
    def missing(cp: dict[str, Any]) -> None:  # g0 left out
        cp["finished"]["request"]["consumed"]["runs"][0][1] = 1
        cp["finished"]["request"]["consumed"]["count"] -= 1

    def extra(cp: dict[str, Any]) -> None:  # a group never made
        cp["finished"]["request"]["consumed"]["ids"] = ["g999999"]
        cp["finished"]["request"]["consumed"]["count"] += 1

    def state(cp: dict[str, Any]) -> None:  # revision r3 said failed, not retired
        retired = cp["finished"]["revision"]["retired"]
        retired["runs"] = [["r", 1, 2], ["r", 4, retired["runs"][0][2]]]
        retired["count"] -= 1
        cp["finished"]["revision"]["failed"] = {"count": 1, "runs": [["r", 3, 3]], "ids": []}

    def live(cp: dict[str, Any]) -> None:  # a live instance's data
        cp["instances"]["gpu"]["h1:g1"][1]["host"] = "h9"

    for name, edit, field, recorded, computed in (
        ("missing", missing, "checkpoint finished request 'g0'", None, "consumed"),
        ("extra", extra, "checkpoint finished request 'g999999'", "consumed", None),
        ("state", state, "checkpoint finished revision 'r3'", "failed", "retired"),
        ("live", live, "checkpoint gpu 'h1:g1'", ["free", {"host": "h9"}], None),
    ):
        log, n = forged(tmp_path, name, edit)
        (message,) = refused(log)
        assert f"replay diverges at line {n}: `{field}` recorded {recorded!r}" in message, name
        if name != "live":
            assert f"engine computed {computed!r}" in message, name


def test_a_checkpoint_whose_finished_entry_is_not_one_is_refused(tmp_path: Path) -> None:
    def count(cp: dict[str, Any]) -> None:
        cp["finished"]["request"]["consumed"]["count"] += 5

    def run(cp: dict[str, Any]) -> None:
        cp["finished"]["request"]["consumed"]["runs"] = [["g", 9, 2]]

    def machine(cp: dict[str, Any]) -> None:
        cp["finished"]["gpu"] = {"free": {"count": 1, "runs": [], "ids": ["h1:g1"]}}

    for name, edit, why in (
        ("count", count, "its finished request 'consumed' count is"),
        ("run", run, "['g', 9, 2] is not a run [prefix, first, last]"),
        ("machine", machine, "lists finished instances of 'gpu', which is never forgotten"),
    ):
        log, n = forged(tmp_path, name, edit)
        (message,) = refused(log)
        assert f"line {n}" in message and why in message, (name, message)


def more_steps(s: Scenario, first: int, last: int) -> None:
    """Steps `first`..`last` as `training` makes them (8 fresh groups each)."""
    for k in range(first, last + 1):
        rev = s.world.globals["revision"]
        groups = [f"g{n}" for n in range((k - 1) * GROUPS, k * GROUPS)]
        for g in groups:
            s.ok("request", g, "enqueue", prompt="1+1=")
            s.ok("request", g, "dispatch", engine="e0")
            s.ok("request", g, "complete", engine="e0", revision=rev)
        train_step(s, k, groups, ["core:0", "core:1"])
        s.ok("rollout_engine", "e0", "installed", revision=k + 1)
        s.ok("revision", f"r{k}", "retire")


def test_a_log_written_so_resumes_and_the_resumed_world_forgets_too(tmp_path: Path) -> None:
    log = tmp_path / "t.jsonl"
    first = training(log, 6, checkpoint_every=7)
    first.engine.close()
    orch = Orchestrator.resume(log, check=True)
    assert size(orch.world) == size(first.world)  # forgotten again at once
    s = Scenario.__new__(Scenario)
    s.engine, s.now = orch, first.now
    more_steps(s, 7, 12)
    orch.log.checkpoint(orch.world)  # type: ignore[union-attr]
    orch.close()
    assert size(orch.world) == size(first.world)
    finished = json.loads(last_line(log))["finished"]
    assert finished["request"]["consumed"]["runs"] == [["g", 0, 12 * GROUPS - 1]]
    one = replay(log)  # the whole file verifies as one log, its chain unbroken
    assert one.chain is not None and one.chain[0] == len(log.read_bytes().splitlines())
    assert replay(log, jobs=3, forget_finished=True).transitions == one.transitions


def test_an_event_taken_back_out_takes_back_what_its_world_forgot(tmp_path: Path) -> None:
    """An interrupt after the world forgot an event's finished instances (here: in the
    checkpoint written after it) takes the event back out whole: the forgotten instances are
    live again, and the same event handled again forgets them, as replay does."""
    log = tmp_path / "t.jsonl"
    s = training(log, 1, checkpoint_every=1)
    forget = s.engine._forget
    assert forget is not None
    writer = s.engine.log
    assert writer is not None
    real = writer.checkpoint
    before = forget.count()

    def interrupted(world: Any, finished: Any = None) -> None:
        if forget.count() > before:
            raise KeyboardInterrupt
        real(world, finished)

    writer.checkpoint = interrupted  # type: ignore[method-assign]
    rev = s.world.globals["revision"]
    groups = [f"g{n}" for n in range(GROUPS, 2 * GROUPS)]
    for g in groups:
        s.ok("request", g, "enqueue", prompt="1+1=")
        s.ok("request", g, "dispatch", engine="e0")
        s.ok("request", g, "complete", engine="e0", revision=rev)
    with pytest.raises(KeyboardInterrupt):
        train_step(s, 2, groups, ["core:0", "core:1"])  # its `stepped` consumes them
    assert forget.count() == before
    assert all(s.world.of("request")[g].state == "claimed" for g in groups)
    writer.checkpoint = real  # type: ignore[method-assign]
    s.ok("training_step", "step-2", "stepped", version=2)
    assert s.world.of("request") == {} and forget.count() > before
    for g in groups:
        assert g in forget.finished["request"].by_state["consumed"]
    s.engine.close()
    assert replay(log, jobs=2, forget_finished=True).transitions == replay(log).transitions


def test_idset_runs_round_trip() -> None:
    ids = fin.IdSet()
    for x in [*(f"g{n}" for n in range(0, 100)), "g105", "g107", "g108", "g01", "x", "h3"]:
        ids.add(x)
    runs, other = ids.runs()
    assert runs == [("g", 0, 99), ("g", 105, 105), ("g", 107, 108), ("h", 3, 3)]
    assert other == ["g01", "x"]
    back = fin.IdSet.from_runs(runs, other)
    assert back.runs() == (runs, other) and len(back) == len(ids)
    assert "g50" in back and "g106" not in back and "g01" in back and "g1" in back
    huge = fin.IdSet.from_runs([("g", 0, 10**12 - 1)], [])  # a line of a few bytes: its memory too
    assert len(huge) == 10**12 and "g999999999999" in huge and huge.nbytes() < 100
    ids.discard("g105")
    assert ids.runs()[0][1] == ("g", 107, 108)


def test_a_stretch_that_meets_a_forgotten_instances_data_falls_back_to_the_whole_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Were a guard to read a forgotten group's data (none does: `finished`'s audit), replay
    from checkpoints that list finished ids could not decide: it verifies the log again from
    its header, keeping every instance, in one stretch, and passes only what that verifies."""
    from ehp_fsm.core.guards import GUARDS
    from tests.core.test_replay_forget import passes

    log = tmp_path / "t.jsonl"
    training(log, 8, checkpoint_every=7).engine.close()
    real = GUARDS["revision_unreferenced"]

    def reads_a_finished_group(ctx: Any) -> str | None:
        g0 = ctx.view.world.get("request", "g0")
        assert g0 is None or g0.get("prompt") == "1+1="  # (`Unsure` once g0 is forgotten)
        return real(ctx)

    monkeypatch.setitem(GUARDS, "revision_unreferenced", reads_a_finished_group)
    seen = passes(monkeypatch)
    result = replay(log, jobs=3, forget_finished=True)
    assert seen == [True, False] and result.stretches == 1
    assert result.transitions == len(log.read_text().splitlines()) - 1 - log.read_text().count(
        CHECKPOINT_EVENT
    )
