"""`ehp-fsm simulate` as a user on a bad day (2026-12-05 review): each refusal names its flag,
why, and what to do, before anything is written; a fault hunt counts every fault it injected.
Real plans, real files and (for the read-only folder) a real process of another user; nothing
is mocked."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ehp_fsm.cli import main

HERE = Path(__file__).parent
GPU_PLAN = HERE.parents[1] / "examples" / "gpu-4x8.toml"
SRC = HERE.parents[1] / "src"


def test_a_hunt_whose_runs_the_faults_stopped_counts_their_faults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every seed's run stopped by its faults (no engine left to roll out): the hunt said "0
    injected in all" and "no fault was injected, so no failure was exercised ... give more
    --hosts or --steps", when the faults were what stopped every run."""
    plan = tmp_path / "faulty.toml"
    plan.write_text(GPU_PLAN.read_text() + "\n[simulate]\ngpu_fault_per_hour = 0.005\n")
    args = ["simulate", str(plan), "--faults", "heavy", "--seeds", "2", "--steps", "3"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "2 runs stopped by design" in out, out  # (the case this is about)
    assert "no fault was injected" not in out, out
    assert " 0 injected in all" not in out, out
    injected = int(out.split("heavy faults, ", 1)[1].split(" injected", 1)[0].replace(",", ""))
    assert injected > 0, out


@pytest.mark.parametrize(
    ("hosts", "said"),
    [
        ("0", "--hosts 0 is not a number of hosts: because a simulated cluster is the plan's"),
        ("-3", "--hosts -3 is not a number of hosts: because"),
        # (its fix said "give --hosts ≥ the plan's 4", and --hosts 2 and 3 run)
        ("1", "--hosts 1: the plan's first 1 hosts hold no rollout engine: because"),
    ],
)
def test_too_few_hosts_says_why_and_the_fewest_that_run(
    tmp_path: Path, hosts: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main(["simulate", str(GPU_PLAN), "--hosts", hosts, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert said in err and "Fix: give --hosts 2 or more" in err, err
    assert not out.exists()
    # and the fewest it names do run (gpu-4x8: the Core on n0, engines from n1 on)
    assert main(["simulate", str(GPU_PLAN), "--hosts", "2", "--steps", "1", "--out", str(out)]) == 0
    assert (out / "receipt.json").is_file()


def test_no_seeds_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", str(GPU_PLAN), "--seeds", "0"]) == 2
    err = capsys.readouterr().err
    assert "--seeds 0 is not a number of seeds: because a fault hunt runs one seed" in err, err
    assert "Fix: give --seeds 1 or more" in err


def test_out_under_a_file_is_refused_naming_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was "NotADirectoryError: Not a directory (…)", naming no flag."""
    (tmp_path / "afile").write_text("mine\n")
    out = tmp_path / "afile" / "sub"
    assert main(["simulate", str(GPU_PLAN), "--steps", "1", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert f"--out {out} cannot be made: because {tmp_path / 'afile'} is a file" in captured.err
    assert "Fix: give --out a folder" in captured.err
    assert captured.out == ""  # refused before the run's command line
    assert (tmp_path / "afile").read_text() == "mine\n"


def test_a_read_only_out_is_refused_naming_out_before_anything_runs() -> None:
    """A folder this user may not write in was refused only when the log was opened, after the
    command line was printed, with "Fix: pass a log_path in a folder this process can write"
    (an argument of the Python API, not a flag). Root writes anywhere, so as root the command
    runs as `nobody` through util-linux's `setpriv` (a real process of another user)."""
    prefix: list[str] = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        # (util-linux's, on every Debian: as root no folder is read-only without it)
        assert setpriv is not None, "as root a read-only folder needs setpriv (util-linux)"
        prefix = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
    top = Path(tempfile.mkdtemp(prefix="ehp-sim-ro-"))  # (pytest's tmp is this user's alone)
    try:
        top.chmod(0o755)
        ro = top / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        env = {**os.environ, "PYTHONPATH": str(SRC)}
        command = [*prefix, sys.executable, "-m", "ehp_fsm.cli", "simulate", str(GPU_PLAN)]
        for out in (ro, ro / "sub"):
            proc = subprocess.run(
                [*command, "--steps", "1", "--out", str(out)],
                capture_output=True,
                text=True,
                env=env,
                cwd=top,
                timeout=120,
                check=False,
            )
            assert proc.returncode == 2, proc
            assert f"--out {out} cannot be written: because this user may not write in {ro}" in (
                proc.stderr
            ), proc.stderr
            assert "Fix: give --out a folder you can write" in proc.stderr
            assert proc.stdout == ""  # refused before the run's command line
        assert list(ro.iterdir()) == []
    finally:
        (top / "ro").chmod(0o755)
        shutil.rmtree(top)


def test_files_of_the_users_in_out_are_refused_and_a_simulations_are_replaced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A summary.txt of the user's in `--out` was replaced without a word; a folder named
    timeline.png failed only after the whole simulation; a `--ehp both` after a single mode
    (and the reverse) left the other run's figures beside the new ones."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "summary.txt").write_text("my notes\n")
    args = ["simulate", str(GPU_PLAN), "--steps", "1"]
    assert main([*args, "--out", str(mine)]) == 2
    assert "holds summary.txt, which no simulation wrote" in capsys.readouterr().err
    assert (mine / "summary.txt").read_text() == "my notes\n"
    odd = tmp_path / "odd"
    (odd / "timeline.png").mkdir(parents=True)
    assert main([*args, "--out", str(odd)]) == 2
    err = capsys.readouterr()
    assert "timeline.png is a folder" in err.err and "transitions verified" not in err.out
    assert not (odd / "transitions.jsonl").exists()  # refused before anything ran
    mix = tmp_path / "mix"
    assert main([*args, "--ehp", "both", "--out", str(mix)]) == 0
    assert main([*args, "--ehp", "on", "--out", str(mix)]) == 0  # a simulation's folder
    assert not (mix / "comparison.txt").exists() and (mix / "summary.txt").is_file()
    assert main([*args, "--ehp", "both", "--out", str(mix)]) == 0
    assert not (mix / "summary.txt").exists() and not (mix / "transitions.jsonl").exists()
    assert (mix / "comparison.txt").is_file()


def test_the_default_ehp_mode_is_the_plans_and_the_pictures_repeat_byte_for_byte(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`[ehp] enabled = false` was simulated with EHP on (5 borrows), unsaid; the same seed gave
    another timeline-gpus.svg (its date, random clip ids)."""
    plan = tmp_path / "off.toml"
    text = GPU_PLAN.read_text().replace(
        'curve_keys = "keys/"', f'curve_keys = "{GPU_PLAN.parent}/keys/"'
    )
    assert "[ehp]\nenabled = true\n" in text
    plan.write_text(text.replace("[ehp]\nenabled = true\n", "[ehp]\nenabled = false\n", 1))
    assert main(["simulate", str(plan), "--steps", "1", "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "--ehp off" in out and "borrows: 0" in out, out
    assert (
        main(["simulate", str(plan), "--steps", "1", "--ehp", "on", "--out", str(tmp_path / "b")])
        == 0
    )
    assert (
        "note: the plan has [ehp] enabled = false; --ehp on simulates it" in capsys.readouterr().out
    )
    assert main(["simulate", str(GPU_PLAN), "--steps", "1", "--out", str(tmp_path / "c")]) == 0
    for name in ("timeline-gpus.svg", "timeline-gpus.png", "timeline.png"):
        again = tmp_path / "again"
        shutil.rmtree(again, ignore_errors=True)
        assert main(["simulate", str(GPU_PLAN), "--steps", "1", "--out", str(again)]) == 0
        assert (again / name).read_bytes() == (tmp_path / "c" / name).read_bytes(), name


def test_borrows_that_fail_before_training_are_counted_and_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An engine stop (5 s) and a finalizer (30 s) longer than the Hybrid's `requested`
    deadline (30 s) fail a whole wave of borrows: the summary said "borrows: 10" and nothing of
    the 10 that failed, nor did the receipt."""
    import json

    text = GPU_PLAN.read_text().replace(
        'curve_keys = "keys/"', f'curve_keys = "{GPU_PLAN.parent}/keys/"'
    )
    plan = tmp_path / "slow-finalizer.toml"
    plan.write_text(text + "\n[simulate]\nsequence_tokens_per_s = 500.0\nfinalizer_s = 30.0\n")
    out = tmp_path / "out"
    args = ["simulate", str(plan), "--hosts", "8", "--steps", "3", "--out", str(out)]
    assert main(args) == 0
    said = capsys.readouterr().out
    receipt = json.loads((out / "receipt.json").read_text())
    assert receipt["failed_borrows"] > 0 and receipt["borrows"] > 0, receipt
    assert f"{receipt['failed_borrows']} more failed before training" in said, said


def test_hosts_not_a_multiple_of_the_plans_say_how_the_mix_moved(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--hosts 5` of a 4-host plan moved the Core from 25 % to 40 % of the GPUs, unsaid (the
    "multiple of 4" hint was in refusals only)."""
    args = ["simulate", str(GPU_PLAN), "--steps", "1", "--out", str(tmp_path / "o")]
    assert main([*args, "--hosts", "5"]) == 0
    said = capsys.readouterr().out
    assert "note: --hosts 5 is not a multiple of the plan's 4 hosts: the Core holds 40% of the" in (
        said
    ), said
    assert main([*args, "--hosts", "8"]) == 0
    assert "not a multiple" not in capsys.readouterr().out
