"""Frames: encode/decode round trips and every way hostile bytes are refused (as values)."""

from __future__ import annotations

import datetime

import msgpack
import pytest
import structlog
import structlog.testing
from hypothesis import given
from hypothesis import strategies as st

from ehp_fsm.runtime import Dropped, DropReason, Frame, FrameError, Kind, decode, encode
from ehp_fsm.runtime.protocol import PROTOCOL_VERSION, process_entry


def wire(**overrides: object) -> dict[str, object]:
    base: dict[str, object] = {
        "version": PROTOCOL_VERSION,
        "kind": "command",
        "id": "m-1",
        "seq": 1,
        "epoch": 7,
        "sender": "controller",
        "payload": {"op": "launch", "args": {"gpus": [0, 1]}, "target_epoch": 1},
    }
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not REMOVE}


REMOVE = object()


def reason_of(data: bytes, **kw: int) -> DropReason:
    got = decode(data, **kw)  # type: ignore[arg-type]
    assert isinstance(got, Dropped), got
    assert got.size == len(data)
    return got.reason


def test_round_trip_every_kind() -> None:
    payloads = {
        Kind.HELLO: {"host_id": "a", "inventory": {"gpus": [0, 1]}},
        Kind.COMMAND: {"op": "stop", "args": {"pid": 3}, "target_epoch": 2},
        Kind.ACK: {"ref": "m-0"},
        Kind.REPLY: {"ref": "m-0", "ok": False, "result": {"why": "x", "blob": b"\x00"}},
        Kind.EVENT: {"name": "exited", "data": {"code": -9}},
        Kind.HEARTBEAT: {},
        Kind.RECONCILE: {
            "processes": [
                process_entry(
                    {"host": "a", "pid": 9, "start_time": 1.5, "launch_token": "t"}, role="engine"
                )
            ]
        },
    }
    assert set(payloads) == set(Kind)
    for kind, payload in payloads.items():
        frame = Frame(kind=kind, id="m-1", seq=3, epoch=2, sender="s", payload=payload)
        assert decode(encode(frame)) == frame


@pytest.mark.parametrize(
    ("obj", "reason"),
    [
        (wire(version=2), DropReason.UNKNOWN_VERSION),
        (wire(version="1"), DropReason.WRONG_TYPE),
        (wire(version=REMOVE), DropReason.MISSING_FIELD),
        (wire(kind="launch_missiles"), DropReason.UNKNOWN_KIND),
        (wire(kind=3), DropReason.WRONG_TYPE),
        (wire(id=REMOVE), DropReason.MISSING_FIELD),
        (wire(id=""), DropReason.WRONG_TYPE),
        (wire(id="x" * 65), DropReason.WRONG_TYPE),
        (wire(seq=-1), DropReason.WRONG_TYPE),
        (wire(seq=True), DropReason.WRONG_TYPE),
        (wire(epoch=1.5), DropReason.WRONG_TYPE),
        (wire(sender=b"controller"), DropReason.WRONG_TYPE),
        (wire(payload=[1]), DropReason.WRONG_TYPE),
        (wire(extra=1), DropReason.UNKNOWN_FIELD),
        (wire(payload={"op": "x", "target_epoch": 1}), DropReason.MISSING_FIELD),
        (wire(payload={"op": 1, "args": {}, "target_epoch": 1}), DropReason.WRONG_TYPE),
        (
            wire(payload={"op": "x", "args": {}, "target_epoch": 1, "sneak": 1}),
            DropReason.UNKNOWN_FIELD,
        ),
        (wire(kind="reply", payload={"ref": "a", "ok": 1, "result": None}), DropReason.WRONG_TYPE),
        (
            wire(kind="reconcile", payload={"processes": [{"host": "a", "pid": True}]}),
            DropReason.WRONG_TYPE,
        ),
        (wire(kind="reconcile", payload={"processes": [1]}), DropReason.WRONG_TYPE),
        ([1, 2, 3], DropReason.NOT_A_MAP),
        ("hello", DropReason.NOT_A_MAP),
    ],
)
def test_schema_violations_are_dropped_with_reason(obj: object, reason: DropReason) -> None:
    assert reason_of(msgpack.packb(obj, use_bin_type=True)) == reason


def test_oversized_is_refused_before_decoding() -> None:
    # Not even msgpack: if decode looked at it, the reason would be not_msgpack.
    assert reason_of(b"\xc1" * 2048, max_bytes=1024) == DropReason.OVERSIZED


