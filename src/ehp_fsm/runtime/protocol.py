"""The control-plane wire format: versioned msgpack frames and their strict validation.

Knows: the frame schema (version, kind, message id, sequence, epoch, sender, payload), the
payload schema of every kind, the size and nesting limits, and how to turn bytes into either a
`Frame` or a `Dropped` value with a reason. Decoding never raises and never unpickles: bytes are
size-checked *before* msgpack sees them, msgpack runs with `raw=False`, `strict_map_key=True`,
length limits and an extension hook that refuses every extension type, and the decoded value is
walked with a depth limit and a whitelist of plain types.

Does not know: sockets, retries, peers or time (see `transport` and `reliability`), nor what a
command *means* (`op` and `args` belong to the controller and the agent).

Field meanings:
- `id`: message id, unique per logical message; a retransmission reuses it (dedup key).
- `seq`: the sender's per-incarnation counter, +1 per *new* message (retransmissions keep theirs).
  Diagnostic only: the receiver never reorders or rejects by `seq`.
- `epoch`: the sender's incarnation. The controller's epoch fences stale controllers (agents drop
  frames from a controller epoch lower than one they have seen); an agent's epoch grows when the
  agent restarts, which is how the controller tells a restart from a reconnect.
- `sender`: the sender's name; the controller checks it equals the socket's routing id.
- A COMMAND's payload names the agent incarnation it is meant for (`target_epoch`): a restarted
  agent drops commands meant for its predecessor instead of acting on them.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import msgpack

from ehp_fsm.runtime.errors import FrameError

PROTOCOL_VERSION: Final = 1
SUPPORTED_VERSIONS: Final = frozenset({PROTOCOL_VERSION})
DEFAULT_MAX_MESSAGE_BYTES: Final = 1 << 20
DEFAULT_MAX_DEPTH: Final = 16
MAX_NAME_CHARS: Final = 128
MAX_ID_CHARS: Final = 64
MAX_CONTAINER_LEN: Final = 100_000
_INT64_MAX: Final = 2**63 - 1


class Kind(enum.StrEnum):
    """What a frame is. Reliable kinds are retried until acknowledged (or replied to)."""

    HELLO = "hello"  # agent → controller: I am host X, here is my inventory
    COMMAND = (
        "command"  # controller → agent: do `op` with `args`; acked (a reply acks too), replied
    )
    ACK = "ack"  # either way: I received message `ref` (it will not be acted on twice)
    REPLY = "reply"  # agent → controller: command `ref` finished, `ok`, `result`
    EVENT = "event"  # agent → controller: something happened (`name`, `data`)
    HEARTBEAT = "heartbeat"  # either way: I am alive (never acknowledged)
    RECONCILE = "reconcile"  # agent → controller: the processes I actually run


#: Kinds the sender retries until the receiver acknowledges them.
RELIABLE_KINDS: Final = frozenset({Kind.HELLO, Kind.COMMAND, Kind.EVENT, Kind.RECONCILE})
#: Reliable kinds that are finished by a REPLY rather than by an ACK.
REPLIED_KINDS: Final = frozenset({Kind.COMMAND})


class DropReason(enum.StrEnum):
    """Why an incoming frame was dropped. Stable strings: they go into logs."""

    OVERSIZED = "oversized"
    NOT_MSGPACK = "not_msgpack"
    TRAILING_BYTES = "trailing_bytes"
    TOO_DEEP = "too_deep"
    FORBIDDEN_TYPE = "forbidden_type"
    NOT_A_MAP = "not_a_map"
    MISSING_FIELD = "missing_field"
    UNKNOWN_FIELD = "unknown_field"
    WRONG_TYPE = "wrong_type"
    UNKNOWN_VERSION = "unknown_version"
    UNKNOWN_KIND = "unknown_kind"
    BAD_ENVELOPE = "bad_envelope"
    SENDER_MISMATCH = "sender_mismatch"
    KEY_NOT_BOUND = "key_not_bound"
    STALE_EPOCH = "stale_epoch"
    WRONG_INCARNATION = "wrong_incarnation"
    UNEXPECTED_KIND = "unexpected_kind"
    UNKNOWN_REF = "unknown_ref"


@dataclass(frozen=True, kw_only=True, slots=True)
class Dropped:
    """An incoming frame that was refused. Log it; never act on it."""

    reason: DropReason
    detail: str
    size: int
    peer: str = ""

    def log_fields(self) -> dict[str, Any]:
        """Fields for one log record: `log.warning("frame_dropped", **d.log_fields())`."""
        return {
            "reason": str(self.reason),
            "detail": self.detail,
            "size": self.size,
            "peer": self.peer,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class Frame:
    """One control-plane message. `payload`'s schema depends on `kind` (see `PAYLOAD_SCHEMA`)."""

    kind: Kind
    id: str
    seq: int
    epoch: int
    sender: str
    payload: Mapping[str, Any] = field(default_factory=dict)
    version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        if type(self.kind) is str and self.kind in _KIND_BY_VALUE:
            object.__setattr__(self, "kind", _KIND_BY_VALUE[self.kind])  # "ack" → Kind.ACK
        problem = _check_plain(self.payload, 1, DEFAULT_MAX_DEPTH)
        if problem is None:
            problem = _check_envelope(
                {
                    "version": self.version,
                    "kind": str(self.kind),
                    "id": self.id,
                    "seq": self.seq,
                    "epoch": self.epoch,
                    "sender": self.sender,
                    "payload": self.payload,
                }
            )
        if problem is None:
            problem = _check_payload(Kind(self.kind), self.payload)
        if problem is not None:
            raise FrameError(
                f"cannot build a {self.kind!s} frame",
                f"{problem[0]}: {problem[1]}",
                "pass plain msgpack types (None, bool, int, float, str, bytes, list, dict with "
                "str keys) in the payload shape `protocol.PAYLOAD_SCHEMA` gives for this kind",
            )

    @classmethod
    def unchecked(
        cls,
        *,
        kind: Kind,
        id: str,
        seq: int,
        epoch: int,
        sender: str,
        payload: Mapping[str, Any],
        version: int = PROTOCOL_VERSION,
    ) -> Frame:
        """Build without validation. Only for frames already validated (decoded) or made by
        the transport from values it controls; everything else goes through the constructor."""
        frame = object.__new__(cls)
        _SET_KIND(frame, kind)
        _SET_ID(frame, id)
        _SET_SEQ(frame, seq)
        _SET_EPOCH(frame, epoch)
        _SET_SENDER(frame, sender)
        _SET_PAYLOAD(frame, payload)
        _SET_VERSION(frame, version)
        return frame

    @property
    def ref(self) -> str:
        """The message id an ACK or REPLY answers ("" for other kinds)."""
        ref = self.payload.get("ref", "")
        return ref if isinstance(ref, str) else ""

    def to_wire(self) -> dict[str, Any]:
        payload = self.payload
        return {
            "version": self.version,
            "kind": self.kind.value if type(self.kind) is Kind else str(self.kind),
            "id": self.id,
            "seq": self.seq,
            "epoch": self.epoch,
            "sender": self.sender,
            "payload": payload if type(payload) is dict else dict(payload),
        }


