"""What a run reads before anything starts: the model directory, the prompts and the reward.

`prepare` is called by `ehp-fsm check` (with `create=False`: it writes nothing) and at the start
of `ehp-fsm run`, so a bad input stops both the same way, before any process starts: a model
directory that cannot be loaded or holds no causal LM (a reward model's classifier, a bare base
model: `models.load.not_causal_lm`), a data file that is missing, empty, not UTF-8, or has a line
without its keys or with a prompt longer than `[model] max_prompt_len` (refused with file and
line), a reward that cannot be imported. With `[model] generate`, a missing model directory is
written by `models.tiny.init_model` (a tiny model of that architecture, random weights from the
run's seed) — `check` builds the same tokenizer in memory instead.

Knows: the plan's `[model]`, `[data]`, `[reward]` and `[grpo]` sampling keys. Does not know:
processes, engines, training.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from ehp_fsm.data.dataset import DataError, PromptDataset, load_dataset, no_checkpoint
from ehp_fsm.data.rewards import RewardError, make_reward
from ehp_fsm.data.task import DatasetTask
from ehp_fsm.errors import PlanError, printable
from ehp_fsm.fspaths import read_regular
from ehp_fsm.models.stops import stop_token_ids
from ehp_fsm.plan import ModelSpec, Plan
from ehp_fsm.translog import starts_a_log


@dataclass(frozen=True)
class Inputs:
    model_dir: Path
    task: DatasetTask
    generated: bool  # the model directory was written just now


def core_device(plan: Plan) -> str:
    """Where the Core's lanes run: the device of the hosts holding its GPUs."""
    hosts = {h.id: h for h in plan.hosts}
    devices = {hosts[plan.host_of(g)].device for g in plan.core.gpus}
    return devices.pop() if len(devices) == 1 else "mixed"


def megatron_missing() -> str | None:
    """What of the `megatron` extra is not installed (None when megatron-core and mbridge are)."""
    import importlib.util

    missing = [m for m in ("megatron.core", "mbridge") if importlib.util.find_spec(m) is None]
    return ", ".join(missing) if missing else None


def unsupported(plan: Plan) -> list[tuple[str, str]]:
    """(plan key, why) for every setting this version of `ehp-fsm run` would not honour: it
    runs torch lanes at TP = PP = CP = 1 or Megatron-Core lanes at the plan's TP and PP with
    CP = 1 on CPU slots, and embedded engines on CPU slots or SGLang engines on CUDA hosts (one
    backend for all). A plan that names more is refused, never run as something else."""
    out: list[tuple[str, str]] = []
    c = plan.core
    if c.backend == "megatron" and (missing := megatron_missing()) is not None:
        out.append(
            (
                "core.backend",
                f"'megatron': {missing} not installed (pip install 'ehp-fsm[megatron]')",
            )
        )
    if c.backend == "torch":
        for key, n in (("core.tp", c.tp), ("core.pp", c.pp), ("core.cp", c.cp)):
            if n != 1:
                out.append((key, f"{n}: the torch lanes are data-parallel only (TP = PP = CP = 1)"))
    else:
        if c.cp != 1:
            out.append(
                (
                    "core.cp",
                    f"{c.cp}: context parallelism is not built: megatron-core's local "
                    "attention refuses CP (only Transformer Engine's attention supports it) "
                    "and a lane runs every sample's whole sequence on each rank; set "
                    "core.cp = 1 (core.tp and core.pp may be > 1)",
                )
            )
    out += _engine_backends(plan)
    sglang_only = _sglang_only_hosts(plan)
    for i, h in enumerate(plan.hosts):
        if h.device != "cpu" and h.id not in sglang_only:
            out.append(
                (
                    f"hosts[{i}].device",
                    f"{h.device!r}: the run trains on CPU slots; a CUDA host may only hold "
                    "SGLang engines, with EHP off (a Hybrid borrowed there would train on CPU)",
                )
            )
    if plan.model is not None and plan.model.dtype != "float32":
        out.append(("model.dtype", f"{plan.model.dtype!r}: the CPU lanes train in float32"))
    return out


def core_runtime(plan: Plan) -> str:
    """How `ehp-fsm run` builds the Core's lanes (and the Hybrids'), in one line for `check`."""
    c = plan.core
    if c.backend == "torch":
        return "torch lanes (the HF model in plain torch, DP-zero Adam), Gloo between ranks"
    where = (
        "on CPU through Megatron's CPU compatibility layer (ehp_fsm.backends.megatron.cpu: "
        "CUDA calls redirected to the CPU, streams synchronous), Gloo between ranks"
        if core_device(plan) == "cpu"
        else f"on {core_device(plan)}"
    )
    if c.tp == c.pp == 1:
        return (
            "Megatron-Core lanes (GPTModel from the HF model through mbridge, Megatron DDP + "
            f"DistributedOptimizer; Hybrids are DP1 lanes restored by DP-zero) {where}"
        )
    shape = " × ".join(f"{k} {n}" for k, n in (("TP", c.tp), ("PP", c.pp)) if n > 1)
    short = "×".join(f"{k}{n}" for k, n in (("TP", c.tp), ("PP", c.pp)) if n > 1)
    parts = []
    if c.tp > 1:
        parts.append(
            "no sequence parallelism (Gloo on CPU has no reduce-scatter for it)"
            if core_device(plan) == "cpu"
            else "no sequence parallelism"
        )
    if c.pp > 1:
        parts.append(
            "a lane's share of a step through Megatron's pipeline schedule as one "
            "micro-batch (its stages run in turn: PP splits the model's memory, not its "
            "time), the loss on the last stage, a tied embedding's gradients summed over the "
            "first and last stage (an untied output layer trains on the last alone)"
        )
    return (
        f"Megatron-Core lanes at {shape} (GPTModel from the HF model through mbridge, each "
        f"lane {c.tp * c.pp} processes: lane rank 0 the pool's worker, relaying every command "
        "to the others; Megatron DDP + DistributedOptimizer sharded over each lane rank's DP "
        f"group; revisions gathered over the lane by mbridge; {'; '.join(parts)}; Hybrids are "
        f"DP1 lanes of the Core's {short} shape restored by DP-zero per lane rank) {where}"
    )


