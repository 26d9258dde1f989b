"""Tiny models of real architectures for CPU runs: a `transformers` config (Qwen3 or Llama) with
a few small layers, random weights from a seed, and a character tokenizer for the arithmetic
task, saved as a Hugging Face directory that `from_pretrained` (and SGLang) load.

What it knows: the architecture's config class (never a hand-written config.json), the
arithmetic alphabet of `ehp_fsm.training.policy` — token ids 0/1/2 are `<pad>`/`<bos>`/`<eos>`
and the characters follow in the same order, so ids agree with the built-in policy and the task —
and how to make the directory deterministic: the same (arch, seed, alphabet) gives byte-identical
`model.safetensors`. The tokenizer prepends `<bos>` like Llama's and carries a pass-through chat
template (the contents of the messages, concatenated), so chat-formatted data works unchanged.
What it does not know: training, revisions (`models.revision_dir`), loading (`models.load`).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import torch

from ehp_fsm.fspaths import path_kind
from ehp_fsm.models.load import ModelError
from ehp_fsm.plan import MAX_SEED
from ehp_fsm.training.policy import VOCAB

Arch = Literal["qwen3", "llama"]
ARCHS: tuple[str, ...] = get_args(Arch)
SPECIALS = ("<pad>", "<bos>", "<eos>")
ARITHMETIC_ALPHABET = "".join(t for t in VOCAB if t not in SPECIALS)
UNK = "<unk>"  # last id: text outside the alphabet still tokenizes (and is visible as <unk>)
PASS_THROUGH_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


@dataclass(frozen=True, kw_only=True)
class TinyShape:
    """Layer sizes of a tiny model (defaults: ≈ 0.1 M parameters, a few ms per forward)."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 64

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ModelError(
                f"hidden_size {self.hidden_size} is not a multiple of "
                f"num_attention_heads {self.num_attention_heads}",
                "each attention head gets hidden_size / heads dimensions",
                "pick sizes that divide",
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}",
                "grouped-query attention shares each key/value head among a whole group",
                "pick sizes that divide",
            )


def build_tokenizer(alphabet: str = ARITHMETIC_ALPHABET) -> Any:
    """A `PreTrainedTokenizerFast`: one token per character of `alphabet`, after the specials
    `<pad>` `<bos>` `<eos>` and before `<unk>`; encoding adds `<bos>`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    fast_class: Any = PreTrainedTokenizerFast  # (typed loosely: transformers 4 and 5 differ)

    if len(set(alphabet)) != len(alphabet) or not alphabet:
        raise ModelError(
            f"alphabet {alphabet!r} is not a non-empty string of distinct characters",
            "each character becomes exactly one token",
            "remove the repeated characters",
        )
    tokens = [*SPECIALS, *alphabet, UNK]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    fast = fast_class(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token=UNK,
    )
    fast.chat_template = PASS_THROUGH_CHAT_TEMPLATE
    return fast


def build_config(arch: Arch, vocab_size: int, shape: TinyShape) -> Any:
    """The architecture's own `transformers` config for a tiny model (tied embeddings)."""
    from transformers import LlamaConfig, Qwen3Config

    config_class: Any = Qwen3Config if arch == "qwen3" else LlamaConfig

    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.hidden_size // shape.num_attention_heads,
        "max_position_embeddings": shape.max_position_embeddings,
        "pad_token_id": SPECIALS.index("<pad>"),
        "bos_token_id": SPECIALS.index("<bos>"),
        "eos_token_id": SPECIALS.index("<eos>"),
        "tie_word_embeddings": True,
    }
    if arch in ARCHS:
        return config_class(**common)
    raise ModelError(
        f"architecture {arch!r} is unknown",
        "tiny models are made from a real architecture's config",
        f"use one of {list(ARCHS)}",
    )


def _not_a_folder(path: Path) -> tuple[Path, str] | None:
    """The nearest of `path` and its ancestors that exists, with what it is (`path_kind`),
    when that is not a folder: `init-model f/x` with `f` a file said only "its folder f cannot
    hold it: File exists". None when it is a folder (or nothing along the path can be told)."""
    for p in (path, *path.parents):
        if (kind := path_kind(p)) is not None:
            return None if kind == "a folder" else (p, kind)
    return None