# Slot setters: `unchecked` fills a frozen frame without `object.__setattr__` per field (the
# decode path builds one frame per message received).
_FRAME_SLOTS: Final = Frame.__dict__  # slot name → member descriptor
_SET_KIND = _FRAME_SLOTS["kind"].__set__
_SET_ID = _FRAME_SLOTS["id"].__set__
_SET_SEQ = _FRAME_SLOTS["seq"].__set__
_SET_EPOCH = _FRAME_SLOTS["epoch"].__set__
_SET_SENDER = _FRAME_SLOTS["sender"].__set__
_SET_PAYLOAD = _FRAME_SLOTS["payload"].__set__
_SET_VERSION = _FRAME_SLOTS["version"].__set__


# ---- payload schema ------------------------------------------------------------------------

_Types = frozenset[type] | None  # exact types accepted (None: any plain value)
_Spec = tuple[_Types, bool]  # (types, required)
_STR: Final = frozenset({str})
_INT: Final = frozenset({int})  # exact: a bool is not an int here
_DICT: Final = frozenset({dict})
_LIST: Final = frozenset({list})
_BOOL: Final = frozenset({bool})
_NUMBER: Final = frozenset({int, float})
_MISSING: Final = object()

#: For each kind, payload key → (accepted exact types, required). No other keys are accepted.
PAYLOAD_SCHEMA: Final[Mapping[Kind, Mapping[str, _Spec]]] = {
    Kind.HELLO: {"host_id": (_STR, True), "inventory": (_DICT, True)},
    Kind.COMMAND: {"op": (_STR, True), "args": (_DICT, True), "target_epoch": (_INT, True)},
    Kind.ACK: {"ref": (_STR, True)},
    Kind.REPLY: {"ref": (_STR, True), "ok": (_BOOL, True), "result": (None, True)},
    Kind.EVENT: {"name": (_STR, True), "data": (_DICT, True)},
    Kind.HEARTBEAT: {},
    Kind.RECONCILE: {"processes": (_LIST, True)},
}

