"""Fault scenarios over real agents, processes and sockets: kill -9 at points of a borrow and of
a return, a lossy network, a recycled pid, hostile frames.

Engines are the idle stand-in process (`--standin rollout_engine`) except where an engine
process is the thing killed: those scenarios run real embedded engines. A stand-in is a real
process the agent launches, watches and stops the same way; it only lacks the HTTP server, which
these scenarios never use. Each scenario ends with `final_checks`: invariants hold, nothing
leaked, nothing orphaned, every group accounted for, the log replays to the same world.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import psutil
import pytest
import zmq

from ehp_fsm.plan import load_plan
from ehp_fsm.runtime import FaultProxy, FaultSchedule, Frame, Kind, encode
from ehp_fsm.runtime.controller import Controller, keys_main
from tests.runtime_system.driver import SLOT, TEST_TRANSPORT, Driver, wait_agents
from tests.runtime_system.harness import (
    REPO,
    AgentProc,
    cleanup,
    final_checks,
    new_run_id,
    run_processes,
    write_plan,
)
from tests.runtime_system.killpoints import KillPoint, Trigger, draw

pytestmark = [pytest.mark.slow]
STANDIN = ("rollout_engine",)


class Rig:
    """A controller in this process and agent processes h1, h2."""

    def __init__(
        self,
        tmp: Path,
        *,
        standin: tuple[str, ...] = STANDIN,
        faults: FaultSchedule | None = None,
    ) -> None:
        self.tmp = tmp
        self.plan_path, self.endpoint = write_plan(tmp)
        self.plan = load_plan(self.plan_path)
        self.log_path = tmp / "transitions.jsonl"
        self.run_id = new_run_id()
        self.ctl = Controller.start(
            self.plan, log_path=self.log_path, bind=self.endpoint, transport=TEST_TRANSPORT
        )
        self.proxy: FaultProxy | None = None
        via = self.endpoint
        if faults is not None:
            self.proxy = FaultProxy(upstream=self.endpoint, schedule=faults)
            self.proxy.start()
            via = self.proxy.endpoint
        self.agents = {
            h: AgentProc(host=h, endpoint=via, tmp=tmp, run_id=self.run_id, standin=standin)
            for h in ("h1", "h2")
        }
        self.driver = Driver(self.ctl)

    def up(self) -> None:
        wait_agents(self.ctl, ["h1", "h2"])
        self.driver.setup()
        self.driver.drive("serving", 90.0)
        assert self.ctl.run_until(
            lambda c: all(e.state == "serving" for e in c.world.of("rollout_engine").values()),
            90.0,
        )

    def instance_pid(self, machine: str, pred: Callable[[object], bool]) -> int | None:
        for inst in self.ctl.world.of(machine).values():
            ident = inst.get("identity")
            if ident and pred(inst) and inst.state not in self.ctl.world.specs[machine].terminal:
                return int(ident["pid"])
        return None


def _kill(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        psutil.Process(pid).kill()
    except psutil.NoSuchProcess:
        return False
    return True


def _on_slot(inst: object) -> bool:
    return SLOT in (inst.get("gpus") or ())  # type: ignore[attr-defined]


def _victim_pid(rig: Rig, victim: str) -> int | None:
    """The victim's process on the slot: the world's identity, else (not reported yet) the
    process the agent started for that role on the slot."""
    machine = {"engine": "rollout_engine", "hybrid": "hybrid_replica"}[victim]
    pid = rig.instance_pid(machine, _on_slot)
    if pid is not None:
        return pid
    for p in run_processes(rig.run_id):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            env = p.environ()
            if env.get("EHP_ROLE") == machine and env.get("EHP_GPUS") == SLOT:
                return p.pid
    return None


PROCESS_KILLS = [
    kp
    for victim in ("agent", "engine", "hybrid")
    for phase in ("borrow", "return")
    for kp in draw(victim, phase)
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kp", PROCESS_KILLS, ids=[kp.id for kp in PROCESS_KILLS])
def test_kill9_during_borrow_or_return(kp: KillPoint, tmp_path: Path) -> None:
    """kill -9 the victim at a drawn transition of a borrow or a return (see `killpoints`)."""
    rig = Rig(tmp_path, standin=() if kp.victim == "engine" else STANDIN)
    ctl, d = rig.ctl, rig.driver
    trigger = Trigger(kp, rig.log_path)
    h1 = rig.agents["h1"]
    fired: list[str] = []

    def on_tick() -> None:
        if kp.victim == "agent":
            if not fired and trigger.poll():
                h1.kill9()
                fired.append("killed")
            elif fired == ["killed"] and ctl.world.get("gpu", SLOT).state == "quarantined":
                h1.start()  # same state dir: adopts the processes that survived
                fired.append("restarted")
        elif not fired and trigger.poll():
            if _kill(_victim_pid(rig, kp.victim)):
                fired.append(kp.victim)
            elif kp.phase == "return":
                # The victim ran before the return began; after its stop was ordered (e.g. the
                # Hybrid's `leave`) it may exit on its own before this tick. The point then
                # tests a stop racing the kill, and the invariants must hold all the same.
                # (In a borrow the victim may not have started yet: keep trying.)
                fired.append("exited-first")

    with cleanup(rig.run_id, list(rig.agents.values()), [ctl]):
        try:
            rig.up()
            if kp.phase == "return":
                d.drive("borrowed", 60.0)
            trigger.begin()
            on_tick()
            d.drive("borrowed" if kp.phase == "borrow" else "serving", 90.0, on_tick)
            if kp.phase == "borrow":
                d.drive("serving", 90.0, on_tick)
            if kp.victim == "agent" and fired == ["killed"]:  # killed in the phase's last tick

                def restarted(c: Controller) -> bool:
                    on_tick()
                    return len(fired) == 2

                assert ctl.run_until(restarted, 30.0), "the killed agent was never quarantined"
            assert fired, f"the {kp.victim} kill never fired; seen {trigger.tail.seen}"
            if kp.victim == "agent":
                assert fired == ["killed", "restarted"]
            final_checks(ctl, rig.run_id, rig.log_path)
        except BaseException as exc:
            exc.add_note(kp.describe())
            raise


def _spawn_controller(
    rig_tmp: Path, plan_path: Path, log: Path, bind: str, stop_at: str
) -> subprocess.Popen[bytes]:
    with (rig_tmp / f"controller-{stop_at}.log").open("wb") as err:
        return _popen(plan_path, log, bind, stop_at, err)


def _popen(
    plan_path: Path, log: Path, bind: str, stop_at: str, err: object
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.runtime_system.driver",
            "--plan",
            str(plan_path),
            "--log",
            str(log),
            "--bind",
            bind,
            "--stop-at",
            stop_at,
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=err,  # type: ignore[arg-type]
    )


def _wait_line(proc: subprocess.Popen[bytes], prefix: str, timeout_s: float) -> str:
    assert proc.stdout is not None
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        line = proc.stdout.readline().decode()
        if line.startswith(prefix):
            return line.strip()
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"controller never printed {prefix!r} (rc={proc.poll()})")


CONTROLLER_KILLS = [kp for phase in ("borrow", "return") for kp in draw("controller", phase)]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("kp", CONTROLLER_KILLS, ids=[kp.id for kp in CONTROLLER_KILLS])
def test_kill9_controller_then_recover(kp: KillPoint, tmp_path: Path) -> None:
    """kill -9 the controller process at a drawn transition of a borrow or a return; a new
    controller recovers from the log (a torn last line after a borrow kill) and finishes."""
    plan_path, endpoint = write_plan(tmp_path)
    log = tmp_path / "transitions.jsonl"
    run_id = new_run_id()
    agents = [
        AgentProc(host=h, endpoint=endpoint, tmp=tmp_path, run_id=run_id, standin=STANDIN)
        for h in ("h1", "h2")
    ]
    stop_at = f"{kp.phase}:{kp.point}"
    proc = _spawn_controller(tmp_path, plan_path, log, endpoint, stop_at)
    recovered: list[Controller] = []
    with cleanup(run_id, agents, recovered):
        try:
            try:
                _wait_line(proc, "REACHED", 100.0)
            finally:
                proc.kill()
                proc.wait(10)
                assert proc.stdout is not None
                proc.stdout.close()
            torn = kp.phase == "borrow"
            if torn:
                with log.open("a") as fh:  # a crash mid-write: a torn last line
                    fh.write('{"seq": 99999, "time": 1.0, "machine": "gpu", "inst')
            ctl = Controller.recover(
                load_plan(plan_path), log, bind=endpoint, transport=TEST_TRANSPORT
            )
            recovered.append(ctl)
            assert ctl.recovery is not None
            if torn:
                assert ctl.recovery.truncated_bytes > 0
                assert "torn" in ctl.recovery.describe()
            d = Driver(ctl)
            wait_agents(ctl, ["h1", "h2"])
            if kp.phase == "borrow":
                d.drive("borrowed", 60.0)
            d.drive("serving", 60.0)
            final_checks(ctl, run_id, log)
        except BaseException as exc:
            exc.add_note(kp.describe())
            raise


@pytest.mark.timeout(120)
def test_clean_shutdown_of_a_controller_process_leaves_no_orphans(tmp_path: Path) -> None:
    plan_path, endpoint = write_plan(tmp_path)
    log = tmp_path / "transitions.jsonl"
    run_id = new_run_id()
    agents = [
        AgentProc(host=h, endpoint=endpoint, tmp=tmp_path, run_id=run_id, standin=STANDIN)
        for h in ("h1", "h2")
    ]
    proc = _spawn_controller(tmp_path, plan_path, log, endpoint, "borrowed")
    with cleanup(run_id, agents):
        try:
            _wait_line(proc, "REACHED", 100.0)
            assert len(run_processes(run_id)) == 2  # the Hybrid on h1, engine e1 on h2
            proc.send_signal(15)
            assert _wait_line(proc, "SHUTDOWN", 60.0) == "SHUTDOWN clean"
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            assert proc.stdout is not None
            proc.stdout.close()
        assert run_processes(run_id) == []
        for a in agents:
            assert psutil.Process(a.pid).children(recursive=True) == []
            assert a.terminate() == 0
        from ehp_fsm.replay import replay

        world = replay(log).world
        assert all(g.state in ("free", "owned") for g in world.of("gpu").values())
        assert {g.get("owner") for g in world.of("gpu").values()} == {None, "core"}


@pytest.mark.timeout(120)
def test_borrow_and_return_through_a_lossy_network(tmp_path: Path) -> None:
    schedule = FaultSchedule(
        seed=7, drop=0.1, duplicate=0.1, delay=0.1, reorder=0.1, delay_s=(0.01, 0.2)
    )
    rig = Rig(tmp_path, faults=schedule)
    proxy = rig.proxy
    assert proxy is not None
    try:
        with cleanup(rig.run_id, list(rig.agents.values()), [rig.ctl]):
            rig.up()
            rig.driver.drive("borrowed", 60.0)
            rig.driver.drive("serving", 60.0)
            proxy.set_schedule(FaultSchedule(seed=8))  # heal, then settle
            final_checks(rig.ctl, rig.run_id, rig.log_path)
            stats = rig.ctl.endpoint.stats
            assert stats["duplicates"] + stats["resent"] > 0
    finally:
        proxy.stop()
        proxy.close()
    for fault in ("dropped", "duplicated", "delayed", "reordered"):
        assert proxy.counts[f"up_{fault}"] + proxy.counts[f"down_{fault}"] > 0, proxy.counts


@pytest.mark.timeout(90)
def test_agent_restarted_with_a_recycled_pid_in_its_state_file(tmp_path: Path) -> None:
    """The recycled pid is simulated (no test can make the kernel reuse a pid): the restarted
    agent's state file names e0's token with the pid of an unrelated live process (a decoy) and
    e0's old start time, which is exactly what a reused pid looks like."""
    rig = Rig(tmp_path)
    ctl = rig.ctl
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    with cleanup(rig.run_id, list(rig.agents.values()), [ctl]):
        try:
            rig.up()
            e0 = ctl.world.get("rollout_engine", "e0")
            ident = dict(e0.get("identity"))
            h1 = rig.agents["h1"]
            h1.kill9()
            _kill(ident["pid"])
            state = rig.agents["h1"].state_dir / "processes.json"
            entries = json.loads(state.read_text())
            (entry,) = [e for e in entries if e["token"] == ident["token"]]
            entry["pid"] = decoy.pid  # start_time stays e0's: not the decoy's
            state.write_text(json.dumps(entries))
            h1.start()
            assert ctl.run_until(
                lambda c: c.world.get("rollout_engine", "e0").state == "failed", 30.0
            )
            # a stop by identity naming the decoy's pid with a foreign start time is refused
            msg = ctl.send_agent_command(
                "h1",
                "stop_process",
                {"identity": {**ident, "pid": decoy.pid}, "machine": "", "instance": ""},
            )
            assert ctl.run_until(lambda c: any(r[0] == msg for r in c.replies), 20.0)
            (reply,) = [r for r in ctl.replies if r[0] == msg]
            assert reply[2] is False and reply[3]["reason"] == "not_same_process"
            assert decoy.poll() is None, "the recycled pid was signalled"
            assert "pid_recycled" in h1.logs[-1].read_text()
            rig.driver.drive("serving", 60.0)
            final_checks(ctl, rig.run_id, rig.log_path)
            assert decoy.poll() is None
        finally:
            decoy.kill()
            decoy.wait(5)


