"""The embedded rollout engine: SGLang's HTTP control API over a Hugging Face causal LM on CPU.

Run it as a process, under SGLang's launch contract (`engine_command.engine_argv` builds the
same line for both, only the module differs)::

    python -m ehp_fsm.rollout.server --host 127.0.0.1 --port 30000 \
        [--model-path REVISION_OR_MODEL_DIR] [--tp-size N] [--weight-version V] \
        [--enable-memory-saver] [--enable-deterministic-inference] [--context-length N] \
        [--max-running-requests N] [--max-queued-requests N] [--log-level L] \
        [--api-key KEY] [--torch-threads N] [--decode-delay-ms MS]

`--model-path` (SGLang's name) is a revision directory or a plain HF model directory to install
at start; without it the engine starts empty and serves nothing until an install. The SGLang
options it takes are `SGLANG_OPTIONS`; the two memory/determinism flags and `--tp-size` are
recorded and reported by `/server_info` (the engine frees weights on release and is
deterministic per request either way, and computes in one process); `--torch-threads` and
`--decode-delay-ms` are its own. Any other option is refused by name (exit code 2).

FastAPI + uvicorn (the stack SGLang's own `http_server.py` serves with); the scheduling,
sampling, pause and install semantics live in `engine.EngineCore`.

Endpoint names, request fields and response fields follow SGLang's source, matched against
`sgl-project/sglang` `python/sglang/srt/entrypoints/http_server.py` (commits 0025436e, 9c0549b7,
and the /model_info rename at 78043d44), `python/sglang/srt/managers/io_struct.py`
(`GenerateReqInput`, `UpdateWeightFromDiskReqInput`, `ReleaseMemoryOccupationReqInput`,
`ResumeMemoryOccupationReqInput`, `PauseGenerationReqInput`, `AbortReq`),
`python/sglang/srt/sampling/sampling_params.py` (`SamplingParams`, incl. `sampling_seed`) and
`tokenizer_manager.py` (`meta_info` keys):

* `POST /generate` — `text` (tokenized with the installed model's tokenizer) | `input_ids`
  (single or batch), `sampling_params`
  (`max_new_tokens`, `temperature`, `top_p`, `top_k`, `stop`, `stop_token_ids`, `ignore_eos`,
  `sampling_seed`; `seed` accepted as an alias; `n` samples per prompt; `skip_special_tokens`
  and `no_stop_trim` shape `text` as SGLang's detokenizer does), `rid`,
  `return_logprob`, `stream` (refused).
  Answer: `{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
  "completion_tokens", "weight_version", "weight_versions", "num_retractions",
  "output_token_logprobs": [[logprob, token_id, null], ...]}}`; a list for batch input or
  `n > 1` (prompt-major; sample j of n draws with `sampling_seed + j`; rids `RID_k` over the
  whole answer for one rid given to a batch or to n > 1 — SGLang's `_normalize_rid` — and
  `RID_j` per prompt for a list of rids). As newer SGLang's `TokenizerManager` (0.5.3 has no
  such check: a second request under a rid in flight overwrote the first's state): a rid
  still in flight is refused with 400 ("Duplicate request ID detected: RID"; free again once
  that request finished or was aborted), and so is a list of rids that names two prompts alike
  ("Duplicate request IDs detected within the request").
  `weight_versions` is SGLang's per-token record (`sglang/srt/utils/weight_versions.py`):
  `[{"version", "start", "end"}, ...]` spans over the output tokens, one per run of tokens made
  under one weight version; `weight_version` is the last span's. `finish_reason` is SGLang's
  `{"type": "stop", "matched": ...}` / `{"type": "length", "length": n}` /
  `{"type": "abort", "message": ...}`.
* `GET /health`, `GET /health_generate` — 200 when serving, and while memory is released (SGLang's
  scheduler skips the probe then); 503 with a message when no weights are installed.
* `GET /server_info` and `GET /get_server_info` (older name) — the launch arguments under
  `ServerArgs`' field names (`model_path`, `tp_size`, `port`, `enable_memory_saver`, ...),
  `weight_version`, `internal_states`, `version`. `GET /get_load` — `[{"dp_rank",
  "num_reqs", "num_waiting_reqs", "num_tokens"}]` (as SGLang 0.5.3's `GetLoadReqOutput`).
* `GET /model_info` and `GET /get_model_info` (older name) — `model_path`, `tokenizer_path`,
  `is_generation`, `preferred_sampling_params`, `weight_version`, plus embedded-only `engine`,
  `status`, `message`, `revision`, `paused`, `released`, `model_config` (model type, sizes,
  context length, dtype).
  `GET /get_weight_version` — `{"weight_version"}`.
* `POST /update_weights_from_disk` — `model_path` (a revision or HF model directory),
  `weight_version` (default: the revision number; "default" for a plain directory),
  `abort_all_requests`,
  `flush_cache` (accepted; nothing to flush) → `success`, `message`, `num_paused_requests`
  (200 on success, 400 on failure, as SGLang).
* `POST /release_memory_occupation`, `POST /resume_memory_occupation` — `tags`
  (`weights`, `kv_cache`, `cuda_graph`; null = all).
* `POST /pause_generation` (`mode`: abort | retract | in_place, default abort),
  `POST /continue_generation`, `POST /abort_request` (`rid`, `abort_all`),
  `GET|POST /flush_cache` (200, or 400 while requests are in flight, as SGLang).

Bounds SGLang lacks (`engine.SamplingParams.from_json`, `EngineCore.encode`): rids of at most
`MAX_RID_CHARS` characters, at most `MAX_STOP_STRINGS` stop strings and `MAX_STOP_TOKEN_IDS`
stop ids per request, and no `text` longer than any prompt that fits in the context; a text is
tokenized off the event loop, on threads of its own (`TOKENIZE_THREADS`).

Errors are SGLang's `{"error": {"message": ...}}` with status 400 (bad request / wrong state),
413 (a body over `http_limits.MAX_BODY_BYTES`, refused before it is parsed) or 503 (no weights
to serve with). A connection that has not sent a whole request within `REQUEST_READ_S` is
closed, and one whose client takes no byte of its answer for `ANSWER_UNREAD_S` is dropped
(`http_limits`).

With an API key (SGLang's `--api-key`; or the environment variable `EHP_ENGINE_API_KEY`,
which keeps it out of the process list) every request but `OPTIONS`, `/health*` and
`/metrics*` must carry `Authorization: Bearer KEY`, else 401 `{"error": "Unauthorized"}` —
SGLang's rule (`utils.add_api_key_middleware`), so the same client drives both. `/server_info`
never reports the key.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import replace
from types import FrameType
from typing import Annotated, Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator
from starlette.exceptions import HTTPException

from ehp_fsm.engine_command import API_KEY_ENV, authorization
from ehp_fsm.rollout.engine import (
    DEFAULT_MAX_QUEUED,
    SEED_RANGE,
    EngineCore,
    EngineRefused,
    SamplingParams,
    brief,
    check_distinct_rids,
)
from ehp_fsm.rollout.http_limits import (
    ANSWER_UNREAD_S,
    MAX_BODY_BYTES,
    REQUEST_READ_S,
    BodyLimit,
    read_deadline_protocol,
)
from ehp_fsm.translog import package_version

ENGINE_NAME = "ehp-fsm-embedded"
#: How often a waiting `/generate` checks that its client is still connected.
DISCONNECT_POLL_S = 0.25
#: The longest `rid` a request may give (SGLang sets no bound; its own are 32 hex digits). With
#: `sampling_params.n` every sample's rid is a copy of it: a 200 kB rid with n = 500 grew the
#: engine by 300 MB and answered 100 MB; one of 30 MB with n = 4096 would take 120 GB.
MAX_RID_CHARS = 1024
#: The longest `weight_version` an install may give (SGLang sets no bound): each later answer
#: quotes it, once per span of `meta_info.weight_versions`.
MAX_WEIGHT_VERSION_CHARS = 256
#: Threads that tokenize `text` prompts (`create_app`): the engine tokenizes one at a time, the
#: second takes a text refused by its length at once while a long one is tokenized.
TOKENIZE_THREADS = 2


def _utf8(value: Any) -> Any:
    """`value`, unless a string in it is not UTF-8 text: JSON's `\\ud800` escape gives Python a
    lone surrogate, which no answer quoting it can encode — a `weight_version` of one made every
    later /generate, /model_info and /server_info answer 500 until the next install."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:  # not recursive: the body may nest as deep as the JSON parser allows
        where, v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as exc:
                at = f" at {where}" if where else ""
                raise ValueError(
                    f"the string{at} holds the lone surrogate {v[exc.start]!a} (character "
                    f"{exc.start}), which is not UTF-8 text: send UTF-8 text"
                ) from None
        elif isinstance(v, dict):
            for k, x in v.items():
                stack.append((f"{where} key" if where else "a key", k))
                name = ascii(k)[1:-1][:40]  # escaped: the key may hold a surrogate itself
                stack.append((f"{where}.{name}" if where else name, x))
        elif isinstance(v, list):
            stack.extend((f"{where}[{i}]", x) for i, x in enumerate(v) if not isinstance(x, int))
    return value


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


