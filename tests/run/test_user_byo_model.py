"""A user's own Hugging Face model directory: what `check` must refuse before `run` starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from ehp_fsm.cli import main
from tests.run.test_user_plan_inputs import EXAMPLES, _plan


def test_a_pytorch_model_bin_model_served_by_embedded_engines_is_refused_by_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The embedded engines start from `[model] path` and load safetensors only: a
    `pytorch_model.bin` model on the torch backend passed `check`, then every engine failed to
    start ("has no safetensors weights") and the run ended at step 0. Refused now by `check`
    and `run`, naming `model.path`, before anything starts."""
    import torch
    from safetensors.torch import load_file

    from ehp_fsm.models.tiny import init_model

    model = init_model(tmp_path / "bin-model", arch="llama")
    torch.save(load_file(model / "model.safetensors"), model / "pytorch_model.bin")
    (model / "model.safetensors").unlink()
    plan = _plan(tmp_path, model=f'path = "{model}"')
    plan.write_text(plan.read_text().replace('generate = "qwen3"\n', ""))  # the user's own
    assert f'path = "{model}"' in plan.read_text()
    for command in ("check", "run"):
        assert main([command, str(plan)]) == 2, command
        err = capsys.readouterr().err
        assert "plan key `model.path` is invalid" in err, err
        assert "pytorch_model.bin" in err and "embedded engines" in err, err
        assert "Traceback" not in err, err
    assert not (tmp_path / "run" / "transitions.jsonl").exists()  # nothing was started


def test_a_models_sampling_defaults_are_not_what_the_engines_sample_with(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model's generation_config.json with sampling defaults (Qwen3's: temperature 0.6,
    top_p 0.95, top_k 20), or `[sglang] args = ["--preferred-sampling-params", ...]`: a
    request set only `temperature`, so what else shaped the engines' distribution was up to
    the server's defaults — SGLang merges its preferred params under every request's own, the
    embedded engine ignored both — while the loss takes π_θ as the softmax at the temperature
    over the whole vocabulary. Every request now pins the rest of the distribution, and
    `check` says the model's defaults are not used."""
    import json

    from ehp_fsm.models.tiny import init_model
    from ehp_fsm.plan import load_plan
    from ehp_fsm.run.inputs import prepare

    model = init_model(tmp_path / "model", arch="qwen3")
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
                "repetition_penalty": 1.1}  # fmt: skip
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen, **defaults}))
    plan = _plan(tmp_path, model=f'path = "{model}"')
    plan.write_text(plan.read_text().replace('generate = "qwen3"\n', ""))
    params = prepare(load_plan(plan), create=False).task.sampling_params(7)
    preferred = {**defaults, "frequency_penalty": 0.5, "presence_penalty": 0.5}
    effective = {**preferred, **params}  # SGLang: the request's own keys win
    assert effective["temperature"] == 1.0 and effective["top_p"] == 1.0, effective
    assert effective["top_k"] == -1 and effective["min_p"] == 0.0, effective
    assert effective["repetition_penalty"] == 1.0, effective
    assert effective["frequency_penalty"] == effective["presence_penalty"] == 0.0, effective
    assert main(["check", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "samples at temperature 1 over the whole vocabulary" in out, out
    assert "generation_config.json's sampling defaults (" in out, out
    assert "top_p 0.95" in out and "are not used" in out, out


def test_a_prompt_with_a_token_the_model_has_no_embedding_for_is_refused_by_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tokenizer given a token the model was never resized for (`add_tokens` without
    `resize_token_embeddings`), and a prompt holding it: `check` said valid; every engine
    refused each request with HTTP 400 ("input_ids contain ids outside the vocabulary"), and
    the run dispatched the same groups again and again — 12,800 refusals logged in 200 s, no
    step, no word of why — until `[deadlines.run] rollout` (300 s) stopped it, naming no
    cause. Refused now by `check` and `run`, naming the line, the token and the fix."""
    from transformers import AutoTokenizer

    from ehp_fsm.models.tiny import init_model

    model = init_model(tmp_path / "model", arch="llama")
    tok = AutoTokenizer.from_pretrained(model)
    vocab = len(tok)
    tok.add_tokens(["<x>"])  # id `vocab`: one past the model's embedding rows
    tok.save_pretrained(model)
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n{"prompt": "1+<x>=", "label": "2"}\n')
    plan = _plan(tmp_path, model=f'path = "{model}"')
    text = plan.read_text().replace('generate = "qwen3"\n', "")
    plan.write_text(text.replace(f'train = "{EXAMPLES}/data/add-0-4.jsonl"', f'train = "{data}"'))
    assert f'train = "{data}"' in plan.read_text()
    for command in ("check", "run"):
        assert main([command, str(plan)]) == 2, command
        err = capsys.readouterr().err
        assert f"dataset {data}:2 cannot be used" in err, err
        assert f"token {vocab} ('<x>')" in err and f"vocabulary of {vocab}" in err, err
        assert "resize_token_embeddings" in err and "Traceback" not in err, err
    assert not (tmp_path / "run" / "transitions.jsonl").exists()  # nothing was started
