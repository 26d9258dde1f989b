"""The trainer pool's control channel with CURVE (`training.pool_socket`): what lets warm workers
run on other hosts than the coordinator.

Real ZeroMQ sockets and CURVE keys (`generate_keys` in tmp_path) throughout. The end-to-end test
starts real worker processes: the Core rank launched by the coordinator itself (its own host's
key), the warm worker launched the way a host agent does (`worker_argv` + the two environment
variables, another host's key). The intruders are raw DEALER sockets in this process that say a
worker's hello: an intruder is a socket, not a trainer, and a real worker could not say hello
without joining the pool's Gloo world first.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import pytest
import zmq
from structlog.testing import capture_logs
from zmq.utils.monitor import recv_monitor_message

from ehp_fsm.core.batch import partition_groups
from ehp_fsm.runtime import identity as ident
from ehp_fsm.runtime.errors import KeyFileError, TransportError
from ehp_fsm.runtime.keys import KeyLayout, generate_keys, load_server_keys
from ehp_fsm.runtime.pool_launch import POOL_TOKEN_ENV, ROUTE_ENV, new_route, routing_id
from ehp_fsm.runtime.protocol import Frame, Kind, encode
from ehp_fsm.training import pool_socket
from ehp_fsm.training.collect import DeliveryCollector
from ehp_fsm.training.pool import PoolError, PoolFailure, TrainerPool
from ehp_fsm.training.pool_socket import CLIENT_ENV, SERVER_ENV, client_keys_from_env, worker_env
from tests.training_pool.rig import ok, tiny_config

HOSTS = {0: "head", 1: "node-1"}  # the Core rank on the coordinator's host, the warm one not

T = TypeVar("T")


def until_logged(
    turn: Callable[[], T], done: Callable[[list[dict[str, Any]]], bool], *, within_s: float = 30.0
) -> tuple[T, list[dict[str, Any]]]:
    """`turn` (a short wait of the pool's, `wait_ready` or `_await`: it reads the pool's socket)
    again and again until `done` holds of the logs of every turn, a turn has nothing left to wait
    for (None), or `within_s`: the last turn's outcome and every log. The test's frames go out
    from its own sockets and reach the pool only once libzmq's I/O threads have connected them
    (with CURVE, after the handshake): on a loaded machine, later than one short wait, which then
    saw none of them."""
    end = time.monotonic() + within_s
    seen: list[dict[str, Any]] = []
    while True:
        with capture_logs() as logs:
            got = turn()
        seen += logs
        if got is None or done(seen) or time.monotonic() >= end:
            return got, seen


def events(logs: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == event]


@pytest.fixture
def keys(tmp_path: Path) -> KeyLayout:
    return generate_keys(tmp_path / "keys", agents=["head", "node-1"])


@pytest.fixture
def pool(tmp_path: Path, keys: KeyLayout) -> Iterator[TrainerPool]:
    """A pool whose channel uses the run's keys, no worker launched."""
    p = TrainerPool(
        tiny_config(),
        work_dir=tmp_path / "pool",
        curve=load_server_keys(keys.root),
        rank_hosts=HOSTS,
        local_client_key=keys.agent_secrets["head"],
    )
    yield p
    p.shutdown(timeout_s=1.0)


