"""The embedded engine's scheduler: a Hugging Face causal LM served on CPU with SGLang's semantics.

`EngineCore` owns one model (built with `AutoModelForCausalLM.from_config` once per config, eval
mode, in the config's dtype or float32) and a scheduler thread. Requests wait in a queue, are
admitted to the running set, and advance one token per scheduler pass. Every forward is a
batch of one over a KV cache (transformers' `DynamicCache`): the prompt is prefilled on a
request's first pass, then one token is fed per pass. Requests whose next forward would be
identical (same tokens, cache built the same way: the G samples of a GRPO group share their
prompt, and often their first tokens) share that one forward (`_shared_work`). So a request's
tokens and log-probs are bit-identical whatever else is running — the property replay and
equivalence runs rely on — and no claim depends on how a CPU kernel blocks a batch.
Sampling is driven by a per-request `torch.Generator` seeded from `sampling_seed` (SGLang's
name) or `seed`; without one the engine draws a seed and still records it, so a retracted
request (its cache dropped) regenerates the same tokens.

It mirrors SGLang's behaviour where an RL orchestrator can see it:

* pause `abort`: in-flight requests finish now with `finish_reason.type == "abort"`; new ones
  wait until `continue_generation`. `retract`: in-flight requests go back to the queue, their
  partial output and KV cache dropped (regenerated after continue). `in_place`: they stay.
* `update_weights_from_disk` on a running engine waits for in-flight requests to finish (new ones
  wait); on a paused engine it installs at once and reports the paused requests in
  `num_paused_requests`; `abort_all_requests` aborts them first. A request that continues
  across an install has its cache recomputed under the new weights (prefill of prompt + output
  so far), so every later token and log-prob is the serving weights'.
* every output token is labelled with the weight version that computed it (`_append_token_locked`
  is the one place tokens are appended): `meta_info.weight_versions` spans, as SGLang's.
* `release_memory_occupation` needs an idle engine; releasing `weights` drops the model, and
  after `resume_memory_occupation` weights must be installed again before anything is served.

What it installs (`model_path`): a revision directory (`models.revision_dir`: its manifest's
file list and sizes are checked, tensors come through safetensors' mmap — the install does not
re-hash; `RevisionStore.verify` does) or a plain HF model directory with safetensors weights.
Config via `AutoConfig`, tokenizer via `AutoTokenizer` (local files only); tied embeddings are
re-tied after the load. Stop conditions: EOS (`models.stops`: `eos_token_id` of config.json,
generation_config.json and the tokenizer, as SGLang reads them),
`stop_token_ids`, stop strings (on the tokenizer's decoding of the output, special tokens
skipped; found decoding a bounded tail per token: `stop_strings`), `max_new_tokens`,
and the context length (`max_position_embeddings`, or the engine's `context_length`).

A failed install (bad path, files that disagree with the manifest, another architecture) is
found before a weight is touched: the installed weights serve on under their own version, as
SGLang's do (it reloads the originals after a failed load), and the engine answers
`success: false` with the reason. Deliberate difference: a failure while the new tensors are
being put in place would leave weights of no known revision, so the engine then drops them —
every request is refused with the failure's message until an install succeeds; for EHP an
engine serving an unknown revision is worse than one serving nothing.

It knows nothing about HTTP (see `server.py`) or about the revision store's folders.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import json
import math
import random
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import torch

from ehp_fsm.data.dataset import max_text_chars
from ehp_fsm.models import revision_dir
from ehp_fsm.models.load import ModelError, resolve_dtype, weights_problem
from ehp_fsm.models.stops import stop_token_ids
from ehp_fsm.rollout.errors import RolloutError
from ehp_fsm.rollout.stop_strings import StopScan, decodes_locally

PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[str, ...] = ("abort", "retract", "in_place")
#: Requests waiting to run at most, by default (SGLang's `--max-queued-requests` has none): one
#: `/generate` with `sampling_params.n` = 10⁶ queued a million requests and grew the process by
#: gigabytes before it was bounded. Far above what a run keeps in flight on one engine.
DEFAULT_MAX_QUEUED = 4096
MEMORY_TAGS: tuple[str, ...] = ("weights", "kv_cache", "cuda_graph")
DEFAULT_WEIGHT_VERSION = "default"  # SGLang's, for a model directory that is not a revision
#: SGLang's `_SAMPLING_EPS`: a temperature below it samples greedily (SGLang sets top_k = 1).
#: Dividing logits by a far smaller one overflowed them to inf: the NaN distribution then made
#: `torch.multinomial` raise in the scheduler thread, and the engine stopped serving.
SAMPLING_EPS = 1e-6
#: The seeds `torch.Generator.manual_seed` takes: [-2⁶³, 2⁶⁴).
SEED_RANGE = (-(1 << 63), 1 << 64)
#: The most stop strings / stop token ids one request may give (SGLang sets no bound). Every
#: output token is checked against each of them while the scheduler holds the engine's lock:
#: 4 million stop strings (a 24 MB body) cost ~0.1 s per token of every request in flight, and
#: kept `/health` waiting as long.
MAX_STOP_STRINGS = 128
MAX_STOP_TOKEN_IDS = 1024


class EngineRefused(RolloutError):
    """A request the engine cannot take in its current state. `status` is the HTTP status."""

    def __init__(self, status: int, what: str, why: str, fix: str) -> None:
        self.status = status
        super().__init__(what, why, fix)


def brief(value: Any, most: int = 80) -> str:
    """`value`'s repr (a message's for an exception), cut to `most` characters: an error echoed
    a 1 MB value back whole (a 2 MB answer)."""
    text = str(value) if isinstance(value, BaseException) else repr(value)
    return text if len(text) <= most else text[:most] + " …"


def check_distinct_rids(rids: Sequence[str | None]) -> None:
    """Refuse one request that names two of its requests alike (SGLang's message); None (a
    rid the engine draws) is no name."""
    counts = Counter(r for r in rids if r is not None)
    twice = [rid for rid, k in counts.items() if k > 1]
    if twice:
        raise EngineRefused(
            400,
            f"Duplicate request IDs detected within the request: {brief(twice, 300)}",
            "each request of a batch needs its own rid, as in SGLang",
            "send distinct rids, or none",
        )


#: SGLang's sampling params the embedded engine honours (`n` is read by the server; `seed` is
#: its alias of `sampling_seed`).
HONOURED_SAMPLING: Final = frozenset(
    {
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "sampling_seed",
        "seed",
        "skip_special_tokens",
        "no_stop_trim",
        "n",
    }
)
#: SGLang's sampling params it does not implement, each with the value that changes nothing:
#: sent so (or null), taken; sent otherwise, refused naming it. They were ignored without a
#: word — `repetition_penalty: 1.2` sampled as 1.0 — and a key of no sampling param at all (a
#: typo, `temprature`), which SGLang refuses, was ignored too.
NEUTRAL_SAMPLING: Final[Mapping[str, object]] = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
    "logit_bias": None,
    "custom_params": None,
    "stream_interval": None,
    "spaces_between_special_tokens": True,
}


def _check_sampling_keys(data: Mapping[str, Any]) -> None:
    """Refuse a key the engine would not honour (`NEUTRAL_SAMPLING`, `HONOURED_SAMPLING`)."""
    for key, value in data.items():
        if key in HONOURED_SAMPLING:
            continue
        if key in NEUTRAL_SAMPLING:
            neutral = NEUTRAL_SAMPLING[key]
            numbers = (int, float)
            same_kind = type(value) is type(neutral) or (
                type(value) in numbers and type(neutral) in numbers
            )
            if value is None or (same_kind and value == neutral):
                continue
            raise ValueError(
                f"{key} is {brief(value)}: the embedded engine does not implement it (SGLang "
                f"does); leave it out or send {json.dumps(neutral)}, which changes nothing"
            )
        close = difflib.get_close_matches(
            str(key), sorted(HONOURED_SAMPLING | NEUTRAL_SAMPLING.keys()), n=1
        )
        raise ValueError(
            f"{brief(key)} is not a sampling param"
            + (f": did you mean {close[0]!r}?" if close else "")
            + " (SGLang refuses it too)"
        )


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """The subset of SGLang's `SamplingParams` the embedded engine honours."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    sampling_seed: int | None = None
    #: how the answer's `text` is decoded (SGLang's defaults): special tokens left out, and the
    #: matched stop string (and what follows it) or stop token cut off
    skip_special_tokens: bool = True
    no_stop_trim: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be ≥ 0, got {self.max_new_tokens}")
        if not 0.0 <= self.temperature < math.inf:  # (an infinite one sampled uniformly)
            raise ValueError(f"temperature must be finite and ≥ 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or ≥ 1, got {self.top_k}")
        seed = self.sampling_seed
        if seed is not None and not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
            raise ValueError(f"sampling_seed must be in [-2**63, 2**64), got {seed}")

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> SamplingParams:
        """SGLang's JSON sampling params; a value of the wrong kind raises ValueError naming its
        key (an infinite `max_new_tokens` once escaped as OverflowError: an HTTP 500). Each value
        must be of its key's JSON kind (`_of_kind`): cast, another kind was read as something the
        client did not send — `"ignore_eos": "false"` as true, `"stop": [null]` as the text
        "None", a seed of 1.5 as 1."""
        data = dict(data or {})
        _check_sampling_keys(data)
        seed_key = "sampling_seed" if "sampling_seed" in data else "seed"
        stop = data.get("stop") or ()
        if isinstance(stop, str):
            stop = (stop,)
        # a string of digits for the ids, or an object for the strings, iterated as one: "123"
        # stopped on ids 1, 2 and 3, where SGLang never matches it
        for key, value, kind, most in (
            ("stop", stop, str, MAX_STOP_STRINGS),
            ("stop_token_ids", data.get("stop_token_ids") or (), int, MAX_STOP_TOKEN_IDS),
        ):
            if not isinstance(value, list | tuple):
                raise ValueError(f"{key} is {brief(value)}: send a list of {kind.__name__}")
            if len(value) > most:
                raise ValueError(
                    f"{key} has {len(value)} entries: the engine takes at most {most} per "
                    "request (each output token is checked against every one)"
                )

        def opt(key: str, default: Any, cast: type) -> Any:
            v = data.get(key)
            if v is None:
                return default
            if not _of_kind(v, cast):
                raise ValueError(f"{key} is {brief(v)}: send {_KIND_NAMES[cast]}")
            try:
                return cast(v)
            except (ValueError, TypeError, OverflowError) as exc:
                raise ValueError(f"{key} is {brief(v)}: {brief(exc)}") from None

        def seq(key: str, values: Any, cast: type) -> tuple[Any, ...]:
            bad = next((x for x in values if not _of_kind(x, cast)), _NONE)
            if bad is not _NONE:
                raise ValueError(
                    f"{key} holds {brief(bad)}: send a list of {_KIND_NAMES[cast]} values"
                )
            try:
                return tuple(cast(x) for x in values)
            except (ValueError, TypeError, OverflowError) as exc:
                raise ValueError(f"{key} is {brief(data.get(key))}: {brief(exc)}") from None

        return cls(
            max_new_tokens=opt("max_new_tokens", 128, int),
            temperature=opt("temperature", 1.0, float),
            top_p=opt("top_p", 1.0, float),
            top_k=opt("top_k", -1, int),
            stop=seq("stop", stop, str),
            stop_token_ids=seq("stop_token_ids", data.get("stop_token_ids") or (), int),
            ignore_eos=opt("ignore_eos", False, bool),
            sampling_seed=opt(seed_key, None, int),
            skip_special_tokens=opt("skip_special_tokens", True, bool),
            no_stop_trim=opt("no_stop_trim", False, bool),
        )


