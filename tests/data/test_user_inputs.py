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


def test_a_misspelled_data_key_is_refused_with_the_keys_a_plan_takes(tmp_path: Path) -> None:
    """`chat_templates = true` in `[data]` was refused with "use only ['train', 'prompt_key',
    'label_key', 'chat_template', 'max_prompt_len', 'seed']" — and `max_prompt_len`, written
    there as told, is then refused ("set [model] max_prompt_len instead"). The refusal now
    names the nearest key and lists only what a plan's [data] takes."""
    from ehp_fsm.errors import PlanError
    from ehp_fsm.plan import load_plan

    examples = Path(__file__).resolve().parents[2] / "examples"
    text = (examples / "short.toml").read_text()
    text = text.replace('train = "data/', f'train = "{examples}/data/')
    plan = tmp_path / "plan.toml"
    plan.write_text(text.replace("[data]\n", "[data]\nchat_templates = true\n"))
    with pytest.raises(PlanError) as err:
        load_plan(plan)
    said = str(err.value)
    assert err.value.key == "data.chat_templates", said
    assert "did you mean `chat_template`?" in said, said
    assert "max_prompt_len" not in said.split("Fix:")[1].split("(")[0], said
    assert "[model] max_prompt_len" in said, said


@pytest.mark.parametrize("init", ["self", "self, prompt, completion, label, metadata"])
def test_a_reward_that_is_a_class_is_refused_naming_the_instance_to_write(
    tmp_path: Path, init: str
) -> None:
    """`function = "my_rewards:Scorer"`, a class whose `__call__` scores: calling the class
    makes an instance, not a score. With an `__init__` that takes four arguments `check` said
    valid and the run stopped at its first completion ("it returned <my_rewards.Scorer object
    ...>, a Scorer, not a number"); with a plain `__init__` the refusal said its signature was
    `Scorer()`. Refused now as a class, naming the instance to make."""
    name = f"user_rewards_{tmp_path.name}"  # a module of its own per test (sys.modules)
    (tmp_path / f"{name}.py").write_text(
        "class Scorer:\n"
        f"    def __init__({init}):\n"
        "        pass\n"
        "    def __call__(self, prompt, completion, label, metadata):\n"
        "        return 1.0\n"
        "scorer = Scorer" + ("()\n" if init == "self" else "(1, 2, 3, 4)\n")
    )
    with pytest.raises(RewardError) as err:
        resolve_reward(f"{name}:Scorer", folder=tmp_path)
    said = str(err.value)
    assert "is a class" in said, said
    assert "scorer = Scorer(...)" in said, said
    assert resolve_reward(f"{name}:scorer", folder=tmp_path)("p", "c", "l", {}) == 1.0


@pytest.mark.parametrize(
    ("kind", "magic"),
    [("gzip", b"\x1f\x8b\x08\x00"), ("zstd", b"\x28\xb5\x2f\xfd"), ("Parquet", b"PAR1")],
)
def test_a_compressed_or_parquet_prompts_file_is_named_as_such(
    tmp_path: Path, kind: str, magic: bytes
) -> None:
    """`train = "prompts.jsonl.gz"` (or a dataset's `.parquet`) was refused as "byte 1 of the
    line is not UTF-8 (invalid start byte). Fix: re-encode the file as UTF-8" — no encoding
    was wrong. The refusal names what the file is and what to give instead."""
    from ehp_fsm.models.tiny import build_tokenizer

    data = tmp_path / "train.jsonl.gz"
    data.write_bytes(magic + bytes(range(128, 256)) + b"\n")
    with pytest.raises(DataError) as err:
        load_dataset(DataConfig(train=data), build_tokenizer())
    said = str(err.value)
    assert f"the file is {kind}" in said, said  # gzip-compressed, zstd-compressed, Parquet
    assert "not UTF-8" not in said and "JSONL" in said, said


@pytest.mark.parametrize(
    ("content", "said", "fix"),
    [
        (  # an old Mac editor's line ends: the whole file was one line
            b'{"prompt": "1+1=", "label": "2"}\r{"prompt": "1+2=", "label": "3"}\r',
            "its lines end in CR alone",
            "tr '\\r' '\\n'",
        ),
        (  # `json.dump(rows, f, indent=2)`: a .json array, pretty-printed
            b'[\n  {"prompt": "1+1=", "label": "2"},\n  {"prompt": "1+2=", "label": "3"}\n]\n',
            "the file is one JSON array",
            "jq -c '.[]'",
        ),
        (  # the same array on one line
            b'[{"prompt": "1+1=", "label": "2"}, {"prompt": "1+2=", "label": "3"}]\n',
            "the line is a JSON list, not an object",
            "jq -c '.[]'",
        ),
    ],
)
def test_a_prompts_file_with_cr_line_ends_or_a_json_array_says_so(
    tmp_path: Path, content: bytes, said: str, fix: str
) -> None:
    """A file whose lines end in CR alone was refused as "not valid JSON (Extra data at column
    31)", and a JSON array (a `.json` file) as "Expecting value" or a list: "write one JSON
    object per line" named neither cause. Now each says what the file is and how to convert it."""
    from ehp_fsm.models.tiny import build_tokenizer

    data = tmp_path / "train.json"
    data.write_bytes(content)
    with pytest.raises(DataError) as err:
        load_dataset(DataConfig(train=data), build_tokenizer())
    text = str(err.value)
    assert said in text and fix in text, text
