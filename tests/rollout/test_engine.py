"""Behaviour only the embedded engine promises: exact reproducibility under concurrency and
retraction, install semantics (drain, pause, abort, failure), and memory release/resume.

Every test drives a real engine process over HTTP (one process for the module; each test
starts from revision 1 installed as weight version "1", nothing paused or in flight). The engine
runs with a 40 ms per-pass decode throttle (a stand-in for a slow device — the only faked edge)
so that tests can act while requests are in flight.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from ehp_fsm.rollout import (
    EngineHandle,
    EngineRequestFailed,
    GenerateResult,
    RevisionStore,
    SGLangClient,
    WeightUpdateFailed,
    launch_engine,
    stop_engine,
)

from .conftest import make_store

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

PROMPT = [1, 4, 5, 13, 6, 16]  # "12+3=" under the tiny model's tokenizer (BOS first)
LONG = {"max_new_tokens": 20, "ignore_eos": True, "temperature": 1.0}

Engine = tuple[EngineHandle, SGLangClient]


@pytest.fixture(scope="module")
def module_store(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> RevisionStore:
    return make_store(tmp_path_factory.mktemp("engine-revisions"), tiny_model)


@pytest.fixture(scope="module")
def module_engine(module_store: RevisionStore) -> Iterator[Engine]:
    handle = launch_engine(model_path=module_store.path(1), decode_delay_ms=40.0)
    try:
        with SGLangClient(handle.url) as c:
            yield handle, c
    finally:
        stop_engine(handle)


@pytest.fixture
def store(module_store: RevisionStore) -> RevisionStore:
    return module_store


@pytest.fixture
def fresh_engine(module_engine: Engine, module_store: RevisionStore) -> Engine:
    """The module's engine, reset to: revision 1 as version "1", not paused, idle."""
    _, c = module_engine
    c.continue_generation()
    c.abort_request(abort_all=True)
    c.resume_memory_occupation()
    c.update_weights_from_disk(str(module_store.path(1)), weight_version="1")
    return module_engine


def _bg(client: SGLangClient, **kw: object) -> Future[GenerateResult]:
    pool = ThreadPoolExecutor(max_workers=1)
    fut = pool.submit(client.generate, **kw)  # type: ignore[arg-type]
    pool.shutdown(wait=False)
    return fut


def _until_running(client: SGLangClient, n: int = 1) -> None:
    deadline = time.monotonic() + 5
    while client.model_info().raw["num_running_reqs"] < n:
        assert time.monotonic() < deadline, "request never started running"
        time.sleep(0.01)


def test_concurrent_results_equal_solo_results(fresh_engine: Engine) -> None:
    """16 concurrent seeded requests give exactly what each gives when run alone."""
    _, c = fresh_engine
    params = [
        {"max_new_tokens": 10, "temperature": 1.0, "top_p": 0.9, "sampling_seed": s}
        for s in range(16)
    ]
    with ThreadPoolExecutor(max_workers=16) as pool:
        together = list(pool.map(lambda p: c.generate(input_ids=PROMPT, sampling_params=p), params))
    alone = [c.generate(input_ids=PROMPT, sampling_params=p) for p in params[:4]]
    for a, t in zip(alone, together[:4], strict=False):
        assert a.output_ids == t.output_ids
        assert a.output_logprobs == t.output_logprobs
    assert len({r.output_ids for r in together}) > 1, "different seeds should differ"


def test_seed_alias_and_text_prompt(fresh_engine: Engine) -> None:
    _, c = fresh_engine
    a = c.generate(text="12+3=", sampling_params={"max_new_tokens": 6, "seed": 11})
    b = c.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 6, "sampling_seed": 11})
    assert a.output_ids == b.output_ids
    assert a.raw["meta_info"]["sampling_seed"] == 11
    assert a.raw["meta_info"]["prompt_tokens"] == len(PROMPT)  # the model's tokenizer, BOS first


