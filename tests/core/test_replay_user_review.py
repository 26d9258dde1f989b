"""`ehp-fsm replay` as an operator audits a run after an incident (h-replay, 2026-12-05): the
receipt of another run or an edited one, a receipt that is no receipt, `--help`, and the bad
day's logs (cut, edited, a FIFO, ...): each a clear verdict, exit 2, no traceback. Every check
runs the real command in a process of its own on real files."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from ehp_fsm import Event, Orchestrator, load_plan
from ehp_fsm.replay import replay

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "borrow_and_return.jsonl"


def ehp(*args: str, limit_as: int | None = None) -> subprocess.CompletedProcess[str]:
    """`ehp-fsm ARGS` (as `python -m ehp_fsm.cli`); `limit_as`: its address space, in bytes."""

    def limit() -> None:
        if limit_as is not None:
            resource.setrlimit(resource.RLIMIT_AS, (limit_as, limit_as))

    return subprocess.run(
        [sys.executable, "-m", "ehp_fsm.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
        preexec_fn=limit,
    )


def receipt_of(log: Path, **more: object) -> dict[str, object]:
    head = replay(log).chain
    assert head is not None
    return {**more, "log_chain": {"count": head[0], "hash": head[1]}}


def simulated(path: Path, seed: int) -> Path:
    """A log whose header records a simulation's seed and faults (as `simulate` writes it)
    and the same events whatever the seed; its receipt beside it, as `simulate` writes one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    plan = load_plan(ROOT / "examples" / "short.toml")
    meta = {"source": "simulate", "seed": seed, "faults": "off"}
    orch = Orchestrator.from_plan(plan, log_path=path, log_meta=meta)
    orch.handle(Event("rollout_engine", "e0", "drain", time=1.0))
    orch.close()
    receipt = receipt_of(path, plan=plan.name, simulated=True, seed=seed, faults="off")
    (path.parent / "receipt.json").write_text(json.dumps(receipt))
    return path


def test_a_receipt_of_another_seed_is_named_as_another_runs_not_as_an_edited_log(
    tmp_path: Path,
) -> None:
    """Two simulations of one plan: the second's receipt given with the first's log said "the
    log's hash chain breaks ... the last line's chain is not the one the receipt records: the
    log was rewritten and its chain rebuilt. Fix: restore the original log" — an operator
    would throw away a sound log."""
    one = simulated(tmp_path / "sim1" / "transitions.jsonl", 1)
    simulated(tmp_path / "sim2" / "transitions.jsonl", 2)
    ok = ehp("replay", str(one), "--receipt", str(tmp_path / "sim1" / "receipt.json"))
    assert ok.returncode == 0 and "matches the receipt" in ok.stdout, ok.stderr
    other = tmp_path / "sim2" / "receipt.json"
    out = ehp("replay", str(one), "--receipt", str(other))
    assert out.returncode == 2, out.stdout
    assert out.stderr == (
        "ehp-fsm: error: the receipt is another run's: its seed is 2, the log's 1: "
        "because a run writes its receipt.json beside its own log. Fix: give --receipt the "
        "receipt.json in the log's folder\n"
    )


def test_a_receipt_that_does_not_match_says_it_may_be_another_runs_or_edited(
    tmp_path: Path,
) -> None:
    """A receipt of the same plan without a seed (a real run's), one line more or another
    hash: it blamed the log alone ("cut short or lines were added", "rewritten"), and said to
    restore it."""
    base = receipt_of(GOLDEN, plan="local")  # the golden log's plan
    chain = base["log_chain"]
    assert isinstance(chain, dict)
    for name, edited in (
        ("count", {**chain, "count": chain["count"] + 1}),
        ("hash", {**chain, "hash": "0" * 32}),
    ):
        receipt = tmp_path / f"{name}.json"
        receipt.write_text(json.dumps({**base, "log_chain": edited}))
        out = ehp("replay", str(GOLDEN), "--receipt", str(receipt))
        assert out.returncode == 2, out.stdout
        err = out.stderr
        first = {  # (a count it read as "recorded '150 lines (the receipt)', the lines hash
            # to '149 lines'")
            "count": "ehp-fsm: error: the log has 149 lines and its receipt records 150: ",
            "hash": "ehp-fsm: error: the log's hash chain breaks at line ",
        }[name]
        assert err.startswith(first), err
        assert (
            "; or the receipt is not this log's (another run's of the same plan, or edited)" in err
        )
        assert err.endswith(
            "Fix: check that the receipt is the receipt.json the run wrote beside this log; if it "
            "is, restore the original log: this one cannot be trusted\n"
        ), err


