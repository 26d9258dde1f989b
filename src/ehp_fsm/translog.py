"""The transition log: one structlog JSON line per attempted transition, accepted or rejected.

Line 1 is a header (`event = "ehp-fsm.log"`, the schema version, the version of ehp-fsm that
wrote it (`ehp_fsm_version`, as the installed package reports it; logs written before 0.1.1
recorded it have none), the engine config and its fingerprint, the spec fingerprints, the
chain's kind). Every other line is a record with the fixed keys of `RECORD_KEYS`; root records
and cascaded ones carry the event's `payload`; cascaded ones also carry `cause` = the seq of the
record whose effect caused them. Schema 2 adds
checkpoint lines between events (`event = "ehp-fsm.checkpoint"`, first key `checkpoint` = the
seq of the last record before it, then the world: version, globals, every instance as [state,
data]); the engine writes one every `checkpoint_every` events (and, by default, no more often
than every two events per instance, so their cost stays a small share of logging). Replay checks
them, and can verify the stretches between them in parallel. The log is the engine's write-ahead
log and the input of `ehp-fsm replay`. This module knows the schema and how to write it;
`replay` knows how to read it.

Schema 3 makes the log tamper-evident: every line (the header included) ends with the key
`chain`, a 128-bit BLAKE2b hash of the previous line's `chain` followed by this line's bytes up to
that key, so an edit, deletion, insertion or reordering of any line breaks the chain at (or just
after) that line. The header names the chain's kind (`chain_kind`) and fingerprints its config
(`config_fingerprint`) as well as the specs. With a key (the `EHP_LOG_KEY` environment variable,
or `key=`) the hash is keyed BLAKE2b — a MAC, as HMAC would be, at half HMAC-SHA256's cost — and
a forger without the key cannot rebuild the chain; without one, anyone can, so a run's receipt
records the log's `chain_head` (lines written, last `chain`) and `replay --receipt` compares it:
that also catches a log cut short, which no chain can show from the inside.

Schema 4 keeps checkpoints the size of the live world: the writer's world forgets its finished
instances (`finished.WRITER_FORGETS`: a step's consumed groups, a done step, a retired
revision), and a checkpoint's `instances` lists the live ones only; a new key, `finished`,
lists the forgotten ones by machine and state as runs of ids (`{"request": {"consumed":
{"count": 16384, "runs": [["g", 0, 16383]], "ids": []}}, ...}`: `[prefix, first, last]` per
run of `<prefix><number>` ids, any other id in `ids`). A machine named there has all its
instances in a forgettable state listed there, none in `instances`; every other machine is
listed whole, as before. (Their data is not in the log's checkpoints: replay keeping every
instance verifies a schema-4 log from its header, in one stretch.)

Lines are rendered by structlog's `JSONRenderer` with msgspec's JSON encoder as its serializer
and written by structlog's `BytesLogger` (structlog's own recipe for fast JSON logging, with
msgspec in orjson's place): compact JSON (no spaces after `:` and `,`), UTF-8. Logs written
by earlier versions (`json.dumps` spacing) read the same: every reader parses JSON.
"""

from __future__ import annotations

import binascii
import functools
import hashlib
import io
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, BinaryIO, Final, cast

import msgspec
import structlog

try:  # POSIX: a log file is locked while it is written (`TransitionLog.create`)
    import fcntl
except ImportError:  # pragma: no cover - Windows: no lock
    fcntl = None  # type: ignore[assignment]

from ehp_fsm.core.spec import MachineSpec
from ehp_fsm.core.transition import Command, Outcome
from ehp_fsm.core.world import World
from ehp_fsm.errors import EhpError, printable
from ehp_fsm.fspaths import kind_of, open_own
from ehp_fsm.loglines import first_line, line_limit, line_number, lines_backward

