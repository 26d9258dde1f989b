"""Fixed-batch bookkeeping for one optimizer step: the group partition and the delivery ledger.

What this module knows:
- how G complete GRPO groups are assigned to the live training replicas of one membership epoch
  (`partition_groups`): every group exactly once, never split, only live replicas, deterministic,
  each replica's load within one group of its capacity-proportional share;
- which gradient deliveries one (step, epoch) expects, and whether a delivery offered for it is
  accepted or rejected and why (`DeliveryLedger`). Rejections are values (`DeliveryRejected`
  with a `RejectReason`), never exceptions; the shell logs them.

What it does not know: tensors, torch, processes, clocks or logging. Shapes arrive as tuples,
time arrives as a number (`now`, `deadline`) from the caller. `PartitionError` is raised only for
input that admits no valid partition at all.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from fractions import Fraction

from ehp_fsm.errors import EhpError

Shapes = tuple[tuple[int, ...], ...]


class PartitionError(EhpError):
    """No valid partition exists for the given groups, replicas and capacities."""


# ---------------------------------------------------------------------------------------------
# Partition
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class GroupPartition:
    """Whole GRPO groups assigned to the live replicas of one (step, epoch).

    `assignments` lists `(replica, group_ids)` in replica-id order; a replica may hold an empty
    tuple only when the partition was built with `require_work=False`.

    `units` are the reduction's weight units per replica when they are not samples: the
    response tokens of its groups under the `token_mean` loss aggregation (the reduced gradient
    is then Σ (Tᵢ/T)·ḡᵢ). Empty: every replica weighs its samples (nᵢ/B).
    """

    step: int
    epoch: int
    group_size: int
    assignments: tuple[tuple[str, tuple[int, ...]], ...]
    units: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.step < 0 or self.epoch < 0:
            raise ValueError(f"step={self.step} and epoch={self.epoch} must be >= 0")
        if self.group_size < 1:
            raise ValueError(f"group_size={self.group_size} must be >= 1 (samples per group)")
        seen: set[int] = set()
        replicas = [r for r, _ in self.assignments]
        if len(set(replicas)) != len(replicas):
            raise ValueError(f"replica listed twice in assignments: {replicas}")
        for replica, groups in self.assignments:
            for g in groups:
                if g in seen:
                    raise ValueError(f"group {g} assigned twice (second time to {replica!r})")
                seen.add(g)
        if self.units:
            named = sorted(r for r, _ in self.units)
            if named != sorted(replicas) or any(u < 0 for _, u in self.units):
                raise ValueError(
                    f"units {self.units} must give one count >= 0 for each replica {replicas}"
                )

    @property
    def replicas(self) -> tuple[str, ...]:
        return tuple(r for r, _ in self.assignments)

    @property
    def working_replicas(self) -> tuple[str, ...]:
        """Replicas that got at least one group — exactly those that must deliver."""
        return tuple(r for r, g in self.assignments if g)

    def groups_of(self, replica: str) -> tuple[int, ...]:
        for r, groups in self.assignments:
            if r == replica:
                return groups
        raise KeyError(f"replica {replica!r} is not in the partition of epoch {self.epoch}")

    def samples_of(self, replica: str) -> int:
        return len(self.groups_of(replica)) * self.group_size

    @property
    def total_groups(self) -> int:
        return sum(len(g) for _, g in self.assignments)

    @property
    def total_samples(self) -> int:
        """B = G·n: the fixed global batch, whatever the partition."""
        return self.total_groups * self.group_size

    def units_of(self, replica: str) -> int:
        """The replica's weight units: its response tokens under `token_mean`, else nᵢ."""
        if self.units:
            return dict(self.units)[replica]
        return self.samples_of(replica)

    @property
    def total_units(self) -> int:
        """T under `token_mean` (all response tokens of the batch), else B."""
        return sum(u for _, u in self.units) if self.units else self.total_samples

    def weight_of(self, replica: str) -> Fraction:
        """uᵢ / U (nᵢ / B, or Tᵢ / T under `token_mean`), exact."""
        return Fraction(self.units_of(replica), self.total_units)

    def with_units(self, units: Mapping[str, int]) -> GroupPartition:
        """The same assignment, weighed by `units` (one count per replica)."""
        return replace(self, units=tuple(sorted((r, int(u)) for r, u in units.items())))


def fair_share(groups: int, capacity: int, total_capacity: int) -> Fraction:
    """A replica's exact proportional share G·cᵢ/C of the groups."""
    return Fraction(groups * capacity, total_capacity)


