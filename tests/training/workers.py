"""Per-rank bodies of the multi-process tests (module level, so spawned processes import them)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ehp_fsm.core.batch import Delivery, DeliveryAccepted, DeliveryLedger, partition_groups
from ehp_fsm.training.adam import AdamConfig
from ehp_fsm.training.backend import TorchBackend
from ehp_fsm.training.dpzero import (
    DpZeroState,
    gather_dp_zero,
    local_dp_zero,
    recv_dp_zero,
    scatter_dp_zero,
    send_dp_zero,
)
from ehp_fsm.training.grpo import mean_gradient, synthetic_groups
from ehp_fsm.training.lane import STATE_KEYS, LaneSpec, TrainingLane
from ehp_fsm.training.policy import PolicyConfig, build_policy
from ehp_fsm.training.reduction import flat_gradients, weighted_allreduce_, weighted_sum

CFG = PolicyConfig(d_model=32, n_heads=4, d_ff=64, n_layers=2, max_len=16)


def flat_world(state: DpZeroState) -> dict[str, Any]:
    """A DP-zero state as a plain dict of tensors (saveable with weights_only)."""
    out: dict[str, Any] = {"version": state.version, "steps": dict(state.steps)}
    for idx, per in state.buffers.items():
        for entry in per.values():
            for k in STATE_KEYS:
                out[f"{idx}.{k}"] = entry[k]
            out[f"{idx}.numel_unpadded"] = entry["numel_unpadded"]
    out["hyper"] = [
        dict(lr=h["lr"], b1=h["betas"][0], b2=h["betas"][1], eps=h["eps"], wd=h["weight_decay"])
        for h in state.hyper
    ]
    return out


def reduction_rank(rank: int, world: int, bucket_bytes: int) -> dict[str, Any]:
    """Each rank computes ḡᵢ on its groups; the bucketed Gloo reduction must give the full-batch
    mean gradient on every rank."""
    live = {"core-0": 1, "core-1": 1, "hybrid:h": 2}
    p = partition_groups(groups=range(7), live=live, group_size=3, step=0, epoch=1)
    me = p.replicas[rank]
    model = build_policy(CFG, seed=11)
    full = synthetic_groups(range(7), group_size=3, config=CFG, seed=5)
    grads = mean_gradient(model, full.select(p.groups_of(me)))
    stats = weighted_allreduce_(
        grads, samples=p.samples_of(me), total_samples=p.total_samples, bucket_bytes=bucket_bytes
    )
    return {
        "grads": grads,
        "expect": mean_gradient(model, full),
        "collectives": stats.collectives,
        "bucket": stats.bucket_bytes_allocated,
        "samples": p.samples_of(me),
    }


def mixed_layout_rank(rank: int, world: int, bucket_bytes: int) -> dict[str, Any]:
    """Rank 0: gradients as flat views; rank 1: separate tensors; rank 2: views of one buffer
    with gaps between them. Every rank knows every rank's values (seeded), so it can check the
    sample-weighted sum itself."""
    shapes = [(3, 5), (40,), (7, 7), (600,), (2,), (33, 9), (1,), (300,), (5, 5, 5)]
    samples = [2, 0, 5]  # rank 1 contributes nothing this step (n = 0)

    def values(r: int) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(1000 + r)
        return [torch.randn(s, generator=gen) for s in shapes]

    mine = values(rank)
    if rank == 0:
        _, grads = flat_gradients(shapes)
        for g, v in zip(grads, mine, strict=True):
            g.copy_(v)
    elif rank == 1:
        grads = tuple(v.clone() for v in mine)
    else:
        big = torch.zeros(sum(v.numel() + 3 for v in mine))
        out, off = [], 0
        for v in mine:
            out.append(big[off : off + v.numel()].view(v.shape).copy_(v))
            off += v.numel() + 3  # a gap of three elements
        grads = tuple(out)
    stats = weighted_allreduce_(
        grads, samples=samples[rank], total_samples=sum(samples), bucket_bytes=bucket_bytes
    )
    expect = weighted_sum(
        [(samples[r], values(r)) for r in range(world)], total_samples=sum(samples)
    )
    return {
        "grads": [g.clone() for g in grads],
        "expect": expect,
        "collectives": stats.collectives,
        "in_place": stats.bytes_in_place,
        "bytes": stats.bytes_reduced,
    }


def dp_zero_rank(rank: int, world: int, dtype_name: str) -> dict[str, Any]:
    """Ranks 0,1: Core DP=2 (pad 16). Rank 2: DP1 Hybrid lane (pad 5). Core trains 2 steps;
    its state goes Core shards → world (rank 0) → Hybrid lane; all step once more on the same
    gradient; then the Hybrid's state goes back into a fresh Core DP=2 layout padded by 3."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    adam = AdamConfig(lr=1e-2, weight_decay=0.1)
    core = dist.new_group([0, 1])
    out: dict[str, Any] = {}
    names: list[str] = []

    def grads(i: int, lane: TrainingLane) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(100 + i)
        return [torch.randn(p.shape, generator=gen) for _, p in lane.named]

    if rank < 2:
        lane = TrainingLane(
            build_policy(CFG, seed=1),
            LaneSpec(
                role="core",
                replica=f"core-{rank}",
                dp_rank=rank,
                dp_size=2,
                pad_multiple=16,
                param_dtype=dtype,
                adam=adam,
            ),
            dp_group=core,
        )
        names = list(lane.param_names)
        for i in range(2):
            lane.apply(grads(i, lane))
        state = gather_dp_zero(lane, group=core, dst=0)
        if rank == 0:
            assert state is not None
            send_dp_zero(state, dst=2, names=names)
            out["core_world_v2"] = flat_world(state)
        lane.apply(grads(2, lane))
        after = gather_dp_zero(lane, group=core, dst=0)
        out["core_params_v3"] = {n: p.detach().clone() for n, p in lane.named}
        if rank == 0:
            assert after is not None
            out["core_world_v3"] = flat_world(after)
        # Reverse: the Hybrid's world arrives at Core rank 0 and is scattered with pad 3.
        back = recv_dp_zero(lane.layout, src=2) if rank == 0 else None
        fresh = TrainingLane(
            build_policy(CFG, seed=99),
            LaneSpec(
                role="core",
                replica=f"core-{rank}",
                dp_rank=rank,
                dp_size=2,
                pad_multiple=3,
                param_dtype=dtype,
                adam=adam,
            ),
            dp_group=core,
        )
        scatter_dp_zero(back, fresh, group=core, src=0)
        again = gather_dp_zero(fresh, group=core, dst=0)
        out["returned_params"] = {n: p.detach().clone() for n, p in fresh.named}
        out["returned_steps"] = [float(t) for t in fresh.step_tensors()]
        out["returned_step_ptrs"] = len({t.data_ptr() for t in fresh.step_tensors()})
        out["returned_pieces"] = len(fresh.pieces)
        if rank == 0:
            assert again is not None
            out["returned_world"] = flat_world(again)
    else:
        lane = TrainingLane(
            build_policy(CFG, seed=42),
            LaneSpec(
                role="hybrid", replica="hybrid:h", pad_multiple=5, param_dtype=dtype, adam=adam
            ),
        )
        names = list(lane.param_names)
        state = recv_dp_zero(lane.layout, src=0)
        scatter_dp_zero(state, lane, group=None)
        out["hybrid_world_v2"] = flat_world(local_dp_zero(lane))
        out["hybrid_version"] = lane.version
        lane.apply(grads(2, lane))
        mine = local_dp_zero(lane)
        out["hybrid_world_v3"] = flat_world(mine)
        out["hybrid_params_v3"] = {n: p.detach().clone() for n, p in lane.named}
        send_dp_zero(mine, dst=0, names=names)
    return out


