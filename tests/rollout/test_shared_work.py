"""The embedded engine's shared forwards: requests whose next forward would be identical run it
once, and every request still gets exactly what it gets alone.

In-process `EngineCore` on the session's tiny Hugging Face model (no HTTP: what is counted is the
model's forward passes, through a forward hook on the real module).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ehp_fsm.rollout.engine import EngineCore, SamplingParams

PROMPT = [1, 4, 5, 13, 6, 16]  # "12+3=" under the tiny model's tokenizer (BOS first)


@pytest.fixture
def core(tiny_model: Path) -> Iterator[EngineCore]:
    c = EngineCore()
    ok, msg, _ = c.update_weights_from_disk(str(tiny_model))
    assert ok, msg
    try:
        yield c
    finally:
        c.shutdown()


def _forwards(core: EngineCore) -> list[int]:
    """A live count of the served model's forward passes."""
    calls = [0]

    def hook(*_: Any) -> None:
        calls[0] += 1

    core._model.register_forward_hook(hook)
    return calls


def _together(core: EngineCore, params: list[SamplingParams]) -> list[dict[str, Any]]:
    """Submit every request while paused, so they all start in the same scheduler pass."""
    core.pause("in_place")
    futures = [core.submit(input_ids=PROMPT, params=p, return_logprob=True) for p in params]
    core.continue_generation()
    return [f.result(timeout=60) for f in futures]


def _alone(core: EngineCore, p: SamplingParams) -> dict[str, Any]:
    return core.submit(input_ids=PROMPT, params=p, return_logprob=True).result(timeout=60)


def _params(seed: int, temperature: float = 1.0) -> SamplingParams:
    return SamplingParams.from_json(
        {
            "max_new_tokens": 5,
            "ignore_eos": True,
            "temperature": temperature,
            "sampling_seed": seed,
        }
    )


def test_a_group_of_identical_greedy_requests_runs_one_forward_per_token(
    core: EngineCore,
) -> None:
    calls = _forwards(core)
    results = _together(core, [_params(s, temperature=0.0) for s in range(16)])
    assert calls[0] == 5, "16 identical sequences: one prefill, then one forward per token"
    assert len({tuple(r["output_ids"]) for r in results}) == 1


def test_sampled_group_members_share_forwards_and_equal_their_solo_runs(
    core: EngineCore,
) -> None:
    params = [_params(s) for s in range(16)]
    calls = _forwards(core)
    together = _together(core, params)
    shared = calls[0]
    assert shared < 16 * 5, "the prompt's prefill at least is shared"
    assert len({tuple(r["output_ids"]) for r in together}) > 1, "seeds should differ"
    calls[0] = 0
    for p, t in zip(params, together, strict=True):
        a = _alone(core, p)
        assert a["output_ids"] == t["output_ids"]
        assert a["meta_info"]["output_token_logprobs"] == t["meta_info"]["output_token_logprobs"]
    assert calls[0] == 16 * 5, "alone, each request runs its own forwards"


def test_a_retracted_member_recomputes_without_disturbing_the_others(core: EngineCore) -> None:
    """Retract in the middle of a shared group: the retracted requests are prefilled afresh
    (their old shared caches are dropped) and still give their solo results."""
    params = [_params(s) for s in range(8)]
    core.pause("in_place")
    futures = [core.submit(input_ids=PROMPT, params=p, return_logprob=True) for p in params]
    core.continue_generation()
    core.pause("retract")
    core.continue_generation()
    together = [f.result(timeout=60) for f in futures]
    for p, t in zip(params, together, strict=True):
        a = _alone(core, p)
        assert a["output_ids"] == t["output_ids"]
        assert a["meta_info"]["output_token_logprobs"] == t["meta_info"]["output_token_logprobs"]


def test_a_forked_cache_is_extended_without_touching_the_original(tiny_model: Path) -> None:
    """`_fork_cache` shares the tensors and relies on `DynamicLayer.update` concatenating into
    new ones: extending the original and the fork with different tokens gives each exactly
    what a deep copy would (a transformers that wrote in place would fail here)."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from ehp_fsm.rollout.engine import _fork_cache

    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([PROMPT]), cache=cache, use_cache=True)
        fork, deep = _fork_cache(cache), copy.deepcopy(cache)
        assert type(fork) is DynamicCache and fork.layers[0].keys is cache.layers[0].keys
        a = model(input_ids=torch.tensor([[7]]), cache=cache, use_cache=True).logits
        b = model(input_ids=torch.tensor([[8]]), cache=fork, use_cache=True).logits
        want = model(input_ids=torch.tensor([[8]]), cache=deep, use_cache=True).logits
        assert torch.equal(b, want) and not torch.equal(a, b)
        for mine, ref in zip(fork.layers, deep.layers, strict=True):
            assert torch.equal(mine.keys, ref.keys) and torch.equal(mine.values, ref.values)
        assert cache.get_seq_length() == fork.get_seq_length() == len(PROMPT) + 1
