"""The finished instances a replay forgets, and what it keeps of them.

A long log creates instances that reach a terminal state and never change again: every step's G
groups end `consumed`, its training step `done`, a revision `retired`. A world that holds them
grows with the log (1,024 hosts × 500 steps: 8.2 M consumed groups), although nothing reads them
but a lookup of their state. `replay(..., forget_finished=True)` drops an instance from the world
once it is in one of its machine's `FORGETTABLE` states, and keeps of it what the checks need:

- its id, in the set of its state (`IdSet`: one bit per id of the form <prefix><number>, as the
  drivers name groups, steps and revisions). The world's lookups (`World.forgotten`) answer a
  stand-in in that state, so an event for it is refused as before ("... is in terminal state
  'consumed', which absorbs every event"), a create under its id too, and a guard that asks its
  state gets it;
- a digest per machine: the sum of a 128-bit hash of (id, state, data) over the forgotten
  instances. A checkpoint line lists every instance: its entries that are not live must be
  exactly the forgotten ones, in their states, and hash to the same sum.

What may be forgotten is what the guards and effects never read beyond the state, checked
against `core.guards` and `core.effects` (a scan with `View.all` or `View.each` does not see a
forgotten instance, so every scan must leave those states out by itself):

- `request` `consumed`: `partition_is_complete` asks a group's state; the scans
  (`inflight_requests_scan`, `revision_unreferenced`) and the index look for dispatched ones.
- `training_step` `done`: `busy_steps` and `no_open_step` scan for non-terminal steps;
  `step_holds_group` reads a step's groups only in the state the event wants (computing,
  publishing or failed). `failed` stays: an `unclaim` naming a failed step reads its groups.
- `revision` `retired`, `failed`: no guard or effect reads another revision.
- `rollout_engine` `stopped`, `failed`: the GPU guards (`owner_claims_gpu`, `_live_holder`) stop
  at a terminal owner's state; the rollout share of an engine outside `ROLLOUT_STATES` is 0;
  `engine_is_serving` asks the state before `record_dispatch` reads `installed`;
  `revision_unreferenced` skips terminal engines; a terminal state has no `update` to cascade.
- `hybrid_replica` `stopped`, `cancelled`, `failed`: the scans ask for active or holding ones,
  the GPU guards stop at the state.

GPUs are never forgotten (their ids are the cluster's, a bounded set). A read of a stand-in's
data, or a checkpoint whose finished entries do not add up, raises `Unsure`: replay then replays
the log again keeping every instance, which decides and names the difference exactly as before.

The writer forgets too (`embedded.Orchestrator`, so the run's controller): the machines of
`WRITER_FORGETS` (groups, steps, revisions: G + 2 instances a step), audited against the run's
shell as well — its readers look a finished group, step or revision up by state only (the
dispatcher's `_state`, the trainer's step checks, the publisher's scans of live revisions), and
a step's message that named a `done` step's reason no longer reads it. Engines and Hybrids are
not forgotten by the writer: the shell reads a finished one's data (`WRITER_FORGETS`). Its
checkpoints (schema 4, `translog`) list the forgotten ids by state (`Forgetter.listing`, runs
of `IdSet.runs`), and replay compares them by id (`replay._check_finished`); a stretch restored
from one takes them back (`IdSet.from_runs`, `Forgetter.install`), their data unknown.
"""

from __future__ import annotations

import bisect
import copy
import hashlib
import os
import re
from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import Any

import msgspec

from ehp_fsm.core.world import Instance, World

#: machine -> the terminal states whose instances replay may forget (see the module docstring).
FORGETTABLE: dict[str, frozenset[str]] = {
    "request": frozenset({"consumed"}),
    "training_step": frozenset({"done"}),
    "revision": frozenset({"retired", "failed"}),
    "rollout_engine": frozenset({"stopped", "failed"}),
    "hybrid_replica": frozenset({"stopped", "cancelled", "failed"}),
}

