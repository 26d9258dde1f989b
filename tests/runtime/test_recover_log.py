"""`recover_log` cuts a crash's torn tail off a log it can recover, and leaves a log it cannot
recover exactly as it was."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ehp_fsm.runtime.recovery import RecoveryError, recover_log
from tests.golden.scenarios import HERE

GOLDEN = HERE / "borrow_and_return.jsonl"


def test_a_torn_last_line_is_cut_and_the_log_replays(tmp_path: Path) -> None:
    log = tmp_path / "t.jsonl"
    whole = GOLDEN.read_bytes()
    log.write_bytes(whole + b'{"seq": 99999, "ev')
    _, report = recover_log(log)
    assert log.read_bytes() == whole
    assert report.truncated_bytes == len(b'{"seq": 99999, "ev')
    assert "torn" in report.describe()
    # what was cut is kept beside the log, not lost (it was cut and kept nowhere, while
    # replay's advice said a resume "sets a torn tail aside": an operator's find)
    kept = tmp_path / f"t.jsonl.cut-{len(whole)}"
    assert report.kept == kept and kept.read_bytes() == b'{"seq": 99999, "ev'
    assert kept.stat().st_mode & 0o777 == 0o600
    assert f"the cut bytes are kept in {kept}" in report.describe()


def test_a_second_tear_at_the_same_place_keeps_its_own_bytes(tmp_path: Path) -> None:
    """A crash loop (a disk still full) tears the log at the same offset again: the second
    cut's bytes were not kept ("File exists")."""
    log = tmp_path / "t.jsonl"
    whole = GOLDEN.read_bytes()
    for tail in (b'{"seq": 1', b'{"seq": 22'):
        log.write_bytes(whole + tail)
        _, report = recover_log(log)
        assert report.kept is not None and report.kept.read_bytes() == tail
    assert sorted(p.name for p in tmp_path.glob("t.jsonl.cut-*")) == [
        f"t.jsonl.cut-{len(whole)}",
        f"t.jsonl.cut-{len(whole)}.2",
    ]


