"""The SGLang client against SGLang 0.5.3's own answers, quoted from its source.

SGLang cannot run here, so its answers are recorded: a small HTTP server on a real socket (the
far edge — it stands in for SGLang and says so) answers each route with the shape SGLang 0.5.3
gives it, quoted from the `sglang==0.5.3` wheel (files under `sglang/srt/`, lines of that
release). The client is the real one, over real HTTP.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from ehp_fsm.rollout import SGLangClient, WeightUpdateFailed

KEY = "k" * 32

#: (status, JSON body or raw text) per "METHOD /path"; a path not here answers FastAPI's 404
#: `{"detail": "Not Found"}`, as SGLang 0.5.3 does for a route it lacks.
Answers = dict[str, tuple[int, Any]]


class _Recorded(BaseHTTPRequestHandler):
    answers: Answers
    seen: list[tuple[str, str, dict[str, Any] | None, str | None]]

    def _answer(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        self.seen.append((method, self.path, body, self.headers.get("Authorization")))
        # SGLang's `--api-key` middleware (`utils/common.py:1052-1063`): every path but
        # /health*, /metrics and OPTIONS needs the bearer key, else 401 {"error": "Unauthorized"}
        if not self.path.startswith("/health") and self.headers.get("Authorization") != (
            f"Bearer {KEY}"
        ):
            status, content = 401, {"error": "Unauthorized"}
        else:
            status, content = self.answers.get(
                f"{method} {self.path}", (404, {"detail": "Not Found"})
            )
        data = content.encode() if isinstance(content, str) else json.dumps(content).encode()
        self.send_response(status)
        kind = "text/plain" if isinstance(content, str) else "application/json"
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._answer("GET")

    def do_POST(self) -> None:
        self._answer("POST")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def sglang() -> Iterator[tuple[str, Answers, list[tuple[str, str, Any, str | None]]]]:
    """A stand-in for SGLang 0.5.3: its URL, the answers to set, the requests it saw."""
    answers: Answers = {}
    seen: list[tuple[str, str, Any, str | None]] = []
    handler = type("Handler", (_Recorded,), {"answers": answers, "seen": seen})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", answers, seen
    srv.shutdown()
    srv.server_close()
    thread.join(timeout=5)


def test_an_install_on_a_data_parallel_engine_is_read_as_the_success_it_is(sglang: Any) -> None:
    """With `--dp-size` > 1, SGLang 0.5.3 answers one `num_paused_requests` per rank:
    `tokenizer_manager.py:1093-1105` (`all_paused_requests = [r.num_paused_requests for r in
    result]`, messages joined with " | "), passed as is by `http_server.py:697-705`. The client
    took `int()` of the list: TypeError on a successful install, which the publisher counts as
    a failed one (and retries until it fails the engine)."""
    url, answers, _ = sglang
    answers["POST /update_weights_from_disk"] = (
        200,
        {
            "success": True,
            "message": "Succeeded to update model weights. | Succeeded to update model weights."
            " Weight version updated to 7.",
            "num_paused_requests": [2, 1],
        },
    )
    with SGLangClient(url, api_key=KEY) as client:
        result = client.update_weights_from_disk("/revisions/7", weight_version="7")
    assert result.success
    assert result.num_paused_requests == 3


def test_a_failed_install_on_a_data_parallel_engine_raises_the_update_failure(
    sglang: Any,
) -> None:
    """The same list on a failed install (`http_server.py:706-710`: 400) is a
    `WeightUpdateFailed` carrying SGLang's message, not a TypeError."""
    url, answers, _ = sglang
    answers["POST /update_weights_from_disk"] = (
        400,
        {"success": False, "message": "no such file | no such file", "num_paused_requests": [0, 0]},
    )
    with SGLangClient(url, api_key=KEY) as client, pytest.raises(WeightUpdateFailed) as info:
        client.update_weights_from_disk("/revisions/8", weight_version="8")
    assert "no such file" in str(info.value)


def test_the_single_rank_install_answer_and_the_body_sglang_reads(sglang: Any) -> None:
    """dp 1: `num_paused_requests` an int (`io_struct.py:984-989`). The body names only fields
    `UpdateWeightFromDiskReqInput` has (`io_struct.py:966-981`: `model_path`,
    `abort_all_requests`, `weight_version`) besides `flush_cache`, which 0.5.3 drops unread — its
    scheduler flushes after every successful load anyway
    (`scheduler_update_weights_mixin.py:31-39`)."""
    url, answers, seen = sglang
    answers["POST /update_weights_from_disk"] = (
        200,
        {"success": True, "message": "ok", "num_paused_requests": 0},
    )
    with SGLangClient(url, api_key=KEY) as client:
        assert client.update_weights_from_disk("/r/2", weight_version="2").num_paused_requests == 0
    body = seen[-1][2]
    assert body["model_path"] == "/r/2" and body["weight_version"] == "2"
    assert body["abort_all_requests"] is False
    assert seen[-1][3] == f"Bearer {KEY}"


