"""Replay a transition log: re-run every root event through the engine and compare.

`replay(path)` rebuilds the world from the header's config, feeds each root record's event to the
pure step function, and checks that the computed records (the root and everything it cascaded)
equal the logged ones field by field. Lines are decoded with msgspec straight into a typed
`LoggedRecord` (keys and types checked in C), so reading costs little beside the re-step. It
returns the verified count and the final world, or raises `ReplayDivergence` at the first line
that differs (a tampered, truncated or foreign log) and `LogFormatError` for a line that is not
a record. `until_seq` stops after the event that contains that seq, to inspect the world there.
The header must name the machine specs replay steps with (their fingerprints) and every line
must have exactly the keys of its kind. What replay proves is that every record follows from
those before it; it does not authenticate the log: an edit to a root record that changes no
decision (its time or correlation id) and a log cut at an event boundary still verify.

Checkpoint lines (schema 2, see `translog`) are compared with the world where they stand (schema
4: the instances a machine listed under `finished` forgot are compared by id and state). With
`jobs` > 1 the log is cut at checkpoints into stretches verified at once in worker processes
(fork when this process has one thread); each stretch restores the world from its first
checkpoint and must reach the next one, so every transition is still verified once. What it
does not know: where logs come from, or how to repair one (see `runtime.recovery`).

Memory: the log is read through a memory map whose read pages are handed back as it goes
(`_batches`), and with `forget_finished` (what `ehp-fsm replay` uses) the world forgets
instances once they are finished (`finished`), so a long log replays in the memory of its live
world rather than of every instance it ever created. A schema-4 log's checkpoints list what their
writer forgot by id only: replay that keeps every instance (`--at`) verifies such a log from its
header in one stretch (a stretch restored from one of them forgets, as its writer did).
"""

from __future__ import annotations

import binascii
import bisect
import contextlib
import hashlib
import itertools
import mmap
import multiprocessing
import multiprocessing.context
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO, NoReturn, TypeGuard

import msgspec

from ehp_fsm.core.effects import EFFECTS
from ehp_fsm.core.guards import GUARDS
from ehp_fsm.core.transition import Accepted, Command, Outcome, Record, step
from ehp_fsm.core.world import Event, Instance, World, config_problem
from ehp_fsm.errors import ChainBroken, EhpError, LogFormatError, ReplayDivergence, printable
from ehp_fsm.finished import FORGETTABLE, FORGETTABLE_STATES, Forgetter, IdSet, Unsure
from ehp_fsm.fspaths import container_of
from ehp_fsm.loglines import check_line_lengths, first_line, line_number
from ehp_fsm.loglines import line_limit as _line_limit
from ehp_fsm.specfiles import load_specs
from ehp_fsm.translog import (
    CHAIN_KINDS,
    CHAIN_MARK,
    CHAIN_SUFFIX,
    CHECKPOINT_EVENT,
    FINISHED_SINCE,
    HEADER_EVENT,
    READABLE_SCHEMA_VERSIONS,
    RECORD_KEYS,
    SCHEMA_VERSION,
    chain_hasher,
    config_fingerprint,
    end_seal,
    log_key,
    outcome_records,
    package_version,
    plain,
    plain_effects,
    specs_differ,
    world_state,
    writer_version,
)

_COMPARED = (
    "seq",
    "machine",
    "instance",
    "source",
    "event",
    "accepted",  # before `dest`: where the engine decides otherwise, that is the news
    "dest",
    "reason",
    "effects",
    "cause",
    "time",
    "correlation",
    "payload",
)


@dataclass(frozen=True)
class ReplayResult:
    """`chain`: (lines in the log, the header included; the last line's `chain`) for a
    schema-3 log replayed to its end (what a run's receipt records); None otherwise."""

    transitions: int
    events: int
    world: World
    last_seq: int
    header: dict[str, Any]
    chain: tuple[int, str] | None = None
    #: the segment this log resumes (its header's `meta.resumes`), replayed to its end
    previous: ReplayResult | None = None
    #: the stretches this log (not the segments it resumes) was verified in, each in its own
    #: process: 1 where it was not cut (`jobs` 1, or no checkpoint line to cut it at)
    stretches: int = 1
    #: whether the log holds a checkpoint line, where `jobs` > 1 found none to cut it at
    #: (None where it was not looked for: `jobs` 1, or a cut was found)
    has_checkpoints: bool | None = None
    #: what made `world` forget its finished instances (`forget_finished`), None where none
    #: was forgotten
    forgetter: Forgetter | None = None


class LoggedRecord(Event, frozen=True, gc=False, kw_only=True, forbid_unknown_fields=True):
    """One record line as the log stores it (the keys of `translog.RECORD_KEYS`, plus the
    event's `payload`). Decoding into this type checks every key and type in one C call per line.

    A record echoes the event that was attempted (machine, instance, event, time, payload,
    correlation) and adds what the engine decided, so it is an `Event`: replay steps a root
    record's line as it was decoded."""

    seq: int
    payload: dict[str, Any]  # required here (an `Event` defaults it)
    source: str
    dest: str
    accepted: bool
    reason: str
    effects: list[dict[str, Any]]
    correlation: str  # required here (an `Event` defaults it)
    cause: int | None
    chain: str = ""  # schema 3: the line's link in the hash chain (checked on the raw bytes)


class FinishedIds(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True):
    """The ids a checkpoint lists of the instances of one machine in one finished state
    (schema 4, `translog`): runs [prefix, first, last] and other ids, `count` in all."""

    count: int
    runs: list[tuple[str, int, int]]
    ids: list[str]


class Checkpoint(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True):
    """A checkpoint line: the world after record `checkpoint` (see `translog`); `finished`
    (schema 4): {machine: {state: ids}} of the instances its writer forgot."""

    checkpoint: int
    version: int
    globals: dict[str, Any]
    instances: dict[str, dict[str, tuple[str, dict[str, Any]]]]
    event: str
    chain: str = ""
    finished: dict[str, dict[str, FinishedIds]] | None = None


_CHECKPOINT_START = b'{"checkpoint":'  # compact (msgspec) and spaced (json.dumps) lines
_decode_record = msgspec.json.Decoder(LoggedRecord).decode
_decode_checkpoint = msgspec.json.Decoder(Checkpoint).decode
_decode_any = msgspec.json.Decoder().decode


def _too_deep(n: int, what: str = "it") -> LogFormatError:
    """Line `n` nests deeper than a JSON reader recurses (msgspec and `json` raise
    `RecursionError` past ~1,000 levels): no line ehp-fsm writes comes near that."""
    return LogFormatError(
        n,
        f"{what} is nested too deep to read (more than ~1,000 levels of lists or maps; "
        "ehp-fsm writes a few): it was not written by ehp-fsm",
        "restore the line from the original log",
    )


def _format_error(n: int, raw: bytes, exc: msgspec.DecodeError | RecursionError) -> LogFormatError:
    """Why line `n` is not a record, in the log's own terms (JSON, object, keys, types)."""
    if isinstance(exc, RecursionError):
        return _too_deep(n)
    try:
        obj = _decode_any(raw)
    except msgspec.DecodeError as bad:
        return LogFormatError(
            n, f"it is not JSON ({bad})", "restore the line from the original log"
        )
    except RecursionError:
        return _too_deep(n)
    if not isinstance(obj, dict):
        return LogFormatError(n, "it is not a JSON object")
    if obj.get("event") == HEADER_EVENT:
        return LogFormatError(
            n,
            "it is another log's header: two logs were joined into one file (cat a b), or a "
            "second log was written into this one",
            "replay each log on its own (the lines before this one are the first log)",
        )
    missing = [k for k in RECORD_KEYS if k not in obj]
    if missing:
        return LogFormatError(n, f"keys {missing} are missing")
    return LogFormatError(n, f"a value has the wrong type ({exc})")


