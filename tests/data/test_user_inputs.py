"""A new user's own prompts and reward: refusals that must say what to do, and say it right."""

from __future__ import annotations

import json
import sys
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


def test_the_reward_code_held_by_a_resume_includes_the_users_modules_it_imports(
    tmp_path: Path,
) -> None:
    """`--resume` held the reward by the file of its module alone (README: "modules that file
    imports are not compared"): a helper module beside it — `from my_helpers import parse`,
    where the scoring happens — edited between the kill and the resume was taken without a
    word. Every module of the user's own that the reward's module imports, transitively (a
    package's `__init__.py` on the way, a relative import, an import inside a function), is
    held too; a standard module hidden by a file of the same name in the folder (`json.py`)
    and installed packages are not."""
    import hashlib
    import uuid

    from ehp_fsm.data.rewards import reward_code
    from ehp_fsm.plan import load_plan
    from ehp_fsm.run.resume import ResumeError, check_resumed_plan, record_plan

    tag = uuid.uuid4().hex[:8]
    name, helpers, pkg = f"ehp_rw_{tag}", f"ehp_rwh_{tag}", f"ehp_rwp_{tag}"
    (tmp_path / f"{name}.py").write_text(
        f"import json\nimport torch\nfrom {helpers} import parse\n\n"
        "def score(prompt, completion, label, metadata):\n"
        f"    from {pkg}.scale import factor  # imported when first called\n"
        "    return factor() * float(parse(completion) == label.strip())\n"
    )
    helper = tmp_path / f"{helpers}.py"
    helper.write_text("def parse(text):\n    return text.strip()\n")
    (tmp_path / pkg).mkdir()
    init = tmp_path / pkg / "__init__.py"
    init.write_text("")
    scale = tmp_path / pkg / "scale.py"
    scale.write_text("from ._base import ONE\n\ndef factor():\n    return ONE\n")
    base = tmp_path / pkg / "_base.py"
    base.write_text("ONE = 1.0\n")
    (tmp_path / "json.py").write_text("raise SystemExit('not this one')\n")  # the stdlib's
    code = reward_code(f"{name}:score", folder=tmp_path)
    assert code is not None
    held = {tmp_path / f"{name}.py", helper, init, scale, base}
    assert set(code) == {str(p) for p in held}, sorted(code)

    root = Path(__file__).resolve().parents[2]
    text = (root / "examples" / "short.toml").read_text()
    text = text.replace(
        'train = "data/add-0-4.jsonl"', f'train = "{root}/examples/data/add-0-4.jsonl"'
    )
    text = text.replace('function = "exact_match"', f'function = "{name}:score"')
    text = text.replace('path = "../runs/', f'path = "{tmp_path}/')
    plan_file = tmp_path / "plan.toml"
    plan_file.write_text(text)
    run_dir = tmp_path / "run"
    record_plan(run_dir, load_plan(plan_file))
    before = hashlib.sha256(base.read_bytes()).hexdigest()
    base.write_text("ONE = 2.0  # every reward doubled, under the same function name\n")
    after = hashlib.sha256(base.read_bytes()).hexdigest()
    with pytest.raises(ResumeError) as err:
        check_resumed_plan(run_dir, load_plan(plan_file))
    said = str(err.value)
    assert str(base) in said and before[:12] in said and after[:12] in said, said

    # a run recorded by an ehp-fsm that held the reward module's own file alone resumes: the
    # helpers it did not record are only added (before, "helper.py sha256 (none) -> ..."
    # refused it); an edit of the file it did record is still refused
    record = run_dir / "resume" / "plan.json"
    doc = json.loads(record.read_text())
    own = str(tmp_path / f"{name}.py")
    doc["reward.code"] = {own: doc["reward.code"][own]}
    del doc["reward.code_scope"]  # (what this ehp-fsm records besides)
    record.write_text(json.dumps(doc))
    check_resumed_plan(run_dir, load_plan(plan_file))
    with (tmp_path / f"{name}.py").open("a") as fh:
        fh.write("# edited\n")
    with pytest.raises(ResumeError, match=f"{name}.py sha256"):
        check_resumed_plan(run_dir, load_plan(plan_file))


