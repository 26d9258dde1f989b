"""Worker scenario: borrow a DP1 Hybrid lane from a DP2 Megatron Core and give it back.

One Gloo world of three processes: ranks 0 and 1 are the Core (a DP2 Megatron lane over the
group {0, 1}, buckets padded for NCCL bus bandwidth), rank 2 is the Hybrid (a DP1 lane over
{2}, default padding). Megatron's parallel state spans the world (TP = PP = 1); each lane's
DDP and DistributedOptimizer shard over the lane's own group (`MegatronBackend.build(...,
dp_group=)`). While the Hybrid is live, every replica's delivery goes through the torch path's
sample-weighted reduction (`MegatronBackend.reduce` -> `weighted_allreduce_`) over the whole
world; Core-only steps reduce over the Core's group. The DP-zero state moves from Core rank 0
to the Hybrid point to point over the same world (`send_dp_zero` / `recv_dp_zero`). Results
are published through a `FileExchange` directory for the test to read.

Schedule (B = 8 samples = 4 groups of 2 per step):
  steps 0-1  Core only                 -> Core gathers DP-zero state at version 2
  Hybrid     scatters it (DP-zero)     -> both publish their state (must be bitwise equal)
  steps 2-4  Core + Hybrid split 4/2/2 -> after step 2 (the next update) and step 4 both publish
  return     the Hybrid leaves after step 4
  steps 5-6  Core only                 -> final Core state
A reference world of two more processes (`reference`, Megatron's global parallel state, DP2)
trains all 7 steps Core-only with Megatron's own DDP path (one micro-batch per group,
`finish_grad_sync` + `DistributedOptimizer.step`) on equal halves of the same batches. It cannot
share the one world: `get_megatron_optimizer` all-gathers its parameter-group keys over the
whole default world, so every rank of a world must build the same number of optimizers at the
same time (a Hybrid lane in the Core's world is built together with the Core's, as the pool's
warm Hybrid workers are).

The whole schedule runs twice in the same processes: with BF16 parameters (FP32 master weights,
keys `*.bf16.*`) and with FP32 parameters (keys `*.fp32.*`). Each published state also records
whether every rank's model parameters are exactly its master shards rounded to the model dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.megatron.harness import WorkerContext

CORE = dict(bucket_size=3000, overlap_grad_reduce=True, pad_buckets_for_high_nccl_busbw=True)
HYBRID = dict(bucket_size=3000, overlap_grad_reduce=True, pad_buckets_for_high_nccl_busbw=False)
SPLIT = {"core0": (0, 1), "core1": (2,), "hybrid": (3,)}  # positions of the step's groups
CORE_RANKS, HYBRID_RANK = (0, 1), 2
WORLD_SIZE = 3
DTYPES = (("bf16", torch.bfloat16), ("fp32", torch.float32))


def _params_are_rounded_masters(backend: Any) -> bool:
    """Collective over the lane's DP group: every model parameter element equals its FP32
    master rounded to the model dtype (exactly; the DistributedOptimizer copies master ->
    param)."""
    from ehp_fsm.backends.megatron import state as st

    dist_opt = st.distributed_optimizer(backend.optimizer)
    ok = True
    for model_param, main in st._owned(dist_opt):
        r = dist_opt._get_model_param_range_map(model_param)["param"]
        piece = model_param.detach().view(-1)[r.start : r.end]
        ok = ok and torch.equal(piece, main.detach().to(model_param.dtype))
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
    torch.distributed.all_reduce(flag, group=dist_opt.data_parallel_group_gloo)
    return int(flag.item()) == 0


def _publish(ctx: WorkerContext, backend: Any, key: str) -> None:
    """Collective over the lane's DP group; its DP rank 0 writes buffers, steps, version,
    model params and whether those params are the rounded masters."""
    rounded = _params_are_rounded_masters(backend)
    state = backend.gather_dp_zero()
    if state is not None:
        params = {n: p.detach().clone() for n, p in backend.named_parameters()}
        ctx.exchange.put(
            key,
            {
                "buffers": state.buffers,
                "steps": dict(state.steps),
                "version": state.version,
                "params": params,
                "rounded_masters": rounded,
            },
        )


def _buckets(backend: Any) -> list[tuple[int, int]]:
    from ehp_fsm.backends.megatron import state as st

    dist_opt = st.distributed_optimizer(backend.optimizer)
    return [
        (b.grad_data.numel(), b.numel_unpadded) for buf in dist_opt.buffers for b in buf.buckets
    ]


def _batch(step: int) -> Any:
    from tests.megatron.scenario_common import step_batch

    return step_batch(step)


def _split_step(backend: Any, replica: str, step: int) -> None:
    """This replica's share of the fixed batch, reduced Σ (nᵢ/B)·ḡᵢ over the whole world
    (Core ranks and the Hybrid), then applied."""
    batch = _batch(step)
    mine = batch.select([batch.group_ids[i] for i in SPLIT[replica]])
    delivery = backend.compute(mine, step=step, epoch=1)
    reduced = backend.reduce(delivery, total_samples=batch.samples, group=None)
    backend.apply(reduced)


def scenario(ctx: WorkerContext) -> None:
    """Entry of every rank of the one world."""
    assert ctx.world_size == WORLD_SIZE
    # Every rank creates every group, in the same order (torch.distributed requires it).
    core_group = torch.distributed.new_group(list(CORE_RANKS))
    hybrid_group = torch.distributed.new_group([HYBRID_RANK])
    for tag, dtype in DTYPES:
        if ctx.rank in CORE_RANKS:
            _core(ctx, tag, dtype, core_group)
        else:
            _hybrid(ctx, tag, dtype, hybrid_group)


def _core(ctx: WorkerContext, tag: str, dtype: torch.dtype, group: Any) -> None:
    from ehp_fsm.backends.megatron import state as st
    from tests.megatron.scenario_common import build, core_only_step, equal_states

    rank, n = ctx.rank, len(CORE_RANKS)
    name = f"core{rank}"
    lane = build("core", name, rank, n, dtype, dp_group=group, **CORE)
    for step in range(2):
        core_only_step(lane, step, rank, n, group=group)
    _publish(ctx, lane, f"core.{tag}.v2")
    snapshot = lane.capture()  # the Protocol's LaneState, restored after the run below
    state = lane.gather_dp_zero()
    if state is not None:  # Core DP rank 0 sends the world state to the Hybrid over the world
        ctx.exchange.put(f"core.{tag}.buckets", _buckets(lane))
        lane.send_dp_zero(state, dst=HYBRID_RANK)
    for step in range(2, 5):  # the Hybrid is live: deliveries reduced over the world
        _split_step(lane, name, step)
        if step in (2, 4):
            _publish(ctx, lane, f"core.{tag}.v{step + 1}")
    for step in range(5, 7):  # returned: Core-only again, reduced over the Core's group
        core_only_step(lane, step, rank, n, group=group, epoch=2)
    _publish(ctx, lane, f"core.{tag}.v7")
    shared = st.shared_step_count(st.distributed_optimizer(lane.optimizer))
    ctx.exchange.put(f"core.{tag}.shared_steps{rank}", shared)
    lane.restore(snapshot)  # five steps later: every bit of version 2 comes back
    ctx.exchange.put(f"core.{tag}.restore_equal{rank}", equal_states(snapshot, lane.capture()))
    _publish(ctx, lane, f"core.{tag}.restored_v2")


def reference(ctx: WorkerContext) -> None:
    """Entry of the reference world (2 ranks): Core-only, Megatron's own DDP path."""
    for tag, dtype in DTYPES:
        _reference(ctx, tag, dtype)