def partition_groups(
    *,
    groups: Sequence[int],
    live: Mapping[str, int],
    group_size: int,
    step: int,
    epoch: int,
    require_work: bool = True,
) -> GroupPartition:
    """Assign whole groups to live replicas in proportion to their capacities.

    `groups` are the ids of G complete groups (each of `group_size` samples); `live` maps each
    live replica of `epoch` to its capacity (a positive int, e.g. 1 per replica of the same
    shape). Loads follow the largest-remainder rule, so each replica's load is the floor or the
    ceiling of its share G·cᵢ/C (within one group of it); ties break by replica id. Groups are
    sorted by id and handed out in contiguous runs in replica-id order, so the same input (in
    any order) gives the same partition.

    With `require_work` (default) every live replica must receive at least one group; raises
    `PartitionError` when that cannot hold within the balance rule.
    """
    if group_size < 1:
        raise PartitionError(
            f"group_size={group_size} is invalid",
            "a GRPO group has at least one sample",
            "pass the number of samples drawn per prompt (n >= 1)",
        )
    if not live:
        raise PartitionError(
            f"no live training replica in epoch {epoch}",
            "a step needs at least one replica to compute its batch",
            "partition only after the Core replicas are live",
        )
    for replica, cap in live.items():
        if cap < 1:
            raise PartitionError(
                f"replica {replica!r} has capacity {cap}",
                "capacities must be positive ints",
                "drop replicas that cannot take work from `live` instead of giving them 0",
            )
    ordered_groups = sorted(groups)
    if len(set(ordered_groups)) != len(ordered_groups):
        dupes = sorted({g for g in ordered_groups if ordered_groups.count(g) > 1})
        raise PartitionError(
            f"group ids {dupes} appear more than once",
            "every group is consumed exactly once per step",
            "deduplicate the collected groups before partitioning",
        )
    replicas = sorted(live)
    g_total = len(ordered_groups)
    if require_work and g_total < len(replicas):
        raise PartitionError(
            f"{g_total} groups cannot give work to {len(replicas)} live replicas",
            "groups are never split and every live replica must receive one",
            "collect at least as many groups as live replicas, or let a replica leave",
        )
    c_total = sum(live.values())
    shares = {r: fair_share(g_total, live[r], c_total) for r in replicas}
    loads = {r: int(shares[r]) for r in replicas}  # floor; shares are non-negative
    left = g_total - sum(loads.values())
    # Largest remainder first; with require_work, replicas whose floor is 0 come first.
    order = sorted(
        replicas,
        key=lambda r: (
            0 if (require_work and loads[r] == 0) else 1,
            -(shares[r] - loads[r]),
            r,
        ),
    )
    for r in order[:left]:
        loads[r] += 1
    if require_work:
        idle = [r for r in replicas if loads[r] == 0]
        if idle:
            raise PartitionError(
                f"replicas {idle} would get no group within their fair share",
                "capacities are so uneven that a proportional split leaves them idle",
                "collect more groups, equalise capacities, or pass require_work=False",
            )
    assignments: list[tuple[str, tuple[int, ...]]] = []
    start = 0
    for r in replicas:
        assignments.append((r, tuple(ordered_groups[start : start + loads[r]])))
        start += loads[r]
    return GroupPartition(
        step=step, epoch=epoch, group_size=group_size, assignments=tuple(assignments)
    )


# ---------------------------------------------------------------------------------------------
# Delivery ledger
# ---------------------------------------------------------------------------------------------


class RejectReason(StrEnum):
    STALE_STEP = "stale_step"  # delivery for an older step
    FUTURE_STEP = "future_step"  # delivery for a step this ledger is not (yet) collecting
    STALE_EPOCH = "stale_epoch"  # delivery computed under an older membership epoch
    FUTURE_EPOCH = "future_epoch"  # delivery claims an epoch newer than the ledger's
    LATE = "late"  # the step already closed or failed (or its deadline passed)
    UNKNOWN_REPLICA = "unknown_replica"  # replica has no slot in this step's partition
    DUPLICATE = "duplicate"  # the slot already holds an accepted delivery
    WRONG_SAMPLE_COUNT = "wrong_sample_count"
    WRONG_SHAPES = "wrong_shapes"


class LedgerStatus(StrEnum):
    OPEN = "open"
    CLOSED = "closed"  # every expected delivery is in
    FAILED = "failed"  # deadline passed with deliveries missing


@dataclass(frozen=True, kw_only=True)
class Delivery:
    """Metadata of one gradient delivery: who computed it, for which step/epoch, its weight units
    (`samples`: its samples, or its response tokens under `token_mean` — see `GroupPartition`),
    and the shapes of the gradient tensors (in parameter order). `token` lets the shell tie the
    record back to the tensors it carries (e.g. an index); the ledger ignores it."""

    step: int
    epoch: int
    replica: str
    samples: int
    shapes: Shapes
    token: int = 0


@dataclass(frozen=True, kw_only=True)
class DeliveryAccepted:
    delivery: Delivery
    closed: bool  # this delivery completed the step


@dataclass(frozen=True, kw_only=True)
class DeliveryRejected:
    delivery: Delivery
    reason: RejectReason
    detail: str


