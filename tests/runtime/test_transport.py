"""Endpoints over real ZeroMQ sockets on 127.0.0.1; only the clock is driven by hand."""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgpack
import pytest
import zmq

from ehp_fsm.runtime import (
    Acked,
    AgentEndpoint,
    ControllerEndpoint,
    Dropped,
    DropReason,
    Frame,
    GaveUp,
    Kind,
    LinkChanged,
    PeerJoined,
    PeerRestarted,
    PeerReturned,
    PeerSilent,
    PeerUnreachable,
    Received,
    Replied,
    TransportConfig,
    TransportError,
    decode,
    encode,
    is_loopback_endpoint,
)
from tests.runtime.harness import FakeClock, Loop, auto_reply, raw_dealer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

CFG = TransportConfig(
    retry_interval_s=0.5,
    deadline_s=5.0,
    heartbeat_interval_s=1.0,
    missed_heartbeats=3,
    max_message_bytes=64 * 1024,
    # the fake clock is advanced between polls to make a peer silent or a deadline pass: with
    # own stalls discounted that time would be the endpoint's own (`test_own_stalls.py`)
    discount_own_stalls=False,
)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:  # type: ignore[type-arg]
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def ctl(clock: FakeClock) -> Iterator[ControllerEndpoint]:
    with ControllerEndpoint(config=CFG, clock=clock, epoch=1) as endpoint:
        yield endpoint


def agent_for(
    ctl_endpoint: str, clock: FakeClock, host: str = "host-a", epoch: int = 1
) -> AgentEndpoint:
    return AgentEndpoint(connect=ctl_endpoint, host_id=host, config=CFG, clock=clock, epoch=epoch)


def first_contact(router: zmq.Socket, agent: AgentEndpoint) -> bytes:  # type: ignore[type-arg]
    """Send the agent's hello to a raw ROUTER; returns the agent's routing id there."""
    agent.hello({})
    deadline = time.monotonic() + 5
    while not router.poll(10):
        assert time.monotonic() < deadline, "the agent's hello never arrived"
        agent.poll(0.01)  # the first send may precede the connection (IMMEDIATE): resend
    peer, _ = router.recv_multipart()
    return peer


def hello_done(loop: Loop, ctl: ControllerEndpoint, agent: AgentEndpoint) -> None:
    msg_id = agent.hello({"gpus": [0, 1]})
    loop.run_until(lambda: any(a.msg_id == msg_id for a in loop.of(agent.name, Acked)))


def test_command_round_trip_acts_once(ctl: ControllerEndpoint, clock: FakeClock) -> None:
    effects: dict[str, int] = {}
    with agent_for(ctl.endpoint, clock) as agent:
        loop = Loop([ctl, agent], handler=auto_reply(effects))
        hello_done(loop, ctl, agent)
        (joined,) = loop.of("controller", PeerJoined)
        assert joined.peer == "host-a" and joined.epoch == 1
        (hello,) = loop.of("controller", Received)
        assert hello.frame.kind is Kind.HELLO and hello.frame.payload["inventory"] == {
            "gpus": [0, 1]
        }
        msg_id = ctl.send_command("host-a", "launch", {"gpus": [0]})
        loop.run_until(lambda: bool(loop.of("controller", Replied)))
        (replied,) = loop.of("controller", Replied)
        assert (replied.msg_id, replied.ok, replied.result) == (msg_id, True, {"done": "launch"})
        assert effects == {msg_id: 1}
        assert ctl.in_flight == 0


def test_a_reply_within_the_turn_carries_the_ack_else_the_next_poll_sends_it(
    ctl: ControllerEndpoint, clock: FakeClock
) -> None:
    with agent_for(ctl.endpoint, clock) as agent:
        loop = Loop([ctl, agent], handler=auto_reply({}))
        hello_done(loop, ctl, agent)
        sent_before = agent.stats["sent"]
        msg_id = ctl.send_command("host-a", "launch", {})
        loop.run_until(lambda: bool(loop.of("controller", Replied)))
        assert [a.msg_id for a in loop.of("controller", Acked)][-1] == msg_id
        assert agent.stats["sent"] - sent_before == 1  # one REPLY frame, no separate ACK
        loop.handler = None  # now the agent does not reply within its turn
        slow = ctl.send_command("host-a", "stop", {})
        loop.run_until(lambda: any(a.msg_id == slow for a in loop.of("controller", Acked)))
        assert not any(r.msg_id == slow for r in loop.of("controller", Replied))
        assert ctl.stats["resent"] == 0  # acked by the agent's next poll, not after a retry