def test_retracted_request_regenerates_identically(fresh_engine: Engine) -> None:
    _, c = fresh_engine
    params = {**LONG, "sampling_seed": 5}
    reference = c.generate(input_ids=PROMPT, sampling_params=params)
    fut = _bg(c, input_ids=PROMPT, sampling_params=params)
    _until_running(c)
    deadline = time.monotonic() + 10
    while c.get_load()[0]["num_tokens"] < len(PROMPT) + 2:  # a few tokens in (not a sleep:
        assert time.monotonic() < deadline  # on a loaded machine there were none yet)
        time.sleep(0.01)
    c.pause_generation("retract")
    time.sleep(0.2)
    c.continue_generation()
    result = fut.result(timeout=60)
    assert result.raw["meta_info"]["num_retractions"] == 1
    assert result.output_ids == reference.output_ids
    assert result.output_logprobs == reference.output_logprobs


def test_install_on_running_engine_waits_for_in_flight_requests(
    fresh_engine: Engine, store: RevisionStore
) -> None:
    _, c = fresh_engine
    fut = _bg(c, input_ids=PROMPT, sampling_params=LONG)
    _until_running(c)
    res = c.update_weights_from_disk(str(store.path(2)), weight_version="two")
    assert res.num_paused_requests == 0
    # The server answered the request before it installed; its answer may still be on its way
    # to this client's thread (a race under load: `fut.done()` was asserted here).
    done = fut.result(timeout=10)
    assert done.weight_version == "1"  # finished on the weights it started with
    assert len(done.output_ids) == LONG["max_new_tokens"]
    assert c.weight_version() == "two"


def test_install_with_abort_all_requests(fresh_engine: Engine, store: RevisionStore) -> None:
    _, c = fresh_engine
    fut = _bg(c, input_ids=PROMPT, sampling_params=LONG)
    _until_running(c)
    c.update_weights_from_disk(str(store.path(2)), abort_all_requests=True)
    assert fut.result(timeout=10).aborted
    assert c.weight_version() == "2"  # defaults to the revision number


def test_a_failed_install_leaves_the_installed_weights_serving(
    fresh_engine: Engine, store: RevisionStore, tmp_path: Path
) -> None:
    """As SGLang (which reloads the original weights after a failed load): an install that
    fails before it touches a weight leaves the engine serving what it had."""
    _, c = fresh_engine
    corrupt = tmp_path / "corrupt"
    shutil.copytree(store.path(2), corrupt)
    weights = corrupt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # e.g. a copy cut short
    with pytest.raises(WeightUpdateFailed, match="the manifest says"):
        c.update_weights_from_disk(str(corrupt), weight_version="bad")
    with pytest.raises(WeightUpdateFailed, match="is not a directory"):
        c.update_weights_from_disk("../../../../etc/passwd", weight_version="bad")
    assert c.health()
    info = c.model_info()
    assert info.status == "serving" and info.weight_version == "1"
    out = c.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 2})
    assert out.weight_version == "1"
    c.update_weights_from_disk(str(store.path(2)), weight_version="good")
    assert c.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 2}).weight_version == (
        "good"
    )


def test_a_failed_install_on_an_engine_without_weights_says_why_until_a_good_one(
    fresh_engine: Engine, store: RevisionStore, tmp_path: Path
) -> None:
    _, c = fresh_engine
    c.release_memory_occupation()
    c.resume_memory_occupation()  # no weights now: they must be installed again
    with pytest.raises(WeightUpdateFailed, match="does not exist"):
        c.update_weights_from_disk("/no/such/revision", weight_version="bad")
    assert not c.health()
    info = c.model_info()
    assert info.status == "failed" and info.weight_version is None
    assert info.message is not None and "does not exist" in info.message
    with pytest.raises(EngineRequestFailed, match="does not exist") as err:
        c.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 2})
    assert err.value.status_code == 503
    c.update_weights_from_disk(str(store.path(2)), weight_version="good")
    assert c.health()
    assert c.model_info().status == "serving"


