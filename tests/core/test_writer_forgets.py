"""The orchestrator's own world forgets its finished instances (`finished.WRITER_FORGETS`), so a
long run's world and its checkpoint lines (schema 4: live instances whole, finished ones as runs
of ids) stay the size of the live world; replay verifies such checkpoints exactly (forgetting or
not, in one stretch or several, `--at`), names a forged one's difference, and a log written so
resumes and goes on forgetting."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from ehp_fsm import Event, Orchestrator
from ehp_fsm import finished as fin
from ehp_fsm.cli import main
from ehp_fsm.core.transition import Rejected
from ehp_fsm.errors import LogFormatError, ReplayDivergence
from ehp_fsm.replay import replay
from ehp_fsm.translog import CHECKPOINT_EVENT
from tests.core.logedit import rechain
from tests.core.scenario import Scenario
from tests.core.test_replay_forget import GROUPS, more_steps, training
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
    # its data is not: a scheduler embedding the orchestrator that reads it is told how to
    # keep it (the message said only "the data of a forgotten instance was read")
    with pytest.raises(fin.Unsure, match="forget_finished=False"):
        s.world.get("request", "g0").get("engine")
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


def test_a_forged_listing_beside_a_machine_left_out_or_added_is_refused(tmp_path: Path) -> None:
    """A checkpoint whose machines are not the world's (one with no live instance left out, or
    an empty one added) was compared by its live instances only: its `finished` ids were never
    read, so a forged listing (g0 left out, a group never made put in, the count kept) passed
    every replay, `ehp-fsm replay` included. Now the machines and the listing are compared."""

    def listing(cp: dict[str, Any]) -> None:
        consumed = cp["finished"]["request"]["consumed"]
        consumed["runs"][0][1] = 1
        consumed["ids"] = ["g999999"]

    def left_out(cp: dict[str, Any]) -> None:
        listing(cp)
        assert cp["instances"].pop("hybrid_replica") == {}

    def added(cp: dict[str, Any]) -> None:
        listing(cp)
        cp["instances"]["zzz"] = {}

    machines = ["capacity", "gpu", "hybrid_replica", "request", "revision", "rollout_engine"]
    machines.append("training_step")
    for name, edit, recorded in (
        ("left_out", left_out, [m for m in machines if m != "hybrid_replica"]),
        ("added", added, [*machines, "zzz"]),
    ):
        log, n = forged(tmp_path, name, edit)
        (message,) = refused(log)
        assert (
            f"replay diverges at line {n}: `checkpoint machines` recorded {recorded!r}, "
            f"engine computed {machines!r}"
        ) in message, message
        assert main(["replay", str(log)]) == 2


def test_a_listing_naming_more_ids_than_records_came_before_it_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each forgotten instance took a record at least: a listing whose count, or whose runs,
    name more ids than the checkpoint's seq is forged. Runs of up to 10**12 ids each named more
    than 2**63 ids, and `len` of the set raised OverflowError (a traceback from `ehp-fsm
    replay`); now the count is checked before the runs are read, the runs' size after, both as
    Python ints."""

    def count(cp: dict[str, Any]) -> None:  # a count past the seq: refused before the runs
        cp["finished"]["request"]["consumed"]["count"] = 2**64 - 1

    def runs(cp: dict[str, Any]) -> None:  # runs of 10**12 ids, the count left as it was
        cp["finished"]["request"]["consumed"]["runs"] = [["g", 0, 10**12 - 1]]

    for name, edit, what in (
        ("count", count, f"count is {2**64 - 1}"),
        ("runs", runs, f"runs and ids name {10**12}"),
    ):
        log, n = forged(tmp_path, name, edit)
        seq = json.loads(log.read_text().splitlines()[n - 1])["checkpoint"]
        (message,) = refused(log)
        assert f"line {n} " in message, message
        assert f"its finished request 'consumed' {what}: more than the {seq} records" in message
        assert main(["replay", str(log)]) == 2