def _header(fh: BinaryIO, limit: int | None = None) -> tuple[dict[str, Any], bytes]:
    """The header and its raw line (read within the line limit, `loglines`)."""
    raw = first_line(fh, _line_limit(limit))
    if not raw:  # said as "the first line is not a header": an empty file has no line
        raise LogFormatError(
            1,
            "the file is empty: its writer stopped before it wrote the header (a full disk, "
            "a run killed as it began its log), or it is not a transition log",
            "replay the log of a run that began; a run's receipt.json says which log it wrote",
        )
    try:
        header = _decode_any(raw) if raw.strip() else None
    except msgspec.DecodeError:
        header = None
    except RecursionError:
        raise _too_deep(1, "the first line (the header)") from None
    if not isinstance(header, dict) or header.get("event") != HEADER_EVENT:
        if (packed := container_of(raw)) is not None:  # a log kept as `transitions.jsonl.gz`
            kind, how = packed
            raise LogFormatError(
                1,
                f"the file is {kind}: replay reads the log as ehp-fsm wrote it",
                f"{how.replace('FILE', 'LOG')} and replay the .jsonl",
            )
        if raw.startswith(b"\xef\xbb\xbf"):
            raise LogFormatError(
                1,
                "the file starts with a UTF-8 byte-order mark, which ehp-fsm does not write: "
                "an editor saved it (and the hash chain covers every byte)",
                "replay the original log, or remove the first 3 bytes (tail -c +4 LOG)",
            )
        raise LogFormatError(
            1,
            f"the first line is not a {HEADER_EVENT!r} header",
            "replay a file written by ehp-fsm",
        )
    version = header.get("schema_version")
    if type(version) is not int or version not in READABLE_SCHEMA_VERSIONS:
        raise LogFormatError(
            1,
            f"schema version {version!r} is not one of {list(READABLE_SCHEMA_VERSIONS)}",
            f"replay it with the ehp-fsm that wrote it: {_writer(header)}",
        )
    config = header.get("config")
    if type(config) is not dict or type(config.get("inventory", {})) is not dict:
        raise LogFormatError(
            1,
            "the header's `config` is not a map with an `inventory` map",
            "restore the header from the original log",
        )
    problem = config_problem(config)
    if problem is not None:  # the guards read it: a string for a count raised a TypeError
        raise LogFormatError(
            1,
            f"the header's config cannot be the engine's: {problem}",
            "restore the header from the original log (ehp-fsm writes the plan's config there)",
        )
    return header, raw


class _Chain:
    """Checks the hash chain of a schema-3 log line by line (see `translog`): each line's
    `chain` must be the hash of the previous line's `chain` and this line's bytes before it."""

    __slots__ = ("head", "key", "link")

    def __init__(self, key: bytes | None, head: bytes = b"") -> None:
        self.key = key or b""  # BLAKE2b with an empty key is the unkeyed hash
        self.link = chain_hasher(key)
        self.head = head

    def check(self, n: int, raw: bytes) -> ChainBroken | None:
        """Move along line `n`; the break it shows, if any (`_Segment.run` does the same
        inline, per line)."""
        end = len(raw) - 1 if raw.endswith(b"\n") else len(raw)
        cut = end - CHAIN_SUFFIX
        if cut < 1 or raw[cut : cut + len(CHAIN_MARK)] != CHAIN_MARK or raw[end - 2 : end] != b'"}':
            raise _unchained(n, raw)
        recorded = raw[cut + len(CHAIN_MARK) : end - 2]
        computed = self.link(self.head + raw[:cut])
        self.head = recorded
        return None if computed == recorded else _broken(n, recorded, computed)


def _unchained(n: int, raw: bytes = b"\n") -> LogFormatError:
    if raw.endswith(b'"}\r\n') or raw.endswith(b'"}\r'):  # the writer writes LF only
        return LogFormatError(
            n,
            "the line ends in CR LF, where ehp-fsm writes LF: the log's line ends were "
            "converted (a Windows editor, git's autocrlf, a copy in text mode), and the hash "
            "chain covers every byte",
            "convert the line ends back (dos2unix LOG) and replay; or replay the original",
        )
    if not raw.endswith(b"\n"):  # only the file's last line can lack its newline
        return LogFormatError(
            n,
            "the log's last line is cut short (no newline, no `chain` key): the process that "
            "wrote it was killed mid-line, or its disk filled",
            "`ehp-fsm run PLAN --resume` cuts a torn tail off (its bytes kept beside the log, "
            "as LOG.cut-OFFSET); to check what is complete, replay a copy without its last "
            "line",
        )
    return LogFormatError(
        n,
        "the line does not end with its `chain` key: it was inserted or edited",
        "restore the line from the original log",
    )


def _broken(n: int, recorded: bytes, computed: bytes) -> ChainBroken:
    return ChainBroken(n, recorded.decode("ascii", "replace"), computed.decode("ascii"))


def _chain_of(header: Mapping[str, Any], raw: bytes, key: bytes | None) -> _Chain | None:
    """The chain checker of a schema-3 log, its header checked (chain kind, key, config
    fingerprint, the header's own link); None for schemas 1 and 2 (no chain), which a key
    refuses: a forger drops the chain and says schema 2."""
    if header.get("schema_version", 0) < 3:
        if key is not None:  # a forger's downgrade: drop the chain, say schema 2
            raise LogFormatError(
                1,
                f"a key was given (EHP_LOG_KEY, or an embedder's `key`) but the log is schema "
                f"{header.get('schema_version')}, which has no hash chain: nothing in it can "
                "be authenticated (a log from before schema 3, or a forged one that dropped "
                "its chain)",
                "unset EHP_LOG_KEY (pass no `key`) to replay it unauthenticated, and do not "
                "trust the log",
            )
        return None
    kind = header.get("chain_kind")
    if kind not in CHAIN_KINDS:
        raise LogFormatError(1, f"the header's `chain_kind` {kind!r} is not one of {CHAIN_KINDS}")
    if kind == CHAIN_KINDS[1] and key is None:
        raise LogFormatError(
            1,
            "the log's hash chain is keyed and no key was given",
            "set EHP_LOG_KEY (or pass `key`) to the key the log was written with",
        )
    if kind == CHAIN_KINDS[0] and key is not None:
        raise LogFormatError(
            1,
            "a key was given (EHP_LOG_KEY, or an embedder's `key`) but the log's chain is "
            "unkeyed: it was written "
            "without the key, or its chain was rebuilt by someone who does not hold it",
            "unset EHP_LOG_KEY (pass no `key`) to check the unkeyed chain, and do not trust "
            "the log",
        )
    logged, mine = header.get("config_fingerprint"), config_fingerprint(header["config"])
    if logged != mine:
        raise LogFormatError(
            1,
            f"the header's config does not match its fingerprint ({logged!r}, the config "
            f"hashes to {mine!r}): the config was edited",
            "restore the header from the original log",
        )
    chain = _Chain(key)
    broken = chain.check(1, raw)
    if broken is not None:
        raise broken
    return chain


def _check_specs(header: Mapping[str, Any], specs: Mapping[str, Any]) -> None:
    """The machines the log was written with are the ones replay steps it with."""
    differ = specs_differ(header, specs)
    if differ:
        raise LogFormatError(
            1,
            f"the log was written with other machine specs than these: {differ}",
            f"replay it with the ehp-fsm (and specs/) that wrote it: {_writer(header)}",
        )


def _writer(header: Mapping[str, Any]) -> str:
    """Which ehp-fsm wrote the log, and which this is: for a message that sends the reader to
    the one that wrote it."""
    return f"version {writer_version(header)} (this is {package_version()})"


@contextlib.contextmanager
def _mapped(
    path: Path, start: int, end: int = 0, checkpoint: Callable[[], None] | None = None
) -> Iterator[Iterator[bytes]]:
    """The lines of the log at `path` from byte `start` (a line start) up to byte `end` (a line
    start; 0: the end of the file), each with its newline. The file is memory-mapped up to
    `end` and read by the map's `readline`: a C call per line that stops at `end` by itself
    (about half what the file object's line iterator costs per line, a quarter of splitting
    read chunks). `checkpoint`: called before each batch of lines (`_batches`)."""
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), end, access=mmap.ACCESS_READ) as mm:
        mm.seek(start)
        lines = iter(mm.readline, b"")
        if _DONTNEED is None and checkpoint is None:
            yield lines
        else:
            yield itertools.chain.from_iterable(_batches(mm, lines, start, _DONTNEED, checkpoint))


