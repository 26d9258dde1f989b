"""Worker scenario: reproduce megatron-core's three torch-Adam step bugs and check the fixes.

Runs in a 2-rank Core world (DP=2) with FP32 parameters, so bug (a)'s second half (copy into a
view of a leaf that requires grad) is reachable; BF16 parameters reach only its `KeyError`.
Every observation is saved for `test_step_bugs.py` to assert on. An exception raised by one of
the backend's fixed paths is recorded (`*_error`) instead of ending the worker, so that removing
one fix fails exactly that bug's test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.megatron.harness import WorkerContext

# Megatron is imported inside the worker functions only: importing it in the pytest process
# trips warnings-as-errors (Apex/TE fallbacks, torch.jit deprecations) for no benefit.


def _steps(replica: Any) -> list[float]:
    from ehp_fsm.backends.megatron import state as st

    return sorted(st.local_steps(st.distributed_optimizer(replica.optimizer)).values())


def _attempt(report: dict[str, object], key: str, fn: Any, *args: Any) -> None:
    """Run a fixed path; record its exception under `{key}_error` (None when it succeeded)."""
    try:
        fn(*args)
        report[f"{key}_error"] = None
    except Exception as exc:  # recorded and asserted on by the test
        report[f"{key}_error"] = f"{type(exc).__name__} {exc}"


def bugs(ctx: WorkerContext) -> None:
    from megatron.core import dist_checkpointing

    from ehp_fsm.backends.megatron import state as st
    from ehp_fsm.training.backend import TrainingBackend
    from ehp_fsm.training.lane import LaneState
    from tests.megatron.scenario_common import build, core_only_step, equal_states

    n, rank = ctx.world_size, ctx.rank
    replica = build("core", f"core{rank}", rank, n, torch.float32, bucket_size=4000)
    dist_opt = st.distributed_optimizer(replica.optimizer)
    group = dist_opt.data_parallel_group_gloo
    for step in range(2):
        core_only_step(replica, step, rank, n)
    report: dict[str, object] = {"params": len(list(st._owned(dist_opt)))}

    # (a) DP-zero load: raw Megatron vs the backend's dp_zero_scatter.
    before = replica.capture()
    gathered = st.dp_zero_gather(replica.model, replica.optimizer, version=replica.version)
    raw = gathered.megatron_dict() if gathered else None
    try:  # FP32 params: the first key copied is "param", a view of a leaf that requires grad.
        dist_opt.load_parameter_state_from_dp_zero(raw)
        report["a_raw"] = "no error"
    except (KeyError, RuntimeError) as exc:
        report["a_raw"] = f"{type(exc).__name__} {exc}"
    torch.distributed.barrier(group)
    try:  # Under no_grad the copy of "param" passes; torch Adam's "step" has no source.
        with torch.no_grad():
            dist_opt.load_parameter_state_from_dp_zero(raw)
        report["a_raw_no_grad"] = "no error"
    except (KeyError, RuntimeError) as exc:
        report["a_raw_no_grad"] = f"{type(exc).__name__} {exc}"
    torch.distributed.barrier(group)
    with torch.no_grad():  # scramble, then restore with the fix
        for _, m in st._owned(dist_opt):
            m.add_(1.0)
            dist_opt.optimizer.state[m]["exp_avg"].zero_()
            dist_opt.optimizer.state[m]["step"] = torch.tensor(99.0)
    _attempt(report, "a_fixed", st.dp_zero_scatter, replica.model, replica.optimizer, gathered)
    torch.distributed.barrier(group)

    def observe_a() -> None:
        report["a_fixed_equal"] = equal_states(before, replica.capture())
        report["a_fixed_steps"] = _steps(replica)
        report["a_fixed_shared"] = st.shared_step_count(dist_opt)

    _attempt(report, "a_observe", observe_a)
    # Each bug section starts from the same healthy state (restore installs independent steps
    # itself), so a missing fix fails its own section only.
    replica.restore(before)
    restored = replica.capture()
    report["restore_is_lane_state"] = isinstance(restored, LaneState)
    report["restore_equal"] = equal_states(before, restored)
    report["restore_shared"] = st.shared_step_count(dist_opt)
    report["is_training_backend"] = isinstance(replica, TrainingBackend)

    # (b) load_state_dict shares one step tensor between all parameters.
    sd = replica.optimizer.state_dict()
    replica.optimizer.load_state_dict(sd)
    report["b_raw_shared"] = st.shared_step_count(dist_opt)
    core_only_step(replica, 10, rank, n)
    report["b_raw_steps_after_one_update"] = _steps(replica)
    _attempt(report, "b_fixed", st.load_optimizer_state_dict, replica.optimizer, sd)
    report["b_fixed_shared"] = st.shared_step_count(dist_opt)
    core_only_step(replica, 11, rank, n)
    report["b_fixed_steps_after_one_update"] = _steps(replica)

    replica.restore(before)

    # (c) dist-checkpointing, dp_reshardable: save at step s, train on, load -> expect step s.
    md = {"distrib_optim_sharding_type": "dp_reshardable"}
    ckpt = str(ctx.out / "ckpt")
    if ctx.rank == 0:
        Path(ckpt).mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    saved_step = _steps(replica)
    sharded = replica.optimizer.sharded_state_dict(
        replica.model.sharded_state_dict(), is_loading=False, metadata=md
    )
    dist_checkpointing.save(sharded, ckpt)
    for step in range(2):
        core_only_step(replica, 20 + step, rank, n)
    report["c_saved_steps"] = saved_step
    report["c_in_memory_steps_before_load"] = _steps(replica)
    for fixed in (False, True):
        sharded = replica.optimizer.sharded_state_dict(
            replica.model.sharded_state_dict(), is_loading=True, metadata=md
        )
        loaded = dist_checkpointing.load(sharded, ckpt)
        if fixed:
            _attempt(
                report, "c_fixed", st.load_dp_reshardable_checkpoint, replica.optimizer, loaded
            )
        else:  # no_grad: isolate the step bug from the FP32 leaf-view one (a).
            with torch.no_grad():
                replica.optimizer.load_state_dict(loaded)
        key = "c_fixed" if fixed else "c_raw"
        report[f"{key}_steps"] = _steps(replica)
        report[f"{key}_shared"] = st.shared_step_count(dist_opt)
        torch.distributed.barrier()
    ctx.save(f"bugs{ctx.rank}", report)