_NONE: Any = object()
_KIND_NAMES: dict[type, str] = {
    int: "an integer",
    float: "a number",
    bool: "true or false",
    str: "text",
}


def _of_kind(value: Any, kind: type) -> bool:
    """Whether JSON value `value` is one of `kind`: a bool is no number (Python's bool is an
    int), text is no number, and a float is an integer only when it is integral (`4.0`, as
    SGLang reads it)."""
    if kind is bool or kind is str:
        return type(value) is kind
    if type(value) is float:
        return kind is float or value.is_integer()
    return type(value) is int


def _checked_prompts(
    requests: Sequence[Mapping[str, Any]], served: _Served
) -> dict[int, tuple[int, ...]]:
    """Each distinct prompt of `requests` (by identity: n samples share one), checked against
    `served` — not empty, fits its context, ids within its vocabulary — as a tuple."""
    out: dict[int, tuple[int, ...]] = {}
    for r in requests:
        input_ids = r["input_ids"]
        if id(input_ids) in out:
            continue
        if not input_ids:
            raise EngineRefused(400, "empty prompt", "a request needs ≥ 1 input token", "send ids")
        if len(input_ids) >= served.context_length:
            raise EngineRefused(
                400,
                f"prompt of {len(input_ids)} tokens is too long",
                f"the model's context is {served.context_length} tokens, ≥ 1 must remain "
                "for output",
                "shorten the prompt",
            )
        bad = [t for t in input_ids if not 0 <= t < served.vocab_size]
        if bad:
            raise EngineRefused(
                400,
                f"input_ids contain ids outside the vocabulary: {bad[:5]}",
                f"the model's vocabulary has {served.vocab_size} ids",
                "tokenize with the model's tokenizer (or send `text`)",
            )
        out[id(input_ids)] = tuple(input_ids)
    return out


@dataclass(eq=False, kw_only=True)
class _Request:
    rid: str
    input_ids: tuple[int, ...]  # shared by the n samples of a prompt: never changed
    params: SamplingParams
    seed: int
    return_logprob: bool
    future: Future[dict[str, Any]] = field(default_factory=Future)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    generator: torch.Generator = field(default_factory=torch.Generator)
    epoch: int = 0  # bumped on retract; a step computed for an older epoch is discarded
    retractions: int = 0
    done: bool = False
    cache: Any = None  # transformers.DynamicCache over input_ids + output_ids[:-1], or None
    cache_weights: int = -1  # the install (EngineCore._weights_gen) the cache was computed under
    cache_prefill: int = 0  # how many tokens the cache's first (prefill) forward fed
    #: SGLang's `weight_versions`: [version, start, end) spans over `output_ids`, one per run of
    #: tokens generated under one weight version
    version_spans: list[list[Any]] = field(default_factory=list)
    #: where the stop strings are looked for: the output decoded as its `text` is
    #: (`skip_special_tokens`), and — once a special token is in the output, the first place
    #: the two decodings differ — with special tokens kept (`EngineCore._stop_string`)
    stop_scan: StopScan = field(init=False)
    stop_scan_kept: StopScan = field(init=False)
    special_out: bool = False  # a special token is in the output (skipped by `stop_scan`)

    def __post_init__(self) -> None:
        self.stop_scan = StopScan(self.params.stop)
        self.stop_scan_kept = StopScan(self.params.stop)

    def reset_generator(self) -> None:
        self.generator = torch.Generator().manual_seed(self.seed)


