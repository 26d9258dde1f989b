"""The backend-selection seam of the trainer pool: what a pool config may name, and what a
Megatron lane refuses (no processes: the pool and run tests build real lanes)."""

from __future__ import annotations

import warnings

import pytest

from ehp_fsm.training.pool_protocol import PoolConfig


def test_a_megatron_pool_names_its_hf_model_and_replaces_warm_workers() -> None:
    """A Megatron pool replaces a dead warm worker like a torch pool (the replacement builds its
    lane when admitted into the world: `tests/training_pool/test_megatron_pool.py`)."""
    with pytest.raises(ValueError, match="HF directory"):
        PoolConfig(backend="megatron")
    with pytest.raises(ValueError, match="backend="):
        PoolConfig(backend="jax")
    assert PoolConfig(backend="megatron", model="/m").respawn_warm is True
    cfg = PoolConfig(backend="megatron", model="/m", respawn_warm=False, device="cpu")
    back = PoolConfig.from_json(cfg.to_json())  # what a worker is started with
    assert (back.backend, back.device, back.respawn_warm) == ("megatron", "cpu", False)


def test_a_megatron_lane_refuses_another_group_and_says_what_to_do() -> None:
    with warnings.catch_warnings():  # Megatron's import-time notices (Apex, TE, torch.jit)
        warnings.simplefilter("ignore")
        from ehp_fsm.backends.megatron.backend import MegatronBackend
        from ehp_fsm.backends.megatron.errors import MegatronBackendError

    with pytest.raises(MegatronBackendError, match="cannot be re-pointed") as err:
        MegatronBackend().rebind_dp_group(None)  # type: ignore[arg-type]
    assert "move_lane" in str(err.value)


def test_tp_is_a_megatron_setting_and_travels_to_the_workers() -> None:
    with pytest.raises(ValueError, match="tensor parallelism"):
        PoolConfig(tp=2)  # the torch lanes are data-parallel
    with pytest.raises(ValueError, match="tp must be >= 1"):
        PoolConfig(backend="megatron", model="/m", respawn_warm=False, tp=0)
    cfg = PoolConfig(backend="megatron", model="/m", respawn_warm=False, tp=2)
    assert PoolConfig.from_json(cfg.to_json()).tp == 2


def test_a_lane_groups_gloo_ranks_by_tp_rank() -> None:
    """Each pool rank is `tp` consecutive Gloo ranks (Megatron's TP groups are then exactly a
    lane's processes); a DP group of lanes is one per TP rank."""
    from ehp_fsm.training.lanes import tp_ranks

    members = (0, 1, 3)  # pool rank 2 left the world
    assert tp_ranks([0, 3], members, tp=2, tp_rank=0) == [0, 4]
    assert tp_ranks([0, 3], members, tp=2, tp_rank=1) == [1, 5]
    assert tp_ranks([1], members, tp=1, tp_rank=0) == [1]
