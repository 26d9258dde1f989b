"""The GPU-role timeline read from the golden borrow-and-return log."""

from __future__ import annotations

import itertools
from pathlib import Path

from ehp_fsm.report.timeline import role_intervals
from tests.golden.scenarios import HERE


def test_borrowed_gpu_goes_engine_releasing_free_hybrid_and_back() -> None:
    spans = [i for i in role_intervals(HERE / "borrow_and_return.jsonl") if i.gpu == "h1:g1"]
    roles = [i.role for i in spans]
    assert roles == ["free", "engine", "releasing", "free", "hybrid", "releasing", "free", "engine"]
    assert [i.owner for i in spans if i.role == "hybrid"] == ["hybrid:x0"]
    for a, b in itertools.pairwise(spans):
        assert a.end == b.start  # contiguous: the GPU always has exactly one role


def test_core_gpus_stay_core() -> None:
    spans = [i for i in role_intervals(HERE / "borrow_and_return.jsonl") if i.gpu.startswith("h0")]
    assert {i.role for i in spans} == {"core"}


def test_an_empty_log_has_no_roles_and_still_draws(tmp_path: Path) -> None:
    """A run stopped before its log's header (an error at start-up) still ends with its
    receipt: the timeline of an empty log is empty axes, not an IndexError in `finish`."""
    from ehp_fsm.report.timeline import draw_timeline

    log = tmp_path / "transitions.jsonl"
    log.write_text("")
    assert role_intervals(log) == []
    paths = draw_timeline([], tmp_path / "timeline", title="empty")
    assert all(p.stat().st_size > 0 for p in paths)


def test_a_timeline_asked_into_a_folder_is_drawn_inside_it(tmp_path: Path) -> None:
    """`--timeline DIR` with DIR a folder wrote DIR.png and DIR.svg beside it."""
    from ehp_fsm.report.timeline import draw_timeline

    (tmp_path / "out").mkdir()
    paths = draw_timeline([], tmp_path / "out")
    assert paths == [tmp_path / "out" / "timeline.png", tmp_path / "out" / "timeline.svg"]
    assert all(p.stat().st_size > 0 for p in paths)


def test_a_plan_named_in_any_script_draws_without_warnings(tmp_path: Path) -> None:
    """A CJK plan name or GPU id printed a dozen matplotlib 'Glyph ... missing from font'
    warnings on every run and simulation (errors here: the suite turns warnings into errors);
    the characters the bundled font lacks are drawn as boxes, silently."""
    from ehp_fsm.report.timeline import Interval, draw_timeline
    from ehp_fsm.sim.output import ROLES, draw_roles

    spans = [Interval("主机-0:g0", "core", "core", 0.0, 5.0)]
    paths = draw_timeline(spans, tmp_path / "timeline", title="运行-实验 (ehp-fsm run)")
    assert all(p.stat().st_size > 0 for p in paths)
    png = draw_roles([(0.0, (1,) * len(ROLES))], 60.0, tmp_path / "roles.png", "运行-实验")
    assert png.stat().st_size > 0


def test_replay_at_draws_the_timeline_of_what_it_verified_reading_no_line_after_it(
    tmp_path: Path,
) -> None:
    """`ehp-fsm replay LOG --at N --timeline OUT` verifies the log to N, and the timeline
    read the whole file, verified or not: a line after N that is no record (here: no `time`)
    ended the command in a KeyError traceback after its verdict. The timeline stops where the
    replay stopped; the whole log's timeline is the same as before."""
    from ehp_fsm.cli import main

    golden = HERE / "borrow_and_return.jsonl"
    log = tmp_path / "t.jsonl"
    log.write_bytes(golden.read_bytes() + b'{"seq": 999999}\n')
    assert main(["replay", str(log), "--at", "5", "--timeline", str(tmp_path / "tl")]) == 0
    assert (tmp_path / "tl.png").is_file()
    whole = role_intervals(golden)
    assert role_intervals(golden, until_seq=10**9) == whole
    early = role_intervals(log, until_seq=5)
    assert max(i.end for i in early) < max(i.end for i in whole)
