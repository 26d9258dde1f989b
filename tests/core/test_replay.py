"""Replay verifies golden logs, rebuilds the world, and pinpoints the line of a tampered log."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ehp_fsm.errors import LogFormatError, ReplayDivergence
from ehp_fsm.finished import WRITER_FORGETS, Forgetter
from ehp_fsm.replay import replay
from ehp_fsm.translog import CHECKPOINT_EVENT, VERSION_KEY
from tests.core.logedit import rechain_raw, render, with_version
from tests.golden.scenarios import HERE, borrow_and_return

GOLDEN = HERE / "borrow_and_return.jsonl"


def lines() -> list[str]:
    return GOLDEN.read_text().splitlines(keepends=True)


def tampered(tmp_path: Path, edit: list[str]) -> Path:
    out = tmp_path / "tampered.jsonl"
    out.write_text("".join(edit))
    return out


def line_where(pred: object) -> int:
    for n, raw in enumerate(lines(), start=1):
        if n > 1 and pred(json.loads(raw)):  # type: ignore[operator]
            return n
    raise AssertionError("no such line")


def test_golden_log_verifies() -> None:
    result = replay(GOLDEN)
    assert result.transitions == len(lines()) - 1
    assert result.world.get("rollout_engine", "e3").state == "serving"
    assert result.world.get("gpu", "h1:g1").get("owner") == "engine:e3"
    assert result.world.globals == {"core_version": 2, "epoch": 2, "revision": 3, "latest_saved": 3}


def test_golden_log_is_what_the_scenario_writes_today(tmp_path: Path) -> None:
    """A behaviour change of the specs shows up here first (regenerate deliberately). The
    header's ehp-fsm version is taken as the golden log's: another version number alone is no
    behaviour change (the header's other keys, every record and the chain are compared)."""
    fresh = tmp_path / "fresh.jsonl"
    borrow_and_return(fresh)
    golden = lines()
    version = json.loads(golden[0])[VERSION_KEY]
    written = fresh.read_text().splitlines(keepends=True)
    # The golden log is schema 3 (kept: an older log replays as before); schema 4 changed
    # checkpoint lines only, and it has none: the same log but for its header's schema.
    head = json.loads(written[0])
    assert (head["schema_version"], json.loads(golden[0])["schema_version"]) == (4, 3)
    assert CHECKPOINT_EVENT not in "".join(written[1:])
    head["schema_version"] = 3
    written = rechain_raw([render(head) + "\n", *written[1:]])
    assert "".join(with_version(written, version)) == "".join(golden)


def test_replay_of_a_run_rebuilds_the_run(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    live = borrow_and_return(log)
    # the live world forgot its finished groups, steps and revisions (`WRITER_FORGETS`)
    kept = replay(log).world
    Forgetter(kept, WRITER_FORGETS)
    assert kept.snapshot() == live.world.snapshot()


def test_changed_destination_is_caught_at_its_line(tmp_path: Path) -> None:
    n = line_where(lambda r: r["event"] == "activate")
    edit = lines()
    edit[n - 1] = edit[n - 1].replace('"dest":"active"', '"dest":"ready"')
    with pytest.raises(ReplayDivergence) as info:
        replay(tampered(tmp_path, edit))
    assert (info.value.line, info.value.field) == (n, "dest")
    assert "line" in str(info.value) and str(n) in str(info.value)


def test_flipped_acceptance_is_caught(tmp_path: Path) -> None:
    n = line_where(lambda r: not r["accepted"])
    edit = lines()
    edit[n - 1] = edit[n - 1].replace('"accepted":false', '"accepted":true')
    with pytest.raises(ReplayDivergence) as info:
        replay(tampered(tmp_path, edit))
    assert (info.value.line, info.value.field) == (n, "accepted")
    assert "(the engine refuses this event: " in str(info.value)


def test_edited_payload_diverges_where_its_consequence_shows(tmp_path: Path) -> None:
    # Changing the recorded pid of the stop confirmation makes the engine refuse it on replay.
    n = line_where(lambda r: r["event"] == "exited" and r["accepted"] and r["instance"] == "e1")
    edit = lines()
    edit[n - 1] = edit[n - 1].replace('"pid":100', '"pid":101')
    with pytest.raises(ReplayDivergence) as info:
        replay(tampered(tmp_path, edit))
    assert info.value.line == n
    # what decides it is that the engine refuses the event, and why: it read "`dest` recorded
    # 'stopped', engine computed 'stopping'", the reason left to guess
    assert (info.value.field, info.value.expected, info.value.actual) == ("accepted", True, False)
    said = str(info.value)
    assert "(the engine refuses this event: " in said and "pid" in said, said


def test_deleted_cascade_record_is_caught(tmp_path: Path) -> None:
    n = line_where(lambda r: r["cause"] is not None)
    edit = lines()
    del edit[n - 1]
    with pytest.raises(ReplayDivergence) as info:
        replay(tampered(tmp_path, edit))
    assert info.value.line in (n - 1, n)


def test_deleted_root_event_breaks_the_sequence(tmp_path: Path) -> None:
    edit = lines()
    del edit[10]
    with pytest.raises(ReplayDivergence) as info:
        replay(tampered(tmp_path, edit))
    assert info.value.line == 11 and info.value.field in ("seq", "cause")


def test_garbage_line_is_a_format_error(tmp_path: Path) -> None:
    edit = lines()
    edit[5] = "{not json\n"
    with pytest.raises(LogFormatError) as info:
        replay(tampered(tmp_path, edit))
    assert info.value.line == 6


def test_missing_header_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LogFormatError, match="header"):
        replay(tampered(tmp_path, lines()[1:]))


def test_an_empty_log_is_named_as_empty_not_as_a_bad_header(tmp_path: Path) -> None:
    """A 0-byte log (its writer stopped before the header: a full disk, a kill as the run
    began it) was "the first line is not a 'ehp-fsm.log' header", as if another file had been
    given; now it says the file is empty and why a log can be."""
    log = tmp_path / "t.jsonl"
    log.write_bytes(b"")
    with pytest.raises(LogFormatError, match="the file is empty: its writer stopped before"):
        replay(log)


def test_replay_until_seq_stops_there() -> None:
    n = line_where(lambda r: r["event"] == "activate")
    seq = json.loads(lines()[n - 1])["seq"]
    result = replay(GOLDEN, until_seq=seq)
    assert result.last_seq >= seq
    assert result.world.get("hybrid_replica", "x0").state == "active"
    assert result.world.get("rollout_engine", "e3") is None


def test_log_cut_inside_an_event_names_the_missing_records(tmp_path: Path) -> None:
    """A crash between two records of one event: the last event is short of its cascades."""
    recs = [json.loads(x) for x in lines()[1:]]
    cut = next(
        i
        for i in range(1, len(recs) - 1)
        if recs[i]["cause"] is not None and recs[i + 1]["cause"] is not None
    )
    short = lines()[: cut + 2]  # the header and records 0..cut; record cut+1 is lost
    with pytest.raises(ReplayDivergence) as info:
        replay(tampered(tmp_path, short))
    assert (info.value.line, info.value.field) == (cut + 2, "records in this event")


def test_a_value_of_the_wrong_type_is_a_format_error_naming_it(tmp_path: Path) -> None:
    edit = lines()
    edit[3] = edit[3].replace('"seq":3', '"seq":"3"')
    with pytest.raises(LogFormatError) as info:
        replay(tampered(tmp_path, edit))
    assert info.value.line == 4 and "seq" in str(info.value)


# -- what a review found replay accepting ------------------------------------------------------


def _header_edited(tmp_path: Path, edit: Any) -> Path:
    src = lines()
    header = json.loads(src[0])
    edit(header)
    return tampered(tmp_path, [json.dumps(header) + "\n", *src[1:]])


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda h: h["specs"].update(gpu="0000000000000000"), "other machine specs"),
        (lambda h: h.pop("specs"), "other machine specs"),
        (lambda h: h.update(config=[1]), "`config`"),
        (lambda h: h["config"].update(inventory=["h0:g0"]), "`config`"),
        (lambda h: h.update(schema_version=True), "schema version"),
    ],
)
def test_a_tampered_header_is_refused(tmp_path: Path, edit: Any, named: str) -> None:
    with pytest.raises(LogFormatError, match=named):
        replay(_header_edited(tmp_path, edit))


