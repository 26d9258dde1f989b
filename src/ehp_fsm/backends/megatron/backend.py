"""`TrainingBackend` on Megatron-Core: GPTModel + Megatron DDP + DistributedOptimizer (Adam).

What this module knows: how to build a Core replica (one DP rank of the fixed Core layout) or a
DP1 Hybrid lane (its own data-parallel group of size 1), run forward/backward on the GRPO groups
it was assigned and hand back its mean-gradient delivery (weighted nᵢ/B at reduction), apply a
reduced gradient with the DistributedOptimizer, and capture/restore the full optimizer state
(locally, or across layouts in the DP-zero format).

What it does not know: which samples go where, which deliveries are fresh, how deliveries are
reduced or moved between processes, or when a Hybrid may join — the state machines and the
reducer decide that. It never patches Megatron-Core; on CPU the process that runs it applies
`ehp_fsm.backends.megatron.cpu` first (the trainer worker of a CPU plan, the CPU tests). A lane
is either the tiny local-spec GPTModel of `MegatronModelConfig` (unit tests, benchmarks) or the
GPTModel of a Hugging Face directory built through mbridge (`hf.py`: `ehp-fsm run`), trained
under the GRPO objective of `ehp_fsm.training.objective`.

Two ways to place lanes. (1) `build(spec)`: the lane is data-parallel over Megatron's global
parallel state, so a Hybrid lane is its own `torch.distributed` world (TP×PP ranks, DP=1) and
deliveries between worlds are moved by the caller. (2) `build(spec, dp_group=...)` (PP = CP = 1,
any TP: `dp_group` is then this TP rank's group of the lanes, and the TP ranks of a lane share
Megatron's TP group): Megatron DDP and the DistributedOptimizer shard over the given group (a
Megatron `ProcessGroupCollection`), so the Core's DP ranks and a DP1 Hybrid lane share one world and
`reduce(group=None)` sums their weighted deliveries with `weighted_allreduce_` over it. Megatron's
optimizer factory all-gathers over the whole default world, so in (2) every rank must build its
lane at the same time (the Hybrid is a warm worker built with the Core). Either way, state
crosses between lanes of different layouts as a `DpZeroState` that the caller moves (file,
socket, object store); micro-batching is one GRPO group per micro-batch by default (see
`MegatronModelConfig.micro_batch_groups`).

Parallelism. TP (any size the model splits over) in both placements. PP (pipeline stages) in
placement (1) only: each rank builds its stage (the tiny model's stage is copied from the whole
seeded model, an HF model's stage loads its share through mbridge) and every stage of the lane
calls each operation. `compute` runs Megatron's pipeline schedule (one call per run of equally
shaped micro-batches; Gloo needs unbatched P2P); the last stage computes the GRPO loss from its
logits exactly as at PP 1 and broadcasts the loss and metrics over the pipeline group; the KL
reference runs forward-only through the schedule over its own stages first. Each stage's
delivery holds its own parameters' gradients, a tied embedding's two copies (first stage's
embedding, last stage's output layer) each holding their sum; `reduce` must then be given the
stage's group across lanes. `apply`, `capture`/`restore` and the DP-zero transfers are per
stage, over the stage's own DP group; `hf_state_dict` is collective over PP (every stage calls
it) and returns the whole model on every stage. A lane at PP 2 (TP 1 or 2) trains as at PP 1:
`tests/megatron/test_pipeline.py`. Refused at build: context parallelism (megatron-core's local
attention has none; only Transformer Engine's attention supports it), virtual pipeline stages,
and a `dp_group` at PP > 1 (the lane's groups would have to replace Megatron's pipeline groups
too). Not built here: a trainer pool that starts a lane's stages (`ehp-fsm run` refuses
`core.pp > 1`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import random as tp_random
from megatron.core.transformer.transformer_config import TransformerConfig

from ehp_fsm.backends.megatron import pipeline
from ehp_fsm.backends.megatron import state as st
from ehp_fsm.backends.megatron.errors import MegatronBackendError
from ehp_fsm.backends.megatron.lanestate import (
    capture_lane_state,
    megatron_layout,
    restore_lane_state,
)
from ehp_fsm.core.batch import Delivery
from ehp_fsm.training.adam import AdamConfig, apply_choice
from ehp_fsm.training.backend import GradientDelivery, TrainingBackend
from ehp_fsm.training.dpzero import DpZeroState
from ehp_fsm.training.grpo import ON_POLICY, GroupBatch, replica_loss
from ehp_fsm.training.lane import LaneSpec, LaneState
from ehp_fsm.training.layout import FlatLayout
from ehp_fsm.training.objective import ObjectiveConfig, ObjectiveMetrics
from ehp_fsm.training.policy import VOCAB
from ehp_fsm.training.reduction import (
    DEFAULT_BUCKET_BYTES,
    require_finite,
    staging_tensors,
    weighted_allreduce_,
)


@dataclass(frozen=True, kw_only=True)
class MegatronModelConfig:
    """A GPTModel (local spec). Defaults: the tiny CPU-test model over the policy vocabulary."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None
    vocab_size: int = len(VOCAB)
    seq_length: int = 16
    # Linear biases off (as in Llama-style models): the key bias has an identically zero true
    # gradient, so Adam turns its rounding noise into ±lr steps that differ between summation
    # orders and make partition-independence untestable beyond bitwise equality.
    add_bias_linear: bool = False
    seed: int = 1234
    # GRPO groups per micro-batch. Each micro-batch's weight gradient leaves the BF16 backward
    # rounded to BF16 before Megatron accumulates it in the FP32 grad buffer; with whole groups
    # per micro-batch at a fixed size, a group's BF16 gradient is the same bits on whichever
    # replica computes it, so a different partition changes only the FP32 summation order.
    micro_batch_groups: int = 1
    bucket_size: int | None = None  # Megatron honours it only with overlap_grad_reduce
    overlap_grad_reduce: bool = False
    pad_buckets_for_high_nccl_busbw: bool = False

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "vocab_size",
            "seq_length",
            "micro_batch_groups",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads}); pick heads that divide it"
            )
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ValueError(f"bucket_size must be >= 1 or None, got {self.bucket_size}")