@pytest.mark.parametrize("field", ["prompt", "label"])
def test_a_lone_surrogate_escape_in_a_prompt_or_label_is_refused_with_its_line(
    tmp_path: Path, field: str
) -> None:
    """`"\\ud800"` (half of a UTF-16 pair, as a JSON writer that cut a string in the middle of
    an emoji leaves it) is valid JSON and no text: `check` crashed with a TypeError out of the
    tokenizer ("TextEncodeInput must be Union[...]"). Refused naming the line and the escape."""
    from ehp_fsm.models.tiny import build_tokenizer

    data = tmp_path / "p.jsonl"
    bad = {"prompt": "1+1=", "label": "2"}
    bad[field] += "\\ud83d"  # the escape's backslash written as such into the JSON line
    text = json.dumps({"prompt": "1+2=", "label": "3"}) + "\n"
    text += '{"prompt": "' + bad["prompt"] + '", "label": "' + bad["label"] + '"}\n'
    data.write_text(text)
    for chat in (False, True):
        with pytest.raises(DataError) as err:
            load_dataset(DataConfig(train=data, chat_template=chat), build_tokenizer())
        said = str(err.value)
        assert f"{data}:2" in said and f"the {field} ({field!r})" in said, said
        assert "\\ud83d" in said and "half of a UTF-16 pair" in said, said


def test_a_numeric_label_reaches_the_reward_as_the_line_writes_it(tmp_path: Path) -> None:
    """The label is "the line's label as a string": a JSON `1.50` arrived as "1.5", `1e3` as
    "1000.0" and `-0` as "0", so `exact_match` scored 0 for a completion "1.50" that is the
    label as written. An integer still arrives as its digits, and a label that is not finite
    is still refused."""
    from ehp_fsm.models.tiny import build_tokenizer

    data = tmp_path / "p.jsonl"
    labels = ["1.50", "1e3", "-0", "14", "12345678901234567890", "2.5E-3", '"7.0"']
    data.write_text("".join(f'{{"prompt": "1+1=", "label": {x}}}\n' for x in labels))
    got = [e.label for e in load_dataset(DataConfig(train=data), build_tokenizer()).examples]
    assert got == ["1.50", "1e3", "-0", "14", "12345678901234567890", "2.5E-3", "7.0"], got
    data.write_text('{"prompt": "1+1=", "label": 1e400}\n')
    with pytest.raises(DataError, match="the label is inf"):
        load_dataset(DataConfig(train=data), build_tokenizer())


@pytest.mark.parametrize(
    "template",
    [
        "{{ raise_exception('System message required') }}",
        "{% for m in messages %}{{ m.content }}",  # a syntax error: no endfor
        "{{ messages[1]['content'] }}",  # only a user message is given
    ],
    ids=["raises", "syntax", "undefined"],
)
def test_a_chat_template_that_cannot_render_a_prompt_is_refused_with_its_line(
    tmp_path: Path, template: str
) -> None:
    """`chat_template = true` with a model whose template raises ("System message required"),
    does not parse or reads a message that is not there crashed `check` with jinja's
    traceback. Refused naming the file, the line, the template's error and both fixes."""
    from ehp_fsm.models.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = template
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "1+2=", "label": "3"}) + "\n")
    with pytest.raises(DataError) as err:
        load_dataset(DataConfig(train=data, chat_template=True), tok)
    said = str(err.value)
    assert f"{data}:1" in said and "chat template cannot render" in said, said
    assert "chat_template = false" in err.value.fix, err.value.fix


