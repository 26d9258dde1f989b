"""Issue 18: the transition log is tamper-evident (schema 3). Every forgery a review found
replay verifying is refused with its line and what differs; a rebuilt chain is caught by the
run's receipt or, for a keyed log, by the key."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ehp_fsm.core.world import Event
from ehp_fsm.errors import ChainBroken, LogFormatError, ReplayDivergence
from ehp_fsm.replay import check_receipt, replay
from ehp_fsm.translog import TransitionLog
from tests.core.logedit import rechain, render
from tests.golden.scenarios import HERE, borrow_and_return

GOLDEN = HERE / "borrow_and_return.jsonl"


def lines() -> list[str]:
    return GOLDEN.read_text().splitlines(keepends=True)


def where(src: list[str], pred: object, after: int = 1) -> int:
    """1-based number of the first record line after `after` that `pred` accepts."""
    for n, raw in enumerate(src, start=1):
        if n > after and pred(json.loads(raw)):  # type: ignore[operator]
            return n
    raise AssertionError("no such line")


def write(tmp_path: Path, src: list[str], name: str = "t.jsonl") -> Path:
    out = tmp_path / name
    out.write_text("".join(src))
    return out


def edit_json(line: str, change: object) -> str:
    """The line with `change(obj)` applied, re-rendered compact; its old chain kept."""
    obj = json.loads(line)
    change(obj)  # type: ignore[operator]
    return render(obj)[:-1] + f',"chain":"{json.loads(line)["chain"]}"' + "}\n"


def receipt_of(path: Path) -> dict[str, object]:
    result = replay(path)
    assert result.chain is not None
    return {"log_chain": {"count": result.chain[0], "hash": result.chain[1]}}


def test_the_golden_log_chain_and_its_head() -> None:
    result = replay(GOLDEN)
    assert result.chain is not None
    assert result.chain[0] == len(lines())
    assert result.chain[1] == json.loads(lines()[-1])["chain"]


def test_chain_head_is_what_replay_ends_with(tmp_path: Path) -> None:
    log = tmp_path / "t.jsonl"
    orch = borrow_and_return(log).engine
    assert orch.log is not None
    head = orch.log.chain_head
    assert orch.chain_head == head
    assert replay(log).chain == head
    check_receipt(replay(log), {"log_chain": {"count": head[0], "hash": head[1]}})


@pytest.mark.parametrize(
    ("what", "pred", "change"),
    [
        ("staleness", None, lambda h: h["config"].update(max_staleness=5)),
        ("deadline", None, lambda h: h["config"]["deadlines"]["training_step"].update(computing=1)),
        ("extra GPU", None, lambda h: h["config"]["inventory"].update({"h9:g0": "h9"})),
    ],
)
def test_an_edited_header_config_is_refused(
    tmp_path: Path, what: str, pred: object, change: object
) -> None:
    src = lines()
    src[0] = edit_json(src[0], change)
    with pytest.raises(LogFormatError, match="config was edited") as info:
        replay(write(tmp_path, src))
    assert info.value.line == 1
    # A forger who also fixes the fingerprint and rebuilds the chain: the receipt catches it.
    receipt = receipt_of(GOLDEN)
    obj = json.loads(src[0])
    from ehp_fsm.translog import config_fingerprint

    obj["config_fingerprint"] = config_fingerprint(obj["config"])
    forged = write(tmp_path, rechain([render(obj) + "\n", *src[1:]]), "forged.jsonl")
    result = replay(forged)  # the chain is consistent again ...
    with pytest.raises(ChainBroken, match="rewritten"):
        check_receipt(result, receipt)  # ... but it is not the run's


@pytest.mark.parametrize(
    ("what", "pred", "change"),
    [
        (
            "checksum",
            lambda r: r["event"] == "saved",
            lambda r: r["payload"].update(checksum="forged"),
        ),
        (
            "reason",
            lambda r: "reason" in r["payload"],
            lambda r: r["payload"].update(reason="forged"),
        ),
        ("extra key", lambda r: r["event"] == "saved", lambda r: r["payload"].update(x=1)),
        ("root time", lambda r: r["cause"] is None and r["seq"] > 20, lambda r: r.update(time=1.5)),
        (
            "correlation",
            lambda r: r["cause"] is None and r["seq"] > 20,
            lambda r: r.update(correlation="c"),
        ),
    ],
)
def test_a_data_only_edit_is_refused_at_its_line(
    tmp_path: Path, what: str, pred: object, change: object
) -> None:
    src = lines()
    n = where(src, pred)
    src[n - 1] = edit_json(src[n - 1], change)
    with pytest.raises(ReplayDivergence) as info:
        replay(write(tmp_path, src))
    # A cascaded record's payload is recomputed (the field is named); a root's is the event
    # itself, and only the chain shows the edit.
    assert info.value.line == n
    if json.loads(src[n - 1])["cause"] is None:
        assert isinstance(info.value, ChainBroken) and f"breaks at line {n}" in str(info.value)
    else:
        assert info.value.field == "payload"


def test_a_deleted_rejected_record_with_seqs_renumbered_is_refused(tmp_path: Path) -> None:
    """The forger erases the recycled-pid refusal and renumbers every seq after it."""
    src = lines()
    n = where(src, lambda r: not r["accepted"] and "reused pid" in r["reason"])
    rest = []
    for x in src[n:]:
        rest.append(
            edit_json(
                x,
                lambda r: r.update(
                    seq=r["seq"] - 1, cause=None if r["cause"] is None else r["cause"] - 1
                ),
            )
        )
    with pytest.raises(ChainBroken) as info:
        replay(write(tmp_path, [*src[: n - 1], *rest]))
    assert info.value.line == n  # the first renumbered line


def test_deleted_inserted_and_swapped_lines_are_refused(tmp_path: Path) -> None:
    src = lines()
    n = 30
    for forged, line in (
        ([*src[: n - 1], *src[n:]], n),  # deleted
        ([*src[:n], src[n - 1], *src[n:]], n + 1),  # inserted (a copy)
        ([*src[: n - 1], src[n], src[n - 1], *src[n + 1 :]], n),  # swapped
    ):
        with pytest.raises(ReplayDivergence) as info:
            replay(write(tmp_path, forged))
        assert info.value.line == line


def test_a_deleted_checkpoint_line_is_refused(tmp_path: Path) -> None:
    log = tmp_path / "cp.jsonl"
    borrow_and_return(log, checkpoint_every=3)
    src = log.read_text().splitlines(keepends=True)
    n = where(src, lambda r: "checkpoint" in r, after=40)
    with pytest.raises(ChainBroken) as info:
        replay(write(tmp_path, [*src[: n - 1], *src[n:]], "no-cp.jsonl"), jobs=2)
    assert info.value.line == n


def test_a_blank_line_is_an_insertion(tmp_path: Path) -> None:
    src = lines()
    with pytest.raises(LogFormatError) as info:
        replay(write(tmp_path, [*src[:10], "\n", *src[10:]]))
    assert info.value.line == 11


def test_a_log_cut_short_is_caught_by_the_receipt(tmp_path: Path) -> None:
    receipt = receipt_of(GOLDEN)
    cut = write(tmp_path, lines()[:-3])
    result = replay(cut)  # every line left still verifies ...
    with pytest.raises(ChainBroken, match="cut short") as info:
        check_receipt(result, receipt)  # ... but the log is not the whole log
    assert info.value.line == len(lines()) - 3


def test_a_keyed_chain_cannot_be_rebuilt_without_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "keyed.jsonl"
    monkeypatch.setenv("EHP_LOG_KEY", "s3cret")
    borrow_and_return(log)
    assert json.loads(log.read_text().splitlines()[0])["chain_kind"] == "blake2b-128-keyed"
    assert replay(log).transitions == len(lines()) - 1
    src = log.read_text().splitlines(keepends=True)
    n = where(src, lambda r: r["event"] == "saved")
    src[n - 1] = edit_json(src[n - 1], lambda r: r["payload"].update(checksum="forged"))
    with pytest.raises(ChainBroken):  # a forger's rebuilt chain, with a guessed key
        replay(write(tmp_path, rechain(src, key="guess"), "forged.jsonl"))
    with pytest.raises(ChainBroken) as info:  # or an unkeyed one
        replay(write(tmp_path, rechain(src), "forged2.jsonl"))
    assert info.value.line == 1
    unkeyed = [edit_json(src[0], lambda h: h.update(chain_kind="blake2b-128")), *src[1:]]
    with pytest.raises(LogFormatError, match="unkeyed"):  # or one that says it is unkeyed
        replay(write(tmp_path, rechain(unkeyed), "forged3.jsonl"))
    assert replay(write(tmp_path, rechain(src, key="s3cret"), "withkey.jsonl")).transitions
    monkeypatch.delenv("EHP_LOG_KEY")
    with pytest.raises(LogFormatError, match="keyed and no key"):
        replay(log)
    assert replay(log, key="s3cret").transitions == len(lines()) - 1


def test_a_keyed_log_cut_short_with_its_receipt_rewritten_is_refused_by_the_seal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A keyed log's receipt recorded only its line count and last `chain`, both read from the
    log itself: whoever could cut the log (no key needed) could rewrite the receipt to the cut
    log's end, and `replay --receipt` said "matches the receipt" (an auditor's find). The
    receipt now seals the end under the key, which a rewritten count and hash do not match.
    An unkeyed log's receipt has no seal (nothing to make it with): its receipt must be kept
    where the log's writer alone can write, as the README says."""
    log = tmp_path / "keyed.jsonl"
    monkeypatch.setenv("EHP_LOG_KEY", "s3cret")
    scenario = borrow_and_return(log)
    sealed = scenario.engine.log_chain
    scenario.engine.close()
    assert sealed is not None and set(sealed) == {"count", "hash", "seal"}
    check_receipt(replay(log), {"log_chain": sealed})  # the run's own receipt holds
    src = log.read_text().splitlines(keepends=True)
    cut = write(tmp_path, src[:-5], "cut.jsonl")
    count, head = len(src) - 5, json.loads(src[-6])["chain"]
    for forged in (
        {"count": count, "hash": head},  # the seal dropped
        {"count": count, "hash": head, "seal": sealed["seal"]},  # the run's seal kept
        {"count": count, "hash": head, "seal": "0" * 32},
    ):
        with pytest.raises(ChainBroken, match="seal"):
            check_receipt(replay(cut), {"log_chain": forged})
    receipt = tmp_path / "receipt.json"
    receipt.write_text(json.dumps({"log_chain": {"count": count, "hash": head}}))
    cmd = [sys.executable, "-m", "ehp_fsm.cli", "replay", str(cut), "--receipt", str(receipt)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert out.returncode == 2 and "the receipt's seal does not hold" in out.stderr, out
    monkeypatch.delenv("EHP_LOG_KEY")
    plain = borrow_and_return(tmp_path / "plain.jsonl").engine
    assert set(plain.log_chain or {}) == {"count", "hash"}  # unkeyed: no seal
    plain.close()


@pytest.mark.parametrize("schema", [1, 2])
def test_a_keyed_replay_refuses_a_log_downgraded_to_a_schema_without_a_chain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, schema: int
) -> None:
    """With EHP_LOG_KEY set, a forged log that simply dropped its chain (its header said
    schema 2, or 1) verified — exit 0, "148 transitions verified" — while an unkeyed schema-3
    log is refused as untrustworthy: the key authenticated nothing. Now it is refused too;
    without a key such a log still replays, as before."""
    from tests.core.logedit import as_schema_2

    src = as_schema_2(lines())
    if schema == 1:
        src[0] = src[0].replace('"schema_version":2', '"schema_version":1', 1)
    n = where(src, lambda r: r["event"] == "saved")
    src[n - 1] = src[n - 1].replace('"correlation":""', '"correlation":"forged"', 1)
    log = write(tmp_path, src)
    assert replay(log).transitions == len(lines()) - 1  # no key: an old log, unauthenticated
    monkeypatch.setenv("EHP_LOG_KEY", "s3cret")
    with pytest.raises(LogFormatError, match="no hash chain") as info:
        replay(log)
    assert info.value.line == 1 and "do not trust" in info.value.fix
    monkeypatch.delenv("EHP_LOG_KEY")
    with pytest.raises(LogFormatError, match="no hash chain"):
        replay(log, key="s3cret")


