"""Replay verifies golden logs, rebuilds the world, and pinpoints the line of a tampered log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ehp_fsm.errors import LogFormatError, ReplayDivergence
from ehp_fsm.replay import replay
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
    """A behaviour change of the specs shows up here first (regenerate deliberately)."""
    fresh = tmp_path / "fresh.jsonl"
    borrow_and_return(fresh)
    assert fresh.read_text() == GOLDEN.read_text()


def test_replay_of_a_run_rebuilds_the_run(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    live = borrow_and_return(log)
    assert replay(log).world.snapshot() == live.world.snapshot()


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


def test_edited_payload_diverges_where_its_consequence_shows(tmp_path: Path) -> None:
    # Changing the recorded pid of the stop confirmation makes the engine refuse it on replay.
    n = line_where(lambda r: r["event"] == "exited" and r["accepted"] and r["instance"] == "e1")
    edit = lines()
    edit[n - 1] = edit[n - 1].replace('"pid":100', '"pid":101')
    with pytest.raises(ReplayDivergence) as info:
        replay(tampered(tmp_path, edit))
    assert info.value.line == n


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