#: Bytes read between two hand-backs of the map's pages (`_batches`).
RELEASE_BYTES = 1 << 24
_DONTNEED: int | None = getattr(mmap, "MADV_DONTNEED", None)
_BATCH = 4096  # lines read between two looks at the position


class _Stopped(Exception):
    """What a replay's `checkpoint` raised, carried out of the line loop untouched (the loop
    takes any other exception for the engine's failure on a restored world)."""

    def __init__(self, raised: Exception) -> None:
        super().__init__(raised)
        self.raised = raised


def _batches(
    mm: mmap.mmap,
    lines: Iterator[bytes],
    start: int,
    advice: int | None,
    checkpoint: Callable[[], None] | None = None,
) -> Iterator[Iterator[bytes]]:
    """`lines` (the map's, from `start`) in batches of `_BATCH`, handing the pages already read
    back to the OS every `RELEASE_BYTES` (`madvise(advice)`, MADV_DONTNEED; None: where the OS
    has none): a page of a mapped file that was read stays in the process's resident set until
    the map is closed, so a replay's peak held the whole log (a 137 MiB log: ~145 MiB of a
    227 MiB peak). The lines are copies (bytes) and no page is read twice; the OS keeps the
    pages in its page cache as it sees fit. `checkpoint` is called before each batch; what it
    raises ends the lines (as `_Stopped`). (`_mapped` chains the batches: a line costs two C
    calls, and this generator runs once per batch.)"""
    page = mmap.PAGESIZE
    done = start - start % page
    while True:
        if checkpoint is not None:
            try:
                checkpoint()
            except Exception as exc:
                raise _Stopped(exc) from exc
        before = mm.tell()
        yield itertools.islice(lines, _BATCH)
        pos = mm.tell()
        if pos == before:
            return
        if advice is not None and pos - done >= RELEASE_BYTES:
            upto = pos - pos % page
            mm.madvise(advice, done, upto - done)
            done = upto


class _Segment:
    """Replays the lines of one stretch of a log into `world`: records are re-stepped and
    compared with what the engine computes, checkpoint lines with the world, and (schema 3)
    each line's link in the hash chain with its bytes. Line numbers count from `first_line`;
    `seq` is the last seq verified. `forget`: the world forgets its finished instances
    (`finished`) after each accepted step."""

    __slots__ = (
        "chain",
        "events",
        "first_line",
        "forget",
        "restored",
        "schema",
        "seq",
        "transitions",
        "world",
    )

    def __init__(
        self,
        world: World,
        first_line: int,
        seq: int = 0,
        chain: _Chain | None = None,
        forget: Forgetter | None = None,
        schema: int = SCHEMA_VERSION,
    ) -> None:
        self.world = world
        self.first_line = first_line
        self.seq = seq
        self.schema = schema  # the header's (a checkpoint's `finished` came with schema 4)
        self.chain = chain
        self.forget = forget
        self.transitions = self.events = 0
        #: the line of the checkpoint the world was restored from (None: from the header):
        #: `run` names it when the engine cannot step that world (see `_unsteppable`)
        self.restored: int | None = None

    def run(self, lines: Iterator[bytes], until_seq: int | None) -> None:
        """Verify `lines` (up to `until_seq`). One pass: a root record is stepped when it is
        read; the outcome's further records must be the next lines, in order. A line whose
        chain link is broken is reported after its content is compared (an edit that changes
        a decision names the field), before the next line is read. (The counters and the chain
        head live in locals while the loop runs: it runs once per line.)"""
        world = self.world
        forget, forgettable = self.forget, FORGETTABLE_STATES
        decode = _decode_record
        chain = self.chain
        chained = chain is not None
        key = chain.key if chain is not None else b""
        blake, hexlify = hashlib.blake2b, binascii.hexlify
        head = chain.head if chain is not None else b""
        broken: ChainBroken | None = None
        mark, suffix, mark_end = CHAIN_MARK, CHAIN_SUFFIX, len(CHAIN_MARK)
        outcome: Outcome | None = None
        computed: tuple[Record, ...] = ()
        event: Event | None = None
        seq, transitions, events = self.seq, 0, 0
        first = i = count = 0  # the root's seq; the next record's index; the event's records
        n = self.first_line - 1
        try:
            for n, raw in enumerate(lines, start=self.first_line):
                if chained:
                    if broken is not None:
                        raise broken
                    if raw.endswith(b'"}\n'):  # every line the writer wrote
                        cut = len(raw) - suffix - 1
                    elif raw.endswith(b'"}'):  # the last line, its newline lost
                        cut = len(raw) - suffix
                    else:
                        raise _unchained(n, raw)
                    if cut < 1 or not raw.startswith(mark, cut):
                        raise _unchained(n, raw)
                    recorded = raw[cut + mark_end : cut + suffix - 2]
                    # `chain_hasher(key)`, inlined (a call less per line)
                    linked = hexlify(blake(head + raw[:cut], digest_size=16, key=key).digest())
                    if linked != recorded:
                        broken = _broken(n, recorded, linked)
                    head = recorded
                try:
                    rec = decode(raw)
                except (msgspec.DecodeError, RecursionError) as exc:  # not JSON, or not a
                    # record (ValidationError), or nested past what the decoder recurses into
                    if not raw.strip():
                        continue
                    cp = _checkpoint(raw)
                    if cp is None:
                        raise _format_error(n, raw, exc) from None
                    if i < count:
                        raise ReplayDivergence(n, "records in this event", i, count) from None
                    _finished_schema(cp, n, self.schema)
                    _check(world, cp, n, seq, forget)
                    continue
                if i < count:  # a record the current event cascaded
                    assert outcome is not None and event is not None
                    r = computed[i]
                    if _expected(r, first + i, first, event, plain(r.payload), rec.chain) != rec:
                        _diverged(n, rec, outcome, i)
                    i += 1
                    if i == count:  # the event is complete
                        if isinstance(outcome, Accepted):
                            world.apply(outcome.changes, outcome.globals)
                            if forget is not None:  # `Forgetter.__call__`, inlined
                                for where, now in outcome.changes.items():
                                    if now.state in forgettable:
                                        forget.forget(where, now)
                        seq = first + i - 1
                        transitions += i
                        events += 1
                        if until_seq is not None and seq >= until_seq:
                            break
                    continue
                # a root record: step its event
                if rec.seq != seq + 1 or rec.cause is not None:
                    _not_a_root(n, rec, seq)
                event = rec  # a root record is its event
                outcome = step(world, event, GUARDS, EFFECTS)
                computed = outcome.records
                r = computed[0]
                # The root record echoes its event (machine, instance, event, time, payload,
                # correlation: the step copies them from the event, which is this very line),
                # so what the engine decided is all there is to compare.
                if (
                    r.source != rec.source
                    or r.dest != rec.dest
                    or r.accepted != rec.accepted
                    or r.reason != rec.reason
                    or ((rec.effects or r.commands) and not _same_effects(rec.effects, r.commands))
                ):
                    _diverged(n, rec, outcome, 0)
                count, i = len(computed), 1
                if count > 1:  # its cascaded records follow
                    first = rec.seq
                    continue
                if isinstance(outcome, Accepted):
                    world.apply(outcome.changes, outcome.globals)
                    if forget is not None:
                        for where, now in outcome.changes.items():
                            if now.state in forgettable:
                                forget.forget(where, now)
                seq = rec.seq
                transitions += 1
                events += 1
                if until_seq is not None and seq >= until_seq:
                    break
            if i < count:  # the lines ran out inside an event
                raise _ends_inside(n, i, count, first)
            if broken is not None:
                raise broken
        except (EhpError, Unsure, MemoryError, _Stopped):
            raise
        except Exception as exc:
            if self.restored is None:  # from the header: the engine's own failure
                raise
            raise _unsteppable(n, self.restored, exc) from None
        finally:
            if chain is not None:
                chain.head = head
            self.seq = seq
            self.transitions += transitions
            self.events += events