class Clients:
    """The test's own DEALER sockets (each closed at the end, with their context)."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sockets: list[zmq.Socket[bytes]] = []

    def socket(self) -> zmq.Socket[bytes]:
        sock = self.ctx.socket(zmq.DEALER)
        self.sockets.append(sock)
        return sock

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)
        self.ctx.destroy(linger=0)


@pytest.fixture
def clients() -> Iterator[Clients]:
    c = Clients()
    yield c
    c.close()


def say_hello(clients: Clients, pool: TrainerPool, rank: int, key_file: Path) -> zmq.Socket[bytes]:
    """A DEALER that connects as `trainer-<rank>` with `key_file`'s keypair and says that
    rank's hello (this process's identity, the pool's launch token)."""
    assert pool.curve_public is not None
    sock = clients.socket()
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, routing_id(f"trainer-{rank}", pool.route(rank)))
    curve = client_keys_from_env(worker_env(pool.curve_public, key_file))
    pool_socket.connect(sock, pool.control, curve)
    me = ident.capture(os.getpid(), launch_token=pool.launch_token)
    inventory = {
        "rank": rank,
        "role": "core" if rank == 0 else "hybrid",
        "world_size": 2,
        "identity": me.to_dict(),
        "version": 0,
        "grad_shapes": [],
        "standby": False,
        "threads": {"intra_op": 1, "inter_op": 1},
    }
    frame = Frame(
        kind=Kind.HELLO,
        id=uuid.uuid4().hex,
        seq=1,
        epoch=1,
        sender=f"trainer-{rank}",
        payload={"host_id": me.host, "inventory": inventory},
    )
    sock.send(encode(frame, max_bytes=pool.config.max_message_bytes))
    return sock


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_curve_pool_end_to_end(tmp_path: Path, pool: TrainerPool, keys: KeyLayout) -> None:
    """The coordinator launches its Core rank itself; "node-1's agent" launches the warm worker
    with the pool's key and its host's key in the environment. Both hellos pass the binding
    check, and both workers answer a command."""
    assert pool.curve_public == load_server_keys(keys.root).public.decode()
    pool._launch(0)  # what `spawn` does: the coordinator's own rank, its host's key
    env = {**os.environ, **worker_env(pool.curve_public or "", keys.agent_secrets["node-1"])}
    env[ROUTE_ENV] = pool.route(1)  # the launch's secret route, as the agent gives it
    env[POOL_TOKEN_ENV] = pool.launch_token  # and the pool's launch token
    with open(tmp_path / "agent-worker-1.log", "wb") as out:
        agent_launched = subprocess.Popen(
            pool.worker_argv(1), env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        with capture_logs() as logs:
            assert pool.wait_ready(timeout_s=90) is None
            for rank in (0, 1):
                status = ok(pool.worker_status(rank))
                assert "version" in status, status
        assert sorted(w.rank for w in pool.workers) == [0, 1]
        assert not [e for e in logs if e["event"] == "frame_dropped"]
        assert pool.shutdown(timeout_s=20) == []
        assert agent_launched.wait(20) == 0  # it obeyed the pool's shutdown command
    finally:
        if agent_launched.poll() is None:
            agent_launched.kill()
            agent_launched.wait(10)


def test_a_key_off_the_allow_list_gets_no_hello_through(
    tmp_path: Path, clients: Clients, pool: TrainerPool, keys: KeyLayout
) -> None:
    """A keypair the run never authorized fails the handshake (ZAP says no): its hello never
    reaches the pool, while rank 0's, with the right key, does."""
    stranger = generate_keys(tmp_path / "other", agents=["node-1"]).agent_secrets["node-1"]
    say_hello(clients, pool, 0, keys.agent_secrets["head"])
    rogue = say_hello(clients, pool, 1, stranger)
    monitor = rogue.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    clients.sockets.append(monitor)
    assert monitor.poll(5000), "the handshake of an unauthorized key did not fail"
    assert recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    # until rank 0's hello is in: rank 1's, refused at the handshake, never comes
    failure, _ = until_logged(lambda: pool.wait_ready(timeout_s=1.0), lambda _: bool(pool.workers))
    assert isinstance(failure, PoolFailure) and failure.reason == "deadline", failure
    assert "ranks [1] sent no hello" in failure.detail
    assert [w.rank for w in pool.workers] == [0]


def test_another_hosts_key_cannot_speak_for_a_rank(
    clients: Clients, pool: TrainerPool, keys: KeyLayout
) -> None:
    """An authorized key of host `head` claiming `trainer-1` (a rank node-1's agent launched)
    completes the handshake, but its frames are dropped and logged; node-1's key then gets the
    same hello through."""
    for rank in (0, 1):
        say_hello(clients, pool, rank, keys.agent_secrets["head"])
    failure, logs = until_logged(
        lambda: pool.wait_ready(timeout_s=1.5),
        lambda logs: bool(pool.workers) and bool(events(logs, "frame_dropped")),
    )
    assert isinstance(failure, PoolFailure) and "ranks [1] sent no hello" in failure.detail
    dropped = events(logs, "frame_dropped")
    assert [(e["reason"], e["peer"]) for e in dropped] == [("key_not_bound", "trainer-1")]
    assert "not the one bound to host 'node-1'" in dropped[0]["detail"]
    # Each rank's own key (a fresh start, since wait_ready takes every hello anew): both pass.
    say_hello(clients, pool, 0, keys.agent_secrets["head"])
    say_hello(clients, pool, 1, keys.agent_secrets["node-1"])  # takes over the route
    assert pool.wait_ready(timeout_s=10) is None
    assert sorted(w.rank for w in pool.workers) == [0, 1]


@pytest.mark.parametrize(
    ("listen", "with_keys", "error", "match"),
    [
        ("tcp://10.9.8.7", False, TransportError, "without CURVE"),
        ("tcp://127.0.0.1:5555", False, TransportError, "is not tcp://ADDRESS"),
        ("tcp://eth0", True, TransportError, "is not tcp://ADDRESS"),
        ("tcp://0.0.0.0", True, TransportError, "is a wildcard"),
        ("tcp://192.0.2.1", True, TransportError, "cannot open"),  # not this host's address
    ],
)
def test_listen_addresses_refused(
    tmp_path: Path,
    keys: KeyLayout,
    listen: str,
    with_keys: bool,
    error: type[Exception],
    match: str,
) -> None:
    curve = load_server_keys(keys.root) if with_keys else None
    with pytest.raises(error, match=match):
        TrainerPool(
            tiny_config(),
            work_dir=tmp_path,
            listen=listen,
            curve=curve,
            rank_hosts=HOSTS if with_keys else None,
        )


def test_rank_bindings_refused(tmp_path: Path, keys: KeyLayout) -> None:
    curve = load_server_keys(keys.root)
    cfg = tiny_config()
    with pytest.raises(PoolError, match=r"ranks \[1\] have no host in rank_hosts"):
        TrainerPool(cfg, work_dir=tmp_path, curve=curve, rank_hosts={0: "head"})
    with pytest.raises(PoolError, match=r"hosts \['node-9'\] have no key in the binding"):
        TrainerPool(cfg, work_dir=tmp_path, curve=curve, rank_hosts={0: "head", 1: "node-9"})
    with pytest.raises(PoolError, match="without CURVE keys"):
        TrainerPool(cfg, work_dir=tmp_path, rank_hosts=HOSTS)
    # A CURVE pool launches a rank itself only with that rank's host's key, checked first.
    pool = TrainerPool(cfg, work_dir=tmp_path, curve=curve, rank_hosts=HOSTS)
    try:
        with pytest.raises(PoolError, match="need a client key"):
            pool._launch(0)
    finally:
        pool.shutdown(timeout_s=1.0)
    pool = TrainerPool(
        cfg,
        work_dir=tmp_path,
        curve=curve,
        rank_hosts=HOSTS,
        local_client_key=keys.agent_secrets["head"],
    )
    try:
        with pytest.raises(PoolError, match="is not the key of host 'node-1'"):
            pool._launch(1)
        assert pool.workers == () and all(w.process is None for w in pool._workers.values())
    finally:
        pool.shutdown(timeout_s=1.0)


def test_worker_key_variables(tmp_path: Path, keys: KeyLayout) -> None:
    server = load_server_keys(keys.root).public.decode()
    secret = keys.agent_secrets["node-1"]
    assert client_keys_from_env({}) is None
    got = client_keys_from_env(worker_env(server, secret))
    assert got is not None and got.server_public == server.encode()
    missing = tmp_path / "nowhere.key_secret"
    public_only, shared = tmp_path / "public.key_secret", tmp_path / "shared.key_secret"
    public_only.write_bytes(keys.controller_public.read_bytes())
    shared.write_bytes(secret.read_bytes())
    public_only.chmod(0o600)
    shared.chmod(0o644)
    cases = [
        ({SERVER_ENV: server}, f"{SERVER_ENV} is set but {CLIENT_ENV} is not"),
        ({CLIENT_ENV: str(secret)}, f"{CLIENT_ENV} is set but {SERVER_ENV} is not"),
        (worker_env("short", secret), f"{SERVER_ENV}='short' is not a 40-character"),
        (worker_env(server, missing), f"{CLIENT_ENV}={missing}: key file {missing} does not"),
        (
            worker_env(server, public_only),
            f"{CLIENT_ENV}={public_only}: key file {public_only} has no secret key",
        ),
        (
            worker_env(server, shared),
            f"{CLIENT_ENV}={shared}: secret key file {shared} is readable by other users",
        ),
    ]
    for env, match in cases:
        with pytest.raises(KeyFileError) as info:
            client_keys_from_env(env)
        assert match in str(info.value), str(info.value)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_worker_with_an_unreadable_key_file_says_so(tmp_path: Path, keys: KeyLayout) -> None:
    """The worker process exits with the variable and the file named, no traceback."""
    missing = tmp_path / "gone.key_secret"
    server = load_server_keys(keys.root).public.decode()
    argv = [sys.executable, "-m", "ehp_fsm.training.worker", "--rank", "1", "--control"]
    argv += ["tcp://127.0.0.1:1", "--rendezvous", "file:///nowhere"]
    argv += ["--config", tiny_config().to_json()]
    env = {**os.environ, **worker_env(server, missing)}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=50)
    assert done.returncode == 2, done.stderr
    assert f"{CLIENT_ENV}={missing}: key file {missing} does not exist" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_frame_of_several_parts_is_dropped(tmp_path: Path, clients: Clients) -> None:
    """A message of three parts (routing id + two) is logged and dropped; the pool's receive
    used to unpack exactly two and raise, taking the coordinator down."""
    pool = TrainerPool(tiny_config(), work_dir=tmp_path)
    try:
        sock = clients.socket()
        sock.setsockopt(zmq.IDENTITY, b"trainer-1")
        pool_socket.connect(sock, pool.control, None)
        sock.send_multipart([b"one", b"two"])
        failure, logs = until_logged(
            lambda: pool.wait_ready(timeout_s=1.0), lambda logs: bool(events(logs, "frame_dropped"))
        )
        assert isinstance(failure, PoolFailure) and failure.reason == "deadline"
        dropped = events(logs, "frame_dropped")
        assert [(e["reason"], e["peer"], e["parts"]) for e in dropped] == [
            ("bad_envelope", "trainer-1", 3)
        ]
    finally:
        pool.shutdown(timeout_s=1.0)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_frame_over_the_limit_is_cut_before_the_pool_holds_it(
    tmp_path: Path, clients: Clients
) -> None:
    """libzmq takes no frame over `max_message_bytes` on the pool's channel (`zmq.MAXMSGSIZE`):
    the sender's connection is cut before the frame is held. Before, the whole frame was read
    into the run's process and only then dropped by the decoder: a 1 GiB frame from any local
    user grew the run by 2 GB. Frames within the limit still reach the pool (logged, dropped)."""
    config = replace(tiny_config(), max_message_bytes=64 * 1024)
    pool = TrainerPool(config, work_dir=tmp_path)
    try:
        assert pool._sock.getsockopt(zmq.MAXMSGSIZE) == config.max_message_bytes
        # (names with a route: not `bad_envelope`; two of them: the ROUTER's handover of one
        # name to a second connection would cut the first)
        big = plain_socket(clients, pool, routing_id("trainer-1", new_route()))
        big.send(b"\xc1" * (config.max_message_bytes + 1))
        small = plain_socket(clients, pool, routing_id("trainer-2", new_route()))
        small.send(b"\xc1")
        failure, logs = until_logged(
            lambda: pool.wait_ready(timeout_s=1.0),
            lambda logs: bool(events(logs, "frame_dropped")),
        )
        # the big frame, sent first on its own connection, is given 2 s more to arrive
        _, more = until_logged(
            lambda: pool.wait_ready(timeout_s=0.5),
            lambda logs: any(e.get("size", 0) > 1 for e in events(logs, "frame_dropped")),
            within_s=2.0,
        )
        dropped = events(logs + more, "frame_dropped")
        assert isinstance(failure, PoolFailure) and failure.reason == "deadline"
        assert dropped and all(e.get("size") == 1 for e in dropped), dropped
    finally:
        pool.shutdown(timeout_s=1.0)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_flood_of_junk_frames_is_counted_and_logged_at_a_bounded_rate(
    tmp_path: Path, clients: Clients
) -> None:
    """Any local process can send the pool's channel frames: 50,000 one-byte frames wrote
    50,002 `frame_dropped` lines (8 MB) to the run's log. Now each is counted
    (`WorkerChannel.dropped`) and the first `burst` of a reason a minute are logged; the next
    one logged says how many were left out."""
    pool = TrainerPool(tiny_config(), work_dir=tmp_path)
    try:
        sock = plain_socket(clients, pool, routing_id("trainer-1", new_route()))
        for _ in range(300):
            sock.send(b"\xc1")
        _, logs = until_logged(
            lambda: pool.wait_ready(timeout_s=0.5),
            lambda logs: pool.dropped["not_msgpack"] >= 300,
        )
        assert pool.dropped["not_msgpack"] == 300
        logged = events(logs, "frame_dropped")
        assert 1 <= len(logged) <= pool._throttle.burst, len(logged)
    finally:
        pool.shutdown(timeout_s=1.0)