def test_replay_cli_checks_the_receipt(tmp_path: Path) -> None:
    receipt = tmp_path / "receipt.json"
    receipt.write_text(json.dumps(receipt_of(GOLDEN)))
    cmd = [sys.executable, "-m", "ehp_fsm.cli", "replay"]
    ok = subprocess.run(
        [*cmd, str(GOLDEN), "--receipt", str(receipt)], capture_output=True, text=True, check=False
    )
    assert ok.returncode == 0, ok.stderr
    assert "hash chain (blake2b-128) intact" in ok.stdout and "matches the receipt" in ok.stdout
    cut = write(tmp_path, lines()[:-1])
    bad = subprocess.run(
        [*cmd, str(cut), "--receipt", str(receipt)], capture_output=True, text=True, check=False
    )
    assert bad.returncode != 0
    assert "cut short" in bad.stderr + bad.stdout


def test_the_writer_chains_every_line(tmp_path: Path) -> None:
    log = TransitionLog.create(tmp_path / "e.jsonl", config={"inventory": {}}, specs={}, key=None)
    assert log.chain_head[0] == 1 and len(log.chain_head[1]) == 32
    log.close()


def test_a_log_appended_to_after_recovery_keeps_its_chain(tmp_path: Path) -> None:
    """A recovering controller appends to the repaired log with a new `TransitionLog`: the
    chain goes on from the last line, so the whole log still verifies."""
    from ehp_fsm.core.effects import EFFECTS
    from ehp_fsm.core.guards import GUARDS
    from ehp_fsm.core.transition import step

    log = tmp_path / "t.jsonl"
    borrow_and_return(log)
    result = replay(log)
    more = TransitionLog(log.open("ab"), first_seq=result.last_seq + 1)
    assert more.chain_head == result.chain
    out = step(result.world, Event("request", "late", "enqueue", 999.0), GUARDS, EFFECTS)
    more.write(out)
    more.close()
    again = replay(log)
    assert again.transitions == result.transitions + 1
    assert again.chain == more.chain_head


