"""A thin SGLang client: one method per control verb, a timeout on every call.

The same client drives the embedded engine (`server.py`) and a real SGLang server. Differences
between SGLang versions that it absorbs (checked in `sgl-project/sglang`'s `http_server.py`,
`io_struct.py` and `tokenizer_manager.py` across versions):

* `/model_info` is the current name; `/get_model_info` is the older one (deprecated with a
  warning since the rename at commit 78043d44). The client tries `/model_info` first and falls
  back to `/get_model_info` on 404, remembering which one answered.
* `weight_version` is in the model-info answer on versions that have it; older ones expose it
  only through `/get_weight_version`, and the oldest have none (→ `None`).
* `/update_weights_from_disk` answers `num_paused_requests` only on newer versions (→ 0),
  one per data-parallel rank with `--dp-size` > 1 (→ their sum).
* `/pause_generation` takes `{"mode": ...}` on newer versions and no body on older ones (which
  ignore it and abort every request: SGLang 0.5.3, `http_server.py:1020-1027`,
  `tokenizer_manager.py:1047-1050`); `/abort_request` gained `abort_all` later (older versions
  take only `rid`).
* SGLang 0.5.3 has only the older names `/get_model_info` and `/get_server_info`, and no
  `meta_info.weight_versions` (`tokenizer_manager.py:1322-1347`).
* `/generate` results carry `output_ids` on current versions; when absent, the token ids are
  read from `meta_info.output_token_logprobs` (`[logprob, token_id, text]` triples). A result
  with a log-prob that is not finite (NaN, ±Infinity) or not a log-probability (above
  `LOGPROB_CEILING`, below `LOGPROB_FLOOR`) is malformed (`ValueError`).

Every failure raises an `EngineError` subclass that names the endpoint and carries the status
code and the server's response text. The client holds no engine state: the rollout machine does.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import httpx

from ehp_fsm.engine_command import api_key_headers
from ehp_fsm.rollout.errors import EngineRequestFailed, EngineUnreachable, WeightUpdateFailed

PAUSE_MODES = ("abort", "retract", "in_place")

#: How long an idle connection to an engine is kept for the next call: below the engine's own
#: keep-alive (uvicorn's 5 s, which SGLang's server and the embedded engine keep). At 5 s on
#: both sides, a call that reused a connection idle for 5 s could reach the engine as it
#: closed it ("Server disconnected without sending a response"), and the call failed as if
#: the engine were unreachable.
KEEPALIVE_S: Final = 2.0


#: The behaviour log-probs an answer may carry; outside them the answer is malformed and its
#: group is requeued. They are π_old in the objective's ratio exp(logp − π_old).
#:
#: Ceiling: a log-probability is ≤ 0. An fp32 log-softmax x − logsumexp(x) is ≤ 0 exactly
#: (the sum holds exp(0) = 1), but an engine may take the logsumexp elsewhere (reduced across
#: tensor-parallel vocabulary shards, a fused kernel), off by a few ulp of its magnitude:
#: ~4e-6 at 30, 1e-4 at 1000. 1e-3 covers that for any logit scale a model has, and what it
#: lets through moves the ratio by at most 0.1%, far inside the clip band (the default clip_low
#: is 0.2); above it the value is not a log-prob (a probability, a logit, a negated
#: log-prob) and the ratio taken against it is meaningless.
LOGPROB_CEILING: Final = 1e-3
#: Floor: a log-softmax is (x_i − max x) − ln Σ exp(x − max x) ≥ −(logit spread) − ln V, and
#: ln V < 21 for a vocabulary of up to 10⁹ tokens; a real model's logit spread is tens to a
#: few hundred (soft-capped models at most twice their cap). A token the engine sampled is
#: tighter still when it reports the distribution it drew from: the token's probability is
#: exp(logprob), and an fp32 exp is 0 below −104. −1e4 is two orders of magnitude past any of
#: these; below it sit mask values (−1e4 − lse, −1e9, −1e30, −FLT_MAX), not probabilities, and
#: the ratio exp(logp + 1e4) overflows any float (fp64 at 709): under a negative advantage an
#: infinite loss and NaN gradients for the whole step.
LOGPROB_FLOOR: Final = -1e4


def logprob_problem(logprobs: Sequence[float]) -> str | None:
    """Why `logprobs` cannot be an engine's behaviour log-probs, or None."""
    if not logprobs or (
        all(map(math.isfinite, logprobs))  # C-speed: a whole answer's tokens, every group
        and min(logprobs) >= LOGPROB_FLOOR
        and max(logprobs) <= LOGPROB_CEILING
    ):
        return None
    for i, lp in enumerate(logprobs):
        if not math.isfinite(lp):
            return f"output_token_logprobs[{i}] is {lp}: a log-prob that is not finite"
        if not LOGPROB_FLOOR <= lp <= LOGPROB_CEILING:
            return (
                f"output_token_logprobs[{i}] is {lp:g}, outside "
                f"{LOGPROB_FLOOR:g}..{LOGPROB_CEILING:g}: not a log-probability"
            )
    return None