def _engine_backends(plan: Plan) -> list[tuple[str, str]]:
    """One backend for every engine (a returned engine is started with the run's backend), and
    SGLang engines only on CUDA hosts (SGLang cannot serve on CPU)."""
    out: list[tuple[str, str]] = []
    first = plan.engines[0].backend
    device = {h.id: h.device for h in plan.hosts}
    for i, e in enumerate(plan.engines):
        if e.backend != first:
            out.append(
                (
                    f"engines[{i}].backend",
                    f"{e.backend!r} beside {first!r} (engines[0]): a returned engine is started "
                    "with the run's one backend, so every engine must name the same",
                )
            )
        elif e.backend == "sglang" and device[e.host] != "cuda":
            out.append(
                (
                    f"engines[{i}].backend",
                    f"'sglang' on host {e.host!r}, whose device is {device[e.host]!r}: SGLang "
                    "serves on CUDA GPUs only; use backend = 'embedded' on CPU hosts",
                )
            )
    return out


def _sglang_only_hosts(plan: Plan) -> set[str]:
    """Hosts whose every GPU belongs to an SGLang engine, in a plan with EHP off: what a CUDA
    host may be while the run trains on CPU."""
    if plan.ehp.enabled:
        return set()
    engine_gpus = {g for e in plan.engines if e.backend == "sglang" for g in e.gpus}
    return {h.id for h in plan.hosts if h.gpus and set(h.gpus) <= engine_gpus}


def refuse_unsupported(plan: Plan) -> None:
    """Refuse a plan that names a setting the run would not honour (`unsupported`), naming
    the first key and how many more."""
    refused = unsupported(plan)
    if refused:
        key, why = refused[0]
        more = f" (and {len(refused) - 1} more: {', '.join(k for k, _ in refused[1:])})"
        raise PlanError(
            key,
            why + (more if len(refused) > 1 else ""),
            "this run trains torch lanes (TP = PP = CP = 1) or Megatron-Core lanes (any TP "
            "and PP, CP = 1) on CPU slots, with "
            "embedded engines or SGLang engines on CUDA hosts; CUDA training is not run yet "
            "(nothing is run as something else)",
            path=plan.source,
        )