def test_retransmitted_command_is_acked_again_but_not_delivered_twice(
    ctl: ControllerEndpoint, clock: FakeClock
) -> None:
    with agent_for(ctl.endpoint, clock) as agent:
        loop = Loop([ctl, agent])  # no handler: the agent does not reply yet
        hello_done(loop, ctl, agent)
        msg_id = ctl.send_command("host-a", "stop", {})
        loop.run_until(lambda: bool(loop.of("controller", Acked)))
        for _ in range(3):  # three retransmissions while the agent is still "acting"
            clock.advance(CFG.retry_interval_s)
            loop.settle()
        assert ctl.stats["resent"] >= 3 and agent.stats["duplicates"] >= 3
        (received,) = loop.of("host-a", Received)[-1:]
        assert [
            r.frame.id for r in loop.of("host-a", Received) if r.frame.kind is Kind.COMMAND
        ] == [msg_id]
        assert len(loop.of("controller", Acked)) == 1  # later acks are not reported again
        agent.reply(received, ok=False, result="busy")
        loop.run_until(lambda: bool(loop.of("controller", Replied)))
        (replied,) = loop.of("controller", Replied)
        assert replied.ok is False and replied.result == "busy" and replied.attempts >= 4


def test_a_duplicate_after_the_reply_gets_the_stored_reply(
    clock: FakeClock,
    ctx: zmq.Context,  # type: ignore[type-arg]
) -> None:
    # A raw ROUTER plays the controller so the test can send byte-identical duplicates.
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    with agent_for(f"tcp://127.0.0.1:{port}", clock) as agent:
        peer = first_contact(router, agent)
        cmd = encode(
            Frame(
                kind=Kind.COMMAND,
                id="c-1",
                seq=1,
                epoch=3,
                sender="controller",
                payload={"op": "launch", "args": {}, "target_epoch": 1},
            )
        )
        got: list[object] = []
        router.send_multipart([peer, cmd])
        router.send_multipart([peer, cmd])
        deadline = time.monotonic() + 5
        while len([g for g in got if isinstance(g, Received)]) < 1 or agent.stats["duplicates"] < 1:
            assert time.monotonic() < deadline
            got += agent.poll(0.01)
        (received,) = [g for g in got if isinstance(g, Received)]
        agent.reply(received, ok=True, result={"pid": 42})
        router.send_multipart([peer, cmd])  # a late retransmission
        answers: list[Frame] = []
        while len([a for a in answers if a.kind is Kind.REPLY]) < 2:
            assert time.monotonic() < deadline
            agent.poll(0.01)
            while router.poll(10):
                _, data = router.recv_multipart()
                frame = decode(data)
                assert isinstance(frame, Frame)
                answers.append(frame)
        replies = [a for a in answers if a.kind is Kind.REPLY]
        assert replies[0] == replies[1]  # byte-for-byte the stored reply, not a second action
        assert replies[0].payload == {"ref": "c-1", "ok": True, "result": {"pid": 42}}
        # The first copy's ACK waits for the end of the agent's turn (then it is sent); the
        # duplicate, received while the command was being acted on, is acknowledged at once
        # (covering the first copy's if both came in one turn). The reply acks nothing more.
        acks = [a.payload["ref"] for a in answers if a.kind is Kind.ACK]
        assert acks in (["c-1"], ["c-1", "c-1"])
        assert len([g for g in got if isinstance(g, Received)]) == 1
    router.close()


def test_command_to_an_absent_agent_gives_up_at_its_deadline(
    ctl: ControllerEndpoint, clock: FakeClock
) -> None:
    with pytest.raises(TransportError, match="unknown agent"):
        ctl.send_command("ghost", "launch", {})
    with agent_for(ctl.endpoint, clock, host="ghost") as agent:
        hello_done(Loop([ctl, agent]), ctl, agent)
    time.sleep(0.05)  # let the ROUTER see the disconnect
    msg_id = ctl.send_command("ghost", "launch", {}, deadline_s=2.0)
    out = []
    for _ in range(5):
        clock.advance(0.5)
        out += ctl.poll(0)
    (gave_up,) = [o for o in out if isinstance(o, GaveUp)]
    assert (gave_up.msg_id, gave_up.reason, gave_up.acked) == (msg_id, "deadline", False)
    assert gave_up.attempts == 4 and ctl.stats["send_failed"] >= 4
    ctl.send_command("ghost", "a", {}, msg_id="fixed")
    with pytest.raises(TransportError, match="already in flight"):
        ctl.send_command("ghost", "a", {}, msg_id="fixed")