@dataclass(frozen=True, kw_only=True)
class StepFailed:
    step: int
    epoch: int
    missing: tuple[str, ...]
    now: float


Outcome = DeliveryAccepted | DeliveryRejected


@dataclass(frozen=True, kw_only=True)
class DeliveryLedger:
    """Expected and received deliveries of one (step, epoch). Immutable: `offer` and `expire`
    return a new ledger together with their outcome."""

    step: int
    epoch: int
    expected: tuple[tuple[str, int], ...]  # (replica, units) for every working replica
    shapes: Shapes
    deadline: float
    received: tuple[Delivery, ...] = ()
    status: LedgerStatus = LedgerStatus.OPEN
    missing: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.expected:
            raise ValueError(
                f"ledger for step {self.step} epoch {self.epoch} expects no delivery; "
                "build it from a partition with at least one working replica"
            )

    @classmethod
    def open(
        cls, partition: GroupPartition, *, shapes: Iterable[Iterable[int]], deadline: float
    ) -> DeliveryLedger:
        """A fresh ledger expecting one delivery per working replica of `partition`."""
        return cls(
            step=partition.step,
            epoch=partition.epoch,
            expected=tuple((r, partition.units_of(r)) for r in partition.working_replicas),
            shapes=tuple(tuple(int(d) for d in s) for s in shapes),
            deadline=deadline,
        )

    @property
    def total_samples(self) -> int:
        return sum(n for _, n in self.expected)

    def outstanding(self) -> tuple[str, ...]:
        got = {d.replica for d in self.received}
        return tuple(r for r, _ in self.expected if r not in got)

    def weights(self) -> dict[str, Fraction]:
        """nᵢ / B per accepted delivery (exact); the reduction multiplies ḡᵢ by these."""
        b = self.total_samples
        return {d.replica: Fraction(d.samples, b) for d in self.received}

    def _reject(
        self, d: Delivery, reason: RejectReason, detail: str
    ) -> tuple[DeliveryLedger, Outcome]:
        return self, DeliveryRejected(delivery=d, reason=reason, detail=detail)

    def offer(self, delivery: Delivery, *, now: float) -> tuple[DeliveryLedger, Outcome]:
        """Accept `delivery` into its slot or reject it with a reason.

        Checks, in order: step, epoch, open (a delivery after close, after failure, or at/after
        the deadline is LATE — an open ledger whose deadline has passed fails first), replica
        known, not a duplicate, sample count, shapes.
        """
        d = delivery
        if d.step < self.step:
            return self._reject(d, RejectReason.STALE_STEP, f"step {d.step} < {self.step}")
        if d.step > self.step:
            return self._reject(d, RejectReason.FUTURE_STEP, f"step {d.step} > {self.step}")
        if d.epoch < self.epoch:
            return self._reject(d, RejectReason.STALE_EPOCH, f"epoch {d.epoch} < {self.epoch}")
        if d.epoch > self.epoch:
            return self._reject(d, RejectReason.FUTURE_EPOCH, f"epoch {d.epoch} > {self.epoch}")
        ledger = self
        if ledger.status is LedgerStatus.OPEN and now >= ledger.deadline:
            ledger, _ = ledger.expire(now=now)
        if ledger.status is not LedgerStatus.OPEN:
            return ledger, DeliveryRejected(
                delivery=d,
                reason=RejectReason.LATE,
                detail=f"step {ledger.step} already {ledger.status.value}",
            )
        slots = dict(ledger.expected)
        if d.replica not in slots:
            return ledger._reject(
                d,
                RejectReason.UNKNOWN_REPLICA,
                f"{d.replica!r} has no slot; expected {sorted(slots)}",
            )
        if any(r.replica == d.replica for r in ledger.received):
            return ledger._reject(d, RejectReason.DUPLICATE, f"{d.replica!r} already delivered")
        if d.samples != slots[d.replica]:
            return ledger._reject(
                d,
                RejectReason.WRONG_SAMPLE_COUNT,
                f"{d.samples} samples, expected {slots[d.replica]}",
            )
        if d.shapes != ledger.shapes:
            return ledger._reject(
                d, RejectReason.WRONG_SHAPES, "gradient shapes differ from the model's"
            )
        received = (*ledger.received, d)
        closed = len(received) == len(ledger.expected)
        new = replace(
            ledger,
            received=received,
            status=LedgerStatus.CLOSED if closed else LedgerStatus.OPEN,
        )
        return new, DeliveryAccepted(delivery=d, closed=closed)

    def expire(self, *, now: float) -> tuple[DeliveryLedger, StepFailed | None]:
        """Fail the step if it is still open at or after its deadline."""
        if self.status is not LedgerStatus.OPEN or now < self.deadline:
            return self, None
        missing = self.outstanding()
        failed = replace(self, status=LedgerStatus.FAILED, missing=missing)
        return failed, StepFailed(step=self.step, epoch=self.epoch, missing=missing, now=now)