@dataclass(frozen=True)
class VersionSpan:
    """Output tokens `[start, end)` were generated under weight `version` (SGLang's
    `meta_info.weight_versions` entry)."""

    version: str
    start: int
    end: int


@dataclass(frozen=True, kw_only=True)
class GenerateResult:
    rid: str | None
    text: str
    output_ids: tuple[int, ...]
    output_logprobs: tuple[float, ...] | None
    finish_reason: dict[str, Any] | None
    weight_version: str | None
    #: which weights generated which output tokens; versions without per-token spans report
    #: one span of `weight_version` over the whole output (None without a weight version)
    weight_versions: tuple[VersionSpan, ...] | None = None
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @property
    def aborted(self) -> bool:
        return self.finish_reason is not None and self.finish_reason.get("type") == "abort"

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GenerateResult:
        meta = data.get("meta_info") or {}
        triples = meta.get("output_token_logprobs")
        ids = data.get("output_ids")
        if ids is None and triples is not None:
            ids = [int(t[1]) for t in triples]
        logprobs = None if triples is None else tuple(float(t[0]) for t in triples)
        version = meta.get("weight_version")
        output_ids = tuple(int(i) for i in (ids or ()))
        # the behaviour log-probs the objective's ratio is taken against: a NaN one, one above
        # 0 or one of -1e30 was accepted, and its group trained on
        if logprobs is not None and (problem := logprob_problem(logprobs)) is not None:
            raise ValueError(problem)
        spans: tuple[VersionSpan, ...] | None = None
        if meta.get("weight_versions") is not None:
            spans = tuple(
                VersionSpan(str(s["version"]), int(s["start"]), int(s["end"]))
                for s in meta["weight_versions"]
            )
        elif version is not None:
            spans = (VersionSpan(str(version), 0, len(output_ids)),)
        return cls(
            rid=meta.get("id"),
            text=str(data.get("text", "")),
            output_ids=output_ids,
            output_logprobs=logprobs,
            finish_reason=meta.get("finish_reason"),
            weight_version=None if version is None else str(version),
            weight_versions=spans,
            raw=data,
        )


@dataclass(frozen=True, kw_only=True)
class ModelInfo:
    model_path: str | None
    weight_version: str | None
    is_generation: bool | None
    raw: dict[str, Any] = field(repr=False, compare=False)

    @property
    def status(self) -> str | None:
        """Embedded engine only: serving | empty | failed | released | updating."""
        value = self.raw.get("status")
        return None if value is None else str(value)

    @property
    def message(self) -> str | None:
        value = self.raw.get("message")
        return None if value is None else str(value)


@dataclass(frozen=True, kw_only=True)
class UpdateResult:
    success: bool
    message: str
    num_paused_requests: int


#: The largest answer the client reads (a `/generate` of many long samples with log-probs is
#: tens of MB); past it the engine is treated as unreachable.
MAX_ANSWER_BYTES = 1 << 30


