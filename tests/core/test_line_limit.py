"""The line limit (`loglines`): replay and recovery refuse a line longer than it after reading
no more than the limit of it, naming the line, what was read, the limit and the variable that
raises it; the default admits the longest line a run writes (a checkpoint of the whole world)
at 8,192 hosts with a wide margin.

Before, a log's line was read, copied and decoded whole: one crafted line of 300 MB took
~1.2 GB of memory (peak RSS) before replay named it, and `recover_log` (`ehp-fsm run --resume`)
read the whole log into memory twice over. The tests use a small limit (a line of a few MiB);
what a 300 MB line costs is measured in the report, not here."""

from __future__ import annotations

import json
import re
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from ehp_fsm.errors import EhpError, LogFormatError
from ehp_fsm.loglines import LINE_LIMIT, LINE_LIMIT_ENV, lines_backward
from ehp_fsm.plan import load_plan
from ehp_fsm.replay import replay
from ehp_fsm.runtime.recovery import recover_log
from ehp_fsm.sim.cluster import scale
from ehp_fsm.sim.story import Simulation
from ehp_fsm.translog import CHECKPOINT_EVENT, world_state
from tests.core.logedit import rechain_raw
from tests.golden.scenarios import HERE

GOLDEN = HERE / "borrow_and_return.jsonl"
GPU_PLAN = HERE.parents[1] / "examples" / "gpu-4x8.toml"
LIMIT = 256 << 10  # 256 KiB
LONG = 8 << 20  # a line of 8 MiB: 32 times the limit


def _with_long_line(tmp_path: Path, size: int = LONG) -> tuple[Path, int]:
    """The golden log with a root record whose payload holds `size` bytes after its fifth
    line, the chain rebuilt over it (a forger's line: valid JSON, a valid link); and the
    long line's number."""
    lines = GOLDEN.read_text().splitlines(keepends=True)
    rec = json.loads(lines[5])
    rec["payload"] = {"pad": "x" * size}
    lines.insert(6, json.dumps(rec) + "\n")
    log = tmp_path / "long.jsonl"
    log.write_text("".join(rechain_raw(lines)))
    return log, 7


def _refused(what: pytest.ExceptionInfo[EhpError], line: int) -> None:
    err = what.value
    assert isinstance(err, LogFormatError)
    assert err.line == line
    text = str(err)
    assert f"line {line} is longer than the line limit ({LIMIT:,} bytes)" in text
    assert f"{LIMIT:,} bytes of it were read" in text
    # what to do: the default reads the line (8 MiB), or a limit of at least its length
    assert re.search(r"\(the default, 256 MiB, reads this line of 8,3\d\d,\d\d\d bytes", text)
    if f"unset {LINE_LIMIT_ENV}" in text:  # the variable lowered the limit
        assert re.search(rf"{LINE_LIMIT_ENV}=819\dKiB ehp-fsm replay LOG", text), text
    else:
        assert "leave line_limit= out" in text and "give it at least 83" in text, text


def _peak_refusal(call: Callable[[], object]) -> tuple[pytest.ExceptionInfo[EhpError], int]:
    """`call()`'s refusal (`EhpError`) and the most memory it allocated (traced) before it."""
    tracemalloc.start()
    try:
        with pytest.raises(EhpError) as what:
            call()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return what, peak


def test_a_line_over_the_limit_is_refused_before_it_is_read_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refusal names the line, how much of it was read, the limit and the variable; and
    replay allocated less than the limit and a chunk (`loglines.CHUNK`, 1 MiB) before it:
    the line (8 MiB) was never held. Before, the line was read (mapped and copied, 8 MiB) and
    decoded, and replay named its payload's divergence."""
    log, n = _with_long_line(tmp_path)
    monkeypatch.setenv(LINE_LIMIT_ENV, "256KiB")
    what, peak = _peak_refusal(lambda: replay(log, jobs=2, forget_finished=True))  # as the CLI
    assert peak < LIMIT + (1 << 20), f"replay allocated {peak:,} bytes before it stopped"
    _refused(what, n)


def test_the_limit_is_a_replay_argument_too(tmp_path: Path) -> None:
    log, n = _with_long_line(tmp_path)
    with pytest.raises(EhpError) as what:
        replay(log, line_limit=LIMIT)
    _refused(what, n)
    assert replay(GOLDEN, line_limit=LIMIT).transitions > 0  # every golden line is short