@pytest.mark.parametrize(
    ("text", "holds"),
    [
        ("null", " (it holds JSON null)"),  # was: no check at all, exit 0
        ("[1, 2]", " (it holds JSON [1, 2])"),  # was: "transition log line 0 is not ..."
        ('"x"', ' (it holds JSON "x")'),
        ("{}", ""),
        ('{"log_chain": 5}', ""),
        ('{"log_chain": {"count": "97", "hash": "x"}}', ""),
    ],
)
def test_replay_refuses_what_is_not_a_receipt_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, holds: str
) -> None:
    from ehp_fsm.cli import main

    receipt = tmp_path / "receipt.json"
    receipt.write_text(text)
    assert main(["replay", str(GOLDEN), "--receipt", str(receipt)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "", captured.out  # refused before the log was replayed
    assert captured.err == (
        f"ehp-fsm: error: --receipt {receipt} is not a run's receipt: because it has no "
        f'`log_chain: {{"count": N, "hash": "..."}}`{holds}. Fix: give --receipt the '
        "receipt.json the run wrote beside this log\n"
    )


@pytest.mark.parametrize("name", ["/dev/zero", "missing.json", "."])
def test_replay_refuses_a_receipt_that_is_no_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """`--receipt /dev/zero` was read until the memory was gone."""
    from ehp_fsm.cli import main

    receipt = name if name.startswith("/") else str(tmp_path / name)
    assert main(["replay", str(GOLDEN), "--receipt", receipt]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ehp-fsm: error: --receipt {receipt} is not a receipt file"), err
    assert "is a directory or a device" in err, err


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("max_hybrids", "x"),
        ("max_staleness", None),
        ("rollout_reserve", "2"),
        ("core_gpus", 0),
        ("core_replicas", None),
        ("deadlines", []),
        ("deadlines", {"hybrid_replica": None}),
    ],
)
def test_a_forged_header_config_the_engine_cannot_read_is_refused_not_a_traceback(
    tmp_path: Path, key: str, value: object
) -> None:
    """A forger who rebuilds the fingerprint and the chain can write any config; one whose
    counts, id lists or deadline table are of another kind ended `ehp-fsm replay` in a
    TypeError or AttributeError traceback (exit 1) from a guard mid-replay."""
    from ehp_fsm.translog import config_fingerprint

    obj = json.loads(lines()[0])
    obj["config"][key] = value
    obj["config_fingerprint"] = config_fingerprint(obj["config"])
    forged = write(tmp_path, rechain([render(obj) + "\n", *lines()[1:]]))
    cmd = [sys.executable, "-m", "ehp_fsm.cli", "replay", str(forged)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert "line 1, its header, is not valid" in out.stderr and f"`{key}`" in out.stderr
