"""A user's own model folder whose config.json was edited by hand, as `ehp-fsm check` (`prepare`)
takes it: a field of the wrong type is named as the config's, not the tokenizer's, and a config
whose tensors take other shapes than the weights hold is refused before anything starts (it
passed, and every trainer then failed to start). Real folders written by `init-model` and
`save_pretrained`; nothing mocked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from ehp_fsm.errors import PlanError
from ehp_fsm.models.load import ModelError, load_model, weight_shapes, weights_problem
from ehp_fsm.plan import load_plan
from ehp_fsm.run.inputs import prepare
from tests.models.test_user_models import _plan


def _edited(tiny_dir: Path, tmp: Path, **fields: Any) -> Path:
    """A copy of the tiny model whose config.json has `fields` set."""
    out = tmp / "model"
    shutil.copytree(tiny_dir, out)
    config = json.loads((out / "config.json").read_text())
    config.update(fields)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _refusal(tmp: Path, model: Path) -> PlanError:
    with pytest.raises(PlanError) as err:
        prepare(load_plan(_plan(tmp, model)), create=False)
    return err.value


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_hidden_layers", "2"), ("vocab_size", "19"), ("hidden_size", 64.0)],
)
def test_a_config_field_of_the_wrong_type_is_named_as_the_configs(
    tiny_dir: Path, tmp_path: Path, field: str, value: object
) -> None:
    """`"num_hidden_layers": "2"` in config.json was refused as "the tokenizer of DIR cannot be
    loaded (transformers said: Validation error for field 'num_hidden_layers':\\n ...)", told
    to point at a folder save_pretrained wrote: the user looked at the tokenizer's files."""
    err = _refusal(tmp_path, _edited(tiny_dir, tmp_path, **{field: value}))
    assert err.key == "model.path"
    assert "config.json cannot be read" in err.why, err.why
    assert field in err.why
    assert "tokenizer" not in err.why
    assert "\\n" not in str(err) and "\n" not in err.why  # transformers' lines, on one
    assert "config.json" in err.fix


@pytest.mark.parametrize(
    ("fields", "tensor"),
    [
        ({"num_attention_heads": 3}, "q_proj.weight"),  # 3 heads × head_dim 16 = 48 rows, not 64
        ({"intermediate_size": 96}, "gate_proj.weight"),  # fewer parameters than the weights
        ({"num_key_value_heads": 1}, "k_proj.weight"),
    ],
)
def test_a_config_whose_shapes_are_not_the_weights_is_refused_by_check(
    tiny_dir: Path, tmp_path: Path, fields: dict[str, int], tensor: str
) -> None:
    """Each edit describes no more parameters than the weights hold, so the count passed:
    `check` said valid, and the run's trainers then failed to start ("You set
    `ignore_mismatched_sizes` to `False`, thus raising an error")."""
    model = _edited(tiny_dir, tmp_path, **fields)
    err = _refusal(tmp_path, model)
    assert err.key == "model.path"
    assert "does not hold the model its config.json describes" in err.why
    assert tensor in err.why and "of shape" in err.why, err.why
    assert err.fix == "use the config.json that came with these weights"
    with pytest.raises(ModelError, match=tensor):  # the trainers' loader says the same
        load_model(model)


def test_folders_save_pretrained_wrote_still_pass(tiny_dir: Path, tmp_path: Path) -> None:
    """No false refusal: the shapes agree for the tiny model, a sharded copy of it (an index
    and four shards) and an untied Llama (its lm_head a tensor of its own)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ehp_fsm.models.tiny import init_model

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_dir).save_pretrained(sharded, max_shard_size="100KB")
    AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(sharded)
    assert (sharded / "model.safetensors.index.json").is_file()
    llama = init_model(tmp_path / "llama", arch="llama", seed=1)
    untied = tmp_path / "untied"
    model = AutoModelForCausalLM.from_pretrained(llama, tie_word_embeddings=False)
    model.save_pretrained(untied)
    AutoTokenizer.from_pretrained(llama).save_pretrained(untied)
    for folder in (tiny_dir, sharded, llama, untied):
        config = AutoConfig.from_pretrained(folder)
        assert weights_problem(config, weight_shapes(folder)) is None, folder
        (tmp_path / "runs").mkdir(exist_ok=True)
        prepare(load_plan(_plan(tmp_path, folder)), create=False)  # no refusal


def _with_new_end_token(tiny_dir: Path, out: Path, *, resize: bool) -> Path:
    """The tiny model with an end-of-text token added to its tokenizer and named as the
    eos_token_id of config.json and generation_config.json (a chat fine-tune's `<|end|>`), its
    embeddings resized to the tokenizer or not."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    tok.add_special_tokens({"eos_token": "<|end|>"})
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    if resize:
        model.resize_token_embeddings(len(tok))
    model.config.eos_token_id = tok.eos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_a_model_whose_every_stop_token_is_outside_its_vocabulary_is_refused(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """`<|end|>` added to the tokenizer as its eos without `resize_token_embeddings`: `check`
    said valid ("responses end at token 19"), and the engines, which sample only the model's
    19 ids, never ended a response — each ran to max_response_len, none well formed."""
    bad = _with_new_end_token(tiny_dir, tmp_path / "unresized", resize=False)
    err = _refusal(tmp_path, bad)
    assert err.key == "model.path"
    assert "no response of" in err.why and "can end" in err.why
    assert "19 ('<|end|>')" in err.why and "vocabulary of 19 ids" in err.why, err.why
    assert "resize_token_embeddings" in err.fix
    # resized as the fix says: it passes
    good = _with_new_end_token(tiny_dir, tmp_path / "resized", resize=True)
    (tmp_path / "runs").mkdir(exist_ok=True)
    inputs = prepare(load_plan(_plan(tmp_path, good)), create=False)
    assert 19 in inputs.task.stop_ids


def test_a_model_folder_without_tokenizer_files_is_told_so(tiny_dir: Path, tmp_path: Path) -> None:
    """With tokenizer.json left out of the folder, transformers' error spoke of sentencepiece
    and tiktoken ("You need to have sentencepiece or tiktoken installed to convert a slow
    tokenizer"): the user installed packages. Now the missing files are named."""
    model = _edited(tiny_dir, tmp_path)
    (model / "tokenizer.json").unlink()
    err = _refusal(tmp_path, model)
    assert err.key == "model.path"
    assert "has no tokenizer: none of tokenizer.json, " in err.why, err.why
    assert "sentencepiece" not in err.why and "save_pretrained" in err.fix
