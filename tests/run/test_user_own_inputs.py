"""A user's own inputs — a Hugging Face model of another architecture than the built-in Qwen3,
their own prompts — as the run takes them: the trainers' π_θ is the policy the engines sampled
from, and a resume trains on the prompts the killed run trained on."""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path

import pytest
import torch

from ehp_fsm.plan import load_plan
from ehp_fsm.rollout.engine import EngineCore, SamplingParams
from ehp_fsm.run.resume import (
    PLAN_RECORD,
    RESUME_DIR,
    ResumeError,
    check_resumed_plan,
    record_plan,
)
from ehp_fsm.training.backend import build_model
from ehp_fsm.training.grpo import GroupBatch, replica_loss
from ehp_fsm.training.objective import ObjectiveConfig

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _short_plan_with_reward(tmp_path: Path, function: str) -> Path:
    """`examples/short.toml` in `tmp_path` with `[reward] function` set to `function`."""
    text = (EXAMPLES / "short.toml").read_text()
    text = text.replace('train = "data/add-0-4.jsonl"', f'train = "{EXAMPLES}/data/add-0-4.jsonl"')
    text = text.replace('function = "exact_match"', f'function = "{function}"')
    text = text.replace('path = "../runs/', f'path = "{tmp_path}/')
    plan_file = tmp_path / "plan.toml"
    plan_file.write_text(text)
    return plan_file


def _gpt2(tmp: Path, *, pad_token_id: int | None = None) -> Path:
    """A tiny GPT-2 with the config transformers gives it, dropout 0.1 included — as every GPT-2
    checkpoint on the Hub has (`resid_pdrop`, `embd_pdrop`, `attn_pdrop`); `pad_token_id` in its
    config as a fine-tuned one's often has."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from ehp_fsm.models.tiny import build_tokenizer

    tok = build_tokenizer()
    config = GPT2Config(
        vocab_size=len(tok), n_positions=32, n_embd=32, n_layer=1, n_head=2,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=pad_token_id,
    )  # fmt: skip
    assert config.resid_pdrop == config.embd_pdrop == config.attn_pdrop == 0.1
    torch.manual_seed(0)
    out = tmp / "gpt2"
    GPT2LMHeadModel(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_a_model_with_dropout_in_its_config_trains_on_the_policy_the_engines_sampled(
    tmp_path: Path,
) -> None:
    """The trainers loaded the model in train mode, so a config with dropout (GPT-2's 0.1)
    computed π_θ with dropout on: at the very weights that sampled, step 1 of a GPT-2 run showed
    ratio mean/max 0.993/1.078 and approx KL 1e-3 where a dropout-free Mistral showed
    1.000/1.000 and 1e-14 — every ratio, clip and gradient was noise, and a Core + Hybrid split
    drew other masks than the whole batch. The policy the trainers step must compute the
    engines' log-probs (the engines run the model in eval mode; SGLang has no dropout)."""
    model_dir = _gpt2(tmp_path)
    core = EngineCore()
    try:
        assert core.update_weights_from_disk(str(model_dir))[0]
        prompt = core.encode("12+3=")
        outs = [
            core.submit(input_ids=prompt, params=params, return_logprob=True).result(30)
            for params in (
                SamplingParams(max_new_tokens=8, ignore_eos=True, sampling_seed=s) for s in range(4)
            )
        ]
    finally:
        core.shutdown()
    rows = [prompt + out["output_ids"] for out in outs]
    tokens = torch.tensor(rows)
    completion = torch.zeros_like(tokens, dtype=torch.bool)
    completion[:, len(prompt) - 1 : -1] = True  # next token belongs to the completion
    old = torch.zeros(tokens.shape, dtype=torch.float32)
    for i, out in enumerate(outs):
        lps = [lp for lp, _tok, _ in out["meta_info"]["output_token_logprobs"]]
        old[i, len(prompt) - 1 : -1] = torch.tensor(lps)
    batch = GroupBatch(
        group_ids=(0,), group_size=4, tokens=tokens, completion=completion,
        rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]), old_logp=old,
    )  # fmt: skip
    model = build_model(str(model_dir), seed=0)  # what every trainer lane builds and steps
    for _ in range(2):  # every forward of a step, not only the first
        metrics = replica_loss(model, batch, ObjectiveConfig()).metrics
        assert metrics.tokens == 4 * 8
        assert abs(metrics.ratio_mean - 1.0) < 1e-4, metrics
        assert abs(metrics.ratio_max - 1.0) < 1e-4, metrics
        assert metrics.approx_kl < 1e-8, metrics