def test_an_index_that_names_a_fifo_or_a_file_elsewhere_is_refused_at_once(
    fresh_engine: Engine, tiny_model: Path, tmp_path: Path
) -> None:
    """A plain model directory whose index names a FIFO: safetensors opened it holding the GIL,
    and the whole engine (its health answer too) froze until something wrote to it (here a
    writer after 20 s; nothing, in an attack). An index that names a file outside its
    directory loaded it. Both are now refused before a file is opened; the engine serves on."""
    _, c = fresh_engine
    model = shutil.copytree(tiny_model, tmp_path / "model")
    (model / "model.safetensors").unlink()
    os.mkfifo(model / "w.safetensors")
    index = model / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"x": "w.safetensors"}}))
    writer = subprocess.Popen(["sh", "-c", f"sleep 20; printf 12345678 > {model}/w.safetensors"])
    try:
        t0 = time.monotonic()
        with pytest.raises(WeightUpdateFailed, match="not a regular file"):
            c.update_weights_from_disk(str(model), weight_version="fifo")
        assert time.monotonic() - t0 < 10.0  # refused at once, not when the writer comes
        assert c.health()
    finally:
        writer.kill()
        writer.wait()
    elsewhere = {"x": str(tiny_model / "model.safetensors")}
    index.write_text(json.dumps({"metadata": {}, "weight_map": elsewhere}))
    with pytest.raises(WeightUpdateFailed, match="not a regular file"):
        c.update_weights_from_disk(str(model), weight_version="elsewhere")
    out = c.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 2})
    assert out.weight_version == "1"


def test_a_failed_install_keeps_paused_requests_for_the_installed_weights(
    fresh_engine: Engine,
) -> None:
    _, c = fresh_engine
    fut = _bg(c, input_ids=PROMPT, sampling_params=LONG)
    _until_running(c)
    c.pause_generation("in_place")
    with pytest.raises(WeightUpdateFailed, match="does not exist"):
        c.update_weights_from_disk("/no/such/revision")
    assert not fut.done()
    c.continue_generation()
    result = fut.result(timeout=30)
    assert not result.aborted and len(result.output_ids) == LONG["max_new_tokens"]
    assert result.weight_version == "1"


def test_release_requires_an_idle_engine(fresh_engine: Engine, store: RevisionStore) -> None:
    _, c = fresh_engine
    fut = _bg(c, input_ids=PROMPT, sampling_params=LONG)
    _until_running(c)
    with pytest.raises(EngineRequestFailed, match="idle engine") as err:
        c.release_memory_occupation()
    assert err.value.status_code == 400
    c.pause_generation("abort")
    assert fut.result(timeout=10).aborted
    c.release_memory_occupation(["weights"])
    with pytest.raises(WeightUpdateFailed, match="resume"):
        c.update_weights_from_disk(str(store.path(2)))
    c.resume_memory_occupation(["weights"])
    c.continue_generation()
    assert c.model_info().status == "empty"
    c.update_weights_from_disk(str(store.path(2)))
    assert c.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 2}).output_ids


def test_flush_cache_refused_while_requests_run(fresh_engine: Engine) -> None:
    _, c = fresh_engine
    fut = _bg(c, input_ids=PROMPT, sampling_params=LONG)
    _until_running(c)
    assert not c.flush_cache()
    fut.result(timeout=30)
    assert c.flush_cache()