def test_a_record_without_payload_or_with_extra_keys_is_a_format_error(tmp_path: Path) -> None:
    src = lines()
    n = line_where(lambda r: r.get("payload") == {} and r.get("cause") is None)
    rec = json.loads(src[n - 1])
    for edit in ({k: v for k, v in rec.items() if k != "payload"}, {**rec, "extra": 1}):
        path = tampered(tmp_path, [*src[: n - 1], json.dumps(edit) + "\n", *src[n:]])
        with pytest.raises(LogFormatError):
            replay(path)


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_line_that_is_both_a_record_and_a_checkpoint_is_refused(
    tmp_path: Path, jobs: int
) -> None:
    # A forged line: a (rejected) record that also carries checkpoint fields holding a forged
    # world (revision 2 current, never saved). The serial path stepped it as a record; the
    # parallel path cut the log there and restored the forged world unchecked, so an engine
    # "installing" revision 2 that was never published verified with jobs=2.
    from ehp_fsm.core.effects import EFFECTS
    from ehp_fsm.core.guards import GUARDS
    from ehp_fsm.core.transition import step
    from ehp_fsm.core.world import Event
    from ehp_fsm.translog import outcome_records, world_state

    from .scenario import Scenario, identity

    log = tmp_path / "honest.jsonl"
    s = Scenario(log_path=log)  # no checkpoint of its own: the forged line is the only cut
    s.publish(1)
    s.ok("rollout_engine", "e0", "launch", host="h1", gpus=["h1:g0"], tp=1, token="t")
    s.ok("rollout_engine", "e0", "healthy", identity=identity("h1", "t"))  # installing r1
    s.engine.close()
    honest = replay(log)
    seq = honest.last_seq
    probe = Event("gpu", "h1:g1", "ehp-fsm.checkpoint", 100.0, {}, "")
    (rec,) = outcome_records(step(honest.world, probe, GUARDS, EFFECTS), seq + 1)
    forged_state = world_state(honest.world)
    forged_state["globals"]["revision"] = 2
    both = {"checkpoint": seq + 1, **forged_state, **rec}
    forged = replay(log).world
    forged.globals["revision"] = 2
    out = step(
        forged, Event("rollout_engine", "e0", "installed", 101.0, {"revision": 2}), GUARDS, EFFECTS
    )
    assert out.accepted
    text = log.read_text() + json.dumps(both, separators=(",", ":")) + "\n"
    text += "".join(
        json.dumps(r, separators=(",", ":")) + "\n" for r in outcome_records(out, seq + 2)
    )
    path = tmp_path / "forged.jsonl"
    path.write_text(text)
    with pytest.raises((LogFormatError, ReplayDivergence)):
        replay(path, jobs=jobs)


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_last_line_cut_mid_write_is_named_as_torn_not_as_edited(
    tmp_path: Path, jobs: int
) -> None:
    """A killed writer leaves a last line without its newline and `chain` key: the message
    says so and points at `--resume`, where an edited line is called edited."""
    text = GOLDEN.read_text()
    torn = tmp_path / "torn.jsonl"
    torn.write_text(text[: len(text) - 40])
    with pytest.raises(LogFormatError, match="last line is cut short") as err:
        replay(torn, jobs=jobs)
    assert "--resume" in err.value.fix
    lines = text.splitlines(keepends=True)
    lines[5] = lines[5][:-40] + "\n"  # the same cut inside the log: an edit
    edited = tmp_path / "edited.jsonl"
    edited.write_text("".join(lines))
    with pytest.raises(LogFormatError, match="inserted or edited"):
        replay(edited, jobs=jobs)


