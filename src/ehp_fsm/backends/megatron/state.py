"""Optimizer-state plumbing for Megatron-Core's `DistributedOptimizer` on the torch-Adam path.

What this module knows:
- the DP-zero format (`get_parameter_state_dp_zero` / `load_parameter_state_from_dp_zero`):
  per-buffer flat "world" tensors with bucket padding removed, so source and target may pad
  their buckets differently (written and read by `shards`, bit for bit as Megatron's own
  functions, which are slow on a GPU);
- the three known bugs of megatron-core 0.16.1 (also 0.19.2) when the inner optimizer is torch
  Adam/AdamW (no Apex / TransformerEngine), and how to work around each without editing
  megatron-core:
  (a) `load_parameter_state_from_dp_zero()` raises `KeyError: 'step'` once Adam state exists
      (the format carries no step), and copies into a view of a leaf that requires grad outside
      `no_grad` (fp32 parameters) -> `dp_zero_scatter` does not call it: it writes the same
      shards with `shards.scatter_world` under `no_grad`, then installs the carried
      per-parameter steps;
  (b) `DistributedOptimizer.load_state_dict()` puts one *shared* step tensor into every
      parameter's state, so each `step()` advances it once per parameter ->
      `load_optimizer_state_dict` gives every parameter its own step tensor;
  (c) dist-checkpointing's `dp_reshardable` format restores the step from the in-memory state
      captured when the sharded state dict was built (stale) -> `load_dp_reshardable_checkpoint`
      re-installs the checkpoint's step per parameter after loading.
- the flat, unpadded gradient layout (same order as the DP-zero world tensors) used to deliver
  and apply sample-weighted gradients.

What it does not know: transports (callers move `DpZeroState` however they like), membership,
or when a transfer is allowed — the state machines decide that.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import ChainedOptimizer, MegatronOptimizer

from ehp_fsm.backends.megatron.errors import MegatronBackendError, OptimizerStateMismatch
from ehp_fsm.backends.megatron.shards import gather_world, scatter_world
from ehp_fsm.errors import EhpError
from ehp_fsm.training.dpzero import DpZeroState
from ehp_fsm.training.lane import HYPER_KEYS, STATE_KEYS


def distributed_optimizer(optimizer: MegatronOptimizer) -> DistributedOptimizer:
    """The single `DistributedOptimizer` inside `optimizer` (dense models have exactly one)."""
    inner: list[Any] = (
        list(optimizer.chained_optimizers)
        if isinstance(optimizer, ChainedOptimizer)
        else [optimizer]
    )
    found = [o for o in inner if isinstance(o, DistributedOptimizer)]
    if len(found) != 1:
        raise MegatronBackendError(
            f"expected exactly one DistributedOptimizer, found {len(found)}",
            "the backend transfers one dense optimizer (MoE expert optimizers are not supported)",
            "build the optimizer with use_distributed_optimizer=True for a dense model",
        )
    return found[0]


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside Megatron's DDP wrapper (parameter names without `module.`)."""
    inner = getattr(model, "module", model)
    assert isinstance(inner, torch.nn.Module)
    return inner


def parameter_names(model: torch.nn.Module) -> dict[torch.nn.Parameter, str]:
    return {p: n for n, p in unwrap(model).named_parameters()}


def _owned(dist_opt: DistributedOptimizer) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(model parameter, main-parameter shard) for every parameter with a shard on this rank."""
    for model_param, (group_index, group_order) in dist_opt.model_param_group_index_map.items():
        main = dist_opt.optimizer.param_groups[group_index]["params"][group_order]
        yield model_param, main


def _new_step(dist_opt: DistributedOptimizer, model_param: torch.nn.Parameter, value: float) -> Any:
    """A step tensor where torch Adam keeps it: on the shard's device for a fused or capturable
    parameter group (the fused kernel reads it there), on the CPU otherwise; FP32 either way."""
    group_index, group_order = dist_opt.model_param_group_index_map[model_param]
    group = dist_opt.optimizer.param_groups[group_index]
    main = group["params"][group_order]
    device = main.device if group.get("fused") or group.get("capturable") else torch.device("cpu")
    return torch.tensor(float(value), dtype=torch.float32, device=device)


def ensure_adam_state(dist_opt: DistributedOptimizer) -> None:
    """Allocate zero Adam state (step 0) for every shard that has none yet.

    `load_parameter_state_from_dp_zero` copies only the keys already present in the state, so a
    fresh optimizer would silently drop the moments without this.
    """
    for model_param, main in _owned(dist_opt):
        state = dist_opt.optimizer.state[main]
        if not state:
            state["step"] = _new_step(dist_opt, model_param, 0.0)
            state["exp_avg"] = torch.zeros_like(main, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(main, memory_format=torch.preserve_format)


def local_steps(dist_opt: DistributedOptimizer) -> dict[torch.nn.Parameter, float]:
    """Each owned parameter's Adam step on this rank (parameters without state are absent)."""
    out: dict[torch.nn.Parameter, float] = {}
    for model_param, main in _owned(dist_opt):
        step = dist_opt.optimizer.state[main].get("step")
        if step is not None:
            out[model_param] = float(step)
    return out