def test_runs_naming_more_than_sys_maxsize_ids_are_refused_not_overflowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs that name more than sys.maxsize ids (9.2 M runs of 10**12 ids: a line of ~200 MB,
    here the set built from the line says so), their count small: `len` of the set raised
    OverflowError; now its size is compared as a Python int, and the line refused."""
    log, _ = forged(tmp_path, "overflow", lambda cp: None)
    built = fin.IdSet.from_runs

    def huge(runs: Any, ids: Any) -> fin.IdSet:
        out = built(runs, ids)
        out._n += sys.maxsize  # (as 9.2 M runs of 10**12 ids would)
        return out

    monkeypatch.setattr(fin.IdSet, "from_runs", huge)
    for kw in ({}, {"forget_finished": True}):
        with pytest.raises(LogFormatError) as info:
            replay(log, **kw)
        assert "is not a valid record" in str(info.value), info.value
        assert f"runs and ids name {sys.maxsize}"[:-2] in str(info.value)  # (and a few)


def test_a_checkpoint_with_finished_in_a_log_before_schema_4_is_refused(tmp_path: Path) -> None:
    """A schema-3 log's writer forgot nothing: a `finished` key in its checkpoint is forged
    (it was accepted, its ids compared as if its writer had listed them)."""
    log, _ = forged(tmp_path, "same", lambda cp: None)
    lines = log.read_text().splitlines(keepends=True)
    head = json.loads(lines[0])
    head["schema_version"] = 3
    old = tmp_path / "schema3.jsonl"
    old.write_text("".join(rechain([json.dumps(head) + "\n", *lines[1:]])))
    first = min(n for n, x in enumerate(lines) if CHECKPOINT_EVENT in x and n > 0) + 1
    (message,) = refused(old)
    assert f"line {first} " in message, message
    assert "`finished` came with schema 4; this log's header says schema 3" in message
    assert main(["replay", str(old)]) == 2


def test_checkpoints_of_groups_named_otherwise_than_by_number_grow_with_the_log_not_its_square(
    tmp_path: Path,
) -> None:
    """Groups named as a scheduler may name them (here `g<n>-a`, as a UUID would be: not
    `<prefix><number>`) are listed one by one under `finished`. A checkpoint came as often as
    the live world allowed (two events an instance) while each listed every group forgotten so
    far: the checkpoints grew with the square of the log (174 kB after 100 steps, 609 kB after
    200: 17 % of the log). Now each listed id counts as an instance of the world, as a kept
    one did (32 kB and 44 kB: 1.4 %)."""
    sizes = {}
    for steps in (100, 200):
        log = tmp_path / f"{steps}.jsonl"
        s = Scenario(log_path=log)
        assert s.engine.log is not None
        s.engine.log.checkpoint_every = 100  # (the default 10,000: a longer run, the same)
        s.serving_engine("e0", "h1:g0")
        more_steps(s, 1, steps, group_id="g{}-a")
        s.engine.close()
        lines = log.read_bytes().splitlines()
        listed = sum(len(x) for x in lines if CHECKPOINT_EVENT.encode() in x)
        sizes[steps] = listed, sum(map(len, lines))
    assert sizes[200][0] <= 0.1 * sizes[200][1], sizes
    assert sizes[200][0] <= 2.5 * sizes[100][0], sizes
    assert replay(log, jobs=2, forget_finished=True).transitions == replay(log).transitions


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


def test_a_log_written_keeping_every_instance_resumes_keeping_them(tmp_path: Path) -> None:
    """`forget_finished=False` keeps every instance (their data read by the caller). Before,
    the log resumed (`Orchestrator.resume`) into a world that forgot them: the groups read
    before the crash were gone from `world.of`, and reading one's data raised `Unsure`.
    `resume(..., forget_finished=False)` goes on as the log was written; the log replays."""
    from ehp_fsm.embedded import OrchestratorError

    log = tmp_path / "t.jsonl"
    first = training(log, 3, checkpoint_every=7, forget_finished=False)
    first.engine.close()
    orch = Orchestrator.resume(log, forget_finished=False)
    assert orch.world.get("request", "g0").get("prompt") == "1+1="  # (its data: still there)
    s = Scenario.__new__(Scenario)
    s.engine, s.now = orch, first.now
    more_steps(s, 4, 6)
    assert len(orch.world.of("request")) == 6 * GROUPS
    orch.close()
    assert replay(log, jobs=3, forget_finished=True).transitions == replay(log).transitions
    forgets = Orchestrator.resume(log)  # (None: as schema 4 is written, it forgets)
    assert forgets.world.of("request") == {}
    forgets.close()
    old = tmp_path / "old.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    head = json.loads(lines[0])
    head["schema_version"] = 3
    old.write_text("".join(rechain([json.dumps(head) + "\n", *lines[1:]])))
    with pytest.raises(OrchestratorError, match="the log is schema 3: its checkpoints list"):
        Orchestrator.resume(old, forget_finished=True)


def test_an_orchestrator_keeping_every_instance_refuses_a_world_that_forgot_some(
    tmp_path: Path,
) -> None:
    """`forget_finished=False` took a replay's forgetting world (`orch.world = ...`): the
    groups it dropped read as gone, their data raised `Unsure`, and its checkpoints listed
    what that forgetter dropped (finished engines too). Refused, as a forgetting one is."""
    from ehp_fsm.embedded import OrchestratorError

    log = tmp_path / "t.jsonl"
    training(log, 2).engine.close()
    keeper = Scenario(forget_finished=False).engine
    with pytest.raises(OrchestratorError, match=r"keeps every instance \(forget_finished=False\)"):
        keeper.world = replay(log, forget_finished=True).world
    keeper.world = replay(log).world  # (every instance: taken, kept)
    assert len(keeper.world.of("request")) == 2 * GROUPS


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
    groups = _step_2_groups(s)
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


def test_a_step_that_breaks_an_invariant_stands_with_what_it_finished_forgotten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`InvariantViolation`: the event stands, logged and applied. Before, it was raised
    before the world forgot what the step finished: step 2's consumed groups stayed live in
    the world and in the next checkpoint's `instances`, which replay (any mode) refused as a
    divergence, so the log of a checked run that went on could not be replayed or resumed."""
    from ehp_fsm.core.effects import EFFECTS
    from ehp_fsm.embedded import InvariantViolation

    log = tmp_path / "t.jsonl"
    s = training(log, 1, checkpoint_every=1)
    _step_2_reduced(s)
    s.serving_engine("e1", "h1:g1")
    # a bug in an effect: a failed engine hands its GPU to no finalizer (a leak)
    monkeypatch.setitem(EFFECTS, "release_gpus", lambda act: None)
    with pytest.raises(InvariantViolation, match="a leak"):
        s.fire("rollout_engine", "e1", "fail")
    with pytest.raises(InvariantViolation, match="a leak"):  # (the world is unsound still)
        s.fire("training_step", "step-2", "stepped", version=2)
    assert s.world.of("request") == {}  # consumed: forgotten, as replay's world forgets them
    assert s.world.get("request", "g8").state == "consumed"
    assert s.engine.log is not None
    s.engine.log.checkpoint(s.world)
    s.engine.close()
    kept = replay(log)
    assert replay(log, forget_finished=True, jobs=2).transitions == kept.transitions
    fin.Forgetter(kept.world, fin.WRITER_FORGETS)
    assert kept.world.snapshot() == s.world.snapshot()
    resumed = Orchestrator.resume(log)
    assert resumed.world.snapshot() == s.world.snapshot()
    resumed.close()