def _check_lane_groups(dp_group: dist.ProcessGroup) -> None:
    """A lane's DP group replaces only Megatron's data-parallel groups: its TP and PP groups
    (and the embedding group of its first and last stage) must be the lane's own processes —
    Megatron initialised with the lanes as its data-parallel dimension (rank order tp-pp-dp),
    so that each rank of `dp_group` is the same TP rank of the same stage of another lane."""
    me = dist.get_rank()
    lane = set(dist.get_process_group_ranks(parallel_state.get_model_parallel_group()))
    shared = lane & set(dist.get_process_group_ranks(dp_group))
    if shared != {me}:
        raise MegatronBackendError(
            f"the lane DP group shares ranks {sorted(shared - {me})} with this rank's "
            "model-parallel group (its TP and PP ranks)",
            "a DP group holds one rank of each lane, the same TP rank of the same stage; "
            "Megatron's TP and PP groups must be each lane's own processes",
            "initialise Megatron with order='tp-cp-ep-pp-dp' over lanes of consecutive ranks, "
            "and pass one rank per lane in dp_group",
        )


def lane_process_groups(dp_group: dist.ProcessGroup) -> ProcessGroupCollection:
    """Megatron's process groups with the data-parallel ones replaced by `dp_group`.

    Megatron's parallel state spans the whole world (CP = EP = 1; TP and PP as initialised,
    with the lanes as its data-parallel dimension, so its TP, PP and embedding groups are each
    lane's own processes: `_check_lane_groups`), so a Core DP group and a DP1 Hybrid lane can
    live in one world: Megatron DDP and the DistributedOptimizer take this collection and
    shard/reduce over the lane's own group (this TP rank's of this stage). Under TP the
    optimizer's grad-stats group (`intra_dist_opt`: a gradient norm for clipping, a grad
    scaler's found-inf) is this TP rank's DP group, not the lane's TP × DP ranks; this backend
    uses neither (`clip_grad` 0, no grad scaler). `tp_dp_cp` is read only by MoE routers (no
    MoE here)."""
    groups = ProcessGroupCollection.use_mpu_process_groups()
    for name in ("dp", "dp_cp", "intra_dp_cp", "intra_dist_opt", "expt_dp", "intra_expt_dp"):
        setattr(groups, name, dp_group)
    groups.tp_dp_cp = dp_group  # MoE routers only (see above)
    return groups


def _check_build_args(
    param_dtype: torch.dtype,
    adam: AdamConfig,
    dp_group: dist.ProcessGroup | None,
    dp_group_gloo: dist.ProcessGroup | None,
) -> None:
    if (dp_group is None) != (dp_group_gloo is None):
        raise MegatronBackendError(
            "dp_group and dp_group_gloo must be given together",
            "the DP-zero transfer runs over a Gloo group of the same ranks as the DP group",
            "pass both (the same group twice on a Gloo-only CPU world) or neither",
        )
    if param_dtype not in (torch.bfloat16, torch.float32):
        raise MegatronBackendError(
            f"param_dtype {param_dtype} is not supported",
            "the backend keeps FP32 master weights for BF16 or FP32 model parameters",
            "use torch.bfloat16 or torch.float32",
        )
    if not adam.decoupled:
        raise MegatronBackendError(
            "Megatron's optimizer factory builds torch AdamW itself",
            "coupled weight decay is not passed through "
            "megatron.core.optimizer.get_megatron_optimizer",
            "use AdamConfig(decoupled=True) with this backend",
        )


