"""A required key written with a typo is named with the key it looks like (`group_sise = 8`
was answered "`grpo.group_size` is required. Fix: add `group_size = ...`", the typo unnamed,
while an optional key's typo got "did you mean"); `ehp-fsm spec` of an unknown machine says
why as every refusal does."""

from __future__ import annotations

from pathlib import Path

import pytest

from ehp_fsm.cli import main
from ehp_fsm.errors import PlanError
from ehp_fsm.plan import load_plan

LOCAL = Path(__file__).resolve().parents[2] / "examples" / "local.toml"


def test_a_required_key_misspelled_is_named_with_its_typo(tmp_path: Path) -> None:
    plan = tmp_path / "typo.toml"
    plan.write_text(LOCAL.read_text().replace("group_size = 16", "group_sise = 16"))
    with pytest.raises(PlanError) as err:
        load_plan(plan)
    msg = str(err.value)
    assert "grpo.group_size" in msg and "`group_sise`" in msg, msg
    assert "Rename `group_sise` to `group_size`" in msg, msg


def test_a_required_key_simply_missing_is_told_to_be_added(tmp_path: Path) -> None:
    plan = tmp_path / "missing.toml"
    plan.write_text(LOCAL.read_text().replace("group_size = 16", ""))
    with pytest.raises(PlanError, match=r"it is required\. Fix: add `group_size = \.\.\.`"):
        load_plan(plan)


def test_spec_of_an_unknown_machine_says_why_and_what_to_do(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["spec", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert "unknown machine 'nosuch': because" in err and "Fix: use one of" in err, err


def test_fewer_groups_a_step_than_core_replicas_is_refused(tmp_path: Path) -> None:
    """`check` said valid for G = 1 on a Core of DP 2, and every step's partition refused it
    ("1 groups cannot give work to 2 live replicas"). Found by the fault-hunt review."""
    text = LOCAL.read_text().replace("prompts_per_step = 16", "prompts_per_step = 1")
    text = text.replace('id = "h0"\ngpus = 1', 'id = "h0"\ngpus = 2', 1)
    text = text.replace('dp = 1\ngpus = ["h0:g0"]', 'dp = 2\ngpus = ["h0:g0", "h0:g1"]', 1)
    assert 'dp = 2\ngpus = ["h0:g0", "h0:g1"]' in text and 'id = "h0"\ngpus = 2' in text
    plan = tmp_path / "under.toml"
    plan.write_text(text)
    with pytest.raises(PlanError, match=r"grpo.prompts_per_step.*at least 2"):
        load_plan(plan)