def _distribution(
    logits: torch.Tensor, params: SamplingParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs under the tempered distribution, the probabilities to draw from after top-k /
    top-p filtering) of `logits[V]`: the same for every request of a shared forward with the
    same sampling settings, so it is computed once for them (`_Draws`)."""
    if params.temperature < SAMPLING_EPS:  # greedy: the untempered log-probs, as SGLang's
        logp = torch.log_softmax(logits.float(), dim=-1)
        return logp, logp
    scaled = logits.float() / params.temperature
    logp = torch.log_softmax(scaled, dim=-1)
    probs = logp.exp()
    if params.top_k > 0 and params.top_k < probs.numel():
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=0)
        drop = cum - sorted_p > params.top_p
        sorted_p = torch.where(drop, torch.zeros_like(sorted_p), sorted_p)
        probs = torch.zeros_like(probs).scatter(0, idx, sorted_p)
    return logp, probs / probs.sum()


class _Draws:
    """Next tokens from one forward's logits: each request draws with its own generator from
    the distribution of its sampling settings, computed once per distinct setting."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits
        self._made: dict[tuple[float, int, float], tuple[torch.Tensor, torch.Tensor]] = {}

    def draw(self, params: SamplingParams, gen: torch.Generator) -> tuple[int, float]:
        """The token and its log-prob under the tempered distribution (before top-k/top-p
        filtering, as SGLang reports it)."""
        key = (params.temperature, params.top_k, params.top_p)
        made = self._made.get(key)
        if made is None:
            made = self._made[key] = _distribution(self.logits, params)
        logp, probs = made
        if params.temperature < SAMPLING_EPS:
            tok = int(torch.argmax(self.logits).item())
        else:
            tok = int(torch.multinomial(probs, 1, generator=gen).item())
        return tok, float(logp[tok].item())


@dataclass(frozen=True, eq=False)
class _Step:
    """One request's part of a scheduler pass, taken under the lock with its epoch."""

    req: _Request
    epoch: int
    tokens: tuple[int, ...]  # input_ids + output_ids at the epoch
    generator: torch.Generator
    cache: Any
    cache_weights: int
    cache_prefill: int


@dataclass(eq=False, kw_only=True)
class _Work:
    """One forward pass of a scheduler pass and the requests whose next token it gives."""

    tokens: tuple[int, ...]
    prefill: int  # the tokens the cache's prefill fed (len(tokens) when this pass prefills)
    cache: Any  # the cache to extend (None: prefill a fresh one); owned by this work alone
    steps: list[_Step]


def _shared_work(batch: Sequence[_Step], weights: int) -> list[_Work]:
    """The forward passes `batch` needs: one per distinct computation, in `batch`'s order.

    Two requests need the same computation when they have the same tokens and their caches were
    built the same way under the installed weights (the same prefill length, then one token per
    pass; or both need a fresh prefill): the model then sees identical inputs, so one pass gives
    both of them bit-identical logits — exactly what each would get alone. This is what makes the
    G samples of a GRPO group cheap: their prompt is prefilled once, and each decoding step runs
    once per distinct prefix instead of once per sample. Each request still samples with its own
    generator.

    Requests that shared a pass share its cache object afterwards. A pass extends its cache in
    place, so a cache still wanted by a later work of this scheduler pass is copied first."""
    works: dict[tuple[tuple[int, ...], int], _Work] = {}
    for step in batch:
        tokens = step.tokens
        valid = step.cache is not None and step.cache_weights == weights
        prefill = step.cache_prefill if valid else len(tokens)
        key = (tokens, prefill)
        work = works.get(key)
        if work is None:
            works[key] = _Work(
                tokens=tokens, prefill=prefill, cache=step.cache if valid else None, steps=[step]
            )
        else:
            work.steps.append(step)
    users: dict[int, int] = {}
    for work in works.values():
        if work.cache is not None:
            users[id(work.cache)] = users.get(id(work.cache), 0) + 1
    for work in works.values():
        if work.cache is None:
            continue
        users[id(work.cache)] -= 1
        if users[id(work.cache)] > 0:  # a later work extends the original
            work.cache = _fork_cache(work.cache)
    return list(works.values())