# Every list a request may carry is checked up to its first wrong entry (`fail_fast`): pydantic
# otherwise makes one error per wrong entry, for each branch of a union, and the refusal lists
# them all — `{"input_ids": [[1], 2, 1, 1, ...]}` of 2 MB (a million ints after one list) held the
# event loop, every client's, for 10 s, and validating it took 1.4 GB (16 times that fits in 32 MB).
_StrictInts = Annotated[list[StrictInt], Field(fail_fast=True)]
_Ints = Annotated[list[int], Field(fail_fast=True)]
_Strs = Annotated[list[str], Field(fail_fast=True)]
_Bools = Annotated[list[bool], Field(fail_fast=True)]
_Dicts = Annotated[list[dict[str, Any]], Field(fail_fast=True)]


class GenerateReqInput(_Body):
    text: str | _Strs | None = None
    #: strict: `true` is no token id (lax, pydantic read `[true, 2]` as `[1, 2]`)
    input_ids: _StrictInts | Annotated[list[_StrictInts], Field(fail_fast=True)] | None = None
    sampling_params: dict[str, Any] | _Dicts | None = None
    rid: str | _Strs | None = None
    return_logprob: bool | _Bools = False
    #: SGLang's log-prob options beyond the sampled tokens': refused when asked for (`_requests_of`)
    logprob_start_len: int | _Ints | None = None
    top_logprobs_num: int | _Ints | None = None
    token_ids_logprob: _Ints | Annotated[list[_Ints], Field(fail_fast=True)] | None = None
    stream: bool = False
    _text = field_validator("text", "sampling_params", "rid")(_utf8)