def shared_step_count(dist_opt: DistributedOptimizer) -> int:
    """How many state entries share their step tensor with another entry (0 when healthy)."""
    seen: dict[int, int] = {}
    for _, main in _owned(dist_opt):
        step = dist_opt.optimizer.state[main].get("step")
        if isinstance(step, torch.Tensor):
            seen[id(step)] = seen.get(id(step), 0) + 1
    return sum(c for c in seen.values() if c > 1)


def install_steps(
    dist_opt: DistributedOptimizer, steps: Mapping[torch.nn.Parameter, float]
) -> None:
    """Give every owned parameter its own step tensor holding `steps[param]`."""
    for model_param, main in _owned(dist_opt):
        state = dist_opt.optimizer.state[main]
        if model_param not in steps:
            raise OptimizerStateMismatch(
                "a parameter has no step to restore",
                "the transferred state does not cover every parameter of the target",
                "transfer from a source with the same model definition",
            )
        state["step"] = _new_step(dist_opt, model_param, steps[model_param])


def load_optimizer_state_dict(optimizer: MegatronOptimizer, state_dict: Any) -> None:
    """`optimizer.load_state_dict` with bug (b) fixed: one independent step tensor per parameter."""
    optimizer.load_state_dict(state_dict)
    dist_opt = distributed_optimizer(optimizer)
    for _, main in _owned(dist_opt):
        state = dist_opt.optimizer.state[main]
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].detach().clone()


def checkpoint_step(state_dict: Any) -> float | None:
    """The step recorded in a (loaded) `DistributedOptimizer.state_dict()`'s param groups."""
    groups = state_dict["optimizer"]["param_groups"]
    steps = {float(g["step"]) for g in groups if g.get("step") is not None}
    if len(steps) > 1:
        raise OptimizerStateMismatch(
            f"the checkpoint records different steps per param group: {sorted(steps)}",
            "torch Adam keeps one step per parameter and Megatron saves one per group",
            "re-save the checkpoint from a run whose groups advanced together",
        )
    return steps.pop() if steps else None


def load_dp_reshardable_checkpoint(optimizer: MegatronOptimizer, loaded: Any) -> None:
    """Load a dist-checkpointing result (`dp_reshardable`) with bugs (b) and (c) fixed.

    `loaded` is what `dist_checkpointing.load(optimizer.sharded_state_dict(..., is_loading=True,
    metadata={"distrib_optim_sharding_type": "dp_reshardable"}), dir)` returned.
    """
    step = checkpoint_step(loaded)
    with torch.no_grad():  # FP32 parameters: the loader copies into views of leaves, see (a)
        optimizer.load_state_dict(loaded)
    dist_opt = distributed_optimizer(optimizer)
    if step is not None:
        install_steps(dist_opt, {p: step for p, _ in _owned(dist_opt)})


# --- DP-zero transfer -------------------------------------------------------------------------
# The state travels as `ehp_fsm.training.dpzero.DpZeroState` (the same format the torch lanes
# use): Megatron's DP-zero buffers, per-parameter steps by name, hyperparameters, version. Model
# parameters are not carried: Megatron's model parameters are the master weights rounded to the
# model dtype, so the target rebuilds them exactly from the master weights.


