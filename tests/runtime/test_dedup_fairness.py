"""One peer cannot make the controller forget another peer's message ids.

The dedup memory (`reliability.DedupCache`) is what makes a retransmitted reliable message
acted on once. It had one least-recently-seen order for every peer: a host that sent as many
events as the memory holds (junk events its key still lets it send) made the controller forget
another host's ids, and the next retransmission of that host's message (its ack lost) was
acted on a second time. Now a full memory forgets the newcomer's own oldest id when it holds
more than its share.
"""

from __future__ import annotations

import time

import msgpack
import zmq

from ehp_fsm.runtime import ControllerEndpoint, TransportConfig
from ehp_fsm.runtime.deliveries import Received
from ehp_fsm.runtime.reliability import DedupCache, DedupState


def test_a_flooding_peer_evicts_its_own_ids_not_anothers() -> None:
    cache = DedupCache(capacity=100)
    for i in range(10):
        cache.admit("a", f"a{i}", state=DedupState.DONE)
    for i in range(1000):
        cache.admit("b", f"b{i}", state=DedupState.DONE)
    assert all(cache.lookup("a", f"a{i}") is not None for i in range(10))
    assert len(cache) == 100 and cache.evictions == 910
    assert cache.lookup("b", "b999") is not None and cache.lookup("b", "b0") is None
    # a peer under its share still gets room: the least recently seen id of all goes
    cache.admit("c", "c0", state=DedupState.DONE)
    assert cache.lookup("c", "c0") is not None and len(cache) == 100
    assert all(cache.lookup("a", f"a{i}") is not None for i in range(10))


def test_one_peer_alone_keeps_the_most_recent_ids() -> None:
    cache = DedupCache(capacity=3)
    for i in range(5):
        cache.admit("a", str(i), state=DedupState.DONE)
    assert [cache.lookup("a", str(i)) is not None for i in range(5)] == [False, False] + [True] * 3
    one = DedupCache(capacity=1)
    one.admit("a", "x", state=DedupState.DONE)
    one.admit("b", "y", state=DedupState.DONE)  # (a's only id goes: the memory holds one)
    assert one.lookup("b", "y") is not None and one.lookup("a", "x") is None


def test_a_hosts_retransmission_is_not_acted_on_again_after_another_hosts_flood() -> None:
    """Real ZeroMQ sockets: host-b sends as many events as the controller remembers, then
    host-a's first event arrives again (a retransmission). Before: delivered twice."""
    config = TransportConfig(dedup_capacity=1000)
    ctx = zmq.Context()
    try:
        with ControllerEndpoint(config=config, epoch=1) as ctl:

            def dealer(name: bytes) -> zmq.Socket[bytes]:
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.ROUTING_ID, name)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(ctl.endpoint)
                return s

            def event(sender: str, i: int) -> bytes:
                frame = {
                    "version": 1,
                    "kind": "event",
                    "id": f"{sender}-{i}",
                    "seq": i,
                    "epoch": 1,
                    "sender": sender,
                    "payload": {"name": "exited", "data": {}},
                }
                return msgpack.packb(frame)

            def delivered(want: int, wait_s: float) -> int:
                got, end = 0, time.monotonic() + wait_s
                while time.monotonic() < end and got < want:
                    got += sum(isinstance(d, Received) for d in ctl.poll(0.05))
                return got

            a, b = dealer(b"host-a"), dealer(b"host-b")
            try:
                a.send(event("host-a", 1))
                assert delivered(1, 10.0) == 1
                for i in range(1000):
                    b.send(event("host-b", i))
                assert delivered(1000, 30.0) == 1000
                a.send(event("host-a", 1))  # the retransmission
                assert delivered(1, 1.0) == 0
            finally:
                a.close()
                b.close()
    finally:
        ctx.term()