HEADER_EVENT = "ehp-fsm.log"
#: The header's key for the version of ehp-fsm that wrote the log (`package_version`); it is
#: not in a log written before `VERSION_SINCE` began to record it (the schema is the same).
VERSION_KEY = "ehp_fsm_version"
VERSION_SINCE = "0.1.1"
SCHEMA_VERSION = 4
#: 1: no checkpoint lines; 3: the hash chain; 4: checkpoints list finished ids (`finished`)
READABLE_SCHEMA_VERSIONS = (1, 2, 3, 4)
#: The first schema with the hash chain (a log before it cannot be appended to)
CHAIN_SINCE = 3
#: The first schema whose checkpoints list the writer's finished instances by id (`finished`)
FINISHED_SINCE = 4
KEY_ENV = "EHP_LOG_KEY"
CHAIN_KINDS = ("blake2b-128", "blake2b-128-keyed")  # without and with a key
#: What every schema-3 line ends with: `,"chain":"<32 hex digits>"}`; the hash covers the line's
#: bytes before it.
CHAIN_MARK = b',"chain":"'
CHAIN_SUFFIX = len(CHAIN_MARK) + 32 + 2  # the mark, the hex digest, `"}`
_LINE_END = b'"}\n'
CHECKPOINT_EVENT = "ehp-fsm.checkpoint"
CHECKPOINT_EVERY = 10_000  # events between two checkpoints, at least
BUFFER_BYTES = 1 << 20  # a `flush_each=False` log's buffer
RECORD_KEYS = (
    "seq",
    "time",
    "machine",
    "instance",
    "source",
    "event",
    "dest",
    "accepted",
    "reason",
    "effects",
    "correlation",
    "cause",
)


_LEAVES = frozenset({str, int, float, bool, type(None)})
_MAPPINGS = frozenset({dict, MappingProxyType})
_SEQUENCES = frozenset({list, tuple})