@pytest.mark.parametrize("bad", [5, None, ["x"]])
def test_a_receipt_whose_hash_is_no_hash_is_refused_before_the_replay(
    tmp_path: Path, bad: object
) -> None:
    """`log_chain: {"count": N, "hash": 5}` was taken for a receipt; after the whole replay it
    said the log "was rewritten and its chain rebuilt"."""
    receipt = tmp_path / "receipt.json"
    good = receipt_of(GOLDEN)
    chain = good["log_chain"]
    assert isinstance(chain, dict)
    receipt.write_text(json.dumps({"log_chain": {**chain, "hash": bad}}))
    out = ehp("replay", str(GOLDEN), "--receipt", str(receipt))
    assert out.returncode == 2 and out.stdout == "", out.stdout  # nothing replayed
    assert out.stderr == (
        f"ehp-fsm: error: --receipt {receipt} is not a run's receipt: because it has no "
        '`log_chain: {"count": N, "hash": "..."}`. Fix: give --receipt the receipt.json the '
        "run wrote beside this log\n"
    )


def test_a_receipt_far_larger_than_any_run_writes_is_refused_unread(tmp_path: Path) -> None:
    """A 1 GiB file given as the receipt was read whole (2.1 GB of memory, 8.6 s) before it was
    refused as not JSON. The command runs here within 1 GiB of address space: reading it whole
    fails there (MemoryError)."""
    receipt = tmp_path / "receipt.json"
    with receipt.open("wb") as fh:
        fh.truncate(1 << 30)  # sparse: no disk used
    out = ehp("replay", str(GOLDEN), "--receipt", str(receipt), limit_as=1 << 30)
    assert out.returncode == 2 and out.stdout == "", out.stdout
    assert out.stderr == (
        f"ehp-fsm: error: --receipt {receipt} is not a run's receipt: because it holds more "
        "than 16 MiB, far more than a run or a simulation writes (a 100-step run's: ~32 kB). "
        "Fix: give --receipt the receipt.json the run wrote beside this log\n"
    )


def test_replay_help_says_what_the_log_is_and_the_exit_status() -> None:
    """`replay --help` listed `log` without a word, and nothing said what the exit status
    means (an auditor's script reads it)."""
    out = ehp("replay", "--help")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "log the transition log: a run's or simulation's transitions.jsonl" in text, text
    assert (
        "exit status: 0 the log verifies (with --at: the world printed); 2 it does not (one "
        "line on stderr: which line, what differs, why and what to do), or the log, the "
        "receipt or an option cannot be used (said on stderr); 130 Ctrl-C." in text
    ), text


def test_a_log_of_its_header_alone_says_one_line(tmp_path: Path) -> None:
    """ "intact over 1 lines"."""
    log = tmp_path / "t.jsonl"
    log.write_bytes(GOLDEN.read_bytes().splitlines(keepends=True)[0])  # its header alone
    out = ehp("replay", str(log))
    assert out.returncode == 0, out.stderr
    assert out.stdout.endswith("hash chain (blake2b-128) intact over 1 line\n"), out.stdout


def _bad_day(tmp_path: Path) -> list[tuple[str, list[str], str]]:
    """(case, replay's arguments, what its error must say) for the logs of a bad day, made
    from the golden log (line 42: a cascaded record; line 41: its root)."""
    lines = GOLDEN.read_bytes().splitlines(keepends=True)

    def log(name: str, body: list[bytes] | bytes) -> str:
        path = tmp_path / f"{name}.jsonl"
        path.write_bytes(body if isinstance(body, bytes) else b"".join(body))
        return str(path)

    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    g = str(GOLDEN)
    return [
        ("cut mid-line", [log("cut", [*lines[:41], lines[41][:30]])], "line 42 "),
        (
            "a space added",
            [log("space", [*lines[:40], lines[40].replace(b",", b", ", 1), *lines[41:]])],
            "breaks at line 41",
        ),
        ("a line removed", [log("removed", [*lines[:41], *lines[42:]])], "line 42"),
        ("a line twice", [log("twice", [*lines[:42], lines[41], *lines[42:]])], "line 43"),
        ("empty", [log("empty", b"")], "the file is empty"),
        ("binary", [log("binary", bytes(range(256)) * 64)], "is not a 'ehp-fsm.log' header"),
        ("a FIFO", [str(fifo)], "is not a regular file"),
        ("a folder", [str(tmp_path)], "it is a directory"),
        ("--jobs 0", [g, "--jobs", "0"], "--jobs 0 is not a number of processes"),
        ("--jobs -1", [g, "--jobs", "-1"], "--jobs -1 is not a number of processes"),
        ("--jobs 10**12", [g, "--jobs", str(10**12)], "give --jobs within 1..256"),
        ("--at 0", [g, "--at", "0"], "--at 0 is not a record's seq"),
    ]