_DIGITS = "0123456789"
_MAX_DIGITS = 12
_GROW = 1 << 16  # bytes a prefix's bit array may grow by for one id (else: the plain set)
_MOD = 1 << 128


class Unsure(Exception):
    """Forgetting could not decide something (a forgotten instance's data was read, or a
    checkpoint's finished entries differ): replay again, keeping every instance."""


#: What a read of a forgotten instance's data says (an embedding scheduler's code may read one:
#: the orchestrator's world forgets too, `WRITER_FORGETS`).
_UNREAD_WHY = (
    "the data of a forgotten instance was read{}: a world that forgets keeps a finished "
    "instance's state only (an embedded Orchestrator keeps every instance with "
    "forget_finished=False)"
)


class _Unread(Mapping[str, Any]):
    """A stand-in's data: any read raises `Unsure` (the audit above says none happens)."""

    def __getitem__(self, key: str) -> Any:
        raise Unsure(_UNREAD_WHY.format(f" ({key!r})"))

    def __iter__(self) -> Iterator[str]:
        raise Unsure(_UNREAD_WHY.format(""))

    def __len__(self) -> int:
        raise Unsure(_UNREAD_WHY.format(""))


UNREAD: Mapping[str, Any] = _Unread()


class IdSet:
    """A set of ids, compact for `<prefix><number>` ids (no leading zero): one bit each, in a
    bit array per prefix that starts at the prefix's first number (g0, g1, ... at 8.2 M groups:
    1 MiB instead of ~0.6 GiB of strings and set entries). Any other id, or a number far beyond
    its prefix's array, goes to an ordinary set. `runs` gives the ids back as runs of
    consecutive numbers per prefix (what a checkpoint line lists) and `from_runs` builds a set
    from them, keeping the runs as they are (two numbers a run, looked up by bisection: a set
    read from a log costs the memory of its line, whatever numbers it names)."""

    __slots__ = ("_arrays", "_n", "_other", "_spans")

    def __init__(self) -> None:
        self._arrays: dict[str, tuple[int, bytearray]] = {}  # prefix -> (first number, bits)
        self._other: set[str] = set()
        self._spans: dict[str, tuple[list[int], list[int]]] = {}  # from_runs: (firsts, lasts)
        self._n = 0

    def __contains__(self, iid: str) -> bool:
        # asked on every lookup of an id the world does not hold: kept short
        prefix = iid.rstrip(_DIGITS)
        entry = self._arrays.get(prefix)
        if entry is not None:
            digits = iid[len(prefix) :]
            if digits and len(digits) <= _MAX_DIGITS and (digits[0] != "0" or digits == "0"):
                k = int(digits) - entry[0]
                bits = entry[1]
                if 0 <= k < len(bits) << 3 and bits[k >> 3] >> (k & 7) & 1:
                    return True
        if self._spans and _in_spans(self._spans, iid):
            return True
        return iid in self._other

    def add(self, iid: str) -> None:
        """Add `iid` (not already in the set: an instance is forgotten once)."""
        self._n += 1
        prefix = iid.rstrip(_DIGITS)
        digits = iid[len(prefix) :]
        if digits and len(digits) <= _MAX_DIGITS and (digits[0] != "0" or digits == "0"):
            n = int(digits)
            entry = self._arrays.get(prefix)
            if entry is None:
                entry = self._arrays[prefix] = (n - n % 8, bytearray())
            base, bits = entry
            k = n - base
            if 0 <= k < (len(bits) + _GROW) * 8:
                byte = k >> 3
                if byte >= len(bits):
                    # room to spare, at most `_GROW` an id (before: the array's length, so
                    # each id just past its end doubled it: 37 revisions failed under ids
                    # r0, r8, r16, r32, ... asked for 2**36 bytes, in the run and in replay)
                    bits.extend(bytes(max(byte + 1 - len(bits), min(len(bits), _GROW))))
                bits[byte] |= 1 << (k & 7)
                return
        self._other.add(iid)

    def discard(self, iid: str) -> None:
        """Take `iid` out again, if `add` put it in (an event taken back out of the world:
        `Forgetter.rollback`)."""
        prefix = iid.rstrip(_DIGITS)
        digits = iid[len(prefix) :]
        entry = self._arrays.get(prefix)
        if entry is not None and _number(digits) is not None:
            k = int(digits) - entry[0]
            bits = entry[1]
            if 0 <= k < len(bits) << 3 and bits[k >> 3] >> (k & 7) & 1:
                bits[k >> 3] &= ~(1 << (k & 7)) & 0xFF
                self._n -= 1
                return
        if iid in self._other:
            self._other.remove(iid)
            self._n -= 1

    def __len__(self) -> int:
        return self._n

    def size(self) -> int:
        """How many ids, as a Python int (`len` raises `OverflowError` past `sys.maxsize`,
        which the runs of a forged checkpoint line can name: replay compares this)."""
        return self._n

    def nbytes(self) -> int:
        """Bytes of bit arrays, and ids in the plain set (a size for tests and reports)."""
        spans = sum(16 * len(firsts) for firsts, _ in self._spans.values())
        return sum(len(b) for _, b in self._arrays.values()) + len(self._other) + spans

    def runs(self) -> tuple[list[tuple[str, int, int]], list[str]]:
        """The ids as (prefix, first, last) runs of consecutive numbers, sorted and maximal
        (the same set gives the same runs, however it was built), and the ids that are not
        `<prefix><number>` (sorted)."""
        found: list[tuple[str, int, int]] = []
        for prefix, (base, bits) in self._arrays.items():
            found += [(prefix, lo, hi) for lo, hi in _bit_runs(base, bits)]
        for prefix, (firsts, lasts) in self._spans.items():
            found += [(prefix, lo, hi) for lo, hi in zip(firsts, lasts, strict=True)]
        other = []
        for iid in self._other:
            prefix = iid.rstrip(_DIGITS)
            n = _number(iid[len(prefix) :])
            if n is None:
                other.append(iid)
            else:
                found.append((prefix, n, n))
        found.sort()
        out: list[tuple[str, int, int]] = []
        for prefix, lo, hi in found:
            if out and out[-1][0] == prefix and lo <= out[-1][2] + 1:
                if hi > out[-1][2]:
                    out[-1] = (prefix, out[-1][1], hi)
                continue
            out.append((prefix, lo, hi))
        return out, sorted(other)

    @classmethod
    def from_runs(cls, runs: list[tuple[str, int, int]], ids: list[str]) -> IdSet:
        """The set of `runs` ((prefix, first, last): prefix without a final digit, numbers
        0 <= first <= last < 10**12) and `ids`, as `runs` gives them; `ValueError` naming
        the first that is not one (overlaps are taken as the union)."""
        out = cls()
        by_prefix: dict[str, list[tuple[int, int]]] = {}
        for run in runs:
            prefix, lo, hi = run
            if (
                type(prefix) is not str
                or prefix.rstrip(_DIGITS) != prefix
                or type(lo) is not int
                or type(hi) is not int
                or not 0 <= lo <= hi < 10**_MAX_DIGITS
            ):
                raise ValueError(f"{list(run)!r} is not a run [prefix, first, last]")
            by_prefix.setdefault(prefix, []).append((lo, hi))
        for prefix, spans in by_prefix.items():
            spans.sort()
            firsts: list[int] = []
            lasts: list[int] = []
            for lo, hi in spans:
                if lasts and lo <= lasts[-1] + 1:
                    lasts[-1] = max(lasts[-1], hi)
                else:
                    firsts.append(lo)
                    lasts.append(hi)
            out._spans[prefix] = (firsts, lasts)
            out._n += sum(hi - lo + 1 for lo, hi in zip(firsts, lasts, strict=True))
        for iid in ids:
            if type(iid) is not str:
                raise ValueError(f"{iid!r} is not an id (a string)")
            if iid not in out:
                out._other.add(iid)
                out._n += 1
        return out


