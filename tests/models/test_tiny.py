"""Tiny models are a real architecture's config with seeded weights, deterministic to the byte,
with a tokenizer whose ids agree with the built-in policy and the arithmetic task."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from ehp_fsm.cli import main
from ehp_fsm.models.load import ModelError, load_model
from ehp_fsm.models.tiny import TinyShape, build_tokenizer, init_model
from ehp_fsm.training.policy import BOS, EOS, PAD, encode
from ehp_fsm.training.task import ArithmeticTask


def test_same_seed_gives_byte_identical_weights_and_another_seed_does_not(tmp_path: Path) -> None:
    a = init_model(tmp_path / "a", arch="llama", seed=5)
    b = init_model(tmp_path / "b", arch="llama", seed=5)
    c = init_model(tmp_path / "c", arch="llama", seed=6)
    weights = [(d / "model.safetensors").read_bytes() for d in (a, b, c)]
    assert weights[0] == weights[1]
    assert weights[0] != weights[2]
    assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()


def test_init_leaves_the_callers_random_state_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expect = torch.rand(3)
    torch.manual_seed(123)
    init_model(tmp_path / "m", seed=1)
    assert torch.equal(torch.rand(3), expect)


@pytest.mark.parametrize(("arch", "model_type"), [("qwen3", "qwen3"), ("llama", "llama")])
def test_each_architecture_loads_and_runs_a_forward(tmp_path, arch, model_type) -> None:
    d = init_model(tmp_path / arch, arch=arch, seed=0, shape=TinyShape(num_hidden_layers=1))
    config = json.loads((d / "config.json").read_text())
    assert config["model_type"] == model_type
    assert (config["pad_token_id"], config["bos_token_id"], config["eos_token_id"]) == (0, 1, 2)
    loaded = load_model(d)
    ids = torch.tensor([loaded.tokenizer("3+4=").input_ids])
    logits = loaded.model(ids).logits
    assert logits.shape == (1, 5, len(loaded.tokenizer))
    assert torch.isfinite(logits).all()


def test_tokenizer_ids_agree_with_the_policy_and_the_task() -> None:
    tok = build_tokenizer()
    q = ArithmeticTask(max_operand=9).question(3)
    assert tuple(tok(q.text).input_ids) == q.prompt_ids
    assert tok("12+7=", add_special_tokens=False).input_ids == encode("12+7=")
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD, BOS, EOS)
    assert tok.decode([*encode("42"), EOS], skip_special_tokens=True) == "42"
    assert tok.unk_token_id == len(tok) - 1
    assert tok("a", add_special_tokens=False).input_ids == [tok.unk_token_id]
    chat = [{"role": "user", "content": "1+1="}]
    assert tok.apply_chat_template(chat, tokenize=False) == "1+1="


def test_a_directory_with_a_model_is_never_overwritten(tiny_dir: Path) -> None:
    before = (tiny_dir / "model.safetensors").read_bytes()
    with pytest.raises(ModelError, match="already holds a model"):
        init_model(tiny_dir, seed=99)
    assert (tiny_dir / "model.safetensors").read_bytes() == before


def test_bad_shapes_and_alphabets_are_refused() -> None:
    with pytest.raises(ModelError, match="not a multiple of num_attention_heads"):
        TinyShape(hidden_size=30, num_attention_heads=4)
    with pytest.raises(ModelError, match="distinct characters"):
        build_tokenizer("1123")


def test_cli_init_model_writes_a_loadable_model(tmp_path: Path, capsys) -> None:
    assert main(["init-model", str(tmp_path / "m"), "--arch", "llama", "--seed", "3"]) == 0
    assert "tiny llama model (seed 3)" in capsys.readouterr().out
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "llama"
    assert main(["init-model", str(tmp_path / "m")]) == 2
    assert "already holds a model" in capsys.readouterr().err
    (tmp_path / "f").write_text("mine")
    assert main(["init-model", str(tmp_path / "f")]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    assert (tmp_path / "f").read_text() == "mine"


def test_cli_init_model_under_a_file_names_it_as_no_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ehp-fsm init-model f/x` with `f` an existing file said "its folder f cannot hold it:
    File exists" (and, deeper, "Not a directory"): now that `f` is a file, not a folder, and
    what to do; `f` is left as it was. A FIFO on the path is named for what it is."""
    f = tmp_path / "f"
    f.write_text("mine")
    for dest in (f / "x", f / "x" / "y"):
        assert main(["init-model", str(dest)]) == 2
        err = capsys.readouterr().err
        assert f"cannot write the model directory {dest}: {f} is a file, not a folder" in err
        assert f"give a model directory path that is not under {f}" in err, err
        assert "File exists" not in err and "Not a directory" not in err, err
    assert f.read_text() == "mine" and sorted(tmp_path.iterdir()) == [f]
    os.mkfifo(tmp_path / "pipe")
    assert main(["init-model", str(tmp_path / "pipe" / "x")]) == 2
    assert f"{tmp_path / 'pipe'} is a FIFO, not a folder" in capsys.readouterr().err


def test_a_seed_outside_the_runs_range_is_refused(tmp_path: Path) -> None:
    """`ehp-fsm init-model DIR --seed 99999999999999999999` ended in torch's traceback
    ("Overflow when unpacking long long"); nothing is written."""
    for seed, why in ((-1, "negative"), (2**32, "too large"), (10**20, "too large")):
        with pytest.raises(ModelError, match=why):
            init_model(tmp_path / "m", seed=seed)
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize(
    ("name", "why"), [("", "it is empty"), ("  ", "it is empty"), ("a\x00", "NUL")]
)
def test_cli_init_model_refuses_a_blank_directory(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    name: str,
    why: str,
) -> None:
    """`ehp-fsm init-model ''` wrote the model into the current directory."""
    monkeypatch.chdir(tmp_path)
    assert main(["init-model", name]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ehp-fsm: error: init-model DIR ") and why in err, err
    assert "give the directory to create" in err and list(tmp_path.iterdir()) == [], err


def test_a_model_directory_appears_whole_or_not_at_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that dies half-way (here: the tokenizer's save raises, as a full disk or a kill
    would stop it) leaves no directory at the model's path: a run killed while it generated its
    model left one with a config and no tokenizer, which the next run took for its model and
    failed on. An existing empty directory (`init-model DIR`) is still written into."""
    from transformers import PreTrainedTokenizerFast

    def full_disk(*_: object, **__: object) -> None:
        raise OSError(28, "No space left on device")

    dest = tmp_path / "models" / "tiny"
    with monkeypatch.context() as m:
        m.setattr(PreTrainedTokenizerFast, "save_pretrained", full_disk)
        with pytest.raises(OSError, match="No space left"):
            init_model(dest)
    assert not dest.exists() and list(dest.parent.iterdir()) == []  # nor a temporary beside it
    init_model(dest)
    assert load_model(dest) is not None
    empty = tmp_path / "empty"
    empty.mkdir()
    init_model(empty)
    assert (empty / "config.json").is_file()


def test_a_model_directory_that_cannot_be_written_is_named_as_given(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`init-model /proc/x` (a folder no user may write): the error named the hidden
    `.tmp-x-<uuid>` directory it writes first, not the path asked for."""
    assert main(["init-model", "/proc/ehp-fsm-test", "--arch", "qwen3"]) == 2
    err = capsys.readouterr().err
    assert "cannot write the model directory /proc/ehp-fsm-test" in err, err
    assert ".tmp-" not in err, err