def _ends_inside(n: int, got: int, want: int, root: int) -> ReplayDivergence:
    """The error of a log whose last line `n` holds record `got` of the `want` records of the
    event whose root record is seq `root`: its writer was killed while it wrote that event's
    lines (or the log was cut there). Kept as `ends_inside` to cross a process boundary."""
    err = ReplayDivergence(n, "records in this event", got, want)
    err.why = (
        f"the log ends inside an event: line {n}, its last, holds {got} of the {want} records "
        f"of the event whose root is seq {root}; its writer was killed while it wrote them, or "
        "the log was cut short here"
    )
    before = f"`ehp-fsm replay LOG --at {root - 1}` shows the world before it" if root > 1 else ""
    err.fix = "; ".join(
        x
        for x in (
            before,
            "`ehp-fsm run PLAN --resume` sets an incomplete last event aside",
            "if the log should go on, restore it from the original",
        )
        if x
    )
    err.ends_inside = root  # type: ignore[attr-defined]
    return err


def _unsteppable(n: int, checkpoint: int, exc: Exception | str) -> LogFormatError:
    """The error of a stretch restored from the checkpoint on line `checkpoint` whose world
    the engine could not step at line `n` (`exc`: what the step raised, e.g. a guard's
    `TypeError` over a value of the wrong type; or its text). A checkpoint the engine wrote
    holds what it can step, so that one was forged; the stretch before it names where it
    differs (the first failing stretch wins). Both line numbers count from the stretch's start
    until `_replay` makes them absolute: the error keeps them as `unsteppable`."""
    detail = exc if isinstance(exc, str) else f"{type(exc).__name__}: {printable(str(exc))[:200]}"
    err = LogFormatError(
        n,
        f"the engine cannot step it from the checkpoint on line {checkpoint} ({detail}): "
        "that checkpoint holds a world the engine never wrote",
        "replay with --jobs 1 to name where the checkpoint differs from the records before "
        "it; restore the original log",
    )
    err.unsteppable = (checkpoint, detail)  # type: ignore[attr-defined]
    return err


def _not_a_root(n: int, rec: LoggedRecord, seq: int) -> NoReturn:
    """Raise the divergence of a line that should be a root record (the next seq, no cause)
    and is not. (A root record of a machine the specs do not know is stepped like any other:
    the engine refused it, and replay computes the same refusal.)"""
    if rec.seq != seq + 1:
        raise ReplayDivergence(n, "seq", rec.seq, seq + 1)
    raise ReplayDivergence(n, "cause", rec.cause, "null (a root record)")


def _same_effects(logged: list[dict[str, Any]], commands: tuple[Command, ...]) -> bool:
    """`logged == plain_effects(commands)`, without building the plain form when each logged
    effect has exactly the command's four keys and equal values (a command's arguments are
    compared as the mapping they are; only where that differs, e.g. a tuple that JSON gave back
    as a list, is the plain form built and compared)."""
    if len(logged) != len(commands):
        return False
    for e, c in zip(logged, commands, strict=True):
        if not (
            len(e) == 4
            and e.get("kind") == c.kind
            and e.get("machine") == c.machine
            and e.get("instance") == c.instance
            and e.get("args") == c.args
        ):
            return logged == plain_effects(commands)
    return True


def _checkpoint(raw: bytes) -> Checkpoint | None:
    """The checkpoint on line `raw`, or None when the line is not one."""
    if not raw.startswith(_CHECKPOINT_START):
        return None
    try:
        cp = _decode_checkpoint(raw)
    except (msgspec.DecodeError, RecursionError):  # (`_format_error` names why)
        return None
    return cp if cp.event == CHECKPOINT_EVENT else None


def _restore(world: World, cp: Checkpoint, n: int, forget: Forgetter | None = None) -> None:
    """Set `world` to the checkpoint on line `n` (`forget`: forgetting its finished instances)."""
    if cp.event != CHECKPOINT_EVENT:
        raise LogFormatError(
            n, f"a checkpoint line has event {cp.event!r}, not {CHECKPOINT_EVENT!r}"
        )
    unknown = sorted(set(cp.instances) - set(world.specs))
    if unknown:
        raise LogFormatError(n, f"the checkpoint names machines {unknown} the specs do not have")
    listed = _listed(world, cp, n)
    if cp.finished is not None and forget is None:
        # its finished instances' data is not in the log's checkpoints: only the log from its
        # header gives back a world that holds every instance
        raise Unsure(f"the checkpoint on line {n} lists finished instances by id only")
    world.version = cp.version
    world.globals = dict(cp.globals)
    world.instances = {
        m: {
            iid: Instance(m, iid, state, data)
            for iid, (state, data) in cp.instances.get(m, {}).items()
        }
        for m in world.specs
    }
    if forget is not None:
        forget.install(listed)
    world.reindex()


def _listed(world: World, cp: Checkpoint, n: int) -> dict[str, dict[str, IdSet]]:
    """The checkpoint's `finished` ids as sets ({machine: {state: ids}}); `LogFormatError`
    naming what is not a list of finished ids (a machine or state no instance is forgotten
    in, a run that is not one, a count that is not its ids')."""
    out: dict[str, dict[str, IdSet]] = {}
    for m, by_state in (cp.finished or {}).items():
        states = FORGETTABLE.get(m) if m in world.specs else None
        if states is None:
            raise LogFormatError(
                n, f"the checkpoint lists finished instances of {m!r}, which is never forgotten"
            )
        out[m] = {}
        for state, listed in by_state.items():
            if state not in states:
                raise LogFormatError(
                    n,
                    f"the checkpoint lists finished {m} instances in state {state!r}, "
                    f"which is not one of {sorted(states)}",
                )
            # each forgotten instance took a record at least: a count past the checkpoint's
            # seq is forged (runs of up to 10**12 ids each named more than 2**63, and `len`
            # of the set raised OverflowError); checked before the runs are read, and after
            # (the sizes are Python ints, never `len`)
            if listed.count > cp.checkpoint:
                raise _too_many(n, m, state, f"count is {listed.count}", cp.checkpoint)
            try:
                ids = IdSet.from_runs(listed.runs, listed.ids)
            except ValueError as exc:
                raise LogFormatError(n, f"its finished {m} {state!r} ids: {exc}") from None
            named = ids.size()
            if named > cp.checkpoint:
                raise _too_many(n, m, state, f"runs and ids name {named}", cp.checkpoint)
            if named != listed.count:
                raise LogFormatError(
                    n,
                    f"its finished {m} {state!r} count is {listed.count}, and its runs "
                    f"and ids name {named}",
                )
            out[m][state] = ids
    return out


def _too_many(n: int, m: str, state: str, what: str, seq: int) -> LogFormatError:
    """A checkpoint's finished listing names more ids than records came before it."""
    return LogFormatError(
        n,
        f"its finished {m} {state!r} {what}: more than the {seq} records before this "
        "checkpoint could have made (each instance took one at least): it was not written by "
        "ehp-fsm",
        "restore the line from the original log",
    )


def _finished_schema(cp: Checkpoint, n: int, schema: int) -> None:
    """`LogFormatError` at line `n` for a checkpoint with `finished` in a log before schema 4
    (its writer forgot nothing; a forger's listing would pass as ids its world never held)."""
    if cp.finished is not None and schema < FINISHED_SINCE:
        raise LogFormatError(
            n,
            f"the checkpoint has a `finished` key: `finished` came with schema "
            f"{FINISHED_SINCE}; this log's header says schema {schema}",
            "restore the line from the original log",
        )


