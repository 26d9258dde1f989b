"""Prompt datasets: `[data] train = "FILE.jsonl"`, one JSON object per line, read once, checked
completely before a run starts, and served in a deterministic per-epoch shuffle.

The plan's table (every key used or refused, as everywhere in a plan):

    [data]
    train = "examples/data/arithmetic.jsonl"  # relative to the plan file's directory
    prompt_key = "prompt"       # the prompt: a string, or (chat_template) a list of messages
    label_key = "label"         # what the reward compares against (a string or a number)
    chat_template = false       # true: render the prompt as one user message (a list of
                                # {"role", "content"} messages: as they are) with the
                                # tokenizer's chat template (generation prompt added)
    max_prompt_len = 256        # tokens, after the template, special tokens included
    seed = 0                    # the shuffle's seed

Every other key of a line is kept as the example's `metadata` (the reward receives it). A
label is handed to the reward as a string: a number as the line writes it (`1.50` is "1.50",
`1e3` is "1e3").

Refusals (`DataError`, naming the file and, where there is one, the 1-based line): a missing
file, a file without any record, bytes that are not UTF-8, a line that is not a JSON object (or
JSON Python will not read: nested past the recursion limit, an integer of over 4300 digits), a
line that writes a key twice in one object (`json.loads` kept the last, silently), a missing
prompt or label key, a prompt that is not a string, a label that is not a string or a
number, a prompt or label holding a lone surrogate (half of a `\\ud83d\\ude00` escape), a
prompt of no tokens (an empty prompt, where the tokenizer adds no start token) or
longer than `max_prompt_len` tokens (one too long in characters for that many tokens is refused
before it is tokenized). Blank lines and a UTF-8 byte order mark at the start are skipped; a
UTF-16 or UTF-32 file is named as such.

Order: `example_at(position)` is the example at a global position of the prompt stream —
position p is item p mod N of epoch p div N, and each epoch is a Fisher–Yates shuffle driven by
SplitMix64 of (seed, epoch), so the stream is the same on every machine and Python version and
depends on nothing but (file, seed). A step that consumes G prompts takes positions
step·G … step·G + G − 1 (`positions_of_step`).

What it does not know: rewards (`data.rewards`), engines, batching into tensors.
"""

from __future__ import annotations

import difflib
import json
import math
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

from ehp_fsm.errors import EhpError, PlanError, printable, toml_key
from ehp_fsm.fspaths import container_of, path_kind, path_problem

_MASK64 = (1 << 64) - 1
_NO_METADATA: Final[Mapping[str, Any]] = MappingProxyType({})  # every example without any
_KEYS = ("train", "prompt_key", "label_key", "chat_template", "max_prompt_len", "seed")


