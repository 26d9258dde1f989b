"""Harness of the runtime system tests: a plan, real agent processes, and the end-of-scenario
checks (invariants, nothing leaked, nothing orphaned, every group accounted for, log replays).

Every process the agents launch inherits `EHP_TEST_RUN=<uuid>` from its agent, so the orphan
check (and the final clean-up, which SIGKILLs whatever is left so a failing test leaks nothing)
finds exactly this test's processes with psutil.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from ehp_fsm.core.invariants import check_invariants
from ehp_fsm.replay import replay
from ehp_fsm.rollout.launch import free_port
from ehp_fsm.runtime.controller import Controller
from ehp_fsm.runtime.identity import START_TIME_TOLERANCE_S, start_time_of
from ehp_fsm.runtime.transport import TransportConfig

REPO = Path(__file__).resolve().parents[2]

PLAN = """
[run]
name = "runtime-system"
log = "{log}"

[[hosts]]
id = "h0"
gpus = 1

[[hosts]]
id = "h1"
gpus = 1

[[hosts]]
id = "h2"
gpus = 1

[core]
dp = 1
gpus = ["h0:g0"]

[[engines]]
id = "e0"
host = "h1"
tp = 1

[[engines]]
id = "e1"
host = "h2"
tp = 1

[rollout]
reserve = 1

[grpo]
prompts_per_step = 2
group_size = 2
steps = 1

[ehp]
replica_size = 1
max_hybrids = 1

[deadlines.rollout_engine]
starting = 90.0
installing = 30.0
draining = 20.0
stopping = 20.0

[deadlines.hybrid_replica]
launching = 20.0
loading = 20.0
leaving = 20.0

