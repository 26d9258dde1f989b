"""The imperative shell around the pure delivery ledger of one (step, epoch).

`DeliveryCollector` keeps the gradient tensors of accepted deliveries beside the pure
`DeliveryLedger`, logs every rejection and a failed step with structlog
(logger `ehp_fsm.training`, keys step, epoch, replica, reason), and reduces exactly the accepted
first deliveries once the ledger has closed. What it does not know: how deliveries travel, or
what the engine does after a failed step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

import structlog
import torch

from ehp_fsm.core.batch import (
    DeliveryAccepted,
    DeliveryLedger,
    GroupPartition,
    LedgerStatus,
    Outcome,
    StepFailed,
)
from ehp_fsm.errors import EhpError
from ehp_fsm.training.backend import GradientDelivery
from ehp_fsm.training.reduction import weighted_sum

log = structlog.get_logger("ehp_fsm.training")


class StepNotClosedError(EhpError):
    """The reduced gradient was requested before every expected delivery was accepted."""


class DeliveryCollector:
    def __init__(
        self, partition: GroupPartition, *, shapes: Iterable[Iterable[int]], deadline: float
    ) -> None:
        self.ledger = DeliveryLedger.open(partition, shapes=shapes, deadline=deadline)
        self._grads: dict[str, tuple[torch.Tensor, ...]] = {}

    def offer(self, delivery: GradientDelivery, *, now: float) -> Outcome:
        self.ledger, out = self.ledger.offer(delivery.record, now=now)
        d = delivery.record
        if isinstance(out, DeliveryAccepted):
            self._grads[d.replica] = delivery.grads
        else:
            log.warning(
                "delivery_rejected",
                step=d.step,
                epoch=d.epoch,
                replica=d.replica,
                reason=out.reason.value,
                detail=out.detail,
            )
        if self.ledger.status is LedgerStatus.FAILED:
            self._log_failed()
        return out

    def expire(self, *, now: float) -> StepFailed | None:
        self.ledger, failed = self.ledger.expire(now=now)
        if failed is not None:
            self._log_failed()
        return failed

    def fail_reduction(self, missing: Sequence[str], *, now: float, reason: str) -> StepFailed:
        """Every record was in, but the gradients of `missing` never reached the reduction (a
        replica died inside it): the step fails with them missing, as at a deadline."""
        self.ledger = replace(self.ledger, status=LedgerStatus.FAILED, missing=tuple(missing))
        self._grads.clear()
        self._log_failed(reason)
        return StepFailed(
            step=self.ledger.step, epoch=self.ledger.epoch, missing=tuple(missing), now=now
        )

    def _log_failed(self, reason: str = "deadline") -> None:
        log.error(
            "step_failed",
            step=self.ledger.step,
            epoch=self.ledger.epoch,
            replica=None,
            reason=reason,
            missing=list(self.ledger.missing),
        )

    def reduced(self) -> list[torch.Tensor]:
        """Σ (nᵢ/B)·ḡᵢ over the accepted deliveries, in acceptance order."""
        if self.ledger.status is not LedgerStatus.CLOSED:
            raise StepNotClosedError(
                f"step {self.ledger.step} epoch {self.ledger.epoch} is {self.ledger.status.value}",
                f"deliveries from {list(self.ledger.outstanding())} are missing",
                "reduce only after every expected delivery was accepted",
            )
        return weighted_sum(
            [(d.samples, self._grads[d.replica]) for d in self.ledger.received],
            total_samples=self.ledger.total_samples,
        )