class DataError(EhpError):
    """A dataset file cannot be used. `path` and `line` (1-based; 0 = the file as a whole)."""

    def __init__(self, path: str, line: int, why: str, fix: str) -> None:
        self.path, self.line = path, line
        where = printable(f"{path}:{line}" if line else path)  # a plan's text, kept on one line
        super().__init__(f"dataset {where} cannot be used", printable(why), fix)


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """The validated `[data]` table."""

    train: Path
    prompt_key: str = "prompt"
    label_key: str = "label"
    chat_template: bool = False
    max_prompt_len: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_key or not self.label_key:
            raise PlanError("data.prompt_key", "the key names must not be empty")
        if self.prompt_key == self.label_key:
            raise PlanError(
                "data.label_key",
                f"it equals prompt_key ({self.prompt_key!r})",
                "the label must be a separate field of each line",
            )
        if self.max_prompt_len < 1:
            raise PlanError("data.max_prompt_len", f"{self.max_prompt_len} is not ≥ 1")
        if self.seed < 0:
            raise PlanError("data.seed", f"{self.seed} is negative", "use a seed ≥ 0")
        if self.seed > 0xFFFFFFFF:  # the shuffle keeps 32 bits: a larger seed would alias
            raise PlanError(
                "data.seed", f"{self.seed} exceeds {0xFFFFFFFF}", "use a seed in 0..4294967295"
            )

    @classmethod
    def from_table(
        cls, table: Mapping[str, Any], *, base_dir: str | Path = ".", file: str = ""
    ) -> DataConfig:
        """Parse a plan's `[data]` table; a relative `train` is taken from `base_dir` (the plan
        file's directory). Unknown keys and wrong types are refused with their key path."""
        for key in table:
            if key not in _KEYS:
                # a plan's [data] keys: its prompt limit is [model] max_prompt_len (the list
                # named max_prompt_len here, which a plan then refused in [data])
                shown = [k for k in _KEYS if k != "max_prompt_len"]
                close = difflib.get_close_matches(str(key), shown, n=1, cutoff=0.6)
                raise PlanError(
                    f"data.{toml_key(key)}",
                    "it is not a [data] key",
                    (f"did you mean `{close[0]}`? Else " if close else "")
                    + f"use only {shown} (the prompt limit is [model] max_prompt_len)",
                    path=file,
                )
        if "train" not in table:
            raise PlanError(
                "data.train", "it is missing", 'name a JSONL file: train = "x.jsonl"', path=file
            )
        kinds: dict[str, type] = {
            "train": str,
            "prompt_key": str,
            "label_key": str,
            "chat_template": bool,
            "max_prompt_len": int,
            "seed": int,
        }
        for key, kind in kinds.items():
            value = table.get(key)
            bad_int = kind is int and isinstance(value, bool)
            if key in table and (not isinstance(value, kind) or bad_int):
                raise PlanError(
                    f"data.{key}",
                    f"it is {value!r}, not a {kind.__name__}",
                    f"give a {kind.__name__}",
                    path=file,
                )
        if (problem := path_problem(table["train"])) is not None:
            raise PlanError(
                "data.train", problem, 'name a JSONL file: train = "x.jsonl"', path=file
            )
        train = Path(table["train"])
        kwargs = {k: table[k] for k in _KEYS[1:] if k in table}
        try:
            return cls(train=train if train.is_absolute() else Path(base_dir) / train, **kwargs)
        except PlanError as exc:  # the config's own checks name the key; add the plan file
            raise PlanError(exc.key, exc.why, exc.fix, path=file) from None


#: A prompt as a line writes it: a string, or (with `chat_template = true`) a list of messages
#: `{"role": ..., "content": ...}`, which the reward receives as written.
PromptValue = str | list[dict[str, str]]


@dataclass(frozen=True, kw_only=True, slots=True)
class Example:
    """One prompt of the dataset. `line` is its 1-based line in the file; `text` is what the
    engine is asked to continue (the prompt after the chat template, if any) and `prompt_ids`
    its tokens; `prompt` is the raw prompt the reward receives (a string, or a list of
    messages)."""

    index: int
    line: int
    prompt: PromptValue
    text: str
    #: the prompt's token ids as native int32 (`pack_ids`; `prompt_ids` unpacks them): 4 bytes
    #: a token where a tuple of Python ints took 8, and 32 more for each id above 256 — a
    #: 242-token prompt held 2 KB of tuple, with a real vocabulary 8.8 KB
    packed_ids: bytes
    label: str
    metadata: Mapping[str, Any] = field(default_factory=dict)

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return tuple(memoryview(self.packed_ids).cast("i"))


def pack_ids(ids: Iterable[int]) -> bytes:
    """Token ids as `Example.packed_ids` holds them (native int32; a vocabulary is far below
    2**31 ids)."""
    return array("i", ids).tobytes()


@dataclass(frozen=True)
class PromptDataset:
    """The checked examples of a file, in file order, and their shuffled stream."""

    path: Path
    examples: tuple[Example, ...]
    seed: int

    def __len__(self) -> int:
        return len(self.examples)

    def epoch_order(self, epoch: int) -> tuple[int, ...]:
        """Example indices in the order of `epoch` (a permutation of 0 … N−1)."""
        if epoch < 0:
            raise ValueError(f"epoch must be ≥ 0, got {epoch}")
        return _shuffled(len(self.examples), self.seed, epoch)

    def example_at(self, position: int) -> Example:
        """The example at global stream position `position` (see the module docstring)."""
        if position < 0:
            raise ValueError(f"position must be ≥ 0, got {position}")
        epoch, offset = divmod(position, len(self.examples))
        return self.examples[self.epoch_order(epoch)[offset]]

    def positions_of_step(self, step: int, prompts_per_step: int) -> range:
        return range(step * prompts_per_step, (step + 1) * prompts_per_step)


