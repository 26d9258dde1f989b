"""Worker scenario: a Megatron lane built from a Hugging Face directory through mbridge.

Runs in a spawned process with the CPU compatibility layer applied (`harness.py`): Megatron's
parallel state (TP = PP = 1), a Core DP1 `MegatronBackend(hf_model=...)` under a GRPO objective
with clip-higher, k3 KL and `token_mean`, two micro-batches of unequal token counts. It
publishes, for the test process to compare against transformers (which this process must not
load: the CPU layer's patched tensor factories break `from_pretrained`'s buffer init):
the GPTModel's weights exported back to HF names before any step (`initial`); the delivery of
one batch (loss, weight, metrics, and the gradient converted to HF names by the bridge's own
`_weight_to_hf_format`); after one optimizer step a revision written by the run's
`RevisionStore` from `hf_state_dict()`, and the lane's logits on a probe batch.
"""

from __future__ import annotations

import torch

from tests.megatron.harness import WorkerContext

GROUPS, GROUP_SIZE = 4, 4


def objective() -> object:
    from ehp_fsm.training.objective import ObjectiveConfig

    return ObjectiveConfig(aggregation="token_mean", clip_low=0.2, clip_high=0.28, kl_coef=0.05)


def batch() -> object:
    """Arithmetic groups in the tiny model's ids, with behaviour log-probs far from the
    policy's (ratios on both sides of the clip range)."""
    import dataclasses

    from ehp_fsm.training.grpo import synthetic_groups
    from ehp_fsm.training.policy import PolicyConfig

    b = synthetic_groups(range(GROUPS), group_size=GROUP_SIZE, config=PolicyConfig(), seed=3)
    gen = torch.Generator().manual_seed(11)
    old = -2.9 + 0.6 * torch.randn(b.tokens.shape, generator=gen)
    return dataclasses.replace(b, old_logp=torch.where(b.completion, old, torch.zeros(())))


def probe() -> torch.Tensor:
    return torch.tensor([[1, 5, 6, 7, 8, 3, 4, 2], [1, 9, 10, 11, 12, 13, 2, 0]])


def scenario(ctx: WorkerContext) -> None:
    from megatron.core import parallel_state

    from ehp_fsm.backends.megatron.backend import (
        LogitsAdapter,
        MegatronBackend,
        MegatronModelConfig,
    )
    from ehp_fsm.rollout.revisions import RevisionStore
    from ehp_fsm.training.adam import AdamConfig
    from ehp_fsm.training.lane import LaneSpec

    model = ctx.out / "model"
    parallel_state.initialize_model_parallel(1, 1)
    be = MegatronBackend(
        MegatronModelConfig(micro_batch_groups=2),
        hf_model=str(model),
        objective=objective(),  # type: ignore[arg-type]
    )
    be.build(LaneSpec(role="core", replica="core:0", adam=AdamConfig(lr=1e-3, eps=1e-6)))
    ctx.save("initial", be.hf_state_dict())
    d = be.compute(batch(), step=0, epoch=0)  # type: ignore[arg-type]
    grads: dict[str, torch.Tensor] = {}
    for (name, _), g in zip(be.named_parameters(), d.grads, strict=True):
        hf_names, hf_grads = be.bridge._weight_to_hf_format(name, g)
        grads.update(zip(hf_names, hf_grads, strict=True))
    m = d.metrics
    ctx.save(
        "delivery",
        {
            "loss": d.loss,
            "weight": d.record.samples,
            "tokens": m.tokens,
            "clipped": m.clipped,
            "ratio_sum": m.ratio_sum,
            "grads": grads,
        },
    )
    be.apply(d.grads)
    store = RevisionStore(ctx.out / "revisions")
    store.save(revision=1, step=1, state_dict=be.hf_state_dict(), base=model)
    with torch.no_grad():
        ctx.save("logits", LogitsAdapter(be.model)(probe()).float())
    ctx.save("untied_output", _untied_output_names(model, ctx.out / "untied"))


def _untied_output_names(tied: object, dest: object) -> dict[str, list[str]]:
    """After the tied model's bridge: what a bridge of the same model untied maps its output
    layer to, and what mbridge's Qwen2 class (Qwen3's base) maps it to now."""
    import json
    import shutil
    from pathlib import Path

    from mbridge.models.qwen2 import Qwen2Bridge

    from ehp_fsm.backends.megatron.hf import bridge_for

    src, out = Path(str(tied)), Path(str(dest))
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    bridge = bridge_for(out, dtype=torch.float32)
    return {
        "untied": bridge._weight_name_mapping_mcore_to_hf("output_layer.weight"),
        "class": [Qwen2Bridge._DIRECT_MAPPING["output_layer.weight"]],
    }


def scenario_tp2(ctx: WorkerContext) -> None:
    """The same lane at TP 2 (one DP1 lane over two processes: Megatron's parallel state at
    TP 2, the lane's DP group one per TP rank, as the trainer pool builds it): the GPTModel
    exported back before any step, the delivery's loss, and after the same optimizer step the
    HF tensors mbridge gathers over TP and the lane's logits on the probe batch."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from ehp_fsm.backends.megatron.backend import (
        LogitsAdapter,
        MegatronBackend,
        MegatronModelConfig,
    )
    from ehp_fsm.training.adam import AdamConfig
    from ehp_fsm.training.lane import LaneSpec

    parallel_state.initialize_model_parallel(2, 1)
    dp_groups = [dist.new_group([r]) for r in range(ctx.world_size)]  # collective, in order
    be = MegatronBackend(
        MegatronModelConfig(micro_batch_groups=2),
        hf_model=str(ctx.out / "model"),
        objective=objective(),  # type: ignore[arg-type]
    )
    be.build(
        LaneSpec(role="core", replica="core:0", adam=AdamConfig(lr=1e-3, eps=1e-6)),
        dp_group=dp_groups[ctx.rank],
    )
    initial = be.hf_state_dict()  # collective over TP
    d = be.compute(batch(), step=0, epoch=0)  # type: ignore[arg-type]
    be.apply(d.grads)
    stepped = be.hf_state_dict()
    with torch.no_grad():
        logits = LogitsAdapter(be.model, vocab_size=be.bridge.vocab_size)(probe()).float()
    if ctx.rank == 0:
        ctx.save("initial", initial)
        ctx.save("delivery", {"loss": d.loss, "weight": d.record.samples})
        ctx.save("stepped", stepped)
        ctx.save("logits", logits)