def prepare(
    plan: Plan,
    *,
    create: bool,
    say: Callable[[str], None] = print,
    refuse_unsupported_first: bool = True,
    checkpoint: Callable[[], None] = no_checkpoint,
) -> Inputs:
    """The model directory (written first when the plan says `generate` and it is missing and
    `create`), and the task over the plan's data, tokenizer and reward. Refuses a plan that
    names a setting the run would not honour (`refuse_unsupported`) — unless
    `refuse_unsupported_first` is false: `check` has said those, and asks what else the run
    would refuse. `checkpoint` is called once the reward is imported and as the prompts are
    read (`load_dataset`): what it raises ends the preparation (a stop asked for meanwhile)."""
    if refuse_unsupported_first:
        refuse_unsupported(plan)
    check_keys(plan)
    check_log_folder(plan)
    model, data = plan.model, plan.data
    if model is None:
        raise PlanError(
            "model",
            "a run needs the model it trains and serves",
            '[model] path = "DIR" (a Hugging Face directory), generate = "qwen3" to make one',
            path=plan.source,
        )
    if data is None:
        raise PlanError(
            "data",
            "a run needs its prompts",
            '[data] train = "FILE.jsonl" with one {"prompt": ..., "label": ...} per line',
            path=plan.source,
        )
    path = Path(model.path)
    generated = False
    try:
        exists = path.exists()
    except OSError as exc:  # no permission to look
        raise PlanError(
            "model.path", f"{path} cannot be looked at ({exc.strerror})", path=plan.source
        ) from None
    try:
        reward = make_reward(
            plan.reward.function,
            on_error=plan.reward.on_error,  # type: ignore[arg-type]
            folder=Path(plan.source).resolve().parent if plan.source else None,
            timeout_s=plan.reward.timeout_s,
        )
    except RewardError as exc:  # its what and why as the key's why, its fix once
        why = f"{exc.what}: {exc.why}" if exc.why else exc.what
        raise PlanError("reward.function", why, exc.fix, path=plan.source) from None
    checkpoint()  # (an import may take long; the model's checks build it: seconds more)
    if not exists and model.generate is not None:
        if create:
            from ehp_fsm.models.tiny import build_tokenizer, init_model

            # the data and the reward are refused before anything is written (the model would
            # be left behind by a run that never began)
            load_dataset(data, build_tokenizer(), checkpoint=checkpoint)
            say(f"model: {path} does not exist; writing a tiny {model.generate} model there")
            init_model(path, arch=model.generate, seed=plan.seed)  # type: ignore[arg-type]
            generated = True
            tokenizer = _tokenizer(path, plan.source)
        else:
            from ehp_fsm.models.tiny import build_tokenizer

            # the folder `run` writes the model in: `check` said valid, then `run` refused
            if (unwritable := _unwritable(path.parent)) is not None:
                raise PlanError(
                    "model.path",
                    f"{path} is to be generated, but its folder {path.parent} cannot be made "
                    f"or written: {unwritable}",
                    "point it at a path in a folder you can write, or at an existing model",
                    path=plan.source,
                )
            tokenizer = build_tokenizer()
    else:
        tokenizer = _tokenizer(path, plan.source)
        _check_architecture(path, plan.source)
    embedded = any(e.backend == "embedded" for e in plan.engines)
    _check_context(model, path, plan.source, embedded=embedded)
    if path.exists() and embedded:
        _check_embedded_weights(path, plan.source)
    if any(e.backend == "sglang" for e in plan.engines):
        _check_sglang_tp(plan, path if path.exists() else None)
    if plan.core.backend == "megatron":
        _check_bridge(
            path if path.exists() else None,
            model.generate,
            tp=plan.core.tp,
            pp=plan.core.pp,
            source=plan.source,
        )
    dataset = load_dataset(data, tokenizer, checkpoint=checkpoint)
    stops = stop_token_ids(path if path.exists() else None, tokenizer)
    vocab: int | None = None
    if path.exists():
        vocab_size = _model_dir(path, plan.source).get("vocab_size")
        _check_prompt_ids(dataset, tokenizer, vocab_size)
        _check_stop_ids(stops, tokenizer, vocab_size, path, plan.source)
        if isinstance(vocab_size, int) and not isinstance(vocab_size, bool) and vocab_size > 0:
            vocab = vocab_size
    task = DatasetTask(
        dataset,
        tokenizer,
        reward,
        max_new_tokens=model.max_response_len,
        temperature=plan.grpo.temperature,
        max_prompt_len=model.max_prompt_len,
        stop_ids=stops,
        vocab_size=vocab,
    )
    return Inputs(model_dir=path, task=task, generated=generated)


def _check_prompt_ids(dataset: PromptDataset, tokenizer: Any, vocab_size: object) -> None:
    """Every prompt's token ids must have a row in the model's embedding (`vocab_size` of its
    config.json): a token added to the tokenizer without `resize_token_embeddings` passed
    `check`, and every engine refused each request holding it (HTTP 400, "ids outside the
    vocabulary") while the run dispatched it again and again until `[deadlines.run] rollout`."""
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size <= 0:
        return  # named otherwise (a nested text config): the engine still refuses such ids
    for ex in dataset.examples:
        if max(ex.prompt_ids, default=0) < vocab_size:
            continue
        bad = next(t for t in ex.prompt_ids if t >= vocab_size)
        raise DataError(
            str(dataset.path),
            ex.line,
            f"the prompt holds token {bad} ({tokenizer.convert_ids_to_tokens(bad)!r}), outside "
            f"the model's vocabulary of {vocab_size} ids (config.json vocab_size; the "
            f"tokenizer has {len(tokenizer)}): no engine can take it",
            "resize the model to its tokenizer (model.resize_token_embeddings(len(tokenizer)), "
            "then save_pretrained), or drop the token from the tokenizer or the prompt",
        )