def _step_2_groups(s: Scenario) -> list[str]:
    """Step 2's 8 groups (of `training(..., 1)`), completed by e0 at the current revision."""
    rev = s.world.globals["revision"]
    groups = [f"g{n}" for n in range(GROUPS, 2 * GROUPS)]
    for g in groups:
        s.ok("request", g, "enqueue", prompt="1+1=")
        s.ok("request", g, "dispatch", engine="e0")
        s.ok("request", g, "complete", engine="e0", revision=rev)
    return groups


def _step_2_reduced(s: Scenario) -> None:
    """Step 2 of `training(..., 1)` up to `reduced`: its 8 groups completed and claimed; its
    `stepped` consumes them (the groups the world then forgets)."""
    groups = _step_2_groups(s)
    s.ok("training_step", "step-2", "begin", step=2)
    part = {"core:0": groups[0::2], "core:1": groups[1::2]}
    s.ok("training_step", "step-2", "partition", groups=groups, partition=part)
    s.ok("training_step", "step-2", "delivered", replicas=["core:0", "core:1"])
    s.ok("training_step", "step-2", "reduced")


#: What forgets an instance (the lines `_Interrupt` counts).
_FORGETS = {fin.Forgetter.forget.__code__, fin.Finished.add.__code__, fin.IdSet.add.__code__}


