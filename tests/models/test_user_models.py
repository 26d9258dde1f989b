"""A user's own model directory as `ehp-fsm check` takes it: a checkpoint that is not a causal
LM (a reward model's classifier, a bare base model) is refused as such, whatever its weights
count; the causal LMs of real architectures pass."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ehp_fsm.errors import PlanError
from ehp_fsm.plan import load_plan
from ehp_fsm.run.inputs import prepare

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _save(tmp: Path, kind: str, *, tied: bool) -> Path:
    """A tiny Llama of `kind` ("lm", "classifier", "base") with the project's tokenizer."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        LlamaForSequenceClassification,
        LlamaModel,
    )

    from ehp_fsm.models.tiny import build_tokenizer

    tok = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=tied, num_labels=1,
    )  # fmt: skip
    model_class = {
        "lm": LlamaForCausalLM,
        "classifier": LlamaForSequenceClassification,
        "base": LlamaModel,
    }[kind]
    torch.manual_seed(0)
    out = tmp / f"{kind}-{'tied' if tied else 'untied'}"
    model_class(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _plan(tmp: Path, model: Path) -> Path:
    text = (EXAMPLES / "short.toml").read_text()
    text = text.replace('path = "../runs/models/tiny-qwen3"', f'path = "{model}"')
    text = text.replace('generate = "qwen3"\n', "")
    text = text.replace('train = "data/', f'train = "{EXAMPLES}/data/')
    text = text.replace('log = "runs/', f'log = "{tmp}/runs/')
    plan = tmp / "plan.toml"
    plan.write_text(text)
    return plan


@pytest.mark.parametrize(
    ("kind", "tied", "named"),
    [
        ("classifier", True, "LlamaForSequenceClassification, a classifier"),
        ("classifier", False, "LlamaForSequenceClassification, a classifier"),
        ("base", False, "LlamaModel, the base model without its language-model head"),
    ],
)
def test_a_checkpoint_that_is_not_a_causal_lm_is_refused_as_such(
    tmp_path: Path, kind: str, tied: bool, named: str
) -> None:
    """A reward model (`…ForSequenceClassification`) or a bare base model (`LlamaModel`) at
    `[model] path`: with tied embeddings the classifier passed `check` (its weights hold the
    causal LM's and a score head more) and the run trained it as a policy whose LM head was
    its embeddings; untied, it and the base model were refused as "its config.json describes
    12,640 parameters and its weights hold 11,008 elements", told to "use the config.json that
    came with these weights" — the config was right, the checkpoint the wrong kind."""
    plan = load_plan(_plan(tmp_path, _save(tmp_path, kind, tied=tied)))
    with pytest.raises(PlanError) as err:
        prepare(plan, create=False)
    said = str(err.value)
    assert err.value.key == "model.path" and "is not a causal LM" in said, said
    assert named in said and "ForCausalLM" in err.value.fix, said


def test_causal_lms_of_real_architectures_are_causal_lms(tmp_path: Path) -> None:
    """The check names no causal LM's checkpoint (nor one it cannot know: remote code, a
    multimodal model, no `architectures`), and a Llama causal LM passes `check` whole."""
    from ehp_fsm.models.load import not_causal_lm

    for names in (
        ["Qwen3ForCausalLM"],
        ["LlamaForCausalLM"],
        ["GPT2LMHeadModel"],
        ["MistralForCausalLM"],
        ["GemmaForCausalLM"],
        ["Qwen2_5_VLForConditionalGeneration"],
        ["MyOwnForCausalLM"],
        None,
        [],
    ):
        assert not_causal_lm(names) is None, names
    assert not_causal_lm(["Qwen2ForRewardModel"]) is not None
    inputs = prepare(load_plan(_plan(tmp_path, _save(tmp_path, "lm", tied=False))), create=False)
    assert inputs.model_dir.name == "lm-untied"


def test_a_hostile_architectures_list_makes_a_short_refusal() -> None:
    """`architectures` of 200,000 classifier names (or one name of a million characters) made
    a refusal of 14 MB (1 MB), all printed on `ehp-fsm check`'s one error line. Each class is
    named once, at most three, each within 80 characters; non-strings are not judged."""
    from ehp_fsm.models.load import not_causal_lm

    many = [f"Net{i}ForSequenceClassification" for i in range(200_000)]
    said = not_causal_lm(many + ["Qwen2ForSequenceClassification"] * 1000)
    assert said is not None and len(said) < 400, len(said or "")
    assert "Net0ForSequenceClassification" in said and "and 199,998 more" in said, said
    same = not_causal_lm(["Qwen2ForSequenceClassification"] * 1000 + ["LlamaModel"])
    assert same is not None and same.count("Qwen2ForSequenceClassification") == 1, same
    long = not_causal_lm(["X" * 1_000_000 + "ForTokenClassification"])
    assert long is not None and len(long) < 300 and "1,000,022 characters" in long, long
    for hostile in ([1, 2], [None], [["LlamaModel"]], "LlamaModel", {"a": 1}, [True]):
        assert not_causal_lm(hostile) is None, hostile


@pytest.mark.parametrize("what", ["nested", "huge"])
def test_a_hostile_config_json_is_refused_as_model_path_not_a_traceback(
    tmp_path: Path, what: str
) -> None:
    """A model's config.json is anyone's file (a model downloaded from a hub): one nested
    200,000 deep raised a RecursionError traceback out of `check`, and one of gigabytes was
    read whole. Both are refused as `model.path`, the size told before anything is read."""
    from ehp_fsm.errors import PlanError
    from ehp_fsm.run.inputs import CONFIG_MAX, _model_dir

    model = tmp_path / "model"
    model.mkdir()
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(1)}, str(model / "model.safetensors"))
    (model / "tokenizer.json").write_text("{}")
    config = model / "config.json"
    if what == "nested":
        config.write_text("[" * 200_000 + "]" * 200_000)
    else:
        with config.open("wb") as fh:  # sparse: its size, without writing it
            fh.truncate(CONFIG_MAX + 1)
    with pytest.raises(PlanError) as err:
        _model_dir(model, "plan.toml")
    said = str(err.value)
    assert "config.json cannot be read as JSON" in said, said
    assert ("nests deeper" if what == "nested" else "larger than") in said, said