@pytest.mark.parametrize("kind", ["def", "async def", "instance", "partial"])
def test_a_reward_that_is_a_generator_function_is_refused_when_resolved(
    tmp_path: Path, kind: str
) -> None:
    """`yield score` instead of `return score`: `check` said valid, and the run failed at its
    first completion ("it returned <generator object ...>, a generator") once its engines and
    trainers had started. Refused when resolved, saying to return the score."""
    import uuid

    name = f"ehp_gen_reward_{uuid.uuid4().hex[:8]}"
    body = {
        "def": "def score(prompt, completion, label, metadata):\n    yield 1.0\n",
        "async def": "async def score(prompt, completion, label, metadata):\n    yield 1.0\n",
        "instance": "class S:\n    def __call__(self, prompt, completion, label, metadata):\n"
        "        yield 1.0\nscore = S()\n",
        "partial": "import functools\n"
        "def base(prompt, completion, label, metadata, k=1):\n    yield float(k)\n"
        "score = functools.partial(base, k=2)\n",
    }[kind]
    (tmp_path / f"{name}.py").write_text(body)
    with pytest.raises(RewardError) as err:
        resolve_reward(f"{name}:score", folder=tmp_path)
    assert "generator function" in str(err.value) and "return" in err.value.fix, str(err.value)


@pytest.mark.parametrize("kind", ["tensor", "array", "decimal", "numpy bool", "bool tensor"])
def test_a_reward_returning_a_tensor_or_a_decimal_is_told_how_to_return_its_number(
    kind: str,
) -> None:
    """`(pred == gold).float().mean()` returns a 0-d tensor: the failure said "a Tensor, not a
    number" with "fix the reward function" and no word of how. It names `.item()` (a tensor,
    an array) or `float(value)` (a Decimal)."""
    import decimal

    import numpy as np
    import torch

    from ehp_fsm.data.rewards import Reward

    value = {
        "tensor": torch.tensor(0.5),
        "array": np.array(0.5),
        "decimal": decimal.Decimal("0.5"),
        "numpy bool": np.True_,  # (told to return `.item()`: a bool, refused too)
        "bool tensor": torch.tensor(True),
    }[kind]
    reward = Reward(fn=lambda p, c, label, m: value, name="mine:score")
    with pytest.raises(RewardError) as err:
        reward.score_group_sync("1+1=", ["2"], "2", {})
    hint = "value.item()" if kind in ("tensor", "array") else "float(value)"
    assert hint in str(err.value), str(err.value)