#: Keys of one entry of a RECONCILE payload's `processes` list (a process identity + labels).
PROCESS_ENTRY_SCHEMA: Final[Mapping[str, _Spec]] = {
    "host": (_STR, True),
    "pid": (_INT, True),
    "start_time": (_NUMBER, True),
    "launch_token": (_STR, True),
    "labels": (_DICT, False),
}

_ENVELOPE: Final[Mapping[str, _Spec]] = {
    "version": (_INT, True),
    "kind": (_STR, True),
    "id": (_STR, True),
    "seq": (_INT, True),
    "epoch": (_INT, True),
    "sender": (_STR, True),
    "payload": (_DICT, True),
}

_Problem = tuple[DropReason, str]
_KIND_BY_VALUE: Final = {k.value: k for k in Kind}
_KIND_VALUES: Final = frozenset(_KIND_BY_VALUE)


def _check_keys(obj: Mapping[str, Any], schema: Mapping[str, _Spec], where: str) -> _Problem | None:
    found = 0
    for key, (types, required) in schema.items():
        value = obj.get(key, _MISSING)
        if value is _MISSING:
            if required:
                return DropReason.MISSING_FIELD, f"{where}{key} is missing"
            continue
        found += 1
        if types is not None and type(value) not in types:
            return DropReason.WRONG_TYPE, f"{where}{key} is {type(value).__name__}"
        if types is not None and type(value) is float and value - value != 0.0:
            # msgpack carries NaN and infinity; the transition log cannot (a start time of NaN
            # reached the orchestrator, whose EventError ended the controller's loop)
            return DropReason.WRONG_TYPE, f"{where}{key} is {value!r}, not a finite number"
    if len(obj) != found:
        extra = sorted(str(k) for k in obj if k not in schema)
        return DropReason.UNKNOWN_FIELD, f"{where or 'envelope '}has unknown keys {extra[:5]}"
    return None


def check_fields(
    obj: Mapping[str, Any], schema: Mapping[str, tuple[frozenset[type] | None, bool]], where: str
) -> str | None:
    """The first problem of map `obj` against `schema` (key → (exact types or None for any,
    required); no other keys), as "reason: detail"; None when it fits. For the layers above
    the transport that check what they read inside a payload (see `runtime.messages`)."""
    problem = _check_keys(obj, schema, where)
    return None if problem is None else f"{problem[0]}: {problem[1]}"