def test_cut_bytes_that_cannot_be_kept_are_said_and_the_recovery_stands(tmp_path: Path) -> None:
    log = tmp_path / "t.jsonl"
    whole = GOLDEN.read_bytes()
    log.write_bytes(whole + b'{"seq": 99999, "ev')
    # a file-size limit of 8 bytes: the cut bytes' file cannot be written (a full disk's
    # like), in a process of its own (Python ignores SIGXFSZ: the write raises EFBIG)
    script = (
        "import resource, sys\n"
        "from ehp_fsm.runtime.recovery import recover_log\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (8, resource.RLIM_INFINITY))\n"
        "_, report = recover_log(sys.argv[1])\n"
        "print(report.kept, report.describe())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(log)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert log.read_bytes() == whole and done.stdout.startswith("None "), done.stdout
    assert "the cut bytes could not be kept (File too large" in done.stdout, done.stdout
    assert list(tmp_path.glob("t.jsonl.cut-*")) == []  # no part of them left behind


def test_a_log_that_diverges_early_is_refused_and_left_untouched(tmp_path: Path) -> None:
    """Before, the torn tail was cut before the replay found the early divergence: the refused
    log had lost its last bytes."""
    lines = GOLDEN.read_text().splitlines(keepends=True)
    n = next(i for i, raw in enumerate(lines) if i > 0 and json.loads(raw)["event"] == "activate")
    lines[n] = lines[n].replace('"dest":"active"', '"dest":"ready"')
    log = tmp_path / "t.jsonl"
    damaged = "".join(lines).encode() + b'{"seq": 99999, "ev'
    log.write_bytes(damaged)
    with pytest.raises(RecoveryError, match="diverges before its last event"):
        recover_log(log)
    assert log.read_bytes() == damaged


def test_a_last_line_nested_too_deep_is_refused_not_a_recursion_error(tmp_path: Path) -> None:
    """A last line nesting 100,000 lists (no JSON reader in Python reads it) ended
    `recover_log` — a controller's recovery, `ehp-fsm run --resume` — in a RecursionError
    traceback out of `json.loads` (only ValueError was caught). It ends with its newline, so
    no crash left it: refused as an edited last line, the log left as it was."""
    log = tmp_path / "t.jsonl"
    deep = GOLDEN.read_bytes() + b"[" * 100_000 + b"]" * 100_000 + b"\n"
    log.write_bytes(deep)
    with pytest.raises(RecoveryError, match="its last event does not verify"):
        recover_log(log)
    assert log.read_bytes() == deep


@pytest.mark.parametrize("damage", ["garbage", "flipped", "commented"])
def test_a_whole_last_line_that_is_not_json_is_refused_not_cut(tmp_path: Path, damage: str) -> None:
    """The writer writes an event's lines, newlines and all, at once: a crash leaves a torn
    last line (no newline) or an event cut short, never a whole line that is not JSON. Such a
    line — the last record replaced, a byte near its end flipped, its first byte made `#` —
    was cut as "a last line that is not JSON", with the rest of the event it ended (a launch
    the controller may have carried out), and the log recovered. Now it is refused as an
    edited last event, the file left as it was (an auditor's find)."""
    lines = GOLDEN.read_bytes().splitlines(keepends=True)
    last = lines[-1]
    lines[-1] = {
        "garbage": b"garbage\n",
        "flipped": last[:-4] + bytes([last[-4] ^ 0x7F]) + last[-3:],
        "commented": b"#" + last[1:],
    }[damage]
    log = tmp_path / "t.jsonl"
    log.write_bytes(b"".join(lines))
    with pytest.raises(RecoveryError, match="its last event does not verify") as err:
        recover_log(log)
    assert f"line {len(lines)}" in str(err.value), err.value
    assert log.read_bytes() == b"".join(lines)


@pytest.mark.parametrize("where", ["head_of_last_line", "across_the_last_newline"])
def test_a_last_line_holding_nul_bytes_is_cut_as_a_crash_leaves_it(
    tmp_path: Path, where: str
) -> None:
    """The log is flushed, not fsynced: after a power loss a page before the end can read as
    zeros while the page after it, ending in a newline, reached the disk. Such a last line is
    crash damage, cut as before (a reviewer's find: refusing every whole non-JSON last line
    refused these too)."""
    whole = GOLDEN.read_bytes()
    lines = whole.splitlines(keepends=True)
    start = len(whole) - len(lines[-1])  # where the last line begins
    data = bytearray(whole)
    if where == "head_of_last_line":
        data[start : start + 64] = bytes(64)
    else:  # the newline between the last two lines, and bytes either side of it
        data[start - 32 : start + 32] = bytes(64)
    log = tmp_path / "t.jsonl"
    log.write_bytes(bytes(data))
    result, report = recover_log(log)
    assert "NUL bytes" in report.describe(), report.describe()
    assert whole.startswith(log.read_bytes()) and log.read_bytes().endswith(b"\n")
    assert result.last_seq < json.loads(lines[-1])["seq"]


def test_a_last_line_without_its_newline_but_whole_is_kept(tmp_path: Path) -> None:
    """`ehp-fsm replay` verifies a log whose last line lost its newline (the chain covers a
    line's bytes before it), while a recovery cut that line as torn — with the event it ended
    (an auditor's find: the two disagreed on the same file). A whole record is kept now, its
    newline put back, and the log replays to the same end; a torn one is still cut."""
    whole = GOLDEN.read_bytes()
    log = tmp_path / "t.jsonl"
    log.write_bytes(whole.rstrip(b"\n"))
    result, report = recover_log(log)
    assert log.read_bytes() == whole
    assert report.truncated_bytes == 0 and report.dropped_records == 0
    assert "the newline put back" in report.describe(), report.describe()
    assert result.last_seq == json.loads(whole.splitlines()[-1])["seq"]
    torn = whole.rstrip(b"\n")[:-3]  # `"}` and a byte of the chain gone: torn, cut
    log.write_bytes(torn)
    _, report = recover_log(log)
    assert "torn" in report.describe() and log.read_bytes() != torn


def test_an_incomplete_last_event_is_cut_from_its_root_record(tmp_path: Path) -> None:
    """The log of a controller killed while it wrote an event's lines (its root record and
    one of its cascaded records, not the last): the event's lines are cut, found from the end
    of the log (`loglines.lines_backward`), and the log before it is kept byte for byte."""
    lines = GOLDEN.read_bytes().splitlines(keepends=True)
    roots = [i for i, x in enumerate(lines) if i and json.loads(x)["cause"] is None]
    ends = [*roots[1:], len(lines)]  # each event's lines: from its root to the next root
    root = max(r for r, end in zip(roots, ends, strict=True) if end - r > 2)
    log = tmp_path / "t.jsonl"
    log.write_bytes(b"".join(lines[: root + 2]))
    _, report = recover_log(log)
    assert log.read_bytes() == b"".join(lines[:root])
    assert report.dropped_records == 2
    assert f"2 record(s) from line {root + 1}" in report.describe()


def test_a_log_appended_to_goes_on_with_its_chain_holding_no_more_than_a_chunk(
    tmp_path: Path,
) -> None:
    """A log reopened to append (a controller recovering, `Orchestrator.resume`) finds its line
    count and last link by reading its first line and its end: it read the whole file into
    memory (twice its size for a moment), a run's log of gigabytes at a cluster's scale. The
    lines between are filler here: only the count, the header and the last line are read."""
    import tracemalloc

    from ehp_fsm.translog import TransitionLog, open_to_append

    lines = GOLDEN.read_bytes().splitlines(keepends=True)
    filler = b'{"x": "' + b"y" * 1000 + b'"}\n'
    log = tmp_path / "t.jsonl"
    with log.open("wb") as fh:
        fh.write(lines[0])
        for _ in range(20_000):  # ~20 MB
            fh.write(filler)
        fh.writelines(lines[1:])
    want = (1 + 20_000 + len(lines) - 1, json.loads(lines[-1])["chain"])
    stream = open_to_append(log)
    tracemalloc.start()
    try:
        t = TransitionLog(stream, first_seq=999)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        stream.close()
    assert t.chain_head == want
    assert peak < 4 << 20, f"reopening the log to append held {peak:,} bytes"


def test_a_controller_does_not_recover_a_log_another_writer_holds(tmp_path: Path) -> None:
    """`Controller.recover` repaired the log's tail and appended to it without its lock: a log
    another orchestrator (or run) was writing lost the line being written (cut as "torn"), and
    both wrote on. Now it is refused as `Orchestrator.resume` refuses it, the file as it was;
    so is a log that does not exist (it is not created)."""
    from ehp_fsm.embedded import Orchestrator
    from ehp_fsm.errors import EhpError
    from ehp_fsm.plan import load_plan
    from ehp_fsm.runtime.controller import Controller

    plan = load_plan(Path(__file__).parents[2] / "examples" / "local.toml")
    log = tmp_path / "t.jsonl"
    holder = Orchestrator.from_plan(plan, log_path=log)
    try:
        with log.open("ab") as fh:
            fh.write(b'{"seq": 99999, "ev')  # the holder's line, being written
        before = log.read_bytes()
        with pytest.raises(EhpError, match="held by another writer"):
            Controller.recover(plan, log)
        assert log.read_bytes() == before
    finally:
        holder.close()
    missing = tmp_path / "none.jsonl"
    with pytest.raises(RecoveryError, match="does not exist"):
        Controller.recover(plan, missing)
    assert not missing.exists()


@pytest.mark.parametrize("forged", ["edited", "rechained"])
def test_a_whole_last_event_that_does_not_verify_is_refused_not_cut(
    tmp_path: Path, forged: str
) -> None:
    """A crash cuts an event's lines short (a torn line, records missing at the end); it does
    not change a whole line. Before, any divergence inside the last event was taken for a
    crash's: an edited last record (its chain broken), or one rewritten with the chain rebuilt
    (an unkeyed chain anyone can rebuild), was cut off with its event and the log recovered
    without a word (`Orchestrator.resume` went on as if the event never happened). Now it is
    refused and the file left as it was."""
    from tests.core.logedit import rechain

    lines = GOLDEN.read_text().splitlines(keepends=True)
    last = json.loads(lines[-1])
    assert last.get("cause") is None and "reason" in last, "the golden log ends in a root record"
    if forged == "edited":
        lines[-1] = lines[-1].replace('"time":', '"time": ', 1)
    else:
        last["reason"] = "forged"
        lines[-1] = json.dumps(last) + "\n"
        lines = rechain(lines)
    log = tmp_path / "t.jsonl"
    damaged = "".join(lines).encode()
    log.write_bytes(damaged)
    with pytest.raises(RecoveryError, match="its last event does not verify") as err:
        recover_log(log)
    assert "the log was edited" in str(err.value)
    assert log.read_bytes() == damaged


def test_a_header_the_replay_refuses_is_refused_with_the_replays_own_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A keyed log recovered without its key (and an unkeyed one with a key): the replay says
    what to do (set or unset EHP_LOG_KEY), and the refusal's fix said "the log was edited or
    written by other specs; restore it or start fresh" — to start afresh a run that only
    lacked its key."""
    from ehp_fsm.embedded import Orchestrator
    from ehp_fsm.plan import load_plan

    plan = load_plan(Path(__file__).parents[2] / "examples" / "local.toml")
    log = tmp_path / "t.jsonl"
    monkeypatch.setenv("EHP_LOG_KEY", "the key")
    Orchestrator.from_plan(plan, log_path=log).close()
    monkeypatch.delenv("EHP_LOG_KEY")
    before = log.read_bytes()
    with pytest.raises(RecoveryError, match="keyed and no key was given") as err:
        recover_log(log)
    assert err.value.fix == "set EHP_LOG_KEY (or pass `key`) to the key the log was written with"
    assert log.read_bytes() == before
