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