def test_a_bad_days_logs_and_options_each_get_a_verdict_not_a_traceback(tmp_path: Path) -> None:
    """No hang (a FIFO is refused unread), no traceback: exit 2 and one line naming it. (These
    passed before this review; kept so they go on passing.)"""
    for case, args, says in _bad_day(tmp_path):
        out = ehp("replay", *args)
        assert out.returncode == 2, (case, out.stdout[-300:])
        assert out.stderr.startswith("ehp-fsm: error: ") and "Traceback" not in out.stderr
        assert says in out.stderr and out.stderr.count("\n") == 1, (case, out.stderr)


def test_a_divergence_in_a_segment_the_log_resumes_names_that_file(tmp_path: Path) -> None:
    """A resumed run's log (4 lines) replays the segment it resumes too: a line edited there
    was named as "line N" of the log given, which has no line N."""
    plan = load_plan(ROOT / "examples" / "short.toml")
    first = simulated(tmp_path / "transitions.1.jsonl", 1)
    head = replay(first).chain
    assert head is not None
    meta = {"resumes": {"log": first.name, "count": head[0], "hash": head[1], "step": 0}}
    log = tmp_path / "transitions.jsonl"
    orch = Orchestrator.from_plan(plan, log_path=log, log_meta=meta)
    orch.handle(Event("rollout_engine", "e0", "drain", time=1.0))
    orch.close()
    assert ehp("replay", str(log)).returncode == 0
    lines = first.read_text().splitlines(keepends=True)
    lines[-1] = lines[-1].replace('"time":1.0', '"time":2.0')
    first.write_text("".join(lines))
    out = ehp("replay", str(log))
    assert out.returncode == 2, out.stdout
    assert out.stderr.startswith(
        f"ehp-fsm: error: in {first.name}, a segment this log resumes: "
    ), out.stderr
    # --at replays this segment alone: it says so (an edited earlier one passed unsaid)
    out = ehp("replay", str(log), "--at", "2")
    assert out.returncode == 0, out.stderr
    assert f"this log resumes {first.name}: the segments before it are not replayed" in (
        out.stderr
    ), out.stderr


def test_a_log_whose_last_line_lost_its_newline_counts_that_line(tmp_path: Path) -> None:
    """Every line verifies (the chain covers a line's bytes before its newline): the count
    said one line fewer ("intact over 5070 lines" for 5,071)."""
    log = tmp_path / "t.jsonl"
    log.write_bytes(GOLDEN.read_bytes().rstrip(b"\n"))
    lines = GOLDEN.read_bytes().count(b"\n")
    out = ehp("replay", str(log))
    assert out.returncode == 0, out.stderr
    assert out.stdout.endswith(f"intact over {lines} lines\n"), out.stdout


def test_the_receipt_of_a_run_that_wrote_no_log_is_named_so(tmp_path: Path) -> None:
    """A run stopped before it began its log (a file-size limit at its start) writes a receipt
    with `"log": null` and no `log_chain`: `replay LOG --receipt` called it "not a run's
    receipt"; it is that run's, of a run with no log."""
    receipt = tmp_path / "receipt.json"
    receipt.write_text(json.dumps({"plan": "short", "log": None, "error": "File too large"}))
    out = ehp("replay", str(GOLDEN), "--receipt", str(receipt))
    assert out.returncode == 2 and out.stdout == "", out.stdout
    assert out.stderr.startswith(
        f"ehp-fsm: error: --receipt {receipt} is the receipt of a run that wrote no log: "
        'because its "log" is null'
    ), out.stderr
    assert f"Fix: replay {GOLDEN} without --receipt" in out.stderr