def test_silent_agent_is_reported_then_its_restart_abandons_pending_commands(
    ctl: ControllerEndpoint, clock: FakeClock
) -> None:
    agent = agent_for(ctl.endpoint, clock, epoch=1)
    loop = Loop([ctl, agent], handler=auto_reply())
    hello_done(loop, ctl, agent)
    loop.settle()  # nothing of the agent's left in flight when the clock jumps
    agent.close()  # kill: no more heartbeats
    loop.endpoints = [ctl]
    pending = ctl.send_command("host-a", "stop", {}, deadline_s=60)
    for _ in range(2):
        clock.advance(CFG.heartbeat_interval_s)
        loop.settle()
    assert loop.of("controller", PeerSilent) == []
    clock.advance(CFG.heartbeat_interval_s)
    loop.settle()
    (silent,) = loop.of("controller", PeerSilent)
    assert silent.peer == "host-a" and silent.silent_for_s >= 3.0
    assert ctl.peers()["host-a"].status.value == "silent"
    with agent_for(ctl.endpoint, clock, epoch=2) as again:  # same host, new incarnation
        loop.endpoints = [ctl, again]
        hello_done(loop, ctl, again)
        (restarted,) = loop.of("controller", PeerRestarted)
        assert (restarted.old_epoch, restarted.new_epoch) == (1, 2)
        (gave_up,) = loop.of("controller", GaveUp)
        assert (gave_up.msg_id, gave_up.reason) == (pending, "peer_restarted")
        # The new incarnation refused the command meant for its predecessor.
        assert not [r for r in loop.of("host-a", Received) if r.frame.id == pending]


def test_agent_heard_again_after_silence_is_returned(
    ctl: ControllerEndpoint, clock: FakeClock
) -> None:
    with agent_for(ctl.endpoint, clock) as agent:
        loop = Loop([ctl, agent])
        hello_done(loop, ctl, agent)
        loop.settle()  # nothing of the agent's left in flight when the clock jumps
        loop.endpoints = [ctl]  # the agent stops polling: it sends nothing
        clock.advance(4 * CFG.heartbeat_interval_s)
        loop.settle()
        assert [s.peer for s in loop.of("controller", PeerSilent)] == ["host-a"]
        loop.endpoints = [ctl, agent]
        loop.run_until(lambda: bool(loop.of("controller", PeerReturned)))
        (back,) = loop.of("controller", PeerReturned)
        assert back.epoch == 1 and back.silent_for_s >= 4.0


def test_agent_drops_frames_from_an_older_controller_epoch(
    clock: FakeClock,
    ctx: zmq.Context,  # type: ignore[type-arg]
) -> None:
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    with agent_for(f"tcp://127.0.0.1:{port}", clock) as agent:
        peer = first_contact(router, agent)
        for epoch, msg, target in ((5, "new", 1), (4, "old", 1), (5, "predecessor's", 0)):
            router.send_multipart(
                [
                    peer,
                    encode(
                        Frame(
                            kind=Kind.COMMAND,
                            id=msg,
                            seq=1,
                            epoch=epoch,
                            sender="controller",
                            payload={"op": "stop", "args": {}, "target_epoch": target},
                        )
                    ),
                ]
            )
        got: list[object] = []
        deadline = time.monotonic() + 5
        while len([g for g in got if isinstance(g, Dropped)]) < 2:
            assert time.monotonic() < deadline
            got += agent.poll(0.01)
        assert [g.frame.id for g in got if isinstance(g, Received)] == ["new"]
        assert [g.reason for g in got if isinstance(g, Dropped)] == [
            DropReason.STALE_EPOCH,
            DropReason.WRONG_INCARNATION,
        ]
    router.close()


@pytest.mark.parametrize(
    ("endpoint", "loopback"),
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.3.2.1:*", True),
        ("tcp://[::1]:5555", True),
        ("tcp://localhost:1", True),
        ("ipc:///tmp/x", True),
        ("inproc://x", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
        ("tcp://10.0.0.2:1", False),
        ("tcp://eth0:5555", False),
        ("pgm://x", False),
        ("nonsense", False),
    ],
)
def test_loopback_recognition(endpoint: str, loopback: bool) -> None:
    assert is_loopback_endpoint(endpoint) is loopback


