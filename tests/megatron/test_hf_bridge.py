"""A Megatron lane built from a Hugging Face directory through mbridge is the HF model.

One real spawned process runs Megatron-Core on CPU (`scenario_hf.py`); this process holds the
Hugging Face side with transformers. What is shown:
- mbridge's conversions round-trip: the GPTModel's weights exported to HF names equal the
  directory's safetensors bit for bit (HF config → TransformerConfig, HF weights → GPTModel,
  GPTModel → HF tensors, with Megatron's local layer spec when Transformer Engine is missing);
- the GRPO objective applies on the Megatron path: the delivery's loss, weight (response
  tokens under `token_mean`), clip count and gradient match the same objective on the HF model
  in plain torch, across two micro-batches of unequal token counts, with clip-higher and k3 KL;
- the revision a Megatron lane writes (the run's `RevisionStore`) loads with
  `from_pretrained`, nothing missing or unexpected, and computes the lane's own logits;
- at TP 2 (a second world of two processes, as the trainer pool builds a TP lane) the same
  round trip is bit-exact (the vocabulary of 19, padded by mbridge to split over TP, comes
  back whole), the loss is the TP 1 lane's, and one optimizer step lands on the TP 1 lane's
  weights to rounding — the QK layernorms included, whose partial gradients per TP rank
  Megatron's own TP sum adds up.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ehp_fsm.models.tiny import init_model
from ehp_fsm.training.grpo import replica_loss
from tests.megatron.harness import load, run_worlds
from tests.megatron.scenario_hf import batch, objective, probe, scenario, scenario_tp2

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = tmp_path_factory.mktemp("megatron-hf")
    init_model(path / "model", seed=0)
    run_worlds([("hf", 1, scenario), ("tp2", 2, scenario_tp2)], path, timeout=240)
    return path


def _hf_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    auto: Any = AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=torch.float32)


def test_mbridge_round_trip_is_bit_exact(out: Path) -> None:
    source = load_file(out / "model" / "model.safetensors")
    exported = load(out, "hf.initial")
    assert exported.keys() == source.keys()
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor), name


def test_a_tied_model_leaves_the_next_bridges_output_layer_its_own(out: Path) -> None:
    """mbridge's Qwen2/Qwen3 bridge maps a tied model's output layer to the embedding by
    writing into its class: a bridge of an untied model built after it in the same process
    then read and exported `output_layer.weight` as `model.embed_tokens.weight`."""
    names = load(out, "hf.untied_output")
    assert names == {"untied": ["lm_head.weight"], "class": ["lm_head.weight"]}, names


def test_the_objective_applies_on_the_megatron_path(out: Path) -> None:
    got = load(out, "hf.delivery")
    model = _hf_model(out / "model")
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    b = batch()
    want = replica_loss(model, b, objective(), reference=reference)  # type: ignore[arg-type]
    assert got["weight"] == want.weight == b.units("token_mean")  # type: ignore[attr-defined]
    assert got["tokens"] == want.metrics.tokens
    assert got["clipped"] == want.metrics.clipped > 0  # the clipped branch was taken
    assert got["ratio_sum"] == pytest.approx(want.metrics.ratio_sum, rel=1e-5)
    assert got["loss"] == pytest.approx(float(want.loss.detach()), rel=1e-5, abs=1e-7)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(want.loss, [p for p in model.parameters() if p.requires_grad])
    assert sorted(got["grads"]) == sorted(names)
    for name, g in zip(names, grads, strict=True):
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-7, msg=name)


def test_the_revision_loads_with_from_pretrained(out: Path) -> None:
    from transformers import AutoModelForCausalLM

    auto: Any = AutoModelForCausalLM
    revision = out / "revisions" / "r00000001"
    assert (revision / "manifest.json").is_file()
    model, info = auto.from_pretrained(revision, dtype=torch.float32, output_loading_info=True)
    assert info["missing_keys"] in ([], set()) and info["unexpected_keys"] in ([], set()), info
    with torch.no_grad():
        logits = model(probe()).logits
    torch.testing.assert_close(logits, load(out, "hf.logits"), rtol=1e-4, atol=1e-5)
    # the step moved the weights: the revision is not the base model
    assert not torch.allclose(logits, _hf_model(out / "model")(probe()).logits.detach())


def test_tp2_round_trip_is_bit_exact(out: Path) -> None:
    source = load_file(out / "model" / "model.safetensors")
    exported = load(out, "tp2.initial")
    assert exported.keys() == source.keys()
    assert source["model.embed_tokens.weight"].shape[0] % 2  # the vocabulary needed padding
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor), name


def test_tp2_trains_as_tp1(out: Path) -> None:
    tp1, tp2 = load(out, "hf.delivery"), load(out, "tp2.delivery")
    assert tp2["weight"] == tp1["weight"]
    assert tp2["loss"] == pytest.approx(tp1["loss"], rel=1e-5, abs=1e-7)
    after = load_file(out / "revisions" / "r00000001" / "model.safetensors")
    stepped = load(out, "tp2.stepped")
    assert stepped.keys() == after.keys()
    before = load_file(out / "model" / "model.safetensors")
    for name, tensor in after.items():
        assert not torch.equal(stepped[name], before[name]), name  # every tensor stepped
        # lr 1e-3: a missing TP sum (a QK norm's partial gradient) is off by ~2e-3
        torch.testing.assert_close(stepped[name], tensor, rtol=0, atol=2e-5, msg=name)
    torch.testing.assert_close(
        load(out, "tp2.logits"), load(out, "hf.logits"), rtol=1e-4, atol=1e-5
    )