@pytest.mark.parametrize("on_error", ["raise", "zero"])
def test_a_reward_that_prints_to_a_gone_output_stops_the_run_as_its_output_gone(
    tmp_path: Path, on_error: str
) -> None:
    """A reward that prints (debugging) under `ehp-fsm run PLAN | head`: once `head` had ended,
    its print raised BrokenPipeError, which failed the reward — the run said "its output is
    gone: stopping cleanly", then exited 2 with "reward ... failed ... BrokenPipeError. Fix: fix
    the reward function" (under on_error = "zero" every completion scored 0) instead of 141.
    The reward's write to a gone output is the run's output gone (`RewardInterrupted`); a
    reward's own broken pipe elsewhere (a socket) is still its failure."""
    import os
    import subprocess
    import sys

    script = tmp_path / "score.py"
    script.write_text(
        "import socket, sys\n"
        "from ehp_fsm.data.rewards import Reward, RewardError, RewardInterrupted\n"
        "def noisy(prompt, completion, label, metadata):\n"
        "    print('scoring', completion, flush=True)\n"
        "    return 1.0\n"
        "def own_pipe(prompt, completion, label, metadata):\n"
        "    a, b = socket.socketpair()\n"
        "    b.close()\n"
        "    a.sendall(b'x' * 1_000_000)\n"
        "    return 1.0\n"
        "fn = {'noisy': noisy, 'own_pipe': own_pipe}[sys.argv[1]]\n"
        f"r = Reward(fn=fn, name='mine:' + fn.__name__, on_error={on_error!r})\n"
        "try:\n"
        "    got = r.score_group_sync('1+1=', ['2'] * 3, '2', {})\n"
        "    sys.stderr.write(f'{fn.__name__}: scored {got} {r.failures.count}\\n')\n"
        "except RewardInterrupted as exc:\n"
        "    sys.stderr.write(f'{fn.__name__}: interrupted: {exc}\\n')\n"
        "except RewardError as exc:\n"
        "    sys.stderr.write(f'{fn.__name__}: failed: {exc}\\n')\n"
    )
    read, write = os.pipe()
    os.close(read)  # the reader has gone before the reward prints: `| head` that has ended
    try:
        gone = subprocess.run(
            [sys.executable, str(script), "noisy"], stdout=write, stderr=subprocess.PIPE, timeout=60
        )
    finally:
        os.close(write)
    said = gone.stderr.decode()
    assert "noisy: interrupted: the run's output is gone" in said, said
    there = subprocess.run(
        [sys.executable, str(script), "own_pipe"], capture_output=True, timeout=60
    )
    said = there.stderr.decode()
    if on_error == "raise":
        assert "own_pipe: failed: reward mine:own_pipe failed" in said, said
    else:
        assert "own_pipe: scored [0.0, 0.0, 0.0] 3" in said, said


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be-bom", "utf-16-le-nobom", "utf-32"])
def test_a_utf16_prompts_file_is_named_as_such_with_the_command_that_converts_it(
    tmp_path: Path, encoding: str
) -> None:
    """Windows PowerShell's `>` and Out-File write UTF-16: such a file was refused as "byte 0
    of the line is not UTF-8" (with its byte order mark) or "not valid JSON ... write one JSON
    object per line" (without one). The encoding is named, with the command that converts it."""
    import shutil
    import subprocess

    from ehp_fsm.models.tiny import build_tokenizer

    text = '{"prompt": "1+1=", "label": "2"}\n{"prompt": "2+1=", "label": "3"}\n'
    data = tmp_path / "p.jsonl"
    data.write_bytes(
        {
            "utf-16": text.encode("utf-16"),  # with its BOM, little-endian here
            "utf-16-be-bom": b"\xfe\xff" + text.encode("utf-16-be"),
            "utf-16-le-nobom": text.encode("utf-16-le"),
            "utf-32": text.encode("utf-32"),
        }[encoding]
    )
    with pytest.raises(DataError) as err:
        load_dataset(DataConfig(train=data), build_tokenizer())
    said = str(err.value)
    assert "UTF-16" in said or "UTF-32" in said, said
    assert "iconv -f" in err.value.fix, err.value.fix
    if shutil.which("iconv") is None:
        return  # (the command named is not here to run)
    words = err.value.fix.split("iconv ", 1)[1].split()  # -f ENC -t UTF-8 FILE > OUT ...
    assert words[0] == "-f" and words[2:3] == ["-t"] and words[4:6] == [data.name, ">"], words
    assert words[6].startswith("prompts.jsonl"), words
    with open(tmp_path / "prompts.jsonl", "wb") as out:
        subprocess.run(["iconv", *words[:4], str(data)], stdout=out, check=True)
    fixed = load_dataset(DataConfig(train=tmp_path / "prompts.jsonl"), build_tokenizer())
    assert [e.prompt for e in fixed.examples] == ["1+1=", "2+1="]


def test_a_helper_module_a_standard_module_hides_is_named_when_the_reward_imports_it(
    tmp_path: Path,
) -> None:
    """The reward module beside the plan imports its helper `statistics.py` from beside it
    (`from statistics import mean_reward`): Python's own `statistics` comes first, and the
    refusal said only "cannot import name 'mean_reward' from 'statistics' (/usr/lib/...)" with
    "check the module name, that it is in the plan's folder ..., PYTHONPATH or installed" —
    where it was. It names the helper hidden, by what, and the rename."""
    import uuid

    name = f"ehp_rw_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "from statistics import mean_reward\n\n"
        "def score(prompt, completion, label, metadata):\n    return mean_reward()\n"
    )
    (tmp_path / "statistics.py").write_text("def mean_reward():\n    return 1.0\n")
    with pytest.raises(RewardError) as err:
        resolve_reward(f"{name}:score", folder=tmp_path)
    said = str(err.value)
    assert "statistics.py beside the plan is hidden by" in said, said
    assert f"rename {tmp_path / 'statistics.py'}" in err.value.fix, err.value.fix


