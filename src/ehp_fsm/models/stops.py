"""The token ids a response ends at, as SGLang decides them: the union of `eos_token_id` in
the model's `config.json` and `generation_config.json` (each an int or a list: SGLang's
`ModelConfig._get_hf_eos_token_id`) and the tokenizer's `eos_token_id` (`Req.check_finished`).

Llama-3 instruct models list three (`<|end_of_text|>`, `<|eom_id|>`, `<|eot_id|>`) where the
tokenizer names one. The embedded engine stops on this set and the task counts a completion
that reached one as well formed: both from this one function, so they cannot disagree.

`model_json` reads a model folder's JSON file (here, and for `data.task` and
`models.revision_dir`) as a regular file of at most `MODEL_JSON_MAX` bytes: a FIFO in its
place was read with `read_text`, which waits for a writer for ever (safe only while
`models.load.check_model_dir`, which refuses one, ran first).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

from ehp_fsm.fspaths import read_regular

#: The most a model folder's JSON file is read to (`run.inputs.CONFIG_MAX`'s 16 MiB: a real
#: config.json or generation_config.json is a few KB)
MODEL_JSON_MAX: Final = 16 << 20

#: The files whose `eos_token_id` SGLang reads, in the model's folder.
EOS_FILES = ("config.json", "generation_config.json")


def _ids(value: Any) -> set[int]:
    """An `eos_token_id` value as ids: an int, a list of ints, or nothing (None, absent). A
    bool or anything else is no token id (json gives `true` as True, an int to isinstance)."""
    items = value if isinstance(value, list) else [value]
    return {v for v in items if isinstance(v, int) and not isinstance(v, bool) and v >= 0}


def model_json(path: Path) -> Any:
    """The JSON of a model folder's file `path`, read only when it is a regular file of at
    most `MODEL_JSON_MAX` bytes (`fspaths.read_regular`: a FIFO is refused, not waited on).
    Raises `OSError` (missing, or not a file) or `ValueError` (too large, not UTF-8, not
    JSON, or nested too deep for the parser)."""
    try:
        return json.loads(read_regular(path, MODEL_JSON_MAX).decode("utf-8"))
    except RecursionError:
        raise ValueError(f"{path} nests deeper than a model's JSON does") from None


def stop_token_ids(model_dir: Path | None, tokenizer: Any) -> frozenset[int]:
    """See the module docstring. `model_dir` None (a model still to be generated) or a file
    that is missing or does not parse adds nothing (`check` refuses a model folder without a
    readable config.json before this runs)."""
    out = _ids(getattr(tokenizer, "eos_token_id", None))
    files = [model_dir / name for name in EOS_FILES] if model_dir is not None else []
    for path in files:
        try:
            doc = model_json(path)
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict):
            out |= _ids(doc.get("eos_token_id"))
    return frozenset(out)