def _fork_cache(cache: Any) -> Any:
    """A copy of `cache` that a forward can extend without touching `cache`. A `DynamicCache`
    of `DynamicLayer`s extends each layer by `torch.cat` into new tensors (it never writes
    into the old ones), so new cache and layer objects over the same tensors suffice: a deep
    copy of the tensors was ~6% of the engine's time. Any other cache is deep-copied.
    `tests/rollout/test_shared_work.py` checks a fork against a deep copy."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    if type(cache) is not DynamicCache or any(type(x) is not DynamicLayer for x in cache.layers):
        return copy.deepcopy(cache)
    fork = copy.copy(cache)
    fork.layers = [copy.copy(layer) for layer in cache.layers]
    return fork


@dataclass(frozen=True, kw_only=True)
class EngineStatus:
    status: str  # "serving" | "empty" | "failed" | "released" | "updating"
    weight_version: str | None
    revision: int | None
    model_path: str | None
    message: str | None
    paused: str | None
    released: tuple[str, ...]
    num_waiting: int
    num_running: int
    model_config: dict[str, Any] | None


@dataclass(frozen=True, kw_only=True)
class _Served:
    """An installed model: the module, its tokenizer and what the scheduler checks against."""

    model: Any  # transformers.PreTrainedModel, eval mode
    tokenizer: Any  # transformers.PreTrainedTokenizerBase
    #: whether stop strings may be looked for in a decoded tail (`stop_strings.decodes_locally`)
    decodes_locally: bool
    #: a copy of `tokenizer` for prompts alone (`EngineCore.encode`): tokenizing a long `text`
    #: under the lock the scheduler decodes with stalled every request in flight
    encoder: Any
    #: the longest `text` that may be tokenized: no prompt longer fits in the context
    #: (`_max_text_chars`; None: unknown, every text is tokenized and refused by its tokens)
    max_text_chars: int | None
    config_key: str  # the config as JSON: the module is reused while it is the same
    tokenizer_key: tuple[tuple[str, str], ...] | None  # the tokenizer files' hashes, if known
    vocab_size: int
    context_length: int
    eos_ids: frozenset[int]
    special_ids: frozenset[int]  # the tokenizer's special tokens (`skip_special_tokens` drops)
    probe_id: int  # one token a health probe may send (BOS, else 0)
    summary: dict[str, Any]


def _read_tensors(
    root: Path,
) -> tuple[dict[str, torch.Tensor], revision_dir.RevisionManifest | None]:
    """The tensors of a revision directory (manifest listing and sizes checked, no re-hash) or of
    a plain HF directory's safetensors weights; and the manifest, if there is one."""
    from safetensors import safe_open

    if not root.exists():
        raise ModelError(f"{root} does not exist", "", "pass a revision or HF model directory")
    if not root.is_dir():
        raise ModelError(f"{root} is not a directory", "", "pass a revision or model directory")
    if (root / revision_dir.MANIFEST_FILE).is_file():
        reader = revision_dir.open_revision(root)
        return reader.state_dict(), reader.manifest
    if (root / revision_dir.SINGLE_FILE).is_file():
        files = [revision_dir.SINGLE_FILE]
    elif (root / revision_dir.INDEX_FILE).is_file():
        try:
            index = json.loads((root / revision_dir.INDEX_FILE).read_text(encoding="utf-8"))
            files = sorted({str(f) for f in index["weight_map"].values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelError(
                f"{root / revision_dir.INDEX_FILE} cannot be read", repr(exc), "rewrite it"
            ) from exc
    else:
        raise ModelError(
            f"{root} has no safetensors weights",
            f"neither {revision_dir.SINGLE_FILE} nor {revision_dir.INDEX_FILE} is there, and the "
            "engine loads no pickled weights",
            "save the model with save_pretrained (safetensors is its default)",
        )
    for name in files:
        # A name from the index is a file of this directory, and a regular one: safetensors
        # opens it holding the GIL, and opening a FIFO blocked the whole engine (its HTTP
        # server too) until something wrote to it.
        if Path(name).name != name or name in (".", "..") or not (root / name).is_file():
            raise ModelError(
                f"{root / revision_dir.INDEX_FILE} names the weight file {name[:200]!r}",
                "it is not a regular file of that directory",
                "list in weight_map the safetensors files save_pretrained wrote beside it",
            )
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(root / name, framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensors[key] = fh.get_tensor(key)
    return tensors, None


def _max_text_chars(tokenizer: Any, context_length: int) -> int | None:
    """The longest `text` worth tokenizing (`data.dataset.max_text_chars` for the context): no
    longer one fits; SGLang tokenizes it whole first (a 30 MB text held the embedded engine for
    114 s). None: no vocabulary to read, the text is tokenized off the event loop and refused
    by its token count."""
    return max_text_chars(tokenizer, context_length)


def _tokenizer_key(
    manifest: revision_dir.RevisionManifest | None,
) -> tuple[tuple[str, str], ...] | None:
    """The hashes of a revision's config and tokenizer files (None for a plain directory)."""
    if manifest is None:
        return None
    return tuple(
        sorted(
            (name, e.sha256)
            for name, e in manifest.files.items()
            if not name.endswith(".safetensors") and name != revision_dir.INDEX_FILE
        )
    )


@dataclass(frozen=True, kw_only=True)
class _Prepared:
    """An install read from disk, not yet swapped in: `tensors` become `served.model`'s."""

    served: _Served
    manifest: revision_dir.RevisionManifest | None
    tensors: dict[str, torch.Tensor]
    root: Path


def _prepare(model_path: str, *, reuse: _Served | None, context_length: int | None) -> _Prepared:
    """Read `model_path`: tensors, config, tokenizer, and the module to load them into — `reuse`'s
    while the config is the same (its parameters are then replaced: no copy, no re-init), else
    one built from the config."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    auto_model: Any = AutoModelForCausalLM
    root = Path(model_path)
    tensors, manifest = _read_tensors(root)
    config = AutoConfig.from_pretrained(root, local_files_only=True, trust_remote_code=False)
    # the directory's own path is part of the config object; it does not change the module
    described = {k: v for k, v in config.to_dict().items() if k != "_name_or_path"}
    config_key = json.dumps(described, sort_keys=True, default=str)
    if reuse is not None and reuse.config_key == config_key:
        model = reuse.model
    else:
        dtype = getattr(config, "dtype", None)
        want = resolve_dtype(dtype) if isinstance(dtype, str | torch.dtype) else torch.float32
        problem = weights_problem(config, {k: t.shape for k, t in tensors.items()})
        if problem is not None:  # before `from_config` allocates what the config claims
            raise ModelError(
                f"{root} does not hold the model its config.json describes",
                f"{problem}: the engine would build the rest in memory",
                "use the config.json that came with these weights",
            )
        model = auto_model.from_config(config, dtype=want)
        model.eval()
        model.requires_grad_(False)
    tok_key = _tokenizer_key(manifest)
    if reuse is not None and tok_key is not None and reuse.tokenizer_key == tok_key:
        tokenizer, encoder = reuse.tokenizer, reuse.encoder
    else:
        tokenizer = AutoTokenizer.from_pretrained(
            root, local_files_only=True, trust_remote_code=False
        )
        encoder = copy.deepcopy(tokenizer)
    limit = int(getattr(config, "max_position_embeddings", 0) or 0)
    context = context_length if context_length is not None else limit
    if context < 2:
        raise ModelError(
            f"the context length of {root} is {context}",
            "a request needs ≥ 1 prompt token and room for ≥ 1 output token",
            "set max_position_embeddings in config.json or launch with --context-length",
        )
    bos = getattr(config, "bos_token_id", None)
    if bos is None:
        bos = getattr(tokenizer, "bos_token_id", None)
    served = _Served(
        model=model,
        tokenizer=tokenizer,
        decodes_locally=decodes_locally(tokenizer),
        encoder=encoder,
        max_text_chars=_max_text_chars(tokenizer, context),
        config_key=config_key,
        tokenizer_key=tok_key,
        vocab_size=int(config.vocab_size),
        context_length=context,
        eos_ids=stop_token_ids(root, tokenizer),
        special_ids=frozenset(int(i) for i in getattr(tokenizer, "all_special_ids", ())),
        probe_id=int(bos) if isinstance(bos, int) else 0,
        summary={
            "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None),
            "vocab_size": int(config.vocab_size),
            "hidden_size": getattr(config, "hidden_size", None),
            "num_hidden_layers": getattr(config, "num_hidden_layers", None),
            "context_length": context,
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        },
    )
    return _Prepared(served=served, manifest=manifest, tensors=tensors, root=root)


def _assign(model: Any, tensors: Mapping[str, torch.Tensor], root: Path) -> None:
    """The tensors become `model`'s parameters (`load_state_dict(assign=True)`, cast to the
    model's dtype if they differ); weights the checkpoint leaves out must be tied ones, which
    `tie_weights` points back at the loaded tensors."""
    expected = model.state_dict()
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise ModelError(
            f"the weights of {root} name tensors the model does not have: {unexpected[:5]}",
            "the weights do not belong to this config's architecture",
            "install a directory whose weights and config.json come from one model",
        )
    bad = [
        f"{k} {tuple(v.shape)} (model {tuple(expected[k].shape)})"
        for k, v in tensors.items()
        if tuple(v.shape) != tuple(expected[k].shape)
    ]
    if bad:
        raise ModelError(
            f"the weights of {root} have other shapes than its config builds: {bad[:5]}",
            "the weights do not belong to this config",
            "install a directory whose weights and config.json come from one model",
        )
    cast = {k: v.to(expected[k].dtype) for k, v in tensors.items()}  # a no-op when equal
    model.load_state_dict(cast, strict=False, assign=True)
    model.tie_weights()
    now = model.state_dict()
    loaded = {now[k].data_ptr() for k in cast}
    missing = sorted(k for k in now if k not in cast and now[k].data_ptr() not in loaded)
    if missing:
        raise ModelError(
            f"the weights of {root} lack tensors: {missing[:5]}",
            "a tensor left out of a checkpoint must be tied to one that is in it",
            "write the revision from the model's full state dict",
        )


def _version_of(prepared: _Prepared, weight_version: str | None) -> str:
    """The weight version an install serves: the one asked for, else the revision number
    (SGLang's "default" for a plain model directory)."""
    if weight_version is not None:
        return weight_version
    manifest = prepared.manifest
    return DEFAULT_WEIGHT_VERSION if manifest is None else str(manifest.revision)


class EngineCore:
    """Scheduler thread + model. Thread-safe; every public method may be called from any thread."""

    def __init__(
        self,
        *,
        max_running_requests: int = 64,
        max_queued_requests: int = DEFAULT_MAX_QUEUED,
        decode_delay_s: float = 0.0,
        context_length: int | None = None,
    ) -> None:
        """`decode_delay_s` sleeps after every scheduler pass: a test throttle that stands in for
        a slow accelerator, so tests can act on requests while they are in flight.
        `context_length` overrides the model config's `max_position_embeddings` (SGLang's
        `--context-length`). `max_queued_requests` (SGLang's `--max-queued-requests`) bounds the
        requests waiting to run: a submission that would queue more is refused whole (503)."""
        if max_running_requests < 1:
            raise ValueError(f"max_running_requests must be ≥ 1, got {max_running_requests}")
        if max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be ≥ 1, got {max_queued_requests}")
        if decode_delay_s < 0:
            raise ValueError(f"decode_delay_s must be ≥ 0, got {decode_delay_s}")
        if context_length is not None and context_length < 2:
            raise ValueError(f"context_length must be ≥ 2, got {context_length}")
        self._decode_delay_s = decode_delay_s
        self._max_running = max_running_requests
        self._max_queued = max_queued_requests
        self._context_length = context_length
        self._cond = threading.Condition()
        self._pass_lock = threading.Lock()  # held by the scheduler during a forward pass
        self._tok_lock = threading.Lock()  # a fast tokenizer is not safe to call concurrently
        self._enc_lock = threading.Lock()  # the same, for the prompts' copy (`_Served.encoder`)
        self._served: _Served | None = None
        self._model: Any = None  # self._served.model while weights are installed
        self._tokenizer: Any = None  # the last installed one (decodes results after a failure)
        self._tokenizer_local = False  # its `_Served.decodes_locally`
        self._weights_gen = 0  # bumped (under _pass_lock) by every install
        #: install (`_weights_gen`) → its weight version: a token is labelled with the version
        #: of the weights that computed it, even if an install lands before it is appended
        self._gen_versions: dict[int, str] = {}
        self._weight_version: str | None = None
        self._revision: int | None = None
        self._model_path: str | None = None
        self._message: str | None = None
        self._failed = False
        self._released: set[str] = set()
        self._paused: str | None = None
        self._updating = False
        self._updating_path: str | None = None  # what the install in progress reads
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._held: list[_Request] = []  # arrived while an install drains the engine
        #: every request in flight by its rid (SGLang's `rid_to_state`): a second request with
        #: a rid in flight is refused
        self._by_rid: dict[str, _Request] = {}
        self._stop = False
        self._seed_rng = random.Random()  # noqa: S311 - sampling seeds, not secrets
        self._thread = threading.Thread(target=self._loop, name="ehp-engine-scheduler", daemon=True)
        self._thread.start()

    # -- lifecycle -------------------------------------------------------------------------
    def stop_serving(self) -> None:
        """Refuse new requests and end every one in flight now (aborted). Does not wait: safe
        from a signal handler. Called on SIGTERM, so the HTTP server's graceful shutdown does
        not wait for requests a pause holds (it waited its full 5 s, and a borrow with it)."""
        with self._cond:
            self._stop = True
            self._abort_locked(self._all_inflight_locked(), "engine shutting down")
            self._cond.notify_all()

    def shutdown(self) -> None:
        self.stop_serving()
        self._thread.join(timeout=5)

    @property
    def max_queued_requests(self) -> int:
        """The most requests that may wait to run (`--max-queued-requests`)."""
        return self._max_queued

    # -- status ----------------------------------------------------------------------------
    def _status_locked(self) -> str:
        if self._updating:
            return "updating"
        if "weights" in self._released:
            return "released"
        if self._failed:
            return "failed"
        if self._model is None:
            return "empty"
        return "serving"

    def status(self) -> EngineStatus:
        with self._cond:
            return EngineStatus(
                status=self._status_locked(),
                weight_version=self._weight_version,
                revision=self._revision,
                model_path=self._model_path,
                message=self._message,
                paused=self._paused,
                released=tuple(sorted(self._released)),
                num_waiting=len(self._waiting) + len(self._held),
                num_running=len(self._running),
                model_config=dict(self._served.summary) if self._served else None,
            )

    def _refusal_locked(self) -> EngineRefused | None:
        s = self._status_locked()
        if s == "serving" or (s == "updating" and self._served is not None):
            return None
        if s == "updating":  # nothing to check a request against yet (was an assert: a 500)
            return EngineRefused(
                503,
                "the engine has no weights yet: an install is in progress",
                "it serves once /update_weights_from_disk has installed "
                + brief(self._updating_path, 200),
                "retry when /health answers 200",
            )
        if s == "released":
            return EngineRefused(
                503,
                "the engine has no weights: its weight memory was released",
                "release_memory_occupation frees the weights, as in SGLang",
                "call /resume_memory_occupation, then /update_weights_from_disk",
            )
        if s == "failed":
            return EngineRefused(
                503,
                "the engine is out of service: its last weight install failed",
                self._message or "unknown failure",
                "install a good revision with /update_weights_from_disk",
            )
        return EngineRefused(
            503,
            "the engine has no weights installed",
            self._message or "it was started without --model-path",
            "install a revision with /update_weights_from_disk",
        )

    # -- generation ------------------------------------------------------------------------
    def submit(
        self,
        *,
        input_ids: Sequence[int],
        params: SamplingParams,
        rid: str | None = None,
        return_logprob: bool = False,
    ) -> Future[dict[str, Any]]:
        """Queue one request; the future resolves to SGLang's `/generate` result dict."""
        return self.submit_all(
            [
                {
                    "input_ids": input_ids,
                    "params": params,
                    "rid": rid,
                    "return_logprob": return_logprob,
                }
            ]
        )[0]

    def submit_all(self, requests: Sequence[Mapping[str, Any]]) -> list[Future[dict[str, Any]]]:
        """Queue every request (each `submit`'s keywords) or none: one that is invalid, or more
        than the queue has room for (`max_queued_requests`), refuses the whole submission, so a
        batch (a prompt's n samples) is never left half queued.

        Each distinct prompt (`input_ids` object: a prompt's n samples share one) is checked
        once, outside the engine's lock, and its samples share one copy of it: checking and
        copying it per sample under the lock — 2000 samples of a 20000-token prompt — held
        every other client (`/health` too) for 1.6 s, and n copies took n × its memory."""
        with self._cond:
            self._admissible_locked(len(requests))
            served = self._served
        assert served is not None  # `_admissible_locked` refuses an engine without weights
        prompts = _checked_prompts(requests, served)
        with self._cond:
            self._admissible_locked(len(requests))  # again: the engine may have changed
            if self._served is not served:  # an install in between: check against the new one
                assert self._served is not None
                prompts = _checked_prompts(requests, self._served)
            reqs = [
                self._request_locked(**{**r, "input_ids": prompts[id(r["input_ids"])]})
                for r in requests
            ]
            self._check_rids_locked(reqs)
            for req in reqs:
                self._by_rid[req.rid] = req
            for req in reqs:
                if req.params.max_new_tokens == 0:
                    self._finish_locked(req, {"type": "length", "length": 0})
                elif self._updating:
                    self._held.append(req)
                else:
                    self._waiting.append(req)
            self._cond.notify_all()
            return [req.future for req in reqs]

    def _check_rids_locked(self, reqs: Sequence[_Request]) -> None:
        """Refuse a submission that names one request twice, or a request in flight: both
        would run, and a client (an abort by rid, a router) could not tell them apart. SGLang's
        `TokenizerManager` refuses them with these messages (and its HTTP layer with 400)."""
        check_distinct_rids([r.rid for r in reqs])
        for r in reqs:
            if r.rid in self._by_rid:
                rid = r.rid if len(r.rid) <= 300 else r.rid[:300] + " …"
                raise EngineRefused(
                    400,
                    f"Duplicate request ID detected: {rid}",
                    "a request with this rid is in flight",
                    "send another rid, or wait until that request finished (or abort it)",
                )

    def _admissible_locked(self, count: int) -> None:
        """Refuse a submission of `count` requests the engine cannot take now."""
        if self._stop:
            raise EngineRefused(503, "engine is shutting down", "stop requested", "retry")
        refusal = self._refusal_locked()
        if refusal is not None:
            raise refusal
        queued = len(self._waiting) + len(self._held)
        if queued + count > self._max_queued:
            raise EngineRefused(
                503,
                f"the request queue is full: {count} more would make {queued + count} waiting",
                f"the engine queues at most {self._max_queued} requests (--max-queued-requests)",
                "retry later, or send fewer samples at once",
            )

    def _request_locked(
        self,
        *,
        input_ids: tuple[int, ...],
        params: SamplingParams,
        rid: str | None = None,
        return_logprob: bool = False,
    ) -> _Request:
        """A request of a checked prompt (`_checked_prompts`), not queued yet."""
        seed = params.sampling_seed
        if seed is None:
            seed = self._seed_rng.getrandbits(63)
        req = _Request(
            rid=rid or uuid.uuid4().hex,
            input_ids=input_ids,
            params=params,
            seed=seed,
            return_logprob=return_logprob,
        )
        req.reset_generator()
        return req

    def encode(self, text: str) -> list[int]:
        """`text`'s token ids under the installed model's tokenizer (special tokens such as BOS
        added as the tokenizer does). Refused while nothing is installed, and a text too long
        for any prompt to fit in the context (`_max_text_chars`) before it is tokenized (a
        tokenized one too long is refused by `submit_all`).
        Tokenizes with the prompts' own copy of the tokenizer: the scheduler never waits for
        it (call it off the event loop: a long text takes seconds)."""
        with self._cond:
            refusal = self._refusal_locked()
            if refusal is not None:
                raise refusal
            served = self._served
            assert served is not None
        if served.max_text_chars is not None and len(text) > served.max_text_chars:
            raise EngineRefused(
                400,
                f"`text` of {len(text)} characters is too long",
                f"the model's context is {served.context_length} tokens and the engine "
                f"tokenizes at most {served.max_text_chars} characters (no prompt longer fits)",
                "shorten the prompt",
            )
        with self._enc_lock:
            ids = served.encoder(text).input_ids
        return [int(i) for i in ids]

    def probe_input_ids(self) -> list[int]:
        """A one-token prompt for a health probe (the model's BOS id when it has one)."""
        with self._cond:
            return [self._served.probe_id if self._served else 0]

    def _decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        tokenizer = self._tokenizer
        if tokenizer is None:
            return ""
        with self._tok_lock:
            return str(tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def _decode_kept(self, ids: Sequence[int]) -> str:
        """`ids` decoded with their special tokens, as SGLang looks for stop strings."""
        return self._decode(ids, skip_special_tokens=False)

    def _text_locked(self, req: _Request, finish_reason: Mapping[str, Any]) -> str:
        """The answer's `text`, as SGLang's detokenizer gives it (`trim_matched_stop`): without
        `no_stop_trim`, a matched stop token is left out and the text ends before a matched
        stop string; special tokens are skipped unless `skip_special_tokens` is false."""
        p = req.params
        ids: Sequence[int] = req.output_ids
        matched = finish_reason.get("matched") if not p.no_stop_trim else None
        if isinstance(matched, int) and not isinstance(matched, bool) and matched and ids:
            ids = ids[:-1]  # SGLang leaves a falsy match (token id 0) in, and so does this
        text = self._decode(ids, skip_special_tokens=p.skip_special_tokens)
        if isinstance(matched, str) and matched and (pos := text.find(matched)) != -1:
            text = text[:pos]
        return text

    def abort(self, *, rid: str = "", abort_all: bool = False) -> int:
        """Abort requests whose rid starts with `rid` (SGLang's matching), or all; returns how
        many were aborted."""
        with self._cond:
            victims = [
                r
                for r in self._all_inflight_locked()
                if abort_all or (rid and r.rid.startswith(rid))
            ]
            self._abort_locked(victims, "aborted by /abort_request")
            self._cond.notify_all()
            return len(victims)

    def abandon(self, futures: Sequence[Future[dict[str, Any]]]) -> int:
        """Abort the requests still in flight behind `futures` — exactly those, not by rid
        prefix: their HTTP client went away and nobody will read them (SGLang aborts a
        request whose connection closed). Returns how many were aborted."""
        wanted = {id(f) for f in futures}
        with self._cond:
            victims = [r for r in self._all_inflight_locked() if id(r.future) in wanted]
            self._abort_locked(victims, "the client disconnected")
            self._cond.notify_all()
            return len(victims)

    def _all_inflight_locked(self) -> list[_Request]:
        return [*self._running, *self._waiting, *self._held]

    def _result_locked(self, req: _Request, finish_reason: dict[str, Any]) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": finish_reason,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": 0,
            "weight_version": self._weight_version,
            "num_retractions": req.retractions,
            "sampling_seed": req.seed,
        }
        spans = [{"version": v, "start": a, "end": b} for v, a, b in req.version_spans]
        if not spans and self._weight_version is not None:
            # SGLang reports a request with no output as one empty span of the serving version
            spans = [{"version": self._weight_version, "start": 0, "end": 0}]
        if spans:
            meta["weight_versions"] = spans
            meta["weight_version"] = spans[-1]["version"]  # SGLang: the last span's
        if req.return_logprob:
            meta["output_token_logprobs"] = [
                [lp, tok, None] for lp, tok in zip(req.logprobs, req.output_ids, strict=True)
            ]
            # SGLang's default (`logprob_start_len` -1) starts the input log-probs at the last
            # prompt token: one entry. One per prompt token made every one of n samples carry
            # the whole prompt (a 6 kB request answered 14 MB; n × context entries at most).
            meta["input_token_logprobs"] = [[None, req.input_ids[-1], None]]
        return {
            "text": self._text_locked(req, finish_reason),
            "output_ids": list(req.output_ids),
            "meta_info": meta,
        }

    def _append_token_locked(self, req: _Request, tok: int, logprob: float, weights: int) -> None:
        """Append one sampled token (computed under install `weights`) to `req`, and extend its
        weight-version spans (SGLang's `meta_info.weight_versions`)."""
        req.output_ids.append(tok)
        req.logprobs.append(logprob)
        version = self._gen_versions.get(weights, self._weight_version or DEFAULT_WEIGHT_VERSION)
        n = len(req.output_ids)
        spans = req.version_spans
        if spans and spans[-1][0] == version and spans[-1][2] == n - 1:
            spans[-1][2] = n
        else:
            spans.append([version, n - 1, n])

    def _finish_locked(self, req: _Request, finish_reason: dict[str, Any]) -> None:
        if req.done:
            return
        req.done = True
        req.cache = None  # the KV memory goes with the request
        if self._by_rid.get(req.rid) is req:  # its rid may be used again
            del self._by_rid[req.rid]
        for queue in (self._running, self._held):
            if req in queue:
                queue.remove(req)
        if req in self._waiting:  # a miss would raise a ValueError quoting the request's
            self._waiting.remove(req)  # repr, prompt and all: 1 ms for 20000 tokens, per finish
        result = self._result_locked(req, finish_reason)
        # Its waiter may have gone (a client that disconnected, a health probe that timed out:
        # asyncio cancels the future it waited on); the scheduler must not die of it.
        with contextlib.suppress(InvalidStateError):
            req.future.set_result(result)

    def _abort_locked(self, reqs: Sequence[_Request], message: str) -> None:
        for r in list(reqs):
            self._finish_locked(r, {"type": "abort", "message": message})

    # -- pause / continue ------------------------------------------------------------------
    def pause(self, mode: str) -> int:
        """SGLang's pause modes; returns the number of requests affected."""
        if mode not in PAUSE_MODES:
            raise EngineRefused(
                400, f"unknown pause mode {brief(mode)}", f"modes are {PAUSE_MODES}", "pick one"
            )
        with self._cond:
            self._paused = mode
            affected = self._all_inflight_locked()
            if mode == "abort":
                self._abort_locked(affected, "aborted by /pause_generation(mode=abort)")
            elif mode == "retract":
                for r in reversed(self._running):
                    self._retract_locked(r)
                    self._waiting.appendleft(r)
                self._running.clear()
            self._cond.notify_all()
            return len(affected)

    def _retract_locked(self, req: _Request) -> None:
        req.epoch += 1
        req.retractions += 1
        req.output_ids.clear()
        req.logprobs.clear()
        req.version_spans.clear()
        req.stop_scan.reset()
        req.stop_scan_kept.reset()
        req.special_out = False
        req.cache = None
        req.reset_generator()

    def continue_generation(self) -> None:
        with self._cond:
            self._paused = None
            self._cond.notify_all()

    def flush_cache(self) -> bool:
        """No shared (prefix) cache to flush — each request's KV cache goes with it; like SGLang,
        refuses (False) while requests are in flight."""
        with self._cond:
            return not self._all_inflight_locked()

    def load(self) -> dict[str, int]:
        """SGLang's `/get_load` entry of one data-parallel rank: requests in flight, those still
        waiting, and the tokens they hold (running: prompt + output so far; waiting: prompt)."""
        with self._cond:
            waiting = [*self._waiting, *self._held]
            tokens = sum(len(r.input_ids) + len(r.output_ids) for r in self._running)
            tokens += sum(len(r.input_ids) for r in waiting)
            return {
                "dp_rank": 0,
                "num_reqs": len(self._running) + len(waiting),
                "num_waiting_reqs": len(waiting),
                "num_tokens": tokens,
            }

    # -- memory ----------------------------------------------------------------------------
    @staticmethod
    def _memory_tags(tags: Sequence[str] | None, verb: str) -> set[str]:
        """The tags a release or resume names (none or empty: all), each one of `MEMORY_TAGS`."""
        wanted = set(tags) if tags else set(MEMORY_TAGS)
        unknown = wanted - set(MEMORY_TAGS)
        if unknown:
            raise EngineRefused(
                400,
                f"unknown memory tags {brief(sorted(unknown))}",
                f"the engine can {verb} {', '.join(MEMORY_TAGS)}, and nothing else",
                f"name only those tags (or none, for all of them); nothing was {verb}d",
            )
        return wanted

    def release_memory(self, tags: Sequence[str] | None) -> None:
        wanted = self._memory_tags(tags, "release")
        with self._cond:
            inflight = len(self._all_inflight_locked())
            if inflight or self._updating:
                raise EngineRefused(
                    400,
                    "release_memory_occupation needs an idle engine",
                    f"{inflight} requests are in flight"
                    + (" and a weight install is running" if self._updating else ""),
                    "pause with mode=abort (or wait for the requests) before releasing",
                )
            self._released |= wanted
            if "weights" in wanted:
                self._served, self._model = None, None
                self._weight_version = None
                self._revision = None
                self._message = "weights released by /release_memory_occupation"

    def resume_memory(self, tags: Sequence[str] | None) -> None:
        # an unknown tag was taken, nothing resumed and 200 "memory resumed" answered: the
        # install after it was refused for released weights the caller had just "resumed"
        wanted = self._memory_tags(tags, "resume")
        with self._cond:
            if "weights" in wanted and "weights" in self._released:
                self._message = "weight memory resumed; weights must be installed again"
            self._released -= wanted
            self._cond.notify_all()

    # -- weights ---------------------------------------------------------------------------
    def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
        drain_timeout_s: float = 600.0,
    ) -> tuple[bool, str, int]:
        """SGLang's `(success, message, num_paused_requests)`."""
        with self._cond:
            if self._updating:
                return False, "another weight update is in progress", 0
            if "weights" in self._released:
                return (
                    False,
                    "weight memory is released; call /resume_memory_occupation first",
                    0,
                )
            self._updating, self._updating_path = True, str(model_path)
            if abort_all_requests:
                self._abort_locked(self._all_inflight_locked(), "aborted for a weight update")
            deadline = time.monotonic() + drain_timeout_s
            while self._paused is None and (self._waiting or self._running):
                left = deadline - time.monotonic()
                if left <= 0:
                    self._updating = False
                    self._waiting.extend(self._held)
                    self._held.clear()
                    self._cond.notify_all()
                    return False, f"in-flight requests did not finish in {drain_timeout_s}s", 0
                self._cond.wait(timeout=min(left, 0.5))
            num_paused = len(self._waiting) + len(self._running) if self._paused else 0
            reuse = self._served
        try:
            prepared = _prepare(model_path, reuse=reuse, context_length=self._context_length)
            version = _version_of(prepared, weight_version)
        except Exception as exc:
            return self._install_refused(f"Failed to update weights from {model_path}: {exc}")
        try:
            with self._pass_lock:  # no forward pass reads the weights while they change
                # the loaded tensors become the parameters: no copy of every weight
                _assign(prepared.served.model, prepared.tensors, prepared.root)
                self._weights_gen += 1  # caches computed under the old weights are stale
                self._gen_versions = {
                    g: v for g, v in self._gen_versions.items() if g >= self._weights_gen - 4
                }
                self._gen_versions[self._weights_gen] = version
        except Exception as exc:
            msg = f"Failed to update weights from {model_path}: {exc}"
            with self._cond:
                self._served, self._model = None, None  # it may hold half of the new tensors
                self._weight_version, self._revision = None, None
                self._failed, self._message = True, msg
                self._updating = False
                self._abort_locked(self._all_inflight_locked(), msg)
                self._cond.notify_all()
            return False, msg, num_paused
        manifest = prepared.manifest
        revision = None if manifest is None else manifest.revision
        with self._cond:
            self._served, self._model = prepared.served, prepared.served.model
            self._tokenizer = prepared.served.tokenizer
            self._tokenizer_local = prepared.served.decodes_locally
            self._weight_version, self._revision = version, revision
            self._model_path, self._failed, self._message = str(model_path), False, None
            self._updating = False
            self._waiting.extend(self._held)
            self._held.clear()
            self._cond.notify_all()
        what = "a model directory" if revision is None else f"revision {revision}"
        return (
            True,
            f"Succeeded to update model weights from {model_path} "
            f"({what}). Weight version updated to {version}.",
            num_paused,
        )

    def _install_refused(self, msg: str) -> tuple[bool, str, int]:
        """An install that failed before it touched a weight (a path that is not a revision, a
        torn file, another architecture's config): the installed weights serve on, as SGLang's
        do (it reloads the originals after a failed load), and the requests it held wait again.
        An engine that had nothing installed stays out of service, saying why."""
        with self._cond:
            num_paused = len(self._waiting) + len(self._running) if self._paused else 0
            if self._served is None:
                self._failed, self._message = True, msg
            self._updating = False
            self._waiting.extend(self._held)
            self._held.clear()
            self._cond.notify_all()
        return False, msg, num_paused

    # -- scheduler -------------------------------------------------------------------------
    def _runnable_locked(self) -> bool:
        return (
            not self._stop
            and self._paused is None
            and self._model is not None
            and bool(self._waiting or self._running)
        )

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cond:
                while not self._stop and not self._runnable_locked():
                    self._cond.wait()
                if self._stop:
                    return
                while self._waiting and len(self._running) < self._max_running:
                    self._running.append(self._waiting.popleft())
                # the generator and the cache are taken with the epoch: a retract during this
                # pass replaces them, and the discarded token must not draw from (or write to)
                # the replacements
                batch = [
                    _Step(
                        r,
                        r.epoch,
                        (*r.input_ids, *r.output_ids),
                        r.generator,
                        r.cache,
                        r.cache_weights,
                        r.cache_prefill,
                    )
                    for r in self._running
                ]
                served = self._served
                weights = self._weights_gen
                assert served is not None
            for work in _shared_work(batch, weights):
                if not self._run_work(work, served, weights):
                    break  # an install swapped the weights: the next pass starts afresh
            if self._decode_delay_s:
                time.sleep(self._decode_delay_s)

    def _run_work(self, work: _Work, served: _Served, weights: int) -> bool:
        """One forward and its requests' next tokens; False when an install swapped the weights
        first. A forward or draw that raises ends its requests (aborted, with the reason) rather
        than the scheduler thread: a thread that died left every later request waiting forever
        while /health still answered 200."""
        try:
            with self._pass_lock, torch.inference_mode():
                if self._weights_gen != weights:
                    return False
                logits, cache = self._forward(served, work.tokens, work.cache)
            draws = _Draws(logits)
            for step in work.steps:
                tok, lp = draws.draw(step.req.params, step.generator)
                self._advance(step, tok, lp, cache, work.prefill, weights, served)
        except Exception as exc:  # any failure of a pass ends its requests only
            with self._cond:
                victims = [s.req for s in work.steps if s.req.epoch == s.epoch]
                self._abort_locked(victims, f"the engine failed computing this request: {exc!r}")
                self._cond.notify_all()
        return True

    def _advance(
        self,
        step: _Step,
        tok: int,
        lp: float,
        cache: Any,
        prefill: int,
        weights: int,
        served: _Served,
    ) -> None:
        """Append the sampled token to `step`'s request, unless it was aborted or retracted
        while the token was computed; finish it if a stop condition holds."""
        req = step.req
        with self._cond:
            if req.done or req.epoch != step.epoch:
                return
            # a pause in place takes effect at the step boundary: the token is kept
            req.cache, req.cache_weights, req.cache_prefill = cache, weights, prefill
            self._append_token_locked(req, tok, lp, weights)
            reason = self._stop_reason(req, tok, served)
            if reason is not None:
                self._finish_locked(req, reason)
                self._cond.notify_all()

    @staticmethod
    def _forward(served: _Served, tokens: tuple[int, ...], cache: Any) -> tuple[torch.Tensor, Any]:
        """Logits of the token after `tokens`. A cache (computed under the installed weights)
        holds every token but the last: only that one is fed. Without one (a new, retracted or
        re-weighted request) the whole sequence is prefilled into a fresh cache."""
        from transformers import DynamicCache

        if cache is None:
            cache = DynamicCache(config=served.model.config)
            feed = list(tokens)
        else:
            feed = [tokens[-1]]
        out = served.model(
            input_ids=torch.tensor([feed], dtype=torch.long), cache=cache, use_cache=True
        )
        return out.logits[0, -1], cache

    def _stop_string(self, req: _Request, tok: int, served: _Served) -> str | None:
        """The first of the request's stop strings, in their order, that occurs in the decoding
        of its whole output with special tokens kept (SGLang's `_check_str_based_finish`
        decodes its tail so: `tokenizer.decode`'s default) or, with `skip_special_tokens`, in
        the decoding without them (its `text`); a bounded tail of each is decoded
        (`StopScan`). Until the output holds a special token the two decodings are one, and
        the one with special tokens kept starts when the first comes."""
        p = req.params
        common = {"tokenizer": self._tokenizer, "local": self._tokenizer_local}
        if not p.skip_special_tokens:
            return req.stop_scan_kept.matched(req.output_ids, self._decode_kept, **common)
        s = req.stop_scan.matched(req.output_ids, self._decode, **common)
        req.special_out = req.special_out or tok in served.special_ids
        if req.special_out:
            kept = req.stop_scan_kept.matched(req.output_ids, self._decode_kept, **common)
            if kept is not None and (s is None or p.stop.index(kept) < p.stop.index(s)):
                return kept
        return s

    def _stop_reason(self, req: _Request, tok: int, served: _Served) -> dict[str, Any] | None:
        p = req.params
        if tok in served.eos_ids and not p.ignore_eos:
            return {"type": "stop", "matched": tok}
        if tok in p.stop_token_ids:
            return {"type": "stop", "matched": tok}
        if p.stop and (s := self._stop_string(req, tok, served)) is not None:
            return {"type": "stop", "matched": s}
        if len(req.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": len(req.output_ids)}
        if len(req.input_ids) + len(req.output_ids) >= served.context_length:
            return {"type": "length", "length": len(req.output_ids)}
        return None