def _check(world: World, cp: Checkpoint, n: int, seq: int, forget: Forgetter | None = None) -> None:
    """Raise `ReplayDivergence` at line `n` unless the checkpoint there equals the world.
    Each instance is compared as it is (state, then data against the checkpoint's); only when
    something differs is the world's plain form built, to decide and to name the difference.
    A world that forgets (`finished`): the checkpoint's other entries must be exactly the
    forgotten instances; when they are not, or anything differs once something was forgotten,
    `Unsure` (replay again, keeping every instance, to decide and name the difference). A
    machine the checkpoint lists under `finished` (schema 4) is compared by `_check_finished`,
    which names its difference itself, forgetting or not."""
    if cp.checkpoint != seq:
        raise ReplayDivergence(n, "checkpoint", cp.checkpoint, seq)
    if cp.version != world.version:
        raise ReplayDivergence(n, "checkpoint version", cp.version, world.version)
    listed = _listed(world, cp, n)
    theirs = cp.instances
    same = cp.globals == world.globals and theirs.keys() == world.instances.keys()
    for m, by_id in world.instances.items() if same else ():
        mine = theirs[m]
        if m in listed:
            _check_finished(world, m, mine, listed[m], n, forget)
            continue
        gone = forget.finished.get(m) if forget is not None else None
        if gone is not None and gone.count:
            if len(mine) != len(by_id) + gone.count or not gone.matches(mine, by_id):
                raise Unsure(f"checkpoint on line {n}: its finished {m} instances differ")
        elif len(mine) != len(by_id):
            same = False
            break
        for iid, inst in by_id.items():
            x = mine.get(iid)
            if x is None or x[0] != inst.state or x[1] != inst.data:
                same = False
                break
        if not same:
            break
    if not same:
        if forget is not None and forget.count():
            raise Unsure(f"checkpoint on line {n} differs from a world that forgot instances")
        _checkpoint_difference(world, cp, n)


def _check_finished(
    world: World,
    m: str,
    mine: Mapping[str, tuple[str, dict[str, Any]]],
    listed: Mapping[str, IdSet],
    n: int,
    forget: Forgetter | None,
) -> None:
    """Raise `ReplayDivergence` at line `n` unless machine `m`'s entries of the checkpoint
    there (`mine`: its live instances; `listed`: {state: ids} of those its writer forgot)
    equal the world's: its live instances exactly, and its instances in a forgettable state
    (those the world forgot, or, keeping every instance, those it holds in such a state) by
    id and state. Names the first id that differs: missing, extra, or in another state."""
    states = FORGETTABLE[m]
    by_id = world.instances[m]
    gone = forget.finished.get(m) if forget is not None else None
    if gone is not None:
        live: Mapping[str, Instance] = by_id
        held = gone.by_state
    else:
        live = {i: inst for i, inst in by_id.items() if inst.state not in states}
        held = {state: IdSet() for state in states}
        for i, inst in by_id.items():
            if inst.state in states:
                held[inst.state].add(i)
    if len(mine) != len(live) or any(
        (entry := mine.get(iid)) is None or entry[0] != inst.state or entry[1] != inst.data
        for iid, inst in live.items()
    ):
        # (as JSON gives them back: a tuple in the world is a list in the line)
        differs = next(
            (
                i
                for i in sorted(set(mine) | set(live))
                if (entry := mine.get(i)) is None
                or i not in live
                or [entry[0], entry[1]] != [live[i].state, plain(live[i].data)]
            ),
            None,
        )
        if differs is not None:
            now, entry = live.get(differs), mine.get(differs)
            raise ReplayDivergence(
                n,
                f"checkpoint {m} {differs!r}",
                None if entry is None else list(entry),
                None if now is None else [now.state, plain(now.data)],
            )
    empty = IdSet()
    first: tuple[tuple[int, str, int], str] | None = None
    for state in sorted(set(listed) | set(held)):
        a, b = listed.get(state, empty).runs(), held.get(state, empty).runs()
        if a != b:
            apart = _first_apart(a, b)
            if apart is not None and (first is None or apart[0] < first[0]):
                first = apart
    if first is None:
        return
    iid = first[1]
    logged = next((state for state, ids in listed.items() if iid in ids), None)
    now = world.get(m, iid)
    raise ReplayDivergence(
        n,
        f"checkpoint finished {m} {iid!r}",
        logged,
        None if now is None else now.state,
    )


def _first_apart(
    a: tuple[list[tuple[str, int, int]], list[str]],
    b: tuple[list[tuple[str, int, int]], list[str]],
) -> tuple[tuple[int, str, int], str] | None:
    """The first id in one of two sets (`IdSet.runs`) and not the other, with a key to order
    it by (ids of runs first, by prefix and number); None when they are the same set."""
    runs_a, runs_b = a[0], b[0]
    points = sorted({(p, lo) for p, lo, _ in runs_a + runs_b})
    points += sorted({(p, hi + 1) for p, _, hi in runs_a + runs_b})
    for p, x in sorted(points):
        if _covers(runs_a, p, x) != _covers(runs_b, p, x):
            return (0, p, x), f"{p}{x}"
    other = sorted(set(a[1]) ^ set(b[1]))
    return ((1, other[0], 0), other[0]) if other else None


def _covers(runs: list[tuple[str, int, int]], prefix: str, x: int) -> bool:
    """Whether sorted, disjoint `runs` hold number `x` of `prefix`."""
    k = bisect.bisect_right(runs, (prefix, x, float("inf"))) - 1
    return k >= 0 and runs[k][0] == prefix and runs[k][1] <= x <= runs[k][2]


def _checkpoint_difference(world: World, cp: Checkpoint, n: int) -> None:
    """Compare the checkpoint on line `n` with the world in plain JSON values; raise at the
    first difference (globals, then by machine and instance id; a machine whose finished
    instances the checkpoint lists by id, by its live instances: `_check_finished` compares
    the rest)."""
    mine = world_state(world)
    if cp.globals != mine["globals"]:
        raise ReplayDivergence(n, "checkpoint globals", cp.globals, mine["globals"])
    theirs = {m: {i: list(x) for i, x in by_id.items()} for m, by_id in cp.instances.items()}
    for m in sorted(set(theirs) | set(mine["instances"])):
        a, b = theirs.get(m, {}), mine["instances"].get(m, {})
        if m in (cp.finished or {}):
            b = {i: x for i, x in b.items() if x[0] not in FORGETTABLE.get(m, ())}
        if a != b:
            iid = next(i for i in sorted(set(a) | set(b)) if a.get(i) != b.get(i))
            raise ReplayDivergence(n, f"checkpoint {m} {iid!r}", a.get(iid), b.get(iid))
    # (reached when the machines named differ, or a value differs only in type): a machine
    # missing or added, and the finished ids, are differences too (before, a forged listing
    # passed beside a checkpoint that left out a machine with no live instance)
    if theirs.keys() != mine["instances"].keys():
        raise ReplayDivergence(n, "checkpoint machines", sorted(theirs), sorted(mine["instances"]))
    for m, listed in _listed(world, cp, n).items():
        _check_finished(world, m, cp.instances[m], listed, n, None)


def _read_header(
    path: Path, key: bytes | None, limit: int | None = None
) -> tuple[dict[str, Any], int, _Chain | None]:
    """The header, the byte offset after it, and the chain checker positioned after it."""
    with path.open("rb") as fh:
        header, raw = _header(fh, limit)
        _check_specs(header, load_specs())
        return header, fh.tell(), _chain_of(header, raw, key)