def unknown_characters(dataset: PromptDataset, tokenizer: Any) -> str | None:
    """What `check` says of prompts holding text the tokenizer encodes as its unknown token
    (`unk_token_id`): how many, the first one's line, and (a fast tokenizer's offsets) which
    characters. The model sees one `<unk>` for each: the tiny model's character tokenizer knows
    `0123456789+-*= ` only, and a first own prompt, "What is 2+3?", trained as seven `<unk>`s
    without a word. None when no prompt holds it (byte-level tokenizers never do)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if not isinstance(unk, int):
        return None
    hit = [ex for ex in dataset.examples if unk in ex.prompt_ids]
    if not hit:
        return None
    first = hit[0]
    chars = ""
    try:
        enc = tokenizer(first.text, add_special_tokens=False, return_offsets_mapping=True)
        spans = [
            o for t, o in zip(enc["input_ids"], enc["offset_mapping"], strict=True) if t == unk
        ]
        seen = dict.fromkeys(first.text[a:b] for a, b in spans)
        chars = (
            ": " + ", ".join(repr(c) for c in list(seen)[:8]) + (", ..." if len(seen) > 8 else "")
        )
    except (NotImplementedError, KeyError, TypeError, ValueError):  # a slow tokenizer: no offsets
        pass
    return (
        f"{len(hit)} prompt(s) hold text the tokenizer does not know (line {first.line}{chars}), "
        f"encoded as {tokenizer.convert_ids_to_tokens(unk)!r}: the model sees that token for it"
    )


def _check_stop_ids(
    stops: frozenset[int], tokenizer: Any, vocab_size: object, path: Path, source: str
) -> None:
    """At least one token a response ends at (`models.stops.stop_token_ids`) must have a row in
    the model's embedding: an end-of-text token added to the tokenizer (and named as
    `eos_token_id`) without `resize_token_embeddings` passed `check`, and the engines, which
    sample only the model's `vocab_size` ids, never ended a response — each ran to
    `max_response_len`, none well formed, without a word of why. (No stop ids at all, or some
    outside and one inside: as the model's files say.)"""
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size <= 0:
        return  # named otherwise (a nested text config): as for the prompts' ids
    if not stops or min(stops) < vocab_size:
        return
    shown = ", ".join(f"{t} ({tokenizer.convert_ids_to_tokens(t)!r})" for t in sorted(stops))
    raise PlanError(
        "model.path",
        f"no response of {path} can end: every token it ends at ({shown}; the eos_token_id "
        "of config.json, generation_config.json and the tokenizer) is outside the model's "
        f"vocabulary of {vocab_size} ids (config.json vocab_size; the tokenizer has "
        f"{len(tokenizer)}), which the engines never sample: each response would run to "
        "max_response_len",
        "resize the model to its tokenizer (model.resize_token_embeddings(len(tokenizer)), "
        "then save_pretrained), or set eos_token_id to a token of the model's vocabulary",
        path=source,
    )


def check_log_folder(plan: Plan) -> None:
    """The log's folder (the run directory) and `run.revisions` must be directories this user
    can create or write, and the log no directory: found now, not as an error once the run has
    started its model and agents. No input may lie where a start removes it
    (`_check_cleared_folders`).

    Nor may the log be a symbolic link (a folder on its way may: a run folder on a bigger
    disk): planted in the run directory, before a run or before its `--resume`, it was
    followed — the run emptied its target and wrote the log there, and took the target's
    folder for its run directory, clearing that folder's revisions, saved states, agents and
    keys."""
    if os.path.islink(plan.log):
        raise PlanError(
            "run.log",
            f"{plan.log} is a symbolic link (to {os.readlink(plan.log)}): the run would empty "
            "that file, write its log there and take the file's folder for its run directory, "
            "clearing it",
            "remove the link (or point run.log at the file itself, if that file's folder is "
            "meant to be the run directory)",
            path=plan.source,
        )
    log = _resolved("run.log", plan.log, plan.source)
    if log.is_dir():  # else found only once the run has started: "Is a directory", --resume
        raise PlanError(
            "run.log",
            f"{log} is a directory, where the run writes its transition log",
            "point it at a file in the run's folder, e.g. runs/NAME/transitions.jsonl",
            path=plan.source,
        )
    _check_log_file(plan, log)
    folders = [("run.log", log.parent, "the run directory")]
    if plan.revisions:
        folders.append(
            ("run.revisions", _resolved("run.revisions", plan.revisions, plan.source), "revisions")
        )
    for key, folder, what in folders:
        if (why := _unwritable(folder)) is None:
            continue
        made = "cannot be written" if folder.is_dir() else "cannot be made"
        raise PlanError(
            key,
            f"its folder {folder} ({what}) {made}: {why}",
            "point it at a path in a folder you can write",
            path=plan.source,
        )
    _check_cleared_folders(plan, log, folders[1][1] if plan.revisions else None)


def _check_log_file(plan: Plan, log: Path) -> None:
    """What `run.log` names now, if anything, must be a transition log (or an empty file): a
    start replaces it. A plan whose log named its training data, the plan itself or any other
    file was checked "valid", and the run overwrote that file with its log (and made its run
    directory beside it); `/dev/null` was refused only after the run had written its files
    into /dev."""
    try:
        st = log.stat()
    except OSError:
        return  # not there, or its folder cannot be read or made (the folder check says so)
    if not stat.S_ISREG(st.st_mode):
        raise PlanError(
            "run.log",
            f"{log} is not a file (a device, a FIFO or a socket), where the run writes its "
            "transition log and makes its run directory beside it",
            "point it at a file in the run's own folder, e.g. runs/NAME/transitions.jsonl",
            path=plan.source,
        )
    if st.st_size == 0 or _is_transition_log(log):
        return
    raise PlanError(
        "run.log",
        f"{log} exists and is not a transition log (its first line is not an ehp-fsm log's "
        "header): a start would replace it with its log, and make its run directory beside it",
        "point run.log at a new file in a folder of the run's own, e.g. "
        "runs/NAME/transitions.jsonl, or move that file away if it is yours to lose",
        path=plan.source,
    )


def _is_transition_log(log: Path) -> bool:
    try:
        with log.open("rb") as fh:
            return starts_a_log(fh)
    except OSError:
        return False


#: The run directory's folders a start removes (`run.startup.clear_run_dir`), besides the
#: revisions folder and `resume/` (a fresh start's).
CLEARED_SUBFOLDERS: Final = ("trainers", "agents", "keys", "verify")
#: What a run keeps in its revisions folder (`rollout.revisions`): `r<8 digits>/` revisions,
#: and the `.tmp-`, `.retired-` and `.launch-` entries of a write, a retirement and an engine's
#: launch. A fresh start removes that folder whole.
_STORE_ENTRY: Final = re.compile(r"r\d{8}|\.(tmp|retired|launch)-.*")


def _check_cleared_folders(plan: Plan, log: Path, revisions: Path | None) -> None:
    """A run's inputs must not lie in a folder its start removes, and `run.revisions` must be
    a folder of the run's own (a fresh start removes it whole, the newest revision kept beside
    it). Before, `check` said valid and `run` deleted them without a word: `revisions =
    "/shared"` with the model, the data or other files in it; CURVE keys made in the run
    directory's `keys/` (the run then stopped: its keys were gone)."""
    inputs = [("run.log", log)]
    if plan.model is not None:
        inputs.append(("model.path", _resolved("model.path", plan.model.path, plan.source)))
    if plan.data is not None:
        inputs.append(("data.train", _resolved("data.train", str(plan.data.train), plan.source)))
    if plan.transport.curve_keys:
        keys = _resolved("transport.curve_keys", plan.transport.curve_keys, plan.source)
        inputs.append(("transport.curve_keys", keys))
    run_dir = log.parent
    cleared = [run_dir / sub for sub in CLEARED_SUBFOLDERS]
    cleared.append(run_dir / "resume")
    if revisions is None:  # a plan's own `run.revisions`: held to more below
        cleared.append(run_dir / "revisions")
    for key, path in inputs[1:]:  # the log is the run's own, in its run directory
        folder = next((f for f in cleared if path == f or f in path.parents), None)
        if folder is not None:
            raise PlanError(
                key,
                f"{path} {'is' if path == folder else 'lies in'} the run directory's "
                f"{folder.name}/ ({folder}), which a run removes as it starts",
                "keep the run's inputs outside its run directory's own folders "
                f"({', '.join(f.name + '/' for f in cleared)})",
                path=plan.source,
            )
    if revisions is None:
        return
    inside = [f"{key} = {p}" for key, p in inputs if p == revisions or revisions in p.parents]
    try:
        foreign = sorted(e for e in os.listdir(revisions) if not _STORE_ENTRY.fullmatch(e))
    except OSError:  # none yet (or not a folder: refused above)
        foreign = []
    if inside:
        why = f"it is or holds {', '.join(inside)}"
    elif foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        why = f"it holds {', '.join(map(repr, foreign[:3]))}{more}, which no run wrote there"
    else:
        return
    raise PlanError(
        "run.revisions",
        f"{revisions} cannot be the revisions folder: {why}, and a fresh start removes that "
        "folder whole",
        "give the revisions a folder of their own (a new one, e.g. a subfolder `revisions`)",
        path=plan.source,
    )


def _unwritable(folder: Path) -> str | None:
    """Why `folder` cannot be made or written by this user (None: it can)."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, where {folder} needs a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        if _read_only(existing):  # root too is refused there: "by this user" misled
            return f"{existing} is on a read-only file system"
        return f"{existing} is not writable by this user"
    return None


def _read_only(path: Path) -> bool:
    """`path` is on a file system mounted read-only."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _resolved(key: str, path: str, source: str) -> Path:
    """`path` made absolute through its symlinks, or refused as `key` (a symlink loop)."""
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop on the way
        raise PlanError(
            key, f"{path} cannot be resolved ({exc})", "point it at a real folder", path=source
        ) from None


def check_keys(plan: Plan) -> None:
    """With `transport.curve_keys`: the directory holds the controller's keypair and binds a
    key to every host of the plan (`ehp-fsm keys DIR --agent HOST ...`); otherwise an agent of
    an unbound host could never be heard, and the run would wait for it in vain."""
    if not plan.transport.curve_keys:
        return
    from ehp_fsm.runtime.errors import KeyFileError
    from ehp_fsm.runtime.keys import load_server_keys

    fix = "write the keys with `ehp-fsm keys DIR --agent HOST ...`, one --agent per host"
    try:
        keys = load_server_keys(plan.transport.curve_keys)
    except KeyFileError as exc:  # its what and why as the key's why; one "Fix:"
        why = f"{exc.what}: {exc.why}" if exc.why else exc.what
        both = f"{fix}; or {exc.fix}" if exc.fix else fix
        raise PlanError("transport.curve_keys", why, both, path=plan.source) from None
    unbound = [h.id for h in plan.hosts if h.id not in keys.hosts]
    if unbound:
        raise PlanError(
            "transport.curve_keys",
            f"{plan.transport.curve_keys} binds no key to the hosts {unbound}",
            fix,
            path=plan.source,
        )


#: The largest `config.json` read (a real one is a few KB; a multimodal one some 100 KB).
CONFIG_MAX = 16 << 20


def _model_dir(path: Path, source: str) -> dict[str, Any]:
    """`[model] path` as a model directory (config, weights, tokenizer files) and its
    `config.json` as a JSON object: what is wrong with it is refused as `model.path`."""
    from ehp_fsm.models.load import ModelError, check_model_dir

    fix = "point [model] path at a directory save_pretrained wrote"
    try:
        check_model_dir(path)
        # bounded, and nested too deep is refused (a downloaded config.json is anyone's file:
        # one of gigabytes was read whole, `[[[...` 200,000 deep was a RecursionError traceback)
        config = json.loads(read_regular(path / "config.json", CONFIG_MAX).decode("utf-8"))
    except ModelError as exc:
        raise PlanError("model.path", f"{exc.what}: {exc.why}", exc.fix, path=source) from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        why = "it nests deeper than any model's config" if isinstance(exc, RecursionError) else exc
        raise PlanError(
            "model.path", f"{path}/config.json cannot be read as JSON ({why})", fix, path=source
        ) from None
    if not isinstance(config, dict):
        raise PlanError("model.path", f"{path}/config.json is not a JSON object", fix, path=source)
    return config


def architecture(path: Path) -> str:
    """What `check` says the model directory at `path` is, from its config.json: its
    architecture class and `model_type`, and its layers, hidden size and vocabulary where the
    config (or its `text_config`) names them — "Qwen3ForCausalLM: qwen3, 2 layers, hidden 64,
    vocab 21". `check` named only the path: which model a folder held (a Qwen3 or a Llama, a
    0.6B or a 7B) was not said. "" when the config cannot be read (`prepare` refuses it)."""
    try:
        config = json.loads(read_regular(path / "config.json", CONFIG_MAX).decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return ""
    if not isinstance(config, dict):
        return ""
    text = config.get("text_config")
    text = text if isinstance(text, dict) else {}

    def number(*keys: str) -> int | None:
        for key in keys:
            for table in (config, text):
                value = table.get(key)
                if isinstance(value, int) and not isinstance(value, bool):
                    return value
        return None

    names = config.get("architectures")
    shown = ", ".join(map(str, names)) if isinstance(names, list) and names else "no architectures"
    layers = number("num_hidden_layers", "n_layer", "num_layers")
    hidden = number("hidden_size", "n_embd", "d_model")
    vocab = number("vocab_size")
    kind = config.get("model_type")
    inside = ", ".join(
        part
        for part in (
            str(kind) if isinstance(kind, str) and kind else None,
            f"{layers} layers" if layers is not None else None,
            f"hidden {hidden}" if hidden is not None else None,
            f"vocab {vocab}" if vocab is not None else None,
        )
        if part
    )
    return f"{shown}: {inside}" if inside else shown


def _tokenizer(path: Path, source: str = "") -> object:
    """The tokenizer of model directory `path`. `AutoTokenizer` reads config.json too: where it
    fails and transformers cannot read the config either, the config is named — a field of the
    wrong type (`"num_hidden_layers": "2"`) was refused as "the tokenizer of ... cannot be
    loaded", and the tokenizer's files were fine."""
    from transformers import AutoConfig, AutoTokenizer

    _check_model_type(_model_dir(path, source), path, source)
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers fails with anything an odd directory leads it to
        failed = exc
    try:
        AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers fails with anything an odd config leads it to
        raise PlanError(
            "model.path",
            f"{path}/config.json cannot be read by transformers ({_said(exc)})",
            "correct the field it names in config.json (each of the type save_pretrained "
            'writes: "num_hidden_layers": 2, not "2"), or use the config.json that came '
            "with these weights",
            path=source,
        ) from None
    files = [f for f in _TOKENIZER_FILES if (path / f).is_file()]
    if not files:  # (transformers then spoke of sentencepiece and tiktoken, not the files)
        raise PlanError(
            "model.path",
            f"{path} has no tokenizer: none of {', '.join(_TOKENIZER_FILES)} is there",
            "save the tokenizer beside the weights (tokenizer.save_pretrained(DIR)), or copy "
            "the tokenizer files that came with the model",
            path=source,
        ) from failed
    raise PlanError(
        "model.path",
        f"the tokenizer of {path} cannot be loaded (transformers said: {_said(failed)})",
        "point [model] path at a directory save_pretrained wrote",
        path=source,
    ) from failed


#: The files a tokenizer is read from: a fast one's, or a slow one's vocabulary.
_TOKENIZER_FILES: Final = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "tiktoken.model",
)


def _said(exc: BaseException) -> str:
    """What transformers said, on one line (its validation errors span several) and short."""
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:300] + "…"


