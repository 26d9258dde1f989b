"""Worker scenarios: one HF lane (`scenario_hf`'s model, objective and batch) at TP × PP.

Every rank initialises Megatron's parallel state at (tp, pp), builds the Core DP1 lane from the
HF directory through mbridge (its stage of the GPTModel) and publishes, per rank: the weights
exported back to HF names before any step (mbridge's export, collective over TP and PP) and
the HF names of the stage's own parameters; the
delivery's loss, weight and metrics (every stage must report the last stage's); at TP 1 the
delivery's gradient of this stage's parameters under HF names (global layer numbers); the HF
weights after one optimizer step. `scenario_pp1` and `scenario_pp2` then exercise the lane's
state (per stage):
capture → another step → restore; a DP-zero gather into a second, perturbed lane of the same
world; and one more step of both lanes.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.megatron.harness import WorkerContext
from tests.megatron.scenario_hf import batch, objective


def scenario_pp1(ctx: WorkerContext) -> None:
    be = _run(ctx, tp=1, pp=1)
    _state_round_trips(ctx, be)


def scenario_pp2(ctx: WorkerContext) -> None:
    be = _run(ctx, tp=1, pp=2)
    _state_round_trips(ctx, be)
    _reduce_per_stage(ctx, be)
    _diverge_tied_copies(ctx, be)


def _reduce_per_stage(ctx: WorkerContext, be: Any) -> None:
    """`reduce` over the default world (both stages) is refused; over the stage's DP group
    (one rank here) it is the delivery itself."""
    from megatron.core import parallel_state

    from ehp_fsm.backends.megatron.errors import MegatronBackendError

    d = be.compute(batch(), step=2, epoch=0)
    own = [g.clone() for g in d.grads]
    try:
        be.reduce(d, total_samples=d.record.samples, group=None)
    except MegatronBackendError as exc:
        error = str(exc)
    else:
        error = ""
    group = parallel_state.get_data_parallel_group()
    reduced = be.reduce(d, total_samples=d.record.samples, group=group)
    same = all(torch.equal(a, b) for a, b in zip(reduced, own, strict=True))
    ctx.save(f"reduce.{ctx.rank}", {"error": error, "same": same})


def _diverge_tied_copies(ctx: WorkerContext, be: Any) -> None:
    """A reduced gradient whose tied copies differ (the first stage's embedding gradient
    zeroed): the export must refuse, on every stage, rather than save one copy."""
    from ehp_fsm.backends.megatron.errors import MegatronBackendError

    d = be.compute(batch(), step=2, epoch=0)
    grads = [
        g.zero_() if ctx.rank == 0 and name == "embedding.word_embeddings.weight" else g
        for (name, _), g in zip(be.named_parameters(), d.grads, strict=True)
    ]
    be.apply(grads)
    try:
        be.hf_state_dict()
    except MegatronBackendError as exc:
        ctx.save(f"diverged.{ctx.rank}", {"error": str(exc)})
    else:
        ctx.save(f"diverged.{ctx.rank}", {"error": ""})


def scenario_tp2_pp2(ctx: WorkerContext) -> None:
    _run(ctx, tp=2, pp=2)


def scenario_dp2_pp2(ctx: WorkerContext) -> None:
    """A Core of two DP ranks at PP 2 in one world of four: each DP rank computes half the
    groups on its stage, reduces over Megatron's DP group (its stage's ranks) and steps."""
    from megatron.core import parallel_state

    from ehp_fsm.backends.megatron.backend import MegatronBackend, MegatronModelConfig
    from ehp_fsm.training.adam import AdamConfig
    from ehp_fsm.training.lane import LaneSpec

    parallel_state.initialize_model_parallel(1, 2)
    dp, rank = (
        parallel_state.get_data_parallel_world_size(),
        parallel_state.get_data_parallel_rank(),
    )
    be = MegatronBackend(
        MegatronModelConfig(micro_batch_groups=2),
        hf_model=str(ctx.out / "model"),
        objective=objective(),  # type: ignore[arg-type]
    )
    be.build(
        LaneSpec(
            role="core",
            replica=f"core:{rank}",
            dp_rank=rank,
            dp_size=dp,
            adam=AdamConfig(lr=1e-3, eps=1e-6),
        )
    )
    whole = batch()
    per = len(whole.group_ids) // dp
    mine = whole.select(whole.group_ids[rank * per : (rank + 1) * per])
    d = be.compute(mine, step=0, epoch=0)
    total = whole.units(objective().aggregation)  # type: ignore[attr-defined]
    group = parallel_state.get_data_parallel_group()
    be.apply(be.reduce(d, total_samples=total, group=group))
    ctx.save(f"stepped.{ctx.rank}", be.hf_state_dict())


def scenario_llama_pp2(ctx: WorkerContext) -> None:
    """A tied-embedding Llama at PP 2: built, its HF weights loaded, exported back."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 2)
    be = _lane(ctx, model="llama")
    ctx.save(f"initial.{ctx.rank}", be.hf_state_dict())
    ctx.save(f"held.{ctx.rank}", _held(be))


def _held(be: Any) -> list[str]:
    """The HF names of this stage's own parameters."""
    from ehp_fsm.backends.megatron import state as st

    to_global = be.bridge._weight_name_mapping_mcore_local_to_global(st.unwrap(be.model))
    return sorted(
        hf
        for name, _ in be.named_parameters()
        for hf in be.bridge._weight_name_mapping_mcore_to_hf(to_global[name])
    )


