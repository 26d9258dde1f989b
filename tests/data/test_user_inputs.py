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