def test_non_loopback_bind_is_refused_unless_allowed() -> None:
    with pytest.raises(TransportError, match="refusing to bind"):
        ControllerEndpoint(bind="tcp://0.0.0.0:*")
    allowed = TransportConfig(allow_non_loopback=True)
    with ControllerEndpoint(bind="tcp://0.0.0.0:*", config=allowed) as ctl:
        assert ctl.endpoint.startswith("tcp://0.0.0.0:")


def test_misuse_raises_with_a_fix(ctl: ControllerEndpoint) -> None:
    hello = Received(
        peer="a",
        frame=Frame(
            kind=Kind.HELLO,
            id="h",
            seq=1,
            epoch=1,
            sender="a",
            payload={"host_id": "a", "inventory": {}},
        ),
    )
    with pytest.raises(TransportError, match="only commands"):
        ctl.reply(hello, ok=True)
    with pytest.raises(TransportError, match="must be positive"):
        TransportConfig(retry_interval_s=0)
    ctl.close()
    with pytest.raises(TransportError, match="closed"):
        ctl.send_command("a", "x", {})


def test_live_controller_survives_hostile_frames_and_keeps_serving(
    ctl: ControllerEndpoint,
    clock: FakeClock,
    ctx: zmq.Context,  # type: ignore[type-arg]
) -> None:
    evil = raw_dealer(ctx, ctl.endpoint, b"evil")
    anon = raw_dealer(ctx, ctl.endpoint)  # no routing id: libzmq assigns a binary one
    good_frame = {
        "version": 1,
        "kind": "event",
        "id": "e",
        "seq": 1,
        "epoch": 1,
        "sender": "evil",
        "payload": {"name": "x", "data": {}},
    }
    hostile: list[tuple[list[bytes], DropReason]] = [
        ([b"\xc1\xc1"], DropReason.NOT_MSGPACK),
        ([b"\x91" * 50_000 + b"\x01"], DropReason.TOO_DEEP),
        (
            [
                msgpack.packb(
                    {
                        **good_frame,
                        "payload": {"name": "x", "data": {"e": msgpack.ExtType(1, b"zz")}},
                    }
                )
            ],
            DropReason.FORBIDDEN_TYPE,
        ),
        ([msgpack.packb({**good_frame, "version": 99})], DropReason.UNKNOWN_VERSION),
        ([msgpack.packb({**good_frame, "kind": "rm_rf"})], DropReason.UNKNOWN_KIND),
        ([msgpack.packb({**good_frame, "sender": "host-a"})], DropReason.SENDER_MISMATCH),
        (
            [
                msgpack.packb(
                    {
                        **good_frame,
                        "kind": "command",
                        "payload": {"op": "x", "args": {}, "target_epoch": 1},
                    }
                )
            ],
            DropReason.UNEXPECTED_KIND,
        ),
        ([b"part1", b"part2"], DropReason.BAD_ENVELOPE),
        ([msgpack.packb([1, 2])], DropReason.NOT_A_MAP),
    ]
    for parts, _ in hostile:
        evil.send_multipart(parts)
    anon.send(msgpack.packb(good_frame))  # claims "evil" from an anonymous id
    evil.send(b"\x00" * (CFG.max_message_bytes + 1))  # over ZMQ_MAXMSGSIZE: connection cut
    with agent_for(ctl.endpoint, clock) as agent:
        loop = Loop([ctl, agent], handler=auto_reply())
        hello_done(loop, ctl, agent)
        loop.run_until(lambda: len(loop.of("controller", Dropped)) >= len(hostile) + 1)
        msg_id = ctl.send_command("host-a", "launch", {})
        loop.run_until(lambda: bool(loop.of("controller", Replied)))
        assert loop.of("controller", Replied)[0].msg_id == msg_id
    reasons = [d.reason for d in loop.of("controller", Dropped)]
    assert sorted(reasons) == sorted([r for _, r in hostile] + [DropReason.SENDER_MISMATCH])
    assert not [d for d in loop.of("controller", Dropped) if d.reason is DropReason.OVERSIZED]
    # The oversized frame never reached the application, and no frame from the hostile
    # peers was delivered as a message.
    assert {r.peer for r in loop.of("controller", Received)} == {"host-a"}
    assert "evil" not in ctl.peers()
    evil.close()
    anon.close()