def test_a_gpt2_whose_config_names_a_pad_token_trains_without_the_attention_mask_warning(
    tmp_path: Path,
) -> None:
    """`ehp-fsm run --verify` on a GPT-2 whose config names its pad token printed transformers'
    "We strongly recommend passing in an `attention_mask` since your input_ids may be padded":
    the trainers' forward (and `--verify`'s replay of it, in the run's own process) passed the
    right-padded rows alone. Their mask is all ones (attention is causal: a position the loss
    reads never sees the padding after it), and given explicitly it changes no logit."""
    import logging

    from transformers.utils import logging as hf_logging

    model_dir = _gpt2(tmp_path, pad_token_id=0)
    model = build_model(str(model_dir), seed=0)
    tokens = torch.tensor([[1, 5, 6, 7, 8, 0, 0], [1, 5, 6, 7, 8, 9, 0]])  # prompt completion PAD
    completion = torch.zeros_like(tokens, dtype=torch.bool)
    completion[0, 3:4] = completion[1, 3:5] = True
    batch = GroupBatch(
        group_ids=(0,), group_size=2, tokens=tokens, completion=completion,
        rewards=torch.tensor([1.0, 0.0]), old_logp=None,
    )  # fmt: skip
    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(handler)
    hf_logging.get_logger("transformers").warning_once.cache_clear()  # said once a process
    try:
        metrics = replica_loss(model, batch, ObjectiveConfig()).metrics
    finally:
        hf_logger.removeHandler(handler)
    assert metrics.tokens == 3
    assert not [m for m in said if "attention_mask" in m], said
    with torch.no_grad():  # the logits the loss read are those of the forward without a mask
        plain = model(tokens[:, :-1]).logits
        masked = model(tokens[:, :-1], attention_mask=torch.ones_like(tokens[:, :-1])).logits
    assert torch.equal(plain, masked)


def test_a_resume_whose_prompts_file_was_rewritten_is_refused_naming_it(tmp_path: Path) -> None:
    """`--resume` holds the plan to the killed run's "(seed, data, reward, ...)", but held the
    data by its path alone: the prompts file rewritten in place (other prompts, other order, 27
    lines for 20) was resumed without a word, and the resumed run's groups, shuffle and skipped
    prompts — all prompt indexes — named other prompts than the killed run's."""
    data = tmp_path / "prompts.jsonl"
    lines = [f'{{"question": "{a}+{b}=", "answer": "{a + b}"}}\n' for a in range(5) for b in (1, 2)]
    data.write_text("".join(lines))
    text = (EXAMPLES / "short.toml").read_text()
    text = text.replace('train = "data/add-0-4.jsonl"', f'train = "{data}"')
    text = text.replace("[data]\n", '[data]\nprompt_key = "question"\nlabel_key = "answer"\n')
    text = text.replace('path = "../runs/', f'path = "{tmp_path}/')
    plan_file = tmp_path / "plan.toml"
    plan_file.write_text(text)
    run_dir = tmp_path / "run"
    record_plan(run_dir, load_plan(plan_file))  # as the killed run's start did
    data.write_text("".join(lines))  # written again, the same bytes: nothing changed
    assert check_resumed_plan(run_dir, load_plan(plan_file)) == []
    data.write_text("".join(reversed(lines)))  # the same path, other prompts at each line
    with pytest.raises(ResumeError) as err:
        check_resumed_plan(run_dir, load_plan(plan_file))
    said = str(err.value)
    # a run stopped by `ehp-fsm stop` is resumed too: not "since the killed run"
    assert "the plan changed how the run trains since the run being resumed" in said, said
    assert "killed" not in said, said
    assert "data.train" in said and "contents" in said, said
    assert "put back the data file the run trained on" in said, said
    # a run of an ehp-fsm that recorded no digest of its data: nothing to compare it with
    record = run_dir / RESUME_DIR / PLAN_RECORD
    recorded = json.loads(record.read_text())
    assert any(k.startswith("data.train") and k != "data.train" for k in recorded), recorded
    record.write_text(
        json.dumps(
            {
                k: v
                for k, v in recorded.items()
                if k == "data.train" or not k.startswith("data.train")
            }
        )
    )
    assert check_resumed_plan(run_dir, load_plan(plan_file)) == []


