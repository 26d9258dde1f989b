"""A user who brings their own prompts and reward (README "Your model, prompts and reward"):
what they get wrong is named for what it is. Real files in a temporary folder, read by the
real loader and importer; nothing mocked."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ehp_fsm.data.dataset import DataConfig, DataError, load_dataset
from ehp_fsm.data.rewards import RewardError, resolve_reward
from ehp_fsm.models.tiny import build_tokenizer

TOK = build_tokenizer()
BOM = b"\xef\xbb\xbf"
LINE_1 = json.dumps({"prompt": "1+1=", "label": "2"}).encode()
LINE_2 = json.dumps({"prompt": "2+2=", "label": 4}).encode()


def _load(tmp_path: Path, content: bytes) -> tuple[Path, DataError | None]:
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(content)
    try:
        load_dataset(DataConfig(train=path), TOK)
    except DataError as exc:
        return path, exc
    return path, None


@pytest.mark.parametrize("end", [b"\n", b"\r\n"])
def test_a_byte_order_mark_inside_the_file_is_named(tmp_path: Path, end: bytes) -> None:
    """`cat a.jsonl b.jsonl > prompts.jsonl` where b.jsonl was saved with a BOM (Windows
    editors, Excel): the mark, invisible, begins a line in the middle of the file. It was
    refused as "the line is not valid JSON (Expecting value at column 1)", told to "write one
    JSON object per line" — which the line, as the user sees it, is."""
    path, err = _load(tmp_path, LINE_1 + end + BOM + LINE_2 + end)
    assert err is not None
    assert (err.path, err.line) == (str(path), 2)
    assert "byte order mark" in err.why and "U+FEFF" in err.why, err.why
    assert "sed 's/^\\xEF\\xBB\\xBF//' prompts.jsonl > fixed.jsonl" in err.fix, err.fix
    # the fix it names, as written, makes a file that loads
    fixed = (LINE_1 + end + BOM + LINE_2 + end).replace(end + BOM, end)
    assert _load(tmp_path, fixed)[1] is None


def test_the_files_own_byte_order_mark_is_still_skipped(tmp_path: Path) -> None:
    assert _load(tmp_path, BOM + LINE_1 + b"\r\n" + LINE_2 + b"\r\n")[1] is None
    _, err = _load(tmp_path, LINE_1 + b"\n" + b"{oops\n")  # other bad lines: as before
    assert err is not None and err.line == 2 and "byte order mark" not in err.why


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A plan's folder with the user's reward module; sys.path and sys.modules as they were
    after the test (`resolve_reward` adds the folder to one and the module to the other)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "byo_review_rewards.py").write_text(
        "def score(prompt, completion, label, metadata):\n    return 1.0\n"
        "def penalty(prompt, completion, label, metadata):\n    return -1.0\n"
    )
    yield tmp_path
    sys.modules.pop("byo_review_rewards", None)


@pytest.mark.parametrize(
    ("spec", "meant"),
    [
        ("byo_review_rewards:scroe", "did you mean 'score'? Else check the name after the colon"),
        ("byo_review_rewards: score", "did you mean 'score'?"),  # a space after the colon
        (
            "byo_review_reward:score",
            "did you mean 'byo_review_rewards' (a module beside the plan)?",
        ),
        (" byo_review_rewards:score", "did you mean 'byo_review_rewards' (a module beside"),
    ],
)
def test_a_reward_named_with_a_typo_says_which_name_was_meant(
    folder: Path, spec: str, meant: str
) -> None:
    """A misspelt function or module was told only "check the name after the colon" (or "check
    the module name ..."), with the plan's folder holding the name one letter away."""
    with pytest.raises(RewardError) as err:
        resolve_reward(spec, folder=folder)
    assert err.value.fix.startswith(meant), err.value.fix
    assert resolve_reward("byo_review_rewards:score", folder=folder)("p", "c", "l", {}) == 1.0


def test_a_name_close_to_nothing_gets_the_plain_fix(folder: Path) -> None:
    for spec in ("byo_review_rewards:zzz", "no_such_module_anywhere:score"):
        with pytest.raises(RewardError) as err:
            resolve_reward(spec, folder=folder)
        assert "did you mean" not in err.value.fix
        assert err.value.fix.startswith("check ")
