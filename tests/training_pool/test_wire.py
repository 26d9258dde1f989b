"""The pool's wire encodings and configuration, in one process (no workers)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ehp_fsm.runtime.protocol import Frame, Kind, decode, encode
from ehp_fsm.training.adam import AdamConfig
from ehp_fsm.training.grpo import synthetic_groups
from ehp_fsm.training.policy import PolicyConfig
from ehp_fsm.training.pool_protocol import (
    PoolConfig,
    PoolError,
    decode_batch,
    decode_tensor,
    encode_batch,
    encode_tensor,
    worker_argv,
)


@given(
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=3),
    dtype=st.sampled_from([torch.int64, torch.bool, torch.float32]),
)
def test_tensor_round_trip(shape: list[int], dtype: torch.dtype) -> None:
    t = (torch.arange(int(torch.tensor(shape).prod()) if shape else 1) % 3).reshape(shape).to(dtype)
    back = decode_tensor(encode_tensor(t))
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)


def test_malformed_tensors_are_refused() -> None:
    good = encode_tensor(torch.zeros(2, 3))
    with pytest.raises(PoolError, match="do not match"):
        decode_tensor({**good, "shape": [2, 4]})
    with pytest.raises(PoolError, match="malformed"):
        decode_tensor({**good, "dtype": "object"})
    with pytest.raises(PoolError, match="cannot travel"):
        encode_tensor(torch.zeros(2, dtype=torch.float16))


def test_batch_survives_a_validated_frame() -> None:
    cfg = PolicyConfig(d_model=32, n_heads=4, d_ff=64, n_layers=2, max_len=16)
    batch = synthetic_groups(range(3), group_size=4, config=cfg, seed=1)
    frame = Frame(
        kind=Kind.COMMAND,
        id="x1",
        seq=1,
        epoch=1,
        sender="trainer-pool",
        payload={"op": "compute", "args": {"batch": encode_batch(batch)}, "target_epoch": 1},
    )
    got = decode(encode(frame))
    assert isinstance(got, Frame)
    back = decode_batch(got.payload["args"]["batch"])
    assert back.group_ids == batch.group_ids
    for name in ("tokens", "completion", "rewards"):
        assert torch.equal(getattr(back, name), getattr(batch, name))


def test_config_round_trips_through_argv() -> None:
    cfg = PoolConfig(
        policy=PolicyConfig(d_model=32, n_heads=4),
        seed=5,
        core_dp=2,
        max_hybrids=2,
        adam=AdamConfig(lr=3e-3, betas=(0.8, 0.99), eps=1e-6),
        revisions="/tmp/r",
    )
    argv = worker_argv(cfg, rank=3, control="tcp://127.0.0.1:1", rendezvous="file:///x")
    assert argv[1:3] == ["-m", "ehp_fsm.training.worker"]
    assert PoolConfig.from_json(argv[argv.index("--config") + 1]) == cfg
    with pytest.raises(PoolError, match="outside the pool's world of 4"):
        worker_argv(cfg, rank=4, control="c", rendezvous="r")


def test_config_refuses_too_many_warm_workers() -> None:
    with pytest.raises(ValueError, match="one warm trainer process per lane"):
        PoolConfig(max_hybrids=33)
    with pytest.raises(ValueError, match="core_dp=0"):
        PoolConfig(core_dp=0)