def test_a_resume_whose_reward_code_was_edited_is_refused_naming_its_file(
    tmp_path: Path,
) -> None:
    """`--resume` held the reward by its name (`[reward] function`) alone: the function edited
    in its module between the kill and the resume (another score for the same name) was taken
    without a word, and the resumed steps were trained on rewards the killed run's were not.
    The reward's code (the file of the module that defines it) is held to the killed run's."""
    name = f"ehp_test_reward_{uuid.uuid4().hex[:8]}"  # a module of its own in this process
    module = tmp_path / f"{name}.py"
    module.write_text(
        "def score(prompt, completion, label, metadata):\n"
        "    return float(completion.strip() == label.strip())\n"
    )
    plan_file = _short_plan_with_reward(tmp_path, f"{name}:score")
    run_dir = tmp_path / "run"
    before = hashlib.sha256(module.read_bytes()).hexdigest()
    record_plan(run_dir, load_plan(plan_file))  # as the killed run's start did
    module.write_text(module.read_text())  # written again, the same bytes: nothing changed
    assert check_resumed_plan(run_dir, load_plan(plan_file)) == []
    module.write_text(
        "def score(prompt, completion, label, metadata):\n"
        "    return 2.0 * float(completion.strip() == label.strip())  # the same name\n"
    )
    after = hashlib.sha256(module.read_bytes()).hexdigest()
    with pytest.raises(ResumeError) as err:
        check_resumed_plan(run_dir, load_plan(plan_file))
    said = str(err.value)
    # a run stopped by `ehp-fsm stop` is resumed too: not "since the killed run"
    assert "the plan changed how the run trains since the run being resumed" in said, said
    assert "killed" not in said, said
    assert str(module) in said and before[:12] in said and after[:12] in said, said
    assert "restore" in said and "with --fresh" in said, said
    # a run of an ehp-fsm that recorded no digest of its reward: nothing to compare it with
    from ehp_fsm.run.resume import REWARD_CODE

    record = run_dir / RESUME_DIR / PLAN_RECORD
    recorded = json.loads(record.read_text())
    assert recorded[REWARD_CODE] == {str(module): f"sha256:{before}"}, recorded[REWARD_CODE]
    record.write_text(json.dumps({k: v for k, v in recorded.items() if k != REWARD_CODE}))
    assert check_resumed_plan(run_dir, load_plan(plan_file)) == []


def test_the_reward_code_recorded_for_a_package_and_a_built_in(tmp_path: Path) -> None:
    """A function of a package (`pkg:score`, defined in its `__init__.py`) is held by that file;
    a built-in (`exact_match`) by its own source
    (`test_a_builtin_reward_is_held_by_its_own_source_not_by_ehp_fsms_whole_module`)."""
    import inspect

    from ehp_fsm.data import rewards
    from ehp_fsm.data.rewards import reward_code

    name = f"ehp_test_rewards_{uuid.uuid4().hex[:8]}"
    (tmp_path / name).mkdir()
    init = tmp_path / name / "__init__.py"
    init.write_text("def score(prompt, completion, label, metadata):\n    return 1.0\n")
    digest = f"sha256:{hashlib.sha256(init.read_bytes()).hexdigest()}"
    assert reward_code(f"{name}:score", folder=tmp_path) == {str(init): digest}
    source = inspect.getsource(rewards.exact_match).encode()
    digest = f"sha256:{hashlib.sha256(source).hexdigest()}"
    assert reward_code("exact_match") == {"ehp_fsm.data.rewards:exact_match": digest}


