"""The launcher starts real server processes, reports their identity, and stops them."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from ehp_fsm.rollout import (
    EngineLaunchError,
    EngineRequestFailed,
    GenerateResult,
    RevisionStore,
    SGLangClient,
    launch_engine,
    stop_engine,
)
from ehp_fsm.runtime.identity import start_time_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_launch_empty_engine_then_install_before_serving(store: RevisionStore) -> None:
    handle = launch_engine()
    try:
        assert handle.is_alive()
        assert start_time_of(handle.pid) == handle.start_time
        assert len(handle.launch_token) == 32
        with SGLangClient(handle.url) as c:
            assert not c.health()  # alive but not serving: nothing installed
            assert c.model_info().status == "empty"
            with pytest.raises(EngineRequestFailed, match="no weights installed"):
                c.generate(input_ids=[1, 4], sampling_params={"max_new_tokens": 1})
            c.update_weights_from_disk(str(store.path(2)))
            assert c.health()
            assert c.weight_version() == "2"
    finally:
        code = stop_engine(handle, grace_s=10)
    assert code is not None
    assert not handle.is_alive()
    assert not psutil.pid_exists(handle.pid) or (start_time_of(handle.pid) != handle.start_time)


def test_launch_with_bad_revision_fails_fast_with_the_log(tmp_path: object) -> None:
    with pytest.raises(EngineLaunchError, match="exited with code 2") as err:
        launch_engine(model_path="/no/such/revision", deadline_s=60)
    assert "does not exist" in err.value.log_tail


def test_stop_engine_is_idempotent(store: RevisionStore) -> None:
    handle = launch_engine(model_path=store.path(1), weight_version="w1")
    with SGLangClient(handle.url) as c:
        assert c.weight_version() == "w1"
    first = stop_engine(handle)
    assert stop_engine(handle) == first


def test_a_temporary_log_goes_with_its_engine_a_given_one_stays(
    store: RevisionStore, tmp_path: Path
) -> None:
    # Without `log_path` the launcher writes the engine's output to a temporary file; it was
    # left in /tmp for every engine ever started (hundreds after a test run).
    temp = launch_engine(model_path=store.path(1))
    given = launch_engine(model_path=store.path(1), log_path=tmp_path / "e.log")
    assert temp.temp_log and temp.log_path.exists() and not given.temp_log
    stop_engine(temp)
    stop_engine(given)
    assert not temp.log_path.exists()
    assert given.log_path.read_text()  # the caller's log is the caller's
    with pytest.raises(EngineLaunchError) as err:  # a failed launch: its tail still reported
        launch_engine(model_path="/no/such/revision", deadline_s=60)
    assert "does not exist" in err.value.log_tail


def test_the_callers_launch_token_is_the_engines(tmp_path: object) -> None:
    # An agent records a launch's token before it starts the engine, and after a crash finds
    # the interrupted launch's process by it: the engine must carry the caller's token.
    handle = launch_engine(env={"EHP_LAUNCH_TOKEN": "agent-token-e0"})
    try:
        assert handle.launch_token == "agent-token-e0"
        assert psutil.Process(handle.pid).environ()["EHP_LAUNCH_TOKEN"] == "agent-token-e0"
    finally:
        stop_engine(handle, grace_s=10)


def test_sigterm_ends_requests_a_pause_holds_and_the_engine_exits_at_once(
    store: RevisionStore,
) -> None:
    # A drained engine is paused (retract) with requests held; the agent then stops it with
    # SIGTERM. uvicorn's graceful shutdown waited for those requests its full 5 s (a borrow
    # took 5.3 s instead of ~0.4 s); the engine now aborts them on the signal.
    import threading
    import time

    from ehp_fsm.rollout import EngineError

    handle = launch_engine(model_path=store.path(2), decode_delay_ms=40.0)
    outcome: list[object] = []
    try:
        with SGLangClient(handle.url) as c, SGLangClient(handle.url) as held:

            def generate() -> None:
                try:
                    outcome.append(
                        held.generate(
                            input_ids=[1, 4, 5],
                            # no early EOS: the request must still run when it is polled
                            sampling_params={"max_new_tokens": 200, "ignore_eos": True},
                        )
                    )
                except EngineError as exc:
                    outcome.append(exc)

            t = threading.Thread(target=generate)
            t.start()
            deadline = time.monotonic() + 10
            while c.model_info().raw["num_running_reqs"] < 1:
                assert time.monotonic() < deadline, "the request never started"
                time.sleep(0.01)
            c.pause_generation("retract")  # the request is now held
            t0 = time.monotonic()
            code = stop_engine(handle, grace_s=10)
            took = time.monotonic() - t0
            t.join(10)
    finally:
        stop_engine(handle, grace_s=1)
    # -15: uvicorn re-raises the signal once it has shut down. The time alone does not tell the
    # fix from its absence since the graceful timeout is 1 s: the engine must have ended the
    # held request itself (an abort), not left it to uvicorn's cut (a 500 after 1 s).
    assert code in (0, -15) and took < 4.0, (code, took)  # was 5 s: the graceful timeout
    assert len(outcome) == 1, "the held request never ended"
    (ended,) = outcome
    assert isinstance(ended, GenerateResult), ended
    assert ended.finish_reason == {"type": "abort", "message": "engine shutting down"}, ended


def test_the_launch_contract_on_the_embedded_engine(store: RevisionStore) -> None:
    """The command line an agent gives SGLang — built by the one builder — with only the
    executable swapped: `-m ehp_fsm.rollout.server` for `-m sglang.launch_server` (the one edge
    faked: SGLang cannot serve on this CPU machine). Driven through the real client."""
    from ehp_fsm.engine_command import EngineCommand, engine_argv

    handle = launch_engine(
        model_path=store.path(2),
        weight_version="2",
        tp_size=2,
        memory_saver=True,
        deterministic=True,
        extra_args=("--context-length", "64"),
    )
    try:
        sglang = engine_argv(
            EngineCommand(
                model_path=str(store.path(2)),
                weight_version="2",
                host=handle.host,
                port=handle.port,
                tp_size=2,
                memory_saver=True,
                deterministic=True,
                extra_args=("--torch-threads", "1", "--decode-delay-ms", "0.0"),
            ),
            backend="sglang",
        )
        # the same line but for the module (and the embedded-only throttles the launcher adds)
        assert handle.argv[2] == "ehp_fsm.rollout.server" and sglang[2] == "sglang.launch_server"
        assert [a for a in handle.argv[3:] if a not in ("--context-length", "64")] == sglang[3:]
        with SGLangClient(handle.url) as c:
            assert c.health()
            info = c.server_info()
            assert info["tp_size"] == 2 and info["port"] == handle.port
            assert info["enable_memory_saver"] and info["enable_deterministic_inference"]
            assert info["model_path"] == str(store.path(2)) and info["context_length"] == 64
            assert c.weight_version() == "2"
            r = c.generate(
                input_ids=[1, 4, 5], sampling_params={"max_new_tokens": 3, "ignore_eos": True}
            )
            assert r.weight_version == "2" and len(r.output_ids) == 3
    finally:
        stop_engine(handle, grace_s=10)


def test_an_sglang_option_the_embedded_engine_lacks_fails_the_launch_by_name(
    store: RevisionStore,
) -> None:
    with pytest.raises(EngineLaunchError, match="exited with code 2") as err:
        launch_engine(model_path=store.path(1), extra_args=("--mem-fraction-static", "0.8"))
    assert "does not support --mem-fraction-static" in err.value.log_tail


def test_an_engine_with_an_api_key_refuses_every_request_without_it(
    store: RevisionStore,
) -> None:
    """SGLang's `--api-key` rule on the embedded engine, launched as the agents launch it: the
    key in the engine's environment (not in its command line, which every user of the host can
    read), the health probe open, anything else 401 without `Authorization: Bearer KEY` — a
    generate, a weight load from any path, a pause. `/server_info` does not echo the key."""
    import httpx

    key = "k3y-" + "x" * 40
    handle = launch_engine(model_path=store.path(1), api_key=key)
    try:
        assert key not in " ".join(psutil.Process(handle.pid).cmdline())
        with httpx.Client(base_url=handle.url, timeout=10.0) as anyone:
            assert anyone.get("/health").status_code == 200  # the agents' and balancers' probe
            for method, path, body in (
                ("POST", "/generate", {"input_ids": [1, 4]}),
                ("POST", "/update_weights_from_disk", {"model_path": str(store.path(2))}),
                ("POST", "/pause_generation", {"mode": "abort"}),
                ("GET", "/server_info", None),
                ("GET", "/model_info", None),
            ):
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
                    got = anyone.request(method, path, json=body, headers=headers)
                    assert (got.status_code, got.json()) == (401, {"error": "Unauthorized"})
        with SGLangClient(handle.url, api_key=key) as c:
            assert c.weight_version() == "1"  # the weight load above did not happen
            assert key not in str(c.server_info())
            c.update_weights_from_disk(str(store.path(2)))
            assert c.weight_version() == "2"
        with SGLangClient(handle.url) as c, pytest.raises(EngineRequestFailed, match="401"):
            c.model_info()
    finally:
        stop_engine(handle)