def test_live_agent_survives_hostile_frames(
    clock: FakeClock,
    ctx: zmq.Context,  # type: ignore[type-arg]
) -> None:
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    with agent_for(f"tcp://127.0.0.1:{port}", clock) as agent:
        peer = first_contact(router, agent)
        router.send_multipart([peer, b"\xc1" * 10])
        router.send_multipart([peer, b"a", b"b"])
        router.send_multipart(
            [
                peer,
                encode(
                    Frame(
                        kind=Kind.REPLY,
                        id="r",
                        seq=1,
                        epoch=1,
                        sender="controller",
                        payload={"ref": "x", "ok": True, "result": None},
                    )
                ),
            ]
        )
        router.send_multipart(
            [
                peer,
                encode(
                    Frame(
                        kind=Kind.COMMAND,
                        id="ok",
                        seq=2,
                        epoch=1,
                        sender="controller",
                        payload={"op": "x", "args": {}, "target_epoch": 1},
                    )
                ),
            ]
        )
        got: list[object] = []
        deadline = time.monotonic() + 5
        while not any(isinstance(g, Received) for g in got):
            assert time.monotonic() < deadline
            got += agent.poll(0.01)
        reasons = sorted(g.reason for g in got if isinstance(g, Dropped))
        assert reasons == sorted(
            [DropReason.NOT_MSGPACK, DropReason.BAD_ENVELOPE, DropReason.UNEXPECTED_KIND]
        )
    router.close()


def test_a_busy_controller_is_waited_for_a_dropped_connection_is_opened_afresh(
    ctl: ControllerEndpoint, clock: FakeClock
) -> None:
    """The agent's side of `tests/run/test_controller_frozen.py`. A controller that does not
    poll (a long training step blocks its loop) is silent but its connection stands: the agent
    keeps it (reconnecting would cost the controller a quarantine of the host). Once libzmq has
    dropped the connection (here: the controller's socket is closed and rebound on the same
    address, as a frozen controller's side times out), the agent opens a fresh connection once
    per silence window while the controller stays silent, and stops once it hears it again."""
    with agent_for(ctl.endpoint, clock) as agent:
        loop = Loop([ctl, agent])
        hello_done(loop, ctl, agent)
        loop.settle()
        window = CFG.heartbeat_interval_s * (CFG.missed_heartbeats + 1)
        loop.endpoints = [agent]  # the controller is busy: it sends nothing
        for _ in range(3):
            clock.advance(window)
            loop.settle()
        assert [s.peer for s in loop.of("host-a", PeerSilent)] == ["controller"]
        assert agent.stats["reconnects"] == 0  # its connection stands: kept
        loop.endpoints = [ctl, agent]
        loop.run_until(lambda: bool(loop.of("host-a", PeerReturned)))
        # The connection drops: a new controller endpoint on the same address (same epoch, so
        # the agent takes its frames as the same controller's).
        address, epoch = ctl.endpoint, ctl.epoch
        ctl.close()
        deadline = time.monotonic() + 10
        while agent._dropped_at is None and time.monotonic() < deadline:
            agent.poll(0.05)
        assert agent._dropped_at is not None  # libzmq reported it
        again = ControllerEndpoint(bind=address, config=CFG, clock=clock, epoch=epoch)
        try:
            loop.endpoints = [agent]  # its loop blocked: the agent cannot tell it from parked
            for n in (1, 2):  # replaced after pauses that double (2 s, then 4 s: <= a window)
                clock.advance(window)
                loop.settle()
                assert agent.stats["reconnects"] == n
            loop.endpoints = [again, agent]
            returned = len(loop.of("host-a", PeerReturned))
            for _ in range(10):  # the new controller hears the agent, then heartbeats it
                clock.advance(CFG.heartbeat_interval_s / 2)
                loop.settle()
                if len(loop.of("host-a", PeerReturned)) > returned:
                    break
            assert len(loop.of("host-a", PeerReturned)) > returned
            made = agent.stats["reconnects"]
            for _ in range(4):  # heartbeats both ways: heard, so no more fresh connections
                clock.advance(CFG.heartbeat_interval_s)
                loop.settle()
            assert agent.stats["reconnects"] == made
            msg = again.send_command("host-a", "report", {})  # the new connection carries it
            loop.run_until(lambda: any(r.frame.id == msg for r in loop.of("host-a", Received)))
        finally:
            again.close()