def plain_socket(clients: Clients, pool: TrainerPool, name: bytes) -> zmq.Socket[bytes]:
    sock = clients.socket()
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, name)
    pool_socket.connect(sock, pool.control, None)
    return sock


def send_frame(sock: zmq.Socket[bytes], kind: Kind, sender: str, payload: dict[str, Any]) -> None:
    frame = Frame(kind=kind, id=uuid.uuid4().hex, seq=1, epoch=1, sender=sender, payload=payload)
    sock.send(encode(frame))


MALFORMED_INVENTORIES: list[dict[str, Any]] = [
    {},
    {"identity": "x"},
    {"rank": 1, "identity": {"host": 1}},
    {
        "rank": 1,
        "role": "hybrid",
        "world_size": 2,
        "identity": {"host": "h", "pid": -3, "start_time": 1.0, "launch_token": "t"},
        "version": 0,
        "grad_shapes": [],
        "standby": False,
    },
    {
        "rank": 1,
        "role": "hybrid",
        "world_size": 2,
        "identity": {"host": "h", "pid": 3, "start_time": 1.0, "launch_token": "t"},
        "version": 0,
        "grad_shapes": [["2"]],
        "standby": False,
    },
]


def test_a_malformed_hello_is_dropped_by_name(tmp_path: Path, clients: Clients) -> None:
    """A hello whose inventory lacks a field or has one of the wrong type is logged and dropped;
    it raised KeyError / IdentityError out of `wait_ready`, taking the coordinator down."""
    pool = TrainerPool(tiny_config(), work_dir=tmp_path)
    try:
        sock = plain_socket(clients, pool, routing_id("trainer-1", pool.route(1)))
        for inventory in MALFORMED_INVENTORIES:
            send_frame(sock, Kind.HELLO, "trainer-1", {"host_id": "h", "inventory": inventory})
        failure, logs = until_logged(
            lambda: pool.wait_ready(timeout_s=0.5),
            lambda logs: len(events(logs, "hello_dropped")) >= len(MALFORMED_INVENTORIES),
        )
        assert isinstance(failure, PoolFailure) and failure.reason == "deadline"
        dropped = events(logs, "hello_dropped")
        assert [e["rank"] for e in dropped] == [1] * len(MALFORMED_INVENTORIES)
        assert all(e["reason"].startswith("malformed: ") for e in dropped), dropped
        assert all(w.rank != 1 for w in pool.workers)
    finally:
        pool.shutdown(timeout_s=1.0)