def _check_parallel_state() -> None:
    """TP and PP are built; context parallelism and virtual pipeline stages are refused."""
    cp = parallel_state.get_context_parallel_world_size()
    if cp != 1:
        raise MegatronBackendError(
            f"Megatron's parallel state has context parallelism {cp}",
            "a lane runs every sample's whole sequence on each of its ranks (nothing splits "
            "sequences or sums the loss over CP ranks), and megatron-core's local attention "
            "(DotProductAttention, the layer spec without Transformer Engine) refuses CP: "
            "only Transformer Engine's attention supports it",
            "initialise Megatron's parallel state with context_parallel_size=1",
        )
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if vpp is not None and vpp > 1:
        raise MegatronBackendError(
            f"Megatron's parallel state has {vpp} virtual pipeline stages per rank",
            "a lane holds one model chunk per pipeline stage (no interleaved schedule)",
            "initialise Megatron's parallel state without virtual_pipeline_model_parallel_size",
        )


def _seed(seed: int) -> None:
    tp_random.get_cuda_rng_tracker().reset()
    tp_random.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)


def _this_device() -> torch.device | None:
    """This rank's GPU when there is one (the CPU runs and tests have none)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def build_gpt_model(config: MegatronModelConfig, *, param_dtype: torch.dtype) -> GPTModel:
    """The tiny local-spec GPTModel of `config`, initialised on CPU from `config.seed` (every
    rank and every world gets the same weights), on this rank's device. Under PP, this rank's
    stage: its parameters are copied from the whole model initialised from the seed (a stage
    drawn from the seed alone would draw its layers from another point of the RNG stream)."""
    _seed(config.seed)
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    model = _tiny_gpt(config, param_dtype, pp=1)
    if pp > 1:
        whole, model = model, _tiny_gpt(config, param_dtype, pp=pp)
        pipeline.copy_stage(whole, model)
    return model.to(device=_this_device(), dtype=param_dtype)


def _tiny_gpt(config: MegatronModelConfig, param_dtype: torch.dtype, *, pp: int) -> GPTModel:
    """The whole tiny model (pp 1), or this rank's stage of it (pp > 1)."""
    pipeline: dict[str, Any] = {}
    if pp > 1:  # Gloo has no batched P2P; NCCL runs the unbatched one too
        pipeline = dict(
            pipeline_model_parallel_size=pp, pipeline_dtype=param_dtype, batch_p2p_comm=False
        )
    transformer = TransformerConfig(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        ffn_hidden_size=config.ffn_hidden_size,
        use_cpu_initialization=True,
        add_bias_linear=config.add_bias_linear,
        bf16=param_dtype == torch.bfloat16,
        params_dtype=param_dtype,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **pipeline,
    )
    return GPTModel(
        config=transformer,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=config.vocab_size,
        max_sequence_length=config.seq_length,
        pre_process=pp == 1 or parallel_state.is_pipeline_first_stage(),
        post_process=pp == 1 or parallel_state.is_pipeline_last_stage(),
    )


def build_model_and_optimizer(
    config: MegatronModelConfig,
    *,
    param_dtype: torch.dtype,
    adam: AdamConfig,
    dp_group: dist.ProcessGroup | None = None,
    dp_group_gloo: dist.ProcessGroup | None = None,
) -> tuple[DistributedDataParallel, MegatronOptimizer]:
    """Build the GPTModel, wrap it in Megatron DDP, create the DistributedOptimizer (AdamW).

    Needs `torch.distributed` and Megatron's parallel state initialised. Every rank and every
    world with the same `config.seed` gets the same initial weights. With `dp_group` the model
    is data-parallel over that group instead of Megatron's global DP group (PP = CP = 1 only);
    `dp_group_gloo` (the same ranks over Gloo) then carries the DP-zero transfers.
    """
    _check_build_args(param_dtype, adam, dp_group, dp_group_gloo)
    model = build_gpt_model(config, param_dtype=param_dtype)
    return wrap_model_and_optimizer(
        model,
        model.config,
        config,
        adam=adam,
        dp_group=dp_group,
        dp_group_gloo=dp_group_gloo,
    )


