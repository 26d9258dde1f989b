"""Loading a Hugging Face causal-LM directory (a tiny model, a base model, or a revision).

What it knows: which files make a loadable directory (`config.json`; weights as
`model.safetensors`, a sharded `model.safetensors.index.json`, `pytorch_model.bin` or a sharded
`pytorch_model.bin.index.json`; a tokenizer as `tokenizer.json` or `tokenizer_config.json`), and
how to say which one is missing — or what stands in its place (a FIFO, a folder), and any FIFO,
socket or device in the folder, which a reader would wait on for ever — before `transformers`
fails with a traceback about the Hub.
Loading is always local (`local_files_only=True`): a run never downloads anything.
What it does not know: revisions and their hashes (`models.revision_dir.verify` checks those).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from pickle import UnpicklingError  # the class torch's weights_only loader raises; no unpickling
from typing import TYPE_CHECKING, Any

from ehp_fsm.errors import EhpError, printable
from ehp_fsm.fspaths import path_kind, read_regular

if TYPE_CHECKING:  # torch is imported where tensors are made: a host agent checks revision
    import torch  # directories without it (importing torch costs ~1.5 s of CPU per process)

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
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
    if (kind := path_kind(p)) != "a folder":
        raise ModelError(
            f"model directory {p} does not exist"
            if kind is None
            else f"{p} is not a directory (it is {kind})",
            "a model is a Hugging Face directory (config.json, weights, tokenizer files)",
            f"create one with `ehp-fsm init-model {p}` or give the path of a saved model",
        )
    if (kind := path_kind(p / "config.json")) != "a file":
        if kind is None:
            _check_not_dangling(p / "config.json")
        raise ModelError(
            f"model directory {p} has no config.json"
            if kind is None  # a FIFO or a folder of that name was "no config.json"
            else f"{p / 'config.json'} is {kind}, not a file",
            "transformers builds the architecture from it",
            "point at the directory save_pretrained wrote, or run `ehp-fsm init-model` there"
            if kind is None
            else "replace it with the config.json file save_pretrained wrote",
        )
    _check_no_special_files(p)
    if not any((p / f).is_file() for f in WEIGHT_FILES):
        raise ModelError(
            f"model directory {p} has no weights",
            f"none of {', '.join(WEIGHT_FILES)} is there{_others(p, WEIGHT_FILES)}",
            "copy the weight files beside config.json (save_pretrained writes them)",
        )
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        raise ModelError(
            f"model directory {p} has no tokenizer",
            f"none of {', '.join(TOKENIZER_FILES)} is there{_others(p, TOKENIZER_FILES)}",
            "save the tokenizer into the same directory (tokenizer.save_pretrained)",
        )
    _check_weight_files(p)
    _check_no_custom_code(p)
    return p


#: The most of a model folder's JSON file read to look for custom code (configs are KBs).
_JSON_MAX = 16 << 20


def _check_no_custom_code(p: Path) -> None:
    """Refuse a model folder that brings its own Python code (`auto_map` in its config.json or
    tokenizer_config.json): transformers asked "Do you wish to run the custom code? [y/N]" in
    the middle of `check`, and a "y" ran the folder's code in the run's own process; the
    trainer pool then failed for want of `trust_remote_code`. ehp-fsm runs no code a model
    folder brings (every load passes `trust_remote_code=False`)."""
    for name in ("config.json", "tokenizer_config.json"):
        try:
            doc = json.loads(read_regular(p / name, _JSON_MAX).decode("utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError):
            continue  # missing, or unreadable: refused where it is read, naming why
        auto_map = doc.get("auto_map") if isinstance(doc, dict) else None
        if auto_map:
            shown = printable(json.dumps(auto_map))[:200]
            raise ModelError(
                f"model directory {p} brings its own code ({name} has auto_map: {shown})",
                "ehp-fsm runs no code from a model folder: the trainers and the engines build "
                "only architectures transformers ships",
                "use a model of an architecture transformers has; if the folder's model_type "
                "is one of them, remove auto_map from its config",
            )


#: Files of a model folder that transformers or the run read by name: one of them as a folder
#: is no file at all.
READ_BY_NAME = (
    "generation_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def _check_no_special_files(p: Path) -> None:
    """Refuse a FIFO, a socket or a device in model folder `p` (and a folder named as one of
    the files read by name): whatever reads the folder's files — `check`'s reading of
    generation_config.json for the stop tokens, transformers' of the tokenizer's — waits on a
    FIFO for a writer for ever (`check` hung, saying nothing) or reads a device without end."""
    try:
        entries = sorted(os.scandir(p), key=lambda e: e.name)
    except OSError:
        return  # (what cannot be listed is named where it is read)
    for entry in entries:
        kind = path_kind(entry.path)
        if kind is None:  # any of its files: the weights and the tokenizer's were told as
            # missing ("has no weights: none of model.safetensors ... is there") or as
            # transformers' "Couldn't instantiate the backend tokenizer"
            _check_not_dangling(Path(entry.path))
        named = entry.name in READ_BY_NAME and kind == "a folder"
        if kind in ("a FIFO", "a socket", "a device") or named:
            raise ModelError(
                f"{entry.path} is {kind}, not a file",
                "the model's files are read whole (the tokenizer's, generation_config.json, "
                "each file a revision carries): a FIFO waits for a writer for ever",
                f"remove it, or put the file save_pretrained wrote at {entry.name}",
            )


def _check_not_dangling(path: Path) -> None:
    """Refuse a link at `path`, a file the run reads by name, whose target does not exist: it
    was taken as no file (a dangling generation_config.json: no stop tokens of the model's
    own), where a reader in the run may follow it and fail later."""
    try:
        target = os.readlink(path)
    except (OSError, ValueError):
        return  # (not a link: nothing is there)
    raise ModelError(
        f"{path} is a link to {printable(target)}, which does not exist",
        "the model's files are read by name: a dangling link is neither the file nor its "
        "absence (a Hugging Face cache's snapshot links to its blobs: one was removed)",
        f"copy the file save_pretrained wrote to {path.name}, or remove the link",
    )


def _others(p: Path, names: Sequence[str]) -> str:
    """What stands in `p` under `names` that is not a file (" as a file: model.safetensors is a
    FIFO"), or "": each was told as missing."""
    found = [(n, k) for n in names if (k := path_kind(p / n)) not in (None, "a file")]
    return ("" if not found else " as a file: ") + "; ".join(f"{n} is {k}" for n, k in found)


def _shards(index: Path) -> list[str]:
    """The files a sharded checkpoint's index names (its `weight_map`'s values). transformers
    reads its `metadata` too (an index without one failed only in the run's processes)."""
    try:
        content = json.loads(index.read_text())
        if not isinstance(content["metadata"], dict):
            raise TypeError("its metadata is not an object")
        return sorted({str(v) for v in content["weight_map"].values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelError(
            f"{index} cannot be read",
            f"it is not a checkpoint index with a metadata object and a weight_map ({exc!r})",
            "copy the index save_pretrained wrote",
        ) from None


def safetensors_files(p: Path) -> list[Path] | None:
    """The safetensors weight files of `p` (`model.safetensors`, or every shard its index
    names); None when its weights are torch pickles (`pytorch_model.bin`, one or sharded). A
    `ModelError` for an index that does not read."""
    index = p / "model.safetensors.index.json"
    if (p / "model.safetensors").is_file():
        return [p / "model.safetensors"]
    if not index.is_file():
        return None
    return [p / s for s in _shards(index)]


def _bin_files(p: Path) -> list[Path]:
    """The `pytorch_model.bin` of `p`, or every shard its `pytorch_model.bin.index.json` names
    (none when it has neither)."""
    if (p / "pytorch_model.bin").is_file():
        return [p / "pytorch_model.bin"]
    index = p / "pytorch_model.bin.index.json"
    return [p / s for s in _shards(index)] if index.is_file() else []


def _missing(f: Path) -> str:
    """A weight file that is not a file: missing, or what stands there."""
    kind = path_kind(f)
    return (
        f"weight file {f} is missing" if kind is None else f"weight file {f} is {kind}, not a file"
    )


def _check_weight_files(p: Path) -> None:
    """Every weight file of `p` is there, and a safetensors file's header reads (a truncated or
    overwritten file, a shard the index names but nobody copied): refused here, naming the
    file, not in a trainer process after start-up. Headers only (no tensor is read; no torch)."""
    from safetensors import SafetensorError, safe_open

    files = safetensors_files(p)
    if files is None:  # torch's format: transformers reads it (weights_only); shards must be there
        for f in _bin_files(p):
            if not f.is_file():
                raise ModelError(
                    _missing(f),
                    "pytorch_model.bin.index.json names it",
                    "copy every shard",
                )
        return
    index = p / "model.safetensors.index.json"
    for f in files:
        if not f.is_file():
            raise ModelError(_missing(f), f"{index.name} names it", "copy every shard")
        try:  # safetensors says "No such file or directory" of a file it may not read
            with open(f, "rb"):
                pass
        except OSError as exc:
            raise ModelError(
                f"weight file {f} cannot be read",
                f"{exc.strerror or exc} (the file is there: its permissions, or its folder's)",
                "give the user that runs ehp-fsm read access (e.g. chmod a+r on the file)",
            ) from None
        try:
            with safe_open(str(f), framework="numpy") as fh:
                fh.keys()
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelError(
                f"weight file {f} cannot be read",
                f"its safetensors header is not valid ({exc}): a truncated or overwritten file",
                "copy the file again from where the model came from",
            ) from None


#: The ends of the class names of checkpoints with another head than a language model's.
_OTHER_HEADS: tuple[str, ...] = (
    "ForSequenceClassification",
    "ForTokenClassification",
    "ForQuestionAnswering",
    "ForRewardModel",
    "ForProcessRewardModel",
)


def not_causal_lm(architectures: object) -> str | None:
    """Why a config.json whose `architectures` is this names no causal LM (None: it does, or
    says nothing): every class it lists is a classifier (a reward model:
    `Qwen2ForSequenceClassification`) or a bare base model without its LM head (`LlamaModel`).
    Such a directory was refused by the weights' count ("describes 12,640 parameters and its
    weights hold 11,008 elements", fix: "use the config.json that came with these weights"),
    or — its embeddings tied, the classifier's head one more tensor — passed, and the run
    trained it as a policy whose LM head was its embeddings."""
    if not isinstance(architectures, list) or not architectures:
        return None
    names = [a for a in architectures if isinstance(a, str)]
    if len(names) != len(architectures):
        return None
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_MAPPING_NAMES,
    )

    def flat(values: Any) -> set[str]:
        return {n for v in values for n in ([v] if isinstance(v, str) else v)}

    lm, base = flat(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()), flat(MODEL_MAPPING_NAMES.values())
    kinds: dict[str, None] = {}  # each class once, in the file's order
    for name in names:
        if name in lm:
            return None
        if name.endswith(_OTHER_HEADS):
            kinds[f"{_shown_name(name)}, a classifier (a reward or value model)"] = None
        elif name in base:
            kinds[f"{name}, the base model without its language-model head"] = None
        else:
            return None  # not known to be anything else (remote code, a multimodal model)
    shown = list(kinds)[:_ARCHITECTURES_SHOWN]
    if len(kinds) > len(shown):  # a config.json of 200,000 names made a 14 MB message
        shown.append(f"and {len(kinds) - len(shown):,} more")
    return f"its config.json's architectures names {'; '.join(shown)}"


def architecture_mismatch(config: Mapping[str, Any]) -> str | None:
    """Why the causal-LM class a config.json's `architectures` names is not the one its
    `model_type` builds (None: it is, or the config says too little to tell). transformers'
    Auto classes build by `model_type` and SGLang by `architectures`: `["FooBarForCausalLM"]`
    (or `["MistralForCausalLM"]`) over `model_type = "llama"` passed `check`, and the trainers
    trained a LlamaForCausalLM while an engine would have built another model."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kind, named = config.get("model_type"), config.get("architectures")
    built = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(kind) if isinstance(kind, str) else None
    if not isinstance(built, str) or not isinstance(named, list) or not named:
        return None
    first = named[0]
    if not isinstance(first, str) or first == built:
        return None
    return (
        f"its config.json's architectures names {_shown_name(first)}, and its model_type "
        f"{kind!r} builds {built}: the trainers build by model_type, SGLang by architectures"
    )


#: The most classes of a config.json's `architectures` a refusal names, each within
#: `_NAME_SHOWN` characters.
_ARCHITECTURES_SHOWN = 3
_NAME_SHOWN = 80


def _shown_name(name: str) -> str:
    return name if len(name) <= _NAME_SHOWN else f"{name[:_NAME_SHOWN]}… ({len(name):,} characters)"


def weights_problem(config: Any, shapes: Mapping[str, Sequence[int]]) -> str | None:
    """Why `config` (a transformers config) describes a larger or other-shaped model than the
    tensors of `shapes` (name → shape; a directory's weights) hold; None when they can fill it.

    `from_pretrained` initializes what the weights lack at random and `from_config` allocates
    the whole model first, so a config.json edited to claim 40,000 layers (or a vocabulary of
    10⁹) took minutes and every byte of memory before anything was refused. First the layers,
    without building anything (the layer index is the first number in a tensor's name, as in
    `model.layers.3.mlp`); then the model built on the meta device (no memory): its parameters
    the tensors' elements must cover, and each tensor it shares a name with the weights must
    have their shape (`_shape_mismatch`)."""
    import torch
    from transformers import AutoModelForCausalLM

    layers = getattr(config, "num_hidden_layers", None)
    numbered = {next((x for x in name.split(".") if x.isdigit()), None) for name in shapes}
    held = len(numbered - {None})
    if isinstance(layers, int) and layers > held:
        return f"its config.json has {layers} layers and its weights hold {held}"
    have = sum(math.prod(shape) for shape in shapes.values())
    auto: Any = AutoModelForCausalLM
    with torch.device("meta"):
        skeleton = auto.from_config(config)
    need = sum(p.numel() for p in skeleton.parameters())  # each tied parameter once
    if need > have:
        return (
            f"its config.json describes {need:,} parameters and its weights hold {have:,} elements"
        )
    return _shape_mismatch(skeleton.state_dict(), shapes)


def names_not_built(config: Any, shapes: Mapping[str, Sequence[int]]) -> list[str]:
    """The tensor names of the weights (`shapes`) that the model `config` builds (on the meta
    device: no memory) does not have, sorted: names transformers renames as it loads the
    checkpoint (GPT-NeoX's `embed_out`, the MoE models' `experts.N.*`), which a loader by name
    (the embedded engine's) cannot place."""
    import torch
    from transformers import AutoModelForCausalLM

    auto: Any = AutoModelForCausalLM
    with torch.device("meta"):
        built = auto.from_config(config).state_dict()
    return sorted(set(shapes) - set(built))


def _shape_mismatch(built: Mapping[str, Any], shapes: Mapping[str, Sequence[int]]) -> str | None:
    """The first tensor (in the model's order) that the model built from the config (`built`:
    its state dict, on meta) and the weights (`shapes`) both name with different shapes, said
    with both; None when every shared name agrees (a name of one only is not judged:
    transformers may rename a checkpoint's keys). A config.json edited to another
    `num_attention_heads` or `intermediate_size` describes no more parameters than the weights
    hold: `check` said valid, and every trainer then failed to start ("You set
    `ignore_mismatched_sizes` to `False`, thus raising an error")."""
    for name, tensor in built.items():
        have = shapes.get(name)
        if have is None:
            continue
        want = tuple(int(n) for n in tensor.shape)
        if want != tuple(int(n) for n in have):
            return (
                f"its config.json makes {name} of shape {list(want)} and its weights hold it "
                f"as {list(have)}"
            )
    return None


def weight_shapes(p: Path) -> dict[str, list[int]]:
    """Name → shape of every tensor in the weights of the directory `p`: the safetensors
    headers, or each `pytorch_model.bin` (or shard of one) mapped onto the meta device
    (`weights_only`, no tensor read); empty where that cannot be known without reading it all
    (a `.bin` in torch's legacy format) or a file does not read (transformers then says why)."""
    from safetensors import safe_open

    files = safetensors_files(p)
    shapes: dict[str, list[int]] = {}
    if files is None:
        for f in _bin_files(p):
            found = _bin_shapes(f)
            if not found:
                return {}  # one shard that cannot be known: nothing is (transformers says why)
            shapes.update(found)
        return shapes
    for f in files:
        with safe_open(str(f), framework="numpy") as fh:
            for name in fh.keys():  # noqa: SIM118 (a safetensors handle is not a mapping)
                shapes[name] = list(fh.get_slice(name).get_shape())
    return shapes


def _bin_shapes(f: Path) -> dict[str, list[int]]:
    """Name → shape of the tensors of a `pytorch_model.bin` (empty where unknown)."""
    import torch

    try:  # a local file the user gave, and still only tensors: weights_only
        state = torch.load(f, map_location="meta", weights_only=True, mmap=True)
    except Exception:  # legacy format, truncated, not torch's: transformers says which
        return {}
    if not isinstance(state, dict):
        return {}
    return {str(k): list(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}


def load_model(path: str | Path, dtype: torch.dtype | str = "float32") -> LoadedModel:
    """Config, causal LM (in `dtype`) and tokenizer of `path`. The model is in eval mode, and
    trains so: gradients flow all the same, and dropout stays off. GRPO's ratio compares π_θ
    with the log-probs the engines sampled by, which run the model without dropout; a config
    with dropout (every GPT-2 checkpoint: 0.1) in train mode made each forward another random
    policy (ratio 0.993/1.078 at the very weights that sampled, and a Core + Hybrid split drew
    other masks than the whole batch)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    # no "Loading weights" bar in a trainer's or a run's output
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # (transformers: untyped)

    p = check_model_dir(path)
    want = resolve_dtype(dtype)
    try:
        config = AutoConfig.from_pretrained(p, local_files_only=True, trust_remote_code=False)
        shapes = weight_shapes(p)  # (check_model_dir read every header already)
        problem = weights_problem(config, shapes) if shapes else None
        if problem is not None:
            raise ModelError(
                f"model directory {p} does not hold the model its config.json describes",
                f"{problem}: the rest would be initialized at random, in memory",
                "use the config.json that came with these weights",
            )
        model = AutoModelForCausalLM.from_pretrained(
            p, config=config, dtype=want, local_files_only=True, trust_remote_code=False
        )
        tokenizer = AutoTokenizer.from_pretrained(p, local_files_only=True, trust_remote_code=False)
    except UnpicklingError as exc:  # (torch's advice, passed on, was `weights_only=False`)
        raise ModelError(
            f"model directory {p} cannot be loaded",
            "its pytorch_model.bin is a pickle that holds more than tensors, and ehp-fsm never "
            "unpickles one: unpickling can run any code the file brings",
            "convert the weights to safetensors where you trust the file (save_pretrained "
            "writes them), and point [model] path there",
        ) from exc
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(
            f"model directory {p} cannot be loaded",
            f"transformers said: {exc}",
            "check that its files come from one save_pretrained (or `ehp-fsm init-model`)",
        ) from exc
    model.eval()  # type: ignore[no-untyped-call]  # (transformers: untyped)
    return LoadedModel(path=p, model=model, tokenizer=tokenizer, config=config)
