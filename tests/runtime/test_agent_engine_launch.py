"""An agent starts an engine from the newest revision of the run's store, with the launch
config the run hands it (`ehp-fsm agent --engine-*`), through the one command builder.

Real agent, real controller endpoint, real engine process on a real socket; the engine is the
embedded one (`--engine-backend embedded`): SGLang cannot serve on this CPU machine."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

from ehp_fsm.engine_command import EngineLaunchConfig
from ehp_fsm.rollout import EngineRequestFailed, RevisionStore, SGLangClient
from ehp_fsm.runtime.agent import AgentConfig, AgentError, _engine_launch, build_parser
from ehp_fsm.runtime.identity import new_launch_token
from ehp_fsm.runtime.keys import ensure_api_key
from tests.rollout.conftest import make_store, revision_state

from .agent_rig import Rig, agent_rig, engine_launch_args


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_engine_starts_from_the_newest_revision_with_the_runs_flags(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    store = make_store(tmp_path / "revisions", tiny_model_dir, revisions=(1, 2))
    key_file = tmp_path / "keys" / "engine-api-key"
    engines = EngineLaunchConfig(
        revisions=str(store.root),
        deterministic=True,
        extra_args=("--context-length", "48"),
        api_key_file=str(key_file),  # written after the agent started, as a run does
    )
    with agent_rig(tmp_path / "agent", engines=engines) as rig:
        try:
            key = ensure_api_key(key_file)
            _launch_and_check(rig, store, key)
        finally:
            rig.agent.processes.stop_all(grace_s=5)  # the rig's close leaves processes running


def _launch_and_check(rig: Rig, store: RevisionStore, key: str) -> None:
    token = new_launch_token()
    args = engine_launch_args(token)
    rig.command("launch", args)
    end = time.monotonic() + 90
    while not any(name == "healthy" for _, name, _ in rig.events):
        assert time.monotonic() < end, rig.events
        rig.pump(0.1)
    identity = next(d for _, n, d in rig.events if n == "healthy")["identity"]
    cmdline = psutil.Process(identity["pid"]).cmdline()
    assert cmdline[1:3] == ["-m", "ehp_fsm.rollout.server"]
    flags = dict(zip(cmdline[3:], [*cmdline[4:], ""], strict=True))
    # the newest revision, through the agent's links to its files (removed once it answered),
    # in a folder that does not bear the launch token: a secret, and the path is in `ps` (it
    # was `.launch-<token>`)
    pin = Path(flags["--model-path"])
    assert pin.parent == store.root and pin.name.startswith(".launch-"), pin
    assert not pin.exists()
    assert token not in " ".join(cmdline)
    assert flags["--weight-version"] == "2" and flags["--tp-size"] == "1"
    assert "--enable-deterministic-inference" in cmdline
    assert flags["--context-length"] == "48"
    assert key not in " ".join(cmdline) and "--api-key" not in cmdline  # in its environment
    with SGLangClient(identity["url"], api_key=key) as c:
        assert c.health() and c.weight_version() == "2"  # serving it from the start
        assert c.server_info()["enable_deterministic_inference"] is True
    with SGLangClient(identity["url"]) as c, pytest.raises(EngineRequestFailed, match="401"):
        c.weight_version()  # without the run's key: refused


def test_the_agent_flags_round_trip_and_bad_ones_are_refused() -> None:
    cfg = EngineLaunchConfig(
        backend="sglang",
        revisions="/r",
        base_model="/models/qwen3",
        extra_args=("--mem-fraction-static", "0.8"),
        start_deadline_s=600.0,
        api_key_file="/keys/engine-api-key",
    )
    base = ["--controller", "tcp://127.0.0.1:9", "--host-id", "h1"]
    assert _engine_launch(build_parser().parse_args([*base, *cfg.agent_flags()])) == cfg
    bad = build_parser().parse_args([*base, "--engine-args", '["--port", "1"]'])
    with pytest.raises(AgentError, match="--port"):
        _engine_launch(bad)
    no_store = build_parser().parse_args([*base, "--engine-backend", "sglang"])
    with pytest.raises(AgentError, match="revision store"):
        _engine_launch(no_store)


def test_an_agent_started_by_the_cluster_reads_the_launch_config_from_the_plan(
    tmp_path: Path,
) -> None:
    from ehp_fsm.plan import load_plan
    from tests.run.test_sglang_plan import PLAN

    plan = tmp_path / "plan.toml"
    extra = '[sglang]\nargs = ["--foo"]\n[deadlines.rollout_engine]\nstarting = 600.0'
    text = PLAN.format(device="cuda", backend="sglang", ehp="false", extra=extra)
    plan.write_text(text.replace("[run]\n", f'[run]\nrevisions = "{tmp_path}/shared"\n', 1))
    base = ["--controller", "tcp://127.0.0.1:9", "--host-id", "n1", "--plan", str(plan)]
    cfg = _engine_launch(build_parser().parse_args(base))
    assert cfg == EngineLaunchConfig(
        backend="sglang",
        revisions=str(tmp_path / "shared"),
        extra_args=("--foo",),
        deterministic=True,
        start_deadline_s=600.0,  # SGLang may take minutes: the agent waits as long as the world
        api_key_file=cfg.api_key_file,
    )
    # the run's key, where the run writes it: `keys/` beside its log (no CURVE key directory)
    log = Path(load_plan(plan).log).resolve()
    assert cfg.api_key_file == str(log.parent / "keys" / "engine-api-key")
    both = build_parser().parse_args([*base, "--engine-backend", "embedded"])
    with pytest.raises(AgentError, match="both given"):
        _engine_launch(both)


def test_a_pinned_revision_outlives_its_retirement(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The run retires a revision once no engine uses it — while a started engine is still
    importing, the newest revision has often moved on. The engine's links keep what it reads."""
    from ehp_fsm.models import revision_dir
    from ehp_fsm.runtime.agent_processes import newest_revision, unpin

    store = make_store(tmp_path / "revisions", tiny_model_dir, revisions=(1, 2))
    path, version = newest_revision(str(store.root))
    assert version == "2" and path is not None and Path(path).name.startswith(".launch-")
    store.save(
        revision=3, step=3, state_dict=revision_state(tiny_model_dir, 3), base=tiny_model_dir
    )
    store.retire(2, referenced=())
    assert not (store.root / "r00000002").exists() and store.revisions() == [1, 3]
    pinned = revision_dir.open_revision(Path(path))  # every file still there, sizes as listed
    assert pinned.manifest.revision == 2
    unpin(path)
    assert not Path(path).exists()
    assert newest_revision(None) == (None, None)


