"""`MegatronBackend.compute` delivers the mean gradient over its samples for any micro-batching.

One real Megatron process (Gloo world of 1, FP32 parameters). The same 4-group batch is computed
with one group per micro-batch (the default), with uneven micro-batches of 3 + 1 groups (loss
factors 1.5 and 0.5), and as one micro-batch; the deliveries must agree to FP32 rounding
(atol 1e-6, rtol 1e-5: the per-sample losses are summed in different orders). A wrong weight of
the uneven micro-batches would move them by about their gradient's size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.megatron.harness import WorkerContext, load, run_worlds

pytestmark = [pytest.mark.slow]
MICRO_BATCHES = (1, 3, 4)  # groups per micro-batch, for a batch of 4 groups


def scenario(ctx: WorkerContext) -> None:
    from tests.megatron.scenario_common import build, step_batch

    batch = step_batch(0)
    assert len(batch.group_ids) == 4
    out: dict[str, Any] = {}
    for groups in MICRO_BATCHES:
        lane = build("core", "core0", 0, 1, torch.float32, micro_batch_groups=groups)
        delivery = lane.compute(batch, step=0, epoch=0)
        out[str(groups)] = {
            "grads": list(delivery.grads),
            "samples": delivery.record.samples,
            "loss": delivery.loss,
        }
    ctx.save("deliveries", out)


@pytest.mark.timeout(200)
def test_deliveries_agree_for_every_micro_batching(tmp_path: Path) -> None:
    run_worlds([("one", 1, scenario)], tmp_path, timeout=150)
    got = load(tmp_path, "one.deliveries")
    whole = got["4"]["grads"]
    assert max(float(g.abs().max()) for g in whole) > 1e-4  # a real gradient
    # on-policy the surrogate's value is −mean(Â) = 0 (advantages are zero-mean in each group);
    # its gradient is not (above). Every micro-batching reports that same value.
    assert abs(got["4"]["loss"]) < 1e-6
    for groups in ("1", "3"):
        assert got[groups]["samples"] == 8
        assert got[groups]["loss"] == pytest.approx(got["4"]["loss"], abs=1e-6)
        for g, ref in zip(got[groups]["grads"], whole, strict=True):
            torch.testing.assert_close(g, ref, atol=1e-6, rtol=1e-5)
