"""A training replica on Megatron-Core: GPTModel + Megatron DDP + DistributedOptimizer (Adam).

What this module knows: how to build a Core replica (one DP rank of the fixed Core layout) or a
DP1 Hybrid lane (its own data-parallel group of size 1), run forward/backward on the samples it
was assigned and hand back a sample-weighted gradient delivery, apply a reduced gradient with
the DistributedOptimizer, and capture/restore the full optimizer state in the DP-zero format.

What it does not know: which samples go where, which deliveries are fresh, how deliveries are
reduced or moved between processes, or when a Hybrid may join — the state machines and the
reducer decide that. It never patches Megatron-Core; the CPU test support lives in
`ehp_fsm.backends.megatron.testing` and is applied only by CPU tests.

Megatron's parallel state is one per process, so a Hybrid lane is a separate process group world
(its own `torch.distributed` job of size TP×PP×CP with DP=1) — exactly how a Hybrid replica starts
on GPUs borrowed from rollout engines. State crosses between the Core world and the Hybrid world
as a `DpZeroState`, which the caller moves (file, socket, object store).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.tensor_parallel import random as tp_random
from megatron.core.transformer.transformer_config import TransformerConfig

from ehp_fsm.backends.megatron import state as st
from ehp_fsm.backends.megatron.errors import MegatronBackendError

Role = Literal["core", "hybrid"]


@dataclass(frozen=True, kw_only=True)
class MegatronModelConfig:
    """A GPTModel (local spec) and its optimizer. Defaults are the tiny CPU-test model."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None
    vocab_size: int = 32
    seq_length: int = 16
    bf16: bool = True
    lr: float = 1e-3
    weight_decay: float = 0.01
    seed: int = 1234
    bucket_size: int | None = None
    pad_buckets_for_high_nccl_busbw: bool = False

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "vocab_size",
            "seq_length",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads}); pick heads that divide it"
            )
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ValueError(f"bucket_size must be >= 1 or None, got {self.bucket_size}")


@dataclass(frozen=True, kw_only=True)
class GradientDelivery:
    """One replica's contribution: (n / B) · its mean gradient, flat and unpadded, FP32 on CPU.

    Summing the deliveries of all replicas of one step gives the full-batch mean gradient for
    every partition of the B samples.
    """

    replica: str
    samples: int
    global_batch: int
    grad: torch.Tensor

    def __post_init__(self) -> None:
        if not 0 <= self.samples <= self.global_batch:
            raise ValueError(
                f"samples ({self.samples}) must be within [0, global_batch={self.global_batch}]"
            )
        if self.grad.dtype != torch.float32 or self.grad.dim() != 1:
            raise ValueError("grad must be a flat float32 tensor")


def build_model_and_optimizer(
    config: MegatronModelConfig,
) -> tuple[DistributedDataParallel, MegatronOptimizer]:
    """Build the model, wrap it in Megatron DDP and create the DistributedOptimizer.

    Needs `torch.distributed` and Megatron's parallel state initialised (see `MegatronReplica`).
    Every rank and every world that uses the same `config.seed` gets the same initial weights.
    """
    tp_random.get_cuda_rng_tracker().reset()
    tp_random.model_parallel_cuda_manual_seed(config.seed)
    torch.manual_seed(config.seed)
    dtype = torch.bfloat16 if config.bf16 else torch.float32
    transformer = TransformerConfig(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        ffn_hidden_size=config.ffn_hidden_size,
        use_cpu_initialization=True,
        bf16=config.bf16,
        params_dtype=dtype,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(
        config=transformer,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=config.vocab_size,
        max_sequence_length=config.seq_length,
    ).to(dtype)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        grad_reduce_in_fp32=True,
        bucket_size=config.bucket_size,
        pad_buckets_for_high_nccl_busbw=config.pad_buckets_for_high_nccl_busbw,
    )
    ddp = DistributedDataParallel(transformer, ddp_config, model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=config.lr,
            weight_decay=config.weight_decay,
            bf16=config.bf16,
            use_distributed_optimizer=True,
            clip_grad=0.0,
        ),
        [ddp],
    )
    return ddp, optimizer


def per_sample_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of each sample ([n] float32)."""
    n, seq = tokens.shape
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(seq - 1).unsqueeze(0).expand(n, seq - 1)
    per_token: torch.Tensor = model(inputs, positions, None, labels=labels)
    return per_token.float().mean(dim=1)


class MegatronReplica:
    """One training replica (a Core DP rank or a DP1 Hybrid lane) backed by Megatron-Core."""

    def __init__(self, *, name: str, role: Role, config: MegatronModelConfig) -> None:
        if not torch.distributed.is_initialized():
            raise MegatronBackendError(
                "torch.distributed is not initialised",
                "Megatron DDP and the DistributedOptimizer communicate over process groups",
                "call torch.distributed.init_process_group before building a replica",
            )
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1)
        dp = parallel_state.get_data_parallel_world_size()
        if role == "hybrid" and dp != 1:
            raise MegatronBackendError(
                f"a Hybrid lane must be DP1, its world has DP={dp}",
                "a Hybrid replica is one data-parallel replica started on borrowed GPUs",
                "launch the Hybrid lane as its own world of TP×PP×CP ranks",
            )
        self.name, self.role, self.config = name, role, config
        self.model, self.optimizer = build_model_and_optimizer(config)
        self.version = 0

    # -- compute ------------------------------------------------------------------------------

    def forward_backward(self, tokens: torch.Tensor, *, global_batch: int) -> GradientDelivery:
        """Local gradient of this replica's samples, weighted n/B (no DP reduction)."""
        n = int(tokens.shape[0])
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        if n:
            loss = per_sample_loss(self.model, tokens).sum() / global_batch
            torch.autograd.backward(loss)
        return GradientDelivery(
            replica=self.name,
            samples=n,
            global_batch=global_batch,
            grad=st.read_flat_grads(self.optimizer),
        )

    def apply_reduced_gradient(self, grad: torch.Tensor) -> int:
        """Write the reduced gradient into the buffers, step the optimizer; returns the version."""
        st.write_flat_grads(self.optimizer, grad)
        ok, _, _ = self.optimizer.step()
        if not ok:
            raise MegatronBackendError(
                "the optimizer skipped its step",
                "Megatron reported a non-finite gradient",
                "check the deliveries of this step for NaN/Inf before reducing them",
            )
        self.version += 1
        return self.version

    # -- state --------------------------------------------------------------------------------

    def dp_zero_gather(self) -> st.DpZeroState | None:
        """Collective over this replica's DP group; the state on DP rank 0, None elsewhere."""
        return st.dp_zero_gather(self.model, self.optimizer, version=self.version)

    def dp_zero_scatter(self, state: st.DpZeroState | None) -> None:
        """Collective: restore `state` (on DP rank 0) into every rank; adopts its version."""
        st.dp_zero_scatter(self.model, self.optimizer, state)
        version = torch.tensor([state.version if state is not None else 0], dtype=torch.int64)
        group = st.distributed_optimizer(self.optimizer).data_parallel_group_gloo
        src = torch.distributed.get_process_group_ranks(group)[0]
        torch.distributed.broadcast(version, src=src, group=group)
        self.version = int(version.item())

    capture_state = dp_zero_gather
    restore_state = dp_zero_scatter