def test_before_revision_1_an_engine_starts_from_the_model_directory(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The run launches its engines while its trainers start: the store is still empty, and the
    engine starts from the plan's model directory, with no weight version (the engine machine
    then has it install revision 1 before it serves). Without that directory it is refused."""
    from ehp_fsm.runtime.agent_processes import newest_revision
    from ehp_fsm.runtime.workers import WorkerError

    store = RevisionStore(tmp_path / "revisions")
    got = newest_revision(str(store.root), base_model=str(tiny_model_dir))
    assert got == (str(tiny_model_dir), None)
    assert not list(store.root.glob(".launch-*"))  # the model directory needs no pin
    with pytest.raises(WorkerError, match="holds no revision"):
        newest_revision(str(store.root))
    store.save(
        revision=1, step=0, state_dict=revision_state(tiny_model_dir, 1), base=tiny_model_dir
    )
    path, version = newest_revision(str(store.root), base_model=str(tiny_model_dir))
    assert version == "1" and [str(p) for p in store.root.glob(".launch-*")] == [path]  # it wins


@pytest.mark.parametrize(
    ("controller", "why"),
    [
        ("tcp://127.0.0.1:99999", "port '99999' is not 1..65535"),  # ZeroMQ dialled 34463
        ("tcp://127.0.0.1", "names no port"),
        ("tcp://127.0.0.1:*", "a port to bind, not one to connect to"),
    ],
)
def test_a_controller_endpoint_the_agent_cannot_connect_to_is_refused(
    controller: str, why: str
) -> None:
    with pytest.raises(AgentError, match="is not an endpoint to connect to") as err:
        AgentConfig(controller=controller, host_id="h1")
    assert why in str(err.value)