def replay(
    path: str | Path,
    *,
    until_seq: int | None = None,
    jobs: int = 1,
    key: str | bytes | None = None,
    forget_finished: bool | Collection[str] = False,
    line_limit: int | None = None,
    checkpoint: Callable[[], None] | None = None,
) -> ReplayResult:
    """Re-run the log at `path` through the engine; see the module docstring.

    Each root record's event is stepped as soon as it is read; the outcome says how many records
    the event made, and exactly that many lines (the root and its cascades) must follow, each
    equal to its computed record. A missing, extra or reordered line is a divergence at its line.

    `jobs` > 1 verifies the log in that many stretches at once, in worker processes, each cut at
    a checkpoint: a stretch starts from the world its first checkpoint holds and must end in the
    world the next one holds, so every transition is still verified and the chain of
    checkpoints ties the stretches together. A log without checkpoints is replayed in one piece.

    Schema 3: every line's link in the hash chain is checked too (each stretch starts from its
    checkpoint line's link), with `key` (default: the `EHP_LOG_KEY` environment variable) when
    the log's chain is keyed. Compare `ReplayResult.chain` with a run's receipt
    (`check_receipt`) to show the log is the whole log.

    A resumed run's log names, in its header's `meta.resumes`, the segment it goes on from
    (`{log, count, hash, step}`: a file beside it and that file's chain head when the run
    resumed). Replayed to its end, such a log replays that segment too (and the one before
    it, ...) and the segment must end exactly there (`previous`); each segment is a complete
    log of its own (a resumed run's world starts afresh from the plan, its Core at `step`).

    `forget_finished`: the world forgets an instance once it is finished (`finished`: in a
    terminal state that nothing reads but its state, as a step's consumed groups), keeping its
    id in a compact set and its data in a digest, so replay's memory follows the live world
    rather than the log's length; `ReplayResult.world` then holds the live instances only. Every
    check is made as without it, with the same verdicts and messages: where forgetting cannot
    decide (`finished.Unsure`: a checkpoint that differs), the log is replayed again keeping
    every instance. (`ehp-fsm replay` forgets unless `--at` asks for the world.) True forgets
    those of every machine of `finished.FORGETTABLE`; a collection of machine names forgets
    only theirs (`finished.WRITER_FORGETS`: the world as the log's writer held it, which
    `Orchestrator.resume` goes on with). `ReplayResult.forgetter` is what forgot them (None
    where nothing was forgotten, a replay keeping every instance included).

    `line_limit`: the longest line read, in bytes (default: the `EHP_LOG_LINE_LIMIT`
    environment variable, else `loglines.LINE_LIMIT`, 256 MiB). Every line of a log is checked
    against it before the log is replayed, reading at most the limit of any line
    (`loglines.check_line_lengths`): a longer line is refused (`LogLineTooLong`) before it is
    read whole — replay reads, copies and decodes a line whole, and a crafted line of 300 MB
    took ~1.2 GB.

    `checkpoint`: called before every `_BATCH` (4,096) lines this process verifies (not in
    the worker processes of `jobs` > 1); what it raises ends the replay and is raised as it
    is (a stop asked for while `ehp-fsm run --resume` replays the log it goes on from: it
    was answered once the whole log had replayed; 260,028 lines took 2.15 s, and a long run's
    log holds millions).
    """
    try:
        return _replay_all(
            Path(path), until_seq, jobs, key, forget_finished, line_limit, checkpoint
        )
    except _Stopped as stopped:
        raise stopped.raised from None


def _replay_all(
    p: Path,
    until_seq: int | None,
    jobs: int,
    key: str | bytes | None,
    forget_finished: bool | Collection[str],
    line_limit: int | None,
    checkpoint: Callable[[], None] | None,
) -> ReplayResult:
    """`replay`: the log and the segments it resumes."""
    limit = _line_limit(line_limit)
    forget = _forgetting(forget_finished)
    result = _replay_segment(p, until_seq, jobs, key, forget, limit, checkpoint)
    if until_seq is not None:
        return result
    # The segments it resumes, newest first, each replayed to its end and checked against the
    # header of the one that resumes it (a loop, not a recursion: a chain of hundreds of
    # segments, as anyone may write, ended in a RecursionError).
    chain = [result]
    seen = {p.resolve()}
    while (prev := _previous_segment(p, chain[-1].header, seen)) is not None:
        p = prev
        seen.add(p.resolve())
        try:
            older = _replay_segment(p, None, jobs, key, forget, limit, checkpoint)
        except EhpError as exc:  # its lines are that file's (it named a line of another)
            exc.what = f"in {printable(p.name)}, a segment this log resumes: {exc.what}"
            raise
        _check_segment_end(p.name, older, chain[-1].header)
        chain.append(older)
    for k in range(len(chain) - 2, -1, -1):
        chain[k] = replace(chain[k], previous=chain[k + 1])
    return chain[0]


def _forgetting(forget_finished: bool | Collection[str]) -> tuple[str, ...] | None:
    """The machines whose finished instances `replay(forget_finished=...)` forgets (None:
    none, every instance kept)."""
    if forget_finished is True:
        return tuple(FORGETTABLE)
    if forget_finished is False:
        return None
    if isinstance(forget_finished, str) or not isinstance(forget_finished, Collection):
        raise TypeError(
            f"forget_finished must be a bool or a collection of machine names, not "
            f"{type(forget_finished).__name__}"
        )
    unknown = sorted(str(m) for m in forget_finished if m not in FORGETTABLE)
    if unknown:
        raise ValueError(
            f"forget_finished names {', '.join(unknown)}, whose finished instances are never "
            f"forgotten (those of {', '.join(FORGETTABLE)} can be)"
        )
    return tuple(m for m in FORGETTABLE if m in forget_finished)


def _replay_segment(
    p: Path,
    until_seq: int | None,
    jobs: int,
    key: str | bytes | None,
    forget: tuple[str, ...] | None,
    limit: int,
    checkpoint: Callable[[], None] | None = None,
) -> ReplayResult:
    """One log (not the segments it resumes), forgetting the finished instances of the
    machines `forget` names (None: keeping every instance)."""
    if forget is not None:
        try:
            return _replay(p, until_seq, jobs, key, forget, limit, checkpoint)
        except Unsure:
            pass  # replay again, keeping every instance: it decides, and names the difference
    try:
        return _replay(p, until_seq, jobs, key, None, limit, checkpoint)
    except Unsure:
        # a stretch restored from a checkpoint that lists finished instances by id met one
        # whose data it needed: the log from its header, in one stretch, holds every one
        if jobs == 1:
            raise
    return _replay(p, until_seq, 1, key, None, limit, checkpoint)


def _replay(
    p: Path,
    until_seq: int | None,
    jobs: int,
    key: str | bytes | None,
    forgetting: tuple[str, ...] | None,
    limit: int,
    checkpoint: Callable[[], None] | None = None,
) -> ReplayResult:
    """One log's replay, forgetting the finished instances of the machines `forgetting` names
    (None: none); `limit`: the line limit; `checkpoint`: called as this process reads."""
    secret = log_key(key)
    header, body, chain = _read_header(p, secret, limit)
    # The log as it is now: a live log (a run still writing it) grows while it is replayed,
    # and the chain head reported is of the last line verified (its count was the lines
    # there at the end, paired with an earlier line's hash).
    size = p.stat().st_size
    with p.open("rb") as fh:  # before any line is read whole (`_mapped` and `_cuts` do)
        check_line_lengths(fh, body, size, limit)
    config = header.get("config") or {}
    if forgetting is None and header.get("schema_version", 0) >= FINISHED_SINCE:
        jobs = 1  # its checkpoints do not hold the data of what their writer forgot
    cuts = _cuts(p, body, jobs, until_seq, size) if jobs > 1 else []
    # Each stretch: (first byte, seq before it); the workers take all but the last, each to just
    # past the checkpoint line that starts the next; this process takes the last one (to the end
    # of the log, or `until_seq`), so it holds the final world. Stretches number their lines
    # from 1; a failure's line is made absolute here (counting lines costs a pass over bytes).
    starts = [(body, 0), *cuts]
    ends = [_line_end(p, off) for off, _ in cuts]
    world = World(load_specs(), config)
    forget = Forgetter(world, forgetting) if forgetting is not None else None
    first, seq = starts[-1]
    schema = header["schema_version"]
    last = _Segment(world, 1, seq, chain, forget, schema)
    failure: _Failure | None = None
    with contextlib.ExitStack() as stack:
        futures = []
        if cuts:
            pool = stack.enter_context(ProcessPoolExecutor(len(cuts), mp_context=_mp_context()))
            futures = [
                pool.submit(
                    _stretch,
                    str(p),
                    config,
                    off,
                    1,
                    before,
                    end,
                    k > 0,
                    secret,
                    forgetting,
                    limit,
                )
                for k, ((off, before), end) in enumerate(zip(starts, ends, strict=False))
            ]
        try:
            with _mapped(p, first, size, checkpoint) as lines:  # to the log's end (as it was)
                if cuts:
                    _restore_first(world, lines, 1, chain, forget, schema)
                    last.first_line, last.restored = 2, 1
                last.run(lines, until_seq)
        except (LogFormatError, ReplayDivergence) as exc:
            failure = _as_data(exc)
        earlier = [f.result() for f in futures]
    transitions, events = last.transitions, last.events
    for (off, _), got in zip(starts, [*earlier, failure], strict=True):
        if got is not None and got[0] != "done":  # the first stretch that failed wins
            base = _line_number(p, off) - 1  # the stretch's lines count from 1
            if got[0] == "unsteppable":  # its checkpoint's line too
                got = (got[0], got[1], base + got[2], *got[3:])
            _raise((got[0], base + got[1], *got[2:]), header)
        if got is not None:
            transitions += got[1]
            events += got[2]
    head = None
    if chain is not None and until_seq is None:
        # the lines verified: one that lost only its newline counts too (it read one short)
        head = (_line_number(p, size) - 1 + _unended(p, size), chain.head.decode("ascii"))
    looked = _has_checkpoint(p, body, size) if jobs > 1 and not cuts else None
    return ReplayResult(
        transitions,
        events,
        world,
        last.seq,
        header,
        head,
        stretches=len(starts),
        has_checkpoints=looked,
        forgetter=forget,
    )