def test_a_line_at_the_limit_is_read(tmp_path: Path) -> None:
    """The limit counts a line's bytes with its newline: a line of exactly the limit passes
    the check (and replays to what it holds), one byte more is refused."""
    log, n = _with_long_line(tmp_path, 1000)
    size = len(log.read_bytes().splitlines(keepends=True)[n - 1])
    with pytest.raises(EhpError) as what:
        replay(log, line_limit=size)
    assert "longer than the line limit" not in str(what.value)  # the payload's divergence
    with pytest.raises(LogFormatError, match=f"line {n} is longer than the line limit"):
        replay(log, line_limit=size - 1)


def test_a_header_over_the_limit_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The header is refused before it is read too: replay allocated less than a chunk (before,
    it was read whole: `readline()`; then read up to the limit before it was refused — a
    300 MB first line took 564 MB of peak RSS under the default limit)."""
    lines = GOLDEN.read_text().splitlines(keepends=True)
    head = json.loads(lines[0])
    head["meta"]["pad"] = "x" * LONG
    log = tmp_path / "header.jsonl"
    log.write_text("".join(rechain_raw([json.dumps(head) + "\n", *lines[1:]])))
    monkeypatch.setenv(LINE_LIMIT_ENV, str(4 * LIMIT))
    _, peak = _peak_refusal(lambda: replay(log))
    assert peak < 2 * LIMIT + (1 << 20), f"replay allocated {peak:,} bytes before it stopped"
    monkeypatch.setenv(LINE_LIMIT_ENV, str(LIMIT))
    with pytest.raises(EhpError) as what:
        replay(log)
    _refused(what, 1)


def test_recovery_refuses_a_line_over_the_limit_and_leaves_the_log_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`recover_log` (a controller's recovery, `ehp-fsm run --resume`) checks every line
    before it cuts or reads anything whole: a long last line without its newline is not a
    torn tail (ehp-fsm writes no such line), and the file is left as it was. Before, the whole
    log was read into memory and the long tail cut off as torn."""
    whole = GOLDEN.read_bytes()
    log = tmp_path / "t.jsonl"
    log.write_bytes(whole + b'{"seq": 99999, "pad": "' + b"x" * LONG)
    monkeypatch.setenv(LINE_LIMIT_ENV, str(LIMIT))
    what, peak = _peak_refusal(lambda: recover_log(log))
    _refused(what, whole.count(b"\n") + 1)
    assert peak < LIMIT + (1 << 20), f"recovery allocated {peak:,} bytes before the refusal"
    assert log.read_bytes() == whole + b'{"seq": 99999, "pad": "' + b"x" * LONG


def test_a_bad_limit_in_the_environment_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(LINE_LIMIT_ENV, "lots")
    with pytest.raises(EhpError, match=f"{LINE_LIMIT_ENV}='lots' is not a line limit"):
        replay(GOLDEN)


def test_lines_backward_gives_every_line_from_the_end(tmp_path: Path) -> None:
    """Across chunk boundaries, with and without a last newline, and an empty first line."""
    import ehp_fsm.loglines as loglines

    for data in (b"a\nbb\n\nccc\n", b"\nx\nyy", b"one", b"", b"x" * 10 + b"\n" + b"y" * 7 + b"\n"):
        path = tmp_path / "f"
        path.write_bytes(data)
        want = _offsets(data)[::-1]
        for chunk in (1, 2, 3, 4, 1 << 20):
            with pytest.MonkeyPatch.context() as mp, path.open("rb") as fh:
                mp.setattr(loglines, "CHUNK", chunk)
                assert list(lines_backward(fh, len(data))) == want, (data, chunk)


def _offsets(data: bytes) -> list[tuple[int, bytes]]:
    out, at = [], 0
    for line in data.splitlines(keepends=True):
        out.append((at, line))
        at += len(line)
    return out


