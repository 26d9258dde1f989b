"""JSONL prompt datasets: refusals name the file and the line; the shuffle is deterministic per
(seed, epoch); the shipped arithmetic file is what its script writes."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from ehp_fsm.data.dataset import CHECK_EVERY, DataConfig, DataError, load_dataset
from ehp_fsm.errors import PlanError
from ehp_fsm.models.tiny import build_tokenizer
from ehp_fsm.training.task import ArithmeticTask

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "examples" / "data" / "arithmetic.jsonl"
TOK = build_tokenizer()


def _write(tmp_path: Path, content: str | bytes, name: str = "d.jsonl") -> Path:
    p = tmp_path / name
    p.write_bytes(content.encode() if isinstance(content, str) else content)
    return p


def _load(path: Path, **kw):
    return load_dataset(DataConfig(train=path, **kw), TOK)


def test_records_become_examples_with_ids_labels_and_metadata(tmp_path: Path) -> None:
    p = _write(tmp_path, '{"prompt": "1+2=", "label": 3, "src": "a"}\n\n{"q": "4+4=", "a": "8"}\n')
    with pytest.raises(DataError) as err:
        _load(p)
    assert (err.value.path, err.value.line) == (str(p), 3)  # the blank line 2 is skipped
    p = _write(
        tmp_path, '{"prompt": "1+2=", "label": 3, "src": "a"}\n\n{"prompt": "4+4=", "label": "8"}\n'
    )
    ds = _load(p)
    assert len(ds) == 2
    first, second = ds.examples
    assert (first.line, first.prompt, first.label, dict(first.metadata)) == (
        1,
        "1+2=",
        "3",
        {"src": "a"},
    )
    assert first.prompt_ids == tuple(TOK("1+2=").input_ids)
    assert first.prompt_ids[0] == TOK.bos_token_id
    assert (second.line, second.index) == (3, 1)


def test_custom_keys_and_the_chat_template(tmp_path: Path) -> None:
    p = _write(tmp_path, '{"q": "4+4=", "a": "8"}\n')
    ds = _load(p, prompt_key="q", label_key="a", chat_template=True)
    (ex,) = ds.examples
    assert ex.text == TOK.apply_chat_template(
        [{"role": "user", "content": "4+4="}], tokenize=False, add_generation_prompt=True
    )
    assert ex.prompt == "4+4="
    assert ex.prompt_ids == tuple(TOK(ex.text, add_special_tokens=False).input_ids)


@pytest.mark.parametrize(
    ("content", "line", "needle"),
    [
        ("", 0, "holds no records"),
        ("\n  \n", 0, "holds no records"),
        (b'{"prompt": "1=", "label": "1"}\n{"prompt": "\xff", "label": "1"}\n', 2, "not UTF-8"),
        ('{"prompt": "1=", "label": "1"}\n{"prompt": "1=", \n', 2, "not valid JSON"),
        ('["1=", "1"]\n', 1, "not an object"),
        ('{"prompt": "1=", "label": "1"}\n{"label": "1"}\n', 2, "no 'prompt' key"),
        ('{"prompt": "1="}\n', 1, "no 'label' key"),
        ('{"prompt": ["1="], "label": "1"}\n', 1, "is a JSON array, not a string"),
        ('{"prompt": null, "label": "1"}\n', 1, "is a JSON null, not a string"),
        ('{"prompt": "1=", "label": {"x": 1}}\n', 1, "is a JSON object"),
        (
            '{"prompt": "1=", "label": "1"}\n{"prompt": "1234567+1=", "label": "1"}\n',
            2,
            "11 tokens",
        ),
        # valid JSON Python will not read: a RecursionError and a ValueError traceback before
        ('{"prompt": "1=", "label": "1"}\n' + "[" * 100_000 + "]" * 100_000, 2, "nests deeper"),
        ('{"prompt": "1=", "label": ' + "9" * 5000 + "}\n", 1, "4300 digits"),
        # refused by its length before it is tokenized (50 MB took 15 GB and minutes)
        ('{"prompt": "' + "1" * 200_000 + '", "label": "1"}\n', 1, "200000 characters"),
    ],
)
def test_refusals_name_the_file_and_line(tmp_path, content, line, needle) -> None:
    p = _write(tmp_path, content)
    with pytest.raises(DataError, match=needle) as err:
        _load(p, max_prompt_len=10)
    assert (err.value.path, err.value.line) == (str(p), line)
    assert str(p) + (f":{line}" if line else "") in str(err.value)
    assert err.value.fix


@pytest.mark.parametrize(
    ("line2", "said"),
    [
        ('{"prompt": "1=", "prompt": "2=", "label": "1"}', 'the key \'prompt\' twice ("1=", "2=")'),
        ('{"prompt": "1=", "label": "1", "label": 2}', "the key 'label' twice (\"1\", 2)"),
        (
            '{"prompt": "1=", "label": "1", "m": {"src": "a", "src": "b"}}',
            "the key 'src' twice in one of its nested objects",
        ),
    ],
)
def test_a_line_writing_a_key_twice_is_refused_naming_the_key(
    tmp_path: Path, line2: str, said: str
) -> None:
    """`json.loads` keeps the last of a repeated key silently: {"prompt": "1=", "prompt": "2="}
    trained on "2=", and a line with two labels was scored against the second."""
    p = _write(tmp_path, '{"prompt": "1=", "label": "1"}\n' + line2 + "\n")
    with pytest.raises(DataError) as err:
        _load(p)
    assert (err.value.path, err.value.line) == (str(p), 2)
    assert f"{p}:2" in str(err.value) and said in str(err.value), str(err.value)
    assert "keep one value for the key" in err.value.fix


def test_a_key_written_thousands_of_times_is_named_in_a_message_of_a_few_lines(
    tmp_path: Path,
) -> None:
    """Every value of the repeated key was shown: a line writing "prompt" 20,000 times (4 MB)
    was refused in a message of 2.4 MB. Now the first three, and how many in all."""
    line = "{" + ",".join([f'"prompt": "{"x" * 200}"'] * 20_000) + ', "label": "1"}'
    p = _write(tmp_path, line + "\n")
    with pytest.raises(DataError) as err:
        _load(p)
    said = str(err.value)
    assert len(said) < 1_000, len(said)
    assert "the key 'prompt' 20,000 times (" in said and ", and 19,997 more)" in said, said


def test_a_missing_file_or_a_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        _load(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="it is a folder, not a file"):
        _load(tmp_path)
    os.mkfifo(tmp_path / "fifo.jsonl")  # named for what it is ("it is not a file" before)
    with pytest.raises(DataError, match="it is a FIFO, not a file"):
        _load(tmp_path / "fifo.jsonl")


def test_chat_template_without_one_in_the_tokenizer_is_refused(tmp_path: Path) -> None:
    tok = build_tokenizer()
    tok.chat_template = None
    p = _write(tmp_path, '{"prompt": "1=", "label": "1"}\n')
    with pytest.raises(DataError, match="no chat template"):
        load_dataset(DataConfig(train=p, chat_template=True), tok)


def test_the_shuffle_is_a_deterministic_permutation_per_epoch(tmp_path: Path) -> None:
    rows = "".join(json.dumps({"prompt": f"{i}+0=", "label": str(i)}) + "\n" for i in range(50))
    p = _write(tmp_path, rows)
    a, b, c = _load(p, seed=1), _load(p, seed=1), _load(p, seed=2)
    assert a.epoch_order(0) == b.epoch_order(0)
    assert sorted(a.epoch_order(0)) == list(range(50))
    assert a.epoch_order(0) != a.epoch_order(1)
    assert a.epoch_order(0) != c.epoch_order(0)
    assert a.epoch_order(0) != tuple(range(50))
    # the stream: every epoch serves each example exactly once, in that epoch's order
    stream = [a.example_at(pos).index for pos in range(100)]
    assert stream[:50] == list(a.epoch_order(0))
    assert stream[50:] == list(a.epoch_order(1))
    # pinned: the order is part of a run's reproducibility across machines and versions
    assert a.epoch_order(0)[:8] == PINNED_ORDER
    assert list(a.positions_of_step(3, 4)) == [12, 13, 14, 15]


PINNED_ORDER = (11, 13, 22, 40, 29, 46, 9, 17)


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ({"train": "x.jsonl", "shuffle": True}, "data.shuffle"),
        ({}, "data.train"),
        ({"train": "x.jsonl", "max_prompt_len": "9"}, "data.max_prompt_len"),
        ({"train": "x.jsonl", "seed": True}, "data.seed"),
        ({"train": "x.jsonl", "max_prompt_len": 0}, "data.max_prompt_len"),
        ({"train": "x.jsonl", "label_key": "prompt"}, "data.label_key"),
    ],
)
def test_the_data_table_refuses_bad_keys_with_their_path(table, key) -> None:
    with pytest.raises(PlanError) as err:
        DataConfig.from_table(table, base_dir="/plans")
    assert err.value.key == key


def test_the_data_table_resolves_train_from_the_plan_directory() -> None:
    cfg = DataConfig.from_table(
        {"train": "d/x.jsonl", "prompt_key": "q", "chat_template": True, "seed": 4},
        base_dir="/plans",
    )
    assert cfg == DataConfig(
        train=Path("/plans/d/x.jsonl"), prompt_key="q", chat_template=True, seed=4
    )
    assert DataConfig.from_table({"train": "/abs.jsonl"}, base_dir="/plans").train == Path(
        "/abs.jsonl"
    )


def test_the_shipped_arithmetic_file_is_what_its_script_writes(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location(
        "make_arithmetic", SHIPPED.with_name("make_arithmetic.py")
    )
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "again.jsonl"
    assert script.main(["--out", str(out)]) == 0
    assert out.read_bytes() == SHIPPED.read_bytes()
    ds = _load(SHIPPED, max_prompt_len=16)
    assert len(ds) >= 2000
    task = ArithmeticTask(max_operand=99, max_new_tokens=6)
    for ex in ds.examples[:200]:
        q = task.question(ex.metadata["index"])
        assert (ex.prompt, ex.label) == (q.text, str(q.answer))
        assert ex.prompt_ids == q.prompt_ids


def test_the_dataset_task_scores_a_group_in_one_reward_call(tmp_path: Path, monkeypatch) -> None:
    """`DatasetTask.score_group` decodes the group and hands it to the reward's thread in one
    call; under on_error = "zero" a failing completion scores 0, the others keep their marks."""
    from ehp_fsm.data.rewards import Reward
    from ehp_fsm.data.task import DatasetTask

    def fn(prompt: str, completion: str, label: str, metadata: object) -> float:
        if completion == "12":
            raise ValueError("not an answer")
        return 1.0 if completion == label else 0.5

    p = _write(tmp_path, '{"prompt": "1+2=", "label": "3"}\n')
    reward = Reward(fn=fn, name="f", on_error="zero")
    task = DatasetTask(_load(p), TOK, reward, max_new_tokens=4, temperature=1.0, max_prompt_len=8)
    handed: list[tuple[str, ...]] = []
    call = reward._caller.call

    def counted(c, timeout_s: float):
        handed.append(c.completions)
        return call(c, timeout_s)

    monkeypatch.setattr(reward._caller, "call", counted)
    eos = TOK.eos_token_id
    enc = TOK.encode
    comps = [
        [*enc("3", add_special_tokens=False), eos],
        enc("12"),
        enc("4", add_special_tokens=False),
    ]
    g = task.score_group(0, comps)
    assert handed == [("3", "12", "4")]  # decoded (specials skipped), one hand-over for the group
    assert [s.reward for s in g.scores] == [1.0, 0.0, 0.5]
    assert [(s.exact, s.well_formed) for s in g.scores] == [
        (True, True),
        (False, False),
        (False, False),
    ]
    assert reward.failures.by_kind == {"raised": 1}
    assert task.score(task.question(0), comps[0]).reward == 1.0


def test_an_empty_prompt_of_no_tokens_is_refused_with_its_line(tmp_path: Path) -> None:
    """A tokenizer that adds no start token (Qwen's) makes "" a request of no tokens, which
    every engine refuses (400 "empty prompt") — found in the run, minutes in; now by check."""
    from tokenizers import processors

    tok = build_tokenizer()
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="$A", pair="$A $B"
    )  # no <bos>, as Qwen's tokenizer
    assert tok("")["input_ids"] == [] and tok("1=")["input_ids"] != []
    p = _write(tmp_path, '{"prompt": "1=", "label": "1"}\n{"prompt": "", "label": "0"}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:2 .*0 tokens"):
        load_dataset(DataConfig(train=p), tok)
    assert len(_load(p)) == 2  # with a start token the empty prompt is one token: kept


def test_a_utf8_byte_order_mark_is_skipped(tmp_path: Path) -> None:
    """A file saved with a BOM (Windows editors, Excel's CSV → JSONL) was refused at line 1 as
    "not valid JSON (Unexpected UTF-8 BOM ...). Fix: write one JSON object per line"."""
    p = _write(
        tmp_path, b'\xef\xbb\xbf{"prompt": "1=", "label": "1"}\r\n{"prompt": "2=", "label": 2}\n'
    )
    ds = _load(p)
    assert [ex.prompt for ex in ds.examples] == ["1=", "2="] and ds.examples[1].label == "2"
    inner = _write(tmp_path, '{"prompt": "1=", "label": "1"}\n\ufeff{"prompt": "2=", "label": 2}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:2 "):  # only the file's start is a BOM
        _load(inner)


def test_a_prompt_of_messages_goes_through_the_chat_template_as_it_is(tmp_path: Path) -> None:
    """A prompt written as a list of messages (a system message, then the user's: how verl's
    and OpenRLHF's data sets write one) was refused ("is a JSON array, not a string"). With
    `chat_template = true` the messages are rendered as they are, and the reward receives them
    as written, its own copy for each call."""
    from ehp_fsm.data.rewards import make_reward

    messages = [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "4+4="},
    ]
    p = _write(tmp_path, json.dumps({"prompt": messages, "label": "8"}) + "\n")
    (ex,) = _load(p, chat_template=True).examples
    assert ex.text == TOK.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "Answer with a number." in ex.text and ex.prompt == messages
    assert ex.prompt_ids == tuple(TOK(ex.text, add_special_tokens=False).input_ids)

    seen: list[object] = []

    def score(prompt: object, completion: str, label: str, metadata: object) -> float:
        seen.append(prompt)
        assert isinstance(prompt, list)
        prompt.clear()  # a reward that changes its copy changes nothing else
        return float(completion.strip() == label)

    import sys
    import types

    mod = types.ModuleType("msg_reward_mod")
    mod.score = score  # type: ignore[attr-defined]
    sys.modules["msg_reward_mod"] = mod
    try:
        reward = make_reward("msg_reward_mod:score")
        assert reward.score_group_sync(ex.prompt, ["8", "9"], ex.label, ex.metadata) == [1.0, 0.0]
    finally:
        del sys.modules["msg_reward_mod"]
    assert seen == [[], []] and ex.prompt == messages  # each call cleared only its own copy


@pytest.mark.parametrize(
    ("prompt", "chat_template", "needle"),
    [
        ([{"role": "user", "content": "1="}], False, "is a JSON array, not a string"),
        ([], True, "is an empty list"),
        (["1="], True, "message 0 of the prompt ('prompt') is not"),
        ([{"role": "tool", "content": "x"}], True, "message 0 of the prompt"),
        ([{"role": "user", "content": 1}], True, "message 0 of the prompt"),
        (
            [{"role": "user", "content": "1="}, {"role": "assistant", "content": "1"}],
            True,
            "ends with an assistant message",
        ),
        ([{"role": "system", "content": "Add."}], True, "ends with a system message"),
        ([{"role": "user", "content": "\ud800"}], True, "holds \\ud800"),
    ],
)
def test_a_prompt_of_messages_the_template_cannot_take_is_refused_with_its_line(
    tmp_path: Path, prompt: object, chat_template: bool, needle: str
) -> None:
    p = _write(
        tmp_path,
        '{"prompt": "1=", "label": "1"}\n' + json.dumps({"prompt": prompt, "label": "1"}) + "\n",
    )
    with pytest.raises(DataError) as err:
        _load(p, chat_template=chat_template)
    assert err.value.line == 2 and needle in str(err.value), str(err.value)


def test_token_ids_are_held_packed_four_bytes_a_token(tmp_path: Path) -> None:
    """A prompt's ids were a tuple of Python ints: 8 bytes a token, and 32 more for every id
    above 256 (any real vocabulary's) — a 242-token prompt held 8.8 KB, 2,000,000 of them
    17 GB. They are native int32 now; what the dataset holds in all stays under 12 bytes a
    token here (ids, the prompt's text at 2 bytes a character, and each example's fields)."""
    import random
    import tracemalloc

    alphabet = "".join(chr(0x4E00 + i) for i in range(600))  # ids up to ~600: none cached
    tok = build_tokenizer(alphabet)
    rng = random.Random(0)
    lines = [
        json.dumps({"prompt": "".join(rng.choices(alphabet, k=200)), "label": str(i)})
        for i in range(2000)
    ]
    p = _write(tmp_path, "\n".join(lines) + "\n")
    config = DataConfig(train=p)
    tracemalloc.start()
    try:
        ds = load_dataset(config, tok)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    tokens = sum(len(ex.prompt_ids) for ex in ds.examples)
    assert tokens >= 2000 * 200 and max(max(ex.prompt_ids) for ex in ds.examples) > 256
    assert held / tokens < 12, f"{held / tokens:.1f} bytes a token"
    first = ds.examples[0]
    assert first.prompt_ids == tuple(tok(first.text).input_ids)  # unpacked as they were
    assert isinstance(first.packed_ids, bytes)  # and immutable, as the frozen example is


def test_the_checkpoint_is_called_through_every_pass_and_what_it_raises_ends_the_load(
    tmp_path: Path,
) -> None:
    """A run stopped while it read its prompts read and tokenized all of them first (600,000:
    14.5 s). `load_dataset` calls its checkpoint every `CHECK_EVERY` lines of each pass."""
    n = 2 * CHECK_EVERY + 1  # 3 calls in each of the 4 passes (read, examples, render, encode)
    p = _write(tmp_path, b'{"prompt": "1+2=", "label": "3"}\n' * n)
    calls: list[int] = []
    ds = load_dataset(DataConfig(train=p), TOK, checkpoint=lambda: calls.append(1))
    assert len(ds) == n and len(calls) == 4 * 3

    class Stop(Exception):
        pass

    for at in (1, 4, 7, 10, 12):  # the first call of each pass, and the last one
        calls.clear()

        def stop(at: int = at) -> None:
            calls.append(1)
            if len(calls) == at:
                raise Stop

        with pytest.raises(Stop):
            load_dataset(DataConfig(train=p), TOK, checkpoint=stop)
        assert len(calls) == at