def _lane(ctx: WorkerContext, *, model: str = "model", perturb_seed: int | None = None) -> Any:
    from ehp_fsm.backends.megatron.backend import MegatronBackend, MegatronModelConfig
    from ehp_fsm.training.adam import AdamConfig
    from ehp_fsm.training.lane import LaneSpec

    be = MegatronBackend(
        MegatronModelConfig(micro_batch_groups=2),
        hf_model=str(ctx.out / model),
        objective=objective(),  # type: ignore[arg-type]
        perturb_seed=perturb_seed,
    )
    be.build(LaneSpec(role="core", replica="core:0", adam=AdamConfig(lr=1e-3, eps=1e-6)))
    return be


def _run(ctx: WorkerContext, *, tp: int, pp: int) -> Any:
    from megatron.core import parallel_state

    from ehp_fsm.backends.megatron import state as st

    parallel_state.initialize_model_parallel(tp, pp)
    be = _lane(ctx)
    initial = be.hf_state_dict()  # collective over TP and PP
    d = be.compute(batch(), step=0, epoch=0)
    grads: dict[str, torch.Tensor] = {}
    if tp == 1:
        to_global = be.bridge._weight_name_mapping_mcore_local_to_global(st.unwrap(be.model))
        for (name, _), g in zip(be.named_parameters(), d.grads, strict=True):
            hf_names, hf_grads = be.bridge._weight_to_hf_format(to_global[name], g)
            grads.update(zip(hf_names, hf_grads, strict=True))
    held_input = st.unwrap(be.model).decoder.input_tensor  # the activation the stage got
    be.apply(d.grads)
    m = d.metrics
    ctx.save(f"input_after_step.{ctx.rank}", None if held_input is None else held_input.numel())
    ctx.save(f"initial.{ctx.rank}", initial)
    ctx.save(f"held.{ctx.rank}", _held(be))
    ctx.save(f"stepped.{ctx.rank}", be.hf_state_dict())
    ctx.save(
        f"delivery.{ctx.rank}",
        {
            "loss": d.loss,
            "weight": d.record.samples,
            "metrics": torch.tensor(
                [m.tokens, m.clipped, m.ratio_sum, m.ratio_max, m.kl_old_sum, m.kl_ref_sum],
                dtype=torch.float64,
            ),
            "grads": grads,
        },
    )
    return be


def _state_round_trips(ctx: WorkerContext, be: Any) -> None:
    captured = be.capture()  # local to this stage
    gathered = be.local_state()  # a DP-zero gather over this stage's one-rank DP group
    again = be.compute(batch(), step=1, epoch=0)
    be.apply(again.grads)
    ctx.save(f"twice.{ctx.rank}", be.hf_state_dict())
    be.restore(captured)
    ctx.save(f"restored.{ctx.rank}", be.hf_state_dict())
    other = _lane(ctx, perturb_seed=7)  # a second lane of this world (collective build)
    other.scatter_dp_zero(gathered)
    ctx.save(f"scattered.{ctx.rank}", other.hf_state_dict())
    mine, theirs = be.compute(batch(), step=1, epoch=0), other.compute(batch(), step=1, epoch=0)
    ctx.save(
        f"next.{ctx.rank}",
        {
            "grads_equal": all(
                torch.equal(a, b) for a, b in zip(mine.grads, theirs.grads, strict=True)
            ),
            "versions": (be.version, other.version),
        },
    )
    be.apply(mine.grads)
    other.apply(theirs.grads)
    ctx.save(f"next_restored.{ctx.rank}", be.hf_state_dict())
    ctx.save(f"next_scattered.{ctx.rank}", other.hf_state_dict())


def scenario_tiny(ctx: WorkerContext) -> None:
    """The tiny local-spec GPTModel (tied embeddings, learned positions) at PP = world size:
    one step's loss, metrics and weights (the stage's parameters, gathered by name)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from ehp_fsm.backends.megatron import state as st
    from tests.megatron.scenario_common import build, step_batch

    parallel_state.initialize_model_parallel(1, ctx.world_size)
    be = build("core", "core:0", 0, 1, torch.float32, micro_batch_groups=2)
    d = be.compute(step_batch(0), step=0, epoch=0)
    be.apply(d.grads)
    mine = {
        _tiny_global(name, ctx.rank): p.detach().clone()
        for name, p in st.unwrap(be.model).named_parameters()
    }
    stages: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(stages, mine)
    ctx.save(
        f"tiny.{ctx.rank}",
        {
            "loss": d.loss,
            "tokens": d.metrics.tokens,
            "ratio_sum": d.metrics.ratio_sum,
            "weights": {k: v for stage in stages for k, v in stage.items()},
            "held": sorted(name for name, _ in be.named_parameters()),
        },
    )


def _tiny_global(name: str, stage: int) -> str:
    """A stage's parameter name with its layer numbered in the whole model (one layer per
    stage at PP 2 of the 2-layer tiny model) and the last stage's tied copy named as the
    embedding."""
    if name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    return name.replace("decoder.layers.0.", f"decoder.layers.{stage}.") if stage else name


def scenario_refusals(ctx: WorkerContext) -> None:
    """Context parallelism and virtual pipeline stages in Megatron's parallel state: refused
    at build, with the reason."""
    from megatron.core import parallel_state

    from ehp_fsm.backends.megatron.errors import MegatronBackendError
    from tests.megatron.scenario_common import build

    errors: dict[str, str] = {}
    for key, kwargs in (
        ("cp", {"context_parallel_size": 2}),
        ("vpp", {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}),
    ):
        parallel_state.initialize_model_parallel(**kwargs)  # type: ignore[arg-type]
        try:
            build("core", "core:0", 0, 1, torch.float32, num_layers=4)
        except MegatronBackendError as exc:
            errors[key] = str(exc)
        else:
            errors[key] = ""
        parallel_state.destroy_model_parallel()
    ctx.save(f"refusals.{ctx.rank}", errors)
