"""Checkpoint lines (schema 2): written by the engine's log, checked by replay, and the cuts at
which replay verifies stretches of a log in parallel worker processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ehp_fsm.errors import LogFormatError, ReplayDivergence
from ehp_fsm.finished import FORGETTABLE, WRITER_FORGETS, Forgetter
from ehp_fsm.replay import replay
from ehp_fsm.report.timeline import role_intervals
from ehp_fsm.translog import CHECKPOINT_EVENT, TransitionLog, world_state
from tests.core.logedit import as_schema_2, rechain, unchained
from tests.golden.scenarios import HERE, borrow_and_return

GOLDEN = HERE / "borrow_and_return.jsonl"


def checkpointed(
    tmp_path: Path, every: int = 1, forget_finished: bool = True
) -> tuple[Path, list[str]]:
    log = tmp_path / "checkpointed.jsonl"
    borrow_and_return(log, checkpoint_every=every, forget_finished=forget_finished)
    return log, log.read_text().splitlines(keepends=True)


def checkpoint_lines(lines: list[str]) -> list[int]:
    """1-based numbers of the checkpoint lines."""
    return [n for n, x in enumerate(lines, start=1) if CHECKPOINT_EVENT in x and n > 1]


def test_checkpoints_hold_the_world_between_events(tmp_path: Path) -> None:
    log, lines = checkpointed(tmp_path)
    cps = checkpoint_lines(lines)
    assert len(cps) > 50  # one after every event of the scenario
    last = json.loads(lines[cps[-1] - 1])
    final = replay(log)
    assert last["checkpoint"] == final.last_seq  # the scenario ends with an event
    # (schema 4) the instances its writer forgot are listed by id, the live ones whole
    forgot = Forgetter(final.world, WRITER_FORGETS)
    assert {k: last[k] for k in ("version", "globals", "instances")} == json.loads(
        json.dumps(world_state(final.world))
    )
    assert last["finished"] == forgot.listing()
    assert last["finished"]["request"]["consumed"]["count"] == forgot.finished["request"].count
    # The records are exactly the golden log's: checkpoints only add lines.
    # (Their chains differ: each checkpoint is a link of the chain too.)
    records = [unchained(x) for n, x in enumerate(lines, start=1) if n not in cps]
    assert records[1:] == [unchained(x) for x in GOLDEN.read_text().splitlines(True)[1:]]


def test_sequential_and_parallel_replay_agree(tmp_path: Path) -> None:
    log, _ = checkpointed(tmp_path, every=3)
    one = replay(log)
    for jobs in (2, 3, 5):
        many = replay(log, jobs=jobs)
        assert (many.transitions, many.events, many.last_seq) == (
            one.transitions,
            one.events,
            one.last_seq,
        )
        assert many.world.snapshot() == one.world.snapshot()
    assert one.transitions == len(GOLDEN.read_text().splitlines()) - 1


def test_every_checkpoint_is_a_valid_start(tmp_path: Path) -> None:
    """Restoring the world from any checkpoint and replaying on gives the same end: the
    checkpoint holds everything the engine needs (restore fidelity)."""
    from ehp_fsm.replay import _stretch

    log, lines = checkpointed(tmp_path)
    config = json.loads(lines[0])["config"]
    full = replay(log)
    offsets = [0]
    for x in lines:
        offsets.append(offsets[-1] + len(x.encode()))
    for n in checkpoint_lines(lines)[::7]:
        seq = json.loads(lines[n - 1])["checkpoint"]
        # (schema 4: a stretch from a checkpoint forgets, as its writer did)
        got = _stretch(
            str(log), config, offsets[n - 1], n, seq, offsets[-1], True, None, tuple(FORGETTABLE)
        )
        assert got[0] == "done", got
        assert got[1] == full.last_seq - seq  # every record after the checkpoint, verified


@pytest.mark.parametrize("jobs", [1, 3])
def test_a_tampered_checkpoint_is_caught_at_its_line(tmp_path: Path, jobs: int) -> None:
    log, lines = checkpointed(tmp_path, every=2)
    n = checkpoint_lines(lines)[len(checkpoint_lines(lines)) // 2]
    cp = json.loads(lines[n - 1])
    gid = sorted(cp["instances"]["gpu"])[0]
    cp["instances"]["gpu"][gid][0] = "failed"
    lines[n - 1] = json.dumps(cp) + "\n"
    log.write_text("".join(rechain(lines)))  # a forger who rebuilds the (unkeyed) chain
    with pytest.raises(ReplayDivergence) as info:
        replay(log, jobs=jobs)
    assert info.value.line == n and info.value.field == f"checkpoint gpu {gid!r}"


@pytest.mark.parametrize("jobs", [1, 2, 4])
def test_a_tampered_record_is_named_by_its_absolute_line_in_any_stretch(
    tmp_path: Path, jobs: int
) -> None:
    log, lines = checkpointed(tmp_path, every=2)
    n = max(
        i
        for i, x in enumerate(lines, start=1)
        if '"dest":"serving"' in x and CHECKPOINT_EVENT not in x
    )  # late in the log: in the last stretch or one before it
    lines[n - 1] = lines[n - 1].replace('"dest":"serving"', '"dest":"draining"')
    log.write_text("".join(lines))
    with pytest.raises(ReplayDivergence) as info:
        replay(log, jobs=jobs)
    assert (info.value.line, info.value.field) == (n, "dest")


def test_the_first_bad_stretch_wins(tmp_path: Path) -> None:
    log, lines = checkpointed(tmp_path, every=2)
    accepted = [i for i, x in enumerate(lines, start=1) if '"accepted":true' in x]
    early, late = accepted[2], accepted[-2]
    for n in (early, late):
        lines[n - 1] = lines[n - 1].replace('"reason":""', '"reason":"edited"', 1)
    log.write_text("".join(lines))
    with pytest.raises(ReplayDivergence) as info:
        replay(log, jobs=4)
    assert info.value.line == early


def test_a_garbled_checkpoint_is_a_format_error(tmp_path: Path) -> None:
    log, lines = checkpointed(tmp_path, every=2)
    n = checkpoint_lines(lines)[3]
    lines[n - 1] = lines[n - 1].replace('"version":', '"version":"', 1)
    log.write_text("".join(lines))
    with pytest.raises(LogFormatError) as info:
        replay(log)
    assert info.value.line == n


def test_a_schema_1_log_without_checkpoints_still_verifies(tmp_path: Path) -> None:
    lines = as_schema_2(GOLDEN.read_text().splitlines(keepends=True))
    head = json.loads(lines[0])
    head["schema_version"] = 1
    old = tmp_path / "v1.jsonl"
    old.write_text(json.dumps(head) + "\n" + "".join(lines[1:]))
    assert replay(old, jobs=2).transitions == len(lines) - 1


def test_a_log_in_the_earlier_json_dumps_spacing_still_verifies(tmp_path: Path) -> None:
    """Logs written before the msgspec renderer have `json.dumps` spacing (`"key": value`);
    replay, its checkpoint detection and its parallel cuts read them the same."""
    # (kept every instance: a writer before schema 4 forgot none, and listed none by id)
    log, lines = checkpointed(tmp_path, every=3, forget_finished=False)
    assert lines[1].startswith('{"seq":1,')  # what the writer renders today: compact
    lines = as_schema_2(lines)  # a log from before the hash chain (schema 3)
    spaced = tmp_path / "spaced.jsonl"
    spaced.write_text("".join(json.dumps(json.loads(x)) + "\n" for x in lines))
    assert spaced.read_text().splitlines()[1].startswith('{"seq": 1, ')
    new, old = replay(log), replay(spaced, jobs=3)
    assert old.transitions == new.transitions == len(lines) - 1 - len(checkpoint_lines(lines))
    assert old.world.snapshot() == new.world.snapshot()
    # a tampered spaced line is still caught at its line
    edit = spaced.read_text().splitlines(keepends=True)
    n = next(i for i, x in enumerate(edit, start=1) if '"dest": "serving"' in x and i > 10)
    edit[n - 1] = edit[n - 1].replace('"dest": "serving"', '"dest": "draining"')
    spaced.write_text("".join(edit))
    with pytest.raises(ReplayDivergence) as info:
        replay(spaced, jobs=3)
    assert info.value.line == n and info.value.field == "dest"


def test_the_log_checkpoints_by_events_and_world_size(tmp_path: Path) -> None:
    """Default policy: every `checkpoint_every` events, but no more often than two events per
    instance (a checkpoint renders every instance)."""
    from ehp_fsm.core.effects import EFFECTS
    from ehp_fsm.core.guards import GUARDS
    from ehp_fsm.core.transition import step
    from ehp_fsm.core.world import Event, World
    from ehp_fsm.specfiles import load_specs

    gpus = {f"h0:g{i}": "h0" for i in range(10)}
    config = {"inventory": gpus, "core_gpus": list(gpus), "core_replicas": ["core:0"]}
    config["replica_size"] = 1
    world = World(load_specs(), config)
    path = tmp_path / "t.jsonl"
    log = TransitionLog.create(path, config=config, specs=world.specs, checkpoint_every=5)
    written = []
    for k in range(60):
        gid = f"h0:g{k % 10}"
        name = ("assign", "release", "confirm_free")[(k // 10) % 3]
        payload = {"owner": "core", "processes_exited": True, "memory_free": True}
        out = step(world, Event("gpu", gid, name, float(k), payload), GUARDS, EFFECTS)
        assert out.accepted, out
        world.apply(out.changes, out.globals)  # type: ignore[union-attr]
        log.write(out)
        if log.checkpoint_due(world):
            log.checkpoint(world)
            written.append(k + 1)
    log.close()
    assert written == [20, 40, 60]  # 10 instances: every 20 events, not every 5
    assert replay(path, jobs=3).transitions == 60


def test_the_timeline_reads_past_checkpoints(tmp_path: Path) -> None:
    log, _ = checkpointed(tmp_path)
    assert role_intervals(log) == role_intervals(GOLDEN)


@pytest.mark.parametrize("jobs", [1, 2, 4])
def test_a_forged_checkpoint_the_engine_cannot_step_is_named_not_a_worker_traceback(
    tmp_path: Path, jobs: int
) -> None:
    """With `--jobs`, a stretch restores its world from a checkpoint line before the stretch
    before it has compared that line: a forged checkpoint (its chain rebuilt) holding values
    of the wrong type — the published revision a map — crashed the stretch's step with a
    worker's `TypeError` traceback out of `ehp-fsm replay`, instead of the divergence the
    stretch before names at that line."""
    log, lines = checkpointed(tmp_path, every=2)
    cps = checkpoint_lines(lines)
    for n in cps:
        cp = json.loads(lines[n - 1])
        cp["globals"]["revision"] = {"forged": 1}
        lines[n - 1] = json.dumps(cp) + "\n"
    log.write_text("".join(rechain(lines)))
    with pytest.raises(ReplayDivergence) as info:
        replay(log, jobs=jobs, forget_finished=True)
    assert (info.value.line, info.value.field) == (cps[0], "checkpoint globals")


def test_a_stretch_from_a_checkpoint_the_engine_cannot_step_names_that_checkpoint(
    tmp_path: Path,
) -> None:
    """The stretch itself (a worker's `_stretch`) returns a failure naming the line it could
    not step and the checkpoint it started from, where it raised the engine's `TypeError`:
    the stretch before it names the difference, and wins."""
    from ehp_fsm.replay import _stretch

    log, lines = checkpointed(tmp_path, every=1)
    config = json.loads(lines[0])["config"]
    cps = checkpoint_lines(lines)
    for k in cps:  # every checkpoint agrees with the forged world: only the step can tell
        cp = json.loads(lines[k - 1])
        cp["globals"]["revision"] = {"forged": 1}
        lines[k - 1] = json.dumps(cp) + "\n"
    n = cps[0]
    cp = json.loads(lines[n - 1])
    text = "".join(rechain(lines))
    log.write_text(text)
    offsets = [0]
    for x in text.splitlines(keepends=True):
        offsets.append(offsets[-1] + len(x.encode()))
    got = _stretch(
        str(log),
        config,
        offsets[n - 1],
        n,
        cp["checkpoint"],
        offsets[-1],
        True,
        None,
        tuple(FORGETTABLE),
    )
    assert got[0] == "unsteppable" and got[1] > n and got[2] == n, got
    assert "TypeError" in got[3], got


def test_replay_jobs_says_when_the_log_had_too_few_checkpoints_to_cut(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A log is cut only at its checkpoint lines (one every 10,000 events): a run's log of a
    few thousand events has none, and `ehp-fsm replay LOG --jobs 4` replayed it in one process
    without a word, as if in four."""
    from ehp_fsm.cli import main

    assert CHECKPOINT_EVENT not in GOLDEN.read_text()
    assert main(["replay", str(GOLDEN), "--jobs", "4"]) == 0
    out = capsys.readouterr().out
    note = "--jobs 4: 1 stretch (this log has no checkpoint lines; replayed in one process)"
    assert note in out.splitlines(), out
    none = replay(GOLDEN, jobs=4)
    assert (none.stretches, none.has_checkpoints) == (1, False)
    one = tmp_path / "one"  # a single checkpoint: two stretches of the four asked for
    one.mkdir()
    log, lines = checkpointed(one, every=60)
    assert len(checkpoint_lines(lines)) == 1
    assert replay(log, jobs=4, forget_finished=True).stretches == 2
    assert main(["replay", str(log), "--jobs", "4"]) == 0
    out = capsys.readouterr().out
    assert (
        "--jobs 4: 2 stretches (a log is cut only at its checkpoint lines, and this one has too "
        "few to cut it in 4; replayed in 2 processes)" in out.splitlines()
    ), out
    # what was asked for was had, or nothing was asked: no word (the verdict line alone)
    many, _ = checkpointed(tmp_path, every=1)
    assert replay(many, jobs=3, forget_finished=True).stretches == 3
    for argv in (["replay", str(many), "--jobs", "3"], ["replay", str(GOLDEN), "--jobs", "1"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "stretch" not in out and "transitions verified" in out, out
    assert main(["replay", str(GOLDEN)]) == 0
    assert "stretch" not in capsys.readouterr().out
    # --at keeps every instance: a schema-4 log's checkpoints do not hold the finished ones
    assert main(["replay", str(many), "--jobs", "4", "--at", "30"]) == 0
    assert capsys.readouterr().err.splitlines()[-1] == (  # (--at: stdout is the world alone)
        "--jobs 4: 1 stretch (--at keeps every instance, and this log's checkpoints list its "
        "finished instances by id only: it is replayed from its start; replayed in one process)"
    )
