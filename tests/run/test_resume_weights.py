"""`--resume` holds the KL reference's weights: with `grpo.kl_coef > 0` the reference is the
model folder's weights, loaded anew by a resume (the policy comes from the saved state)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from ehp_fsm.plan import load_plan
from ehp_fsm.run.resume import MODEL_WEIGHTS, ResumeError, check_resumed_plan, record_plan

ROOT = Path(__file__).resolve().parents[2]


def _plan(tmp: Path, model: Path, kl: float) -> Path:
    text = (ROOT / "examples" / "short.toml").read_text()
    text = text.replace('train = "data/', f'train = "{ROOT}/examples/data/')
    text = text.replace('path = "../runs/models/tiny-qwen3"', f'path = "{model}"')
    text = text.replace('generate = "qwen3"\n', "")
    text = text.replace("[grpo]\n", f"[grpo]\nkl_coef = {kl}\n")
    path = tmp / f"plan-{kl}.toml"
    path.write_text(text)
    return path


def _scale_embeddings(model: Path, by: float) -> None:
    tensors = load_file(model / "model.safetensors")
    name = next(n for n in tensors if "embed_tokens" in n)
    tensors[name] = tensors[name] * by
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("kl", [0.5, 0.0])
def test_a_resume_refuses_other_weights_in_the_model_folder_when_kl_is_on(
    tmp_path: Path, tiny_model_dir: Path, kl: float
) -> None:
    """Other weights put in `[model] path` between a kill and its resume (config and
    tokenizer the same) were taken without a word: the KL term was then measured against them
    (an ML user's run: ref KL 79.8 on the resumed steps where the run had 0.04, the loss +39.8
    where it was +0.02). With `kl_coef > 0` the start records a digest of the weights and a
    resume refuses others, naming them; with `kl_coef = 0` the folder's weights are not read
    by a resume, so they are not held."""
    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    plan = _plan(tmp_path, model, kl)
    run_dir = tmp_path / "run"
    record_plan(run_dir, load_plan(plan))
    assert check_resumed_plan(run_dir, load_plan(plan)) == []
    _scale_embeddings(model, 50.0)
    if kl == 0.0:
        assert check_resumed_plan(run_dir, load_plan(plan)) == []
        return
    with pytest.raises(ResumeError) as err:
        check_resumed_plan(run_dir, load_plan(plan))
    said = str(err.value)
    assert f"{MODEL_WEIGHTS}: the weights in [model] path are not those the run started" in said
    assert "put back the weights the run started from in [model] path" in said, said
    shutil.copyfile(tiny_model_dir / "model.safetensors", model / "model.safetensors")
    assert check_resumed_plan(run_dir, load_plan(plan)) == []  # put back: it resumes


def test_a_kl_term_dropped_at_the_resume_is_named_not_the_weights(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """`kl_coef` from 0.5 to 0 between the kill and the resume: the refusal is the change of
    `grpo.kl_coef`; the weights, held only with a KL term, are not said to differ (a reviewer's
    find: "the weights ... are not those the run started from (... -> (not set))")."""
    record_plan(tmp_path / "run", load_plan(_plan(tmp_path, tiny_model_dir, 0.5)))
    with pytest.raises(ResumeError) as err:
        check_resumed_plan(tmp_path / "run", load_plan(_plan(tmp_path, tiny_model_dir, 0.0)))
    said = str(err.value)
    assert "grpo.kl_coef: 0.5 -> 0.0" in said and MODEL_WEIGHTS not in said, said
