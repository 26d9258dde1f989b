"""The torch path's Adam rule holds on the Megatron path too (one real Megatron process, a Gloo
world of 1): Megatron's optimizer factory builds torch AdamW with torch's automatic
foreach/fused choice, and the backend turns that into per-parameter temporaries
(`foreach=False`) while an explicit `foreach=True`/`False` or `fused=True` stays as the user set
it. Checked on the torch AdamW inside the DistributedOptimizer that Megatron built, after two
steps (torch reads the choice from each parameter group at every step); the updates agree with
the automatic choice's (foreach and the single-tensor loop bit for bit, fused to rounding).
Without the backend's `_apply_adam_choice` the automatic case keeps `foreach=None` and the
explicit choices are lost (checked by removing the call: the first two tests fail).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.megatron.harness import WorkerContext, load, run_worlds

pytestmark = [pytest.mark.slow]
CHOICES: dict[str, dict[str, bool]] = {
    "automatic": {},
    "foreach": {"foreach": True},
    "no_foreach": {"foreach": False},
    "fused": {"fused": True},
}


def scenario(ctx: WorkerContext) -> None:
    from ehp_fsm.backends.megatron import state as st
    from ehp_fsm.backends.megatron.backend import MegatronBackend, MegatronModelConfig
    from ehp_fsm.backends.megatron.errors import MegatronBackendError
    from ehp_fsm.training.adam import AdamConfig
    from ehp_fsm.training.lane import LaneSpec
    from tests.megatron.scenario_common import ADAM, core_only_step

    out: dict[str, Any] = {}
    for name, choice in CHOICES.items():
        lane = MegatronBackend(MegatronModelConfig())
        adam = AdamConfig(lr=ADAM.lr, weight_decay=ADAM.weight_decay, **choice)
        lane.build(LaneSpec(role="core", replica="core0", param_dtype=torch.float32, adam=adam))
        start = {n: p.detach().clone() for n, p in lane.named_parameters()}
        for step in range(2):
            core_only_step(lane, step, 0, 1)
        inner = st.distributed_optimizer(lane.optimizer).optimizer
        out[name] = {
            "cls": type(inner).__name__,
            "foreach": [g["foreach"] for g in inner.param_groups],
            "fused": [g["fused"] for g in inner.param_groups],
            "params": {n: p.detach().clone() for n, p in lane.named_parameters()},
            "moved": max(
                float((p.detach() - start[n]).abs().max()) for n, p in lane.named_parameters()
            ),
        }
    coupled = MegatronBackend(MegatronModelConfig())
    try:
        coupled.build(
            LaneSpec(role="core", replica="core0", adam=AdamConfig(decoupled=False)),
        )
        out["coupled_error"] = None
    except MegatronBackendError as exc:
        out["coupled_error"] = str(exc)
    ctx.save("choices", out)


@pytest.fixture(scope="module")
def got(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root: Path = tmp_path_factory.mktemp("megatron-adam")
    run_worlds([("one", 1, scenario)], root, timeout=150)
    result: dict[str, Any] = load(root, "one.choices")
    return result


@pytest.mark.timeout(200)
def test_automatic_choice_becomes_per_parameter_temporaries(got: dict[str, Any]) -> None:
    auto = got["automatic"]
    assert auto["cls"] == "AdamW"  # Megatron built torch AdamW (no TE/Apex here)
    assert len(auto["foreach"]) > 1  # every group (Megatron splits weight-decay groups)
    assert set(auto["foreach"]) == {False}
    assert set(auto["fused"]) == {None}


@pytest.mark.timeout(200)
def test_explicit_foreach_and_fused_are_kept(got: dict[str, Any]) -> None:
    assert set(got["foreach"]["foreach"]) == {True} and set(got["foreach"]["fused"]) == {None}
    assert set(got["no_foreach"]["foreach"]) == {False}
    assert set(got["no_foreach"]["fused"]) == {None}
    assert set(got["fused"]["fused"]) == {True} and set(got["fused"]["foreach"]) == {None}


@pytest.mark.timeout(200)
def test_every_choice_steps_to_the_same_parameters(got: dict[str, Any]) -> None:
    auto = got["automatic"]["params"]
    assert min(got[name]["moved"] for name in CHOICES) > 1e-4  # trained, not initial copies
    for name in ("foreach", "no_foreach"):
        for n, p in got[name]["params"].items():
            assert torch.equal(p, auto[n]), (name, n)  # the same elementwise ops
    for n, p in got["fused"]["params"].items():
        torch.testing.assert_close(p, auto[n], atol=1e-6, rtol=1e-5)  # one fused expression


@pytest.mark.timeout(200)
def test_coupled_weight_decay_is_still_refused(got: dict[str, Any]) -> None:
    assert got["coupled_error"] is not None
    assert "coupled weight decay is not passed through" in got["coupled_error"]