[transport]
controller = "{endpoint}"
heartbeat_s = 0.25
"""


#: A test's own agent endpoint beating at the plan's heartbeat (`heartbeat_s` above; silent
#: after 3 missed, 0.75 s). With the endpoint's default (1 s) a test whose pumps paused past
#: 0.75 s on a loaded machine made its agent silent: a report asked again where a launch was
#: awaited, a GPU quarantined (`test_reconcile_scope` failed 1 of 8 loaded runs).
PLAN_BEAT = TransportConfig(heartbeat_interval_s=0.25)


def write_plan(tmp: Path, endpoint: str | None = None) -> tuple[Path, str]:
    endpoint = endpoint or f"tcp://127.0.0.1:{free_port()}"
    path = tmp / "plan.toml"
    path.write_text(PLAN.format(log=tmp / "transitions.jsonl", endpoint=endpoint))
    return path, endpoint


class AgentProc:
    """One `python -m ehp_fsm.runtime.agent` process (restartable with the same state dir)."""

    def __init__(
        self,
        *,
        host: str,
        endpoint: str,
        tmp: Path,
        run_id: str,
        standin: Sequence[str] = (),
        extra: Sequence[str] = (),
    ) -> None:
        self.host, self.endpoint, self.run_id = host, endpoint, run_id
        self.state_dir = tmp / f"agent-{host}"
        self.standin = list(standin)
        self.extra: list[str] = list(extra)  # more `ehp-fsm agent` arguments
        self.proc: subprocess.Popen[bytes] | None = None
        self.logs: list[Path] = []
        self.start()

    def start(self) -> None:
        argv = [
            sys.executable,
            "-m",
            "ehp_fsm.runtime.agent",
            "--controller",
            self.endpoint,
            "--host-id",
            self.host,
            "--slots",
            "1",
            "--device",
            "cpu",
            "--state-dir",
            str(self.state_dir),
            "--heartbeat-s",
            "0.25",
            "--stop-grace-s",
            "5",
        ]
        for role in self.standin:
            argv += ["--standin", role]
        argv += self.extra
        self.state_dir.mkdir(parents=True, exist_ok=True)
        logfile = self.state_dir / f"agent-{len(self.logs)}.log"
        self.logs.append(logfile)
        env = {**os.environ, "EHP_TEST_RUN": self.run_id, "PYTHONPATH": str(REPO / "src")}
        with logfile.open("wb") as fh:
            self.proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def terminate(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def tail(self, n: int = 30) -> str:
        text = ""
        for path in self.logs[-2:]:
            with contextlib.suppress(OSError):
                text += "\n".join(path.read_text(errors="replace").splitlines()[-n:]) + "\n"
        return text


def run_processes(run_id: str) -> list[psutil.Process]:
    """Every live process started for this test run (agents' children and adopted ones),
    agents excluded."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            env = p.environ()
            cmd = " ".join(p.info["cmdline"] or [])
            status = p.status()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if status == psutil.STATUS_ZOMBIE:
            continue
        if env.get("EHP_TEST_RUN") == run_id and "ehp_fsm.runtime.agent" not in cmd:
            out.append(p)
    return out


def kill_run(run_id: str) -> None:
    for p in run_processes(run_id):
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


@contextlib.contextmanager
def cleanup(
    run_id: str, agents: list[AgentProc], controllers: Sequence[Controller] = ()
) -> Iterator[None]:
    try:
        yield
    finally:
        for c in controllers:
            c.close()
        for a in agents:
            with contextlib.suppress(Exception):
                if a.proc is not None and a.proc.poll() is None:
                    a.proc.kill()
                    a.proc.wait(5)
        kill_run(run_id)


def new_run_id() -> str:
    return uuid.uuid4().hex


def live_instances(ctl: Controller) -> dict[int, str]:
    """pid → instance for every non-terminal engine/Hybrid with a recorded identity."""
    return {int(ident["pid"]): f"{m}:{i}" for m, i, ident in ctl.owned_processes()}


def settle(ctl: Controller, timeout_s: float = 30.0) -> None:
    """Tick until no GPU waits for a finalizer or a reconcile, and no stop is in flight."""

    def quiet(c: Controller) -> bool:
        states = {g.state for g in c.world.of("gpu").values()}
        return not ({"releasing", "quarantined"} & states) and c.link.settled()

    assert ctl.run_until(quiet, timeout_s), f"did not settle: {ledger_of(ctl)}"


def ledger_of(ctl: Controller) -> dict[str, tuple[str, Any]]:
    return {g.id: (g.state, g.get("owner")) for g in ctl.world.of("gpu").values()}


def assert_ledger_sound(ctl: Controller) -> None:
    """Every GPU free, or owned by core or by a live engine/Hybrid whose process runs."""
    live = live_instances(ctl)
    for g in ctl.world.of("gpu").values():
        owner = g.get("owner")
        assert g.state in ("free", "owned"), f"GPU {g.id} is {g.state}: {ledger_of(ctl)}"
        if g.state == "free" or owner == "core":
            continue
        kind, _, oid = str(owner).partition(":")
        machine = {"engine": "rollout_engine", "hybrid": "hybrid_replica"}[kind]
        inst = ctl.world.get(machine, oid)
        assert inst is not None
        assert inst.state not in ctl.world.specs[machine].terminal, f"{owner} owns {g.id}"
        ident = inst.get("identity")
        if ident is not None:
            assert int(ident["pid"]) in live
            assert same_process(ident), f"{owner}'s process is gone (by pid and start time)"


def same_process(ident: Mapping[str, Any]) -> bool:
    """Whether the identity's pid still names the process that started at its start time."""
    try:
        started = start_time_of(int(ident["pid"]))
    except psutil.NoSuchProcess:
        return False
    return abs(started - float(ident["start_time"])) <= START_TIME_TOLERANCE_S


def assert_no_orphans(ctl: Controller, run_id: str, timeout_s: float = 10.0) -> None:
    """Every process of this run belongs to a live instance of the world (waits for stops)."""
    end = time.monotonic() + timeout_s
    while True:
        live = live_instances(ctl)
        strays = [p.pid for p in run_processes(run_id) if p.pid not in live]
        if not strays:
            break
        assert time.monotonic() < end, f"orphan processes {strays}; live: {live}"
        ctl.tick(0.05)
    for _, name, ident in ctl.owned_processes():
        assert same_process(ident), f"{name}'s process {ident['pid']} is not running"


def assert_groups_accounted(ctl: Controller, groups: Sequence[str] = ("g0", "g1")) -> None:
    spec = ctl.world.specs["rollout_engine"]
    for g in groups:
        r = ctl.world.get("request", g)
        assert r is not None, f"group {g} was lost"
        if r.state == "dispatched":
            e = ctl.world.get("rollout_engine", str(r.get("engine")))
            assert e is not None and e.state not in spec.terminal, f"{g} sits on a dead engine"


def final_checks(ctl: Controller, run_id: str, log_path: Path) -> None:
    settle(ctl)
    assert check_invariants(ctl.world) == []
    assert_ledger_sound(ctl)
    assert_no_orphans(ctl, run_id)
    assert_groups_accounted(ctl)
    result = replay(log_path)
    assert result.world.snapshot() == ctl.world.snapshot()