def test_hostile_byte_strings() -> None:
    assert reason_of(b"") == DropReason.NOT_MSGPACK
    assert reason_of(b"\xc1") == DropReason.NOT_MSGPACK  # reserved byte
    assert reason_of(b"\x81\xa1k") == DropReason.NOT_MSGPACK  # truncated map
    assert reason_of(b"\x92\x01") == DropReason.NOT_MSGPACK  # array of 2, one present
    assert reason_of(b"\xdd\xff\xff\xff\xff") == DropReason.NOT_MSGPACK  # 4G array header
    assert reason_of(msgpack.packb(1) + b"\x01") == DropReason.TRAILING_BYTES
    assert reason_of(b"\xa2\xff\xfe") == DropReason.NOT_MSGPACK  # invalid utf-8 str


def test_extension_types_and_timestamps_are_refused() -> None:
    ext = msgpack.packb(
        wire(payload={"op": "x", "args": {"e": msgpack.ExtType(5, b"abc")}, "target_epoch": 1})
    )
    assert reason_of(ext) == DropReason.FORBIDDEN_TYPE
    when = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    ts = msgpack.packb(
        wire(payload={"op": "x", "args": {"t": when}, "target_epoch": 1}), datetime=True
    )
    assert reason_of(ts) == DropReason.FORBIDDEN_TYPE


def test_non_string_map_keys_are_refused() -> None:
    data = msgpack.packb(
        wire(payload={"op": "x", "args": {1: 2}, "target_epoch": 1}), strict_types=False
    )
    assert reason_of(data) == DropReason.NOT_MSGPACK  # strict_map_key refuses int keys


def test_nesting_bombs() -> None:
    deep = b"\x91" * 100_000 + b"\x01"  # 100k nested one-element arrays, 100 kB
    assert reason_of(deep, max_bytes=1 << 20) == DropReason.TOO_DEEP
    nested: object = 1
    for _ in range(40):
        nested = {"a": nested}
    assert reason_of(
        msgpack.packb(wire(payload={"op": "x", "args": nested, "target_epoch": 1}))
    ) == (DropReason.TOO_DEEP)


def test_building_a_bad_frame_raises_with_a_fix() -> None:
    with pytest.raises(FrameError, match="Fix:"):
        Frame(kind=Kind.COMMAND, id="m", seq=1, epoch=1, sender="c", payload={"op": "x"})
    with pytest.raises(FrameError, match="plain msgpack"):
        Frame(
            kind=Kind.COMMAND,
            id="m",
            seq=1,
            epoch=1,
            sender="c",
            payload={"op": "x", "args": {"o": object()}, "target_epoch": 1},
        )
    big = Frame(
        kind=Kind.COMMAND,
        id="m",
        seq=1,
        epoch=1,
        sender="c",
        payload={"op": "x", "args": {"b": b"x" * 5000}, "target_epoch": 1},
    )
    with pytest.raises(FrameError, match="maximum message size"):
        encode(big, max_bytes=4096)


def test_dropped_log_fields_are_plain() -> None:
    got = decode(b"\xc1", peer="p")
    assert isinstance(got, Dropped)
    with structlog.testing.capture_logs() as logs:
        structlog.get_logger().warning("frame_dropped", **got.log_fields())
    assert logs == [
        {
            "event": "frame_dropped",
            "log_level": "warning",
            "reason": "not_msgpack",
            "detail": got.detail,
            "size": 1,
            "peer": "p",
        }
    ]
    assert got.log_fields() == {
        "reason": "not_msgpack",
        "detail": got.detail,
        "size": 1,
        "peer": "p",
    }


@given(st.binary(max_size=512))
def test_decode_never_raises_on_random_bytes(data: bytes) -> None:
    assert isinstance(decode(data, max_bytes=256), Frame | Dropped)


plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


@given(
    kind=st.sampled_from([Kind.COMMAND, Kind.EVENT]),
    args=st.dictionaries(st.text(max_size=8), plain, max_size=5),
    seq=st.integers(0, 2**63 - 1),
    epoch=st.integers(0, 2**63 - 1),
)
def test_valid_frames_round_trip(kind: Kind, args: dict, seq: int, epoch: int) -> None:  # type: ignore[type-arg]
    payload = (
        {"op": "x", "args": args, "target_epoch": 1}
        if kind is Kind.COMMAND
        else {"name": "x", "data": args}
    )
    frame = Frame(kind=kind, id="m", seq=seq, epoch=epoch, sender="s", payload=payload)
    assert decode(encode(frame)) == frame


@given(st.binary(min_size=1, max_size=64), st.integers(0, 200))
def test_mutated_valid_frames_never_raise(noise: bytes, at: int) -> None:
    good = encode(
        Frame(
            kind=Kind.EVENT,
            id="m",
            seq=1,
            epoch=1,
            sender="s",
            payload={"name": "n", "data": {"k": [1, 2.5, "v"]}},
        )
    )
    at = min(at, len(good))
    mutated = good[:at] + noise + good[at + len(noise) :]
    got = decode(mutated)
    assert isinstance(got, Frame | Dropped)