def _number(digits: str) -> int | None:
    """The number `digits` spell as an id's number (no leading zero, at most 12 digits)."""
    if digits and len(digits) <= _MAX_DIGITS and (digits[0] != "0" or digits == "0"):
        return int(digits)
    return None


def _in_spans(spans: Mapping[str, tuple[list[int], list[int]]], iid: str) -> bool:
    prefix = iid.rstrip(_DIGITS)
    entry = spans.get(prefix)
    n = _number(iid[len(prefix) :]) if entry is not None else None
    if entry is None or n is None:
        return False
    k = bisect.bisect_right(entry[0], n) - 1
    return k >= 0 and n <= entry[1][k]


#: Runs of bytes a bit array's runs are read from: whole bytes set, or one byte set in part.
_SET_BYTES = re.compile(rb"\xff+|[^\x00\xff]")


def _bit_runs(base: int, bits: bytearray) -> Iterator[tuple[int, int]]:
    """(first, last) of each run of set bits of `bits` (bit k: number `base` + k), in order;
    whole bytes set are passed over in one step (a run of 16,384 groups: one match)."""
    start = last = -2
    for m in _SET_BYTES.finditer(bits):
        first = base + 8 * m.start()
        if start >= 0 and last + 1 != first:  # bytes with no bit set between
            yield start, last
            start = -2
        if bits[m.start()] == 0xFF:
            if start < 0:
                start = first
            last = base + 8 * m.end() - 1
            continue
        byte = bits[m.start()]
        for j in range(8):
            if byte >> j & 1:
                if start < 0:
                    start = first + j
                last = first + j
            elif start >= 0:
                yield start, last
                start = -2
    if start >= 0:
        yield start, last