def test_a_rank_has_one_name(tmp_path: Path, clients: Clients) -> None:
    """`trainer-01` or `trainer-+1` is not rank 1: its frames were taken as rank 1's (here a
    forged `worker_failed` ended the start as rank 1's error) from beside rank 1's own route."""
    pool = TrainerPool(tiny_config(), work_dir=tmp_path)
    try:
        for name in ("trainer-01", "trainer-+1", "trainer-1_0"):
            sock = plain_socket(clients, pool, routing_id(name, pool.route(1)))
            send_frame(sock, Kind.EVENT, name, {"name": "worker_failed", "data": {"error": "x"}})
        failure, logs = until_logged(
            lambda: pool.wait_ready(timeout_s=0.5),
            lambda logs: len(events(logs, "frame_dropped")) >= 3,
        )
        assert isinstance(failure, PoolFailure) and failure.reason == "deadline", failure
        dropped = [e["peer"] for e in events(logs, "frame_dropped")]
        assert sorted(dropped) == ["trainer-+1", "trainer-01", "trainer-1_0"]
    finally:
        pool.shutdown(timeout_s=1.0)


def test_a_rank_s_name_without_its_launch_route_cannot_take_the_rank_s_route(
    tmp_path: Path, clients: Clients
) -> None:
    """A process that can reach the pool's port (on loopback: any user of the machine) and knows
    a rank's name — `trainer-0`, and the pool's launch token, both in the worker's command line —
    connected under that name, spoke for the Core (here a forged `worker_failed` broke the
    pool's next command) and, by the ROUTER's handover, took the Core rank's route until the
    worker reconnected. Now a routing id holds the launch's secret route, which only the
    launched process has (its environment): the intruders' frames are dropped, and the Core's
    own worker keeps its route and answers."""
    pool = TrainerPool(tiny_config(), work_dir=tmp_path)
    try:
        pool._launch(0)
        pool._launch(1)
        assert pool.wait_ready(timeout_s=90) is None
        for name in (b"trainer-0", routing_id("trainer-0", new_route())):
            sock = plain_socket(clients, pool, name)
            forged = {"name": "worker_failed", "data": {"error": "forged"}}
            send_frame(sock, Kind.EVENT, "trainer-0", forged)
        dropped: list[str] = []
        for _ in range(50):  # the pool reads its socket while it waits for an answer
            with capture_logs() as logs:
                status = ok(pool.worker_status(0))
            assert "version" in status, status  # the pool's own rank 0 answered
            dropped += [e["reason"] for e in logs if e["event"] == "frame_dropped"]
            if len(dropped) == 2:
                break
            time.sleep(0.1)
        assert sorted(dropped) == ["bad_envelope", "unknown_route"]
        # in no command line (every user reads it): the route, the pool's launch token (it was
        # `--launch-token`, and in `--parent`); both reach the worker in its environment
        for secret in (pool.route(0), pool.launch_token):
            assert secret not in " ".join(pool.worker_argv(0))
        env = pool.worker_env(0)
        assert env[ROUTE_ENV] == pool.route(0) and env[POOL_TOKEN_ENV] == pool.launch_token
    finally:
        pool.shutdown(timeout_s=1.0)