def init_model(
    dest: str | Path,
    *,
    arch: Arch = "qwen3",
    seed: int = 0,
    vocab: str = ARITHMETIC_ALPHABET,
    shape: TinyShape | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a tiny `arch` model with weights drawn under `torch.manual_seed(seed)` and the
    character tokenizer of `vocab` into `dest` (created; must not hold a config.json yet).
    Returns the directory. The same arguments give byte-identical `model.safetensors`."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    # a run's output is its own: no "Writing model shards" bar
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # (transformers: untyped)

    auto: Any = AutoModelForCausalLM
    out = Path(dest)
    if out.exists() and not out.is_dir():  # was the OS's bare "File exists"
        raise ModelError(
            f"{out} is a file, not a directory",
            "a model is a directory (config.json, model.safetensors, the tokenizer's files)",
            "give a new directory path (the file is left as it is)",
        )
    if (blocker := _not_a_folder(out.parent)) is not None:  # was "its folder f: File exists"
        where, kind = blocker
        raise ModelError(
            f"cannot write the model directory {out}: {where} is {kind}, not a folder",
            f"the model directory would be made inside {where}, and only a folder holds one",
            f"give a model directory path that is not under {where} (it is left as it is), "
            f"or move {where} aside",
        )
    if (out / "config.json").exists():
        raise ModelError(
            f"{out} already holds a model (config.json)",
            "init-model never overwrites weights",
            "choose an empty or new directory",
        )
    if out.is_dir() and (held := sorted(p.name for p in out.iterdir())):
        # a folder of other files (`init-model .`, a model copied without its config.json):
        # its model.safetensors and tokenizer files were overwritten, the rest mixed in
        more = f" and {len(held) - 3} more" if len(held) > 3 else ""
        raise ModelError(
            f"{out} is not empty (it holds {', '.join(map(repr, held[:3]))}{more})",
            "init-model writes config.json, model.safetensors and the tokenizer's files, and "
            "never over or beside other files",
            "choose an empty or new directory",
        )
    if seed < 0:
        raise ModelError(f"seed {seed} is negative", "torch seeds are ≥ 0", "use a seed ≥ 0")
    if seed > MAX_SEED:  # torch.manual_seed raised "Overflow when unpacking long long"
        raise ModelError(
            f"seed {seed} is too large",
            f"a run's seed, which generates its model, is at most {MAX_SEED}",
            f"use a seed within 0..{MAX_SEED}",
        )
    tokenizer = build_tokenizer(vocab)
    config = build_config(arch, len(tokenizer), shape or TinyShape())
    # fork_rng: the caller's global RNG state is left as it was
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = config.pad_token_id
    if out.exists():  # an empty directory given to `init-model`: into it
        _save(out, model, tokenizer, {"arch": arch, "seed": seed, "vocab": vocab})
        return out
    # A new directory appears whole or not at all: written beside it, then renamed. A run
    # killed while it wrote its model (kill -9, a lost machine) left a directory with a config
    # and no weights, which the next run took for the model and failed on.
    tmp = out.parent / f".tmp-{out.name}-{uuid.uuid4().hex}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as exc:  # named by the path asked for, not the hidden one beside it
        raise ModelError(
            f"cannot write the model directory {out}",
            f"its folder {out.parent} cannot hold it: {exc.strerror or exc}",
            "give a path in a folder you can write",
        ) from None
    try:
        _save(tmp, model, tokenizer, {"arch": arch, "seed": seed, "vocab": vocab})
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "config.json").exists():
                raise
            # another process wrote it meanwhile (the same arguments: the same bytes)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _save(out: Path, model: Any, tokenizer: Any, meta: dict[str, Any]) -> None:
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _write_json(out / "ehp_tiny.json", meta)
    # the weights as readable as the rest (the umask's mode of a file written here): written
    # 0600, a model shared with other users of a machine was unreadable but for its weights
    mode = (out / "ehp_tiny.json").stat().st_mode & 0o777
    for weights in out.glob("*.safetensors"):
        os.chmod(weights, mode)


def _write_json(path: Path, data: object) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