class _DuplicateKey(ValueError):
    """A JSON object of a line writes a key twice (`_duplicate` says which and where)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """`object_pairs_hook` of a prompts line: its object as a dict, or `_DuplicateKey` for a
    key written twice (`json.loads` kept the last value, silently: {"prompt": "a", "prompt":
    "b"} trained on "b"). A dict, then a length compare: ~6 % over `json.loads` a line."""
    record = dict(pairs)
    if len(record) != len(pairs):
        raise _DuplicateKey
    return record


def _duplicate(text: str) -> str:
    """What `_unique_keys` refused in line `text`: the first key written twice in one object,
    its values, and whether that object is the line's own or one nested in it."""
    objects: list[list[tuple[str, Any]]] = []

    def kept(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        objects.append(pairs)
        return dict(pairs)

    decoder = json.JSONDecoder(object_pairs_hook=kept)
    try:  # (raw: text after the object is the line's other error, not this one's)
        decoder.raw_decode(text.lstrip())
        closed = True
    except (ValueError, RecursionError):  # the line breaks after the repeated key
        closed = False
    for n, pairs in enumerate(objects):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                found = [v for k, v in pairs if k == key]
                # (the first few: a key written 20,000 times in a 4 MB line was a 2.4 MB message)
                values = ", ".join(_shown_json(v) for v in found[:3])
                if len(found) > 3:
                    values += f", and {len(found) - 3:,} more"
                times = "twice" if len(found) == 2 else f"{len(found):,} times"
                # an object's hook runs after those of the objects it holds: the line's is last
                top = closed and n == len(objects) - 1
                where = "" if top else " in one of its nested objects"
                return f"the line writes the key {key!r} {times}{where} ({values})"
            seen.add(key)
    return "the line writes a key twice"  # (not reached: `_unique_keys` found one)


#: The decoder of a prompts line (`_unique_keys`).
_LINE: Final = json.JSONDecoder(object_pairs_hook=_unique_keys)

_ONE_A_LINE: Final = "write one JSON object per line"
#: A JSON array of records (what `json.dump(rows, f)` writes) as JSON Lines.
_FROM_ARRAY: Final = "write one JSON object per line (jq -c '.[]' {name} > prompts.jsonl)"


#: Lines (or prompts) between two calls of `load_dataset`'s `checkpoint`.
CHECK_EVERY: Final = 16384


def _checked(items: Iterable[Any], checkpoint: Callable[[], None]) -> Iterator[Any]:
    """`items`, calling `checkpoint` before the first and every `CHECK_EVERY`th."""
    for n, item in enumerate(items):
        if n % CHECK_EVERY == 0:
            checkpoint()
        yield item


def no_checkpoint() -> None:
    """The `checkpoint` of a load nothing can stop."""


def load_dataset(
    config: DataConfig, tokenizer: Any, *, checkpoint: Callable[[], None] = no_checkpoint
) -> PromptDataset:
    """Read and check `config.train` completely (see the refusals in the module docstring).
    `tokenizer` is a transformers tokenizer (`load_model(...).tokenizer`). `checkpoint` is
    called every `CHECK_EVERY` lines of each pass (reading, rendering, tokenizing): what it
    raises ends the load (a run stopped while it reads its inputs: a 600,000-prompt file was
    read and tokenized whole, 14.5 s, before the run said it stopped)."""
    path = config.train
    where = str(path)
    if (kind := path_kind(path)) != "a file":  # a FIFO, a folder: named, not "not a file"
        raise DataError(
            where,
            0,
            "the file does not exist" if kind is None else f"it is {kind}, not a file",
            "set [data] train to a JSONL file (relative paths start at the plan's directory)",
        )
    raw = path.read_bytes()
    if (packed := container_of(raw)) is not None:  # was "byte 1 ... is not UTF-8": re-encode
        kind, how = packed
        raise DataError(
            where,
            0,
            f"the file is {kind}, not JSONL text",
            f"{how.replace('FILE', path.name)} into a .jsonl, and set [data] train to it",
        )
    if (wide := _wide_unicode(raw[:4])) is not None:  # was "byte 0 ... is not UTF-8"
        raise DataError(
            where,
            0,
            f"the file is {wide} text (it starts with a {wide} byte order mark; Windows "
            "PowerShell's `>` and Out-File write UTF-16), not UTF-8",
            f"re-encode it as UTF-8 (iconv -f {wide[:6]} -t UTF-8 {path.name} > prompts.jsonl; "
            "in PowerShell: Out-File -Encoding utf8) and set [data] train to it",
        )
    if raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark (Windows editors, Excel)
        raw = raw[3:]  # line 1 was refused as "not valid JSON", told to write JSON objects
    rows: list[tuple[int, dict[str, Any]]] = []
    for number, chunk in _checked(enumerate(raw.split(b"\n"), start=1), checkpoint):
        try:
            text = chunk.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(
                where,
                number,
                f"byte {exc.start} of the line is not UTF-8 ({exc.reason})",
                "re-encode the file as UTF-8",
            ) from exc
        if not text.strip():
            continue
        try:
            record = _LINE.decode(text)
        except _DuplicateKey:  # json.loads kept the last of them, silently
            raise DataError(
                where,
                number,
                _duplicate(text) + ": a JSON reader keeps one of them (Python's the last), so "
                "which one the run would use is a guess",
                "keep one value for the key on the line (a JSONL file built by joining objects "
                "may repeat one)",
            ) from None
        except json.JSONDecodeError as exc:
            why, fix = f"the line is not valid JSON ({exc.msg} at column {exc.colno})", _ONE_A_LINE
            if "\r" in text.rstrip():  # lines that end in CR alone: the file is one "line"
                why += "; its lines end in CR alone (an old Mac editor), not LF"
                fix = f"convert the line ends (tr '\\r' '\\n' < {path.name} > fixed.jsonl)"
            elif text.lstrip(" \t").startswith("\ufeff"):  # `cat a.jsonl b.jsonl`, b with a BOM
                # (the file's own first mark is skipped above; this one was an invisible
                # "Expecting value at column 1", told to write JSON objects)
                why += (
                    "; it starts with a UTF-8 byte order mark (U+FEFF, invisible in an editor): "
                    "a file saved with one was joined after this file's other lines"
                )
                fix = (
                    "remove the marks (sed 's/^\\xEF\\xBB\\xBF//' "
                    f"{path.name} > fixed.jsonl) and set [data] train to the fixed file"
                )
            elif number == 1 and text.strip() == "[":  # a pretty-printed JSON array
                why += "; the file is one JSON array (a .json file), not JSON Lines"
                fix = _FROM_ARRAY.format(name=path.name)
            elif "\x00" in text:  # UTF-16 without its byte order mark: NULs between the bytes
                why += "; it holds NUL bytes, as UTF-16 or UTF-32 text does"
                fix = (
                    f"re-encode the file as UTF-8 (iconv -f UTF-16LE -t UTF-8 {path.name} > "
                    "prompts.jsonl, if it is UTF-16 written on Windows)"
                )
            raise DataError(where, number, why, fix) from exc
        except (ValueError, RecursionError) as exc:  # valid JSON Python will not read
            raise DataError(
                where,
                number,
                "the line cannot be read: "
                + (
                    "its JSON nests deeper than Python's recursion limit"
                    if isinstance(exc, RecursionError)
                    else str(exc).split(";")[0]  # an integer of more than 4300 digits
                ),
                "write one flat JSON object per line (prompt, label and metadata)",
            ) from None
        if not isinstance(record, dict):
            raise DataError(
                where,
                number,
                f"the line is a JSON {type(record).__name__}, not an object",
                _FROM_ARRAY.format(name=path.name) if isinstance(record, list) else _ONE_A_LINE,
            )
        label = record.get(config.label_key)
        if isinstance(label, int | float) and not isinstance(label, bool) and math.isfinite(label):
            record[config.label_key] = _written_label(text, config.label_key, label)
        rows.append((number, record))
    if not rows:
        raise DataError(
            where, 0, "it holds no records", "write at least one JSON object, one per line"
        )
    examples = [
        _example(i, number, rec, config, where)
        for i, (number, rec) in _checked(enumerate(rows), checkpoint)
    ]
    del rows
    texts = [
        _render(ex.prompt, config, tokenizer, ex.line) for ex in _checked(examples, checkpoint)
    ]
    if (most := max_text_chars(tokenizer, config.max_prompt_len)) is not None:
        for ex, text in zip(examples, texts, strict=True):  # before any of them is tokenized
            if len(text) > most:
                raise DataError(
                    where,
                    ex.line,
                    f"the prompt is {len(text)} characters{_wrapped(config)}, more than "
                    f"max_prompt_len = {config.max_prompt_len} tokens of this tokenizer can "
                    f"hold (at most {most} characters)",
                    "shorten or drop the prompt, or raise [model] max_prompt_len",
                )
    out: list[Example] = []
    encoded = _encoded(tokenizer, texts, config)
    for ex, text, ids in _checked(zip(examples, texts, encoded, strict=True), checkpoint):
        if not ids:  # an empty prompt, with a tokenizer that adds no start token (Qwen's)
            raise DataError(
                where,
                ex.line,
                f"the prompt ({config.prompt_key!r}) is {prompt_chars(ex.prompt)} characters and 0 "
                "tokens: an engine refuses a request with nothing to continue",
                "give the line a non-empty prompt, or drop it",
            )
        if len(ids) > config.max_prompt_len:
            raise DataError(
                where,
                ex.line,
                f"the prompt is {len(ids)} tokens{_wrapped(config)}, longer than "
                f"max_prompt_len = {config.max_prompt_len}",
                # a plan's limit is [model] max_prompt_len: [data] refuses the key
                "shorten or drop the prompt, or raise [model] max_prompt_len",
            )
        out.append(
            Example(
                index=ex.index,
                line=ex.line,
                prompt=ex.prompt,
                text=text,
                packed_ids=pack_ids(ids),
                label=ex.label,
                metadata=ex.metadata,
            )
        )
    return PromptDataset(path=path, examples=tuple(out), seed=config.seed)


#: The fewest characters a token is taken to cover when bounding a text by its length: a guess
#: for a vocabulary of short strings (the engine bounds a request's `text` the same way).
MIN_CHARS_PER_TOKEN = 16


def max_text_chars(tokenizer: Any, tokens: int) -> int | None:
    """The longest text worth tokenizing when at most `tokens` tokens fit: `tokens` × the
    longest string of the tokenizer's vocabulary (at least `MIN_CHARS_PER_TOKEN`) — a token of
    a byte-level or SentencePiece vocabulary covers at most its string's length, so a longer
    text cannot fit. A 50 MB prompt was tokenized whole before its length was compared: 15 GB
    and over two minutes of `check`. None: no vocabulary to read (every text is tokenized; a
    guess of 16 characters a token refused texts that fit when its tokens were longer)."""
    try:
        longest = max((len(str(t)) for t in tokenizer.get_vocab()), default=0)
    except (AttributeError, NotImplementedError, TypeError):  # no vocabulary to read
        return None
    return tokens * max(longest, MIN_CHARS_PER_TOKEN) if longest else None


#: Prompts tokenized per call: the whole file at once held every prompt's encoding (ids,
#: attention mask, offsets) together — 533 MB peak for 100k short prompts.
_ENCODE_CHUNK = 4096


def _encoded(tokenizer: Any, texts: list[str], config: DataConfig) -> Iterator[list[int]]:
    """Each text's token ids, tokenized a chunk at a time (ids only)."""
    for start in range(0, len(texts), _ENCODE_CHUNK):
        yield from tokenizer(
            texts[start : start + _ENCODE_CHUNK],
            add_special_tokens=not config.chat_template,
            return_attention_mask=False,
            return_token_type_ids=False,
        )["input_ids"]


def _example(
    index: int, line: int, record: Mapping[str, Any], config: DataConfig, where: str
) -> Example:
    for key in (config.prompt_key, config.label_key):
        if key not in record:
            raise DataError(
                where,
                line,
                f"the line has no {key!r} key (it has {sorted(record)})",
                "add the key to every line, or set [data] prompt_key / label_key to its name",
            )
    prompt = record[config.prompt_key]
    if isinstance(prompt, list):
        _check_messages(prompt, config, where, line)
    elif not isinstance(prompt, str):
        raise DataError(
            where,
            line,
            f"the prompt ({config.prompt_key!r}) is a JSON {_json_kind(prompt)}, not a string",
            "write the prompt as a string (chat_template = true wraps it as a user message), "
            'or, with chat_template = true, as a list of messages ({"role": ..., "content": '
            "...})",
        )
    label = record[config.label_key]
    texts = [m["content"] for m in prompt] if isinstance(prompt, list) else [prompt]
    for what, key, value in (
        *(("prompt", config.prompt_key, t) for t in texts),
        ("label", config.label_key, label),
    ):
        if isinstance(value, str) and (bad := _lone_surrogate(value)) is not None:
            raise DataError(
                where,
                line,
                f"the {what} ({key!r}) holds {bad}: half of a UTF-16 pair, written as a JSON "
                "escape without its other half, which is no character (no tokenizer or "
                "reward can take it)",
                "write the character itself in UTF-8, or both halves of its escape "
                "(e.g. \\ud83d\\ude00), or drop it",
            )
    if isinstance(label, bool) or not isinstance(label, str | int | float):
        raise DataError(
            where,
            line,
            f"the label ({config.label_key!r}) is a JSON {_json_kind(label)}",
            "write the label as a string or a number",
        )
    if isinstance(label, float) and not math.isfinite(label):
        raise DataError(where, line, f"the label is {label}", "write a finite number")
    metadata = {k: v for k, v in record.items() if k not in (config.prompt_key, config.label_key)}
    # (one empty mapping for every line without metadata, no `__dict__` per example: a
    # 2,000,000-line file of prompts and labels took 1.96 GB to check)
    return Example(
        index=index,
        line=line,
        prompt=prompt,
        text=prompt,
        packed_ids=b"",
        label=label if isinstance(label, str) else str(label),
        metadata=metadata or _NO_METADATA,
    )


#: The roles a chat-format prompt's messages may have (what chat templates render).
MESSAGE_ROLES: Final = ("system", "user", "assistant")


def _check_messages(prompt: list[Any], config: DataConfig, where: str, line: int) -> None:
    """Refuse a chat-format prompt (a list of messages, as verl and OpenRLHF data sets write
    one: a system message, then the user's) that the chat template cannot take as it is: one
    without `chat_template = true` (the run would have nothing to render it with), an empty
    list, a message that is not an object with a `role` of `MESSAGE_ROLES` and a string
    `content`, or one that ends with another message than the user's (the model continues
    the last turn: a prompt ends with the user's; a system message alone asks nothing)."""
    key = config.prompt_key
    if not config.chat_template:
        raise DataError(
            where,
            line,
            f"the prompt ({key!r}) is a JSON array, not a string (a list of messages is "
            "rendered by the tokenizer's chat template, and chat_template = false)",
            'write the prompt as a string, or as messages ({"role": ..., "content": ...}) '
            "with [data] chat_template = true",
        )
    if not prompt:
        raise DataError(where, line, f"the prompt ({key!r}) is an empty list", "give it messages")
    for i, m in enumerate(prompt):
        ok = (
            isinstance(m, dict)
            and m.get("role") in MESSAGE_ROLES
            and isinstance(m.get("content"), str)
        )
        if not ok:
            raise DataError(
                where,
                line,
                f"message {i} of the prompt ({key!r}) is not "
                '{"role": "system" | "user" | "assistant", "content": "<text>"} '
                f"(it is {_shown_json(m)})",
                "write each message as an object with a role and a string content",
            )
    if prompt[-1]["role"] != "user":  # (a system message alone passed: nothing was asked)
        raise DataError(
            where,
            line,
            f"the prompt ({key!r}) ends with {'an' if prompt[-1]['role'] == 'assistant' else 'a'}"
            f" {prompt[-1]['role']} message",
            "end it with the user's message: the model answers after the last one",
        )


def _shown_json(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 120 else text[:120] + "…"


def prompt_chars(prompt: PromptValue) -> int:
    """The characters of a prompt: a string's, or the contents of its messages together."""
    return len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in prompt)


def _wide_unicode(head: bytes) -> str | None:
    """The encoding a UTF-16 or UTF-32 byte order mark at the start of a file names."""
    for mark, name in (
        (b"\xff\xfe\x00\x00", "UTF-32LE"),
        (b"\x00\x00\xfe\xff", "UTF-32BE"),
        (b"\xff\xfe", "UTF-16LE"),
        (b"\xfe\xff", "UTF-16BE"),
    ):
        if head.startswith(mark):
            return name
    return None


def _written_label(text: str, key: str, parsed: int | float) -> str:
    """A numeric label as its line writes it (`1.50`, `1e3`, `-0`): the label is the line's,
    as a string, and `str()` of the parsed number gave "1.5", "1000.0" and "0" — an
    `exact_match` against a completion "1.50" scored 0. Only a line whose label is a number is
    read again (its numbers kept as their text)."""
    try:
        written = json.loads(text, parse_int=str, parse_float=str).get(key)
    except (ValueError, RecursionError):  # (read once already: not expected)
        written = None
    return written if isinstance(written, str) else str(parsed)


def _lone_surrogate(text: str) -> str | None:
    """The first lone surrogate of `text` (a JSON `\\ud800` escape without its pair), shown
    with its character offset; None when `text` is all characters. Such a prompt crashed
    `check` with a TypeError out of the tokenizer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"\\u{ord(text[exc.start]):04x} at character {exc.start + 1}"
    return None


def _wrapped(config: DataConfig) -> str:
    """What a prompt's length counts, said where it is refused: with `chat_template = true` the
    prompt inside the template's turn markers (a 4-character prompt, "2+9=", was refused as "9
    tokens" without a word of why)."""
    return " with the chat template (chat_template = true)" if config.chat_template else ""


def _render(prompt: PromptValue, config: DataConfig, tokenizer: Any, line: int = 0) -> str:
    """The text the engine continues: `prompt`, or with `chat_template = true` the prompt as
    one user message (a list of messages: as they are) through the tokenizer's chat template,
    generation prompt added. A template that cannot render it (one that raises "System message
    required", a syntax error, a filter jinja lacks) is refused naming the line: it crashed
    `check` with jinja's traceback."""
    if not config.chat_template:
        assert isinstance(prompt, str)  # (a list of messages is refused without a template)
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            str(config.train),
            0,
            "chat_template = true but the tokenizer has no chat template",
            "set chat_template = false, or use a model directory whose tokenizer has one",
        )
    try:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # jinja and transformers fail with anything a template leads to
        raise DataError(
            str(config.train),
            line,
            "chat_template = true, and the tokenizer's chat template cannot render the prompt "
            f"{'as one user message' if isinstance(prompt, str) else 'messages'} "
            f"({type(exc).__name__}: {str(exc)[:300]})",
            "fix the model's chat template (chat_template.jinja or tokenizer_config.json's "
            "chat_template), or set chat_template = false and write each prompt as the "
            "model is to continue it",
        ) from None
    if not isinstance(text, str):
        raise DataError(
            str(config.train),
            line,
            f"the tokenizer's chat template rendered a {type(text).__name__}, not a text",
            "fix the model's chat template, or set chat_template = false",
        )
    return text


def _json_kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _splitmix64(x: int) -> int:
    """One SplitMix64 output for state `x` (the same portable hash as `ehp_fsm.training.task`)."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@lru_cache(maxsize=4)
def _shuffled(n: int, seed: int, epoch: int) -> tuple[int, ...]:
    """Fisher–Yates over 0 … n−1 driven by SplitMix64((seed, epoch, i)); portable, pure."""
    order = list(range(n))
    base = ((seed & 0xFFFFFFFF) << 32) ^ (epoch & 0xFFFFFFFF)
    state = _splitmix64(base)
    for i in range(n - 1, 0, -1):
        state = _splitmix64(state)
        j = state % (i + 1)
        order[i], order[j] = order[j], order[i]
    return tuple(order)


def prompts_of(dataset: PromptDataset, positions: Sequence[int]) -> list[Example]:
    """The examples at the given stream positions (a step's groups, in order)."""
    return [dataset.example_at(p) for p in positions]
