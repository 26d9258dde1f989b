"""Retry, dedup and liveness bookkeeping, driven by explicit times (no sockets)."""

from __future__ import annotations

import pytest

from ehp_fsm.runtime import Kind, TransportError
from ehp_fsm.runtime.reliability import (
    DedupCache,
    DedupState,
    Heard,
    LivenessTracker,
    Outbox,
    PeerStatus,
)


def add(
    box: Outbox,
    msg_id: str,
    *,
    now: float = 0.0,
    deadline: float = 10.0,
    reply: bool = True,
    peer: str = "a",
) -> None:
    box.add(
        msg_id=msg_id,
        peer=peer,
        kind=Kind.COMMAND,
        data=b"x",
        now=now,
        deadline=deadline,
        completes_on_reply=reply,
    )


def test_outbox_retries_on_its_interval_until_the_deadline() -> None:
    box = Outbox(retry_interval_s=1.0)
    add(box, "m", deadline=3.5)
    assert box.due(0.9) == []
    assert [e.attempts for e in box.due(1.0)] == [2]
    assert box.due(1.5) == []
    assert [e.attempts for e in box.due(2.0)] == [3]
    assert box.expired(3.4) == []
    (gone,) = box.expired(3.5)
    assert gone.msg_id == "m" and len(box) == 0
    assert box.next_timer() is None


def test_ack_finishes_events_but_commands_wait_for_their_reply() -> None:
    box = Outbox(retry_interval_s=1.0)
    add(box, "cmd", reply=True)
    add(box, "evt", reply=False)
    entry, finished = box.on_ack("cmd", "a", 0.2)
    assert entry is not None and not finished and "cmd" in box
    assert box.on_ack("cmd", "a", 0.3) == (None, False)  # only the first ack counts
    entry, finished = box.on_ack("evt", "a", 0.2)
    assert finished and "evt" not in box
    assert box.on_reply("cmd", "other-peer") is None  # a reply from the wrong peer is ignored
    assert box.on_reply("cmd", "a") is not None and len(box) == 0
    assert box.on_reply("cmd", "a") is None  # a duplicate reply finds nothing


def test_outbox_refuses_a_duplicate_id_and_abandons_by_peer() -> None:
    box = Outbox(retry_interval_s=1.0)
    add(box, "m")
    with pytest.raises(TransportError, match="already in flight"):
        add(box, "m")
    add(box, "n", peer="b")
    assert [e.msg_id for e in box.abandon_peer("a")] == ["m"]
    assert len(box) == 1
    with pytest.raises(TransportError, match="positive"):
        Outbox(retry_interval_s=0)


def test_dedup_is_bounded_and_remembers_replies() -> None:
    cache = DedupCache(capacity=2)
    cache.admit("a", "1", state=DedupState.ACTING)
    assert cache.record_reply("a", "1", b"R1")
    entry = cache.lookup("a", "1")
    assert entry is not None and entry.state is DedupState.DONE and entry.reply == b"R1"
    assert cache.lookup("b", "1") is None  # ids are per peer
    cache.admit("a", "2", state=DedupState.DONE)
    cache.lookup("a", "1")  # touch: "2" is now the least recently seen
    cache.admit("a", "3", state=DedupState.DONE)
    assert cache.lookup("a", "2") is None and cache.lookup("a", "1") is not None
    assert len(cache) == 2 and cache.evictions == 1
    assert not cache.record_reply("a", "2", b"late")


def test_liveness_reports_silence_once_and_tells_return_from_restart() -> None:
    live = LivenessTracker(heartbeat_interval_s=1.0, missed=3)
    assert live.heard("a", 5, 0.0)[0] is Heard.NEW
    assert live.heard("a", 5, 1.0)[0] is Heard.SAME
    assert live.newly_silent(3.9) == []
    assert [p for p, _ in live.newly_silent(4.0)] == ["a"]
    assert live.newly_silent(9.0) == []  # reported once
    assert live.get("a").status is PeerStatus.SILENT  # type: ignore[union-attr]
    assert live.heard("a", 5, 9.5)[0] is Heard.RETURNED
    assert live.heard("a", 4, 9.6)[0] is Heard.STALE  # an old incarnation's late frame
    assert live.heard("a", 6, 9.7)[0] is Heard.RESTARTED
    assert live.get("a").epoch == 6  # type: ignore[union-attr]
    assert live.next_timer() == pytest.approx(12.7)
    with pytest.raises(TransportError, match="missed >= 1"):
        LivenessTracker(heartbeat_interval_s=1.0, missed=0)