@pytest.mark.timeout(90)
def test_malformed_oversized_and_unauthenticated_frames_never_crash_the_controller(
    tmp_path: Path,
) -> None:
    rig = Rig(tmp_path)
    ctl = rig.ctl
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sockets: list[zmq.Socket[bytes]] = []
    with cleanup(rig.run_id, list(rig.agents.values()), [ctl]):
        try:
            rig.up()
            before = ctl.world.snapshot()
            rogue = context.socket(zmq.DEALER)
            sockets.append(rogue)
            rogue.setsockopt(zmq.LINGER, 0)
            rogue.setsockopt(zmq.ROUTING_ID, b"rogue")
            rogue.connect(rig.endpoint)
            good = Frame(kind=Kind.HEARTBEAT, id="m1", seq=1, epoch=1, sender="rogue")
            bad_frames = [
                b"\xc1not msgpack",
                msgpack.packb([1, 2, 3]),
                msgpack.packb({"version": 99, "kind": "event"}),
                msgpack.packb({**good.to_wire(), "kind": "launch_missiles"}),
                msgpack.packb({**good.to_wire(), "sender": "h1"}),  # impersonation
                msgpack.packb(
                    {**good.to_wire(), "kind": "event", "payload": {"name": 1, "data": {}}}
                ),
                msgpack.packb(msgpack.ExtType(1, b"x")),
                msgpack.packb(
                    {**good.to_wire(), "kind": "reconcile", "payload": {"processes": [{"pid": 1}]}}
                ),
            ]
            for data in bad_frames:
                rogue.send(data)
            rogue.send_multipart([b"a", b"b"])
            ctl.run_until(lambda c: sum(c.drops.values()) >= len(bad_frames), 10.0)
            assert sum(ctl.drops.values()) >= len(bad_frames), ctl.drops
            # oversized: libzmq's MAXMSGSIZE cuts the connection before a byte is decoded
            big = context.socket(zmq.DEALER)
            sockets.append(big)
            big.setsockopt(zmq.LINGER, 0)
            big.connect(rig.endpoint)
            big.send(b"x" * (ctl.endpoint.config.max_message_bytes + 10))
            ctl.run_until(lambda c: False, 0.5)
            # unauthenticated: a CURVE client with keys the controller never authorised
            public, secret = zmq.curve_keypair()
            stranger = context.socket(zmq.DEALER)
            sockets.append(stranger)
            stranger.setsockopt(zmq.LINGER, 0)
            stranger.curve_publickey, stranger.curve_secretkey = public, secret
            stranger.curve_serverkey = zmq.curve_keypair()[0]
            stranger.connect(rig.endpoint)
            # its handshake fails; once its connection is dropped a DEALER with no peer would
            # block in send for good (seen once under load): the frame is offered, not forced
            with contextlib.suppress(zmq.Again):
                stranger.send(encode(good), zmq.NOBLOCK)
            ctl.run_until(lambda c: False, 0.5)
            assert ctl.world.snapshot() == before
            assert "rogue" not in ctl.agents
            assert {"not_msgpack", "not_a_map", "unknown_version", "unknown_kind"} <= set(ctl.drops)
            # still serving its agents: a whole borrow and return afterwards
            rig.driver.drive("borrowed", 60.0)
            rig.driver.drive("serving", 60.0)
            final_checks(ctl, rig.run_id, rig.log_path)
        finally:
            for sock in sockets:
                sock.close(linger=0)
            context.term()