@pytest.mark.parametrize("top", ["sys.exit(0)", "argparse"])
def test_a_reward_module_that_exits_when_imported_is_refused_not_taken_for_the_exit(
    tmp_path: Path, top: str
) -> None:
    """A reward module that is also a script, its code not under `if __name__ == "__main__"`:
    `sys.exit(0)` at its top level made `ehp-fsm check` (and `run`) exit 0 saying nothing — a
    CI step took it for valid — and argparse at its top level parsed ehp-fsm's command line,
    printing "usage: ehp-fsm [-h] [--scale SCALE] ... unrecognized arguments: check
    plan.toml" as if ehp-fsm's own usage were wrong. Refused, naming the module and the fix."""
    import uuid

    name = f"ehp_rw_{uuid.uuid4().hex[:8]}"
    body = {
        "sys.exit(0)": "import sys\nsys.exit(0)\n",
        "argparse": "import argparse\nparser = argparse.ArgumentParser()\n"
        "parser.add_argument('--scale', type=float, default=1.0)\n"
        "args = parser.parse_args(['check', 'plan.toml'])  # ehp-fsm's argv, as a script does\n",
    }[top]
    (tmp_path / f"{name}.py").write_text(
        body + "def score(prompt, completion, label, metadata):\n    return 1.0\n"
    )
    with pytest.raises(RewardError) as err:
        resolve_reward(f"{name}:score", folder=tmp_path)
    said = str(err.value)
    assert f"reward module {name!r} ended the process as it was imported" in said, said
    assert '__name__ == "__main__"' in err.value.fix, err.value.fix


def test_a_reward_module_running_argparse_prints_no_usage_that_looks_like_ehp_fsms(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse at a reward module's top level parses ehp-fsm's command line: its "usage:
    ehp-fsm [-h] [--scale SCALE]" and "ehp-fsm: error: unrecognized arguments: check
    plan.toml" were printed above the refusal, as if ehp-fsm's own usage were wrong. Only the
    refusal is said, with what argparse said in it; what a module that goes on writes to
    stderr is written as it comes."""
    import uuid

    monkeypatch.setattr(sys, "argv", ["ehp-fsm", "check", "plan.toml"])
    name = f"ehp_rw_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "import argparse, sys\nprint('loading', file=sys.stderr)\n"
        "parser = argparse.ArgumentParser()\nparser.add_argument('--scale', type=float)\n"
        "args = parser.parse_args()\n"
        "def score(prompt, completion, label, metadata):\n    return 1.0\n"
    )
    with pytest.raises(RewardError) as err:
        resolve_reward(f"{name}:score", folder=tmp_path)
    assert capsys.readouterr().err == "loading\n"
    assert "argparse, which said 'unrecognized arguments: check plan.toml'" in str(err.value)


class _Collected:
    """A caller's stderr whose `write` returns None (as `print` allows, and many a redirect
    written for a notebook or a service does)."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def write(self, text: str) -> None:
        self.parts.append(text)

    def flush(self) -> None:
        pass


def test_the_stderr_holder_without_its_stream_raises_attribute_error_not_recursion() -> None:
    """argparse's holder (`sys.stderr` while a reward module is imported) looked `stream` up
    through `__getattr__` where it was not set yet (a copy, as `copy.copy` makes it, asked for
    `__setstate__`; a lookup before `__init__`): RecursionError. Now AttributeError, and a
    copy writes to the same stream."""
    import copy

    from ehp_fsm.data.rewards import _ArgparseHeld

    caller = _Collected()
    twin = copy.copy(_ArgparseHeld(caller))
    twin.write("a line\n")
    twin.flush()
    assert caller.parts == ["a line\n"]
    bare = _ArgparseHeld.__new__(_ArgparseHeld)
    with pytest.raises(AttributeError, match="'stream'"):
        bare.stream  # noqa: B018
    assert not hasattr(bare, "encoding")