class UpdateWeightFromDiskReqInput(_Body):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    #: bounded: every later answer quotes it (`meta_info`, `/server_info`), and 1 MB was taken
    weight_version: str | None = Field(default=None, max_length=MAX_WEIGHT_VERSION_CHARS)
    flush_cache: bool = True
    _text = field_validator("model_path", "load_format", "weight_version")(_utf8)


class MemoryOccupationReqInput(_Body):
    tags: _Strs | None = None
    _text = field_validator("tags")(_utf8)


class PauseGenerationReqInput(_Body):
    mode: str = "abort"
    _text = field_validator("mode")(_utf8)


class AbortReq(_Body):
    rid: str = ""
    abort_all: bool = False
    _text = field_validator("rid")(_utf8)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def _validation_message(exc: RequestValidationError, limit: int = 2000) -> str:
    """Each of pydantic's errors as `field.path: message`, without the input it was given: the
    whole body was echoed back (a 1 MB string answered with over 1 MB)."""
    parts = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":  # loc: ("body", character position)
            parts.append(f"the body is not JSON: {err.get('msg')} at {err['loc'][-1]}")
            continue
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    text = "; ".join(parts)
    return text if len(text) <= limit else text[:limit] + " …"


def _unparsed(cause: BaseException) -> str | None:
    """Why FastAPI's JSON parser gave up on a body that is JSON in form (None: not one of those
    causes). FastAPI answered each with a bare `{"detail": "There was an error parsing the
    body"}`, outside SGLang's error shape, naming neither the cause nor a fix."""
    if isinstance(cause, RecursionError):
        return (
            "it nests lists or objects deeper than the JSON parser reads (Python's recursion "
            f"limit, {sys.getrecursionlimit()}): send SGLang's request fields, a few levels deep"
        )
    if isinstance(cause, UnicodeDecodeError):
        return (
            f"it is not UTF-8 text ({cause.reason} at byte {cause.start}): send JSON encoded "
            "as UTF-8"
        )
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        return (
            f"it holds an integer of more than {sys.get_int_max_str_digits()} digits, more "
            "than Python reads and far past any field's range: send the numbers the fields take"
        )
    return None


def _json_type(content_type: str) -> bool:
    """Whether FastAPI reads a body of `content_type` as JSON (`application/json`, `…+json`)."""
    main = content_type.split(";", 1)[0].strip().lower()
    return main == "application/json" or (
        main.startswith("application/") and main.endswith("+json")
    )


