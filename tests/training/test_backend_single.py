"""TorchBackend in one process: a DP1 lane matches plain torch AdamW on the whole model exactly,
and the Protocol is satisfied."""

from __future__ import annotations

import pytest
import torch

from ehp_fsm.training.adam import AdamConfig
from ehp_fsm.training.backend import TorchBackend, TrainingBackend
from ehp_fsm.training.grpo import mean_gradient, synthetic_groups
from ehp_fsm.training.lane import LaneSpec
from ehp_fsm.training.policy import PolicyConfig, build_policy

CFG = PolicyConfig(d_model=16, n_heads=2, d_ff=32, n_layers=1)


@pytest.mark.parametrize("pad", [1, 7, 64])
def test_dp1_lane_matches_plain_adamw_bit_exact(pad):
    be = TorchBackend(CFG, seed=0)
    assert isinstance(be, TrainingBackend)
    be.build(
        LaneSpec(
            role="hybrid",
            replica="hybrid:h",
            pad_multiple=pad,
            adam=AdamConfig(lr=1e-2, weight_decay=0.1),
        )
    )
    ref = build_policy(CFG, seed=0)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(3):
        batch = synthetic_groups(range(step * 4, step * 4 + 4), group_size=3, config=CFG, seed=1)
        d = be.compute(batch, step=step, epoch=0)
        assert d.record.samples == 12
        assert d.record.shapes == be.grad_shapes()
        be.apply(be.reduce(d, total_samples=batch.samples, group=None))
        for p, g in zip(ref.parameters(), mean_gradient(ref, batch), strict=True):
            p.grad = g
        opt.step()
    assert be.version == 3
    for (name, p), q in zip(be.lane.model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), name
    steps = be.lane.step_tensors()
    assert len({t.data_ptr() for t in steps}) == len(steps)
    assert all(float(t) == 3.0 for t in steps)
