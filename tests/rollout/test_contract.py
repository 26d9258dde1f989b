"""Contract suite for the SGLang client against an engine over real HTTP.

In CI the engine is the embedded one (a real `python -m ehp_fsm.rollout.server` process). With
`EHP_SGLANG_URL` (and `EHP_SGLANG_MODEL_PATH`) set, the same tests drive a real SGLang server —
`benchmarks/gpu/sglang_contract.sh` does that. Tests that check behaviour only the embedded
engine promises say so and are skipped against SGLang.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from ehp_fsm.rollout import (
    EngineRequestFailed,
    EngineUnreachable,
    GenerateResult,
    SGLangClient,
    WeightUpdateFailed,
    free_port,
)

from .conftest import Target

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

PROMPT = [1, 4, 5, 13, 6]  # BOS "12+3" on the embedded vocabulary; plain small ids elsewhere
GREEDY = {"max_new_tokens": 8, "temperature": 0.0}


@pytest.fixture(autouse=True)
def _leave_engine_serving(target: Target, client: SGLangClient) -> Iterator[None]:
    """Each test starts from, and restores, a serving engine with the first install path."""
    yield
    client.continue_generation()
    if not client.health():
        client.update_weights_from_disk(target.install_path, weight_version="restored")


def _in_background(client: SGLangClient, **kwargs: object) -> Future[GenerateResult]:
    pool = ThreadPoolExecutor(max_workers=1)
    fut = pool.submit(client.generate, **kwargs)  # type: ignore[arg-type]
    pool.shutdown(wait=False)
    return fut


def _wait_in_flight(client: SGLangClient, target: Target) -> None:
    """Give a background request time to be admitted (the embedded engine reports it)."""
    import time

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if target.kind != "embedded":
            time.sleep(1.0)
            return
        if client.model_info().raw.get("num_running_reqs"):
            return
        time.sleep(0.02)
    pytest.fail("the background request never became in flight")


def test_health_and_model_info(client: SGLangClient) -> None:
    assert client.health()
    info = client.model_info()
    assert info.is_generation is True
    assert "weight_version" in info.raw
    assert client.weight_version() == info.weight_version


def test_both_model_info_names_answer(target: Target) -> None:
    import httpx

    for path in ("/model_info", "/get_model_info"):
        r = httpx.get(target.url + path, timeout=10)
        assert r.status_code == 200, path
        assert "weight_version" in r.json()


def test_generate_returns_ids_logprobs_and_version(client: SGLangClient) -> None:
    rid = f"contract-{uuid.uuid4().hex}"
    r = client.generate(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True, rid=rid)
    assert r.rid == rid
    assert 1 <= len(r.output_ids) <= 8
    assert r.output_logprobs is not None
    assert len(r.output_logprobs) == len(r.output_ids)
    assert all(lp <= 0.0 for lp in r.output_logprobs)
    assert r.finish_reason is not None
    assert r.finish_reason["type"] in ("length", "stop")
    assert r.weight_version == client.model_info().weight_version


def test_greedy_generation_is_deterministic(client: SGLangClient) -> None:
    a = client.generate(input_ids=PROMPT, sampling_params=GREEDY)
    b = client.generate(input_ids=PROMPT, sampling_params=GREEDY)
    assert a.output_ids == b.output_ids


def test_batch_input(client: SGLangClient) -> None:
    rids = [f"b-{uuid.uuid4().hex}", f"b-{uuid.uuid4().hex}"]
    out = client.generate_batch(input_ids=[PROMPT, PROMPT[:3]], sampling_params=GREEDY, rids=rids)
    assert [r.rid for r in out] == rids
    assert all(r.output_ids for r in out)


def test_concurrent_requests_all_complete(client: SGLangClient) -> None:
    params = {"max_new_tokens": 6, "temperature": 1.0}
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(
            pool.map(lambda _: client.generate(input_ids=PROMPT, sampling_params=params), range(16))
        )
    assert len({r.rid for r in results}) == 16
    assert all(r.finish_reason and r.finish_reason["type"] != "abort" for r in results)


def test_update_weights_sets_weight_version(client: SGLangClient, target: Target) -> None:
    res = client.update_weights_from_disk(target.other_install_path, weight_version="contract-7")
    assert res.success
    assert res.num_paused_requests == 0
    assert client.model_info().weight_version == "contract-7"
    assert client.generate(input_ids=PROMPT, sampling_params=GREEDY).weight_version == "contract-7"
    client.update_weights_from_disk(target.install_path, weight_version="contract-8")
    assert client.weight_version() == "contract-8"


def test_failed_update_raises_with_the_servers_message(
    client: SGLangClient, target: Target
) -> None:
    bad = f"/nonexistent/ehp-{uuid.uuid4().hex}"
    with pytest.raises(WeightUpdateFailed) as info:
        client.update_weights_from_disk(bad, weight_version="never")
    assert info.value.status_code == 400
    assert info.value.response_text  # the engine's own words travel with the error
    assert bad in str(info.value) or "nonexistent" in info.value.response_text
    assert client.weight_version() != "never"
    client.update_weights_from_disk(target.install_path, weight_version="after-failure")
    assert client.health()
    assert client.generate(input_ids=PROMPT, sampling_params=GREEDY).weight_version == (
        "after-failure"
    )


def test_abort_request_by_rid(client: SGLangClient, target: Target) -> None:
    rid = f"abort-me-{uuid.uuid4().hex}"
    fut = _in_background(client, input_ids=PROMPT, sampling_params=target.long_params, rid=rid)
    _wait_in_flight(client, target)
    client.abort_request(rid)
    result = fut.result(timeout=60)
    assert result.aborted, result.finish_reason
    assert client.health()


def test_pause_abort_then_continue(client: SGLangClient, target: Target) -> None:
    fut = _in_background(client, input_ids=PROMPT, sampling_params=target.long_params)
    _wait_in_flight(client, target)
    client.pause_generation("abort")
    assert fut.result(timeout=60).aborted
    client.continue_generation()
    assert client.generate(input_ids=PROMPT, sampling_params=GREEDY).output_ids


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_keeps_requests_until_continue(
    client: SGLangClient, target: Target, mode: str
) -> None:
    fut = _in_background(client, input_ids=PROMPT, sampling_params=target.long_params)
    _wait_in_flight(client, target)
    client.pause_generation(mode)
    threading.Event().wait(0.5)
    assert not fut.done(), "a paused request must neither finish nor be aborted"
    client.continue_generation()
    result = fut.result(timeout=120)
    assert not result.aborted
    assert result.finish_reason == {"type": "length", "length": len(result.output_ids)}


def test_update_while_paused_in_place_reports_paused_requests(
    client: SGLangClient, target: Target
) -> None:
    if target.kind != "embedded":
        pytest.skip("num_paused_requests accounting is checked on the embedded engine only")
    fut = _in_background(client, input_ids=PROMPT, sampling_params=target.long_params)
    _wait_in_flight(client, target)
    client.pause_generation("in_place")
    res = client.update_weights_from_disk(target.other_install_path, weight_version="mid-flight")
    assert res.num_paused_requests == 1
    client.continue_generation()
    assert fut.result(timeout=60).weight_version == "mid-flight"


def test_release_and_resume_require_reinstall(client: SGLangClient, target: Target) -> None:
    client.release_memory_occupation()
    # SGLang skips its health probe while memory is released: the server is healthy (200)
    assert client.health()
    assert client.health_generate()
    if target.kind == "embedded":
        assert client.model_info().status == "released"
        with pytest.raises(EngineRequestFailed, match="released") as info:
            client.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert info.value.status_code == 503
    client.resume_memory_occupation()
    if target.kind == "embedded":
        with pytest.raises(EngineRequestFailed, match="must be installed again"):
            client.generate(input_ids=PROMPT, sampling_params=GREEDY)
    client.update_weights_from_disk(target.install_path, weight_version="reinstalled")
    assert client.health()
    r = client.generate(input_ids=PROMPT, sampling_params=GREEDY)
    assert r.weight_version == "reinstalled"


def test_flush_cache_when_idle(client: SGLangClient) -> None:
    assert client.flush_cache()


def test_bad_request_carries_the_response_text(client: SGLangClient) -> None:
    with pytest.raises(EngineRequestFailed) as info:
        client.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 4, "top_p": 7.0})
    assert info.value.status_code == 400
    assert "top_p" in info.value.response_text


def test_generate_timeout_is_reported(client: SGLangClient, target: Target) -> None:
    rid = f"slow-{uuid.uuid4().hex}"
    with pytest.raises(EngineUnreachable, match="timeout"):
        client.generate(
            input_ids=PROMPT, sampling_params=target.long_params, rid=rid, timeout_s=0.2
        )
    client.abort_request(rid)


def test_unreachable_engine_is_reported() -> None:
    c = SGLangClient(f"http://127.0.0.1:{free_port()}", timeout_s=2.0)
    with c, pytest.raises(EngineUnreachable, match="ConnectError"):
        c.health()


def test_weight_versions_span_the_output(client: SGLangClient, target: Target) -> None:
    client.update_weights_from_disk(target.install_path, weight_version="span-1")
    r = client.generate(input_ids=PROMPT, sampling_params=GREEDY)
    assert "weight_versions" in r.raw["meta_info"] or target.kind != "embedded"
    assert r.weight_versions is not None
    assert [(s.version, s.start, s.end) for s in r.weight_versions] == [
        ("span-1", 0, len(r.output_ids))
    ]


def test_an_install_mid_request_splits_its_weight_versions(
    client: SGLangClient, target: Target
) -> None:
    if target.kind != "embedded":
        pytest.skip("per-token spans across an install need a paused in-place request")
    client.update_weights_from_disk(target.install_path, weight_version="before")
    fut = _in_background(client, input_ids=PROMPT, sampling_params=target.long_params)
    _wait_in_flight(client, target)
    import time

    deadline = time.monotonic() + 10
    while client.get_load()[0]["num_tokens"] < len(PROMPT) + 2:  # ≥ 2 tokens under "before"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    client.pause_generation("in_place")
    client.update_weights_from_disk(target.other_install_path, weight_version="after")
    client.continue_generation()
    r = fut.result(timeout=60)
    spans = [(s.version, s.start, s.end) for s in r.weight_versions or ()]
    assert [v for v, _, _ in spans] == ["before", "after"], spans
    assert spans[0][1] == 0 and spans[0][2] == spans[1][1] >= 2 and spans[1][2] == len(r.output_ids)
    assert r.weight_version == "after"  # SGLang's: the last span's


def test_n_samples_per_prompt(client: SGLangClient, target: Target) -> None:
    params = {"max_new_tokens": 5, "temperature": 1.0, "n": 3, "sampling_seed": 11}
    out = client.generate_batch(input_ids=[PROMPT, PROMPT[:3]], sampling_params=params)
    assert len(out) == 6  # prompt-major: 3 of the first prompt, then 3 of the second
    assert len({r.rid for r in out}) == 6
    assert all(r.output_ids and not r.aborted for r in out)
    if target.kind == "embedded":
        # sample j of n draws with seed + j: the same as a single request with that seed
        for j in range(3):
            one = client.generate(
                input_ids=PROMPT, sampling_params={**params, "n": 1, "sampling_seed": 11 + j}
            )
            assert out[j].output_ids == one.output_ids
        assert len({r.output_ids for r in out[:3]}) > 1 or len(out[0].output_ids) == 0


def test_n_samples_are_named_from_the_rids(client: SGLangClient, target: Target) -> None:
    if target.kind != "embedded":
        pytest.skip("SGLang gives parallel samples fresh rids")
    params = {"max_new_tokens": 2, "n": 2}
    per_prompt = client.generate_batch(
        input_ids=[PROMPT, PROMPT], sampling_params=params, rids=["a", "b"]
    )
    assert [r.rid for r in per_prompt] == ["a_0", "a_1", "b_0", "b_1"]
    import httpx

    body = {"input_ids": [PROMPT, PROMPT], "sampling_params": params, "rid": "one"}
    answer = httpx.post(target.url + "/generate", json=body, timeout=60).json()
    assert [a["meta_info"]["id"] for a in answer] == ["one_0", "one_1", "one_2", "one_3"]


def test_n_must_be_one_count_for_the_batch(client: SGLangClient) -> None:
    with pytest.raises(EngineRequestFailed) as info:
        client.generate_batch(
            input_ids=[PROMPT, PROMPT],
            sampling_params=[{"max_new_tokens": 2, "n": 2}, {"max_new_tokens": 2, "n": 3}],
        )
    assert info.value.status_code == 400
    with pytest.raises(ValueError, match="generate_batch"):
        client.generate(input_ids=PROMPT, sampling_params={"n": 2})


def test_server_info_and_load(client: SGLangClient, target: Target) -> None:
    info = client.server_info()
    assert info["tp_size"] >= 1
    assert "version" in info and "internal_states" in info
    load = client.get_load()
    assert load and {"num_reqs", "num_waiting_reqs", "num_tokens"} <= set(load[0])
    if target.kind == "embedded":
        assert load[0]["num_reqs"] == 0
        fut = _in_background(client, input_ids=PROMPT, sampling_params=target.long_params)
        _wait_in_flight(client, target)
        busy = client.get_load()[0]
        assert busy["num_reqs"] == 1 and busy["num_tokens"] >= len(PROMPT)
        client.abort_request(abort_all=True)
        assert fut.result(timeout=60).aborted


def test_both_server_info_names_answer(target: Target) -> None:
    import httpx

    for path in ("/server_info", "/get_server_info"):
        r = httpx.get(target.url + path, timeout=10)
        assert r.status_code == 200 or (target.kind == "sglang" and path == "/server_info")


def test_input_logprobs_start_at_the_last_prompt_token(target: Target) -> None:
    """SGLang's `logprob_start_len` defaults to -1: input log-probs from the last prompt token
    on (one entry; none in later releases). The embedded engine gave one per prompt token, in
    every one of n samples: a 6 kB request (2000 prompt tokens, n = 500) answered 14 MB."""
    import httpx

    body = {
        "input_ids": PROMPT * 8,
        "return_logprob": True,
        "sampling_params": {"n": 4, "max_new_tokens": 1},
    }
    r = httpx.post(target.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    for answer in r.json():
        entries = answer["meta_info"]["input_token_logprobs"]
        assert len(entries) <= 1, entries
        assert all(e[1] == PROMPT[-1] for e in entries), entries
        assert len(answer["meta_info"]["output_token_logprobs"]) == len(answer["output_ids"])