def _refused(exc: EngineRefused) -> JSONResponse:
    return _error(exc.status, str(exc))


def _as_list(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise EngineRefused(
                400,
                f"`{name}` has {len(value)} entries for {n} prompts",
                "batch sizes differ",
                f"send one `{name}` per prompt or a single one for all",
            )
        return value
    return [value] * n


def _parallel_n(sampling_params: Any) -> int:
    """SGLang's parallel sampling count `n` (the same for every prompt of a batch)."""
    dicts = sampling_params if isinstance(sampling_params, list) else [sampling_params]
    counts = set()
    for d in dicts:
        n = (d or {}).get("n", 1) if isinstance(d, dict) else 1
        n = 1 if n is None else n
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise EngineRefused(
                400, f"sampling_params.n is {brief(n)}", "n counts samples per prompt", "send n ≥ 1"
            )
        counts.add(n)
    if len(counts) > 1:
        raise EngineRefused(
            400,
            f"sampling_params.n differs between prompts: {sorted(counts)}",
            "SGLang expands every prompt of a batch into the same number of samples",
            "send one n for the whole batch",
        )
    return counts.pop() if counts else 1  # no sampling_params ([]): `_as_list` refuses them


def _check_size(core: EngineCore, prompts: int, n: int) -> None:
    """Refuse a request of more samples than the engine could ever queue before one of them is
    built: a huge `sampling_params.n` built n request records (time and memory growing with n)
    only to be refused by the queue bound. The same 503 as `EngineCore.submit_all`'s."""
    limit = core.max_queued_requests
    if prompts * n > limit:
        raise EngineRefused(
            503,
            f"the request queue is full: {prompts} prompts × sampling_params.n = {n} would be "
            f"{prompts * n} waiting",
            f"the engine queues at most {limit} requests (--max-queued-requests)",
            "send fewer prompts or samples per request",
        )


def _unsupported_logprobs(obj: GenerateReqInput) -> None:
    """Refuse the log-probs the engine does not compute: the prompt's (`logprob_start_len` ≥ 0),
    the top-k alternatives (`top_logprobs_num` > 0) and chosen ids' (`token_ids_logprob`). They
    were ignored: a client asking for them got no `output_top_logprobs`, or one entry of null
    prompt log-probs, and failed further on (SGLang ignores them without `return_logprob`)."""
    wanted = obj.return_logprob if isinstance(obj.return_logprob, list) else [obj.return_logprob]
    if not any(wanted):
        return

    def listed(v: Any) -> list[Any]:
        return v if isinstance(v, list) else [v]

    asked = [
        name
        for name, on in (
            ("logprob_start_len", any(x not in (None, -1) for x in listed(obj.logprob_start_len))),
            ("top_logprobs_num", any(x not in (None, 0) for x in listed(obj.top_logprobs_num))),
            ("token_ids_logprob", bool(obj.token_ids_logprob)),
        )
        if on
    ]
    if asked:
        raise EngineRefused(
            400,
            f"{', '.join(asked)} asked for",
            "the embedded engine computes the log-probs of the sampled tokens only "
            "(meta_info.output_token_logprobs)",
            f"leave out {', '.join(asked)} (or run an SGLang engine)",
        )


def _derived_seed(params: SamplingParams, j: int) -> SamplingParams:
    """The j-th of n samples: seed + j (a request with n = 1 and that seed gives the same).
    Past the seeds torch takes (< 2⁶⁴) it wraps to seed + j - 2⁶⁴, the generator torch makes of
    seed + j; it wrapped at 2⁶³ before, so a negative seed or one ≥ 2⁶³ drew other tokens than
    the n = 1 request with seed + j."""
    if j == 0 or params.sampling_seed is None:
        return params
    seed = params.sampling_seed + j
    return replace(params, sampling_seed=seed - (1 << 64) if seed >= SEED_RANGE[1] else seed)


def _requests_of(core: EngineCore, obj: GenerateReqInput) -> tuple[bool, list[dict[str, Any]]]:
    """(single answer?, the `EngineCore.submit` keyword sets): one per prompt, or n per prompt
    with `sampling_params.n` (prompt-major, as SGLang orders them)."""
    if obj.stream:
        raise EngineRefused(
            400, "stream=true is not supported", "the embedded engine answers whole", "send false"
        )
    if (obj.text is None) == (obj.input_ids is None):
        raise EngineRefused(
            400,
            "exactly one of `text` and `input_ids` is required",
            "SGLang's GenerateReqInput takes one input kind",
            "send one of them",
        )
    _unsupported_logprobs(obj)
    given = obj.rid if isinstance(obj.rid, list) else [obj.rid or ""]
    longest = max((len(r) for r in given), default=0)
    if longest > MAX_RID_CHARS:
        raise EngineRefused(
            400,
            f"a rid of {longest} characters",
            f"the engine takes rids of at most {MAX_RID_CHARS} characters (each of the n samples "
            "of a prompt gets a copy)",
            "send shorter rids",
        )
    if isinstance(obj.rid, list):
        check_distinct_rids(obj.rid)  # before any text is tokenized
    n = _parallel_n(obj.sampling_params)
    if obj.text is not None:
        single = isinstance(obj.text, str)
        texts = [obj.text] if isinstance(obj.text, str) else obj.text
        _check_size(core, len(texts), n)  # before tokenizing any of them
        prompts = [core.encode(t) for t in texts]
    else:
        ids = obj.input_ids or []
        single = not ids or not isinstance(ids[0], list)
        prompts = [list(ids)] if single else [list(x) for x in ids]  # type: ignore[arg-type]
    b = len(prompts)
    _check_size(core, b, n)
    try:
        params = [
            SamplingParams.from_json(p) for p in _as_list(obj.sampling_params, b, "sampling_params")
        ]
    except (ValueError, TypeError) as exc:
        raise EngineRefused(
            400, "invalid sampling_params", str(exc), "send SGLang's sampling params"
        ) from None
    if n > 1 and isinstance(obj.return_logprob, list):
        raise EngineRefused(
            400,
            "a list of return_logprob with sampling_params.n > 1",
            "SGLang refuses it (Cannot use list return_logprob with parallel_sample_num > 1)",
            "send one return_logprob for the whole request",
        )
    rids = _as_list(obj.rid, b, "rid")
    logprob = _as_list(obj.return_logprob, b, "return_logprob")
    out = []
    for i in range(b):
        for j in range(n):
            rid = rids[i]
            # a list names each prompt (RID_j per sample of n > 1); one rid names them all:
            # RID_k over the whole answer of a batch or of n > 1, as SGLang's `_normalize_rid`
            # (the prompts of a batch all took that one rid: duplicates, refused now)
            if rid is not None and isinstance(obj.rid, list):
                rid = f"{rid}_{j}" if n > 1 else rid
            elif rid is not None and (n > 1 or not single):
                rid = f"{rid}_{i * n + j}"
            out.append(
                {
                    "input_ids": prompts[i],
                    "params": _derived_seed(params[i], j),
                    "rid": rid,
                    "return_logprob": bool(logprob[i]),
                }
            )
    return single and n == 1, out


#: Paths SGLang serves without the key: its load balancers' and the agents' health probes.
_OPEN_PREFIXES = ("/health", "/metrics")


def _authorized(request: Request, api_key: str) -> bool:
    """SGLang's rule: `OPTIONS`, `/health*` and `/metrics*` are open; anything else needs
    `Authorization: Bearer <key>` (compared in constant time)."""
    if request.method == "OPTIONS" or request.url.path.startswith(_OPEN_PREFIXES):
        return True
    given = request.headers.get("authorization", "")
    return secrets.compare_digest(given.encode(), authorization(api_key).encode())


def create_app(
    core: EngineCore,
    launch: dict[str, Any] | None = None,
    *,
    max_body_bytes: int = MAX_BODY_BYTES,
    api_key: str | None = None,
) -> FastAPI:
    """The HTTP API over `core`; `launch` is what `/server_info` reports of the command line
    (SGLang's `ServerArgs` field names); a request body over `max_body_bytes` is refused (413);
    with `api_key`, a request without it is refused (401; see the module docstring)."""
    launch = dict(launch or {})
    # Tokenizing `text` has threads of its own: on the loop's default pool (which installs
    # use too) a long install delayed every text prompt, and tokenizing delayed installs.
    tokenizing = ThreadPoolExecutor(max_workers=TOKENIZE_THREADS, thread_name_prefix="ehp-tokenize")

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            tokenizing.shutdown(wait=False, cancel_futures=True)
            await asyncio.to_thread(core.shutdown)

    app = FastAPI(lifespan=lifespan, openapi_url=None)
    app.add_middleware(BodyLimit, limit=max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        ctype = request.headers.get("content-type", "")
        if not _json_type(ctype):
            # FastAPI reads a body as JSON only under a JSON content type (older releases, as
            # SGLang's may be, took a body without one too); the bare "Input should be a valid
            # dictionary" did not say so
            given = f"Content-Type {brief(ctype, 60)}" if ctype else "no Content-Type"
            return _error(
                400,
                f"invalid request body: it was sent with {given}, so it is not read as JSON: "
                "send it with `Content-Type: application/json`",
            )
        return _error(400, f"invalid request body: {_validation_message(exc)}")

    @app.exception_handler(HTTPException)  # Starlette's: what FastAPI's routing raises
    async def _http_error(request: Request, exc: HTTPException) -> Response:
        cause = exc.__cause__
        if exc.status_code == 400 and cause is not None and _unparsed(cause) is not None:
            return _error(400, f"invalid request body: {_unparsed(cause)}")
        return await http_exception_handler(request, exc)  # FastAPI's (and SGLang's) own

    if api_key is not None:
        key = api_key

        @app.middleware("http")
        async def _authentication(
            request: Request, call_next: Callable[[Request], Awaitable[Response]]
        ) -> Response:
            if not _authorized(request, key):
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
            return await call_next(request)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(obj: GenerateReqInput, request: Request) -> Any:
        try:
            if obj.text is not None:  # seconds for a long text: off the loop that serves the rest
                loop = asyncio.get_running_loop()
                single, requests = await loop.run_in_executor(tokenizing, _requests_of, core, obj)
            else:  # ids: as cheap as parsing the body was
                single, requests = _requests_of(core, obj)
            futures = core.submit_all(requests)  # all of them, or none (a full queue)
        except EngineRefused as exc:
            return _refused(exc)
        gathered = asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        while not (await asyncio.wait({gathered}, timeout=DISCONNECT_POLL_S))[0]:
            if await request.is_disconnected():  # nobody will read them: free the engine
                core.abandon(futures)
        results = gathered.result()
        # plain JSON already: FastAPI's jsonable_encoder walked every value of every answer on
        # the event loop (0.3–0.6 s for 2000 samples, 30× json.dumps)
        return JSONResponse(results[0] if single else results)

    async def _health() -> Response:
        st = core.status()
        if st.status == "updating" and st.model_config is None:  # no weights until it is done
            return JSONResponse(
                {"status": st.status, "message": "no weights yet: an install is in progress"},
                status_code=503,
            )
        if st.status in ("serving", "updating", "released"):
            # released: SGLang's scheduler skips the health probe while memory is released and
            # the server answers 200 (the process is fine; it serves again after resume + install)
            return Response(status_code=200)
        return JSONResponse(
            {"status": st.status, "message": st.message or "no weights installed"},
            status_code=503,
        )

    @app.get("/health")
    async def health() -> Response:
        return await _health()

    @app.get("/health_generate")
    async def health_generate() -> Response:
        resp = await _health()
        st = core.status()
        busy = st.paused or st.num_running or st.num_waiting or st.status == "released"
        if resp.status_code != 200 or busy:
            return resp  # busy or paused: healthy without an extra probe, as SGLang
        # SGLang's probe rid is HEALTH_CHECK_<time>: two probes at once must not collide
        rid = f"HEALTH_CHECK_{uuid.uuid4().hex}"
        try:
            fut = core.submit(
                input_ids=core.probe_input_ids(),
                params=SamplingParams(max_new_tokens=1, temperature=0.0),
                rid=rid,
            )
            await asyncio.wait_for(asyncio.wrap_future(fut), timeout=20)
        except EngineRefused as exc:
            return JSONResponse({"status": "unhealthy", "message": str(exc)}, status_code=503)
        except TimeoutError:
            core.abort(rid=rid)  # the probe must not run on after its answer
            return JSONResponse(
                {"status": "unhealthy", "message": "the probe did not finish within 20 s"},
                status_code=503,
            )
        return Response(status_code=200)

    def _model_info() -> dict[str, Any]:
        st = core.status()
        return {
            "model_path": st.model_path,
            "tokenizer_path": st.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": st.weight_version,
            "engine": ENGINE_NAME,
            "status": st.status,
            "message": st.message,
            "revision": st.revision,
            "paused": st.paused,
            "released": list(st.released),
            "num_running_reqs": st.num_running,
            "num_waiting_reqs": st.num_waiting,
            "model_config": st.model_config,
        }

    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        return _model_info()

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return _model_info()

    def _server_info() -> dict[str, Any]:
        st = core.status()
        return {
            **launch,
            "weight_version": st.weight_version,
            "internal_states": [
                {
                    "status": st.status,
                    "paused": st.paused,
                    "released": list(st.released),
                    "num_running_reqs": st.num_running,
                    "num_waiting_reqs": st.num_waiting,
                }
            ],
            "version": f"{ENGINE_NAME} {package_version()}",
            "engine": ENGINE_NAME,
        }

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        return _server_info()

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        return _server_info()

    @app.get("/get_load")
    async def get_load() -> list[dict[str, int]]:
        return [core.load()]

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        return {"weight_version": core.status().weight_version}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(obj: UpdateWeightFromDiskReqInput) -> JSONResponse:
        ok, message, paused = await asyncio.to_thread(
            core.update_weights_from_disk,
            obj.model_path,
            weight_version=obj.weight_version,
            abort_all_requests=obj.abort_all_requests,
        )
        return JSONResponse(
            {"success": ok, "message": message, "num_paused_requests": paused},
            status_code=200 if ok else 400,
        )

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(obj: MemoryOccupationReqInput) -> JSONResponse:
        try:
            core.release_memory(obj.tags)
        except EngineRefused as exc:
            return _refused(exc)
        return JSONResponse({"success": True, "message": "memory released"})

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(obj: MemoryOccupationReqInput) -> JSONResponse:
        try:
            core.resume_memory(obj.tags)
        except EngineRefused as exc:
            return _refused(exc)
        return JSONResponse({"success": True, "message": "memory resumed"})

    @app.post("/pause_generation")
    async def pause_generation(obj: PauseGenerationReqInput | None = None) -> JSONResponse:
        try:
            n = core.pause((obj or PauseGenerationReqInput()).mode)
        except EngineRefused as exc:
            return _refused(exc)
        return JSONResponse(
            {"message": "Generation paused successfully.", "status": "ok", "num_requests": n}
        )

    @app.post("/continue_generation")
    async def continue_generation() -> JSONResponse:
        core.continue_generation()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.post("/abort_request")
    async def abort_request(obj: AbortReq) -> Response:
        core.abort(rid=obj.rid, abort_all=obj.abort_all)
        return Response(status_code=200)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        ok = core.flush_cache()
        return PlainTextResponse(
            "Cache flushed.\n(When there are running or waiting requests, the operation will "
            "not be performed.)\n",
            status_code=200 if ok else 400,
        )

    return app


#: The SGLang options (0.5.3's names) the embedded engine takes, besides its own
#: `--torch-threads` and `--decode-delay-ms`. Every other option is refused by name.
SGLANG_OPTIONS: tuple[str, ...] = (
    "--model-path",
    "--model",
    "--tp-size",
    "--tensor-parallel-size",
    "--host",
    "--port",
    "--weight-version",
    "--enable-memory-saver",
    "--enable-deterministic-inference",
    "--context-length",
    "--max-running-requests",
    "--max-queued-requests",
    "--log-level",
    "--api-key",
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ehp_fsm.rollout.server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # an SGLang option it lacks must not match one of its own by prefix
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument(
        "--model-path",
        "--model",
        default=None,
        help="revision or HF model directory to install at start (SGLang's name)",
    )
    p.add_argument(
        "--tp-size",
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="the engine's TP (reported by /server_info; the embedded engine computes in one "
        "process whatever the TP)",
    )
    p.add_argument(
        "--weight-version",
        default=None,
        help='default: the revision number ("default" for a plain model directory)',
    )
    p.add_argument(
        "--enable-memory-saver",
        action="store_true",
        help="accepted: the embedded engine frees its weights on release either way",
    )
    p.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="accepted: the embedded engine is deterministic per request either way",
    )
    p.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="prompt + output limit (default: the model's max_position_embeddings)",
    )
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=DEFAULT_MAX_QUEUED,
        help=f"requests waiting to run at most (default {DEFAULT_MAX_QUEUED}; SGLang: "
        "unbounded); a /generate that would queue more is refused whole with 503",
    )
    p.add_argument("--log-level", default="warning")
    p.add_argument(
        "--api-key",
        default=None,
        help=f"requests must carry `Authorization: Bearer KEY` (SGLang's rule; default: the "
        f"environment variable {API_KEY_ENV}, which keeps the key out of the process list)",
    )
    p.add_argument("--torch-threads", type=int, default=1, help="embedded only")
    p.add_argument(
        "--decode-delay-ms",
        type=float,
        default=0.0,
        help="embedded only: sleep after every decode pass (a test throttle standing in for a "
        "slow device)",
    )
    return p


