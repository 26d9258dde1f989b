"""Megatron-Core training backend (optional extra: `pip install ehp-fsm[megatron]`).

Layout:
- `backend`  — `MegatronReplica` (Core DP rank or DP1 Hybrid lane), `MegatronModelConfig`,
  `GradientDelivery`, `build_model_and_optimizer`.
- `state`    — DP-zero gather/scatter with per-parameter steps (`DpZeroState`), the fixes for
  megatron-core's torch-Adam step bugs, and the flat gradient layout.
- `errors`   — `MegatronBackendError`, `OptimizerStateMismatch`.
- `testing/` — the CPU compatibility layer for tests; never imported by the backend.
"""

from ehp_fsm.backends.megatron.backend import (
    GradientDelivery,
    MegatronModelConfig,
    MegatronReplica,
    build_model_and_optimizer,
)
from ehp_fsm.backends.megatron.errors import MegatronBackendError, OptimizerStateMismatch
from ehp_fsm.backends.megatron.state import (
    DpZeroState,
    dp_zero_gather,
    dp_zero_scatter,
    load_dp_reshardable_checkpoint,
    load_optimizer_state_dict,
)

__all__ = [
    "DpZeroState",
    "GradientDelivery",
    "MegatronBackendError",
    "MegatronModelConfig",
    "MegatronReplica",
    "OptimizerStateMismatch",
    "build_model_and_optimizer",
    "dp_zero_gather",
    "dp_zero_scatter",
    "load_dp_reshardable_checkpoint",
    "load_optimizer_state_dict",
]
