"""`ehp-fsm simulate` at the edges of its inputs: the `[simulate]` cost model at its bounds,
`response_lengths_file` in every bad shape, and the flags at theirs. Each either runs or is
refused with one `ehp-fsm: error:` line naming the key or flag — never a traceback, never a
run that goes on for ever."""

from __future__ import annotations

import functools
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ehp_fsm.cli import main
from ehp_fsm.plan import MAX_COUNT

ROOT = Path(__file__).resolve().parents[2]


def _plan(tmp_path: Path, simulate: str) -> Path:
    """examples/short.toml (3 engines, 4 groups of 4) with `simulate` as its [simulate]."""
    text = (ROOT / "examples" / "short.toml").read_text(encoding="utf-8")
    text = text.replace('"data/add-0-4.jsonl"', repr(str(ROOT / "examples/data/add-0-4.jsonl")))
    plan = tmp_path / "plan.toml"
    plan.write_text(f"{text}\n[simulate]\n{simulate}\n", encoding="utf-8")
    return plan


#: a step's compute may take as long as it takes (the run's default gives up after 300 s)
_NO_STEP_DEADLINE = "\n[deadlines.training_step]\ncomputing = 1e9"


def _one_error(err: str) -> str:
    assert err.startswith("ehp-fsm: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(
    ("simulate", "waited_for", "keys"),
    [
        # a step's compute longer than a virtual day (within its deadline): `results.pop(sid)`
        # was a KeyError
        ("train_s_per_sample = 1e6" + _NO_STEP_DEADLINE, "step-1's compute", "train_s_per_sample"),
        ("optimizer_s = 1e6" + _NO_STEP_DEADLINE, "step-1's compute", "optimizer_s"),
        ("save_gb_per_s = 1e-6" + _NO_STEP_DEADLINE, "step-1's compute", "save_gb_per_s"),
        ("reduce_gb_per_s = 1e-6" + _NO_STEP_DEADLINE, "'s compute", "reduce_gb_per_s"),
        # an engine start longer than a virtual day (within its deadline): "no engine came up"
        (
            "engine_start_s = 1e6\n[deadlines.rollout_engine]\nstarting = 1e9",
            "every engine to serve revision 1",
            "engine_start_s",
        ),
        # a rollout longer than a virtual day (within its deadline): "0 groups cannot give
        # work to 1 live replicas"
        (
            "engine_tokens_per_s = 1e-3\nresponse_max_tokens = 1000\n[deadlines.run]\n"
            "rollout = 1e9",
            "4 completed groups for step 1",
            "engine_tokens_per_s",
        ),
    ],
)
def test_a_wait_past_a_virtual_day_names_the_cost_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], simulate: str, waited_for: str, keys: str
) -> None:
    plan = _plan(tmp_path, simulate)
    assert main(["simulate", str(plan), "--steps", "2", "--out", str(tmp_path / "o")]) == 2
    err = _one_error(capsys.readouterr().err)
    assert "waited more than 24 virtual hours for" in err and waited_for in err, err
    assert "[simulate] cost model" in err and keys in err, err


@pytest.mark.parametrize(
    ("simulate", "stopped"),
    [
        # each past the deadline that bounds it, the run stops there; the simulation waited a
        # virtual day and then blamed the cost model ("waited more than 24 virtual hours")
        (
            "train_s_per_sample = 1e6",
            "training step 1 was given up: its computation did not end within "
            "[deadlines.training_step] computing (300 s)",
        ),
        (
            "engine_tokens_per_s = 1e-3\nresponse_max_tokens = 1000",
            "rollout did not produce 4 groups for step 1 in 300 s ([deadlines.run] rollout; ",
        ),
    ],
)
def test_a_step_past_the_run_s_deadlines_stops_as_the_run_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], simulate: str, stopped: str
) -> None:
    plan = _plan(tmp_path, simulate)
    assert main(["simulate", str(plan), "--steps", "2", "--out", str(tmp_path / "o")]) == 2
    err = _one_error(capsys.readouterr().err)
    assert stopped in err and "ehp-fsm run` stops so too" in err, err
    assert "virtual hours" not in err, err