#: Causal LMs a refused `model_type` is pointed to (those this transformers has).
_COMMON_LMS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "phi3", "gpt2", "olmo2")


def _check_model_type(doc: Mapping[str, Any], path: Path, source: str) -> None:
    """A `model_type` transformers does not know is refused naming it (and the causal LMs it
    does): transformers' own refusal came after its warning "You are using a model of type
    `foobar` to instantiate a model of type ``", with escaped line breaks, and cut in the
    middle of "pip install --upgrade transformers"."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kind = doc.get("model_type")
    if not isinstance(kind, str) or kind in CONFIG_MAPPING:
        return  # (no model_type at all: transformers' refusal names it)
    known = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    close = difflib.get_close_matches(kind, known, n=1, cutoff=0.75)
    import transformers

    raise PlanError(
        "model.path",
        f"{path}/config.json has model_type {printable(kind)[:80]!r}, which transformers "
        f"{transformers.__version__} does not know",
        (f"did you mean {close[0]!r}? " if close else "")
        + "use a model of an architecture transformers has (its causal LMs: "
        + ", ".join(k for k in _COMMON_LMS if k in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
        + f" and {len(known):,} in all), or a transformers that knows this one",
        path=source,
    )


def _check_architecture(path: Path, source: str = "") -> None:
    """The model's config.json builds a causal LM (on the meta device: no memory, no weights
    read), as every trainer and engine of the run will: a `model_type` transformers does not
    know, or a config it cannot build (a negative `vocab_size`), passed `check` and failed
    only once the run had started its agents and trainers."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ehp_fsm.models.load import (
        architecture_mismatch,
        not_causal_lm,
        weight_shapes,
        weights_problem,
    )

    doc = _model_dir(path, source)
    other = not_causal_lm(doc.get("architectures"))
    if other is None and (mismatch := architecture_mismatch(doc)) is not None:
        raise PlanError(
            "model.path",
            f"{path} names two models: {mismatch}",
            "set architectures to the class its model_type builds (or model_type to the one "
            "its weights were saved by): use the config.json that came with these weights",
            path=source,
        )
    if other is not None:
        raise PlanError(
            "model.path",
            f"{path} is not a causal LM: {other}; the run samples and trains through an LM "
            "head, which these weights do not have",
            "point [model] path at the policy's causal LM (a …ForCausalLM checkpoint; a reward "
            "model's score belongs in [reward] function)",
            path=source,
        )
    auto: Any = AutoModelForCausalLM
    problem = None
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        shapes = weight_shapes(path)  # a config claiming 40,000 layers: 133 s to build on meta
        if shapes:
            problem = weights_problem(config, shapes)  # builds it on meta once its layers fit
        else:
            with torch.device("meta"):
                auto.from_config(config)
    except Exception as exc:  # transformers and torch fail with anything an odd config leads to
        raise PlanError(
            "model.path",
            f"the causal LM of {path} cannot be built from its config.json "
            f"({type(exc).__name__}: {str(exc)[:300]})",
            "point [model] path at a directory save_pretrained wrote for a causal LM",
            path=source,
        ) from None
    if problem is not None:
        raise PlanError(
            "model.path",
            f"{path} does not hold the model its config.json describes: {problem}",
            "use the config.json that came with these weights",
            path=source,
        )


