"""A new user's own prompts and reward: refusals that must say what to do, and say it right."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ehp_fsm.data.dataset import DataConfig, DataError, load_dataset
from ehp_fsm.data.rewards import RewardError, resolve_reward


@pytest.mark.parametrize("where", ["{}.py", "rewards/{}.py", "{folder}/{}.py"])
def test_a_reward_given_by_file_path_is_refused_naming_the_module_to_write(
    tmp_path: Path, where: str
) -> None:
    """`function = "my_rewards.py:score"` was refused as "No module named 'my_rewards.py'",
    told to try `python -c 'import my_rewards.py'`. Now: a file path, and what to write."""
    name = f"user_rewards_{tmp_path.name}"  # a module of its own per test (sys.modules)
    (tmp_path / f"{name}.py").write_text(
        "def score(prompt, completion, label, metadata):\n    return 1.0\n"
    )
    spec = where.format(name, folder=tmp_path) + ":score"
    with pytest.raises(RewardError) as err:
        resolve_reward(spec, folder=tmp_path)
    message = str(err.value)
    assert "is a file path, not a module name" in message, message
    assert f'function = "{name}:score"' in message, message
    assert f"import {name}.py" not in message, message
    assert resolve_reward(f"{name}:score", folder=tmp_path)("p", "c", "l", {}) == 1.0


def test_a_prompt_too_long_in_characters_names_the_plan_key_that_raises_the_limit(
    tmp_path: Path,
) -> None:
    """A prompt longer in characters than `max_prompt_len` tokens can hold was refused with
    "raise [data] max_prompt_len" — a key a plan refuses ("set [model] max_prompt_len")."""
    from ehp_fsm.models.tiny import build_tokenizer

    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"prompt": "1+" * 500 + "1=", "label": "2"}) + "\n")
    with pytest.raises(DataError) as err:
        load_dataset(DataConfig(train=data, max_prompt_len=8), build_tokenizer())
    assert "characters" in str(err.value) and "[model] max_prompt_len" in str(err.value)
    assert "[data] max_prompt_len" not in str(err.value), str(err.value)


@pytest.mark.parametrize("meta", [{"id": 3}, 3], ids=["nested", "flat"])
def test_a_reward_that_changes_its_metadata_changes_no_other_call(
    tmp_path: Path, meta: object
) -> None:
    """The reward was handed the dataset's own metadata dict: a reward that takes what it needs
    (`metadata.pop("meta")`) scored its group's first completion 1.0 and every other one 0 by
    `KeyError: 'meta'` (under `on_error = "zero"`: a group of equal answers given a spread of
    rewards, and so an advantage), and the prompt had no `meta` in any later epoch either.
    Each call now gets the line's metadata as the file has it."""
    from ehp_fsm.data.rewards import Reward
    from ehp_fsm.models.tiny import build_tokenizer

    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "label": "2", "meta": meta}) + "\n")
    ex = load_dataset(DataConfig(train=data), build_tokenizer()).example_at(0)
    name = f"user_rewards_{tmp_path.name}"  # a module of its own per test (sys.modules)
    (tmp_path / f"{name}.py").write_text(
        "def score(prompt, completion, label, metadata):\n"
        "    meta = metadata.pop('meta')\n"
        "    if isinstance(meta, dict):\n"
        "        meta = meta.pop('id')\n"
        "    return float(meta == 3 and completion == label)\n"
    )
    fn = resolve_reward(f"{name}:score", folder=tmp_path)
    reward = Reward(fn=fn, name=f"{name}:score", on_error="zero")
    for _epoch in range(2):  # the same example, as every later epoch hands it over again
        got = reward.score_group_sync(ex.prompt, ["2", "2", "2"], ex.label, ex.metadata)
        assert got == [1.0, 1.0, 1.0], reward.failures
    assert reward.failures.count == 0, reward.failures
    assert ex.metadata == {"meta": meta}


def test_a_prompt_too_long_with_the_chat_template_says_the_template_is_counted(
    tmp_path: Path,
) -> None:
    """With `chat_template = true` the 4-character prompt "2+9=" of a user's Mistral was
    refused as "the prompt is 9 tokens, longer than max_prompt_len = 8": the count was the
    prompt wrapped in the chat template's turn markers, and nothing said so."""
    from ehp_fsm.models.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = (  # a turn marker around each message, as chat models have
        "{% for m in messages %}1={{ m['content'] }}+{% endfor %}"
        "{% if add_generation_prompt %}2={% endif %}"
    )
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    raw = len(tok("1+1=").input_ids)
    load_dataset(DataConfig(train=data, max_prompt_len=raw), tok)  # it fits by itself
    with pytest.raises(DataError) as err:
        load_dataset(DataConfig(train=data, max_prompt_len=raw, chat_template=True), tok)
    said = str(err.value)
    assert "9 tokens with the chat template (chat_template = true)" in said, said