def test_a_simulation_that_stops_leaves_no_earlier_report_beside_its_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second simulation into the same `--out` that stops part-way (here a wait past a
    virtual day; Ctrl-C alike) left the first one's receipt, summary and timelines beside its
    own log, and `replay LOG --receipt` called that log cut short or edited. Now the earlier
    report goes once the new log is begun."""
    out = tmp_path / "o"
    assert main(["simulate", str(_plan(tmp_path, "")), "--steps", "1", "--out", str(out)]) == 0
    assert (out / "receipt.json").is_file() and (out / "timeline-gpus.svg").is_file()
    plan = _plan(tmp_path, "train_s_per_sample = 1e6")
    assert main(["simulate", str(plan), "--steps", "2", "--out", str(out)]) == 2
    capsys.readouterr()
    assert sorted(p.name for p in out.iterdir()) == ["transitions.jsonl"]
    assert (
        main(["replay", str(out / "transitions.jsonl"), "--receipt", str(out / "receipt.json")])
        == 2
    )
    assert "is not a receipt file: because it does not exist" in capsys.readouterr().err


def _disk_full_at(limit: int) -> None:  # in the child, before it runs: a real write limit
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past it fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_a_full_disk_mid_simulation_names_the_log_and_the_fix(tmp_path: Path) -> None:
    """The disk under `--out` fills while the simulation writes its log (a real limit: the
    process's RLIMIT_FSIZE at 20 kB). Before: "ehp-fsm: error: OSError: No space left on
    device" (seen on a 3 MB tmpfs) — no file, no step, a generic fix. Now the log's path,
    and what to do."""
    out = tmp_path / "o"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ehp_fsm.cli",
            "simulate",
            str(_plan(tmp_path, "")),
            "--steps",
            "5",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        preexec_fn=functools.partial(_disk_full_at, 20_000),
    )
    assert done.returncode == 2, done.stdout + done.stderr
    err = _one_error(done.stderr)
    assert f"the simulation stopped: File too large writing its log {out}/transitions.jsonl" in err
    assert "give --out a folder on another" in err, err


def test_the_fault_hunt_reports_such_a_wait_as_its_finding(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The hunt ran into the same KeyError (a traceback); now the seed and the reason."""
    plan = _plan(tmp_path, "train_s_per_sample = 1e6" + _NO_STEP_DEADLINE)
    argv = ["simulate", str(plan), "--steps", "1", "--seeds", "1", "--faults", "heavy"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "fault hunt: seed 0 breaks: the simulated run waited more than 24" in out, out


def test_engines_that_never_serve_say_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An install longer than its deadline fails every engine: "no engine came up" said
    neither why nor what to change."""
    plan = _plan(tmp_path, "model_gb = 1e6")
    assert main(["simulate", str(plan), "--steps", "1", "--out", str(tmp_path / "o")]) == 2
    err = _one_error(capsys.readouterr().err)
    assert "no engine came up" in err and "[deadlines.rollout_engine]" in err, err
    assert "model_gb / install_gb_per_s" in err, err


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (None, "cannot be read"),  # missing
        ("", "holds no lengths"),
        ("# only a comment\n\n", "holds no lengths"),
        ("12\nabc\n", ":2: 'abc' is not a token count"),
        ("-5\n", ":1: '-5' is not a token count"),
        ("1e3\n", ":1: '1e3' is not a token count"),
        ("12.5\n", "is not a token count"),
        (f"{10**400}\n", "is not a token count"),
        ("10000001\n", "within 1..10000000"),
        ("\xff\n", "is not a token count"),
    ],
)
def test_a_bad_lengths_file_is_refused_by_its_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, why: str
) -> None:
    lengths = tmp_path / "lengths.txt"
    if content is not None:
        lengths.write_text(content, encoding="utf-8")
    plan = _plan(tmp_path, f'response_lengths_file = "{lengths}"')
    for command in ("check", "simulate"):
        assert main([command, str(plan)]) == 2
        err = _one_error(capsys.readouterr().err)
        assert "plan key `simulate.response_lengths_file`" in err and why in err, err
        assert ". Fix: " in err, err  # (an empty one said no fix)


def test_a_binary_lengths_file_is_named_not_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It said "cannot be read ('utf-8' codec can't decode byte 0x89 ...)", and no fix."""
    lengths = tmp_path / "lengths.bin"
    lengths.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    plan = _plan(tmp_path, f'response_lengths_file = "{lengths}"')
    assert main(["check", str(plan)]) == 2
    err = _one_error(capsys.readouterr().err)
    assert f"{lengths} is not UTF-8 text (invalid start byte at byte 0)" in err, err
    assert "Fix: write one response length (tokens) per line, as text" in err, err


@pytest.mark.parametrize(
    ("line", "fix"),
    [
        ('engine_tokens_per_s = "fast"', "write engine_tokens_per_s as int or float"),
        ("engine_tokens_per_s = true", "write engine_tokens_per_s as int or float, not true"),
        ("engine_tokens_per_s = -1.0", "give engine_tokens_per_s a number within"),
        ("engine_tokens_per_s = nan", "give engine_tokens_per_s a number within"),
        ("engine_tokens_per_s = inf", "give engine_tokens_per_s a number within"),
        ("response_max_tokens = 2.5", "write response_max_tokens as int"),
        ("response_max_tokens = 0", "give response_max_tokens a whole number within 1.."),
    ],
)
def test_a_bad_cost_value_says_what_to_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, fix: str
) -> None:
    """A value of the wrong type or range was refused with why and no fix (every plan section
    reads its values so: `plan._Reader`)."""
    assert main(["check", str(_plan(tmp_path, line))]) == 2
    err = _one_error(capsys.readouterr().err)
    assert f". Fix: {fix}" in err, err


def test_a_lengths_file_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    """A BOM (as some editors and spreadsheet exports write one) was read as part of the first
    line: "'\\ufeff10' is not a token count"."""
    from ehp_fsm.plan import load_plan

    lengths = tmp_path / "lengths.txt"
    lengths.write_bytes("\ufeff10\n# a comment\n20\n".encode())
    plan = load_plan(
        _plan(tmp_path, f'response_lengths_file = "{lengths}"\nresponse_max_tokens = 50')
    )
    assert plan.simulate is not None and plan.simulate.response_lengths == (10, 20)


def test_out_must_be_a_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--out FILE` said "FileExistsError: File exists" without the flag; `--out ''` silently
    wrote to the default folder. Both are refused before anything runs."""
    monkeypatch.chdir(tmp_path)  # where the default folder `runs/short-sim` would be
    plan = _plan(tmp_path, "")
    (tmp_path / "taken").write_text("x")
    assert main(["simulate", str(plan), "--steps", "1", "--out", str(tmp_path / "taken")]) == 2
    err = _one_error(capsys.readouterr().err)
    assert f"--out {tmp_path / 'taken'} is not a folder" in err and "names a file" in err, err
    assert main(["simulate", str(plan), "--steps", "1", "--out", ""]) == 2
    err = _one_error(capsys.readouterr().err)
    assert "--out '' is not a folder" in err and "empty" in err, err
    assert not (Path("runs") / "short-sim").exists()
    assert main(["simulate", str(plan), "--steps", "1", "--out", str(tmp_path / "new" / "o")]) == 0
    assert (tmp_path / "new" / "o" / "transitions.jsonl").is_file()


def test_out_never_empties_a_log_no_simulation_wrote(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--out runs/<plan>` (the run's own folder) emptied the run's transitions.jsonl and
    replaced its receipt; a simulation's own earlier log there is still overwritten."""
    plan = _plan(tmp_path, "")
    run_log = '{"schema_version":3,"meta":{"plan":"short"},"config":{}}\n{"seq":1}\n'
    cases = (
        (tmp_path / "run", "transitions.jsonl", []),
        (tmp_path / "both", "ehp-on/transitions.jsonl", ["--ehp", "both"]),
    )
    for out, log, args in cases:
        path = out / log
        path.parent.mkdir(parents=True)
        path.write_text(run_log)
        assert main(["simulate", str(plan), "--steps", "1", "--out", str(out), *args]) == 2
        err = _one_error(capsys.readouterr().err)
        assert f"holds a transition log that no simulation wrote ({path})" in err, err
        assert path.read_text() == run_log  # untouched
        assert not (out / "ehp-off").exists()  # nothing ran: the check comes first
    again = tmp_path / "sim"
    for _ in range(2):
        assert main(["simulate", str(plan), "--steps", "1", "--out", str(again)]) == 0
    assert (again / "receipt.json").is_file()


@pytest.mark.slow
def test_steps_beyond_a_plans_limit_are_refused_at_once(tmp_path: Path) -> None:
    """`--steps 10**20` ran until killed (a plan's grpo.steps is at most MAX_COUNT)."""
    plan = _plan(tmp_path, "")
    for steps in (MAX_COUNT + 1, 10**20):
        done = subprocess.run(
            [sys.executable, "-m", "ehp_fsm.cli", "simulate", str(plan), "--steps", str(steps)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
            check=False,
        )
        assert done.returncode == 2, done.stderr
        err = _one_error(done.stderr)
        assert f"--steps {steps} is not a number of steps" in err, err
        assert f"give --steps within 1..{MAX_COUNT}" in err, err


def test_agent_silences_are_bounded_so_a_heavy_hunt_ends(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`agent_silence_per_hour = 1e6` passed `check`, and `--faults heavy` then spent ~1,000 s
    of wall time a step on silences; the largest rate allowed now runs in seconds."""
    assert main(["check", str(_plan(tmp_path, "agent_silence_per_hour = 1e6"))]) == 2
    err = _one_error(capsys.readouterr().err)
    assert "plan key `simulate.agent_silence_per_hour`" in err and "0..100" in err, err
    plan = _plan(tmp_path, "agent_silence_per_hour = 100.0")
    argv = ["simulate", str(plan), "--steps", "2", "--seeds", "1", "--faults", "heavy"]
    assert main(argv) == 0, capsys.readouterr()
    assert "fault hunt: 1 seeds, no invariant broken" in capsys.readouterr().out


def test_a_step_that_outlives_its_deadline_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A step's compute outlived `[deadlines.training_step] computing`: the stop said "(a
    Hybrid died in each)", which none had; and it was tried twice more, where the run gives
    such a step up at once."""
    plan = _plan(tmp_path, "")
    plan.write_text(plan.read_text() + "\n[deadlines.training_step]\ncomputing = 0.001\n")
    assert main(["simulate", str(plan), "--steps", "1", "--out", str(tmp_path / "o")]) == 2
    err = _one_error(capsys.readouterr().err)
    assert (
        "training step 1 was given up: its computation did not end within "
        "[deadlines.training_step] computing (0.001 s)"
    ) in err, err
    log = (tmp_path / "o" / "transitions.jsonl").read_text()
    assert '"instance":"step-1.1"' not in log  # not tried again


@pytest.mark.parametrize(
    ("old", "new", "kind", "name"),
    [
        ('id = "e1"', 'id = "e0.1"', "engines", "e0.1"),
        ('"h2"', '"h0.1"', "hosts", "h0.1"),
    ],
)
def test_hosts_copies_that_would_take_a_plans_id_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], old: str, new: str, kind: str, name: str
) -> None:
    """Copy k of an id is `ID.k`: with an engine `e0.1` (or a host `h0.1`) in the plan,
    `--hosts 6` made two, and the run stopped on "the machines refused rollout_engine e0.1
    launch" (or a GPU 'assign' refused)."""
    plan = _plan(tmp_path, "")
    plan.write_text(plan.read_text().replace(old, new))
    out = str(tmp_path / "o")
    assert main(["simulate", str(plan), "--hosts", "6", "--steps", "1", "--out", out]) == 2
    err = _one_error(capsys.readouterr().err)
    assert f"would have two {kind} {name!r}" in err and "rename the plan's" in err, err


def test_lengths_above_the_cap_are_capped_and_check_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A lengths file from a run with a longer cap: each length above `response_max_tokens`
    is capped there (an engine ends a response at its max tokens), and `check` counts them.
    They were drawn as they stood, so a group took longer than any run of the plan could."""
    from ehp_fsm.plan import load_plan

    lengths = tmp_path / "lengths.txt"
    lengths.write_text("10\n5000\n300\n", encoding="utf-8")
    plan = _plan(tmp_path, f'response_lengths_file = "{lengths}"\nresponse_max_tokens = 300')
    spec = load_plan(plan).simulate
    assert spec is not None and spec.response_lengths == (10, 300, 300)
    assert spec.response_lengths_capped == 1
    assert main(["check", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "3 response lengths from response_lengths_file (1 above response_max_tokens" in out


def test_out_holding_a_log_nested_too_deep_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A `transitions.jsonl` under `--out` whose first line is `[[[...` (200,000 deep) raised
    a RecursionError traceback from the check that the log is a simulation's."""
    plan = _plan(tmp_path, "")
    deep = tmp_path / "deep"
    deep.mkdir()
    (deep / "transitions.jsonl").write_text("[" * 200_000 + "\n")
    assert main(["simulate", str(plan), "--steps", "1", "--out", str(deep)]) == 2
    err = _one_error(capsys.readouterr().err)
    assert "holds a transition log that no simulation wrote" in err, err
    assert (deep / "transitions.jsonl").read_text() == "[" * 200_000 + "\n"


def test_out_holding_a_fifo_as_its_log_is_refused_at_once(tmp_path: Path) -> None:
    """A FIFO as `transitions.jsonl` under `--out` hung the simulation for ever: its log's
    open waited for a reader (a device there took the log). Refused, naming it."""
    plan = _plan(tmp_path, "")
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "transitions.jsonl")
    cmd = [sys.executable, "-m", "ehp_fsm.cli", "simulate", str(plan), "--steps", "1"]
    done = subprocess.run(
        [*cmd, "--out", str(fifo)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2, done.stderr
    err = _one_error(done.stderr)
    assert f"{fifo / 'transitions.jsonl'} is a FIFO, not a file" in err, err
    assert "remove the FIFO" in err, err