def test_model_info_and_server_info_fall_back_to_the_names_0_5_3_has(sglang: Any) -> None:
    """SGLang 0.5.3 has `/get_model_info` (`http_server.py:456-466`, with `weight_version`) and
    `/get_server_info` (`http_server.py:477-488`) only: no `/model_info`, no `/server_info`."""
    url, answers, _ = sglang
    answers["GET /get_model_info"] = (
        200,
        {
            "model_path": "/r/3",
            "tokenizer_path": "/r/3",
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "3",
        },
    )
    answers["GET /get_server_info"] = (200, {"tp_size": 2, "version": "0.5.3"})
    with SGLangClient(url, api_key=KEY) as client:
        assert client.weight_version() == "3"
        info = client.model_info()
        assert (info.model_path, info.is_generation) == ("/r/3", True)
        assert client.server_info()["version"] == "0.5.3"


def test_results_in_0_5_3_shapes(sglang: Any) -> None:
    """A batch `/generate` answers a list (`tokenizer_manager.py:1015-1016`); each result's
    `meta_info` is `tokenizer_manager.py:1322-1347` (`id`, `finish_reason`, `prompt_tokens`,
    `weight_version`, `completion_tokens`, `cached_tokens`), log-probs are `(logprob, id, None)`
    (`tokenizer_manager.py:1505-1513`), finish reasons `schedule_batch.py:138-182`. A request
    aborted before prefill has no `output_ids` nor log-probs (`tokenizer_manager.py:1652-1663`);
    one aborted by the scheduler carries only `id` and `finish_reason`
    (`tokenizer_manager.py:1645-1650`)."""
    url, answers, seen = sglang
    done = {
        "text": "12",
        "output_ids": [5, 6, 2],
        "meta_info": {
            "id": "g1.1.0",
            "finish_reason": {"type": "stop", "matched": 2},
            "prompt_tokens": 4,
            "weight_version": "5",
            "output_token_logprobs": [[-0.5, 5, None], [-0.25, 6, None], [-0.1, 2, None]],
            "input_token_logprobs": [],
            "completion_tokens": 3,
            "cached_tokens": 0,
            "e2e_latency": 0.1,
        },
    }
    before_prefill = {
        "text": "",
        "meta_info": {
            "id": "g1.1.1",
            "finish_reason": {"type": "abort", "message": "Abort before prefill"},
            "prompt_tokens": 0,
            "completion_tokens": 0,
        },
    }
    by_scheduler = {
        "meta_info": {
            "id": "g1.1.2",
            "finish_reason": {
                "type": "abort",
                "message": "Aborted",
                "status_code": None,
                "err_type": None,
            },
        }
    }
    answers["POST /generate"] = (200, [done, before_prefill, by_scheduler])
    params = {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 3}
    with SGLangClient(url, api_key=KEY) as client:
        out = client.generate_batch(
            input_ids=[[1, 2, 3, 4]] * 3,
            sampling_params=[params] * 3,
            rids=["g1.1.0", "g1.1.1", "g1.1.2"],
        )
    assert out[0].output_ids == (5, 6, 2) and out[0].output_logprobs == (-0.5, -0.25, -0.1)
    assert out[0].weight_version == "5" and not out[0].aborted
    assert [o.aborted for o in out[1:]] == [True, True]
    assert out[1].output_ids == () and out[2].output_ids == () and out[2].text == ""
    # the request: GenerateReqInput's fields (`io_struct.py:89-110`), one rid per prompt
    # (`io_struct.py:409-415`), SamplingParams' keys (`sampling/sampling_params.py:33-58`)
    body = seen[-1][2]
    assert body["rid"] == ["g1.1.0", "g1.1.1", "g1.1.2"] and body["return_logprob"] is True
    assert body["sampling_params"][0] == params


def test_control_answers_of_0_5_3(sglang: Any) -> None:
    """`/pause_generation` and `/continue_generation` answer `{"message", "status"}` and read no
    body (`http_server.py:1020-1037`); `/abort_request` an empty 200 (`http_server.py:966-973`);
    `/flush_cache` 400 with plain text while requests run (`http_server.py:590-598`); `/health`
    200 or 503 with no body and no key (`http_server.py:384-453`, `utils/common.py:1057`)."""
    url, answers, seen = sglang
    answers["POST /pause_generation"] = (
        200,
        {"message": "Generation paused successfully.", "status": "ok"},
    )
    answers["POST /continue_generation"] = (
        200,
        {"message": "Generation continued successfully.", "status": "ok"},
    )
    answers["POST /abort_request"] = (200, "")
    answers["POST /flush_cache"] = (400, "Cache flushed.\nPlease check backend logs ...\n")
    answers["GET /health"] = (503, "")
    with SGLangClient(url, api_key=KEY) as client:
        client.pause_generation("retract")
        client.continue_generation()
        client.abort_request("g1.1.0")
        assert client.flush_cache() is False
        assert client.health() is False
    assert seen[2][2] == {"rid": "g1.1.0", "abort_all": False}  # `io_struct.py:1162-1171`
    with SGLangClient(url) as keyless:
        assert keyless.health() is False  # /health is open