def _previous_segment(path: Path, header: Mapping[str, Any], seen: set[Path]) -> Path | None:
    """The segment the log at `path` (whose header is `header`) resumes, from its header's
    `meta.resumes` (see `replay`); None for a log that resumes nothing. `seen`: the segments
    of the chain so far (resolved), which it may not name again."""
    meta = header.get("meta")
    resumes = meta.get("resumes") if isinstance(meta, Mapping) else None
    if resumes is None:
        return None
    name = resumes.get("log") if isinstance(resumes, Mapping) else None
    if not isinstance(name, str) or not name or Path(name).name != name:
        raise LogFormatError(
            1,
            "the header's `meta.resumes` does not name a segment file beside the log",
            "restore the header from the original log",
        )
    prev = path.parent / name
    if not prev.is_file():
        raise LogFormatError(
            1,
            f"the log resumes the segment {name}, which is not beside it",
            "keep a resumed run's log segments (transitions.<n>.jsonl) in its folder",
        )
    if prev.resolve() in seen:
        raise LogFormatError(1, f"the segments resume each other in a loop ({name})")
    return prev


def _check_segment_end(name: str, result: ReplayResult, header: Mapping[str, Any]) -> None:
    """Raise `ChainBroken` unless the segment `name`, replayed to its end (`result`), ends
    where the header of the log that resumes it says it did."""
    resumes = header["meta"]["resumes"]  # (read by `_previous_segment`)
    want = (resumes.get("count"), resumes.get("hash"))
    if result.chain != want:
        raise ChainBroken(
            result.chain[0] if result.chain is not None else 0,
            f"{name} ending at {want}",
            result.chain,
            why=f"the segment {name} does not end where the log that resumes it says it did: "
            "it was cut, extended or rewritten after the resume, or another log was put in "
            "its place",
            fix=f"put back the {name} the run set aside when it resumed; an edited log cannot "
            "be trusted",
        )


#: Keys a simulation's receipt and its log's header (`meta`) both record: where they differ,
#: the receipt is another run's of the same plan (it read as a log cut short or rebuilt).
_RUN_KEYS = ("seed", "faults")
_NOT_ITS = "; or the receipt is not this log's (another run's of the same plan, or edited)"
_RECEIPT_FIX = (
    "check that the receipt is the receipt.json the run wrote beside this log; if it is, "
    "restore the original log: this one cannot be trusted"
)


def is_log_chain(chain: object) -> TypeGuard[Mapping[str, Any]]:
    """Whether `chain` is a receipt's `log_chain`: {"count": lines, "hash": a string} (a hash
    that is a number was read as a rebuilt log)."""
    return (
        isinstance(chain, Mapping)
        and type(chain.get("count")) is int
        and isinstance(chain.get("hash"), str)
    )


def check_receipt(
    result: ReplayResult, receipt: Mapping[str, Any], *, key: str | bytes | None = None
) -> None:
    """Raise `ChainBroken` unless the replayed log ends where the run's receipt says it did:
    `receipt["log_chain"]` = {"count": lines, "hash": the last line's chain} (what
    `TransitionLog.chain_head` gave when the run ended), and for a keyed log its `seal` under
    the key (`key`, else `EHP_LOG_KEY`: `translog.receipt_log_chain`). A log cut short, or one
    whose chain was rebuilt after an edit, ends elsewhere; a keyed log cut short and given a
    receipt rewritten to its new end has no seal that holds."""
    want = receipt.get("log_chain")
    if not is_log_chain(want):
        raise LogFormatError(
            0,
            'the receipt has no `log_chain: {"count": N, "hash": "..."}`',
            "give the receipt the run wrote beside this log",
        )
    meta = result.header.get("meta")
    logged = meta.get("plan") if isinstance(meta, Mapping) else None
    named = receipt.get("plan")
    if isinstance(logged, str) and isinstance(named, str) and logged != named:
        # another run's receipt: its chain differs, which read as an edited log
        raise EhpError(
            f"the receipt is of plan {named!r}, the log of plan {logged!r}",
            "a run writes its receipt.json beside its own log",
            "give --receipt the receipt.json in the log's folder",
        )
    for name in _RUN_KEYS:  # a simulation's receipt and its log's header both record these
        if (
            isinstance(meta, Mapping)
            and name in meta
            and name in receipt
            and meta[name] != receipt[name]
        ):
            raise EhpError(
                f"the receipt is another run's: its {name} is "
                f"{printable(repr(receipt[name]))[:40]}, the log's "
                f"{printable(repr(meta[name]))[:40]}",
                "a run writes its receipt.json beside its own log",
                "give --receipt the receipt.json in the log's folder",
            )
    if result.chain is None:
        raise LogFormatError(
            1,
            "the log has no hash chain (schema 1 or 2), or was replayed only in part",
            "replay the whole log written by an ehp-fsm with schema 3",
        )
    count, head = result.chain
    if count != want["count"]:
        raise ChainBroken(
            count,
            f"{want['count']} lines (the receipt)",
            f"{count} lines",
            why="the log does not have the number of lines the receipt records: it was cut "
            f"short or lines were added{_NOT_ITS}",
            fix=_RECEIPT_FIX,
            what=f"the log has {count} lines and its receipt records {want['count']}",
        )
    if head != want.get("hash"):
        raise ChainBroken(
            count,
            want.get("hash"),
            head,
            why="the last line's chain is not the one the receipt records: the log was "
            f"rewritten and its chain rebuilt{_NOT_ITS}",
            fix=_RECEIPT_FIX,
        )
    if result.header.get("chain_kind") == CHAIN_KINDS[1]:
        seal, k = want.get("seal"), log_key(key)
        if k is None or not isinstance(seal, str) or seal != end_seal(k, count, head):
            raise ChainBroken(
                count,
                printable(repr(seal))[:40],
                "a seal made with the key",
                why="the receipt's `log_chain` has no seal that the key makes, where a run "
                "seals a keyed log's end: the receipt was written without the key (an "
                "ehp-fsm before 2026-12-06 did not seal), or its count and hash were "
                f"rewritten to a log cut short{_NOT_ITS}",
                fix=_RECEIPT_FIX,
                what="the receipt's seal does not hold",
            )


def _unended(path: Path, size: int) -> int:
    """1 when the first `size` bytes of `path` end in a line without its newline, else 0."""
    if size == 0:
        return 0
    with path.open("rb") as fh:
        fh.seek(size - 1)
        return int(fh.read(1) != b"\n")