def test_replay_jobs_beyond_the_limit_are_refused_at_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--jobs 10**8` looked for 10**8 cuts in a 100-line log (minutes; 10**12 never ended),
    and on a large log would start a process per checkpoint."""
    import signal

    from ehp_fsm.cli import main

    limit = 256  # cli.MAX_REPLAY_JOBS

    def hang(signum: int, frame: object) -> None:
        raise AssertionError("replay --jobs did not return within 20 s")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(20)
    try:
        for jobs in (limit + 1, 10**12):
            assert main(["replay", str(GOLDEN), "--jobs", str(jobs)]) == 2
            err = capsys.readouterr().err
            assert f"--jobs {jobs} is not a number of processes" in err, err
            assert f"give --jobs within 1..{limit}" in err, err
        assert main(["replay", str(GOLDEN), "--jobs", str(limit)]) == 0
        assert "transitions verified" in capsys.readouterr().out
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_a_timeline_with_nowhere_to_go_is_refused_before_the_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--timeline ''` was skipped without a word; `--timeline FILE/x` failed after the whole
    replay with an OSError that did not name the flag."""
    from ehp_fsm.cli import main

    log = str(HERE / "borrow_and_return.jsonl")
    afile = tmp_path / "afile"
    afile.write_text("")
    for out in ("", " ", str(afile / "x"), str(tmp_path / "missing" / "x"), f"{tmp_path}/"):
        assert main(["replay", log, "--timeline", out]) == 2, out
        captured = capsys.readouterr()
        assert "--timeline" in captured.err and "names no file" in captured.err, captured.err
        assert "transitions verified" not in captured.out
    assert main(["replay", log, "--timeline", str(tmp_path / "tl")]) == 0
    assert (tmp_path / "tl.png").exists()


def test_another_plans_receipt_is_named_as_such_not_as_an_edited_log(tmp_path: Path) -> None:
    """`replay LOG --receipt` with the receipt of another plan's run said the log's chain
    "breaks ... it was cut short or lines were added. Fix: restore the original log"."""
    from ehp_fsm import Event, Orchestrator, load_plan
    from ehp_fsm.errors import ChainBroken, EhpError
    from ehp_fsm.replay import check_receipt

    log = tmp_path / "t.jsonl"
    plan = load_plan(Path(__file__).resolve().parents[2] / "examples" / "local.toml")
    engine = Orchestrator.from_plan(plan, log_path=log)
    launch = {"host": "h1", "gpus": ["h1:g0"], "tp": 1, "token": "t"}
    engine.handle(Event("rollout_engine", "e0", "launch", 1.0, launch))
    count, head = engine.chain_head
    engine.close()
    result = replay(log)
    check_receipt(result, {"plan": "local", "log_chain": {"count": count, "hash": head}})
    other = {"plan": "mine2", "log_chain": {"count": count + 9, "hash": "0" * 32}}
    with pytest.raises(EhpError, match="the receipt is of plan 'mine2', the log of plan 'local'"):
        check_receipt(result, other)
    with pytest.raises(ChainBroken):  # this plan's receipt of another length: an edited log
        check_receipt(result, {**other, "plan": "local"})


DEEP = "[" * 100_000 + "]" * 100_000  # valid JSON no JSON reader in Python can nest into


@pytest.mark.parametrize("jobs", [1, 2])
@pytest.mark.parametrize("where", ["record", "header", "checkpoint"])
def test_a_line_nested_too_deep_is_a_format_error_not_a_recursion_error(
    tmp_path: Path, where: str, jobs: int
) -> None:
    """A forged line (its chain rebuilt) whose payload nests 100,000 lists deep ended
    `ehp-fsm replay` in a RecursionError traceback out of msgspec's decoder (exit 1); now
    it is a format error naming the line."""
    from tests.core.logedit import rechain_raw

    log = tmp_path / "checkpointed.jsonl"
    borrow_and_return(log, checkpoint_every=2)
    edit = log.read_text().splitlines(keepends=True)
    if where == "header":
        n = 1
        edit[0] = edit[0].replace('"meta":{', f'"meta":{{"x":{DEEP},', 1)
    elif where == "record":
        n = next(i for i, x in enumerate(edit, start=1) if '"payload":{"' in x and i > 1)
        edit[n - 1] = edit[n - 1].replace('"payload":{', f'"payload":{{"x":{DEEP},', 1)
    else:
        n = next(i for i, x in enumerate(edit, start=1) if x.startswith('{"checkpoint":'))
        edit[n - 1] = edit[n - 1].replace('"globals":{', f'"globals":{{"x":{DEEP},', 1)
    log.write_text("".join(rechain_raw(edit)))  # a forger's chain: only the nesting is wrong
    with pytest.raises(LogFormatError, match="nested too deep") as info:
        replay(log, jobs=jobs)
    assert info.value.line == n


def test_a_receipt_nested_too_deep_is_refused_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`replay LOG --receipt R` where R nests 100,000 lists deep: a RecursionError traceback
    out of `json.loads` (only ValueError and OSError were caught)."""
    from ehp_fsm.cli import main

    receipt = tmp_path / "receipt.json"
    receipt.write_text(DEEP)
    assert main(["replay", str(GOLDEN), "--receipt", str(receipt)]) == 2
    err = capsys.readouterr().err
    assert "is not a readable JSON receipt" in err and "nested too deep" in err, err