_encode = msgspec.json.Encoder(
    enc_hook=lambda x: dict(x) if isinstance(x, Mapping) else repr(x)
).encode


def entry_hash(iid: str, state: str, data: Mapping[str, Any], keyed: Any) -> int:
    """The 128-bit keyed hash of one instance as a checkpoint lists it (its data as JSON gives
    it back: a tuple and a list hash the same, as do a mapping and a dict). `keyed`: a BLAKE2b
    hasher that has taken its key (copied per entry: the key's block is hashed once). The key
    is drawn at random per `Finished`: a sum of hashes nobody else can compute cannot be
    matched by a forged set of entries (an unkeyed sum could, by a generalized birthday
    search)."""
    try:
        raw = _encode((iid, state, data))
    except (TypeError, ValueError) as exc:  # a value JSON cannot hold: decide by keeping all
        raise Unsure(f"the data of {iid!r} cannot be hashed ({exc})") from None
    h = keyed.copy()
    h.update(raw)
    return int.from_bytes(h.digest(), "little")


class Finished:
    """What replay keeps of the forgotten instances of one machine: their ids by state, their
    count and the sum of their `entry_hash`es (under a key of its own)."""

    __slots__ = ("by_state", "count", "digest", "keyed", "machine")

    def __init__(self, machine: str, states: frozenset[str]) -> None:
        self.machine = machine
        self.by_state = {s: IdSet() for s in sorted(states)}
        self.count = 0
        self.digest = 0
        self.keyed = hashlib.blake2b(digest_size=16, key=os.urandom(16))

    def __deepcopy__(self, memo: dict[int, Any]) -> Finished:
        """A copy of its own (`copy.deepcopy(world)` failed: a hasher cannot be pickled), under
        the same key: a copy goes on matching what the original would."""
        other = Finished.__new__(Finished)
        other.machine = self.machine
        other.by_state = copy.deepcopy(self.by_state, memo)
        other.count = self.count
        other.digest = self.digest
        other.keyed = self.keyed.copy()
        return other

    def add(self, iid: str, state: str, data: Mapping[str, Any]) -> None:
        self.by_state[state].add(iid)
        self.count += 1
        self.digest = (self.digest + entry_hash(iid, state, data, self.keyed)) % _MOD

    def restore(self, listed: Mapping[str, IdSet]) -> None:
        """Take the ids of a checkpoint's `finished` entry ({state: ids}; their data is not
        known, so the digest counts none of them: a machine listed so is checked by id)."""
        for state, ids in listed.items():
            self.by_state[state] = ids
        self.count = sum(ids.size() for ids in self.by_state.values())

    def stand_in(self, iid: str) -> Instance | None:
        """A forgotten instance as lookups see it (its state; its data unreadable)."""
        for state, ids in self.by_state.items():
            if iid in ids:
                return Instance(self.machine, iid, state, UNREAD)
        return None

    def matches(
        self, listed: Mapping[str, tuple[str, dict[str, Any]]], live: Mapping[str, Any]
    ) -> bool:
        """Whether the entries of a checkpoint's `listed` ({id: (state, data)}) that are not
        `live` are exactly the forgotten instances (the caller has checked that `listed` holds
        `count` more entries than `live`, and every live one)."""
        total = 0
        for iid, (state, data) in listed.items():
            if iid in live:
                continue
            ids = self.by_state.get(state)
            if ids is None or iid not in ids:
                return False
            total += entry_hash(iid, state, data, self.keyed)
        return total % _MOD == self.digest