def test_stop_strings_and_stop_token_ids(fresh_engine: Engine) -> None:
    _, c = fresh_engine
    free = c.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 20, "temperature": 0})
    assert len(free.output_ids) >= 2
    first = free.output_ids[0]
    r = c.generate(
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": 20, "temperature": 0, "stop_token_ids": [first]},
    )
    assert r.output_ids == (first,)
    assert r.finish_reason == {"type": "stop", "matched": first}
    sampled = {"max_new_tokens": 20, "ignore_eos": True, "sampling_seed": 4}
    text = c.generate(input_ids=PROMPT, sampling_params=sampled).text
    assert len(text) >= 3, text  # decoded by the model's tokenizer, specials skipped
    s = text[2]
    r = c.generate(input_ids=PROMPT, sampling_params={**sampled, "stop": [s]})
    assert r.finish_reason == {"type": "stop", "matched": s}
    assert r.text == text[: text.index(s)]  # SGLang's text ends before the stop string
    kept = c.generate(
        input_ids=PROMPT, sampling_params={**sampled, "stop": [s], "no_stop_trim": True}
    )
    assert kept.output_ids == r.output_ids
    assert s in kept.text and text.startswith(kept.text)


def test_text_is_decoded_as_sglang_decodes_it(fresh_engine: Engine) -> None:
    """`text` ignored `skip_special_tokens` and `no_stop_trim` (slime sends both: false and
    true by default): special tokens were always left out, and a matched stop token or string
    always kept. Now SGLang's rules (`trim_matched_stop`): the matched stop token is cut off
    and the text ends before the matched stop string unless `no_stop_trim`; special tokens
    are kept with `skip_special_tokens: false`."""
    _, c = fresh_engine
    for seed in range(100):  # a seeded sample that ends on the tiny model's EOS ("<eos>")
        sp: dict[str, object] = {"max_new_tokens": 40, "sampling_seed": seed}
        free = c.generate(input_ids=PROMPT, sampling_params=sp)
        if free.finish_reason == {"type": "stop", "matched": 2} and len(free.output_ids) >= 3:
            break
    else:
        pytest.fail("no seed of 100 ended on EOS")
    assert free.output_ids[-1] == 2 and "<eos>" not in free.text
    both = {**sp, "skip_special_tokens": False, "no_stop_trim": True}
    raw = c.generate(input_ids=PROMPT, sampling_params=both)
    assert raw.output_ids == free.output_ids
    assert raw.text == free.text + "<eos>", raw.text
    specials = c.generate(input_ids=PROMPT, sampling_params={**sp, "skip_special_tokens": False})
    assert specials.text == free.text  # the matched stop token is cut off
    first = free.output_ids[0]
    one = c.generate(input_ids=PROMPT, sampling_params={**sp, "stop_token_ids": [first]})
    assert one.output_ids == (first,) and one.text == ""
    kept = {**sp, "stop_token_ids": [first], "no_stop_trim": True}
    assert c.generate(input_ids=PROMPT, sampling_params=kept).text == free.text[:1]


def test_invalid_inputs_are_400_with_reasons(fresh_engine: Engine) -> None:
    _, c = fresh_engine
    for kw, needle in [
        ({"input_ids": [1, 999]}, "outside the vocabulary"),
        ({"input_ids": [1] * 64}, "too long"),  # the model's context is 64 tokens
        ({"text": "1+" * 40}, "too long"),
    ]:
        with pytest.raises(EngineRequestFailed, match=needle) as err:
            c.generate(**kw)  # type: ignore[arg-type]
        assert err.value.status_code == 400


def test_a_submission_larger_than_the_queue_is_refused_whole(fresh_engine: Engine) -> None:
    """`sampling_params.n` = 10⁶ once queued a million requests (gigabytes, minutes of work
    nobody waits for). More than `--max-queued-requests` (default 4096) is refused with 503,
    nothing of it queued, and the engine serves the next request as before."""
    import httpx

    from ehp_fsm.rollout.engine import DEFAULT_MAX_QUEUED

    handle, c = fresh_engine
    t0 = time.monotonic()
    r = httpx.post(
        f"{handle.url}/generate",
        json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "n": 10**6}},
        timeout=30,
    )
    assert r.status_code == 503, r.text
    assert "the request queue is full" in r.text and "--max-queued-requests" in r.text
    assert time.monotonic() - t0 < 20
    r = httpx.post(
        f"{handle.url}/generate",
        json={
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 2, "n": DEFAULT_MAX_QUEUED + 1},
        },
        timeout=30,
    )
    assert r.status_code == 503
    assert c.get_load()[0]["num_waiting_reqs"] == 0  # none of it was queued
    assert c.get_load()[0]["num_reqs"] == 0
    assert (
        len(
            c.generate(
                input_ids=PROMPT, sampling_params={"max_new_tokens": 2, "ignore_eos": True}
            ).output_ids
        )
        == 2
    )