def _handshake(loop: Loop, agent: AgentEndpoint) -> None:
    """Poll until the agent's current connection has completed its ZMTP handshake (since it
    was last dropped or replaced)."""

    def done() -> bool:
        changes = [c.what for c in loop.of(agent.name, LinkChanged)]
        ends = [i for i, what in enumerate(changes) if what in ("disconnected", "reconnected")]
        return "handshake_succeeded" in changes[(ends[-1] if ends else -1) + 1 :]

    loop.run_until(done)


def test_a_connection_parked_behind_its_routing_id_is_replaced_after_pauses_that_double(
    ctl: ControllerEndpoint,
    clock: FakeClock,
    ctx: zmq.Context,  # type: ignore[type-arg]
) -> None:
    """What a frozen controller's agents meet at its resume, made to last: the controller's
    ROUTER (no handover) still holds the agent's routing id for another connection (here a
    squatter's; at a resume, the agent's own dead one), so each new connection of the agent
    completes its handshake and is parked: the controller hears "host-a" and heartbeats it,
    the agent hears nothing, and libzmq reports nothing dropped. The agent replaces such a
    connection (`unheard`: here its handshake did not wait in a frozen controller's queue)
    after 2 heartbeat intervals, then 4, 8, up to four silence windows (12); once the id is
    free, the next one is attached, the controller is heard, and the pauses start over."""
    with agent_for(ctl.endpoint, clock) as agent:
        loop = Loop([ctl, agent])
        hello_done(loop, ctl, agent)
        address, epoch = ctl.endpoint, ctl.epoch
        ctl.close()  # the agent's connection drops
        loop.endpoints = [agent]
        loop.run_until(lambda: agent.connection_dropped)
        # A controller on another port, where the squatter takes "host-a"; then on the agent's.
        again = ControllerEndpoint(config=CFG, clock=clock, epoch=epoch)
        try:
            squatter = raw_dealer(ctx, again.endpoint, routing_id=b"host-a")
            squatter.send(
                encode(
                    Frame.unchecked(
                        kind=Kind.HEARTBEAT, id="sq-1", seq=1, epoch=1, sender="host-a", payload={}
                    )
                )
            )
            loop.endpoints = [again, agent]
            loop.run_until(lambda: bool(loop.of("controller", PeerJoined)))
            again._socket.bind(address)  # the agent's pending reconnection lands here: parked
            _handshake(loop, agent)
            clock.advance(CFG.heartbeat_interval_s * CFG.missed_heartbeats)  # silent
            loop.settle()  # and the parked connection is replaced (2 intervals are past)
            assert [s.peer for s in loop.of("host-a", PeerSilent)] == ["controller"]
            made = agent.stats["reconnects"]
            assert made == 1
            for pause in (4.0, 8.0):  # × heartbeat interval (1 s here)
                _handshake(loop, agent)
                clock.advance(pause - 0.1)
                loop.settle()
                assert agent.stats["reconnects"] == made  # not yet
                clock.advance(0.2)
                loop.settle()
                made += 1
                assert agent.stats["reconnects"] == made
            whys = [c.why for c in loop.of("host-a", LinkChanged) if c.what == "reconnected"]
            assert whys == ["unheard"] * 3
            assert squatter.poll(0)  # the controller's heartbeats went to the squatter
            assert not loop.of("host-a", PeerReturned)  # and none reached the agent
            squatter.close()
            loop.settle()  # the controller's turns release the id; the agent's is still parked
            again.send_command("host-a", "report", {})  # no connection holds "host-a": said
            loop.settle()
            assert [u.peer for u in loop.of("controller", PeerUnreachable)] == ["host-a"]
            _handshake(loop, agent)  # still parked: it came while the squatter held the id
            clock.advance(12.0 - 0.1)
            loop.settle()
            assert agent.stats["reconnects"] == made
            clock.advance(0.2)
            loop.settle()
            assert agent.stats["reconnects"] == made + 1
            for _ in range(4):  # attached: the controller's heartbeat reaches the agent
                clock.advance(CFG.heartbeat_interval_s)
                loop.settle()
            assert loop.of("host-a", PeerReturned)
            assert not agent.connection_dropped and agent.stats["reconnects"] == made + 1
            assert agent._patience_s == 2 * CFG.heartbeat_interval_s  # starts over
        finally:
            again.close()
