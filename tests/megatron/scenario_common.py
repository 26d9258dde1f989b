"""Shared pieces of the Megatron worker scenarios: batches, Core-only steps, local snapshots."""

from __future__ import annotations

import torch

from ehp_fsm.backends.megatron import state as st
from ehp_fsm.backends.megatron.backend import MegatronModelConfig, MegatronReplica


def batch(step: int, global_batch: int, config: MegatronModelConfig) -> torch.Tensor:
    """The fixed global batch of one step (identical in every process)."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, config.vocab_size, (global_batch, config.seq_length), generator=gen)


def train_core_step(replica: MegatronReplica, tokens: torch.Tensor, rank: int, world: int) -> None:
    """One Core-only step: equal shares, deliveries summed in rank order over Gloo, applied."""
    share = tokens.shape[0] // world
    mine = tokens[rank * share : (rank + 1) * share]
    delivery = replica.forward_backward(mine, global_batch=int(tokens.shape[0]))
    parts = [torch.empty_like(delivery.grad) for _ in range(world)]
    torch.distributed.all_gather(parts, delivery.grad)
    total = parts[0].clone()
    for p in parts[1:]:
        total += p
    replica.apply_reduced_gradient(total)


def snapshot_local(replica: MegatronReplica) -> dict[str, torch.Tensor]:
    """Copies of this rank's master shards, Adam moments, steps and model parameters."""
    dist_opt = st.distributed_optimizer(replica.optimizer)
    names = st.parameter_names(replica.model)
    out: dict[str, torch.Tensor] = {}
    for model_param, main in st._owned(dist_opt):
        name = names[model_param]
        out[f"{name}.main"] = main.detach().clone()
        for key, value in dist_opt.optimizer.state[main].items():
            out[f"{name}.{key}"] = value.detach().clone()
    for param, name in names.items():
        out[f"{name}.model"] = param.detach().clone()
    return out