def _unsupported(extra: list[str]) -> str | None:
    """The refusal of arguments the parser did not take (None: there are none)."""
    if not extra:
        return None
    names = sorted({a.split("=", 1)[0] for a in extra if a.startswith("-")}) or extra[:3]
    return (
        f"ehp-fsm engine: the embedded engine does not support {', '.join(names)}. It takes "
        f"SGLang's {', '.join(SGLANG_OPTIONS)} and its own --torch-threads, --decode-delay-ms; "
        "drop the others from the plan's [sglang] args or run an SGLang engine (backend = "
        '"sglang" on a CUDA host).'
    )


def main(argv: list[str] | None = None) -> int:
    args, extra = _parser().parse_known_args(argv)
    refusal = _unsupported(extra)
    if refusal is None and args.tp_size < 1:
        refusal = f"ehp-fsm engine: --tp-size must be ≥ 1, got {args.tp_size}"
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if refusal is None and api_key is not None and not api_key.strip():
        refusal = "ehp-fsm engine: the API key is empty (give a key, or none at all)"
    if refusal is None and args.max_queued_requests < 1:
        refusal = (
            f"ehp-fsm engine: --max-queued-requests must be ≥ 1, got {args.max_queued_requests}"
        )
    if refusal is None and len(args.weight_version or "") > MAX_WEIGHT_VERSION_CHARS:
        refusal = (
            f"ehp-fsm engine: --weight-version has {len(args.weight_version)} characters; "
            f"give at most {MAX_WEIGHT_VERSION_CHARS}"
        )
    if refusal is not None:
        print(refusal, file=sys.stderr, flush=True)
        return 2
    torch.set_num_threads(args.torch_threads)
    core = EngineCore(
        max_running_requests=args.max_running_requests,
        max_queued_requests=args.max_queued_requests,
        decode_delay_s=args.decode_delay_ms / 1000.0,
        context_length=args.context_length,
    )
    if args.model_path is not None:
        ok, message, _ = core.update_weights_from_disk(
            args.model_path, weight_version=args.weight_version
        )
        if not ok:
            print(f"ehp-fsm engine: cannot start: {message}", file=sys.stderr, flush=True)
            core.shutdown()
            return 2
    started = "empty" if args.model_path is None else f"from {args.model_path}"
    print(f"ehp-fsm engine pid={os.getpid()} on {args.host}:{args.port} {started}", file=sys.stderr)
    launch = {
        "model_path": args.model_path,
        "tokenizer_path": args.model_path,
        "host": args.host,
        "port": args.port,
        "tp_size": args.tp_size,
        "pp_size": 1,
        "dp_size": 1,
        "ep_size": 1,
        "context_length": args.context_length,
        "max_running_requests": args.max_running_requests,
        "max_queued_requests": args.max_queued_requests,
        "enable_memory_saver": args.enable_memory_saver,
        "enable_deterministic_inference": args.enable_deterministic_inference,
    }
    _Server(
        uvicorn_config(
            create_app(core, launch, api_key=api_key), args.host, args.port, args.log_level
        ),
        core,
    ).run()
    return 0


