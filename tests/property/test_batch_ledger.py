"""Properties of `DeliveryLedger` under random interleavings of valid, stale, duplicate, wrong
and late deliveries: the accepted set is exactly the first valid delivery of every expected slot,
or the step fails at its deadline listing exactly the missing replicas."""

from __future__ import annotations

from fractions import Fraction

from hypothesis import given
from hypothesis import strategies as st

from ehp_fsm.core.batch import (
    Delivery,
    DeliveryAccepted,
    DeliveryLedger,
    DeliveryRejected,
    LedgerStatus,
    RejectReason,
    partition_groups,
)

SHAPES = ((4, 3), (3,))
STEP, EPOCH = 5, 2


def _ledger(n_replicas: int, groups: int) -> DeliveryLedger:
    live = {f"r{i}": 1 for i in range(n_replicas)}
    p = partition_groups(groups=range(groups), live=live, group_size=3, step=STEP, epoch=EPOCH)
    return DeliveryLedger.open(p, shapes=SHAPES, deadline=100.0)


kinds = st.sampled_from(
    [
        "valid",
        "valid",
        "valid",
        "stale_step",
        "future_step",
        "stale_epoch",
        "future_epoch",
        "unknown",
        "samples",
        "shapes",
    ]
)


@given(
    n_replicas=st.integers(1, 4),
    extra_groups=st.integers(0, 6),
    script=st.lists(st.tuples(kinds, st.integers(0, 3), st.floats(0, 120)), max_size=30),
)
def test_ledger_accepts_exactly_the_first_valid_delivery_per_slot(n_replicas, extra_groups, script):
    ledger = _ledger(n_replicas, n_replicas + extra_groups)
    slots = dict(ledger.expected)
    now = 0.0
    first_valid: dict[str, int] = {}
    closed_at: float | None = None
    for token, (kind, who, dt) in enumerate(script):
        now = max(now, dt)  # time only moves forward
        replica = f"r{who % n_replicas}"
        d = Delivery(
            step=STEP,
            epoch=EPOCH,
            replica=replica,
            samples=slots[replica],
            shapes=SHAPES,
            token=token,
        )
        expect: RejectReason | None = None
        if kind == "stale_step":
            d = Delivery(
                step=STEP - 1, epoch=EPOCH, replica=replica, samples=d.samples, shapes=SHAPES
            )
            expect = RejectReason.STALE_STEP
        elif kind == "future_step":
            d = Delivery(
                step=STEP + 1, epoch=EPOCH, replica=replica, samples=d.samples, shapes=SHAPES
            )
            expect = RejectReason.FUTURE_STEP
        elif kind == "stale_epoch":
            d = Delivery(
                step=STEP, epoch=EPOCH - 1, replica=replica, samples=d.samples, shapes=SHAPES
            )
            expect = RejectReason.STALE_EPOCH
        elif kind == "future_epoch":
            d = Delivery(
                step=STEP, epoch=EPOCH + 1, replica=replica, samples=d.samples, shapes=SHAPES
            )
            expect = RejectReason.FUTURE_EPOCH
        elif kind == "unknown":
            d = Delivery(step=STEP, epoch=EPOCH, replica="ghost", samples=3, shapes=SHAPES)
        elif kind == "samples":
            d = Delivery(
                step=STEP, epoch=EPOCH, replica=replica, samples=d.samples + 1, shapes=SHAPES
            )
        elif kind == "shapes":
            d = Delivery(
                step=STEP, epoch=EPOCH, replica=replica, samples=d.samples, shapes=((4, 3),)
            )
        before = ledger
        ledger, out = ledger.offer(d, now=now)
        if expect is not None:
            assert isinstance(out, DeliveryRejected)
            assert out.reason is expect
            continue
        if before.status is not LedgerStatus.OPEN or now >= before.deadline:
            assert isinstance(out, DeliveryRejected)
            assert out.reason is RejectReason.LATE
            continue
        if kind == "unknown":
            assert isinstance(out, DeliveryRejected)
            assert out.reason is RejectReason.UNKNOWN_REPLICA
        elif replica in first_valid:
            assert isinstance(out, DeliveryRejected)
            assert out.reason is RejectReason.DUPLICATE
        elif kind == "samples":
            assert isinstance(out, DeliveryRejected)
            assert out.reason is RejectReason.WRONG_SAMPLE_COUNT
        elif kind == "shapes":
            assert isinstance(out, DeliveryRejected)
            assert out.reason is RejectReason.WRONG_SHAPES
        else:
            assert isinstance(out, DeliveryAccepted)
            first_valid[replica] = token
            if out.closed:
                closed_at = now
    ledger, failed = ledger.expire(now=1000.0)
    if len(first_valid) == len(slots):
        assert ledger.status is LedgerStatus.CLOSED
        assert closed_at is not None
        assert failed is None
        assert sum(ledger.weights().values()) == Fraction(1)
    else:
        assert ledger.status is LedgerStatus.FAILED
        assert set(ledger.missing) == set(slots) - set(first_valid)
        # `failed` is None only when a late offer already failed the step at its deadline.
        assert failed is None or failed.missing == ledger.missing
    # The ledger holds exactly the first valid delivery of each slot, nothing else.
    assert {d.replica: d.token for d in ledger.received} == first_valid


def test_late_delivery_after_close_is_rejected_as_late():
    ledger = _ledger(2, 2)
    for r, n in ledger.expected:
        ledger, out = ledger.offer(
            Delivery(step=STEP, epoch=EPOCH, replica=r, samples=n, shapes=SHAPES), now=1.0
        )
        assert isinstance(out, DeliveryAccepted)
    assert ledger.status is LedgerStatus.CLOSED
    _, out = ledger.offer(
        Delivery(step=STEP, epoch=EPOCH, replica="r0", samples=3, shapes=SHAPES), now=2.0
    )
    assert isinstance(out, DeliveryRejected)
    assert out.reason is RejectReason.LATE


def test_deadline_fails_with_missing_list_and_rejects_afterwards():
    ledger = _ledger(3, 3)
    ledger, _ = ledger.offer(
        Delivery(step=STEP, epoch=EPOCH, replica="r1", samples=3, shapes=SHAPES), now=1.0
    )
    same, failed = ledger.expire(now=99.9)
    assert failed is None
    assert same is ledger
    ledger, failed = ledger.expire(now=100.0)
    assert failed is not None
    assert failed.missing == ("r0", "r2")
    _, out = ledger.offer(
        Delivery(step=STEP, epoch=EPOCH, replica="r0", samples=3, shapes=SHAPES), now=101.0
    )
    assert isinstance(out, DeliveryRejected)
    assert out.reason is RejectReason.LATE