def test_a_recorded_reward_code_edited_to_hold_many_files_makes_a_short_refusal(
    tmp_path: Path,
) -> None:
    """`resume/plan.json` is a file of the run folder: its `reward.code` edited to list
    200,000 files made a refusal of 8 MB (every file in the reason, and again in the fix). A
    few are named, and how many more."""
    plan = load_plan(Path(__file__).parents[2] / "examples" / "local.toml")
    record_plan(tmp_path, plan)
    path = tmp_path / RESUME_DIR / PLAN_RECORD
    doc = json.loads(path.read_text())
    doc["reward.code"] = {f"/f{i}.py": "sha256:00" for i in range(200_000)}
    path.write_text(json.dumps(doc))
    with pytest.raises(ResumeError, match=r"reward\.code") as err:
        check_resumed_plan(tmp_path, plan)
    assert len(str(err.value)) < 3000
    # (the 200,000 recorded, and the reward's own file now)
    assert "and 199,996 more" in str(err.value) and "(and 199,996 more)" in err.value.fix


def test_a_reward_that_is_a_partial_is_held_by_the_file_of_the_function_it_calls(
    tmp_path: Path,
) -> None:
    """`score = functools.partial(base, scale=2.0)`, `base` imported from a helper module: a
    partial's `__module__` is "functools", so the code recorded was the standard library's
    functools.py (a Python upgrade refused the resume) and the helper, the code that scores,
    was not recorded at all."""
    from ehp_fsm.data.rewards import reward_code

    name = f"ehp_test_rewards_{uuid.uuid4().hex[:8]}"
    helper = tmp_path / f"{name}_helper.py"
    helper.write_text(
        "def base(prompt, completion, label, metadata, scale=1.0):\n    return scale\n"
    )
    module = tmp_path / f"{name}.py"
    module.write_text(
        f"import functools\nfrom {name}_helper import base\n"
        "score = functools.partial(base, scale=2.0)\n"
    )
    code = reward_code(f"{name}:score", folder=tmp_path)
    assert code is not None and set(code) == {str(module), str(helper)}


def test_a_module_the_reward_imports_that_is_new_since_the_record_is_refused(
    tmp_path: Path,
) -> None:
    """A record's files unchanged and one more now was taken as a record of an older ehp-fsm
    (which held the reward's own module alone) — for a run recorded by this one too. A reward
    whose module takes an optional override (`try: from my_overrides import SCALE`, `except
    ImportError: SCALE = 1.0`) resumed without a word with `my_overrides.py` written between the
    kill and the resume, and scored the resumed steps twice as high. Only a record from before
    imported modules were held (no `reward.code_scope`) resumes with files added."""
    tag = uuid.uuid4().hex[:8]
    name, extra = f"ehp_rw_{tag}", f"ehp_rwo_{tag}"
    module = tmp_path / f"{name}.py"
    module.write_text(
        f"try:\n    from {extra} import SCALE\nexcept ImportError:\n    SCALE = 1.0\n\n"
        "def score(prompt, completion, label, metadata):\n"
        "    return SCALE * float(completion.strip() == label.strip())\n"
    )
    plan_file = _short_plan_with_reward(tmp_path, f"{name}:score")
    run_dir = tmp_path / "run"
    record_plan(run_dir, load_plan(plan_file))  # as the killed run's start did
    assert check_resumed_plan(run_dir, load_plan(plan_file)) == []
    override = tmp_path / f"{extra}.py"
    override.write_text("SCALE = 2.0\n")
    with pytest.raises(ResumeError) as err:
        check_resumed_plan(run_dir, load_plan(plan_file))
    said = str(err.value)
    assert f"{override} sha256 (none) -> " in said, said
    assert f"remove {override}: the run being resumed had no such file" in err.value.fix, (
        err.value.fix
    )
    # a record of an older ehp-fsm (no scope: the reward's own module alone) still resumes
    record = run_dir / RESUME_DIR / PLAN_RECORD
    doc = json.loads(record.read_text())
    assert doc["reward.code_scope"] == "imports", doc.get("reward.code_scope")
    del doc["reward.code_scope"]
    record.write_text(json.dumps(doc))
    assert check_resumed_plan(run_dir, load_plan(plan_file)) == []
