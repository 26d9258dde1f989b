"""The engine core in-process, serving the tiny HF model: a request whose waiter went away (its
future cancelled, as asyncio does when a client disconnects or the health probe times out) must
not take the scheduler thread down with it; a retract never shifts the sampling stream; the KV
cache gives the log-probs a full forward gives; installs keep the module and swap its tensors,
and a request that goes on across an install is recomputed under the new weights."""

from __future__ import annotations

from pathlib import Path

import torch

from ehp_fsm.rollout.engine import EngineCore, SamplingParams
from tests.rollout.conftest import make_store


def test_a_request_whose_waiter_went_away_does_not_stop_the_scheduler(
    tmp_path: Path, tiny_model: Path
) -> None:
    store = make_store(tmp_path / "revisions", tiny_model, revisions=(1,))
    core = EngineCore()
    try:
        assert core.update_weights_from_disk(str(store.path(1)))[0]
        core.pause("retract")  # held: the request waits, its waiter gives up
        gone = core.submit(input_ids=[1, 5], params=SamplingParams(max_new_tokens=2))
        assert gone.cancel()
        core.continue_generation()  # it runs, finishes, and nobody is there for its result
        later = core.submit(input_ids=[1, 5, 6], params=SamplingParams(max_new_tokens=2))
        assert later.result(timeout=10)["meta_info"]["finish_reason"]["type"] in ("length", "stop")
    finally:
        core.shutdown()


def test_a_retract_during_a_forward_pass_does_not_shift_the_sampling_stream(
    tmp_path: Path, tiny_model: Path
) -> None:
    """The retract lands between the forward pass and the sampling of that pass's token (the
    scheduler does not hold the engine's lock there). The discarded token must draw from the
    old generator: drawing from the fresh one shifted the whole regenerated sequence (seen in CI
    as `test_retracted_request_regenerates_identically` failing one run in many)."""
    store = make_store(tmp_path / "revisions", tiny_model, revisions=(1,))
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, sampling_seed=5)
    core = EngineCore()
    try:
        assert core.update_weights_from_disk(str(store.path(1)))[0]
        reference = core.submit(input_ids=[1, 5, 6], params=params).result(timeout=30)
        passes = 0

        def retract_on_the_fourth_pass(*_: object) -> None:
            nonlocal passes
            passes += 1
            if passes == 4:  # inside the scheduler thread, between forward and sample
                core.pause("retract")
                core.continue_generation()

        model = core._model
        assert model is not None
        hook = model.register_forward_hook(retract_on_the_fourth_pass)
        try:
            result = core.submit(input_ids=[1, 5, 6], params=params).result(timeout=30)
        finally:
            hook.remove()
        assert result["meta_info"]["num_retractions"] == 1
        assert result["output_ids"] == reference["output_ids"]
    finally:
        core.shutdown()