def hyperparameters(dist_opt: DistributedOptimizer) -> tuple[dict[str, Any], ...]:
    return tuple(
        {k: (tuple(g[k]) if k == "betas" else float(g[k])) for k in HYPER_KEYS}
        for g in dist_opt.optimizer.param_groups
    )


def _gather_steps(
    dist_opt: DistributedOptimizer, names: dict[torch.nn.Parameter, str], order: list[str]
) -> dict[str, float]:
    """Per-parameter steps of the whole DP group (max and min agree, else the state is corrupt)."""
    index = {n: i for i, n in enumerate(order)}
    high = torch.full((len(order),), float("-inf"), dtype=torch.float64)
    low = torch.full((len(order),), float("inf"), dtype=torch.float64)
    for param, step in local_steps(dist_opt).items():
        high[index[names[param]]] = step
        low[index[names[param]]] = step
    group = dist_opt.data_parallel_group_gloo
    torch.distributed.all_reduce(high, op=torch.distributed.ReduceOp.MAX, group=group)
    torch.distributed.all_reduce(low, op=torch.distributed.ReduceOp.MIN, group=group)
    if bool(torch.isinf(high).any()):
        missing = [order[i] for i in torch.nonzero(torch.isinf(high)).flatten().tolist()]
        raise OptimizerStateMismatch(
            f"no Adam step for {missing[:3]}",
            "the optimizer has not taken a step (or lost its state) on some parameters",
            "gather after at least one optimizer step",
        )
    if not torch.equal(high, low):
        bad = [order[i] for i in torch.nonzero(high != low).flatten().tolist()]
        raise OptimizerStateMismatch(
            f"DP ranks disagree on the Adam step of {bad[:3]}",
            "the ranks' shards of one parameter advanced differently (shared-step bug (b)?)",
            "restore the optimizer with load_optimizer_state_dict / dp_zero_scatter",
        )
    return {n: float(high[i]) for i, n in enumerate(order)}


def dp_zero_gather(
    model: torch.nn.Module, optimizer: MegatronOptimizer, *, version: int
) -> DpZeroState | None:
    """Gather the full state on DP rank 0 (collective over the DP group; None on other ranks).
    Before the first optimizer step (version 0) the Adam state is allocated first — zero
    moments, step 0, what the first step would start from — so a Hybrid can join at step 0."""
    dist_opt = distributed_optimizer(optimizer)
    ensure_adam_state(dist_opt)
    names = parameter_names(model)
    steps = _gather_steps(dist_opt, names, list(names.values()))
    buffers = gather_world(dist_opt)
    if buffers is None:
        return None
    return DpZeroState(
        buffers=buffers, steps=steps, hyper=hyperparameters(dist_opt), version=version
    )


def dp_zero_scatter(
    model: torch.nn.Module, optimizer: MegatronOptimizer, state: DpZeroState | None
) -> None:
    """Restore `state` (given on DP rank 0, None elsewhere) into every rank's shards.

    Megatron's loader is not used (bug (a), and it is slow: `shards`): `shards.scatter_world`
    writes the same shards under `no_grad`, independent per-parameter steps are installed
    afterwards, and the model parameters are rebuilt from the master weights (copy into the
    param buffer, then Megatron's all-gather).
    """
    dist_opt = distributed_optimizer(optimizer)
    names = parameter_names(model)
    order = list(names.values())
    group = dist_opt.data_parallel_group_gloo
    src = torch.distributed.get_process_group_ranks(group)[0]
    is_src = group.rank() == 0
    # DP rank 0 checks the state and broadcasts its verdict with the steps ([refused, step per
    # parameter]): a rank that raised alone would leave its peers waiting in the broadcast
    # until the collective timeout.
    refusal = _scatter_refusal(state, order, dist_opt) if is_src else None
    steps_vec = torch.zeros(1 + len(order), dtype=torch.float64)
    if refusal is not None:
        steps_vec[0] = 1.0
    elif state is not None:
        steps_vec[1:] = torch.tensor([state.steps[n] for n in order], dtype=torch.float64)
    torch.distributed.broadcast(steps_vec, src=src, group=group)
    if refusal is not None:
        raise refusal
    if steps_vec[0].item() != 0.0:
        raise OptimizerStateMismatch(
            "DP rank 0 refused the transferred state; nothing was installed",
            "it did not match this model or optimizer (DP rank 0's error says how)",
            "fix what DP rank 0's error names, then transfer again",
        )
    steps_vec = steps_vec[1:]

    ensure_adam_state(dist_opt)
    with torch.no_grad():
        scatter_world(dist_opt, state.buffers if state is not None else None)
        dist_opt._copy_main_params_to_model_params()
        for chunk in dist_opt.model_chunks:
            chunk.start_param_sync(force_sync=True)
    by_name = dict(zip(order, steps_vec.tolist(), strict=True))
    install_steps(dist_opt, {p: by_name[n] for p, n in names.items()})