def _check_envelope(obj: Mapping[str, Any]) -> _Problem | None:
    # Fast path (every well-formed frame): exactly the seven keys, each of its exact type. Any
    # miss falls through to the field-by-field checks, which name the problem.
    if (
        len(obj) == 7
        and type(obj.get("version")) is int
        and obj["version"] in SUPPORTED_VERSIONS
        and type(obj.get("kind")) is str
        and type(obj.get("id")) is str
        and type(obj.get("seq")) is int
        and type(obj.get("epoch")) is int
        and type(obj.get("sender")) is str
        and type(obj.get("payload")) is dict
    ):
        return _check_envelope_values(
            obj["kind"], obj["id"], obj["seq"], obj["epoch"], obj["sender"]
        )
    # Version first: a future version may legitimately change every other field.
    version = obj.get("version", _MISSING)
    if version is _MISSING:
        return DropReason.MISSING_FIELD, "version is missing"
    if type(version) is not int:
        return DropReason.WRONG_TYPE, f"version is {type(version).__name__}"
    if version not in SUPPORTED_VERSIONS:
        return (
            DropReason.UNKNOWN_VERSION,
            f"version {version} (supported {sorted(SUPPORTED_VERSIONS)})",
        )
    problem = _check_keys(obj, _ENVELOPE, "")
    if problem is not None:
        return problem
    return _check_envelope_values(obj["kind"], obj["id"], obj["seq"], obj["epoch"], obj["sender"])


def _check_envelope_values(
    kind: str, id: str, seq: int, epoch: int, sender: str
) -> _Problem | None:
    if kind not in _KIND_VALUES:
        return DropReason.UNKNOWN_KIND, f"kind {kind[:32]!r}"
    if not 0 < len(id) <= MAX_ID_CHARS:
        return DropReason.WRONG_TYPE, f"id must have 1..{MAX_ID_CHARS} characters"
    if not 0 < len(sender) <= MAX_NAME_CHARS:
        return DropReason.WRONG_TYPE, f"sender must have 1..{MAX_NAME_CHARS} characters"
    if not (0 <= seq <= _INT64_MAX and 0 <= epoch <= _INT64_MAX):
        return DropReason.WRONG_TYPE, "seq and epoch must be in 0..2**63-1"
    return None


def _check_payload(kind: Kind, payload: Mapping[str, Any]) -> _Problem | None:
    problem = _check_keys(payload, PAYLOAD_SCHEMA[kind], "payload.")
    if problem is not None or kind is not Kind.RECONCILE:
        return problem
    for i, entry in enumerate(payload["processes"]):
        if type(entry) is not dict:
            return DropReason.WRONG_TYPE, f"payload.processes[{i}] is {type(entry).__name__}"
        problem = _check_keys(entry, PROCESS_ENTRY_SCHEMA, f"payload.processes[{i}].")
        if problem is not None:
            return problem
    return None


_SCALARS: Final = frozenset({type(None), bool, int, float, str, bytes})


def _check_plain(value: object, depth: int, max_depth: int) -> _Problem | None:
    """Whitelist walk: only plain msgpack types, containers nested at most `max_depth` deep.

    Iterative (no recursion, whatever the input) and by exact type: a subclass such as an enum
    or msgpack's `Timestamp` is refused, not silently coerced.
    """
    if type(value) in _SCALARS:
        return None
    stack: list[tuple[object, int]] = [(value, depth)]
    while stack:
        item, level = stack.pop()
        if level > max_depth:
            return DropReason.TOO_DEEP, f"nesting deeper than {max_depth}"
        kind = type(item)
        if kind is list:
            assert isinstance(item, list)
            for child in item:
                if type(child) not in _SCALARS:
                    stack.append((child, level + 1))
        elif kind is dict:
            assert isinstance(item, dict)
            for key, child in item.items():
                if type(key) is not str:
                    return DropReason.FORBIDDEN_TYPE, f"map key of type {type(key).__name__}"
                if type(child) not in _SCALARS:
                    stack.append((child, level + 1))
        else:
            return DropReason.FORBIDDEN_TYPE, f"value of type {kind.__name__}"
    return None


class _ExtensionRefused(Exception):
    pass


def _refuse_ext(code: int, data: bytes) -> object:
    raise _ExtensionRefused(f"extension type {code} is not accepted")


# ---- encode / decode -----------------------------------------------------------------------