def plain(value: Any) -> Any:
    """Mappings → dicts, tuples → lists, recursively: what JSON will give back on replay."""
    t = type(value)
    if t in _LEAVES:  # the exact types first: an ABC check per value costs more than the rest
        return value
    if t in _MAPPINGS:
        return {
            (k if type(k) is str else str(k)): (v if type(v) in _LEAVES else plain(v))
            for k, v in value.items()
        }
    if t in _SEQUENCES:
        return [v if type(v) in _LEAVES else plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def plain_effects(commands: tuple[Command, ...]) -> list[dict[str, Any]]:
    """`[plain(c.to_dict()) for c in commands]`, without the intermediate dicts."""
    return [
        {"kind": c.kind, "machine": c.machine, "instance": c.instance, "args": plain(c.args)}
        for c in commands
    ]


class _Line(msgspec.Struct, gc=False):
    """One record as `TransitionLog.write` encodes it: a struct whose fields are the record's
    keys in the order `logger.info(event, **rest)` renders them (`event` last), which msgspec
    encodes to the same bytes as that dict (the values are not checked against the
    annotations: what a field holds is what is encoded). `tests/core/test_log_lines.py`
    compares the two."""

    seq: int
    time: Any
    machine: str
    instance: str
    source: str
    dest: str
    accepted: bool
    reason: str
    effects: list[dict[str, Any]]
    correlation: str
    cause: int | None
    payload: Any
    event: str


def outcome_records(outcome: Outcome, first_seq: int) -> list[dict[str, Any]]:
    """The log records of one outcome, numbered from `first_seq` (pure; writer and replay)."""
    ev = outcome.event
    out = []
    for i, r in enumerate(outcome.records):
        rec = {
            "seq": first_seq + i,
            "time": ev.time,
            "machine": r.machine,
            "instance": r.instance,
            "source": r.source,
            "event": r.event,
            "dest": r.dest,
            "accepted": r.accepted,
            "reason": r.reason,
            "effects": plain_effects(r.commands) if r.commands else [],
            "correlation": ev.correlation,
            "cause": None if r.cause is None else first_seq + r.cause,
        }
        rec["payload"] = plain(r.payload)
        out.append(rec)
    return out


def world_state(world: World) -> dict[str, Any]:
    """The world as a checkpoint line stores it, in plain JSON values."""
    return {
        "version": world.version,
        "globals": plain(world.globals),
        "instances": {
            m: {iid: [inst.state, plain(inst.data)] for iid, inst in by_id.items()}
            for m, by_id in world.instances.items()
        },
    }


def _forgotten_ids(world: World) -> Mapping[str, Any]:
    """What a world that forgets forgot, as a checkpoint lists it (`finished.Forgetter.listing`,
    the forgetter whose lookups the world asks)."""
    listing = getattr(getattr(world.forgotten, "__self__", None), "listing", None)
    if listing is None:
        raise ValueError(
            "a checkpoint of a world that forgets needs the ids it forgot: pass "
            "finished=Forgetter.listing() (Orchestrator writes its own checkpoints)"
        )
    return cast(Mapping[str, Any], listing())


def spec_fingerprints(specs: Mapping[str, MachineSpec]) -> dict[str, str]:
    """A short hash per machine of its states and transitions (what replay must agree with)."""
    out = {}
    for name, spec in sorted(specs.items()):
        table = [
            (t.source, t.event, t.dest, t.guards, t.effects)
            for t in (spec.create, *spec.transitions)
        ]
        text = json.dumps([sorted(spec.states), spec.initial, sorted(spec.terminal), table])
        out[name] = hashlib.sha256(text.encode()).hexdigest()[:16]
    return out


def specs_differ(header: Mapping[str, Any], specs: Mapping[str, MachineSpec]) -> list[str]:
    """The machines whose specs differ between a log's `header` and `specs` (sorted; empty when
    they agree): what a log must be replayed or resumed with."""
    logged, mine = header.get("specs"), spec_fingerprints(specs)
    if logged == mine:
        return []
    if not isinstance(logged, dict):
        return ["(the header's `specs` is missing or not a map)"]
    return sorted(m for m in set(logged) | set(mine) if logged.get(m) != mine.get(m))


def config_fingerprint(config: Mapping[str, Any]) -> str:
    """A short hash of the world config (keys sorted), as the header records it."""
    text = json.dumps(plain(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def package_version() -> str:
    """This ehp-fsm's version, as the installed package reports it (`importlib.metadata`);
    "unknown" when it is not installed (its source on PYTHONPATH)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ehp-fsm")
    except PackageNotFoundError:
        return "unknown"


def writer_version(header: Mapping[str, Any]) -> str:
    """The version of ehp-fsm that wrote the log whose header is `header`, for a message:
    "unknown (written before ...)" for a log from before the header recorded it."""
    if VERSION_KEY not in header:
        return f"unknown (written before version {VERSION_SINCE} recorded it)"
    value = header[VERSION_KEY]
    if isinstance(value, str) and value:
        return printable(value)[:60]
    return f"unknown (the header's {VERSION_KEY} is {printable(repr(value))[:60]})"


def log_key(value: str | bytes | None = None) -> bytes | None:
    """The chain's key: `value`, else the `EHP_LOG_KEY` environment variable; None when neither
    is set (an unkeyed chain). Any length: it is hashed to the 32 bytes BLAKE2b takes."""
    if value is None:
        value = os.environ.get(KEY_ENV) or None
    if value is None:
        return None
    raw = value.encode() if isinstance(value, str) else value
    return hashlib.sha256(raw).digest()


def chain_hasher(key: bytes | None) -> Callable[[bytes], bytes]:
    """`link(prev_chain + line_bytes) -> 32 hex digits (bytes)`: BLAKE2b-128, keyed when
    `key`."""
    blake, hexlify = hashlib.blake2b, binascii.hexlify
    if key is None:
        return lambda data: hexlify(blake(data, digest_size=16).digest())
    return lambda data: hexlify(blake(data, digest_size=16, key=key).digest())


#: What a receipt's seal hashes before its log's end: no line's `chain` is a hash of it.
SEAL_DOMAIN: Final = b"ehp-fsm receipt log_chain\0"


def receipt_log_chain(count: int, head: str, *, key: bytes | None) -> dict[str, Any]:
    """A receipt's `log_chain`: the log's line count and last `chain`, and for a keyed chain
    its `seal` — BLAKE2b-128 under the key of `SEAL_DOMAIN`, the count and the hash. Without
    it, anyone who could cut a keyed log could write its receipt too: a prefix's count and
    last `chain` are read from the prefix itself, and `replay --receipt` took the cut log
    (an auditor's find); the seal cannot be made without the key."""
    out: dict[str, Any] = {"count": count, "hash": head}
    if key is not None:
        out["seal"] = end_seal(key, count, head)
    return out


def end_seal(key: bytes, count: int, head: str) -> str:
    data = SEAL_DOMAIN + f"{count}:{head}".encode("ascii", "replace")
    return hashlib.blake2b(data, digest_size=16, key=key).hexdigest()


@functools.lru_cache(maxsize=4)
def _encoder(default: Callable[[Any], Any]) -> msgspec.json.Encoder:
    return msgspec.json.Encoder(enc_hook=default)


def _encode(obj: Any, *, default: Callable[[Any], Any]) -> bytes:
    """The serializer `JSONRenderer` calls (`serializer(event_dict, default=...)`): msgspec's
    JSON encoder, one per fallback; a value it cannot encode goes to structlog's fallback
    (`default`, which renders it as its `repr`), as with `json.dumps`."""
    return _encoder(default).encode(obj)


def _open_exclusive(path: str | Path, flush_each: bool, *, empty: bool = True) -> BinaryIO:
    """The log file at `path`, emptied (unless not `empty`: `open_to_append`) and locked
    (see `TransitionLog.create`); unbuffered when each outcome is written at once (`_put`
    writes it whole or not at all)."""
    fix = "pass a log_path in a folder this process can write (missing folders are made)"
    name = printable(str(path))
    try:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        # append mode: opening does not empty a file another log may be writing; a symbolic
        # link there is refused (`open_own`): its target was emptied and the log written in it.
        # Mode 0600: launches carry their processes' launch tokens (`run.owned`: secrets).
        _refuse_special(p, name, os.lstat(p).st_mode if os.path.lexists(p) else None)
        # O_NONBLOCK: a FIFO put there after that check fails at once (ENXIO) instead of
        # waiting for a reader, and is refused below; cleared again for the file
        fd = open_own(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, private=True)
        try:
            _refuse_special(p, name, os.fstat(fd).st_mode)
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        stream = os.fdopen(fd, "ab", buffering=0 if flush_each else BUFFER_BYTES)
    except EhpError:
        raise
    except (OSError, TypeError, ValueError) as exc:
        raise EhpError(f"the transition log {name} cannot be created", str(exc), fix) from None
    try:
        if fcntl is not None:
            fcntl.flock(stream.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        if empty:
            _refuse_foreign(stream, name)
            stream.truncate(0)
            stream.seek(0)
    except BlockingIOError:
        stream.close()
        raise EhpError(
            f"the transition log {name} is held by another writer (an Orchestrator or an "
            "`ehp-fsm run`, in this process or another)",
            "a log has one writer: two would interleave their records and neither would replay",
            "give each Orchestrator its own log_path, or close() the one that holds it first "
            "(to go on with that log then, Orchestrator.resume(log_path, ...): from_plan on "
            "it empties it); if a run holds it, let it end or stop it (`ehp-fsm stop PLAN`) "
            "before starting another on the same log",
        ) from None
    except OSError as exc:
        stream.close()
        raise EhpError(f"the transition log {name} cannot be created", str(exc), fix) from None
    except BaseException:
        stream.close()
        raise
    return stream


def _refuse_foreign(stream: BinaryIO, name: str) -> None:
    """Refuse to empty a file that holds something and is no transition log: a log path that
    named a data file, a plan or a script (`Orchestrator.from_plan(log_path=...)`) replaced it
    with the log, without a word. An earlier log there is replaced, as documented."""
    if os.fstat(stream.fileno()).st_size == 0:
        return
    fd = os.open(f"/proc/self/fd/{stream.fileno()}", os.O_RDONLY | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as fh:
        if starts_a_log(fh):
            return
    raise EhpError(
        f"the transition log {name} would replace a file that is not a transition log",
        "the file there holds something else (its first line is not an ehp-fsm log's header), "
        "and starting a log empties it",
        "give the log a path of its own (a new file, e.g. runs/NAME/transitions.jsonl), or "
        "move that file away if it is yours to lose",
    )


def starts_a_log(fh: BinaryIO) -> bool:
    """Whether the file `fh` reads (from its start) opens with an ehp-fsm log's header."""
    try:
        header = json.loads(first_line(fh, line_limit()))
    except (EhpError, OSError, ValueError, RecursionError):  # (too long, not JSON, too deep)
        return False
    return isinstance(header, dict) and header.get("event") == HEADER_EVENT


def _refuse_special(path: Path, name: str, mode: int | None) -> None:
    """Refuse a log path that names something other than a file (`mode`: its `st_mode`; None
    when nothing is there): a FIFO there (`simulate --out DIR` holding one) hung the open for
    ever, waiting for a reader, and a device took the log and lost it. A link is left to
    `open_own`, which names it."""
    kind = "a file" if mode is None else kind_of(mode)
    if kind in ("a file", "a symbolic link", "a folder"):
        return  # (a folder: the open says so)
    raise EhpError(
        f"the transition log {name} is {kind}, not a file",
        "a log is a file written whole and read back by replay and resume (writing to a FIFO "
        "waits for a reader for ever; a device keeps nothing)",
        f"give the log a path where a file can be made (or remove the {kind[2:]} {name})",
    )


def open_to_append(path: str | Path) -> BinaryIO:
    """The log file at `path` opened unbuffered to append and locked as `TransitionLog.create`
    locks it (`EhpError` while another log writes there), not emptied: for
    `TransitionLog(stream, first_seq=...)` to go on with its seq and hash chain once its
    tail is repaired (`Orchestrator.resume`). The stream is named by the path: a log goes on
    with the chain of the file its stream names (`TransitionLog._resume`)."""
    stream = _open_exclusive(path, True, empty=False)
    setattr(stream, "name", str(path))  # noqa: B010 - (a FileIO made from a fd: named by it)
    try:
        _refuse_unchained(stream, path)
    except BaseException:
        stream.close()
        raise
    return stream


def _refuse_unchained(stream: BinaryIO, path: str | Path) -> None:
    """Refuse to append to a log of a schema before the hash chain (1 or 2): the lines this
    version writes would carry a chain that starts from nothing in the middle of the file (a
    schema-2 log resumed went on with chained lines that no replay checks). A header that
    cannot be read is left to the recovery that follows, which names what is wrong with it."""
    try:  # (the stream is write-only: the file read through its own descriptor)
        fd = os.open(f"/proc/self/fd/{stream.fileno()}", os.O_RDONLY | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as fh:
            # the whole header, within the line limit replay reads it by: cut at 1 MiB (a
            # plan of some 10,000 GPUs), a schema-2 header did not parse and was appended to
            header = json.loads(first_line(fh, line_limit()))
    except (EhpError, OSError, ValueError, RecursionError):
        return
    version = header.get("schema_version") if isinstance(header, dict) else None
    if type(version) is int and version < CHAIN_SINCE:
        raise EhpError(
            f"the transition log {printable(str(path))} is schema {version} (written by an "
            f"ehp-fsm before the hash chain of schema {CHAIN_SINCE}), so it cannot be "
            "appended to",
            "lines written now would be chained from nothing in the middle of the file",
            "replay it as it is (`ehp-fsm replay LOG`) and start a new log (a new run, or "
            "Orchestrator.from_plan with another log_path)",
        )


class TransitionLog:
    """Appends records through a structlog logger that renders JSON lines to `stream` (binary).

    Records are rendered as structlog's `JSONRenderer` renders them (its serializer, msgspec,
    see the module docstring, called directly) and written as `BytesLogger` writes them —
    what `logger.info(event, **fields)` would run — without the bound logger's per-call work
    (its context copy and keyword merge): the record dict is built once, in the order that
    call would give (`event` last). The lines of one outcome are
    written with one write and one flush, before `write` returns: the log is the controller's
    write-ahead log, and an outcome's records reach the OS before any of its commands are
    performed. (A flush hands the lines to the OS; it does not fsync.)

    `flush_each=False` gives up that rule for a writer with no commands that reach outside
    the process (`ehp-fsm simulate`: every performer is simulated, so no record has to reach
    the OS before anything happens): the lines go into the stream's buffer and reach the file
    at each checkpoint, at `flush` and at `close` (which a simulation's `finally` calls, on
    error too) — the same bytes, one system call per buffer instead of one per outcome.
    """

    def __init__(
        self,
        stream: BinaryIO,
        *,
        first_seq: int = 1,
        checkpoint_every: int | None = CHECKPOINT_EVERY,
        checkpoint_events_per_instance: float = 2.0,
        key: bytes | None = None,
        flush_each: bool = True,
    ) -> None:
        """`key`: the chain's key as `log_key` gives it (None: unkeyed). `flush_each`: see
        the class docstring."""
        if checkpoint_every is not None and checkpoint_every < 1:
            raise ValueError(f"checkpoint_every={checkpoint_every} must be >= 1, or None for none")
        self.checkpoint_every = checkpoint_every
        self.checkpoint_events_per_instance = checkpoint_events_per_instance
        self._since_checkpoint = 0
        # the runs and other ids the last checkpoint's `finished` listed: counted as instances
        # by `checkpoint_due`, as a checkpoint renders each of them
        self._listed = 0
        self._stream = stream
        self._out = structlog.BytesLogger(stream)
        self._broken: OSError | None = None  # a failed write `_put` could not undo
        # Where an unbuffered file ends (`_put` cuts a failed write back to it; kept here, not
        # asked of the file: a seek per event); None for any other stream.
        self._end: int | None = stream.tell() if isinstance(stream, io.RawIOBase) else None
        self.flush_each = flush_each
        self._render = structlog.processors.JSONRenderer(serializer=_encode)
        # What `_render` calls for a record (`_encode` with the renderer's fallback), taken
        # once: `write` renders every record with it, the same bytes without two calls a line.
        self._encode_record = _encoder(self._render._dumps_kw["default"]).encode
        self.next_seq = first_seq
        self.keyed = key is not None
        self._key = key
        self._link = chain_hasher(key)
        self._head = b""  # the last line's `chain` (empty before the header)
        self._lines = 0
        name = getattr(stream, "name", None)
        if "a" in str(getattr(stream, "mode", "")) and isinstance(name, str) and stream.tell():
            self._resume(Path(name), key)

    def _resume(self, path: Path, key: bytes | None) -> None:
        """Go on with the chain of the log this stream appends to (a controller recovering
        a log repaired up to a whole line): its line count and last link; a keyed log's key is
        the `EHP_LOG_KEY` environment variable unless one was given. Reads the first line and
        the last (`loglines`: a chunk at a time; the log was checked by `recover_log`, its
        lines within the line limit) and counts the lines between, not the whole file."""
        with path.open("rb") as fh:
            try:
                header = json.loads(fh.readline())
            except ValueError:
                return  # not a log this version wrote: nothing to go on from
            if not isinstance(header, dict) or header.get("schema_version", 0) < 3:
                return
            if header.get("chain_kind") == CHAIN_KINDS[1] and key is None:
                key = log_key()
            self.keyed = key is not None
            self._key = key
            self._link = chain_hasher(key)
            size = os.fstat(fh.fileno()).st_size
            last = next(lines_backward(fh, size), (0, b""))[1].rstrip(b"\n")
            if last.endswith(b'"}') and last[-CHAIN_SUFFIX:].startswith(CHAIN_MARK):
                self._head = last[-CHAIN_SUFFIX + len(CHAIN_MARK) : -2]
            self._lines = line_number(fh, size) - 1  # the newlines before its end

    @property
    def chain_head(self) -> tuple[int, str]:
        """(lines written, the header included; the last line's `chain`): what a run's receipt
        records as `log_chain: {"count": ..., "hash": ...}` for `ehp-fsm replay --receipt`."""
        return self._lines, self._head.decode("ascii")

    def log_chain(self) -> dict[str, Any]:
        """`chain_head` as a receipt's `log_chain`, sealed when the chain is keyed
        (`receipt_log_chain`)."""
        return receipt_log_chain(*self.chain_head, key=self._key)

    def _chained(self, rendered: bytes) -> tuple[bytes, bytes]:
        """`rendered` (a JSON object) with its `chain` key appended (no newline), and the head
        it moves the chain to (`_emit` moves it once the line is written)."""
        body = rendered[:-1]
        head = self._link(self._head + body)
        return b"".join((body, CHAIN_MARK, head, b'"}')), head

    @classmethod
    def create(
        cls,
        path: str | Path,
        *,
        config: Mapping[str, Any],
        specs: Mapping[str, MachineSpec],
        meta: Mapping[str, Any] | None = None,
        checkpoint_every: int | None = CHECKPOINT_EVERY,
        checkpoint_events_per_instance: float = 2.0,
        key: str | bytes | None = None,
        flush_each: bool = True,
    ) -> TransitionLog:
        """A new log file at `path` (parents created) with its header written. `key`: the
        chain's key (default: the `EHP_LOG_KEY` environment variable; unset: unkeyed).

        The file is held with an exclusive lock (`flock`) until the log is closed: a second
        log created at the same path while one writes there — another `Orchestrator`, in this
        process or another — is refused (`EhpError`) before it touches the file; before, it
        emptied the file under the first, and both wrote into it: a log that did not replay.
        A path that cannot be written is refused (`EhpError`) naming it and why."""
        stream = _open_exclusive(path, flush_each)
        log = cls(
            stream,
            checkpoint_every=checkpoint_every,
            checkpoint_events_per_instance=checkpoint_events_per_instance,
            key=log_key(key),
            flush_each=flush_each,
        )
        log.header(config=config, specs=specs, meta=meta or {})
        return log

    def header(
        self,
        *,
        config: Mapping[str, Any],
        specs: Mapping[str, MachineSpec],
        meta: Mapping[str, Any],
    ) -> None:
        line = self._render(
            self._out,
            "info",
            {
                "schema_version": SCHEMA_VERSION,
                VERSION_KEY: package_version(),
                "config": plain(config),
                "config_fingerprint": config_fingerprint(config),
                "specs": spec_fingerprints(specs),
                "meta": plain(meta),
                "chain_kind": CHAIN_KINDS[self.keyed],
                "event": HEADER_EVENT,
            },
        )
        self._emit(*self._chained(cast(bytes, line)))

    def _emit(self, data: bytes, head: bytes) -> None:
        """One line (no final newline): written now, or buffered (`flush_each`); then the
        chain's head moves to `head`."""
        if self.flush_each:
            self._put(data + b"\n")
        else:
            self._stream.write(data + b"\n")
        self._head = head
        self._lines += 1

    def _put(self, data: bytes) -> None:
        """Write `data` (whole lines) to the OS now, all of it or none: when a write fails (a
        full disk, a file size limit) the file is cut back to where it was and the error
        raised — the records of an event whose change is not made do not reach the log, and
        the next event's lines follow the last whole one. (A buffered stream kept a failed
        write's bytes in its buffer and wrote them with the next event's: a record of an
        event never applied, its seq given again — the log stopped replaying there.) A
        stream that is not an unbuffered file is written and flushed as it is."""
        stream = self._stream
        if self._broken is not None:
            raise OSError(
                self._broken.errno,
                f"the transition log {getattr(stream, 'name', '')!s} was left with part of a "
                f"line by a failed write ({self._broken}) that could not be undone: it takes "
                "no more records; replay it to the last whole line and start a new log",
            )
        start = self._end
        if start is None:  # not an unbuffered file
            stream.write(data)
            stream.flush()
            return
        view, done = memoryview(data), 0
        try:
            while done < len(data):
                done += stream.write(view[done:]) or 0
        except OSError as exc:
            if done:
                try:
                    os.ftruncate(stream.fileno(), start)
                    stream.seek(start)
                except OSError:
                    self._broken = exc
            raise
        self._end = start + done

    def flush(self) -> None:
        """Hand what is buffered to the OS."""
        self._stream.flush()

    def write(self, outcome: Outcome) -> int:
        """Log every record of `outcome`; returns the seq of its root record.

        Each line is `_chained`'s, built in one pass: the record's bytes up to its closing
        brace, the chain mark, the new head and the line's end joined once (a `%`-format and
        a newline appended per line cost more than encoding the record)."""
        first = self.next_seq
        ev = outcome.event
        time, correlation = ev.time, ev.correlation
        encode, link, join = self._encode_record, self._link, b"".join
        head = self._head
        lines = []
        seq = first
        for r in outcome.records:
            # The keys of `outcome_records`, in the order `info(event, **rest)` renders them
            # (`_Line`: the same bytes as that dict, built and encoded in less time).
            cause = r.cause
            body = encode(
                _Line(
                    seq,
                    time,
                    r.machine,
                    r.instance,
                    r.source,
                    r.dest,
                    r.accepted,
                    r.reason,
                    plain_effects(r.commands) if r.commands else [],
                    correlation,
                    None if cause is None else first + cause,
                    plain(r.payload),
                    r.event,
                )
            )[:-1]
            head = link(head + body)
            lines.append(join((body, CHAIN_MARK, head, _LINE_END)))
            seq += 1
        if lines:
            if self.flush_each:
                self._put(lines[0] if len(lines) == 1 else join(lines))
            else:
                self._stream.write(lines[0] if len(lines) == 1 else join(lines))
        self._head = head
        self._lines += seq - first
        self.next_seq = seq
        self._since_checkpoint += 1
        return first

    def checkpoint_due(self, world: World) -> bool:
        """Whether a checkpoint of `world` is due: `checkpoint_every` events since the last one,
        and at least `checkpoint_events_per_instance` per instance of the world (a checkpoint
        costs about one record's rendering per instance) and per run or id the last one listed
        under `finished` (schema 4: a world that forgets ids that are not `<prefix><number>`,
        a UUID a group, lists each; counting only the live world, such checkpoints came as
        often as the live world allowed while each grew with the run, and the log's
        checkpoints grew with the square of its length: 8.8 MB of a 15.8 MB log after 400
        steps of 8 groups named by UUID, where a world keeping them wrote 0.9 MB)."""
        every, since = self.checkpoint_every, self._since_checkpoint
        if every is None or since < every:
            return False
        size = sum(len(by_id) for by_id in world.instances.values()) + self._listed
        return since >= self.checkpoint_events_per_instance * size

    def checkpoint(self, world: World, finished: Mapping[str, Any] | None = None) -> None:
        """Write a checkpoint line: the world after the last record written. `finished`: the
        ids the world forgot (`Forgetter.listing`: schema 4's `finished` key; None: a world
        that forgets nothing, listed whole as before; a world that forgets: its forgetter's)."""
        if finished is None and world.forgotten is not None:
            finished = _forgotten_ids(world)
        fields = {"checkpoint": self.next_seq - 1, **world_state(world)}
        listed = 0
        if finished is not None:
            fields["finished"] = finished
            listed = sum(
                len(ids.get("runs", ())) + len(ids.get("ids", ()))
                for by_state in finished.values()
                for ids in by_state.values()
            )
        line = self._render(self._out, "info", {**fields, "event": CHECKPOINT_EVENT})
        self._emit(*self._chained(cast(bytes, line)))
        self.flush()
        self._since_checkpoint, self._listed = 0, listed

    def close(self) -> None:
        """Flush and close the file (once: a closed log's `close` does nothing)."""
        if self._stream.closed:
            return
        self._stream.flush()
        self._stream.close()

    def mark(self) -> tuple[Any, ...]:
        """Where the log stands (its end, seq and chain): `rollback` takes it back there."""
        end = self._end
        if end is None and self._stream.seekable():
            end = self._stream.tell()
        return end, self._head, self._lines, self.next_seq, self._since_checkpoint, self._listed

    def rollback(self, mark: tuple[Any, ...]) -> None:
        """Cut the file back to `mark` (`mark()`) and go on from there: the lines of an event
        whose handling was interrupted (a KeyboardInterrupt between the write and the world's
        change) leave the log with it. Raises `OSError` when the file cannot be cut."""
        end, head, lines, seq, since, listed = mark
        stream = self._stream
        if end is None:
            raise OSError(f"the transition log {getattr(stream, 'name', '')!s} cannot be cut back")
        if self._end is not None:
            os.ftruncate(stream.fileno(), end)
            self._end = end
        else:
            stream.truncate(end)
        stream.seek(end)
        self._broken = None
        self._head, self._lines, self.next_seq, self._since_checkpoint = head, lines, seq, since
        self._listed = listed