def test_a_log_with_crlf_line_ends_is_named_as_converted_not_as_edited(tmp_path: Path) -> None:
    """A log whose line ends were turned into CR LF (a Windows editor, git's autocrlf, a
    text-mode transfer) was refused at line 1 as "inserted or edited. Fix: restore the line
    from the original log"; the operator could not tell that only the line ends changed."""
    log = tmp_path / "crlf.jsonl"
    log.write_bytes(GOLDEN.read_bytes().replace(b"\n", b"\r\n"))
    with pytest.raises(LogFormatError, match="CR LF") as info:
        replay(log)
    assert info.value.line == 1 and "dos2unix" in info.value.fix
    one = lines()
    one[6] = one[6].replace("\n", "\r\n")  # one line converted: named at that line
    with pytest.raises(LogFormatError, match="CR LF") as info:
        replay(tampered(tmp_path, one))
    assert info.value.line == 7


@pytest.mark.parametrize(
    ("magic", "named"),
    [(b"\x1f\x8b\x08\x00", "gzip"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"\xfd7zXZ\x00", "xz")],
)
def test_a_compressed_log_is_named_as_compressed(tmp_path: Path, magic: bytes, named: str) -> None:
    """`replay transitions.jsonl.gz` said "the first line is not a 'ehp-fsm.log' header.
    Fix: replay a file written by ehp-fsm" — of a file ehp-fsm wrote, compressed."""
    import gzip

    log = tmp_path / "t.jsonl.gz"
    log.write_bytes(gzip.compress(GOLDEN.read_bytes()) if named == "gzip" else magic + b"\0" * 64)
    with pytest.raises(LogFormatError, match=f"{named}-compressed") as info:
        replay(log)
    assert info.value.line == 1 and "decompress" in info.value.fix


