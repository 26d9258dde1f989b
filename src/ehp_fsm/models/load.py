"""Loading a Hugging Face causal-LM directory (a tiny model, a base model, or a revision).

What it knows: which files make a loadable directory (`config.json`; weights as
`model.safetensors`, a sharded `model.safetensors.index.json`, or `pytorch_model.bin`; a
tokenizer as `tokenizer.json` or `tokenizer_config.json`), and how to say which one is missing
before `transformers` fails with a traceback about the Hub. Loading is always local
(`local_files_only=True`): a run never downloads anything.
What it does not know: revisions and their hashes (`models.revision_dir.verify` checks those).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ehp_fsm.errors import EhpError

if TYPE_CHECKING:  # torch is imported where tensors are made: a host agent checks revision
    import torch  # directories without it (importing torch costs ~1.5 s of CPU per process)

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
DTYPE_NAMES = ("float32", "bfloat16", "float16")


class ModelError(EhpError):
    """A model directory cannot be written or loaded as asked."""


@dataclass(frozen=True, kw_only=True)
class LoadedModel:
    """A model ready to train or sample, with its tokenizer and config."""

    path: Path
    model: Any  # transformers.PreTrainedModel
    tokenizer: Any  # transformers.PreTrainedTokenizerBase
    config: Any  # transformers.PretrainedConfig


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """`torch.float32` or its name ("float32", "bfloat16", "float16")."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPE_NAMES:
        raise ModelError(
            f"dtype {dtype!r} is unknown", "", f"use one of {sorted(DTYPE_NAMES)} or a torch.dtype"
        )
    return getattr(torch, dtype)  # type: ignore[no-any-return]


def check_model_dir(path: str | Path) -> Path:
    """The directory, if it has a config, weights and a tokenizer; else a `ModelError` naming
    the path, what is missing and what to do."""
    p = Path(path)
    if not p.is_dir():
        raise ModelError(
            f"model directory {p} does not exist" if not p.exists() else f"{p} is not a directory",
            "a model is a Hugging Face directory (config.json, weights, tokenizer files)",
            f"create one with `ehp-fsm init-model {p}` or give the path of a saved model",
        )
    if not (p / "config.json").is_file():
        raise ModelError(
            f"model directory {p} has no config.json",
            "transformers builds the architecture from it",
            "point at the directory save_pretrained wrote, or run `ehp-fsm init-model` there",
        )
    if not any((p / f).is_file() for f in WEIGHT_FILES):
        raise ModelError(
            f"model directory {p} has no weights",
            f"none of {', '.join(WEIGHT_FILES)} is there",
            "copy the weight files beside config.json (save_pretrained writes them)",
        )
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        raise ModelError(
            f"model directory {p} has no tokenizer",
            f"none of {', '.join(TOKENIZER_FILES)} is there",
            "save the tokenizer into the same directory (tokenizer.save_pretrained)",
        )
    _check_safetensors(p)
    return p


def _check_safetensors(p: Path) -> None:
    """Every safetensors weight file of `p` is there and its header reads (a truncated or
    overwritten file, a shard the index names but nobody copied): refused here, naming the
    file, not in a trainer process after start-up. Headers only (no tensor is read; no torch)."""
    from safetensors import SafetensorError, safe_open

    index = p / "model.safetensors.index.json"
    if (p / "model.safetensors").is_file():
        files = [p / "model.safetensors"]
    elif index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelError(
                f"{index} cannot be read",
                f"it is not a safetensors index with a weight_map ({exc})",
                "copy the index save_pretrained wrote",
            ) from None
        files = [p / str(s) for s in shards]
    else:
        return  # pytorch_model.bin: transformers reads it (weights_only)
    for f in files:
        if not f.is_file():
            raise ModelError(
                f"weight file {f} is missing", f"{index.name} names it", "copy every shard"
            )
        try:
            with safe_open(str(f), framework="numpy") as fh:
                fh.keys()
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelError(
                f"weight file {f} cannot be read",
                f"its safetensors header is not valid ({exc}): a truncated or overwritten file",
                "copy the file again from where the model came from",
            ) from None


def load_model(path: str | Path, dtype: torch.dtype | str = "float32") -> LoadedModel:
    """Config, causal LM (in `dtype`, eval mode off: ready to train) and tokenizer of `path`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    # no "Loading weights" bar in a trainer's or a run's output
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # (transformers: untyped)

    p = check_model_dir(path)
    want = resolve_dtype(dtype)
    try:
        config = AutoConfig.from_pretrained(p, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            p, config=config, dtype=want, local_files_only=True
        )
        tokenizer = AutoTokenizer.from_pretrained(p, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(
            f"model directory {p} cannot be loaded",
            f"transformers said: {exc}",
            "check that its files come from one save_pretrained (or `ehp-fsm init-model`)",
        ) from exc
    model.train()
    return LoadedModel(path=p, model=model, tokenizer=tokenizer, config=config)