def _check_context(
    model: ModelSpec, path: Path, source: str = "", *, embedded: bool = False
) -> None:
    """`[model]` lengths must fit the model's context (`max_position_embeddings`; a model to be
    generated gets the tiny shape's). With `embedded` engines the config must name one: an
    embedded engine sizes requests by it and refuses a model without (a Bloom config, whose
    ALiBi has no position limit, passed `check` and every engine then failed to start)."""
    from ehp_fsm.models.tiny import TinyShape

    limit = TinyShape().max_position_embeddings
    if path.exists():
        limit = _model_dir(path, source).get("max_position_embeddings", 0)
        if not isinstance(limit, int) or limit <= 0:  # named otherwise: GPT-2's n_positions
            from transformers import AutoConfig

            try:  # the config's own map from the canonical name (built: _check_architecture)
                config = AutoConfig.from_pretrained(
                    path, local_files_only=True, trust_remote_code=False
                )
                limit = getattr(config, "max_position_embeddings", 0)
            except Exception:
                limit = 0
    total = model.max_prompt_len + model.max_response_len
    if embedded and not (isinstance(limit, int) and limit > 0):
        raise PlanError(
            "model.path",
            f"{path}'s config.json names no context length (max_position_embeddings, or its "
            "architecture's name for it, such as GPT-2's n_positions), and the embedded "
            "engines size every request by it: each would refuse to start",
            f'add "max_position_embeddings": N to its config.json, N the longest sequence '
            f"the model takes (at least max_prompt_len + max_response_len = {total})",
            path=source,
        )
    if isinstance(limit, int) and 0 < limit < total:
        raise PlanError(
            "model.max_response_len",
            f"prompt {model.max_prompt_len} + response {model.max_response_len} tokens exceed "
            f"the model's context of {limit}",
            "lower max_prompt_len or max_response_len",
            path=source,
        )


