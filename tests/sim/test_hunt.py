"""The fault hunt: many seeds under heavy faults with invariants at every event; the first seed
that breaks one is reported with the command that reproduces it. The planted-bug test is the
proof the hunt can fail: with the engines' `release_gpus` effect switched off (a bug of the
kind the design lists: a stopped owner that keeps its GPUs), the first engine death leaks."""

from __future__ import annotations

from pathlib import Path

import pytest

from ehp_fsm.cli import main
from ehp_fsm.core import effects
from ehp_fsm.core.transition import Act
from ehp_fsm.plan import load_plan
from ehp_fsm.sim.hunt import hunt

HEAVY = Path(__file__).parent / "train_heavy.toml"


def test_heavy_faults_over_seeds_break_no_invariant(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "simulate",
            str(HEAVY),
            "--hosts",
            "8",
            "--steps",
            "12",
            "--faults",
            "heavy",
            "--seeds",
            "3",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "fault hunt: 3 seeds, no invariant broken" in out
    injected = int(out.split("heavy faults, ")[1].split(" injected in all")[0].replace(",", ""))
    assert injected > 0 and "no fault was injected" not in out, out


def test_a_hunt_that_injected_no_fault_says_it_exercised_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A hunt whose runs saw no fault (rates of zero here; at the default rates, a few hosts
    over a few virtual minutes) proved nothing about failures: it said "no invariant broken"
    alone, as if it had."""
    text = HEAVY.read_text(encoding="utf-8").replace(
        "[simulate]\n",
        "[simulate]\ngpu_fault_per_hour = 0.0\nagent_silence_per_hour = 0.0\n"
        "slow_node_fraction = 0.0\n",
    )
    plan = tmp_path / "plan.toml"
    plan.write_text(text, encoding="utf-8")
    argv = ["simulate", str(plan), "--hosts", "4", "--steps", "2", "--faults", "heavy"]
    assert main([*argv, "--seeds", "2"]) == 0
    out = capsys.readouterr().out
    assert "(heavy faults, 0 injected in all;" in out, out
    assert "no fault was injected, so no failure was exercised" in out, out


def test_a_planted_leak_is_found_with_its_seed_and_command(monkeypatch: pytest.MonkeyPatch) -> None:
    def keep_gpus(act: Act) -> None:
        return None  # the bug: a failed or stopped owner hands no GPU to the finalizer

    monkeypatch.setitem(effects.EFFECTS, "release_gpus", keep_gpus)
    found = hunt(
        load_plan(HEAVY),
        plan_path="tests/sim/train_heavy.toml",
        hosts=4,
        steps=12,
        seeds=range(0, 5),
    )
    assert found.failing_seed is not None
    assert "a leak" in found.reason
    assert found.command == (
        f"ehp-fsm simulate tests/sim/train_heavy.toml --hosts 4 --steps 12 --seed "
        f"{found.failing_seed} --faults heavy --ehp on"
    )


def test_a_crash_under_faults_is_found_with_its_seed_and_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A controller that raises (here: the effect that hands a stopped owner's GPUs to the
    finalizer) ended the hunt in a traceback naming neither the seed nor the command."""

    def crash(act: Act) -> None:
        raise RuntimeError("planted")

    monkeypatch.setitem(effects.EFFECTS, "release_gpus", crash)
    found = hunt(load_plan(HEAVY), plan_path="my plan.toml", hosts=4, steps=12, seeds=range(0, 5))
    assert found.failing_seed is not None
    assert found.reason.startswith("RuntimeError: planted (raised by"), found.reason
    assert found.command == (
        f"ehp-fsm simulate 'my plan.toml' --hosts 4 --steps 12 --seed {found.failing_seed} "
        "--faults heavy --ehp on"
    )