def encode(frame: Frame, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> bytes:
    """Frame → bytes. Raises `FrameError` if the frame would be refused by a receiver.

    The payload was checked when the frame was built; a payload mutated since then is caught
    by msgpack (unserialisable) or by the receiver (schema).
    """
    try:
        data: bytes = msgpack.packb(frame.to_wire(), use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise FrameError(
            f"cannot encode {frame.kind!s} frame {frame.id}",
            str(exc),
            "send only plain msgpack types (do not mutate a payload after building the frame)",
        ) from exc
    if len(data) > max_bytes:
        raise FrameError(
            f"{frame.kind!s} frame {frame.id} is {len(data)} bytes",
            f"the maximum message size is {max_bytes} bytes",
            "send large data out of band (a file path, a URL) and put only its reference in "
            "the payload",
        )
    return data


def decode(
    data: bytes,
    *,
    max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_depth: int = DEFAULT_MAX_DEPTH,
    peer: str = "",
) -> Frame | Dropped:
    """Bytes → `Frame`, or `Dropped` with a reason. Never raises, whatever the bytes."""
    size = len(data)

    def dropped(reason: DropReason, detail: str) -> Dropped:
        return Dropped(reason=reason, detail=detail, size=size, peer=peer)

    if size > max_bytes:  # before msgpack sees a byte
        return dropped(DropReason.OVERSIZED, f"{size} bytes > limit {max_bytes}")
    limit = min(size, MAX_CONTAINER_LEN)
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            ext_hook=_refuse_ext,
            max_str_len=size,
            max_bin_len=size,
            max_array_len=limit,
            max_map_len=limit,
            max_ext_len=size,  # reach _refuse_ext (timestamps become Timestamp: refused below)
        )
    except msgpack.ExtraData:
        return dropped(DropReason.TRAILING_BYTES, "bytes after the first msgpack object")
    except _ExtensionRefused as exc:
        return dropped(DropReason.FORBIDDEN_TYPE, str(exc))
    except msgpack.StackError:
        return dropped(DropReason.TOO_DEEP, "nesting deeper than msgpack's stack")
    except Exception as exc:  # any unpack failure of hostile bytes is a drop, never a crash
        return dropped(DropReason.NOT_MSGPACK, f"{type(exc).__name__}: {str(exc)[:120]}")
    if type(obj) is not dict:
        return dropped(DropReason.NOT_A_MAP, f"top level is {type(obj).__name__}")
    # The envelope's values are checked by exact type; only the payload needs the full walk.
    problem = _check_envelope(obj) or _check_plain(obj["payload"], 1, max_depth)
    if problem is not None:
        return dropped(*problem)
    kind = _KIND_BY_VALUE[obj["kind"]]
    problem = _check_payload(kind, obj["payload"])
    if problem is not None:
        return dropped(*problem)
    # Fully validated above: build without running __post_init__'s checks a second time.
    return Frame.unchecked(
        kind=kind,
        id=obj["id"],
        seq=obj["seq"],
        epoch=obj["epoch"],
        sender=obj["sender"],
        payload=obj["payload"],
        version=obj["version"],
    )


def outgoing(
    kind: Kind, *, id: str, seq: int, epoch: int, sender: str, payload: Mapping[str, Any]
) -> Frame:
    """A frame whose envelope the transport made itself: only the caller's payload is checked.

    Raises `FrameError` if the payload is not plain msgpack data of the kind's schema.
    """
    problem = _check_plain(payload, 1, DEFAULT_MAX_DEPTH) or _check_payload(kind, payload)
    if problem is not None:
        raise FrameError(
            f"cannot build a {kind!s} frame",
            f"{problem[0]}: {problem[1]}",
            "pass plain msgpack types (None, bool, int, float, str, bytes, list, dict with "
            "str keys) in the payload shape `protocol.PAYLOAD_SCHEMA` gives for this kind",
        )
    return Frame.unchecked(kind=kind, id=id, seq=seq, epoch=epoch, sender=sender, payload=payload)


def process_entry(identity_fields: Mapping[str, Any], **labels: Any) -> dict[str, Any]:
    """One RECONCILE `processes` entry from identity fields (see `identity.ProcessIdentity`)."""
    entry = {k: identity_fields[k] for k in ("host", "pid", "start_time", "launch_token")}
    if labels:
        entry["labels"] = dict(labels)
    return entry