#: Every state some machine's instances are forgotten in: a change to any other state (most of
#: them) is passed over with one set lookup (`Forgetter.__call__`, and replay's loop).
FORGETTABLE_STATES: frozenset[str] = frozenset().union(*FORGETTABLE.values())
#: The machines whose finished instances the writer's world forgets (`embedded.Orchestrator`,
#: so the run's controller): their ids go to a checkpoint's `finished` entry. Engines and
#: Hybrids are kept: the run's shell reads a finished one's data (a failed one's reason, shown
#: once: `run.watch.FailureWatch`; a left Hybrid's GPUs: `run.watch`; the host of an instance
#: an agent reports on: `runtime.reconcile`), and there are a few per borrow, not G per step.
WRITER_FORGETS: tuple[str, ...] = ("request", "training_step", "revision")
#: Machines whose finished instances the world's index still holds (`core.index`: an engine's
#: state and GPUs, whatever its state; groups and GPUs leave it when they leave the states it
#: asks about).
_INDEX_HOLDS = frozenset({"rollout_engine"})


#: `Forgetter.mark`: per machine (its `Finished`, in order), count, digest and set sizes.
_Mark = tuple[tuple[int, int, tuple[int, ...]], ...]


class Forgetter:
    """Makes `world` forget its finished instances: it drops them from `world.instances`, keeps
    a `Finished` per machine, and answers the world's lookups of them (`World.forgotten`: the
    step's lookups, `View.get`, `World.get` ask it after a miss; iteration sees the live
    instances only). Call it with each accepted step's changes after `World.apply`, and
    `install` again after the world is restored from a checkpoint."""

    __slots__ = ("finished", "miss_id", "miss_machine", "states", "world")

    def __init__(self, world: World, machines: Collection[str] | None = None) -> None:
        """`machines`: those whose finished instances are forgotten (default: every machine
        of `FORGETTABLE`; the writer's: `WRITER_FORGETS`)."""
        self.world = world
        self.states = {
            m: s
            for m, s in FORGETTABLE.items()
            if m in world.specs and (machines is None or m in machines)
        }
        self.finished: dict[str, Finished] = {}
        # the last lookup found in neither (a new instance is looked up twice: by the step
        # and by a guard or `World.apply`); cleared when an instance is forgotten
        self.miss_machine = self.miss_id = ""
        self.install()

    def install(self, restored: Mapping[str, Mapping[str, IdSet]] | None = None) -> None:
        """Forget the finished instances the world holds (a world restored from a checkpoint
        holds them all, or those `restored` does not name), afresh, and answer the world's
        lookups of forgotten ones. `restored`: {machine: {state: ids}} of a checkpoint's
        `finished` entry (`translog`, schema 4), the instances its writer had forgotten."""
        self.finished = {m: Finished(m, states) for m, states in self.states.items()}
        for m, listed in (restored or {}).items():
            self.finished[m].restore(listed)
        self.miss_machine = self.miss_id = ""
        for m, states in self.states.items():
            by_id = self.world.instances[m]
            for iid in [i for i, inst in by_id.items() if inst.state in states]:
                inst = by_id.pop(iid)
                self.finished[m].add(iid, inst.state, inst.data)
        self.world.forgotten = self.stand_in

    def stand_in(self, machine: str, iid: str) -> Instance | None:
        """The forgotten instance `iid` of `machine` as lookups see it (its state; its data
        unreadable), or None when it was never forgotten."""
        finished = self.finished.get(machine)
        if finished is None or not finished.count or type(iid) is not str:
            return None
        if iid == self.miss_id and machine == self.miss_machine:
            return None
        inst = finished.stand_in(iid)
        if inst is None:
            self.miss_machine, self.miss_id = machine, iid
        return inst

    def __call__(self, changes: Mapping[tuple[str, str], Instance]) -> None:
        """Forget the instances `changes` (applied) left in a forgettable state."""
        for key, inst in changes.items():
            if inst.state in FORGETTABLE_STATES:
                self.forget(key, inst)

    def forget(self, key: tuple[str, str], inst: Instance) -> None:
        """Forget instance `key` (machine, id), now `inst`, if its state is one its machine's
        instances are forgotten in."""
        m, iid = key
        gone = self.states.get(m)
        if gone is None or inst.state not in gone:
            return  # a state another machine's instances are forgotten in
        del self.world.instances[m][iid]
        if m in _INDEX_HOLDS:
            self.world.index.change(m, iid, inst, None)
        self.finished[m].add(iid, inst.state, inst.data)
        self.miss_machine = self.miss_id = ""

    def count(self) -> int:
        """Instances forgotten so far."""
        return sum(f.count for f in self.finished.values())

    def mark(self) -> _Mark:
        """Each machine's count, digest and set sizes as they stand: what `rollback` puts
        back (taken before an event's instances are forgotten)."""
        return tuple(
            (f.count, f.digest, tuple(ids._n for ids in f.by_state.values()))
            for f in self.finished.values()
        )

    def rollback(self, mark: _Mark, keys: Iterable[tuple[tuple[str, str], Instance]]) -> None:
        """Take back the forgetting of `keys` ((machine, id), the instance as forgotten) done
        since `mark`, as far as it went (the world's instances are put back by the caller):
        an event taken back out (`embedded.Orchestrator`'s repair). The counts are put back
        from `mark`, not counted down: an interrupt inside `forget` leaves an id's bit and
        the counts apart (a set's size one more than its ids: the next checkpoint's count
        did not match its runs, which replay refused). Running it again does the same."""
        for (m, iid), inst in keys:
            finished = self.finished.get(m)
            ids = finished.by_state.get(inst.state) if finished is not None else None
            if ids is not None:
                ids.discard(iid)  # (its membership; the sizes are put back below)
        for f, (count, digest, sizes) in zip(self.finished.values(), mark, strict=True):
            for ids, size in zip(f.by_state.values(), sizes, strict=True):
                ids._n = size
            f.count, f.digest = count, digest
        self.miss_machine = self.miss_id = ""

    def listing(self) -> dict[str, dict[str, dict[str, Any]]]:
        """The forgotten ids as a checkpoint line lists them (`translog`, schema 4): {machine:
        {state: {"count": n, "runs": [[prefix, first, last], ...], "ids": [other ids]}}} for
        every machine this forgetter forgets (a machine with none: {}; a state with none is
        left out)."""
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for m, finished in self.finished.items():
            out[m] = {}
            for state, ids in finished.by_state.items():
                if len(ids):
                    runs, other = ids.runs()
                    out[m][state] = {
                        "count": len(ids),
                        "runs": [list(r) for r in runs],
                        "ids": other,
                    }
        return out
