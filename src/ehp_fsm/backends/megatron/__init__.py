"""Megatron-Core training backend (optional extra: `pip install ehp-fsm[megatron]`).

Layout:
- `backend`  — `MegatronBackend` (the `TrainingBackend` Protocol of `ehp_fsm.training.backend`,
  for a Core DP rank or a DP1 Hybrid lane; `capture`/`restore` use the Protocol's `LaneState`),
  `MegatronModelConfig`, `build_model_and_optimizer`, `lane_process_groups` (a lane's own DP
  group — one per TP rank under TP — so Core and Hybrid lanes can share one world).
- `lanestate` — Megatron's per-rank bucket sharding as a `FlatLayout`; `LaneState` capture and
  restore.
- `state`    — DP-zero gather/scatter with per-parameter steps (as
  `ehp_fsm.training.dpzero.DpZeroState`), the fixes for megatron-core's torch-Adam step bugs,
  the flat gradient layout, `save_dp_zero` / `load_dp_zero`.
- `shards`   — the DP-zero world tensors read from and written into a `DistributedOptimizer`'s
  shards in bounded device-side chunks (Megatron's format; its own functions copy one
  parameter at a time through pageable memory).
- `pipeline` — what a lane adds at PP > 1: the GRPO objective through Megatron's pipeline
  schedule (loss on the last stage, broadcast to every stage), the tied embedding's gradient
  sum over the embedding group, a tiny model's stage copied from the whole seeded model.
- `hf`       — GPTModels from Hugging Face directories and back, through mbridge.
- `errors`   — `MegatronBackendError`, `OptimizerStateMismatch`.
- `cpu`      — the CPU compatibility layer (applied by a CPU plan's trainer workers and the CPU
  tests before Megatron builds anything; never imported by the backend modules).
"""

from ehp_fsm.backends.megatron.backend import (
    MegatronBackend,
    MegatronModelConfig,
    build_model_and_optimizer,
    lane_process_groups,
)
from ehp_fsm.backends.megatron.errors import MegatronBackendError, OptimizerStateMismatch
from ehp_fsm.backends.megatron.state import (
    dp_zero_gather,
    dp_zero_scatter,
    load_dp_reshardable_checkpoint,
    load_dp_zero,
    load_optimizer_state_dict,
    save_dp_zero,
)

__all__ = [
    "MegatronBackend",
    "MegatronBackendError",
    "MegatronModelConfig",
    "OptimizerStateMismatch",
    "build_model_and_optimizer",
    "dp_zero_gather",
    "dp_zero_scatter",
    "lane_process_groups",
    "load_dp_reshardable_checkpoint",
    "load_dp_zero",
    "load_optimizer_state_dict",
    "save_dp_zero",
]
