"""Megatron-Core pipeline parallelism for one lane: the pieces `MegatronBackend` adds at PP > 1.

What it knows: how one lane's stages (one rank each per TP rank, Megatron's parallel state at
PP > 1) run the GRPO objective through Megatron's pipeline schedule so the delivery equals the
PP 1 lane's — the loss on the last stage from its logits with the PP 1 path's per-micro-batch
scaling (the schedule told not to divide by its micro-batch count), the KL reference's
log-probs from a forward-only pass over the reference's own stages, the loss and metrics
broadcast from the last stage to every stage; how a tied embedding's two copies (first stage's
embedding, last stage's output layer) get the tied weight's gradient (Megatron's own
embedding-group sum); how a stage of the tiny local-spec model takes its share of the whole
model initialised from the seed.

What it does not know: building, optimizers, state transfers (per stage, as at PP 1), which
processes are a lane's stages (the caller's world), how commands reach them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel
from megatron.core.models.gpt.gpt_model import GPTModel

from ehp_fsm.backends.megatron import state as st
from ehp_fsm.training.grpo import GroupBatch, logits_loss, reference_log_probs
from ehp_fsm.training.objective import ObjectiveConfig, ObjectiveMetrics


def backward(
    model: DistributedDataParallel,
    adapter: torch.nn.Module,
    objective: ObjectiveConfig,
    parts: Sequence[GroupBatch],
    units: int,
    *,
    reference: torch.nn.Module | None,
) -> tuple[float, ObjectiveMetrics]:
    """The backward of the lane's micro-batches `parts` (whole groups; `units`: the batch's
    weight units) through Megatron's pipeline schedule, on this rank's stage `model` (its
    `adapter`: logits on the last stage, hidden states before): every stage of the lane calls
    it with the same parts; the last stage computes the objective from its logits (the same
    loss and scaling as the backend's PP 1 path, micro-batch for micro-batch), and its loss
    Σ_m (u_m/u)·loss_m and merged metrics are broadcast over the pipeline group, so every stage
    returns them. Runs of micro-batches of one shape go through the schedule together (its P2P
    buffers have one shape per call). `reference` (a frozen `LogitsAdapter` over the
    reference's stage) only when the objective's `kl_coef > 0`."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    schedule = get_forward_backward_func()
    refs: list[torch.Tensor | None] = [None] * len(parts)
    if objective.needs_reference:
        assert reference is not None, "kl_coef > 0 needs the frozen reference"
        refs = _reference_log_probs(reference, parts, schedule, objective.temperature)
    scale = len(parts)

    def step(data: Any, stage: Any) -> tuple[torch.Tensor, Any]:
        del stage  # the schedule hands back `model`, which `adapter` wraps
        part, ref = next(data)
        output = adapter(part.tokens[:, :-1])

        def loss_func(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
            out = logits_loss(logits, part, objective, ref_logp=ref)
            share = out.weight / units if units else 0.0
            factor = share * scale
            loss = out.loss if factor == 1.0 else out.loss * factor
            report = {"loss": float(out.loss.detach()) * share, "metrics": out.metrics}
            return loss, torch.ones((), dtype=torch.int), report

        return output, loss_func

    config = model.config
    per_token = config.calculate_per_token_loss
    # With a (loss, tokens, report) triple and per-token losses on, the schedule backwards
    # the loss exactly as returned (no division by its micro-batch count).
    config.calculate_per_token_loss = True
    reports: list[Any] = []
    try:
        with model.no_sync():  # a delivery is this lane's own gradient
            for run in _runs_of_one_shape(parts):
                first = parts[run[0]]
                reports += schedule(
                    forward_step_func=step,
                    data_iterator=iter([(parts[i], refs[i]) for i in run]),
                    model=[model],
                    num_microbatches=len(run),
                    seq_length=first.tokens.shape[1] - 1,
                    micro_batch_size=first.samples,
                    forward_only=False,
                )
    finally:
        config.calculate_per_token_loss = per_token
        _drop_input_tensor(model)
    mean_loss = 0.0  # summed in the PP 1 path's order (reports exist on the last stage only)
    for report in reports:
        mean_loss += report["loss"]
    merged = ObjectiveMetrics.merge(report["metrics"] for report in reports)
    return _from_last_stage(mean_loss, merged, device=next(model.parameters()).device)


def _reference_log_probs(
    reference: Any, parts: Sequence[GroupBatch], schedule: Any, temperature: float
) -> list[torch.Tensor | None]:
    """The frozen reference's log-probs per micro-batch, run forward-only through the
    pipeline schedule over the reference's own stages: on the last stage (the only one
    that computes the loss), None on the others."""

    def step(data: Any, stage: Any) -> tuple[torch.Tensor, Any]:
        del stage  # the reference's stage, which `reference` wraps
        part = next(data)
        output = reference(part.tokens[:, :-1])

        def collect(logits: torch.Tensor) -> tuple[torch.Tensor, Any]:
            return logits.new_zeros(()), {"ref": reference_log_probs(logits, part, temperature)}

        return output, collect

    reports: list[Any] = []
    with torch.no_grad(), contextlib.ExitStack() as after:
        after.callback(_drop_input_tensor, reference.model)
        for run in _runs_of_one_shape(parts):
            first = parts[run[0]]
            reports += schedule(
                forward_step_func=step,
                data_iterator=iter([parts[i] for i in run]),
                model=[reference.model],
                num_microbatches=len(run),
                seq_length=first.tokens.shape[1] - 1,
                micro_batch_size=first.samples,
                forward_only=True,
            )
    if not parallel_state.is_pipeline_last_stage():
        return [None] * len(parts)
    return [report["ref"] for report in reports]


def _drop_input_tensor(model: torch.nn.Module) -> None:
    """Let go of the activation the schedule handed a stage after the first
    (`GPTModel.set_input_tensor`: the stage's transformer block keeps it, with its gradient,
    until the next one replaces it). Kept, it is memory the lane no longer needs — and a parked
    Hybrid's worker that still references it is never confirmed free, so its GPU stays
    `releasing` and the run's return waits for it in vain (found by a 30-step PP 2 run)."""
    stage: Any = st.unwrap(model)  # the GPTModel inside Megatron DDP (or the model itself)
    stage.set_input_tensor(None)


def sum_tied_embedding_grads(model: DistributedDataParallel) -> None:
    """Under PP with tied embeddings, the first stage's word embedding and the last stage's
    output layer are copies of one weight, each with the gradient of its own use: Megatron's
    own step (in `finalize_model_grads`) sums them over its embedding group, so both copies
    hold the tied weight's gradient and step alike. Nothing at PP 1 or with untied weights."""
    import importlib

    fmg: Any = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        fmg._allreduce_word_embedding_grads([model], model.config)


def copy_stage(whole: GPTModel, stage: GPTModel) -> None:
    """Copy the whole model's weights into the stage: its layers by their global numbers, the
    last stage's copy of the tied embedding from the embedding."""
    source = dict(whole.named_parameters())
    offset = {
        f"decoder.layers.{i}.": f"decoder.layers.{layer.layer_number - 1}."
        for i, layer in enumerate(stage.decoder.layers)
    }
    with torch.no_grad():
        for name, param in stage.named_parameters():
            key = name
            for local, global_ in offset.items():
                if name.startswith(local):
                    key = global_ + name[len(local) :]
            if key == "output_layer.weight" and key not in source:  # tied: the embedding
                key = "embedding.word_embeddings.weight"
            param.copy_(source[key])


def _runs_of_one_shape(parts: Sequence[GroupBatch]) -> list[list[int]]:
    """Indices of consecutive micro-batches of one shape (rows × tokens), in order."""
    runs: list[list[int]] = []
    for i, part in enumerate(parts):
        if runs and parts[runs[-1][0]].tokens.shape == part.tokens.shape:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _from_last_stage(
    loss: float, metrics: ObjectiveMetrics, *, device: torch.device
) -> tuple[float, ObjectiveMetrics]:
    """The last pipeline stage's loss and metrics on every stage (float64: exact for the
    Python floats and the token counts)."""
    values = torch.tensor(
        [
            loss,
            metrics.tokens,
            metrics.clipped,
            metrics.ratio_sum,
            metrics.ratio_max,
            metrics.kl_old_sum,
            metrics.kl_ref_sum,
        ],
        dtype=torch.float64,
        device=device,
    )
    dist.broadcast(
        values,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    got = values.tolist()
    return got[0], ObjectiveMetrics(
        tokens=int(got[1]),
        clipped=int(got[2]),
        ratio_sum=got[3],
        ratio_max=got[4],
        kl_old_sum=got[5],
        kl_ref_sum=got[6],
    )