def _reference(ctx: WorkerContext, tag: str, dtype: torch.dtype) -> None:
    from ehp_fsm.backends.megatron.backend import LogitsAdapter
    from ehp_fsm.training.grpo import ON_POLICY, replica_loss
    from tests.megatron.scenario_common import build

    rank, n = ctx.rank, ctx.world_size
    ref = build("core", f"core{rank}", rank, n, dtype, **CORE)

    def reference_step(step: int) -> None:
        batch = _batch(step)
        per = len(batch.group_ids) // n
        mine = batch.select(batch.group_ids[rank * per : (rank + 1) * per])
        ref.model.zero_grad_buffer()
        ref.optimizer.zero_grad()
        # Megatron's schedule: one micro-batch per group, each loss divided by the number of
        # micro-batches, all but the last under no_sync (the grads accumulate in FP32).
        chunks = [mine.select([g]) for g in mine.group_ids]
        for i, chunk in enumerate(chunks):
            loss = replica_loss(LogitsAdapter(ref.model), chunk, ON_POLICY).loss / len(chunks)
            if i < len(chunks) - 1:
                with ref.model.no_sync():
                    torch.autograd.backward(loss)
            else:
                torch.autograd.backward(loss)
        ref.model.finish_grad_sync()
        ok, _, _ = ref.optimizer.step()
        assert ok

    for step in range(7):
        reference_step(step)
        if step + 1 in (2, 3, 5, 7):
            _publish(ctx, ref, f"core.{tag}.ref.v{step + 1}")


def _hybrid(ctx: WorkerContext, tag: str, dtype: torch.dtype, group: Any) -> None:
    from ehp_fsm.backends.megatron import state as st
    from tests.megatron.scenario_common import build

    lane = build("hybrid", "hybrid", 0, 1, dtype, dp_group=group, **HYBRID)
    lane.scatter_dp_zero(lane.recv_dp_zero(src=CORE_RANKS[0]))
    ctx.exchange.put(f"hybrid.{tag}.buckets", _buckets(lane))
    _publish(ctx, lane, f"hybrid.{tag}.restored")
    for step in range(2, 5):
        _split_step(lane, "hybrid", step)
        if step in (2, 4):
            _publish(ctx, lane, f"hybrid.{tag}.v{step + 1}")
    ctx.exchange.put(
        f"hybrid.{tag}.shared_steps", st.shared_step_count(st.distributed_optimizer(lane.optimizer))
    )
