"""Refusals: each says what, why and what to do, and no state is silently mangled."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ehp_fsm.core.batch import Delivery, partition_groups
from ehp_fsm.errors import EhpError
from ehp_fsm.training.backend import GradientDelivery
from ehp_fsm.training.collect import DeliveryCollector, StepNotClosedError
from ehp_fsm.training.dpzero import local_dp_zero, scatter_dp_zero, world_to_shard
from ehp_fsm.training.lane import LaneSpec, TrainingLane, TrainingStateError
from ehp_fsm.training.layout import FlatLayout, LayoutError
from ehp_fsm.training.reduction import ReductionError, weighted_allreduce_, weighted_sum


def _lane(features: int, pad: int = 4) -> TrainingLane:
    return TrainingLane(
        nn.Linear(features, 2), LaneSpec(role="hybrid", replica="h", pad_multiple=pad)
    )


def test_restore_into_another_layout_is_refused_and_points_to_dp_zero():
    a, b = _lane(3, pad=4), _lane(3, pad=5)
    with pytest.raises(TrainingStateError, match="dpzero") as info:
        b.restore(a.capture())
    assert isinstance(info.value, EhpError)
    assert info.value.fix


def test_world_state_of_another_model_is_refused():
    world = local_dp_zero(_lane(3))
    other = _lane(4)
    with pytest.raises(TrainingStateError, match="unpadded elements"):
        world_to_shard(world.buffers, other.layout, 0)
    with pytest.raises(TrainingStateError, match="no state to scatter"):
        scatter_dp_zero(None, other, group=None)


def test_layouts_of_different_parameters_are_refused():
    a = FlatLayout.build([("w", (2, 3))], dp_size=1, pad_multiple=1, param_dtype=torch.float32)
    b = FlatLayout.build([("w", (3, 2))], dp_size=2, pad_multiple=1, param_dtype=torch.float32)
    with pytest.raises(LayoutError, match="different parameters"):
        a.check_same_params(b)


def test_lane_spec_validation_is_actionable():
    with pytest.raises(ValueError, match="Hybrid lane is DP1"):
        LaneSpec(role="hybrid", replica="h", dp_size=2)
    with pytest.raises(ValueError, match="dp_rank"):
        LaneSpec(role="core", replica="c", dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="needs its DP process group"):
        TrainingLane(nn.Linear(2, 2), LaneSpec(role="core", replica="c", dp_size=2))


def test_reduction_refuses_bad_weights_and_incomplete_batches():
    g = [torch.ones(3)]
    with pytest.raises(ReductionError, match="sample count"):
        weighted_allreduce_(g, samples=9, total_samples=8)
    with pytest.raises(ReductionError, match="not B=8"):
        weighted_sum([(4, g)], total_samples=8)
    with pytest.raises(ReductionError, match="cover 12 samples, not B=8"):  # Σnᵢ > B too
        weighted_sum([(4, g), (8, g)], total_samples=8)
    (out,) = weighted_sum([(4, g), (4, [torch.full((3,), 3.0)])], total_samples=8)
    assert out.tolist() == [2.0, 2.0, 2.0]  # Σnᵢ == B: the sample-weighted mean
    with pytest.raises(ReductionError, match="contiguous"):
        weighted_allreduce_([torch.ones(3, 4).t()], samples=1, total_samples=2)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_reduced_gradient_is_refused_before_the_optimizer_steps(bad):
    lane = _lane(3)
    lane.apply([torch.full(p.shape, 0.5) for _, p in lane.named])  # Adam has state to corrupt
    before = lane.capture()
    reduced = [torch.full(p.shape, 0.5) for _, p in lane.named]
    reduced[-1].view(-1)[0] = bad
    with pytest.raises(ReductionError, match=f"gradient of {lane.param_names[-1]} holds NaN"):
        lane.apply(reduced)
    after = lane.capture()
    assert after.version == before.version == 1
    for field in ("params", "master", "exp_avg", "exp_avg_sq", "steps"):
        mine, theirs = getattr(before, field), getattr(after, field)
        assert mine.keys() == theirs.keys()
        for k in mine:
            assert torch.equal(mine[k], theirs[k]), (field, k)


def test_an_empty_tensor_never_starts_an_in_place_bucket():
    # An empty view of an unrelated buffer first in a bucket: the bucket's region must be cut
    # from the first tensor that has elements, not from the empty one's storage.
    other = torch.full((1000,), 5.0)
    flat = torch.ones(20)
    grads = [other[0:0], flat[0:10], other[3:3], flat[10:20], other[0:0]]
    stats = weighted_allreduce_(grads, samples=1, total_samples=4)
    assert stats.bytes_in_place == stats.bytes_reduced == 20 * 4
    assert torch.equal(flat, torch.full((20,), 0.25))
    assert torch.equal(other, torch.full((1000,), 5.0))


def test_collector_refuses_to_reduce_an_open_step():
    p = partition_groups(groups=[0, 1], live={"a": 1, "b": 1}, group_size=2, step=0, epoch=0)
    col = DeliveryCollector(p, shapes=[(3,)], deadline=5.0)
    col.offer(
        GradientDelivery(
            record=Delivery(step=0, epoch=0, replica="a", samples=2, shapes=((3,),)),
            grads=(torch.ones(3),),
        ),
        now=1.0,
    )
    with pytest.raises(StepNotClosedError, match=r"\['b'\]"):
        col.reduced()