@pytest.mark.parametrize("stderr", ["returns None", "None"])
def test_a_reward_module_that_writes_to_stderr_imports_whatever_stderr_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stderr: str
) -> None:
    """While a reward module is imported its writes to stderr go through argparse's holder.
    Before, a module that wrote a line there (a print, a warning) could not be imported
    under a stderr whose `write` returns None ("TypeError: int() argument must be ... not
    'NoneType'") or with no stderr at all (`sys.stderr` None: "'NoneType' object has no
    attribute 'write'"), where it imported before the holder. Now it imports, and the line
    reaches that stderr (no stderr: `print` writes it to stdout, as Python does)."""
    import uuid

    name = f"ehp_rw_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "import sys\nprint('loading', file=sys.stderr)\n"
        "def score(prompt, completion, label, metadata):\n    return 1.0\n"
    )
    collected = _Collected()
    monkeypatch.setattr(sys, "stderr", collected if stderr == "returns None" else None)
    fn = resolve_reward(f"{name}:score", folder=tmp_path)
    assert sys.stderr is (collected if stderr == "returns None" else None)
    assert fn("p", "c", "l", {}) == 1.0
    if stderr == "returns None":
        assert collected.parts == ["loading", "\n"]


def test_a_builtin_reward_is_held_by_its_own_source_not_by_ehp_fsms_whole_module(
    tmp_path: Path,
) -> None:
    """A built-in reward's code was the digest of the whole of ehp-fsm's `data/rewards.py`:
    any change to that file (an upgrade between a crash and its resume) refused the resume,
    telling the operator to "restore rewards.py as the run had it". It is held by the
    function's own source; a run recorded the old way resumes, and a built-in whose own source
    changed is still refused."""
    import hashlib
    import inspect

    from ehp_fsm.data.rewards import exact_match, reward_code
    from ehp_fsm.plan import load_plan
    from ehp_fsm.run.resume import ResumeError, check_resumed_plan, record_plan

    source = inspect.getsource(exact_match).encode()
    key = "ehp_fsm.data.rewards:exact_match"
    assert reward_code("exact_match") == {key: "sha256:" + hashlib.sha256(source).hexdigest()}

    root = Path(__file__).resolve().parents[2]
    text = (root / "examples" / "short.toml").read_text()
    text = text.replace(
        'train = "data/add-0-4.jsonl"', f'train = "{root}/examples/data/add-0-4.jsonl"'
    )
    text = text.replace('path = "../runs/', f'path = "{tmp_path}/')
    assert 'function = "exact_match"' in text
    plan_file = tmp_path / "plan.toml"
    plan_file.write_text(text)
    run_dir = tmp_path / "run"
    record_plan(run_dir, load_plan(plan_file))
    record = run_dir / "resume" / "plan.json"

    def recorded(code: dict[str, str]) -> None:
        doc = json.loads(record.read_text())
        doc["reward.code"] = code
        doc.pop("reward.code_scope", None)  # (what this ehp-fsm records besides)
        record.write_text(json.dumps(doc))

    # an older ehp-fsm's record: the whole module, of another version
    recorded({"/old/site-packages/ehp_fsm/data/rewards.py": "sha256:" + "0" * 64})
    check_resumed_plan(run_dir, load_plan(plan_file))
    # the built-in's own source changed since the run recorded it
    recorded({key: "sha256:" + "1" * 64})
    with pytest.raises(ResumeError, match=f"{key} sha256 111111111111 ->"):
        check_resumed_plan(run_dir, load_plan(plan_file))