def test_the_default_limit_admits_a_checkpoint_of_8192_hosts_with_a_wide_margin(
    tmp_path: Path,
) -> None:
    """The longest line ehp-fsm writes is a checkpoint: the whole world. A run's world keeps
    every instance (the simulation forgets consumed groups; replay keeping every instance
    holds what a run's does): gpu-4x8 at 32 hosts after 2 steps, per host, times 8,192 hosts,
    must fit the default limit 4 times over (measured: 7,548 bytes per host at 1,024 hosts
    and 2 steps, 61.8 MB at 8,192; the limit is 256 MiB)."""
    log = tmp_path / "sim.jsonl"
    plan = scale(load_plan(GPU_PLAN), 32)
    Simulation(plan, log_path=log, steps=2, seed=0, faults="off", ehp=True).run()
    world = replay(log).world  # every instance kept
    cp = {"checkpoint": 0, **world_state(world), "event": CHECKPOINT_EVENT}
    per_host = len(msgspec.json.encode(cp)) / 32
    assert per_host * 8192 * 4 <= LINE_LIMIT, per_host


@pytest.mark.parametrize(
    ("value", "limit"),
    [
        ("1" + "0" * 30, None),  # 10**30: readline's size overflowed (a bare OverflowError)
        ("9" * 5000, None),  # int() of 5,000 digits: a bare ValueError
        (" 5 MiB ", 5 << 20),
        ("00400", 400),
        ("５", "refused"),  # a full-width digit read as 5
        ("१२३", "refused"),  # Devanagari digits read as 123
        ("0", "refused"),
        ("-5", "refused"),
        ("1e9", "refused"),
    ],
)
def test_a_limit_of_any_size_or_script_is_a_number_of_bytes_or_named(
    monkeypatch: pytest.MonkeyPatch, value: str, limit: int | str | None
) -> None:
    """A limit past the largest size a read takes is no limit (every line passes); a value
    that is no ASCII number of bytes is named. Before, 10**30 and 5,000 digits ended replay
    in a traceback, and non-ASCII digits were taken as numbers."""
    import sys

    from ehp_fsm.loglines import line_limit

    monkeypatch.setenv(LINE_LIMIT_ENV, value)
    if limit == "refused":
        with pytest.raises(EhpError, match="is not a line limit"):
            line_limit()
        return
    if limit is None:
        assert replay(GOLDEN).transitions > 0
        assert replay(GOLDEN, line_limit=10**30).transitions > 0
    assert line_limit() == (sys.maxsize if limit is None else limit)


def test_a_limit_lowered_by_the_variable_says_to_unset_it_not_to_double_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`EHP_LOG_LINE_LIMIT=100 ehp-fsm replay LOG` said to use 200; at 200, 400, and so on,
    for a header of ~1 kB. Now: unset it (the default reads the line), or at least the
    line's length."""
    from ehp_fsm.cli import main

    header = len(GOLDEN.read_bytes().split(b"\n", 1)[0]) + 1
    for lowered in ("100", "200"):
        monkeypatch.setenv(LINE_LIMIT_ENV, lowered)
        assert main(["replay", str(GOLDEN)]) == 2
        err = capsys.readouterr().err
        assert f"Fix: unset {LINE_LIMIT_ENV} (the default, 256 MiB, reads this line of " in err
        assert f"line of {header:,} bytes), or set it to at least the line's length: " in err
        assert f"{LINE_LIMIT_ENV}=1KiB ehp-fsm replay LOG" in err, err
        assert f"={2 * int(lowered)} " not in err, err
    monkeypatch.setenv(LINE_LIMIT_ENV, "1KiB")  # what it said reads the header (and the rest)
    assert replay(GOLDEN).transitions > 0


def test_a_line_past_the_default_too_is_told_a_limit_past_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a lowered limit a line longer than the default too (here the default is made
    4 MiB, the line 8 MiB) is told to raise the limit past the default, not to unset it."""
    import ehp_fsm.loglines

    monkeypatch.setattr(ehp_fsm.loglines, "LINE_LIMIT", 4 << 20)
    log, n = _with_long_line(tmp_path)
    monkeypatch.setenv(LINE_LIMIT_ENV, "256KiB")
    with pytest.raises(LogFormatError, match=f"line {n} is longer") as what:
        replay(log)
    assert "unset" not in str(what.value) and f"{LINE_LIMIT_ENV}=8MiB " in str(what.value)


def test_a_lowered_limit_under_the_header_says_it_was_lowered(tmp_path: Path) -> None:
    """A limit set below the header's length blamed the log alone ("this line was not
    written by ehp-fsm")."""
    with pytest.raises(LogFormatError, match="line 1 is longer") as what:
        replay(GOLDEN, line_limit=100)
    assert "the limit, lowered below its default (256 MiB)" in str(what.value)