def _scatter_refusal(
    state: DpZeroState | None, order: list[str], dist_opt: DistributedOptimizer
) -> EhpError | None:
    """Why DP rank 0 cannot scatter `state` into this model and optimizer; None when it can."""
    if state is None:
        return MegatronBackendError(
            "dp_zero_scatter got no state on DP rank 0",
            "DP rank 0 scatters the world tensors to the other ranks",
            "pass the gathered DpZeroState on DP rank 0",
        )
    if set(state.steps) != set(order):
        return OptimizerStateMismatch(
            "the transferred state names different parameters than the target model",
            f"differences: {sorted(set(state.steps) ^ set(order))[:5]}",
            "build the target from the same model configuration as the source",
        )
    if (short := _world_mismatch(state, dist_opt)) is not None:
        return OptimizerStateMismatch(
            short,
            "the target's grad buffers hold a different number of elements",
            "build the target from the same model configuration as the source",
        )
    if tuple(state.hyper) != hyperparameters(dist_opt):
        return OptimizerStateMismatch(
            "the transferred optimizer hyperparameters differ from the target's",
            f"source {state.hyper} vs target {hyperparameters(dist_opt)}",
            "build the target optimizer with the source's configuration",
        )
    return None


def _world_skeleton(dist_opt: DistributedOptimizer) -> list[tuple[int, Any, int]]:
    """(buffer index, dtype key, unpadded numel) of the DP-zero world tensors, in send order."""
    return [
        (index, key, dist_opt.buffers[index].numel_unpadded)
        for index, per_dtype in enumerate(dist_opt.gbuf_ranges)
        for key in per_dtype
    ]


def _world_mismatch(state: DpZeroState, dist_opt: DistributedOptimizer) -> str | None:
    """The first world tensor of `state` whose size is not what `dist_opt`'s buffers hold;
    None when every one fits."""
    for index, key, numel in _world_skeleton(dist_opt):
        entry = state.buffers.get(index, {}).get(key)
        sizes = [] if entry is None else [int(entry[k].numel()) for k in STATE_KEYS]
        if entry is None or {int(entry["numel_unpadded"]), *sizes} != {numel}:
            return f"the state has no world tensors of {numel} elements for buffer {index} {key}"
    return None


def _hyper_rows(hyper: tuple[dict[str, Any], ...]) -> torch.Tensor:
    return torch.tensor(
        [[h["lr"], *h["betas"], h["eps"], h["weight_decay"]] for h in hyper], dtype=torch.float64
    )


def dp_zero_send(
    optimizer: MegatronOptimizer,
    state: DpZeroState,
    *,
    order: list[str],
    dst: int,
    group: torch.distributed.ProcessGroup | None = None,
) -> None:
    """Send `state` point to point to rank `dst` (of `group`; global rank when None): every
    world tensor, then steps (in `order`) + version, then hyperparameters. Tensors only, no
    pickle. The receiver calls `dp_zero_recv` with a model of the same definition."""
    dist_opt = distributed_optimizer(optimizer)
    if (short := _world_mismatch(state, dist_opt)) is not None:
        raise OptimizerStateMismatch(
            short,
            "the sender's own model defines what is sent",
            "send a state gathered from this lane (gather_dp_zero)",
        )
    for index, key, _ in _world_skeleton(dist_opt):
        for k in STATE_KEYS:
            torch.distributed.send(state.buffers[index][key][k].contiguous(), dst=dst, group=group)
    meta = torch.tensor([state.steps[n] for n in order] + [state.version], dtype=torch.float64)
    torch.distributed.send(meta, dst=dst, group=group)
    torch.distributed.send(_hyper_rows(state.hyper), dst=dst, group=group)


