"""Errors raised by the Megatron-Core backend (children of `ehp_fsm.errors.EhpError`)."""

from __future__ import annotations

from ehp_fsm.errors import EhpError


class MegatronBackendError(EhpError):
    """The Megatron-Core backend was used in a way it cannot honour (layout, state, call order)."""


class OptimizerStateMismatch(MegatronBackendError):
    """Transferred optimizer state does not fit the target (sizes, step values, parameter names)."""
