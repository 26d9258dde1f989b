"""Worker scenario: borrow a DP1 Hybrid lane from a DP2 Megatron Core and give it back.

Two worlds run at once: the Core (2 Gloo ranks, DP=2, buckets padded for NCCL bus bandwidth)
and the Hybrid (1 rank, its own world, DP=1, default padding) — Megatron's parallel state is one
per process, so a DP1 lane beside a DP2 Core is a separate world, as a Hybrid job on borrowed
GPUs is. They exchange state and deliveries through a `FileExchange` directory.

Schedule (B = 8 samples = 4 groups of 2 per step):
  steps 0-1  Core only                 -> Core gathers DP-zero state at version 2
  Hybrid     scatters it (DP-zero)     -> both publish their state (must be bitwise equal)
  steps 2-4  Core + Hybrid split 4/2/2 -> after step 2 (the next update) and step 4 both publish
  return     the Hybrid leaves after step 4
  steps 5-6  Core only                 -> final Core state
A reference model in the Core world trains all 7 steps with Megatron's own DDP path
(`finish_grad_sync` + `DistributedOptimizer.step`) on equal halves of the same batches.

The whole schedule runs twice in the same processes: with BF16 parameters (FP32 master weights,
keys `bf16.*`) and with FP32 parameters (keys `fp32.*`). Each published state also records
whether every rank's model parameters are exactly its master shards rounded to the model dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.megatron.harness import WorkerContext

CORE = dict(bucket_size=3000, overlap_grad_reduce=True, pad_buckets_for_high_nccl_busbw=True)
HYBRID = dict(bucket_size=3000, overlap_grad_reduce=True, pad_buckets_for_high_nccl_busbw=False)
SPLIT = {"core0": (0, 1), "core1": (2,), "hybrid": (3,)}  # positions of the step's groups
ORDER = ("core0", "core1", "hybrid")


DTYPES = (("bf16", torch.bfloat16), ("fp32", torch.float32))


def _params_are_rounded_masters(backend: Any) -> bool:
    """Collective over the DP group: every model parameter element equals its FP32 master
    rounded to the model dtype (exactly; the DistributedOptimizer copies master -> param)."""
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
    """Collective gather; DP rank 0 writes buffers, steps, version, model params and whether
    those params are the rounded masters."""
    rounded = _params_are_rounded_masters(backend)
    state = backend.gather_dp_zero()
    if state is not None:
        params = {n: p.detach().clone() for n, p in backend.named_parameters()}
        ctx.save(
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


def _split_step(ctx: WorkerContext, backend: Any, replica: str, step: int, tag: str) -> None:
    """Compute this replica's share, exchange weighted deliveries, sum in fixed order, apply."""
    batch = _batch(step)
    mine = batch.select([batch.group_ids[i] for i in SPLIT[replica]])
    delivery = backend.compute(mine, step=step, epoch=1)
    weight = delivery.record.samples / batch.samples
    ctx.exchange.put(f"{tag}.d{step}.{replica}", [weight * g for g in delivery.grads])
    parts = [ctx.exchange.get(f"{tag}.d{step}.{r}") for r in ORDER]
    reduced = [torch.zeros_like(g) for g in parts[0]]
    for part in parts:
        for acc, g in zip(reduced, part, strict=True):
            acc += g
    backend.apply(reduced)


def _batch(step: int) -> Any:
    from tests.megatron.scenario_common import step_batch

    return step_batch(step)


def core(ctx: WorkerContext) -> None:
    for tag, dtype in DTYPES:
        _core(ctx, tag, dtype)


def hybrid(ctx: WorkerContext) -> None:
    for tag, dtype in DTYPES:
        _hybrid(ctx, tag, dtype)


def _core(ctx: WorkerContext, tag: str, dtype: torch.dtype) -> None:
    from ehp_fsm.backends.megatron import state as st
    from ehp_fsm.backends.megatron.backend import LogitsAdapter
    from ehp_fsm.training.grpo import per_sample_loss
    from tests.megatron.scenario_common import build, core_only_step

    rank, n = ctx.rank, ctx.world_size
    name = f"core{rank}"
    lane = build("core", name, rank, n, dtype, **CORE)
    ref = build("core", name, rank, n, dtype, **CORE)

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
            loss = per_sample_loss(LogitsAdapter(ref.model), chunk).mean() / len(chunks)
            if i < len(chunks) - 1:
                with ref.model.no_sync():
                    torch.autograd.backward(loss)
            else:
                torch.autograd.backward(loss)
        ref.model.finish_grad_sync()
        ok, _, _ = ref.optimizer.step()
        assert ok

    for step in range(2):
        core_only_step(lane, step, rank, n)
        reference_step(step)
    _publish(ctx, lane, f"{tag}.v2")
    _publish(ctx, ref, f"{tag}.ref.v2")
    state = lane.gather_dp_zero()
    if state is not None:
        tmp, final = (
            ctx.exchange.root / f".{tag}.state_v2.tmp",
            ctx.exchange.root / f"{tag}.state_v2.pt",
        )
        st.save_dp_zero(state, tmp)
        tmp.rename(final)
        ctx.save(f"{tag}.buckets", _buckets(lane))
    ctx.exchange.get(f"hybrid.{tag}.restored")  # the Hybrid is active from step 2 on
    for step in range(2, 5):
        _split_step(ctx, lane, name, step, tag)
        reference_step(step)
        if step in (2, 4):
            _publish(ctx, lane, f"{tag}.v{step + 1}")
            _publish(ctx, ref, f"{tag}.ref.v{step + 1}")
    for step in range(5, 7):
        core_only_step(lane, step, rank, n)
        reference_step(step)
    _publish(ctx, lane, f"{tag}.v7")
    _publish(ctx, ref, f"{tag}.ref.v7")
    shared = st.shared_step_count(st.distributed_optimizer(lane.optimizer))
    ctx.save(f"{tag}.shared_steps{rank}", shared)


def _hybrid(ctx: WorkerContext, tag: str, dtype: torch.dtype) -> None:
    from ehp_fsm.backends.megatron import state as st
    from tests.megatron.scenario_common import build

    lane = build("hybrid", "hybrid", 0, 1, dtype, **HYBRID)
    ctx.exchange.get(f"core.{tag}.buckets")  # written after the state file
    lane.scatter_dp_zero(st.load_dp_zero(ctx.exchange.root / f"{tag}.state_v2.pt"))
    ctx.save(f"{tag}.buckets", _buckets(lane))
    _publish(ctx, lane, f"{tag}.restored")
    for step in range(2, 5):
        _split_step(ctx, lane, "hybrid", step, tag)
        if step in (2, 4):
            _publish(ctx, lane, f"{tag}.v{step + 1}")
    ctx.save(f"{tag}.shared_steps", st.shared_step_count(st.distributed_optimizer(lane.optimizer)))