def test_a_stray_reply_with_a_malformed_record_is_dropped(tmp_path: Path, clients: Clients) -> None:
    """A reply to no awaited command whose `record` is not a delivery record is logged and
    dropped; reading it raised KeyError out of the step's wait (`_await`), breaking the step."""
    pool = TrainerPool(tiny_config(), work_dir=tmp_path)
    try:
        sock = plain_socket(clients, pool, routing_id("trainer-1", pool.route(1)))
        for record in ({}, {"step": "0", "epoch": 0, "replica": "c0", "samples": 1, "shapes": []}):
            result = {"record": record}
            send_frame(sock, Kind.REPLY, "trainer-1", {"ref": "x", "ok": True, "result": result})
        part = partition_groups(groups=[0], live={"c0": 1}, group_size=2, step=0, epoch=0)
        collector = DeliveryCollector(part, shapes=[(3,)], deadline=5.0)
        got, logs = until_logged(
            lambda: pool._await(
                {1: "awaited"}, op="step", timeout_s=0.5, collector=collector, current_step=0
            ),
            lambda logs: len(events(logs, "stray_reply")) >= 2,
        )
        assert isinstance(got, PoolFailure) and got.reason == "deadline"
        strays = events(logs, "stray_reply")
        assert len(strays) == 2 and all("record" in e["detail"] for e in strays)
    finally:
        pool.shutdown(timeout_s=1.0)