def _full_forward_logprobs(model_dir: Path, prompt: list[int], output: list[int]) -> list[float]:
    """Log-probs of `output` after `prompt` from one forward over the whole sequence (no cache),
    with the directory loaded by transformers itself."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


def test_log_probs_from_the_kv_cache_equal_a_full_forward(tmp_path: Path, tiny_model: Path) -> None:
    store = make_store(tmp_path / "revisions", tiny_model, revisions=(1,))
    core = EngineCore()
    try:
        assert core.update_weights_from_disk(str(store.path(1)))[0]
        prompt = core.encode("12+3=")
        assert prompt[0] == 1  # the tokenizer adds BOS
        params = SamplingParams(max_new_tokens=16, ignore_eos=True, sampling_seed=3)
        out = core.submit(input_ids=prompt, params=params, return_logprob=True).result(30)
        got = [lp for lp, _tok, _ in out["meta_info"]["output_token_logprobs"]]
        want = _full_forward_logprobs(store.path(1), prompt, out["output_ids"])
        assert len(got) == 16
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
    finally:
        core.shutdown()


def test_installs_reuse_the_module_retie_embeddings_and_take_plain_model_dirs(
    tmp_path: Path, tiny_model: Path
) -> None:
    store = make_store(tmp_path / "revisions", tiny_model, revisions=(1, 2))
    core = EngineCore()
    try:
        ok, _, _ = core.update_weights_from_disk(str(store.path(1)))
        assert ok
        model = core._model
        ok, message, _ = core.update_weights_from_disk(str(store.path(2)))
        assert ok and "revision 2" in message
        assert core._model is model  # same config: the module stays, its tensors are swapped
        embed = model.get_input_embeddings().weight
        assert model.get_output_embeddings().weight is embed  # re-tied after the assign
        stored = store.load(2).state_dict()
        assert torch.equal(embed, stored["model.embed_tokens.weight"])
        assert core.status().weight_version == "2" and core.status().revision == 2
        ok, _, _ = core.update_weights_from_disk(str(tiny_model))  # a plain HF directory
        assert ok
        st = core.status()
        assert (st.weight_version, st.revision) == ("default", None)
        assert st.model_config is not None and st.model_config["model_type"] == "qwen3"
        assert not torch.equal(
            model.get_input_embeddings().weight, stored["model.embed_tokens.weight"]
        )
    finally:
        core.shutdown()


def test_a_request_paused_in_place_across_an_install_goes_on_under_the_new_weights(
    tmp_path: Path, tiny_model: Path
) -> None:
    """Tokens sampled before the install carry the old weights' log-probs, every later one the
    new weights' over the whole sequence: the cache computed under the old weights is dropped
    and the prompt + output so far prefilled again (reusing it mixed the two models)."""
    import threading

    store = make_store(tmp_path / "revisions", tiny_model, revisions=(1, 2))
    core = EngineCore()
    try:
        assert core.update_weights_from_disk(str(store.path(1)))[0]
        paused = threading.Event()
        passes = 0

        def pause_on_the_third_pass(*_: object) -> None:
            nonlocal passes
            passes += 1
            if passes == 3:
                core.pause("in_place")
                paused.set()

        model = core._model
        hook = model.register_forward_hook(pause_on_the_third_pass)
        try:
            prompt = core.encode("7+8=")
            params = SamplingParams(max_new_tokens=10, ignore_eos=True, sampling_seed=9)
            fut = core.submit(input_ids=prompt, params=params, return_logprob=True)
            assert paused.wait(30)
            ok, _, num_paused = core.update_weights_from_disk(str(store.path(2)))
            assert ok and num_paused == 1
            core.continue_generation()
            out = fut.result(30)
        finally:
            hook.remove()
        assert out["meta_info"]["weight_version"] == "2"
        got = [lp for lp, _tok, _ in out["meta_info"]["output_token_logprobs"]]
        old = _full_forward_logprobs(store.path(1), prompt, out["output_ids"])
        new = _full_forward_logprobs(store.path(2), prompt, out["output_ids"])
        assert max(abs(a - b) for a, b in zip(got[:3], old[:3], strict=True)) < 1e-4
        assert max(abs(a - b) for a, b in zip(got[3:], new[3:], strict=True)) < 1e-4
        assert max(abs(a - b) for a, b in zip(old[3:], new[3:], strict=True)) > 1e-3
    finally:
        core.shutdown()


def test_the_trainer_takes_pi_theta_at_the_temperature_the_engine_sampled_at(
    tmp_path: Path, tiny_model: Path
) -> None:
    """The engine returns log-probs of softmax(logits / T); the trainer's loss took π_θ at T = 1,
    so at `[grpo] temperature` 0.5 the ratio π_θ / π_behaviour was far from 1 at the very
    weights that sampled (on-policy), and clipping cut the gradient of tokens that had not
    moved. Now the objective's temperature is the plan's, and on-policy ratios are 1."""
    from transformers import AutoModelForCausalLM

    from ehp_fsm.training.grpo import GroupBatch, logits_loss
    from ehp_fsm.training.objective import ObjectiveConfig

    store = make_store(tmp_path / "revisions", tiny_model, revisions=(1,))
    core = EngineCore()
    try:
        assert core.update_weights_from_disk(str(store.path(1)))[0]
        prompt = core.encode("12+3=")
        params = SamplingParams(
            max_new_tokens=12, ignore_eos=True, sampling_seed=3, temperature=0.5
        )
        out = core.submit(input_ids=prompt, params=params, return_logprob=True).result(30)
    finally:
        core.shutdown()
    behaviour = [lp for lp, _tok, _ in out["meta_info"]["output_token_logprobs"]]
    tokens = torch.tensor([prompt + out["output_ids"]])
    n, p = tokens.shape[1], len(prompt)
    completion = torch.tensor([[p - 1 <= t < n - 1 for t in range(n)]])
    old = torch.zeros((1, n))
    old[0, p - 1 : n - 1] = torch.tensor(behaviour)
    batch = GroupBatch(
        group_ids=(0,),
        group_size=1,
        tokens=tokens,
        completion=completion,
        rewards=torch.zeros(1),
        old_logp=old,
    )
    model = AutoModelForCausalLM.from_pretrained(store.path(1), local_files_only=True).eval()
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits.float()
    m = logits_loss(logits, batch, ObjectiveConfig(temperature=0.5)).metrics
    assert abs(m.ratio_mean - 1.0) < 1e-4 and abs(m.ratio_max - 1.0) < 1e-4, m
    untempered = logits_loss(logits, batch, ObjectiveConfig()).metrics  # what the run did
    assert abs(untempered.ratio_mean - 1.0) > 1e-2, untempered