def dp_zero_padding_rank(rank: int, world: int) -> dict[str, Any]:
    """DP=3, source and destination not group rank 0: gather to rank 2, scatter from rank 2
    into a layout whose last shard is almost all padding (a lane needs at least one real
    element), whose live shards were filled with NaN first; then gather that layout to rank 1."""
    adam = AdamConfig(lr=1e-2)
    group = dist.new_group([0, 1, 2])

    def lane(pad: int, seed: int) -> TrainingLane:
        spec = LaneSpec(
            role="core", replica=f"c{rank}", dp_rank=rank, dp_size=3, pad_multiple=pad, adam=adam
        )
        return TrainingLane(build_policy(CFG, seed=seed), spec, dp_group=group)

    src = lane(5, seed=1)
    gen = torch.Generator().manual_seed(7)
    for _ in range(2):
        src.apply([torch.randn(p.shape, generator=gen) for _, p in src.named])
    unpadded = src.layout.buffers[0].numel_unpadded
    state = gather_dp_zero(src, group=group, dst=2)
    target = lane(unpadded // 2 - 1, seed=2)  # shard = pad: rank 2 holds 2-3 real elements
    for trio in target.live_shards().values():
        for t in trio.values():
            t.fill_(float("nan"))
    scatter_dp_zero(state, target, group=group, src=2)
    lo, hi = target.layout.shard_range(0, rank)
    mine = target.live_shards()[0]
    out: dict[str, Any] = {
        "real": max(0, min(hi, unpadded) - lo),
        "padding_zero": all(
            float(t[max(0, min(hi, unpadded) - lo) :].abs().sum()) == 0.0 for t in mine.values()
        ),
        "finite": all(bool(torch.isfinite(t).all()) for t in mine.values()),
        "params": {n: p.detach().clone() for n, p in target.named},
        "src_params": {n: p.detach().clone() for n, p in src.named},
        "version": target.version,
    }
    again = gather_dp_zero(target, group=group, dst=1)
    if rank == 2:
        assert state is not None
        out["world"] = flat_world(state)
    if rank == 1:
        assert again is not None
        out["world"] = flat_world(again)
    return out


# -- the headline equivalence run ---------------------------------------------------------------

K, G, N = 6, 8, 4  # steps, groups per step, samples per group: B = 32 fixed
BORROW, RETURN = 2, 4


def _step(
    be: TorchBackend,
    *,
    step: int,
    epoch: int,
    live: dict[str, int],
    rank_of: dict[str, int],
    group: dist.ProcessGroup | None,
    me: str,
) -> dict[str, Any]:
    """One fixed-batch step on this rank: partition, compute, ledger, weighted reduce, apply."""
    p = partition_groups(
        groups=range(step * G, (step + 1) * G), live=live, group_size=N, step=step, epoch=epoch
    )
    batch = synthetic_groups(range(step * G, (step + 1) * G), group_size=N, config=CFG, seed=7)
    delivery = be.compute(batch.select(p.groups_of(me)), step=step, epoch=epoch)
    # The ledger sees every live replica's delivery record (sample counts travel over Gloo).
    counts = torch.zeros(len(rank_of), dtype=torch.long)
    counts[sorted(rank_of).index(me)] = delivery.record.samples
    dist.all_reduce(counts, group=group)
    ledger = DeliveryLedger.open(p, shapes=be.grad_shapes(), deadline=1e9)
    for i, r in enumerate(sorted(rank_of)):
        ledger, outcome = ledger.offer(
            Delivery(
                step=step, epoch=epoch, replica=r, samples=int(counts[i]), shapes=be.grad_shapes()
            ),
            now=0.0,
        )
        assert isinstance(outcome, DeliveryAccepted), outcome
    assert ledger.status.value == "closed"
    reduced = be.reduce(
        delivery, total_samples=ledger.total_samples, group=group, bucket_bytes=64 * 1024
    )
    be.apply(reduced)
    return {"samples": delivery.record.samples, "B": ledger.total_samples}


def equivalence_rank(rank: int, world: int) -> dict[str, Any]:
    adam = AdamConfig(lr=1e-3, eps=1e-6, weight_decay=0.01)
    core = dist.new_group([0, 1])
    everyone = dist.new_group([0, 1, 2])
    core_ranks = {"core-0": 0, "core-1": 1}
    out: dict[str, Any] = {"log": []}

    def core_backend() -> TorchBackend:
        be = TorchBackend(CFG, seed=3)
        be.build(
            LaneSpec(
                role="core",
                replica=f"core-{rank}",
                dp_rank=rank,
                dp_size=2,
                pad_multiple=64,
                adam=adam,
            ),
            dp_group=core,
        )
        return be

    # Reference: K steps, Core only.
    if rank < 2:
        ref = core_backend()
        for step in range(K):
            _step(
                ref,
                step=step,
                epoch=0,
                live={"core-0": 1, "core-1": 1},
                rank_of=core_ranks,
                group=core,
                me=f"core-{rank}",
            )
            if ref.version == BORROW:
                w = ref.gather_dp_zero(group=core, dst=0)
                if w is not None:
                    out["ref_v2"] = flat_world(w)
        w = ref.gather_dp_zero(group=core, dst=0)
        if w is not None:
            out["ref_final"] = flat_world(w)
        out["ref_params"] = {n: p.detach().clone() for n, p in ref.lane.named}
    dist.barrier()

    # EHP: the Hybrid (rank 2) is launched up front; it is borrowed at step 2, returned at 4.
    if rank < 2:
        be = core_backend()
    else:
        be = TorchBackend(CFG, seed=1234)  # loads its state from the Core, not from its seed
        be.build(LaneSpec(role="hybrid", replica="hybrid:h", pad_multiple=24, adam=adam))
    all_ranks = {"core-0": 0, "core-1": 1, "hybrid:h": 2}
    epoch = 0
    for step in range(K):
        if step == BORROW:
            # Core DP shards → world on Core rank 0 → Hybrid lane (its own padding).
            if rank < 2:
                w = be.gather_dp_zero(group=core, dst=0)
                if w is not None:
                    out["ehp_v2"] = flat_world(w)
                    send_dp_zero(w, dst=2, names=list(be.lane.param_names))
            else:
                state = recv_dp_zero(be.lane.layout, src=0)
                be.scatter_dp_zero(state, group=None)
                out["hybrid_loaded_version"] = be.version
                out["hybrid_loaded"] = flat_world(local_dp_zero(be.lane))
            epoch += 1  # the Hybrid becomes active at this step boundary
        if step == RETURN:
            # Hybrid leaves: its state goes back to Core rank 0 in DP-zero form for the check.
            if rank == 2:
                send_dp_zero(local_dp_zero(be.lane), dst=0, names=list(be.lane.param_names))
                out["hybrid_at_return"] = flat_world(local_dp_zero(be.lane))
            w = be.gather_dp_zero(group=core, dst=0) if rank < 2 else None
            if rank == 0:
                assert w is not None
                back = recv_dp_zero(be.lane.layout, src=2)
                out["core_at_return"] = flat_world(w)
                out["returned_from_hybrid"] = flat_world(back)
            epoch += 1
        hybrid_live = BORROW <= step < RETURN
        if hybrid_live:
            info = _step(
                be,
                step=step,
                epoch=epoch,
                live={"core-0": 1, "core-1": 1, "hybrid:h": 1},
                rank_of=all_ranks,
                group=everyone,
                me=be.lane.spec.replica,
            )
        elif rank < 2:
            info = _step(
                be,
                step=step,
                epoch=epoch,
                live={"core-0": 1, "core-1": 1},
                rank_of=core_ranks,
                group=core,
                me=f"core-{rank}",
            )
        else:
            continue
        out["log"].append({"step": step, "epoch": epoch, **info})
    if rank < 2:
        w = be.gather_dp_zero(group=core, dst=0)
        if w is not None:
            out["ehp_final"] = flat_world(w)
        out["ehp_params"] = {n: p.detach().clone() for n, p in be.lane.named}
        out["ehp_step_ptrs"] = len({t.data_ptr() for t in be.lane.step_tensors()})
        out["ehp_pieces"] = len(be.lane.pieces)
    return out


def scatter_refusal_rank(rank: int, world: int) -> dict[str, Any]:
    """Core DP=2: rank 0 scatters a state whose buffer sizes do not fit the layout (refused on
    rank 0); both ranks must raise at once, nothing installed; then the right state scatters."""
    import dataclasses
    import time

    lane = TrainingLane(
        build_policy(CFG, seed=1),
        LaneSpec(role="core", replica=f"core-{rank}", dp_rank=rank, dp_size=2, pad_multiple=16),
        dp_group=dist.group.WORLD,
    )
    lane.apply([torch.full(p.shape, 0.1) for _, p in lane.named])
    good = gather_dp_zero(lane, group=None, dst=0)
    bad = None
    if good is not None:
        bad = dataclasses.replace(
            good,
            buffers={
                i: {k: {**e, "numel_unpadded": e["numel_unpadded"] + 1} for k, e in d.items()}
                for i, d in good.buffers.items()
            },
        )
    before = [t.clone() for t in lane.capture().master.values()]
    t0 = time.monotonic()
    try:
        scatter_dp_zero(bad, lane, group=None, src=0)
        error = ""
    except Exception as exc:
        error = f"{type(exc).__name__} {exc}"
    seconds = time.monotonic() - t0
    after = list(lane.capture().master.values())
    unchanged = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    scatter_dp_zero(good, lane, group=None, src=0)  # the group is still in step
    return {"error": error, "seconds": seconds, "unchanged": unchanged, "version": lane.version}