def _check_embedded_weights(path: Path, source: str = "") -> None:
    """The first embedded engines start from `[model] path` itself (before revision 1), and the
    embedded engine loads safetensors only: a `pytorch_model.bin` model passed `check` and every
    engine then failed to start ("has no safetensors weights")."""
    from ehp_fsm.models.load import safetensors_files

    if safetensors_files(path) is None:
        raise PlanError(
            "model.path",
            f"{path} holds its weights as pytorch_model.bin, and the embedded engines start "
            "from it and load safetensors only",
            "save the model as safetensors (transformers' save_pretrained writes them) and "
            "point [model] path there",
            path=source,
        )
    from transformers import AutoConfig

    from ehp_fsm.models.load import names_not_built, weight_shapes

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        foreign = names_not_built(config, weight_shapes(path))
    except Exception:  # (refused where the config and weights are checked, naming why)
        return
    if foreign:
        shown = ", ".join(foreign[:3]) + (
            f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        )
        raise PlanError(
            "model.path",
            f"the weights of {path} name tensors its architecture does not have as saved "
            f"({shown}): transformers renames this architecture's weights as it loads them, "
            "and the embedded engines load them by name, as saved",
            "use an architecture whose saved names are its own (Llama, Qwen2/3, Mistral, "
            "GPT-2, Phi, OPT, ...), or engines backend = 'sglang' on CUDA hosts",
            path=source,
        )


