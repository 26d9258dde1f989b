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