class SGLangClient:
    """HTTP client for one engine at `base_url` (e.g. `http://127.0.0.1:30000`).

    `timeout_s` bounds every control call; `generate_timeout_s` bounds `/generate` (it waits
    for the whole generation); `update_timeout_s` bounds `/update_weights_from_disk`. Each bounds
    the whole call: an answer still arriving at it fails the call (`EngineUnreachable`).
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 10.0,
        generate_timeout_s: float = 120.0,
        update_timeout_s: float = 300.0,
        transport: httpx.BaseTransport | None = None,
        api_key: str | None = None,
    ) -> None:
        if timeout_s <= 0 or generate_timeout_s <= 0 or update_timeout_s <= 0:
            raise ValueError("every timeout must be > 0 seconds; a call without one can hang")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.generate_timeout_s = generate_timeout_s
        self.update_timeout_s = update_timeout_s
        # SGLang's `--api-key`: every request but the health probes must carry it
        self._http = httpx.Client(
            base_url=self.base_url,
            timeout=timeout_s,
            transport=transport,
            headers=api_key_headers(api_key),
            limits=httpx.Limits(
                max_connections=100, max_keepalive_connections=20, keepalive_expiry=KEEPALIVE_S
            ),
        )
        self._model_info_path: str | None = None

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SGLangClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transport -------------------------------------------------------------------------
    def _call(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        timeout_s: float | None = None,
        ok: Sequence[int] = (200,),
    ) -> httpx.Response:
        timeout = timeout_s if timeout_s else self.timeout_s
        deadline = time.monotonic() + timeout
        try:
            # httpx's timeout bounds each wait for a byte, not the call: an answer sent a byte
            # at a time held the call (and a dispatcher thread) for as long as it went on
            with self._http.stream(method, path, json=json, timeout=timeout) as streamed:
                body = bytearray()
                for chunk in streamed.iter_bytes():  # decoded: a compressed bomb is cut too
                    body += chunk
                    if time.monotonic() > deadline:
                        raise EngineUnreachable(
                            self.base_url,
                            path,
                            f"no whole answer within the timeout ({timeout} s)",
                            timed_out=True,
                        )
                    if len(body) > MAX_ANSWER_BYTES:
                        raise EngineUnreachable(
                            self.base_url, path, f"its answer passed {MAX_ANSWER_BYTES} bytes"
                        )
        except httpx.TimeoutException as exc:
            raise EngineUnreachable(
                self.base_url,
                path,
                f"no answer within the timeout ({timeout} s, {type(exc).__name__})",
                timed_out=True,
            ) from exc
        except httpx.TransportError as exc:
            raise EngineUnreachable(self.base_url, path, f"{type(exc).__name__}: {exc}") from exc
        headers = [(k, v) for k, v in streamed.headers.items() if k != "content-encoding"]
        resp = httpx.Response(
            streamed.status_code, headers=headers, content=bytes(body), request=streamed.request
        )
        if resp.status_code not in ok:
            raise EngineRequestFailed(self.base_url, path, resp.status_code, resp.text)
        return resp

    # -- generation ------------------------------------------------------------------------
    def generate(
        self,
        *,
        input_ids: Sequence[int] | None = None,
        text: str | None = None,
        sampling_params: dict[str, Any] | None = None,
        return_logprob: bool = True,
        rid: str | None = None,
        timeout_s: float | None = None,
    ) -> GenerateResult:
        """One prompt (token ids or text) → one result (`generate_batch` takes `n` > 1)."""
        if int((sampling_params or {}).get("n") or 1) != 1:
            raise ValueError("sampling_params n > 1 answers a list: use generate_batch")
        body = self._generate_body(input_ids, text, sampling_params, return_logprob, rid)
        data = self._call(
            "POST", "/generate", json=body, timeout_s=timeout_s or self.generate_timeout_s
        ).json()
        return GenerateResult.from_json(data)

    def generate_batch(
        self,
        *,
        input_ids: Sequence[Sequence[int]],
        sampling_params: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
        return_logprob: bool = True,
        rids: Sequence[str] | None = None,
        timeout_s: float | None = None,
    ) -> list[GenerateResult]:
        """Several prompts in one `/generate` call (SGLang's batch input). With
        `sampling_params` `n` > 1 each prompt gives n results, prompt-major."""
        body: dict[str, Any] = {
            "input_ids": [list(x) for x in input_ids],
            "return_logprob": return_logprob,
        }
        if sampling_params is not None:
            body["sampling_params"] = (
                sampling_params if isinstance(sampling_params, dict) else list(sampling_params)
            )
        if rids is not None:
            body["rid"] = list(rids)
        data = self._call(
            "POST", "/generate", json=body, timeout_s=timeout_s or self.generate_timeout_s
        ).json()
        return [GenerateResult.from_json(d) for d in data]

    @staticmethod
    def _generate_body(
        input_ids: Sequence[int] | None,
        text: str | None,
        sampling_params: dict[str, Any] | None,
        return_logprob: bool,
        rid: str | None,
    ) -> dict[str, Any]:
        if (input_ids is None) == (text is None):
            raise ValueError("pass exactly one of input_ids and text")
        body: dict[str, Any] = {"return_logprob": return_logprob}
        if input_ids is not None:
            body["input_ids"] = list(input_ids)
        else:
            body["text"] = text
        if sampling_params is not None:
            body["sampling_params"] = dict(sampling_params)
        if rid is not None:
            body["rid"] = rid
        return body

    # -- health and info -------------------------------------------------------------------
    def health(self, *, timeout_s: float | None = None) -> bool:
        """True on 200, False on 503 (up but not serving); raises if unreachable. `timeout_s`
        (default `timeout_s` of the client): a liveness probe bounds it short."""
        return self._call("GET", "/health", ok=(200, 503), timeout_s=timeout_s).status_code == 200

    def health_generate(self, *, timeout_s: float = 30.0) -> bool:
        return (
            self._call("GET", "/health_generate", ok=(200, 503), timeout_s=timeout_s).status_code
            == 200
        )

    def model_info(self, *, timeout_s: float | None = None) -> ModelInfo:
        """`timeout_s` bounds each of its calls (default `timeout_s` of the client)."""
        data = self._model_info_json(timeout_s)
        version = data.get("weight_version") if "weight_version" in data else None
        if "weight_version" not in data:
            version = self._weight_version_endpoint(timeout_s)
        return ModelInfo(
            model_path=data.get("model_path"),
            weight_version=None if version is None else str(version),
            is_generation=data.get("is_generation"),
            raw=data,
        )

    def _model_info_json(self, timeout_s: float | None = None) -> dict[str, Any]:
        paths = [self._model_info_path] if self._model_info_path else []
        paths += [p for p in ("/model_info", "/get_model_info") if p not in paths]
        for path in paths:
            resp = self._call("GET", path, ok=(200, 404), timeout_s=timeout_s)
            if resp.status_code == 200:
                self._model_info_path = path
                data = resp.json()
                return data if isinstance(data, dict) else {}
        raise EngineRequestFailed(self.base_url, "/model_info", 404, "neither name exists")

    def server_info(self) -> dict[str, Any]:
        """The engine's launch arguments and state: `/server_info`, or `/get_server_info` on
        versions before the rename (slime's client tries the two in the same order)."""
        for path in ("/server_info", "/get_server_info"):
            resp = self._call("GET", path, ok=(200, 404))
            if resp.status_code == 200:
                data = resp.json()
                return data if isinstance(data, dict) else {}
        raise EngineRequestFailed(self.base_url, "/server_info", 404, "neither name exists")

    def get_load(self) -> list[dict[str, Any]]:
        """SGLang's `/get_load`: one entry per data-parallel rank (`num_reqs`,
        `num_waiting_reqs`, `num_tokens`)."""
        data = self._call("GET", "/get_load").json()
        return [dict(d) for d in (data if isinstance(data, list) else [data])]

    def _weight_version_endpoint(self, timeout_s: float | None = None) -> str | None:
        resp = self._call("GET", "/get_weight_version", ok=(200, 404), timeout_s=timeout_s)
        if resp.status_code == 404:
            return None
        value = resp.json().get("weight_version")
        return None if value is None else str(value)

    def weight_version(self, *, timeout_s: float | None = None) -> str | None:
        return self.model_info(timeout_s=timeout_s).weight_version

    # -- weights and memory ----------------------------------------------------------------
    def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
        timeout_s: float | None = None,
    ) -> UpdateResult:
        """Install weights from `model_path`; raises `WeightUpdateFailed` on success=false."""
        body: dict[str, Any] = {
            "model_path": model_path,
            "abort_all_requests": abort_all_requests,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        resp = self._call(
            "POST",
            "/update_weights_from_disk",
            json=body,
            timeout_s=timeout_s or self.update_timeout_s,
            ok=(200, 400),
        )
        try:
            data = resp.json()
        except ValueError:
            data = {"success": False, "message": resp.text}
        if not isinstance(data, dict) or "success" not in data:
            raise EngineRequestFailed(
                self.base_url, "/update_weights_from_disk", resp.status_code, resp.text
            )
        result = UpdateResult(
            success=bool(data["success"]),
            message=str(data.get("message", "")),
            num_paused_requests=_paused_count(data.get("num_paused_requests")),
        )
        if not result.success:
            raise WeightUpdateFailed(
                self.base_url,
                model_path,
                result.message,
                resp.status_code,
                result.num_paused_requests,
            )
        return result

    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        self._call("POST", "/release_memory_occupation", json={"tags": _tags(tags)})

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        self._call("POST", "/resume_memory_occupation", json={"tags": _tags(tags)})

    # -- request control -------------------------------------------------------------------
    def pause_generation(self, mode: str = "abort") -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._call("POST", "/pause_generation", json={"mode": mode})

    def continue_generation(self) -> None:
        self._call("POST", "/continue_generation", json={})

    def abort_request(self, rid: str = "", *, abort_all: bool = False) -> None:
        if not rid and not abort_all:
            raise ValueError("pass a rid, or abort_all=True")
        self._call("POST", "/abort_request", json={"rid": rid, "abort_all": abort_all})

    def flush_cache(self) -> bool:
        """True if flushed; False if the engine refused because requests are in flight."""
        return self._call("POST", "/flush_cache", ok=(200, 400)).status_code == 200


def _paused_count(value: Any) -> int:
    """`num_paused_requests` of an update's answer: a count, or one count per data-parallel
    rank — SGLang 0.5.3 answers a list when `--dp-size` > 1 (`tokenizer_manager.py`
    `_wait_for_model_update_from_disk`), and `int()` of it failed a successful install."""
    if isinstance(value, list):
        return sum(int(v or 0) for v in value)
    return int(value or 0)


def _tags(tags: Sequence[str] | None) -> list[str] | None:
    return None if tags is None else list(tags)
