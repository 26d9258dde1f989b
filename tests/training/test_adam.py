"""Adam foreach temporaries: automatic choice → per-parameter stepping; explicit choices kept;
same update either way. And the shared-step failure our restore avoids."""

from __future__ import annotations

import pytest
import torch

from ehp_fsm.training.adam import AdamConfig, apply_choice, build_adam
from ehp_fsm.training.lane import LaneSpec, TrainingLane


def _params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in [(33, 17), (5,), (64, 64), (3, 3, 3)]]


def _run(config: AdamConfig, steps=4):
    ps = _params()
    opt = build_adam(ps, config)
    for i in range(steps):
        gen = torch.Generator().manual_seed(100 + i)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return opt, ps


def test_automatic_choice_steps_per_parameter_and_explicit_choices_are_kept():
    auto, _ = _run(AdamConfig())
    assert auto.param_groups[0]["foreach"] is False
    assert auto.param_groups[0]["fused"] is None
    fe, _ = _run(AdamConfig(foreach=True))
    assert fe.param_groups[0]["foreach"] is True
    fu, _ = _run(AdamConfig(fused=True))
    assert fu.param_groups[0]["fused"] is True
    off, _ = _run(AdamConfig(foreach=False))
    assert off.param_groups[0]["foreach"] is False
    with pytest.raises(ValueError, match="only one"):
        AdamConfig(foreach=True, fused=True)


@pytest.mark.parametrize(
    ("config", "foreach", "fused"),
    [
        (AdamConfig(), False, None),
        (AdamConfig(foreach=True), True, None),
        (AdamConfig(foreach=False), False, None),
        (AdamConfig(fused=True), None, True),
    ],
)
def test_apply_choice_gives_an_optimizer_built_elsewhere_the_same_choice(config, foreach, fused):
    # What Megatron's factory does: torch AdamW with the automatic choice, several groups.
    ps = _params()
    opt = torch.optim.AdamW([{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}])
    assert {g["foreach"] for g in opt.param_groups} == {None}
    apply_choice(opt, config)
    assert [(g["foreach"], g["fused"]) for g in opt.param_groups] == [(foreach, fused)] * 2
    built = build_adam(_params(), config)  # the same choice as building it ourselves
    assert (built.param_groups[0]["foreach"], built.param_groups[0]["fused"]) == (foreach, fused)


def test_apply_choice_refuses_what_is_not_torch_adam():
    with pytest.raises(TypeError, match=r"needs a torch\.optim\.Adam or AdamW, got SGD"):
        apply_choice(torch.optim.SGD(_params(), lr=0.1), AdamConfig())


@pytest.mark.parametrize("decoupled", [True, False])
def test_per_parameter_and_foreach_and_fused_give_the_same_update(decoupled):
    base = dict(lr=1e-2, weight_decay=0.05, decoupled=decoupled)
    _, auto = _run(AdamConfig(**base))
    _, fe = _run(AdamConfig(**base, foreach=True))
    _, fu = _run(AdamConfig(**base, fused=True))
    for a, b, c in zip(auto, fe, fu, strict=True):
        # foreach and the single-tensor path run the same elementwise ops: bit-exact here.
        assert torch.equal(a, b)
        # fused is a different kernel (one fused expression): equal up to rounding.
        torch.testing.assert_close(a, c, atol=1e-6, rtol=1e-5)


def test_shared_step_tensor_is_the_known_failure_and_restore_never_creates_it():
    # The failure: one step tensor shared by every parameter is advanced once per parameter.
    ps = _params()
    opt = torch.optim.Adam(ps, lr=1e-3, foreach=True)
    shared = torch.tensor(5.0)
    for p in ps:
        p.grad = torch.ones_like(p)
        opt.state[p] = {
            "step": shared,
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
        }
    opt.step()
    assert float(shared) == 5.0 + len(ps)  # not 6: the failure is real in torch
    # Our restore gives every piece its own step, so one step advances each by one.
    lane = TrainingLane(
        torch.nn.Linear(4, 3), LaneSpec(role="hybrid", replica="h", adam=AdamConfig(foreach=True))
    )
    lane.apply([torch.ones(3, 4), torch.ones(3)])
    state = lane.capture()
    lane.restore(state)
    steps = lane.step_tensors()
    assert len({id(t) for t in steps}) == len({t.data_ptr() for t in steps}) == len(steps)
    lane.apply([torch.ones(3, 4), torch.ones(3)])
    assert [float(t) for t in lane.step_tensors()] == [2.0, 2.0]