def _check_sglang_tp(plan: Plan, path: Path | None) -> None:
    """SGLang splits a model's attention heads over an engine's TP ranks, and refuses at launch
    a TP that does not divide them (its key/value heads it replicates; its vocabulary it pads):
    every TP an SGLang engine may start with — its own, and `[rollout] allowed_tp` for a
    returned one — must divide `num_attention_heads` (a model still to be generated: the tiny
    shape's). A TP3 engine on a 4-head model passed `check`, and its every launch would fail,
    minutes into the run."""
    from ehp_fsm.models.tiny import TinyShape

    heads = TinyShape().num_attention_heads if path is None else None
    if path is not None:
        heads = _model_dir(path, plan.source).get("num_attention_heads")
    if not isinstance(heads, int) or isinstance(heads, bool) or heads <= 0:
        return  # named otherwise (a nested text config): SGLang says so at launch
    tps = [(f"engines[{i}].tp", e.tp) for i, e in enumerate(plan.engines) if e.backend == "sglang"]
    tps += [("rollout.allowed_tp", t) for t in plan.rollout.allowed_tp]
    for key, tp in tps:
        if heads % tp:
            fits = [t for t in range(1, min(heads, 64) + 1) if heads % t == 0]  # (TPs used)
            raise PlanError(
                key,
                f"TP{tp}: the model's {heads} attention heads do not split over {tp} ranks, and "
                "SGLang refuses such an engine at its launch",
                f"use a TP that divides {heads} ({', '.join(map(str, fits))})",
                path=plan.source,
            )


def _check_bridge(
    path: Path | None, generate: str | None, *, tp: int = 1, pp: int = 1, source: str = ""
) -> None:
    """A Megatron Core builds its GPTModel through mbridge: the model's architecture must be
    one mbridge knows (a model still to be generated: its architecture's name), its weights
    safetensors (mbridge reads nothing else), under TP its attention heads, key/value heads and
    MLP width must split evenly over the TP ranks (the vocabulary need not: mbridge pads it),
    and under PP its layers over the stages."""
    import warnings

    with warnings.catch_warnings():  # Megatron's "Apex / Transformer Engine not installed"
        warnings.simplefilter("ignore")
        from mbridge.core.bridge import _MODEL_REGISTRY

    from ehp_fsm.models.load import safetensors_files
    from ehp_fsm.models.tiny import TinyShape

    kind = generate
    shape: dict[str, Any] = {
        "num_attention_heads": TinyShape().num_attention_heads,
        "num_key_value_heads": TinyShape().num_key_value_heads,
        "intermediate_size": TinyShape().intermediate_size,
    }
    if path is not None:
        loaded = _model_dir(path, source)
        kind = loaded.get("model_type")
        shape = {k: loaded.get(k) for k in shape}
    layers = TinyShape().num_hidden_layers if path is None else loaded.get("num_hidden_layers")
    if pp > 1 and isinstance(layers, int) and layers % pp:
        raise PlanError(
            "core.pp",
            f"{pp}: the model's {layers} layers do not split over {pp} pipeline stages",
            f"pick a core.pp that divides {layers}, or another model",
            path=source,
        )
    for name, n in shape.items():
        if tp > 1 and isinstance(n, int) and n % tp:
            raise PlanError(
                "core.tp",
                f"{tp}: the model's {name} = {n} does not split over {tp} TP ranks",
                f"pick a core.tp that divides {n}, or another model",
                path=source,
            )
    if path is not None and safetensors_files(path) is None:
        raise PlanError(
            "model.path",
            f"{path} holds its weights as pytorch_model.bin, and core.backend = 'megatron' "
            "loads them through mbridge, which reads safetensors only",
            "save the model as safetensors (transformers' save_pretrained writes them) and "
            "point [model] path there, or use core.backend = 'torch'",
            path=source,
        )
    if not isinstance(kind, str) or kind not in _MODEL_REGISTRY:
        raise PlanError(
            "core.backend",
            f"'megatron' builds the GPTModel through mbridge, which has no bridge for "
            f"model_type {kind!r}",
            f"use a model of one of {sorted(_MODEL_REGISTRY)}, or core.backend = 'torch'",
            path=source,
        )
    if path is not None:  # what the bridge would build otherwise: refused here, not by the
        # trainers after the engines started (or never: the lane trained off-policy)
        from transformers import AutoConfig

        from ehp_fsm.models.bridged import bridge_refusal

        try:
            config = AutoConfig.from_pretrained(
                str(path), local_files_only=True, trust_remote_code=False
            ).to_dict()
        except (OSError, ValueError):  # (said by the model's own checks)
            config = {}
        if (refusal := bridge_refusal(config)) is not None:
            raise PlanError(
                "core.backend",
                f"'megatron' cannot build {path}: it {refusal[0]}, and {refusal[1]}",
                "use a model without it, or core.backend = 'torch' (transformers builds it whole)",
                path=source,
            )