def test_a_log_with_a_byte_order_mark_is_named_as_such(tmp_path: Path) -> None:
    log = tmp_path / "bom.jsonl"
    log.write_bytes(b"\xef\xbb\xbf" + GOLDEN.read_bytes())
    with pytest.raises(LogFormatError, match="byte-order mark") as info:
        replay(log)
    assert info.value.line == 1


def test_two_logs_joined_are_named_as_joined_at_the_second_header(tmp_path: Path) -> None:
    """`cat a.jsonl b.jsonl > both.jsonl`: the second header was named by the record keys it
    lacks ("keys ['seq', 'time', ...] are missing")."""
    both = tampered(tmp_path, lines() + lines())
    with pytest.raises(LogFormatError, match="another log's header") as info:
        replay(both)
    assert info.value.line == len(lines()) + 1
    assert "each log on its own" in info.value.fix


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_log_that_ends_inside_an_event_says_so_and_how_to_see_the_world_before_it(
    tmp_path: Path, jobs: int
) -> None:
    """A crashed writer's log that ends between two records of one event was told "the log
    was edited, truncated out of order, or written by a different spec. Fix: restore the
    original log" — of the only log there is. Now it says where the log ends and how to read
    the world before that event (`--at`), and that a resume sets the event aside."""
    recs = [json.loads(x) for x in lines()[1:]]
    cut = next(
        i
        for i in range(1, len(recs) - 1)
        if recs[i]["cause"] is not None and recs[i + 1]["cause"] is not None
    )
    root = max(r["seq"] for r in recs[: cut + 1] if r["cause"] is None)
    short = tampered(tmp_path, lines()[: cut + 2])
    with pytest.raises(ReplayDivergence) as info:
        replay(short, jobs=jobs)
    assert (info.value.line, info.value.field) == (cut + 2, "records in this event")
    assert "the log ends inside an event" in info.value.why
    assert f"--at {root - 1}" in info.value.fix and "--resume" in info.value.fix
    assert replay(short, until_seq=root - 1).last_seq == root - 1


def test_a_log_written_on_while_it_is_replayed_reports_the_chain_it_verified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ehp-fsm replay` of a live log (a run or Orchestrator still writing it) verified the
    lines there when it began, then counted the lines there when it ended: "hash chain intact
    over 5 lines" paired 5 with the 4th line's hash, a head no log ever had. Now the count and
    the hash are of the same, verified, line."""
    import ehp_fsm.replay as replay_module
    from ehp_fsm import Event, Orchestrator, load_plan

    log = tmp_path / "live.jsonl"
    plan = load_plan(Path(__file__).resolve().parents[2] / "examples" / "local.toml")
    writer = Orchestrator.from_plan(plan, log_path=log)
    writer.handle(Event("request", "g0", "enqueue", 1.0, {"prompt": "p"}))
    head = writer.chain_head
    run = replay_module._Segment.run

    def run_then_write_on(self: Any, lines: Any, until_seq: Any) -> None:
        run(self, lines, until_seq)
        writer.handle(Event("request", "g1", "enqueue", 2.0, {"prompt": "p"}))

    monkeypatch.setattr(replay_module._Segment, "run", run_then_write_on)
    result = replay(log)
    writer.close()
    assert result.chain == head and result.transitions == head[0] - 1