def _line_number(path: Path, offset: int) -> int:
    """The number of the line that starts at byte `offset`."""
    with path.open("rb") as fh:
        return line_number(fh, offset)


# What a stretch ends in, as plain data (it crosses a process boundary): ("done", transitions,
# events), ("divergence", line, field, expected, actual), ("format", line, why, fix),
# ("unsteppable", line, checkpoint line, what the step raised) or ("ends", line, records read,
# records of the event, its root's seq).
_Failure = tuple[Any, ...]


def _as_data(exc: LogFormatError | ReplayDivergence) -> _Failure:
    if hasattr(exc, "unsteppable"):  # (`_unsteppable`)
        return ("unsteppable", exc.line, *exc.unsteppable)
    if hasattr(exc, "ends_inside"):  # (`_ends_inside`)
        assert isinstance(exc, ReplayDivergence)
        return ("ends", exc.line, exc.expected, exc.actual, exc.ends_inside)
    if isinstance(exc, ChainBroken):
        return ("chain", exc.line, exc.expected, exc.actual)
    if isinstance(exc, ReplayDivergence):
        return ("divergence", exc.line, exc.field, exc.expected, exc.actual, exc.said)
    return ("format", exc.line, exc.why, exc.fix)


def _raise(got: _Failure, header: Mapping[str, Any]) -> NoReturn:
    """Raise the failure `got` of the log whose header is `header` (a divergence names the
    ehp-fsm that wrote the log: another one's engine may decide otherwise)."""
    if got[0] == "unsteppable":
        raise _unsteppable(got[1], got[2], got[3])
    if got[0] == "ends":
        raise _ends_inside(got[1], got[2], got[3], got[4])
    if got[0] == "chain":
        raise ChainBroken(got[1], got[2], got[3])
    if got[0] == "divergence":
        err = ReplayDivergence(got[1], got[2], got[3], got[4], said=got[5])
        err.fix = (
            "restore the original log, or replay it with the ehp-fsm (and specs/) that wrote "
            f"it: {_writer(header)}"
        )
        raise err
    raise LogFormatError(got[1], got[2], got[3])


def _restore_first(
    world: World,
    lines: Iterator[bytes],
    n: int,
    chain: _Chain | None = None,
    forget: Forgetter | None = None,
    schema: int = SCHEMA_VERSION,
) -> None:
    """Restore `world` from the checkpoint on the stretch's first line; the chain goes on from
    that line's link (the stretch before checks the link itself). `schema`: the header's."""
    raw = next(lines, b"")
    cp = _checkpoint(raw)
    if cp is None:
        raise LogFormatError(n, "a stretch must start at a checkpoint line")
    _finished_schema(cp, n, schema)
    try:
        _restore(world, cp, n, forget)
    except (EhpError, Unsure, MemoryError):
        raise
    except Exception as exc:  # (the index over data of the wrong type)
        raise _unsteppable(n, n, exc) from None
    if chain is not None:
        chain.head = cp.chain.encode("ascii")


def _stretch(
    path: str,
    config: dict[str, Any],
    start: int,
    first_line: int,
    seq: int,
    end: int,
    restore: bool,
    key: bytes | None = None,
    forgetting: tuple[str, ...] | None = None,
    limit: int | None = None,
) -> _Failure:
    """Worker: verify the stretch [start, end) of the log; ("done", transitions, events), or
    the failure as data (`Unsure` is raised: the caller replays again, keeping every
    instance). `key`: the chain's key as `translog.log_key` gives it; `limit`: the line limit
    (the caller checked the stretch's lines against it)."""
    world = World(load_specs(), config)
    forget = Forgetter(world, forgetting) if forgetting is not None else None
    try:
        header, _, chain = _read_header(Path(path), key, limit)
        schema = header["schema_version"]
        seg = _Segment(world, first_line, seq, chain, forget, schema)
        with _mapped(Path(path), start, end) as lines:
            if restore:
                _restore_first(world, lines, first_line, chain, forget, schema)
                seg.first_line, seg.restored = first_line + 1, first_line
            seg.run(lines, None)
    except (LogFormatError, ReplayDivergence) as exc:
        return _as_data(exc)
    return ("done", seg.transitions, seg.events)


def _cuts(
    path: Path, body: int, jobs: int, until_seq: int | None, size: int
) -> list[tuple[int, int]]:
    """Up to `jobs - 1` checkpoint lines that cut the first `size` bytes of the log into
    stretches of about equal bytes: (byte offset, seq before) of each, in file order. Only the
    bytes between each even split and its nearest checkpoint are searched."""
    mark = b"\n" + _CHECKPOINT_START
    cuts: list[tuple[int, int]] = []
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_READ) as mm:
        for k in range(1, jobs):
            target = body + (size - body) * k // jobs
            after, before = mm.find(mark, target), mm.rfind(mark, body - 1, target)
            near = [x + 1 for x in (after, before) if x != -1]
            if not near:
                continue
            off = min(near, key=lambda o: abs(o - target))
            if any(off == c for c, _ in cuts):
                continue
            cp = _checkpoint(mm[off : mm.find(b"\n", off) + 1])
            if cp is None:
                continue  # not a well-formed checkpoint: the stretch before it will say so
            if until_seq is not None and cp.checkpoint >= until_seq:
                break
            cuts.append((off, cp.checkpoint))
    return sorted(cuts)


def _has_checkpoint(path: Path, body: int, size: int) -> bool:
    """Whether the first `size` bytes of the log hold a checkpoint line after its header
    (ending at `body`): where `_cuts` found none to cut at, why (`ehp-fsm replay --jobs`)."""
    if size <= body:
        return False
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_READ) as mm:
        return mm.find(b"\n" + _CHECKPOINT_START, body - 1) != -1


def _line_end(path: Path, offset: int) -> int:
    """The byte offset just after the line that starts at `offset`."""
    with path.open("rb") as fh:
        fh.seek(offset)
        return offset + len(fh.readline())


def _mp_context() -> multiprocessing.context.BaseContext:
    """fork when this process runs one thread (cheap, safe); forkserver otherwise."""
    return multiprocessing.get_context("fork" if threading.active_count() == 1 else "forkserver")


def _expected(
    r: Record, seq: int, first: int, event: Event, payload: dict[str, Any], chain: str = ""
) -> LoggedRecord:
    """The line the log must hold at `seq` for computed record `r` of the event whose root is
    seq `first` (`payload`: the root's own, as read; a cascade's, as JSON gives it back)."""
    return LoggedRecord(
        seq=seq,
        time=event.time,
        machine=r.machine,
        instance=r.instance,
        source=r.source,
        dest=r.dest,
        accepted=r.accepted,
        reason=r.reason,
        effects=plain_effects(r.commands) if r.commands else [],
        correlation=event.correlation,
        cause=None if r.cause is None else first + r.cause,
        name=r.event,
        payload=payload,
        chain=chain,  # checked on the raw line by `_Chain`
    )


def _diverged(n: int, logged: LoggedRecord, outcome: Outcome, i: int) -> None:
    """Raise `ReplayDivergence` at line `n` naming the first field where the logged record
    differs from computed record `i` of `outcome`."""
    first = logged.seq - i
    mine = outcome_records(outcome, first)[i]
    for key in _COMPARED:
        value = getattr(logged, "name" if key == "event" else key)
        if key == "accepted" and value != mine["accepted"]:
            # with its reason: "`dest` recorded 'saving', engine computed '<new>'" left the
            # operator to guess why
            said = (
                f"the engine refuses this event: {mine['reason']}"
                if not mine["accepted"]
                else f"the engine accepts this event, which the log records as refused "
                f"({logged.reason})"
            )
            raise ReplayDivergence(n, "accepted", logged.accepted, mine["accepted"], said=said)
        if plain(value) != mine[key]:
            raise ReplayDivergence(n, key, value, mine[key])
    raise ReplayDivergence(n, "record", msgspec.to_builtins(logged), mine)