def test_a_client_that_goes_away_has_its_requests_aborted(fresh_engine: Engine) -> None:
    """As SGLang does: a `/generate` whose HTTP client disconnected is aborted, so the engine
    does not spend its passes on results nobody reads. The engine is paused while the client
    is there, so its requests cannot finish: only the abort empties it (a bound on the time
    against their natural finish, ≥ 2 s, flaked on a loaded machine)."""
    import httpx

    handle, c = fresh_engine
    params = {"max_new_tokens": 50, "ignore_eos": True, "temperature": 1.0, "n": 4}
    c.pause_generation("in_place")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{handle.url}/generate",
            json={"input_ids": PROMPT, "sampling_params": params},
            timeout=httpx.Timeout(5.0, read=0.5),
        )
    deadline = time.monotonic() + 30
    while c.get_load()[0]["num_reqs"]:
        assert time.monotonic() < deadline, "the requests of a client that went away were kept"
        time.sleep(0.05)
    c.continue_generation()
    assert (
        len(
            c.generate(
                input_ids=PROMPT, sampling_params={"max_new_tokens": 2, "ignore_eos": True}
            ).output_ids
        )
        == 2
    )


def test_requests_during_the_first_install_are_refused_until_it_is_done(
    module_store: RevisionStore,
) -> None:
    """An engine started empty (as the run's first engines are, before revision 1 exists) is
    installed over HTTP; its first install takes seconds (transformers' imports). A request
    meanwhile found the engine "updating" and took it for serving: checking it against weights
    that did not exist yet raised (an assert) — a 500 for `/generate` (ids or text) and for the
    open `/health_generate`, the connection reset. Now 503 saying an install is in progress
    (/health too), then served once the install has answered."""
    handle = launch_engine(model_path=None)
    try:
        with SGLangClient(handle.url) as c, httpx.Client(base_url=handle.url) as http:
            install = ThreadPoolExecutor(max_workers=1).submit(
                c.update_weights_from_disk, str(module_store.path(1))
            )
            bodies = [
                {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}},
                {"text": "12+3=", "sampling_params": {"max_new_tokens": 2}},
            ]
            during = 0
            while not install.done():
                updating = c.model_info().status == "updating"
                answers = [http.post("/generate", json=b, timeout=30) for b in bodies]
                answers += [http.get(p, timeout=30) for p in ("/health_generate", "/health")]
                if not (updating and c.model_info().status == "updating"):
                    continue  # the install may have ended (or not begun) meanwhile
                during += 1
                for r in answers:
                    assert r.status_code == 503, (r.request.url.path, r.status_code, r.text)
                    assert "install is in progress" in r.text, r.text
            install.result()
            assert during >= 1, "the install ended before a request was sent during it"
            for b in bodies:
                assert http.post("/generate", json=b, timeout=30).status_code == 200
            assert http.get("/health_generate", timeout=30).status_code == 200
            assert handle.is_alive()
    finally:
        stop_engine(handle)


