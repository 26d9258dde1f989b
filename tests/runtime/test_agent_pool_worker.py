"""An agent launches a rank of the run's trainer pool only from a `trainer` field it checks
field by field, with a command line it builds itself (the pool's own, the agent as parent):
whatever else a launch carries — an argv, a module, an option inside a field, a bad endpoint,
a configuration that does not parse — is refused with its name and starts nothing.

Real agent and real controller endpoint over real sockets; a real pool (bound, no worker
started) gives the fields. No process is launched here (the slow test in
`test_pool_worker_launch` launches real workers)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from ehp_fsm.runtime.agent import AgentConfig
from ehp_fsm.runtime.deliveries import Replied
from ehp_fsm.runtime.identity import capture, new_launch_token
from ehp_fsm.runtime.pool_launch import (
    CURVE_CLIENT_ENV,
    CURVE_SERVER_ENV,
    POOL_TOKEN_ENV,
    ROUTE_ENV,
    TrainerLaunch,
    TrainerLaunchError,
)
from ehp_fsm.runtime.workers import (
    ROLE_ENGINE,
    ROLE_POOL_WORKER,
    LaunchSpec,
    WorkerError,
    WorkerRegistry,
)
from ehp_fsm.training.pool import PoolConfig, TrainerPool
from ehp_fsm.training.pool_protocol import worker_argv
from tests.procs import running_after

from .agent_rig import Rig, agent_rig

Z85_KEY = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"  # 40 Z85 characters (a public key's shape)


@pytest.fixture
def pool(tmp_path: Path) -> Any:
    p = TrainerPool.bind(PoolConfig(core_dp=1, max_hybrids=1), work_dir=tmp_path / "pool")
    yield p
    p.shutdown(timeout_s=1.0)


DROP = object()  # a key left out


def launch_args(pool: TrainerPool, **over: Any) -> dict[str, Any]:
    """A well-formed pool worker launch for rank 1 of `pool`; `over` replaces top-level keys."""
    args: dict[str, Any] = {
        "machine": ROLE_POOL_WORKER,
        "instance": "pool-r1",
        "role": ROLE_POOL_WORKER,
        "gpus": [],
        "token": new_launch_token(),
        "trainer": TrainerLaunch.for_pool(pool, 1).to_wire(),
    }
    return {k: v for k, v in (args | over).items() if v is not DROP}


def with_trainer(pool: TrainerPool, **over: Any) -> dict[str, Any]:
    """A launch whose trainer field has `over` replaced (a value of `DROP` removes the key)."""
    trainer = TrainerLaunch.for_pool(pool, 1).to_wire() | over
    return launch_args(pool, trainer={k: v for k, v in trainer.items() if v is not DROP})


def ask(rig: Rig, args: dict[str, Any]) -> Replied:
    msg = rig.ctl.send_command("h1", "launch", args)
    end = time.monotonic() + 10
    while msg not in rig.replies:
        assert time.monotonic() < end, "no reply to the launch"
        rig.pump(0.02)
    return rig.replies[msg]


def refused_cases(pool: TrainerPool) -> list[tuple[str, dict[str, Any], str]]:
    """Launches refused at once (ok=False): (what, launch args, what the refusal names)."""
    return [
        ("no trainer field", launch_args(pool, trainer=DROP), "no trainer field"),
        ("trainer not a map", launch_args(pool, trainer=[1, 2]), "not a map"),
        ("rank missing", with_trainer(pool, rank=DROP), "trainer.rank"),
        ("rank a bool", with_trainer(pool, rank=True), "trainer.rank"),
        ("rank a string", with_trainer(pool, rank="1"), "trainer.rank"),
        ("rank negative", with_trainer(pool, rank=-1), "trainer.rank"),
        ("control not tcp", with_trainer(pool, control="ipc:///tmp/x"), "trainer.control"),
        ("control port", with_trainer(pool, control="tcp://127.0.0.1:70000"), "port 70000"),
        ("control too long", with_trainer(pool, control="tcp://" + "a" * 300 + ":1"), "control"),
        ("rendezvous", with_trainer(pool, rendezvous="http://x/y"), "trainer.rendezvous"),
        ("relative file", with_trainer(pool, rendezvous="file://x/y"), "trainer.rendezvous"),
        ("pool token", with_trainer(pool, pool_token="a b c d e f"), "trainer.pool_token"),
        ("config not text", with_trainer(pool, config={"core_dp": 1}), "trainer.config"),
        ("standby a string", with_trainer(pool, standby="yes"), "trainer.standby"),
        ("curve key shape", with_trainer(pool, curve_server_key="abc"), "curve_server_key"),
        ("curve without keys", with_trainer(pool, curve_server_key=Z85_KEY), "--keys"),
        ("instance a path", launch_args(pool, instance="../../x"), "instance"),
        ("machine", launch_args(pool, machine=ROLE_ENGINE), "machine"),
        ("trainer on another role", launch_args(pool, role="hybrid_replica"), "role"),
        ("short token", launch_args(pool, token="t1"), "launch token"),
        # what a controller (or whoever speaks for one) might try to run instead
        ("argv in trainer", with_trainer(pool, argv=["/bin/sh", "-c", "id"]), "['argv']"),
        ("module in trainer", with_trainer(pool, module="os"), "['module']"),
        ("argv in the launch", launch_args(pool, argv=["/bin/sh"]), "['argv']"),
        (
            "an option in control",
            with_trainer(pool, control=f"{pool.control} --module os"),
            "trainer.control",
        ),
        (
            "an option in rendezvous",
            with_trainer(pool, rendezvous="tcp://127.0.0.1:1 -c x"),
            "trainer.rendezvous",
        ),
    ]


def failed_cases(pool: TrainerPool) -> list[tuple[str, dict[str, Any], str]]:
    """Launches whose configuration does not hold: read off the agent's loop (it imports
    torch), so they fail as `launch_failed` with the reason."""
    cfg = json.loads(pool.config.to_json())
    return [
        ("rank outside the world", with_trainer(pool, rank=2), "outside the pool's world"),
        ("config not JSON", with_trainer(pool, config="{nope"), "trainer.config"),
        ("config invalid", with_trainer(pool, config=json.dumps(cfg | {"core_dp": 0})), "core_dp"),
        ("config a list", with_trainer(pool, config="[1]"), "trainer.config"),
        ("standby on a Core rank", with_trainer(pool, rank=0, standby=True), "Core rank"),
        (
            "python in config",
            with_trainer(pool, config=json.dumps(cfg | {"python": "sh"})),
            "python",
        ),
    ]


@pytest.mark.timeout(120)
def test_malformed_or_smuggled_trainer_fields_are_refused_with_their_name(
    tmp_path: Path, pool: TrainerPool
) -> None:
    with agent_rig(tmp_path / "agent") as rig:
        for what, args, named in refused_cases(pool):
            reply = ask(rig, args)
            assert reply.ok is False, what
            assert reply.result["reason"] == "bad_trainer", (what, reply.result)
            assert named in reply.result["detail"], (what, reply.result["detail"])
        assert rig.agent.managed == {} and not rig.agent.processes.exited_tokens
        assert not rig.agent.processes.state_path.exists()  # not even a launch intended
        tokens = {}
        for what, args, named in failed_cases(pool):
            reply = ask(rig, args)
            assert reply.ok and reply.result == {"starting": True}, (what, reply.result)
            tokens[args["token"]] = (what, named)
        end = time.monotonic() + 60
        while len(
            failed := {d["token"]: d for _, n, d in rig.events if n == "launch_failed"}
        ) < len(tokens):
            assert time.monotonic() < end, failed
            rig.pump(0.05)
        for token, (what, named) in tokens.items():
            reason = failed[token]["reason"]
            assert reason.startswith("bad_trainer: ") and named in reason, (what, reason)
        assert rig.agent.managed == {}  # nothing was started
        assert [n for _, n, _ in rig.events if n != "launch_failed"] == []
        assert json.loads(rig.agent.processes.state_path.read_text()) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_pool_worker_holds_its_gpus_until_it_is_gone(tmp_path: Path, pool: TrainerPool) -> None:
    with agent_rig(tmp_path / "agent", slots=2) as rig:
        try:
            reply = ask(rig, launch_args(pool, gpus=["h1:g1"]))
            assert reply.ok and reply.result == {"starting": True}
            rig.pump(0.2)
            (ident,) = [d["identity"] for _, n, d in rig.events if n == "launched"]
            assert rig.agent.managed[ident["token"]].role == ROLE_POOL_WORKER
            for gpu in ("h1:g0", "h1:g1"):
                rig.command("confirm_gpu_free", {"gpu": gpu, "owner": "hybrid:x1"}, seconds=0.5)
            assert rig.freed() == ["h1:g0"]  # g1 is the worker's while it runs
            args = {"machine": ROLE_POOL_WORKER, "instance": "pool-r1", "identity": ident}
            assert rig.command("stop_process", args, seconds=0.3).ok  # type: ignore[union-attr]
            end = time.monotonic() + 30
            while "h1:g1" not in rig.freed():
                assert time.monotonic() < end, rig.events
                rig.pump(0.05)
            (exited,) = [d for _, n, d in rig.events if n == "exited"]
            assert exited["identity"] == ident and exited["stopped"] is True
        finally:
            rig.agent.processes.stop_all(grace_s=5)  # the rig's close leaves processes running


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_restarted_agent_adopts_its_pool_worker(tmp_path: Path, pool: TrainerPool) -> None:
    # The first agent "crashes" (closes without stopping anything); the next one, on the same
    # state directory, adopts the worker, reports it as a pool worker and stops it at shutdown.
    # (In-process agents: the worker's parent, this test process, lives on; a real agent's
    # worker would exit with it, and the adopting agent would report that exit.)
    with agent_rig(tmp_path / "agent") as rig:
        assert ask(rig, launch_args(pool)).ok
        rig.pump(0.2)
        (ident,) = [d["identity"] for _, n, d in rig.events if n == "launched"]
        popen = rig.agent.managed[ident["token"]].popen
    assert popen is not None
    try:
        with agent_rig(tmp_path / "agent") as rig:
            try:
                assert list(rig.agent.managed) == [ident["token"]]
                (entry,) = rig.agent.process_entries()
                assert entry["pid"] == ident["pid"] and entry["launch_token"] == ident["token"]
                assert entry["labels"]["machine"] == entry["labels"]["role"] == ROLE_POOL_WORKER
            finally:
                rig.agent.processes.stop_all(grace_s=5)
            assert running_after([ident["pid"]], 10) == []
    finally:
        if popen.poll() is None:
            popen.kill()
        popen.wait(10)


def test_the_agent_builds_the_pools_own_command_line_with_itself_as_parent(
    pool: TrainerPool,
) -> None:
    me = capture(1, launch_token=new_launch_token())  # any live process stands for the agent
    trainer = TrainerLaunch.from_wire(TrainerLaunch.for_pool(pool, 1, standby=True).to_wire())
    expected = worker_argv(
        pool.config,
        rank=1,
        control=pool.control,
        rendezvous=pool.rendezvous,
        parent=me,
        standby=True,
    )
    assert trainer.argv(parent=me) == expected
    # the secrets are in no command line (every user reads it): the route, the pool's launch
    # token (it was `--launch-token`) and the parent's (it was in `--parent`)
    for secret in (pool.route(1), pool.launch_token, me.launch_token):
        assert secret not in " ".join(expected)
    route = {ROUTE_ENV: pool.route(1), POOL_TOKEN_ENV: pool.launch_token}
    assert trainer.env(None) == route == trainer.env(Path("/k/agents/h1.key_secret"))
    curve = TrainerLaunch.for_pool(pool, 1, curve_server_key=Z85_KEY)
    assert curve.env(Path("/k/agents/h1.key_secret")) == {
        **route,
        CURVE_SERVER_ENV: Z85_KEY,
        CURVE_CLIENT_ENV: "/k/agents/h1.key_secret",
    }
    with pytest.raises(TrainerLaunchError, match="--keys"):
        curve.env(None)
    with pytest.raises(WorkerError, match="cannot be given an argv"):
        WorkerRegistry().register(ROLE_POOL_WORKER, lambda spec: ["/bin/sh"])


def test_a_warm_pool_worker_on_no_gpu_of_a_cuda_host_sees_the_hosts_devices() -> None:
    # It holds none until the pool activates it on the GPUs its Hybrid borrowed; any other
    # launch without GPUs on a CUDA host sees none, as before.
    base = {"machine": "m", "instance": "i", "host_id": "h1", "token": "t" * 8, "device": "cuda"}
    warm = LaunchSpec(role=ROLE_POOL_WORKER, gpus=(), **base).env()
    assert "CUDA_VISIBLE_DEVICES" not in warm and warm["EHP_GPUS"] == ""
    assert (
        LaunchSpec(role=ROLE_POOL_WORKER, gpus=("h1:g3",), **base).env()["CUDA_VISIBLE_DEVICES"]
        == "3"
    )
    assert LaunchSpec(role=ROLE_ENGINE, gpus=(), **base).env()["CUDA_VISIBLE_DEVICES"] == ""


def test_an_agent_with_keys_gives_its_own_secret_key_file(tmp_path: Path) -> None:
    from ehp_fsm.runtime.agent import Agent
    from ehp_fsm.runtime.keys import generate_keys

    generate_keys(tmp_path / "keys", agents=("h1",))
    agent = Agent(
        AgentConfig(
            controller="tcp://127.0.0.1:1",
            host_id="h1",
            state_dir=tmp_path / "state",
            keys_dir=tmp_path / "keys",
        )
    )
    try:
        key_file = agent.processes.curve_key_file
        assert key_file == (tmp_path / "keys" / "agents" / "h1.key_secret").resolve()
        assert key_file.is_file()
    finally:
        agent.close()
