"""`ehp-fsm init-model DIR` writes into a new or empty directory only: into a folder of other
files it overwrote weights ("init-model never overwrites weights", its own error said)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ehp_fsm.cli import main


@pytest.mark.parametrize("held", ["model.safetensors", "notes.txt"])
def test_init_model_refuses_a_directory_that_holds_other_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], held: str
) -> None:
    """A model copied without its config.json (its weights were replaced by random ones), or
    `init-model .` in a project folder (the model's files mixed into it)."""
    (tmp_path / held).write_text("mine")
    assert main(["init-model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path} is not empty (it holds {held!r})" in err, err
    assert "choose an empty or new directory" in err, err
    assert [p.name for p in tmp_path.iterdir()] == [held]
    assert (tmp_path / held).read_text() == "mine"
