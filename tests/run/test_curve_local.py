"""`transport.curve = "local"`: a one-machine run makes CURVE keys for its own agents (one per
host id, bound to it) and the whole run takes the authenticated path — the controller's CURVE
server refuses any agent that does not present its own host's key, so a run that ends clean
proves every agent authenticated (the run that shows it is
`test_run.py::test_run_borrows_returns_and_ends_clean`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ehp_fsm.errors import PlanError
from ehp_fsm.plan import load_plan
from tests.run.test_run import plan_text


def curve_plan(tmp: Path, transport_extra: str) -> Path:
    log = tmp / "run" / "transitions.jsonl"
    text = plan_text(log, 2).replace(
        'controller = "tcp://127.0.0.1:*"', f'controller = "tcp://127.0.0.1:*"\n{transport_extra}'
    )
    assert transport_extra in text
    path = tmp / "plan.toml"
    path.write_text(text)
    return path


def test_local_curve_is_refused_beside_keys_or_a_non_loopback_plane(tmp_path: Path) -> None:
    for extra in ('curve = "local"\ncurve_keys = "k"', 'curve = "on"'):
        with pytest.raises(PlanError, match=r"transport\.curve"):
            load_plan(curve_plan(tmp_path, extra))
    assert load_plan(curve_plan(tmp_path, 'curve = "local"')).transport.curve == "local"


def test_a_loopback_plan_without_keys_is_local_curve_unless_it_says_off(tmp_path: Path) -> None:
    """Without CURVE an agent's hello carries no secret: a local process that reached the
    run's port first held a host's agent id, and the run sent it launch tokens, then the
    engines' API key and every prompt, to the engine URL it reported. The default is now the
    authenticated path; a plan says `curve = "off"` to have the plain channel."""
    assert load_plan(curve_plan(tmp_path, "")).transport.curve == "local"
    assert load_plan(curve_plan(tmp_path, 'curve = "off"')).transport.curve == "off"
    keyed = load_plan(curve_plan(tmp_path, 'curve_keys = "k"')).transport
    assert keyed.curve == "off" and keyed.curve_keys == str(tmp_path / "k")  # the keys' CURVE


def test_external_agents_cannot_have_local_keys(tmp_path: Path) -> None:
    """`--agents external` with the default (local keys, made at the run's start for agents
    it starts itself): refused before anything starts, naming the key and both ways out;
    such agents could never have completed the handshake."""
    import io

    from ehp_fsm.rollout.launch import free_port
    from ehp_fsm.run import job as job_module

    path = curve_plan(tmp_path, "")
    path.write_text(path.read_text().replace("tcp://127.0.0.1:*", f"tcp://127.0.0.1:{free_port()}"))
    with pytest.raises(PlanError) as raised:
        job_module.run(load_plan(path), out=io.StringIO(), agents="external")
    text = str(raised.value)
    assert "transport.curve" in text and "--agents external" in text, text
    assert "curve_keys" in text and 'curve = "off"' in text, text
    assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.slow  # a one-step run: ~20 s
@pytest.mark.timeout(200)
def test_a_process_posing_as_an_agent_gets_nothing_from_a_default_run(tmp_path: Path) -> None:
    """A local process connects as host h1's agent before the real one can (it waits on the
    run's port, so it is there first), says hello and keeps listening. On the plain channel
    it held h1's id, the real agent never got in, and the run sent it h1's launches (with
    their secret tokens) and then its engines' traffic. With the default's CURVE it never
    completes the handshake: the run trains as usual and it receives nothing."""
    import os
    import subprocess
    import sys
    import threading
    import uuid

    from ehp_fsm.rollout.launch import free_port
    from ehp_fsm.runtime.transport import AgentEndpoint, Received

    port = free_port()
    path = curve_plan(tmp_path, "")
    path.write_text(path.read_text().replace("tcp://127.0.0.1:*", f"tcp://127.0.0.1:{port}"))
    received: list[object] = []
    stop = threading.Event()

    def pose() -> None:
        ep = AgentEndpoint(connect=f"tcp://127.0.0.1:{port}", host_id="h1")
        try:
            ep.hello({"gpus": ["h1:g0"], "device": "cpu", "agent_pid": os.getpid()})
            while not stop.is_set():
                received.extend(i for i in ep.poll(0.1) if isinstance(i, Received))
        finally:
            ep.close()

    poser = threading.Thread(target=pose, daemon=True)
    poser.start()  # connecting before the run binds: libzmq connects the moment it does
    env = {**os.environ, "EHP_TEST_RUN": uuid.uuid4().hex}
    proc = subprocess.run(
        [sys.executable, "-m", "ehp_fsm.cli", "run", str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    stop.set()
    poser.join(10)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step 2/2" in proc.stdout, proc.stdout
    assert received == []


# A run with `curve = "local"` ending clean (exit 0, `clean_controller`, every agent exited 0,
# no process left) with a key per host id in `keys/hosts.json`: the borrow-and-verify run of
# `test_run.py::test_run_borrows_returns_and_ends_clean` takes the authenticated path (one run
# carries both).