def dp_zero_recv(
    optimizer: MegatronOptimizer,
    *,
    order: list[str],
    src: int,
    group: torch.distributed.ProcessGroup | None = None,
) -> DpZeroState:
    """Receive what `dp_zero_send` sent from rank `src`; the world tensors' sizes come from this
    lane's own buffers (unpadded sizes do not depend on padding or DP size)."""
    dist_opt = distributed_optimizer(optimizer)
    buffers: dict[int, dict[Any, dict[str, Any]]] = {}
    for index, key, numel in _world_skeleton(dist_opt):
        entry: dict[str, Any] = {"numel_unpadded": numel}
        for k in STATE_KEYS:
            entry[k] = torch.empty(numel, dtype=torch.float32)
            torch.distributed.recv(entry[k], src=src, group=group)
        buffers.setdefault(index, {})[key] = entry
    meta = torch.empty(len(order) + 1, dtype=torch.float64)
    torch.distributed.recv(meta, src=src, group=group)
    rows = torch.empty(len(dist_opt.optimizer.param_groups), 5, dtype=torch.float64)
    torch.distributed.recv(rows, src=src, group=group)
    values = meta.tolist()
    hyper = tuple(
        {"lr": r[0], "betas": (r[1], r[2]), "eps": r[3], "weight_decay": r[4]}
        for r in rows.tolist()
    )
    return DpZeroState(
        buffers=buffers,
        steps=dict(zip(order, values[:-1], strict=True)),
        hyper=hyper,
        version=int(values[-1]),
    )


def state_nbytes(state: DpZeroState) -> int:
    """Bytes of tensor payload (master weights and Adam moments)."""
    total = 0
    for per_dtype in state.buffers.values():
        for entry in per_dtype.values():
            for key in STATE_KEYS:
                total += entry[key].numel() * entry[key].element_size()
    return total


def save_dp_zero(state: DpZeroState, path: Path) -> None:
    """Write `state` with `torch.save` (read back with `load_dp_zero`, weights only)."""
    payload = {
        "buffers": state.buffers,
        "steps": dict(state.steps),
        "hyper": [dict(h) for h in state.hyper],
        "version": state.version,
    }
    torch.save(payload, path)


def load_dp_zero(path: Path) -> DpZeroState:
    payload = torch.load(path, weights_only=True)
    return DpZeroState(
        buffers=payload["buffers"],
        steps={k: float(v) for k, v in payload["steps"].items()},
        hyper=tuple({**h, "betas": tuple(h["betas"])} for h in payload["hyper"]),
        version=int(payload["version"]),
    )


# --- flat gradient layout ---------------------------------------------------------------------


def _bucket_views(dist_opt: DistributedOptimizer) -> Iterator[torch.Tensor]:
    """The unpadded part of every bucket's gradient, in DP-zero world order."""
    for buffer in dist_opt.buffers:
        for bucket in buffer.buckets:
            yield bucket.grad_data[: bucket.numel_unpadded]


def flat_grad_numel(optimizer: MegatronOptimizer) -> int:
    return sum(v.numel() for v in _bucket_views(distributed_optimizer(optimizer)))


def read_flat_grads(optimizer: MegatronOptimizer) -> torch.Tensor:
    """A new FP32 CPU tensor with this replica's local gradient (never aliases a live buffer)."""
    views = list(_bucket_views(distributed_optimizer(optimizer)))
    return torch.cat([v.detach().to("cpu", torch.float32) for v in views])


def write_flat_grads(optimizer: MegatronOptimizer, flat: torch.Tensor) -> None:
    """Overwrite the gradient buffers with `flat` (bucket padding set to zero)."""
    dist_opt = distributed_optimizer(optimizer)
    expected = flat_grad_numel(optimizer)
    if flat.dim() != 1 or flat.numel() != expected:
        raise OptimizerStateMismatch(
            f"reduced gradient has shape {tuple(flat.shape)}, expected ({expected},)",
            "the gradient was produced by a replica with a different model",
            "reduce deliveries from replicas built with the same model configuration",
        )
    offset = 0
    with torch.no_grad():
        for buffer in dist_opt.buffers:
            buffer.grad_data.zero_()
            for bucket in buffer.buckets:
                n = bucket.numel_unpadded
                bucket.grad_data[:n].copy_(flat[offset : offset + n])
                offset += n