def test_a_reply_to_another_rank_s_command_does_not_answer_it(
    tmp_path: Path, clients: Clients
) -> None:
    """Rank 1's route answering the ref the pool awaits from rank 0 is a stray, not rank 0's
    answer: `_await` took a reply by its ref alone, whichever rank sent it."""
    pool = TrainerPool(tiny_config(), work_dir=tmp_path)
    try:
        sock = plain_socket(clients, pool, routing_id("trainer-1", pool.route(1)))
        reply = {"ref": "rank0-ref", "ok": True, "result": {"version": 7}}
        send_frame(sock, Kind.REPLY, "trainer-1", reply)
        got, logs = until_logged(
            lambda: pool._await({0: "rank0-ref"}, op="status", timeout_s=0.5),
            lambda logs: bool(events(logs, "stray_reply")),
        )
        assert isinstance(got, PoolFailure) and got.reason == "deadline", got
        assert got.rank == 0
        assert [e["rank"] for e in events(logs, "stray_reply")] == [1]
    finally:
        pool.shutdown(timeout_s=1.0)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"record": {"step": 0}}, "record."),
        ({"record": None}, "record is NoneType"),
        ({"loss": "0.5"}, "loss is str"),
        ({"compute_s": None}, "compute_s is NoneType"),
        ({"compute_cpu_s": [1.0]}, "compute_cpu_s is list"),
        ({"metrics": []}, "metrics is list"),
        ({"metrics": {"tokens": 1.5}}, "metrics.tokens is float"),
        ({"metrics": {"tokens": True}}, "metrics.tokens is bool"),
        ({"metrics": {"ratio_sum": "x"}}, "metrics.ratio_sum is str"),
        ({"metrics": {"bogus": 1}}, "metrics.bogus"),
    ],
)
def test_a_compute_reply_that_cannot_be_read_is_named(change: dict[str, Any], named: str) -> None:
    """A worker's `compute` reply is checked before the step reads it (`TrainerPool.step`:
    a malformed one raised KeyError or TypeError in the step's thread; now a `worker_error`
    failure of that rank, naming the field)."""
    from ehp_fsm.training.pool_protocol import compute_reply_problem

    good: dict[str, Any] = {
        "record": {"step": 0, "epoch": 0, "replica": "c0", "samples": 2, "shapes": [[3]]},
        "loss": float("nan"),  # a number: a diverged step is the reduction's to refuse
        "metrics": {"tokens": 4, "clipped": 0, "ratio_sum": 4.0, "ratio_max": 1},
        "compute_s": 0.1,
        "compute_cpu_s": 0,
    }
    assert compute_reply_problem(good) is None
    problem = compute_reply_problem({**good, **change})
    assert problem is not None and named in problem, problem


def test_a_plain_pools_workers_do_not_inherit_pool_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain pool launches its ranks with its own environment, less any pool key variables it
    inherited (a worker would otherwise try CURVE against a plain socket and never connect)."""
    sock = pool_socket.PoolSocket(ranks=range(2))
    try:
        assert sock.curve_public is None and sock.control.startswith("tcp://127.0.0.1:")
        assert sock.launch_env(0) is None  # nothing to strip: this environment as it is
        monkeypatch.setenv(SERVER_ENV, "x" * 40)
        monkeypatch.setenv(CLIENT_ENV, "/somewhere.key_secret")
        env = sock.launch_env(0)
        assert env is not None and SERVER_ENV not in env and CLIENT_ENV not in env
        assert env["PATH"] == os.environ["PATH"]
    finally:
        sock.close()