def wrap_model_and_optimizer(
    model: torch.nn.Module,
    transformer: TransformerConfig,
    config: MegatronModelConfig,
    *,
    adam: AdamConfig,
    dp_group: dist.ProcessGroup | None = None,
    dp_group_gloo: dist.ProcessGroup | None = None,
) -> tuple[DistributedDataParallel, MegatronOptimizer]:
    """Megatron DDP around a built GPTModel (FP32 grad buffers, distributed optimizer) and the
    DistributedOptimizer (AdamW, FP32 master weights) over it; see `build_model_and_optimizer`."""
    bf16 = transformer.bf16
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        grad_reduce_in_fp32=True,
        bucket_size=config.bucket_size,
        overlap_grad_reduce=config.overlap_grad_reduce,
        pad_buckets_for_high_nccl_busbw=config.pad_buckets_for_high_nccl_busbw,
    )
    groups = lane_process_groups(dp_group) if dp_group is not None else None
    ddp = DistributedDataParallel(transformer, ddp_config, model, pg_collection=groups)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=adam.lr,
            adam_beta1=adam.betas[0],
            adam_beta2=adam.betas[1],
            adam_eps=adam.eps,
            weight_decay=adam.weight_decay,
            bf16=bf16,
            use_distributed_optimizer=True,
            clip_grad=0.0,
        ),
        [ddp],
        # Megatron refuses to build Gloo groups from a collection; the lane's own is set below.
        use_gloo_process_groups=groups is None,
        pg_collection=groups,
    )
    _apply_adam_choice(optimizer, adam)
    if dp_group_gloo is not None:
        assert dp_group is not None
        if dist.get_process_group_ranks(dp_group_gloo) != dist.get_process_group_ranks(dp_group):
            raise MegatronBackendError(
                "dp_group_gloo holds other ranks than dp_group",
                "Megatron's DP-zero gather/scatter runs over the Gloo twin of the DP group",
                "create both groups from the same rank list",
            )
        st.distributed_optimizer(optimizer).data_parallel_group_gloo = dp_group_gloo
    return ddp, optimizer


def _apply_adam_choice(optimizer: MegatronOptimizer, adam: AdamConfig) -> None:
    """The torch path's Adam rule on the optimizer Megatron built: Megatron constructs torch
    AdamW with torch's automatic foreach/fused choice (its `OptimizerConfig` has no field for
    it), so per-parameter temporaries (or the user's explicit foreach/fused) are set on the
    inner optimizer's parameter groups, as `ehp_fsm.training.adam.build_adam` would pass them.
    With Transformer Engine or Apex installed Megatron builds their FusedAdam instead: its
    own kernels, untouched; an explicit torch choice is refused there."""
    inner = st.distributed_optimizer(optimizer).optimizer
    if isinstance(inner, torch.optim.Adam):
        apply_choice(inner, adam)
    elif not adam.automatic:
        raise MegatronBackendError(
            f"Megatron built {type(inner).__module__}.{type(inner).__name__}, not torch Adam, "
            f"so the explicit foreach={adam.foreach} / fused={adam.fused} cannot apply",
            "megatron.core.optimizer prefers Transformer Engine's or Apex's FusedAdam when "
            "either is installed; foreach/fused are torch Adam options",
            "leave foreach and fused unset, or run without Transformer Engine and Apex",
        )


def _main_grad(param: torch.nn.Parameter) -> torch.Tensor:
    """Megatron DDP accumulates each parameter's gradient into a view of its FP32 grad buffer."""
    grad: torch.Tensor = param.main_grad  # type: ignore[attr-defined]  # set by Megatron DDP
    return grad


def _sum_partial_grads_over_tp(model: DistributedDataParallel) -> None:
    """Under TP, a parameter every TP rank holds whole but sees only its own heads through (the
    QK layernorms) gets a partial gradient on each rank: Megatron's own step that sums them
    over the TP group (run by its `finalize_model_grads`, which this backend does not call,
    since a delivery is reduced over DP by the reducer, not by Megatron DDP). Nothing at TP 1."""
    import importlib

    fmg: Any = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        fmg._allreduce_non_tensor_model_parallel_grads(
            [model], model.config, parallel_state.get_tensor_model_parallel_group()
        )