class _Interrupt:
    """A trace function (`sys.settrace`) that raises KeyboardInterrupt at the `at`-th line run
    in `_FORGETS` while the first two instances are forgotten (Ctrl-C between two of their
    lines), or only counts those lines (None)."""

    def __init__(self, at: int | None) -> None:
        self.at, self.lines, self.where, self.forgets = at, 0, "", 0

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        if event != "call" or frame.f_code not in _FORGETS:
            return None
        self.forgets += frame.f_code is fin.Forgetter.forget.__code__
        return self._line if self.forgets <= 2 else None

    def _line(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            self.lines += 1
            if self.lines == self.at:
                self.where = f"{frame.f_code.co_qualname}:{frame.f_lineno}"
                raise KeyboardInterrupt
        return self._line


def test_an_interrupt_anywhere_in_forgetting_takes_the_event_back_out_whole(
    tmp_path: Path,
) -> None:
    """A KeyboardInterrupt at each line that forgets the first two of step 2's consumed groups
    (its `stepped`). Before, the repair counted each forgotten id back down, which an interrupt
    inside `forget` had not counted up yet (or had counted, its bit not set): a set's size
    one more than its ids, or a machine's count one less. The next checkpoint's count did not
    match its runs, and replay refused the log ("count is 17, and its runs and ids name 16");
    a count of 0 with an id in the set hid a forgotten instance from lookups. Now the counts
    are put back as they were, and the event handled again leaves the log replaying."""
    stepped = Event("training_step", "step-2", "stepped", 100.0, {"version": 2})

    def interrupted(at: int | None) -> tuple[Scenario, Path, _Interrupt]:
        log = tmp_path / f"t{at}.jsonl"
        s = training(log, 1, checkpoint_every=1)
        _step_2_reduced(s)
        trace = _Interrupt(at)
        sys.settrace(trace)
        try:
            s.engine.handle(stepped)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        return s, log, trace

    whole, _, counted = interrupted(None)
    whole.engine.close()
    assert counted.lines > 20, counted.lines
    for at in range(1, counted.lines + 1):
        s, log, trace = interrupted(at)
        assert trace.where, f"no interrupt at line {at}"
        forget = s.engine._forget
        assert forget is not None
        for f in forget.finished.values():
            for state, ids in f.by_state.items():
                runs, other = ids.runs()
                named = sum(hi - lo + 1 for _, lo, hi in runs) + len(other)
                assert len(ids) == named, f"{trace.where}: {f.machine} {state}"
            assert f.count == sum(len(ids) for ids in f.by_state.values()), trace.where
        assert s.world.of("training_step")["step-2"].state == "stepping", trace.where
        assert s.engine.handle(stepped).accepted, trace.where
        assert s.world.of("request") == {} and forget.count() == 2 * GROUPS + 2
        s.engine.close()
        kept = replay(log)
        assert replay(log, jobs=2, forget_finished=True).transitions == kept.transitions
        fin.Forgetter(kept.world, fin.WRITER_FORGETS)
        assert kept.world.snapshot() == s.world.snapshot(), trace.where
        log.unlink()


def test_ids_that_each_double_a_bit_array_grow_it_by_at_most_its_limit(tmp_path: Path) -> None:
    """A bit array grew by its own length whenever an id fell just past its end, so ids each
    at the end of the one before (r0, r8, r16, r32, r64, ...) doubled it each time: 26 failed
    revisions took 32 MiB in the orchestrator's world and in replay's (37: 64 GiB, the
    process killed). Now an id grows it by at most `finished._GROW` bytes."""
    log = tmp_path / "t.jsonl"
    s = Scenario(log_path=log)
    forget = s.engine._forget
    assert forget is not None
    failed, ids = forget.finished["revision"].by_state["failed"], fin.IdSet()
    for k in range(26):
        base, bits = failed._arrays.get("r", (0, bytearray()))
        rid = f"r{base + 8 * len(bits)}"  # just past the end of the array
        s.ok("revision", rid, "save", revision=k + 1, step=0)
        s.ok("revision", rid, "fail")
        ids.add(rid)
    most = 26 * (fin._GROW + 1)
    assert ids.nbytes() <= most and failed.nbytes() <= most
    s.engine.close()
    replayed = replay(log, forget_finished=True).world.forgotten
    assert replayed is not None
    assert replayed.__self__.finished["revision"].by_state["failed"].nbytes() <= most  # type: ignore[attr-defined]


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


def test_a_deep_copy_of_the_world_is_a_snapshot_of_its_own(tmp_path: Path) -> None:
    """A scheduler embedding the orchestrator copies its world to ask "what if" (or to keep a
    snapshot): `copy.deepcopy(orch.world)` raised TypeError (a mappingproxy, then a keyed
    hasher, cannot be pickled). The copy keeps what the world was, forgotten instances
    included, while the world goes on."""
    import copy

    from ehp_fsm.translog import world_state

    s = training(tmp_path / "t.jsonl", 3)
    snapshot = copy.deepcopy(s.world)
    then = world_state(snapshot)
    assert then == world_state(s.world)
    more_steps(s, 4, 6)
    assert world_state(snapshot) == then != world_state(s.world)
    assert snapshot.get("request", "g0").state == "consumed"  # forgotten before the copy
    assert snapshot.get("request", "g40") is None  # a group of step 6: not yet, in the copy
    assert s.world.get("request", "g40").state == "consumed"
    assert snapshot.globals["revision"] < s.world.globals["revision"]
    s.engine.close()