def test_a_rid_in_flight_is_refused_until_its_request_ended(fresh_engine: Engine) -> None:
    """Two concurrent /generate with one rid were both served (an abort by rid then hit both,
    and a router could not tell their answers apart). As SGLang's TokenizerManager: the second
    is refused, 400 "Duplicate request ID detected: RID"; the first runs on and completes; the
    rid is free again once its request finished or was aborted. A pause in place holds the
    first one in flight for as long as the test needs."""
    handle, c = fresh_engine

    def post(rid: object, **sp: object) -> httpx.Response:
        body = {"input_ids": PROMPT, "rid": rid, "sampling_params": {"max_new_tokens": 3, **sp}}
        return httpx.post(f"{handle.url}/generate", json=body, timeout=30)

    for ending in ("finished", "aborted"):
        rid = f"dup-{ending}"
        first = _bg(c, input_ids=PROMPT, sampling_params=LONG, rid=rid)
        _until_running(c)
        c.pause_generation("in_place")
        try:
            second = post(rid)
            assert second.status_code == 400, second.text
            assert f"Duplicate request ID detected: {rid}" in second.json()["error"]["message"]
        finally:
            c.continue_generation()
        if ending == "aborted":
            c.abort_request(rid)
            assert first.result(timeout=30).aborted
        else:
            done = first.result(timeout=30)
            assert done.finish_reason == {"type": "length", "length": LONG["max_new_tokens"]}
            assert done.rid == rid
        again = post(rid)
        assert again.status_code == 200 and again.json()["meta_info"]["id"] == rid, again.text

    # sample j of n is named RID_j: one whose name is in flight is refused by that name
    held = _bg(c, input_ids=PROMPT, sampling_params=LONG, rid="group_1")
    _until_running(c)
    c.pause_generation("in_place")
    try:
        r = post("group", n=2)  # group_0, group_1
        assert r.status_code == 400, r.text
        assert "Duplicate request ID detected: group_1" in r.json()["error"]["message"]
    finally:
        c.continue_generation()
    assert not held.result(timeout=30).aborted


def test_rids_within_one_request_are_distinct(fresh_engine: Engine) -> None:
    """A list of rids naming two prompts alike was served: both answers carried one id. As
    SGLang: 400 "Duplicate request IDs detected within the request: [...]", before any text is
    tokenized. The names n > 1 gives each sample (RID_j per prompt of a list) cannot collide:
    the part after the last "_" is the sample's number."""
    handle, _ = fresh_engine
    url = f"{handle.url}/generate"
    for prompt in ({"input_ids": [PROMPT, PROMPT]}, {"text": ["12+3=", "4+5="]}):
        body = {**prompt, "rid": ["a", "a"], "sampling_params": {"max_new_tokens": 2}}
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "Duplicate request IDs detected within the request: ['a']" in message, message
    body = {"input_ids": [PROMPT, PROMPT], "rid": ["a", "a_0"], "sampling_params": {"n": 2}}
    r = httpx.post(url, json={**body, "sampling_params": {"n": 2, "max_new_tokens": 2}})
    assert r.status_code == 200, r.text
    assert [a["meta_info"]["id"] for a in r.json()] == ["a_0", "a_1", "a_0_0", "a_0_1"]


def test_one_rid_names_each_prompt_of_a_batch(fresh_engine: Engine) -> None:
    """One rid for a batch of prompts (n = 1) gave every prompt that same rid — two requests
    of one name in flight; SGLang's `_normalize_rid` names them RID_0, RID_1, ... (as the
    engine already did for n > 1). A single prompt keeps the rid as it is."""
    handle, _ = fresh_engine
    sp = {"max_new_tokens": 2}
    for prompt in ({"input_ids": [PROMPT, PROMPT[:3]]}, {"text": ["12+3=", "4+5="]}):
        body = {**prompt, "rid": "batch", "sampling_params": sp}
        r = httpx.post(f"{handle.url}/generate", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert [a["meta_info"]["id"] for a in r.json()] == ["batch_0", "batch_1"]
    body = {"input_ids": PROMPT, "rid": "single", "sampling_params": sp}
    r = httpx.post(f"{handle.url}/generate", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["meta_info"]["id"] == "single", r.text