def _perturb(model: torch.nn.Module, *, seed: int) -> None:
    """Seeded noise on every weight (see `MegatronBackend.__init__`'s `perturb_seed`)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.02
            p.add_(noise.to(device=p.device, dtype=p.dtype))


class LogitsAdapter(torch.nn.Module):
    """`forward(tokens[B, T]) -> logits[B, T, V]` over a GPTModel (what the GRPO loss calls).

    Under tensor parallelism the output layer is vocab-parallel: the logits are gathered over
    the TP group (Megatron's own gather; its backward hands each rank its slice), and with
    `vocab_size` the rows mbridge padded the vocabulary with (so it divides by TP) are cut
    off, so the softmax is the Hugging Face model's over its own vocabulary and the padded rows
    never get a gradient."""

    def __init__(self, model: torch.nn.Module, *, vocab_size: int | None = None) -> None:
        super().__init__()
        self.model = model
        self.vocab_size = vocab_size

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n, t = tokens.shape
        positions = torch.arange(t, device=tokens.device).unsqueeze(0).expand(n, t)
        config = getattr(self.model, "config", None)  # the GPTModel's (Megatron DDP keeps it)
        if getattr(config, "tensor_model_parallel_size", 1) == 1:
            logits: torch.Tensor = self.model(tokens, positions, None)
        else:
            logits = self.model(tokens, positions, None, runtime_gather_output=True)
        if not getattr(st.unwrap(self.model), "post_process", True):
            return logits  # a pipeline stage before the last: hidden states for the next
        if self.vocab_size is not None and logits.shape[-1] != self.vocab_size:
            logits = logits[..., : self.vocab_size]
        return logits


class MegatronBackend:
    """`ehp_fsm.training.backend.TrainingBackend` on Megatron-Core (GPTModel + DDP +
    DistributedOptimizer). One instance is one lane: a Core DP rank or a DP1 Hybrid lane."""

    def __init__(
        self,
        config: MegatronModelConfig | None = None,
        *,
        hf_model: str | None = None,
        objective: ObjectiveConfig = ON_POLICY,
        perturb_seed: int | None = None,
    ) -> None:
        """`config`: the tiny local-spec GPTModel (the unit tests' model), or with `hf_model`
        the lane's Megatron settings (buckets, micro-batches) while the GPTModel itself comes
        from the Hugging Face directory through mbridge (`hf.py`). `objective`: the GRPO loss
        (per-token ratio against the engine's log-probs, clip-higher, k3 KL, aggregation).
        `perturb_seed`: a warm Hybrid lane moves its weights off the model's by seeded noise,
        so a state load that did nothing shows. With `kl_coef > 0` the lane builds a frozen
        reference of its initial weights (under PP its own stages, run forward-only through
        the pipeline schedule before each micro-batch run)."""
        self.config = config or MegatronModelConfig()
        self.hf_model = hf_model
        self.objective = objective
        self.perturb_seed = perturb_seed
        self.bridge: Any = None
        self.reference: torch.nn.Module | None = None
        self._max_positions = self.config.seq_length
        self._vocab_size: int | None = None  # an HF model's own vocabulary (mbridge may pad)
        self._spec: LaneSpec | None = None
        self._model: DistributedDataParallel | None = None
        self._optimizer: MegatronOptimizer | None = None
        self._layout: FlatLayout | None = None
        self._version = 0

    # -- build ---------------------------------------------------------------------------------

    def build(
        self,
        spec: LaneSpec,
        *,
        dp_group: dist.ProcessGroup | None = None,
        dp_group_gloo: dist.ProcessGroup | None = None,
    ) -> None:
        """Build the lane. Without `dp_group` it is data-parallel over Megatron's global DP
        group (a Core job, or a Hybrid job in its own world). With `dp_group` (and its Gloo twin
        `dp_group_gloo`; on a Gloo-only world the same group, the default) the lane shards over
        that group, so Core ranks and a DP1 Hybrid lane can share one world and reduce their
        deliveries over it."""
        if not dist.is_initialized():
            raise MegatronBackendError(
                "torch.distributed is not initialised",
                "Megatron DDP and the DistributedOptimizer communicate over process groups",
                "call torch.distributed.init_process_group before build()",
            )
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1)
        _check_parallel_state()
        if dp_group is None:
            dp, rank = (
                parallel_state.get_data_parallel_world_size(),
                parallel_state.get_data_parallel_rank(),
            )
        else:
            _check_lane_groups(dp_group)
            if dp_group_gloo is None:
                if dist.get_backend(dp_group) != "gloo":
                    raise MegatronBackendError(
                        "dp_group is not a Gloo group and no dp_group_gloo was given",
                        "Megatron's DP-zero gather/scatter runs over Gloo",
                        "pass dp_group_gloo=dist.new_group(ranks, backend='gloo')",
                    )
                dp_group_gloo = dp_group
            dp, rank = dp_group.size(), dp_group.rank()
        if dp != spec.dp_size or rank != spec.dp_rank:
            raise MegatronBackendError(
                f"lane spec says DP rank {spec.dp_rank} of {spec.dp_size}, the lane's DP group "
                f"says {rank} of {dp}",
                "the optimizer shards over the lane's DP group (Megatron's global one unless "
                "dp_group is given)",
                "pass the lane's DP group, or launch it in a world whose DP layout matches",
            )
        self._spec = spec
        _check_build_args(spec.param_dtype, spec.adam, dp_group, dp_group_gloo)
        model = self._fresh_model(spec.param_dtype)
        if self.objective.needs_reference:
            self._build_reference(spec.param_dtype)
        if self.perturb_seed is not None:
            _perturb(model, seed=self.perturb_seed)
        transformer: TransformerConfig = model.config
        self._model, self._optimizer = wrap_model_and_optimizer(
            model,
            transformer,
            self.config,
            adam=spec.adam,
            dp_group=dp_group,
            dp_group_gloo=dp_group_gloo,
        )
        self._layout = megatron_layout(self._model, self._optimizer)
        self._version = 0

    def _build_reference(self, param_dtype: torch.dtype) -> None:
        """The KL reference: the initial weights, frozen, outside DDP."""
        self.reference = LogitsAdapter(self._fresh_model(param_dtype), vocab_size=self._vocab_size)
        self.reference.eval().requires_grad_(False)

    def drop_reference(self) -> None:
        """A parked lane gives its KL reference back whole (nothing of it stays referenced);
        `restore_reference` builds it again."""
        self.reference = None

    def restore_reference(self) -> None:
        """Build the KL reference again after `drop_reference` (nothing to do without one, or
        while it is there): the same initial weights from the same source, so the same bytes.
        Collective over the lane's TP and PP groups, as the build is (every rank of the lane
        calls it at once)."""
        if self.objective.needs_reference and self.reference is None:
            self._build_reference(self.spec.param_dtype)

    def _fresh_model(self, param_dtype: torch.dtype) -> torch.nn.Module:
        """A new GPTModel with the lane's initial weights (a GPTModel holds process groups, so
        the KL reference is built again rather than copied)."""
        if self.hf_model is None:
            tiny: torch.nn.Module = build_gpt_model(self.config, param_dtype=param_dtype)
            return tiny
        return self._build_hf_model(param_dtype)

    def _build_hf_model(self, param_dtype: torch.dtype) -> torch.nn.Module:
        """The GPTModel of the HF directory (config through mbridge), its HF weights loaded."""
        from ehp_fsm.backends.megatron import hf

        assert self.hf_model is not None
        _seed(self.config.seed)
        if self.bridge is None:
            self.bridge = hf.bridge_for(self.hf_model, dtype=param_dtype)
        # On this rank's device before the weights load: mbridge scatters each weight's TP
        # shards over the TP group from a buffer shaped like the parameter, and NCCL moves
        # CUDA tensors only (a CPU-built model fails there even at TP 1).
        model = hf.build_gpt(self.bridge).to(device=_this_device(), dtype=param_dtype)
        hf.load_hf_weights(self.bridge, model, self.hf_model)
        self._max_positions = int(self.bridge.hf_config.max_position_embeddings)
        self._vocab_size = int(self.bridge.vocab_size)
        return model

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The current weights as a Hugging Face state dict (mbridge's export): what a revision
        saves. Only for a lane built from an HF directory. Collective over the lane's TP and
        PP groups: every rank of the lane calls it, and each gets the whole model."""
        if self.bridge is None:
            raise MegatronBackendError(
                "this lane was not built from a Hugging Face directory",
                "a revision is saved in the HF layout through the model's mbridge bridge",
                "build the lane with MegatronBackend(hf_model=DIR)",
            )
        from ehp_fsm.backends.megatron import hf

        return hf.hf_state_dict(self.bridge, st.unwrap(self.model))

    @property
    def spec(self) -> LaneSpec:
        if self._spec is None:
            raise MegatronBackendError(
                "the backend is not built", "there is no model yet", "call build(spec) first"
            )
        return self._spec

    @property
    def model(self) -> DistributedDataParallel:
        assert self._model is not None, "call build(spec) first"
        return self._model

    @property
    def optimizer(self) -> MegatronOptimizer:
        assert self._optimizer is not None, "call build(spec) first"
        return self._optimizer

    @property
    def layout(self) -> FlatLayout:
        """This rank's layout: one buffer per Megatron bucket (what `capture` addresses)."""
        assert self._layout is not None, "call build(spec) first"
        return self._layout

    @property
    def version(self) -> int:
        return self._version

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return list(st.unwrap(self.model).named_parameters())

    def grad_shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(p.shape) for _, p in self.named_parameters())

    # -- compute -------------------------------------------------------------------------------

    def compute(self, batch: GroupBatch, *, step: int, epoch: int) -> GradientDelivery:
        """The gradient of the objective's local loss over the batch (normalised by its own
        units: response tokens under `token_mean`, else samples), owned fp32 copies; the record
        carries the units as its weight. No DP reduction.

        Runs one micro-batch per `config.micro_batch_groups` whole groups, accumulating in
        Megatron's FP32 grad buffers: the delivery is (1/c) Σ_m (u_m·c/u) ḡ_m over the c
        micro-batches (the factor u_m·c/u is exactly 1 when the micro-batches are equal).

        Under PP every stage calls it with the same batch: the same micro-batches, losses and
        factors go through Megatron's pipeline schedule (`pipeline.backward`); every stage
        returns the last stage's loss and metrics and its own parameters' gradients (a tied
        embedding's copies summed over Megatron's embedding group)."""
        if batch.tokens.shape[1] - 1 > self._max_positions:
            raise MegatronBackendError(
                f"samples of {batch.tokens.shape[1]} tokens exceed the model's "
                f"{self._max_positions} positions + 1",
                "the model has that many positions",
                "shorten the samples (or raise MegatronModelConfig.seq_length)",
            )
        device = next(self.model.parameters()).device
        if batch.tokens.device != device:
            batch = dataclasses.replace(
                batch,
                tokens=batch.tokens.to(device),
                completion=batch.completion.to(device),
                rewards=batch.rewards.to(device),
                old_logp=None if batch.old_logp is None else batch.old_logp.to(device),
            )
        size = self.config.micro_batch_groups
        chunks = [batch.group_ids[i : i + size] for i in range(0, len(batch.group_ids), size)]
        parts = [batch.select(chunk) for chunk in chunks]
        units = batch.units(self.objective.aggregation)
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            mean_loss, metrics = pipeline.backward(
                self.model,
                LogitsAdapter(self.model, vocab_size=self._vocab_size),
                self.objective,
                parts,
                units,
                reference=self.reference,
            )
        else:
            mean_loss, metrics = self._backward(parts, units)
        _sum_partial_grads_over_tp(self.model)
        pipeline.sum_tied_embedding_grads(self.model)
        inverse = 1.0 / len(chunks)
        grads = tuple(
            _main_grad(p).detach().to(torch.float32, copy=True).mul_(inverse)
            for _, p in self.named_parameters()
        )
        record = Delivery(
            step=step,
            epoch=epoch,
            replica=self.spec.replica,
            samples=units,
            shapes=self.grad_shapes(),
        )
        return GradientDelivery(record=record, grads=grads, loss=mean_loss, metrics=metrics)

    def _backward(self, parts: Sequence[GroupBatch], units: int) -> tuple[float, ObjectiveMetrics]:
        """One forward/backward per micro-batch on the whole model (PP 1); the delivery's local
        loss Σ_m (u_m/u) · loss_m and the merged metrics."""
        adapter = LogitsAdapter(self.model, vocab_size=self._vocab_size)
        mean_loss = 0.0  # Σ_m (u_m/u) · loss of micro-batch m: the delivery's local loss
        metrics = []
        with self.model.no_sync():  # a delivery is this lane's own gradient: no DP reduction
            for part in parts:
                out = replica_loss(adapter, part, self.objective, reference=self.reference)
                metrics.append(out.metrics)
                share = out.weight / units if units else 0.0
                factor = share * len(parts)
                torch.autograd.backward(out.loss if factor == 1.0 else out.loss * factor)
                mean_loss += float(out.loss.detach()) * share
        return mean_loss, ObjectiveMetrics.merge(metrics)

    def reduce(
        self,
        delivery: GradientDelivery,
        *,
        total_samples: int,
        group: dist.ProcessGroup | None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> tuple[torch.Tensor, ...]:
        """Σ (uᵢ/U)·ḡᵢ over `group` in place. Under PP the group must hold this stage's ranks
        of the lanes only (a delivery holds this stage's parameters), never the default
        world, which holds every stage."""
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        if group is None and pp > 1:
            raise MegatronBackendError(
                f"reduce over the default world at PP {pp}",
                "the world holds every pipeline stage of the lane, and each stage's delivery "
                "holds the gradients of its own parameters only",
                "pass the group of this stage's ranks across the lanes (Megatron's "
                "data-parallel group: parallel_state.get_data_parallel_group())",
            )
        weighted_allreduce_(
            delivery.grads,
            samples=delivery.record.samples,
            total_samples=total_samples,
            group=group,
            bucket_bytes=bucket_bytes,
        )
        return delivery.grads

    def apply(self, reduced: Sequence[torch.Tensor]) -> int:
        """Write the reduced gradient into Megatron's grad buffers, step; returns the version."""
        named = self.named_parameters()
        if len(reduced) != len(named):
            raise MegatronBackendError(
                f"{len(reduced)} gradients for {len(named)} parameters",
                "a reduced gradient has one tensor per parameter, in parameter order",
                "reduce deliveries of lanes built from the same model configuration",
            )
        for (name, p), g in zip(named, reduced, strict=True):
            if tuple(g.shape) != tuple(p.shape):
                raise MegatronBackendError(
                    f"gradient for {name} has shape {tuple(g.shape)}, expected {tuple(p.shape)}",
                    "the delivery came from a different model",
                    "reduce deliveries of lanes built from the same model configuration",
                )
        # Megatron checks for NaN/Inf only with a grad scaler, which this backend never has.
        require_finite(reduced, [name for name, _ in named])
        self.model.zero_grad_buffer()
        with torch.no_grad():
            for (_, p), g in zip(named, reduced, strict=True):
                _main_grad(p).copy_(g)
        ok, _, _ = self.optimizer.step()
        if not ok:
            raise MegatronBackendError(
                "the optimizer skipped its step",
                "Megatron reported that the step could not be taken",
                "check the deliveries of this step and the optimizer configuration",
            )
        self._version += 1
        return self._version

    # -- state ---------------------------------------------------------------------------------

    def capture(self) -> LaneState:
        """Owned copy of this rank's exact state (local, not collective), in the Protocol's
        `LaneState`: its layout has one buffer per Megatron bucket (see `lanestate`)."""
        return capture_lane_state(self.model, self.optimizer, self.layout, version=self._version)

    def restore(self, state: LaneState) -> None:
        """Install a state captured on this rank's layout (same model, buckets, DP rank)."""
        restore_lane_state(self.model, self.optimizer, self.layout, state)
        self._version = state.version

    def gather_dp_zero(
        self, *, group: dist.ProcessGroup | None = None, dst: int = 0
    ) -> DpZeroState | None:
        """Collective over Megatron's DP group; the state on DP rank 0, None elsewhere."""
        self._check_group(group, dst)
        return st.dp_zero_gather(self.model, self.optimizer, version=self._version)

    def scatter_dp_zero(
        self, state: DpZeroState | None, *, group: dist.ProcessGroup | None = None, src: int = 0
    ) -> None:
        """Collective: install `state` (given on DP rank 0) into every rank; adopts its version."""
        self._check_group(group, src)
        st.dp_zero_scatter(self.model, self.optimizer, state)
        version = torch.tensor([state.version if state is not None else 0], dtype=torch.int64)
        gloo = st.distributed_optimizer(self.optimizer).data_parallel_group_gloo
        dist.broadcast(version, src=dist.get_process_group_ranks(gloo)[0], group=gloo)
        self._version = int(version.item())

    def send_dp_zero(self, state: DpZeroState, *, dst: int) -> None:
        """Point to point: send a gathered state to global rank `dst` (e.g. from Core DP rank 0
        to a Hybrid lane in the same world, which calls `recv_dp_zero`)."""
        order = list(st.parameter_names(self.model).values())
        st.dp_zero_send(self.optimizer, state, order=order, dst=dst)

    def recv_dp_zero(self, *, src: int) -> DpZeroState:
        """Point to point: receive the state `send_dp_zero` sent from global rank `src`."""
        order = list(st.parameter_names(self.model).values())
        return st.dp_zero_recv(self.optimizer, order=order, src=src)

    # -- what a trainer worker needs beyond the Protocol (`training.lanes.PoolLane`) ----------

    def revision_state_dict(self) -> dict[str, torch.Tensor]:
        return self.hf_state_dict()

    def local_state(self) -> DpZeroState:
        """A DP1 lane's state (a gather over its own one-rank group)."""
        if self.spec.dp_size != 1:
            raise MegatronBackendError(
                f"local_state of a lane sharded over {self.spec.dp_size} DP ranks",
                "only a DP1 lane holds its whole state",
                "gather_dp_zero over the lane's DP group",
            )
        state = self.gather_dp_zero()
        assert state is not None  # DP rank 0 of a one-rank group
        return state

    def rebind_dp_group(self, group: dist.ProcessGroup) -> None:
        """Refused: Megatron's DDP buckets, its DistributedOptimizer and its parallel state hold
        the groups of the world they were built in. A lane for a re-formed world is built anew
        there and given this one's captured state (`ehp_fsm.training.lanes.move_lane`)."""
        del group
        raise MegatronBackendError(
            "a Megatron lane cannot be re-pointed at another process group",
            "its DDP buckets, DistributedOptimizer and Megatron parallel state keep the process "
            "groups of the world they were built in",
            "build the lane in the new world and restore its captured state "
            "(ehp_fsm.training.lanes.move_lane)",
        )

    def close(self) -> None:
        """Nothing to stop (no snapshot thread on this backend)."""

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The lane's tensors by kind (what a parked worker must no longer reference): the
        model's parameters, DDP's main-grad views, the distributed optimizer's
        FP32 master shards and Adam state, this thread's reduction staging bucket."""
        module = st.unwrap(self.model)
        inner = st.distributed_optimizer(self.optimizer).optimizer
        params = list(module.parameters())
        return {
            # not the module's buffers (rotary tables): constants of the build, not state
            "params": list[torch.Tensor](params),
            "grads": [_main_grad(p) for p in params if getattr(p, "main_grad", None) is not None],
            "master": [p for g in inner.param_groups for p in g["params"]],
            "optimizer": [
                t for s in inner.state.values() for t in s.values() if isinstance(t, torch.Tensor)
            ],
            "reference": [] if self.reference is None else list(self.reference.parameters()),
            "staging": list(staging_tensors()),
        }

    def _check_group(self, group: dist.ProcessGroup | None, root: int) -> None:
        if root != 0 or (group is not None and group.size() != self.spec.dp_size):
            raise MegatronBackendError(
                f"DP-zero transfer with root {root} over a group of "
                f"{group.size() if group is not None else 'default'} ranks",
                "Megatron gathers to and scatters from DP rank 0 of its own DP group",
                "pass group=None (or Megatron's DP group) and root 0",
            )


if TYPE_CHECKING:  # mypy proves the backend satisfies the Protocol (never executed)
    _PROTOCOL_CHECK: TrainingBackend = MegatronBackend(MegatronModelConfig())