def uvicorn_config(
    app: FastAPI,
    host: str,
    port: int,
    log_level: str,
    *,
    read_s: float = REQUEST_READ_S,
    write_s: float = ANSWER_UNREAD_S,
    connections: int | None = None,
) -> uvicorn.Config:
    """How the engine serves `app`: uvicorn's h11 protocol with a deadline on reading each
    request and on an answer its client leaves unread, and a cap on open connections
    (`http_limits`; default `max_connections()`), short keep-alive and graceful-shutdown
    waits."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=read_deadline_protocol(read_s, write_s, connections),
        timeout_keep_alive=5,
        # On SIGTERM the engine has ended every request already (`_Server.handle_exit`); a
        # connection still open after that is waited for 1 s, not 5: in default runs one
        # drained engine in two or three still took the full 5 s to exit, and its borrow with it.
        timeout_graceful_shutdown=1,
    )


class _Server(uvicorn.Server):
    """uvicorn's server; on SIGTERM/SIGINT the engine ends its in-flight requests first, so the
    graceful shutdown finds none waiting (a request held by a pause kept the process 5 s)."""

    def __init__(self, config: uvicorn.Config, core: EngineCore) -> None:
        super().__init__(config)
        self._core = core

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._core.stop_serving()
        super().handle_exit(sig, frame)


if __name__ == "__main__":
    sys.exit(main())