@pytest.mark.timeout(60)
def test_curve_controller_admits_only_authorised_agents(tmp_path: Path) -> None:
    """CURVE on: agent h1 holds authorised keys (made by `keys_main`, the `ehp-fsm keys`
    command); a stranger with the right server key but an unauthorised keypair says hello as
    h2 and is never heard."""
    keys = tmp_path / "keys"
    assert keys_main([str(keys), "--agent", "h1"]) == 0
    plan_path, endpoint = write_plan(tmp_path)
    text = plan_path.read_text().replace(
        "heartbeat_s = 0.25", f'heartbeat_s = 0.25\ncurve_keys = "{keys}"'
    )
    plan_path.write_text(text)
    run_id = new_run_id()
    ctl = Controller.start(
        load_plan(plan_path), log_path=tmp_path / "t.jsonl", bind=endpoint, transport=TEST_TRANSPORT
    )
    agent = AgentProc(host="h1", endpoint=endpoint, tmp=tmp_path, run_id=run_id, standin=STANDIN)
    agent.extra = ["--keys", str(keys)]
    agent.kill9()
    agent.start()
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    stranger = context.socket(zmq.DEALER)
    with cleanup(run_id, [agent], [ctl]):
        try:
            wait_agents(ctl, ["h1"])
            public, secret = zmq.curve_keypair()
            stranger.setsockopt(zmq.LINGER, 0)
            stranger.setsockopt(zmq.ROUTING_ID, b"h2")
            stranger.curve_publickey, stranger.curve_secretkey = public, secret
            stranger.curve_serverkey = (keys / "controller.key").read_bytes().split(b'"')[1]
            stranger.connect(endpoint)
            hello = Frame(
                kind=Kind.HELLO,
                id="x1",
                seq=1,
                epoch=1,
                sender="h2",
                payload={"host_id": "h2", "inventory": {"gpus": ["h2:g0"]}},
            )
            # An unauthorised DEALER has no peer once its CURVE handshake is refused, and a
            # DEALER with no peer blocks in send: bound it (the frame is never heard either way).
            stranger.setsockopt(zmq.SNDTIMEO, 2000)
            with contextlib.suppress(zmq.Again):
                stranger.send(encode(hello))
            ctl.run_until(lambda c: False, 1.5)
            assert "h2" not in ctl.agents
            assert ctl.agents["h1"].reconciled
        finally:
            stranger.close(linger=0)
            context.term()
