"""load_model names the path, what is missing and what to do, before transformers is asked."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from ehp_fsm.models.load import ModelError, load_model


def test_loads_config_model_and_tokenizer_in_the_asked_dtype(tiny_dir: Path) -> None:
    loaded = load_model(tiny_dir, "bfloat16")
    assert loaded.model.dtype == torch.bfloat16
    assert loaded.model.training
    assert loaded.config.model_type == "qwen3"
    assert loaded.tokenizer.eos_token == "<eos>"


def _copy_without(src: Path, dest: Path, *names: str) -> Path:
    shutil.copytree(src, dest)
    for n in names:
        (dest / n).unlink()
    return dest


@pytest.mark.parametrize(
    ("remove", "needle", "fix"),
    [
        (("config.json",), "has no config.json", "init-model"),
        (("model.safetensors",), "has no weights", "save_pretrained"),
        (("tokenizer.json", "tokenizer_config.json"), "has no tokenizer", "tokenizer"),
    ],
)
def test_missing_pieces_are_named(tiny_dir, tmp_path, remove, needle, fix) -> None:
    d = _copy_without(tiny_dir, tmp_path / "m", *remove)
    with pytest.raises(ModelError, match=needle) as err:
        load_model(d)
    assert str(d) in str(err.value)
    assert fix in err.value.fix


def test_missing_directory_and_a_file_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist") as err:
        load_model(tmp_path / "nope")
    assert "ehp-fsm init-model" in err.value.fix
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ModelError, match="is not a directory"):
        load_model(f)


def test_unreadable_config_is_an_error_not_a_traceback(tiny_dir, tmp_path) -> None:
    d = _copy_without(tiny_dir, tmp_path / "m")
    (d / "config.json").write_text("{ not json")
    with pytest.raises(ModelError, match="cannot be loaded"):
        load_model(d)


def test_unknown_dtype_is_refused(tiny_dir: Path) -> None:
    with pytest.raises(ModelError, match="float64"):
        load_model(tiny_dir, "float64")
