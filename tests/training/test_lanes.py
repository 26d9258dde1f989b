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


def test_a_lane_groups_gloo_ranks_by_lane_rank() -> None:
    """Each pool rank is `tp × pp` consecutive Gloo ranks (Megatron's TP and PP groups are then
    exactly a lane's processes); a DP group of lanes is one per lane rank."""
    from ehp_fsm.training.lanes import lane_ranks

    members = (0, 1, 3)  # pool rank 2 left the world
    assert lane_ranks([0, 3], members, lane_size=2, lane_rank=0) == [0, 4]
    assert lane_ranks([0, 3], members, lane_size=2, lane_rank=1) == [1, 5]
    assert lane_ranks([1], members, lane_size=1, lane_rank=0) == [1]
    assert lane_ranks([0, 3], members, lane_size=4, lane_rank=3) == [3, 11]  # TP 2 × PP 2


def test_pp_is_a_megatron_setting_travels_and_names_a_lanes_processes() -> None:
    with pytest.raises(ValueError, match="pipeline parallelism is built on the 'megatron'"):
        PoolConfig(pp=2)
    with pytest.raises(ValueError, match="pp must be >= 1"):
        PoolConfig(backend="megatron", model="/m", respawn_warm=False, pp=0)
    cfg = PoolConfig(backend="megatron", model="/m", respawn_warm=False, tp=2, pp=2)
    back = PoolConfig.from_json(cfg.to_json())
    assert (back.tp, back.pp, back.lane_size) == (2, 2, 4)
    assert [back.lane_part(k) for k in range(4)] == [
        "PP stage 0, TP rank 0",
        "PP stage 0, TP rank 1",
        "PP stage 1, TP rank 0",
        "PP stage 1, TP rank 1",
    ]
    assert PoolConfig(backend="megatron", model="/m", respawn_warm=False, tp=2).lane_part(1) == (
        "TP rank 1"
    )


def test_megatron_orders_a_lanes_processes_tp_then_pp_then_lanes() -> None:
    """The rank order the lanes initialise Megatron with ("tp-cp-ep-pp-dp") puts a lane's
    TP × PP processes consecutively: Megatron's TP and PP groups are each one lane's, and its
    DP dimension runs over the lanes (checked with Megatron's own rank generator)."""
    with warnings.catch_warnings():  # Megatron's import-time notices, when imported first here
        warnings.simplefilter("ignore")
        from megatron.core.parallel_state import RankGenerator

    gen = RankGenerator(tp=2, ep=1, dp=3, pp=2, cp=1, order="tp-cp-ep-pp-dp")
    assert gen.get_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    assert gen.get_ranks("pp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11]]
    assert gen.get_ranks("tp-pp") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
